//! When the upstream says how long to wait: `retry-after-ms` (OpenAI's milliseconds),
//! `Retry-After` (delta-seconds or HTTP-date, a
//! date read against the response's own `Date` when it has one), `RateLimit-Reset` and
//! `X-RateLimit-Reset` (delta seconds, or an epoch timestamp, told apart by size).
//! Unparseable values are ignored, as if absent.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::HeaderMap;

/// Values above this are epoch timestamps, not deltas: no API asks to wait 30 years.
const EPOCH_THRESHOLD: u64 = 1_000_000_000;

/// A wait the upstream asked for, and which header said so (for logs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hint {
    pub wait: Duration,
    pub(crate) source: &'static str,
}

/// A field's value as trimmed text; absent when it is not text.
pub(crate) fn header<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
    h.get(name).and_then(|v| v.to_str().ok()).map(str::trim)
}

/// From the response to `at`, read against the response's own `Date` when it has one.
fn until(h: &HeaderMap, at: SystemTime, now: SystemTime) -> Duration {
    let reference = header(h, "date")
        .and_then(|d| httpdate::parse_http_date(d).ok())
        .unwrap_or(now);
    at.duration_since(reference).unwrap_or(Duration::ZERO)
}

/// A reset field's value `v` in response `h`: delta seconds, or a Unix timestamp in
/// seconds or milliseconds.
pub(crate) fn epoch_or_delta(h: &HeaderMap, v: &str, now: SystemTime) -> Option<Duration> {
    let n: u64 = v.parse().ok()?;
    Some(if n > EPOCH_THRESHOLD * 1000 {
        until(h, UNIX_EPOCH + Duration::from_millis(n), now)
    } else if n > EPOCH_THRESHOLD {
        until(h, UNIX_EPOCH + Duration::from_secs(n), now)
    } else {
        Duration::from_secs(n)
    })
}

/// Reads the first usable hint, in order of authority. `now` is the local wall clock,
/// used when the response has no `Date`.
pub fn server_hint(h: &HeaderMap, now: SystemTime) -> Option<Hint> {
    // OpenAI's and Azure OpenAI's, finer than the whole seconds of `Retry-After`.
    if let Some(ms) = header(h, "retry-after-ms").and_then(|v| v.parse::<f64>().ok())
        && ms.is_finite()
        && ms >= 0.0
    {
        return Some(Hint {
            wait: Duration::from_secs_f64((ms / 1000.0).min(1e9)),
            source: "retry-after-ms",
        });
    }
    if let Some(v) = header(h, "retry-after") {
        let wait = match v.parse::<u64>() {
            Ok(secs) => Some(Duration::from_secs(secs)),
            Err(_) => httpdate::parse_http_date(v)
                .ok()
                .map(|at| until(h, at, now)),
        };
        if let Some(wait) = wait {
            return Some(Hint {
                wait,
                source: "retry-after",
            });
        }
    }
    for (name, source) in [
        ("ratelimit-reset", "ratelimit-reset"),
        ("x-ratelimit-reset", "x-ratelimit-reset"),
    ] {
        if let Some(wait) = header(h, name).and_then(|v| epoch_or_delta(h, v, now)) {
            return Some(Hint { wait, source });
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, v.parse().unwrap());
        }
        h
    }

    fn at(secs: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs)
    }

    // 2026-12-01T00:00:00Z
    const T: u64 = 1_796_083_200;

    #[test]
    fn retry_after_both_forms() {
        let now = at(T);
        let h = headers(&[("retry-after", "7")]);
        assert_eq!(
            server_hint(&h, now),
            Some(Hint {
                wait: Duration::from_secs(7),
                source: "retry-after"
            })
        );
        let date = httpdate::fmt_http_date(at(T + 30));
        assert_eq!(
            server_hint(&headers(&[("retry-after", &date)]), now)
                .unwrap()
                .wait,
            Duration::from_secs(30)
        );
    }

    #[test]
    fn a_date_is_read_against_the_response_date() {
        // Our clock is 100 s behind the server's; the server's Date is what counts.
        let h = headers(&[
            ("date", &httpdate::fmt_http_date(at(T + 100))),
            ("retry-after", &httpdate::fmt_http_date(at(T + 110))),
        ]);
        assert_eq!(
            server_hint(&h, at(T)).unwrap().wait,
            Duration::from_secs(10)
        );
    }

    #[test]
    fn past_dates_and_garbage() {
        let past = httpdate::fmt_http_date(at(T - 60));
        assert_eq!(
            server_hint(&headers(&[("retry-after", &past)]), at(T))
                .unwrap()
                .wait,
            Duration::ZERO
        );
        for junk in ["soon", "-5", "1.5", "Tue, 99 Foo 2026", ""] {
            assert_eq!(
                server_hint(&headers(&[("retry-after", junk)]), at(T)),
                None,
                "{junk:?}"
            );
        }
        // Garbage in Retry-After falls through to the next header.
        let h = headers(&[("retry-after", "later"), ("x-ratelimit-reset", "12")]);
        assert_eq!(
            server_hint(&h, at(T)).unwrap(),
            Hint {
                wait: Duration::from_secs(12),
                source: "x-ratelimit-reset"
            }
        );
    }

    #[test]
    fn reset_headers_seconds_or_epoch() {
        let now = at(T);
        assert_eq!(
            server_hint(&headers(&[("ratelimit-reset", "3")]), now)
                .unwrap()
                .wait,
            Duration::from_secs(3)
        );
        let epoch = (T + 45).to_string();
        assert_eq!(
            server_hint(&headers(&[("x-ratelimit-reset", &epoch)]), now)
                .unwrap()
                .wait,
            Duration::from_secs(45)
        );
        let epoch_ms = ((T + 2) * 1000).to_string();
        assert_eq!(
            server_hint(&headers(&[("x-ratelimit-reset", &epoch_ms)]), now)
                .unwrap()
                .wait,
            Duration::from_secs(2)
        );
        assert_eq!(server_hint(&HeaderMap::new(), now), None);
    }
}
