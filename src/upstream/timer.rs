//! Per-connection timers for deadlines that recur with every request: one tokio timer per
//! connection instead of one per request.
//!
//! hyper asks for a new timer each time it starts reading a request head (the header read
//! timeout, which is also what closes a keep-alive connection left idle), and each upstream
//! attempt has its timeout. With tokio's timer each is a timer-wheel insertion and removal
//! for every request, a measurable share of a proxied request's instructions
//! (3.4% when measured; the git history of docs/BENCHMARKS.md). Here a connection keeps one tokio timer per purpose, armed no later
//! than the earliest deadline still wanted. Successive deadlines only move later, so the
//! wheel is touched about once per timeout period: when the timer fires early for a
//! deadline that has since moved, it is set again.

use parking_lot::{Mutex, MutexGuard};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tokio::time::{Instant, Sleep};

/// Serves one deadline at a time (hyper's HTTP/1 server only asks for the header read, and
/// a connection's requests take turns); a second deadline polled concurrently would take
/// over the wake-up.
///
/// Invariants:
/// - At most one deadline waits at a time: the one whose waker `sleep` holds. Debug builds
///   check it (`waiting`), so a caller that ever breaks it fails the tests instead of
///   losing a wake-up in production.
/// - `sleep` is armed no later than the deadline that waits: it wakes that deadline on
///   time, or early, and an early wake-up re-arms it.
#[derive(Clone)]
pub(crate) struct ConnTimer {
    shared: Arc<Mutex<Shared>>,
}

struct Shared {
    sleep: Pin<Box<Sleep>>,
    /// What `sleep` is set to; `None` until the first deadline.
    armed: Option<Instant>,
    /// The waker `sleep` will wake, so that polling again with the same one (a connection
    /// task is polled several times per request) skips tokio's registration.
    waker: Option<Waker>,
    /// The deadline waiting now, by number (see the invariants); the next number to give.
    #[cfg(debug_assertions)]
    waiting: Option<u64>,
    #[cfg(debug_assertions)]
    next_id: u64,
}

fn lock(m: &Mutex<Shared>) -> MutexGuard<'_, Shared> {
    m.lock()
}

impl ConnTimer {
    /// Needs a tokio runtime (it creates an unarmed tokio timer).
    pub(crate) fn new() -> ConnTimer {
        // A far deadline that is never polled: registering happens at the first reset.
        let idle = Box::pin(tokio::time::sleep(Duration::from_secs(86_400 * 365)));
        ConnTimer {
            shared: Arc::new(Mutex::new(Shared {
                sleep: idle,
                armed: None,
                waker: None,
                #[cfg(debug_assertions)]
                waiting: None,
                #[cfg(debug_assertions)]
                next_id: 0,
            })),
        }
    }

    /// Completes at `at`.
    pub(crate) fn at(&self, at: Instant) -> Deadline {
        #[cfg(debug_assertions)]
        let id = {
            let mut sh = lock(&self.shared);
            sh.next_id += 1;
            sh.next_id
        };
        Deadline {
            shared: self.shared.clone(),
            at,
            #[cfg(debug_assertions)]
            id,
        }
    }
}

// hyper's `Timer` speaks `std::time::Instant`; everything here converts to tokio's at once
// so that paused time in tests applies.
#[allow(
    clippy::disallowed_types,
    reason = "hyper's Timer speaks std::time::Instant (see above)"
)]
impl hyper::rt::Timer for ConnTimer {
    fn sleep(&self, duration: Duration) -> Pin<Box<dyn hyper::rt::Sleep>> {
        Box::pin(self.at(crate::clock::now() + duration))
    }

    fn sleep_until(&self, deadline: std::time::Instant) -> Pin<Box<dyn hyper::rt::Sleep>> {
        Box::pin(self.at(Instant::from_std(deadline)))
    }

    fn now(&self) -> std::time::Instant {
        crate::clock::now().into_std()
    }
}

/// One deadline, served by the connection's timer.
pub(crate) struct Deadline {
    shared: Arc<Mutex<Shared>>,
    at: Instant,
    #[cfg(debug_assertions)]
    id: u64,
}

impl Deadline {
    /// This deadline now waits on the shared timer: no other may be waiting.
    #[cfg(debug_assertions)]
    fn waits(&self, sh: &mut Shared) {
        debug_assert!(
            sh.waiting.is_none_or(|w| w == self.id),
            "two deadlines of one ConnTimer wait at once; the first would never be woken"
        );
        sh.waiting = Some(self.id);
    }

    /// This deadline no longer waits (it completed, or it was dropped).
    #[cfg(debug_assertions)]
    fn done(&self, sh: &mut Shared) {
        if sh.waiting == Some(self.id) {
            sh.waiting = None;
        }
    }
}

#[cfg(debug_assertions)]
impl Drop for Deadline {
    fn drop(&mut self) {
        let mut sh = lock(&self.shared);
        self.done(&mut sh);
    }
}

impl hyper::rt::Sleep for Deadline {}

impl Future for Deadline {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let at = self.at;
        let sh = &mut *lock(&self.shared);
        let poll = self.poll_shared(sh, at, cx);
        #[cfg(debug_assertions)]
        match poll {
            Poll::Pending => self.waits(sh),
            Poll::Ready(()) => self.done(sh),
        }
        poll
    }
}

impl Deadline {
    fn poll_shared(&self, sh: &mut Shared, at: Instant, cx: &mut Context<'_>) -> Poll<()> {
        // Set no later than `at` and not fired yet: it will wake us, no need for the clock.
        if sh.armed.is_some_and(|armed| armed <= at) {
            if !sh.sleep.is_elapsed() && sh.waker.as_ref().is_some_and(|w| w.will_wake(cx.waker()))
            {
                return Poll::Pending;
            }
            if sh.sleep.as_mut().poll(cx).is_pending() {
                sh.waker = Some(cx.waker().clone());
                return Poll::Pending;
            }
        }
        // Fired (perhaps for an earlier deadline that has since moved), set for later than
        // `at`, or never set.
        if Instant::now() >= at {
            return Poll::Ready(());
        }
        sh.sleep.as_mut().reset(at);
        sh.armed = Some(at);
        if sh.sleep.as_mut().poll(cx).is_ready() {
            // Fired between the clock read above and here: go round once more.
            cx.waker().wake_by_ref();
        } else {
            sh.waker = Some(cx.waker().clone());
        }
        Poll::Pending
    }
}

/// One tokio timer for the deadlines of many requests at once: the attempt and total
/// deadlines of the requests inside one intercepted tunnel, the streams of an HTTP/2
/// connection among them, which run side by side where [`ConnTimer`] serves one at a
/// time. A tokio timer per deadline would be a wheel insertion and removal per request,
/// and on a worker whose wheel is empty each new earliest deadline also has tokio write
/// to the event loop's eventfd, to wake the thread that is running it.
///
/// Invariants, under the lock:
/// - `sleep` is armed no later than every waiting deadline, unless it has fired: then
///   the first waiter to see it so wakes all the others to look again.
/// - `holder` names the waiting deadline whose waker `sleep` holds, whenever one waits
///   and `sleep` has not fired; a holder that stops waiting hands `sleep` to another.
pub(crate) struct Timers {
    shared: Mutex<Many>,
}

struct Many {
    sleep: Pin<Box<Sleep>>,
    /// What `sleep` is set to; `None` until the first deadline, and once it has fired.
    armed: Option<Instant>,
    /// The waiting deadlines' wakers, by slot; `None` is a free slot.
    waiting: Vec<Option<Waker>>,
    free: Vec<usize>,
    /// The slot whose waker `sleep` holds.
    holder: Option<usize>,
}

impl Timers {
    /// Needs a tokio runtime (it creates an unarmed tokio timer).
    pub(crate) fn new() -> Timers {
        Timers {
            shared: Mutex::new(Many {
                sleep: Box::pin(tokio::time::sleep(Duration::from_secs(86_400 * 365))),
                armed: None,
                waiting: Vec::new(),
                free: Vec::new(),
                holder: None,
            }),
        }
    }

    /// Completes at `at`.
    pub(crate) fn at(&self, at: Instant) -> Due<'_> {
        Due {
            timers: self,
            at,
            slot: None,
        }
    }
}

impl Many {
    /// Keeps `waker` in `slot` (taking a slot for a deadline that had none); whether the
    /// slot held another waker before.
    fn keep(&mut self, slot: &mut Option<usize>, waker: &Waker) -> bool {
        match *slot {
            Some(i) => match &mut self.waiting[i] {
                Some(w) if w.will_wake(waker) => false,
                w => {
                    *w = Some(waker.clone());
                    true
                }
            },
            None => {
                let i = match self.free.pop() {
                    Some(i) => {
                        self.waiting[i] = Some(waker.clone());
                        i
                    }
                    None => {
                        self.waiting.push(Some(waker.clone()));
                        self.waiting.len() - 1
                    }
                };
                *slot = Some(i);
                true
            }
        }
    }

    /// `slot`'s deadline no longer waits; if `sleep` held its waker, another waiter's
    /// takes its place.
    fn leave(&mut self, slot: usize) {
        self.waiting[slot] = None;
        self.free.push(slot);
        if self.holder != Some(slot) {
            return;
        }
        self.holder = None;
        let Some((next, waker)) = self
            .waiting
            .iter()
            .enumerate()
            .find_map(|(i, w)| w.as_ref().map(|w| (i, w)))
        else {
            return;
        };
        let mut cx = Context::from_waker(waker);
        if self.sleep.as_mut().poll(&mut cx).is_ready() {
            // Fired: that waiter sees it and wakes the rest.
            waker.wake_by_ref();
        } else {
            self.holder = Some(next);
        }
    }
}

/// A deadline on [`Timers`].
pub(crate) struct Due<'a> {
    timers: &'a Timers,
    at: Instant,
    /// Where its waker is kept while it waits.
    slot: Option<usize>,
}

impl Future for Due<'_> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        let mut guard = this.timers.shared.lock();
        let m = &mut *guard;
        // Set no later than `at` and not fired: it will wake us, or whoever holds it will.
        if m.armed.is_some_and(|armed| armed <= this.at) && !m.sleep.is_elapsed() {
            let changed = m.keep(&mut this.slot, cx.waker());
            if m.holder.is_some() && (m.holder != this.slot || !changed) {
                return Poll::Pending;
            }
            if m.sleep.as_mut().poll(cx).is_pending() {
                m.holder = this.slot;
                return Poll::Pending;
            }
        }
        if m.armed.is_some() && m.sleep.is_elapsed() {
            // It fired for someone: everyone waiting looks again, and the earliest
            // still to come sets it again.
            m.armed = None;
            m.holder = None;
            for (i, w) in m.waiting.iter().enumerate() {
                if let Some(w) = w
                    && Some(i) != this.slot
                {
                    w.wake_by_ref();
                }
            }
        }
        if Instant::now() >= this.at {
            if let Some(slot) = this.slot.take() {
                m.leave(slot);
            }
            return Poll::Ready(());
        }
        // Not set, set for later than `at`, or fired.
        m.sleep.as_mut().reset(this.at);
        m.armed = Some(this.at);
        m.keep(&mut this.slot, cx.waker());
        m.holder = this.slot;
        if m.sleep.as_mut().poll(cx).is_ready() {
            // Fired between the clock read above and here: go round once more.
            cx.waker().wake_by_ref();
        }
        Poll::Pending
    }
}

impl Drop for Due<'_> {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            self.timers.shared.lock().leave(slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper::rt::Timer;

    /// The one-deadline rule is checked: a second deadline waiting while the first still
    /// waits would leave the first without a wake-up, and debug builds say so at once.
    #[cfg(debug_assertions)]
    #[tokio::test(start_paused = true)]
    #[should_panic(expected = "two deadlines of one ConnTimer wait at once")]
    async fn two_waiting_deadlines_break_the_rule_loudly() {
        let timer = ConnTimer::new();
        let mut a = Box::pin(timer.sleep(Duration::from_secs(10)));
        let mut b = Box::pin(timer.sleep(Duration::from_secs(20)));
        assert!(futures_util::poll!(&mut a).is_pending());
        let _ = futures_util::poll!(&mut b);
    }

    /// A deadline that completed or was dropped no longer waits: the next may.
    #[tokio::test(start_paused = true)]
    async fn deadlines_take_turns() {
        let timer = ConnTimer::new();
        let mut a = Box::pin(timer.sleep(Duration::from_secs(10)));
        assert!(futures_util::poll!(&mut a).is_pending());
        drop(a);
        let b = timer.sleep(Duration::from_secs(5));
        b.await;
        let c = timer.sleep(Duration::from_secs(5));
        c.await;
    }

    #[tokio::test(start_paused = true)]
    async fn deadlines_fire_on_time_with_one_timer_moved_forward() {
        let timer = ConnTimer::new();
        let t0 = Instant::now();
        let first = timer.sleep(Duration::from_secs(30));
        // A later deadline asked for before the first one fires, as for the next request.
        tokio::time::sleep(Duration::from_secs(10)).await;
        drop(first);
        let second = timer.sleep(Duration::from_secs(30));
        second.await;
        assert_eq!(Instant::now() - t0, Duration::from_secs(40));

        // An earlier deadline than the one armed moves the timer back.
        let late = timer.sleep(Duration::from_secs(60));
        let early = timer.sleep(Duration::from_secs(5));
        let t1 = Instant::now();
        early.await;
        assert_eq!(Instant::now() - t1, Duration::from_secs(5));
        late.await;
        assert_eq!(Instant::now() - t1, Duration::from_secs(60));
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// The deadline whose waker the shared timer holds goes away (its request was
    /// answered): the other, later one still completes on time.
    #[tokio::test(start_paused = true)]
    async fn a_deadline_outlives_the_one_that_armed_the_timer() {
        let timers = Timers::new();
        let t0 = Instant::now();
        let mut first = Box::pin(timers.at(t0 + ms(100)));
        let mut second = Box::pin(timers.at(t0 + ms(300)));
        assert!(futures_util::poll!(&mut first).is_pending());
        assert!(futures_util::poll!(&mut second).is_pending());
        drop(first);
        // Under paused time a lost wake-up would end only here.
        tokio::time::timeout(ms(60_000), second)
            .await
            .expect("completes");
        assert_eq!(Instant::now() - t0, ms(300));
    }

    proptest::proptest! {
        /// Deadlines waiting side by side on one `Timers`, each polled with a waker of
        /// its own as an HTTP/2 connection's streams are, some dropped before they are
        /// due as answered requests' are: each one kept completes at its own instant,
        /// and none dropped completes before it is dropped.
        #[test]
        fn side_by_side_deadlines_complete_on_time(
            plan in proptest::collection::vec(
                (0u64..2_000, 1u64..5_000, proptest::option::of(0u64..5_000)),
                1..24,
            )
        ) {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .start_paused(true)
                .build()
                .unwrap();
            rt.block_on(async {
                use futures_util::StreamExt;
                let timers = Timers::new();
                let t0 = Instant::now();
                let mut waiting = futures_util::stream::FuturesUnordered::new();
                for (i, &(start, len, drop_after)) in plan.iter().enumerate() {
                    let timers = &timers;
                    waiting.push(async move {
                        tokio::time::sleep_until(t0 + ms(start)).await;
                        let at = Instant::now() + ms(len);
                        let due = timers.at(at);
                        match drop_after {
                            Some(after) if after < len => {
                                tokio::select! {
                                    biased;
                                    () = due => panic!("deadline {i} completed {after} ms before it was due"),
                                    () = tokio::time::sleep(ms(after)) => {}
                                }
                            }
                            _ => {
                                due.await;
                                assert_eq!(Instant::now(), at, "deadline {i}");
                            }
                        }
                    });
                }
                // Under paused time a lost wake-up would end only here.
                let all = async { while waiting.next().await.is_some() {} };
                tokio::time::timeout(ms(60_000), all).await.expect("every deadline completes");
            });
        }
    }
}
