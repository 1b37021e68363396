//! Host patterns and path globs as written in `hosts = [...]` and `paths = [...]`.
//! They are parsed when the file is read, so a bad pattern is reported with its position
//! and matching on the request path never has to deal with malformed patterns.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr};

use serde::{Deserialize, Deserializer, Serialize, Serializer, de};

/// `api.example.com`, `*.example.com`, either with an optional `:port`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct HostPattern {
    /// Lower-case host name or IP literal (without brackets). For a wildcard this is the
    /// suffix including its leading dot (`.example.com`).
    pub(crate) host: String,
    pub(crate) wildcard: bool,
    pub(crate) port: Option<u16>,
}

impl HostPattern {
    pub fn parse(s: &str) -> Result<Self, String> {
        let (host, port) = split_host_port(s)
            .ok_or_else(|| format!("invalid host pattern {s:?}: expected host or host:port"))?;
        let port = match port {
            None => None,
            Some(p) => Some(
                p.parse::<u16>()
                    .ok()
                    .filter(|p| *p != 0)
                    .ok_or_else(|| format!("invalid port in host pattern {s:?}"))?,
            ),
        };
        let host = host.trim_end_matches('.').to_ascii_lowercase();
        let (wildcard, name) = match host.strip_prefix("*.") {
            Some(rest) => (true, rest),
            None => (false, host.as_str()),
        };
        let ip = ip_literal(name);
        let is_ip = ip.is_some();
        let valid_name = !name.is_empty()
            && name.split('.').all(|label| {
                !label.is_empty()
                    && label.len() <= 63
                    && label
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            });
        if !(valid_name || (is_ip && !wildcard)) {
            return Err(format!(
                "invalid host pattern {s:?}: use an exact name, an IP address or \"*.suffix\" \
                 (a wildcard only as the whole first label)"
            ));
        }
        let host = match (wildcard, ip) {
            (true, _) => format!(".{name}"),
            // One spelling per address, the one requests are normalised to.
            (false, Some(ip)) => ip.to_string(),
            (false, None) => name.to_string(),
        };
        Ok(HostPattern {
            host,
            wildcard,
            port,
        })
    }

    /// `host` must already be lower-case without a trailing dot (see `route::normalize_host`).
    pub fn matches(&self, host: &str, port: u16) -> bool {
        if self.port.is_some_and(|p| p != port) {
            return false;
        }
        if self.wildcard {
            // `*.example.com` covers `a.example.com` and `a.b.example.com`, not `example.com`.
            host.len() > self.host.len() && host.ends_with(&self.host)
        } else {
            host == self.host
        }
    }
}

/// An IP literal in every spelling the system resolver accepts, so that a host cannot
/// dodge its upstream by writing its address differently: IPv6 (IPv4-mapped becomes IPv4),
/// and IPv4 as `inet_aton` reads it: one to four parts, each decimal, `0x` hex or
/// `0`-prefixed octal, the last filling the remaining bytes (`127.1`, `2130706433`,
/// `0x7f000001`, `0177.0.0.1`).
pub fn ip_literal(host: &str) -> Option<IpAddr> {
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Some(match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
            v4 => v4,
        });
    }
    if !host.bytes().next()?.is_ascii_digit() {
        return None;
    }
    let parts: Vec<&str> = host.split('.').collect();
    if parts.len() > 4 {
        return None;
    }
    let mut value: u32 = 0;
    for (i, part) in parts.iter().enumerate() {
        let n = if let Some(hex) = part.strip_prefix("0x").or_else(|| part.strip_prefix("0X")) {
            u32::from_str_radix(hex, 16).ok()?
        } else if part.len() > 1 && part.starts_with('0') {
            u32::from_str_radix(&part[1..], 8).ok()?
        } else {
            part.parse::<u32>().ok()?
        };
        if !part
            .bytes()
            .all(|b| b.is_ascii_hexdigit() || b == b'x' || b == b'X')
        {
            return None;
        }
        let last = i + 1 == parts.len();
        let room = if last { 8 * (4 - i as u32) } else { 8 };
        if room < 32 && n >> room != 0 {
            return None;
        }
        value = if last {
            value | n
        } else {
            value | (n << (8 * (3 - i as u32)))
        };
    }
    Some(IpAddr::V4(Ipv4Addr::from(value)))
}

/// Splits `host`, `host:port`, `[v6]` or `[v6]:port`. A bare IPv6 literal has no port.
fn split_host_port(s: &str) -> Option<(&str, Option<&str>)> {
    if let Some(rest) = s.strip_prefix('[') {
        let (h, after) = rest.split_once(']')?;
        return match after {
            "" => Some((h, None)),
            p => Some((h, Some(p.strip_prefix(':')?))),
        };
    }
    match s.matches(':').count() {
        0 => Some((s, None)),
        1 => s.split_once(':').map(|(h, p)| (h, Some(p))),
        _ => Some((s, None)),
    }
}

impl fmt::Display for HostPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = if self.wildcard {
            format!("*{}", self.host)
        } else if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        };
        match self.port {
            Some(p) => write!(f, "{name}:{p}"),
            None => f.write_str(&name),
        }
    }
}

/// A path glob: `/v1/orders/**`, `/v1/products/*`. Segments are literal, `*` (exactly one
/// non-empty segment) or `**` (any number of segments, including none).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathGlob {
    source: String,
    segments: Vec<Segment>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Literal(String),
    One,
    Any,
}

impl PathGlob {
    pub fn parse(s: &str) -> Result<Self, String> {
        let Some(rest) = s.strip_prefix('/') else {
            return Err(format!("invalid path glob {s:?}: it must start with '/'"));
        };
        if s.contains(['?', '#']) {
            return Err(format!(
                "invalid path glob {s:?}: globs match the path only, without query or fragment"
            ));
        }
        let mut segments = Vec::new();
        let count = rest.split('/').count();
        for (i, seg) in rest.split('/').enumerate() {
            // Requests are matched with dot segments resolved and slashes merged: such a
            // glob could never match.
            if matches!(seg, "." | "..") || (seg.is_empty() && i + 1 < count && count > 1) {
                return Err(format!(
                    "invalid path glob {s:?}: paths are matched with \"//\", \"/./\" and \
                     \"/../\" resolved, so a glob cannot contain them"
                ));
            }
            let parsed = match seg {
                "**" => Segment::Any,
                "*" => Segment::One,
                s if s.contains('*') => {
                    return Err(format!(
                        "invalid path glob {:?}: '*' and '**' must stand for a whole segment \
                         (\"/v1/*/items\", \"/v1/**\"), found {s:?}",
                        rest
                    ));
                }
                // Written as requests are matched: `/v1/%6Frders` is `/v1/orders`.
                lit if lit.to_ascii_uppercase().contains("%2F") => {
                    return Err(format!(
                        "invalid path glob {s:?}: paths are matched with \"%2F\" read as \"/\", \
                         so a glob cannot contain it; write the slash"
                    ));
                }
                lit => Segment::Literal(decode_unreserved(lit, false)),
            };
            // Two `**` in a row mean the same as one; keep matching linear.
            if parsed == Segment::Any && segments.last() == Some(&Segment::Any) {
                continue;
            }
            segments.push(parsed);
        }
        Ok(PathGlob {
            source: s.to_string(),
            segments,
        })
    }

    /// Matches a request path (no query) in O(path segments × pattern segments) whatever
    /// the pattern: runs on every request for every family, with paths chosen by clients.
    /// Walks the path's segments without collecting them.
    pub fn matches(&self, path: &str) -> bool {
        let path = path.strip_prefix('/').unwrap_or(path);
        match_segments(&self.segments, path.split('/'))
    }
}

/// Every segment other than `**` matches exactly one path segment, so when the pattern
/// fails after a `**`, only the latest `**` needs to take one more segment: an earlier
/// `**` taking more could only leave the later one less to choose from. That keeps one
/// resume point instead of a backtracking stack (the classic wildcard argument, here over
/// segments instead of characters).
///
/// The path as globs see it, so that spelling cannot move a request out of its family:
/// percent-encoded unreserved characters decoded and other escapes in upper case
/// (RFC 3986 §6.2.2.1-2), dot segments removed (§5.2.4), repeated slashes merged (as
/// nginx's `merge_slashes`). An encoded slash `%2F` is read as a slash too: RFC 3986 says
/// it is not one, but servers that decode the path before routing (Go's `net/http`
/// among them) count `/v1%2Forders` as `/v1/orders`, and a limit must not be dodged by
/// the difference. The request itself is forwarded as sent. Borrows when there
/// is nothing to do, which is almost always.
pub fn normalize_path(path: &str) -> std::borrow::Cow<'_, str> {
    let bytes = path.as_bytes();
    let dotted = bytes
        .windows(2)
        .any(|w| w[0] == b'/' && (w[1] == b'/' || w[1] == b'.'));
    if !dotted && !bytes.contains(&b'%') {
        return std::borrow::Cow::Borrowed(path);
    }
    let decoded = decode_unreserved(path, true);
    let mut out: Vec<&str> = Vec::new();
    let rest = decoded.strip_prefix('/').unwrap_or(&decoded);
    let mut segments = rest.split('/').peekable();
    // A trailing `.`, `..` or empty segment leaves the path ending in `/`, as RFC 3986
    // has it; globs treat `/a` and `/a/` alike anyway.
    let mut trailing = false;
    while let Some(seg) = segments.next() {
        let last = segments.peek().is_none();
        match seg {
            "." | "" => trailing = last,
            ".." => {
                out.pop();
                trailing = last;
            }
            s => {
                out.push(s);
                trailing = false;
            }
        }
    }
    let mut normal = String::with_capacity(decoded.len());
    for seg in &out {
        normal.push('/');
        normal.push_str(seg);
    }
    if trailing || out.is_empty() {
        normal.push('/');
    }
    std::borrow::Cow::Owned(normal)
}

/// `%41` → `A` for unreserved characters, and `%2F` → `/` when `slash`; other escapes
/// keep their meaning, in upper case.
fn decode_unreserved(s: &str, slash: bool) -> String {
    let b = s.as_bytes();
    let mut out = String::with_capacity(s.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && let (Some(h), Some(l)) = (
                b.get(i + 1).and_then(|c| (*c as char).to_digit(16)),
                b.get(i + 2).and_then(|c| (*c as char).to_digit(16)),
            )
        {
            let c = (h * 16 + l) as u8;
            if c.is_ascii_alphanumeric()
                || matches!(c, b'-' | b'.' | b'_' | b'~')
                || (slash && c == b'/')
            {
                out.push(c as char);
            } else {
                out.push('%');
                out.push_str(&format!("{c:02X}"));
            }
            i += 3;
            continue;
        }
        if b[i] == b'%' {
            // A `%` that starts no escape is written as one, so that a decoded character
            // after it cannot complete a new escape (`%%4161` → `%25A61`, not `%A61`): the
            // normal form stays one, however often it is normalised.
            out.push_str("%25");
            i += 1;
            continue;
        }
        // Paths reach here as valid URI text: ASCII, but stay safe on anything else.
        let ch = s[i..].chars().next().unwrap_or('\u{fffd}');
        out.push(ch);
        i += ch.len_utf8().max(1);
    }
    out
}

/// `parts` always yields at least one segment (`""` for an empty path).
fn match_segments(pat: &[Segment], mut parts: std::str::Split<'_, char>) -> bool {
    let mut at = 0;
    // After the latest `**`: the pattern index that follows it and the path where the
    // pattern resumes when the `**` swallows one more segment.
    let mut resume: Option<(usize, std::str::Split<'_, char>)> = None;
    loop {
        let advanced = match pat.get(at) {
            None => {
                // The path is used up, or only a trailing `/` is left.
                let mut rest = parts.clone();
                if match rest.next() {
                    None => true,
                    Some(last) => last.is_empty() && rest.next().is_none(),
                } {
                    return true;
                }
                false
            }
            Some(Segment::Any) => {
                if at + 1 == pat.len() {
                    return true;
                }
                at += 1;
                resume = Some((at, parts.clone()));
                true
            }
            Some(seg) => {
                let mut next = parts.clone();
                let ok = next.next().is_some_and(|part| match seg {
                    Segment::One => !part.is_empty(),
                    Segment::Literal(l) => l == part,
                    Segment::Any => false,
                });
                if ok {
                    parts = next;
                    at += 1;
                }
                ok
            }
        };
        if advanced {
            continue;
        }
        let Some((after, from)) = &mut resume else {
            return false;
        };
        if from.next().is_none() {
            return false;
        }
        at = *after;
        parts = from.clone();
    }
}

macro_rules! string_backed {
    ($t:ty) => {
        impl<'de> Deserialize<'de> for $t {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = String::deserialize(d)?;
                <$t>::parse(&s).map_err(de::Error::custom)
            }
        }
        impl Serialize for $t {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_str(self)
            }
        }
    };
}

impl fmt::Display for PathGlob {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.source)
    }
}

string_backed!(HostPattern);
string_backed!(PathGlob);

#[cfg(test)]
mod tests {
    use super::*;

    fn glob(s: &str) -> PathGlob {
        PathGlob::parse(s).unwrap()
    }

    #[test]
    fn globs_match_segments() {
        let g = glob("/v1/orders/**");
        assert!(g.matches("/v1/orders"));
        assert!(g.matches("/v1/orders/"));
        assert!(g.matches("/v1/orders/123/items"));
        assert!(!g.matches("/v1/ordersx"));
        assert!(!g.matches("/v1/other/orders"));

        let g = glob("/v1/products/*");
        assert!(g.matches("/v1/products/42"));
        assert!(!g.matches("/v1/products/"));
        assert!(!g.matches("/v1/products"));
        assert!(!g.matches("/v1/products/42/reviews"));

        let g = glob("/**/items/*");
        assert!(g.matches("/items/1"));
        assert!(g.matches("/a/b/items/1"));
        assert!(!g.matches("/a/b/items"));

        assert!(glob("/").matches("/"));
        assert!(!glob("/").matches("/a"));
        assert!(glob("/a/*/c").matches("/a/b/c"));
    }

    /// The matcher as it was, over a collected path: the walk over the segments must agree.
    fn reference(pat: &[Segment], parts: &[&str]) -> bool {
        match pat.split_first() {
            None => parts.is_empty() || parts == [""],
            Some((Segment::Any, rest)) => {
                rest.is_empty() || (0..=parts.len()).any(|skip| reference(rest, &parts[skip..]))
            }
            Some((seg, rest)) => match parts.split_first() {
                None => false,
                Some((part, more)) => {
                    let ok = match seg {
                        Segment::One => !part.is_empty(),
                        Segment::Literal(l) => l == part,
                        Segment::Any => unreachable!(),
                    };
                    ok && reference(rest, more)
                }
            },
        }
    }

    proptest::proptest! {
        #[test]
        fn the_walk_agrees_with_the_collected_matcher(
            pattern in "(/(a|b|\\*|\\*\\*)){1,8}",
            path in "(/(a|b|c|)){0,10}",
        ) {
            let g = glob(&pattern);
            let trimmed = path.strip_prefix('/').unwrap_or(&path);
            let parts: Vec<&str> = trimmed.split('/').collect();
            proptest::prop_assert_eq!(g.matches(&path), reference(&g.segments, &parts), "{} {}", pattern, path);
        }
    }

    /// Several `**` separated by literals, against a long path that almost matches: the
    /// backtracking matcher this replaced took seconds at 600 bytes and doubled with each
    /// `**`; the walk is a few hundred thousand steps. The bound is loose on purpose.
    #[test]
    fn many_double_stars_take_linear_time() {
        let path = "/a".repeat(2_000) + "/c";
        let started = tokio::time::Instant::now();
        for pattern in [
            "/**/a/**/a/**/a/**/a/**/a/**/b",
            "/**/*/**/*/**/*/**/*/**/b/**",
            "/v1/**/o/**/o/**/o/**/cancel",
        ] {
            assert!(!glob(pattern).matches(&path), "{pattern}");
        }
        assert!(glob("/**/a/**/a/**/c").matches(&path));
        assert!(
            started.elapsed() < std::time::Duration::from_secs(2),
            "took {:?}",
            started.elapsed()
        );
    }

    #[test]
    fn paths_are_normalised_for_matching() {
        for (raw, normal) in [
            ("/v1/orders/1", "/v1/orders/1"),
            ("//v1//orders/1", "/v1/orders/1"),
            ("/v1/./orders/1", "/v1/orders/1"),
            ("/v1/x/../orders/1", "/v1/orders/1"),
            ("/../../v1/orders", "/v1/orders"),
            ("/v1/%6Frders/%31", "/v1/orders/1"),
            ("/%76%31/orders", "/v1/orders"),
            ("/v1/orders/%2e%2e/admin", "/v1/admin"),
            ("/v1/a%2fb", "/v1/a/b"),
            ("/v1%2Forders%2F1", "/v1/orders/1"),
            ("/v1/x%2F..%2Forders", "/v1/orders"),
            ("/v1/a%2F%2Fb", "/v1/a/b"),
            ("/v1/%252F", "/v1/%252F"),
            ("/v1/%3f", "/v1/%3F"),
            ("/v1/caf%c3%a9", "/v1/caf%C3%A9"),
            ("/v1/orders/.", "/v1/orders/"),
            ("/v1/orders/..", "/v1/"),
            ("/.", "/"),
            ("/", "/"),
            ("/.well-known/x", "/.well-known/x"),
            // A `%` that starts no escape is one; a decoded character never completes a
            // new escape (found by fuzzing: normalising again changed the path).
            ("/v1/100%", "/v1/100%25"),
            ("/v1/%%4161", "/v1/%25A61"),
            ("/v1/%zz", "/v1/%25zz"),
        ] {
            assert_eq!(normalize_path(raw), normal, "{raw}");
            assert_eq!(normalize_path(normal), normal, "{normal}");
        }
        assert!(matches!(
            normalize_path("/v1/orders/1"),
            std::borrow::Cow::Borrowed(_)
        ));
        let g = glob("/v1/orders/**");
        for raw in [
            "//v1/orders/1",
            "/v1/./orders",
            "/x/../v1/orders/9",
            "/v1/%6frders/2",
        ] {
            assert!(g.matches(&normalize_path(raw)), "{raw}");
        }
        assert!(glob("/v1/%6Frders/*").matches(&normalize_path("/v1/orders/3")));
    }

    #[test]
    fn bad_globs_rejected() {
        assert!(PathGlob::parse("v1/orders").is_err());
        assert!(PathGlob::parse("/v1/ord*").is_err());
        assert!(PathGlob::parse("/v1/***").is_err());
        assert!(PathGlob::parse("/v1?x=1").is_err());
        assert!(PathGlob::parse("/v1/../admin").is_err());
        assert!(PathGlob::parse("/v1/./x").is_err());
        assert!(PathGlob::parse("/v1//x").is_err());
        assert!(PathGlob::parse("/v1/a%2fb").is_err());
        assert!(PathGlob::parse("/v1/orders/").is_ok());
        assert!(PathGlob::parse("/").is_ok());
    }

    #[test]
    fn ip_literals_in_every_spelling() {
        for s in [
            "127.0.0.1",
            "127.1",
            "127.0.1",
            "2130706433",
            "0x7f000001",
            "0X7F.1",
            "0177.0.0.1",
            "0x7f.0.0.0x1",
            "::ffff:127.0.0.1",
        ] {
            assert_eq!(ip_literal(s), Some("127.0.0.1".parse().unwrap()), "{s}");
        }
        assert_eq!(ip_literal("::1"), Some("::1".parse().unwrap()));
        for s in [
            "example.com",
            "1e100.net",
            "256.0.0.1",
            "1.2.3.4.5",
            "1.2.3.256",
            "4294967296",
            "08.1.1.1",
            "1..2",
            "",
            "0x",
            "1.2.3.-4",
        ] {
            assert_eq!(ip_literal(s), None, "{s}");
        }
        let p = HostPattern::parse("127.1:8080").unwrap();
        assert_eq!(p.host, "127.0.0.1");
        let p = HostPattern::parse("[::ffff:10.0.0.1]").unwrap();
        assert_eq!(p.host, "10.0.0.1");
        let p = HostPattern::parse("[2001:DB8:0::1]").unwrap();
        assert_eq!(p.host, "2001:db8::1");
    }

    #[test]
    fn hosts() {
        let p = HostPattern::parse("*.Example.com").unwrap();
        assert!(p.matches("a.example.com", 443));
        assert!(p.matches("a.b.example.com", 80));
        assert!(!p.matches("example.com", 80));
        assert!(!p.matches("badexample.com", 80));

        let p = HostPattern::parse("api.example.com:8443").unwrap();
        assert!(p.matches("api.example.com", 8443));
        assert!(!p.matches("api.example.com", 443));
        assert_eq!(p.to_string(), "api.example.com:8443");

        let p = HostPattern::parse("[::1]:8080").unwrap();
        assert!(p.matches("::1", 8080));
        assert_eq!(p.to_string(), "[::1]:8080");

        for bad in [
            "",
            "a*.example.com",
            "*.",
            "api.example.com:0",
            "a..b",
            "x:y",
            "*.1.2.3.4x:",
        ] {
            assert!(
                HostPattern::parse(bad).is_err(),
                "{bad:?} should be rejected"
            );
        }
    }
}
