//! The one road from a routed request to an upstream response. Every policy that shapes
//! traffic wraps [`run`], and they nest in the order the code reads, outermost first:
//!
//! ```text
//! total timeout          (here)           ends in 504 total_timeout
//! └─ retry loop          (issue 4)
//!    └─ circuit breaker  (issue 4)
//!       └─ limiter       (here)           FIFO admission within every limit
//!          └─ attempt timeout (issue 4)
//!             └─ upstream call (here)     pooled client
//! ```

use http::{Request, Response};
use tokio::time::Instant;

use super::Body;
use super::error::ProxyError;
use crate::app::App;
use crate::config::Config;
use crate::limit::PermitBody;
use crate::route::Route;

/// Sends `req` (already stripped and addressed to the upstream) under the route's policy.
pub async fn run(
    app: &App,
    config: &Config,
    route: Option<&Route>,
    req: Request<Body>,
) -> Result<Response<Body>, ProxyError> {
    let policy = match route {
        Some(r) => {
            let u = &config.upstreams[r.upstream];
            r.family.map_or(&u.policy, |f| &u.families[f].policy)
        }
        None => &config.defaults,
    };
    let total = policy.total_timeout;
    let limited = async {
        let permit = match route {
            Some(r) => app.limiter.acquire(r).await?,
            None => None,
        };
        let resp = attempt(app, config, route, req).await?;
        Ok(resp.map(|body| PermitBody::wrap(body, permit)))
    };
    match tokio::time::timeout(total, limited).await {
        Ok(result) => result,
        Err(_) => Err(ProxyError::TotalTimeout(total)),
    }
}

/// One upstream attempt, measured.
async fn attempt(
    app: &App,
    config: &Config,
    route: Option<&Route>,
    req: Request<Body>,
) -> Result<Response<Body>, ProxyError> {
    let (upstream, family) = config.labels(route);
    let start = Instant::now();
    let resp = app.client.send(req).await?;
    app.metrics
        .upstream_duration
        .with_label_values(&[upstream, family])
        .observe(start.elapsed().as_secs_f64());
    app.metrics
        .upstream_responses
        .with_label_values(&[upstream, family, resp.status().as_str()])
        .inc();
    Ok(resp.map(super::stream))
}
