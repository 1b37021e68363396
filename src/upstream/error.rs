//! How one upstream attempt failed, whichever connection carried it: the one error type
//! of this layer, in the terms of `retry.on`. `proxy::error` maps it to a local response,
//! once.

use std::time::Duration;

use crate::body::BoxError;
use crate::config::RetryOn;
use crate::egress::EgressError;

/// Walks an error's causes to the first one of type `T`.
pub(crate) fn find_cause<'a, T: std::error::Error + 'static>(
    err: &'a (dyn std::error::Error + 'static),
) -> Option<&'a T> {
    let mut cur = Some(err);
    while let Some(e) = cur {
        if let Some(t) = e.downcast_ref::<T>() {
            return Some(t);
        }
        // io::Error hides what it wraps from `source()`; tokio-rustls reports TLS
        // failures that way.
        if let Some(inner) = e
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
            && let Some(t) = find_cause::<T>(inner)
        {
            return Some(t);
        }
        cur = e.source();
    }
    None
}

/// The full cause chain of a foreign error (hyper's, rustls') on one line. sluice's own
/// errors name their causes in their message already, so they are displayed, not walked.
pub(crate) fn chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut out = err.to_string();
    let mut cur = err.source();
    while let Some(e) = cur {
        out.push_str(": ");
        out.push_str(&e.to_string());
        cur = e.source();
    }
    out
}

/// How one upstream attempt failed, in the terms of `retry.on`.
#[derive(Debug, thiserror::Error)]
pub(crate) enum AttemptError {
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
    /// sluice's own want of resources: no descriptor left under its cap or the kernel's,
    /// no memory for a socket. Nothing about the upstream: never its breaker's, never
    /// retried against it.
    #[error("{}", chain(&**.0))]
    Local(BoxError),
}

impl AttemptError {
    /// The `retry.on` entry this failure answers to, if any.
    pub(crate) fn retry_on(&self) -> Option<RetryOn> {
        match self {
            AttemptError::Connect(_) => Some(RetryOn::Connect),
            AttemptError::Reset(_) => Some(RetryOn::Reset),
            AttemptError::Timeout(_) => Some(RetryOn::Timeout),
            // Another attempt meets the same certificate, rule, name or answer.
            AttemptError::Tls(_)
            | AttemptError::Denied(_)
            | AttemptError::Resolve(_)
            | AttemptError::Protocol(_)
            | AttemptError::Local(_) => None,
        }
    }

    /// For `sluice_retries_total{reason}`.
    pub(crate) fn label(&self) -> &'static str {
        match self {
            AttemptError::Connect(_) => "connect",
            AttemptError::Reset(_) => "reset",
            AttemptError::Timeout(_) => "timeout",
            AttemptError::Tls(_) => "tls",
            AttemptError::Denied(_) => "denied",
            AttemptError::Resolve(_) => "resolve",
            AttemptError::Protocol(_) => "protocol",
            AttemptError::Local(_) => "local",
        }
    }

    /// A connection to the upstream could not be made: sluice's own want of resources, or
    /// the upstream's failure to accept it.
    pub(crate) fn from_connect(e: std::io::Error) -> AttemptError {
        if crate::egress::is_local_failure(&e) {
            AttemptError::Local(Box::new(e))
        } else {
            AttemptError::Connect(Box::new(e))
        }
    }

    /// A plain-HTTP upstream connection failed (see `h1`).
    pub(crate) fn from_h1(e: super::h1::Error) -> AttemptError {
        if e.is_protocol() {
            AttemptError::Protocol(Box::new(e))
        } else {
            AttemptError::Reset(Box::new(e))
        }
    }

    /// sluice never asks for an upgrade on a forwarded request (`Upgrade` is hop-by-hop),
    /// so a 101 cannot be relayed: the client would read the next protocol as HTTP.
    pub(crate) fn unasked_upgrade() -> AttemptError {
        AttemptError::Protocol(
            "101 Switching Protocols to a request that asked for no upgrade".into(),
        )
    }

    /// A refusal by the egress rules, or a name that did not resolve.
    pub(crate) fn from_egress(e: EgressError) -> AttemptError {
        if e.is_refusal() {
            AttemptError::Denied(e)
        } else {
            AttemptError::Resolve(e)
        }
    }
}
