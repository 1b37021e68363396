//! The four limit kinds as pure state machines: every method takes `now` and nothing here
//! sleeps, locks or allocates per call (a sliding window keeps one instant per permit).
//!
//! Each answers the same questions: can one more be taken now, take it, when could the
//! n-th more be taken, undo a take that was never used, and is it back to its initial
//! state (so an idle partition can be dropped without losing anything).

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;

use crate::config::Limit;

#[derive(Debug, Clone)]
pub enum LimitState {
    /// GCRA, the exact integer form of a token bucket: `tat` is the theoretical arrival
    /// time of the next request, in nanoseconds since `base` multiplied by `rate`, so that
    /// the emission interval `per / rate` needs no rounding.
    TokenBucket {
        rate: u128,
        per_ns: u128,
        burst: u128,
        base: Instant,
        tat: u128,
    },
    /// Instants of the admissions still inside the window, oldest first.
    SlidingWindow {
        permits: usize,
        window: Duration,
        taken: VecDeque<Instant>,
    },
    /// The current window opened at `start` (the first admission after the previous one
    /// closed) and has admitted `count`.
    FixedWindow {
        permits: u32,
        window: Duration,
        start: Option<Instant>,
        count: u32,
    },
    /// `since` is the reload epoch the limit was created in: a permit granted in an
    /// earlier epoch never took it, so its release must not give it back.
    Concurrency {
        max: u32,
        in_flight: u32,
        since: u64,
    },
}

impl LimitState {
    pub fn new(spec: &Limit, now: Instant) -> LimitState {
        match *spec {
            Limit::TokenBucket {
                rate, per, burst, ..
            } => LimitState::TokenBucket {
                rate: u128::from(rate.get()),
                per_ns: per.as_nanos(),
                burst: u128::from(burst.get()),
                base: now,
                tat: 0,
            },
            Limit::SlidingWindow {
                permits, window, ..
            } => LimitState::SlidingWindow {
                permits: permits.get() as usize,
                window,
                taken: VecDeque::new(),
            },
            Limit::FixedWindow {
                permits, window, ..
            } => LimitState::FixedWindow {
                permits: permits.get(),
                window,
                start: None,
                count: 0,
            },
            Limit::Concurrency { max, .. } => LimitState::Concurrency {
                max: max.get(),
                in_flight: 0,
                since: 0,
            },
        }
    }

    /// A new limit created by the reload of `epoch`.
    pub fn new_in(spec: &Limit, now: Instant, epoch: u64) -> LimitState {
        let mut l = LimitState::new(spec, now);
        if let LimitState::Concurrency { since, .. } = &mut l {
            *since = epoch;
        }
        l
    }

    /// This limit under a changed spec of the same kind (a reload), keeping what has been
    /// taken: a token bucket keeps its debt in permits, windows keep their admissions
    /// (as far back as the old window remembered), concurrency keeps its permits in
    /// flight. A lowered limit therefore admits nothing until the permits already taken
    /// fit under it. A different kind starts fresh.
    pub fn carry(mut self, spec: &Limit, now: Instant, epoch: u64) -> LimitState {
        self.refresh(now);
        match (self, spec) {
            (
                LimitState::TokenBucket {
                    rate,
                    per_ns,
                    base,
                    tat,
                    ..
                },
                Limit::TokenBucket {
                    rate: r,
                    per,
                    burst,
                    ..
                },
            ) => {
                // Debt in scaled units: `per_ns` is one permit. Rounded up, so the
                // conversion never creates a permit.
                let debt = tat.saturating_sub(scaled(base, now, rate));
                let new_per = per.as_nanos();
                LimitState::TokenBucket {
                    rate: u128::from(r.get()),
                    per_ns: new_per,
                    burst: u128::from(burst.get()),
                    base: now,
                    tat: (debt * new_per).div_ceil(per_ns),
                }
            }
            (
                LimitState::SlidingWindow { mut taken, .. },
                Limit::SlidingWindow {
                    permits, window, ..
                },
            ) => {
                while taken.front().is_some_and(|t| *t + *window <= now) {
                    taken.pop_front();
                }
                LimitState::SlidingWindow {
                    permits: permits.get() as usize,
                    window: *window,
                    taken,
                }
            }
            (
                LimitState::FixedWindow { start, count, .. },
                Limit::FixedWindow {
                    permits, window, ..
                },
            ) => {
                let mut l = LimitState::FixedWindow {
                    permits: permits.get(),
                    window: *window,
                    start,
                    count,
                };
                l.refresh(now);
                l
            }
            (
                LimitState::Concurrency {
                    in_flight, since, ..
                },
                Limit::Concurrency { max, .. },
            ) => LimitState::Concurrency {
                max: max.get(),
                in_flight,
                since,
            },
            (_, spec) => LimitState::new_in(spec, now, epoch),
        }
    }

    /// Whether two limits are of the same kind, so one can carry into the other.
    pub fn same_kind(&self, spec: &Limit) -> bool {
        matches!(
            (self, spec),
            (LimitState::TokenBucket { .. }, Limit::TokenBucket { .. })
                | (
                    LimitState::SlidingWindow { .. },
                    Limit::SlidingWindow { .. }
                )
                | (LimitState::FixedWindow { .. }, Limit::FixedWindow { .. })
                | (LimitState::Concurrency { .. }, Limit::Concurrency { .. })
        )
    }

    /// Forgets what time has made irrelevant (expired window entries).
    fn refresh(&mut self, now: Instant) {
        match self {
            LimitState::SlidingWindow { window, taken, .. } => {
                while taken.front().is_some_and(|t| *t + *window <= now) {
                    taken.pop_front();
                }
            }
            LimitState::FixedWindow {
                window,
                start,
                count,
                ..
            } => {
                if start.is_some_and(|s| now >= s + *window) {
                    *start = None;
                    *count = 0;
                }
            }
            LimitState::TokenBucket { .. } | LimitState::Concurrency { .. } => {}
        }
    }

    /// How many could be taken at `now`, one after another.
    pub fn available(&mut self, now: Instant) -> u64 {
        self.refresh(now);
        match self {
            LimitState::TokenBucket {
                rate,
                per_ns,
                burst,
                base,
                tat,
            } => {
                let t = scaled(*base, now, *rate);
                let tau = (*burst - 1) * *per_ns;
                let next = (*tat).max(t);
                // Admissions k = 0.. while next + k·T <= t + τ.
                if next > t + tau {
                    0
                } else {
                    ((t + tau - next) / *per_ns + 1) as u64
                }
            }
            LimitState::SlidingWindow { permits, taken, .. } => {
                (*permits - taken.len().min(*permits)) as u64
            }
            LimitState::FixedWindow { permits, count, .. } => {
                u64::from(*permits - (*count).min(*permits))
            }
            LimitState::Concurrency { max, in_flight, .. } => {
                u64::from(*max - (*in_flight).min(*max))
            }
        }
    }

    pub fn can_take(&mut self, now: Instant) -> bool {
        self.available(now) > 0
    }

    /// Takes one permit. Callers check `can_take` first, for every limit, so a request
    /// takes all its permits at the same instant or none.
    pub fn take(&mut self, now: Instant) {
        self.refresh(now);
        match self {
            LimitState::TokenBucket {
                rate,
                per_ns,
                base,
                tat,
                ..
            } => {
                *tat = (*tat).max(scaled(*base, now, *rate)) + *per_ns;
            }
            LimitState::SlidingWindow { taken, .. } => taken.push_back(now),
            LimitState::FixedWindow { start, count, .. } => {
                start.get_or_insert(now);
                *count += 1;
            }
            LimitState::Concurrency { in_flight, .. } => *in_flight += 1,
        }
    }

    /// Gives back a permit taken at `at` that was never used (its waiter went away at the
    /// moment it was admitted). The state becomes what it would be had it never been taken.
    pub fn undo(&mut self, at: Instant, epoch: u64, now: Instant) {
        self.refresh(now);
        match self {
            LimitState::TokenBucket { per_ns, tat, .. } => *tat = tat.saturating_sub(*per_ns),
            LimitState::SlidingWindow { taken, .. } => {
                if let Some(i) = taken.iter().rposition(|t| *t == at) {
                    taken.remove(i);
                }
            }
            LimitState::FixedWindow { start, count, .. } => {
                if start.is_some_and(|s| at >= s) && *count > 0 {
                    *count -= 1;
                    if *count == 0 {
                        *start = None;
                    }
                }
            }
            LimitState::Concurrency { .. } => self.release(epoch),
        }
    }

    /// A finished request, admitted in reload epoch `epoch`, gives its concurrency permit
    /// back; the other kinds return permits with time alone.
    pub fn release(&mut self, epoch: u64) {
        if let LimitState::Concurrency {
            in_flight, since, ..
        } = self
            && *since <= epoch
        {
            *in_flight = in_flight.saturating_sub(1);
        }
    }

    pub fn is_concurrency(&self) -> bool {
        matches!(self, LimitState::Concurrency { .. })
    }

    /// The earliest instant at which the `n`-th permit from now (n >= 1) could be taken if
    /// nothing else took any, or `None` when only a release can tell (concurrency).
    /// A lower bound of the real wait, so rejecting on it never rejects a request that
    /// could have made it.
    pub fn ready_at(&mut self, n: u64, now: Instant) -> Option<Instant> {
        self.refresh(now);
        let n = n.max(1);
        match self {
            LimitState::TokenBucket {
                rate,
                per_ns,
                burst,
                base,
                tat,
            } => {
                let t = scaled(*base, now, *rate);
                let tau = (*burst - 1) * *per_ns;
                let need = (*tat).max(t) + u128::from(n - 1) * *per_ns;
                if need <= t + tau {
                    return Some(now);
                }
                // Scaled units back to nanoseconds, rounding up so the instant admits.
                let at_ns = (need - tau).div_ceil(*rate);
                Some(*base + Duration::from_nanos(u64::try_from(at_ns).unwrap_or(u64::MAX)))
            }
            LimitState::SlidingWindow {
                permits,
                window,
                taken,
            } => {
                // Slot i of the window frees at taken[i] + window (free slots: now); the
                // m-th future admission reuses slot (m-1) mod permits, one window later
                // for every full turn.
                // After a reload lowered the limit more may be held than allowed: the
                // excess must expire before any slot frees.
                let p = *permits as u64;
                let len = taken.len() as u64;
                let free = p.saturating_sub(len);
                let excess = len.saturating_sub(p);
                let m = n - 1;
                let slot = m % p;
                let turns = (m / p) as u32;
                let base = if slot < free {
                    now
                } else {
                    taken[(excess + slot - free) as usize] + *window
                };
                Some(base + *window * turns)
            }
            LimitState::FixedWindow {
                permits,
                window,
                start,
                count,
            } => {
                let p = u64::from(*permits);
                let (open, used) = match start {
                    Some(s) => (*s, u64::from(*count)),
                    None => (now, 0),
                };
                let left = p.saturating_sub(used);
                if n <= left {
                    return Some(now);
                }
                let turns = 1 + (n - left - 1) / p;
                Some(open + *window * u32::try_from(turns).unwrap_or(u32::MAX))
            }
            LimitState::Concurrency { max, in_flight, .. } => {
                (n <= u64::from(max.saturating_sub(*in_flight))).then_some(now)
            }
        }
    }

    /// True when the limit is exactly as a fresh one: nothing held, nothing remembered.
    pub fn is_pristine(&mut self, now: Instant) -> bool {
        self.refresh(now);
        match self {
            LimitState::TokenBucket {
                rate, base, tat, ..
            } => *tat <= scaled(*base, now, *rate),
            LimitState::SlidingWindow { taken, .. } => taken.is_empty(),
            LimitState::FixedWindow { start, .. } => start.is_none(),
            LimitState::Concurrency { in_flight, .. } => *in_flight == 0,
        }
    }
}

fn scaled(base: Instant, now: Instant, rate: u128) -> u128 {
    now.saturating_duration_since(base).as_nanos() * rate
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::num::NonZeroU32;

    fn nz(v: u32) -> NonZeroU32 {
        NonZeroU32::new(v).unwrap()
    }

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    fn token(rate: u32, per: Duration, burst: u32, now: Instant) -> LimitState {
        let spec = Limit::TokenBucket {
            rate: nz(rate),
            per,
            burst: nz(burst),
            scope: Default::default(),
        };
        LimitState::new(&spec, now)
    }

    /// Admits greedily every millisecond over `span` and returns the admission instants.
    fn drive(l: &mut LimitState, start: Instant, span: Duration) -> Vec<Instant> {
        let mut out = Vec::new();
        let mut now = start;
        while now < start + span {
            while l.can_take(now) {
                l.take(now);
                out.push(now);
            }
            now += ms(1);
        }
        out
    }

    #[test]
    fn token_bucket_bursts_then_refills_at_rate() {
        let t0 = Instant::now();
        let mut l = token(3, Duration::from_secs(1), 6, t0);
        assert_eq!(l.available(t0), 6);
        let got = drive(&mut l, t0, Duration::from_secs(10));
        assert_eq!(
            got.iter().filter(|t| **t == t0).count(),
            6,
            "the burst at once"
        );
        // Then one every 333.33 ms: 6 + 3 per second over 10 s (the last refill lands at 9.999 s).
        assert_eq!(got.len(), 6 + 29);
        assert_eq!(
            got[6],
            t0 + ms(334),
            "the first refill, rounded up to the next ms"
        );
        assert_eq!(
            l.ready_at(1, t0 + ms(10_000)),
            Some(t0 + Duration::from_nanos(10_000_000_000))
        );
    }

    #[test]
    fn token_bucket_exact_with_awkward_rates() {
        let t0 = Instant::now();
        let mut l = token(7, Duration::from_secs(3), 1, t0);
        l.take(t0);
        // Emission interval 3/7 s = 428571428.57 ns: ready at the next whole nanosecond.
        assert_eq!(
            l.ready_at(1, t0),
            Some(t0 + Duration::from_nanos(428_571_429))
        );
        assert!(!l.can_take(t0 + Duration::from_nanos(428_571_428)));
        assert!(l.can_take(t0 + Duration::from_nanos(428_571_429)));
        assert_eq!(l.ready_at(7, t0), Some(t0 + Duration::from_secs(3)));
    }

    #[test]
    fn sliding_window_returns_each_permit_window_after_it_was_taken() {
        let t0 = Instant::now();
        let spec = Limit::SlidingWindow {
            permits: nz(3),
            window: ms(1000),
            scope: Default::default(),
        };
        let mut l = LimitState::new(&spec, t0);
        l.take(t0);
        l.take(t0 + ms(100));
        l.take(t0 + ms(400));
        assert!(!l.can_take(t0 + ms(999)));
        assert_eq!(l.ready_at(1, t0 + ms(500)), Some(t0 + ms(1000)));
        assert_eq!(l.ready_at(2, t0 + ms(500)), Some(t0 + ms(1100)));
        assert_eq!(l.ready_at(3, t0 + ms(500)), Some(t0 + ms(1400)));
        assert_eq!(l.ready_at(4, t0 + ms(500)), Some(t0 + ms(2000)));
        assert!(l.can_take(t0 + ms(1000)));
        assert_eq!(l.available(t0 + ms(1100)), 2);
    }

    #[test]
    fn fixed_window_opens_at_first_admission() {
        let t0 = Instant::now();
        let spec = Limit::FixedWindow {
            permits: nz(2),
            window: ms(1000),
            scope: Default::default(),
        };
        let mut l = LimitState::new(&spec, t0);
        let first = t0 + ms(300);
        l.take(first);
        l.take(first + ms(10));
        assert!(!l.can_take(t0 + ms(1299)));
        assert_eq!(l.ready_at(1, t0 + ms(500)), Some(first + ms(1000)));
        assert_eq!(l.ready_at(3, t0 + ms(500)), Some(first + ms(2000)));
        assert!(l.can_take(first + ms(1000)));
        // The next window opens at the next admission, not on a clock boundary.
        let second = t0 + ms(5000);
        l.take(second);
        l.take(second);
        assert!(!l.can_take(second + ms(999)));
        assert!(l.can_take(second + ms(1000)));
    }

    #[test]
    fn concurrency_holds_until_release() {
        let t0 = Instant::now();
        let mut l = LimitState::new(
            &Limit::Concurrency {
                max: nz(2),
                scope: Default::default(),
            },
            t0,
        );
        l.take(t0);
        l.take(t0);
        assert!(
            !l.can_take(t0 + Duration::from_secs(3600)),
            "time alone frees nothing"
        );
        assert_eq!(l.ready_at(1, t0), None);
        l.release(0);
        assert!(l.can_take(t0));
        l.release(0);
        assert!(l.is_pristine(t0));
    }

    #[test]
    fn undo_restores_the_untaken_state() {
        let t0 = Instant::now();
        let specs = [
            Limit::TokenBucket {
                rate: nz(1),
                per: ms(1000),
                burst: nz(2),
                scope: Default::default(),
            },
            Limit::SlidingWindow {
                permits: nz(2),
                window: ms(1000),
                scope: Default::default(),
            },
            Limit::FixedWindow {
                permits: nz(2),
                window: ms(1000),
                scope: Default::default(),
            },
            Limit::Concurrency {
                max: nz(2),
                scope: Default::default(),
            },
        ];
        for spec in &specs {
            let mut l = LimitState::new(spec, t0);
            l.take(t0 + ms(10));
            l.undo(t0 + ms(10), 0, t0 + ms(20));
            assert!(l.is_pristine(t0 + ms(20)), "{spec:?} -> {l:?}");
            assert_eq!(l.available(t0 + ms(20)), 2, "{spec:?}");
        }
    }

    #[test]
    fn pristine_again_once_time_has_passed() {
        let t0 = Instant::now();
        let mut l = token(10, ms(1000), 5, t0);
        for _ in 0..5 {
            l.take(t0);
        }
        assert!(!l.is_pristine(t0 + ms(499)));
        assert!(l.is_pristine(t0 + ms(500)));
    }

    fn spec_token(rate: u32, per: Duration, burst: u32) -> Limit {
        Limit::TokenBucket {
            rate: nz(rate),
            per,
            burst: nz(burst),
            scope: Default::default(),
        }
    }

    #[test]
    fn a_carried_token_bucket_keeps_its_debt_in_permits() {
        let t0 = Instant::now();
        let sec = Duration::from_secs(1);
        let mut l = token(10, sec, 10, t0);
        for _ in 0..5 {
            l.take(t0);
        }
        // Five taken; a burst of three admits nothing until two are left (300 ms at 10/s).
        let mut lower = l.clone().carry(&spec_token(10, sec, 3), t0, 1);
        assert_eq!(lower.available(t0), 0);
        assert_eq!(lower.ready_at(1, t0), Some(t0 + ms(300)));
        let mut higher = l.clone().carry(&spec_token(10, sec, 20), t0, 1);
        assert_eq!(higher.available(t0), 15);
        // The debt of five permits now drains at the new rate, one a second.
        let mut slower = l.carry(&spec_token(1, sec, 10), t0, 1);
        assert_eq!(slower.available(t0), 5);
        assert_eq!(slower.available(t0 + ms(999)), 5);
        assert_eq!(slower.available(t0 + ms(1000)), 6);
    }

    #[test]
    fn carried_windows_and_concurrency_keep_what_was_taken() {
        let t0 = Instant::now();
        let sliding = |p, w| Limit::SlidingWindow {
            permits: nz(p),
            window: ms(w),
            scope: Default::default(),
        };
        let mut l = LimitState::new(&sliding(5, 1000), t0);
        for i in 0..4 {
            l.take(t0 + ms(10 * i));
        }
        let mut lower = l.clone().carry(&sliding(2, 1000), t0 + ms(100), 1);
        assert_eq!(lower.available(t0 + ms(100)), 0);
        // Two of four must expire: the third admission's instant plus the window.
        assert_eq!(lower.ready_at(1, t0 + ms(100)), Some(t0 + ms(1020)));
        assert_eq!(lower.ready_at(2, t0 + ms(100)), Some(t0 + ms(1030)));
        assert_eq!(
            l.clone()
                .carry(&sliding(10, 1000), t0 + ms(100), 1)
                .available(t0 + ms(100)),
            6
        );
        // A shorter window forgets what falls out of it.
        assert_eq!(
            l.carry(&sliding(5, 200), t0 + ms(500), 1)
                .available(t0 + ms(500)),
            5
        );

        let fixed = |p| Limit::FixedWindow {
            permits: nz(p),
            window: ms(1000),
            scope: Default::default(),
        };
        let mut f = LimitState::new(&fixed(5), t0);
        for _ in 0..3 {
            f.take(t0);
        }
        let mut lower = f.clone().carry(&fixed(2), t0 + ms(100), 1);
        assert_eq!(lower.available(t0 + ms(100)), 0);
        assert_eq!(
            lower.available(t0 + ms(1000)),
            2,
            "the next window is whole"
        );
        assert_eq!(f.carry(&fixed(10), t0 + ms(100), 1).available(t0), 7);

        let conc = |m| Limit::Concurrency {
            max: nz(m),
            scope: Default::default(),
        };
        let mut c = LimitState::new(&conc(4), t0);
        for _ in 0..3 {
            c.take(t0);
        }
        let mut lower = c.carry(&conc(2), t0, 1);
        assert_eq!(lower.available(t0), 0);
        lower.release(0);
        assert_eq!(lower.available(t0), 0);
        lower.release(0);
        assert_eq!(lower.available(t0), 1);
        // A limit born in epoch 1 was never paid by a permit of epoch 0.
        let mut born = LimitState::new_in(&conc(2), t0, 1);
        born.take(t0);
        born.release(0);
        assert_eq!(born.available(t0), 1);
        born.release(1);
        assert_eq!(born.available(t0), 2);
    }

    #[test]
    fn a_changed_kind_starts_fresh() {
        let t0 = Instant::now();
        let mut l = token(1, Duration::from_secs(1), 1, t0);
        l.take(t0);
        let spec = Limit::SlidingWindow {
            permits: nz(3),
            window: ms(1000),
            scope: Default::default(),
        };
        assert!(!l.same_kind(&spec));
        assert_eq!(l.carry(&spec, t0, 1).available(t0), 3);
    }
}
