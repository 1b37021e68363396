//! A rolling window of counters split into ten slots, shared by the retry budget and the
//! circuit breaker. Pure in `now`: old slots are cleared as time moves past them.

use std::time::Duration;

use tokio::time::Instant;

const SLOTS: usize = 10;

#[derive(Debug, Clone)]
pub(super) struct Rolling {
    base: Instant,
    slot: Duration,
    /// Index (in slot lengths since `base`) of the newest slot written.
    head: u64,
    counts: [[u64; 2]; SLOTS],
}

impl Rolling {
    pub(super) fn new(window: Duration, now: Instant) -> Rolling {
        Rolling {
            base: now,
            slot: (window / SLOTS as u32).max(Duration::from_millis(1)),
            head: 0,
            counts: [[0; 2]; SLOTS],
        }
    }

    fn advance(&mut self, now: Instant) -> usize {
        let idx =
            (now.saturating_duration_since(self.base).as_nanos() / self.slot.as_nanos()) as u64;
        if idx > self.head {
            let stale = (idx - self.head).min(SLOTS as u64);
            for i in 1..=stale {
                self.counts[((self.head + i) % SLOTS as u64) as usize] = [0; 2];
            }
            self.head = idx;
        }
        (self.head % SLOTS as u64) as usize
    }

    /// Adds one to counter `which` (0 or 1) at `now`.
    pub(super) fn add(&mut self, which: usize, now: Instant) {
        let i = self.advance(now);
        self.counts[i][which] += 1;
    }

    /// Both counters summed over the window ending at `now`.
    pub(super) fn totals(&mut self, now: Instant) -> [u64; 2] {
        self.advance(now);
        self.counts
            .iter()
            .fold([0; 2], |acc, c| [acc[0] + c[0], acc[1] + c[1]])
    }

    pub(super) fn clear(&mut self) {
        self.counts = [[0; 2]; SLOTS];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_expire_slot_by_slot() {
        let t0 = Instant::now();
        let mut r = Rolling::new(Duration::from_secs(10), t0);
        r.add(0, t0);
        r.add(1, t0 + Duration::from_secs(5));
        assert_eq!(r.totals(t0 + Duration::from_millis(9_999)), [1, 1]);
        assert_eq!(r.totals(t0 + Duration::from_secs(10)), [0, 1]);
        assert_eq!(r.totals(t0 + Duration::from_secs(16)), [0, 0]);
        r.add(0, t0 + Duration::from_secs(100));
        assert_eq!(r.totals(t0 + Duration::from_secs(100)), [1, 0]);
    }
}
