//! Routing: a request's target (host, port, method, path, headers) → the upstream that
//! names the host, the first family that matches in file order, and the partition the
//! request is counted against. Pure lookups; nothing here does I/O (the key of displayed
//! partition hashes is read from the environment once).

use std::borrow::Cow;
use std::fmt;
use std::net::IpAddr;

use http::{HeaderMap, Method};
use sha2::{Digest, Sha256};

use crate::config::pattern::{ip_literal, normalize_path};
use crate::config::{Config, HostPattern, KeySource, Policy, Upstream};

/// Host index built once per config. Exact names win over wildcards, a longer wildcard
/// suffix wins over a shorter one, and a pattern with a port wins over one without —
/// the precedence nginx uses for `server_name`, so it surprises nobody.
#[derive(Debug, Default)]
pub struct Router {
    /// Fx rather than SipHash: the names come from the config, and a client's host is only
    /// looked up, never inserted, so it cannot crowd a bucket.
    exact: rustc_hash::FxHashMap<String, Vec<(Option<u16>, usize)>>,
    /// (suffix with leading dot, port, upstream index), longest suffix first.
    wildcards: Vec<(String, Option<u16>, usize)>,
}

impl Router {
    pub fn new(upstreams: &[Upstream]) -> Router {
        let mut r = Router::default();
        for (i, u) in upstreams.iter().enumerate() {
            for HostPattern {
                host,
                wildcard,
                port,
            } in &u.hosts
            {
                if *wildcard {
                    r.wildcards.push((host.clone(), *port, i));
                } else {
                    r.exact.entry(host.clone()).or_default().push((*port, i));
                }
            }
        }
        for v in r.exact.values_mut() {
            v.sort_by_key(|(port, _)| port.is_none());
        }
        r.wildcards.sort_by(|a, b| {
            b.0.len()
                .cmp(&a.0.len())
                .then(a.1.is_none().cmp(&b.1.is_none()))
        });
        r
    }

    /// Index of the upstream for `host` (already normalised) and `port`.
    pub(crate) fn upstream(&self, host: &str, port: u16) -> Option<usize> {
        let fits = |p: &Option<u16>| p.is_none_or(|p| p == port);
        if let Some((_, i)) = self
            .exact
            .get(host)
            .and_then(|c| c.iter().find(|(p, _)| fits(p)))
        {
            return Some(*i);
        }
        self.wildcards
            .iter()
            .find(|(suffix, p, _)| {
                fits(p) && host.len() > suffix.len() && host.ends_with(suffix.as_str())
            })
            .map(|(_, _, i)| *i)
    }
}

/// Lower-case, no trailing dot, no IPv6 brackets, IP literals in one spelling
/// ([`ip_literal`]): the form host patterns are stored in.
pub fn normalize_host(host: &str) -> String {
    normal_host(host).0.into_owned()
}

/// [`normalize_host`], borrowed from `host` when it is already in that form (most hosts
/// are: a request then allocates nothing for it), with the address when it is an IP
/// literal.
pub(crate) fn normal_host(host: &str) -> (Cow<'_, str>, Option<IpAddr>) {
    // Dots and brackets in any nesting (`[api.example.com.].`) until none is left, so
    // that normalising is done in one go: a dot left in would make the host miss its
    // upstream (found by fuzzing).
    let mut h = host;
    loop {
        let t = h.trim_end_matches('.');
        let t = t
            .strip_prefix('[')
            .and_then(|t| t.strip_suffix(']'))
            .unwrap_or(t);
        if t.len() == h.len() {
            break;
        }
        h = t;
    }
    // Dotted-decimal IPv4 as std reads it (four decimal parts, no leading zeros) is
    // already in the form `Display` writes: kept, not formatted again, which cost more
    // than the rest of a request's routing.
    if let Ok(v4) = h.parse::<std::net::Ipv4Addr>() {
        return (Cow::Borrowed(h), Some(IpAddr::V4(v4)));
    }
    match ip_literal(h) {
        Some(ip) => (Cow::Owned(ip.to_string()), Some(ip)),
        None if h.bytes().any(|b| b.is_ascii_uppercase()) => {
            (Cow::Owned(h.to_ascii_lowercase()), None)
        }
        None => (Cow::Borrowed(h), None),
    }
}

/// The host (IPv6 in brackets, as written) and port of a URI authority
/// (`[user@]host[:port]`), exactly as `Uri::host` and `Uri::port_u16` read them, in one
/// pass: those scan the authority again on every call, and a request's way through asked
/// four times (about 2,000 instructions, a fifteenth of a proxied request's).
pub fn authority_parts(authority: &str) -> (&str, Option<u16>) {
    let b = authority.as_bytes();
    // The host starts after the last `@`; its end is the first `:` after that, unless it
    // is bracketed. The port follows the last `:` of all, as `Uri::port` reads it.
    let (mut start, mut first_colon, mut last_colon) = (0, None, None);
    for (i, &c) in b.iter().enumerate() {
        // `:` to `@` in one comparison: letters, digits, `.` and `-` (most of any host)
        // are outside it.
        if c.wrapping_sub(b':') <= b'@' - b':' {
            if c == b'@' {
                (start, first_colon) = (i + 1, None);
            } else if c == b':' {
                first_colon = first_colon.or(Some(i));
                last_colon = Some(i);
            }
        }
    }
    let rest = &authority[start..];
    let host = if rest.starts_with('[') {
        rest.find(']').map_or(rest, |i| &rest[..=i])
    } else {
        &authority[start..first_colon.unwrap_or(b.len())]
    };
    let port = last_colon.and_then(|i| port_u16(&b[i + 1..]));
    (host, port)
}

/// A port as `u16::from_str` reads it (decimal digits, leading zeros and one leading `+`
/// allowed), without its generic radix handling: a port is read on every request.
fn port_u16(digits: &[u8]) -> Option<u16> {
    let digits = digits.strip_prefix(b"+").unwrap_or(digits);
    if digits.is_empty() {
        return None;
    }
    let mut n: u32 = 0;
    for &d in digits {
        let d = d.wrapping_sub(b'0');
        if d > 9 {
            return None;
        }
        n = n * 10 + u32::from(d);
        if n > u32::from(u16::MAX) {
            return None;
        }
    }
    u16::try_from(n).ok()
}

/// The subject a request is counted against: a 128-bit prefix of SHA-256 over the key's
/// value. Unsalted on purpose so every replica derives the same partition; the value
/// itself is never kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Partition(pub u128);

impl Partition {
    pub fn of(value: &[u8]) -> Partition {
        let digest = Sha256::digest(value);
        let mut first = [0u8; 16];
        first.copy_from_slice(&digest[..16]);
        Partition(u128::from_be_bytes(first))
    }

    /// Short form for `/buckets`, logs and `explain`: 12 hex digits of a keyed hash, so a
    /// reader of those cannot confirm a guessed low-entropy value (a tenant id, a short
    /// key) by hashing it. SHA-256 over key and a fixed-length input needs no HMAC: no
    /// length extension can change what is hashed.
    pub(crate) fn short(&self) -> String {
        let mut h = Sha256::new();
        h.update(display_key());
        h.update(self.0.to_be_bytes());
        let d = h.finalize();
        d[..6].iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// The environment variable that sets the key of displayed partition hashes: replicas and
/// `sluice explain` that share it show the same hash for the same value.
pub(crate) const PARTITION_SECRET_ENV: &str = "SLUICE_PARTITION_SECRET";

/// The key of displayed partition hashes: from [`PARTITION_SECRET_ENV`], else random for
/// this process.
fn display_key() -> &'static [u8; 32] {
    static KEY: std::sync::OnceLock<[u8; 32]> = std::sync::OnceLock::new();
    KEY.get_or_init(|| match std::env::var(PARTITION_SECRET_ENV) {
        Ok(secret) if !secret.is_empty() => Sha256::digest(secret.as_bytes()).into(),
        _ => rand::random(),
    })
}

impl fmt::Display for Partition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.short())
    }
}

/// Where a request goes. Indices point into the `Config` it was routed with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Route {
    pub upstream: usize,
    pub family: Option<usize>,
    /// `None`: the upstream's unkeyed partition (no key configured, or the header absent).
    pub partition: Option<Partition>,
    /// Its tenant within the family's queue, when the family names a tenant source and
    /// the request carries it.
    pub tenant: Option<u64>,
}

impl Router {
    /// Routes a request of `config` (the one this router was built from); `None` means
    /// no upstream names the host.
    pub fn route(
        &self,
        config: &Config,
        host: &str,
        port: u16,
        method: &Method,
        path: &str,
        headers: &HeaderMap,
    ) -> Option<Route> {
        let upstream = self.upstream(host, port)?;
        let u = &config.upstreams[upstream];
        let path = normalize_path(path);
        let family = u.families.iter().position(|f| f.matches(method, &path));
        let partition = u.key.as_ref().and_then(|k| partition_of(k, headers));
        let tenant = family
            .and_then(|f| u.families[f].tenant.as_ref())
            .and_then(|t| tenant_of(t, headers));
        Some(Route {
            upstream,
            family,
            partition,
            tenant,
        })
    }
}

impl Route {
    /// The policy this route runs under in `config`: its family's, else its upstream's.
    pub(crate) fn policy<'c>(&self, config: &'c Config) -> &'c Policy {
        let u = &config.upstreams[self.upstream];
        self.family.map_or(&u.policy, |f| &u.families[f].policy)
    }
}

/// Metric labels for a route of `config`: `("unmatched", "-")` when there is none.
pub(crate) fn labels<'c>(config: &'c Config, route: Option<&Route>) -> (&'c str, &'c str) {
    match route {
        None => ("unmatched", "-"),
        Some(r) => {
            let u = &config.upstreams[r.upstream];
            let f = r.family.map_or("-", |f| u.families[f].name.as_str());
            (u.name.as_str(), f)
        }
    }
}

/// A tenant as a keyed hash of its value: SipHash with this process's random key, so
/// values a client chooses cannot be made to collide, and the value is not kept.
fn tenant_of(source: &KeySource, headers: &HeaderMap) -> Option<u64> {
    use std::hash::BuildHasher;
    static KEY: std::sync::OnceLock<std::collections::hash_map::RandomState> =
        std::sync::OnceLock::new();
    match source {
        KeySource::Header(name) => {
            let value = headers.get(name)?;
            Some(KEY.get_or_init(Default::default).hash_one(value.as_bytes()))
        }
    }
}

fn partition_of(key: &KeySource, headers: &HeaderMap) -> Option<Partition> {
    match key {
        KeySource::Header(name) => {
            let mut values = headers.get_all(name).iter().peekable();
            values.peek()?;
            // Several fields of one name count as one subject, joined as a list would be.
            let mut hasher_input = Vec::new();
            for (i, v) in values.enumerate() {
                if i > 0 {
                    hasher_input.extend_from_slice(b", ");
                }
                hasher_input.extend_from_slice(v.as_bytes());
            }
            Some(Partition::of(&hasher_input))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONF: &str = r#"
[[upstream]]
name = "market"
hosts = ["api.market.example", "*.market.example", "*.eu.market.example:8443"]
key = "header:Authorization"
  [[upstream.family]]
  name = "orders"
  methods = ["POST", "put"]
  paths = ["/v1/orders/**"]
  [[upstream.family]]
  name = "catalog"
  paths = ["/v1/catalog/**", "/v1/products/*"]
  [[upstream.family]]
  name = "orders-read"
  paths = ["/v1/orders/**"]

[[upstream]]
name = "eu"
hosts = ["*.eu.market.example"]

[[upstream]]
name = "pinned"
hosts = ["api.market.example:8080"]
"#;

    fn conf() -> Config {
        Config::parse(CONF, "test.toml").unwrap()
    }

    fn route(c: &Config, host: &str, port: u16, m: &str, path: &str) -> (String, String) {
        let m = Method::from_bytes(m.as_bytes()).unwrap();
        let r = Router::new(&c.upstreams).route(c, host, port, &m, path, &HeaderMap::new());
        let (u, f) = labels(c, r.as_ref());
        (u.to_string(), f.to_string())
    }

    #[test]
    fn hosts_and_precedence() {
        let c = conf();
        let r = |h: &str, p: u16| route(&c, h, p, "GET", "/").0;
        assert_eq!(r("api.market.example", 443), "market");
        assert_eq!(r("api.market.example", 8080), "pinned");
        assert_eq!(r("x.market.example", 80), "market");
        assert_eq!(r("x.eu.market.example", 80), "eu");
        assert_eq!(r("x.eu.market.example", 8443), "market");
        assert_eq!(r("market.example", 80), "unmatched");
        assert_eq!(r("other.example", 80), "unmatched");
    }

    #[test]
    fn families_first_match_in_file_order() {
        let c = conf();
        let f = |m: &str, p: &str| route(&c, "api.market.example", 443, m, p).1;
        assert_eq!(f("POST", "/v1/orders/1"), "orders");
        assert_eq!(f("PUT", "/v1/orders"), "orders");
        assert_eq!(f("GET", "/v1/orders/1"), "orders-read");
        assert_eq!(f("GET", "/v1/products/7"), "catalog");
        assert_eq!(f("GET", "/v1/products/7/x"), "-");
        assert_eq!(f("DELETE", "/v1/catalog"), "catalog");
    }

    #[test]
    fn partition_is_stable_and_keyed() {
        let c = conf();
        let router = Router::new(&c.upstreams);
        let mut h = HeaderMap::new();
        h.insert("authorization", "Bearer live_abc".parse().unwrap());
        let r1 = router
            .route(&c, "api.market.example", 443, &Method::GET, "/", &h)
            .unwrap();
        let r2 = router
            .route(&c, "api.market.example", 443, &Method::GET, "/", &h)
            .unwrap();
        assert_eq!(r1.partition, r2.partition);
        // The same value hashes the same everywhere: pin the digest.
        assert_eq!(Partition::of(b"Bearer live_abc"), r1.partition.unwrap());
        // What is shown is keyed: never the digest's own prefix.
        assert_ne!(Partition::of(b"abc").short(), "ba7816bf8f01");
        assert_eq!(Partition::of(b"abc").short().len(), 12);
        assert_eq!(Partition::of(b"abc").short(), Partition::of(b"abc").short());

        h.insert("authorization", "Bearer test_abc".parse().unwrap());
        let r3 = router
            .route(&c, "api.market.example", 443, &Method::GET, "/", &h)
            .unwrap();
        assert_ne!(r1.partition, r3.partition);

        let none = router.route(
            &c,
            "api.market.example",
            443,
            &Method::GET,
            "/",
            &HeaderMap::new(),
        );
        assert_eq!(none.unwrap().partition, None);
    }

    #[test]
    fn normalizes() {
        assert_eq!(normalize_host("API.Example.com."), "api.example.com");
        // Spellings std's IPv4 parser refuses still reach the canonical form.
        for (h, want) in [
            ("127.000.0.1", "127.0.0.1"),
            ("010.0.0.1", "8.0.0.1"),
            ("127.1", "127.0.0.1"),
            ("[127.0.0.1].", "127.0.0.1"),
        ] {
            assert_eq!(normalize_host(h), want, "{h}");
        }
        for ip in [
            [0, 0, 0, 0],
            [127, 0, 0, 1],
            [255, 255, 255, 255],
            [10, 20, 30, 40],
        ] {
            let text = std::net::Ipv4Addr::from(ip).to_string();
            assert_eq!(normalize_host(&text), text);
        }
        assert_eq!(normalize_host("[::1]"), "::1");
        assert_eq!(normalize_host("[API.Example.com.]"), "api.example.com");
        assert_eq!(normalize_host("[::1.]"), "::1");
        assert_eq!(normalize_host("[API.Example.com.]."), "api.example.com");
        assert_eq!(normalize_host("[[::1]]"), "::1");
    }

    /// The borrowed reading is the owned one, borrows when nothing changes, and names the
    /// address exactly when the normal form parses as one (what the egress rules check).
    #[test]
    fn normal_host_borrows_what_is_already_normal() {
        for (h, borrows) in [
            ("api.example.com", true),
            ("api.example.com.", true),
            ("127.0.0.1", true),
            ("1.2.3.4.5", true),
            ("", true),
            ("API.example.com", false),
            ("127.1", false),
            ("0x7f000001", false),
            ("[::1]", false),
            ("[::ffff:10.0.0.1]", false),
            ("::1", false),
            ("[API.Example.com.].", false),
        ] {
            let (normal, ip) = normal_host(h);
            let owned = normalize_host(h);
            assert_eq!(normal, owned, "{h}");
            assert_eq!(ip, owned.parse::<IpAddr>().ok(), "{h}");
            assert_eq!(matches!(normal, Cow::Borrowed(_)), borrows, "{h}");
        }
    }

    proptest::proptest! {
        /// Whatever authority `http` accepts, the one-pass reading agrees with its own
        /// `host()` and `port_u16()`.
        #[test]
        fn authority_parts_agree_with_the_uri(text in "([a-z:]{0,3}@){0,2}([a-z0-9.-]{0,6}|\\[[0-9a-f:]{2,6}\\])(:[0-9+]{0,6}){0,2}") {
            if let Ok(uri) = format!("http://{text}/").parse::<http::Uri>() {
                let a = uri.authority().map_or("", |a| a.as_str());
                proptest::prop_assert_eq!(
                    authority_parts(a),
                    (uri.host().unwrap_or(""), uri.port_u16()),
                    "{}", a
                );
            }
        }
    }

    proptest::proptest! {
        /// The hand-written reading agrees with std's on any text near its form.
        #[test]
        fn ports_read_as_std_does(text in "\\+?[0-9]{0,7}|[0-9+ -]{0,7}") {
            proptest::prop_assert_eq!(port_u16(text.as_bytes()), text.parse::<u16>().ok(), "{}", text);
        }
    }

    #[test]
    fn ports_of_the_edges() {
        for text in ["0", "65535", "65536", "+80", "++80", "-1", "00080", ""] {
            assert_eq!(port_u16(text.as_bytes()), text.parse().ok(), "{text}");
        }
    }

    #[test]
    fn authority_parts_of_the_usual_forms() {
        for (a, want) in [
            ("api.example", ("api.example", None)),
            ("127.0.0.1:8080", ("127.0.0.1", Some(8080))),
            ("[::1]:443", ("[::1]", Some(443))),
            ("[::1]", ("[::1]", None)),
            ("user:pw@host:81", ("host", Some(81))),
            ("user:pw@host", ("host", None)),
            ("host:", ("host", None)),
            ("a@b@c:1", ("c", Some(1))),
            ("h:0008080", ("h", Some(8080))),
        ] {
            assert_eq!(authority_parts(a), want, "{a}");
        }
    }
}
