//! Trust towards upstreams. Roots are Mozilla's set compiled in (webpki-roots) rather
//! than the platform store: a sidecar image is often distroless or scratch, with no CA
//! bundle at all, and the same binary should trust the same roots everywhere. An
//! upstream may add its own CA file (`upstream_ca`) for private or test CAs.
//! Verification is never switched off.

use std::path::Path;
use std::sync::Arc;

use rustls::{ClientConfig, RootCertStore};

use super::ca::pem_certs;
use super::{TlsError, provider};

pub fn client_config(extra_ca: Option<&Path>) -> Result<ClientConfig, TlsError> {
    let mut roots = RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    if let Some(path) = extra_ca {
        let pem = crate::config::read_capped(path, crate::config::MAX_CONFIG_BYTES).map_err(
            |source| TlsError::Io {
                path: path.display().to_string(),
                source,
            },
        )?;
        let certs = pem_certs(&pem);
        if certs.is_empty() {
            return Err(TlsError::Invalid {
                path: path.display().to_string(),
                message: "no certificate in the file".into(),
            });
        }
        for c in certs {
            roots.add(c)?;
        }
    }
    Ok(ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(Arc::new(roots))
        .with_no_client_auth())
}
