//! How connections end: the drain that lets a connection finish its exchange and close,
//! then the stop that cuts what is left. Shared by the proxy listener's connections,
//! CONNECT tunnels and intercepted TLS connections.

use std::future::{Future, poll_fn};
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Waker};

use hyper::body::Incoming;
use hyper::server::conn::http1;
use tokio_util::sync::{CancellationToken, WaitForCancellationFuture};
use tokio_util::task::TaskTracker;

/// A client has this long to send a request head once its connection is waiting for one:
/// it bounds both a head sent byte by byte and a keep-alive connection left idle (hyper's
/// default, named here because operators ask). Plain and intercepted connections alike.
pub(crate) const HEADER_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// What connection and tunnel tasks need to know about shutdown.
#[derive(Clone)]
pub(crate) struct Lifecycle {
    pub(crate) tracker: TaskTracker,
    /// Cancelled when the drain starts (by [`Lifecycle::start_drain`] only, which sets
    /// `draining` first): connections finish their current request and close.
    drain: CancellationToken,
    /// Cancelled when the drain time is up: whatever still runs is cut.
    pub(crate) stop: CancellationToken,
    /// Set just before `drain` is cancelled (see [`DrainWatch`]).
    draining: Arc<AtomicBool>,
}

/// A connection that can be asked to finish its current exchange and close.
pub(crate) trait Graceful: Future {
    fn graceful_shutdown(self: Pin<&mut Self>);
}

impl<I, S> Graceful for http1::UpgradeableConnection<I, S>
where
    Self: Future,
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    S: hyper::service::HttpService<Incoming>,
    S::ResBody: http_body::Body + 'static,
    <S::ResBody as http_body::Body>::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    fn graceful_shutdown(self: Pin<&mut Self>) {
        http1::UpgradeableConnection::graceful_shutdown(self)
    }
}

impl Lifecycle {
    pub(crate) fn new() -> Lifecycle {
        Lifecycle {
            tracker: TaskTracker::new(),
            drain: CancellationToken::new(),
            stop: CancellationToken::new(),
            draining: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Starts the drain: each connection finishes its exchange in progress and closes.
    pub(crate) fn start_drain(&self) {
        // Before the cancel, so that a connection woken by it finds the flag set.
        self.draining.store(true, Ordering::Release);
        self.drain.cancel();
    }

    /// Serves a connection; when the drain starts it finishes the exchange in progress and
    /// closes, and when the drain time is up it is cut.
    pub(crate) async fn until_drained<C, T, E>(&self, conn: C) -> Result<(), E>
    where
        C: Graceful + Future<Output = Result<T, E>>,
    {
        // A token of the connection's own. Polling a token takes its lock, and the
        // drain token is shared by every connection on every worker: polled at each
        // wakeup of each connection, it would be a lock the workers contend for, and a
        // worker preempted while holding it would stall the other worker's connections
        // for a time slice (the git history of docs/BENCHMARKS.md). A child is told when
        // its parent is cancelled.
        let drain = self.drain_child();
        let mut cancelled = pin!(drain.cancelled());
        let mut watch = self.watch();
        let mut conn = pin!(conn);
        // The connection first: its wake-ups are nearly all of this task's.
        let served = poll_fn(|cx| match conn.as_mut().poll(cx) {
            Poll::Ready(r) => Poll::Ready(Some(r)),
            Poll::Pending => watch.poll(cancelled.as_mut(), cx).map(|()| None),
        })
        .await;
        if let Some(r) = served {
            return r.map(|_| ());
        }
        conn.as_mut().graceful_shutdown();
        tokio::select! {
            r = conn.as_mut() => r.map(|_| ()),
            _ = self.stop.cancelled() => Ok(()),
        }
    }

    /// A token of its own for one connection, cancelled when the drain starts.
    pub(crate) fn drain_child(&self) -> CancellationToken {
        self.drain.child_token()
    }

    /// A watch on this lifecycle's drain token, or a child of it.
    pub(crate) fn watch(&self) -> DrainWatch<'_> {
        DrainWatch {
            draining: &self.draining,
            waker: None,
        }
    }
}

/// Resolves when the drain starts, and costs next to nothing to poll again before then.
/// A connection's task polls it at every wake-up, and asking the token each time takes
/// two locks (the token's state, then its waiter list) for about 280 instructions a
/// request (`bench/callgrind.sh`). Once the token holds this task's waker, the token is
/// asked again only if the waker changes or the drain has begun: the token wakes that
/// waker when it is cancelled, and the flag, set before the cancel, says so without a
/// lock.
pub(crate) struct DrainWatch<'a> {
    draining: &'a AtomicBool,
    /// The waker the token holds, once it holds one.
    waker: Option<Waker>,
}

impl DrainWatch<'_> {
    /// Polls `cancelled`, the same future each time, when its answer can have changed.
    pub(crate) fn poll(
        &mut self,
        mut cancelled: Pin<&mut WaitForCancellationFuture<'_>>,
        cx: &mut Context<'_>,
    ) -> Poll<()> {
        if !self.draining.load(Ordering::Acquire)
            && self.waker.as_ref().is_some_and(|w| w.will_wake(cx.waker()))
        {
            return Poll::Pending;
        }
        let polled = cancelled.as_mut().poll(cx);
        if polled.is_pending() {
            self.waker = Some(cx.waker().clone());
        }
        polled
    }
}
