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
}
