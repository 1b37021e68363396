//! HTTP/2 inside an intercepted tunnel, served with the `h2` crate rather than through
//! hyper: hyper's HTTP/2 server cannot send `100 Continue`, and a client that sends
//! `Expect: 100-continue` over HTTP/2 (curl and Go after a 1 s timeout, Java's HttpClient
//! never) waits for it before sending its body. Here a request's `100` goes out when its
//! body is first read, which the pipeline does once the request is admitted: a request
//! the queue refuses gets its refusal without a `100`, as over HTTP/1.1.
//!
//! The connection's limits are hyper's defaults for its HTTP/2 server (concurrent streams,
//! header list size, windows, the reset-stream bounds that stop rapid-reset floods); a
//! stream the client resets is dropped at once, cancelling its request. What a client
//! holds is bounded by progress, never by liveliness: a stream whose window stays shut
//! for `send_timeout` is reset, a connection with no stream for `tunnel_idle_timeout`
//! is closed, and one with no stream after a GOAWAY ends a second later, PINGs or not.

use std::future::poll_fn;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use futures_util::task::AtomicWaker;
use h2::server::SendResponse;
use h2::{Reason, RecvStream, SendStream};
use http::{HeaderMap, Request, Response, StatusCode, header};
use http_body::{Body as HttpBody, Frame};
use tokio::io::{AsyncRead, AsyncWrite};

use super::forward;
use super::lifecycle::Lifecycle;
use crate::app::App;
use crate::body::{Body, BoxError};
use crate::upstream::timer::Timers;

/// hyper's defaults for its HTTP/2 server, kept so that the limits the hardening review
/// probed (CONTINUATION floods, rapid reset) stay what they were.
const MAX_CONCURRENT_STREAMS: u32 = 200;
const MAX_HEADER_LIST_SIZE: u32 = 16 << 10;
const WINDOW: u32 = 1 << 20;
const MAX_SEND_BUFFER: usize = 400 << 10;
const MAX_PENDING_RESETS: usize = 20;
const MAX_LOCAL_RESETS: usize = 1024;
/// How long a stream answered before its request ended waits for the client to end it.
const LINGER: std::time::Duration = std::time::Duration::from_secs(1);

/// Serves the HTTP/2 connection `io` until the client closes it, the drain asks it to
/// finish, or an error ends it: intercepted (TLS terminated, `h2` agreed by ALPN, and
/// the upstream is spoken to over TLS), or h2c with prior knowledge found in a CONNECT
/// tunnel (plain, and so the upstream), as `tunnel` says.
pub(crate) async fn serve<I>(
    app: std::sync::Arc<App>,
    lc: Lifecycle,
    io: I,
    tunnel: forward::Tunnel,
) -> Result<(), h2::Error>
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let mut conn = h2::server::Builder::new()
        .max_concurrent_streams(MAX_CONCURRENT_STREAMS)
        .max_header_list_size(MAX_HEADER_LIST_SIZE)
        .initial_window_size(WINDOW)
        .initial_connection_window_size(WINDOW)
        .max_send_buffer_size(MAX_SEND_BUFFER)
        .max_pending_accept_reset_streams(MAX_PENDING_RESETS)
        .max_local_error_reset_streams(Some(MAX_LOCAL_RESETS))
        .handshake::<_, Bytes>(io)
        .await?;
    let drain = lc.drain_child();
    let mut cancelled = pin!(drain.cancelled());
    let mut watch = lc.watch();
    // The deadlines of all its streams' requests, on one tokio timer.
    let timers = Timers::new();
    let config = app.config();
    let (idle, send_timeout) = (config.proxy.tunnel_idle_timeout, config.proxy.send_timeout);
    drop(config);
    // The streams being answered, polled by this connection's task rather than each by
    // a task of its own: a stream borrows the connection's `App`, lifecycle and tunnel,
    // where a task needed clones of them, counters that every worker's connections share.
    let mut answering = FuturesUnordered::new();
    // Since when no stream has been open; `None` while one is. PINGs and SETTINGS do
    // not count: a connection holds a slot for its streams, not for its liveliness.
    let opened = crate::clock::now();
    let mut quiet_since = Some(opened);
    // Armed no later than `quiet_since + idle` while the connection is quiet, and moved
    // on only when it fires early: a client that sends one request at a time would
    // otherwise register and cancel a timer for every request.
    let mut idle_timer = pin!(tokio::time::sleep_until(opened + idle));
    let mut idle_armed = true;
    // Once set, the connection ends at this instant whatever the client does: after a
    // GOAWAY with no stream left, a client that never reads would hold it (and the
    // drain) by leaving the GOAWAY's PING unanswered.
    let mut close_at: Option<tokio::time::Instant> = None;
    let mut draining = false;
    loop {
        let next = tokio::select! {
            // Streams before the connection, so that what they queued in this turn goes
            // out in the connection's next write, together.
            biased;
            Some(()) = answering.next(), if !answering.is_empty() => {
                if answering.is_empty() {
                    let now = crate::clock::now();
                    quiet_since = Some(now);
                    if !idle_armed {
                        idle_timer.as_mut().reset(now + idle);
                        idle_armed = true;
                    }
                    if draining {
                        close_at = Some(now + CLOSE_GRACE);
                    }
                }
                continue;
            }
            next = conn.accept() => next,
            () = poll_fn(|cx| watch.poll(cancelled.as_mut(), cx)), if !draining => {
                // GOAWAY: streams already open finish, no new ones start.
                conn.graceful_shutdown();
                draining = true;
                if answering.is_empty() {
                    close_at = Some(tokio::time::Instant::now() + CLOSE_GRACE);
                }
                continue;
            }
            () = &mut idle_timer, if idle_armed && close_at.is_none() => {
                match quiet_since.map(|t| t + idle) {
                    Some(due) if due > idle_timer.deadline() => idle_timer.as_mut().reset(due),
                    Some(_) => {
                        tracing::debug!(?idle, "HTTP/2 connection without a stream for the idle timeout: closed");
                        conn.graceful_shutdown();
                        close_at = Some(tokio::time::Instant::now() + CLOSE_GRACE);
                        idle_armed = false;
                    }
                    None => idle_armed = false,
                }
                continue;
            }
            () = sleep_until_some(close_at) => return Ok(()),
        };
        let Some(next) = next else {
            return Ok(());
        };
        let (req, respond) = next?;
        quiet_since = None;
        answering.push(answer(
            &app,
            &lc,
            req,
            respond,
            &tunnel,
            &timers,
            send_timeout,
        ));
    }
}

/// How long a connection with no stream left may take to end after its GOAWAY.
const CLOSE_GRACE: std::time::Duration = std::time::Duration::from_secs(1);

/// Resolves at `at`, or never when there is none.
async fn sleep_until_some(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// One stream: the request through the forward path, its `100` when its body is first
/// read, then the response, sent as the client's window allows.
async fn answer(
    app: &App,
    lc: &Lifecycle,
    req: Request<RecvStream>,
    mut respond: SendResponse<Bytes>,
    tunnel: &forward::Tunnel,
    timers: &Timers,
    send_timeout: std::time::Duration,
) {
    let expects = req
        .headers()
        .get(header::EXPECT)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    // Only a request with a body to come has progress to report: a GET's stream has
    // already ended, and it waits for no `100`.
    let progress = (!req.body().is_end_stream()).then(|| Arc::new(Progress::default()));
    let req = req.map(|recv| Incoming {
        recv,
        progress: progress.clone(),
        trailers: false,
    });
    let target = tunnel.target(&req);
    // Boxed: this future lives in the connection's set of streams, which moves it whole
    // when it is added, and the forward path's future is most of its size.
    let mut forwarded = Box::pin(forward::intercepted(app, lc, timers, req, target));
    let mut continued = !expects || progress.is_none();
    let resp = loop {
        tokio::select! {
            // The response first: on a wake-up it is what has most likely come.
            biased;
            resp = &mut forwarded => break resp,
            () = poll_fn(|cx| first_read(progress.as_deref(), cx)), if !continued => {
                continued = true;
                let mut head = Response::new(());
                *head.status_mut() = StatusCode::CONTINUE;
                let _ = respond.send_informational(head);
            }
            // The client reset the stream: its request is cancelled with it.
            _ = poll_fn(|cx| respond.poll_reset(cx)) => return,
        }
    };
    drop(forwarded);
    let (mut parts, body) = resp.into_parts();
    strip_connection_fields(&mut parts.headers);
    let end = body.is_end_stream();
    let Ok(mut send) = respond.send_response(Response::from_parts(parts, ()), end) else {
        return;
    };
    if !end {
        relay(body, &mut send, send_timeout).await;
    }
    // Answered before the client finished its request (a refusal without `100`, an
    // upstream that answered early): the stream is reset with NO_ERROR once nothing
    // holds it (RFC 9113 §8.1). Held a moment first, until the client resets or closes
    // it itself: some clients (curl 7.88) drop a response whose RST_STREAM they read
    // in the same batch.
    if progress.is_some_and(|p| !p.received.load(Ordering::Relaxed)) {
        let _ = tokio::time::timeout(LINGER, poll_fn(|cx| send.poll_reset(cx))).await;
    }
}

/// Fields HTTP/2 forbids (RFC 9113 §8.2.2); the forward path has removed the hop-by-hop
/// ones already, except on its own answers. One look over the fields finds none in
/// nearly every response, for less than a removal of each would cost.
fn strip_connection_fields(headers: &mut HeaderMap) {
    let forbidden = |n: &header::HeaderName| {
        n == header::CONNECTION
            || n == header::TRANSFER_ENCODING
            || n == header::UPGRADE
            || n == "keep-alive"
            || n == "proxy-connection"
    };
    if !headers.keys().any(forbidden) {
        return;
    }
    for name in [
        header::CONNECTION,
        header::TRANSFER_ENCODING,
        header::UPGRADE,
        header::HeaderName::from_static("keep-alive"),
        header::HeaderName::from_static("proxy-connection"),
    ] {
        headers.remove(name);
    }
}

/// The response body onto the stream, no faster than the client's window opens. A
/// window that stays shut for `send_timeout` (nginx's `send_timeout`, as for an HTTP/1.1
/// client that stops reading) resets the stream: the response, and the permits it
/// holds, go. PINGs meanwhile do not count: a window that does not open is no progress.
async fn relay(body: Body, send: &mut SendStream<Bytes>, send_timeout: std::time::Duration) {
    let mut body = pin!(body);
    loop {
        let frame = tokio::select! {
            frame = poll_fn(|cx| body.as_mut().poll_frame(cx)) => frame,
            _ = poll_fn(|cx| send.poll_reset(cx)) => return,
        };
        match frame {
            None => {
                let _ = send.send_data(Bytes::new(), true);
                return;
            }
            Some(Err(e)) => {
                tracing::debug!(error = %e, "response body failed: stream reset");
                send.send_reset(Reason::INTERNAL_ERROR);
                return;
            }
            Some(Ok(frame)) => match frame.into_data() {
                Ok(mut data) => {
                    while !data.is_empty() {
                        send.reserve_capacity(data.len());
                        let room = poll_fn(|cx| send.poll_capacity(cx));
                        let room = match tokio::time::timeout(send_timeout, room).await {
                            Ok(Some(Ok(n))) => n,
                            Ok(_) => return,
                            Err(_) => {
                                tracing::debug!(
                                    ?send_timeout,
                                    "HTTP/2 client's window shut for send_timeout: stream reset"
                                );
                                send.send_reset(Reason::CANCEL);
                                return;
                            }
                        };
                        if send
                            .send_data(data.split_to(room.min(data.len())), false)
                            .is_err()
                        {
                            return;
                        }
                    }
                }
                Err(frame) => {
                    if let Ok(trailers) = frame.into_trailers() {
                        let _ = send.send_trailers(trailers);
                        return;
                    }
                }
            },
        }
    }
}

/// What a request body's reader tells its stream: set by [`Incoming`], read by `answer`.
#[derive(Default)]
struct Progress {
    /// The body was first read: the request was admitted, its `100` may go.
    read: AtomicBool,
    /// Woken at the first read.
    reader: AtomicWaker,
    /// The client has sent all of it.
    received: AtomicBool,
}

/// Ready once the body was first read; never without a body.
fn first_read(progress: Option<&Progress>, cx: &mut Context<'_>) -> Poll<()> {
    let Some(p) = progress else {
        return Poll::Pending;
    };
    if p.read.load(Ordering::Acquire) {
        return Poll::Ready(());
    }
    p.reader.register(cx.waker());
    if p.read.load(Ordering::Acquire) {
        Poll::Ready(())
    } else {
        Poll::Pending
    }
}

/// A request body read from its stream. Read bytes are released to the client's window
/// as they are taken, so an upload moves at the pace its upstream reads it.
struct Incoming {
    recv: RecvStream,
    /// `None` when the stream had ended before the request went on.
    progress: Option<Arc<Progress>>,
    trailers: bool,
}

impl HttpBody for Incoming {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let Some(p) = &self.progress
            && !p.read.load(Ordering::Relaxed)
        {
            p.read.store(true, Ordering::Release);
            p.reader.wake();
        }
        if !self.trailers {
            match self.recv.poll_data(cx) {
                Poll::Ready(Some(Ok(data))) => {
                    let _ = self.recv.flow_control().release_capacity(data.len());
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(Box::new(e)))),
                Poll::Ready(None) => {
                    self.trailers = true;
                    if let Some(p) = &self.progress {
                        p.received.store(true, Ordering::Relaxed);
                    }
                }
                Poll::Pending => return Poll::Pending,
            }
        }
        match self.recv.poll_trailers(cx) {
            Poll::Ready(Ok(Some(t))) => Poll::Ready(Some(Ok(Frame::trailers(t)))),
            Poll::Ready(Ok(None)) => Poll::Ready(None),
            Poll::Ready(Err(e)) => Poll::Ready(Some(Err(Box::new(e)))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.recv.is_end_stream()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_http2_forbids_go_and_the_rest_stay() {
        for forbidden in [
            "connection",
            "transfer-encoding",
            "upgrade",
            "keep-alive",
            "proxy-connection",
        ] {
            let mut headers = HeaderMap::new();
            headers.insert(header::CONTENT_TYPE, "text/plain".parse().unwrap());
            headers.insert(
                header::HeaderName::from_static(forbidden),
                "x".parse().unwrap(),
            );
            headers.insert("sluice-reason", "queue_timeout".parse().unwrap());
            strip_connection_fields(&mut headers);
            let left: Vec<&str> = headers.keys().map(|k| k.as_str()).collect();
            assert_eq!(left, ["content-type", "sluice-reason"], "{forbidden}");
        }
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_LENGTH, "5".parse().unwrap());
        headers.insert(header::VIA, "1.1 sluice".parse().unwrap());
        let kept = headers.clone();
        strip_connection_fields(&mut headers);
        assert_eq!(headers, kept);
    }
}
