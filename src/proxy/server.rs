//! The proxy listener: accept loops, one HTTP/1.1 connection task per client (keep-alive,
//! upgrades for CONNECT), the cap on connections, and each request's way from the client
//! connection into `forward` or `connect`. The process around it (admin listener,
//! reloads, shutdown sequence) is wired in `crate::server`.
//!
//! The binary serves clients thread-per-core ([`Workers`]): one single-threaded runtime
//! per CPU, each running the connections it is given start to end, so a request never
//! waits for or wakes another thread on its way through. What is shared between them
//! (limiter, metrics, config) is behind locks held for a few instructions.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use http::{Method, Request, Response};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Handle;
use tokio_util::sync::CancellationToken;

use super::lifecycle::{HEADER_READ_TIMEOUT, Lifecycle};
use super::{connect, forward};
use crate::app::App;
use crate::body::Body;
use crate::upstream::pinned::PinnedConns;
use crate::upstream::timer::ConnTimer;

/// Request heads larger than this (request line plus headers) are answered 431, close to
/// Envoy's 60 KiB default.
pub(crate) const MAX_HEAD_BYTES: usize = 64 * 1024;

// More than 100 header fields are answered 431 too (Envoy's default is 100 as well):
// hyper's default, left implicit on purpose, since naming any limit makes hyper allocate
// and fill a header index array for every request instead of using the stack.

/// Single-threaded runtimes on their own threads, one per core by default, that serve
/// client connections. Dropping it stops them (after the server has drained).
pub struct Workers {
    handles: Vec<Handle>,
    threads: Vec<std::thread::JoinHandle<()>>,
    done: CancellationToken,
}

impl Workers {
    /// Starts `count` workers; with `cpus`, worker `i` runs only on `cpus[i]`: two
    /// unpinned workers that the scheduler puts on one CPU take turns for time slices
    /// until it moves one, and every connection of both waits meanwhile
    /// (docs/BENCHMARKS.md, "The tail"). [`crate::cpus::plan`]
    /// decides when that pays. Unpinned, with `spread`, they are kept apart on those
    /// CPUs instead ([`crate::cpus::Spread`]).
    /// Returns the workers and the CPUs they were pinned to, if all of them were.
    pub fn start(
        count: usize,
        cpus: Option<Vec<usize>>,
        spread: Option<Vec<usize>>,
    ) -> io::Result<(Workers, Option<Vec<usize>>)> {
        let count = count.max(1);
        crate::cpus::starting_workers(count);
        let cpus = cpus.filter(|c| c.len() >= count);
        let done = CancellationToken::new();
        let mut workers = Workers {
            handles: Vec::new(),
            threads: Vec::new(),
            done: done.clone(),
        };
        // Each worker pins itself and says whether that worked.
        let (pinned_tx, pinned_rx) = std::sync::mpsc::channel();
        let spread = spread
            .filter(|_| cpus.is_none())
            .map(|allowed| crate::cpus::Spread::new(count, allowed));
        for i in 0..count {
            let mut rt = tokio::runtime::Builder::new_current_thread();
            rt.enable_all();
            crate::clock::per_poll(&mut rt);
            // The worker's log lines go to the writer when it has nothing left to run
            // (see `log::batch_thread`).
            match spread.clone() {
                Some(spread) => {
                    let resting = spread.clone();
                    rt.on_thread_park(move || {
                        crate::log::flush_thread();
                        resting.resting(i);
                    })
                    .on_thread_unpark(move || spread.running(i));
                }
                None => {
                    rt.on_thread_park(crate::log::flush_thread);
                }
            }
            let rt = rt.build()?;
            workers.handles.push(rt.handle().clone());
            let done = done.clone();
            let cpu = cpus.as_ref().and_then(|c| c.get(i).copied());
            let pinned_tx = pinned_tx.clone();
            let thread = std::thread::Builder::new()
                .name(format!("sluice-worker-{i}"))
                .spawn(move || {
                    crate::cpus::this_is_worker(i);
                    crate::log::batch_thread();
                    crate::upstream::turn::enroll(rt.handle());
                    let _ = pinned_tx.send(cpu.is_some_and(pin_to));
                    drop(pinned_tx);
                    rt.block_on(done.cancelled())
                })?;
            workers.threads.push(thread);
        }
        drop(pinned_tx);
        let all_pinned = pinned_rx.iter().take(count).filter(|&ok| ok).count() == count;
        Ok((workers, cpus.filter(|_| all_pinned)))
    }

    pub fn handles(&self) -> Vec<Handle> {
        self.handles.clone()
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.done.cancel();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Keeps the calling thread on `cpu`; a refusal leaves it where the scheduler puts it.
#[cfg(target_os = "linux")]
fn pin_to(cpu: usize) -> bool {
    use rustix::thread::{CpuSet, sched_setaffinity};
    let mut only = CpuSet::new();
    only.set(cpu);
    match sched_setaffinity(None, &only) {
        Ok(()) => true,
        Err(e) => {
            tracing::warn!(cpu, error = %e, "cannot pin a worker to its CPU; it runs unpinned");
            false
        }
    }
}

#[cfg(not(target_os = "linux"))]
fn pin_to(_: usize) -> bool {
    false
}

/// A runtime that serves clients, and how many connections it has now.
struct Worker {
    handle: Handle,
    live: Arc<AtomicUsize>,
}

/// Counts a connection out of its worker however its task ends.
struct Counted(Arc<AtomicUsize>);

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Accepts and serves clients on `listener` until `accepting` is cancelled, on these
/// runtimes (none: the caller's). `default_cap`: the connection cap when the config names
/// none.
pub(crate) fn spawn_accepting(
    app: Arc<App>,
    (listener, default_cap): (TcpListener, u64),
    lc: Lifecycle,
    accepting: CancellationToken,
    workers: Vec<Handle>,
) -> tokio::task::JoinHandle<()> {
    let workers = workers
        .into_iter()
        .map(|handle| Worker {
            handle,
            live: Arc::default(),
        })
        .collect();
    tokio::spawn(accept_loop(
        app,
        (listener, default_cap),
        lc,
        accepting,
        workers,
    ))
}

async fn accept_loop(
    app: Arc<App>,
    (listener, default_cap): (TcpListener, u64),
    lc: Lifecycle,
    accepting: CancellationToken,
    workers: Vec<Worker>,
) {
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = accepting.cancelled() => return,
        };
        match accepted {
            Ok((stream, peer)) => {
                let cap = app.config().proxy.max_connections.unwrap_or(default_cap);
                let Some(slot) = Slot::take(&app.client_connections, cap) else {
                    app.metrics.connections_refused.inc();
                    // Answering takes a descriptor for up to a second: under a flood,
                    // beyond a few dozen at once the connection is just closed.
                    if let Some(answering) = Slot::take(&REFUSING, MAX_REFUSING) {
                        tokio::spawn(refuse(stream, cap, answering));
                    }
                    continue;
                };
                let _ = stream.set_nodelay(true);
                hand_out(&app, (stream, slot), peer, &lc, &workers);
            }
            Err(e) => {
                // Typically EMFILE: back off a little instead of spinning.
                tracing::warn!(error = %e, "accept failed");
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(50)) => {}
                    _ = accepting.cancelled() => return,
                }
            }
        }
    }
}

/// Over-the-cap connections being answered at once, at most [`MAX_REFUSING`].
static REFUSING: std::sync::LazyLock<Arc<AtomicUsize>> = std::sync::LazyLock::new(Arc::default);
const MAX_REFUSING: u64 = 64;

/// A client connection's place under `max_connections`.
pub(crate) struct Slot(Arc<AtomicUsize>);

impl Slot {
    fn take(count: &Arc<AtomicUsize>, cap: u64) -> Option<Slot> {
        let cap = usize::try_from(cap).unwrap_or(usize::MAX);
        count
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < cap).then_some(n + 1)
            })
            .ok()
            .map(|_| Slot(count.clone()))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Answers a connection beyond the cap with a 503 it can read (rather than a reset), then
/// closes it. The request is not read: a second is given for it to arrive so that
/// closing does not reset the connection before the client has our answer.
async fn refuse(mut stream: TcpStream, cap: u64, _answering: Slot) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let body = format!(
        "{{\"error\": {{\"code\": \"sluice_connection_limit\", \"message\": \"sluice serves \
         {cap} client connections at most (proxy.max_connections); retry shortly\"}}}}\n"
    );
    let resp = format!(
        "HTTP/1.1 503 Service Unavailable\r\nsluice-reason: connection_limit\r\n\
         retry-after: 1\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         connection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        stream.write_all(resp.as_bytes()).await?;
        stream.shutdown().await?;
        let mut sink = [0u8; 4096];
        while stream.read(&mut sink).await? > 0 {}
        Ok::<_, io::Error>(())
    })
    .await;
}

/// Gives a new connection to the worker with the fewest, where it stays to its end. (With
/// a shared accept queue, whichever thread wakes first would take a whole burst.)
fn hand_out(
    app: &Arc<App>,
    (stream, slot): (TcpStream, Slot),
    peer: SocketAddr,
    lc: &Lifecycle,
    workers: &[Worker],
) {
    let Some((index, worker)) = workers
        .iter()
        .enumerate()
        .min_by_key(|(_, w)| w.live.load(Ordering::Relaxed))
    else {
        lc.tracker.spawn(serve_connection(
            app.clone(),
            (stream, slot),
            peer,
            lc.clone(),
            0,
        ));
        return;
    };
    // Re-registered with the worker's event loop on arrival.
    let stream = match stream.into_std() {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(%peer, error = %e, "cannot hand a connection to a worker");
            return;
        }
    };
    worker.live.fetch_add(1, Ordering::Relaxed);
    let live = Counted(worker.live.clone());
    let (app, lc2) = (app.clone(), lc.clone());
    worker.handle.spawn(lc.tracker.track_future(async move {
        let _live = live;
        match TcpStream::from_std(stream) {
            Ok(stream) => serve_connection(app, (stream, slot), peer, lc2, index).await,
            Err(e) => tracing::warn!(%peer, error = %e, "a worker cannot take a connection"),
        }
    }));
}

/// `worker`: the index of the worker running it (0 without workers).
async fn serve_connection(
    app: Arc<App>,
    (stream, slot): (TcpStream, Slot),
    peer: SocketAddr,
    lc: Lifecycle,
    worker: usize,
) {
    let send_timeout = app.config().proxy.send_timeout;
    let conns = PinnedConns::new(app.idle_conns.clone(), worker);
    let shared = Arc::new(ConnShared {
        app,
        lc: lc.clone(),
        upstreams: conns.clone(),
        peer,
    });
    let svc = service_fn(move |req: Request<Incoming>| handle(shared.clone(), req));
    let conn = http1::Builder::new()
        // One flat buffer per write: API responses are small, and copying a body chunk
        // costs less than hyper's bookkeeping for vectored writes (the git history of
        // docs/BENCHMARKS.md).
        .writev(false)
        .timer(ConnTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .max_header_size(MAX_HEAD_BYTES)
        .serve_connection(TokioIo::new(ClientIo::new(stream, slot, send_timeout)), svc)
        .with_upgrades();
    let result = lc.until_drained(conn).await;
    conns.hand_over();
    if let Err(e) = result {
        if e.is_parse() || e.is_parse_too_large() {
            // hyper answered this request itself (431 for a head too large, else 400)
            // without calling the service: it still gets its access line.
            let (status, outcome) = if e.is_parse_too_large() {
                (431, "head_too_large")
            } else {
                (400, "bad_request")
            };
            crate::log::access(&crate::log::Access {
                method: "-",
                host: "-",
                path: "-",
                upstream: "-",
                family: "-",
                status,
                outcome,
                duration: Duration::ZERO,
                at: crate::clock::now(),
            });
        }
        tracing::debug!(%peer, error = %e, "client connection ended with an error");
    }
    // Before the connection's task ends: a drain that waits for it then logs its end
    // after the connection's last access line.
    crate::log::flush_thread();
}

/// A client socket whose writes may not stay blocked for longer than `limit` (nginx's
/// `send_timeout`): a client that stops reading would otherwise keep its response, and
/// the concurrency permit that goes with it, forever. The error ends the connection,
/// which drops the response and gives the permits back. It stays with the socket after
/// an upgrade, so a tunnel whose client stops reading ends the same way, and so does the
/// connection's place under `max_connections`, given back when the socket closes.
pub(crate) struct ClientIo<T> {
    inner: T,
    _slot: Slot,
    limit: Duration,
    /// Armed when a write finds the socket full, disarmed by the next write that goes
    /// through: most responses never block and never touch the timer wheel.
    blocked: Option<Pin<Box<tokio::time::Sleep>>>,
    armed: bool,
}

impl<T> ClientIo<T> {
    pub(crate) fn new(inner: T, slot: Slot, limit: Duration) -> ClientIo<T> {
        ClientIo {
            inner,
            _slot: slot,
            limit,
            blocked: None,
            armed: false,
        }
    }

    /// On a write that made no progress: whether the client has been stuck too long.
    fn stalled(&mut self, cx: &mut std::task::Context<'_>) -> bool {
        let deadline = tokio::time::Instant::now() + self.limit;
        let sleep = self
            .blocked
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        if !self.armed {
            sleep.as_mut().reset(deadline);
            self.armed = true;
        }
        sleep.as_mut().poll(cx).is_ready()
    }

    fn timed_out(&self) -> io::Error {
        io::Error::new(
            io::ErrorKind::TimedOut,
            format!(
                "the client read nothing for {} (send_timeout)",
                crate::config::units::fmt_duration(self.limit)
            ),
        )
    }
}

impl<T: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for ClientIo<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for ClientIo<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<io::Result<usize>> {
        use std::task::Poll;
        match Pin::new(&mut self.inner).poll_write(cx, buf) {
            Poll::Pending => {
                if self.stalled(cx) {
                    return Poll::Ready(Err(self.timed_out()));
                }
                Poll::Pending
            }
            done => {
                self.armed = false;
                done
            }
        }
    }

    fn poll_flush(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        use std::task::Poll;
        match Pin::new(&mut self.inner).poll_flush(cx) {
            Poll::Pending => {
                if self.stalled(cx) {
                    return Poll::Ready(Err(self.timed_out()));
                }
                Poll::Pending
            }
            done => done,
        }
    }

    fn poll_shutdown(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// What a client connection's requests share, behind one reference count: cloning its
/// parts for each request cost two locks (the cancellation tokens) and five atomic
/// increments, and as many again to drop.
struct ConnShared {
    app: Arc<App>,
    lc: Lifecycle,
    upstreams: PinnedConns,
    peer: SocketAddr,
}

/// A request's whole life. A plain function returning an `async move` block, not an
/// `async fn`: an `async fn` keeps a second copy of every argument it moves on (the request,
/// 264 bytes), and each copy is paid again at every level that holds this future.
#[allow(clippy::manual_async_fn, reason = "see above: arguments stored once")]
fn handle(
    conn: Arc<ConnShared>,
    req: Request<Incoming>,
) -> impl Future<Output = Result<Response<Body>, Infallible>> {
    async move {
        Ok(if req.method() == Method::CONNECT {
            // Boxed: a tunnel is set up once per connection, and its larger future would
            // otherwise size every plain request's future.
            Box::pin(connect::tunnel(&conn.app, &conn.lc, req, conn.peer)).await
        } else {
            let resp = forward::forward(&conn.app, &conn.lc, &conn.upstreams, req).await;
            crate::upstream::turn::write_in_turn().await;
            resp
        })
    }
}
