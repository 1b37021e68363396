//! How connections end: the drain that lets a connection finish its exchange and close,
//! then the stop that cuts what is left. Shared by the proxy listener's connections,
//! CONNECT tunnels and intercepted TLS connections.

use std::future::Future;
use std::pin::Pin;

use hyper::body::Incoming;
use hyper::server::conn::http1;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// A client has this long to send a request head once its connection is waiting for one:
/// it bounds both a head sent byte by byte and a keep-alive connection left idle (hyper's
/// default, named here because operators ask). Plain and intercepted connections alike.
pub(crate) const HEADER_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// What connection and tunnel tasks need to know about shutdown.
#[derive(Clone)]
pub(crate) struct Lifecycle {
    pub(crate) tracker: TaskTracker,
    /// Cancelled when the drain starts: connections finish their current request and close.
    pub(crate) drain: CancellationToken,
    /// Cancelled when the drain time is up: whatever still runs is cut.
    pub(crate) stop: CancellationToken,
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
    /// Serves a connection; when the drain starts it finishes the exchange in progress and
    /// closes, and when the drain time is up it is cut.
    pub(crate) async fn until_drained<C, T, E>(&self, conn: C) -> Result<(), E>
    where
        C: Graceful + Future<Output = Result<T, E>>,
    {
        // A token of the connection's own. Polling a token takes its lock, and the
        // drain token is shared by every connection on every worker: polled at each
        // wakeup of each connection, it was a lock the workers contended for, and a
        // worker preempted while holding it stalled the other worker's connections for a
        // time slice (the git history of docs/BENCHMARKS.md). A child is told when its parent is cancelled.
        let drain = self.drain.child_token();
        tokio::pin!(conn);
        tokio::select! {
            r = conn.as_mut() => r.map(|_| ()),
            _ = drain.cancelled() => {
                conn.as_mut().graceful_shutdown();
                tokio::select! {
                    r = conn.as_mut() => r.map(|_| ()),
                    _ = self.stop.cancelled() => Ok(()),
                }
            }
        }
    }
}
