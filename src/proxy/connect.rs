//! `CONNECT host:port`: a blind tunnel for HTTPS. The destination is routed (so
//! `unmatched = "deny"` applies), resolved and checked against the egress rules, and
//! connected *before* the client hears 200, so a dead destination is a 502, not a tunnel
//! that closes at once. Bytes then flow both ways until either side closes.

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::error::ProxyError;
use super::forward::finish;
use super::server::Lifecycle;
use super::{Body, empty};
use crate::app::App;
use crate::config::Unmatched;
use crate::config::pattern::split_host_port;
use crate::route::normalize_host;

pub(crate) async fn tunnel(
    app: &App,
    lifecycle: &Lifecycle,
    req: Request<Incoming>,
) -> Response<Body> {
    let start = Instant::now();
    let config = app.config();
    let Some((host, port)) = req
        .uri()
        .authority()
        .and_then(|a| split_host_port(a.as_str()))
        .and_then(|(h, p)| Some((normalize_host(h), p?.parse::<u16>().ok()?)))
    else {
        let err = ProxyError::BadRequest("CONNECT needs host:port".into());
        return finish(
            app,
            &config,
            None,
            &Method::CONNECT,
            "-",
            "-",
            start,
            Err(err),
        );
    };
    let route = config.route(&host, port, &Method::CONNECT, "", req.headers());
    let policy = route
        .as_ref()
        .map_or(&config.defaults, |r| &config.upstreams[r.upstream].policy);

    let result = async {
        if route.is_none() && config.proxy.unmatched == Unmatched::Deny {
            return Err(ProxyError::UnmatchedDenied);
        }
        let addrs = app
            .resolver
            .resolve(&host, port)
            .await
            .map_err(ProxyError::Egress)?;
        let upstream = connect_any(&addrs, policy.attempt_timeout)
            .await
            .map_err(|e| ProxyError::UpstreamUnreachable(Box::new(e)))?;
        Ok(upstream)
    }
    .await;

    let upstream = match result {
        Ok(u) => u,
        Err(e) => {
            return finish(
                app,
                &config,
                route.as_ref(),
                &Method::CONNECT,
                &host,
                "-",
                start,
                Err(e),
            );
        }
    };
    let on_upgrade = hyper::upgrade::on(req);
    let stop = lifecycle.stop.clone();
    lifecycle.tracker.spawn(async move {
        let mut upstream = upstream;
        let client = match on_upgrade.await {
            Ok(c) => c,
            Err(e) => {
                tracing::debug!(error = %e, "CONNECT upgrade failed");
                return;
            }
        };
        let mut client = TokioIo::new(client);
        tokio::select! {
            r = tokio::io::copy_bidirectional(&mut client, &mut upstream) => match r {
                Ok((up, down)) => tracing::debug!(bytes_up = up, bytes_down = down, "tunnel closed"),
                Err(e) => tracing::debug!(error = %e, "tunnel ended with an error"),
            },
            _ = stop.cancelled() => tracing::debug!("tunnel cut at the end of the drain"),
        }
    });
    let mut resp = Response::new(empty());
    *resp.status_mut() = StatusCode::OK;
    finish(
        app,
        &config,
        route.as_ref(),
        &Method::CONNECT,
        &host,
        "-",
        start,
        Ok(resp),
    )
}

/// Tries each address in turn, each bounded by `timeout`.
async fn connect_any(addrs: &[SocketAddr], timeout: Duration) -> io::Result<TcpStream> {
    let mut last = io::Error::new(io::ErrorKind::NotFound, "no address to connect to");
    for addr in addrs {
        match tokio::time::timeout(timeout, TcpStream::connect(addr)).await {
            Ok(Ok(s)) => {
                let _ = s.set_nodelay(true);
                return Ok(s);
            }
            Ok(Err(e)) => last = e,
            Err(_) => {
                last = io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("connect to {addr} timed out"),
                )
            }
        }
    }
    Err(last)
}
