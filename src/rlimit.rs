//! The open-file limit. A proxy holds about two descriptors per client (its connection
//! and the upstream's), so the soft limit, often 1024, is raised to the hard one at start,
//! and what is left sizes the default cap on client connections, keeping descriptors in
//! reserve for upstream pools, the config watcher and the admin listener.

/// Descriptors kept out of the connection cap's reach: idle upstream connections, the
/// admin listener and its clients, the config watcher, Redis, log files.
pub(crate) const RESERVED: u64 = 256;

/// The default cap, however many descriptors there are: beyond it a sidecar is better
/// served by a second replica than by one bigger proxy.
pub(crate) const DEFAULT_MAX_CONNECTIONS: u64 = 10_000;

/// Raises the soft open-file limit to the hard one; returns (before, after).
#[cfg(unix)]
#[allow(
    unsafe_code,
    reason = "getrlimit and setrlimit have no safe wrapper in std"
)]
pub fn raise_nofile() -> std::io::Result<(u64, u64)> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we pass and reads nothing else.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let before = lim.rlim_cur;
    if lim.rlim_cur >= lim.rlim_max {
        return Ok((before, before));
    }
    lim.rlim_cur = lim.rlim_max;
    // SAFETY: setrlimit reads the struct we pass; raising the soft limit up to the hard
    // one needs no privilege.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok((before, lim.rlim_cur))
}

#[cfg(not(unix))]
pub fn raise_nofile() -> std::io::Result<(u64, u64)> {
    Err(std::io::Error::from(std::io::ErrorKind::Unsupported))
}

/// The soft open-file limit now, if the platform has one.
#[cfg(unix)]
#[allow(unsafe_code, reason = "getrlimit has no safe wrapper in std")]
pub(crate) fn nofile() -> Option<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: as in raise_nofile.
    (unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0).then_some(lim.rlim_cur)
}

#[cfg(not(unix))]
pub(crate) fn nofile() -> Option<u64> {
    None
}

/// The connection cap when the config names none: what the descriptors allow beyond the
/// reserve, two per connection, at most [`DEFAULT_MAX_CONNECTIONS`].
pub(crate) fn default_max_connections(nofile: Option<u64>) -> u64 {
    match nofile {
        // RLIM_INFINITY and other huge values are as good as unlimited.
        Some(n) => (n.saturating_sub(RESERVED) / 2).clamp(16, DEFAULT_MAX_CONNECTIONS),
        None => DEFAULT_MAX_CONNECTIONS,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_cap_leaves_descriptors_in_reserve() {
        assert_eq!(default_max_connections(Some(512)), 128);
        assert_eq!(default_max_connections(Some(1024)), 384);
        assert_eq!(default_max_connections(Some(100)), 16);
        assert_eq!(
            default_max_connections(Some(1 << 20)),
            DEFAULT_MAX_CONNECTIONS
        );
        assert_eq!(
            default_max_connections(Some(u64::MAX)),
            DEFAULT_MAX_CONNECTIONS
        );
        assert_eq!(default_max_connections(None), DEFAULT_MAX_CONNECTIONS);
    }
}
