//! A sliding window counter as the provider keeps one (haproxy's `sc_http_req_rate`,
//! Python `limits`' sliding window counter, many gateways and CDNs): at each arrival it
//! estimates the last `window` from two fixed windows, the previous one's count weighted
//! by the share of it the last `window` still covers plus the current one's count, and
//! accepts while that estimate with the arrival stays within `permits` (after rounding
//! it down, where the provider rounds).
//!
//! sluice sees sends, not arrivals. A request counts for more the later it arrives
//! (fully in the current window, partly in the previous one, not at all before), so at
//! any instant each sent request is counted as if it arrived at its bound (its send plus
//! the margin, lowered to its response), or just now while the bound is still ahead; an
//! admitted request not yet sent counts fully. Every such term only falls with time, so
//! an estimate that has room for one more now has room at every later instant: whichever
//! of its possible instants each request arrives at, the provider accepts it.
//!
//! Where the provider's windows fall: on the clock, or unknown (`Any`: haproxy starts a
//! counter's windows at its first request), in which case the estimate must hold for
//! every placement of the window edges. A provider that reads its clock to the
//! millisecond may place an arrival up to 1 ms earlier in its window than it was, which
//! weighs the previous window a little more: the weights allow for it.

use std::time::Duration;

use tokio::time::Instant;

use super::bounds::Bounds;
use super::time::{Id, ns_between, shifted, to_next_edge};

/// The resolution of a provider's clock that the weights allow for.
const GRAIN: u128 = 1_000_000;

#[derive(Debug, Clone, Copy)]
pub(super) enum Edges {
    /// Any placement of the window edges.
    Any,
    /// Windows start at `origin` and every `window` before and after it, give or take
    /// `slack` (edges taken from a reset the provider announced in whole seconds): the
    /// estimate must hold wherever within it the edges are.
    Clock { origin: Instant, slack: Duration },
}

/// Estimates are kept multiplied by the window in nanoseconds, so that a weight is an
/// integer: a request in the current window counts `window`, one in the previous window
/// `window` less the part of it already past (less a millisecond).
#[derive(Debug, Clone)]
pub(super) struct Counter {
    permits: u128,
    window: u128,
    pub(super) margin: Duration,
    pub(super) pending: u64,
    edges: Edges,
    /// The provider rounds the estimate down before comparing.
    rounds_down: bool,
    sent: Bounds,
}

impl Counter {
    pub(super) fn new(
        permits: u32,
        window: Duration,
        margin: Duration,
        edges: Edges,
        rounds_down: bool,
    ) -> Counter {
        Counter {
            permits: u128::from(permits),
            window: window.as_nanos().max(1),
            margin,
            pending: 0,
            edges,
            rounds_down,
            sent: Bounds::default(),
        }
    }

    /// This counter under a changed spec (a reload), keeping what has been sent.
    pub(super) fn carry(mut self, new: Counter, now: Instant) -> Counter {
        self.permits = new.permits;
        self.window = new.window;
        self.margin = new.margin;
        self.edges = new.edges;
        self.rounds_down = new.rounds_down;
        self.refresh(now);
        self
    }

    pub(super) fn window(&self) -> Duration {
        Duration::from_nanos(u64::try_from(self.window).unwrap_or(u64::MAX))
    }

    /// Whether the windows are on the clock.
    pub(super) fn on_clock(&self) -> bool {
        matches!(self.edges, Edges::Clock { .. })
    }

    /// Moves the clock's edges to `edge`, known to within `slack`.
    pub(super) fn realign(&mut self, edge: Instant, slack: Duration) {
        if self.on_clock() {
            self.edges = Edges::Clock {
                origin: edge,
                slack,
            };
        }
    }

    /// How long to the next clock edge, and how far the real edges may be from sluice's
    /// (`None` at any alignment).
    pub(super) fn edges(&self, now: Instant) -> Option<(Duration, Duration)> {
        let Edges::Clock { origin, slack } = self.edges else {
            return None;
        };
        Some((to_next_edge(origin, self.window(), now), slack))
    }

    /// How far `t` is from the nearest clock edge (`None` at any alignment).
    pub(super) fn off_edge(&self, t: Instant) -> Option<Duration> {
        let Edges::Clock { origin, .. } = self.edges else {
            return None;
        };
        let w = self.window as i128;
        let phase = ns_between(origin, t).rem_euclid(w);
        Some(Duration::from_nanos(phase.min(w - phase) as u64))
    }

    /// A request counts for nothing two windows after its bound, wherever the edges fall.
    pub(super) fn refresh(&mut self, now: Instant) {
        let span = self.window() * 2;
        self.sent.forget_while(|t| t + span <= now);
    }

    /// The estimate at `t`, times the window: the sent requests at their bounds, and
    /// `extra` more that reach the provider at `extra_at` (or later).
    fn load(&self, t: Instant, extra: u64, extra_at: Instant) -> u128 {
        let w = self.window;
        if let Edges::Clock {
            origin,
            slack: Duration::ZERO,
        } = self.edges
        {
            // Edges known: count the bounds in the current window and in the previous
            // one, either side of their edges.
            let x = ns_between(origin, t).rem_euclid(w as i128);
            let start = shifted(t, -x);
            let before = shifted(start, -(w as i128));
            let extra_in = |lo: Instant, hi: Option<Instant>| {
                if extra_at >= lo && hi.is_none_or(|h| extra_at < h) {
                    u128::from(extra)
                } else {
                    0
                }
            };
            let cur =
                u128::from(self.sent.weight() - self.sent.before(start)) + extra_in(start, None);
            let prev = u128::from(self.sent.before(start) - self.sent.before(before))
                + extra_in(before, Some(start));
            return cur * w + prev * weight(x as u128, w);
        }
        // How long before `t` each request arrived, with how many arrived then; the ones
        // still ahead count fully.
        let mut full: u128 = 0;
        let mut past: Vec<(u128, u128)> = Vec::new();
        for (at, weight) in self.sent.iter().rev() {
            if at >= t {
                full += u128::from(weight);
                continue;
            }
            let d = (t - at).as_nanos();
            if d >= 2 * w {
                break;
            }
            past.push((d, u128::from(weight)));
        }
        if extra_at >= t {
            full += u128::from(extra);
        } else if extra > 0 {
            let d = (t - extra_at).as_nanos();
            let i = past.partition_point(|p| p.0 < d);
            past.insert(i, (d, u128::from(extra)));
        }
        let full = full * w;
        // Any placement of the edges, or (edges known to within a slack) any within it.
        let range = match self.edges {
            Edges::Clock { origin, slack } => {
                let x = ns_between(origin, t).rem_euclid(w as i128) as u128;
                let s = slack.as_nanos();
                Some(((x + w - s % w) % w, 2 * s))
            }
            Edges::Any => None,
        };
        full + worst(&past, w, range)
    }

    /// Whether an estimate of `load` (times the window) leaves room for one more.
    fn room(&self, load: u128) -> bool {
        let cap = self.permits * self.window;
        if self.rounds_down {
            load < cap
        } else {
            load + self.window <= cap
        }
    }

    pub(super) fn available(&self, now: Instant) -> u64 {
        let load = self.load(now, self.pending, now);
        let (w, cap) = (self.window, self.permits * self.window);
        let n = if self.rounds_down {
            cap.saturating_sub(load).div_ceil(w)
        } else {
            cap.saturating_sub(load) / w
        };
        u64::try_from(n).unwrap_or(u64::MAX)
    }

    pub(super) fn sent(&mut self, id: Id, w: u64, reserved: bool, now: Instant) {
        if reserved {
            self.pending = self.pending.saturating_sub(w);
        }
        self.sent.insert(now + self.margin, id, w);
    }

    /// Admission `id`, sent, weighs `w` now: its estimate term changes in place.
    pub(super) fn reweigh(&mut self, id: Id, w: u64) {
        self.sent.reweigh(id, w);
    }

    pub(super) fn answered(&mut self, id: Id, now: Instant) {
        self.sent.answered(id, now);
    }

    /// The earliest instant the `n`-th unit from now (n >= 1) could be admitted if
    /// nothing else took any, a lower bound: the pending requests and the `n - 1` before
    /// it as if they reached the provider now (any later, they would count for more),
    /// and no more than `permits` in any one window.
    pub(super) fn ready_at(&self, n: u64, now: Instant) -> Instant {
        let ahead = n.max(1) - 1 + self.pending;
        let per_window = (ahead + 1).div_ceil((self.permits as u64).max(1));
        let floor = super::time::turns_after(now, self.window(), per_window.saturating_sub(2));
        let fits = |t: Instant| self.room(self.load(t, ahead, now));
        if fits(floor) {
            return floor;
        }
        // Every estimate falls with time and is empty two windows after the last bound,
        // wherever within the window its edge is.
        let end = self.sent.latest().map_or(now, |l| l.max(now)).max(floor) + self.window() * 2;
        let (mut lo, mut hi) = (0i128, ns_between(floor, end));
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if fits(shifted(floor, mid)) {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        shifted(floor, hi)
    }

    pub(super) fn is_pristine(&self) -> bool {
        self.pending == 0 && self.sent.is_empty()
    }
}

/// The previous window's weight at `x` into the current one: what of it the last window
/// still covers, plus a millisecond of the provider's clock.
fn weight(x: u128, w: u128) -> u128 {
    w - x.saturating_sub(GRAIN).min(w)
}

/// The largest estimate over the placements of the window edges that put `x` (how far
/// into the current window the estimate is made) in `range` (its start, and how far it
/// runs on, wrapping at the window), or over every placement. Moving the current
/// window's start back (`x` growing) only lowers the previous window's weight, except
/// where an arrival moves into the current window (`x = d`) or into the previous one
/// (`x = d - w`): the largest estimate is at one of those, or where the range starts.
fn worst(past: &[(u128, u128)], w: u128, range: Option<(u128, u128)>) -> u128 {
    let (start, len) = range.filter(|r| r.1 < w).unwrap_or((0, w));
    let inside = |x: &u128| (x + w - start) % w <= len;
    // Both kinds of candidates come in order from `past`, and are merged in order.
    let split = past.partition_point(|p| p.0 < w);
    let (near, far) = past.split_at(split);
    let mut a = near.iter().map(|p| p.0).peekable();
    let mut b = far.iter().map(|p| p.0 - w).peekable();
    let mut xs: Vec<u128> = Vec::with_capacity(past.len() + 2);
    while let Some(x) = match (a.peek(), b.peek()) {
        (Some(x), Some(y)) if x > y => b.next(),
        (Some(_), _) => a.next(),
        (None, _) => b.next(),
    } {
        if inside(&x) {
            xs.push(x);
        }
    }
    // Where the range starts, and the window's start when the range wraps past it.
    let mut seed = |x: u128| xs.insert(xs.partition_point(|c| *c < x), x);
    seed(start);
    if start + len >= w {
        seed(0);
    }
    xs.dedup();
    let (mut i, mut j) = (0, 0);
    let (mut cur, mut upto) = (0u128, 0u128);
    let mut best = 0;
    for x in xs {
        while i < past.len() && past[i].0 <= x {
            cur += past[i].1;
            i += 1;
        }
        while j < past.len() && past[j].0 <= x + w {
            upto += past[j].1;
            j += 1;
        }
        best = best.max(cur * w + (upto - cur) * weight(x, w));
    }
    best
}
