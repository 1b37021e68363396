//! sluice in front of the rate limiters providers run, not models of them: haproxy's
//! stick-table counter, nginx's `limit_req` and the Python `limits` strategies, each
//! started on loopback at 10 requests per second as its own documentation writes it,
//! sluice configured from `docs/config.md` ("What does my provider count?") at the same
//! numbers. 20 clients send as fast as sluice lets them for more than 10 windows, with
//! retries off so that every 429 the limiter answers reaches a client: none does, and
//! the limiter is used close to its limit. `scripts/test` installs haproxy, nginx and
//! `limits`.

use sluice_test_support as support;

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use support::Proxy;
use tokio::time::Instant;

const RATE: u32 = 10;
const CLIENTS: usize = 20;
/// How long the clients keep sending: more than 10 windows of one second.
const SENDING: Duration = Duration::from_millis(10_500);

/// A limiter running in a child process, on 127.0.0.1.
struct Limiter {
    name: String,
    addr: SocketAddr,
    /// The path its requests go to.
    path: &'static str,
    process: std::process::Child,
    _dir: tempfile::TempDir,
}

impl Drop for Limiter {
    fn drop(&mut self) {
        let _ = self.process.kill();
        let _ = self.process.wait();
    }
}

impl Limiter {
    /// Starts `program` with `args` and waits until it accepts connections on `port`.
    async fn spawn(
        name: &str,
        dir: tempfile::TempDir,
        port: u16,
        path: &'static str,
        program: &str,
        args: &[&str],
    ) -> Limiter {
        let mut process = Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("{program} runs (scripts/test installs it): {e}"));
        let addr: SocketAddr = ([127, 0, 0, 1], port).into();
        let up = support::eventually(Duration::from_secs(20), || async move {
            tokio::net::TcpStream::connect(addr).await.is_ok()
        })
        .await;
        if !up {
            let _ = process.kill();
            panic!("{name} did not listen on {addr}");
        }
        Limiter {
            name: name.to_string(),
            addr,
            path,
            process,
            _dir: dir,
        }
    }

    fn url(&self) -> String {
        format!("http://{}{}", self.addr, self.path)
    }
}

/// haproxy counting each client's requests with `sc_http_req_rate` over one second and
/// refusing above `RATE`, as its documentation's rate-limiting example does.
async fn haproxy() -> Limiter {
    let dir = tempfile::tempdir().unwrap();
    let port = support::free_port();
    let cfg = dir.path().join("haproxy.cfg");
    std::fs::write(
        &cfg,
        format!(
            "global\n    maxconn 256\n\
             defaults\n    mode http\n    timeout connect 5s\n    timeout client 30s\n    \
             timeout server 30s\n\
             frontend api\n    bind 127.0.0.1:{port}\n    \
             http-request track-sc0 src table per_client\n    \
             http-request deny deny_status 429 if {{ sc_http_req_rate(0) gt {RATE} }}\n    \
             http-request return status 200 content-type text/plain string ok\n\
             backend per_client\n    \
             stick-table type ip size 1k expire 10s store http_req_rate(1s)\n"
        ),
    )
    .unwrap();
    let cfg = cfg.display().to_string();
    Limiter::spawn("haproxy", dir, port, "/", "haproxy", &["-f", &cfg, "-db"]).await
}

/// nginx `limit_req` keyed by the client address at `RATE` r/s with `burst` (none when 0),
/// answering 429 (`limit_req_status`), serving a static file after the limit.
async fn nginx(burst: u32, nodelay: bool) -> Limiter {
    let dir = tempfile::tempdir().unwrap();
    let port = support::free_port();
    let d = dir.path().display().to_string();
    std::fs::create_dir(dir.path().join("www")).unwrap();
    std::fs::write(dir.path().join("www/ok"), "ok\n").unwrap();
    let burst_arg = if burst > 0 {
        format!(" burst={burst}")
    } else {
        String::new()
    };
    let nodelay_arg = if nodelay { " nodelay" } else { "" };
    std::fs::write(
        dir.path().join("nginx.conf"),
        format!(
            "daemon off;\nmaster_process off;\nworker_processes 1;\npid {d}/nginx.pid;\n\
             error_log {d}/error.log;\nevents {{ worker_connections 256; }}\n\
             http {{\n  access_log off;\n  client_body_temp_path {d}/body;\n  \
             limit_req_zone $binary_remote_addr zone=api:1m rate={RATE}r/s;\n  \
             limit_req_status 429;\n  \
             server {{\n    listen 127.0.0.1:{port};\n    root {d}/www;\n    \
             location / {{ limit_req zone=api{burst_arg}{nodelay_arg}; }}\n  }}\n}}\n"
        ),
    )
    .unwrap();
    let name = format!("nginx rate={RATE}r/s{burst_arg}{nodelay_arg}");
    let (conf, prefix) = (format!("{d}/nginx.conf"), format!("{d}/"));
    let args = ["-p", &prefix, "-c", &conf, "-e", "stderr"];
    Limiter::spawn(&name, dir, port, "/ok", "nginx", &args).await
}

/// A service limited by the Python `limits` package with `strategy` at "10/second".
async fn python_limits(strategy: &str) -> Limiter {
    let dir = tempfile::tempdir().unwrap();
    let port = support::free_port();
    let server = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/limiter_server.py");
    let server = server.display().to_string();
    let (kind, rate) = (format!("limits:{strategy}"), format!("{RATE}/second"));
    let args = [server.as_str(), &port.to_string(), &kind, &rate];
    Limiter::spawn(&kind, dir, port, "/", "python3", &args).await
}

/// What the clients got through sluice.
struct Outcome {
    ok: usize,
    refused: usize,
    other: Vec<u16>,
    elapsed: Duration,
}

/// `CLIENTS` clients, each on its own connection, send through sluice set to `limit` in
/// front of `limiter` until `SENDING` has passed; sluice never retries.
async fn through(limiter: &Limiter, limit: &str) -> Outcome {
    through_with(limiter, limit, "").await
}

/// As `through`, with `families` after the upstream's limits.
async fn through_with(limiter: &Limiter, limit: &str, families: &str) -> Outcome {
    let proxy = Proxy::start(&format!(
        "[[upstream]]\nname = \"provider\"\nhosts = [\"127.0.0.1\"]\nlimits = [{limit}]\n\
         [upstream.retry]\nmax_attempts = 1\n{families}"
    ))
    .await;
    let start = Arc::new(tokio::sync::Barrier::new(CLIENTS));
    let built: Vec<reqwest::Client> = (0..CLIENTS).map(|_| proxy.client()).collect();
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for client in built {
        let (url, start) = (limiter.url(), start.clone());
        tasks.push(tokio::spawn(async move {
            start.wait().await;
            let mut statuses = Vec::new();
            while t0.elapsed() < SENDING {
                let status = match client.get(&url).send().await {
                    Ok(r) => {
                        let s = r.status().as_u16();
                        let _ = r.bytes().await;
                        s
                    }
                    Err(_) => 0,
                };
                statuses.push(status);
            }
            statuses
        }));
    }
    let mut statuses = Vec::new();
    for t in tasks {
        statuses.extend(t.await.unwrap());
    }
    let count = |s: u16| statuses.iter().filter(|x| **x == s).count();
    Outcome {
        ok: count(200),
        refused: count(429),
        other: statuses
            .iter()
            .copied()
            .filter(|s| *s != 200 && *s != 429)
            .collect(),
        elapsed: t0.elapsed(),
    }
}

/// One test's limiters at a time: each test runs two or three real limiters and their
/// clients at once, and all of them together on two cores would stall the limiters'
/// own clocks (a Python server reading its clock late counts an arrival late).
static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// No 429 from `limiter` behind `limit`, and at least `least` of the limit used: the
/// requests accepted over the time they took, against `RATE` a second plus `burst` at
/// the start.
async fn holds(limiter: Limiter, limit: &str, burst: u32, least: f64) {
    holds_with(limiter, limit, "", burst, least).await;
}

/// As `holds`, with `families` after the upstream's limits.
async fn holds_with(limiter: Limiter, limit: &str, families: &str, burst: u32, least: f64) {
    let o = through_with(&limiter, limit, families).await;
    let name = &limiter.name;
    assert_eq!(
        o.refused, 0,
        "{name} behind {limit}: {} answered 429",
        o.refused
    );
    assert!(o.other.is_empty(), "{name} behind {limit}: {:?}", o.other);
    let possible = f64::from(burst) + o.elapsed.as_secs_f64() * f64::from(RATE);
    let used = o.ok as f64 / possible;
    eprintln!(
        "{name} behind {limit}: {} accepted, {} refused in {:?}: {:.1}% of the limit",
        o.ok,
        o.refused,
        o.elapsed,
        used * 100.0
    );
    assert!(
        used >= least,
        "{name} behind {limit}: {} accepted in {:?} is {:.1}% of the limit",
        o.ok,
        o.elapsed,
        used * 100.0
    );
}

/// The weighted two-window counters: haproxy's, whose windows start at a client's first
/// request, and `limits`', on the clock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sliding_counters_never_refuse() {
    let _turn = TURN.lock().await;
    let (h, l) = tokio::join!(haproxy(), python_limits("sliding-window-counter"));
    tokio::join!(
        holds(
            h,
            "{ kind = \"sliding_counter\", permits = 10, window = \"1s\" }",
            10,
            0.85
        ),
        holds(
            l,
            "{ kind = \"sliding_counter\", permits = 10, window = \"1s\", align = \"clock\" }",
            10,
            0.85
        ),
    );
}

/// `limits`' fixed window (it starts with the first request and counts refused ones too)
/// and its moving window (an exact log).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn windows_never_refuse() {
    let _turn = TURN.lock().await;
    let (f, m) = tokio::join!(
        python_limits("fixed-window"),
        python_limits("moving-window")
    );
    tokio::join!(
        holds(
            f,
            "{ kind = \"fixed_window\", permits = 10, window = \"1s\" }",
            10,
            0.85
        ),
        holds(
            m,
            "{ kind = \"sliding_window\", permits = 10, window = \"1s\" }",
            10,
            0.85
        ),
    );
}

/// nginx with no burst, with a burst it serves at once (`nodelay`), and with a burst it
/// delays: the same `leaky_bucket` for the last two, since nginx refuses the same
/// requests either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nginx_limit_req_never_refuses() {
    let _turn = TURN.lock().await;
    let (none, nodelay, delayed) = tokio::join!(nginx(0, false), nginx(5, true), nginx(5, false));
    tokio::join!(
        holds(
            none,
            "{ kind = \"leaky_bucket\", rate = 10, per = \"1s\" }",
            1,
            0.85
        ),
        holds(
            nodelay,
            "{ kind = \"leaky_bucket\", rate = 10, per = \"1s\", burst = 5 }",
            6,
            0.85
        ),
        holds(
            delayed,
            "{ kind = \"leaky_bucket\", rate = 10, per = \"1s\", burst = 5 }",
            6,
            0.85
        ),
    );
}

/// A fixed weight maps onto a counter of requests: each request priced 5 units of
/// `weight` (docs/config.md's weighted REST example), against limits of 50 units a
/// second, is nginx's `limit_req` of 10 r/s and haproxy's counter of 10 a second. The
/// counter in units is stricter than haproxy's by up to a request: a provider counting
/// units rounds its estimate down in units, so 5 units need an estimate below 46 of 50,
/// where haproxy rounds down in requests and admits below 10 of 10 (86% of the limit
/// here, against 93% for the same counter in requests).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fixed_weights_map_onto_counters_of_requests() {
    let _turn = TURN.lock().await;
    let (n, h) = tokio::join!(nginx(0, false), haproxy());
    let weighed = "[[upstream.family]]\nname = \"bulk\"\n\
                   [upstream.family.cost.weight]\nestimate = 5\n";
    tokio::join!(
        holds_with(
            n,
            "{ kind = \"token_bucket\", rate = 50, per = \"1s\", burst = 5, unit = \"weight\" }",
            weighed,
            1,
            0.85
        ),
        holds_with(
            h,
            "{ kind = \"sliding_counter\", permits = 50, window = \"1s\", unit = \"weight\" }",
            weighed,
            10,
            0.78
        ),
    );
}

/// The choice for an unknown algorithm, against every limiter above at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn published_never_refuses_anywhere() {
    let _turn = TURN.lock().await;
    let (h, c, f, m, n) = tokio::join!(
        haproxy(),
        python_limits("sliding-window-counter"),
        python_limits("fixed-window"),
        python_limits("moving-window"),
        nginx(0, false),
    );
    let published = "{ kind = \"published\", permits = 10, window = \"1s\" }";
    tokio::join!(
        holds(h, published, 1, 0.85),
        holds(c, published, 1, 0.85),
        holds(f, published, 1, 0.85),
        holds(m, published, 1, 0.85),
        holds(n, published, 1, 0.85),
    );
}

/// What the kinds above are for: an exact sliding log in front of haproxy's counter at
/// the same numbers is refused, many times (it sends a window's permits back to back,
/// which the counter weighs into the next window too). This shows the harness sees
/// refusals.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sliding_log_in_front_of_haproxy_is_refused() {
    let _turn = TURN.lock().await;
    let h = haproxy().await;
    let o = through(
        &h,
        "{ kind = \"sliding_window\", permits = 10, window = \"1s\" }",
    )
    .await;
    assert!(o.refused >= 10, "haproxy refused only {}", o.refused);
}
