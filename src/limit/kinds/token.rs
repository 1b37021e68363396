//! A token bucket as the provider runs it, in GCRA form, fed with the instants at which
//! requests may have reached the provider rather than the instants sluice admitted them.

use std::time::Duration;

use tokio::time::Instant;

use super::time::Id;

/// GCRA in integers: `tat` is the theoretical arrival time of the next request, in
/// nanoseconds since `base` multiplied by `rate`, so that the emission interval `per / rate`
/// needs no rounding.
///
/// Admitted requests that have not been sent yet (`pending`) hold a token each: they will
/// reach the provider at some instant from now on, and the bucket only fills with time, so
/// admitting a request while more than `pending` tokens are available now keeps every one
/// of them conforming whenever it is sent. A sent request enters `tat` at the latest
/// instant the provider may have counted it (its send plus the margin, or its response
/// if that came first), which is the worst case for every later one.
#[derive(Debug, Clone)]
pub struct Gcra {
    rate: u128,
    per_ns: u128,
    burst: u128,
    base: Instant,
    tat: u128,
    pub(super) margin: Duration,
    pub(super) pending: u64,
    /// The last send folded into `tat`: its id, `tat` before it, and the arrival bound it
    /// used, so that a response before the margin ran out can take back what it assumed.
    last: Option<(Id, u128, u128)>,
}

impl Gcra {
    pub fn new(rate: u32, per: Duration, burst: u32, margin: Duration, now: Instant) -> Gcra {
        Gcra {
            rate: u128::from(rate),
            per_ns: per.as_nanos(),
            burst: u128::from(burst),
            base: now,
            tat: 0,
            margin,
            pending: 0,
            last: None,
        }
    }

    fn scaled(&self, t: Instant) -> u128 {
        t.saturating_duration_since(self.base).as_nanos() * self.rate
    }

    fn tau(&self) -> u128 {
        (self.burst - 1) * self.per_ns
    }

    /// This bucket under a changed spec (a reload), keeping its debt in permits.
    pub fn carry(
        self,
        rate: u32,
        per: Duration,
        burst: u32,
        margin: Duration,
        now: Instant,
    ) -> Gcra {
        // Debt in scaled units: `per_ns` is one permit. Rounded up, so the conversion never
        // creates a permit.
        let debt = self.tat.saturating_sub(self.scaled(now));
        let new_per = per.as_nanos();
        Gcra {
            tat: (debt * new_per).div_ceil(self.per_ns),
            pending: self.pending,
            ..Gcra::new(rate, per, burst, margin, now)
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

    pub fn available(&self, now: Instant) -> u64 {
        self.tokens(now).saturating_sub(self.pending)
    }

    pub fn sent(&mut self, id: Id, reserved: bool, now: Instant) {
        if reserved {
            self.pending = self.pending.saturating_sub(1);
        }
        let latest = self.scaled(now + self.margin);
        let before = self.tat;
        self.tat = before.max(latest) + self.per_ns;
        self.last = Some((id, before, latest));
    }

    pub fn answered(&mut self, id: Id, now: Instant) {
        let Some((last, before, latest)) = self.last else {
            return;
        };
        let r = self.scaled(now);
        // Only the last send can be re-folded: ones after it were folded on top of it.
        if last == id && r < latest {
            self.tat = before.max(r) + self.per_ns;
            self.last = Some((id, before, r));
        }
    }

    /// The earliest instant the `n`-th request from now could be admitted, a lower bound:
    /// the pending requests go first, as if they were sent at once.
    pub fn ready_at(&self, n: u64, now: Instant) -> Instant {
        let t = self.scaled(now);
        let need = self.tat.max(t) + u128::from(n + self.pending - 1) * self.per_ns;
        if need <= t + self.tau() {
            return now;
        }
        // Scaled units back to nanoseconds, rounding up so the instant admits.
        let at_ns = (need - self.tau()).div_ceil(self.rate);
        self.base + Duration::from_nanos(u64::try_from(at_ns).unwrap_or(u64::MAX))
    }

    pub fn is_pristine(&self, now: Instant) -> bool {
        self.pending == 0 && self.tat <= self.scaled(now)
    }
}
