//! A fixed window on the clock, as the provider counts it: windows start at whole
//! multiples of `window` since the Unix epoch (plus an offset), each admits `permits`
//! arrivals, and the count starts again at the next edge, whenever the requests came.
//!
//! A sent request arrives somewhere between its send and its bound (the send plus the
//! margin, lowered to its response): it counts in every window that span touches. An
//! admitted request not yet sent may arrive in any window from now on: it counts in all
//! of them until it is sent. Edges known only to within `slack` (taken from a reset the
//! provider announced, in whole seconds) widen every span by that much on both sides.

use std::time::Duration;

use tokio::time::Instant;

use super::time::{Id, ns_between, shifted, to_next_edge};

#[derive(Debug, Clone)]
struct Sent {
    id: Id,
    at: Instant,
    bound: Instant,
    /// The first and last windows it may land in (kept with the edges they were
    /// computed from).
    first: i128,
    last: i128,
    /// The units it costs.
    w: u64,
}

#[derive(Debug, Clone)]
pub(super) struct Calendar {
    permits: u64,
    window: Duration,
    pub(super) margin: Duration,
    pub(super) pending: u64,
    /// A window edge.
    origin: Instant,
    /// How far the real edges may be from `origin`'s.
    slack: Duration,
    /// Sent requests that may still count in the current window or a later one.
    sent: Vec<Sent>,
}

impl Calendar {
    pub(super) fn new(
        permits: u32,
        window: Duration,
        margin: Duration,
        origin: Instant,
    ) -> Calendar {
        Calendar {
            permits: u64::from(permits),
            window,
            margin,
            pending: 0,
            origin,
            slack: Duration::ZERO,
            sent: Vec::new(),
        }
    }

    /// This window under a changed spec (a reload), keeping what has been sent.
    pub(super) fn carry(mut self, new: Calendar, now: Instant) -> Calendar {
        self.permits = new.permits;
        self.window = new.window;
        self.margin = new.margin;
        self.origin = new.origin;
        self.slack = Duration::ZERO;
        self.respan();
        self.refresh(now);
        self
    }

    /// Places every send again after the edges moved.
    fn respan(&mut self) {
        let mut sent = std::mem::take(&mut self.sent);
        for s in &mut sent {
            (s.first, s.last) = self.span(s.at, s.bound);
        }
        self.sent = sent;
    }

    pub(super) fn window(&self) -> Duration {
        self.window
    }

    /// Moves the edges to `edge` (and every window from it), known to within `slack`.
    /// What was sent is counted again against them.
    pub(super) fn realign(&mut self, edge: Instant, slack: Duration) {
        self.origin = edge;
        self.slack = slack;
        self.respan();
    }

    /// How long to the next edge, and how far the real edges may be from sluice's.
    pub(super) fn edges(&self, now: Instant) -> (Duration, Duration) {
        (to_next_edge(self.origin, self.window, now), self.slack)
    }

    /// How far `t` is from the nearest edge.
    pub(super) fn off_edge(&self, t: Instant) -> Duration {
        let w = self.window.as_nanos().max(1) as i128;
        let phase = ns_between(self.origin, t).rem_euclid(w);
        Duration::from_nanos(phase.min(w - phase) as u64)
    }

    /// The windows a send at `send` with bound `bound` may land in, first and last.
    fn span(&self, send: Instant, bound: Instant) -> (i128, i128) {
        let slack = self.slack.as_nanos() as i128;
        let w = self.window.as_nanos().max(1) as i128;
        let at = |t: Instant, by: i128| (ns_between(self.origin, t) + by).div_euclid(w);
        (at(send, -slack), at(bound, slack))
    }

    /// The window `t` falls in, counted from the one starting at `origin`.
    fn index(&self, t: Instant) -> i128 {
        ns_between(self.origin, t).div_euclid(self.window.as_nanos().max(1) as i128)
    }

    /// The first window a request sent at `now` may land in: with edges known only to
    /// within the slack, the one `slack` before.
    fn first(&self, now: Instant) -> i128 {
        self.index(shifted(now, -(self.slack.as_nanos() as i128)))
    }

    /// The first instant from which requests land no earlier than window `k` (its start,
    /// and the slack), no earlier than `now`.
    fn start_from(&self, k: i128, now: Instant) -> Instant {
        let start = k * self.window.as_nanos() as i128 + self.slack.as_nanos() as i128;
        let here = ns_between(self.origin, now);
        shifted(now, (start - here).max(0))
    }

    pub(super) fn refresh(&mut self, now: Instant) {
        let k = self.first(now);
        self.sent.retain(|s| s.last >= k);
    }

    /// The weight of the sent requests that may land in window `k`.
    fn sent_in(&self, k: i128) -> u64 {
        self.sent
            .iter()
            .filter(|s| s.first <= k && k <= s.last)
            .map(|s| s.w)
            .sum()
    }

    /// The last window a sent request may land in.
    fn last(&self) -> Option<i128> {
        self.sent.iter().map(|s| s.last).max()
    }

    pub(super) fn available(&self, now: Instant) -> u64 {
        let k = self.first(now);
        let fullest = (k..=self.last().unwrap_or(k).max(k))
            .map(|k| self.sent_in(k))
            .max()
            .unwrap_or(0);
        self.permits.saturating_sub(fullest + self.pending)
    }

    pub(super) fn sent(&mut self, id: Id, w: u64, reserved: bool, now: Instant) {
        if reserved {
            self.pending = self.pending.saturating_sub(w);
        }
        let bound = now + self.margin;
        let (first, last) = self.span(now, bound);
        self.sent.push(Sent {
            id,
            at: now,
            bound,
            first,
            last,
            w,
        });
    }

    /// Admission `id`, sent, weighs `w` now: every window it may land in counts that.
    pub(super) fn reweigh(&mut self, id: Id, w: u64) {
        if let Some(s) = self.sent.iter_mut().rev().find(|s| s.id == id) {
            s.w = w;
        }
    }

    pub(super) fn answered(&mut self, id: Id, now: Instant) {
        // Answers come soon after their sends: search from the latest.
        let Some(i) = self.sent.iter().rposition(|s| s.id == id) else {
            return;
        };
        let s = &self.sent[i];
        let bound = s.bound.min(now).max(s.at);
        let (first, last) = self.span(s.at, bound);
        let s = &mut self.sent[i];
        (s.bound, s.first, s.last) = (bound, first, last);
    }

    /// The earliest instant the `n`-th unit from now could be admitted, a lower bound.
    /// An admission counts in every window from its own on until it is sent, so the first
    /// can go in the first window after which every window has room for it and the
    /// pending ones; from there each window takes what room it has, the pending first.
    pub(super) fn ready_at(&self, n: u64, now: Instant) -> Instant {
        let p = self.permits.max(1);
        let pending = self.pending;
        let here = self.first(now);
        let last = self.last().unwrap_or(here).max(here);
        let sent = |k: i128| self.sent_in(k);
        let mut k = (here..=last)
            .rev()
            .find(|k| sent(*k) + pending + 1 > p)
            .map_or(here, |full| full + 1);
        let mut need = n.max(1) + pending;
        while k <= last {
            let room = p.saturating_sub(sent(k));
            if need <= room {
                return self.start_from(k, now);
            }
            need -= room;
            k += 1;
        }
        // Empty windows from here on, `permits` each.
        self.start_from(k + ((need - 1) / p) as i128, now)
    }

    pub(super) fn is_pristine(&self) -> bool {
        self.pending == 0 && self.sent.is_empty()
    }
}
