//! What a broken client or a broken upstream can do to sluice, and what it gets instead:
//! the regression tests of the hardening review (issue 15), against real sockets.

use sluice_test_support as support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// An upstream whose breaker opens after four failures out of at least four attempts.
fn touchy(up: &Upstream) -> String {
    format!(
        "[[upstream]]\nname = \"api\"\nhosts = [\"127.0.0.1:{}\"]\nattempt_timeout = \"500ms\"\n\
         [upstream.breaker]\nmin_requests = 4\nfailure_ratio = 0.5\nwindow = \"1m\"\nopen_for = \"1m\"\n",
        up.addr.port()
    )
}

/// Sends `head` and `body` on a new connection to the proxy, and reads what comes back
/// (nothing if the proxy closes first).
async fn send(proxy: &Proxy, head: &str, body: &[u8], then_close: bool) -> Option<RawResponse> {
    let mut s = TcpStream::connect(proxy.addr).await.unwrap();
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(body).await.unwrap();
    if then_close {
        drop(s);
        return None;
    }
    let resp = tokio::time::timeout(Duration::from_secs(10), read_response(&mut s))
        .await
        .expect("an answer in time");
    // The connection is closed after a client failure: nothing more can be read on it.
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut rest)).await;
    assert!(
        closed.is_ok(),
        "the connection is closed after {}",
        resp.status
    );
    Some(resp)
}

/// Broken uploads from one client (a malformed chunk, a disconnect halfway, an upload
/// slower than attempt_timeout) are the client's: 400 or 408, never retried, never
/// counted against the upstream, whose breaker stays closed for everyone else.
#[tokio::test]
async fn a_clients_broken_body_never_trips_the_upstreams_breaker() {
    let up = Upstream::start().await;
    let proxy = Proxy::start(&touchy(&up)).await;
    let url = up.url("/read");
    let chunked = format!("POST {url} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n");
    let sized = format!("POST {url} HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n");
    for _ in 0..5 {
        let r = send(&proxy, &chunked, b"5\r\nhello\r\nzz\r\n", false)
            .await
            .unwrap();
        assert_eq!(r.status, 400, "{}", r.head);
        assert_eq!(r.header("sluice-reason").as_deref(), Some("bad_request"));

        send(&proxy, &sized, b"0123456789", true).await;

        // Ten bytes of a hundred, then nothing: the upstream waits for the rest.
        let r = send(&proxy, &sized, b"0123456789", false).await.unwrap();
        assert_eq!(r.status, 408, "{}", r.head);
        assert_eq!(r.header("sluice-reason").as_deref(), Some("client_timeout"));
    }
    // Let the disconnected uploads finish on sluice's side.
    let settled = eventually(Duration::from_secs(5), || async {
        let m = proxy.metrics().await;
        metric(
            &m,
            r#"sluice_requests_total{family="-",outcome="sluice_bad_request",upstream="api"}"#,
        ) == Some(10.0)
    })
    .await;
    let m = proxy.metrics().await;
    assert!(settled, "{m}");

    let ok = proxy
        .client()
        .post(up.url("/read"))
        .body("fine")
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
    assert_eq!(ok.text().await.unwrap(), "4");
    let m = proxy.metrics().await;
    assert_eq!(
        metric(&m, r#"sluice_breaker_state{state="closed",upstream="api"}"#),
        Some(1.0),
        "{m}"
    );
    assert_eq!(
        metric(
            &m,
            r#"sluice_requests_total{family="-",outcome="sluice_client_timeout",upstream="api"}"#
        ),
        Some(5.0),
        "{m}"
    );
    assert!(!m.contains("sluice_retries_total{"), "nothing retried: {m}");
    for status in ["502", "504"] {
        assert!(!m.contains(&format!("outcome=\"{status}\"")), "{m}");
    }
}

/// A request body slower than total_timeout (shorter than attempt_timeout here) is 408
/// too, not 504.
#[tokio::test]
async fn a_body_slower_than_total_timeout_is_408() {
    let up = Upstream::start().await;
    let proxy = Proxy::start(&format!(
        "[[upstream]]\nname = \"api\"\nhosts = [\"127.0.0.1:{}\"]\n\
         attempt_timeout = \"5s\"\ntotal_timeout = \"400ms\"\n",
        up.addr.port()
    ))
    .await;
    let head = format!(
        "PUT {} HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n",
        up.url("/read")
    );
    let r = send(&proxy, &head, b"0123456789", false).await.unwrap();
    assert_eq!(r.status, 408, "{}", r.head);
    assert_eq!(r.header("sluice-reason").as_deref(), Some("client_timeout"));
    // The upstream that is slow itself still gets 504.
    let slow = proxy
        .client()
        .get(up.url("/slow/2000"))
        .send()
        .await
        .unwrap();
    assert_eq!(slow.status(), 504);
}

/// Queued requests read nothing of their bodies: a queue full of large PUTs holds no
/// replay copies, and each body is read only once its request is admitted (then copied
/// while it streams, so it can still be retried).
#[tokio::test]
async fn queued_bodies_are_not_read_before_admission() {
    let up = Upstream::start().await;
    let proxy = Proxy::start(&format!(
        "[[upstream]]\nname = \"api\"\nhosts = [\"127.0.0.1:{}\"]\n\
         limits = [{{ kind = \"concurrency\", max = 1 }}]\n",
        up.addr.port()
    ))
    .await;
    let client = proxy.client();
    let hold = tokio::spawn({
        let c = client.clone();
        let url = up.url("/slow/1500");
        async move { c.get(url).send().await.unwrap().status() }
    });
    let holding = eventually(Duration::from_secs(5), || async { up.seen().len() == 1 }).await;
    assert!(holding);
    const BODY: usize = 256 * 1024;
    let puts: Vec<_> = (0..12)
        .map(|_| {
            let c = client.clone();
            let url = up.url("/read");
            tokio::spawn(async move {
                let r = c.put(url).body(vec![b'x'; BODY]).send().await.unwrap();
                (r.status().as_u16(), r.text().await.unwrap())
            })
        })
        .collect();
    let all_queued = eventually(Duration::from_secs(5), || async {
        let m = proxy.metrics().await;
        metric(&m, r#"sluice_queue_depth{family="-",upstream="api"}"#) == Some(12.0)
    })
    .await;
    let m = proxy.metrics().await;
    assert!(all_queued, "{m}");
    assert_eq!(metric(&m, "sluice_replay_buffered_bytes"), Some(0.0), "{m}");
    assert_eq!(hold.await.unwrap(), 200);
    for p in puts {
        assert_eq!(p.await.unwrap(), (200, BODY.to_string()));
    }
    let m = proxy.metrics().await;
    assert_eq!(
        metric(&m, "sluice_replay_buffered_bytes"),
        Some(0.0),
        "all given back: {m}"
    );
}

/// Replay copies have a process-wide budget: beyond it a request streams once and is not
/// retried; within it, a retry resends the whole body.
#[tokio::test]
async fn replay_memory_is_bounded_process_wide() {
    let up = Upstream::start().await;
    let proxy = Proxy::start(&format!(
        "max_replay_memory = \"100KiB\"\n\
         [[upstream]]\nname = \"api\"\nhosts = [\"127.0.0.1:{}\"]\n\
         retry = {{ backoff = {{ base = \"10ms\", max = \"10ms\" }} }}\n",
        up.addr.port()
    ))
    .await;
    let client = proxy.client();
    let big = client
        .put(up.url("/seq/big/503,200"))
        .body(vec![b'x'; 200 * 1024])
        .send()
        .await
        .unwrap();
    assert_eq!(big.status(), 503, "not retried: its copy did not fit");
    assert!(big.headers().get("sluice-attempts").is_none());
    let small = client
        .put(up.url("/seq/small/503,200"))
        .body(vec![b'x'; 50 * 1024])
        .send()
        .await
        .unwrap();
    assert_eq!(small.status(), 200);
    assert_eq!(small.headers()["sluice-attempts"], "2");
}

/// A raw upstream: accepts connections and answers every request head it reads with
/// `response`, as many times as asked on one connection.
async fn raw_upstream(response: &'static [u8]) -> std::net::SocketAddr {
    raw_upstream_counted(response).await.0
}

/// [`raw_upstream`], with the number of request heads it has read.
async fn raw_upstream_counted(response: &'static [u8]) -> (std::net::SocketAddr, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let heads = Arc::new(AtomicUsize::new(0));
    let counted = heads.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                return;
            };
            let heads = counted.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                loop {
                    let Ok(n) = s.read(&mut chunk).await else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                    while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        buf.drain(..end + 4);
                        heads.fetch_add(1, Ordering::SeqCst);
                        if s.write_all(response).await.is_err() {
                            return;
                        }
                    }
                }
            });
        }
    });
    (addr, heads)
}

/// RFC 9112 §6.3: with both Transfer-Encoding and Content-Length, the length is ignored
/// and must not be passed on; the client gets the whole body, and the connection stays
/// usable.
#[tokio::test]
async fn a_content_length_beside_transfer_encoding_is_dropped() {
    let up = raw_upstream(
        b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n\
          5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
    )
    .await;
    let proxy = Proxy::start("").await;
    let mut s = TcpStream::connect(proxy.addr).await.unwrap();
    for _ in 0..2 {
        s.write_all(format!("GET http://{up}/ HTTP/1.1\r\nHost: {up}\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let head = read_head(&mut s).await;
        assert_eq!(head.status, 200, "{}", head.head);
        assert_eq!(head.header("content-length"), None, "{}", head.head);
        assert_eq!(
            head.header("transfer-encoding").as_deref(),
            Some("chunked"),
            "{}",
            head.head
        );
        let mut body = Vec::new();
        while !body.ends_with(b"0\r\n\r\n") {
            let mut chunk = [0u8; 256];
            let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut chunk))
                .await
                .expect("the body in time")
                .unwrap();
            assert!(n > 0, "connection closed");
            body.extend_from_slice(&chunk[..n]);
        }
        let text = String::from_utf8_lossy(&body);
        assert!(text.contains("hello") && text.contains(" world"), "{text}");
    }
}

/// A client that stops reading a large response loses it after send_timeout, and the
/// concurrency permit it held goes to the next client.
#[tokio::test]
async fn a_client_that_stops_reading_gives_its_permit_back() {
    let up = Upstream::start().await;
    let proxy = Proxy::start(&format!(
        "send_timeout = \"500ms\"\n\
         [[upstream]]\nname = \"api\"\nhosts = [\"127.0.0.1:{}\"]\nmax_wait = \"20s\"\n\
         limits = [{{ kind = \"concurrency\", max = 2 }}]\n",
        up.addr.port()
    ))
    .await;
    // Two clients ask for 64 MiB each and read none of it.
    let mut stalled = Vec::new();
    for _ in 0..2 {
        let mut s = TcpStream::connect(proxy.addr).await.unwrap();
        let req = format!("GET {} HTTP/1.1\r\nHost: x\r\n\r\n", up.url("/big/65536"));
        s.write_all(req.as_bytes()).await.unwrap();
        stalled.push(s);
    }
    let both = eventually(Duration::from_secs(5), || async { up.seen().len() == 2 }).await;
    assert!(both);
    let started = tokio::time::Instant::now();
    let client = proxy.client();
    let resp = client.get(up.url("/")).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "admitted once the stalled responses were cut, not after max_wait: {:?}",
        started.elapsed()
    );
    // Both stalled connections are cut (the client's kept connection goes with it), and
    // what they can still read is what the kernel had buffered, then the end. Counting
    // to zero, not "at most the client's one": a stalled connection still open would
    // start streaming the rest of its 64 MiB once read below.
    drop((resp, client));
    let cut = eventually(Duration::from_secs(10), || async {
        let open = metric(&proxy.metrics().await, "sluice_client_connections");
        open.is_some_and(|n| n == 0.0)
    })
    .await;
    assert!(cut, "{}", proxy.metrics().await);
    for mut s in stalled {
        let mut sink = vec![0u8; 1 << 20];
        let closed = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                match s.read(&mut sink).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        })
        .await;
        assert!(closed.is_ok(), "the stalled connection ends");
    }
}

/// Sends CONNECT on a new connection and reads the answer's head.
async fn open_tunnel(
    proxy: std::net::SocketAddr,
    target: std::net::SocketAddr,
) -> (TcpStream, u16) {
    let mut s = TcpStream::connect(proxy).await.unwrap();
    s.write_all(format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let head = read_head(&mut s).await;
    (s, head.status)
}

/// A tunnel that carries bytes stays open; one with nothing either way for
/// tunnel_idle_timeout is closed.
#[tokio::test]
async fn silent_tunnels_are_closed() {
    let echo = echo_server().await;
    let proxy = Proxy::start("tunnel_idle_timeout = \"600ms\"\n").await;
    let (mut busy, status) = open_tunnel(proxy.addr, echo).await;
    assert_eq!(status, 200);
    let (mut silent, status) = open_tunnel(proxy.addr, echo).await;
    assert_eq!(status, 200);
    for _ in 0..8 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        busy.write_all(b"ping").await.unwrap();
        let mut back = [0u8; 4];
        busy.read_exact(&mut back).await.unwrap();
        assert_eq!(&back, b"ping", "a busy tunnel outlives the idle timeout");
    }
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(5), silent.read_to_end(&mut rest)).await;
    assert!(
        matches!(closed, Ok(Ok(0))),
        "the silent tunnel is closed: {closed:?}"
    );
}

/// Beyond max_connections a client gets a 503 it can read; the admin listener answers
/// meanwhile, and a place freed is a place taken.
#[tokio::test]
async fn connections_beyond_the_cap_are_refused_cleanly() {
    let up = Upstream::start().await;
    let echo = echo_server().await;
    let proxy = Proxy::start("max_connections = 4\n").await;
    let mut open = Vec::new();
    for _ in 0..4 {
        let (s, status) = open_tunnel(proxy.addr, echo).await;
        assert_eq!(status, 200);
        open.push(s);
    }
    for _ in 0..3 {
        let r = raw(
            proxy.addr,
            format!("GET {} HTTP/1.1\r\nHost: x\r\n\r\n", up.url("/")).as_bytes(),
        )
        .await;
        assert_eq!(r.status, 503, "{}", r.head);
        assert_eq!(
            r.header("sluice-reason").as_deref(),
            Some("connection_limit")
        );
        assert_eq!(r.header("retry-after").as_deref(), Some("1"));
    }
    let (code, _) = proxy.admin_get("/healthz").await;
    assert_eq!(code, 200);
    let m = proxy.metrics().await;
    assert_eq!(metric(&m, "sluice_client_connections"), Some(4.0), "{m}");
    assert_eq!(
        metric(&m, "sluice_connections_refused_total"),
        Some(3.0),
        "{m}"
    );
    drop(open.pop());
    let freed = eventually(Duration::from_secs(5), || async {
        let r = raw(
            proxy.addr,
            format!(
                "GET {} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                up.url("/")
            )
            .as_bytes(),
        )
        .await;
        r.status == 200
    })
    .await;
    assert!(freed);
}

/// The review's case: the binary under a 512-descriptor limit and hundreds of silent
/// tunnels. The default cap leaves descriptors in reserve, so tunnels beyond it get 503
/// and the admin listener keeps answering.
#[tokio::test]
async fn under_a_small_descriptor_limit_the_admin_listener_still_answers() {
    let echo = echo_server().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sluice.toml");
    std::fs::write(
        &path,
        format!(
            "[proxy]\nlisten = \"127.0.0.1:0\"\nadmin = \"127.0.0.1:0\"\n\
             [[upstream]]\nname = \"echo\"\nhosts = [\"127.0.0.1:{}\"]\n",
            echo.port()
        ),
    )
    .unwrap();
    let mut sluice = Sluice::spawn_with_nofile(512, &["run", "-c", path.to_str().unwrap()]);
    let (port, admin) = sluice.listening().await;
    assert!(sluice.ready(admin).await);
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", sluice.pid())).unwrap();
    assert!(
        limits
            .lines()
            .any(|l| l.starts_with("Max open files") && l.contains(" 512 ")),
        "{limits}"
    );
    let proxy: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let mut tunnels = Vec::new();
    let mut refused = 0;
    for _ in 0..200 {
        let (s, status) = open_tunnel(proxy, echo).await;
        match status {
            200 => tunnels.push(s),
            503 => refused += 1,
            other => panic!("unexpected {other}"),
        }
    }
    // 512 descriptors, 256 in reserve, two per tunnel.
    assert_eq!(tunnels.len(), 128);
    assert_eq!(refused, 72);
    let health = reqwest::get(format!("http://127.0.0.1:{admin}/healthz"))
        .await
        .unwrap();
    assert_eq!(health.status(), 200);
    let m = admin_text(admin, "/metrics").await;
    assert_eq!(metric(&m, "sluice_client_connections"), Some(128.0));
    drop(tunnels);
    sluice.signal("TERM");
    let (code, log) = sluice.exit().await;
    assert_eq!(code, Some(0), "{log:?}");
}

/// The soft open-file limit is raised to the hard one at start.
#[tokio::test]
async fn the_soft_descriptor_limit_is_raised() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sluice.toml");
    std::fs::write(
        &path,
        "[proxy]\nlisten = \"127.0.0.1:0\"\nadmin = \"127.0.0.1:0\"\n",
    )
    .unwrap();
    let mut sh = std::process::Command::new("sh");
    sh.arg("-c")
        .arg("ulimit -Sn 256 && exec \"$0\" \"$@\"")
        .arg(env!("CARGO_BIN_EXE_sluice"));
    let mut sluice = Sluice::spawn_shell(sh, &["run", "-c", path.to_str().unwrap()]);
    let (_, admin) = sluice.listening().await;
    assert!(sluice.ready(admin).await);
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", sluice.pid())).unwrap();
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap()
        .to_string();
    let fields: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(fields[3], fields[4], "soft = hard: {line}");
    assert_ne!(fields[3], "256", "{line}");
    sluice.signal("TERM");
    let (_, log) = sluice.exit().await;
    assert!(
        log.iter().any(|l| l.contains("raised the open-file limit")),
        "{log:?}"
    );
}

/// The first request after a 429 and when it reached the upstream.
async fn after_429(proxy: &Proxy, up: &Upstream) -> Duration {
    let client = proxy.client();
    let first = client
        .get(up.url("/seq/day/429ra86400,200"))
        .send()
        .await
        .unwrap();
    // Longer than max_retry_after: not retried, the 429 goes back to the client.
    assert_eq!(first.status(), 429);
    let t429 = up.seen()[0].at;
    let next = client.get(up.url("/next")).send().await.unwrap();
    assert_eq!(next.status(), 200);
    up.seen()[1].at - t429
}

/// `Retry-After: 86400` pauses the bucket for max_cooldown at most, which follows
/// max_retry_after unless set: a bogus header does not lock a bucket for an hour.
#[tokio::test]
async fn a_bogus_retry_after_pauses_a_bucket_for_max_cooldown_at_most() {
    let up = Upstream::start().await;
    let proxy = Proxy::start(&format!(
        "[[upstream]]\nname = \"api\"\nhosts = [\"127.0.0.1:{}\"]\n\
         retry = {{ max_retry_after = \"1s\" }}\n",
        up.addr.port()
    ))
    .await;
    let waited = after_429(&proxy, &up).await;
    assert!(
        waited >= Duration::from_millis(900) && waited < Duration::from_secs(10),
        "paused for {waited:?}"
    );

    let up = Upstream::start().await;
    let proxy = Proxy::start(&format!(
        "[[upstream]]\nname = \"api\"\nhosts = [\"127.0.0.1:{}\"]\n\
         retry = {{ max_retry_after = \"1s\", max_cooldown = \"2s\" }}\n",
        up.addr.port()
    ))
    .await;
    let waited = after_429(&proxy, &up).await;
    assert!(
        waited >= Duration::from_millis(1900) && waited < Duration::from_secs(10),
        "paused for {waited:?}"
    );
}

/// Spelling does not sidestep a limit: an IP-literal host in any form reaches its
/// upstream, and a path with `//`, dot segments or encoded unreserved characters its
/// family; the request goes upstream exactly as sent.
#[tokio::test]
async fn hosts_and_paths_are_matched_however_they_are_spelled() {
    let up = Upstream::start().await;
    let port = up.addr.port();
    let proxy = Proxy::start(&format!(
        "[[upstream]]\nname = \"api\"\nhosts = [\"127.0.0.1:{port}\"]\n\
         [[upstream.family]]\nname = \"orders\"\npaths = [\"/v1/orders/**\"]\n"
    ))
    .await;
    let hosts = [
        "127.0.0.1",
        "127.1",
        "2130706433",
        "0x7f000001",
        "0177.0.0.1",
        "[::ffff:127.0.0.1]",
        "[::ffff:7f00:1]",
        "0X7F000001",
        "127.0.0.1.",
    ];
    for host in hosts {
        let url = format!("http://{host}:{port}/v1/orders/1");
        let r = raw(
            proxy.addr,
            format!("GET {url} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes(),
        )
        .await;
        assert_eq!(r.status, 200, "{url}: {}", r.head);
    }
    let paths = [
        "//v1/orders/2",
        "/v1//orders/2",
        "/v1/./orders/2",
        "/v1/x/../orders/2",
        "/v1/%6Frders/2",
        "/%76%31/orders/2",
        "/v1%2Forders/2",
        "/v1%2forders%2F2",
    ];
    for path in paths {
        let url = format!("http://127.0.0.1:{port}{path}");
        let r = raw(
            proxy.addr,
            format!("GET {url} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes(),
        )
        .await;
        assert_eq!(r.status, 200, "{url}: {}", r.head);
    }
    let m = proxy.metrics().await;
    assert_eq!(
        metric(
            &m,
            r#"sluice_requests_total{family="orders",outcome="200",upstream="api"}"#
        ),
        Some((hosts.len() + paths.len()) as f64),
        "{m}"
    );
    assert!(!m.contains(r#"upstream="unmatched""#), "{m}");
    let seen: Vec<String> = up.seen().iter().map(|s| s.uri.clone()).collect();
    for path in paths {
        assert!(
            seen.iter().any(|u| u == path),
            "{path} forwarded as sent: {seen:?}"
        );
    }
}

/// Answers that would be the same on every attempt are relayed as one 502, not retried:
/// a 101 to a request that asked for no upgrade (relayed, the client would read the next
/// protocol as HTTP), a response head over hyper's limit, a status line that is not HTTP.
#[tokio::test]
async fn answers_that_break_http_are_502_and_never_retried() {
    let oversized: &'static [u8] = Box::leak(
        format!(
            "HTTP/1.1 200 OK\r\nX-Big: {}\r\nContent-Length: 0\r\n\r\n",
            "a".repeat(600 << 10)
        )
        .into_bytes()
        .into_boxed_slice(),
    );
    let cases: [(&str, &'static [u8]); 3] = [
        (
            "101",
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n",
        ),
        ("oversized head", oversized),
        ("bad status line", b"HTTP/1.1 abc OK\r\nContent-Length: 0\r\n\r\n"),
    ];
    for (what, response) in cases {
        let (addr, heads) = raw_upstream_counted(response).await;
        let proxy = Proxy::start(&format!(
            "[[upstream]]\nname = \"raw\"\nhosts = [\"127.0.0.1:{}\"]\n\
             retry = {{ backoff = {{ base = \"10ms\", max = \"20ms\" }} }}\n",
            addr.port()
        ))
        .await;
        let mut s = TcpStream::connect(proxy.addr).await.unwrap();
        let r = tokio::time::timeout(
            Duration::from_secs(10),
            get(&mut s, &format!("http://{addr}/"), true),
        )
        .await
        .expect("an answer in time");
        assert_eq!(r.status, 502, "{what}: {}", r.head);
        assert_eq!(
            r.header("sluice-reason").as_deref(),
            Some("upstream_unreachable"),
            "{what}"
        );
        assert_eq!(heads.load(Ordering::SeqCst), 1, "{what}: sent once");
        let m = proxy.metrics().await;
        assert_eq!(
            metric(
                &m,
                "sluice_requests_total{family=\"-\",outcome=\"sluice_upstream_unreachable\",upstream=\"raw\"}"
            ),
            Some(1.0),
            "{what}: {m}"
        );
        assert!(!m.contains("sluice_retries_total{"), "{what}: {m}");
    }
}

/// Resolution from a fixed table that counts the lookups.
struct CountedLookup {
    table: StaticLookup,
    lookups: Arc<AtomicUsize>,
}

impl sluice::Lookup for CountedLookup {
    fn lookup(
        &self,
        host: String,
    ) -> std::pin::Pin<
        Box<dyn std::future::Future<Output = std::io::Result<Vec<std::net::IpAddr>>> + Send>,
    > {
        self.lookups.fetch_add(1, Ordering::SeqCst);
        self.table.lookup(host)
    }
}

/// A name that does not resolve is answered 502 at once: not retried (the resolver has
/// retried already), and not held against the upstream, since a client can make up any
/// number of names under a wildcard host.
#[tokio::test]
async fn a_name_that_does_not_resolve_is_not_retried_nor_counted_by_the_breaker() {
    let up = Upstream::start().await;
    let port = up.addr.port();
    let lookups = Arc::new(AtomicUsize::new(0));
    let lookup = CountedLookup {
        table: StaticLookup(
            [("ok.example.test".to_string(), vec![up.addr.ip()])]
                .into_iter()
                .collect(),
        ),
        lookups: lookups.clone(),
    };
    let proxy = Proxy::start_with(
        &format!(
            "[[upstream]]\nname = \"api\"\nhosts = [\"*.example.test:{port}\"]\n\
             retry = {{ backoff = {{ base = \"10ms\", max = \"20ms\" }} }}\n\
             [upstream.breaker]\nmin_requests = 4\nfailure_ratio = 0.5\nwindow = \"1m\"\nopen_for = \"1m\"\n"
        ),
        Some(Arc::new(lookup)),
    )
    .await;
    let client = proxy.client();
    for i in 0..6 {
        let r = client
            .get(format!("http://nope{i}.example.test:{port}/"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 502);
        assert_eq!(r.headers()["sluice-reason"], "upstream_unreachable");
        assert!(r.headers().get("sluice-attempts").is_none());
    }
    assert_eq!(lookups.load(Ordering::SeqCst), 6, "one lookup per request");
    let ok = client
        .get(format!("http://ok.example.test:{port}/"))
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200, "the breaker stayed closed");
    let m = proxy.metrics().await;
    assert!(!m.contains("sluice_retries_total{"), "{m}");
}

/// The config file is read with a cap: `-c /dev/zero` fails at once with a clear message,
/// for `check` and `run` alike.
#[tokio::test]
async fn an_endless_config_file_is_refused_at_once() {
    for command in ["check", "run"] {
        let sluice = Sluice::spawn(&[command, "-c", "/dev/zero"]);
        let (code, log) = tokio::time::timeout(Duration::from_secs(10), sluice.exit())
            .await
            .expect("exits at once");
        assert_ne!(code, Some(0), "{command}");
        assert!(
            log.iter()
                .any(|l| l.contains("/dev/zero") && l.contains("larger than")),
            "{command}: {log:?}"
        );
    }
}

/// The partition a request of tenant `value` is shown as in `/buckets`.
async fn shown_partition(env: Option<&str>, up: &Upstream, value: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let path = binary_config(
        dir.path(),
        &format!(
            "[[upstream]]\nname = \"api\"\nhosts = [\"127.0.0.1:{}\"]\nkey = \"header:X-Tenant\"\n\
             limits = [{{ kind = \"token_bucket\", rate = 100, per = \"1s\", burst = 100 }}]\n",
            up.addr.port()
        ),
    );
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"));
    if let Some(secret) = env {
        command.env("SLUICE_PARTITION_SECRET", secret);
    }
    let mut sluice = Sluice::spawn_shell(command, &["run", "-c", path.to_str().unwrap()]);
    let (port, admin) = sluice.listening().await;
    assert!(sluice.ready(admin).await);
    let client = client_via(port);
    let r = client
        .get(up.url("/"))
        .header("x-tenant", value)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let text = admin_text(admin, "/buckets").await;
    let buckets: serde_json::Value = serde_json::from_str(&text).unwrap();
    let shown = buckets
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["partition"] != "-")
        .unwrap_or_else(|| panic!("{buckets}"))["partition"]
        .as_str()
        .unwrap()
        .to_string();
    let mut explain = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"));
    if let Some(secret) = env {
        explain.env("SLUICE_PARTITION_SECRET", secret);
    }
    let out = explain
        .args(["explain", "-c", path.to_str().unwrap(), "GET"])
        .arg(up.url("/"))
        .args(["-H", &format!("X-Tenant: {value}")])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let matches = text.contains(&shown);
    sluice.signal("TERM");
    sluice.exit().await;
    assert_eq!(
        matches,
        env.is_some(),
        "explain agrees iff keyed alike: {text}"
    );
    shown
}

/// Partition hashes in `/buckets` and `explain` are keyed: not the SHA-256 prefix anyone
/// can compute from a guessed tenant id, different in every process unless
/// SLUICE_PARTITION_SECRET gives replicas and `explain` the same key.
#[tokio::test]
async fn partition_hashes_are_keyed() {
    use sha2::{Digest, Sha256};
    let up = Upstream::start().await;
    let unsalted: String = Sha256::digest(b"42")[..6]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let a = shown_partition(None, &up, "42").await;
    let b = shown_partition(None, &up, "42").await;
    assert_eq!(a.len(), 12);
    assert_ne!(a, unsalted);
    assert_ne!(a, b, "a key per process");
    let c = shown_partition(Some("s3cret"), &up, "42").await;
    let d = shown_partition(Some("s3cret"), &up, "42").await;
    assert_eq!(c, d, "a shared key");
    assert_ne!(c, unsalted);
}

/// An upstream failure is logged once, its causes named once.
#[tokio::test]
async fn an_upstream_failure_logs_its_causes_once() {
    let closed = closed_port().await;
    let dir = tempfile::tempdir().unwrap();
    let path = binary_config(
        dir.path(),
        &format!(
            "[[upstream]]\nname = \"gone\"\nhosts = [\"127.0.0.1:{}\"]\nretry = {{ max_attempts = 1 }}\n",
            closed.port()
        ),
    );
    let mut sluice = Sluice::spawn(&["run", "-c", path.to_str().unwrap()]);
    let (port, admin) = sluice.listening().await;
    assert!(sluice.ready(admin).await);
    let client = client_via(port);
    let r = client
        .get(format!("http://{closed}/"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 502);
    sluice.signal("TERM");
    let (_, log) = sluice.exit().await;
    let line = log
        .iter()
        .find(|l| l.contains("upstream request failed"))
        .unwrap_or_else(|| panic!("{log:?}"));
    assert_eq!(line.matches("refused").count(), 1, "{line}");
}

/// The control endpoints as a browser on the operator's machine would reach them (a
/// `kubectl port-forward` open): a page whose name resolves to the listener (DNS
/// rebinding) sends its own name as Host, a page of another site sends its Origin, and a
/// form posts with a simple content type. Each is refused; the same requests from curl
/// (an IP or `localhost` as Host, no Origin, no body) and the probes are not.
#[tokio::test]
async fn control_endpoints_refuse_what_a_browser_page_sends() {
    let dir = tempfile::tempdir().unwrap();
    let proxy = Proxy::from_file(&binary_config(dir.path(), "")).await;
    let admin = proxy.admin;
    let port = admin.port();
    // The status of `method path` sent with `headers`, as each expectation names it.
    let expect = |method: &'static str, path: &'static str, headers: String, status: u16| async move {
        let req = format!(
            "{method} {path} HTTP/1.1\r\n{headers}Content-Length: 0\r\nConnection: close\r\n\r\n"
        );
        let got = raw(admin, req.as_bytes()).await.status;
        assert_eq!(got, status, "{method} {path} with {headers:?}");
    };
    let here = format!("Host: 127.0.0.1:{port}\r\n");
    for path in ["/config", "/buckets"] {
        for host in [
            "attacker.example",
            "attacker.example:9901",
            "127.0.0.1.nip.io",
        ] {
            expect("GET", path, format!("Host: {host}\r\n"), 403).await;
        }
        for host in [
            "127.0.0.1".to_string(),
            format!("127.0.0.1:{port}"),
            format!("localhost:{port}"),
            format!("[::1]:{port}"),
        ] {
            expect("GET", path, format!("Host: {host}\r\n"), 200).await;
        }
        let foreign = format!("{here}Origin: http://attacker.example\r\n");
        expect("GET", path, foreign, 403).await;
        let own = format!("{here}Origin: http://127.0.0.1:{port}\r\n");
        expect("GET", path, own, 200).await;
    }
    for ct in [
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
    ] {
        let form = format!("{here}Content-Type: {ct}\r\n");
        expect("POST", "/reload", form, 415).await;
    }
    let rebound = "Host: attacker.example\r\n".to_string();
    expect("POST", "/reload", rebound, 403).await;
    expect("POST", "/reload", here.clone(), 200).await;
    // Probes and metrics answer whatever the Host: kubelet and Prometheus use the pod IP,
    // or a Service name.
    for path in ["/livez", "/readyz", "/metrics"] {
        expect("GET", path, "Host: sluice.shop.svc\r\n".to_string(), 200).await;
    }
}

/// A chunked request whose trailer section carries framing, routing and credential
/// fields, through the plain-HTTP path to an upstream that records the bytes it gets:
/// the body arrives, no trailer field does (the TLS path sends none either).
#[tokio::test]
async fn request_trailers_are_not_forwarded() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (tx, rx) = tokio::sync::oneshot::channel::<String>();
    tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        // Until the chunked body's end: the last chunk and the empty line after whatever
        // trailer fields came.
        loop {
            let n = s.read(&mut buf).await.unwrap();
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
            let text = String::from_utf8_lossy(&got);
            if let Some(i) = text.find("\r\n0\r\n")
                && text[i + 3..].contains("\r\n\r\n")
            {
                break;
            }
        }
        s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
            .await
            .unwrap();
        let _ = tx.send(String::from_utf8_lossy(&got).into_owned());
    });
    let proxy = Proxy::start("").await;
    let req = format!(
        "POST http://127.0.0.1:{port}/t HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\
         Transfer-Encoding: chunked\r\nTrailer: X-Sum\r\nConnection: close\r\n\r\n\
         3\r\nabc\r\n0\r\nX-Sum: 1\r\nHost: evil.example\r\nContent-Length: 5\r\n\
         Transfer-Encoding: gzip\r\nAuthorization: Bearer stolen\r\n\r\n"
    );
    let resp = raw(proxy.addr, req.as_bytes()).await;
    assert_eq!(resp.status, 200);
    let seen = tokio::time::timeout(Duration::from_secs(5), rx)
        .await
        .unwrap()
        .unwrap();
    assert!(
        seen.contains("\r\n3\r\nabc\r\n0\r\n\r\n"),
        "the body, ended: {seen}"
    );
    for field in [
        "X-Sum",
        "evil.example",
        "Content-Length: 5",
        "gzip",
        "stolen",
    ] {
        assert!(
            !seen.contains(field),
            "{field} reached the upstream: {seen}"
        );
    }
}

/// One address holding 1,000 idle connections to the admin listener (127.0.0.2, loopback
/// like every address here) takes only its own few places: `/livez` from another address
/// answers at once, and the idle ones are closed when their head does not come.
#[tokio::test]
async fn idle_admin_connections_from_one_peer_lock_nobody_out() {
    // A thousand sockets here: the soft open-file limit may be 1024.
    let _ = sluice::raise_nofile();
    let proxy = Proxy::start("").await;
    let mut held = Vec::new();
    for _ in 0..1000 {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.2:0".parse().unwrap()).unwrap();
        if let Ok(s) = socket.connect(proxy.admin).await {
            held.push(s);
        }
    }
    // Accepted or not, give the listener time to take them all in.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let t = tokio::time::Instant::now();
    let r = raw(
        proxy.admin,
        b"GET /livez HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(r.status, 200);
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    // Those kept are closed for their silence (the head timeout), the rest at once.
    let mut b = [0u8; 16];
    for s in held.iter_mut() {
        let read = tokio::time::timeout(Duration::from_secs(10), s.read(&mut b)).await;
        assert!(
            matches!(read, Ok(Ok(0) | Err(_))),
            "an idle admin connection still open after 10 s"
        );
    }
}

/// A client that sends a new `Authorization` value with every request makes a partition
/// per request. Past `max_partitions`, a new value is answered 503 `partition_limit` at
/// once; keys that have a partition and requests without the header go on.
#[tokio::test]
async fn new_keys_beyond_max_partitions_are_refused_and_the_rest_is_served() {
    let up = Upstream::start().await;
    let proxy = Proxy::start(&format!(
        "[[upstream]]\nname = \"api\"\nhosts = [\"127.0.0.1:{}\"]\n\
         key = \"header:Authorization\"\nmax_partitions = 50\n\
         limits = [{{ kind = \"fixed_window\", permits = 300, window = \"1m\" }}]\n",
        up.addr.port()
    ))
    .await;
    let client = proxy.client();
    let (mut served, mut refused) = (0, 0);
    for i in 0..80 {
        let r = client
            .get(up.url("/"))
            .header("authorization", format!("Bearer key-{i}"))
            .send()
            .await
            .unwrap();
        match r.status().as_u16() {
            200 => served += 1,
            503 => {
                assert_eq!(r.headers()["sluice-reason"], "partition_limit");
                assert_eq!(r.headers()["retry-after"], "5");
                refused += 1;
            }
            s => panic!("request {i}: {s}"),
        }
    }
    assert_eq!((served, refused), (50, 30));
    assert_eq!(
        up.seen().len(),
        50,
        "the refused never reached the upstream"
    );
    let again = client
        .get(up.url("/"))
        .header("authorization", "Bearer key-0")
        .send()
        .await
        .unwrap();
    assert_eq!(again.status(), 200, "a key with a partition");
    let bare = client.get(up.url("/")).send().await.unwrap();
    assert_eq!(bare.status(), 200, "no key: the upstream's own partition");
    let m = proxy.metrics().await;
    let series = |s: &str| metric(&m, s).unwrap_or_else(|| panic!("{s} in\n{m}"));
    assert_eq!(
        series(r#"sluice_rejections_total{family="-",reason="partition_limit",upstream="api"}"#),
        30.0
    );
    assert_eq!(
        series(r#"sluice_upstream_partitions{upstream="api"}"#),
        51.0
    );
    assert_eq!(
        series(r#"sluice_upstream_max_partitions{upstream="api"}"#),
        50.0
    );
    assert_eq!(
        series(
            r#"sluice_requests_total{family="-",outcome="sluice_partition_limit",upstream="api"}"#
        ),
        30.0
    );
}

/// An HTTP/2 connection to sluice in plain text: h2c with prior knowledge through a
/// CONNECT tunnel to `up`, served by the same HTTP/2 server as intercepted HTTPS.
async fn h2c_through(
    proxy: std::net::SocketAddr,
    up: std::net::SocketAddr,
    builder: &h2::client::Builder,
) -> (
    h2::client::SendRequest<bytes::Bytes>,
    h2::client::Connection<TcpStream, bytes::Bytes>,
) {
    let tunnel = connect_tunnel(proxy, up).await;
    builder.handshake(tunnel).await.unwrap()
}

fn h2_get(up: std::net::SocketAddr, path: &str) -> http::Request<()> {
    http::Request::get(format!("http://{up}{path}"))
        .body(())
        .unwrap()
}

/// An HTTP/2 client that opens large responses and never opens its window, while it
/// sends PINGs to look alive, has each stream reset after `send_timeout`: the permits go
/// back and other clients are served. Before the fix all 4 concurrency permits were
/// still held after 46 s and every other client got 429.
#[tokio::test]
async fn an_http2_client_with_a_shut_window_gives_its_permits_back() {
    let up = Upstream::start_h2c().await;
    let proxy = Proxy::start(&format!(
        "send_timeout = \"1s\"\n\
         [[upstream]]\nname = \"api\"\nhosts = [\"127.0.0.1:{}\"]\nmax_wait = \"10s\"\n\
         limits = [{{ kind = \"concurrency\", max = 4 }}]\n",
        up.addr.port()
    ))
    .await;
    let (mut client, conn) = h2c_through(
        proxy.addr,
        up.addr,
        h2::client::Builder::new().initial_window_size(0),
    )
    .await;
    let mut conn = conn;
    let mut pings = conn.ping_pong().unwrap();
    tokio::spawn(conn);
    // PINGs all along: liveliness is not progress.
    tokio::spawn(async move {
        loop {
            if pings.ping(h2::Ping::opaque()).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
    let mut streams = Vec::new();
    for i in 0..4 {
        client = client.ready().await.unwrap();
        let (resp, _) = client
            .send_request(h2_get(up.addr, &format!("/big/512?{i}")), true)
            .unwrap();
        streams.push(resp);
    }
    let mut bodies = Vec::new();
    for resp in streams {
        let resp = tokio::time::timeout(Duration::from_secs(10), resp)
            .await
            .expect("heads come without window")
            .unwrap();
        assert_eq!(resp.status(), 200);
        bodies.push(resp.into_body());
    }
    let started = tokio::time::Instant::now();
    let other = proxy.client().get(up.url("/other")).send().await.unwrap();
    assert_eq!(other.status(), 200, "a permit came back");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    // The stalled streams were reset.
    for mut body in bodies {
        let end = tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                match body.data().await {
                    Some(Ok(_)) => continue,
                    Some(Err(e)) => return Some(e),
                    None => return None,
                }
            }
        })
        .await
        .expect("the stream ends");
        assert!(
            end.as_ref()
                .and_then(|e| e.reason())
                .is_some_and(|r| r == h2::Reason::CANCEL),
            "{end:?}"
        );
    }
}

/// An HTTP/2 connection with no stream, kept up by PINGs alone, is closed after
/// `tunnel_idle_timeout`: PINGs do not hold its connection slot.
#[tokio::test]
async fn an_http2_connection_without_streams_is_closed_whatever_it_pings() {
    let (up, _proxy, mut client, _, ended) = pinged_h2c_idle_2s().await;
    // One request first: a connection that has been used is as idle as a new one.
    let (resp, _) = client.send_request(h2_get(up.addr, "/a"), true).unwrap();
    assert_eq!(resp.await.unwrap().status(), 200);
    let took = tokio::time::timeout(Duration::from_secs(10), ended)
        .await
        .expect("closed within 10 s")
        .unwrap();
    assert!(took < Duration::from_secs(5), "{took:?}");
    drop(client);
}

/// An HTTP/2 connection's idle time runs from its last stream's end: a stream that ends
/// shortly before the connection would have been closed buys it a whole
/// `tunnel_idle_timeout` more, and so does one still open when it would have been.
#[tokio::test]
async fn an_http2_connections_idle_time_runs_from_its_last_stream() {
    let (up, _proxy, mut client, start, ended) = pinged_h2c_idle_2s().await;
    let idle = Duration::from_secs(2);
    // Ends at 1.5 s, before the 2 s the connection alone would have had; then one from
    // 3 s to 4.5 s, open across the 3.5 s the first stream's end leaves it.
    for (at, path) in [(1500, "/a"), (3000, "/slow/1500")] {
        tokio::time::sleep_until(start + Duration::from_millis(at)).await;
        let (resp, _) = client.send_request(h2_get(up.addr, path), true).unwrap();
        assert_eq!(resp.await.unwrap().status(), 200, "{path}");
    }
    let last = start.elapsed();
    let took = tokio::time::timeout(Duration::from_secs(10), ended)
        .await
        .expect("closed within 10 s")
        .unwrap();
    // The proxy dates the stream's end before the client sees its answer, by however
    // long a loaded machine takes to deliver it. An early close would come 3 s early.
    assert!(
        took + Duration::from_millis(500) >= last + idle,
        "closed {took:?} after opening, the last stream ended at {last:?}"
    );
    assert!(took < last + idle + Duration::from_secs(3), "{took:?}");
    drop(client);
}

/// An h2c connection through a proxy whose `tunnel_idle_timeout` is 2 s, sending PINGs
/// every 300 ms from the start, so that the tunnel's bytes never idle and only streams
/// count. Returns the upstream and the proxy (to keep), the client's handle, when the
/// connection opened, and how long after that it ended.
async fn pinged_h2c_idle_2s() -> (
    Upstream,
    Proxy,
    h2::client::SendRequest<bytes::Bytes>,
    tokio::time::Instant,
    tokio::task::JoinHandle<Duration>,
) {
    let up = Upstream::start_h2c().await;
    let proxy = Proxy::start(&format!(
        "tunnel_idle_timeout = \"2s\"\n\
         [[upstream]]\nname = \"api\"\nhosts = [\"127.0.0.1:{}\"]\n",
        up.addr.port()
    ))
    .await;
    let (client, mut conn) = h2c_through(proxy.addr, up.addr, &h2::client::Builder::new()).await;
    let start = tokio::time::Instant::now();
    let mut pings = conn.ping_pong().unwrap();
    let ended = tokio::spawn(async move {
        let _ = conn.await;
        start.elapsed()
    });
    tokio::spawn(async move {
        while pings.ping(h2::Ping::opaque()).await.is_ok() {
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    });
    (up, proxy, client, start, ended)
}

/// A client that never reads (so never answers the GOAWAY's PING) holds no shutdown: an
/// idle HTTP/2 connection ends a second into the drain, as an idle HTTP/1.1 one ends at
/// once. Before, it held the drain for its whole `drain_timeout`.
#[tokio::test]
async fn an_http2_client_that_never_reads_does_not_hold_the_drain() {
    let up = Upstream::start_h2c().await;
    let dir = tempfile::tempdir().unwrap();
    let path = binary_config(
        dir.path(),
        &format!(
            "[[upstream]]\nname = \"api\"\nhosts = [\"127.0.0.1:{}\"]\n",
            up.addr.port()
        ),
    );
    let config = std::fs::read_to_string(&path)
        .unwrap()
        .replace("[proxy]\n", "[proxy]\ndrain_timeout = \"20s\"\n");
    std::fs::write(&path, config).unwrap();
    let mut sluice = Sluice::spawn(&["run", "-c", path.to_str().unwrap()]);
    let (port, admin) = sluice.listening().await;
    assert!(sluice.ready(admin).await);
    let mut s = connect_tunnel(([127, 0, 0, 1], port).into(), up.addr).await;
    // The preface and an empty SETTINGS frame, then nothing is ever read.
    s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let started = tokio::time::Instant::now();
    sluice.signal("TERM");
    let (code, _) = sluice.exit().await;
    assert_eq!(code, Some(0));
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "{:?}",
        started.elapsed()
    );
    drop(s);
}

/// A drain lets an HTTP/2 stream already in flight finish: its response arrives whole
/// after the GOAWAY, then the connection ends and the drain with it, long before the
/// drain's deadline (30 s) would cut it.
#[tokio::test]
async fn an_http2_stream_in_flight_finishes_during_the_drain() {
    let up = Upstream::start_h2c().await;
    let mut proxy = Proxy::start(&format!(
        "drain_timeout = \"30s\"\n[[upstream]]\nname = \"api\"\nhosts = [\"127.0.0.1:{}\"]\n",
        up.addr.port()
    ))
    .await;
    let (client, conn) = h2c_through(proxy.addr, up.addr, &h2::client::Builder::new()).await;
    let driver = tokio::spawn(conn);
    let mut client = client.ready().await.unwrap();
    let (resp, _) = client
        .send_request(h2_get(up.addr, "/slow/700"), true)
        .unwrap();
    tokio::time::timeout(Duration::from_secs(10), async {
        while up.seen().is_empty() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the request reached the upstream");
    proxy.shutdown();
    let resp = tokio::time::timeout(Duration::from_secs(5), resp)
        .await
        .expect("the response came")
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let mut got = Vec::new();
    while let Some(chunk) = body.data().await {
        let chunk = chunk.unwrap();
        let _ = body.flow_control().release_capacity(chunk.len());
        got.extend_from_slice(&chunk);
    }
    assert_eq!(got, b"slow");
    tokio::time::timeout(Duration::from_secs(10), proxy.task.take().unwrap())
        .await
        .expect("the drain ends once the stream has, not at its deadline")
        .unwrap();
    let _ = tokio::time::timeout(Duration::from_secs(5), driver).await;
}

/// Probes keep answering whatever idle connections are held: 8 from 127.0.0.1 itself
/// (what exec probes and port-forward use) and 16 more from other loopback addresses
/// fill every loopback place, yet each of 30 probes from 127.0.0.1 answers, since a
/// newcomer takes the place of the connection idle the longest. Before, the 8 idle ones
/// from 127.0.0.1 locked out every probe from 127.0.0.1.
#[tokio::test]
async fn probes_answer_whatever_idle_admin_connections_are_held() {
    let proxy = Proxy::start("").await;
    let mut held = Vec::new();
    for i in 0..24 {
        let from = if i < 8 {
            "127.0.0.1:0".to_string()
        } else {
            format!("127.0.0.{}:0", 2 + (i - 8) / 8)
        };
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind(from.parse().unwrap()).unwrap();
        held.push(socket.connect(proxy.admin).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    for _ in 0..30 {
        let r = tokio::time::timeout(
            Duration::from_secs(2),
            raw(
                proxy.admin,
                b"GET /readyz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
            ),
        )
        .await
        .expect("the probe is answered");
        assert_eq!(r.status, 200);
    }
    drop(held);
}

/// A client that leaves while its request is out (an HTTP/1.1 connection dropped 50 ms
/// in, an HTTP/2 stream reset) does not free its concurrency slot while the provider
/// still works on the request: the slot comes back when the attempt would have timed
/// out. Before the fix it came back at once, and the next request reached the upstream
/// while the first was still running there (240 in flight against `max = 4`).
#[tokio::test]
async fn a_client_that_leaves_does_not_free_the_providers_slot_early() {
    let up = Upstream::start_h2c().await;
    let proxy = Proxy::start(&format!(
        "[[upstream]]\nname = \"api\"\nhosts = [\"127.0.0.1:{}\"]\n\
         attempt_timeout = \"1500ms\"\nmax_wait = \"10s\"\n\
         limits = [{{ kind = \"concurrency\", max = 1 }}]\n",
        up.addr.port()
    ))
    .await;
    let arrival = |path: &str| {
        up.seen()
            .into_iter()
            .find(|s| s.uri.ends_with(path))
            .map(|s| s.at)
    };
    // HTTP/1.1: the connection dropped 50 ms after the request went.
    let mut s = TcpStream::connect(proxy.addr).await.unwrap();
    s.write_all(
        format!(
            "GET {} HTTP/1.1\r\nHost: {}\r\n\r\n",
            up.url("/slow/3000?h1"),
            up.addr
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    drop(s);
    let next = proxy
        .client()
        .get(up.url("/after-h1"))
        .send()
        .await
        .unwrap();
    assert_eq!(next.status(), 200);
    let gap = arrival("/after-h1").unwrap() - arrival("/slow/3000?h1").unwrap();
    assert!(gap >= Duration::from_millis(1300), "{gap:?}");

    // HTTP/2: the stream reset 50 ms after the request went.
    let (client, conn) = h2c_through(proxy.addr, up.addr, &h2::client::Builder::new()).await;
    tokio::spawn(conn);
    let mut client = client.ready().await.unwrap();
    let (resp, mut stream) = client
        .send_request(h2_get(up.addr, "/slow/3000?h2"), true)
        .unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    stream.send_reset(h2::Reason::CANCEL);
    drop(resp);
    let next = proxy
        .client()
        .get(up.url("/after-h2"))
        .send()
        .await
        .unwrap();
    assert_eq!(next.status(), 200);
    let gap = arrival("/after-h2").unwrap() - arrival("/slow/3000?h2").unwrap();
    assert!(gap >= Duration::from_millis(1300), "{gap:?}");
}

/// One intercepted HTTP/2 connection whose streams each need an upstream connection (an
/// HTTP/1.1 upstream) cannot take more descriptors than `max_connections` allows
/// upstream connections: the streams beyond get 503 `connection_limit`, sluice's own
/// failure, which the breaker never hears of. Before, one h2 connection opened 200
/// upstream connections, six of them took every descriptor, and the EMFILE failures
/// opened the upstream's breaker for every client.
#[tokio::test]
async fn http2_streams_take_upstream_connections_within_the_cap_and_never_trip_the_breaker() {
    crypto();
    let dir = tempfile::tempdir().unwrap();
    let certs = certs::for_localhost(dir.path(), &[b"http/1.1"]);
    let up = Upstream::start_tls(certs.server.clone()).await;
    let (ca_cert, ca_key) = sluice::write_new_ca(&dir.path().join("ca")).unwrap();
    let proxy = Proxy::start(&format!(
        "max_connections = 4\n\
         [tls]\nca_cert = {ca_cert:?}\nca_key = {ca_key:?}\n\
         [[upstream]]\nname = \"api\"\nhosts = [\"localhost:{}\"]\ntls = \"intercept\"\n\
         upstream_ca = {:?}\n\
         [upstream.breaker]\nmin_requests = 4\nfailure_ratio = 0.5\nwindow = \"1m\"\n",
        up.addr.port(),
        certs.ca_path
    ))
    .await;
    let target = format!("localhost:{}", up.addr.port());
    let tunnel = connect_tunnel(proxy.addr, &target).await;
    let tls = certs::connector(std::path::Path::new(&ca_cert), &[b"h2"])
        .connect(
            rustls_pki_types::ServerName::try_from("localhost").unwrap(),
            tunnel,
        )
        .await
        .unwrap();
    let (client, conn) = h2::client::handshake(tls).await.unwrap();
    tokio::spawn(conn);
    let mut streams = Vec::new();
    for i in 0..20 {
        let mut c = client.clone().ready().await.unwrap();
        let req = http::Request::get(format!("https://{target}/slow/800?{i}"))
            .body(())
            .unwrap();
        streams.push(c.send_request(req, true).unwrap().0);
    }
    let mut statuses = Vec::new();
    for s in streams {
        let resp = tokio::time::timeout(Duration::from_secs(10), s)
            .await
            .expect("answered")
            .unwrap();
        statuses.push(resp.status().as_u16());
        if resp.status() == 503 {
            assert_eq!(resp.headers()["sluice-reason"], "connection_limit");
        }
    }
    assert!(statuses.contains(&200), "{statuses:?}");
    assert!(statuses.contains(&503), "{statuses:?}");
    assert!(
        up.connections.load(Ordering::SeqCst) <= 4,
        "{} upstream connections",
        up.connections.load(Ordering::SeqCst)
    );
    let m = proxy.metrics().await;
    assert!(
        metric(&m, "sluice_local_failures_total").unwrap_or(0.0) >= 4.0,
        "{m}"
    );
    assert_eq!(
        metric(&m, r#"sluice_breaker_state{state="closed",upstream="api"}"#),
        Some(1.0),
        "sluice's own failures are not the upstream's: {m}"
    );
    // And the upstream is served once connections are free.
    let mut c = client.ready().await.unwrap();
    let req = http::Request::get(format!("https://{target}/after"))
        .body(())
        .unwrap();
    let resp = c.send_request(req, true).unwrap().0.await.unwrap();
    assert_eq!(resp.status(), 200);
}

/// The kernel's own refusal, not sluice's cap: under a 64-descriptor limit with a cap set
/// far above it, upstream connects fail with EMFILE. Those are sluice's failures: 503
/// `connection_limit`, counted as such, and the upstream's breaker (open after 4 failures
/// here) stays closed, so once descriptors are free the upstream is served. Before, the
/// EMFILE failures opened the breaker for every client.
#[tokio::test]
async fn emfile_is_sluices_failure_not_the_upstreams() {
    crypto();
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sluice.toml");
    std::fs::write(
        &path,
        format!(
            "[proxy]\nlisten = \"127.0.0.1:0\"\nadmin = \"127.0.0.1:0\"\nmax_connections = 1000\n\
             [egress]\nallow = [\"127.0.0.0/8\"]\n\
             [[upstream]]\nname = \"api\"\nhosts = [\"127.0.0.1:{}\"]\n\
             retry = {{ max_attempts = 1 }}\n\
             [upstream.breaker]\nmin_requests = 4\nfailure_ratio = 0.5\nwindow = \"1m\"\nopen_for = \"1m\"\n",
            up.addr.port()
        ),
    )
    .unwrap();
    let mut sluice = Sluice::spawn_with_nofile(64, &["run", "-c", path.to_str().unwrap()]);
    let (port, admin) = sluice.listening().await;
    assert!(sluice.ready(admin).await);
    let proxy: std::net::SocketAddr = ([127, 0, 0, 1], port).into();
    let mut waiting = Vec::new();
    for i in 0..60 {
        let Ok(mut s) = TcpStream::connect(proxy).await else {
            continue;
        };
        let req = format!(
            "GET {} HTTP/1.1\r\nHost: {}\r\n\r\n",
            up.url(&format!("/slow/1500?{i}")),
            up.addr
        );
        if s.write_all(req.as_bytes()).await.is_ok() {
            waiting.push(s);
        }
    }
    let mut statuses = Vec::new();
    for mut s in waiting {
        let mut head = Vec::new();
        let mut b = [0u8; 1];
        let read = tokio::time::timeout(Duration::from_secs(15), async {
            while !head.ends_with(b"\r\n\r\n") {
                match s.read(&mut b).await {
                    Ok(1) => head.push(b[0]),
                    _ => break,
                }
            }
        })
        .await;
        if read.is_ok() && head.len() > 12 {
            let text = String::from_utf8_lossy(&head).to_string();
            let status: u16 = text[9..12].parse().unwrap();
            if status != 200 {
                assert_eq!(status, 503, "{text}");
                assert!(text.contains("sluice-reason: connection_limit"), "{text}");
            }
            statuses.push(status);
        }
    }
    assert!(
        statuses.contains(&503),
        "some connects met EMFILE: {statuses:?}"
    );
    let m = admin_text(admin, "/metrics").await;
    assert!(
        metric(&m, "sluice_local_failures_total").unwrap_or(0.0) >= 4.0,
        "{m}"
    );
    assert_eq!(
        metric(&m, r#"sluice_breaker_state{state="closed",upstream="api"}"#),
        Some(1.0),
        "{m}"
    );
    let after = client_via(port).get(up.url("/after")).send().await.unwrap();
    assert_eq!(after.status(), 200);
    sluice.signal("TERM");
    let _ = sluice.exit().await;
}
