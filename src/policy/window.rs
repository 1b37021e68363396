//! A rolling window of counters split into ten slots, shared by the retry budget and the
//! circuit breaker. Pure in `now`: old slots are cleared as time moves past them.

use std::time::Duration;

use tokio::time::Instant;

const SLOTS: usize = 10;

#[derive(Debug, Clone)]
pub(super) struct Rolling {
    base: Instant,
    /// A slot's length in nanoseconds: slots are counted in 64 bits (584 years of them),
    /// where `Duration::as_nanos` would divide in 128.
    slot: u64,
    /// Index (in slot lengths since `base`) of the newest slot written.
    head: u64,
    /// Where the newest slot ends: until then a count goes to it as it is, without the
    /// difference of instants (about 40 instructions) that finds its index.
    head_ends: Instant,
    counts: [[u64; 2]; SLOTS],
    /// The sum of `counts`, kept as slots fill and clear: the breaker reads it after
    /// every answer.
    sum: [u64; 2],
}

impl Rolling {
    pub(super) fn new(window: Duration, now: Instant) -> Rolling {
        let slot = (window / SLOTS as u32).max(Duration::from_millis(1));
        Rolling {
            base: now,
            slot: nanos(slot),
            head: 0,
            head_ends: now + slot,
            counts: [[0; 2]; SLOTS],
            sum: [0; 2],
        }
    }

    fn advance(&mut self, now: Instant) -> usize {
        if now < self.head_ends {
            return (self.head % SLOTS as u64) as usize;
        }
        let idx = nanos(now.saturating_duration_since(self.base)) / self.slot;
        if idx > self.head {
            let stale = (idx - self.head).min(SLOTS as u64);
            for i in 1..=stale {
                let old =
                    std::mem::take(&mut self.counts[((self.head + i) % SLOTS as u64) as usize]);
                self.sum = [self.sum[0] - old[0], self.sum[1] - old[1]];
            }
            self.head = idx;
            let ends = Duration::from_nanos(idx.saturating_add(1).saturating_mul(self.slot));
            self.head_ends = self.base.checked_add(ends).unwrap_or(now);
        }
        (self.head % SLOTS as u64) as usize
    }

    /// Adds one to counter `which` (0 or 1) at `now`, and returns both counters summed
    /// over the window ending at `now`, this one included.
    pub(super) fn add(&mut self, which: usize, now: Instant) -> [u64; 2] {
        let i = self.advance(now);
        self.counts[i][which] += 1;
        self.sum[which] += 1;
        self.sum
    }

    /// Both counters summed over the window ending at `now`.
    pub(super) fn totals(&mut self, now: Instant) -> [u64; 2] {
        self.advance(now);
        self.sum
    }

    pub(super) fn clear(&mut self) {
        self.counts = [[0; 2]; SLOTS];
        self.sum = [0; 2];
    }
}

/// `d` in nanoseconds, saturating at `u64::MAX`.
fn nanos(d: Duration) -> u64 {
    d.as_secs()
        .saturating_mul(1_000_000_000)
        .saturating_add(u64::from(d.subsec_nanos()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn counts_expire_slot_by_slot() {
        let t0 = Instant::now();
        let mut r = Rolling::new(Duration::from_secs(10), t0);
        r.add(0, t0);
        r.add(1, t0 + Duration::from_secs(5));
        assert_eq!(r.totals(t0 + Duration::from_millis(9_999)), [1, 1]);
        assert_eq!(r.totals(t0 + Duration::from_secs(10)), [0, 1]);
        assert_eq!(r.totals(t0 + Duration::from_secs(16)), [0, 0]);
        assert_eq!(r.add(0, t0 + Duration::from_secs(100)), [1, 0]);
        assert_eq!(r.totals(t0 + Duration::from_secs(100)), [1, 0]);
    }

    proptest! {
        /// Whatever the arrivals, the totals are the events of the last ten slots: those
        /// at or after the start of the slot nine before the current one.
        #[test]
        fn totals_count_the_last_ten_slots(
            steps in proptest::collection::vec((0..3usize, 0..2_500u64), 1..200),
        ) {
            let t0 = Instant::now();
            let slot = Duration::from_millis(100);
            let mut r = Rolling::new(slot * SLOTS as u32, t0);
            let mut events: Vec<(u64, usize)> = Vec::new();
            let mut at = Duration::ZERO;
            for (op, gap_ms) in steps {
                at += Duration::from_millis(gap_ms / 10);
                let idx = nanos(at) / nanos(slot);
                let got = match op {
                    2 => r.totals(t0 + at),
                    which => {
                        events.push((idx, which));
                        r.add(which, t0 + at)
                    }
                };
                let mut want = [0; 2];
                for &(e, which) in &events {
                    if e + SLOTS as u64 > idx {
                        want[which] += 1;
                    }
                }
                prop_assert_eq!(got, want);
            }
        }
    }
}
