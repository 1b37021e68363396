//! Egress rules: which destination addresses sluice refuses to connect to, checked on the
//! address actually resolved (so a DNS name that points at the cloud metadata service is
//! refused like the literal address), and the resolver the upstream client and CONNECT
//! tunnels share so the check cannot be bypassed by either path.

use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use hyper_util::client::legacy::connect::dns::Name;

/// Link-local ranges: 169.254.0.0/16 holds the cloud metadata endpoints
/// (169.254.169.254); fe80::/10 is its IPv6 counterpart. IPv4-mapped IPv6 forms of the
/// v4 range are refused too, since they reach the same hosts.
pub fn is_denied(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_link_local(),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => v4.is_link_local(),
            None => (v6.segments()[0] & 0xffc0) == 0xfe80,
        },
    }
}

#[derive(Debug, thiserror::Error)]
pub enum EgressError {
    #[error("destination {addr} is a link-local address, which egress rules forbid")]
    Denied { addr: IpAddr },
    #[error("cannot resolve host: {0}")]
    Lookup(#[source] io::Error),
    #[error("host resolved to no addresses")]
    NoAddresses,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// Name resolution, replaceable so tests can give a name a chosen address.
pub trait Lookup: Send + Sync + 'static {
    fn lookup(&self, host: String) -> BoxFuture<io::Result<Vec<IpAddr>>>;
}

/// The system resolver (getaddrinfo on a blocking thread, through tokio).
pub struct SystemLookup;

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
pub struct Resolver {
    lookup: Arc<dyn Lookup>,
}

impl Default for Resolver {
    fn default() -> Self {
        Resolver::new(Arc::new(SystemLookup))
    }
}

impl Resolver {
    pub fn new(lookup: Arc<dyn Lookup>) -> Resolver {
        Resolver { lookup }
    }

    pub async fn resolve(&self, host: &str, port: u16) -> Result<Vec<SocketAddr>, EgressError> {
        let ips = match host.parse::<IpAddr>() {
            Ok(ip) => vec![ip],
            Err(_) => self
                .lookup
                .lookup(host.to_string())
                .await
                .map_err(EgressError::Lookup)?,
        };
        if let Some(addr) = ips.iter().copied().find(|ip| is_denied(*ip)) {
            return Err(EgressError::Denied { addr });
        }
        if ips.is_empty() {
            return Err(EgressError::NoAddresses);
        }
        Ok(ips
            .into_iter()
            .map(|ip| SocketAddr::new(ip, port))
            .collect())
    }
}

/// Lets hyper-util's `HttpConnector` use this resolver, so pooled connections pass the
/// same check. The port is filled in by the connector.
impl tower_service::Service<Name> for Resolver {
    type Response = std::vec::IntoIter<SocketAddr>;
    type Error = EgressError;
    type Future = BoxFuture<Result<Self::Response, EgressError>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), EgressError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, name: Name) -> Self::Future {
        let this = self.clone();
        Box::pin(async move { Ok(this.resolve(name.as_str(), 0).await?.into_iter()) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_local_is_denied() {
        for s in [
            "169.254.169.254",
            "169.254.0.1",
            "fe80::1",
            "febf::1",
            "::ffff:169.254.169.254",
        ] {
            assert!(is_denied(s.parse().unwrap()), "{s}");
        }
        for s in [
            "127.0.0.1",
            "10.0.0.1",
            "::1",
            "fec0::1",
            "2001:db8::1",
            "169.253.255.255",
        ] {
            assert!(!is_denied(s.parse().unwrap()), "{s}");
        }
    }

    #[tokio::test]
    async fn literal_addresses_skip_lookup() {
        let r = Resolver::default();
        assert!(matches!(
            r.resolve("169.254.169.254", 80).await,
            Err(EgressError::Denied { .. })
        ));
        let ok = r.resolve("127.0.0.1", 8080).await.unwrap();
        assert_eq!(ok, vec!["127.0.0.1:8080".parse().unwrap()]);
    }
}
