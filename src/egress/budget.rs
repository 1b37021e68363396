//! The descriptors upstream connections may take. `max_connections` bounds client
//! connections; one client connection may open many upstream ones (each stream of an
//! HTTP/2 connection to an HTTP/1.1 upstream needs its own), so upstream connections have
//! a bound of their own, the same number: client and upstream connections together then
//! stay within the open-file limit whatever protocol the clients speak. Every upstream
//! connection carries its [`Slot`] and gives it back when it closes.
//!
//! A connection refused here, or by the kernel for want of descriptors or memory, is
//! sluice's own failure: `egress::is_local_failure` tells the callers, which answer
//! `connection_limit` and keep it from the upstream's breaker.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// Upstream connections open now, against their cap.
#[derive(Debug)]
pub(crate) struct Budget {
    open: AtomicUsize,
    cap: AtomicUsize,
}

impl Budget {
    pub(crate) fn new(cap: usize) -> Budget {
        Budget {
            open: AtomicUsize::new(0),
            cap: AtomicUsize::new(cap),
        }
    }

    /// The cap from now on (a reload's `max_connections`); open connections stay.
    pub(crate) fn set_cap(&self, cap: usize) {
        self.cap.store(cap, Ordering::Relaxed);
    }

    pub(crate) fn open(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    /// A slot for one more connection, if the cap allows it.
    pub(crate) fn take(self: &Arc<Self>) -> Result<Slot, NoDescriptor> {
        let cap = self.cap.load(Ordering::Relaxed);
        self.open
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < cap).then_some(n + 1)
            })
            .map(|_| Slot(self.clone()))
            .map_err(|_| NoDescriptor(cap))
    }
}

/// One upstream connection's place under the cap.
#[derive(Debug)]
pub(crate) struct Slot(Arc<Budget>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Every place under the cap is taken.
#[derive(Debug, thiserror::Error)]
#[error(
    "sluice has {0} upstream connections open, its limit (max_connections): no descriptor \
     for another"
)]
pub(crate) struct NoDescriptor(pub(crate) usize);

/// An upstream connection with its slot: the slot goes back when the socket closes.
#[derive(Debug)]
pub(crate) struct Counted {
    io: TcpStream,
    _slot: Option<Slot>,
}

impl Counted {
    pub(crate) fn new(io: TcpStream, slot: Slot) -> Counted {
        Counted {
            io,
            _slot: Some(slot),
        }
    }

    pub(crate) fn get_ref(&self) -> &TcpStream {
        &self.io
    }
}

/// A connection made outside the budget (tests of the HTTP/1.1 client).
impl From<TcpStream> for Counted {
    fn from(io: TcpStream) -> Counted {
        Counted { io, _slot: None }
    }
}

impl AsyncRead for Counted {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for Counted {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

impl hyper_util::client::legacy::connect::Connection for Counted {
    /// Without the addresses hyper-util's own `TcpStream` reports: the pooled client
    /// copies them into every response's extensions, three allocations a response that
    /// nothing here reads.
    fn connected(&self) -> hyper_util::client::legacy::connect::Connected {
        hyper_util::client::legacy::connect::Connected::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_bounded_and_come_back() {
        let b = Arc::new(Budget::new(2));
        let one = b.take().unwrap();
        let two = b.take().unwrap();
        assert!(b.take().is_err());
        drop(one);
        assert_eq!(b.open(), 1);
        let _three = b.take().unwrap();
        b.set_cap(1);
        assert!(b.take().is_err());
        drop(two);
        assert!(b.take().is_err(), "still 1 open against a cap of 1");
    }
}
