//! Everything that can stop a request before an upstream answers it, and the single
//! mapping from those failures to the responses sluice makes itself (PRODUCT.md's table):
//! status, `sluice-reason`, and a JSON body `{"error": {"code", "message"}}`.

use std::time::Duration;

use http::{HeaderValue, Response, StatusCode, header};

use crate::body::{Body, BoxError, full};
use crate::config::units::fmt_duration;
use crate::egress::EgressError;
use crate::limit::LimitError;
use crate::limit::bucket::retry_after as whole_seconds;
use crate::price::Unpriced;
use crate::upstream::error::{AttemptError, chain};

#[derive(Debug, thiserror::Error)]
pub(crate) enum ProxyError {
    /// A request line in origin-form (`GET /path`) sent to the proxy port.
    #[error(
        "this is a forward proxy: send the absolute URL in the request line \
         (GET http://host/path) or set HTTP_PROXY, and use CONNECT for https"
    )]
    NotProxyRequest,
    #[error("bad request: {0}")]
    BadRequest(String),
    #[error("the destination host is not configured and unmatched = \"deny\"")]
    UnmatchedDenied,
    #[error(transparent)]
    Egress(EgressError),
    #[error(transparent)]
    Limit(#[from] LimitError),
    #[error("the upstream's circuit is open; retry in {}", fmt_duration(*retry_after))]
    BreakerOpen { retry_after: Duration },
    #[error("no response from the upstream within attempt_timeout ({})", fmt_duration(*.0))]
    UpstreamTimeout(Duration),
    /// The message names every cause, so the error has no `source()` of its own: a log
    /// that walked it would print the causes twice.
    #[error("upstream unreachable: {}", chain(&**.0))]
    UpstreamUnreachable(BoxError),
    #[error("total_timeout of {} ran out", fmt_duration(*.0))]
    TotalTimeout(Duration),
    /// The client's request body broke (malformed framing, disconnect mid-upload).
    #[error("{0}")]
    ClientBody(String),
    /// sluice's own resources ran out (upstream connections at their cap, descriptors,
    /// socket memory): nothing the upstream did.
    #[error("{}", chain(&**.0))]
    LocalResources(BoxError),
    /// What the request costs cannot be told, or can never be admitted (boxed: every
    /// request's future holds room for a `ProxyError`).
    #[error(transparent)]
    Unpriced(Box<Unpriced>),
    /// The client sent its body too slowly for the upstream's timeout.
    #[error("the request body did not arrive within {}", fmt_duration(*.0))]
    ClientTimeout(Duration),
}

impl From<Unpriced> for ProxyError {
    fn from(u: Unpriced) -> ProxyError {
        ProxyError::Unpriced(Box::new(u))
    }
}

impl ProxyError {
    /// The `sluice-reason` value and the status of the local response, by variant (the
    /// table in PRODUCT.md): one exhaustive match, so a new variant must say both.
    fn kind(&self) -> (&'static str, StatusCode) {
        use StatusCode as S;
        match self {
            ProxyError::NotProxyRequest | ProxyError::BadRequest(_) | ProxyError::ClientBody(_) => {
                ("bad_request", S::BAD_REQUEST)
            }
            ProxyError::ClientTimeout(_) => ("client_timeout", S::REQUEST_TIMEOUT),
            ProxyError::Unpriced(u) => {
                let (reason, status) = u.answer();
                (reason, S::from_u16(status).unwrap_or(S::BAD_REQUEST))
            }
            ProxyError::UnmatchedDenied => ("denied", S::FORBIDDEN),
            ProxyError::Egress(e) if e.is_refusal() => ("denied", S::FORBIDDEN),
            ProxyError::Egress(_) | ProxyError::UpstreamUnreachable(_) => {
                ("upstream_unreachable", S::BAD_GATEWAY)
            }
            ProxyError::TotalTimeout(_) => ("total_timeout", S::GATEWAY_TIMEOUT),
            ProxyError::LocalResources(_) => ("connection_limit", S::SERVICE_UNAVAILABLE),
            ProxyError::BreakerOpen { .. } => ("breaker_open", S::SERVICE_UNAVAILABLE),
            ProxyError::UpstreamTimeout(_) => ("upstream_timeout", S::GATEWAY_TIMEOUT),
            ProxyError::Limit(e) => match e {
                LimitError::QueueFull { .. } => ("queue_full", S::TOO_MANY_REQUESTS),
                LimitError::QueueTimeout { .. } => ("queue_timeout", S::TOO_MANY_REQUESTS),
                LimitError::ShuttingDown => ("shutting_down", S::SERVICE_UNAVAILABLE),
                LimitError::ClusterUnavailable { .. } => {
                    ("cluster_unavailable", S::SERVICE_UNAVAILABLE)
                }
                LimitError::PartitionLimit { .. } => ("partition_limit", S::SERVICE_UNAVAILABLE),
            },
        }
    }

    /// The `sluice-reason` value; metrics use `sluice_<reason>` as the outcome.
    pub(crate) fn reason(&self) -> &'static str {
        self.kind().0
    }

    pub(crate) fn status(&self) -> StatusCode {
        self.kind().1
    }

    /// The `Retry-After` a local response carries, when waiting helps.
    pub(crate) fn retry_after(&self) -> Option<Duration> {
        match self {
            ProxyError::Limit(
                LimitError::QueueFull { retry_after }
                | LimitError::QueueTimeout { retry_after }
                | LimitError::ClusterUnavailable { retry_after }
                | LimitError::PartitionLimit { retry_after },
            )
            | ProxyError::BreakerOpen { retry_after } => Some(*retry_after),
            ProxyError::LocalResources(_) => Some(Duration::from_secs(1)),
            _ => None,
        }
    }

    pub(crate) fn outcome(&self) -> String {
        format!("sluice_{}", self.reason())
    }

    pub(crate) fn to_response(&self) -> Response<Body> {
        let reason = self.reason();
        // Written directly rather than through a `serde_json::Value`: a refusal is the
        // answer a flooding client gets thousands of times a second, and a value tree
        // costs a dozen allocations each time (scripts/cost-budgets.toml, `limited`).
        let message = self.to_string();
        let mut body = Vec::with_capacity(48 + reason.len() + message.len());
        body.extend_from_slice(b"{\"error\":{\"code\":\"sluice_");
        body.extend_from_slice(reason.as_bytes());
        body.extend_from_slice(b"\",\"message\":");
        // Writing a string into a Vec cannot fail.
        let _ = serde_json::to_writer(&mut body, &message);
        body.extend_from_slice(b"}}\n");
        let mut resp = Response::new(full(body));
        *resp.status_mut() = self.status();
        let h = resp.headers_mut();
        h.insert("sluice-reason", HeaderValue::from_static(reason));
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Some(after) = self.retry_after() {
            h.insert(
                header::RETRY_AFTER,
                HeaderValue::from(whole_seconds(after).as_secs()),
            );
        }
        if matches!(
            self,
            ProxyError::ClientBody(_) | ProxyError::ClientTimeout(_)
        ) || matches!(self, ProxyError::Unpriced(u) if matches!(**u, Unpriced::BodyTooLarge { .. }))
        {
            // The rest of the request body is in no known state: nothing more can be read
            // off this connection.
            h.insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        resp
    }
}

impl From<AttemptError> for ProxyError {
    fn from(e: AttemptError) -> ProxyError {
        match e {
            AttemptError::Denied(d) | AttemptError::Resolve(d) => ProxyError::Egress(d),
            AttemptError::Timeout(t) => ProxyError::UpstreamTimeout(t),
            AttemptError::Local(e) => ProxyError::LocalResources(e),
            other => ProxyError::UpstreamUnreachable(Box::new(other)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[tokio::test]
    async fn local_response_shape() {
        let resp = ProxyError::UnmatchedDenied.to_response();
        assert_eq!(resp.status(), StatusCode::FORBIDDEN);
        assert_eq!(resp.headers()["sluice-reason"], "denied");
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["error"]["code"], "sluice_denied");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("unmatched")
        );
    }

    /// A message that quotes what the client sent stays one JSON string, whatever it holds.
    #[tokio::test]
    async fn a_message_with_quotes_and_control_characters_is_escaped() {
        let text = "bad \"value\"\\ here\n\u{1}\u{7f}é";
        let resp = ProxyError::BadRequest(text.into()).to_response();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["error"]["code"], "sluice_bad_request");
        assert!(v["error"]["message"].as_str().unwrap().contains(text));
        assert_eq!(body.last(), Some(&b'\n'));
    }

    /// Every variant against PRODUCT.md's table of local responses: reason, status and
    /// whether Retry-After is sent.
    #[test]
    fn every_variant_maps_as_the_product_table_says() {
        let d = Duration::from_secs(2);
        let io = || -> BoxError { Box::new(std::io::Error::other("reset")) };
        let cases: Vec<(ProxyError, &str, u16, bool)> = vec![
            (
                LimitError::QueueFull { retry_after: d }.into(),
                "queue_full",
                429,
                true,
            ),
            (
                LimitError::QueueTimeout { retry_after: d }.into(),
                "queue_timeout",
                429,
                true,
            ),
            (
                ProxyError::BreakerOpen { retry_after: d },
                "breaker_open",
                503,
                true,
            ),
            (ProxyError::TotalTimeout(d), "total_timeout", 504, false),
            (
                ProxyError::UpstreamUnreachable(io()),
                "upstream_unreachable",
                502,
                false,
            ),
            (ProxyError::UnmatchedDenied, "denied", 403, false),
            (LimitError::ShuttingDown.into(), "shutting_down", 503, false),
            (ProxyError::NotProxyRequest, "bad_request", 400, false),
            (
                ProxyError::BadRequest("x".into()),
                "bad_request",
                400,
                false,
            ),
            (
                ProxyError::ClientBody("x".into()),
                "bad_request",
                400,
                false,
            ),
            (ProxyError::ClientTimeout(d), "client_timeout", 408, false),
            (
                ProxyError::UpstreamTimeout(d),
                "upstream_timeout",
                504,
                false,
            ),
            (
                LimitError::ClusterUnavailable { retry_after: d }.into(),
                "cluster_unavailable",
                503,
                true,
            ),
            (
                LimitError::PartitionLimit { retry_after: d }.into(),
                "partition_limit",
                503,
                true,
            ),
            (
                Unpriced::TooLarge {
                    unit: "tokens".into(),
                    cost: 9,
                    most: 8,
                    why: "its max",
                }
                .into(),
                "cost_too_large",
                413,
                false,
            ),
            (
                Unpriced::Declared("x".into()).into(),
                "bad_request",
                400,
                false,
            ),
        ];
        for (e, reason, status, retry_after) in cases {
            let resp = e.to_response();
            assert_eq!(e.reason(), reason, "{e}");
            assert_eq!(resp.status().as_u16(), status, "{e}");
            assert_eq!(resp.headers()["sluice-reason"], reason, "{e}");
            assert_eq!(
                resp.headers().contains_key(header::RETRY_AFTER),
                retry_after,
                "{e}"
            );
        }
    }

    #[test]
    fn statuses() {
        assert_eq!(
            ProxyError::NotProxyRequest.status(),
            StatusCode::BAD_REQUEST
        );
        assert_eq!(
            ProxyError::TotalTimeout(Duration::from_secs(1)).status(),
            StatusCode::GATEWAY_TIMEOUT
        );
        let denied = ProxyError::Egress(EgressError::Denied {
            addr: "169.254.169.254:80".parse().unwrap(),
            why: crate::egress::Why::Configured,
        });
        assert_eq!(denied.status(), StatusCode::FORBIDDEN);
        let port = ProxyError::Egress(EgressError::Port { port: 22 });
        assert_eq!(port.reason(), "denied");
        let dns = ProxyError::Egress(EgressError::NoAddresses);
        assert_eq!(dns.status(), StatusCode::BAD_GATEWAY);
        assert_eq!(dns.outcome(), "sluice_upstream_unreachable");
    }
}
