//! TLS: the interception CA (`ca`) and the client side towards upstreams (`client`); the
//! server side that terminates intercepted CONNECT tunnels is `proxy::intercept`, which
//! uses both. rustls with the
//! ring provider throughout, so the build needs no C toolchain beyond the one cargo has.

pub(crate) mod ca;
pub(crate) mod client;

use parking_lot::Mutex;
use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use rustls::crypto::CryptoProvider;

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{0}: the CA key is readable by others or writable by its group; run `chmod 600 {0}` (in a Kubernetes Secret volume: defaultMode 0400, or 0440 with fsGroup); sluice refuses to sign with a key others can read"
    )]
    KeyTooOpen(String),
    #[error(
        "{path}: permission denied: the key belongs to uid {uid} gid {gid} with mode {mode:04o}, and sluice runs as uid {euid} gid {egid}; a Kubernetes Secret volume's files belong to root unless the pod sets securityContext.fsGroup: set fsGroup to sluice's group ({egid}) and the volume's defaultMode to 0440 (docs/kubernetes.md, \"HTTPS\")"
    )]
    KeyUnreadable {
        path: String,
        uid: u32,
        gid: u32,
        mode: u32,
        euid: u32,
        egid: u32,
    },
    #[error("{path}: {message}")]
    Invalid { path: String, message: String },
    #[error("certificate generation failed: {0}")]
    Rcgen(#[from] rcgen::Error),
    #[error("TLS configuration failed: {0}")]
    Rustls(#[from] rustls::Error),
}

/// The one crypto provider sluice uses.
pub(crate) fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Logs handshake failures once per client address per minute; a client that does not
/// trust the CA retries often and would flood the log otherwise.
#[derive(Default)]
pub(crate) struct HandshakeLog {
    last: Mutex<HashMap<IpAddr, Instant>>,
}

impl HandshakeLog {
    pub(crate) fn should_log(&self, ip: IpAddr) -> bool {
        let now = Instant::now();
        let mut last = self.last.lock();
        if last.len() > 4096 {
            last.retain(|_, t| now - *t < Duration::from_secs(60));
        }
        match last.get(&ip) {
            Some(t) if now - *t < Duration::from_secs(60) => false,
            _ => {
                last.insert(ip, now);
                true
            }
        }
    }
}
