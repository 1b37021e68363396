//! A request body that can be sent more than once without being read before it is
//! needed. Nothing is read from the client until an attempt's connection asks for it
//! (after admission); while the first attempt streams the body, a copy of what went by is
//! kept, within `max_replay_body` for the request and `max_replay_memory` for the whole
//! process, so a retry can send it again and carry on from the client where the copy
//! ends. Beyond either bound the copy is dropped and the request simply is not retried.
//!
//! It also tells the client's failures from the upstream's: a body the client breaks
//! (malformed chunk, disconnect) or is too slow to send is the client's fault, never the
//! upstream's, whatever error the upstream connection then reports.

use parking_lot::{Mutex, MutexGuard};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body as HttpBody, Frame, SizeHint};
use http_body_util::BodyExt;

use crate::body::{Body, BoxError, empty};

/// Bytes held for replay across the process, against `proxy.max_replay_memory`.
#[derive(Debug, Default)]
pub(crate) struct ReplayBudget {
    used: AtomicU64,
    limit: AtomicU64,
}

impl ReplayBudget {
    pub(crate) fn new(limit: u64) -> ReplayBudget {
        ReplayBudget {
            used: AtomicU64::new(0),
            limit: AtomicU64::new(limit),
        }
    }

    pub(crate) fn set_limit(&self, limit: u64) {
        self.limit.store(limit, Ordering::Relaxed);
    }

    pub(crate) fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    fn take(&self, n: u64) -> bool {
        let limit = self.limit.load(Ordering::Relaxed);
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(n).filter(|total| *total <= limit)
            })
            .is_ok()
    }

    fn give_back(&self, n: u64) {
        let _ = self
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                Some(used.saturating_sub(n))
            });
    }
}

/// Bytes of the replay budget held by something other than a replay (a body read to
/// price its request), given back when dropped.
pub(crate) struct BudgetHold {
    budget: Arc<ReplayBudget>,
    bytes: u64,
}

impl ReplayBudget {
    /// Holds `bytes` of the budget, if that much is left.
    pub(crate) fn hold(self: &Arc<Self>, bytes: u64) -> Option<BudgetHold> {
        self.take(bytes).then(|| BudgetHold {
            budget: self.clone(),
            bytes,
        })
    }
}

impl Drop for BudgetHold {
    fn drop(&mut self) {
        self.budget.give_back(self.bytes);
    }
}

/// A body that holds part of the replay budget until it has been read or dropped.
pub(crate) struct HeldBody {
    pub(crate) body: crate::body::Body,
    pub(crate) hold: Option<BudgetHold>,
}

impl http_body::Body for HeldBody {
    type Data = bytes::Bytes;
    type Error = crate::body::BoxError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<bytes::Bytes>, Self::Error>>> {
        let polled = std::pin::Pin::new(&mut self.body).poll_frame(cx);
        if matches!(polled, std::task::Poll::Ready(None)) {
            self.hold = None;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// How the client's side of a request failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ClientFault {
    /// The body could not be read: malformed framing, or the client left mid-upload.
    Broken(String),
}

#[derive(Debug, thiserror::Error)]
#[error("the client's request body failed: {0}")]
pub(crate) struct ClientBodyError(pub String);

/// The request body as the retry loop holds it.
pub(crate) enum Replay {
    /// No body: every attempt gets an empty one, with nothing shared.
    Empty,
    Shared(Arc<Mutex<State>>),
}

pub(crate) struct State {
    /// The client's body, until it ends or fails.
    source: Option<Body>,
    /// What was read, while a copy is still kept.
    chunks: Vec<Bytes>,
    /// Data frames read from the client so far (kept or not).
    read: usize,
    trailers: Option<HeaderMap>,
    ended: bool,
    /// Whether a copy is (still) kept for replay.
    keep: bool,
    kept: u64,
    limit: u64,
    budget: Arc<ReplayBudget>,
    fault: Option<ClientFault>,
    /// The last look at the client's body found it had nothing yet.
    waiting_on_client: bool,
    /// The client's body's own size hint, for every attempt.
    size: SizeHint,
}

impl Drop for State {
    fn drop(&mut self) {
        self.budget.give_back(self.kept);
    }
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock()
}

impl Replay {
    /// `keep`: whether a copy is kept so that the request may be sent again.
    pub(crate) fn new(body: Body, keep: bool, limit: u64, budget: &Arc<ReplayBudget>) -> Replay {
        if body.is_end_stream() {
            return Replay::Empty;
        }
        let size = body.size_hint();
        // A body announced as larger than the copy may be is not kept at all.
        let keep = keep && size.lower() <= limit;
        Replay::Shared(Arc::new(Mutex::new(State {
            source: Some(body),
            chunks: Vec::new(),
            read: 0,
            trailers: None,
            ended: false,
            keep,
            kept: 0,
            limit,
            budget: budget.clone(),
            fault: None,
            waiting_on_client: false,
            size,
        })))
    }

    /// The body for the next attempt: what was kept, then the rest from the client.
    pub(crate) fn for_attempt(&self) -> Body {
        match self {
            Replay::Empty => empty(),
            Replay::Shared(s) => Attempt {
                shared: s.clone(),
                pos: 0,
                sent: 0,
                trailers_sent: false,
            }
            .boxed_unsync(),
        }
    }

    /// Whether another attempt can send the whole body again.
    pub(crate) fn replayable(&self) -> bool {
        match self {
            Replay::Empty => true,
            Replay::Shared(s) => {
                let st = lock(s);
                st.keep && st.fault.is_none()
            }
        }
    }

    /// The client broke its body.
    pub(crate) fn fault(&self) -> Option<ClientFault> {
        match self {
            Replay::Empty => None,
            Replay::Shared(s) => lock(s).fault.clone(),
        }
    }

    /// Gives up on the client's body, which has stalled: what an attempt still reads of
    /// it is an error, so no upstream takes a cut-off body for a whole one, and the body is
    /// handed back to be dropped.
    pub(crate) fn forsake(&self) -> Option<Body> {
        match self {
            Replay::Empty => None,
            Replay::Shared(s) => {
                let mut st = lock(s);
                st.fault.get_or_insert_with(|| {
                    ClientFault::Broken("the client stopped sending".into())
                });
                st.source.take()
            }
        }
    }

    /// The body is not complete and the last look found the client had not sent more: a
    /// timeout now is the client's.
    pub(crate) fn waiting_on_client(&self) -> bool {
        match self {
            Replay::Empty => false,
            Replay::Shared(s) => {
                let st = lock(s);
                st.waiting_on_client && !st.ended && st.fault.is_none()
            }
        }
    }
}

impl State {
    /// Keeps a copy of `data` if both bounds allow, else stops keeping for good.
    fn keep(&mut self, data: &Bytes) {
        if !self.keep {
            return;
        }
        let n = data.len() as u64;
        if self.kept + n <= self.limit && self.budget.take(n) {
            self.kept += n;
            self.chunks.push(data.clone());
        } else {
            self.keep = false;
            self.budget.give_back(self.kept);
            self.kept = 0;
            self.chunks = Vec::new();
        }
    }
}

/// One attempt's view of the body.
struct Attempt {
    shared: Arc<Mutex<State>>,
    /// Data frames this attempt has sent.
    pos: usize,
    /// Bytes this attempt has sent, for its size hint.
    sent: u64,
    trailers_sent: bool,
}

impl HttpBody for Attempt {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        let mut st = lock(&this.shared);
        if this.pos < st.read {
            // Behind the client: from the copy, if it is still there (an earlier attempt
            // still being written after a later one dropped the copy cannot go on).
            let Some(chunk) = st.chunks.get(this.pos).filter(|_| st.keep).cloned() else {
                return Poll::Ready(Some(Err("the replay copy of the body is gone".into())));
            };
            this.pos += 1;
            this.sent += chunk.len() as u64;
            return Poll::Ready(Some(Ok(Frame::data(chunk))));
        }
        if let Some(ClientFault::Broken(why)) = &st.fault {
            return Poll::Ready(Some(Err(Box::new(ClientBodyError(why.clone())))));
        }
        if st.ended {
            if let Some(t) = st.trailers.as_ref().filter(|_| !this.trailers_sent) {
                this.trailers_sent = true;
                return Poll::Ready(Some(Ok(Frame::trailers(t.clone()))));
            }
            return Poll::Ready(None);
        }
        let Some(source) = st.source.as_mut() else {
            return Poll::Ready(None);
        };
        match std::pin::Pin::new(source).poll_frame(cx) {
            Poll::Pending => {
                st.waiting_on_client = true;
                Poll::Pending
            }
            Poll::Ready(None) => {
                st.waiting_on_client = false;
                st.ended = true;
                st.source = None;
                Poll::Ready(None)
            }
            Poll::Ready(Some(Err(e))) => {
                let why = e.to_string();
                st.waiting_on_client = false;
                st.fault = Some(ClientFault::Broken(why.clone()));
                st.source = None;
                Poll::Ready(Some(Err(Box::new(ClientBodyError(why)))))
            }
            Poll::Ready(Some(Ok(frame))) => {
                st.waiting_on_client = false;
                match frame.into_data() {
                    Ok(data) => {
                        st.keep(&data);
                        st.read += 1;
                        this.pos += 1;
                        this.sent += data.len() as u64;
                        Poll::Ready(Some(Ok(Frame::data(data))))
                    }
                    Err(frame) => {
                        // Trailers end the body.
                        if let Some(t) = frame.trailers_ref() {
                            st.trailers = Some(t.clone());
                            this.trailers_sent = true;
                        }
                        st.ended = true;
                        st.source = None;
                        Poll::Ready(Some(Ok(frame)))
                    }
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        let st = lock(&self.shared);
        st.ended
            && self.pos >= st.read
            && (st.trailers.is_none() || self.trailers_sent)
            && st.fault.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        let st = lock(&self.shared);
        match st.size.exact() {
            Some(n) => SizeHint::with_exact(n.saturating_sub(self.sent)),
            None => SizeHint::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::body::stream;

    type Sender = tokio::sync::mpsc::Sender<Result<Frame<Bytes>, BoxError>>;

    /// A client body fed by the test, one frame at a time.
    fn client() -> (Sender, Body) {
        let (tx, rx) = tokio::sync::mpsc::channel(8);
        let s =
            futures_util::stream::unfold(
                rx,
                |mut rx| async move { rx.recv().await.map(|f| (f, rx)) },
            );
        (tx, stream(http_body_util::StreamBody::new(s)))
    }

    fn data(s: &'static str) -> Result<Frame<Bytes>, BoxError> {
        Ok(Frame::data(Bytes::from_static(s.as_bytes())))
    }

    async fn all(body: Body) -> Result<Bytes, BoxError> {
        Ok(body.collect().await?.to_bytes())
    }

    #[tokio::test]
    async fn nothing_is_read_before_an_attempt_asks() {
        let budget = Arc::new(ReplayBudget::new(1 << 20));
        let (tx, body) = client();
        let replay = Replay::new(body, true, 1024, &budget);
        tx.send(data("ab")).await.unwrap();
        tokio::task::yield_now().await;
        assert_eq!(budget.used(), 0, "read nothing yet");
        let mut first = replay.for_attempt();
        let f = first.frame().await.unwrap().unwrap();
        assert_eq!(f.into_data().unwrap().as_ref(), b"ab");
        assert_eq!(
            budget.used(),
            2,
            "the copy is kept while the attempt streams"
        );
        assert!(!replay.waiting_on_client());
    }

    #[tokio::test]
    async fn a_retry_replays_the_copy_then_continues_from_the_client() {
        let budget = Arc::new(ReplayBudget::new(1 << 20));
        let (tx, body) = client();
        let replay = Replay::new(body, true, 1024, &budget);
        tx.send(data("ab")).await.unwrap();
        let mut first = replay.for_attempt();
        first.frame().await.unwrap().unwrap();
        drop(first); // the attempt failed after sending part of the body
        assert!(replay.replayable());
        tx.send(data("cd")).await.unwrap();
        drop(tx);
        assert_eq!(all(replay.for_attempt()).await.unwrap().as_ref(), b"abcd");
        assert_eq!(all(replay.for_attempt()).await.unwrap().as_ref(), b"abcd");
        drop(replay);
        assert_eq!(budget.used(), 0, "the copy's bytes go back");
    }

    #[tokio::test]
    async fn beyond_either_bound_the_body_streams_once() {
        let budget = Arc::new(ReplayBudget::new(1 << 20));
        let (tx, body) = client();
        let replay = Replay::new(body, true, 3, &budget);
        for s in ["ab", "cd", "e"] {
            tx.send(data(s)).await.unwrap();
        }
        drop(tx);
        assert_eq!(all(replay.for_attempt()).await.unwrap().as_ref(), b"abcde");
        assert!(!replay.replayable());
        assert_eq!(budget.used(), 0);

        let small = Arc::new(ReplayBudget::new(3));
        let (tx, body) = client();
        let a = Replay::new(body, true, 1024, &small);
        tx.send(data("ab")).await.unwrap();
        drop(tx);
        assert_eq!(all(a.for_attempt()).await.unwrap().as_ref(), b"ab");
        assert!(a.replayable());
        let (tx, body) = client();
        let b = Replay::new(body, true, 1024, &small);
        tx.send(data("cd")).await.unwrap();
        drop(tx);
        assert_eq!(all(b.for_attempt()).await.unwrap().as_ref(), b"cd");
        assert!(
            !b.replayable(),
            "the process-wide budget is spent by the first"
        );
        drop(a);
        assert_eq!(small.used(), 0);
    }

    #[tokio::test]
    async fn a_broken_client_body_is_the_clients_fault() {
        let budget = Arc::new(ReplayBudget::new(1 << 20));
        let (tx, body) = client();
        let replay = Replay::new(body, true, 1024, &budget);
        tx.send(data("ab")).await.unwrap();
        tx.send(Err("invalid chunk size".into())).await.unwrap();
        let err = all(replay.for_attempt()).await.unwrap_err();
        assert!(err.to_string().contains("invalid chunk size"), "{err}");
        assert!(matches!(replay.fault(), Some(ClientFault::Broken(_))));
        assert!(!replay.replayable());
    }

    #[tokio::test]
    async fn a_slow_client_is_seen_waiting() {
        let budget = Arc::new(ReplayBudget::new(1 << 20));
        let (tx, body) = client();
        let replay = Replay::new(body, false, 1024, &budget);
        let mut attempt = replay.for_attempt();
        let pending =
            tokio::time::timeout(std::time::Duration::from_millis(10), attempt.frame()).await;
        assert!(pending.is_err());
        assert!(replay.waiting_on_client());
        tx.send(data("x")).await.unwrap();
        attempt.frame().await.unwrap().unwrap();
        assert!(!replay.waiting_on_client());
    }

    #[test]
    fn an_empty_body_shares_nothing() {
        let budget = Arc::new(ReplayBudget::new(0));
        let replay = Replay::new(empty(), true, 0, &budget);
        assert!(matches!(replay, Replay::Empty));
        assert!(replay.for_attempt().is_end_stream());
    }
}
