//! The bodies of the fuzz targets, shared by the fuzzers (fuzz/fuzz_targets/) and by
//! tests/fuzz_corpus.rs, which replays every committed input on stable on each test run.
//! Each takes arbitrary bytes and checks what must hold for any input, beyond not
//! panicking.

use std::time::{Duration, UNIX_EPOCH};

use http::{HeaderMap, HeaderName, HeaderValue, Method};
use sluice::{Action, ClassifyRule, Config, ConfigError};
use sluice::{HostPattern, PathGlob, ip_literal, normalize_path};
use sluice::{Router, normalize_host};
use sluice::{needs_body, server_hint};

/// The config loader, and what a valid config goes on to build: routes, limiter plans,
/// the redacted `/config` view and `explain`.
pub fn config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match Config::parse(text, "fuzz.toml") {
        Ok(config) => {
            let _ = config.to_redacted_json();
            let metrics =
                sluice::Metrics::new(prometheus::Registry::new()).expect("fresh registry");
            let _ = sluice::plans(&config, &metrics);
            let mut headers = HeaderMap::new();
            headers.insert("authorization", HeaderValue::from_static("Bearer k"));
            let router = Router::new(&config.upstreams);
            for u in &config.upstreams {
                for h in &u.hosts {
                    let host = h.to_string().replace('*', "a");
                    let url = format!("http://{host}/v1/orders/1");
                    if let Ok(uri) = url.parse() {
                        let _ = sluice::explain(&config, &Method::POST, &uri, &headers);
                    }
                    let bare = normalize_host(host.rsplit_once(':').map_or(&*host, |(h, _)| h));
                    let _ = router.route(&config, &bare, 443, &Method::GET, "/v1/a/../b", &headers);
                }
            }
        }
        Err(ConfigError::Invalid { line, col, .. }) => {
            // The place named is in the file (or just past its end).
            let lines = text.split('\n').count();
            assert!(line >= 1 && line <= lines + 1, "line {line} of {lines}");
            assert!(col >= 1, "col {col}");
        }
        Err(ConfigError::Read { .. }) => unreachable!("parse reads no file"),
    }
}

/// Path globs and normalisation, host patterns and host normalisation. The first line is
/// a glob, the second a request path, the third a host pattern, the fourth a host.
pub fn patterns(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let mut lines = text.split('\n');
    let glob = lines.next().unwrap_or_default();
    let raw_path = lines.next().unwrap_or_default();
    let path = format!("/{}", raw_path.trim_start_matches('/'));

    let normal = normalize_path(&path);
    assert_eq!(
        normalize_path(&normal),
        normal,
        "normalising twice changes nothing"
    );
    assert!(normal.starts_with('/'), "{normal:?}");
    assert!(!normal.contains("//"), "{normal:?}");
    assert!(
        !normal.split('/').any(|s| s == "." || s == ".."),
        "{normal:?}"
    );
    if let Ok(g) = PathGlob::parse(glob) {
        // Terminates whatever the pattern (linear time is asserted in pattern.rs).
        let _ = g.matches(&normal);
        let everything = PathGlob::parse("/**").expect("valid");
        assert!(everything.matches(&normal));
    }

    let pattern = lines.next().unwrap_or_default();
    let host = lines.next().unwrap_or_default();
    let h = normalize_host(host);
    assert_eq!(
        normalize_host(&h),
        h,
        "normalising a host twice changes nothing"
    );
    if let Some(ip) = ip_literal(host) {
        assert_eq!(h, ip.to_string());
    }
    if let Ok(p) = HostPattern::parse(pattern) {
        let _ = p.matches(&h, 443);
        // What a pattern prints is what it parses back to.
        assert_eq!(HostPattern::parse(&p.to_string()).as_ref(), Ok(&p));
    }
}

const HINT_HEADERS: [&str; 4] = [
    "retry-after",
    "ratelimit-reset",
    "x-ratelimit-reset",
    "date",
];

/// The Retry-After / RateLimit-Reset / X-RateLimit-Reset / Date parsers: one value per
/// line, in that order; the first 8 bytes set the wall clock.
pub fn hints(data: &[u8]) {
    let (clock, rest) = data.split_at(data.len().min(8));
    let mut secs = [0u8; 8];
    secs[..clock.len()].copy_from_slice(clock);
    // Any instant up to the year 9999, as SystemTime allows everywhere.
    let now = UNIX_EPOCH + Duration::from_secs(u64::from_le_bytes(secs) % 253_402_300_800);
    let mut h = HeaderMap::new();
    for (name, value) in HINT_HEADERS.iter().zip(rest.split(|b| *b == b'\n')) {
        if let Ok(v) = HeaderValue::from_bytes(value) {
            h.insert(HeaderName::from_static(name), v);
        }
    }
    let hint = server_hint(&h, now);
    if let Some(v) = h.get("retry-after").and_then(|v| v.to_str().ok())
        && let Ok(n) = v.trim().parse::<u64>()
    {
        assert_eq!(hint.map(|h| h.wait), Some(Duration::from_secs(n)));
    }
}

/// The 429 classifier: a status byte pair, then rule fields and the body separated by NUL
/// bytes (JSON pointer, value to equal, substring, body).
pub fn classify(data: &[u8]) {
    if data.len() < 3 {
        return;
    }
    let status = 100 + u16::from_le_bytes([data[0], data[1]]) % 500;
    let action = match data[2] % 3 {
        0 => Action::Retry,
        1 => Action::Cooldown,
        _ => Action::Fail,
    };
    let mut fields = data[3..].splitn(4, |b| *b == 0);
    let mut text = || {
        fields
            .next()
            .map(|f| String::from_utf8_lossy(f).into_owned())
    };
    let (pointer, equals, needle) = (text(), text(), text());
    let body = fields_rest(data);
    let rules = vec![
        ClassifyRule {
            status: Some(status),
            json: pointer.filter(|p| p.starts_with('/')),
            equals: equals.into_iter().collect(),
            body_contains: None,
            action,
        },
        ClassifyRule {
            status: None,
            json: None,
            equals: Vec::new(),
            body_contains: needle.filter(|n| !n.is_empty()),
            action,
        },
    ];
    let with_body = sluice::classify(&rules, status, Some(body));
    let _ = sluice::classify(&rules, status, None);
    let _ = needs_body(&rules, status);
    assert!(
        status != 429 || with_body.is_some(),
        "a 429 always means something"
    );
}

/// What follows the third NUL byte after the header bytes: the body.
fn fields_rest(data: &[u8]) -> &[u8] {
    let mut rest = &data[3..];
    for _ in 0..3 {
        match rest.iter().position(|b| *b == 0) {
            Some(i) => rest = &rest[i + 1..],
            None => return &[],
        }
    }
    rest
}

/// The upstream response codec: a head parsed from bytes as they arrive in pieces
/// (at every split of the input) is the head parsed from them at once, and so is the
/// chunked body decoded after it; nothing panics.
pub fn response(data: &[u8]) {
    use bytes::BytesMut;
    use sluice::h1::chunked::{Decoded, Decoder};
    use sluice::h1::{Framing, parse_response};

    // What a response gives: its status, fields, framing and (when chunked) the body's
    // bytes, or the first error; and how much of the input was left over. `spare`: a map
    // a previous response left, which must not show through.
    fn run(data: &[u8], step: usize, mut spare: Option<HeaderMap>) -> (String, usize) {
        let mut buf = BytesMut::new();
        let mut fed = 0;
        let mut spans = Vec::new();
        let head = loop {
            match parse_response(&mut buf, &Method::GET, &mut spans, &mut spare) {
                Ok(Some(h)) => break h,
                Ok(None) if fed < data.len() => {
                    let n = step.min(data.len() - fed);
                    buf.extend_from_slice(&data[fed..fed + n]);
                    fed += n;
                }
                Ok(None) => return ("incomplete head".into(), 0),
                Err(e) => return (format!("head error: {e}"), 0),
            }
        };
        let mut out = format!("{} {:?} {:?}", head.status, head.headers, head.framing);
        if head.framing == Framing::Chunked {
            let mut d = Decoder::default();
            let mut body = Vec::new();
            loop {
                match d.decode(&mut buf) {
                    Ok(Decoded::Data(b)) => body.extend_from_slice(&b),
                    Ok(Decoded::End(t)) => {
                        out += &format!(" body {body:?} trailers {t:?}");
                        break;
                    }
                    Ok(Decoded::More) if fed < data.len() => {
                        let n = step.min(data.len() - fed);
                        buf.extend_from_slice(&data[fed..fed + n]);
                        fed += n;
                    }
                    Ok(Decoded::More) => return (out + " incomplete body", 0),
                    Err(e) => return (out + &format!(" body error: {e}"), 0),
                }
            }
        }
        (out, buf.len() + data.len() - fed)
    }

    let whole = run(data, data.len().max(1), None);
    let stale = || {
        let mut m = HeaderMap::new();
        m.insert("x-stale", HeaderValue::from_static("1"));
        m.append(http::header::CONTENT_LENGTH, HeaderValue::from_static("9"));
        Some(m)
    };
    for step in [1, 2, 7, 64] {
        assert_eq!(run(data, step, None), whole, "fed {step} bytes at a time");
        assert_eq!(
            run(data, step, stale()),
            whole,
            "fed {step} at a time, a map reused"
        );
    }
}

/// The request target's authority as the proxy reads it (`route::authority_parts`, which
/// routing and the egress check use) against the `http` crate's own reading (which the
/// pooled client's connector dials), for whatever hyper accepts as an authority or an
/// absolute URI: a request must never be checked under one host and sent to another.
pub fn authority(data: &[u8]) {
    use http::Uri;
    use http::uri::Authority;
    use sluice::authority_parts;

    let check = |a: &Authority| {
        assert_eq!(
            authority_parts(a.as_str()),
            (a.host(), a.port_u16()),
            "{:?}",
            a.as_str()
        );
    };
    if let Ok(a) = Authority::try_from(data) {
        check(&a);
    }
    if let Ok(uri) = Uri::try_from(data)
        && let Some(a) = uri.authority()
    {
        check(a);
    }
}

/// The request head written to a plain-HTTP upstream: for any method, origin-form target
/// and fields, the bytes parse back as one complete HTTP/1.1 request with the same
/// method, target and fields, and with exactly the framing field the returned framing
/// says (a `Content-Length` that does not parse, or two that disagree, are refused).
/// Input: the first byte picks the body (empty, a known size, unknown), then lines:
/// method, target, and `name: value` fields.
pub fn request(data: &[u8]) {
    use sluice::h1::{BodyFraming, encode_request};

    let Some((&shape, rest)) = data.split_first() else {
        return;
    };
    let mut lines = rest.split(|&b| b == b'\n');
    let (Some(method), Some(target)) = (lines.next(), lines.next()) else {
        return;
    };
    let Ok(method) = Method::from_bytes(method) else {
        return;
    };
    let Ok(target) = http::uri::PathAndQuery::try_from(target) else {
        return;
    };
    if !target.as_str().starts_with('/') {
        return;
    }
    let mut headers = HeaderMap::new();
    for line in lines {
        let Some(colon) = line.iter().position(|&b| b == b':') else {
            continue;
        };
        let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(&line[..colon]),
            HeaderValue::from_bytes(line[colon + 1..].trim_ascii()),
        ) else {
            continue;
        };
        // Hop-by-hop: removed before a request gets here.
        if name == http::header::TRANSFER_ENCODING {
            continue;
        }
        headers.append(name, value);
    }
    let body = match shape % 3 {
        0 => (true, Some(0)),
        1 => (false, Some(u64::from(shape))),
        _ => (false, None),
    };
    let mut out = Vec::new();
    let lengths: Vec<&HeaderValue> = headers
        .get_all(http::header::CONTENT_LENGTH)
        .iter()
        .collect();
    let framing = match encode_request(&mut out, &method, target.as_str(), &headers, body) {
        Ok(f) => f,
        Err(_) => {
            let parsed: Vec<Option<u64>> = lengths
                .iter()
                .map(|v| std::str::from_utf8(v.as_bytes()).ok()?.trim().parse().ok())
                .collect();
            assert!(
                parsed.iter().any(Option::is_none) || parsed.windows(2).any(|w| w[0] != w[1]),
                "refused without a bad or disagreeing Content-Length: {lengths:?}"
            );
            return;
        }
    };
    let mut fields = [httparse::EMPTY_HEADER; 256];
    let mut req = httparse::Request::new(&mut fields);
    let parsed = req.parse(&out);
    assert!(
        matches!(parsed, Ok(httparse::Status::Complete(n)) if n == out.len()),
        "{parsed:?}: {}",
        String::from_utf8_lossy(&out)
    );
    assert_eq!(req.method, Some(method.as_str()));
    assert_eq!(req.path, Some(target.as_str()));
    assert_eq!(req.version, Some(1));
    let named = |n: &str| {
        req.headers
            .iter()
            .filter(|h| h.name.eq_ignore_ascii_case(n))
            .count()
    };
    let (cl, te) = (named("content-length"), named("transfer-encoding"));
    match framing {
        BodyFraming::Chunked => assert_eq!((cl, te), (0, 1)),
        BodyFraming::Length(_) => assert_eq!((cl, te), (1, 0)),
        BodyFraming::None => assert!(cl <= 1 && te == 0, "{cl} {te}"),
    }
    // Every other field goes out as it came, in order.
    let sent: Vec<(&str, &[u8])> = req
        .headers
        .iter()
        .filter(|h| {
            !h.name.eq_ignore_ascii_case("content-length")
                && !h.name.eq_ignore_ascii_case("transfer-encoding")
        })
        .map(|h| (h.name, h.value))
        .collect();
    let given: Vec<(&str, &[u8])> = headers
        .iter()
        .filter(|(n, _)| *n != http::header::CONTENT_LENGTH)
        .map(|(n, v)| (n.as_str(), v.as_bytes()))
        .collect();
    assert_eq!(sent, given);
}
