//! A sliding window as the provider counts it: a permit comes back `window` after the
//! latest instant the provider may have counted its request.

use std::time::Duration;

use tokio::time::Instant;

use super::bounds::Bounds;
use super::time::{Id, turns_after};

/// `pending` units are admitted but not sent: each holds a slot with no known return.
/// `sent` holds, ascending, the latest instant the provider may have counted each sent
/// request (with the units it weighs) (its send plus the margin, lowered to its response when that comes first);
/// its slot frees `window` later. Any request the provider counted before another's
/// slot was reused is then at least `window` before it, at the provider.
#[derive(Debug, Clone)]
pub(super) struct Sliding {
    permits: u64,
    window: Duration,
    pub(super) margin: Duration,
    pub(super) pending: u64,
    sent: Bounds,
}

impl Sliding {
    pub(super) fn new(permits: u32, window: Duration, margin: Duration) -> Sliding {
        Sliding {
            permits: u64::from(permits),
            window,
            margin,
            pending: 0,
            sent: Bounds::default(),
        }
    }

    /// This window under a changed spec (a reload), keeping what has been taken.
    pub(super) fn carry(mut self, new: Sliding, now: Instant) -> Sliding {
        self.permits = new.permits;
        self.window = new.window;
        self.margin = new.margin;
        self.refresh(now);
        self
    }

    pub(super) fn refresh(&mut self, now: Instant) {
        let window = self.window;
        self.sent.forget_while(|t| t + window <= now);
    }

    fn held(&self) -> u64 {
        self.pending + self.sent.weight()
    }

    pub(super) fn available(&self) -> u64 {
        self.permits.saturating_sub(self.held())
    }

    pub(super) fn sent(&mut self, id: Id, w: u64, reserved: bool, now: Instant) {
        if reserved {
            self.pending = self.pending.saturating_sub(w);
        }
        self.sent.insert(now + self.margin, id, w);
    }

    /// Admission `id`, sent, weighs `w` now: its slots shrink or grow in place, freeing
    /// when its entry's window passes as before.
    pub(super) fn reweigh(&mut self, id: Id, w: u64) {
        self.sent.reweigh(id, w);
    }

    pub(super) fn answered(&mut self, id: Id, now: Instant) {
        self.sent.answered(id, now);
    }

    /// The earliest instant the `n`-th unit from now (n >= 1) could be taken if nothing
    /// else took any: a lower bound, with every pending request as if sent now.
    pub(super) fn ready_at(&self, n: u64, now: Instant) -> Instant {
        // Slot i of the window frees when its holder's `window` has passed (free slots:
        // now); the m-th future admission reuses slot (m-1) mod permits, one window later
        // for every full turn. After a reload lowered the limit more may be held than
        // allowed: the excess must expire before any slot frees.
        let p = self.permits.max(1);
        let held = self.held();
        let free = p.saturating_sub(held);
        let excess = held.saturating_sub(p);
        let m = n.max(1) - 1;
        let slot = m % p;
        let base = if slot < free {
            now
        } else {
            self.frees(excess + slot - free, now)
        };
        turns_after(base, self.window, m / p)
    }

    /// When the `i`-th held slot (0-based, earliest first) frees at the soonest: sent
    /// requests in order, pending ones as if sent at `now`.
    fn frees(&self, i: u64, now: Instant) -> Instant {
        let before_now = self.sent.before(now);
        let t = if i < before_now {
            self.sent.unit(i)
        } else if i < before_now + self.pending {
            None
        } else {
            self.sent.unit(i - self.pending)
        };
        t.unwrap_or(now) + self.window
    }

    pub(super) fn is_pristine(&self) -> bool {
        self.pending == 0 && self.sent.is_empty()
    }
}
