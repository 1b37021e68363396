//! The four limit kinds as pure state machines: every method takes `now` and nothing here
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

mod fixed;
mod sliding;
mod time;
mod token;

pub use time::Id;

use std::time::Duration;

use tokio::time::Instant;

use crate::config::Limit;
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
    kind: Kind,
}

#[derive(Debug, Clone)]
enum Kind {
    TokenBucket(Gcra),
    SlidingWindow(Sliding),
    FixedWindow(Fixed),
    Concurrency { max: u32, in_flight: u32 },
}

impl LimitState {
    pub fn new(spec: &Limit, now: Instant) -> LimitState {
        LimitState::new_in(spec, now, 0)
    }

    /// A new limit created by the reload of `epoch`.
    pub fn new_in(spec: &Limit, now: Instant, epoch: u64) -> LimitState {
        let margin = spec.margin().unwrap_or_default();
        let kind = match *spec {
            Limit::TokenBucket {
                rate, per, burst, ..
            } => Kind::TokenBucket(Gcra::new(rate.get(), per, burst.get(), margin, now)),
            Limit::SlidingWindow {
                permits, window, ..
            } => Kind::SlidingWindow(Sliding::new(permits.get(), window, margin)),
            Limit::FixedWindow {
                permits, window, ..
            } => Kind::FixedWindow(Fixed::new(permits.get(), window, margin)),
            Limit::Concurrency { max, .. } => Kind::Concurrency {
                max: max.get(),
                in_flight: 0,
            },
        };
        LimitState {
            since: epoch,
            slowest: Duration::ZERO,
            kind,
        }
    }

    /// This limit under a changed spec of the same kind (a reload), keeping what has been
    /// taken: a token bucket keeps its debt in permits, windows keep their admissions
    /// (as far back as the old window remembered), concurrency keeps its permits in
    /// flight. A lowered limit therefore admits nothing until the permits already taken
    /// fit under it. A different kind starts fresh.
    pub fn carry(self, spec: &Limit, now: Instant, epoch: u64) -> LimitState {
        let margin = spec.margin().unwrap_or_default();
        let kind = match (self.kind, spec) {
            (
                Kind::TokenBucket(g),
                Limit::TokenBucket {
                    rate, per, burst, ..
                },
            ) => Kind::TokenBucket(g.carry(rate.get(), *per, burst.get(), margin, now)),
            (
                Kind::SlidingWindow(w),
                Limit::SlidingWindow {
                    permits, window, ..
                },
            ) => Kind::SlidingWindow(w.carry(permits.get(), *window, margin, now)),
            (
                Kind::FixedWindow(w),
                Limit::FixedWindow {
                    permits, window, ..
                },
            ) => Kind::FixedWindow(w.carry(permits.get(), *window, margin, now)),
            (Kind::Concurrency { in_flight, .. }, Limit::Concurrency { max, .. }) => {
                Kind::Concurrency {
                    max: max.get(),
                    in_flight,
                }
            }
            (_, spec) => return LimitState::new_in(spec, now, epoch),
        };
        LimitState {
            since: self.since,
            slowest: self.slowest,
            kind,
        }
    }

    /// Whether two limits are of the same kind, so one can carry into the other.
    pub fn same_kind(&self, spec: &Limit) -> bool {
        matches!(
            (&self.kind, spec),
            (Kind::TokenBucket(_), Limit::TokenBucket { .. })
                | (Kind::SlidingWindow(_), Limit::SlidingWindow { .. })
                | (Kind::FixedWindow(_), Limit::FixedWindow { .. })
                | (Kind::Concurrency { .. }, Limit::Concurrency { .. })
        )
    }

    /// Forgets what time has made irrelevant (expired window entries, closed windows).
    fn refresh(&mut self, now: Instant) {
        match &mut self.kind {
            Kind::SlidingWindow(w) => w.refresh(now),
            Kind::FixedWindow(w) => w.refresh(now),
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
            Kind::Concurrency { max, in_flight } => u64::from(max.saturating_sub(*in_flight)),
        }
    }

    pub fn can_take(&mut self, now: Instant) -> bool {
        self.available(now) > 0
    }

    /// Admits one. Callers check `can_take` first, for every limit, so a request takes
    /// all its permits at the same instant or none.
    pub fn take(&mut self, now: Instant) {
        self.refresh(now);
        match &mut self.kind {
            Kind::TokenBucket(g) => g.pending += 1,
            Kind::SlidingWindow(w) => w.pending += 1,
            Kind::FixedWindow(w) => w.pending += 1,
            Kind::Concurrency { in_flight, .. } => *in_flight += 1,
        }
    }

    /// Admission `id` was handed to its upstream connection at `now`. `epoch` is the
    /// reload epoch it was admitted in, `None` when its admission was already undone (a
    /// send that raced its own cancellation). A send this limit never admitted still
    /// counts: the provider will see it.
    pub fn sent(&mut self, id: Id, epoch: Option<u64>, now: Instant) {
        let reserved = epoch.is_some_and(|e| e >= self.since);
        match &mut self.kind {
            Kind::TokenBucket(g) => g.sent(id, reserved, now),
            Kind::SlidingWindow(w) => {
                w.refresh(now);
                w.sent(id, reserved, now)
            }
            Kind::FixedWindow(w) => w.sent(id, reserved, now),
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
            Kind::Concurrency { .. } => {}
        }
    }

    /// Admission of `epoch` never reached its upstream connection (connect failed, the
    /// client left): the provider never saw it, so its rate permit comes back.
    pub fn unsent(&mut self, epoch: u64) {
        if epoch < self.since {
            return;
        }
        match &mut self.kind {
            Kind::TokenBucket(g) => g.pending = g.pending.saturating_sub(1),
            Kind::SlidingWindow(w) => w.pending = w.pending.saturating_sub(1),
            Kind::FixedWindow(w) => w.pending = w.pending.saturating_sub(1),
            Kind::Concurrency { .. } => {}
        }
    }

    /// Gives back everything an admission of `epoch` took (it never reached its waiter):
    /// the state becomes what it would be had it never been admitted.
    pub fn undo(&mut self, epoch: u64) {
        self.unsent(epoch);
        self.release(epoch);
    }

    /// A finished request, admitted in reload epoch `epoch`, gives its concurrency permit
    /// back; the other kinds return permits with time alone.
    pub fn release(&mut self, epoch: u64) {
        if let Kind::Concurrency { in_flight, .. } = &mut self.kind
            && self.since <= epoch
        {
            *in_flight = in_flight.saturating_sub(1);
        }
    }

    pub fn is_concurrency(&self) -> bool {
        matches!(self.kind, Kind::Concurrency { .. })
    }

    /// The margin this limit allows between a send and the provider counting it.
    pub fn margin(&self) -> Option<Duration> {
        match &self.kind {
            Kind::TokenBucket(g) => Some(g.margin),
            Kind::SlidingWindow(w) => Some(w.margin),
            Kind::FixedWindow(w) => Some(w.margin),
            Kind::Concurrency { .. } => None,
        }
    }

    /// The slowest answer seen later than the margin after its send.
    pub fn slowest_answer(&self) -> Duration {
        self.slowest
    }

    /// Raises the margin to `to` for the sends from now on (never lowers it).
    pub fn grow_margin(&mut self, to: Duration) {
        let m = match &mut self.kind {
            Kind::TokenBucket(g) => &mut g.margin,
            Kind::SlidingWindow(w) => &mut w.margin,
            Kind::FixedWindow(w) => &mut w.margin,
            Kind::Concurrency { .. } => return,
        };
        *m = (*m).max(to);
    }

    /// Admitted requests not yet handed to a connection (for `/buckets`).
    pub fn unsent_count(&self) -> u64 {
        match &self.kind {
            Kind::TokenBucket(g) => g.pending,
            Kind::SlidingWindow(w) => w.pending as u64,
            Kind::FixedWindow(w) => u64::from(w.pending),
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
            Kind::Concurrency { max, in_flight } => {
                (n <= u64::from(max.saturating_sub(*in_flight))).then_some(now)
            }
        }
    }

    /// True when the limit is exactly as a fresh one: nothing held, nothing remembered.
    pub fn is_pristine(&mut self, now: Instant) -> bool {
        self.refresh(now);
        match &self.kind {
            Kind::TokenBucket(g) => g.is_pristine(now),
            Kind::SlidingWindow(w) => w.is_pristine(),
            Kind::FixedWindow(w) => w.is_pristine(),
            Kind::Concurrency { in_flight, .. } => *in_flight == 0,
        }
    }
}

#[cfg(test)]
mod tests;
