//! What a client sends first through a CONNECT tunnel to a configured upstream, decided
//! within a fixed budget: a TLS handshake (carried blind, the tunnel's permit held), a
//! complete HTTP/1.1 request head or the HTTP/2 preface (served as the forward proxy
//! serves plain HTTP, each request paying its limits), or anything else, refused.
//!
//! Refused rather than carried blind: the upstream is a configured HTTP API, and bytes
//! that are neither TLS nor HTTP as sluice parses it may still be HTTP as a laxer server
//! parses it (a stray byte before the method, a head cut by a pause); carried blind, they
//! would reach it past every limit. The decision reads only the client's bytes: an
//! upstream that speaks first (a 408 after its own timeout) cannot steer it either.

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::time::Instant;

/// The longest the decision may take, when `tunnel_idle_timeout` is longer: a client's
/// first bytes come at once, and a silent tunnel holds a connection slot and a permit.
pub(crate) const BUDGET_MAX: Duration = Duration::from_secs(10);
/// As many bytes as a request head may have (the forward proxy's limit).
const MAX_HEAD: usize = 64 << 10;
/// The client preface of HTTP/2 with prior knowledge (RFC 9113 §3.4).
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// Header fields httparse is given room for; more is still HTTP, for hyper to refuse.
const FIELDS: usize = 128;

/// What the client's first bytes are.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A TLS record: HTTPS, which only the upstream can read.
    Tls,
    /// A complete HTTP/1.x request head (after any empty lines RFC 9112 §2.2 lets a
    /// server skip).
    Http1,
    /// The HTTP/2 connection preface: h2c with prior knowledge (gRPC in plain text).
    H2c,
}

/// Why a tunnel's first bytes were refused.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Refused {
    #[error("neither TLS nor an HTTP request")]
    NotHttp,
    #[error("no complete request head within {0:?}")]
    TooSlow(Duration),
    #[error("a request head over 64 KiB")]
    TooLarge,
    #[error("the client closed before a complete request head")]
    Closed,
}

impl Refused {
    /// For `sluice_tunnels_refused_total{reason}`.
    pub(crate) fn label(&self) -> &'static str {
        match self {
            Refused::NotHttp => "not_http",
            Refused::TooSlow(_) => "too_slow",
            Refused::TooLarge => "too_large",
            Refused::Closed => "closed",
        }
    }
}

/// What `bytes` (all the client has sent so far) decide, if they decide yet.
pub(crate) fn decide(bytes: &[u8]) -> Option<Result<Kind, Refused>> {
    let first = *bytes.first()?;
    // A TLS record's content type: handshake (22). No request line starts so.
    if first == 0x16 {
        return Some(Ok(Kind::Tls));
    }
    if bytes.len() < PREFACE.len() && PREFACE.starts_with(bytes) {
        return None;
    }
    if bytes.starts_with(PREFACE) {
        return Some(Ok(Kind::H2c));
    }
    let mut fields = [httparse::EMPTY_HEADER; FIELDS];
    match httparse::Request::new(&mut fields).parse(bytes) {
        Ok(httparse::Status::Complete(_)) | Err(httparse::Error::TooManyHeaders) => {
            Some(Ok(Kind::Http1))
        }
        Ok(httparse::Status::Partial) if bytes.len() >= MAX_HEAD => Some(Err(Refused::TooLarge)),
        Ok(httparse::Status::Partial) => None,
        Err(_) => Some(Err(Refused::NotHttp)),
    }
}

/// Reads the client's first bytes until they decide, for at most `budget`; the bytes
/// read, which whoever serves the tunnel reads first.
pub(crate) async fn sniff<C: AsyncRead + Unpin>(
    client: &mut C,
    budget: Duration,
) -> (Result<Kind, Refused>, Vec<u8>) {
    let deadline = Instant::now() + budget;
    let mut bytes = Vec::with_capacity(1024);
    loop {
        if bytes.len() == bytes.capacity() {
            bytes.reserve(bytes.len().min(MAX_HEAD));
        }
        let read = tokio::time::timeout_at(deadline, client.read_buf(&mut bytes)).await;
        match read {
            Err(_) => return (Err(Refused::TooSlow(budget)), bytes),
            Ok(Ok(0) | Err(_)) => return (Err(Refused::Closed), bytes),
            Ok(Ok(_)) => {
                if let Some(decided) = decide(&bytes) {
                    return (decided, bytes);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_is_told_and_nothing_else_passes() {
        let d = |b: &[u8]| decide(b);
        assert_eq!(d(b""), None);
        assert_eq!(d(b"\x16\x03\x01\x02\x00"), Some(Ok(Kind::Tls)));
        assert_eq!(
            d(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n"),
            Some(Ok(Kind::Http1))
        );
        // RFC 9112 §2.2: empty lines before the request line are skipped.
        assert_eq!(
            d(b"\r\nGET / HTTP/1.1\r\nHost: a\r\n\r\n"),
            Some(Ok(Kind::Http1))
        );
        // A head not yet complete waits, however it was cut.
        for cut in [
            &b"GET"[..],
            b"GET ",
            b"GET /x HTTP/1.1\r\nHost: a\r\n",
            b"\r\n",
        ] {
            assert_eq!(d(cut), None, "{:?}", String::from_utf8_lossy(cut));
        }
        assert_eq!(d(PREFACE), Some(Ok(Kind::H2c)));
        assert_eq!(d(&PREFACE[..10]), None);
        assert_eq!(d(b"PRI * HTTP/2.0\r\n\r\nXX"), Some(Err(Refused::NotHttp)));
        // Another protocol's first bytes: refused, not carried blind.
        for other in [
            &b"AUTH secret\r\n"[..],
            b"SSH-2.0-OpenSSH_9.2\r\n",
            b"\x00\x00\x00\x08",
            b"GET / HTTP/3.0\r\n\r\n",
            b" GET / HTTP/1.1\r\n\r\n",
            b"\x05\x01\x00",
        ] {
            assert_eq!(
                d(other),
                Some(Err(Refused::NotHttp)),
                "{:?}",
                String::from_utf8_lossy(other)
            );
        }
        let mut big = b"GET / HTTP/1.1\r\nX: ".to_vec();
        big.resize(MAX_HEAD, b'a');
        assert_eq!(d(&big), Some(Err(Refused::TooLarge)));
        let mut many = b"GET / HTTP/1.1\r\n".to_vec();
        for i in 0..200 {
            many.extend_from_slice(format!("X-{i}: y\r\n").as_bytes());
        }
        many.extend_from_slice(b"\r\n");
        assert_eq!(d(&many), Some(Ok(Kind::Http1)), "for hyper to answer 431");
    }

    #[tokio::test(start_paused = true)]
    async fn a_head_is_read_across_pauses_within_the_budget_and_not_after() {
        let (mut client, mut server) = tokio::io::duplex(1 << 16);
        tokio::spawn(async move {
            use tokio::io::AsyncWriteExt;
            for part in [&b"GE"[..], b"T /x HTTP/1.1\r\n", b"Host: a\r\n\r\n"] {
                tokio::time::sleep(Duration::from_secs(3)).await;
                client.write_all(part).await.unwrap();
            }
            tokio::time::sleep(Duration::from_secs(60)).await;
        });
        let (kind, bytes) = sniff(&mut server, Duration::from_secs(10)).await;
        assert_eq!(kind, Ok(Kind::Http1));
        assert_eq!(bytes, b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n");

        let (mut client, mut server) = tokio::io::duplex(1 << 16);
        tokio::spawn(async move {
            use tokio::io::AsyncWriteExt;
            client.write_all(b"GET /x HTTP/1.1\r\n").await.unwrap();
            tokio::time::sleep(Duration::from_secs(60)).await;
        });
        let started = Instant::now();
        let (kind, _) = sniff(&mut server, Duration::from_secs(10)).await;
        assert_eq!(kind, Err(Refused::TooSlow(Duration::from_secs(10))));
        assert_eq!(started.elapsed(), Duration::from_secs(10));
    }
}
