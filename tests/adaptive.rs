//! Limits that follow the provider: a provider that shares its budget with a hidden
//! second client and announces what is left (`RateLimit`), through the real proxy with
//! the configured limit set to the provider's published one. Wall-clock, wide margins.

use sluice_test_support as support;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Response, StatusCode};
use http_body_util::Full;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use support::*;
use tokio::net::TcpListener;
use tokio::time::Instant;

/// A provider with a fixed window of `permits` per `window` on its own clock. At the start
/// of each window a hidden client, not behind sluice, spends `hidden` of them. Every
/// answer carries `RateLimit: "default";r=<left>;t=<seconds to the reset, rounded up>`.
struct SharedProvider {
    addr: SocketAddr,
    /// (accepted, refused) requests from sluice.
    counts: Arc<Mutex<(u32, u32)>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for SharedProvider {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl SharedProvider {
    async fn start(permits: u32, window: Duration, hidden: u32) -> SharedProvider {
        SharedProvider::serve(permits, window, hidden, true).await
    }

    /// The same, silent about its budget: no `RateLimit` field.
    async fn silent(permits: u32, window: Duration) -> SharedProvider {
        SharedProvider::serve(permits, window, 0, false).await
    }

    async fn serve(permits: u32, window: Duration, hidden: u32, announce: bool) -> SharedProvider {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let counts = Arc::new(Mutex::new((0, 0)));
        let t0 = Instant::now();
        // (start of the current window, requests counted in it)
        let state = Arc::new(Mutex::new((t0, hidden)));
        let c = counts.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let (state, c) = (state.clone(), c.clone());
                tokio::spawn(async move {
                    let svc = service_fn(move |_req| {
                        let (state, c) = (state.clone(), c.clone());
                        async move {
                            let now = Instant::now();
                            let mut st = state.lock();
                            while now >= st.0 + window {
                                *st = (st.0 + window, hidden);
                            }
                            let ok = st.1 < permits;
                            if ok {
                                st.1 += 1;
                            }
                            let left = permits - st.1;
                            let reset = (st.0 + window - now).as_secs_f64().ceil() as u64;
                            drop(st);
                            let mut counts = c.lock();
                            if ok {
                                counts.0 += 1;
                            } else {
                                counts.1 += 1;
                            }
                            let status = if ok {
                                StatusCode::OK
                            } else {
                                StatusCode::TOO_MANY_REQUESTS
                            };
                            let mut resp = Response::builder().status(status);
                            if announce {
                                resp = resp
                                    .header("ratelimit", format!("\"default\";r={left};t={reset}"));
                            }
                            Ok::<_, Infallible>(
                                resp.body(Full::new(Bytes::from_static(b"ok\n"))).unwrap(),
                            )
                        }
                    });
                    let _ = http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        SharedProvider { addr, counts, task }
    }
}

/// Four clients sending as fast as sluice admits them, for `run`.
async fn flood(proxy: &Proxy, url: String, run: Duration) {
    let end = Instant::now() + run;
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let (client, url) = (proxy.client(), url.clone());
        tasks.push(tokio::spawn(async move {
            while Instant::now() < end {
                let left = end.saturating_duration_since(Instant::now());
                let send = client.get(&url).header("sluice-max-wait", "1s").send();
                match tokio::time::timeout(left, send).await {
                    Ok(Ok(r)) => {
                        let _ = r.bytes().await;
                    }
                    Ok(Err(_)) => tokio::time::sleep(Duration::from_millis(10)).await,
                    Err(_) => return,
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

fn config(provider: SocketAddr, learn: bool) -> String {
    format!(
        "[[upstream]]\nname = \"shared\"\nhosts = [\"127.0.0.1:{}\"]\n{}\
         retry = {{ max_attempts = 1 }}\n\
         limits = [{{ kind = \"fixed_window\", permits = 30, window = \"2s\" }}]\n",
        provider.port(),
        if learn { "learn = \"headers\"\n" } else { "" },
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn learning_the_announced_budget_avoids_the_429s_a_hidden_client_causes() {
    // The provider publishes 30 per 2 s, and sluice is set to exactly that; a second
    // client of the same key spends 20 at the start of every window.
    let (stat, learned) = tokio::join!(
        SharedProvider::start(30, Duration::from_secs(2), 20),
        SharedProvider::start(30, Duration::from_secs(2), 20),
    );
    let (c_static, c_learned) = (config(stat.addr, false), config(learned.addr, true));
    let (p_static, p_learned) = tokio::join!(Proxy::start(&c_static), Proxy::start(&c_learned));
    let run = Duration::from_secs(6);
    tokio::join!(
        flood(&p_static, format!("http://{}/", stat.addr), run),
        flood(&p_learned, format!("http://{}/", learned.addr), run),
    );
    let (s_ok, s_429) = *stat.counts.lock();
    let (l_ok, l_429) = *learned.counts.lock();
    // Statically sluice sends its 30 per window and the provider refuses the 20 the
    // hidden client took: about 60 refusals in 3 windows.
    assert!(s_429 >= 30, "static: {s_ok} accepted, {s_429} refused");
    // Learning, it paces to what the provider says is left: at most the requests in
    // flight when a window opens are refused.
    assert!(
        l_429 <= 4,
        "learned: {l_ok} accepted, {l_429} refused (static: {s_ok}, {s_429})"
    );
    // ...and it still uses what is left (10 per window).
    assert!(l_ok >= 20, "learned: {l_ok} accepted, {l_429} refused");
    eprintln!(
        "static: {s_ok} accepted, {s_429} refused; learned: {l_ok} accepted, {l_429} refused"
    );
}

#[tokio::test]
async fn a_learned_pace_shows_in_buckets_and_refuses_a_client_that_cannot_wait_for_it() {
    // 1000 per 30 s, 997 of them spent elsewhere: 2 left after sluice's first request.
    let provider = SharedProvider::start(1000, Duration::from_secs(30), 997).await;
    let proxy = Proxy::start(&format!(
        "[[upstream]]\nname = \"shared\"\nhosts = [\"127.0.0.1:{}\"]\nlearn = \"headers\"\n\
         retry = {{ max_attempts = 1 }}\n\
         limits = [{{ kind = \"sliding_window\", permits = 100, window = \"1m\" }}]\n",
        provider.addr.port()
    ))
    .await;
    let client = proxy.client();
    let url = format!("http://{}/", provider.addr);
    let send = |wait: &'static str| client.get(&url).header("sluice-max-wait", wait).send();
    assert_eq!(send("1s").await.unwrap().status(), 200);
    // What is left (2) is spread over the 30 s to the reset: one now, the next in 15 s.
    assert_eq!(send("1s").await.unwrap().status(), 200);
    let t0 = Instant::now();
    let refused = send("1s").await.unwrap();
    assert!(t0.elapsed() < Duration::from_secs(3));
    assert_eq!(refused.status(), 429);
    assert_eq!(refused.headers()["sluice-reason"], "queue_timeout");
    let after: u64 = refused.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((5..=30).contains(&after), "Retry-After {after}");
    assert_eq!(*provider.counts.lock(), (2, 0));

    let (status, text) = proxy.admin_get("/buckets").await;
    assert_eq!(status, 200);
    let buckets: serde_json::Value = serde_json::from_str(&text).unwrap();
    let learned = &buckets
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["upstream"] == "shared" && b["family"].is_null())
        .unwrap()["learned"];
    assert_eq!(learned["source"], "ratelimit", "{text}");
    assert_eq!(learned["announced_remaining"], 1, "{text}");
    let resets = learned["resets_in_seconds"].as_f64().unwrap();
    assert!((20.0..=30.0).contains(&resets), "{text}");
    // The configured limit alone would admit 98 more in this minute.
    let available = buckets[0]["limits"][0]["available"].as_u64().unwrap();
    assert_eq!(available, 98, "{text}");

    let m = proxy.metrics().await;
    assert_eq!(
        metric(&m, r#"sluice_learned_partitions{upstream="shared"}"#),
        Some(1.0),
        "{m}"
    );
    let configured = metric(&m, r#"sluice_configured_rate{upstream="shared"}"#).unwrap();
    assert!((configured - 100.0 / 60.0).abs() < 1e-9, "{m}");
    // One request left over about 30 s.
    let effective = metric(&m, r#"sluice_effective_rate{upstream="shared"}"#).unwrap();
    assert!((0.02..0.05).contains(&effective), "{m}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adapting_to_an_unannounced_lower_limit_cuts_the_429s() {
    // sluice is set to 30 per 2 s; the provider's real limit is 30% lower and it says
    // nothing of it but 429 (without Retry-After).
    let (stat, adapt) = tokio::join!(
        SharedProvider::silent(21, Duration::from_secs(2)),
        SharedProvider::silent(21, Duration::from_secs(2)),
    );
    let conf = |p: &SharedProvider, adaptive: &str| {
        format!(
            "[[upstream]]\nname = \"lower\"\nhosts = [\"127.0.0.1:{}\"]\n{adaptive}\
             retry = {{ max_attempts = 1 }}\n\
             limits = [{{ kind = \"fixed_window\", permits = 30, window = \"2s\" }}]\n",
            p.addr.port()
        )
    };
    let (c_static, c_adapt) = (conf(&stat, ""), conf(&adapt, "adaptive = {}\n"));
    let (p_static, p_adapt) = tokio::join!(Proxy::start(&c_static), Proxy::start(&c_adapt));
    let run = Duration::from_secs(8);
    tokio::join!(
        flood(&p_static, format!("http://{}/", stat.addr), run),
        flood(&p_adapt, format!("http://{}/", adapt.addr), run),
    );
    let (s_ok, s_429) = *stat.counts.lock();
    let (a_ok, a_429) = *adapt.counts.lock();
    eprintln!(
        "static: {s_ok} accepted, {s_429} refused; adaptive: {a_ok} accepted, {a_429} refused"
    );
    assert!(s_429 >= 10, "static: {s_ok} accepted, {s_429} refused");
    assert!(
        a_429 * 3 <= s_429,
        "adaptive: {a_ok} accepted, {a_429} refused; static: {s_ok}, {s_429}"
    );
    // ...while still sending most of what the provider takes.
    assert!(
        a_ok * 10 >= s_ok * 6,
        "adaptive: {a_ok} accepted, {a_429} refused; static: {s_ok}, {s_429}"
    );
    let m = p_adapt.metrics().await;
    let share = metric(
        &m,
        r#"sluice_adaptive_rate_ratio{family="-",upstream="lower"}"#,
    )
    .unwrap();
    assert!((0.1..=1.0).contains(&share), "{m}");
}

#[tokio::test]
async fn an_interactive_tenant_is_not_held_behind_a_bulk_tenants_backlog() {
    let up = Upstream::start().await;
    let proxy = Proxy::start(
        "[[upstream]]\nname = \"api\"\nhosts = [\"127.0.0.1\"]\n\
         limits = [{ kind = \"token_bucket\", rate = 20, per = \"1s\", burst = 1 }]\n\
         [[upstream.family]]\nname = \"jobs\"\ntenant = \"header:X-Tenant\"\n",
    )
    .await;
    let client = proxy.client();
    let mut bulk = Vec::new();
    for i in 0..80 {
        let req = client
            .get(up.url(&format!("/bulk/{i}")))
            .header("x-tenant", "bulk")
            .send();
        bulk.push(tokio::spawn(req));
    }
    // Let the backlog form: 80 at 20/s is 4 s of queue.
    assert!(
        eventually(Duration::from_secs(5), || async {
            let m = proxy.metrics().await;
            metric(&m, r#"sluice_queue_depth{family="jobs",upstream="api"}"#).unwrap_or(0.0) >= 50.0
        })
        .await
    );
    let (_, text) = proxy.admin_get("/buckets").await;
    let buckets: serde_json::Value = serde_json::from_str(&text).unwrap();
    let jobs = buckets
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["family"] == "jobs")
        .unwrap();
    assert_eq!(jobs["tenants_waiting"], 1, "{text}");
    let t0 = Instant::now();
    let resp = client
        .get(up.url("/ui"))
        .header("x-tenant", "ui")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let waited: u64 = resp.headers()["sluice-queue-wait"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    // Its turn comes after one of the bulk tenant's: 50 ms at 20/s, where FIFO would
    // have kept it behind the whole backlog (2 s or more).
    assert!(waited < 1000, "waited {waited} ms");
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    for b in bulk {
        assert_eq!(b.await.unwrap().unwrap().status(), 200);
    }
    // The tenant header is the application's: it goes on to the upstream untouched.
    let seen = up.seen();
    assert_eq!(seen.len(), 81);
    assert!(seen.iter().all(|s| s.header("x-tenant").is_some()));
}

/// `"name";k=v;k=v, ...` as (name, key) -> value.
fn fields(v: &str) -> std::collections::HashMap<(String, String), u64> {
    let mut out = std::collections::HashMap::new();
    for item in v.split(',') {
        let mut parts = item.trim().split(';');
        let name = parts.next().unwrap().trim_matches('"').to_string();
        for p in parts {
            let (k, val) = p.split_once('=').unwrap();
            out.insert((name.clone(), k.to_string()), val.parse().unwrap());
        }
    }
    out
}

#[tokio::test]
async fn responses_describe_the_bucket_they_paid_in_ratelimit_fields() {
    let up = Upstream::start().await;
    let proxy = Proxy::start(
        "[[upstream]]\nname = \"api\"\nhosts = [\"127.0.0.1\"]\nratelimit_headers = true\n\
         limits = [{ kind = \"fixed_window\", permits = 5, window = \"10s\" }]\n\
         [[upstream.family]]\nname = \"f\"\n\
         limits = [{ kind = \"sliding_window\", permits = 2, window = \"1s\" }]\n",
    )
    .await;
    let client = proxy.client();
    let resp = client.get(up.url("/a")).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let policy = fields(resp.headers()["ratelimit-policy"].to_str().unwrap());
    let at = |f: &std::collections::HashMap<(String, String), u64>, n: &str, k: &str| {
        f[&(n.to_string(), k.to_string())]
    };
    assert_eq!((at(&policy, "api", "q"), at(&policy, "api", "w")), (5, 10));
    assert_eq!(
        (at(&policy, "api/f", "q"), at(&policy, "api/f", "w")),
        (2, 1)
    );
    let now = fields(resp.headers()["ratelimit"].to_str().unwrap());
    assert_eq!(at(&now, "api", "r"), 4);
    assert!((9..=11).contains(&at(&now, "api", "t")), "{now:?}");
    assert_eq!(at(&now, "api/f", "r"), 1);
    assert!((1..=2).contains(&at(&now, "api/f", "t")), "{now:?}");

    assert_eq!(client.get(up.url("/b")).send().await.unwrap().status(), 200);
    // sluice's own 429 says the same, with nothing left in the family's window.
    let refused = client
        .get(up.url("/c"))
        .header("sluice-max-wait", "0")
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 429);
    let now = fields(refused.headers()["ratelimit"].to_str().unwrap());
    assert_eq!((at(&now, "api/f", "r"), at(&now, "api", "r")), (0, 3));
    assert!(refused.headers().contains_key("sluice-queue-wait"));
}

/// A provider with windows of 20 s on the clock, a second before now and every 20 s
/// from there, announcing its reset (`X-RateLimit-Reset`, a Unix second): sluice's clock
/// windows, with no offset written, end somewhere else. Ten clients, five at once and
/// five more as soon as sluice lets them. Reading the announcement, sluice moves its
/// edges to the provider's and holds the second five until its next window (give or take
/// the announcement's whole seconds); without it, it sends them when its own window
/// turns, inside the provider's, which refuses them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clock_windows_follow_the_reset_the_provider_announces() {
    use support::provider::{Clock, Counter, Provider};
    let window = Duration::from_secs(20);
    let unix = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
    };
    // sluice's own edge (a whole 20 s of Unix time) between 5 s and 14 s from now: inside
    // the provider's window, with time for the first five to go, and further from the
    // provider's edge (19 s on) than an announcement's whole seconds blur.
    let mut now = unix();
    let to_edge = |now: Duration| 20 - now.as_secs() % 20;
    while !(5..=14).contains(&to_edge(now)) {
        tokio::time::sleep(Duration::from_millis(500)).await;
        now = unix();
    }
    let offset = Duration::from_secs((now.as_secs() + 20 - 1) % 20);
    let limit = "limits = [{ kind = \"fixed_window\", permits = 5, window = \"20s\", \
                 align = \"clock\" }]\nretry = { max_attempts = 1 }\n";
    let run = |learn: bool| async move {
        let clock = Clock {
            t0: Instant::now(),
            unix0: unix(),
        };
        let provider = Provider::start(Counter::calendar(5, window, offset, clock), None).await;
        let proxy = Proxy::start(&format!(
            "[[upstream]]\nname = \"p\"\nhosts = [\"127.0.0.1:{}\"]\n{}{limit}",
            provider.addr.port(),
            if learn { "learn = \"headers\"\n" } else { "" },
        ))
        .await;
        let url = format!("http://{}/", provider.addr);
        let mut clients = Vec::new();
        for _ in 0..10 {
            let (client, url) = (proxy.client(), url.clone());
            clients.push(tokio::spawn(async move {
                client.get(&url).send().await.unwrap().status().as_u16()
            }));
        }
        for c in clients {
            c.await.unwrap();
        }
        let buckets = proxy.admin_get("/buckets").await.1;
        (provider.counts(), buckets)
    };
    let ((learned, buckets), (unread, _)) = tokio::join!(run(true), run(false));
    assert_eq!(learned, (10, 0), "following the announced reset: {buckets}");
    let b: serde_json::Value = serde_json::from_str(&buckets).unwrap();
    assert_eq!(
        b[0]["limits"][0]["edges_from"], "announced reset",
        "{buckets}"
    );
    assert_eq!(unread, (5, 5), "on sluice's own clock edges");
}
