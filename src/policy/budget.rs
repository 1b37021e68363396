//! The retry budget: over the last `window`, retries may add at most `ratio` of an
//! upstream's requests plus `min_per_second` per second. It caps the extra load retries
//! put on an upstream that is struggling, which is exactly when every request fails.

use tokio::time::Instant;

use super::window::Rolling;
use crate::config::BudgetPolicy;

const REQUESTS: usize = 0;
const RETRIES: usize = 1;

#[derive(Debug)]
pub(crate) struct RetryBudget {
    policy: BudgetPolicy,
    counts: Rolling,
}

impl RetryBudget {
    pub(crate) fn new(policy: &BudgetPolicy, now: Instant) -> RetryBudget {
        RetryBudget {
            policy: policy.clone(),
            counts: Rolling::new(policy.window, now),
        }
    }

    /// A request arrived (its first attempt).
    pub(crate) fn record_request(&mut self, now: Instant) {
        self.counts.add(REQUESTS, now);
    }

    /// Takes one retry from the budget, if there is one left.
    pub(crate) fn try_retry(&mut self, now: Instant) -> bool {
        let [requests, retries] = self.counts.totals(now);
        let allowed = self.policy.ratio * requests as f64
            + f64::from(self.policy.min_per_second) * self.policy.window.as_secs_f64();
        if (retries as f64) < allowed.floor() {
            self.counts.add(RETRIES, now);
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn ratio_plus_floor_then_refills() {
        let t0 = Instant::now();
        let p = BudgetPolicy {
            ratio: 0.2,
            min_per_second: 1,
            window: Duration::from_secs(10),
        };
        let mut b = RetryBudget::new(&p, t0);
        for _ in 0..100 {
            b.record_request(t0);
        }
        // 20% of 100 plus 1/s over 10 s.
        let granted = (0..100).filter(|_| b.try_retry(t0)).count();
        assert_eq!(granted, 30);
        assert!(!b.try_retry(t0 + Duration::from_secs(9)));
        assert!(
            b.try_retry(t0 + Duration::from_secs(10)),
            "the window moved on"
        );
    }
}
