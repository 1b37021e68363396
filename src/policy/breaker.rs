//! The circuit breaker, a pure state machine in `now`:
//! closed → open when, over the last `window`, at least `min_requests` attempts ended and
//! the share of failures reached `failure_ratio`; open → half-open after `open_for`; in
//! half-open one probe at a time, whose success closes and whose failure reopens.

use std::time::Duration;

use tokio::time::Instant;

use super::window::Rolling;
use crate::config::BreakerPolicy;

const OK: usize = 0;
const FAILED: usize = 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum State {
    Closed,
    Open { until: Instant },
    HalfOpen { probing: bool },
}

impl State {
    pub(crate) fn name(&self) -> &'static str {
        match self {
            State::Closed => "closed",
            State::Open { .. } => "open",
            State::HalfOpen { .. } => "half_open",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Admit {
    /// Closed: go ahead.
    Yes,
    /// Half-open: this request is the one probe; report its outcome with `probe = true`.
    Probe,
    /// Open (or a probe is under way): fail fast.
    No { retry_after: Duration },
}

#[derive(Debug)]
pub(crate) struct Breaker {
    policy: BreakerPolicy,
    state: State,
    outcomes: Rolling,
}

impl Breaker {
    pub(crate) fn new(policy: &BreakerPolicy, now: Instant) -> Breaker {
        Breaker {
            policy: policy.clone(),
            state: State::Closed,
            outcomes: Rolling::new(policy.window, now),
        }
    }

    pub(crate) fn state(&self) -> State {
        self.state
    }

    pub(crate) fn admit(&mut self, now: Instant) -> Admit {
        match self.state {
            State::Closed => Admit::Yes,
            State::Open { until } if now < until => Admit::No {
                retry_after: until - now,
            },
            State::Open { .. } | State::HalfOpen { probing: false } => {
                self.state = State::HalfOpen { probing: true };
                Admit::Probe
            }
            State::HalfOpen { probing: true } => Admit::No {
                retry_after: Duration::from_secs(1),
            },
        }
    }

    /// An attempt ended. Outcomes of attempts let in while closed count only while it is
    /// still closed; in half-open only the probe decides.
    pub(crate) fn record(&mut self, failed: bool, probe: bool, now: Instant) {
        match self.state {
            State::HalfOpen { .. } if probe => {
                self.outcomes.clear();
                self.state = if failed {
                    State::Open {
                        until: now + self.policy.open_for,
                    }
                } else {
                    State::Closed
                };
            }
            State::Closed => {
                let [ok, bad] = self.outcomes.add(if failed { FAILED } else { OK }, now);
                let total = ok + bad;
                if total >= u64::from(self.policy.min_requests)
                    && bad as f64 >= self.policy.failure_ratio * total as f64
                {
                    self.outcomes.clear();
                    self.state = State::Open {
                        until: now + self.policy.open_for,
                    };
                }
            }
            _ => {}
        }
    }

    /// The probe ended without an outcome (its client went away): let another one try.
    pub(crate) fn abandon_probe(&mut self) {
        if self.state == (State::HalfOpen { probing: true }) {
            self.state = State::HalfOpen { probing: false };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn breaker(now: Instant) -> Breaker {
        let p = BreakerPolicy {
            failure_ratio: 0.5,
            min_requests: 4,
            window: Duration::from_secs(10),
            open_for: Duration::from_secs(5),
        };
        Breaker::new(&p, now)
    }

    #[test]
    fn opens_on_ratio_with_enough_requests() {
        let t0 = Instant::now();
        let mut b = breaker(t0);
        b.record(true, false, t0);
        b.record(true, false, t0);
        b.record(true, false, t0);
        assert_eq!(b.state(), State::Closed, "3 < min_requests");
        b.record(false, false, t0);
        assert_eq!(
            b.state(),
            State::Open {
                until: t0 + Duration::from_secs(5)
            }
        );
        assert_eq!(
            b.admit(t0 + Duration::from_secs(2)),
            Admit::No {
                retry_after: Duration::from_secs(3)
            }
        );
    }

    #[test]
    fn failures_age_out_of_the_window() {
        let t0 = Instant::now();
        let mut b = breaker(t0);
        b.record(true, false, t0);
        b.record(true, false, t0);
        for _ in 0..2 {
            b.record(false, false, t0 + Duration::from_secs(11));
        }
        assert_eq!(
            b.state(),
            State::Closed,
            "only 2 recent attempts, both fine"
        );
    }

    #[test]
    fn half_open_lets_one_probe_and_decides_on_it() {
        let t0 = Instant::now();
        let mut b = breaker(t0);
        for _ in 0..4 {
            b.record(true, false, t0);
        }
        let t1 = t0 + Duration::from_secs(5);
        assert_eq!(b.admit(t1), Admit::Probe);
        assert!(
            matches!(b.admit(t1), Admit::No { .. }),
            "one probe at a time"
        );
        b.record(true, false, t1); // a late non-probe outcome does not decide
        assert_eq!(b.state(), State::HalfOpen { probing: true });
        b.record(true, true, t1);
        assert_eq!(
            b.state(),
            State::Open {
                until: t1 + Duration::from_secs(5)
            }
        );

        let t2 = t1 + Duration::from_secs(5);
        assert_eq!(b.admit(t2), Admit::Probe);
        b.abandon_probe();
        assert_eq!(
            b.admit(t2),
            Admit::Probe,
            "an abandoned probe frees the slot"
        );
        b.record(false, true, t2);
        assert_eq!(b.state(), State::Closed);
        assert_eq!(b.admit(t2), Admit::Yes);
    }
}
