//! The record every request leaves, forwarded or tunnelled: one increment of
//! `sluice_requests_total` and one access-log line, after the local response a failure
//! becomes.

use http::{Method, Response};
use tokio::time::Instant;

use super::error::ProxyError;
use crate::app::Live;
use crate::body::Body;
use crate::route::Route;

/// What the request counter and the access line say about one request.
pub(crate) struct Record<'a> {
    pub(crate) route: Option<&'a Route>,
    pub(crate) method: &'a Method,
    /// The target host as routed, or `-` when there is none.
    pub(crate) host: &'a str,
    /// The path without its query, or `-`.
    pub(crate) path: &'a str,
    pub(crate) start: Instant,
}

/// Turns the result into the client's response and records it: one counter increment and
/// one access-log line per request. The log names the path without its query, where
/// secrets tend to travel, and never a header value.
pub(crate) fn finish(
    config: &Live,
    record: &Record<'_>,
    result: Result<Response<Body>, ProxyError>,
) -> Response<Body> {
    let Record {
        route,
        method,
        host,
        path,
        start,
    } = *record;
    let (upstream, family) = crate::route::labels(&config.config, route);
    let (resp, failure) = match result {
        Ok(resp) => (resp, None),
        Err(e) => {
            if matches!(
                e,
                ProxyError::UpstreamUnreachable(_) | ProxyError::Egress(_)
            ) {
                // Display already carries the causes (see error.rs): walking `source()`
                // as well would print each of them twice.
                tracing::warn!(%method, upstream, family, error = %e, "upstream request failed");
            }
            (e.to_response(), Some(e.outcome()))
        }
    };
    // An upstream's answer is labelled with its status, borrowed: no allocation on the
    // path every response takes.
    let status = resp.status();
    let outcome = failure.as_deref().unwrap_or(status.as_str());
    config.route_metrics.get(route).requests.inc(outcome);
    // A sampled upstream logs a share of its requests; the counter above has them all.
    let share = route.map_or(1.0, |r| config.upstreams[r.upstream].access_log);
    if share < 1.0 && rand::random::<f64>() >= share {
        return resp;
    }
    let now = crate::clock::now();
    crate::log::access(&crate::log::Access {
        method: method.as_str(),
        host,
        path,
        upstream,
        family,
        status: status.as_u16(),
        outcome,
        duration: now.saturating_duration_since(start),
        at: now,
    });
    resp
}
