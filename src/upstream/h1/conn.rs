//! One HTTP/1.1 upstream connection, driven by whoever holds it: the request's future
//! writes the request and reads the response head; the response body then owns the
//! connection and reads its bytes as the client side asks for them, and gives the
//! connection back ([`Home`], which `pinned::Owner` implements) once the body has ended
//! cleanly.

use std::future::poll_fn;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use crate::egress::Counted;
use bytes::{Bytes, BytesMut};
use http::{Method, Response};
use http_body::{Body as HttpBody, Frame, SizeHint};
use tokio::io::AsyncWrite;

use super::chunked::{Decoded, Decoder};
use super::{BodyFraming, Error, Framing, Head, Span, encode_request, parse_response};
use crate::body::BoxError;
use crate::upstream::outbound::Outbound;

/// Bytes asked of the socket per read, once a read has filled what it was given.
const READ_SIZE: usize = 8 * 1024;
/// Bytes a connection's reads ask for until then: a small answer's head and body fit. Its
/// buffer stays a small allocation instead of an 8 KiB one whose first page the answer
/// touches, 2 KiB less memory per idle client connection (docs/BENCHMARKS.md, "Memory per
/// idle connection"); a larger answer grows it once, for the connection's life.
const FIRST_READ: usize = 2048;
/// Request body bytes gathered before a write.
const WRITE_BATCH: usize = 64 * 1024;
/// The most of its encoding buffer a parked request box keeps: room for a head and a
/// small body. What an upload's batches grew beyond it is freed rather than held by an
/// idle connection.
const PARKED_WIRE: usize = 4 * 1024;

/// An upstream connection between requests: the socket and what was read past the last
/// response (nothing, on a connection fit for reuse). Boxed: a connection changes hands
/// several times a request (idle list, exchange, response body, home), and each hand
/// moves a pointer rather than its 112 bytes; the box is made once per connection.
#[derive(Debug)]
pub(crate) struct Conn(Box<Parts>);

#[derive(Debug)]
pub(crate) struct Parts {
    io: Counted,
    buf: BytesMut,
    /// What a read reserves room for: `FIRST_READ`, then `READ_SIZE` for good.
    read_size: usize,
    spans: Vec<Span>,
    /// The last request's box and the buffer inside it that requests are encoded into,
    /// lent to each request in turn so that a request costs no allocation for either
    /// (growing a new buffer cost four).
    parked: Option<Box<Outgoing>>,
}

impl std::ops::Deref for Conn {
    type Target = Parts;

    fn deref(&self) -> &Parts {
        &self.0
    }
}

impl std::ops::DerefMut for Conn {
    fn deref_mut(&mut self) -> &mut Parts {
        &mut self.0
    }
}

impl Conn {
    pub(crate) fn new(io: impl Into<Counted>) -> Conn {
        let io = io.into();
        Conn(Box::new(Parts {
            io,
            buf: BytesMut::new(),
            read_size: FIRST_READ,
            spans: Vec::new(),
            parked: None,
        }))
    }
}

impl Parts {
    /// Reads what the socket has into the buffer; `Ok(0)`: the upstream closed. Through
    /// tokio's `AsyncRead`, which remembers a short read, so that the next read waits for
    /// readiness instead of trying the socket first.
    fn poll_read(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        if self.buf.capacity() - self.buf.len() < self.read_size / 2 {
            self.buf.reserve(self.read_size);
        }
        let room = self.buf.capacity() - self.buf.len();
        let read = tokio_util::io::poll_read_buf(Pin::new(&mut self.io), cx, &mut self.buf);
        if matches!(read, Poll::Ready(Ok(n)) if n >= room) {
            self.read_size = READ_SIZE;
        }
        read
    }

    /// The box a request is encoded into (see [`Outgoing::new`]).
    pub(crate) fn take_parked(&mut self) -> Option<Box<Outgoing>> {
        self.parked.take()
    }

    /// Whether an idle connection can take a request: the upstream has neither closed it
    /// nor sent anything unasked (which no request of ours would explain). tokio's
    /// `try_read` makes no system call unless the event loop has seen the socket become
    /// readable (bytes or the upstream's FIN), so the usual case costs nothing (`strace
    /// -c`: two `recvfrom` per proxied request, one on each side).
    pub(crate) fn idle_and_open(&self) -> bool {
        let mut probe = [0u8; 1];
        self.buf.is_empty()
            && matches!(self.io.get_ref().try_read(&mut probe), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
    }
}

/// A request on its way: its head, encoded once a connection is there (so that the
/// body's send hook fires then, see `Outbound`), and its body.
pub(crate) struct Outgoing {
    /// The request's method, which says whether the response has a body.
    method: Method,
    body: Outbound,
    /// Encoded and not yet written: the head, then body bytes in their framing.
    wire: Vec<u8>,
    /// How far `wire` has been written.
    pos: usize,
    framing: BodyFraming,
    /// Bytes of the body still owed under `Content-Length`.
    owed: u64,
    body_done: bool,
    /// Some of the request reached a socket: it can no longer move to another connection.
    started: bool,
    /// An emptied map the response head's fields go into, when the client connection had
    /// one to spare (see `PinnedConns::recycle`).
    pub(crate) spare: Option<http::HeaderMap>,
}

impl std::fmt::Debug for Outgoing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outgoing")
            .field("method", &self.method)
            .field("pos", &self.pos)
            .field("wire", &self.wire.len())
            .finish()
    }
}

impl Outgoing {
    /// Encodes the head (`target`: origin-form) into `parked`, a connection's box (see
    /// [`Conn::take_parked`]), or a new one; the box goes back to the connection the
    /// request ends on.
    pub(crate) fn new(
        (method, target, headers): (&Method, &str, &http::HeaderMap),
        body: Outbound,
        parked: Option<Box<Outgoing>>,
    ) -> Result<Box<Outgoing>, Error> {
        let mut out = parked.unwrap_or_else(|| {
            Box::new(Outgoing {
                method: Method::GET,
                body: Outbound::from(crate::body::empty()),
                wire: Vec::new(),
                pos: 0,
                framing: BodyFraming::None,
                owed: 0,
                body_done: true,
                started: false,
                spare: None,
            })
        });
        out.wire.clear();
        let empty = body.is_end_stream();
        let exact = body.size_hint().exact();
        let framing = encode_request(&mut out.wire, method, target, headers, (empty, exact))?;
        if out.method != *method {
            out.method = method.clone();
        }
        out.body = body;
        out.pos = 0;
        out.framing = framing;
        out.owed = match framing {
            BodyFraming::Length(n) => n,
            _ => 0,
        };
        out.body_done = framing == BodyFraming::None;
        out.started = false;
        out.spare = None;
        Ok(out)
    }

    /// `req`, encoded into a buffer of its own, for tests.
    #[cfg(test)]
    pub(crate) fn of(req: http::Request<Outbound>, target: &str) -> Box<Outgoing> {
        let (parts, body) = req.into_parts();
        match Outgoing::new((&parts.method, target, &parts.headers), body, None) {
            Ok(out) => out,
            Err(e) => panic!("cannot encode the request: {e}"),
        }
    }

    /// Parks the box and its encoding buffer with the connection once the request is
    /// done with them; the body (ended) goes now, not with the next request.
    fn give_back(mut self: Box<Self>, conn: &mut Conn) {
        if self.wire.capacity() > PARKED_WIRE {
            self.wire = Vec::new();
        }
        self.wire.clear();
        self.body = Outbound::from(crate::body::empty());
        self.spare = None;
        conn.parked = Some(self);
    }

    /// Whether the request can still go on another connection: nothing of it was taken
    /// by a socket.
    pub(crate) fn unsent(&self) -> bool {
        !self.started
    }

    /// Writes as much of the request as the socket takes: the head, then the body,
    /// batched.
    fn poll_write(&mut self, cx: &mut Context<'_>, io: &mut Counted) -> Poll<Result<(), Error>> {
        loop {
            // Gather body bytes first, so that a small body leaves in the head's write.
            while !self.body_done && self.wire.len() - self.pos < WRITE_BATCH {
                match Pin::new(&mut self.body).poll_frame(cx) {
                    Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                        Ok(data) => self.put_data(&data)?,
                        // Request trailers end the body and go no further: see `put_end`.
                        Err(frame) => {
                            if frame.is_trailers() {
                                self.put_end()?;
                            }
                        }
                    },
                    Poll::Ready(Some(Err(e))) => return Poll::Ready(Err(Error::RequestBody(e))),
                    Poll::Ready(None) => self.put_end()?,
                    Poll::Pending => break,
                }
            }
            if self.pos == self.wire.len() {
                if self.body_done {
                    return Poll::Ready(Ok(()));
                }
                return Poll::Pending; // the body will wake us
            }
            match Pin::new(&mut *io).poll_write(cx, &self.wire[self.pos..]) {
                Poll::Ready(Ok(0)) => {
                    return Poll::Ready(Err(io::Error::from(io::ErrorKind::WriteZero).into()));
                }
                Poll::Ready(Ok(n)) => {
                    self.started = true;
                    self.pos += n;
                    if self.pos == self.wire.len() {
                        self.wire.clear();
                        self.pos = 0;
                    }
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e.into())),
                Poll::Pending => return Poll::Pending,
            }
        }
    }

    fn put_data(&mut self, data: &Bytes) -> Result<(), Error> {
        if data.is_empty() {
            return Ok(());
        }
        match self.framing {
            BodyFraming::Length(_) => {
                let n = data.len() as u64;
                if n > self.owed {
                    return Err(Error::RequestLength);
                }
                self.owed -= n;
                self.wire.extend_from_slice(data);
            }
            BodyFraming::Chunked => {
                let mut hex = [0u8; 16];
                let mut i = hex.len();
                let mut n = data.len();
                loop {
                    i -= 1;
                    hex[i] = b"0123456789abcdef"[n % 16];
                    n /= 16;
                    if n == 0 {
                        break;
                    }
                }
                self.wire.extend_from_slice(&hex[i..]);
                self.wire.extend_from_slice(b"\r\n");
                self.wire.extend_from_slice(data);
                self.wire.extend_from_slice(b"\r\n");
            }
            _ => return Err(Error::RequestLength),
        }
        Ok(())
    }

    /// Ends the body. A request's trailer fields are never sent: the head went without
    /// its `Trailer` field (a connection's own), so the upstream expects none, and fields
    /// after the body could carry framing, routing or credentials past every check made
    /// on the head (RFC 9110 §6.5.1 lets a recipient discard them). The TLS path's
    /// client sends none either.
    fn put_end(&mut self) -> Result<(), Error> {
        match self.framing {
            BodyFraming::Chunked => self.wire.extend_from_slice(b"0\r\n\r\n"),
            BodyFraming::Length(_) if self.owed > 0 => return Err(Error::RequestLength),
            _ => {}
        }
        self.body_done = true;
        Ok(())
    }
}

/// An exchange that failed, with its request if nothing of it reached the socket (so it
/// may go on another connection).
pub(crate) struct Failed {
    pub(crate) error: Error,
    pub(crate) unsent: Option<Box<Outgoing>>,
}

/// Sends the request `out` on `conn` and reads the response head. Reads while it
/// writes: an upstream may answer before it has read the whole body, either to refuse it
/// (then that answer is what the client should get) or because it streams (an echo), in
/// which case the response body goes on sending the request's as it reads. The
/// connection goes with the response; `home` takes it back once the body has ended
/// cleanly.
///
/// The request comes boxed and stays in its box, which goes on to `Failed` or the body:
/// each level of the pipeline moves an 8-byte pointer rather than 250 bytes of head. Not
/// an `async fn`, which would keep a second copy of its arguments in its future.
#[allow(clippy::manual_async_fn, reason = "see above: arguments stored once")]
pub(crate) fn exchange<H: Home>(
    mut conn: Conn,
    mut out: Box<Outgoing>,
    home: H,
) -> impl Future<Output = Result<Response<UpstreamBody<H>>, Failed>> {
    async move {
        let fail = |error, out: Box<Outgoing>| Failed {
            error,
            unsent: out.unsent().then_some(out),
        };
        let mut write_failed: Option<Error> = None;
        let mut sent = false;
        let head = poll_fn(|cx| {
            loop {
                if !sent && write_failed.is_none() {
                    match out.poll_write(cx, &mut conn.io) {
                        Poll::Ready(Ok(())) => sent = true,
                        // The client's body failed: the upstream will not answer a request
                        // that never ends.
                        Poll::Ready(Err(e @ (Error::RequestBody(_) | Error::RequestLength))) => {
                            return Poll::Ready(Err(e));
                        }
                        // The upstream may have answered and closed: read what it said.
                        Poll::Ready(Err(e)) => write_failed = Some(e),
                        Poll::Pending => {}
                    }
                }
                let (out, conn) = (&mut *out, &mut *conn);
                match parse_response(&mut conn.buf, &out.method, &mut conn.spans, &mut out.spare)? {
                    // 100 Continue and 103 Early Hints precede the response; a 101 is
                    // refused by the caller.
                    Some(h) if h.status.is_informational() && h.status != 101 => continue,
                    Some(h) => return Poll::Ready(Ok(h)),
                    None => {}
                }
                match ready!(conn.poll_read(cx)) {
                    Ok(0) => {
                        return Poll::Ready(Err(write_failed
                            .take()
                            .unwrap_or(Error::Closed("head arrived"))));
                    }
                    Ok(_) => {}
                    Err(e) => return Poll::Ready(Err(write_failed.take().unwrap_or(e.into()))),
                }
            }
        })
        .await;
        let head = match head {
            Ok(head) => head,
            Err(e) => return Err(fail(e, out)),
        };
        // A 101 leaves the connection in another protocol; a request that could not be
        // written whole, in no known state.
        let upgraded = head.status == 101;
        let sending = if !sent && write_failed.is_none() && !upgraded {
            Some(out)
        } else {
            out.give_back(&mut conn);
            None
        };
        let home = (head.keep_alive && write_failed.is_none() && !upgraded).then_some(home);
        Ok(response(head, conn, sending, home))
    }
}

/// Where a connection goes when a response body has ended cleanly on it.
pub(crate) trait Home: Send + Unpin + 'static {
    fn take_back(self, conn: Conn);
}

fn response<H: Home>(
    head: Head,
    conn: Conn,
    sending: Option<Box<Outgoing>>,
    home: Option<H>,
) -> Response<UpstreamBody<H>> {
    let Head {
        status,
        version,
        headers,
        framing,
        ..
    } = head;
    let mut body = UpstreamBody {
        conn: Some(conn),
        sending,
        read: match framing {
            Framing::Empty => Reading::Done,
            Framing::Length(n) => Reading::Length(n),
            Framing::Chunked => Reading::Chunked(Decoder::default()),
            Framing::Close => Reading::Close,
        },
        home,
    };
    // After a 101 the connection is in another protocol: it stays with the body for
    // `take_upgraded`, or closes with it.
    if matches!(body.read, Reading::Done) && status != 101 {
        body.finish();
    }
    let mut resp = Response::new(body);
    *resp.status_mut() = status;
    *resp.version_mut() = version;
    *resp.headers_mut() = headers;
    resp
}

enum Reading {
    Length(u64),
    Chunked(Decoder),
    Close,
    Done,
}

/// A response body read straight from its upstream connection.
pub(crate) struct UpstreamBody<H> {
    /// Gone once the body has ended (given back or closed).
    conn: Option<Conn>,
    /// The rest of a request whose answer began before it was all sent.
    sending: Option<Box<Outgoing>>,
    read: Reading,
    /// Takes the connection back after a clean end; `None`: the connection closes.
    home: Option<H>,
}

impl<H> std::fmt::Debug for UpstreamBody<H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamBody")
            .field("done", &matches!(self.read, Reading::Done))
            .field("goes_home", &self.home.is_some())
            .finish()
    }
}

impl<H> UpstreamBody<H> {
    /// After a `101`: the connection in its new protocol, and what the upstream already
    /// sent in it behind the head.
    pub(crate) fn take_upgraded(&mut self) -> Option<(Counted, BytesMut)> {
        self.sending = None;
        self.home = None;
        self.conn.take().map(|c| {
            let Parts { io, buf, .. } = *c.0;
            (io, buf)
        })
    }
}

impl<H: Home> UpstreamBody<H> {
    /// The body ended cleanly: the connection goes home if it may carry another request,
    /// the request went out whole, and nothing unasked follows the response.
    fn finish(&mut self) {
        self.read = Reading::Done;
        if let (Some(conn), Some(home)) = (self.conn.take(), self.home.take())
            && conn.buf.is_empty()
            && self.sending.take().is_none()
        {
            home.take_back(conn);
        }
    }

    fn fail(&mut self, e: Error) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.read = Reading::Done;
        self.conn = None;
        self.sending = None;
        self.home = None;
        Poll::Ready(Some(Err(Box::new(e))))
    }
}

impl<H: Home> HttpBody for UpstreamBody<H> {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if let (Some(req), Some(conn)) = (this.sending.as_mut(), this.conn.as_mut()) {
            match req.poll_write(cx, &mut conn.io) {
                Poll::Ready(Ok(())) => {
                    if let Some(req) = this.sending.take() {
                        req.give_back(conn);
                    }
                }
                // The upstream stopped reading the request; what it answers still
                // counts, but the connection cannot carry another.
                Poll::Ready(Err(_)) => {
                    this.sending = None;
                    this.home = None;
                }
                Poll::Pending => {}
            }
        }
        loop {
            let Some(conn) = this.conn.as_mut() else {
                return Poll::Ready(None);
            };
            match &mut this.read {
                Reading::Done => return Poll::Ready(None),
                Reading::Length(left) if !conn.buf.is_empty() => {
                    let n = usize::try_from(*left)
                        .unwrap_or(usize::MAX)
                        .min(conn.buf.len());
                    let data = conn.buf.split_to(n).freeze();
                    *left -= n as u64;
                    if *left == 0 {
                        this.finish();
                    }
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Reading::Chunked(d) => match d.decode(&mut conn.buf) {
                    Ok(Decoded::Data(data)) => return Poll::Ready(Some(Ok(Frame::data(data)))),
                    Ok(Decoded::End(trailers)) => {
                        this.finish();
                        return Poll::Ready(trailers.map(|t| Ok(Frame::trailers(t))));
                    }
                    Ok(Decoded::More) => {}
                    Err(e) => return this.fail(e),
                },
                Reading::Close if !conn.buf.is_empty() => {
                    let data = conn.buf.split().freeze();
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Reading::Length(_) | Reading::Close => {}
            }
            // The buffer is spent (or holds an incomplete chunk line): read more.
            match ready!(conn.poll_read(cx)) {
                Ok(0) if matches!(this.read, Reading::Close) => {
                    this.read = Reading::Done;
                    this.conn = None;
                    this.sending = None;
                    return Poll::Ready(None);
                }
                Ok(0) => return this.fail(Error::Closed("body ended")),
                Ok(_) => {}
                Err(e) => return this.fail(e.into()),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self.read, Reading::Done)
    }

    fn size_hint(&self) -> SizeHint {
        match self.read {
            Reading::Length(n) => SizeHint::with_exact(n),
            Reading::Done => SizeHint::with_exact(0),
            _ => SizeHint::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    //! The connection against upstreams that write exact bytes on a real loopback
    //! socket: each test states what the upstream sends and what must come of it (the
    //! head, the body, whether the connection goes home), as a protocol implementation's
    //! tests do.

    use super::*;
    use crate::body::{empty, full};
    use http_body_util::BodyExt;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    /// Notes whether the connection came back.
    #[derive(Clone, Default)]
    struct Recorder(Arc<AtomicBool>);

    impl Home for Recorder {
        fn take_back(self, _conn: Conn) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    /// An upstream that reads the request head (and `body_len` bytes after it), sends
    /// `reply`, then closes (`close`) or keeps the socket open a while; returns what it
    /// read.
    async fn upstream(
        reply: &'static [u8],
        body_len: usize,
        close: bool,
    ) -> (Conn, tokio::task::JoinHandle<Vec<u8>>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut got = Vec::new();
            let mut buf = [0u8; 4096];
            loop {
                let head_end = got.windows(4).position(|w| w == b"\r\n\r\n");
                if head_end.is_some_and(|end| got.len() >= end + 4 + body_len) {
                    break;
                }
                let n = s.read(&mut buf).await.unwrap();
                if n == 0 {
                    break;
                }
                got.extend_from_slice(&buf[..n]);
            }
            s.write_all(reply).await.unwrap();
            if close {
                s.shutdown().await.unwrap();
            } else {
                tokio::time::sleep(std::time::Duration::from_millis(300)).await;
            }
            got
        });
        let io = tokio::net::TcpStream::connect(addr).await.unwrap();
        (Conn::new(io), server)
    }

    fn request(method: Method, body: crate::body::Body) -> Box<Outgoing> {
        let req = http::Request::builder()
            .method(method)
            .header("host", "upstream.test")
            .body(Outbound::from(body))
            .unwrap();
        Outgoing::of(req, "/path?q=1")
    }

    /// Sends `out` to an upstream answering `reply`; the response's status, its body,
    /// its trailers, whether the connection went home, and what the upstream read.
    async fn exchange_with(
        out: Box<Outgoing>,
        reply: &'static [u8],
        body_len: usize,
        close: bool,
    ) -> (u16, Vec<u8>, Option<http::HeaderMap>, bool, Vec<u8>) {
        let (conn, server) = upstream(reply, body_len, close).await;
        let home = Recorder::default();
        let resp = match exchange(conn, out, home.clone()).await {
            Ok(r) => r,
            Err(f) => panic!("exchange failed: {}", f.error),
        };
        let status = resp.status().as_u16();
        let collected = resp.into_body().collect().await.unwrap();
        let trailers = collected.trailers().cloned();
        let body = collected.to_bytes().to_vec();
        let went_home = home.0.load(Ordering::SeqCst);
        (status, body, trailers, went_home, server.await.unwrap())
    }

    #[tokio::test]
    async fn a_sized_response_is_read_whole_and_the_connection_goes_home() {
        let (status, body, _, home, sent) = exchange_with(
            request(Method::GET, empty()),
            b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello",
            0,
            false,
        )
        .await;
        assert_eq!((status, body.as_slice(), home), (200, &b"hello"[..], true));
        let sent = String::from_utf8(sent).unwrap();
        assert!(sent.starts_with("GET /path?q=1 HTTP/1.1\r\n"), "{sent}");
        assert!(sent.contains("host: upstream.test\r\n"), "{sent}");
        assert!(
            !sent.contains("content-length"),
            "a GET without a body says nothing: {sent}"
        );
    }

    /// 100 Continue, 102 Processing and 103 Early Hints (with fields) precede the final
    /// response: they are passed over and the final one is what the caller gets.
    #[tokio::test]
    async fn informational_responses_before_the_final_one_are_passed_over() {
        let (status, body, _, home, _) = exchange_with(
            request(Method::GET, empty()),
            b"HTTP/1.1 100 Continue\r\n\r\n\
              HTTP/1.1 102 Processing\r\n\r\n\
              HTTP/1.1 103 Early Hints\r\nlink: </style.css>; rel=preload\r\n\r\n\
              HTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\nok",
            0,
            false,
        )
        .await;
        assert_eq!((status, body.as_slice(), home), (201, &b"ok"[..], true));
    }

    #[tokio::test]
    async fn a_chunked_response_with_trailers_is_decoded() {
        let (status, body, trailers, home, _) = exchange_with(
            request(Method::GET, empty()),
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n\
              5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\nx-checksum: abc\r\n\r\n",
            0,
            false,
        )
        .await;
        assert_eq!(
            (status, body.as_slice(), home),
            (200, &b"hello world"[..], true)
        );
        assert_eq!(trailers.unwrap()["x-checksum"], "abc");
    }

    #[tokio::test]
    async fn connection_close_or_http_1_0_keeps_the_connection_from_going_home() {
        for reply in [
            &b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok"[..],
            &b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\nok"[..],
        ] {
            let reply: &'static [u8] = reply;
            let (status, body, _, home, _) =
                exchange_with(request(Method::GET, empty()), reply, 0, false).await;
            assert_eq!((status, body.as_slice(), home), (200, &b"ok"[..], false));
        }
    }

    #[tokio::test]
    async fn a_body_without_length_runs_until_the_upstream_closes() {
        let (status, body, _, home, _) = exchange_with(
            request(Method::GET, empty()),
            b"HTTP/1.1 200 OK\r\n\r\nuntil the end",
            0,
            true,
        )
        .await;
        assert_eq!(
            (status, body.as_slice(), home),
            (200, &b"until the end"[..], false)
        );
    }

    /// A response to HEAD has no body whatever its Content-Length says; 204 and 304
    /// have none either.
    #[tokio::test]
    async fn head_204_and_304_have_no_body() {
        let (status, body, _, home, _) = exchange_with(
            request(Method::HEAD, empty()),
            b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n",
            0,
            false,
        )
        .await;
        assert_eq!((status, body.len(), home), (200, 0, true));
        for reply in [
            &b"HTTP/1.1 204 No Content\r\n\r\n"[..],
            &b"HTTP/1.1 304 Not Modified\r\ncontent-length: 10\r\n\r\n"[..],
        ] {
            let reply: &'static [u8] = reply;
            let (_, body, _, home, _) =
                exchange_with(request(Method::GET, empty()), reply, 0, false).await;
            assert_eq!((body.len(), home), (0, true));
        }
    }

    /// Bytes after the response that no request asked for: the connection is not
    /// trusted with another request.
    #[tokio::test]
    async fn unasked_bytes_after_a_response_keep_the_connection_from_going_home() {
        let (status, body, _, home, _) = exchange_with(
            request(Method::GET, empty()),
            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokHTTP/1.1 200 OK\r\n\r\n",
            0,
            false,
        )
        .await;
        assert_eq!((status, body.as_slice(), home), (200, &b"ok"[..], false));
    }

    /// A body of known size goes with Content-Length, one of unknown size chunked.
    #[tokio::test]
    async fn request_bodies_are_framed_by_what_is_known_of_them() {
        let (_, _, _, home, sent) = exchange_with(
            request(Method::POST, full("hello")),
            b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
            5,
            false,
        )
        .await;
        let sent = String::from_utf8(sent).unwrap();
        assert!(sent.contains("content-length: 5\r\n\r\nhello"), "{sent}");
        assert!(home);

        let chunks = futures_util::stream::iter([
            Ok::<_, BoxError>(Frame::data(Bytes::from_static(b"abc"))),
            Ok(Frame::data(Bytes::from_static(b"defghijklmnopq"))),
        ]);
        let unknown =
            http_body_util::BodyExt::boxed_unsync(http_body_util::StreamBody::new(chunks));
        let wire = b"3\r\nabc\r\ne\r\ndefghijklmnopq\r\n0\r\n\r\n";
        let (_, _, _, home, sent) = exchange_with(
            request(Method::POST, unknown),
            b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
            wire.len(),
            false,
        )
        .await;
        let sent = String::from_utf8(sent).unwrap();
        assert!(
            sent.contains("transfer-encoding: chunked\r\n\r\n"),
            "{sent}"
        );
        assert!(sent.ends_with(std::str::from_utf8(wire).unwrap()), "{sent}");
        assert!(home);
    }

    /// An upstream may refuse a request before reading its body: its answer is what
    /// the caller gets, and the connection, left mid-request, never goes home.
    #[tokio::test]
    async fn an_early_answer_to_an_unfinished_upload_is_returned_and_the_connection_dropped() {
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, BoxError>>(1);
        tx.send(Ok(Frame::data(Bytes::from_static(b"part"))))
            .await
            .unwrap();
        // The rest of the body never comes while the exchange runs.
        let stream = futures_util::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|item| (item, rx))
        });
        let body = http_body_util::BodyExt::boxed_unsync(http_body_util::StreamBody::new(stream));
        let out = {
            let req = http::Request::builder()
                .method(Method::PUT)
                .header("content-length", "1000")
                .body(Outbound::from(body))
                .unwrap();
            Outgoing::of(req, "/upload")
        };
        let (status, body, _, home, _) = exchange_with(
            out,
            b"HTTP/1.1 413 Content Too Large\r\ncontent-length: 3\r\nconnection: close\r\n\r\nbig",
            4,
            false,
        )
        .await;
        drop(tx);
        assert_eq!((status, body.as_slice(), home), (413, &b"big"[..], false));
    }

    /// The upstream closes without answering: an error, and the request is not offered
    /// for another connection, since it reached this one.
    #[tokio::test]
    async fn a_close_before_the_head_fails_and_keeps_the_sent_request() {
        let (conn, _server) = upstream(b"", 0, true).await;
        let Err(failed) = exchange(conn, request(Method::GET, empty()), Recorder::default()).await
        else {
            panic!("an answer from a closed connection");
        };
        assert!(matches!(failed.error, Error::Closed(_)), "{}", failed.error);
        assert!(failed.unsent.is_none());
    }

    /// A 101 hands over the socket and what the upstream sent behind the head.
    #[tokio::test]
    async fn a_switch_of_protocols_hands_over_the_socket_and_what_followed() {
        let (conn, _server) = upstream(
            b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n\x81\x02hi",
            0,
            false,
        )
        .await;
        let home = Recorder::default();
        let Ok(mut resp) = exchange(conn, request(Method::GET, empty()), home.clone()).await else {
            panic!("no 101");
        };
        assert_eq!(resp.status(), 101);
        // What follows the head may arrive with it or just after.
        let (mut io, mut rest) = resp.body_mut().take_upgraded().unwrap();
        assert!(resp.into_body().conn.is_none(), "the socket left the body");
        while rest.len() < 4 {
            let mut more = [0u8; 16];
            let n = io.read(&mut more).await.unwrap();
            assert!(n > 0, "the upstream's frame after the head");
            rest.extend_from_slice(&more[..n]);
        }
        assert_eq!(&rest[..], b"\x81\x02hi");
        assert!(
            !home.0.load(Ordering::SeqCst),
            "an upgraded connection never goes home"
        );
    }

    /// Keeps the connection that came home.
    #[derive(Clone, Default)]
    struct Keeper(Arc<parking_lot::Mutex<Option<Conn>>>);

    impl Home for Keeper {
        fn take_back(self, conn: Conn) {
            *self.0.lock() = Some(conn);
        }
    }

    /// An idle connection does not hold what an upload grew its encoding buffer to, and
    /// the next request is encoded into its box all the same.
    #[tokio::test]
    async fn an_idle_connection_does_not_keep_an_uploads_batches() {
        let upload = 20 * PARKED_WIRE;
        let (conn, server) = upstream(
            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok",
            upload,
            false,
        )
        .await;
        let home = Keeper::default();
        let out = request(Method::POST, full(vec![b'x'; upload]));
        let Ok(resp) = exchange(conn, out, home.clone()).await else {
            panic!("no answer");
        };
        let got = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&got[..], b"ok");
        let mut conn = home.0.lock().take().expect("the connection came home");
        let parked = conn.take_parked().expect("the request's box is parked");
        assert!(
            parked.wire.capacity() <= PARKED_WIRE,
            "a parked box keeps {} bytes",
            parked.wire.capacity()
        );
        let next = http::Request::builder()
            .header("host", "upstream.test")
            .body(Outbound::from(empty()))
            .unwrap();
        let (parts, body) = next.into_parts();
        let next =
            Outgoing::new((&parts.method, "/next", &parts.headers), body, Some(parked)).unwrap();
        assert!(next.wire.starts_with(b"GET /next HTTP/1.1\r\n"));
        assert!(
            server.await.unwrap().len() > upload,
            "the upload went out whole"
        );
    }

    /// A small answer leaves the connection's read buffer at `FIRST_READ`; an answer
    /// larger than that, head and body, is read whole and the reads ask for `READ_SIZE`
    /// from then on.
    #[tokio::test]
    async fn reads_start_small_and_grow_once_an_answer_fills_them() {
        async fn answer(reply: &'static [u8]) -> (Vec<u8>, Conn) {
            let (conn, server) = upstream(reply, 0, false).await;
            let home = Keeper::default();
            let Ok(resp) = exchange(conn, request(Method::GET, empty()), home.clone()).await else {
                panic!("no answer");
            };
            let body = resp
                .into_body()
                .collect()
                .await
                .unwrap()
                .to_bytes()
                .to_vec();
            server.await.unwrap();
            let conn = home.0.lock().take().expect("the connection came home");
            (body, conn)
        }
        let (body, conn) = answer(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok").await;
        assert_eq!(body, b"ok");
        assert_eq!(conn.read_size, FIRST_READ);
        assert!(
            conn.buf.capacity() <= FIRST_READ,
            "an idle connection keeps {} bytes of buffer",
            conn.buf.capacity()
        );

        let field = "v".repeat(3 * FIRST_READ);
        let content = "b".repeat(5 * READ_SIZE);
        let reply = format!(
            "HTTP/1.1 200 OK\r\nx-long: {field}\r\ncontent-length: {}\r\n\r\n{content}",
            content.len()
        );
        let (body, conn) = answer(Box::leak(reply.into_bytes().into_boxed_slice())).await;
        assert_eq!(body, content.as_bytes());
        assert_eq!(conn.read_size, READ_SIZE);
    }
}
