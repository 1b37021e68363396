//! `tls = "intercept"`: after answering a CONNECT with 200, sluice terminates TLS itself
//! with a leaf certificate for the requested name, signed by the configured CA, and
//! serves HTTP/1.1 or HTTP/2 (by ALPN) inside. Every request then goes through the same
//! pipeline as plain HTTP, addressed to the CONNECT target over verified TLS.
//!
//! An intercepted connection is bounded like a blind tunnel: its handshake must end
//! within `tunnel_idle_timeout` (10 s at most), hyper's header-read timeout is armed on
//! HTTP/1.1, and a connection with no bytes either way for `tunnel_idle_timeout` is
//! closed, freeing its place under `max_connections`.

use std::convert::Infallible;
use std::fmt;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use http::Request;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::upgrade::Upgraded;
use hyper_util::rt::TokioIo;
use rustls::ServerConfig;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Instant;
use tokio_rustls::LazyConfigAcceptor;

use super::forward;
use super::lifecycle::Lifecycle;
use crate::app::App;
use crate::tls::provider;
use crate::upstream::timer::{ConnTimer, Timers};

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

/// The longest a client may take over its TLS handshake, when `tunnel_idle_timeout` is
/// longer: a handshake takes milliseconds, and one that stalls holds a connection slot.
const HANDSHAKE_MAX: Duration = Duration::from_secs(10);

/// A stream that notes when bytes last moved either way.
struct Watched<T> {
    inner: T,
    since: Instant,
    /// Milliseconds from `since` to the last read or write that moved bytes.
    last: Arc<AtomicU64>,
}

impl<T> Watched<T> {
    fn touch(&self) {
        let ms = u64::try_from(self.since.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last.store(ms, Ordering::Relaxed);
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Watched<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.touch();
        }
        r
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Watched<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, data);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.touch();
        }
        r
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Resolves once no bytes have moved for `idle`.
async fn idle_for(since: Instant, last: &AtomicU64, idle: Duration) {
    loop {
        let at = since + Duration::from_millis(last.load(Ordering::Relaxed)) + idle;
        if Instant::now() >= at {
            return;
        }
        tokio::time::sleep_until(at).await;
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
    let idle = app.config().proxy.tunnel_idle_timeout;
    let since = Instant::now();
    let last = Arc::new(AtomicU64::new(0));
    let io = Watched {
        inner: TokioIo::new(upgraded),
        since,
        last: last.clone(),
    };
    let handshake = idle.min(HANDSHAKE_MAX);
    let accept = LazyConfigAcceptor::new(rustls::server::Acceptor::default(), io);
    let start = match tokio::time::timeout_at(since + handshake, accept).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => return failed("client TLS handshake failed", e.to_string()),
        Err(_) => return failed("client TLS handshake timed out", format!("{handshake:?}")),
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
    // In the server's order of preference; a client that offers only `http/1.0` is served
    // HTTP/1.1 semantics in HTTP/1.0 messages, as hyper does for an HTTP/1.0 request, and
    // one that offers nothing gets no ALPN and HTTP/1.1 or h2 by its first bytes.
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec(), b"http/1.0".to_vec()];
    let tls = match tokio::time::timeout_at(since + handshake, start.into_stream(Arc::new(config)))
        .await
    {
        Ok(Ok(t)) => t,
        Ok(Err(e)) => return failed("client TLS handshake failed", e.to_string()),
        Err(_) => return failed("client TLS handshake timed out", format!("{handshake:?}")),
    };

    let tunnel = forward::Tunnel::new(&host, port, true);
    if tls.get_ref().1.alpn_protocol() == Some(b"h2") {
        // HTTP/2 is served with the h2 crate, for `100 Continue` (see `h2server`).
        let stop = lc.stop.clone();
        tokio::select! {
            result = super::h2server::serve(app.clone(), lc.clone(), tls, tunnel) => {
                if let Err(e) = result {
                    tracing::debug!(client = %peer, error = %e, "intercepted connection ended with an error");
                }
            }
            () = idle_for(since, &last, idle) => {
                tracing::debug!(client = %peer, "intercepted connection idle: closed");
            }
            _ = stop.cancelled() => {}
        }
        return;
    }
    // HTTP/2 is agreed by ALPN only (RFC 9113 §3.2), so a client that offered none
    // speaks HTTP/1.
    tokio::select! {
        result = serve_http1(app.clone(), &lc, tls, tunnel) => {
            if let Err(e) = result {
                tracing::debug!(client = %peer, error = %e, "intercepted connection ended with an error");
            }
        }
        () = idle_for(since, &last, idle) => {
            tracing::debug!(client = %peer, "intercepted connection idle: closed");
        }
    }
}

/// What the HTTP/1.1 requests inside one tunnel share: a request clones this `Arc`
/// rather than the app and the lifecycle, whose tokens every worker's connections share.
struct Inside {
    app: Arc<App>,
    lc: Lifecycle,
    tunnel: forward::Tunnel,
    /// Its requests' deadlines.
    timers: Timers,
}

/// Serves the HTTP/1.1 requests inside a tunnel with hyper until the drain. On a
/// [`ConnTimer`], as the proxy's own connections are: without a timer hyper skips its
/// header-read timeout silently, and a tokio timer per request is a wheel insertion and
/// removal each time. With upgrades: a WebSocket handshake inside the tunnel switches
/// like a plain one.
async fn serve_http1<I>(
    app: Arc<App>,
    lc: &Lifecycle,
    io: I,
    tunnel: forward::Tunnel,
) -> Result<(), hyper::Error>
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let inside = Arc::new(Inside {
        app,
        lc: lc.clone(),
        tunnel,
        timers: Timers::new(),
    });
    let svc = service_fn(move |req: Request<Incoming>| {
        let inside = inside.clone();
        async move {
            let target = inside.tunnel.target(&req);
            let resp = forward::intercepted(&inside.app, &inside.lc, &inside.timers, req, target);
            Ok::<_, Infallible>(resp.await)
        }
    });
    let conn = http1::Builder::new()
        .timer(ConnTimer::new())
        .header_read_timeout(super::lifecycle::HEADER_READ_TIMEOUT)
        .serve_connection(TokioIo::new(io), svc)
        .with_upgrades();
    lc.until_drained(conn).await
}

/// Plain HTTP a client sent through a CONNECT tunnel to `host:port` (see
/// `connect::tunnel`): served as HTTP/1.1 with hyper, or as HTTP/2 (`h2`, prior
/// knowledge) with `h2server`, each request routed and limited as the forward proxy's
/// are, and sent to the upstream in plain HTTP.
pub(crate) async fn serve_plain<I>(
    app: Arc<App>,
    lc: Lifecycle,
    io: I,
    host: String,
    port: u16,
    peer: SocketAddr,
    h2: bool,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let idle = app.config().proxy.tunnel_idle_timeout;
    let since = Instant::now();
    let last = Arc::new(AtomicU64::new(0));
    let io = Watched {
        inner: io,
        since,
        last: last.clone(),
    };
    let tunnel = forward::Tunnel::new(&host, port, false);
    if h2 {
        let stop = lc.stop.clone();
        tokio::select! {
            result = super::h2server::serve(app.clone(), lc.clone(), io, tunnel) => {
                if let Err(e) = result {
                    tracing::debug!(client = %peer, error = %e, "h2c tunnel ended with an error");
                }
            }
            () = idle_for(since, &last, idle) => {
                tracing::debug!(client = %peer, "h2c tunnel idle: closed");
            }
            _ = stop.cancelled() => {}
        }
        return;
    }
    tokio::select! {
        result = serve_http1(app.clone(), &lc, io, tunnel) => {
            if let Err(e) = result {
                tracing::debug!(client = %peer, error = %e, "plain HTTP tunnel ended with an error");
            }
        }
        () = idle_for(since, &last, idle) => {
            tracing::debug!(client = %peer, "plain HTTP tunnel idle: closed");
        }
    }
}
