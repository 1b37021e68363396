//! Two connections joined byte for byte, as a CONNECT tunnel and a switched protocol
//! (`Upgrade`) are: until either side closes, nothing moves for the idle timeout, or the
//! drain time is up.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Bytes moved through a splice, and how it ended.
#[derive(Debug)]
pub(crate) enum Ended {
    /// A side closed: bytes from the client to the upstream, and back.
    Closed(u64, u64),
    Failed(io::Error),
    Idle,
    Cut,
}

/// Joins `client` and `upstream` until either closes, nothing moves either way for
/// `idle`, or `stop` is cancelled.
pub(crate) async fn splice<C, U>(
    client: &mut C,
    upstream: U,
    idle: Duration,
    stop: &CancellationToken,
) -> Ended
where
    C: AsyncRead + AsyncWrite + Unpin,
    U: AsyncRead + AsyncWrite + Unpin,
{
    let mut upstream = Activity::new(upstream);
    let last = upstream.last.clone();
    tokio::select! {
        r = tokio::io::copy_bidirectional(client, &mut upstream) => match r {
            Ok((up, down)) => Ended::Closed(up, down),
            Err(e) => Ended::Failed(e),
        },
        () = idle_for(&last, idle) => Ended::Idle,
        _ = stop.cancelled() => Ended::Cut,
    }
}

/// The upstream side of a tunnel, noting when bytes last went either way (everything the
/// client sends is written here, everything it receives is read here).
pub(crate) struct Activity<S> {
    inner: S,
    /// Milliseconds from `base` to the last transfer.
    last: Arc<(Instant, AtomicU64)>,
}

impl<S> Activity<S> {
    fn new(inner: S) -> Activity<S> {
        Activity {
            inner,
            last: Arc::new((Instant::now(), AtomicU64::new(0))),
        }
    }

    fn moved(&self) {
        let ms = u64::try_from(self.last.0.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last.1.store(ms, Ordering::Relaxed);
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Activity<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.moved();
        }
        r
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Activity<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.moved();
        }
        r
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Completes once nothing has moved for `idle`: sleeps until the last transfer plus `idle`,
/// then looks again (one timer per idle period, not per transfer).
pub(crate) async fn idle_for(last: &(Instant, AtomicU64), idle: Duration) {
    loop {
        let at = last.0 + Duration::from_millis(last.1.load(Ordering::Relaxed)) + idle;
        if Instant::now() >= at {
            return;
        }
        tokio::time::sleep_until(at).await;
    }
}
