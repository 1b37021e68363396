//! How long to wait before a retry when the upstream gave no hint: capped exponential
//! backoff with jitter. Pure: the caller passes the random draw, so tests can pin it.

use std::time::Duration;

use crate::config::{Backoff, Jitter};

/// The wait before retry number `retry` (1 for the first retry). `unit` is a uniform
/// draw in [0, 1); `prev` is the previous delay (for decorrelated jitter; `base` at first).
/// Never more than `max`.
pub(crate) fn delay(b: &Backoff, retry: u32, prev: Duration, unit: f64) -> Duration {
    let unit = unit.clamp(0.0, 1.0);
    let exp = b
        .base
        .saturating_mul(1u32 << retry.saturating_sub(1).min(20))
        .min(b.max);
    let d = match b.jitter {
        Jitter::None => exp,
        Jitter::Full => exp.mul_f64(unit),
        Jitter::Equal => exp / 2 + (exp / 2).mul_f64(unit),
        // AWS's "decorrelated jitter": uniform between base and three times the last wait.
        Jitter::Decorrelated => {
            let hi = prev.max(b.base).saturating_mul(3);
            b.base + (hi - b.base).mul_f64(unit)
        }
    };
    d.min(b.max)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn backoff(jitter: Jitter) -> Backoff {
        Backoff {
            base: Duration::from_millis(500),
            max: Duration::from_secs(30),
            jitter,
        }
    }

    #[test]
    fn exponential_then_capped() {
        let b = backoff(Jitter::None);
        let got: Vec<u64> = (1..=8)
            .map(|n| delay(&b, n, b.base, 0.5).as_millis() as u64)
            .collect();
        assert_eq!(got, [500, 1000, 2000, 4000, 8000, 16000, 30000, 30000]);
        assert_eq!(delay(&b, 1000, b.base, 0.5), Duration::from_secs(30));
    }

    #[test]
    fn jitter_kinds() {
        let ms = |d: Duration| d.as_millis();
        assert_eq!(
            ms(delay(&backoff(Jitter::Full), 3, Duration::ZERO, 0.25)),
            500
        );
        assert_eq!(
            ms(delay(&backoff(Jitter::Equal), 3, Duration::ZERO, 0.0)),
            1000
        );
        assert_eq!(
            ms(delay(&backoff(Jitter::Equal), 3, Duration::ZERO, 0.5)),
            1500
        );
        let d = backoff(Jitter::Decorrelated);
        assert_eq!(ms(delay(&d, 2, Duration::from_secs(2), 0.0)), 500);
        assert_eq!(ms(delay(&d, 2, Duration::from_secs(2), 0.5)), 3250);
    }

    proptest! {
        #[test]
        fn every_delay_within_its_jitter_range(retry in 1u32..40, unit in 0.0f64..1.0, prev_ms in 0u64..120_000,
                                               base_ms in 1u64..5_000, max_ms in 1u64..60_000) {
            let max_ms = max_ms.max(base_ms);
            let prev = Duration::from_millis(prev_ms);
            for jitter in [Jitter::None, Jitter::Full, Jitter::Equal, Jitter::Decorrelated] {
                let b = Backoff { base: Duration::from_millis(base_ms), max: Duration::from_millis(max_ms), jitter };
                let d = delay(&b, retry, prev, unit);
                let exp = b.base.saturating_mul(1u32 << (retry - 1).min(20)).min(b.max);
                prop_assert!(d <= b.max);
                match jitter {
                    Jitter::None => prop_assert_eq!(d, exp),
                    Jitter::Full => prop_assert!(d <= exp),
                    Jitter::Equal => prop_assert!(d >= exp / 2 && d <= exp),
                    Jitter::Decorrelated => {
                        prop_assert!(d >= b.base.min(b.max));
                        prop_assert!(d <= prev.max(b.base) * 3);
                    }
                }
            }
        }
    }
}
