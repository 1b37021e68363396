//! The rest of an HTTP/1.1 request body that sluice stops reading before its end: after a
//! local answer (a 429 from the queue, a refusal) or when the upstream answered early and
//! closed. It is read and thrown away, within bounds, as nginx discards one: a client
//! still sending when its connection closes gets a reset, and a reset destroys the answer
//! it has not read yet (a client that sends its whole body before reading, as Python's
//! `http.client` does, sees only a broken pipe). Read to its end, the body also leaves
//! the connection fit for the client's next request.
//!
//! Two bodies are left alone. One never read whose request asked `Expect: 100-continue`:
//! its client is waiting for a `100` that does not come, and reading would make hyper
//! send one. And one whose client stalled ([`forsaking`]): its 408 closes the connection.

use std::cell::Cell;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Version, header};
use http_body::{Body as HttpBody, Frame, SizeHint};
use http_body_util::BodyExt;
use tokio::time::Instant;

use crate::body::BoxError;

/// Silence that ends the discarding (nginx's `lingering_timeout`).
const SILENCE: Duration = Duration::from_secs(5);
/// How long a body is discarded at most (nginx's `lingering_time`): a client that keeps
/// sending holds its connection no longer than this after its answer.
const AT_MOST: Duration = Duration::from_secs(30);

thread_local! {
    /// Set while [`forsaking`] drops a body.
    static FORSAKING: Cell<bool> = const { Cell::new(false) };
}

/// Drops `body` without discarding its rest: its client stalled, and its answer (a 408)
/// closes the connection, as nginx closes one after `client_body_timeout`. The body is
/// boxed by then, out of reach of its [`Rest`], so the drop is told by the thread it
/// runs on.
pub(crate) fn forsaking<T>(body: T) {
    forsaken(|| drop(body));
}

/// Runs `drop_it`, whose drops of client bodies do not discard.
fn forsaken(drop_it: impl FnOnce()) {
    FORSAKING.set(true);
    drop_it();
    FORSAKING.set(false);
}

/// `reading` (which owns a client's body) within `limit`: on time, its output; else
/// `None`, and `reading` is dropped as [`forsaking`] drops a body.
pub(crate) async fn within<F: Future>(limit: Duration, reading: F) -> Option<F::Output> {
    let mut reading = std::pin::pin!(Some(reading));
    let mut expiry = std::pin::pin!(tokio::time::sleep(limit));
    std::future::poll_fn(|cx| {
        if let Some(r) = reading.as_mut().as_pin_mut()
            && let Poll::Ready(out) = r.poll(cx)
        {
            return Poll::Ready(Some(out));
        }
        if expiry.as_mut().poll(cx).is_ready() {
            forsaken(|| reading.as_mut().set(None));
            return Poll::Ready(None);
        }
        Poll::Pending
    })
    .await
}

/// A client's request body on its way through sluice; dropped before its end, the rest is
/// read and thrown away by a task of its own (see the module's comment).
pub(crate) struct Rest<B>
where
    B: HttpBody<Data = Bytes> + Send + Unpin + 'static,
{
    body: Option<B>,
    /// The request asked `Expect: 100-continue`.
    expect: bool,
    read: Read,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Read {
    Never,
    Some,
    /// It ended, or failed: nothing is left to read.
    Done,
}

impl<B> Rest<B>
where
    B: HttpBody<Data = Bytes> + Send + Unpin + 'static,
{
    pub(crate) fn new(body: B, expect: bool) -> Rest<B> {
        Rest {
            body: Some(body),
            expect,
            read: Read::Never,
        }
    }
}

impl<B> HttpBody for Rest<B>
where
    B: HttpBody<Data = Bytes> + Send + Unpin + 'static,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let Some(body) = self.body.as_mut() else {
            return Poll::Ready(None);
        };
        let polled = Pin::new(body).poll_frame(cx);
        self.read = match &polled {
            Poll::Ready(Some(Ok(_))) => Read::Some,
            Poll::Ready(_) => Read::Done,
            // Polled: hyper has sent any `100` the client waits for.
            Poll::Pending => Read::Some,
        };
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.as_ref().is_none_or(HttpBody::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.body
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), HttpBody::size_hint)
    }
}

impl<B> Drop for Rest<B>
where
    B: HttpBody<Data = Bytes> + Send + Unpin + 'static,
{
    fn drop(&mut self) {
        let Some(body) = self.body.take() else {
            return;
        };
        let waiting_for_100 = self.expect && self.read == Read::Never;
        if self.read == Read::Done || waiting_for_100 || FORSAKING.get() || body.is_end_stream() {
            return;
        }
        // Outside a runtime (a test dropping a request) there is no client to answer.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(discard(body));
        }
    }
}

/// Reads `body` to its end and drops what it reads, until it ends or fails, nothing comes
/// for [`SILENCE`], or [`AT_MOST`] has passed.
async fn discard<B>(mut body: B)
where
    B: HttpBody<Data = Bytes> + Unpin,
{
    let end = Instant::now() + AT_MOST;
    let mut bytes = 0u64;
    let how = loop {
        let quiet = (Instant::now() + SILENCE).min(end);
        match tokio::time::timeout_at(quiet, body.frame()).await {
            Ok(Some(Ok(frame))) => {
                bytes += frame.data_ref().map_or(0, |d| d.len() as u64);
            }
            Ok(None) => break "ended",
            Ok(Some(Err(_))) => break "failed",
            Err(_) if Instant::now() >= end => break "too long",
            Err(_) => break "silent",
        }
    };
    tracing::debug!(bytes, how, "discarded the rest of a request body");
}

/// A request that is answered without being sent on: the rest of its body is discarded
/// (HTTP/1.1; an HTTP/2 stream's is refused by a reset).
pub(crate) fn rest_of<B>(req: Request<B>)
where
    B: HttpBody<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<BoxError>,
{
    if req.version() == Version::HTTP_2 || req.body().is_end_stream() {
        return;
    }
    let expect = req.headers().contains_key(header::EXPECT);
    drop(Rest::new(req.into_body(), expect));
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::StreamBody;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::sync::mpsc;

    type Item = Result<Frame<Bytes>, std::convert::Infallible>;
    type Chunks = StreamBody<futures_util::stream::BoxStream<'static, Item>>;

    /// A body fed by the test, counting the frames read from it.
    fn fed() -> (mpsc::Sender<Item>, Chunks, Arc<AtomicUsize>) {
        let (tx, rx) = mpsc::channel(64);
        let read = Arc::new(AtomicUsize::new(0));
        let counted = read.clone();
        let stream = futures_util::stream::unfold(rx, move |mut rx| {
            let counted = counted.clone();
            async move {
                let item = rx.recv().await?;
                counted.fetch_add(1, Ordering::SeqCst);
                Some((item, rx))
            }
        });
        (tx, StreamBody::new(Box::pin(stream) as _), read)
    }

    async fn feed(tx: &mpsc::Sender<Item>, chunk: &'static [u8]) {
        tx.send(Ok(Frame::data(Bytes::from_static(chunk))))
            .await
            .unwrap();
    }

    async fn settle() {
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_dropped_before_its_end_is_read_to_its_end() {
        let (tx, body, read) = fed();
        let mut rest = Rest::new(body, false);
        feed(&tx, b"a").await;
        assert!(rest.frame().await.is_some());
        drop(rest);
        for _ in 0..3 {
            feed(&tx, b"b").await;
        }
        settle().await;
        assert_eq!(read.load(Ordering::SeqCst), 4);
        // The discarding ends with the body.
        drop(tx);
        settle().await;
    }

    #[tokio::test(start_paused = true)]
    async fn an_unread_body_is_discarded_unless_its_client_waits_for_100() {
        let (tx, body, read) = fed();
        drop(Rest::new(body, false));
        feed(&tx, b"a").await;
        settle().await;
        assert_eq!(read.load(Ordering::SeqCst), 1, "no Expect: discarded");

        let (tx, body, read) = fed();
        drop(Rest::new(body, true));
        // The receiver is gone with the body: nobody reads.
        assert!(
            tx.send(Ok(Frame::data(Bytes::from_static(b"a"))))
                .await
                .is_err()
        );
        assert_eq!(read.load(Ordering::SeqCst), 0, "Expect, never read: left");
    }

    #[tokio::test(start_paused = true)]
    async fn a_forsaken_body_is_dropped_unread() {
        let (tx, body, read) = fed();
        let mut rest = Rest::new(body, false);
        feed(&tx, b"a").await;
        assert!(rest.frame().await.is_some());
        forsaking(crate::body::stream(rest));
        assert!(tx.is_closed(), "dropped at once");
        assert_eq!(read.load(Ordering::SeqCst), 1);
        // Only that drop: the next body dropped on this thread is discarded again.
        let (tx, body, read) = fed();
        drop(Rest::new(body, false));
        feed(&tx, b"b").await;
        settle().await;
        assert_eq!(read.load(Ordering::SeqCst), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_read_out_of_time_forsakes_its_body_and_one_on_time_gives_its_output() {
        let (tx, body, _) = fed();
        let mut rest = Rest::new(body, false);
        let late = within(Duration::from_secs(1), async move {
            rest.frame().await.is_some()
        });
        assert_eq!(late.await, None);
        settle().await;
        assert!(tx.is_closed(), "dropped at once, not discarded");

        let (tx, body, _) = fed();
        feed(&tx, b"a").await;
        let mut rest = Rest::new(body, false);
        let on_time = within(Duration::from_secs(1), async move {
            rest.frame().await.is_some()
        });
        assert_eq!(on_time.await, Some(true));
    }

    #[tokio::test(start_paused = true)]
    async fn discarding_stops_after_silence_and_after_its_time() {
        // Silence: nothing for SILENCE ends it, and the body is dropped.
        let (tx, body, _) = fed();
        drop(Rest::new(body, false));
        settle().await;
        tokio::time::advance(SILENCE + Duration::from_millis(1)).await;
        settle().await;
        assert!(tx.is_closed(), "dropped after {SILENCE:?} of silence");

        // A client that keeps sending is cut off after AT_MOST.
        let (tx, body, read) = fed();
        drop(Rest::new(body, false));
        let start = Instant::now();
        while !tx.is_closed() {
            let _ = tx.send(Ok(Frame::data(Bytes::from_static(b"x")))).await;
            tokio::time::advance(Duration::from_secs(1)).await;
            settle().await;
            assert!(start.elapsed() <= AT_MOST + Duration::from_secs(1));
        }
        assert!(start.elapsed() >= AT_MOST, "{:?}", start.elapsed());
        assert!(read.load(Ordering::SeqCst) >= 29);
    }

    #[tokio::test]
    async fn frames_and_size_pass_unchanged() {
        let body = http_body_util::Full::new(Bytes::from_static(b"whole"));
        let rest = Rest::new(body, false);
        assert_eq!(rest.size_hint().exact(), Some(5));
        let got = rest.collect().await.unwrap().to_bytes();
        assert_eq!(&got[..], b"whole");
    }
}
