//! Where a listener binds, as `listen`, `admin`, `--listen` and `--admin` write it: one
//! address, or every address of whichever families the host has. The second is what a
//! pod wants: an IPv4-only, an IPv6-only and a dual-stack cluster each probe and scrape
//! the pod on the address family they have, and `[::]` cannot bind where IPv6 is off.

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::str::FromStr;

use serde::{Serialize, Serializer};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ListenAddr {
    /// `IP:PORT`: that address only. `0.0.0.0` is every IPv4 address; `[::]` every IPv6
    /// address, and IPv4 too where the kernel maps it (Linux does by default).
    Addr(SocketAddr),
    /// `:PORT` or `*:PORT`: every address of both families (one IPv6 socket that also
    /// accepts IPv4), or every IPv4 address where the host has no IPv6.
    AnyFamily(u16),
}

impl ListenAddr {
    pub fn port(&self) -> u16 {
        match self {
            ListenAddr::Addr(a) => a.port(),
            ListenAddr::AnyFamily(p) => *p,
        }
    }

    /// Whether only clients on this host can connect.
    pub fn is_loopback(&self) -> bool {
        matches!(self, ListenAddr::Addr(a) if a.ip().is_loopback())
    }

    /// An address of this host that reaches the listener: itself, or loopback for a
    /// wildcard (127.0.0.1, which every pod has, whatever its cluster's families).
    pub fn local_target(&self) -> SocketAddr {
        match *self {
            ListenAddr::Addr(a) if !a.ip().is_unspecified() => a,
            ListenAddr::Addr(a) if a.is_ipv6() => {
                SocketAddr::new(IpAddr::V6(std::net::Ipv6Addr::LOCALHOST), a.port())
            }
            _ => SocketAddr::new(IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), self.port()),
        }
    }
}

impl From<SocketAddr> for ListenAddr {
    fn from(a: SocketAddr) -> Self {
        ListenAddr::Addr(a)
    }
}

#[derive(Debug, thiserror::Error)]
#[error(
    "{0:?} is not a listen address: \"IP:PORT\" (\"127.0.0.1:3128\", \"[::1]:3128\") or \
     \":PORT\" for every address of every family the host has"
)]
pub struct BadListenAddr(String);

impl FromStr for ListenAddr {
    type Err = BadListenAddr;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || BadListenAddr(s.to_string());
        if let Some(port) = s.strip_prefix("*:").or_else(|| s.strip_prefix(':')) {
            return port.parse().map(ListenAddr::AnyFamily).map_err(|_| bad());
        }
        s.parse().map(ListenAddr::Addr).map_err(|_| bad())
    }
}

impl fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ListenAddr::Addr(a) => a.fmt(f),
            ListenAddr::AnyFamily(p) => write!(f, "*:{p}"),
        }
    }
}

impl Serialize for ListenAddr {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_spelling_parses_and_prints_back() {
        for (text, want, shown) in [
            ("127.0.0.1:3128", "127.0.0.1:3128", "127.0.0.1:3128"),
            ("[::1]:3128", "[::1]:3128", "[::1]:3128"),
            ("0.0.0.0:9901", "0.0.0.0:9901", "0.0.0.0:9901"),
            ("[::]:9901", "[::]:9901", "[::]:9901"),
        ] {
            let a: ListenAddr = text.parse().unwrap();
            assert_eq!(a, ListenAddr::Addr(want.parse().unwrap()));
            assert_eq!(a.to_string(), shown);
        }
        assert_eq!(
            ":9901".parse::<ListenAddr>().unwrap(),
            ListenAddr::AnyFamily(9901)
        );
        assert_eq!(
            "*:0".parse::<ListenAddr>().unwrap(),
            ListenAddr::AnyFamily(0)
        );
        assert_eq!(ListenAddr::AnyFamily(9901).to_string(), "*:9901");
        for bad in ["", ":", "9901", "*:x", ":70000", "localhost:9901", "::1:80"] {
            assert!(bad.parse::<ListenAddr>().is_err(), "{bad}");
        }
    }

    #[test]
    fn a_wildcard_is_reached_on_loopback() {
        let t = |s: &str| s.parse::<ListenAddr>().unwrap().local_target().to_string();
        assert_eq!(t(":9901"), "127.0.0.1:9901");
        assert_eq!(t("0.0.0.0:9901"), "127.0.0.1:9901");
        assert_eq!(t("[::]:9901"), "[::1]:9901");
        assert_eq!(t("10.1.2.3:9901"), "10.1.2.3:9901");
        assert!(!":3128".parse::<ListenAddr>().unwrap().is_loopback());
        assert!("[::1]:3128".parse::<ListenAddr>().unwrap().is_loopback());
    }
}
