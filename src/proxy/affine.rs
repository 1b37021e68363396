//! Plain-HTTP upstream connections that follow the client connection, driven inside its
//! task. A keep-alive client's next request goes out on the upstream connection its last
//! one used: no pool lookup, no shared lock, no spawned task, and no hop to another task
//! and back (the client connection's task polls its upstream connections itself, see
//! `Driven`). With one event loop per core (`server::Workers`) a request then stays on
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

use parking_lot::{Mutex, MutexGuard};
use std::collections::HashMap;
use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::task::{Context, Poll, Wake, Waker};

use http::uri::{PathAndQuery, Uri};
use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::time::Instant;

use super::body::Outbound;
use super::client::AttemptError;
use super::server::Graceful;
use super::timer::{ConnTimer, Deadline};
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

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock()
}

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
    /// Wakes the side of the `Driven` task that polls the upstream connections: a newly
    /// adopted connection has to be polled once before anything wakes it.
    waker: Option<Waker>,
}

/// The upstream connections of one client connection.
#[derive(Clone)]
pub struct Affine {
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
        let mut map = lock(&self.by_addr);
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
        let mut map = lock(&self.by_addr);
        let list = map
            .entry((worker, conn.host.clone(), conn.port))
            .or_default();
        if list.len() < MAX_IDLE_PER_ADDR {
            list.push(conn);
        }
    }

    /// Closes connections idle for longer than [`IDLE_TIMEOUT`].
    pub fn expire(&self, now: Instant) {
        let mut map = lock(&self.by_addr);
        map.retain(|_, list| {
            list.retain(|c| !c.expired(now) && !c.sender.is_closed());
            !list.is_empty()
        });
    }

    /// Connections waiting, for tests and the admin view.
    pub fn len(&self) -> usize {
        lock(&self.by_addr).values().map(Vec::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A request's hold on an upstream connection. Released at the end of the response body
/// the connection goes back to its client connection for the next request; dropped
/// earlier, the connection is closed (its response was not read to the end).
pub struct Lease {
    affine: Affine,
    id: u64,
    sender: Sender,
}

impl Lease {
    pub fn release(self) {
        let Lease { affine, id, sender } = self;
        let mut st = lock(&affine.state);
        if let Some(slot) = st.slots.iter_mut().find(|s| s.id == id) {
            slot.sender = Some((sender, Instant::now()));
        }
    }
}

impl Affine {
    /// Needs a tokio runtime (for its timer).
    pub fn new(shared: Arc<IdleConns>, worker: usize) -> Affine {
        Affine {
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
                            affine: self.clone(),
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
        let mut st = lock(&self.state);
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
        let mut st = lock(&self.state);
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
        let mut st = lock(&self.state);
        st.slots
            .retain_mut(|s| s.driver.as_mut().poll(cx).is_pending());
    }

    /// The client left: idle connections go to the shared list, the rest are closed.
    fn hand_over(&self) {
        let slots = std::mem::take(&mut lock(&self.state).slots);
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
/// poll apiece, so while this future is being polled a wake only marks it to go round
/// again; only a wake from outside (a socket, a timer, another task) reaches the task.
///
/// Each side has its own waker, and a round polls only the sides woken since their last
/// poll: a side not woken has nothing to do, and polling it anyway cost each of its
/// sockets a readiness check (17 per request, a tenth of the instructions, before).
pub(crate) struct Driven<C> {
    conn: Pin<Box<C>>,
    affine: Affine,
    wake: Arc<Rewake>,
    /// For the client connection and everything its requests wait on.
    client: Waker,
    /// For the upstream connections.
    upstream: Waker,
}

/// Going round again within one poll is bounded, so one busy connection cannot keep a
/// worker thread from its other tasks.
const MAX_ROUNDS: usize = 8;

const IDLE: u8 = 0;
const POLLING: u8 = 1;
const WOKEN: u8 = 2;

/// Sides of a `Driven`, as bits of `Rewake::dirty`.
const CLIENT: u8 = 1;
const UPSTREAM: u8 = 2;

/// What the two sides' wakers share: which sides were woken, and whether the task is
/// being polled (a wake then only marks the side) or must be woken.
struct Rewake {
    state: AtomicU8,
    dirty: AtomicU8,
    task: Mutex<Option<Waker>>,
}

impl Rewake {
    fn wake(&self, side: u8) {
        // SeqCst here and in `Driven::poll`: the side is marked before the state is read,
        // and the poll clears the state before it reads the marks, so that one of the two
        // always sees the other.
        self.dirty.fetch_or(side, Ordering::SeqCst);
        match self
            .state
            .compare_exchange(POLLING, WOKEN, Ordering::SeqCst, Ordering::SeqCst)
        {
            Ok(_) | Err(WOKEN) => {}
            Err(_) => {
                if let Some(task) = lock(&self.task).as_ref() {
                    task.wake_by_ref();
                }
            }
        }
    }

    /// Whether `side` was woken, clearing the mark.
    fn take(&self, side: u8) -> bool {
        self.dirty.fetch_and(!side, Ordering::SeqCst) & side != 0
    }
}

/// One side's waker.
struct Side {
    shared: Arc<Rewake>,
    bit: u8,
}

impl Wake for Side {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref()
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.shared.wake(self.bit)
    }
}

impl<C> Driven<C> {
    pub(crate) fn new(conn: C, affine: Affine) -> Driven<C> {
        let wake = Arc::new(Rewake {
            state: AtomicU8::new(IDLE),
            // Both are polled first.
            dirty: AtomicU8::new(CLIENT | UPSTREAM),
            task: Mutex::new(None),
        });
        let side = |bit| {
            Waker::from(Arc::new(Side {
                shared: wake.clone(),
                bit,
            }))
        };
        let (client, upstream) = (side(CLIENT), side(UPSTREAM));
        lock(&affine.state).waker = Some(upstream.clone());
        Driven {
            conn: Box::pin(conn),
            affine,
            wake,
            client,
            upstream,
        }
    }
}

impl<C: Future> Future for Driven<C> {
    type Output = C::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<C::Output> {
        let this = self.get_mut();
        {
            let mut task = lock(&this.wake.task);
            if !task.as_ref().is_some_and(|t| t.will_wake(cx.waker())) {
                *task = Some(cx.waker().clone());
            }
        }
        let wake = &*this.wake;
        for _ in 0..MAX_ROUNDS {
            wake.state.store(POLLING, Ordering::SeqCst);
            // The client side first: a request it sends is written by the upstream side
            // just after, in the same round.
            if wake.take(CLIENT)
                && let Poll::Ready(out) = this
                    .conn
                    .as_mut()
                    .poll(&mut Context::from_waker(&this.client))
            {
                wake.state.store(IDLE, Ordering::SeqCst);
                this.affine.hand_over();
                return Poll::Ready(out);
            }
            if wake.take(UPSTREAM) {
                this.affine.drive(&mut Context::from_waker(&this.upstream));
            }
            wake.state.store(IDLE, Ordering::SeqCst);
            // A wake from here on sees IDLE and wakes the task; one before this left its
            // mark, and this round's own wakes did too: go round for them.
            if wake.dirty.load(Ordering::SeqCst) == 0 {
                return Poll::Pending;
            }
        }
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

impl<C: Graceful> Graceful for Driven<C> {
    fn graceful_shutdown(self: Pin<&mut Self>) {
        let this = self.get_mut();
        this.conn.as_mut().graceful_shutdown();
        // Nothing woke the client connection, but it has to be polled to act on this.
        this.wake.dirty.fetch_or(CLIENT, Ordering::SeqCst);
    }
}
