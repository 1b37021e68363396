//! The wake protocol of a task that polls several futures ("sides") itself, as
//! [`super::pinned::ClientAndUpstreams`] polls a client connection and its upstream
//! connections: each side has its own waker, and a wake that comes while the task is
//! being polled only marks its side, to be polled in another round of the same poll,
//! instead of going through the scheduler.
//!
//! # Invariants
//!
//! - No wake is lost: a side's wake either marks the side before the poll's last look at
//!   the marks (the poll goes round again and polls it), or it finds the task not being
//!   polled and wakes it. This holds because the wake marks, then reads `polling`; the
//!   poll clears `polling`, then reads the marks; all four with `SeqCst`, so in their one
//!   total order at least one of the two reads sees the other's write.
//! - A side is polled only if it was woken since its last poll (its mark is taken just
//!   before it is polled), except the first time, when every side is marked.
//! - The task's own waker is the one of the latest poll.
//!
//! The atomics and the lock come from `super::sync`, so that `tests/loom_wake.rs` can
//! check this file under the loom model checker with loom's types in their place.

use std::task::Waker;

use super::sync::{AtomicBool, AtomicU8, Mutex, Ordering};

pub struct SideWakes {
    /// Set while the task is inside a round of its poll.
    polling: AtomicBool,
    /// The sides woken since their last poll, one bit each.
    marks: AtomicU8,
    task: Mutex<Option<Waker>>,
}

impl SideWakes {
    /// With `sides` marked, so that the first poll polls them.
    pub fn new(sides: u8) -> SideWakes {
        SideWakes {
            polling: AtomicBool::new(false),
            marks: AtomicU8::new(sides),
            task: Mutex::new(None),
        }
    }

    /// Side `side`'s waker fired.
    pub fn wake(&self, side: u8) {
        self.marks.fetch_or(side, Ordering::SeqCst);
        if !self.polling.load(Ordering::SeqCst)
            && let Some(task) = self.task.lock().as_ref()
        {
            task.wake_by_ref();
        }
    }

    /// At the start of a poll: the waker to wake the task with from now on.
    pub fn set_task(&self, waker: &Waker) {
        let mut task = self.task.lock();
        if !task.as_ref().is_some_and(|t| t.will_wake(waker)) {
            *task = Some(waker.clone());
        }
    }

    /// A round begins: wakes from here on only mark their side.
    pub fn begin_round(&self) {
        self.polling.store(true, Ordering::SeqCst);
    }

    /// Whether `side` was woken, clearing its mark: poll it if so.
    pub fn take(&self, side: u8) -> bool {
        self.marks.fetch_and(!side, Ordering::SeqCst) & side != 0
    }

    /// A round ends; whether a side was woken meanwhile, so that the poll must go round
    /// again (or have the task woken) rather than return.
    pub fn end_round(&self) -> bool {
        self.polling.store(false, Ordering::SeqCst);
        self.marks.load(Ordering::SeqCst) != 0
    }
}
