//! Trust towards upstreams. Roots are Mozilla's set compiled in (webpki-roots) rather
//! than the platform store: a sidecar image is often distroless or scratch, with no CA
//! bundle at all, and the same binary should trust the same roots everywhere. An
//! upstream may add its own CA file (`upstream_ca`) for private or test CAs.
//! Verification is never switched off. A certificate in that file that the upstream
//! presents as its own is accepted as a pin (the exact bytes, valid now and for the
//! name), even when it says CA:TRUE, as a plain `openssl req -x509` certificate does:
//! webpki refuses a CA certificate as an end entity, where curl and OpenSSL accept it.

use std::path::Path;
use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};
use rustls_pki_types::{CertificateDer, ServerName, UnixTime};

use super::ca::pem_certs;
use super::{TlsError, provider};

pub(crate) fn client_config(extra_ca: Option<&Path>) -> Result<ClientConfig, TlsError> {
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
        for c in &certs {
            roots.add(c.clone())?;
        }
        let webpki = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider())
            .build()
            .map_err(|e| TlsError::Invalid {
                path: path.display().to_string(),
                message: e.to_string(),
            })?;
        let verifier = Pinned {
            webpki,
            pinned: certs,
        };
        return Ok(ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(verifier))
            .with_no_client_auth());
    }
    Ok(ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(Arc::new(roots))
        .with_no_client_auth())
}

/// webpki's verification, and where it refuses, the upstream_ca file's own certificates
/// as pins: the exact certificate, within its validity period and valid for the name.
/// The handshake's signature is still checked against it, so the upstream must hold its
/// key.
#[derive(Debug)]
struct Pinned {
    webpki: Arc<WebPkiServerVerifier>,
    pinned: Vec<CertificateDer<'static>>,
}

impl Pinned {
    fn pin_holds(&self, cert: &CertificateDer<'_>, name: &ServerName<'_>, now: UnixTime) -> bool {
        if !self.pinned.iter().any(|p| p.as_ref() == cert.as_ref()) {
            return false;
        }
        let now = i64::try_from(now.as_secs()).unwrap_or(i64::MAX);
        let valid_now = x509_parser::parse_x509_certificate(cert).is_ok_and(|(_, c)| {
            x509_parser::time::ASN1Time::from_timestamp(now)
                .is_ok_and(|t| c.validity().is_valid_at(t))
        });
        valid_now
            && webpki::EndEntityCert::try_from(cert)
                .is_ok_and(|ee| ee.verify_is_valid_for_subject_name(name).is_ok())
    }
}

impl ServerCertVerifier for Pinned {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self.webpki.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        ) {
            Err(_) if self.pin_holds(end_entity, server_name, now) => {
                Ok(ServerCertVerified::assertion())
            }
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.webpki.supported_verify_schemes()
    }
}
