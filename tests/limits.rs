//! The limiter through the real proxy: a recording upstream on loopback, reqwest clients
//! through sluice, and arrival times checked with wide margins (wall-clock time here;
//! exact instants are checked under paused time in `src/limit`).

use sluice_test_support as support;

use std::time::Duration;

use support::*;
use tokio::time::Instant;

fn upstream_config(body: &str) -> String {
    format!("[[upstream]]\nname = \"api\"\nhosts = [\"127.0.0.1\"]\n{body}")
}

/// Most arrivals that fall inside any interval of `span`.
fn max_in_any(arrivals: &[Instant], span: Duration) -> usize {
    arrivals
        .iter()
        .map(|a| {
            arrivals
                .iter()
                .filter(|b| **b >= *a && **b < *a + span)
                .count()
        })
        .max()
        .unwrap_or(0)
}

#[tokio::test]
async fn a_sliding_window_shapes_concurrent_clients() {
    let up = Upstream::start().await;
    let proxy = Proxy::start(&upstream_config(
        "limits = [{ kind = \"sliding_window\", permits = 3, window = \"1s\" }]\n",
    ))
    .await;
    let client = proxy.client();
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..9 {
        let (c, url) = (client.clone(), up.url(&format!("/r{i}")));
        tasks.push(tokio::spawn(async move {
            c.get(url).send().await.unwrap().status()
        }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    let elapsed = t0.elapsed();
    let arrivals: Vec<Instant> = up.seen().iter().map(|s| s.at).collect();
    assert_eq!(arrivals.len(), 9);
    assert!(
        elapsed >= Duration::from_millis(1950),
        "9 requests at 3/s take 2 s, took {elapsed:?}"
    );
    // Any 950 ms holds at most 3 arrivals (50 ms of slack for delivery jitter).
    assert_eq!(max_in_any(&arrivals, Duration::from_millis(950)), 3);

    let m = proxy.metrics().await;
    assert!(
        m.contains(r#"sluice_queue_wait_seconds_count{family="-",upstream="api"} 9"#),
        "{m}"
    );
    assert!(
        m.contains(r#"sluice_requests_total{family="-",outcome="200",upstream="api"} 9"#),
        "{m}"
    );
}

#[tokio::test]
async fn families_do_not_block_each_other() {
    let up = Upstream::start().await;
    let proxy = Proxy::start(&upstream_config(
        "[[upstream.family]]\nname = \"orders\"\npaths = [\"/orders/**\"]\n\
         limits = [{ kind = \"sliding_window\", permits = 1, window = \"12s\" }]\n\
         [[upstream.family]]\nname = \"catalog\"\npaths = [\"/catalog/**\"]\n\
         limits = [{ kind = \"sliding_window\", permits = 100, window = \"1s\" }]\n",
    ))
    .await;
    let client = proxy.client();
    let mut orders = Vec::new();
    for i in 0..3 {
        let (c, url) = (client.clone(), up.url(&format!("/orders/{i}")));
        orders.push(tokio::spawn(async move {
            c.get(url).send().await.unwrap().status()
        }));
    }
    assert!(
        metric_reaches(
            &proxy,
            r#"sluice_queue_depth{family="orders",upstream="api"}"#,
            2.0
        )
        .await,
        "two orders wait"
    );
    let t0 = Instant::now();
    for i in 0..10 {
        let resp = client
            .get(up.url(&format!("/catalog/{i}")))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
    }
    // Behind orders it would wait 12 s.
    assert!(
        t0.elapsed() < Duration::from_secs(6),
        "catalog waited behind orders: {:?}",
        t0.elapsed()
    );
    let (status, depth) = proxy.admin_get("/metrics").await;
    assert_eq!(status, 200);
    assert!(
        depth.contains(r#"sluice_queue_depth{family="orders",upstream="api"} 2"#),
        "{depth}"
    );
    for o in orders {
        o.abort();
    }
}

#[tokio::test]
async fn queue_bounds_answer_at_once_with_retry_after() {
    let up = Upstream::start().await;
    let proxy = Proxy::start(&upstream_config(
        "max_queue = 2\nmax_wait = \"20s\"\nlimits = [{ kind = \"fixed_window\", permits = 1, window = \"10s\" }]\n",
    ))
    .await;
    let client = proxy.client();
    assert_eq!(
        client.get(up.url("/first")).send().await.unwrap().status(),
        200
    );
    let mut waiting = Vec::new();
    for _ in 0..2 {
        let (c, url) = (client.clone(), up.url("/queued"));
        waiting.push(tokio::spawn(async move { c.get(url).send().await }));
    }
    assert!(
        metric_reaches(
            &proxy,
            r#"sluice_queue_depth{family="-",upstream="api"}"#,
            2.0
        )
        .await,
        "the queue is full"
    );

    let t0 = Instant::now();
    let full = client.get(up.url("/overflow")).send().await.unwrap();
    // Queued, it would wait about 10 s.
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "queue_full is immediate"
    );
    assert_eq!(full.status(), 429);
    assert_eq!(full.headers()["sluice-reason"], "queue_full");
    let retry_after: u64 = full.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((9..=30).contains(&retry_after), "Retry-After {retry_after}");
    let body: serde_json::Value = serde_json::from_slice(&full.bytes().await.unwrap()).unwrap();
    assert_eq!(body["error"]["code"], "sluice_queue_full");

    let m = proxy.metrics().await;
    assert!(
        m.contains(r#"sluice_rejections_total{family="-",reason="queue_full",upstream="api"} 1"#),
        "{m}"
    );
    assert!(
        m.contains(
            r#"sluice_requests_total{family="-",outcome="sluice_queue_full",upstream="api"} 1"#
        ),
        "{m}"
    );
    for w in waiting {
        w.abort();
    }
}

#[tokio::test]
async fn a_wait_known_to_exceed_max_wait_is_refused_at_once() {
    let up = Upstream::start().await;
    let proxy = Proxy::start(&upstream_config(
        "max_wait = \"20s\"\nlimits = [{ kind = \"sliding_window\", permits = 1, window = \"1m\" }]\n",
    ))
    .await;
    let client = proxy.client();
    assert_eq!(client.get(up.url("/a")).send().await.unwrap().status(), 200);
    let t0 = Instant::now();
    let resp = client.get(up.url("/b")).send().await.unwrap();
    // Waiting out max_wait first would take 20 s.
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    assert_eq!(resp.status(), 429);
    assert_eq!(resp.headers()["sluice-reason"], "queue_timeout");
    let retry_after: u64 = resp.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        (55..=60).contains(&retry_after),
        "Retry-After {retry_after}"
    );
    assert_eq!(up.seen().len(), 1);
}

#[tokio::test]
async fn a_concurrency_permit_is_held_until_the_body_is_sent() {
    let up = Upstream::start().await;
    let proxy = Proxy::start(&upstream_config(
        "limits = [{ kind = \"concurrency\", max = 1 }]\n",
    ))
    .await;
    let client = proxy.client();
    let first = client.get(up.url("/drip/5/100")).send().await.unwrap();
    assert_eq!(first.status(), 200);
    // Headers are in, the body still drips: the second request must not reach upstream.
    let second = {
        let (c, url) = (client.clone(), up.url("/second"));
        tokio::spawn(async move { c.get(url).send().await.unwrap().status() })
    };
    let body = first.text().await.unwrap();
    let body_done = Instant::now();
    assert_eq!(body.matches("drip-").count(), 5);
    assert_eq!(second.await.unwrap(), 200);
    let seen = up.seen();
    assert_eq!(seen[1].uri, "/second");
    assert!(
        seen[1].at + Duration::from_millis(20) >= body_done,
        "second request started before the first body ended"
    );
}

#[tokio::test]
async fn clients_that_give_up_while_queued_leave_the_bucket_at_full_speed() {
    let up = Upstream::start().await;
    let proxy = Proxy::start(&upstream_config(
        "limits = [{ kind = \"concurrency\", max = 1 }, { kind = \"token_bucket\", rate = 50, per = \"10s\", burst = 50 }]\n",
    ))
    .await;
    let client = proxy.client();
    // One slow request holds the only concurrency permit while 200 impatient clients queue
    // and give up.
    let holder = {
        let (c, url) = (client.clone(), up.url("/slow/1500"));
        tokio::spawn(async move { c.get(url).send().await.unwrap().status() })
    };
    assert!(
        eventually(Duration::from_secs(10), || async { !up.seen().is_empty() }).await,
        "the holder reached the upstream"
    );
    let impatient = reqwest::Client::builder()
        .proxy(reqwest::Proxy::all(proxy.url()).unwrap())
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let mut quitters = Vec::new();
    for i in 0..200 {
        let (c, url) = (impatient.clone(), up.url(&format!("/quit{i}")));
        quitters.push(tokio::spawn(async move { c.get(url).send().await }));
    }
    for q in quitters {
        assert!(q.await.unwrap().is_err(), "gave up");
    }
    assert_eq!(holder.await.unwrap(), 200);
    // Wait for the proxy to notice every disconnect, then check nothing is left behind.
    let mut depth = String::new();
    for _ in 0..50 {
        depth = proxy.metrics().await;
        if depth.contains(r#"sluice_queue_depth{family="-",upstream="api"} 0"#) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        depth.contains(r#"sluice_queue_depth{family="-",upstream="api"} 0"#),
        "{depth}"
    );
    assert_eq!(
        up.seen()
            .iter()
            .filter(|s| s.uri.starts_with("/quit"))
            .count(),
        0,
        "no quitter reached upstream"
    );
    // Nothing leaked: 50 requests now pass at once on the token bucket's full burst.
    let t0 = Instant::now();
    for i in 0..50 {
        assert_eq!(
            client
                .get(up.url(&format!("/after{i}")))
                .send()
                .await
                .unwrap()
                .status(),
            200
        );
    }
    // Tokens leaked to the quitters would come back at 5 a second: 10 s for 50.
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
}

#[tokio::test]
async fn partitions_by_key_and_buckets_endpoint() {
    let up = Upstream::start().await;
    let proxy = Proxy::start(&upstream_config(
        "key = \"header:Authorization\"\nlimits = [{ kind = \"fixed_window\", permits = 1, window = \"1m\" }]\n\
         max_wait = \"1s\"\n",
    ))
    .await;
    let client = proxy.client();
    let send = |key: &'static str| client.get(up.url("/k")).header("authorization", key).send();
    assert_eq!(send("Bearer live_key").await.unwrap().status(), 200);
    assert_eq!(
        send("Bearer test_key").await.unwrap().status(),
        200,
        "another key, another budget"
    );
    assert_eq!(send("Bearer live_key").await.unwrap().status(), 429);
    // No header: the unkeyed partition, with its own budget.
    assert_eq!(client.get(up.url("/k")).send().await.unwrap().status(), 200);

    let (status, text) = proxy.admin_get("/buckets").await;
    assert_eq!(status, 200);
    assert!(
        !text.contains("live_key") && !text.contains("test_key"),
        "{text}"
    );
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let parts: Vec<&str> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["partition"].as_str().unwrap())
        .collect();
    assert_eq!(parts.len(), 3, "{text}");
    assert!(parts.contains(&"-"));
    assert!(parts.iter().filter(|p| **p != "-").all(|p| p.len() == 12));
}

#[tokio::test]
async fn a_blind_tunnel_holds_a_concurrency_permit_while_open() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let echo = echo_server().await;
    let proxy = Proxy::start(
        "[[upstream]]\nname = \"tunnelled\"\nhosts = [\"127.0.0.1\"]\nmax_wait = \"300ms\"\n\
         limits = [{ kind = \"concurrency\", max = 1 }]\n",
    )
    .await;
    let connect = format!("CONNECT {echo} HTTP/1.1\r\nHost: {echo}\r\n\r\n");
    let mut first = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    first.write_all(connect.as_bytes()).await.unwrap();
    assert_eq!(read_response(&mut first).await.status, 200);

    let second = raw(proxy.addr, connect.as_bytes()).await;
    assert_eq!(
        second.status, 429,
        "the only permit is held by the open tunnel"
    );
    assert_eq!(
        second.header("sluice-reason").as_deref(),
        Some("queue_timeout")
    );

    // A TLS record: carried blind to a configured upstream (anything that is neither TLS
    // nor HTTP would close the tunnel; see proxy::sniff).
    first.write_all(b"\x16\x03\x01ping").await.unwrap();
    let mut buf = [0u8; 7];
    first.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"\x16\x03\x01ping");
    drop(first);
    let mut third = None;
    for _ in 0..50 {
        let r = raw(proxy.addr, connect.as_bytes()).await;
        if r.status == 200 {
            third = Some(r);
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        third.is_some(),
        "the permit came back when the tunnel closed"
    );
}

fn queue_wait(resp: &reqwest::Response) -> Option<u64> {
    resp.headers()
        .get("sluice-queue-wait")
        .map(|v| v.to_str().unwrap().parse().unwrap())
}

#[tokio::test]
async fn a_response_that_paid_a_limit_says_how_long_it_waited() {
    let up = Upstream::start().await;
    let proxy = Proxy::start(&format!(
        "{}\n[[upstream]]\nname = \"free\"\nhosts = [\"localhost\"]\n",
        upstream_config(
            "limits = [{ kind = \"sliding_window\", permits = 1, window = \"600ms\" }]\n"
        )
    ))
    .await;
    let client = proxy.client();
    let first = client.get(up.url("/a")).send().await.unwrap();
    assert_eq!(first.status(), 200);
    assert!(queue_wait(&first).unwrap() < 300, "{:?}", first.headers());
    let second = client.get(up.url("/b")).send().await.unwrap();
    assert_eq!(second.status(), 200);
    let waited = queue_wait(&second).unwrap();
    assert!((300..5000).contains(&waited), "waited {waited} ms");
    // An upstream with no limits, and a host no upstream matches: nothing paid, nothing said.
    let free = format!("http://localhost:{}/c", up.addr.port());
    let resp = client.get(free).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(queue_wait(&resp), None);
    let echo = echo_server().await;
    let proxy = Proxy::start("[egress]\nallow = [\"127.0.0.1\"]\n").await;
    let resp = proxy
        .client()
        .get(format!("http://{echo}/"))
        .send()
        .await
        .unwrap();
    assert_eq!(queue_wait(&resp), None);
}

#[tokio::test]
async fn sluice_max_wait_refuses_at_once_what_it_cannot_admit_in_time() {
    let up = Upstream::start().await;
    let proxy = Proxy::start(&upstream_config(
        "max_wait = \"20s\"\nlimits = [{ kind = \"sliding_window\", permits = 1, window = \"10s\" }]\n",
    ))
    .await;
    let client = proxy.client();
    let first = client
        .get(up.url("/a"))
        .header("sluice-max-wait", "2s")
        .send()
        .await
        .unwrap();
    assert_eq!(first.status(), 200);
    assert_eq!(up.seen()[0].header("sluice-max-wait"), None, "stripped");
    // Without the header this request would wait 10 s for the next permit (max_wait
    // allows 20); a client that waits at most 1 s is refused now.
    let t0 = Instant::now();
    let resp = client
        .get(up.url("/b"))
        .header("sluice-max-wait", "1")
        .send()
        .await
        .unwrap();
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    assert_eq!(resp.status(), 429);
    assert_eq!(resp.headers()["sluice-reason"], "queue_timeout");
    assert!(resp.headers().contains_key("retry-after"));
    assert!(queue_wait(&resp).unwrap() < 1000);
    assert_eq!(up.seen().len(), 1);
    let m = proxy.metrics().await;
    assert!(
        m.contains(
            r#"sluice_rejections_total{family="-",reason="queue_timeout",upstream="api"} 1"#
        ),
        "{m}"
    );
}

#[tokio::test]
async fn sluice_max_wait_ends_an_unknowable_wait_and_is_capped_by_max_wait() {
    let up = Upstream::start().await;
    let proxy = Proxy::start(&upstream_config(
        "max_wait = \"1500ms\"\nlimits = [{ kind = \"concurrency\", max = 1 }]\n",
    ))
    .await;
    let client = proxy.client();
    // Holds the only permit for 20 s.
    let holder = tokio::spawn({
        let (client, url) = (client.clone(), up.url("/slow/20000"));
        async move { client.get(url).send().await }
    });
    assert!(eventually(Duration::from_secs(5), || async { up.seen().len() == 1 }).await);
    for (asked, at_least, at_most) in [("300ms", 250, 1400), ("10s", 1400, 8000)] {
        let t0 = Instant::now();
        let resp = client
            .get(up.url("/b"))
            .header("sluice-max-wait", asked)
            .send()
            .await
            .unwrap();
        let took = t0.elapsed().as_millis() as u64;
        assert_eq!(resp.status(), 429, "{asked}");
        assert_eq!(resp.headers()["sluice-reason"], "queue_timeout");
        let waited = queue_wait(&resp).unwrap();
        assert!(
            (at_least..at_most).contains(&waited) && (at_least..at_most + 2000).contains(&took),
            "asked {asked}: waited {waited} ms, answered after {took} ms"
        );
    }
    holder.abort();
}

#[tokio::test]
async fn a_malformed_sluice_max_wait_is_a_bad_request() {
    let up = Upstream::start().await;
    let proxy = Proxy::start(&upstream_config(
        "limits = [{ kind = \"concurrency\", max = 1 }]\n",
    ))
    .await;
    let resp = proxy
        .client()
        .get(up.url("/a"))
        .header("sluice-max-wait", "soon")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    assert_eq!(resp.headers()["sluice-reason"], "bad_request");
    let body = resp.text().await.unwrap();
    assert!(body.contains("sluice-max-wait"), "{body}");
    assert!(up.seen().is_empty());
    // A wait too long for any clock is no limit, not a crash.
    for huge in ["18446744073709551615", "500000000years"] {
        let resp = proxy
            .client()
            .get(up.url("/b"))
            .header("sluice-max-wait", huge)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "{huge}");
    }
}
