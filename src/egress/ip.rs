//! What an address is, for the egress rules: one canonical form for the IPv6 spellings of
//! an IPv4 address, the IPv4 addresses other IPv6 forms carry (which a tunnel or a
//! translator would reach), and the built-in list of destinations a proxy has no business
//! reaching unless told to.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::LazyLock;

use ipnet::IpNet;

/// Why a built-in rule refuses an address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Class {
    Unspecified,
    Loopback,
    LinkLocal,
    Metadata,
    Multicast,
    Reserved,
}

impl fmt::Display for Class {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Class::Unspecified => "an unspecified (this-host) address",
            Class::Loopback => "a loopback address",
            Class::LinkLocal => "a link-local address (cloud metadata lives there)",
            Class::Metadata => "a cloud metadata endpoint",
            Class::Multicast => "a multicast address",
            Class::Reserved => "a reserved address",
        })
    }
}

/// Refused unless `[egress] allow` or an `[[upstream]]` names them. Metadata endpoints
/// outside link-local space are listed one by one (sources: each provider's instance
/// metadata documentation).
const BUILTIN: &[(&str, Class)] = &[
    ("0.0.0.0/8", Class::Unspecified),
    ("127.0.0.0/8", Class::Loopback),
    // AWS, GCP, Azure, Oracle, DigitalOcean, OpenStack (169.254.169.254), ECS task
    // metadata (169.254.170.2), Tencent Cloud (169.254.0.23).
    ("169.254.0.0/16", Class::LinkLocal),
    ("100.100.100.200/32", Class::Metadata), // Alibaba Cloud
    ("168.63.129.16/32", Class::Metadata),   // Azure WireServer
    ("192.0.0.192/32", Class::Metadata),     // Oracle Cloud (classic)
    ("224.0.0.0/4", Class::Multicast),
    ("240.0.0.0/4", Class::Reserved), // with 255.255.255.255, broadcast
    ("::/128", Class::Unspecified),
    ("::1/128", Class::Loopback),
    ("fe80::/10", Class::LinkLocal),
    ("fd00:ec2::254/128", Class::Metadata), // AWS IMDS over IPv6
    ("ff00::/8", Class::Multicast),
];

static PARSED: LazyLock<Vec<(IpNet, Class)>> = LazyLock::new(|| {
    BUILTIN
        .iter()
        .filter_map(|(net, class)| Some((net.parse().ok()?, *class)))
        .collect()
});

/// The built-in rule `ip` falls under, if any (`ip` in canonical form).
pub(crate) fn builtin(ip: IpAddr) -> Option<Class> {
    PARSED
        .iter()
        .find_map(|(net, class)| net.contains(&ip).then_some(*class))
}

/// One form per destination: IPv6 addresses that mean an IPv4 host as such (mapped,
/// compatible, SIIT-translated, the NAT64 well-known prefix) become that IPv4 address, so
/// every rule written for IPv4 applies to them.
pub(crate) fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match as_v4(v6) {
            Some(v4) => IpAddr::V4(v4),
            None => ip,
        },
    }
}

fn as_v4(v6: Ipv6Addr) -> Option<Ipv4Addr> {
    let s = v6.segments();
    let low = last32(v6);
    let zero = |range: std::ops::Range<usize>| s[range].iter().all(|&x| x == 0);
    let v4 = match (s[4], s[5]) {
        // ::ffff:a.b.c.d (mapped)
        (0, 0xffff) if zero(0..4) => true,
        // ::ffff:0:a.b.c.d (SIIT, RFC 6145)
        (0xffff, 0) if zero(0..4) => true,
        // ::a.b.c.d (IPv4-compatible, deprecated but still routed by some stacks); `::`
        // and `::1` are IPv6's own.
        (0, 0) if zero(0..4) => u32::from(low) > 1,
        // 64:ff9b::/96, the NAT64 well-known prefix (RFC 6052): the translator connects
        // to exactly that IPv4 address.
        (0, 0) => s[..4] == [0x64, 0xff9b, 0, 0],
        _ => false,
    };
    v4.then_some(low)
}

/// IPv4 addresses an IPv6 address (canonical) carries inside it, which a tunnel or
/// translator on the way would deliver to: local-use NAT64 (RFC 8215, every RFC 6052
/// layout a /48 allows), 6to4 (RFC 3056), Teredo server and client (RFC 4380) and an ISATAP
/// interface identifier (RFC 5214). The rules refuse the IPv6 address when they refuse any
/// of these.
pub(crate) fn embedded_v4(ip: IpAddr) -> Vec<Ipv4Addr> {
    let IpAddr::V6(v6) = ip else {
        return Vec::new();
    };
    let s = v6.segments();
    let b = v6.octets();
    let mut out = Vec::new();
    if s[0] == 0x64 && s[1] == 0xff9b && s[2] == 1 {
        for prefix_len in [48, 56, 64, 96] {
            out.push(rfc6052(&b, prefix_len));
        }
    }
    if s[0] == 0x2002 {
        out.push(Ipv4Addr::new(b[2], b[3], b[4], b[5]));
    }
    if s[0] == 0x2001 && s[1] == 0 {
        out.push(Ipv4Addr::new(b[4], b[5], b[6], b[7]));
        out.push(Ipv4Addr::from(!u32::from(last32(v6))));
    }
    if (s[4] & !0x0200) == 0 && s[5] == 0x5efe {
        out.push(last32(v6));
    }
    out
}

/// The IPv4 address at the place RFC 6052 puts it for a prefix of `len` bits: right
/// after the prefix, skipping bits 64..72 (the "u" octet).
fn rfc6052(b: &[u8; 16], len: usize) -> Ipv4Addr {
    if len == 96 {
        return Ipv4Addr::new(b[12], b[13], b[14], b[15]);
    }
    let mut v4 = [0u8; 4];
    let mut i = len / 8;
    for byte in &mut v4 {
        if i == 8 {
            i += 1;
        }
        *byte = b[i];
        i += 1;
    }
    Ipv4Addr::from(v4)
}

fn last32(v6: Ipv6Addr) -> Ipv4Addr {
    let b = v6.octets();
    Ipv4Addr::new(b[12], b[13], b[14], b[15])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn ipv6_spellings_of_ipv4_become_ipv4() {
        for s in [
            "::ffff:169.254.169.254",
            "::a9fe:a9fe",
            "::ffff:0:a9fe:a9fe",
            "64:ff9b::a9fe:a9fe",
        ] {
            assert_eq!(canonical(ip(s)), ip("169.254.169.254"), "{s}");
        }
        for s in ["::", "::1", "2001:db8::1", "fe80::1", "64:ff9b:1::1"] {
            assert_eq!(canonical(ip(s)), ip(s), "{s}");
        }
    }

    #[test]
    fn embedded_ipv4_is_found_in_every_form() {
        let meta = "169.254.169.254".parse::<Ipv4Addr>().unwrap();
        for s in [
            "2002:a9fe:a9fe::1",                    // 6to4
            "2001:0:a9fe:a9fe::1",                  // Teredo server
            "2001:0:4136:e378:8000:63bf:5601:5601", // Teredo client (inverted)
            "2001:db8::5efe:a9fe:a9fe",             // ISATAP
            "2001:db8::200:5efe:a9fe:a9fe",         // ISATAP, universal bit
            "64:ff9b:1:a9fe:a9:fe00::",             // local NAT64, /48 layout
            "64:ff9b:1::a9fe:a9fe",                 // local NAT64, /96 layout
        ] {
            assert!(
                embedded_v4(ip(s)).contains(&meta),
                "{s}: {:?}",
                embedded_v4(ip(s))
            );
        }
        assert!(embedded_v4(ip("2001:db8::1")).is_empty());
        assert!(embedded_v4(ip("127.0.0.1")).is_empty());
    }

    #[test]
    fn builtin_table_parses() {
        assert_eq!(PARSED.len(), BUILTIN.len());
    }

    #[test]
    fn builtin_classes() {
        for (s, c) in [
            ("127.0.0.1", Class::Loopback),
            ("127.255.0.9", Class::Loopback),
            ("0.0.0.0", Class::Unspecified),
            ("::", Class::Unspecified),
            ("::1", Class::Loopback),
            ("169.254.169.254", Class::LinkLocal),
            ("fe80::1", Class::LinkLocal),
            ("fd00:ec2::254", Class::Metadata),
            ("100.100.100.200", Class::Metadata),
            ("168.63.129.16", Class::Metadata),
            ("224.0.0.1", Class::Multicast),
            ("ff02::1", Class::Multicast),
            ("255.255.255.255", Class::Reserved),
        ] {
            assert_eq!(builtin(ip(s)), Some(c), "{s}");
        }
        for s in [
            "10.0.0.1",
            "93.184.216.34",
            "2001:db8::1",
            "100.100.100.201",
        ] {
            assert_eq!(builtin(ip(s)), None, "{s}");
        }
    }
}
