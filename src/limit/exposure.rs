//! What a limit promises against the algorithms providers run at the same numbers: for
//! each, whether every request it lets through is within that algorithm's limit, or how
//! far past it the worst traffic the limit allows goes (`sluice explain`). A limit of
//! `rate` per `per` is compared with providers counting `rate` per `per`, a window
//! limit with providers counting `permits` per `window`. Margins only make sluice more
//! careful and are left out.
//!
//! The figures come from the worst arrival patterns each kind admits: a window's
//! permits at its end and the next window's at its start (fixed windows), a window's
//! permits where another counter weighs them fully (logs and counters), a bucket's burst
//! then its refill. `tests/provider.rs` checks the "within" claims against the models of
//! the algorithms.

use crate::config::{CounterAlign, Limit, WindowAlign};

/// A provider algorithm, at the limit's own numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algorithm {
    /// At most N in any interval of the window.
    SlidingLog,
    /// The weighted two-window counter, its windows anywhere, rounding down.
    SlidingCounter,
    /// Windows on the clock, where sluice's own clock windows are.
    ClockWindows,
    /// Windows from the first request.
    FirstRequestWindows,
    /// A token bucket whose burst is the whole limit.
    FullBucket,
    /// A token bucket with a burst of 1 (nginx `limit_req` without `burst`).
    Pacing,
}

impl Algorithm {
    pub(crate) const ALL: [Algorithm; 6] = [
        Algorithm::SlidingLog,
        Algorithm::SlidingCounter,
        Algorithm::ClockWindows,
        Algorithm::FirstRequestWindows,
        Algorithm::FullBucket,
        Algorithm::Pacing,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Algorithm::SlidingLog => "a sliding log",
            Algorithm::SlidingCounter => "a sliding window counter",
            Algorithm::ClockWindows => "fixed windows on the clock",
            Algorithm::FirstRequestWindows => "fixed windows from the first request",
            Algorithm::FullBucket => "a token bucket as deep as the limit",
            Algorithm::Pacing => "a token bucket with a burst of 1",
        }
    }

    /// What the worst traffic reaches, in the algorithm's own measure.
    fn measure(self, n: u64) -> String {
        match self {
            Algorithm::SlidingLog | Algorithm::ClockWindows | Algorithm::FirstRequestWindows => {
                format!("{n} in one window")
            }
            Algorithm::SlidingCounter => format!("an estimate of {n}"),
            Algorithm::FullBucket | Algorithm::Pacing => format!("{n} at once"),
        }
    }
}

/// One algorithm's verdict on a limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    pub algorithm: Algorithm,
    /// What the algorithm allows: requests per window, or at once.
    pub(crate) allowed: u64,
    /// The most the limit lets through in that measure.
    pub(crate) worst: u64,
}

impl Verdict {
    pub fn within(&self) -> bool {
        self.worst <= self.allowed
    }

    /// "its estimate reaches 24 (12 allowed)".
    pub(crate) fn overrun(&self) -> String {
        format!(
            "{} ({} allowed)",
            self.algorithm.measure(self.worst),
            self.allowed
        )
    }
}

/// How `limit` fares against each algorithm, or `None` for one that counts no rate.
pub fn exposure(limit: &Limit) -> Option<Vec<Verdict>> {
    use Algorithm::*;
    // The numbers the providers count with, and the worst of each measure in order:
    // log, counter, clock windows, first-request windows, full bucket, pacing. Both
    // buckets measure the same thing: the burst the traffic needs at the rate.
    let (p, worst): (u64, [u64; 6]) = match *limit {
        Limit::SlidingWindow { permits, .. } => {
            let p = u64::from(permits.get());
            (p, [p, 2 * p, p, p, p, p])
        }
        Limit::FixedWindow { permits, align, .. } => {
            let p = u64::from(permits.get());
            // A window's permits at its end, the next window's at its start.
            match align {
                WindowAlign::First => (p, [2 * p - 1, 2 * p, 2 * p - 1, p, 2 * p - 1, 2 * p - 1]),
                WindowAlign::Clock => (p, [2 * p, 2 * p, p, 2 * p, 2 * p, 2 * p]),
            }
        }
        Limit::SlidingCounter { permits, align, .. } => {
            let p = u64::from(permits.get());
            match align {
                CounterAlign::Any => (p, [p, p, p, p, p, p]),
                // A window's permits at its end, then as many as the fading weight
                // allows, all of them again just before the next edge.
                CounterAlign::Clock => (p, [2 * p, 2 * p, p, 2 * p, p + 1, p + 1]),
            }
        }
        Limit::TokenBucket { rate, burst, .. } => bucket(rate.get(), burst.get()),
        Limit::LeakyBucket { rate, burst, .. } => bucket(rate.get(), burst.saturating_add(1)),
        Limit::Published { permits, .. } => {
            let p = u64::from(permits.get());
            (p, [p, p, p, p, 1, 1])
        }
        Limit::Concurrency { .. } => return None,
    };
    let allowed = |a: Algorithm| if a == Pacing { 1 } else { p };
    Some(
        Algorithm::ALL
            .iter()
            .zip(worst)
            .map(|(&algorithm, worst)| Verdict {
                algorithm,
                allowed: allowed(algorithm),
                worst,
            })
            .collect(),
    )
}

/// A bucket of `burst` refilled `rate` times a period, against providers counting `rate`
/// per period: the burst at once, then the refill.
fn bucket(rate: u32, burst: u32) -> (u64, [u64; 6]) {
    let (p, b) = (u64::from(rate), u64::from(burst));
    // The burst at a window's start and the refill through it; a counter sees them all
    // in its previous window at its next edge, with one more arriving.
    (p, [b + p - 1, b + p, b + p - 1, b + p - 1, b, b])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn verdicts(text: &str) -> Vec<(Algorithm, bool, u64)> {
        let l: Limit = toml::from_str(text).unwrap();
        exposure(&l)
            .unwrap()
            .into_iter()
            .map(|v| (v.algorithm, v.within(), v.worst))
            .collect()
    }

    fn within(text: &str) -> Vec<Algorithm> {
        verdicts(text)
            .into_iter()
            .filter(|v| v.1)
            .map(|v| v.0)
            .collect()
    }

    #[test]
    fn each_kind_is_within_what_it_models() {
        use Algorithm::*;
        let log = "kind = \"sliding_window\"\npermits = 12\nwindow = \"1s\"";
        assert_eq!(
            within(log),
            [SlidingLog, ClockWindows, FirstRequestWindows, FullBucket]
        );
        assert_eq!(verdicts(log)[1], (SlidingCounter, false, 24));
        let counter = "kind = \"sliding_counter\"\npermits = 12\nwindow = \"1s\"";
        assert_eq!(within(counter), Algorithm::ALL[..5]);
        let published = "kind = \"published\"\npermits = 12\nwindow = \"1s\"";
        assert_eq!(within(published), Algorithm::ALL);
        let first = "kind = \"fixed_window\"\npermits = 300\nwindow = \"1m\"";
        assert_eq!(within(first), [FirstRequestWindows]);
        assert_eq!(verdicts(first)[0], (SlidingLog, false, 599));
        let clock = format!("{first}\nalign = \"clock\"");
        assert_eq!(within(&clock), [ClockWindows]);
        let token = "kind = \"token_bucket\"\nrate = 10\nper = \"1s\"\nburst = 10";
        assert_eq!(within(token), [FullBucket]);
        let paced = "kind = \"token_bucket\"\nrate = 10\nper = \"1s\"\nburst = 1";
        assert_eq!(
            within(paced),
            [
                SlidingLog,
                ClockWindows,
                FirstRequestWindows,
                FullBucket,
                Pacing
            ]
        );
        // At exactly 10 a second, a counter whose edge falls on an arrival sees 11.
        assert_eq!(verdicts(paced)[1], (SlidingCounter, false, 11));
        let nginx = "kind = \"leaky_bucket\"\nrate = 10\nper = \"1s\"";
        assert_eq!(within(nginx), within(paced));
    }
}
