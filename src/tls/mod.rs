//! TLS: the interception CA (`ca`), the client side towards upstreams (`client`), and the
//! server side that terminates intercepted CONNECT tunnels (`intercept`). rustls with the
//! ring provider throughout, so the build needs no C toolchain beyond the one cargo has.

pub mod ca;
pub mod client;
pub mod intercept;

use std::sync::Arc;

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
    #[error("{path}: {message}")]
    Invalid { path: String, message: String },
    #[error("certificate generation failed: {0}")]
    Rcgen(#[from] rcgen::Error),
    #[error("TLS configuration failed: {0}")]
    Rustls(#[from] rustls::Error),
}

/// The one crypto provider sluice uses.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}
