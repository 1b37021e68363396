//! sluice's own HTTP/1.1 client side for plain-HTTP upstream connections: the request
//! head written straight from the `http` types, the response head parsed with
//! `httparse`, and the response body read from the socket by the body itself, in the
//! client connection's task, with no connection task and no channel in between.
//!
//! Pure parts here and in [`chunked`] (framing as RFC 9112 §6 has it, testable without a
//! socket); the socket work in [`conn`]. hyper still serves the client side and the TLS
//! upstreams.
//!
//! Invariants, each tested (`conn`'s tests against upstreams that write exact bytes,
//! `differential` against hyper's client on the same bytes, the `request` and
//! `response` fuzz targets):
//!
//! - A request head is origin-form HTTP/1.1 with at most one framing field: the
//!   request's own `Content-Length` when it has one (duplicates that agree are sent once,
//!   a disagreeing or unparsable one is refused), else the body's exact size, else
//!   chunked. `Transfer-Encoding` never arrives here and request trailers never leave.
//! - A response is framed as RFC 9112 §6.3 says: no body after HEAD, 1xx, 204 or 304;
//!   chunked over any `Content-Length` (which is dropped, and the connection not
//!   reused); a length; else until close. Informational responses before the final one
//!   are passed over, except 101, which hands the socket to the caller.
//! - A connection goes back for another request only when the response said it may
//!   (HTTP/1.1 without `Connection: close`, or HTTP/1.0 with keep-alive), its body ended
//!   cleanly, the request went out whole, and nothing unasked follows the response.
//! - A head is bounded (`MAX_RESPONSE_HEAD`, `MAX_RESPONSE_HEADERS`), and the same bytes
//!   give the same result however the socket splits them.

pub mod chunked;
pub(crate) mod conn;
#[cfg(test)]
mod differential;

use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, StatusCode, Version};
use std::mem::MaybeUninit;

/// A response head larger than this is refused as a protocol error: hyper's default
/// buffer limit was about 400 KiB; API responses carry a few hundred bytes of head.
pub(crate) const MAX_RESPONSE_HEAD: usize = 256 * 1024;

/// Header fields per response head, as hyper allowed.
const MAX_RESPONSE_HEADERS: usize = 100;

/// What went wrong on an upstream connection, in terms the pipeline maps onto
/// `retry.on` (see `AttemptError`).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("the upstream closed the connection before the response {0}")]
    Closed(&'static str),
    #[error("unparsable response head: {0}")]
    Parse(httparse::Error),
    #[error("response head larger than {MAX_RESPONSE_HEAD} bytes")]
    HeadTooLarge,
    #[error("response framing: {0}")]
    Framing(&'static str),
    #[error("chunked response body: {0}")]
    Chunk(&'static str),
    #[error("the request body failed: {0}")]
    RequestBody(crate::body::BoxError),
    #[error("the request body does not match its Content-Length")]
    RequestLength,
}

impl Error {
    /// The upstream broke HTTP (as opposed to the connection failing): it would do the
    /// same again.
    pub(crate) fn is_protocol(&self) -> bool {
        matches!(
            self,
            Error::Parse(_) | Error::HeadTooLarge | Error::Framing(_) | Error::Chunk(_)
        )
    }
}

/// How a response body is delimited (RFC 9112 §6.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// No body: a response to HEAD, a 1xx, 204 or 304, or `Content-Length: 0`.
    Empty,
    Length(u64),
    Chunked,
    /// Until the upstream closes the connection.
    Close,
}

/// A parsed response head.
#[derive(Debug)]
pub struct Head {
    pub status: StatusCode,
    pub(crate) version: Version,
    pub headers: HeaderMap,
    pub framing: Framing,
    /// Whether the connection may carry another request once this response is read.
    pub(crate) keep_alive: bool,
}

/// Parses a response head from the front of `buf`, taking its bytes out of it. `None`:
/// not all of it has arrived yet. `method` is the request's (a response to HEAD has no
/// body whatever its `Content-Length` says). `spans` is scratch space, kept by the
/// connection so that no parse allocates or clears an array for it.
pub fn parse_response(
    buf: &mut BytesMut,
    method: &Method,
    spans: &mut Vec<Span>,
    spare: &mut Option<HeaderMap>,
) -> Result<Option<Head>, Error> {
    if buf.is_empty() {
        return Ok(None);
    }
    let mut slots = [const { MaybeUninit::uninit() }; MAX_RESPONSE_HEADERS];
    let mut resp = httparse::Response::new(&mut []);
    let parsed = httparse::ParserConfig::default()
        .parse_response_with_uninit_headers(&mut resp, buf, &mut slots);
    let len = match parsed {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) if buf.len() >= MAX_RESPONSE_HEAD => {
            return Err(Error::HeadTooLarge);
        }
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(e) => return Err(Error::Parse(e)),
    };
    let code = resp.code.unwrap_or(0);
    let status = StatusCode::from_u16(code).map_err(|_| Error::Framing("invalid status code"))?;
    let version = if resp.version == Some(0) {
        Version::HTTP_10
    } else {
        Version::HTTP_11
    };
    // Where each field is, so that the values can share the head's bytes once they are
    // taken out of `buf` (one allocation for the head, none per value).
    let base = buf.as_ptr() as usize;
    spans.clear();
    spans.extend(resp.headers.iter().map(|h| Span {
        name: h.name.as_ptr() as usize - base,
        name_len: h.name.len(),
        value: h.value.as_ptr() as usize - base,
        value_len: h.value.len(),
    }));
    let bytes: Bytes = buf.split_to(len).freeze();
    let mut headers = match spare.take() {
        Some(mut map) => {
            map.clear();
            map.reserve(spans.len());
            map
        }
        None => HeaderMap::with_capacity(spans.len()),
    };
    let mut seen = Fields::default();
    for s in spans.iter() {
        let raw = &bytes[s.name..s.name + s.name_len];
        let name = match common_name(raw) {
            Some(name) => name,
            None => {
                HeaderName::from_bytes(raw).map_err(|_| Error::Framing("invalid header name"))?
            }
        };
        if seen.note(&name, &bytes[s.value..s.value + s.value_len]) {
            continue;
        }
        // Checked again (httparse allows what `HeaderValue` does); the unchecked
        // constructor would save little and is `unsafe`.
        let value = HeaderValue::from_maybe_shared(bytes.slice(s.value..s.value + s.value_len))
            .map_err(|_| Error::Framing("invalid header value"))?;
        headers.append(name, value);
    }
    let (framing, keep_alive) = framing(status, version, &mut headers, method, &seen)?;
    Ok(Some(Head {
        status,
        version,
        headers,
        framing,
        keep_alive,
    }))
}

/// The fields origin servers send on most responses, found without
/// `HeaderName::from_bytes` (which lowers the name into a scratch buffer and then compares
/// it with each standard name of its length): an eighth of a response head's parse.
/// `name` is a token, as httparse lets through (RFC 9110 §5.6.2).
fn common_name(name: &[u8]) -> Option<HeaderName> {
    use header::*;
    let candidates: &[(&[u8], HeaderName)] = match name.len() {
        4 => &[(b"date", DATE), (b"etag", ETAG), (b"vary", VARY)],
        6 => &[(b"server", SERVER)],
        7 => &[(b"expires", EXPIRES)],
        10 => &[(b"connection", CONNECTION), (b"set-cookie", SET_COOKIE)],
        12 => &[(b"content-type", CONTENT_TYPE)],
        13 => &[
            (b"last-modified", LAST_MODIFIED),
            (b"cache-control", CACHE_CONTROL),
            (b"accept-ranges", ACCEPT_RANGES),
        ],
        14 => &[(b"content-length", CONTENT_LENGTH)],
        16 => &[(b"content-encoding", CONTENT_ENCODING)],
        17 => &[(b"transfer-encoding", TRANSFER_ENCODING)],
        _ => return None,
    };
    candidates
        .iter()
        .find(|(lower, _)| token_is(name, lower))
        .map(|(_, h)| h.clone())
}

/// Whether the token `name` is `lower` (lower-case letters and `-`) in any case, compared
/// a word at a time. `| 0x20` lowers `A`–`Z`; among token characters no other becomes a
/// letter or `-` by it, so a token that differs cannot be made to match.
fn token_is(name: &[u8], lower: &[u8]) -> bool {
    match name.len() {
        n if n != lower.len() || n < 4 => false,
        n if n < 8 => words::<4>(name, lower),
        _ => words::<8>(name, lower),
    }
}

/// `a` and `b` (each at least `W` bytes, `W` at most eight) agree, `| 0x20` applied,
/// `W` bytes at a time, the last word overlapping the one before.
fn words<const W: usize>(a: &[u8], b: &[u8]) -> bool {
    let word = |s: &[u8], at: usize| {
        let mut x = [0u8; 8];
        if let (Some(to), Some(from)) = (x.get_mut(..W), s.get(at..at + W)) {
            to.copy_from_slice(from);
        }
        u64::from_le_bytes(x) | 0x2020_2020_2020_2020
    };
    let last = a.len().saturating_sub(W);
    let mut at = 0;
    loop {
        let here = at.min(last);
        if word(a, here) != word(b, here) {
            return false;
        }
        if here == last {
            return true;
        }
        at += W;
    }
}

/// Where a header field's name and value are in the head.
#[derive(Debug, Clone, Copy)]
pub struct Span {
    name: usize,
    name_len: usize,
    value: usize,
    value_len: usize,
}

/// What framing needs from the fields, noted as the head is read: three hashed lookups
/// per response fewer than asking the map afterwards.
#[derive(Default)]
struct Fields {
    /// `Connection` names `close` / `keep-alive`.
    close: bool,
    keep_alive: bool,
    /// `Transfer-Encoding` is present; whether its last coding is chunked.
    coding: Option<bool>,
    /// The `Content-Length` values agree on this length...
    length: Option<u64>,
    /// ...unless one is invalid or they differ.
    bad_length: bool,
}

impl Fields {
    /// Notes what framing needs from a field. True for a `Connection` that names only
    /// `close` or `keep-alive`: it has said all it has to say here, and being hop-by-hop
    /// (RFC 9110 §7.6.1) it would only be put in the map for the proxy to take out again.
    /// One that names other fields stays, so that those are removed too.
    fn note(&mut self, name: &HeaderName, value: &[u8]) -> bool {
        let elements = || value.split(|&b| b == b',').map(<[u8]>::trim_ascii);
        if name == header::CONNECTION {
            let mut plain = true;
            for t in elements() {
                let close = t.eq_ignore_ascii_case(b"close");
                let keep_alive = t.eq_ignore_ascii_case(b"keep-alive");
                self.close |= close;
                self.keep_alive |= keep_alive;
                plain &= close || keep_alive || t.is_empty();
            }
            return plain;
        } else if name == header::TRANSFER_ENCODING {
            if let Some(last) = elements().rfind(|t| !t.is_empty()) {
                self.coding = Some(last.eq_ignore_ascii_case(b"chunked"));
            } else {
                self.coding.get_or_insert(false);
            }
        } else if name == header::CONTENT_LENGTH {
            for t in elements() {
                match parse_length(t) {
                    Ok(n) if self.length.is_none_or(|l| l == n) => self.length = Some(n),
                    _ => self.bad_length = true,
                }
            }
        }
        false
    }
}

/// The body's delimitation and whether the connection stays open, from the head.
fn framing(
    status: StatusCode,
    version: Version,
    headers: &mut HeaderMap,
    method: &Method,
    seen: &Fields,
) -> Result<(Framing, bool), Error> {
    let mut keep_alive = match version {
        Version::HTTP_10 => seen.keep_alive,
        _ => !seen.close,
    };
    if *method == Method::HEAD
        || status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
    {
        return Ok((Framing::Empty, keep_alive));
    }
    if let Some(chunked_last) = seen.coding {
        // §6.3 (3): Transfer-Encoding wins over Content-Length, which must not be passed
        // on, and such a message may be an attempt at response splitting: this
        // connection carries nothing after it.
        if headers.remove(header::CONTENT_LENGTH).is_some() {
            keep_alive = false;
        }
        return Ok(if chunked_last && version == Version::HTTP_11 {
            (Framing::Chunked, keep_alive)
        } else {
            // Not chunked last (or an HTTP/1.0 sender, which has no chunked coding): the
            // body runs to the end of the connection.
            (Framing::Close, false)
        });
    }
    if seen.bad_length {
        return Err(Error::Framing("invalid or conflicting Content-Length"));
    }
    Ok(match seen.length {
        Some(0) => (Framing::Empty, keep_alive),
        Some(n) => (Framing::Length(n), keep_alive),
        None => (Framing::Close, false),
    })
}

fn parse_length(digits: &[u8]) -> Result<u64, Error> {
    if digits.is_empty() || digits.len() > 19 || !digits.iter().all(u8::is_ascii_digit) {
        return Err(Error::Framing("invalid Content-Length"));
    }
    Ok(digits
        .iter()
        .fold(0u64, |n, d| n * 10 + u64::from(d - b'0')))
}

/// How the request body is delimited on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyFraming {
    None,
    Length(u64),
    Chunked,
}

/// Writes the request head (origin-form target, HTTP/1.1) into `out`, with the framing
/// field the body needs when the head has none: the request's own `Content-Length` is
/// kept and trusted (the body is checked against it as it is sent); otherwise the
/// body's exact size, or chunked. `Transfer-Encoding` never reaches here (hop-by-hop).
pub fn encode_request(
    out: &mut Vec<u8>,
    method: &Method,
    target: &str,
    headers: &HeaderMap,
    body: (bool, Option<u64>),
) -> Result<BodyFraming, Error> {
    let (empty, exact) = body;
    out.extend_from_slice(method.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(target.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    let mut declared = None;
    for (name, value) in headers {
        if name == header::CONTENT_LENGTH {
            let n =
                parse_length(value.as_bytes().trim_ascii()).map_err(|_| Error::RequestLength)?;
            if declared.is_some_and(|d| d != n) {
                return Err(Error::RequestLength);
            }
            if declared.is_some() {
                continue;
            }
            declared = Some(n);
        }
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    let framing = match (declared, empty, exact) {
        (Some(0), _, _) => BodyFraming::None,
        (Some(n), _, _) => BodyFraming::Length(n),
        (None, true, _) => {
            // As user agents do: a method whose requests normally carry a body says it
            // has none; the others say nothing.
            if matches!(*method, Method::POST | Method::PUT | Method::PATCH) {
                out.extend_from_slice(b"content-length: 0\r\n");
            }
            BodyFraming::None
        }
        (None, false, Some(n)) => {
            out.extend_from_slice(b"content-length: ");
            out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
            out.extend_from_slice(b"\r\n");
            if n == 0 {
                BodyFraming::None
            } else {
                BodyFraming::Length(n)
            }
        }
        (None, false, None) => {
            out.extend_from_slice(b"transfer-encoding: chunked\r\n");
            BodyFraming::Chunked
        }
    };
    out.extend_from_slice(b"\r\n");
    Ok(framing)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(raw: &str, method: Method) -> Result<Option<Head>, Error> {
        let mut buf = BytesMut::from(raw.as_bytes());
        parse_response(&mut buf, &method, &mut Vec::new(), &mut None)
    }

    fn head(raw: &str) -> Head {
        parse(raw, Method::GET).unwrap().unwrap()
    }

    /// Every name the fast path knows, in every case at each position, is the name
    /// `HeaderName::from_bytes` reads; one changed byte is not.
    #[test]
    fn common_names_read_as_http_reads_them() {
        for name in KNOWN {
            let want = HeaderName::from_bytes(name.as_bytes()).unwrap();
            assert_eq!(common_name(name.as_bytes()), Some(want.clone()), "{name}");
            assert_eq!(
                common_name(name.to_uppercase().as_bytes()),
                Some(want.clone())
            );
            for i in 0..name.len() {
                let mut b = name.as_bytes().to_vec();
                b[i] = b[i].to_ascii_uppercase();
                assert_eq!(common_name(&b), Some(want.clone()), "{name} at {i}");
                for other in [b'x', b'_', b'0', b'~', b'^'] {
                    let mut b = name.as_bytes().to_vec();
                    if b[i] != other {
                        b[i] = other;
                        assert_eq!(common_name(&b), None, "{:?}", String::from_utf8_lossy(&b));
                    }
                }
            }
        }
        assert_eq!(common_name(b"x-a"), None);
        assert_eq!(common_name(b""), None);
    }

    const KNOWN: [&str; 14] = [
        "date",
        "etag",
        "vary",
        "server",
        "expires",
        "connection",
        "set-cookie",
        "content-type",
        "last-modified",
        "cache-control",
        "accept-ranges",
        "content-length",
        "content-encoding",
        "transfer-encoding",
    ];

    proptest::proptest! {
        /// A known name with its case changed anywhere and a few bytes replaced by any
        /// token character: the fast path finds exactly what `HeaderName::from_bytes`
        /// reads when that is a known name, and nothing otherwise.
        #[test]
        fn common_name_agrees_with_http(
            pick in 0..KNOWN.len(),
            upper in proptest::collection::vec(proptest::bool::ANY, 18),
            edits in proptest::collection::vec((0..18usize, "[!#$%&'*+.^_`|~0-9A-Za-z-]"), 0..3),
        ) {
            let mut b: Vec<u8> = KNOWN[pick].bytes().zip(&upper)
                .map(|(c, &u)| if u { c.to_ascii_uppercase() } else { c })
                .collect();
            for (at, c) in edits {
                let at = at % b.len();
                b[at] = c.as_bytes()[0];
            }
            let http = HeaderName::from_bytes(&b).unwrap();
            let known = KNOWN.contains(&http.as_str());
            proptest::prop_assert_eq!(common_name(&b), known.then_some(http));
        }
    }

    #[test]
    fn a_plain_response_keeps_its_fields_and_leaves_the_body() {
        let mut buf = BytesMut::from(
            &b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-A: 1\r\nx-a: 2\r\n\r\nok"[..],
        );
        let h = parse_response(&mut buf, &Method::GET, &mut Vec::new(), &mut None)
            .unwrap()
            .unwrap();
        assert_eq!(h.status, 200);
        assert_eq!(h.framing, Framing::Length(2));
        assert!(h.keep_alive);
        let all: Vec<_> = h.headers.get_all("x-a").iter().collect();
        assert_eq!(all, ["1", "2"]);
        assert_eq!(&buf[..], b"ok");
    }

    #[test]
    fn partial_heads_wait_and_oversized_ones_fail() {
        assert!(
            parse("HTTP/1.1 200 OK\r\nA: b\r\n", Method::GET)
                .unwrap()
                .is_none()
        );
        let big = format!("HTTP/1.1 200 OK\r\nA: {}", "x".repeat(MAX_RESPONSE_HEAD));
        assert!(matches!(parse(&big, Method::GET), Err(Error::HeadTooLarge)));
        assert!(matches!(
            parse("HTTP/1.1 2000 OK\r\n\r\n", Method::GET),
            Err(Error::Parse(_))
        ));
        assert!(parse("garbage\r\n\r\n", Method::GET).is_err());
    }

    #[test]
    fn framing_follows_rfc_9112_section_6_3() {
        let f = |raw: &str| head(raw).framing;
        assert_eq!(
            f("HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\n"),
            Framing::Empty
        );
        assert_eq!(f("HTTP/1.1 304 Not Modified\r\n\r\n"), Framing::Empty);
        assert_eq!(f("HTTP/1.1 100 Continue\r\n\r\n"), Framing::Empty);
        assert_eq!(
            f("HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"),
            Framing::Empty
        );
        assert_eq!(
            parse("HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n", Method::HEAD)
                .unwrap()
                .unwrap()
                .framing,
            Framing::Empty
        );
        assert_eq!(
            f("HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"),
            Framing::Chunked
        );
        let h = head("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, gzip\r\n\r\n");
        assert_eq!((h.framing, h.keep_alive), (Framing::Close, false));
        let h = head("HTTP/1.1 200 OK\r\n\r\n");
        assert_eq!((h.framing, h.keep_alive), (Framing::Close, false));
        // Both: chunked wins, the length is dropped, the connection is not reused.
        let h = head("HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n");
        assert_eq!((h.framing, h.keep_alive), (Framing::Chunked, false));
        assert!(!h.headers.contains_key("content-length"));
        // Repeated equal lengths are one length; differing ones are an error.
        assert_eq!(
            f("HTTP/1.1 200 OK\r\nContent-Length: 4, 4\r\nContent-Length: 4\r\n\r\n"),
            Framing::Length(4)
        );
        for bad in ["4, 5", "-1", "0x10", "", "99999999999999999999", "1 2"] {
            let raw = format!("HTTP/1.1 200 OK\r\nContent-Length: {bad}\r\n\r\n");
            assert!(
                matches!(parse(&raw, Method::GET), Err(Error::Framing(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn keep_alive_by_version_and_connection() {
        let k = |raw: &str| head(raw).keep_alive;
        assert!(k("HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\n"));
        assert!(!k(
            "HTTP/1.1 200 OK\r\nConnection: Close\r\nContent-Length: 1\r\n\r\n"
        ));
        assert!(!k(
            "HTTP/1.1 200 OK\r\nConnection: foo, close\r\nContent-Length: 1\r\n\r\n"
        ));
        assert!(!k("HTTP/1.0 200 OK\r\nContent-Length: 1\r\n\r\n"));
        assert!(k(
            "HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 1\r\n\r\n"
        ));
        // A plain `Connection` is read and left out of the map; one naming other fields
        // stays for the proxy to remove them.
        let h = head("HTTP/1.1 200 OK\r\nConnection: keep-alive\r\nContent-Length: 1\r\n\r\n");
        assert!(h.keep_alive && !h.headers.contains_key(header::CONNECTION));
        let h = head("HTTP/1.1 200 OK\r\nConnection: close, x-a\r\nContent-Length: 1\r\n\r\n");
        assert!(!h.keep_alive);
        assert_eq!(h.headers[header::CONNECTION], "close, x-a");
        // HTTP/1.0 has no chunked coding.
        let h = head("HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n");
        assert_eq!((h.framing, h.keep_alive), (Framing::Close, false));
    }

    #[test]
    fn request_heads_are_origin_form_with_the_framing_the_body_needs() {
        let enc = |method: Method, headers: &[(&str, &str)], body| {
            let mut map = HeaderMap::new();
            for (k, v) in headers {
                map.append(
                    HeaderName::from_bytes(k.as_bytes()).unwrap(),
                    HeaderValue::from_str(v).unwrap(),
                );
            }
            let mut out = Vec::new();
            let f = encode_request(&mut out, &method, "/a?b=1", &map, body);
            (String::from_utf8(out).unwrap(), f)
        };
        let (text, f) = enc(Method::GET, &[("host", "x")], (true, Some(0)));
        assert_eq!(text, "GET /a?b=1 HTTP/1.1\r\nhost: x\r\n\r\n");
        assert_eq!(f.unwrap(), BodyFraming::None);
        let (text, f) = enc(Method::POST, &[], (true, Some(0)));
        assert_eq!(text, "POST /a?b=1 HTTP/1.1\r\ncontent-length: 0\r\n\r\n");
        assert_eq!(f.unwrap(), BodyFraming::None);
        let (text, f) = enc(Method::PUT, &[("content-length", "5")], (false, Some(5)));
        assert_eq!(text, "PUT /a?b=1 HTTP/1.1\r\ncontent-length: 5\r\n\r\n");
        assert_eq!(f.unwrap(), BodyFraming::Length(5));
        let (text, f) = enc(Method::POST, &[], (false, Some(7)));
        assert!(text.ends_with("content-length: 7\r\n\r\n"));
        assert_eq!(f.unwrap(), BodyFraming::Length(7));
        let (text, f) = enc(Method::POST, &[], (false, None));
        assert!(text.ends_with("transfer-encoding: chunked\r\n\r\n"));
        assert_eq!(f.unwrap(), BodyFraming::Chunked);
        let (_, f) = enc(
            Method::POST,
            &[("content-length", "5"), ("content-length", "6")],
            (false, None),
        );
        assert!(matches!(f, Err(Error::RequestLength)));
        // A repeated equal length is written once.
        let (text, _) = enc(
            Method::POST,
            &[("content-length", "5"), ("content-length", "5")],
            (false, Some(5)),
        );
        assert_eq!(text.matches("content-length").count(), 1);
    }
}
