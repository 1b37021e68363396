//! The upstream's side of a connection that switched protocols (`101`), as the
//! connection that carried the request hands it over; `proxy::upgrade` joins it to the
//! client's.

use std::sync::Arc;

use crate::egress::Counted;
use bytes::BytesMut;
use hyper::upgrade::OnUpgrade;
use parking_lot::Mutex;

/// The upstream's side of a switched connection, handed from the upstream client to the
/// forward path in the response's extensions (which must be `Clone`).
#[derive(Clone)]
pub(crate) struct UpstreamSide(Arc<Mutex<Option<Side>>>);

pub(crate) enum Side {
    /// From the own HTTP/1.1 client: the socket, and what the upstream already sent in
    /// the new protocol behind its head.
    Own(Counted, BytesMut),
    /// From hyper's client (TLS upstreams), once it lets the connection go.
    Hyper(OnUpgrade),
}

impl UpstreamSide {
    pub(crate) fn own(io: Counted, rest: BytesMut) -> UpstreamSide {
        UpstreamSide(Arc::new(Mutex::new(Some(Side::Own(io, rest)))))
    }

    pub(crate) fn hyper(on: OnUpgrade) -> UpstreamSide {
        UpstreamSide(Arc::new(Mutex::new(Some(Side::Hyper(on)))))
    }

    pub(crate) fn take(&self) -> Option<Side> {
        self.0.lock().take()
    }
}
