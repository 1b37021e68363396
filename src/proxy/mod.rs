//! The proxy side: listener, worker threads and connections ([`server`], with its
//! per-connection timers in `timer`), the two request kinds ([`forward`] for
//! absolute-form, [`connect`] for tunnels), the [`pipeline`] every upstream request goes
//! through, the upstream clients ([`pinned`] for `http://`, speaking sluice's own
//! HTTP/1.1 client side from [`h1`], and the pooled [`client`] for TLS), and [`error`], the one place that turns failures into the responses sluice
//! makes itself.

pub mod body;
pub mod client;
pub mod connect;
pub mod error;
pub mod forward;
pub mod h1;
pub mod h2server;
pub mod headers;
pub mod intercept;
pub(crate) mod lifecycle;
pub mod outbound;
pub mod pinned;
pub mod pipeline;
pub mod replay;
pub mod rewind;
pub mod server;
#[cfg(test)]
mod sizes;
pub mod splice;
pub(crate) mod timer;
pub mod upgrade;

use bytes::Bytes;
use http_body_util::BodyExt;
use http_body_util::combinators::UnsyncBoxBody;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// An idle upstream connection older than this is closed rather than reused, by both
/// upstream clients: shorter than the common 60 s+ server keep-alive, so we rarely send on
/// one the upstream is closing.
pub const IDLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(50);

/// Bodies in both directions: streamed from the peer, or small and made here.
pub type Body = UnsyncBoxBody<Bytes, BoxError>;

pub fn full(bytes: impl Into<Bytes>) -> Body {
    http_body_util::Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed_unsync()
}

pub fn empty() -> Body {
    http_body_util::Empty::new()
        .map_err(|never| match never {})
        .boxed_unsync()
}

pub fn stream<B>(body: B) -> Body
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    body.map_err(Into::into).boxed_unsync()
}
