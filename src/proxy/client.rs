//! The pooled upstream client: hyper-util's client over an `HttpConnector` whose name
//! resolution goes through the egress [`Resolver`], so every pooled connection has passed
//! the egress rules.

use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use super::Body;
use super::error::{ProxyError, find_cause};
use crate::egress::{EgressError, Resolver};

#[derive(Clone)]
pub struct UpstreamClient {
    inner: Client<HttpConnector<Resolver>, Body>,
}

impl UpstreamClient {
    pub fn new(resolver: Resolver) -> UpstreamClient {
        let mut connector = HttpConnector::new_with_resolver(resolver);
        connector.set_nodelay(true);
        connector.enforce_http(true);
        let inner = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            // Shorter than the common 60 s+ server keep-alive, so we rarely reuse a
            // connection the upstream is about to close.
            .pool_idle_timeout(Duration::from_secs(50))
            .set_host(false)
            .build(connector);
        UpstreamClient { inner }
    }

    pub async fn send(&self, req: Request<Body>) -> Result<Response<Incoming>, ProxyError> {
        self.inner
            .request(req)
            .await
            .map_err(|e| match find_cause::<EgressError>(&e) {
                Some(EgressError::Denied { addr }) => {
                    ProxyError::Egress(EgressError::Denied { addr: *addr })
                }
                _ => ProxyError::UpstreamUnreachable(Box::new(e)),
            })
    }
}
