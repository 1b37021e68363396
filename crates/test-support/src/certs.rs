//! A private CA and a certificate for 127.0.0.1 signed by it, for TLS upstreams.

use parking_lot::Mutex;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio::time::Instant;

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, SanType};
use rustls_pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};

pub struct TestCerts {
    /// The CA's certificate (PEM), for `upstream_ca`.
    pub ca_path: PathBuf,
    /// The 127.0.0.1 certificate and its key (PEM), for servers configured by file.
    pub cert_path: PathBuf,
    pub key_path: PathBuf,
    /// A server config presenting the 127.0.0.1 certificate, offering `alpn`.
    pub server: Arc<rustls::ServerConfig>,
}

/// Writes the CA to `dir/upstream-ca.pem`, the certificate and key beside it.
pub fn for_localhost(dir: &Path, alpn: &[&[u8]]) -> TestCerts {
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::default();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "test upstream CA");
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let ca_path = dir.join("upstream-ca.pem");
    std::fs::write(&ca_path, ca_cert.pem()).unwrap();
    let issuer = Issuer::new(ca_params, ca_key);
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::default();
    params.subject_alt_names = vec![
        SanType::IpAddress("127.0.0.1".parse().unwrap()),
        SanType::DnsName("localhost".try_into().unwrap()),
    ];
    let cert = params.signed_by(&key, &issuer).unwrap();
    let cert_path = dir.join("server-cert.pem");
    let key_path = dir.join("server-key.pem");
    std::fs::write(&cert_path, cert.pem()).unwrap();
    std::fs::write(&key_path, key.serialize_pem()).unwrap();
    let mut server = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(
        vec![cert.der().clone()],
        PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
    )
    .unwrap();
    server.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    TestCerts {
        ca_path,
        cert_path,
        key_path,
        server: Arc::new(server),
    }
}

/// A TLS upstream on 127.0.0.1 whose certificate is signed by a CA of its own. It
/// answers `secure hello`, except to a path with `/stall` in it, which it never answers.
pub struct TlsUpstream {
    pub addr: SocketAddr,
    pub ca_path: PathBuf,
    pub seen: Arc<Mutex<Vec<(Instant, String)>>>,
    /// Connections accepted so far.
    pub connections: Arc<AtomicUsize>,
}

pub async fn tls_upstream(dir: &Path) -> TlsUpstream {
    let certs = for_localhost(dir, &[b"h2", b"http/1.1"]);
    let ca_path = certs.ca_path;
    let acceptor = tokio_rustls::TlsAcceptor::from(certs.server);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let connections = Arc::new(AtomicUsize::new(0));
    let (s, accepted) = (seen.clone(), connections.clone());
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            accepted.fetch_add(1, Ordering::SeqCst);
            let (acceptor, s) = (acceptor.clone(), s.clone());
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let svc = service_fn(move |req: Request<Incoming>| {
                    let s = s.clone();
                    async move {
                        s.lock().push((
                            Instant::now(),
                            format!("{:?} {}", req.version(), req.uri().path()),
                        ));
                        if req.uri().path().contains("/stall") {
                            // Never answered: for timeouts.
                            std::future::pending::<()>().await;
                        }
                        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(
                            b"secure hello",
                        ))))
                    }
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(tls), svc)
                    .await;
            });
        }
    });
    TlsUpstream {
        addr,
        ca_path,
        seen,
        connections,
    }
}

/// A TLS client trusting only the CA in `ca` (PEM), offering `alpn`.
pub fn connector(ca: &Path, alpn: &[&[u8]]) -> tokio_rustls::TlsConnector {
    use rustls_pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(rustls_pki_types::CertificateDer::from_pem_file(ca).unwrap())
        .unwrap();
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    tokio_rustls::TlsConnector::from(Arc::new(config))
}

/// sluice intercepting HTTPS to 127.0.0.1 (upstream `secure`), with a new CA of its own
/// in `dir/ca` and `up`'s CA trusted for the upstream; `more` goes on the upstream's table
/// (its own keys, then families). Returns the proxy and its CA certificate.
pub async fn intercepting(dir: &Path, up: &TlsUpstream, more: &str) -> (crate::Proxy, PathBuf) {
    let (ca_cert, ca_key) = sluice::write_new_ca(&dir.join("ca")).unwrap();
    let proxy = crate::Proxy::start(&format!(
        "[tls]\nca_cert = {ca_cert:?}\nca_key = {ca_key:?}\n\
         [[upstream]]\nname = \"secure\"\nhosts = [\"127.0.0.1\"]\ntls = \"intercept\"\n\
         upstream_ca = {:?}\n{more}",
        up.ca_path
    ))
    .await;
    (proxy, ca_cert)
}

/// TLS to `target` through a CONNECT tunnel of `proxy`, trusting only `ca`, with `h2`
/// agreed by ALPN: what an HTTP/2 client of an intercepted upstream speaks over.
pub async fn h2_tunnel(
    proxy: SocketAddr,
    ca: &Path,
    target: SocketAddr,
) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
    let tunnel = crate::connect_tunnel(proxy, target).await;
    let name = rustls_pki_types::ServerName::try_from("127.0.0.1").unwrap();
    connector(ca, &[b"h2"]).connect(name, tunnel).await.unwrap()
}
