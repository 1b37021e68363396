//! `tls = "intercept"`: after answering a CONNECT with 200, sluice terminates TLS itself
//! with a leaf certificate for the requested name, signed by the configured CA, and
//! serves HTTP/1.1 or HTTP/2 (by ALPN) inside. Every request then goes through the same
//! pipeline as plain HTTP, addressed to the CONNECT target over verified TLS.

use std::convert::Infallible;
use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;

use http::Request;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::upgrade::Upgraded;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use rustls::ServerConfig;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio_rustls::LazyConfigAcceptor;

use super::forward;
use super::lifecycle::Lifecycle;
use crate::app::App;
use crate::tls::provider;

/// Serves one leaf whatever the client asks for: it was chosen for this connection.
struct OneLeaf(Arc<CertifiedKey>);

impl fmt::Debug for OneLeaf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("OneLeaf")
    }
}

impl ResolvesServerCert for OneLeaf {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.clone())
    }
}

/// Terminates TLS on an upgraded CONNECT stream and serves the requests inside.
pub(crate) async fn serve(
    app: Arc<App>,
    lc: Lifecycle,
    upgraded: Upgraded,
    host: String,
    port: u16,
    peer: SocketAddr,
) {
    let Some(ca) = app.config().authority.clone() else {
        tracing::error!(host, "interception requested but no CA is loaded");
        return;
    };
    let failed = |what: &str, error: String| {
        app.metrics.tls_handshake_failures.inc();
        if app.handshake_log.should_log(peer.ip()) {
            tracing::warn!(client = %peer.ip(), host, error, "{what} (logged once a minute per client)");
        }
    };
    let start =
        match LazyConfigAcceptor::new(rustls::server::Acceptor::default(), TokioIo::new(upgraded))
            .await
        {
            Ok(s) => s,
            Err(e) => return failed("client TLS handshake failed", e.to_string()),
        };
    let name = start
        .client_hello()
        .server_name()
        .map_or_else(|| host.clone(), str::to_string);
    let leaf = match ca.leaf(&name) {
        Ok(l) => l,
        Err(e) => return failed("cannot issue a certificate", e.to_string()),
    };
    let config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map(|b| {
            b.with_no_client_auth()
                .with_cert_resolver(Arc::new(OneLeaf(leaf)))
        });
    let mut config = match config {
        Ok(c) => c,
        Err(e) => return failed("TLS configuration failed", e.to_string()),
    };
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    let tls = match start.into_stream(Arc::new(config)).await {
        Ok(t) => t,
        Err(e) => return failed("client TLS handshake failed", e.to_string()),
    };

    let svc_app = app.clone();
    let svc = service_fn(move |req: Request<Incoming>| {
        let (app, host) = (svc_app.clone(), host.clone());
        async move { Ok::<_, Infallible>(forward::intercepted(&app, req, &host, port).await) }
    });
    let builder = auto::Builder::new(TokioExecutor::new());
    let conn = builder.serve_connection(TokioIo::new(tls), svc);
    let result = lc.until_drained(conn).await;
    if let Err(e) = result {
        tracing::debug!(client = %peer, error = %e, "intercepted connection ended with an error");
    }
}
