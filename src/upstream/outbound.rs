//! The request body on its way upstream, which tells the limiter the instant the request
//! is handed to its upstream connection.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};

use crate::body::{Body, BoxError};
use crate::limit::SendHook;

/// A request body on its way upstream, carrying the hook that reports the instant the
/// request is handed to its connection: when a client takes a request to write its head,
/// it asks the body whether it is empty or how long it is (`h1::conn` both, hyper
/// `is_end_stream` for HTTP/1 and `size_hint` for HTTP/2), and never before. That is after connecting and TLS, on
/// whichever connection the request got, and not at all for a request that never got
/// one, so the limiter counts the request from there.
pub(crate) struct Outbound {
    inner: Body,
    /// Taken by the first look; a `Cell` because the first look may be through `&self`.
    hook: std::cell::Cell<Option<SendHook>>,
}

impl Outbound {
    pub(crate) fn new(inner: Body, hook: Option<SendHook>) -> Outbound {
        Outbound {
            inner,
            hook: std::cell::Cell::new(hook),
        }
    }

    fn handed_over(&self) {
        if let Some(hook) = self.hook.take() {
            hook.fire();
        }
    }
}

impl From<Body> for Outbound {
    fn from(inner: Body) -> Outbound {
        Outbound::new(inner, None)
    }
}

impl HttpBody for Outbound {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.handed_over();
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.handed_over();
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.handed_over();
        self.inner.size_hint()
    }
}
