//! Plain-HTTP upstream connections that follow the client connection, driven inside its
//! task. A keep-alive client's next request goes out on the upstream connection its last
//! one used: no pool lookup, no shared lock, no spawned task, and no hop to another task
//! and back (the client connection's task polls its upstream connections itself, see
//! `ClientAndUpstreams`). With one event loop per core (`server::Workers`) a request then stays on
//! one thread from the client's bytes to the upstream's and back.
//!
//! When the client leaves, its idle upstream connections go to an idle list
//! ([`IdleConns`]) for the next client on the same worker to adopt, so clients that open
//! a connection per request still reuse upstream connections. An upstream thus sees at
//! most as many connections as clients have open to sluice: server connections are
//! private to the client's session, as with haproxy's `http-reuse never`, except that
//! idle ones are passed on rather than closed when the session ends.
//!
//! TLS upstreams keep the shared pooled client ([`super::client`]): a handshake and an
//! HTTP/2 connection are worth sharing between clients.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use http::uri::{PathAndQuery, Uri};
use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::time::Instant;

use super::error::AttemptError;
use super::lifecycle::Graceful;
use super::outbound::Outbound;
use super::timer::{ConnTimer, Deadline};
use super::wake::SideWakes;
use crate::egress::{Resolver, Rules};
use crate::route::normalize_host;

use super::IDLE_TIMEOUT;

/// Idle connections kept per upstream address in the shared list; more are closed.
const MAX_IDLE_PER_ADDR: usize = 256;

/// The worker whose event loop the connection's socket is registered with, host (as in
/// the URL, without brackets) and port.
type Addr = (usize, Box<str>, u16);
type Driver = Pin<Box<dyn Future<Output = ()> + Send>>;
type Sender = http1::SendRequest<Outbound>;

/// One upstream connection: the handle requests are sent on, and the future that does the
/// connection's I/O.
struct Conn {
    host: Box<str>,
    port: u16,
    peer: Peer,
    sender: Sender,
    driver: Driver,
    idle_since: Instant,
}

impl Conn {
    fn expired(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.idle_since) >= IDLE_TIMEOUT
    }
}

/// Where a connection went, and the egress rules it was last found allowed by: after a
/// reload changes them, a kept connection is checked again before it is reused.
struct Peer {
    ip: IpAddr,
    rules: Arc<Rules>,
}

impl Peer {
    fn allowed(&mut self, resolver: &Resolver, rules: &Arc<Rules>, host: &str, port: u16) -> bool {
        if Arc::ptr_eq(&self.rules, rules) {
            return true;
        }
        let ok = resolver
            .check(rules, &normalize_host(host), self.ip, port)
            .is_ok();
        if ok {
            self.rules = rules.clone();
        }
        ok
    }
}

/// A connection of a client connection, with its sender out while a request holds it.
struct Slot {
    id: u64,
    host: Box<str>,
    port: u16,
    peer: Peer,
    sender: Option<(Sender, Instant)>,
    driver: Driver,
}

#[derive(Default)]
struct State {
    slots: Vec<Slot>,
    next_id: u64,
    /// Wakes the side of the `ClientAndUpstreams` task that polls the upstream connections: a newly
    /// adopted connection has to be polled once before anything wakes it.
    waker: Option<Waker>,
}

/// The upstream connections of one client connection.
#[derive(Clone)]
pub struct PinnedConns {
    state: Arc<Mutex<State>>,
    shared: Arc<IdleConns>,
    /// The worker this client connection runs on (see `server::Workers`).
    worker: usize,
    /// Times this client connection's upstream attempts, which take turns.
    attempts: ConnTimer,
}

/// Upstream connections whose client has left, waiting for another client on the same
/// worker: a socket stays registered with the event loop it was opened on, so a client on
/// another worker would have every readiness event cross threads. Not polled while here:
/// a connection the upstream closed in the meantime is found out when it is adopted (and
/// a request it could not send is sent on a fresh connection).
#[derive(Default)]
pub struct IdleConns {
    by_addr: Mutex<HashMap<Addr, Vec<Conn>>>,
}

impl IdleConns {
    fn take(
        &self,
        worker: usize,
        (host, port): (&str, u16),
        (resolver, rules): (&Resolver, &Arc<Rules>),
        now: Instant,
    ) -> Option<Conn> {
        let mut map = self.by_addr.lock();
        // Allocation-free lookup would need a borrowed key type; this runs once per client
        // connection and address, not per request.
        let key = (worker, Box::<str>::from(host), port);
        let list = map.get_mut(&key)?;
        let conn = loop {
            let mut c = list.pop()?;
            if !c.expired(now)
                && !c.sender.is_closed()
                && c.peer.allowed(resolver, rules, host, port)
            {
                break c;
            }
        };
        if list.is_empty() {
            map.remove(&key);
        }
        Some(conn)
    }

    fn put(&self, worker: usize, conn: Conn) {
        let mut map = self.by_addr.lock();
        let list = map
            .entry((worker, conn.host.clone(), conn.port))
            .or_default();
        if list.len() < MAX_IDLE_PER_ADDR {
            list.push(conn);
        }
    }

    /// Closes connections idle for longer than [`IDLE_TIMEOUT`].
    pub fn expire(&self, now: Instant) {
        let mut map = self.by_addr.lock();
        map.retain(|_, list| {
            list.retain(|c| !c.expired(now) && !c.sender.is_closed());
            !list.is_empty()
        });
    }

    /// Connections waiting, for tests and the admin view.
    pub fn len(&self) -> usize {
        self.by_addr.lock().values().map(Vec::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A request's hold on an upstream connection. Released at the end of the response body
/// the connection goes back to its client connection for the next request; dropped
/// earlier, the connection is closed (its response was not read to the end).
pub struct Lease {
    conns: PinnedConns,
    id: u64,
    sender: Sender,
}

impl Lease {
    pub fn release(self) {
        let Lease { conns, id, sender } = self;
        let mut st = conns.state.lock();
        if let Some(slot) = st.slots.iter_mut().find(|s| s.id == id) {
            slot.sender = Some((sender, Instant::now()));
        }
    }
}

impl PinnedConns {
    /// Needs a tokio runtime (for its timer).
    pub fn new(shared: Arc<IdleConns>, worker: usize) -> PinnedConns {
        PinnedConns {
            state: Arc::default(),
            shared,
            worker,
            attempts: ConnTimer::new(),
        }
    }

    /// An upstream attempt's deadline, on this client connection's own timer.
    pub(crate) fn attempt_deadline(&self, at: Instant) -> Deadline {
        self.attempts.at(at)
    }

    /// Sends `req` (absolute-form `http://` URI) on one of this client's upstream
    /// connections, adopting an idle one or connecting when it has none. The lease goes
    /// with the response body; a response without one (HEAD, 204, 304, length 0) gives
    /// the connection back at once, since no one will read a body to its end.
    ///
    /// Not an `async fn`, which would keep a second copy of the request (see
    /// `forward::forward`).
    pub fn send<'a>(
        &'a self,
        (resolver, rules): (&'a Resolver, &'a Arc<Rules>),
        mut req: Request<Outbound>,
    ) -> impl Future<Output = Result<(Response<Incoming>, Option<Lease>), AttemptError>> + 'a {
        let origin = origin_form(req.uri());
        let absolute = std::mem::replace(req.uri_mut(), origin);
        async move {
            let host = absolute
                .host()
                .map(|h| h.trim_start_matches('[').trim_end_matches(']'))
                .filter(|h| !h.is_empty())
                .ok_or_else(|| AttemptError::Connect("the request has no host".into()))?;
            let port = absolute.port_u16().unwrap_or(80);
            loop {
                let ((id, mut sender), reused) = match self.checkout(host, port, resolver, rules) {
                    Some(conn) => (conn, true),
                    // Boxed: connecting is rare next to sending on a kept connection, and
                    // its future would otherwise size every request's.
                    None => (
                        Box::pin(self.connect(resolver, rules, host, port)).await?,
                        false,
                    ),
                };
                if let Err(e) = sender.ready().await {
                    if reused {
                        continue; // closed while idle: the next one, or a new one
                    }
                    return Err(AttemptError::Reset(Box::new(e)));
                }
                match sender.try_send_request(req).await {
                    Ok(resp) if resp.status() == StatusCode::SWITCHING_PROTOCOLS => {
                        // Dropping the sender closes a connection in no known state.
                        return Err(AttemptError::unasked_upgrade());
                    }
                    Ok(resp) => {
                        let lease = Lease {
                            conns: self.clone(),
                            id,
                            sender,
                        };
                        if http_body::Body::is_end_stream(resp.body()) {
                            lease.release();
                            return Ok((resp, None));
                        }
                        return Ok((resp, Some(lease)));
                    }
                    Err(mut e) => match e.take_message() {
                        // Never written: the connection closed under us and nothing reached
                        // the upstream, so it goes on another connection whatever the method.
                        Some(unsent) if reused => req = unsent,
                        _ => return Err(AttemptError::after_send(e.into_error())),
                    },
                }
            }
        }
    }

    /// Takes this client's idle connection to `host:port`, else one from the shared list.
    fn checkout(
        &self,
        host: &str,
        port: u16,
        resolver: &Resolver,
        rules: &Arc<Rules>,
    ) -> Option<(u64, Sender)> {
        let now = Instant::now();
        let mut st = self.state.lock();
        for s in st.slots.iter_mut() {
            if s.port != port || *s.host != *host {
                continue;
            }
            // An expired sender, or one the egress rules no longer allow, is dropped here,
            // so its connection closes and the drive forgets it.
            if let Some((sender, since)) = s.sender.take()
                && now.saturating_duration_since(since) < IDLE_TIMEOUT
                && s.peer.allowed(resolver, rules, host, port)
            {
                return Some((s.id, sender));
            }
        }
        let conn = self
            .shared
            .take(self.worker, (host, port), (resolver, rules), now)?;
        Some(adopt(&mut st, conn))
    }

    async fn connect(
        &self,
        resolver: &Resolver,
        rules: &Arc<Rules>,
        host: &str,
        port: u16,
    ) -> Result<(u64, Sender), AttemptError> {
        let addrs = resolver
            .resolve(host, port)
            .await
            .map_err(AttemptError::from_egress)?;
        let stream = crate::egress::connect(&addrs)
            .await
            .map_err(|e| AttemptError::Connect(Box::new(e)))?;
        let peer = Peer {
            ip: stream.peer_addr().map_or(addrs[0].ip(), |a| a.ip()),
            rules: rules.clone(),
        };
        let (sender, conn) = http1::Builder::new()
            .writev(false) // as on the client-facing side (server.rs)
            .handshake(TokioIo::new(stream))
            .await
            .map_err(|e| AttemptError::Connect(Box::new(e)))?;
        let driver: Driver = Box::pin(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "upstream connection ended with an error");
            }
        });
        let mut st = self.state.lock();
        Ok(adopt(
            &mut st,
            Conn {
                host: host.into(),
                port,
                peer,
                sender,
                driver,
                idle_since: Instant::now(),
            },
        ))
    }

    /// Polls every upstream connection; the ones that ended are forgotten.
    fn drive(&self, cx: &mut Context<'_>) {
        let mut st = self.state.lock();
        st.slots
            .retain_mut(|s| s.driver.as_mut().poll(cx).is_pending());
    }

    /// The client left: idle connections go to the shared list, the rest are closed.
    fn hand_over(&self) {
        let slots = std::mem::take(&mut self.state.lock().slots);
        for s in slots {
            if let Some((sender, idle_since)) = s.sender
                && !sender.is_closed()
            {
                self.shared.put(
                    self.worker,
                    Conn {
                        host: s.host,
                        port: s.port,
                        peer: s.peer,
                        sender,
                        driver: s.driver,
                        idle_since,
                    },
                );
            }
        }
    }
}

/// Makes a connection one of this client's, held by the request that asked for it.
fn adopt(st: &mut State, conn: Conn) -> (u64, Sender) {
    let id = st.next_id;
    st.next_id += 1;
    st.slots.push(Slot {
        id,
        host: conn.host,
        port: conn.port,
        peer: conn.peer,
        sender: None,
        driver: conn.driver,
    });
    if let Some(w) = &st.waker {
        w.wake_by_ref();
    }
    (id, conn.sender)
}

/// The request target as an upstream expects it (`/path?query`), the way a client talking
/// to it directly would write it.
fn origin_form(uri: &Uri) -> Uri {
    let pq = uri
        .path_and_query()
        .filter(|pq| !pq.as_str().is_empty())
        .cloned()
        .unwrap_or_else(|| PathAndQuery::from_static("/"));
    Uri::from(pq)
}

/// A client connection together with its upstream connections, polled in one task.
///
/// The two sides wake each other several times per request (request written, response
/// head, body wanted, body sent). Going through the scheduler for each would cost a task
/// poll apiece, so while this future is being polled a wake only marks its side to be
/// polled in another round of the same poll; only a wake from outside (a socket, a
/// timer, another task) reaches the task. [`SideWakes`] holds the protocol and its
/// invariants.
///
/// Each side has its own waker, and a round polls only the sides woken since their last
/// poll: a side not woken has nothing to do, and polling it anyway cost each of its
/// sockets a readiness check.
pub(crate) struct ClientAndUpstreams<C> {
    conn: Pin<Box<C>>,
    conns: PinnedConns,
    wakes: Arc<SideWakes>,
    /// For the client connection and everything its requests wait on.
    client: Waker,
    /// For the upstream connections.
    upstream: Waker,
}

/// Going round again within one poll is bounded, so one busy connection cannot keep a
/// worker thread from its other tasks.
const MAX_ROUNDS: usize = 8;

/// The sides of a `ClientAndUpstreams`, as bits of its [`SideWakes`].
const CLIENT: u8 = 1;
const UPSTREAM: u8 = 2;

/// One side's waker.
struct SideWaker {
    wakes: Arc<SideWakes>,
    side: u8,
}

impl Wake for SideWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref()
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.wakes.wake(self.side)
    }
}

impl<C> ClientAndUpstreams<C> {
    pub(crate) fn new(conn: C, conns: PinnedConns) -> ClientAndUpstreams<C> {
        let wakes = Arc::new(SideWakes::new(CLIENT | UPSTREAM));
        let side = |side| {
            Waker::from(Arc::new(SideWaker {
                wakes: wakes.clone(),
                side,
            }))
        };
        let (client, upstream) = (side(CLIENT), side(UPSTREAM));
        conns.state.lock().waker = Some(upstream.clone());
        ClientAndUpstreams {
            conn: Box::pin(conn),
            conns,
            wakes,
            client,
            upstream,
        }
    }
}

impl<C: Future> Future for ClientAndUpstreams<C> {
    type Output = C::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<C::Output> {
        let this = self.get_mut();
        let wakes = &*this.wakes;
        wakes.set_task(cx.waker());
        for _ in 0..MAX_ROUNDS {
            wakes.begin_round();
            // The client side first: a request it sends is written by the upstream side
            // just after, in the same round.
            if wakes.take(CLIENT)
                && let Poll::Ready(out) = this
                    .conn
                    .as_mut()
                    .poll(&mut Context::from_waker(&this.client))
            {
                wakes.end_round();
                this.conns.hand_over();
                return Poll::Ready(out);
            }
            if wakes.take(UPSTREAM) {
                this.conns.drive(&mut Context::from_waker(&this.upstream));
            }
            if !wakes.end_round() {
                return Poll::Pending;
            }
        }
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

impl<C: Graceful> Graceful for ClientAndUpstreams<C> {
    fn graceful_shutdown(self: Pin<&mut Self>) {
        let this = self.get_mut();
        this.conn.as_mut().graceful_shutdown();
        // Nothing woke the client connection, but it has to be polled to act on this,
        // whether or not the caller polls next.
        this.wakes.wake(CLIENT);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    /// The task's waker: counts the times the scheduler would have been asked to poll.
    #[derive(Default)]
    struct Count(AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.wake_by_ref()
        }
        fn wake_by_ref(self: &Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// A stand-in client connection that does what `script` says on each poll, keeping
    /// the waker it was polled with.
    struct Scripted<F> {
        polls: Arc<AtomicUsize>,
        waker: Arc<Mutex<Option<Waker>>>,
        shutdown: Arc<AtomicBool>,
        script: F,
    }

    impl<F: FnMut(usize, &Waker) + Unpin> Future for Scripted<F> {
        type Output = &'static str;
        fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<&'static str> {
            let this = self.get_mut();
            let n = this.polls.fetch_add(1, Ordering::SeqCst) + 1;
            *this.waker.lock() = Some(cx.waker().clone());
            if this.shutdown.load(Ordering::SeqCst) {
                return Poll::Ready("closed");
            }
            (this.script)(n, cx.waker());
            Poll::Pending
        }
    }

    impl<F: FnMut(usize, &Waker) + Unpin> Graceful for Scripted<F> {
        fn graceful_shutdown(self: Pin<&mut Self>) {
            self.shutdown.store(true, Ordering::SeqCst);
        }
    }

    struct Harness<F> {
        task: Pin<Box<ClientAndUpstreams<Scripted<F>>>>,
        polls: Arc<AtomicUsize>,
        waker: Arc<Mutex<Option<Waker>>>,
        woken: Arc<Count>,
    }

    impl<F: FnMut(usize, &Waker) + Unpin> Harness<F> {
        fn new(script: F) -> Harness<F> {
            let (polls, waker) = (Arc::new(AtomicUsize::new(0)), Arc::default());
            let conn = Scripted {
                polls: Arc::clone(&polls),
                waker: Arc::clone(&waker),
                shutdown: Arc::default(),
                script,
            };
            let conns = PinnedConns::new(Arc::default(), 0);
            Harness {
                task: Box::pin(ClientAndUpstreams::new(conn, conns)),
                polls,
                waker,
                woken: Arc::default(),
            }
        }

        fn poll(&mut self) -> Poll<&'static str> {
            let waker = Waker::from(self.woken.clone());
            self.task.as_mut().poll(&mut Context::from_waker(&waker))
        }

        fn polls(&self) -> usize {
            self.polls.load(Ordering::SeqCst)
        }

        fn woken(&self) -> usize {
            self.woken.0.load(Ordering::SeqCst)
        }

        /// The client side's waker, as a socket would hold it.
        fn client_waker(&self) -> Waker {
            self.waker.lock().clone().expect("polled once")
        }
    }

    #[tokio::test]
    async fn a_wake_during_the_poll_goes_round_instead_of_through_the_scheduler() {
        let mut h = Harness::new(|n, w: &Waker| {
            if n == 1 {
                w.wake_by_ref();
            }
        });
        assert!(h.poll().is_pending());
        assert_eq!(h.polls(), 2, "polled again in the same poll");
        assert_eq!(h.woken(), 0, "the task was not woken");
    }

    #[tokio::test]
    async fn a_wake_from_another_thread_during_the_poll_is_not_lost() {
        let mut h = Harness::new(|n, w: &Waker| {
            if n == 1 {
                let w = w.clone();
                std::thread::spawn(move || w.wake()).join().unwrap();
            }
        });
        assert!(h.poll().is_pending());
        assert_eq!(h.polls(), 2);
        assert_eq!(h.woken(), 0);
    }

    #[tokio::test]
    async fn a_wake_after_the_poll_wakes_the_task_and_only_the_woken_side_is_polled() {
        let mut h = Harness::new(|_, _: &Waker| {});
        assert!(h.poll().is_pending());
        assert_eq!((h.polls(), h.woken()), (1, 0));
        // Polled again with nothing woken (the upstream side's turn, say): the client
        // connection has nothing to do and is left alone.
        assert!(h.poll().is_pending());
        assert_eq!(h.polls(), 1);
        let w = h.client_waker();
        std::thread::spawn(move || w.wake()).join().unwrap();
        assert_eq!(h.woken(), 1, "the task is woken once");
        assert!(h.poll().is_pending());
        assert_eq!(h.polls(), 2);
    }

    #[tokio::test]
    async fn a_side_that_keeps_waking_itself_yields_after_the_round_limit() {
        let mut h = Harness::new(|_, w: &Waker| w.wake_by_ref());
        assert!(h.poll().is_pending());
        assert_eq!(h.polls(), MAX_ROUNDS);
        assert_eq!(h.woken(), 1, "back to the scheduler, to be polled again");
        assert!(h.poll().is_pending());
        assert_eq!(h.polls(), 2 * MAX_ROUNDS);
    }

    #[tokio::test]
    async fn a_graceful_shutdown_wakes_the_task_to_act_on_it() {
        let mut h = Harness::new(|_, _: &Waker| {});
        assert!(h.poll().is_pending());
        h.task.as_mut().graceful_shutdown();
        assert_eq!(h.woken(), 1, "no caller has to poll right after");
        assert_eq!(h.poll(), Poll::Ready("closed"));
    }
}
