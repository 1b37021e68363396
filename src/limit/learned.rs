//! A partition's pace learned from the provider (`learn = "headers"`): when a response
//! says fewer requests remain in the provider's window than sluice's own limits would
//! still admit, someone else spends the same key, and what remains is spread evenly
//! over the time to the reset. The gate is gone at the reset, and as soon as the
//! provider announces at least what sluice believes it has. Pure in `now`.

use std::time::Duration;

use tokio::time::Instant;

use crate::policy::announced::Announced;

#[derive(Debug, Clone)]
pub(crate) struct Learned {
    /// What the provider said, and when the response arrived.
    pub(crate) announced: Announced,
    /// The provider's reset: from then on the configured limits alone decide.
    pub(crate) reset: Instant,
    /// Admissions left before the reset.
    pub(crate) left: u64,
    /// Between two admissions: the time to the reset shared by what remained.
    interval: Duration,
    /// The earliest next admission.
    next: Instant,
}

impl Learned {
    /// Whether `a`, announced at `now` while sluice's own limits would admit `believed`
    /// more, means slowing down. `None`: it does not (sluice is the only spender it sees).
    /// `before`: the pace learned so far, whose spacing a new announcement keeps (every
    /// response would otherwise let the next request through at once).
    pub(crate) fn from(
        a: Announced,
        believed: u64,
        now: Instant,
        before: Option<&Learned>,
    ) -> Option<Learned> {
        if a.remaining >= believed || a.reset.is_zero() {
            return None;
        }
        let interval = if a.remaining == 0 {
            a.reset
        } else {
            a.reset / u32::try_from(a.remaining).unwrap_or(u32::MAX)
        };
        let next = before
            .filter(|b| b.active(now))
            .map_or(now, |b| b.next.clamp(now, now + interval));
        Some(Learned {
            announced: a,
            reset: now + a.reset,
            left: a.remaining,
            interval,
            next,
        })
    }

    pub(crate) fn active(&self, now: Instant) -> bool {
        now < self.reset
    }

    pub(crate) fn can_take(&self, now: Instant) -> bool {
        self.can_take_n(1, now)
    }

    /// Whether an admission costing `w` of the budget's unit may pass now; one that costs
    /// nothing of it always may.
    pub(crate) fn can_take_n(&self, w: u64, now: Instant) -> bool {
        w == 0 || !self.active(now) || (self.left >= w && now >= self.next)
    }

    pub(crate) fn take(&mut self, now: Instant) {
        self.take_n(1, now);
    }

    /// An admission costing `w`: what remains shrinks by it, and the next waits `w`
    /// intervals (the budget spread evenly over the time to the reset).
    pub(crate) fn take_n(&mut self, w: u64, now: Instant) {
        if w > 0 && self.active(now) {
            self.left = self.left.saturating_sub(w);
            let w = u32::try_from(w).unwrap_or(u32::MAX);
            self.next = self.next.max(now) + self.interval.saturating_mul(w);
        }
    }

    /// For a budget in a priced unit: the earliest instant admissions costing `total` in
    /// all could have passed, a lower bound (the last of them may go at the next slot).
    pub(crate) fn ready_for(&self, total: u64, now: Instant) -> Instant {
        if !self.active(now) || total == 0 {
            now
        } else if total > self.left {
            self.reset
        } else {
            self.next.max(now)
        }
    }

    /// The earliest instant the `n`-th next admission could pass.
    pub(crate) fn ready_at(&self, n: u64, now: Instant) -> Instant {
        if !self.active(now) {
            return now;
        }
        if n > self.left {
            return self.reset;
        }
        let spaced = self
            .interval
            .saturating_mul(u32::try_from(n - 1).unwrap_or(u32::MAX));
        (self.next.max(now) + spaced).min(self.reset)
    }

    /// Requests per second the provider's announcement leaves, over its whole window.
    pub(crate) fn rate(&self) -> f64 {
        self.announced.remaining as f64 / self.announced.reset.as_secs_f64().max(1e-3)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn announced(remaining: u64, secs: u64) -> Announced {
        Announced {
            remaining,
            reset: Duration::from_secs(secs),
            source: "ratelimit",
            unit: "requests",
        }
    }

    #[test]
    fn a_budget_of_tokens_spreads_over_the_time_to_the_reset() {
        let t0 = Instant::now();
        // 1,000 tokens left over 10 s, while sluice believed 5,000: 10 ms a token.
        let mut l = Learned::from(announced(1000, 10), 5000, t0, None).unwrap();
        assert!(l.can_take_n(300, t0) && !l.can_take_n(1001, t0));
        l.take_n(300, t0);
        assert!(!l.can_take_n(1, t0 + Duration::from_millis(2999)));
        assert!(
            l.can_take_n(0, t0),
            "a request that costs none of it passes"
        );
        assert!(l.can_take_n(700, t0 + Duration::from_secs(3)));
        assert!(!l.can_take_n(701, t0 + Duration::from_secs(3)));
        assert_eq!(l.ready_for(0, t0), t0);
        assert_eq!(l.ready_for(700, t0), t0 + Duration::from_secs(3));
        assert_eq!(l.ready_for(701, t0), t0 + Duration::from_secs(10));
    }

    #[test]
    fn what_remains_is_spread_to_the_reset_then_the_gate_is_gone() {
        let t0 = Instant::now();
        assert!(
            Learned::from(announced(10, 10), 10, t0, None).is_none(),
            "sluice alone"
        );
        let mut l = Learned::from(announced(4, 8), 10, t0, None).unwrap();
        let mut admitted = Vec::new();
        let mut now = t0;
        while now < t0 + Duration::from_secs(12) {
            if l.can_take(now) {
                l.take(now);
                admitted.push((now - t0).as_secs());
            }
            now += Duration::from_millis(250);
        }
        // 4 over 8 s, 2 s apart; then the provider's new window: no gate.
        assert_eq!(&admitted[..4], &[0, 2, 4, 6]);
        assert_eq!(admitted[4], 8);
        assert!(admitted.len() > 10);
        let later = t0 + Duration::from_secs(12);
        assert_eq!(l.ready_at(100, later), later);
    }

    #[test]
    fn nothing_left_waits_for_the_reset() {
        let t0 = Instant::now();
        let l = Learned::from(announced(0, 5), 3, t0, None).unwrap();
        assert!(!l.can_take(t0));
        assert_eq!(l.ready_at(1, t0), t0 + Duration::from_secs(5));
        assert!(l.can_take(t0 + Duration::from_secs(5)));
    }

    #[test]
    fn ready_at_counts_the_spacing_and_the_reset() {
        let t0 = Instant::now();
        let mut l = Learned::from(announced(3, 6), 9, t0, None).unwrap();
        assert_eq!(l.ready_at(1, t0), t0);
        assert_eq!(l.ready_at(3, t0), t0 + Duration::from_secs(4));
        assert_eq!(l.ready_at(4, t0), t0 + Duration::from_secs(6));
        l.take(t0);
        assert_eq!(
            (l.left, l.ready_at(1, t0)),
            (2, t0 + Duration::from_secs(2))
        );
        // The next announcement keeps the spacing rather than opening the gate at once,
        // within its own interval.
        let t1 = t0 + Duration::from_millis(100);
        let again = Learned::from(announced(2, 6), 9, t1, Some(&l)).unwrap();
        assert_eq!(again.ready_at(1, t1), t0 + Duration::from_secs(2));
        let many = Learned::from(announced(60, 6), 90, t1, Some(&l)).unwrap();
        assert_eq!(many.ready_at(1, t1), t1 + Duration::from_millis(100));
    }
}
