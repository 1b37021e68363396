//! Egress rules: which destinations sluice connects to. They are checked on the address a
//! name actually resolves to (so a name pointing at the metadata service is refused like
//! the literal address), by the one resolver the pooled client, plain-HTTP connections
//! and CONNECT tunnels share, and on literal addresses before a request is queued.
//!
//! The order, most specific first: sluice's own listeners are always refused; then
//! `[egress] deny`; then hosts an `[[upstream]]` names exactly and `[egress] allow` are
//! let through; then the built-in list ([`ip::builtin`]) is refused; everything else
//! passes. CONNECT also needs an allowed port (443, ports upstreams name, or
//! `[egress] connect_ports`).

mod budget;
mod dial;
pub(crate) mod ip;

pub(crate) use budget::Counted;
use budget::{Budget, NoDescriptor};

use parking_lot::RwLock;
use std::fmt;
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};

use http::Uri;
use hyper_util::rt::TokioIo;
use ipnet::IpNet;

use crate::config::{Config, HostPattern, PortRange};
use crate::route::normalize_host;
use ip::Class;

/// Why a destination is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Why {
    OwnListener,
    Configured,
    Builtin(Class),
    /// An IPv6 address carrying an IPv4 address that the rules refuse.
    Embeds(std::net::Ipv4Addr),
}

impl fmt::Display for Why {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Why::OwnListener => f.write_str("one of sluice's own listeners"),
            Why::Configured => f.write_str("in [egress] deny"),
            Why::Builtin(c) => write!(
                f,
                "{c}, refused unless [egress] allow or an [[upstream]] names it"
            ),
            Why::Embeds(v4) => write!(f, "an IPv6 form of {v4}, which the egress rules refuse"),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum EgressError {
    #[error("destination {addr} is {why}")]
    Denied { addr: SocketAddr, why: Why },
    #[error(
        "CONNECT to port {port} is not allowed: tunnels go to 443, to ports an [[upstream]] \
         names, or to [egress] connect_ports"
    )]
    Port { port: u16 },
    #[error("cannot resolve host: {0}")]
    Lookup(#[source] io::Error),
    #[error("host resolved to no addresses")]
    NoAddresses,
}

impl EgressError {
    /// A refusal by the rules, as opposed to a name that could not be resolved.
    pub(crate) fn is_refusal(&self) -> bool {
        matches!(self, EgressError::Denied { .. } | EgressError::Port { .. })
    }

    /// A copy, to take it out of the error that wraps it (an `io::Error` does not clone:
    /// a lookup failure keeps its kind and message).
    pub(crate) fn copy(&self) -> EgressError {
        match self {
            EgressError::Denied { addr, why } => EgressError::Denied {
                addr: *addr,
                why: *why,
            },
            EgressError::Port { port } => EgressError::Port { port: *port },
            EgressError::Lookup(e) => EgressError::Lookup(io::Error::new(e.kind(), e.to_string())),
            EgressError::NoAddresses => EgressError::NoAddresses,
        }
    }
}

/// The rules of one config; rebuilt on reload.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct Rules {
    deny: Vec<IpNet>,
    allow: Vec<IpNet>,
    connect_ports: Vec<PortRange>,
    /// Exact (not wildcard) host patterns of every upstream: named destinations.
    named: Vec<HostPattern>,
    /// Host patterns that name a port, which CONNECT may then open.
    with_port: Vec<HostPattern>,
    /// Host patterns that name no port: CONNECT may open port 80 to them, since what a
    /// tunnel to a configured upstream carries is served as HTTP with its limits, or
    /// refused (`proxy::sniff`), never carried blind unless it is TLS.
    without_port: Vec<HostPattern>,
}

impl Rules {
    pub(crate) fn new(config: &Config) -> Rules {
        let patterns = config.upstreams.iter().flat_map(|u| u.hosts.iter());
        Rules {
            deny: config.egress.deny.clone(),
            allow: config.egress.allow.clone(),
            connect_ports: config.egress.connect_ports.clone(),
            named: patterns.clone().filter(|p| !p.wildcard).cloned().collect(),
            with_port: patterns
                .clone()
                .filter(|p| p.port.is_some())
                .cloned()
                .collect(),
            without_port: patterns.filter(|p| p.port.is_none()).cloned().collect(),
        }
    }

    /// Whether CONNECT may open `host:port` (`host` normalised).
    pub(crate) fn connect_port(&self, host: &str, port: u16) -> Result<(), EgressError> {
        if self.connect_ports.iter().any(|r| r.contains(port))
            || self.with_port.iter().any(|p| p.matches(host, port))
            || (port == 80 && self.without_port.iter().any(|p| p.matches(host, port)))
        {
            return Ok(());
        }
        Err(EgressError::Port { port })
    }

    fn decide(&self, host: &str, ip: IpAddr, port: u16) -> Result<(), Why> {
        let embedded = ip::embedded_v4(ip);
        let candidates = || std::iter::once(ip).chain(embedded.iter().map(|v4| IpAddr::V4(*v4)));
        if candidates().any(|c| self.deny.iter().any(|n| n.contains(&c))) {
            return Err(Why::Configured);
        }
        if self.named.iter().any(|p| p.matches(host, port))
            || self.allow.iter().any(|n| n.contains(&ip))
        {
            return Ok(());
        }
        if let Some(class) = ip::builtin(ip) {
            return Err(Why::Builtin(class));
        }
        match embedded
            .iter()
            .find(|v4| ip::builtin(IpAddr::V4(**v4)).is_some())
        {
            Some(v4) => Err(Why::Embeds(*v4)),
            None => Ok(()),
        }
    }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// Name resolution, replaceable so tests can give a name a chosen address.
pub trait Lookup: Send + Sync + 'static {
    fn lookup(&self, host: String) -> BoxFuture<io::Result<Vec<IpAddr>>>;
}

/// The system resolver (getaddrinfo on a blocking thread, through tokio).
pub(crate) struct SystemLookup;

impl Lookup for SystemLookup {
    fn lookup(&self, host: String) -> BoxFuture<io::Result<Vec<IpAddr>>> {
        Box::pin(async move {
            let addrs = tokio::net::lookup_host((host.as_str(), 0)).await?;
            Ok(addrs.map(|a| a.ip()).collect())
        })
    }
}

/// Resolves and applies the egress rules. If any address of a name is forbidden the whole
/// name is refused: connecting to "the other" address would be a race we do not want to win.
#[derive(Clone)]
pub(crate) struct Resolver {
    lookup: Arc<dyn Lookup>,
    /// The live config's rules, for connections made below the request (pooled client).
    rules: Arc<RwLock<Arc<Rules>>>,
    /// The proxy and admin listeners, once bound.
    own: Arc<OnceLock<Vec<SocketAddr>>>,
    /// The descriptors upstream connections may take (see `budget`).
    budget: Arc<Budget>,
}

impl Default for Resolver {
    fn default() -> Self {
        Resolver::new(Arc::new(SystemLookup))
    }
}

impl Resolver {
    pub(crate) fn new(lookup: Arc<dyn Lookup>) -> Resolver {
        Resolver {
            lookup,
            rules: Arc::default(),
            own: Arc::default(),
            budget: Arc::new(Budget::new(usize::MAX)),
        }
    }

    /// How many upstream connections may be open at once from now on.
    pub(crate) fn set_upstream_cap(&self, cap: usize) {
        self.budget.set_cap(cap);
    }

    /// Upstream connections open now.
    pub(crate) fn upstream_connections(&self) -> usize {
        self.budget.open()
    }

    /// Connects to the first of `addrs` to answer (see `dial`), under the budget of
    /// upstream connections: the connection carries its place and gives it back when it
    /// closes.
    pub(crate) async fn connect(&self, addrs: &[SocketAddr]) -> io::Result<Counted> {
        let slot = self.budget.take().map_err(io::Error::other)?;
        Ok(Counted::new(dial::connect(addrs).await?, slot))
    }

    /// The rules connections use from now on.
    pub(crate) fn set_rules(&self, rules: Arc<Rules>) {
        *self.rules.write() = rules;
    }

    /// The listeners sluice serves on, never a destination.
    pub(crate) fn set_own(&self, addrs: Vec<SocketAddr>) {
        let _ = self.own.set(addrs);
    }

    fn rules(&self) -> Arc<Rules> {
        self.rules.read().clone()
    }

    /// Whether `rules` let a connection to `ip:port` through, for a request to `host`
    /// (normalised, see [`normalize_host`]).
    pub(crate) fn check(
        &self,
        rules: &Rules,
        host: &str,
        ip: IpAddr,
        port: u16,
    ) -> Result<(), EgressError> {
        let ip = ip::canonical(ip);
        let addr = SocketAddr::new(ip, port);
        if self.is_own(ip, port) {
            return Err(EgressError::Denied {
                addr,
                why: Why::OwnListener,
            });
        }
        rules
            .decide(host, ip, port)
            .map_err(|why| EgressError::Denied { addr, why })
    }

    /// A listener bound to a wildcard address is reached through every local address.
    fn is_own(&self, ip: IpAddr, port: u16) -> bool {
        let Some(own) = self.own.get() else {
            return false;
        };
        own.iter().any(|l| {
            l.port() == port
                && (ip::canonical(l.ip()) == ip
                    || ip.is_unspecified()
                    || (l.ip().is_unspecified() && is_local(ip)))
        })
    }

    /// The addresses of `host` (a name or an IP literal in any spelling) that `rules`
    /// allow (the live rules).
    pub(crate) async fn resolve(
        &self,
        host: &str,
        port: u16,
    ) -> Result<Vec<SocketAddr>, EgressError> {
        let host = normalize_host(host);
        let ips = match host.parse::<IpAddr>() {
            Ok(ip) => vec![ip],
            Err(_) => self
                .lookup
                .lookup(host.clone())
                .await
                .map_err(EgressError::Lookup)?,
        };
        if ips.is_empty() {
            return Err(EgressError::NoAddresses);
        }
        let rules = self.rules();
        ips.into_iter()
            .map(|ip| {
                self.check(&rules, &host, ip, port)?;
                Ok(SocketAddr::new(ip, port))
            })
            .collect()
    }
}

/// Whether `ip` is an address of this host: one it can bind to.
fn is_local(ip: IpAddr) -> bool {
    ip.is_loopback() || std::net::UdpSocket::bind(SocketAddr::new(ip, 0)).is_ok()
}

/// Whether `e` is sluice's own want of resources rather than the upstream's failure: its
/// own cap, or the kernel's refusal for want of descriptors (EMFILE, ENFILE) or memory
/// (ENOBUFS, ENOMEM).
pub(crate) fn is_local_failure(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if err.downcast_ref::<NoDescriptor>().is_some() {
            return true;
        }
        // Transparent, so its `source()` skips the io::Error it wraps.
        if let Some(ConnectError::Io(io)) = err.downcast_ref::<ConnectError>()
            && is_local_failure(io)
        {
            return true;
        }
        if let Some(io) = err.downcast_ref::<io::Error>() {
            if raw_is_local(io) {
                return true;
            }
            if let Some(inner) = io.get_ref()
                && is_local_failure(inner)
            {
                return true;
            }
        }
        cur = err.source();
    }
    false
}

#[cfg(unix)]
fn raw_is_local(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
    )
}

#[cfg(not(unix))]
fn raw_is_local(_: &io::Error) -> bool {
    false
}

/// Why a pooled connection could not be made.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ConnectError {
    #[error(transparent)]
    Egress(#[from] EgressError),
    #[error("the URL has no host")]
    NoHost,
    #[error(transparent)]
    Io(#[from] io::Error),
}

/// The pooled client's connector: every connection passes the live rules, with the port
/// known (which hyper-util's resolver interface does not give).
#[derive(Clone)]
pub(crate) struct Connector(pub Resolver);

impl tower_service::Service<Uri> for Connector {
    type Response = TokioIo<Counted>;
    type Error = ConnectError;
    type Future = BoxFuture<Result<Self::Response, ConnectError>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), ConnectError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let resolver = self.0.clone();
        Box::pin(async move {
            let host = uri
                .host()
                .filter(|h| !h.is_empty())
                .ok_or(ConnectError::NoHost)?;
            let default = if uri.scheme() == Some(&http::uri::Scheme::HTTPS) {
                443
            } else {
                80
            };
            let port = uri.port_u16().unwrap_or(default);
            let addrs = resolver.resolve(host, port).await?;
            Ok(TokioIo::new(resolver.connect(&addrs).await?))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_failures_are_told_from_the_upstreams() {
        let own: Box<dyn std::error::Error + Send + Sync> =
            Box::new(io::Error::other(NoDescriptor(3)));
        assert!(is_local_failure(&*own));
        let emfile = io::Error::from_raw_os_error(libc::EMFILE);
        assert!(is_local_failure(&emfile));
        let refused = io::Error::from_raw_os_error(libc::ECONNREFUSED);
        assert!(!is_local_failure(&refused));
    }

    fn rules(toml: &str) -> Rules {
        Rules::new(&Config::parse(toml, "t.toml").unwrap())
    }

    fn verdict(r: &Resolver, rules: &Rules, host: &str, addr: &str) -> Result<(), Why> {
        let a: SocketAddr = addr.parse().unwrap();
        match r.check(rules, host, a.ip(), a.port()) {
            Ok(()) => Ok(()),
            Err(EgressError::Denied { why, .. }) => Err(why),
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    fn defaults_refuse_local_and_metadata_destinations() {
        let r = Resolver::default();
        let rules = rules("");
        for addr in [
            "127.0.0.1:6379",
            "[::1]:80",
            "0.0.0.0:80",
            "169.254.169.254:80",
            "[fd00:ec2::254]:80",
            "100.100.100.200:80",
            "[::ffff:127.0.0.1]:80",
            "[64:ff9b::a9fe:a9fe]:80",
            "[::a9fe:a9fe]:80",
            "224.0.0.1:80",
        ] {
            assert!(verdict(&r, &rules, "x", addr).is_err(), "{addr}");
        }
        assert_eq!(
            verdict(&r, &rules, "x", "[2002:a9fe:a9fe::1]:80"),
            Err(Why::Embeds("169.254.169.254".parse().unwrap()))
        );
        for addr in ["93.184.216.34:443", "10.1.2.3:80", "[2001:db8::1]:443"] {
            assert_eq!(verdict(&r, &rules, "x", addr), Ok(()), "{addr}");
        }
    }

    #[test]
    fn named_upstreams_and_allow_widen_deny_narrows() {
        let r = Resolver::default();
        let rules = rules(
            r#"
            [egress]
            allow = ["127.0.0.2"]
            deny = ["10.0.0.0/8", "2001:db8::/32"]
            [[upstream]]
            name = "local"
            hosts = ["127.0.0.1:8080", "localhost"]
            [[upstream]]
            name = "wild"
            hosts = ["*.example.com"]
            "#,
        );
        assert_eq!(verdict(&r, &rules, "127.0.0.1", "127.0.0.1:8080"), Ok(()));
        assert!(verdict(&r, &rules, "127.0.0.1", "127.0.0.1:6379").is_err());
        assert_eq!(verdict(&r, &rules, "localhost", "127.0.0.1:6379"), Ok(()));
        assert_eq!(verdict(&r, &rules, "x", "127.0.0.2:6379"), Ok(()));
        // A wildcard names no address: a name under it that resolves to loopback is refused.
        assert!(verdict(&r, &rules, "a.example.com", "127.0.0.1:80").is_err());
        assert_eq!(
            verdict(&r, &rules, "x", "10.0.0.1:80"),
            Err(Why::Configured)
        );
        assert_eq!(
            verdict(&r, &rules, "x", "[::ffff:10.0.0.1]:80"),
            Err(Why::Configured)
        );
        assert_eq!(
            verdict(&r, &rules, "x", "[2002:a00:1::1]:80"),
            Err(Why::Configured)
        );
    }

    #[test]
    fn own_listeners_are_refused_whatever_names_them() {
        let r = Resolver::default();
        r.set_own(vec![
            "0.0.0.0:3128".parse().unwrap(),
            "127.0.0.1:9901".parse().unwrap(),
        ]);
        let rules = rules(
            r#"
            [egress]
            allow = ["0.0.0.0/0", "::/0"]
            [[upstream]]
            name = "local"
            hosts = ["127.0.0.1"]
            "#,
        );
        for addr in [
            "127.0.0.1:9901",
            "0.0.0.0:9901",
            "127.0.0.1:3128",
            "127.0.0.7:3128",
            "[::ffff:127.0.0.1]:3128",
            "0.0.0.0:3128",
        ] {
            assert_eq!(
                verdict(&r, &rules, "127.0.0.1", addr),
                Err(Why::OwnListener),
                "{addr}"
            );
        }
        assert_eq!(verdict(&r, &rules, "127.0.0.1", "127.0.0.1:8080"), Ok(()));
        // 127.0.0.7 is not where the admin listener is bound.
        assert_eq!(verdict(&r, &rules, "x", "127.0.0.7:9901"), Ok(()));
    }

    #[test]
    fn connect_ports() {
        let rules = rules(
            r#"
            [[upstream]]
            name = "a"
            hosts = ["api.example.com:8443", "*.example.org:9443"]
            "#,
        );
        assert!(rules.connect_port("anything.net", 443).is_ok());
        assert!(rules.connect_port("api.example.com", 8443).is_ok());
        assert!(rules.connect_port("x.example.org", 9443).is_ok());
        assert!(rules.connect_port("anything.net", 8443).is_err());
        assert!(rules.connect_port("api.example.com", 22).is_err());
        // Port 80 to a host an upstream names without a port: what the tunnel carries
        // is served as HTTP with its limits.
        let plain = super::tests::rules(
            "[[upstream]]\nname = \"p\"\nhosts = [\"plain.example.com\", \"*.example.net\"]\n",
        );
        assert!(plain.connect_port("plain.example.com", 80).is_ok());
        assert!(plain.connect_port("a.example.net", 80).is_ok());
        assert!(plain.connect_port("other.example.com", 80).is_err());
        assert!(plain.connect_port("plain.example.com", 8080).is_err());
        assert!(
            rules.connect_port("api.example.com", 80).is_err(),
            "named with 8443 only"
        );
        let custom = super::tests::rules("[egress]\nconnect_ports = [8443, \"9000-9009\"]\n");
        assert!(custom.connect_port("x", 8443).is_ok());
        assert!(custom.connect_port("x", 9009).is_ok());
        assert!(custom.connect_port("x", 9010).is_err());
        assert!(custom.connect_port("x", 443).is_err());
        for bad in ["[0]", "[\"9-8\"]", "[\"x\"]", "[70000]"] {
            assert!(
                Config::parse(&format!("[egress]\nconnect_ports = {bad}\n"), "t").is_err(),
                "{bad}"
            );
        }
    }

    #[tokio::test]
    async fn literals_in_any_spelling_skip_lookup_and_are_checked() {
        let r = Resolver::default();
        r.set_rules(Arc::new(rules("")));
        for host in [
            "169.254.169.254",
            "127.1",
            "2130706433",
            "0x7f000001",
            "[::ffff:7f00:1]",
        ] {
            assert!(
                matches!(r.resolve(host, 80).await, Err(EgressError::Denied { .. })),
                "{host}"
            );
        }
        let ok = r.resolve("93.184.216.34", 8080).await.unwrap();
        assert_eq!(ok, vec!["93.184.216.34:8080".parse().unwrap()]);
    }
}
