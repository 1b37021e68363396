//! The same response bytes read by this client and by hyper's HTTP/1.1 client (which
//! sluice still uses for TLS upstreams): the status, fields, body, trailers and whether
//! the connection may carry another request must agree, with two differences, both
//! tested: this client leaves the connection's own fields (`Connection`, `Keep-Alive`)
//! out of the head it returns, where hyper keeps them for the proxy to remove; and a
//! response with both `Transfer-Encoding` and `Content-Length` loses the length and ends
//! its connection here (RFC 9112 §6.3: a sign of smuggling, "ought to be handled as an
//! error"), where hyper keeps both and reuses the connection.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request};
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::conn::{Conn, Home, Outgoing, exchange};
use crate::body::empty;
use crate::upstream::outbound::Outbound;

type Fields = Vec<(String, String)>;

/// What a client made of a response: the status, fields, body and trailers, or that it
/// failed; and whether the connection could carry another request.
#[derive(Debug, PartialEq, Eq)]
struct Reading {
    result: Result<(u16, Fields, Vec<u8>, Fields), ()>,
    reusable: bool,
}

fn fields(map: &http::HeaderMap) -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = map
        .iter()
        .map(|(k, v)| {
            (
                k.to_string(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect();
    v.sort();
    v
}

/// An upstream that reads one request head, writes `reply`, and closes after `close`
/// or keeps the connection open.
async fn upstream(reply: &'static [u8], close: bool) -> TcpStream {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let mut got = Vec::new();
        let mut buf = [0u8; 1024];
        while !got.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = s.read(&mut buf).await.unwrap();
            if n == 0 {
                return;
            }
            got.extend_from_slice(&buf[..n]);
        }
        s.write_all(reply).await.unwrap();
        if close {
            s.shutdown().await.unwrap();
        } else {
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
    });
    TcpStream::connect(addr).await.unwrap()
}

#[derive(Clone, Default)]
struct Recorder(Arc<AtomicBool>);

impl Home for Recorder {
    fn take_back(self, _conn: Conn) {
        self.0.store(true, Ordering::SeqCst);
    }
}

async fn ours(reply: &'static [u8], close: bool, method: Method) -> Reading {
    let io = upstream(reply, close).await;
    let req = Request::builder()
        .method(method)
        .header("host", "upstream.test")
        .body(Outbound::from(empty()))
        .unwrap();
    let out = Outgoing::of(req, "/");
    let home = Recorder::default();
    let result = match exchange(Conn::new(io), out, home.clone()).await {
        Err(_) => Err(()),
        Ok(resp) => {
            let (parts, body) = resp.into_parts();
            match body.collect().await {
                Err(_) => Err(()),
                Ok(c) => {
                    let trailers = c.trailers().map(fields).unwrap_or_default();
                    Ok((
                        parts.status.as_u16(),
                        fields(&parts.headers),
                        c.to_bytes().to_vec(),
                        trailers,
                    ))
                }
            }
        }
    };
    let reusable = home.0.load(Ordering::SeqCst);
    Reading { result, reusable }
}

async fn hypers(reply: &'static [u8], close: bool, method: Method) -> Reading {
    let io = upstream(reply, close).await;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io))
        .await
        .unwrap();
    let driver = tokio::spawn(conn);
    let req = Request::builder()
        .method(method)
        .uri("/")
        .header("host", "upstream.test")
        .body(Empty::<Bytes>::new())
        .unwrap();
    let result = match sender.send_request(req).await {
        Err(_) => Err(()),
        Ok(resp) => {
            let (parts, body) = resp.into_parts();
            match body.collect().await {
                Err(_) => Err(()),
                Ok(c) => {
                    let trailers = c.trailers().map(fields).unwrap_or_default();
                    Ok((
                        parts.status.as_u16(),
                        fields(&parts.headers),
                        c.to_bytes().to_vec(),
                        trailers,
                    ))
                }
            }
        }
    };
    // hyper ends the connection's task when the connection cannot be reused. The cases
    // run concurrently, so a wide margin costs little.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let reusable = result.is_ok() && !driver.is_finished() && sender.is_ready();
    driver.abort();
    Reading { result, reusable }
}

/// Responses where the two clients read the same (but for the connection's own
/// fields).
const SAME: &[(&str, &[u8], bool)] = &[
    ("sized", b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello", false),
    ("no reason phrase", b"HTTP/1.1 200\r\ncontent-length: 2\r\n\r\nok", false),
    ("padded length", b"HTTP/1.1 200 OK\r\ncontent-length:  2 \r\n\r\nok", false),
    ("repeated equal lengths", b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 2\r\n\r\nok", false),
    (
        "chunked with extensions and trailers",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5;x=y\r\nhello\r\n0\r\nx-sum: 1\r\n\r\n",
        false,
    ),
    (
        "informational responses first",
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>; rel=preload\r\n\r\n\
          HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok",
        false,
    ),
    ("connection: close", b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok", false),
    ("HTTP/1.0", b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\nok", false),
    (
        "HTTP/1.0 keep-alive",
        b"HTTP/1.0 200 OK\r\nconnection: keep-alive\r\ncontent-length: 2\r\n\r\nok",
        false,
    ),
    ("until close", b"HTTP/1.1 200 OK\r\n\r\nto the end", true),
    ("204 with a length", b"HTTP/1.1 204 No Content\r\ncontent-length: 10\r\n\r\n", false),
    ("304", b"HTTP/1.1 304 Not Modified\r\n\r\n", false),
    ("differing lengths", b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\nok", false),
    ("a length that is not a number", b"HTTP/1.1 200 OK\r\ncontent-length: 2x\r\n\r\nok", false),
    ("a bad chunk size", b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nok\r\n0\r\n\r\n", false),
    ("not HTTP", b"SSH-2.0-OpenSSH_9.2\r\n\r\n", false),
    ("closed mid-body", b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort", true),
    ("closed before the head", b"", true),
    ("bytes no request asked for", b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokHTTP/1.1 200 OK\r\n\r\n", false),
];

/// hyper's reading without the connection's own fields, which this client drops.
fn without_connection_fields(mut r: Reading) -> Reading {
    if let Ok((_, fields, _, _)) = &mut r.result {
        fields.retain(|(k, _)| k != "connection" && k != "keep-alive");
    }
    r
}

#[tokio::test]
async fn the_same_bytes_read_as_hyper_reads_them() {
    let readings =
        futures_util::future::join_all(SAME.iter().map(|(name, reply, close)| async move {
            let a = ours(reply, *close, Method::GET).await;
            let b = without_connection_fields(hypers(reply, *close, Method::GET).await);
            (name, a, b)
        }))
        .await;
    let mut wrong = Vec::new();
    for (name, a, b) in readings {
        if a != b {
            wrong.push(format!("{name}:\n  ours:  {a:?}\n  hyper: {b:?}"));
        }
    }
    // A response to HEAD has no body, whatever its length says.
    let head = b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n";
    let (a, b) = (
        ours(head, false, Method::HEAD).await,
        hypers(head, false, Method::HEAD).await,
    );
    if a != b {
        wrong.push(format!("HEAD:\n  ours:  {a:?}\n  hyper: {b:?}"));
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// Both framings at once: the body is read as chunked by both, but here the length goes
/// and the connection ends, where hyper keeps both and the connection.
#[tokio::test]
async fn chunked_over_a_length_ends_the_connection_here_and_not_in_hyper() {
    let reply = b"HTTP/1.1 200 OK\r\ncontent-length: 99\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n";
    let chunked = vec![("transfer-encoding".to_string(), "chunked".to_string())];
    let both = vec![
        ("content-length".to_string(), "99".to_string()),
        ("transfer-encoding".to_string(), "chunked".to_string()),
    ];
    assert_eq!(
        ours(reply, false, Method::GET).await,
        Reading {
            result: Ok((200, chunked, b"ok".to_vec(), vec![])),
            reusable: false
        }
    );
    assert_eq!(
        hypers(reply, false, Method::GET).await,
        Reading {
            result: Ok((200, both, b"ok".to_vec(), vec![])),
            reusable: true
        }
    );
}
