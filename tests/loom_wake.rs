//! The wake protocol of `src/proxy/wake.rs` under the loom model checker: every
//! interleaving of a poll with wakes from other threads, with loom's atomics and lock in
//! place of the real ones. No wake may be lost: a side woken is polled by the poll under
//! way, or the task is woken to poll it, and its mark is still there for that poll.

mod sync {
    pub use loom::sync::atomic::{AtomicBool, AtomicU8, Ordering};

    /// loom's lock with parking_lot's signature, as the protocol uses it.
    pub struct Mutex<T>(loom::sync::Mutex<T>);

    impl<T> Mutex<T> {
        pub fn new(t: T) -> Mutex<T> {
            Mutex(loom::sync::Mutex::new(t))
        }

        pub fn lock(&self) -> loom::sync::MutexGuard<'_, T> {
            self.0
                .lock()
                .expect("not poisoned: nothing panics while holding it")
        }
    }
}

#[path = "../src/proxy/wake.rs"]
mod wake;

use std::sync::Arc;
use std::task::{Wake, Waker};

use loom::sync::atomic::{AtomicUsize, Ordering};
use wake::SideWakes;

/// The task's waker: counts the times the scheduler is asked to poll it.
struct Count(AtomicUsize);

impl Wake for Count {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref()
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

const A: u8 = 1;
const B: u8 = 2;

/// Every interleaving with up to three preemptions: enough for a protocol of four
/// atomic steps a side, and bounded so the suite stays quick in debug builds.
fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(3);
    b.check(f);
}

/// One poll of the task: rounds until nothing is marked, polling (taking) each side
/// marked. Returns the sides it polled.
fn poll(w: &SideWakes) -> u8 {
    let mut polled = 0;
    loop {
        w.begin_round();
        for side in [A, B] {
            if w.take(side) {
                polled |= side;
            }
        }
        if !w.end_round() {
            return polled;
        }
    }
}

/// Each side woken from its own thread while the task polls.
#[test]
fn no_wake_is_lost() {
    model(|| {
        let w = Arc::new(SideWakes::new(0));
        let count = Arc::new(Count(AtomicUsize::new(0)));
        w.set_task(&Waker::from(count.clone()));
        let threads: Vec<_> = [A, B]
            .into_iter()
            .map(|side| {
                let w = w.clone();
                loom::thread::spawn(move || w.wake(side))
            })
            .collect();
        let polled = poll(&w);
        for t in threads {
            t.join().expect("the waker thread ends");
        }
        let woken = count.0.load(Ordering::SeqCst);
        for side in [A, B] {
            if polled & side == 0 {
                assert!(
                    woken > 0,
                    "side {side} missed by the poll, and the task not woken"
                );
                assert!(w.take(side), "side {side} still marked for the next poll");
            }
        }
    });
}

/// A wake from another thread racing the end of the poll: with a first wake already
/// marked, the poll goes round; the second either joins a round or wakes the task.
#[test]
fn a_wake_at_the_end_of_a_poll_wakes_the_task() {
    model(|| {
        let w = Arc::new(SideWakes::new(A));
        let count = Arc::new(Count(AtomicUsize::new(0)));
        w.set_task(&Waker::from(count.clone()));
        let t = {
            let w = w.clone();
            loom::thread::spawn(move || w.wake(A))
        };
        let first = poll(&w);
        assert_eq!(first, A, "the initial mark is polled");
        t.join().expect("the waker thread ends");
        let marked_after = w.take(A);
        let woken = count.0.load(Ordering::SeqCst);
        // Marked after the poll's last look: the task must have been woken for it.
        assert!(!marked_after || woken > 0, "a mark left with no wake");
    });
}
