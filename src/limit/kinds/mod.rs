//! The limit kinds as pure state machines: every method takes `now` and nothing here
//! sleeps or locks, so each rule is tested by stepping `now`.
//!
//! A provider counts a request when it *arrives*; sluice decides when it *admits* it, and
//! between the two lie connecting, TLS and the network. So the rate kinds follow each
//! admission through its life: admitted (it holds its permit, with no known return),
//! sent (handed to its upstream connection: the provider counts it no earlier than this,
//! and no later than the limit's margin after it), answered (the response head proves it
//! arrived by then). Permits come back by the instants the provider may have counted
//! requests, never by sluice's own admission instants. An admission that never reached
//! its connection is undone. Concurrency counts requests in flight and ignores all this.

mod bounds;
mod calendar;
mod counter;
mod fixed;
mod sliding;
mod time;
mod token;

pub(crate) use time::{Id, unix_at};
pub(crate) use token::Pace;

use std::time::Duration;

use tokio::time::Instant;

use crate::config::{CounterAlign, Limit, Rounding, WindowAlign};
use calendar::Calendar;
use counter::{Counter, Edges};
use fixed::Fixed;
use sliding::Sliding;
use token::Gcra;

#[derive(Debug, Clone)]
pub struct LimitState {
    /// The reload epoch the limit was created in: an admission of an earlier epoch never
    /// took from it, so neither its send nor its release may give anything back here.
    since: u64,
    /// The slowest answer that came back later than the margin after its send: the
    /// provider may have counted that request that late (for the edge-429 hint).
    slowest: Duration,
    /// The kind as written (`LimitSpec::kind_letter`): a reload carries state only into
    /// the same one.
    letter: char,
    /// The unit it counts, by its upstream's unit index (`limit::costs`): a request
    /// takes its cost in this unit.
    unit: u8,
    kind: Kind,
}

#[derive(Debug, Clone)]
enum Kind {
    /// `token_bucket`, `leaky_bucket` and `published`: they differ only in their pace.
    TokenBucket(Gcra),
    SlidingWindow(Sliding),
    FixedWindow(Fixed),
    /// `fixed_window` with `align = "clock"`.
    Calendar(Calendar),
    SlidingCounter(Counter),
    Concurrency {
        max: u32,
        in_flight: u32,
    },
}

impl Kind {
    /// The state of a fresh `spec` at `now`, when the Unix time is `unix`.
    fn of(spec: &Limit, now: Instant, unix: Duration) -> Kind {
        let margin = spec.margin().unwrap_or_default();
        let edge = |window, offset: Option<Duration>| {
            time::edge_after(now, unix, window, offset.unwrap_or_default())
        };
        match *spec {
            Limit::TokenBucket { .. } | Limit::LeakyBucket { .. } | Limit::Published { .. } => {
                // Validation refuses rates nginx reads as zero; one a second is the fallback.
                let pace =
                    Pace::of(spec).unwrap_or_else(|| Pace::token(1, Duration::from_secs(1), 1));
                Kind::TokenBucket(Gcra::new(pace, margin, now))
            }
            Limit::SlidingWindow {
                permits, window, ..
            } => Kind::SlidingWindow(Sliding::new(permits.get(), window, margin)),
            Limit::FixedWindow {
                permits,
                window,
                align: WindowAlign::First,
                ..
            } => Kind::FixedWindow(Fixed::new(permits.get(), window, margin)),
            Limit::FixedWindow {
                permits,
                window,
                align: WindowAlign::Clock,
                offset,
                ..
            } => Kind::Calendar(Calendar::new(
                permits.get(),
                window,
                margin,
                edge(window, offset),
            )),
            Limit::SlidingCounter {
                permits,
                window,
                align,
                offset,
                rounding,
                ..
            } => {
                let edges = match align {
                    CounterAlign::Any => Edges::Any,
                    CounterAlign::Clock => Edges::Clock {
                        origin: edge(window, offset),
                        slack: Duration::ZERO,
                    },
                };
                Kind::SlidingCounter(Counter::new(
                    permits.get(),
                    window,
                    margin,
                    edges,
                    rounding == Rounding::Down,
                ))
            }
            Limit::Concurrency { max, .. } => Kind::Concurrency {
                max: max.get(),
                in_flight: 0,
            },
        }
    }
}

impl LimitState {
    pub fn new(spec: &Limit, now: Instant) -> LimitState {
        LimitState::new_in(spec, now, 0)
    }

    /// A new limit created by the reload of `epoch`.
    pub(crate) fn new_in(spec: &Limit, now: Instant, epoch: u64) -> LimitState {
        LimitState::on_clock(spec, now, epoch, unix_at(now))
    }

    /// As [`LimitState::new_in`], when the Unix time at `now` is `unix` (windows on the
    /// clock fall by it).
    pub fn on_clock(spec: &Limit, now: Instant, epoch: u64, unix: Duration) -> LimitState {
        LimitState {
            since: epoch,
            slowest: Duration::ZERO,
            letter: spec.kind_letter(),
            unit: spec.unit(),
            kind: Kind::of(spec, now, unix),
        }
    }

    /// The unit it counts, as an index into its upstream's units.
    pub(crate) fn unit(&self) -> u8 {
        self.unit
    }

    /// This limit under a changed spec of the same kind (a reload), keeping what has been
    /// taken: a token bucket keeps its debt in permits, windows and counters keep their
    /// admissions (as far back as the old window remembered), concurrency keeps its
    /// permits in flight. A lowered limit therefore admits nothing until the permits
    /// already taken fit under it. A different kind starts fresh.
    pub(crate) fn carry(self, spec: &Limit, now: Instant, epoch: u64) -> LimitState {
        if !self.same_kind(spec) {
            return LimitState::new_in(spec, now, epoch);
        }
        let margin = spec.margin().unwrap_or_default();
        let kind = match (self.kind, Kind::of(spec, now, unix_at(now))) {
            (Kind::TokenBucket(g), Kind::TokenBucket(new)) => {
                Kind::TokenBucket(g.carry(new.pace(), margin, now))
            }
            (Kind::SlidingWindow(w), Kind::SlidingWindow(new)) => {
                Kind::SlidingWindow(w.carry(new, now))
            }
            (Kind::FixedWindow(w), Kind::FixedWindow(new)) => Kind::FixedWindow(w.carry(new, now)),
            (Kind::Calendar(w), Kind::Calendar(new)) => Kind::Calendar(w.carry(new, now)),
            (Kind::SlidingCounter(c), Kind::SlidingCounter(new)) => {
                Kind::SlidingCounter(c.carry(new, now))
            }
            (Kind::Concurrency { in_flight, .. }, Kind::Concurrency { max, .. }) => {
                Kind::Concurrency { max, in_flight }
            }
            (_, fresh) => fresh,
        };
        LimitState {
            since: self.since,
            slowest: self.slowest,
            letter: self.letter,
            unit: self.unit,
            kind,
        }
    }

    /// Whether two limits are of the same kind counting the same unit, so one can carry
    /// into the other.
    pub(crate) fn same_kind(&self, spec: &Limit) -> bool {
        self.letter == spec.kind_letter() && self.unit == spec.unit()
    }

    /// Forgets what time has made irrelevant (expired window entries, closed windows).
    fn refresh(&mut self, now: Instant) {
        match &mut self.kind {
            Kind::SlidingWindow(w) => w.refresh(now),
            Kind::FixedWindow(w) => w.refresh(now),
            Kind::Calendar(w) => w.refresh(now),
            Kind::SlidingCounter(c) => c.refresh(now),
            Kind::TokenBucket(_) | Kind::Concurrency { .. } => {}
        }
    }

    /// How many could be admitted at `now`, one after another.
    pub fn available(&mut self, now: Instant) -> u64 {
        self.refresh(now);
        match &self.kind {
            Kind::TokenBucket(g) => g.available(now),
            Kind::SlidingWindow(w) => w.available(),
            Kind::FixedWindow(w) => w.available(),
            Kind::Calendar(w) => w.available(now),
            Kind::SlidingCounter(c) => c.available(now),
            Kind::Concurrency { max, in_flight } => u64::from(max.saturating_sub(*in_flight)),
        }
    }

    pub fn can_take(&mut self, now: Instant) -> bool {
        self.available(now) > 0
    }

    /// Whether `w` units can be taken now, at once (a request that costs `w`). A cost of
    /// nothing is always admitted.
    pub fn can_take_n(&mut self, w: u64, now: Instant) -> bool {
        w == 0 || self.available(now) >= w
    }

    /// Admits one. Callers check `can_take` first, for every limit, so a request takes
    /// all its permits at the same instant or none.
    pub fn take(&mut self, now: Instant) {
        self.take_n(1, now);
    }

    /// Admits a request that costs `w` units (see `can_take_n`).
    pub fn take_n(&mut self, w: u64, now: Instant) {
        self.refresh(now);
        match &mut self.kind {
            Kind::TokenBucket(g) => g.pending += w,
            Kind::SlidingWindow(x) => x.pending += w,
            Kind::FixedWindow(x) => x.pending += w,
            Kind::Calendar(x) => x.pending += w,
            Kind::SlidingCounter(c) => c.pending += w,
            Kind::Concurrency { in_flight, .. } => {
                *in_flight = in_flight.saturating_add(u32::try_from(w).unwrap_or(u32::MAX))
            }
        }
    }

    /// Admission `id` was handed to its upstream connection at `now`. `epoch` is the
    /// reload epoch it was admitted in, `None` when its admission was already undone (a
    /// send that raced its own cancellation). A send this limit never admitted still
    /// counts: the provider will see it.
    pub fn sent(&mut self, id: Id, epoch: Option<u64>, now: Instant) {
        self.sent_n(id, 1, epoch, now);
    }

    /// As `sent`, for an admission that costs `w` units.
    pub fn sent_n(&mut self, id: Id, w: u64, epoch: Option<u64>, now: Instant) {
        let reserved = epoch.is_some_and(|e| e >= self.since);
        match &mut self.kind {
            Kind::TokenBucket(g) => g.sent(id, w, reserved, now),
            Kind::SlidingWindow(x) => {
                x.refresh(now);
                x.sent(id, w, reserved, now)
            }
            Kind::FixedWindow(x) => x.sent(id, w, reserved, now),
            Kind::Calendar(x) => {
                x.refresh(now);
                x.sent(id, w, reserved, now)
            }
            Kind::SlidingCounter(c) => {
                c.refresh(now);
                c.sent(id, w, reserved, now)
            }
            Kind::Concurrency { .. } => {}
        }
    }

    /// Admission `id` of reload epoch `epoch`, sent costing `was` units, costs `w`: its
    /// true cost, as its response reported it. The difference is given back to or taken
    /// from what the admission holds (`token_bucket`: the bucket, which may go into
    /// debt; `sliding_window`, `sliding_counter`, `fixed_window` on the clock: its entry;
    /// `fixed_window` from the first request: more is charged to the open window, and a
    /// refund only to a window known to hold it).
    pub fn reweigh(&mut self, id: Id, was: u64, w: u64, epoch: u64, now: Instant) {
        if epoch < self.since || was == w {
            return;
        }
        self.refresh(now);
        match &mut self.kind {
            Kind::TokenBucket(g) => g.reweigh(id, was, w, now),
            Kind::SlidingWindow(x) => x.reweigh(id, w),
            Kind::FixedWindow(x) => x.reweigh(id, was, w, now),
            Kind::Calendar(x) => x.reweigh(id, w),
            Kind::SlidingCounter(c) => c.reweigh(id, w),
            Kind::Concurrency { .. } => {}
        }
    }

    /// The response to admission `id` arrived at `now`, `took` after its send: the
    /// provider had counted it by then.
    pub fn answered(&mut self, id: Id, now: Instant, took: Duration) {
        if self.margin().is_some_and(|m| took > m) {
            self.slowest = self.slowest.max(took);
        }
        match &mut self.kind {
            Kind::TokenBucket(g) => g.answered(id, now),
            Kind::SlidingWindow(w) => w.answered(id, now),
            Kind::FixedWindow(w) => w.answered(id, now),
            Kind::Calendar(w) => w.answered(id, now),
            Kind::SlidingCounter(c) => c.answered(id, now),
            Kind::Concurrency { .. } => {}
        }
    }

    /// Admission of `epoch` never reached its upstream connection (connect failed, the
    /// client left): the provider never saw it, so its rate permit comes back.
    pub fn unsent(&mut self, epoch: u64) {
        self.unsent_n(1, epoch);
    }

    /// As `unsent`, for an admission that cost `w` units.
    pub fn unsent_n(&mut self, w: u64, epoch: u64) {
        if epoch < self.since {
            return;
        }
        match &mut self.kind {
            Kind::TokenBucket(g) => g.pending = g.pending.saturating_sub(w),
            Kind::SlidingWindow(x) => x.pending = x.pending.saturating_sub(w),
            Kind::FixedWindow(x) => x.pending = x.pending.saturating_sub(w),
            Kind::Calendar(x) => x.pending = x.pending.saturating_sub(w),
            Kind::SlidingCounter(c) => c.pending = c.pending.saturating_sub(w),
            Kind::Concurrency { .. } => {}
        }
    }

    /// Gives back everything an admission of `epoch` that cost `w` took (it never reached
    /// its waiter): the state becomes what it would be had it never been admitted.
    pub(crate) fn undo(&mut self, w: u64, epoch: u64) {
        self.unsent_n(w, epoch);
        self.release(w, epoch);
    }

    /// A finished request, admitted in reload epoch `epoch` and costing `w`, gives its
    /// concurrency permit back; the other kinds return permits with time alone.
    pub(crate) fn release(&mut self, w: u64, epoch: u64) {
        if let Kind::Concurrency { in_flight, .. } = &mut self.kind
            && self.since <= epoch
        {
            *in_flight = in_flight.saturating_sub(u32::try_from(w).unwrap_or(u32::MAX));
        }
    }

    pub(crate) fn is_concurrency(&self) -> bool {
        matches!(self.kind, Kind::Concurrency { .. })
    }

    /// The window of a limit whose windows are on the clock.
    pub(crate) fn clock_window(&self) -> Option<Duration> {
        match &self.kind {
            Kind::Calendar(w) => Some(w.window()),
            Kind::SlidingCounter(c) if c.on_clock() => Some(c.window()),
            _ => None,
        }
    }

    /// Windows on the clock: how long to the next edge, and how far the provider's edges
    /// may be from it (zero unless they were moved to an announced reset).
    pub(crate) fn clock_edges(&self, now: Instant) -> Option<(Duration, Duration)> {
        match &self.kind {
            Kind::Calendar(w) => Some(w.edges(now)),
            Kind::SlidingCounter(c) => c.edges(now),
            _ => None,
        }
    }

    /// A window edge the provider announced at `edge`, known to within `slack`: unless
    /// the clock's edges are already that close to it, they move there.
    pub fn realign(&mut self, edge: Instant, slack: Duration) -> bool {
        match &mut self.kind {
            Kind::Calendar(w) if w.off_edge(edge) > slack => w.realign(edge, slack),
            Kind::SlidingCounter(c) if c.off_edge(edge).is_some_and(|d| d > slack) => {
                c.realign(edge, slack)
            }
            _ => return false,
        }
        true
    }

    /// The margin this limit allows between a send and the provider counting it.
    pub(crate) fn margin(&self) -> Option<Duration> {
        match &self.kind {
            Kind::TokenBucket(g) => Some(g.margin),
            Kind::SlidingWindow(w) => Some(w.margin),
            Kind::FixedWindow(w) => Some(w.margin),
            Kind::Calendar(w) => Some(w.margin),
            Kind::SlidingCounter(c) => Some(c.margin),
            Kind::Concurrency { .. } => None,
        }
    }

    /// The slowest answer seen later than the margin after its send.
    pub(crate) fn slowest_answer(&self) -> Duration {
        self.slowest
    }

    /// Raises the margin to `to` for the sends from now on (never lowers it).
    pub(crate) fn grow_margin(&mut self, to: Duration) {
        let m = match &mut self.kind {
            Kind::TokenBucket(g) => &mut g.margin,
            Kind::SlidingWindow(w) => &mut w.margin,
            Kind::FixedWindow(w) => &mut w.margin,
            Kind::Calendar(w) => &mut w.margin,
            Kind::SlidingCounter(c) => &mut c.margin,
            Kind::Concurrency { .. } => return,
        };
        *m = (*m).max(to);
    }

    /// Admitted requests not yet handed to a connection (for `/buckets`).
    pub(crate) fn unsent_count(&self) -> u64 {
        match &self.kind {
            Kind::TokenBucket(g) => g.pending,
            Kind::SlidingWindow(w) => w.pending,
            Kind::FixedWindow(w) => w.pending,
            Kind::Calendar(w) => w.pending,
            Kind::SlidingCounter(c) => c.pending,
            Kind::Concurrency { .. } => 0,
        }
    }

    /// The earliest instant at which the `n`-th permit from now (n >= 1) could be taken if
    /// nothing else took any, or `None` when only a release can tell (concurrency).
    /// A lower bound of the real wait, so rejecting on it never rejects a request that
    /// could have made it; later than `now` whenever nothing can be taken now, so a
    /// driver sleeping until it never spins.
    pub fn ready_at(&mut self, n: u64, now: Instant) -> Option<Instant> {
        self.refresh(now);
        let n = n.max(1);
        match &self.kind {
            Kind::TokenBucket(g) => Some(g.ready_at(n, now)),
            Kind::SlidingWindow(w) => Some(w.ready_at(n, now)),
            Kind::FixedWindow(w) => Some(w.ready_at(n, now)),
            Kind::Calendar(w) => Some(w.ready_at(n, now)),
            Kind::SlidingCounter(c) => Some(c.ready_at(n, now)),
            Kind::Concurrency { max, in_flight } => {
                (n <= u64::from(max.saturating_sub(*in_flight))).then_some(now)
            }
        }
    }

    /// True when the limit is exactly as a fresh one: nothing held, nothing remembered.
    pub(crate) fn is_pristine(&mut self, now: Instant) -> bool {
        self.refresh(now);
        match &self.kind {
            Kind::TokenBucket(g) => g.is_pristine(now),
            Kind::SlidingWindow(w) => w.is_pristine(),
            Kind::FixedWindow(w) => w.is_pristine(),
            Kind::Calendar(w) => w.is_pristine(),
            Kind::SlidingCounter(c) => c.is_pristine(),
            Kind::Concurrency { in_flight, .. } => *in_flight == 0,
        }
    }
}

#[cfg(test)]
mod tests;
