//! Everything that talks to upstreams, behind [`send`]: the client connection's own
//! plain-HTTP connections ([`pinned`], speaking sluice's HTTP/1.1 client side from
//! [`h1`]), hyper's pooled client for TLS ([`pooled`]), the request body that reports its
//! hand-over ([`outbound`]) and the replayable one ([`replay`]), the per-connection
//! timers ([`timer`]), the head every attempt of a request sends ([`head`]), the
//! upstream's side of a switched protocol ([`switched`]), the order of a busy worker's
//! writes ([`turn`]), and [`error`], how one attempt failed, whichever connection carried
//! it.

pub(crate) mod error;
pub mod h1;
pub(crate) mod head;
pub(crate) mod outbound;
pub(crate) mod pinned;
pub(crate) mod pooled;
pub(crate) mod replay;
pub(crate) mod switched;
pub(crate) mod timer;
pub(crate) mod turn;

use std::future::Future;

use http::uri::Scheme;
use tokio::time::Instant;
use tokio_util::either::Either;

use std::sync::Arc;

use crate::egress::{Resolver, Rules};
use error::AttemptError;
pub(crate) use head::{AttemptHead, RequestHead};
use outbound::Outbound;
use pinned::{Own, UpstreamResponse};
use pooled::UpstreamClient;
use timer::{Deadline, Due, Timers};

/// What a request's client connection lends it: its own plain-HTTP upstream connections
/// and their timers, or inside an intercepted tunnel (whose requests take the pooled
/// client) the tunnel's timers.
#[derive(Clone, Copy)]
pub(crate) enum Way<'a> {
    Own(&'a Own<'a>),
    Tunnel(&'a Timers),
}

impl<'a> Way<'a> {
    pub(crate) fn own(self) -> Option<&'a Own<'a>> {
        match self {
            Way::Own(own) => Some(own),
            Way::Tunnel(_) => None,
        }
    }

    /// An upstream attempt's deadline.
    pub(crate) fn attempt_deadline(self, at: Instant) -> Either<Deadline, Due<'a>> {
        match self {
            Way::Own(own) => Either::Left(own.conns.attempt_deadline(at)),
            Way::Tunnel(timers) => Either::Right(timers.at(at)),
        }
    }

    /// A request's `total_timeout`.
    pub(crate) fn total_deadline(self, at: Instant) -> Either<Deadline, Due<'a>> {
        match self {
            Way::Own(own) => Either::Left(own.conns.total_deadline(at)),
            Way::Tunnel(timers) => Either::Right(timers.at(at)),
        }
    }
}

/// The ways one attempt can leave.
pub(crate) struct Via<'a> {
    /// The client connection's own plain-HTTP connections, with what a new one is dialled
    /// by; `None` inside an intercepted tunnel, whose requests use the pooled client.
    pub(crate) own: Option<(&'a Own<'a>, &'a Resolver, &'a Arc<Rules>)>,
    /// The route's pooled client: TLS, and plain HTTP without connections of its own.
    pub(crate) pooled: &'a UpstreamClient,
}

/// Sends `head` and `body` on the connection `via` gives it: a pinned one for `http://`
/// when the client connection has its own, else the pooled client. `start` is a clock
/// reading the caller took just before, by which idle connections are judged (no clock
/// read here).
///
/// Boxed: the caller holds a pointer rather than the request, and every level above it
/// on the request path holds the caller's future and is copied whole when it is built,
/// so a size here counts several times over (docs/architecture.md); the allocation costs
/// less.
pub(crate) fn send<'a>(
    via: Via<'a>,
    head: AttemptHead<'a>,
    body: Outbound,
    start: Instant,
) -> impl Future<Output = Result<UpstreamResponse, AttemptError>> + Unpin + 'a {
    match via.own {
        Some((own, resolver, rules)) if head.head.uri.scheme() == Some(&Scheme::HTTP) => {
            let to = (own.host, own.port);
            Either::Left(Box::pin(own.conns.send(
                (resolver, rules),
                to,
                head,
                body,
                start,
            )))
        }
        _ => Either::Right(Box::pin(via.pooled.send(head.into_request(body)))),
    }
}
