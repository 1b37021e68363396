//! The pooled upstream client: hyper-util's client over the egress [`Connector`], so every
//! pooled connection has passed the egress rules.

use std::sync::Arc;

use http::Request;
use http_body_util::Either;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use super::error::{AttemptError, find_cause};
use super::outbound::Outbound;
use super::pinned::UpstreamResponse;
use super::switched::UpstreamSide;
use crate::egress::{Connector, EgressError, Resolver};

/// Pools per worker. hyper-util runs each connection it pools as a task on the runtime
/// that opened it, and a request hands its work to that task through a channel: were one
/// pool shared by the workers, a request on one worker taking a connection another
/// opened would wake that worker to write and read for it and be woken back, several
/// thread switches a request (docs/BENCHMARKS.md, "HTTP/2 through interception"). Kept
/// per worker, as Envoy keeps its pools per worker thread, a connection is used on the
/// thread it runs on; an upstream sees up to one pool's connections per worker.
#[derive(Clone)]
pub(crate) struct UpstreamClient {
    /// One set per worker, by `worker_index`, and a last one for every other thread
    /// (and workers started after this client was built).
    per_worker: Arc<[Clients]>,
}

/// The clients of one worker.
struct Clients {
    inner: Client<HttpsConnector<Connector>, Outbound>,
    /// For requests that ask to switch protocols (`Upgrade`): HTTP/1.1 only, since the
    /// mechanism does not exist in HTTP/2, and no pool, since the connection leaves.
    upgrading: Client<HttpsConnector<Connector>, Outbound>,
    /// For `http://` requests in HTTP/2 (h2c with prior knowledge, found in a tunnel):
    /// HTTP/2 without TLS, as their client spoke it to the origin.
    h2c: Client<HttpsConnector<Connector>, Outbound>,
}

impl UpstreamClient {
    /// Pooled clients for http:// and https:// upstreams (HTTP/2 when the upstream
    /// offers it by ALPN), trusting what `tls` trusts, for each worker started so far.
    pub(crate) fn new(resolver: Resolver, tls: rustls::ClientConfig) -> UpstreamClient {
        let sets = crate::cpus::worker_slots() + 1;
        UpstreamClient {
            per_worker: (0..sets).map(|_| Clients::new(&resolver, &tls)).collect(),
        }
    }

    /// The calling thread's clients.
    fn here(&self) -> &Clients {
        let last = self.per_worker.len() - 1;
        let i = crate::cpus::worker_index().map_or(last, |i| i.min(last));
        &self.per_worker[i]
    }

    /// The response; the pool keeps its connections (compare `PinnedConns::send`).
    ///
    /// The request's URI names its authority, as `Host` does: the field goes, and the
    /// client writes it back from the URI on an HTTP/1.1 connection, while on HTTP/2 the
    /// URI becomes `:authority` alone (RFC 9113 §8.3.1). Both on HTTP/2, nginx before
    /// 1.25 answers 400 "duplicate host header". Which of the two the connection speaks
    /// is known only once the pool has one (ALPN).
    pub(crate) async fn send(
        &self,
        mut req: Request<Outbound>,
    ) -> Result<UpstreamResponse, AttemptError> {
        req.headers_mut().remove(http::header::HOST);
        let asked = req.headers().contains_key(http::header::UPGRADE);
        let clients = self.here();
        let client = if asked {
            &clients.upgrading
        } else if req.version() == http::Version::HTTP_2
            && req.uri().scheme() == Some(&http::uri::Scheme::HTTP)
        {
            &clients.h2c
        } else {
            &clients.inner
        };
        let mut resp = client.request(req).await.map_err(|e| {
            if crate::egress::is_local_failure(&e) {
                AttemptError::Local(Box::new(e))
            } else if let Some(egress) = find_cause::<EgressError>(&e).map(EgressError::copy) {
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
            if !asked {
                return Err(AttemptError::unasked_upgrade());
            }
            // The forward path joins it to the client's side (see `upgrade`).
            let side = UpstreamSide::hyper(hyper::upgrade::on(&mut resp));
            resp.extensions_mut().insert(side);
        }
        Ok(resp.map(Either::Right))
    }
}

impl Clients {
    fn new(resolver: &Resolver, tls: &rustls::ClientConfig) -> Clients {
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls.clone())
            .https_or_http()
            .enable_http1()
            .enable_http2()
            .wrap_connector(Connector(resolver.clone()));
        let inner = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .timer(TokioTimer::new())
            .pool_idle_timeout(super::pinned::IDLE_TIMEOUT)
            .build(https);
        let h2c = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .timer(TokioTimer::new())
            .pool_idle_timeout(super::pinned::IDLE_TIMEOUT)
            .http2_only(true)
            .build(
                hyper_rustls::HttpsConnectorBuilder::new()
                    .with_tls_config(tls.clone())
                    .https_or_http()
                    .enable_http2()
                    .wrap_connector(Connector(resolver.clone())),
            );
        let http1 = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls.clone())
            .https_or_http()
            .enable_http1()
            .wrap_connector(Connector(resolver.clone()));
        let upgrading = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(0)
            .timer(TokioTimer::new())
            .build(http1);
        Clients {
            inner,
            upgrading,
            h2c,
        }
    }
}
