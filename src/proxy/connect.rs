//! `CONNECT host:port`: a blind tunnel for HTTPS. The destination is routed (so
//! `unmatched = "deny"` applies), resolved and checked against the egress rules, and
//! connected *before* the client hears 200, so a dead destination is a 502, not a tunnel
//! that closes at once. Bytes then flow both ways until either side closes, or nothing
//! has moved for `tunnel_idle_timeout`.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::egress::Counted;
use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::time::Instant;

use super::access::{Record, finish};
use super::error::ProxyError;
use super::lifecycle::Lifecycle;
use super::sniff::{self, Kind};
use super::splice::Ended;
use crate::app::App;
use crate::body::{Body, empty};
use crate::config::{TlsMode, Unmatched};
use crate::route::{authority_parts, normalize_host};

pub(crate) async fn tunnel(
    app: &Arc<App>,
    lc: &Lifecycle,
    req: Request<Incoming>,
    peer: SocketAddr,
) -> Response<Body> {
    let start = Instant::now();
    let config = app.config();
    // Read as the forward path reads an absolute URI's authority, so the two cannot
    // disagree on a host. Userinfo has no place in CONNECT's authority-form (RFC 9110,
    // 9.3.6): refused rather than quietly dropped.
    let Some((host, port)) = req
        .uri()
        .authority()
        .map(|a| a.as_str())
        .filter(|a| !a.contains('@'))
        .map(authority_parts)
        .and_then(|(h, p)| Some((normalize_host(h), p?)))
    else {
        let err = ProxyError::BadRequest("CONNECT needs host:port".into());
        let record = Record {
            route: None,
            method: &Method::CONNECT,
            host: "-",
            path: "-",
            start,
        };
        return finish(&config, &record, Err(err));
    };
    let route = config.route(&host, port, &Method::CONNECT, "", req.headers());
    let done = |result| {
        let record = Record {
            route: route.as_ref(),
            method: &Method::CONNECT,
            host: &host,
            path: "-",
            start,
        };
        finish(&config, &record, result)
    };
    if route.is_none() && config.proxy.unmatched == Unmatched::Deny {
        return done(Err(ProxyError::UnmatchedDenied));
    }
    let upstream = route.as_ref().map(|r| &config.upstreams[r.upstream]);
    let policy = upstream.map_or(&config.defaults, |u| &u.policy);
    // Refuse forbidden destinations before anything else happens, intercepted or not.
    if let Err(e) = config.egress_rules.connect_port(&host, port) {
        return done(Err(ProxyError::Egress(e)));
    }
    let addrs = match app.resolver.resolve(&host, port).await {
        Ok(a) => a,
        Err(e) => return done(Err(ProxyError::Egress(e))),
    };
    let on_upgrade = hyper::upgrade::on(req);

    if upstream.is_some_and(|u| u.tls == TlsMode::Intercept) {
        let (app, lifecycle, host) = (app.clone(), lc.clone(), host.clone());
        lc.tracker.spawn(async move {
            match on_upgrade.await {
                Ok(upgraded) => {
                    super::intercept::serve(app, lifecycle, upgraded, host, port, peer).await
                }
                Err(e) => tracing::debug!(error = %e, "CONNECT upgrade failed"),
            }
        });
        return done(Ok(ok_response()));
    }

    // A blind tunnel pays the upstream's concurrency limits, one permit while it is open.
    let permit = match &route {
        Some(r) => match app
            .limiter
            .acquire_tunnel(&config.plans[r.upstream], r)
            .await
        {
            Ok(p) => p,
            Err(e) => return done(Err(e.into())),
        },
        None => None,
    };
    let upstream_io = match connect_any(&app.resolver, &addrs, policy.attempt_timeout).await {
        Ok(s) => s,
        Err(e) if crate::egress::is_local_failure(&e) => {
            app.local_failure(&e);
            return done(Err(ProxyError::LocalResources(Box::new(e))));
        }
        Err(e) => return done(Err(ProxyError::UpstreamUnreachable(Box::new(e)))),
    };
    let blind = Blind {
        app: app.clone(),
        lc: lc.clone(),
        upstream_io,
        permit,
        matched: route.is_some(),
        host: host.clone(),
        port,
        peer,
        idle: config.proxy.tunnel_idle_timeout,
    };
    lc.tracker.spawn(blind.carry(on_upgrade));
    done(Ok(ok_response()))
}

/// A blind tunnel whose client has its 200: the connection to the destination, and
/// the concurrency permit it holds while open.
struct Blind {
    app: Arc<App>,
    lc: Lifecycle,
    upstream_io: Counted,
    permit: Option<crate::limit::Permit>,
    /// Routed to a configured upstream, whose plain HTTP is served as the forward proxy's.
    matched: bool,
    host: String,
    port: u16,
    peer: SocketAddr,
    idle: Duration,
}

impl Blind {
    /// Carries bytes both ways until either side closes, nothing moves for `idle`, or
    /// the drain ends. To a configured upstream, what the client sends first is read
    /// before anything is carried (see `sniff`).
    async fn carry(self, on_upgrade: hyper::upgrade::OnUpgrade) {
        let client = match on_upgrade.await {
            Ok(c) => c,
            Err(e) => {
                tracing::debug!(error = %e, "CONNECT upgrade failed");
                return;
            }
        };
        let mut client = TokioIo::new(client);
        let Blind {
            app,
            lc,
            mut upstream_io,
            permit,
            matched,
            host,
            port,
            peer,
            idle,
        } = self;
        if matched {
            let budget = idle.min(sniff::BUDGET_MAX);
            let (kind, first) = tokio::select! {
                sniffed = sniff::sniff(&mut client, budget) => sniffed,
                _ = lc.stop.cancelled() => return,
            };
            match kind {
                Ok(Kind::Tls) => {
                    use tokio::io::AsyncWriteExt;
                    if upstream_io.write_all(&first).await.is_err() {
                        return;
                    }
                }
                // Plain HTTP to an upstream sluice knows (Node's undici sends http://
                // URLs through CONNECT; gRPC in plain text sends the HTTP/2 preface):
                // served as the forward proxy serves it, each request paying its limits,
                // so the tunnel's own permit goes back first (it would otherwise wait
                // against itself under a `concurrency` limit).
                Ok(kind) => {
                    drop((permit, upstream_io));
                    let io = super::rewind::Rewind::new(first, client);
                    let h2 = kind == Kind::H2c;
                    super::intercept::serve_plain(app, lc, io, host, port, peer, h2).await;
                    return;
                }
                Err(why) => {
                    app.metrics
                        .tunnels_refused
                        .with_label_values(&[why.label()])
                        .inc();
                    if app.handshake_log.should_log(peer.ip()) {
                        tracing::warn!(client = %peer.ip(), host, port, reason = %why,
                            "tunnel to a configured upstream closed: its first bytes are \
                             neither TLS nor HTTP (logged once a minute per client)");
                    }
                    return;
                }
            }
        }
        let _permit = permit;
        match super::splice::splice(&mut client, upstream_io, idle, &lc.stop).await {
            Ended::Closed(up, down) => {
                tracing::debug!(bytes_up = up, bytes_down = down, "tunnel closed")
            }
            Ended::Failed(e) => tracing::debug!(error = %e, "tunnel ended with an error"),
            Ended::Idle => tracing::debug!(?idle, "tunnel closed: idle"),
            Ended::Cut => tracing::debug!("tunnel cut at the end of the drain"),
        }
    }
}

fn ok_response() -> Response<Body> {
    let mut resp = Response::new(empty());
    *resp.status_mut() = StatusCode::OK;
    resp
}

/// Races the addresses (see `Resolver::connect`), the whole race bounded by `timeout`.
async fn connect_any(
    resolver: &crate::egress::Resolver,
    addrs: &[SocketAddr],
    timeout: Duration,
) -> io::Result<Counted> {
    tokio::time::timeout(timeout, resolver.connect(addrs))
        .await
        .unwrap_or_else(|_| Err(io::Error::new(io::ErrorKind::TimedOut, "connect timed out")))
}
