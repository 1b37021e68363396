//! Upstream connections: reused by the client connection that opened them, handed to the
//! next client when it leaves, never reused once the upstream closed them; and the
//! thread-per-core workers the binary serves clients on.

use sluice_test_support as support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use sluice::Workers;
use support::certs::tls_upstream;
use support::{Proxy, Upstream, eventually, get, read_response};

#[tokio::test]
async fn clients_that_leave_hand_their_upstream_connection_to_the_next() {
    let up = Upstream::start().await;
    let proxy = Proxy::start("").await;
    for i in 0..4 {
        let mut s = TcpStream::connect(proxy.addr).await.unwrap();
        let resp = get(&mut s, &up.url(&format!("/c{i}")), true).await;
        assert_eq!((resp.status, resp.body.as_slice()), (200, &b"hello"[..]));
        // The proxy closes after a `Connection: close` exchange and parks the upstream
        // connection just after.
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest).await;
        let app = proxy.app.clone();
        assert!(
            eventually(Duration::from_secs(5), || {
                let app = app.clone();
                async move { app.idle_upstream_connections() == 1 }
            })
            .await,
            "client {i}: its upstream connection was parked"
        );
    }
    assert_eq!(up.seen().len(), 4);
    assert_eq!(
        up.connections.load(Ordering::SeqCst),
        1,
        "four clients, one after another, shared one upstream connection"
    );
}

#[tokio::test]
async fn concurrent_clients_get_their_own_upstream_connections() {
    let up = Upstream::start().await;
    let proxy = Proxy::start("").await;
    let mut clients = Vec::new();
    for _ in 0..3 {
        clients.push(TcpStream::connect(proxy.addr).await.unwrap());
    }
    // Each client's request is still waiting upstream when the next one is sent.
    for s in clients.iter_mut() {
        let req = format!("GET {} HTTP/1.1\r\nHost: x\r\n\r\n", up.url("/slow/300"));
        s.write_all(req.as_bytes()).await.unwrap();
    }
    for s in clients.iter_mut() {
        assert_eq!(read_response(s).await.status, 200);
    }
    assert_eq!(up.connections.load(Ordering::SeqCst), 3);
    // Then each keeps reusing its own.
    for s in clients.iter_mut() {
        assert_eq!(get(s, &up.url("/again"), false).await.status, 200);
    }
    assert_eq!(up.connections.load(Ordering::SeqCst), 3);
}

/// An HTTP/1.1 server that answers one request per connection and then closes it,
/// without saying so in the response, as servers with a short keep-alive timeout do.
async fn one_shot_upstream() -> (std::net::SocketAddr, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let conns = Arc::new(AtomicUsize::new(0));
    let counted = conns.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            counted.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let _ = s
                    .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                    .await;
            });
        }
    });
    (addr, conns)
}

#[tokio::test]
async fn a_connection_the_upstream_closed_is_not_used_again() {
    let (addr, conns) = one_shot_upstream().await;
    let proxy = Proxy::start("").await;
    let mut s = TcpStream::connect(proxy.addr).await.unwrap();
    for i in 0..3 {
        let resp = get(&mut s, &format!("http://{addr}/n{i}"), false).await;
        assert_eq!(
            (resp.status, resp.body.as_slice()),
            (200, &b"ok"[..]),
            "request {i}"
        );
        // Idle long enough for the close to arrive, as between real calls.
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(conns.load(Ordering::SeqCst), 3);

    // A client that leaves after the upstream closed on it parks nothing.
    drop(s);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(proxy.app.idle_upstream_connections(), 0);
}

#[tokio::test]
async fn workers_serve_many_clients_and_drain_on_shutdown() {
    let up = Upstream::start().await;
    let workers = Workers::start(2, None, None).unwrap().0;
    let mut proxy = Proxy::on_workers(
        r#"
[[upstream]]
name = "slow"
hosts = ["127.0.0.1"]
limits = [{ kind = "token_bucket", rate = 40, per = "1s", burst = 1 }]
"#,
        &workers,
    )
    .await;
    // 8 clients, each with its own connection, 5 requests each through one bucket: the
    // bucket is shared by both workers, so 40 requests take about a second.
    let start = tokio::time::Instant::now();
    let mut tasks = Vec::new();
    for c in 0..8 {
        let addr = proxy.addr;
        let url = up.url(&format!("/w{c}"));
        tasks.push(tokio::spawn(async move {
            let mut s = TcpStream::connect(addr).await.unwrap();
            for _ in 0..5 {
                assert_eq!(get(&mut s, &url, false).await.status, 200);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let took = start.elapsed();
    assert_eq!(up.seen().len(), 40);
    assert!(
        took >= Duration::from_millis(900),
        "40 requests at 40/s with a burst of 1 cannot finish in {took:?}"
    );

    // A request in flight when the shutdown starts still gets its answer.
    let mut s = TcpStream::connect(proxy.addr).await.unwrap();
    let req = format!("GET {} HTTP/1.1\r\nHost: x\r\n\r\n", up.url("/slow/400"));
    s.write_all(req.as_bytes()).await.unwrap();
    let arrived = || {
        let seen = up.seen.clone();
        async move { seen.lock().len() == 41 }
    };
    assert!(eventually(Duration::from_secs(5), arrived).await);
    proxy.shutdown();
    assert_eq!(read_response(&mut s).await.status, 200);
    proxy.task.take().unwrap().await.unwrap();
    assert!(
        TcpStream::connect(proxy.addr).await.is_err(),
        "the listener is closed after the drain"
    );
    drop(workers);
}

/// TLS upstreams are pooled per worker: a client on another worker opens a connection of
/// its own rather than take one whose task runs on the first worker's event loop, and
/// each worker's later requests reuse its own.
#[tokio::test]
async fn pooled_tls_connections_are_kept_per_worker() {
    let dir = tempfile::tempdir().unwrap();
    let up = tls_upstream(dir.path()).await;
    let workers = Workers::start(2, None, None).unwrap().0;
    let proxy = Proxy::on_workers(
        &format!(
            "[[upstream]]\nname = \"secure\"\nhosts = [\"127.0.0.1\"]\nscheme = \"https\"\nupstream_ca = {:?}\n",
            up.ca_path
        ),
        &workers,
    )
    .await;
    let url = |path: &str| format!("http://{}{path}", up.addr);
    // The first connection goes to worker 0, the second, while the first is open, to
    // worker 1 (the worker with the fewest).
    let mut first = TcpStream::connect(proxy.addr).await.unwrap();
    assert_eq!(get(&mut first, &url("/a"), false).await.status, 200);
    let mut second = TcpStream::connect(proxy.addr).await.unwrap();
    assert_eq!(get(&mut second, &url("/b"), false).await.status, 200);
    assert_eq!(
        up.connections.load(Ordering::SeqCst),
        2,
        "the second worker opened a connection of its own"
    );
    for _ in 0..3 {
        assert_eq!(get(&mut first, &url("/c"), false).await.status, 200);
        assert_eq!(get(&mut second, &url("/d"), false).await.status, 200);
    }
    assert_eq!(
        up.connections.load(Ordering::SeqCst),
        2,
        "each worker reused its own"
    );
    assert_eq!(up.seen.lock().len(), 8);
    drop((first, second));
    drop(proxy);
    drop(workers);
}

#[tokio::test]
async fn parked_connections_stay_with_the_worker_that_opened_them() {
    let up = Upstream::start().await;
    let elsewhere = Upstream::start().await;
    let workers = Workers::start(2, None, None).unwrap().0;
    let proxy = Proxy::on_workers("", &workers).await;
    // Connections go to the worker with the fewest: the first to worker 0, the second,
    // while the first is open, to worker 1. The second's answer from another upstream
    // shows it was taken while the first was open.
    let mut first = TcpStream::connect(proxy.addr).await.unwrap();
    assert_eq!(get(&mut first, &up.url("/a"), false).await.status, 200);
    let mut second = TcpStream::connect(proxy.addr).await.unwrap();
    assert_eq!(
        get(&mut second, &elsewhere.url("/"), false).await.status,
        200
    );
    drop(first);
    let app = proxy.app.clone();
    let parked = || {
        let app = app.clone();
        async move { app.idle_upstream_connections() == 1 }
    };
    assert!(eventually(Duration::from_secs(5), parked).await);

    // Worker 1 does not take worker 0's connection: its socket belongs to worker 0's
    // event loop.
    assert_eq!(get(&mut second, &up.url("/b"), false).await.status, 200);
    assert_eq!(up.connections.load(Ordering::SeqCst), 2);
    assert_eq!(proxy.app.idle_upstream_connections(), 1);

    // The next client goes to worker 0 (no connections now) and takes it.
    let mut third = TcpStream::connect(proxy.addr).await.unwrap();
    assert_eq!(get(&mut third, &up.url("/c"), false).await.status, 200);
    assert_eq!(up.connections.load(Ordering::SeqCst), 2);
    assert_eq!(proxy.app.idle_upstream_connections(), 0);
    drop((second, third));
    drop(proxy);
    drop(workers);
}

#[tokio::test]
async fn a_name_whose_first_address_does_not_answer_falls_back_to_the_next() {
    let up = Upstream::start().await;
    let port = up.addr.port();
    // 127.0.0.2 on the same port: a listener that never accepts, its queue filled, so
    // further connects hang like packets dropped on the way.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket
        .bind(std::net::SocketAddr::from(([127, 0, 0, 2], port)))
        .unwrap();
    let _blackhole = socket.listen(1).unwrap();
    let mut queued = Vec::new();
    loop {
        let connect = TcpStream::connect(("127.0.0.2", port));
        match tokio::time::timeout(Duration::from_millis(200), connect).await {
            Ok(Ok(s)) => queued.push(s),
            _ => break,
        }
        assert!(queued.len() < 64, "the listen queue never filled");
    }

    let lookup = support::StaticLookup(
        [(
            "dual.test".to_string(),
            vec!["127.0.0.2".parse().unwrap(), "127.0.0.1".parse().unwrap()],
        )]
        .into(),
    );
    let proxy = Proxy::start_with("", Some(Arc::new(lookup))).await;
    let start = tokio::time::Instant::now();
    let resp = proxy
        .client()
        .get(format!("http://dual.test:{port}/hello"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(250) && took < Duration::from_secs(5),
        "the second address was tried after the first hung for a moment: {took:?}"
    );
    assert_eq!(up.seen().len(), 1);
}

#[tokio::test]
async fn responses_without_a_body_give_the_connection_back_too() {
    let up = Upstream::start().await;
    let proxy = Proxy::start("").await;
    let mut s = TcpStream::connect(proxy.addr).await.unwrap();
    // None of these has a body, so the head is the whole response.
    for (method, path, status) in [
        ("GET", "/status/204", 204),
        ("GET", "/status/304", 304),
        ("HEAD", "/hello", 200),
        ("GET", "/status/204", 204),
    ] {
        let req = format!("{method} {} HTTP/1.1\r\nHost: x\r\n\r\n", up.url(path));
        s.write_all(req.as_bytes()).await.unwrap();
        let resp = support::read_head(&mut s).await;
        assert_eq!(resp.status, status, "{method} {path}");
    }
    assert_eq!(
        up.connections.load(Ordering::SeqCst),
        1,
        "empty responses left the upstream connection reusable"
    );
}
