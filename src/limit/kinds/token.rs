//! A token bucket as the provider runs it, in GCRA form, fed with the instants at which
//! requests may have reached the provider rather than the instants sluice admitted them.
//! Three kinds run on it: `token_bucket` as written, `leaky_bucket` in nginx's units and
//! `published`, which paces (see [`Pace`]).

use std::time::Duration;

use tokio::time::Instant;

use super::time::Id;
use crate::config::Limit;

/// The rule a GCRA enforces: one request every `per_ns / rate` nanoseconds, and requests
/// up to `tau / rate` nanoseconds ahead of that schedule (`tau` is in nanoseconds times
/// `rate`, so neither needs rounding).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Pace {
    pub(crate) rate: u128,
    pub(crate) per_ns: u128,
    pub(crate) tau: u128,
}

const MS: u128 = 1_000_000;

impl Pace {
    /// `rate` per `per`, `burst` at once.
    pub(crate) fn token(rate: u32, per: Duration, burst: u32) -> Pace {
        let per_ns = per.as_nanos();
        Pace {
            rate: u128::from(rate),
            per_ns,
            tau: u128::from(burst.saturating_sub(1)) * per_ns,
        }
    }

    /// nginx `limit_req` at `rate` per `per` with `burst`, as nginx counts it: the rate in
    /// thousandths of a request per second, truncated (`100r/m` is 1666), time in whole
    /// milliseconds, and each request's excess drained by `rate × ms / 1000`, truncated.
    /// nginx refuses a request when the excess it would leave exceeds `burst`.
    ///
    /// A GCRA whose interval and tolerance are whole milliseconds accepts the arrivals
    /// nginx sees (its clock truncated to the millisecond) whenever it accepts the real
    /// ones: `floor(b) - floor(a) >= floor(b - a)`. With a rate of whole requests per
    /// second nginx drains exactly `r/1000` per millisecond, so an interval of
    /// `ceil(1000 / r)` ms and a tolerance of `burst` intervals keep the excess within
    /// `burst`: after k requests since the excess was last zero it is at most
    /// `1000k - r(kT - τ)`, which is at most `1000 × burst`. Otherwise every truncated
    /// drain can lose up to a thousandth of a request, so each request costs 1001
    /// thousandths and the tolerance is the exact `burst × 10⁶ / r` ms, rounded down.
    /// `None` when the rate is below one request in 1000 seconds (nginx reads it as 0).
    pub(crate) fn nginx(rate: u32, per: Duration, burst: u32) -> Option<Pace> {
        let milli = u128::from(rate) * 1000 * 1_000_000_000 / per.as_nanos().max(1);
        if milli == 0 {
            return None;
        }
        let exact = milli.is_multiple_of(1000);
        let cost: u128 = if exact { 1000 } else { 1001 };
        let interval_ms = (cost * 1000).div_ceil(milli);
        let tau_ms = if exact {
            u128::from(burst) * interval_ms
        } else {
            u128::from(burst) * 1_000_000 / milli
        };
        Some(Pace {
            rate: 1,
            per_ns: interval_ms * MS,
            tau: tau_ms * MS,
        })
    }

    /// `permits` per `window` whatever the provider's algorithm: one request at a time,
    /// spaced so that a token bucket with a burst of 1 accepts them (`window / permits`
    /// apart), a sliding counter at any alignment that reads its clock to the millisecond
    /// does too (more than `(window + 1 ms) / permits`: at that spacing its estimate can
    /// reach the limit exactly), and so does a bucket that counts in whole milliseconds
    /// (nginx: `window / permits` rounded up to whole milliseconds when it is at least one).
    pub(crate) fn published(permits: u32, window: Duration) -> Pace {
        let p = u128::from(permits);
        let w = window.as_nanos();
        // One nanosecond per request more than (window + 1 ms) / permits.
        let spread = Pace {
            rate: p,
            per_ns: w + MS + p,
            tau: 0,
        };
        let whole_ms = (w / p).div_ceil(MS) * MS;
        if w / p >= MS && whole_ms * p > w + MS + p {
            Pace {
                rate: 1,
                per_ns: whole_ms,
                tau: 0,
            }
        } else {
            spread
        }
    }

    /// The pace of a limit that runs on a GCRA, `None` for the others (and for a
    /// `leaky_bucket` slower than nginx can count, which validation refuses).
    pub(crate) fn of(spec: &Limit) -> Option<Pace> {
        match *spec {
            Limit::TokenBucket {
                rate, per, burst, ..
            } => Some(Pace::token(rate.get(), per, burst.get())),
            Limit::LeakyBucket {
                rate, per, burst, ..
            } => Pace::nginx(rate.get(), per, burst),
            Limit::Published {
                permits, window, ..
            } => Some(Pace::published(permits.get(), window)),
            _ => None,
        }
    }

    /// The interval between two requests, in nanoseconds.
    pub(crate) fn interval_ns(&self) -> f64 {
        self.per_ns as f64 / self.rate as f64
    }

    /// How far ahead of the schedule a request may go, in nanoseconds.
    pub(crate) fn tolerance_ns(&self) -> f64 {
        self.tau as f64 / self.rate as f64
    }

    /// Requests at once from rest.
    pub(crate) fn burst(&self) -> u64 {
        (self.tau / self.per_ns + 1) as u64
    }
}

/// GCRA in integers: `tat` is the theoretical arrival time of the next request, in
/// nanoseconds since `base` multiplied by `rate`, so that the emission interval `per / rate`
/// needs no rounding.
///
/// Admitted requests that have not been sent yet (`pending`) hold their tokens (one for a
/// limit that counts requests, their cost for one that counts a unit): they will
/// reach the provider at some instant from now on, and the bucket only fills with time, so
/// admitting a request while more than `pending` tokens are available now keeps every one
/// of them conforming whenever it is sent. A sent request enters `tat` at the latest
/// instant the provider may have counted it (its send plus the margin, or its response
/// if that came first), which is the worst case for every later one.
#[derive(Debug, Clone)]
pub(super) struct Gcra {
    rate: u128,
    per_ns: u128,
    tau: u128,
    base: Instant,
    tat: u128,
    pub(super) margin: Duration,
    pub(super) pending: u64,
    /// The last send folded into `tat`: its id, `tat` before it, the arrival bound it
    /// used and its weight, so that a response before the margin ran out can take back
    /// what it assumed.
    last: Option<(Id, u128, u128, u64)>,
    /// The latest arrival bound of every send before `last`: until then one of them may
    /// not have reached the provider, and a refund could not be given back safely.
    settled_by: u128,
}

impl Gcra {
    pub(super) fn new(pace: Pace, margin: Duration, now: Instant) -> Gcra {
        Gcra {
            rate: pace.rate,
            per_ns: pace.per_ns,
            tau: pace.tau,
            base: now,
            tat: 0,
            margin,
            pending: 0,
            last: None,
            settled_by: 0,
        }
    }

    fn scaled(&self, t: Instant) -> u128 {
        t.saturating_duration_since(self.base).as_nanos() * self.rate
    }

    fn tau(&self) -> u128 {
        self.tau
    }

    pub(super) fn pace(&self) -> Pace {
        Pace {
            rate: self.rate,
            per_ns: self.per_ns,
            tau: self.tau,
        }
    }

    /// This bucket under a changed spec (a reload), keeping its debt in permits.
    pub(super) fn carry(self, pace: Pace, margin: Duration, now: Instant) -> Gcra {
        // Debt in scaled units: `per_ns` is one permit. Rounded up, so the conversion never
        // creates a permit.
        let debt = self.tat.saturating_sub(self.scaled(now));
        let fresh = Gcra::new(pace, margin, now);
        // Sends folded in before the reload may reach the provider until their margin
        // has passed: no refund before then.
        let settled_by = fresh.scaled(now + self.margin.max(margin));
        Gcra {
            tat: (debt * pace.per_ns).div_ceil(self.per_ns),
            pending: self.pending,
            settled_by,
            ..fresh
        }
    }

    /// Tokens available now, before the pending requests take theirs.
    fn tokens(&self, now: Instant) -> u64 {
        let t = self.scaled(now);
        let next = self.tat.max(t);
        // Admissions k = 0.. while next + k·T <= t + τ.
        if next > t + self.tau() {
            0
        } else {
            ((t + self.tau() - next) / self.per_ns + 1) as u64
        }
    }

    pub(super) fn available(&self, now: Instant) -> u64 {
        self.tokens(now).saturating_sub(self.pending)
    }

    pub(super) fn sent(&mut self, id: Id, w: u64, reserved: bool, now: Instant) {
        if reserved {
            self.pending = self.pending.saturating_sub(w);
        }
        let latest = self.scaled(now + self.margin);
        let before = self.tat;
        self.tat = before.max(latest) + u128::from(w) * self.per_ns;
        if let Some((_, _, earlier, _)) = self.last {
            self.settled_by = self.settled_by.max(earlier);
        }
        self.last = Some((id, before, latest, w));
    }

    pub(super) fn answered(&mut self, id: Id, now: Instant) {
        // Only the last send can be re-folded: ones after it were folded on top of it.
        let Some((_, before, latest, w)) = self.last.filter(|l| l.0 == id) else {
            return;
        };
        let r = self.scaled(now);
        if r < latest {
            self.tat = before.max(r) + u128::from(w) * self.per_ns;
            self.last = Some((id, before, r, w));
        }
    }

    /// Admission `id`, sent weighing `was`, weighs `w` now: the difference is paid back
    /// into the bucket, or owed by it (the bucket goes into debt: nothing more is admitted
    /// until time has paid it), as the provider settles a request's true cost.
    ///
    /// A refund is what the provider gives back: never beyond a full bucket, and never out
    /// of the charge of a request that may not have reached it yet. The last send is
    /// folded in again over the refunded state; while an earlier send may still be on
    /// its way (its margin has not passed), the estimate stands.
    pub(super) fn reweigh(&mut self, id: Id, was: u64, w: u64, now: Instant) {
        let per = self.per_ns;
        if w >= was {
            self.tat += u128::from(w - was) * per;
            if let Some(last) = self.last.as_mut().filter(|l| l.0 == id) {
                last.3 = w;
            }
            return;
        }
        let r = self.scaled(now);
        let back = u128::from(was - w) * per;
        let refund = |t: u128| t.saturating_sub(back).max(r.min(t));
        match self.last {
            // Its own send is the last: folded in again at its new weight.
            Some((last, before, latest, _)) if last == id => {
                self.tat = (before.max(latest) + u128::from(w) * per).max(r.min(self.tat));
                self.last = Some((id, before, latest, w));
            }
            _ if self.settled_by > r => {}
            // The last send may still be on its way: the refund goes under it.
            Some((last, before, latest, lw)) if latest > r => {
                let before = refund(before);
                self.tat = before.max(latest) + u128::from(lw) * per;
                self.last = Some((last, before, latest, lw));
            }
            _ => self.tat = refund(self.tat),
        }
    }

    /// The earliest instant the `n`-th request from now could be admitted, a lower bound:
    /// the pending requests go first, as if they were sent at once.
    pub(super) fn ready_at(&self, n: u64, now: Instant) -> Instant {
        let t = self.scaled(now);
        let need = self.tat.max(t) + u128::from(n + self.pending - 1) * self.per_ns;
        if need <= t + self.tau() {
            return now;
        }
        // Scaled units back to nanoseconds, rounding up so the instant admits.
        let at_ns = (need - self.tau()).div_ceil(self.rate);
        self.base + Duration::from_nanos(u64::try_from(at_ns).unwrap_or(u64::MAX))
    }

    pub(super) fn is_pristine(&self, now: Instant) -> bool {
        self.pending == 0 && self.tat <= self.scaled(now)
    }
}
