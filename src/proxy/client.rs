//! The pooled upstream client: hyper-util's client over the egress [`Connector`], so every
//! pooled connection has passed the egress rules.

use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use super::BoxError;
use super::body::Outbound;
use super::error::{ProxyError, chain, find_cause};
use super::pinned::Lease;
use crate::config::RetryOn;
use crate::egress::{Connector, EgressError, Resolver};

#[derive(Clone)]
pub struct UpstreamClient {
    inner: Client<HttpsConnector<Connector>, Outbound>,
}

impl UpstreamClient {
    /// A pooled client for http:// and https:// upstreams (HTTP/2 when the upstream
    /// offers it by ALPN), trusting what `tls` trusts.
    pub fn new(resolver: Resolver, tls: rustls::ClientConfig) -> UpstreamClient {
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .enable_http2()
            .wrap_connector(Connector(resolver));
        let inner = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .timer(TokioTimer::new())
            .pool_idle_timeout(super::IDLE_TIMEOUT)
            .set_host(false)
            .build(https);
        UpstreamClient { inner }
    }

    /// The response, with no lease: the pool keeps its connections (compare
    /// `PinnedConns::send`).
    pub async fn send(
        &self,
        req: Request<Outbound>,
    ) -> Result<(Response<Incoming>, Option<Lease>), AttemptError> {
        let resp = self.inner.request(req).await.map_err(|e| {
            if let Some(egress) = find_cause::<EgressError>(&e).map(EgressError::copy) {
                AttemptError::from_egress(egress)
            } else if find_cause::<rustls::Error>(&e).is_some() {
                AttemptError::Tls(Box::new(e))
            } else if find_cause::<hyper::Error>(&e).is_some_and(hyper::Error::is_parse) {
                AttemptError::Protocol(Box::new(e))
            } else if e.is_connect() {
                AttemptError::Connect(Box::new(e))
            } else {
                AttemptError::Reset(Box::new(e))
            }
        })?;
        if resp.status() == http::StatusCode::SWITCHING_PROTOCOLS {
            return Err(AttemptError::unasked_upgrade());
        }
        Ok((resp, None))
    }
}

/// How one upstream attempt failed, in the terms of `retry.on`.
#[derive(Debug, thiserror::Error)]
pub enum AttemptError {
    #[error("connect failed: {}", chain(&**.0))]
    Connect(BoxError),
    #[error("connection failed after the request was sent: {}", chain(&**.0))]
    Reset(BoxError),
    #[error("TLS with the upstream failed: {}", chain(&**.0))]
    Tls(BoxError),
    #[error("no response headers within attempt_timeout ({0:?})")]
    Timeout(Duration),
    #[error(transparent)]
    Denied(EgressError),
    /// The name did not resolve, or to no address. The resolver has already retried
    /// (resolv.conf's `attempts`), so another attempt a moment later would only repeat it.
    #[error(transparent)]
    Resolve(EgressError),
    /// The upstream answered with something that is not HTTP as the request allows (an
    /// unparsable or oversized head, a 101 to a request that asked for no upgrade): it
    /// would answer the same again.
    #[error("the upstream's response broke HTTP: {}", chain(&**.0))]
    Protocol(BoxError),
}

impl AttemptError {
    /// The `retry.on` entry this failure answers to, if any.
    pub fn retry_on(&self) -> Option<RetryOn> {
        match self {
            AttemptError::Connect(_) => Some(RetryOn::Connect),
            AttemptError::Reset(_) => Some(RetryOn::Reset),
            AttemptError::Timeout(_) => Some(RetryOn::Timeout),
            // Another attempt meets the same certificate, rule, name or answer.
            AttemptError::Tls(_)
            | AttemptError::Denied(_)
            | AttemptError::Resolve(_)
            | AttemptError::Protocol(_) => None,
        }
    }

    /// For `sluice_retries_total{reason}`.
    pub fn label(&self) -> &'static str {
        match self {
            AttemptError::Connect(_) => "connect",
            AttemptError::Reset(_) => "reset",
            AttemptError::Timeout(_) => "timeout",
            AttemptError::Tls(_) => "tls",
            AttemptError::Denied(_) => "denied",
            AttemptError::Resolve(_) => "resolve",
            AttemptError::Protocol(_) => "protocol",
        }
    }

    /// A connection that failed once the request was on it.
    pub fn after_send(e: hyper::Error) -> AttemptError {
        if e.is_parse() {
            AttemptError::Protocol(Box::new(e))
        } else {
            AttemptError::Reset(Box::new(e))
        }
    }

    /// sluice never asks for an upgrade on a forwarded request (`Upgrade` is hop-by-hop),
    /// so a 101 cannot be relayed: the client would read the next protocol as HTTP.
    pub fn unasked_upgrade() -> AttemptError {
        AttemptError::Protocol(
            "101 Switching Protocols to a request that asked for no upgrade".into(),
        )
    }

    /// A refusal by the egress rules, or a name that did not resolve.
    pub fn from_egress(e: EgressError) -> AttemptError {
        if e.is_refusal() {
            AttemptError::Denied(e)
        } else {
            AttemptError::Resolve(e)
        }
    }
}

impl From<AttemptError> for ProxyError {
    fn from(e: AttemptError) -> ProxyError {
        match e {
            AttemptError::Denied(d) | AttemptError::Resolve(d) => ProxyError::Egress(d),
            AttemptError::Timeout(t) => ProxyError::UpstreamTimeout(t),
            other => ProxyError::UpstreamUnreachable(Box::new(other)),
        }
    }
}
