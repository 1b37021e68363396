//! The breaker around Redis, pure in `now`: after `failures` calls in a row fail, no call
//! is made for `open_for`; then one call probes, and its outcome closes or reopens it.
//! While it is open the replicas fall back as `on_redis_error` says.

use std::time::Duration;

use tokio::time::Instant;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum State {
    Closed,
    Open,
    /// One probe is out; everyone else stays on the fallback until it answers.
    Probing,
}

#[derive(Debug)]
pub(super) struct Breaker {
    failures: u32,
    open_for: Duration,
    in_a_row: u32,
    open_until: Option<Instant>,
    probing: bool,
    /// When it last opened, and when a call succeeded after that, if one has.
    outage: Option<(Instant, Option<Instant>)>,
}

impl Breaker {
    pub(super) fn new(failures: u32, open_for: Duration) -> Breaker {
        Breaker {
            failures: failures.max(1),
            open_for,
            in_a_row: 0,
            open_until: None,
            probing: false,
            outage: None,
        }
    }

    pub(super) fn state(&self, now: Instant) -> State {
        match self.open_until {
            None => State::Closed,
            Some(_) if self.probing => State::Probing,
            Some(t) if now < t => State::Open,
            Some(_) => State::Closed,
        }
    }

    /// Whether a call may go to Redis now. After `open_for` the first caller is let
    /// through as the probe.
    pub(super) fn allow(&mut self, now: Instant) -> bool {
        match self.open_until {
            None => true,
            Some(t) if now < t || self.probing => false,
            Some(_) => {
                self.probing = true;
                true
            }
        }
    }

    /// Until when calls are held back (for `Retry-After`), if they are.
    pub(super) fn open_until(&self) -> Option<Instant> {
        self.open_until
    }

    pub(super) fn success(&mut self, now: Instant) {
        if let Some((_, back @ None)) = &mut self.outage {
            *back = Some(now);
        }
        self.in_a_row = 0;
        self.open_until = None;
        self.probing = false;
    }

    /// When the breaker last opened, and when a call succeeded after that, if one has.
    pub(super) fn outage(&self) -> Option<(Instant, Option<Instant>)> {
        self.outage
    }

    /// Opens now, as if `failures` calls in a row had failed; returns whether it was
    /// closed.
    pub(super) fn trip(&mut self, now: Instant) -> bool {
        let was_closed = self.open_until.is_none();
        if was_closed {
            self.outage = Some((now, None));
        }
        self.open_until = Some(now + self.open_for);
        self.probing = false;
        self.in_a_row = self.in_a_row.max(self.failures);
        was_closed
    }

    /// A failed call; returns whether this one opened the breaker.
    pub(super) fn failure(&mut self, now: Instant) -> bool {
        self.in_a_row = self.in_a_row.saturating_add(1);
        let was_closed = self.open_until.is_none();
        if self.probing || self.in_a_row >= self.failures {
            if self.open_until.is_none() {
                self.outage = Some((now, None));
            }
            self.open_until = Some(now + self.open_for);
            self.probing = false;
            return was_closed;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_failures_in_a_row_and_probes_once() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut b = Breaker::new(3, Duration::from_secs(5));
        assert!(!b.failure(t0));
        b.success(t0);
        assert_eq!(b.outage(), None, "never open");
        assert!(!b.failure(t0));
        assert!(!b.failure(t0));
        assert_eq!(b.state(t0), State::Closed);
        assert!(b.failure(t0), "the third in a row opens it");
        assert_eq!(b.outage(), Some((t0, None)));
        assert_eq!(b.state(t0), State::Open);
        assert!(!b.allow(t0 + 4 * s));
        assert!(b.allow(t0 + 5 * s), "the probe");
        assert!(!b.allow(t0 + 5 * s), "one at a time");
        assert_eq!(b.state(t0 + 5 * s), State::Probing);
        assert!(!b.failure(t0 + 5 * s), "was not closed");
        assert!(!b.allow(t0 + 9 * s), "reopened by the failed probe");
        assert!(b.allow(t0 + 10 * s));
        b.success(t0 + 10 * s);
        assert_eq!(b.state(t0 + 10 * s), State::Closed);
        assert_eq!(
            b.outage(),
            Some((t0, Some(t0 + 10 * s))),
            "from the first opening"
        );
        assert!(b.allow(t0 + 10 * s));
    }
}
