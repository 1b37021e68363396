//! A family's effective rate under `adaptive` (AIMD, as TCP's congestion control): a 429
//! the provider did not announce multiplies it by `decrease`, a run of answers without
//! one adds `increase` of the configured rate, never above the configured rate and never
//! below `floor` of it. Below the configured rate, admissions are spaced `1 / rate`
//! apart, paid like one more family limit. Pure in `now`.
//!
//! One overload brings many 429s at once (every request in flight meets it, and every
//! request until the provider's window turns), so a 429 cuts again only if its request
//! was admitted after the last cut and a whole period of the limit (its window, or a
//! token bucket's `per`) has passed since: one cut per round trip and per window, as TCP
//! cuts once per window of data.

use std::time::Duration;

use tokio::time::Instant;

use crate::config::Adaptive;

/// How long an idle partition keeps a lowered rate before it may be swept.
pub(crate) const FORGET_AFTER: Duration = Duration::from_secs(60);

/// What a family adapts: its `adaptive` settings, and the rate limit it adapts below.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Adapts {
    pub(crate) spec: Adaptive,
    /// Requests per second the tightest rate limit allows.
    pub(crate) rate: f64,
    /// That limit's period: the least time between two cuts.
    pub(crate) every: Duration,
}

#[derive(Debug, Clone)]
pub(crate) struct Aimd {
    spec: Adaptive,
    every: Duration,
    /// Requests per second the family's tightest rate limit allows.
    configured: f64,
    /// Requests per second allowed now.
    rate: f64,
    /// Answers without a 429 since the last change.
    run: u32,
    last_decrease: Option<Instant>,
    /// The earliest next admission while below the configured rate.
    next: Option<Instant>,
}

impl Aimd {
    pub(crate) fn new(a: Adapts) -> Aimd {
        Aimd {
            spec: a.spec,
            every: a.every,
            configured: a.rate,
            rate: a.rate,
            run: 0,
            last_decrease: None,
            next: None,
        }
    }

    /// The same state under a reloaded spec and configured rate; the effective rate
    /// keeps its share of the configured one.
    pub(crate) fn carry(&self, a: Adapts) -> Aimd {
        let share = self.rate / self.configured;
        Aimd {
            spec: a.spec,
            every: a.every,
            configured: a.rate,
            rate: (a.rate * share).clamp(a.rate * a.spec.floor, a.rate),
            ..self.clone()
        }
    }

    pub(crate) fn rate(&self) -> f64 {
        self.rate
    }

    pub(crate) fn configured(&self) -> f64 {
        self.configured
    }

    /// Whether a partition idle now may drop this state: at the configured rate, or a
    /// minute after its last cut (a partition that comes back starts at the configured
    /// rate again rather than being kept in memory for ever).
    pub(crate) fn forgettable(&self, now: Instant) -> bool {
        !self.slowed()
            || self
                .last_decrease
                .is_none_or(|d| now.saturating_duration_since(d) >= FORGET_AFTER)
    }

    /// Whether it holds admissions back at all.
    pub(crate) fn slowed(&self) -> bool {
        self.rate < self.configured
    }

    fn interval(&self) -> Duration {
        // The rate is at least `floor` of a configured one: never zero, but a rate of one
        // per decade is not worth a panic on the request path.
        Duration::try_from_secs_f64(1.0 / self.rate).unwrap_or(Duration::from_secs(86_400 * 365))
    }

    pub(crate) fn can_take(&self, now: Instant) -> bool {
        !self.slowed() || self.next.is_none_or(|n| now >= n)
    }

    pub(crate) fn take(&mut self, now: Instant) {
        if self.slowed() {
            self.next = Some(self.next.map_or(now, |n| n.max(now)) + self.interval());
        }
    }

    /// The earliest instant the `n`-th next admission could pass.
    pub(crate) fn ready_at(&self, n: u64, now: Instant) -> Instant {
        if !self.slowed() {
            return now;
        }
        let first = self.next.map_or(now, |t| t.max(now));
        let spaced = self
            .interval()
            .checked_mul(u32::try_from(n.saturating_sub(1)).unwrap_or(u32::MAX))
            .unwrap_or(Duration::MAX);
        first
            .checked_add(spaced)
            .unwrap_or(first + Duration::from_secs(86_400 * 365))
    }

    /// A 429 that classification retries or cools down, to a request admitted at
    /// `admitted`, arrived at `now`.
    pub(crate) fn refused(&mut self, admitted: Instant, now: Instant) {
        self.run = 0;
        if self
            .last_decrease
            .is_some_and(|d| admitted < d || now < d + self.every)
        {
            return;
        }
        let floor = self.configured * self.spec.floor;
        self.rate = (self.rate * self.spec.decrease).max(floor);
        self.last_decrease = Some(now);
    }

    /// An answer that was not such a 429.
    pub(crate) fn succeeded(&mut self) {
        if !self.slowed() {
            return;
        }
        self.run += 1;
        if self.run >= self.spec.successes {
            self.run = 0;
            self.rate = (self.rate + self.configured * self.spec.increase).min(self.configured);
            if !self.slowed() {
                self.next = None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn adapts(decrease: f64, increase: f64, floor: f64, successes: u32, rate: f64) -> Adapts {
        Adapts {
            spec: Adaptive {
                decrease,
                increase,
                floor,
                successes,
            },
            rate,
            every: Duration::from_millis(100),
        }
    }

    #[test]
    fn a_429_halves_once_per_round_trip_and_successes_climb_back() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut a = Aimd::new(adapts(0.5, 0.25, 0.1, 2, 8.0));
        a.refused(ms(0), ms(100));
        assert_eq!(a.rate(), 4.0);
        // Admitted before that cut: the same overload, no second cut.
        a.refused(ms(50), ms(300));
        assert_eq!(a.rate(), 4.0);
        // Admitted after it, but within the limit's period (100 ms) of it: no cut either.
        a.refused(ms(150), ms(160));
        assert_eq!(a.rate(), 4.0);
        a.refused(ms(150), ms(300));
        assert_eq!(a.rate(), 2.0);
        for i in 0..3 {
            a.refused(ms(1000 + 200 * i), ms(1000 + 200 * i + 5));
        }
        assert_eq!(a.rate(), 0.8, "floor: 10% of 8");
        for _ in 0..8 {
            a.succeeded();
        }
        assert_eq!(a.rate(), 8.0, "2 per step of 2 successes, capped");
        assert!(!a.slowed());
    }

    #[test]
    fn below_the_configured_rate_admissions_are_spaced() {
        let t0 = Instant::now();
        let mut a = Aimd::new(adapts(0.5, 0.1, 0.1, 10, 4.0));
        assert!(a.can_take(t0));
        a.refused(t0, t0);
        assert_eq!(a.ready_at(1, t0), t0);
        a.take(t0);
        assert!(!a.can_take(t0 + Duration::from_millis(499)));
        assert!(a.can_take(t0 + Duration::from_millis(500)));
        assert_eq!(a.ready_at(3, t0), t0 + Duration::from_millis(1500));
        let reloaded = a.carry(adapts(0.5, 0.1, 0.1, 10, 8.0));
        assert_eq!(reloaded.rate(), 4.0, "half of the new configured rate");
    }

    proptest! {
        /// Whatever answers come, the rate stays within [floor, configured]; once the
        /// 429s stop, enough successes bring it back to the configured rate.
        #[test]
        fn the_rate_stays_in_bounds_and_recovers(
            decrease in 0.05f64..0.95,
            increase in 0.01f64..1.0,
            floor in 0.01f64..1.0,
            successes in 1u32..20,
            configured in 0.1f64..1000.0,
            answers in proptest::collection::vec((any::<bool>(), 0u64..2000, 0u64..50), 0..300),
        ) {
            let t0 = Instant::now();
            let mut a = Aimd::new(adapts(decrease, increase, floor, successes, configured));
            let mut now = t0;
            for (refused, back, step) in answers {
                now += Duration::from_millis(step);
                if refused {
                    let admitted = now.checked_sub(Duration::from_millis(back)).unwrap_or(t0).max(t0);
                    a.refused(admitted, now);
                } else {
                    a.succeeded();
                }
                let lo = configured * floor;
                prop_assert!(a.rate() >= lo * (1.0 - 1e-12) && a.rate() <= configured * (1.0 + 1e-12),
                    "rate {} outside [{lo}, {configured}]", a.rate());
            }
            let steps = ((1.0 - floor) / increase).ceil() as u32 + 1;
            for _ in 0..steps * successes {
                a.succeeded();
            }
            prop_assert!(!a.slowed(), "rate {} of {configured} after the 429s stopped", a.rate());
            prop_assert!(a.can_take(now));
        }
    }
}
