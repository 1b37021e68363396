//! WebSockets through the forward proxy: a real WebSocket server (tokio-tungstenite)
//! behind sluice, and a client that sends its handshake to the proxy in absolute form,
//! as aiohttp and `HTTP_PROXY` clients do, then speaks WebSocket frames on the same
//! connection.

use sluice_test_support as support;

use std::net::SocketAddr;
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::Role;

/// Sends a WebSocket handshake for `url` to the proxy; the status line and head of the
/// answer, and the WebSocket on that connection after a 101.
async fn open(
    proxy: &Proxy,
    url: &str,
    host: SocketAddr,
    protocol: &str,
) -> (u16, String, Option<WebSocketStream<TcpStream>>) {
    let mut s = TcpStream::connect(proxy.addr).await.unwrap();
    s.write_all(
        format!(
            "GET {url} HTTP/1.1\r\nHost: {host}\r\nUpgrade: {protocol}\r\nConnection: Upgrade\r\n\
             Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    // Byte by byte: nothing past the head may be taken from the WebSocket.
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut b))
            .await
            .expect("an answer in time")
            .unwrap();
        assert_eq!(n, 1, "closed after {}", String::from_utf8_lossy(&head));
        head.push(b[0]);
    }
    let head = String::from_utf8_lossy(&head).to_string();
    let status: u16 = head[9..12].parse().unwrap();
    let ws = if status == 101 {
        Some(WebSocketStream::from_raw_socket(s, Role::Client, None).await)
    } else {
        None
    };
    (status, head, ws)
}

async fn echoes<S>(ws: &mut WebSocketStream<S>, m: Message)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    ws.send(m.clone()).await.unwrap();
    let back = tokio::time::timeout(Duration::from_secs(10), ws.next())
        .await
        .expect("the echo in time")
        .unwrap()
        .unwrap();
    assert_eq!(back, m);
}

/// A WebSocket through the forward proxy (`ws://` and `http://` URLs alike): the upgrade
/// is matched to its upstream, holds that upstream's concurrency permit until it closes,
/// and is counted.
#[tokio::test]
async fn websockets_pass_through_and_hold_their_concurrency_permit() {
    let up = ws_echo(None).await;
    let proxy = Proxy::start(&format!(
        "[[upstream]]\nname = \"chat\"\nhosts = [\"127.0.0.1:{}\"]\nmax_wait = \"300ms\"\n\
         limits = [{{ kind = \"concurrency\", max = 1 }}]\n",
        up.port()
    ))
    .await;
    let (status, head, ws) = open(&proxy, &format!("ws://{up}/chat"), up, "websocket").await;
    assert_eq!(status, 101, "{head}");
    let lower = head.to_ascii_lowercase();
    assert!(lower.contains("upgrade: websocket"), "{head}");
    assert!(lower.contains("connection: upgrade"), "{head}");
    assert!(lower.contains("sec-websocket-accept:"), "{head}");
    let mut ws = ws.unwrap();
    echoes(&mut ws, Message::text("hello")).await;
    echoes(&mut ws, Message::binary(vec![0u8, 1, 2, 255])).await;

    // The open WebSocket holds the only permit: a second one waits, then is refused.
    let (status, head, _) = open(&proxy, &format!("http://{up}/chat"), up, "websocket").await;
    assert_eq!(status, 429, "{head}");
    assert!(head.contains("queue_timeout"), "{head}");

    ws.close(None).await.unwrap();
    drop(ws);
    assert!(
        eventually(Duration::from_secs(5), || async {
            let m = proxy.metrics().await;
            metric(&m, r#"sluice_upgraded_connections{upstream="chat"}"#) == Some(0.0)
        })
        .await
    );
    let (status, head, ws) = open(&proxy, &format!("http://{up}/chat"), up, "websocket").await;
    assert_eq!(status, 101, "the permit came back: {head}");
    let mut ws = ws.unwrap();
    echoes(&mut ws, Message::text("again")).await;
    let m = proxy.metrics().await;
    assert_eq!(
        metric(
            &m,
            r#"sluice_upgrades_total{result="switched",upstream="chat"}"#
        ),
        Some(2.0),
        "{m}"
    );
    assert_eq!(
        metric(&m, r#"sluice_upgraded_connections{upstream="chat"}"#),
        Some(1.0),
        "{m}"
    );
}

/// A switched connection is a tunnel: silent for `tunnel_idle_timeout`, it is closed.
#[tokio::test]
async fn a_silent_websocket_is_closed_after_the_tunnel_idle_timeout() {
    let up = ws_echo(None).await;
    let proxy = Proxy::start("tunnel_idle_timeout = \"1s\"\n").await;
    let (status, head, ws) = open(&proxy, &format!("http://{up}/"), up, "websocket").await;
    assert_eq!(status, 101, "{head}");
    let mut ws = ws.unwrap();
    let t = tokio::time::Instant::now();
    let end = tokio::time::timeout(Duration::from_secs(10), ws.next()).await;
    assert!(matches!(end, Ok(None | Some(Err(_)))), "closed: {end:?}");
    assert!(
        t.elapsed() >= Duration::from_millis(800),
        "{:?}",
        t.elapsed()
    );
}

/// An upstream that answers every request 503 and counts the heads it read.
async fn failing_upstream() -> (SocketAddr, std::sync::Arc<parking_lot::Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let heads = std::sync::Arc::new(parking_lot::Mutex::new(Vec::new()));
    let kept = heads.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let kept = kept.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                kept.lock().push(String::from_utf8_lossy(&buf).to_string());
                let _ = s
                    .write_all(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                    .await;
            });
        }
    });
    (addr, heads)
}

/// An upgrade request is never retried (a 503 to a GET would be), and a protocol
/// `upgrades` does not allow, or `h2c`, is not passed on: not as the only offer, not
/// behind an allowed one in the same field or in a second `Upgrade` line (an h2c-capable
/// upstream would switch to HTTP/2 and serve any number of requests on one permit).
#[tokio::test]
async fn an_upgrade_is_sent_once_and_other_protocols_are_not_passed_on() {
    let (up, heads) = failing_upstream().await;
    let proxy = Proxy::start(&format!(
        "[[upstream]]\nname = \"down\"\nhosts = [\"127.0.0.1:{}\"]\n\
         retry = {{ max_attempts = 3, backoff = {{ base = \"10ms\", max = \"10ms\" }} }}\n",
        up.port()
    ))
    .await;
    let (status, head, _) = open(&proxy, &format!("http://{up}/"), up, "websocket").await;
    assert_eq!(status, 503, "{head}");
    assert_eq!(heads.lock().len(), 1, "sent once");
    assert!(
        heads.lock()[0]
            .to_ascii_lowercase()
            .contains("upgrade: websocket")
    );
    for protocol in [
        "h2c",
        "custom/1",
        "websocket, h2c",
        "h2c, websocket",
        "websocket,h2c/1",
        "websocket, custom/1",
        "websocket\r\nUpgrade: h2c",
    ] {
        heads.lock().clear();
        let (status, head, _) = open(&proxy, &format!("http://{up}/"), up, protocol).await;
        assert_eq!(status, 503, "{head}");
        let seen = heads.lock().clone();
        assert!(
            seen.iter()
                .all(|h| !h.to_ascii_lowercase().contains("upgrade")),
            "{protocol}: {seen:?}"
        );
    }
    let m = proxy.metrics().await;
    assert_eq!(
        metric(
            &m,
            r#"sluice_upgrades_total{result="refused",upstream="down"}"#
        ),
        Some(1.0),
        "{m}"
    );

    // sluice's own answer (the upstream cannot be reached) is no refusal by it.
    let gone = closed_port().await;
    let proxy = Proxy::start(&format!(
        "[[upstream]]\nname = \"gone\"\nhosts = [\"127.0.0.1:{}\"]\n\
         retry = {{ max_attempts = 1 }}\n",
        gone.port()
    ))
    .await;
    let at = SocketAddr::from(([127, 0, 0, 1], gone.port()));
    let (status, head, _) = open(&proxy, &format!("http://{at}/"), at, "websocket").await;
    assert_eq!(status, 502, "{head}");
    let m = proxy.metrics().await;
    assert_eq!(
        metric(
            &m,
            r#"sluice_upgrades_total{result="local",upstream="gone"}"#
        ),
        Some(1.0),
        "{m}"
    );
    assert_eq!(
        metric(
            &m,
            r#"sluice_upgrades_total{result="refused",upstream="gone"}"#
        ),
        None,
        "{m}"
    );
}

/// A `wss://` WebSocket through an intercepted tunnel: sluice terminates the client's TLS,
/// sends the handshake to the upstream over its own verified TLS (HTTP/1.1: there is no
/// upgrade in HTTP/2), and joins the two after the 101. The client is tungstenite's own
/// handshake, the server tungstenite's accept over rustls.
#[tokio::test]
async fn a_wss_websocket_passes_through_interception() {
    support::crypto();
    let dir = tempfile::tempdir().unwrap();
    let certs = support::certs::for_localhost(dir.path(), &[b"h2", b"http/1.1"]);
    let up = ws_echo(Some(certs.server.clone())).await;
    let (ca_cert, ca_key) = sluice::write_new_ca(&dir.path().join("ca")).unwrap();
    let proxy = Proxy::start(&format!(
        "[tls]\nca_cert = {ca_cert:?}\nca_key = {ca_key:?}\n\
         [[upstream]]\nname = \"secure\"\nhosts = [\"127.0.0.1\"]\ntls = \"intercept\"\n\
         upstream_ca = {:?}\nlimits = [{{ kind = \"concurrency\", max = 2 }}]\n",
        certs.ca_path
    ))
    .await;

    let tunnel = connect_tunnel(proxy.addr, up).await;
    let connector = support::certs::connector(&ca_cert, &[]);
    let name = rustls_pki_types::ServerName::try_from("127.0.0.1").unwrap();
    let tls = connector.connect(name, tunnel).await.unwrap();
    let (mut ws, resp) = tokio_tungstenite::client_async(format!("wss://{up}/chat"), tls)
        .await
        .unwrap_or_else(|e| panic!("the handshake through interception: {e}"));
    assert_eq!(resp.status(), 101);
    echoes(&mut ws, Message::text("through interception")).await;
    let m = proxy.metrics().await;
    assert_eq!(
        metric(
            &m,
            r#"sluice_upgrades_total{result="switched",upstream="secure"}"#
        ),
        Some(1.0),
        "{m}"
    );
}

/// Inside an intercepted tunnel spoken in HTTP/2, sluice does not offer RFC 8441's
/// extended CONNECT (it sends no SETTINGS_ENABLE_CONNECT_PROTOCOL), so an HTTP/2 client
/// cannot open a WebSocket there and opens an HTTP/1.1 connection for it instead, which
/// `a_wss_websocket_passes_through_interception` covers. Here hyper's HTTP/2 client is
/// refused before anything is sent, and an ordinary request on the same connection works.
#[tokio::test]
async fn extended_connect_is_not_offered_inside_intercepted_h2() {
    support::crypto();
    let dir = tempfile::tempdir().unwrap();
    let up = support::certs::tls_upstream(dir.path()).await;
    let (proxy, ca_cert) = support::certs::intercepting(dir.path(), &up, "").await;
    let target = up.addr;
    let tls = support::certs::h2_tunnel(proxy.addr, &ca_cert, target).await;
    let (mut send, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tls),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    // The server's SETTINGS arrive with its first answer.
    let plain = http::Request::get(format!("https://{target}/"))
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .unwrap();
    let resp = send.send_request(plain).await.unwrap();
    assert_eq!(resp.status(), 200);
    let mut connect = http::Request::connect(format!("https://{target}/chat"))
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .unwrap();
    connect
        .extensions_mut()
        .insert(hyper::ext::Protocol::from_static("websocket"));
    let refused = send.send_request(connect).await;
    assert!(refused.is_err(), "{refused:?}");
    assert_eq!(
        up.seen.lock().len(),
        1,
        "only the plain request reached the upstream"
    );
}
