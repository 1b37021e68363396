//! Response body plumbing for the pipeline (the request bodies are `outbound`'s and
//! `replay`'s): peeking at a response body for classification without losing a byte, and
//! the response body that carries its concurrency permit and its upstream connection's
//! lease, reads what a priced request really cost as it passes, and enforces the idle
//! timeout between chunks.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body::{Body as HttpBody, Frame, SizeHint};
use http_body_util::BodyExt;
use tokio::time::{Instant, Sleep};

use crate::body::{Body, BoxError};
use crate::limit::{Correction, Permit};
use crate::price::usage::{Meter, Throttle};
use prometheus::IntCounter;

/// Reads up to `limit` bytes of `body` for a look at it, and returns them with a body
/// that still yields every frame, those already read first.
pub(crate) async fn peek(mut body: Body, limit: usize) -> Result<(Bytes, Body), BoxError> {
    let mut seen: VecDeque<Frame<Bytes>> = VecDeque::new();
    let mut prefix = BytesMut::new();
    let mut ended = false;
    while prefix.len() < limit {
        match body.frame().await {
            None => {
                ended = true;
                break;
            }
            Some(Err(e)) => return Err(e),
            Some(Ok(frame)) => {
                if let Some(d) = frame.data_ref() {
                    prefix.extend_from_slice(&d[..d.len().min(limit - prefix.len())]);
                }
                seen.push_back(frame);
            }
        }
    }
    let rest = if ended { None } else { Some(body) };
    Ok((prefix.freeze(), Prefixed::body(seen, rest)))
}

/// Frames already read, then the rest of the original body.
struct Prefixed {
    frames: VecDeque<Frame<Bytes>>,
    rest: Option<Body>,
}

impl Prefixed {
    fn body(frames: VecDeque<Frame<Bytes>>, rest: Option<Body>) -> Body {
        Prefixed { frames, rest }.boxed_unsync()
    }
}

impl HttpBody for Prefixed {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let Some(f) = self.frames.pop_front() {
            return Poll::Ready(Some(Ok(f)));
        }
        match self.rest.as_mut() {
            Some(rest) => Pin::new(rest).poll_frame(cx),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.frames.is_empty() && self.rest.as_ref().is_none_or(|r| r.is_end_stream())
    }
}

#[derive(Debug, thiserror::Error)]
#[error("the upstream body stalled for longer than attempt_timeout ({0:?})")]
pub(crate) struct BodyStalled(Duration);

/// An upstream response body on its way to the client. It holds the request's
/// concurrency permit until the last frame (or until it is dropped), and fails the body
/// if the upstream sends nothing for `idle`. (A plain-HTTP upstream's body gives its
/// connection back itself, see `h1::conn`.)
/// Generic over the upstream's body so that it is boxed once, here, not twice.
pub(crate) struct ResponseBody<B> {
    inner: B,
    permit: Option<Permit>,
    idle: Duration,
    /// Armed the first time the upstream makes us wait, so a body that arrives with its
    /// headers (most API responses) never touches the timer wheel.
    timer: Option<Pin<Box<Sleep>>>,
    /// Reads what the request really cost as the body passes, for a priced family.
    metered: Option<Box<Metered>>,
}

/// A response body's reader of the request's actual cost, and what it corrects: when
/// dropped (the body ended, failed or was abandoned) the limits the request paid are
/// corrected by what the body reported, if anything.
pub(crate) struct Metered {
    pub(crate) meter: Meter,
    pub(crate) correction: Correction,
    /// `sluice_cost_total{stage="actual"}` by unit index.
    pub(crate) counters: Vec<(u8, IntCounter)>,
    /// The unit index of `points`, when Shopify's `throttleStatus` paces it (`learn`).
    pub(crate) points: Option<u8>,
}

impl Drop for Metered {
    fn drop(&mut self) {
        let actual = self.meter.finish();
        if let (Some(unit), Some(t)) = (self.points, self.meter.throttle()) {
            self.correction.learn_in(shopify(t), unit);
        }
        if actual.is_empty() {
            return;
        }
        for (index, n) in &actual {
            if let Some((_, c)) = self.counters.iter().find(|(i, _)| i == index) {
                c.inc_by(*n);
            }
        }
        self.correction.correct(&actual);
    }
}

/// Shopify's bucket as a budget: what it holds now plus what it restores in the next
/// second, for the next second; the next response says again.
fn shopify(t: Throttle) -> crate::policy::announced::Announced {
    crate::policy::announced::Announced {
        remaining: t
            .available
            .saturating_add(t.restore)
            .min(t.maximum.max(t.available)),
        reset: Duration::from_secs(1),
        source: "extensions.cost.throttleStatus",
        unit: "points",
    }
}

impl<B> ResponseBody<B>
where
    B: HttpBody<Data = Bytes> + Unpin + Send + 'static,
    B::Error: Into<BoxError>,
{
    pub(crate) fn wrap(
        inner: B,
        permit: Option<Permit>,
        idle: Duration,
        metered: Option<Box<Metered>>,
    ) -> Body {
        let permit = permit.filter(Permit::holds_concurrency);
        ResponseBody {
            inner,
            permit,
            idle,
            timer: None,
            metered,
        }
        .boxed_unsync()
    }

    /// The whole body went through: the permit is free, and the cost it reported counts.
    fn finished(&mut self) {
        self.permit = None;
        self.metered = None;
    }
}

impl<B> HttpBody for ResponseBody<B>
where
    B: HttpBody<Data = Bytes> + Unpin + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let (Some(m), Some(data)) = (this.metered.as_mut(), frame.data_ref()) {
                    m.meter.feed(data);
                }
                if let Some(t) = this.timer.as_mut() {
                    t.as_mut().reset(Instant::now() + this.idle);
                }
                // hyper stops polling a body that says it has ended, so this may be the
                // last look we get.
                if this.inner.is_end_stream() {
                    this.finished();
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(None) => {
                this.finished();
                Poll::Ready(None)
            }
            Poll::Ready(Some(Err(e))) => {
                this.permit = None;
                Poll::Ready(Some(Err(e.into())))
            }
            Poll::Pending => {
                let idle = this.idle;
                let timer = this
                    .timer
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(idle)));
                if timer.as_mut().poll(cx).is_ready() {
                    this.permit = None;
                    return Poll::Ready(Some(Err(Box::new(BodyStalled(this.idle)))));
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::body::stream;

    fn chunks(parts: &[&'static str]) -> Body {
        let frames: Vec<Result<Frame<Bytes>, BoxError>> = parts
            .iter()
            .map(|p| Ok(Frame::data(Bytes::from_static(p.as_bytes()))))
            .collect();
        stream(http_body_util::StreamBody::new(futures_util::stream::iter(
            frames,
        )))
    }

    #[tokio::test]
    async fn peek_reads_a_prefix_and_loses_nothing() {
        let (prefix, body) = peek(chunks(&["hello ", "wide ", "world"]), 8)
            .await
            .unwrap();
        assert_eq!(prefix.as_ref(), b"hello wi");
        assert_eq!(
            body.collect().await.unwrap().to_bytes().as_ref(),
            b"hello wide world"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_stalled_body_fails_after_the_idle_time() {
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, BoxError>>(1);
        let s =
            futures_util::stream::unfold(
                rx,
                |mut rx| async move { rx.recv().await.map(|f| (f, rx)) },
            );
        let mut body = ResponseBody::wrap(
            stream(http_body_util::StreamBody::new(s)),
            None,
            Duration::from_secs(2),
            None,
        );
        tx.send(Ok(Frame::data(Bytes::from_static(b"x"))))
            .await
            .unwrap();
        assert!(body.frame().await.unwrap().is_ok());
        let t0 = Instant::now();
        let err = body.frame().await.unwrap().unwrap_err();
        assert!(err.to_string().contains("stalled"));
        assert_eq!(Instant::now() - t0, Duration::from_secs(2));
    }
}
