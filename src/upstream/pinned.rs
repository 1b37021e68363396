//! Plain-HTTP upstream connections that follow the client connection. A keep-alive
//! client's next request goes out on the upstream connection its last one used: no pool
//! lookup across workers, no spawned task, and no hop to another task and back. The
//! connection has no task of its own at all (see `h1::conn`): the request's future
//! writes to it and the response body reads from it, both in the client connection's
//! task, so with one event loop per core (`server::Workers`) a request stays on one
//! thread from the client's bytes to the upstream's and back.
//!
//! When the client leaves, its idle upstream connections go to an idle list
//! ([`IdleConns`]) for the next client on the same worker to adopt, so clients that open
//! a connection per request still reuse upstream connections. An upstream thus sees at
//! most as many connections as clients have open to sluice: server connections are
//! private to the client's session, as with haproxy's `http-reuse never`, except that
//! idle ones are passed on rather than closed when the session ends.
//!
//! An idle connection is not watched: one the upstream closed is found out when it is
//! taken (a `recv` that would block says it is still open) or swept.
//!
//! TLS upstreams keep the shared pooled client ([`super::client`]): a handshake and an
//! HTTP/2 connection are worth sharing between clients.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::future::Future;
use std::net::IpAddr;
use std::sync::Arc;

use http::{HeaderMap, Response, StatusCode};
use http_body_util::Either;
use hyper::body::Incoming;
use tokio::time::Instant;

use super::error::AttemptError;
use super::h1::Error as H1Error;
use super::h1::conn::{Conn, Failed, Home, Outgoing, UpstreamBody, exchange};
use super::head::AttemptHead;
use super::outbound::Outbound;
use super::switched::UpstreamSide;
use super::timer::{ConnTimer, Deadline};
use crate::egress::{Resolver, Rules};
use crate::route::normalize_host;

/// An idle upstream connection older than this is closed rather than reused, by both
/// kinds of connection: shorter than the common 60 s+ server keep-alive, so we rarely
/// send on one the upstream is closing.
pub(crate) const IDLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(50);

/// The most fields a map kept for reuse holds room for (see [`PinnedConns::recycle`]).
const SPARE_FIELDS: usize = 64;

/// Idle connections kept per upstream address in the shared list; more are closed.
const MAX_IDLE_PER_ADDR: usize = 256;

/// The worker whose event loop the connection's socket is registered with, host (as in
/// the URL, without brackets) and port.
type Addr = (usize, Box<str>, u16);

/// Where a connection goes: host (as in the URL, without brackets), port, and the peer.
struct Key {
    host: Box<str>,
    port: u16,
    peer: Peer,
}

/// An idle connection, and since when.
struct Idle {
    key: Key,
    conn: Conn,
    since: Instant,
}

impl Idle {
    fn expired(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.since) >= IDLE_TIMEOUT
    }

    /// Fit to take `host:port`'s next request under `rules`.
    fn usable(&mut self, now: Instant, resolver: &Resolver, rules: &Arc<Rules>) -> bool {
        !self.expired(now)
            && self
                .key
                .peer
                .allowed(resolver, rules, &self.key.host, self.key.port)
            && self.conn.idle_and_open()
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

#[derive(Default)]
struct State {
    idle: Vec<Idle>,
    /// The client connection has ended: connections given back go to the shared list.
    left: bool,
    /// A finished request's field map, emptied, for the next response head (see
    /// [`PinnedConns::recycle`]).
    spare: Option<HeaderMap>,
}

/// The upstream connections of one client connection.
#[derive(Clone)]
pub(crate) struct PinnedConns {
    state: Arc<Mutex<State>>,
    shared: Arc<IdleConns>,
    /// The worker this client connection runs on (see `server::Workers`).
    worker: usize,
    /// Times this client connection's upstream attempts, which take turns.
    attempts: ConnTimer,
    /// Times its requests' `total_timeout`, which take turns too.
    totals: ConnTimer,
}

/// A request's way out on its client connection's own upstream connections: those, and
/// the host (as the URL wrote it, without brackets) and port it goes to, read once when
/// the request was routed.
#[derive(Clone, Copy)]
pub(crate) struct Own<'a> {
    pub(crate) conns: &'a PinnedConns,
    pub(crate) host: &'a str,
    pub(crate) port: u16,
}

/// Upstream connections whose client has left, waiting for another client on the same
/// worker: a socket stays registered with the event loop it was opened on, so a client on
/// another worker would have every readiness event cross threads.
#[derive(Default)]
pub(crate) struct IdleConns {
    by_addr: Mutex<HashMap<Addr, Vec<Idle>>>,
}

impl IdleConns {
    fn take(
        &self,
        worker: usize,
        (host, port): (&str, u16),
        (resolver, rules): (&Resolver, &Arc<Rules>),
        now: Instant,
    ) -> Option<(Key, Conn)> {
        let mut map = self.by_addr.lock();
        // Allocation-free lookup would need a borrowed key type; this runs once per client
        // connection and address, not per request.
        let key = (worker, Box::<str>::from(host), port);
        let list = map.get_mut(&key)?;
        let found = loop {
            let mut c = list.pop()?;
            if c.usable(now, resolver, rules) {
                break c;
            }
        };
        if list.is_empty() {
            map.remove(&key);
        }
        Some((found.key, found.conn))
    }

    /// Parks a connection, unless the upstream has closed it already.
    fn put(&self, worker: usize, idle: Idle) {
        if !idle.conn.idle_and_open() {
            return;
        }
        let mut map = self.by_addr.lock();
        let list = map
            .entry((worker, idle.key.host.clone(), idle.key.port))
            .or_default();
        if list.len() < MAX_IDLE_PER_ADDR {
            list.push(idle);
        }
    }

    /// Closes connections idle for longer than [`IDLE_TIMEOUT`] or closed by the upstream.
    pub(crate) fn expire(&self, now: Instant) {
        let mut map = self.by_addr.lock();
        map.retain(|_, list| {
            list.retain(|c| !c.expired(now) && c.conn.idle_and_open());
            !list.is_empty()
        });
    }

    /// Connections waiting, for tests and the admin view.
    pub(crate) fn len(&self) -> usize {
        self.by_addr.lock().values().map(Vec::len).sum()
    }
}

/// Takes a connection back to its client connection once a response body has ended on it.
pub(crate) struct Owner {
    conns: PinnedConns,
    key: Key,
}

impl Home for Owner {
    fn take_back(self, conn: Conn) {
        let Owner { conns, key } = self;
        let idle = Idle {
            key,
            conn,
            since: crate::clock::now(),
        };
        let mut st = conns.state.lock();
        if st.left {
            drop(st);
            conns.shared.put(conns.worker, idle);
        } else {
            st.idle.push(idle);
        }
    }
}

/// A request between its connections: not yet encoded (the head is encoded in the first
/// connection's buffer), or encoded and unsent, for another connection.
enum Pending {
    Body(Outbound),
    Encoded(Box<Outgoing>),
}

/// An upstream's response, from either upstream client: one of a client's own
/// connections (left) or the pooled TLS client (right).
pub(crate) type UpstreamResponse = Response<Either<UpstreamBody<Owner>, Incoming>>;

impl PinnedConns {
    /// Needs a tokio runtime (for its timer).
    pub(crate) fn new(shared: Arc<IdleConns>, worker: usize) -> PinnedConns {
        PinnedConns {
            state: Arc::default(),
            shared,
            worker,
            attempts: ConnTimer::new(),
            totals: ConnTimer::new(),
        }
    }

    /// Keeps a finished request's field map for the next response head on this client
    /// connection. hyper parses each request into the map of the response before it, so
    /// the two maps take turns and no request or response allocates one: two
    /// allocations per request fewer, for a map of a few hundred bytes kept while the
    /// connection is idle. A map that has grown past [`SPARE_FIELDS`] is dropped.
    pub(crate) fn recycle(&self, mut map: HeaderMap) {
        if map.capacity() == 0 || map.capacity() > SPARE_FIELDS {
            return;
        }
        // Emptied here: its values share the request's bytes, which hyper's read buffer
        // can reuse only once nothing holds them.
        map.clear();
        let mut st = self.state.lock();
        if st.spare.is_none() {
            st.spare = Some(map);
        }
    }

    /// An upstream attempt's deadline, on this client connection's own timer.
    pub(crate) fn attempt_deadline(&self, at: Instant) -> Deadline {
        self.attempts.at(at)
    }

    /// A request's `total_timeout`, on this client connection's own timer.
    pub(crate) fn total_deadline(&self, at: Instant) -> Deadline {
        self.totals.at(at)
    }

    /// Sends the request (absolute-form `http://` URI naming `host` and `port`) on one of
    /// this client's upstream connections to them, adopting an idle one or connecting when
    /// it has none. The head is
    /// encoded where it lies, once a connection is there; the connection goes with the
    /// response body, which gives it back once read to its end. `now`: a reading the
    /// caller took just before (the attempt's start: for an unmatched request, its
    /// arrival), by which idle connections are judged.
    ///
    /// Not an `async fn`, which would keep a second copy of the request (see
    /// `forward::forward`).
    pub(crate) fn send<'a>(
        &'a self,
        (resolver, rules): (&'a Resolver, &'a Arc<Rules>),
        (host, port): (&'a str, u16),
        head: AttemptHead<'a>,
        body: Outbound,
        now: Instant,
    ) -> impl Future<Output = Result<UpstreamResponse, AttemptError>> + 'a {
        // Made here, not in the block: what the block moves from is stored in its future
        // besides what it moves into.
        let mut pending = Pending::Body(body);
        let mut now = now;
        async move {
            let h = &*head.head;
            if host.is_empty() {
                return Err(AttemptError::Connect("the request has no host".into()));
            }
            // The request target as an upstream expects it (`/path?query`), the way a
            // client talking to it directly would write it.
            let target = match h.uri.path_and_query().map(|pq| pq.as_str()) {
                Some(pq) if !pq.is_empty() => pq,
                _ => "/",
            };
            loop {
                let ((key, mut conn), reused) =
                    match self.checkout(host, port, resolver, rules, now) {
                        Some(found) => (found, true),
                        // Boxed: connecting is rare next to sending on a kept connection, and
                        // its future would otherwise size every request's.
                        None => (
                            Box::pin(self.connect(resolver, rules, host, port)).await?,
                            false,
                        ),
                    };
                let out = match pending {
                    Pending::Encoded(out) => out,
                    // Encoded once a connection is there, in its buffer: the body's send
                    // hook fires as it is read (see `Outbound`).
                    Pending::Body(body) => {
                        let head = (&h.method, target, &h.headers);
                        match Outgoing::new(head, body, conn.take_parked()) {
                            Ok(mut out) => {
                                out.spare = self.state.lock().spare.take();
                                out
                            }
                            Err(e) => {
                                Owner {
                                    conns: self.clone(),
                                    key,
                                }
                                .take_back(conn);
                                return Err(AttemptError::from_h1(e));
                            }
                        }
                    }
                };
                let owner = Owner {
                    conns: self.clone(),
                    key,
                };
                super::turn::write_in_turn().await;
                match exchange(conn, out, owner).await {
                    // The request asked to switch (see `upgrade`): the connection goes to
                    // the forward path, which joins it to the client's. Looked up only
                    // for a 101: a lookup on every request's path costs more.
                    Ok(resp)
                        if resp.status() == StatusCode::SWITCHING_PROTOCOLS
                            && h.headers.contains_key(http::header::UPGRADE) =>
                    {
                        let (mut parts, mut body) = resp.into_parts();
                        if let Some((io, rest)) = body.take_upgraded() {
                            parts.extensions.insert(UpstreamSide::own(io, rest));
                        }
                        return Ok(Response::from_parts(parts, Either::Left(body)));
                    }
                    // The connection went with the response, which is dropped: it closes.
                    Ok(resp) if resp.status() == StatusCode::SWITCHING_PROTOCOLS => {
                        return Err(AttemptError::unasked_upgrade());
                    }
                    Ok(resp) => return Ok(resp.map(Either::Left)),
                    // Nothing reached the upstream (a kept connection closed under us):
                    // it goes on another connection whatever the method.
                    Err(Failed {
                        error: H1Error::Io(_) | H1Error::Closed(_),
                        unsent: Some(unsent),
                    }) if reused => {
                        pending = Pending::Encoded(unsent);
                        // The failed exchange took time: idle connections are judged
                        // by the clock now, not by the attempt's start.
                        now = crate::clock::now();
                    }
                    Err(failed) => return Err(AttemptError::from_h1(failed.error)),
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
        now: Instant,
    ) -> Option<(Key, Conn)> {
        let mut st = self.state.lock();
        let mut i = 0;
        while i < st.idle.len() {
            let c = &st.idle[i];
            if c.key.port != port || *c.key.host != *host {
                i += 1;
                continue;
            }
            // One that expired, that the upstream closed, or that the egress rules no
            // longer allow is dropped here, and closes.
            let mut c = st.idle.swap_remove(i);
            if c.usable(now, resolver, rules) {
                return Some((c.key, c.conn));
            }
        }
        drop(st);
        self.shared
            .take(self.worker, (host, port), (resolver, rules), now)
    }

    async fn connect(
        &self,
        resolver: &Resolver,
        rules: &Arc<Rules>,
        host: &str,
        port: u16,
    ) -> Result<(Key, Conn), AttemptError> {
        let addrs = resolver
            .resolve(host, port)
            .await
            .map_err(AttemptError::from_egress)?;
        let stream = resolver
            .connect(&addrs)
            .await
            .map_err(AttemptError::from_connect)?;
        let peer = Peer {
            ip: stream
                .get_ref()
                .peer_addr()
                .map_or(addrs[0].ip(), |a| a.ip()),
            rules: rules.clone(),
        };
        let key = Key {
            host: host.into(),
            port,
            peer,
        };
        Ok((key, Conn::new(stream)))
    }

    /// The client left: idle connections go to the shared list, and so do the ones whose
    /// responses are still being read, once they end.
    pub(crate) fn hand_over(&self) {
        let idle = {
            let mut st = self.state.lock();
            st.left = true;
            std::mem::take(&mut st.idle)
        };
        for c in idle {
            self.shared.put(self.worker, c);
        }
    }

    /// This client's idle connections, for tests.
    #[cfg(test)]
    fn idle(&self) -> usize {
        self.state.lock().idle.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::body::{Body, BoxError, empty, full, stream};
    use crate::config::Config;
    use bytes::Bytes;
    use http_body::Frame;
    use http_body_util::BodyExt;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    /// What a scripted upstream connection does, in order.
    enum Step {
        /// Reads until these bytes have arrived (then keeps what it read).
        ReadUntil(&'static str),
        Write(&'static str),
        /// Tells the test it is about to close, and closes.
        Close,
        /// Stays open, reading nothing, until the test ends.
        Hold,
    }

    struct Upstream {
        addr: std::net::SocketAddr,
        accepted: Arc<AtomicUsize>,
        read: Arc<Mutex<Vec<u8>>>,
        closed: tokio::sync::mpsc::UnboundedReceiver<()>,
    }

    /// A raw upstream: its n-th connection plays the n-th script.
    async fn upstream(scripts: Vec<Vec<Step>>) -> Upstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let read = Arc::new(Mutex::new(Vec::new()));
        let (tx, closed) = tokio::sync::mpsc::unbounded_channel();
        let (a, r) = (accepted.clone(), read.clone());
        tokio::spawn(async move {
            for script in scripts {
                let (mut s, _) = listener.accept().await.unwrap();
                a.fetch_add(1, Ordering::SeqCst);
                let (r, tx) = (r.clone(), tx.clone());
                tokio::spawn(async move {
                    let mut seen = Vec::new();
                    for step in script {
                        match step {
                            Step::ReadUntil(end) => {
                                while !String::from_utf8_lossy(&seen).contains(end) {
                                    let mut b = [0u8; 4096];
                                    let n = s.read(&mut b).await.unwrap_or(0);
                                    if n == 0 {
                                        return;
                                    }
                                    seen.extend_from_slice(&b[..n]);
                                    r.lock().extend_from_slice(&b[..n]);
                                }
                                seen.clear();
                            }
                            Step::Write(bytes) => s.write_all(bytes.as_bytes()).await.unwrap(),
                            Step::Close => {
                                drop(s);
                                let _ = tx.send(());
                                return;
                            }
                            Step::Hold => {
                                tokio::time::sleep(Duration::from_secs(3600)).await;
                            }
                        }
                    }
                });
            }
        });
        Upstream {
            addr,
            accepted,
            read,
            closed,
        }
    }

    use std::time::Duration;

    struct Client {
        conns: PinnedConns,
        resolver: Resolver,
        rules: Arc<Rules>,
    }

    impl Client {
        fn new() -> Client {
            let config = Config::parse("[egress]\nallow = [\"127.0.0.1\"]\n", "t.toml").unwrap();
            let rules = Arc::new(Rules::new(&config));
            let resolver = Resolver::default();
            resolver.set_rules(rules.clone());
            Client {
                conns: PinnedConns::new(Arc::default(), 0),
                resolver,
                rules,
            }
        }

        async fn send(
            &self,
            up: &Upstream,
            method: &str,
            body: Body,
        ) -> Result<UpstreamResponse, AttemptError> {
            let (parts, ()) = http::Request::builder()
                .method(method)
                .uri(format!("http://{}/p?q=1", up.addr))
                .header("host", up.addr.to_string())
                .body(())
                .unwrap()
                .into_parts();
            let mut head = crate::upstream::head::RequestHead::from_parts(parts);
            let host = up.addr.ip().to_string();
            self.conns
                .send(
                    (&self.resolver, &self.rules),
                    (&host, up.addr.port()),
                    AttemptHead {
                        head: &mut head,
                        last: true,
                    },
                    Outbound::from(body),
                    crate::clock::now(),
                )
                .await
        }
    }

    /// Data and trailers of a response body.
    async fn read_all(resp: UpstreamResponse) -> (String, Option<http::HeaderMap>) {
        let collected = resp.into_body().collect().await.unwrap();
        let trailers = collected.trailers().cloned();
        (
            String::from_utf8(collected.to_bytes().to_vec()).unwrap(),
            trailers,
        )
    }

    const HEAD_END: &str = "\r\n\r\n";

    #[tokio::test]
    async fn keep_alive_requests_share_one_connection_which_comes_back_after_each_body() {
        let up = upstream(vec![vec![
            Step::ReadUntil(HEAD_END),
            Step::Write("HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfirst"),
            Step::ReadUntil(HEAD_END),
            Step::Write(
                "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nsec\r\n3\r\nond\r\n0\r\nx-t: 1\r\n\r\n",
            ),
            Step::ReadUntil(HEAD_END),
            Step::Write("HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n"),
            Step::Hold,
        ]])
        .await;
        let c = Client::new();
        let resp = c.send(&up, "GET", empty()).await.unwrap();
        assert_eq!(c.conns.idle(), 0, "held by the body");
        assert_eq!(read_all(resp).await.0, "first");
        assert_eq!(c.conns.idle(), 1);
        let (data, trailers) = read_all(c.send(&up, "GET", empty()).await.unwrap()).await;
        assert_eq!(data, "second");
        assert_eq!(trailers.unwrap()["x-t"], "1");
        // A response to HEAD has no body whatever its length says, and frees the
        // connection at once.
        let head = c.send(&up, "HEAD", empty()).await.unwrap();
        assert!(http_body::Body::is_end_stream(head.body()));
        assert_eq!(c.conns.idle(), 1);
        assert_eq!(up.accepted.load(Ordering::SeqCst), 1);
        let wire = String::from_utf8(up.read.lock().clone()).unwrap();
        assert!(wire.starts_with(&format!("GET /p?q=1 HTTP/1.1\r\nhost: {}\r\n\r\n", up.addr)));
    }

    #[tokio::test]
    async fn a_kept_connection_the_upstream_closed_is_replaced_unseen() {
        let mut up = upstream(vec![
            vec![
                Step::ReadUntil(HEAD_END),
                Step::Write("HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\na"),
                Step::Close,
            ],
            vec![
                Step::ReadUntil(HEAD_END),
                Step::Write("HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nb"),
                Step::Hold,
            ],
        ])
        .await;
        let c = Client::new();
        assert_eq!(
            read_all(c.send(&up, "POST", empty()).await.unwrap())
                .await
                .0,
            "a"
        );
        up.closed.recv().await;
        assert_eq!(
            read_all(c.send(&up, "POST", empty()).await.unwrap())
                .await
                .0,
            "b"
        );
        assert_eq!(up.accepted.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn an_answer_before_the_body_has_gone_is_relayed_and_the_connection_closed() {
        let up = upstream(vec![vec![
            Step::ReadUntil(HEAD_END),
            Step::Write("HTTP/1.1 413 Content Too Large\r\nContent-Length: 4\r\n\r\nbig!"),
            Step::Hold,
        ]])
        .await;
        let c = Client::new();
        // A body whose second chunk never comes.
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, BoxError>>(1);
        tx.send(Ok(Frame::data(Bytes::from_static(b"part"))))
            .await
            .unwrap();
        let frames =
            futures_util::stream::unfold(
                rx,
                |mut rx| async move { rx.recv().await.map(|f| (f, rx)) },
            );
        let body = stream(http_body_util::StreamBody::new(frames));
        let resp = c.send(&up, "PUT", body).await.unwrap();
        assert_eq!(resp.status(), 413);
        assert_eq!(read_all(resp).await.0, "big!");
        assert_eq!(c.conns.idle(), 0, "the request never ended: not reusable");
        drop(tx);
    }

    /// An upstream that streams its answer as it reads (an echo) gets the rest of the
    /// request while its response is read; the connection is reused after both ended.
    #[tokio::test]
    async fn the_request_body_goes_on_while_the_response_streams() {
        let up = upstream(vec![vec![
            Step::ReadUntil(HEAD_END),
            Step::Write("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"),
            Step::ReadUntil("ping"),
            Step::Write("4\r\npong\r\n"),
            Step::ReadUntil("0\r\n\r\n"),
            Step::Write("0\r\n\r\n"),
            Step::Hold,
        ]])
        .await;
        let c = Client::new();
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, BoxError>>(1);
        let frames =
            futures_util::stream::unfold(
                rx,
                |mut rx| async move { rx.recv().await.map(|f| (f, rx)) },
            );
        let body = stream(http_body_util::StreamBody::new(frames));
        let mut resp = c.send(&up, "POST", body).await.unwrap();
        tx.send(Ok(Frame::data(Bytes::from_static(b"ping"))))
            .await
            .unwrap();
        let pong = resp.body_mut().frame().await.unwrap().unwrap();
        assert_eq!(pong.into_data().unwrap(), "pong");
        drop(tx);
        assert!(resp.body_mut().frame().await.is_none());
        assert_eq!(c.conns.idle(), 1);
    }

    #[tokio::test]
    async fn request_bodies_are_framed_by_length_or_chunked() {
        let up = upstream(vec![vec![
            Step::ReadUntil("abcde"),
            Step::Write("HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"),
            Step::ReadUntil("0\r\n\r\n"),
            Step::Write("HTTP/1.1 204 No Content\r\n\r\n"),
            Step::Hold,
        ]])
        .await;
        let c = Client::new();
        let resp = c.send(&up, "POST", full("abcde")).await.unwrap();
        assert_eq!(resp.status(), 200);
        let frames = futures_util::stream::iter(
            ["abc", "de"].map(|s| Ok::<_, BoxError>(Frame::data(Bytes::from_static(s.as_bytes())))),
        );
        let body = stream(http_body_util::StreamBody::new(frames));
        let resp = c.send(&up, "POST", body).await.unwrap();
        assert_eq!(resp.status(), 204);
        let wire = String::from_utf8(up.read.lock().clone()).unwrap();
        assert!(wire.contains("content-length: 5\r\n\r\nabcde"), "{wire}");
        assert!(
            wire.ends_with("transfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"),
            "{wire}"
        );
        assert_eq!(c.conns.idle(), 1);
    }

    #[tokio::test]
    async fn connections_left_in_no_known_state_are_closed() {
        let up = upstream(vec![
            // A body not read to its end.
            vec![
                Step::ReadUntil(HEAD_END),
                Step::Write("HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf"),
                Step::Hold,
            ],
            // Bytes after the response that no request asked for.
            vec![
                Step::ReadUntil(HEAD_END),
                Step::Write("HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokHTTP/1.1 200 OK\r\n"),
                Step::Hold,
            ],
            // A body delimited by the end of the connection.
            vec![
                Step::ReadUntil(HEAD_END),
                Step::Write("HTTP/1.1 200 OK\r\n\r\nuntil the end"),
                Step::Close,
            ],
            // Connection: close.
            vec![
                Step::ReadUntil(HEAD_END),
                Step::Write("HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 1\r\n\r\nx"),
                Step::Hold,
            ],
            vec![
                Step::ReadUntil(HEAD_END),
                Step::Write("HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n"),
                Step::Hold,
            ],
        ])
        .await;
        let c = Client::new();
        let mut resp = c.send(&up, "GET", empty()).await.unwrap();
        resp.body_mut().frame().await.unwrap().unwrap();
        drop(resp);
        assert_eq!(c.conns.idle(), 0);
        assert_eq!(
            read_all(c.send(&up, "GET", empty()).await.unwrap()).await.0,
            "ok"
        );
        assert_eq!(c.conns.idle(), 0);
        assert_eq!(
            read_all(c.send(&up, "GET", empty()).await.unwrap()).await.0,
            "until the end"
        );
        assert_eq!(c.conns.idle(), 0);
        assert_eq!(
            read_all(c.send(&up, "GET", empty()).await.unwrap()).await.0,
            "x"
        );
        assert_eq!(c.conns.idle(), 0);
        let e = c.send(&up, "GET", empty()).await.unwrap_err();
        assert!(matches!(e, AttemptError::Protocol(_)), "{e}");
        assert_eq!(c.conns.idle(), 0);
        assert_eq!(up.accepted.load(Ordering::SeqCst), 5);
    }

    #[tokio::test]
    async fn what_is_not_http_is_a_protocol_error_and_an_early_close_a_reset() {
        let up = upstream(vec![
            vec![
                Step::ReadUntil(HEAD_END),
                Step::Write("SMTP ready\r\n\r\n"),
                Step::Hold,
            ],
            vec![
                Step::ReadUntil(HEAD_END),
                Step::Write("HTTP/1.1 200 OK\r\nContent-Length: 1, 2\r\n\r\n"),
                Step::Hold,
            ],
            vec![
                Step::ReadUntil(HEAD_END),
                Step::Write("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"),
                Step::Hold,
            ],
            vec![
                Step::ReadUntil(HEAD_END),
                Step::Write("HTTP/1.1 200"),
                Step::Close,
            ],
        ])
        .await;
        let c = Client::new();
        for _ in 0..2 {
            let e = c.send(&up, "GET", empty()).await.unwrap_err();
            assert!(matches!(e, AttemptError::Protocol(_)), "{e}");
        }
        let resp = c.send(&up, "GET", empty()).await.unwrap();
        let e = resp.into_body().collect().await.unwrap_err();
        assert!(e.to_string().contains("chunk"), "{e}");
        let e = c.send(&up, "GET", empty()).await.unwrap_err();
        assert!(matches!(e, AttemptError::Reset(_)), "{e}");
        assert_eq!(c.conns.idle(), 0);
    }

    #[tokio::test]
    async fn idle_connections_go_to_the_next_client_when_theirs_leaves() {
        let up = upstream(vec![vec![
            Step::ReadUntil(HEAD_END),
            Step::Write("HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\n1"),
            Step::ReadUntil(HEAD_END),
            Step::Write("HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\n2"),
            Step::Hold,
        ]])
        .await;
        let first = Client::new();
        assert_eq!(
            read_all(first.send(&up, "GET", empty()).await.unwrap())
                .await
                .0,
            "1"
        );
        first.conns.hand_over();
        let second = Client {
            conns: PinnedConns::new(first.conns.shared.clone(), 0),
            ..Client::new()
        };
        assert_eq!(first.conns.shared.len(), 1);
        assert_eq!(
            read_all(second.send(&up, "GET", empty()).await.unwrap())
                .await
                .0,
            "2"
        );
        assert_eq!(up.accepted.load(Ordering::SeqCst), 1);
        assert_eq!((second.conns.idle(), first.conns.shared.len()), (1, 0));
    }
}
