//! RFC 9110 §7.6.1: connection-specific ("hop-by-hop") fields belong to one connection and
//! are never forwarded, in either direction.

use http::HeaderMap;
use http::header::{self, HeaderName, HeaderValue};

const FIXED: usize = 9;

/// The fixed hop-by-hop fields, as typed names built at compile time: removing by `&str`
/// would parse each name again on every request. A `static`, not a `const`: a `const`
/// array would be built and dropped again at every use.
static HOP_BY_HOP: [HeaderName; FIXED] = [
    header::CONNECTION,
    HeaderName::from_static("proxy-connection"),
    HeaderName::from_static("keep-alive"),
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::PROXY_AUTHORIZATION,
    header::PROXY_AUTHENTICATE,
];

/// The position of a name in [`HOP_BY_HOP`]: a `match` on the string compiles to a switch on
/// its length and one comparison, where comparing with each typed name took nine.
fn fixed_index(name: &str) -> Option<usize> {
    Some(match name {
        "connection" => 0,
        "proxy-connection" => 1,
        "keep-alive" => 2,
        "te" => 3,
        "trailer" => 4,
        "transfer-encoding" => 5,
        "upgrade" => 6,
        "proxy-authorization" => 7,
        "proxy-authenticate" => 8,
        _ => return None,
    })
}

/// Which of the fixed hop-by-hop fields a message carries, from one pass over the few
/// names present (cheap comparisons): each removal, and each other look at one of them,
/// is a hashed lookup, and most requests have none, most responses only `Connection`.
#[derive(Clone, Copy)]
pub(crate) struct HopByHop {
    present: [bool; FIXED],
}

impl HopByHop {
    pub(crate) fn scan(headers: &HeaderMap) -> HopByHop {
        let mut present = [false; FIXED];
        for k in headers.keys() {
            if let Some(i) = fixed_index(k.as_str()) {
                present[i] = true;
            }
        }
        HopByHop { present }
    }

    /// Whether the message has an `Upgrade` field.
    pub(crate) fn upgrade(&self) -> bool {
        self.present[6]
    }
}

/// Removes the fixed hop-by-hop fields and every field that `Connection` names. Returns
/// whether the message said `TE: trailers` (and only that): the one `TE` value HTTP/2
/// allows (RFC 9113 §8.2.2), which gRPC requires of every request, and which the
/// request path passes on.
#[must_use = "a request's `TE: trailers` is passed on"]
pub(crate) fn strip_hop_by_hop(headers: &mut HeaderMap) -> bool {
    strip_scanned(headers, HopByHop::scan(headers))
}

/// [`strip_hop_by_hop`], for a message already scanned (and not changed since).
#[must_use = "a request's `TE: trailers` is passed on"]
pub(crate) fn strip_scanned(headers: &mut HeaderMap, scanned: HopByHop) -> bool {
    let present = scanned.present;
    if !present.contains(&true) {
        return false;
    }
    let te_trailers = present[3] && {
        let mut te = headers.get_all(header::TE).iter();
        te.next()
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"trailers"))
            && te.next().is_none()
    };
    let plain = |v: &HeaderValue| {
        let v = v.as_bytes();
        v.eq_ignore_ascii_case(b"keep-alive") || v.eq_ignore_ascii_case(b"close")
    };
    if present[0] && !headers.get_all(header::CONNECTION).iter().all(plain) {
        // `Connection: keep-alive` or `close` names nothing beyond the fixed list: only
        // other tokens are parsed (and allocated).
        let named: Vec<HeaderName> = headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(str::trim)
            .filter(|t| !t.eq_ignore_ascii_case("keep-alive") && !t.eq_ignore_ascii_case("close"))
            .filter_map(|t| HeaderName::from_bytes(t.as_bytes()).ok())
            .collect();
        for name in &named {
            headers.remove(name);
        }
    }
    for (name, _) in HOP_BY_HOP.iter().zip(present).filter(|(_, p)| *p) {
        headers.remove(name);
    }
    if present[5] {
        // RFC 9112 §6.3: with Transfer-Encoding the length is the decoded body's, and a
        // Content-Length alongside it must be removed before forwarding. Left in, it
        // would frame the body we send re-encoded: truncated, with the rest of it read as
        // the next response.
        headers.remove(header::CONTENT_LENGTH);
    }
    te_trailers
}

/// RFC 9110 §7.6.3: a proxy adds itself to `Via` on what it forwards, with the version
/// of the protocol it received the message in.
pub(crate) fn append_via(headers: &mut HeaderMap, received: http::Version) {
    // Each a constant: `from_static` called at run time checks every byte again, twice a
    // request.
    let via = match received {
        http::Version::HTTP_09 => const { HeaderValue::from_static("0.9 sluice") },
        http::Version::HTTP_10 => const { HeaderValue::from_static("1.0 sluice") },
        http::Version::HTTP_2 => const { HeaderValue::from_static("2 sluice") },
        http::Version::HTTP_3 => const { HeaderValue::from_static("3 sluice") },
        _ => const { HeaderValue::from_static("1.1 sluice") },
    };
    headers.append(header::VIA, via);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_match_agrees_with_the_table() {
        for (i, name) in HOP_BY_HOP.iter().enumerate() {
            assert_eq!(fixed_index(name.as_str()), Some(i), "{name}");
        }
        assert_eq!(fixed_index("x-connection"), None);
    }

    #[test]
    fn strips_fixed_and_named_fields() {
        let mut h = HeaderMap::new();
        for (k, v) in [
            ("connection", "close, X-Session"),
            ("connection", "x-trace"),
            ("x-session", "1"),
            ("x-trace", "2"),
            ("keep-alive", "timeout=5"),
            ("proxy-connection", "keep-alive"),
            ("te", "trailers"),
            ("trailer", "x-sum"),
            ("transfer-encoding", "chunked"),
            ("content-length", "3"),
            ("upgrade", "websocket"),
            ("proxy-authorization", "Basic eDp5"),
            ("authorization", "Bearer keep-me"),
            ("x-other", "keep"),
        ] {
            h.append(HeaderName::from_static(k), HeaderValue::from_static(v));
        }
        assert!(strip_hop_by_hop(&mut h), "te: trailers was there");
        let left: Vec<_> = h.keys().map(|k| k.as_str()).collect();
        assert_eq!(left, ["authorization", "x-other"]);
        for te in ["gzip", "trailers, gzip"] {
            let mut h = HeaderMap::new();
            h.insert(header::TE, HeaderValue::from_static(te));
            assert!(!strip_hop_by_hop(&mut h), "{te}");
        }
    }
}
