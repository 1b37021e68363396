//! A sliding window as the provider counts it: a permit comes back `window` after the
//! latest instant the provider may have counted its request.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;

use super::time::{Id, turns_after};

/// `pending` requests are admitted but not sent: each holds a slot with no known return.
/// `sent` holds, ascending, the latest instant the provider may have counted each sent
/// request (its send plus the margin, lowered to its response when that comes first);
/// its slot frees `window` later. Any request the provider counted before another's
/// slot was reused is then at least `window` before it, at the provider.
#[derive(Debug, Clone)]
pub struct Sliding {
    permits: usize,
    window: Duration,
    pub(super) margin: Duration,
    pub(super) pending: usize,
    sent: VecDeque<(Instant, Id)>,
}

impl Sliding {
    pub fn new(permits: u32, window: Duration, margin: Duration) -> Sliding {
        Sliding {
            permits: permits as usize,
            window,
            margin,
            pending: 0,
            sent: VecDeque::new(),
        }
    }

    /// This window under a changed spec (a reload), keeping what has been taken.
    pub fn carry(
        mut self,
        permits: u32,
        window: Duration,
        margin: Duration,
        now: Instant,
    ) -> Sliding {
        self.permits = permits as usize;
        self.window = window;
        self.margin = margin;
        self.refresh(now);
        self
    }

    pub fn refresh(&mut self, now: Instant) {
        while self
            .sent
            .front()
            .is_some_and(|(t, _)| *t + self.window <= now)
        {
            self.sent.pop_front();
        }
    }

    fn held(&self) -> usize {
        self.pending + self.sent.len()
    }

    pub fn available(&self) -> u64 {
        self.permits.saturating_sub(self.held()) as u64
    }

    /// Keeps `sent` ascending; new entries are nearly always the latest.
    fn insert(&mut self, entry: (Instant, Id)) {
        let at = self
            .sent
            .iter()
            .rposition(|(t, _)| *t <= entry.0)
            .map_or(0, |i| i + 1);
        self.sent.insert(at, entry);
    }

    pub fn sent(&mut self, id: Id, reserved: bool, now: Instant) {
        if reserved {
            self.pending = self.pending.saturating_sub(1);
        }
        self.insert((now + self.margin, id));
    }

    pub fn answered(&mut self, id: Id, now: Instant) {
        // Answers come soon after their sends: search from the latest.
        let Some(i) = self.sent.iter().rposition(|(_, s)| *s == id) else {
            return;
        };
        if self.sent[i].0 > now {
            self.sent.remove(i);
            self.insert((now, id));
        }
    }

    /// The earliest instant the `n`-th permit from now (n >= 1) could be taken if nothing
    /// else took any: a lower bound, with every pending request as if sent now.
    pub fn ready_at(&self, n: u64, now: Instant) -> Instant {
        // Slot i of the window frees when its holder's `window` has passed (free slots:
        // now); the m-th future admission reuses slot (m-1) mod permits, one window later
        // for every full turn. After a reload lowered the limit more may be held than
        // allowed: the excess must expire before any slot frees.
        let p = self.permits as u64;
        let held = self.held() as u64;
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
        let i = i as usize;
        let before_now = self.sent.partition_point(|(t, _)| *t < now);
        let t = if i < before_now {
            self.sent.get(i)
        } else if i < before_now + self.pending {
            None
        } else {
            self.sent.get(i - self.pending)
        };
        t.map_or(now, |(t, _)| *t) + self.window
    }

    pub fn is_pristine(&self) -> bool {
        self.pending == 0 && self.sent.is_empty()
    }
}
