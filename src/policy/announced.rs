//! The budget a provider announces in its responses: how many requests it will still
//! take from this client, and when its window resets. Read from, in order:
//!
//! - `RateLimit` as a list of named quota items with `r` (remaining) and `t` (seconds to
//!   reset) parameters, as draft-ietf-httpapi-ratelimit-headers has written it since
//!   draft 08: `RateLimit: "default";r=50;t=30`;
//! - `RateLimit` as the dictionary of draft 07: `limit=100, remaining=50, reset=30`;
//! - the `RateLimit-Remaining` / `RateLimit-Reset` pair of drafts 00–06;
//! - `X-RateLimit-Remaining` / `X-RateLimit-Reset` as many APIs send them, the reset in
//!   seconds or as a Unix timestamp (seconds or milliseconds, told apart by size).
//!
//! - OpenAI's and Azure OpenAI's `x-ratelimit-{remaining,reset}-{requests,tokens}`, the
//!   resets as Go writes durations (`6m0s`, `12ms`, `1.5s`);
//! - Anthropic's `anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-
//!   {remaining,reset}`, the resets as RFC 3339 instants;
//! - GitHub's `x-ratelimit-resource`: the GraphQL resource counts points, not requests
//!   (`x-ratelimit-used` stands in for a missing remaining, with `x-ratelimit-limit`).
//!
//! Each budget names its unit: `requests`, or the unit sluice's config must give the
//! limits it paces (`tokens`, `input_tokens`, `output_tokens`, `points`). Within a unit
//! the quota with the fewest left wins. A field that cannot be read counts as absent: a
//! provider's typo must not stop traffic.

use std::time::{Duration, SystemTime};

use http::HeaderMap;

use super::hints::{epoch_or_delta, header};

/// The longest reset believed: a provider's field is input like any other, and a pace
/// that would hold a partition back for longer than a day is more likely a bug in the
/// provider than a budget.
pub(crate) const MAX_RESET: Duration = Duration::from_secs(24 * 3600);

/// What a response said of the provider's budget for the key it was sent with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Announced {
    /// Requests the provider will still accept before its window resets.
    pub(crate) remaining: u64,
    /// From the response's arrival to the reset.
    pub(crate) reset: Duration,
    /// Which field said so, for `/buckets` and logs.
    pub(crate) source: &'static str,
    /// What it counts: `requests`, or a priced unit's name.
    pub(crate) unit: &'static str,
}

/// The unit of the budgets most APIs announce.
pub(crate) const REQUESTS: &str = "requests";

#[cfg(test)]
/// Reads the budget of requests a response announces, if it announces one. `now` is the
/// local wall clock, for resets written as timestamps in a response without `Date`.
pub(crate) fn announced(h: &HeaderMap, now: SystemTime) -> Option<Announced> {
    every(h, now).into_iter().find(|a| a.unit == REQUESTS)
}

/// Every budget a response announces, one per unit (the tightest quota of each).
pub(crate) fn every(h: &HeaderMap, now: SystemTime) -> Vec<Announced> {
    let mut out: Vec<Announced> = Vec::new();
    let mut add = |a: Announced| {
        let a = Announced {
            reset: a.reset.min(MAX_RESET),
            ..a
        };
        match out.iter_mut().find(|b| b.unit == a.unit) {
            Some(b) if a.remaining < b.remaining => *b = a,
            Some(_) => {}
            None => out.push(a),
        }
    };
    dialects(h, now, &mut add);
    if let Some(a) = read(h, now) {
        add(a);
    }
    out
}

/// The vendors' own fields.
fn dialects(h: &HeaderMap, now: SystemTime, add: &mut impl FnMut(Announced)) {
    for (unit, remaining, reset, source) in [
        (
            REQUESTS,
            "x-ratelimit-remaining-requests",
            "x-ratelimit-reset-requests",
            "x-ratelimit-remaining-requests",
        ),
        (
            "tokens",
            "x-ratelimit-remaining-tokens",
            "x-ratelimit-reset-tokens",
            "x-ratelimit-remaining-tokens",
        ),
    ] {
        let budget = header(h, remaining)
            .and_then(|r| r.parse::<u64>().ok())
            .zip(header(h, reset).and_then(go_duration));
        if let Some((remaining, reset)) = budget {
            add(Announced {
                remaining,
                reset,
                source,
                unit,
            });
        }
    }
    // Names written out: every response of a learning upstream is read for them.
    for (unit, remaining, reset, source) in [
        (
            REQUESTS,
            "anthropic-ratelimit-requests-remaining",
            "anthropic-ratelimit-requests-reset",
            "anthropic-ratelimit-requests",
        ),
        (
            "tokens",
            "anthropic-ratelimit-tokens-remaining",
            "anthropic-ratelimit-tokens-reset",
            "anthropic-ratelimit-tokens",
        ),
        (
            "input_tokens",
            "anthropic-ratelimit-input-tokens-remaining",
            "anthropic-ratelimit-input-tokens-reset",
            "anthropic-ratelimit-input-tokens",
        ),
        (
            "output_tokens",
            "anthropic-ratelimit-output-tokens-remaining",
            "anthropic-ratelimit-output-tokens-reset",
            "anthropic-ratelimit-output-tokens",
        ),
    ] {
        let left = header(h, remaining).and_then(|r| r.parse().ok());
        let until = header(h, reset)
            .and_then(|r| humantime::parse_rfc3339_weak(r).ok())
            .map(|at| at.duration_since(now).unwrap_or(Duration::ZERO));
        if let (Some(remaining), Some(reset)) = (left, until) {
            add(Announced {
                remaining,
                reset,
                source,
                unit,
            });
        }
    }
    // GitHub's GraphQL budget is in points; its other resources count requests, which
    // the generic `X-RateLimit-*` reading below takes.
    if header(h, "x-ratelimit-resource") == Some("graphql") {
        let remaining = header(h, "x-ratelimit-remaining")
            .and_then(|r| r.parse::<u64>().ok())
            .or_else(|| {
                let limit: u64 = header(h, "x-ratelimit-limit")?.parse().ok()?;
                let used: u64 = header(h, "x-ratelimit-used")?.parse().ok()?;
                Some(limit.saturating_sub(used))
            });
        let reset = header(h, "x-ratelimit-reset").and_then(|v| epoch_or_delta(h, v, now));
        if let (Some(remaining), Some(reset)) = (remaining, reset) {
            add(Announced {
                remaining,
                reset,
                source: "x-ratelimit-resource",
                unit: "points",
            });
        }
    }
}

/// A duration as Go writes one: `1h2m3.5s`, `6m0s`, `12ms`, `250us`, `0s`.
pub(crate) fn go_duration(v: &str) -> Option<Duration> {
    let mut rest = v.trim();
    if rest.is_empty() {
        return None;
    }
    let mut total = 0f64;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let n: f64 = rest[..digits].parse().ok()?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let seconds = match &rest[..unit_len] {
            "h" => 3600.0,
            "m" => 60.0,
            "s" => 1.0,
            "ms" => 1e-3,
            "us" | "µs" => 1e-6,
            "ns" => 1e-9,
            _ => return None,
        };
        rest = &rest[unit_len..];
        total += n * seconds;
    }
    (total.is_finite() && total >= 0.0).then(|| Duration::from_secs_f64(total.min(1e9)))
}

fn read(h: &HeaderMap, now: SystemTime) -> Option<Announced> {
    if let Some(v) = header(h, "ratelimit") {
        if let Some(a) = structured(v) {
            return Some(a);
        }
        if let Some(a) = dictionary(v) {
            return Some(a);
        }
    }
    let pair = |remaining: &str, reset: &str, source| {
        let r = header(h, remaining)?.parse::<u64>().ok()?;
        let t = epoch_or_delta(h, header(h, reset)?, now)?;
        Some(Announced {
            remaining: r,
            reset: t,
            source,
            unit: REQUESTS,
        })
    };
    pair(
        "ratelimit-remaining",
        "ratelimit-reset",
        "ratelimit-remaining",
    )
    .or_else(|| {
        pair(
            "x-ratelimit-remaining",
            "x-ratelimit-reset",
            "x-ratelimit-remaining",
        )
    })
}

/// Splits `s` at `sep` where it is not inside a quoted string.
fn split_unquoted(s: &str, sep: u8) -> impl Iterator<Item = &str> {
    let mut quoted = false;
    let mut escaped = false;
    let mut start = 0;
    let bytes = s.as_bytes();
    let mut i = 0;
    std::iter::from_fn(move || {
        if start > bytes.len() {
            return None;
        }
        while i < bytes.len() {
            let b = bytes[i];
            i += 1;
            if escaped {
                escaped = false;
            } else if quoted && b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                quoted = !quoted;
            } else if b == sep && !quoted {
                let part = &s[start..i - 1];
                start = i;
                return Some(part.trim());
            }
        }
        let part = &s[start..];
        start = bytes.len() + 1;
        Some(part.trim())
    })
}

/// `"name";r=N;t=N, "other";r=N;t=N`: the item with the fewest remaining.
fn structured(v: &str) -> Option<Announced> {
    let mut best: Option<Announced> = None;
    for item in split_unquoted(v, b',') {
        let mut parts = split_unquoted(item, b';');
        let name = parts.next()?;
        // A dictionary member (draft 07) is `key=value`, not a quota name.
        if name.contains('=') && !name.starts_with('"') {
            return None;
        }
        let (mut r, mut t) = (None, None);
        for p in parts {
            let (k, val) = p.split_once('=')?;
            match k.trim() {
                "r" => r = val.trim().parse::<u64>().ok(),
                "t" => t = val.trim().parse::<u64>().ok(),
                _ => {}
            }
        }
        let (Some(remaining), Some(t)) = (r, t) else {
            continue;
        };
        if best.is_none_or(|b| remaining < b.remaining) {
            best = Some(Announced {
                remaining,
                reset: Duration::from_secs(t),
                source: "ratelimit",
                unit: REQUESTS,
            });
        }
    }
    best
}

/// `limit=100, remaining=50, reset=30` (draft 07).
fn dictionary(v: &str) -> Option<Announced> {
    let (mut r, mut t) = (None, None);
    for member in split_unquoted(v, b',') {
        // Parameters (`;w=60`) describe the policy, not the current budget.
        let member = member.split(';').next()?.trim();
        let (k, val) = member.split_once('=')?;
        match k.trim() {
            "remaining" => r = val.trim().parse::<u64>().ok(),
            "reset" => t = val.trim().parse::<u64>().ok(),
            _ => {}
        }
    }
    Some(Announced {
        remaining: r?,
        reset: Duration::from_secs(t?),
        source: "ratelimit",
        unit: REQUESTS,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::UNIX_EPOCH;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, v.parse().unwrap());
        }
        h
    }

    const T: u64 = 1_796_083_200;

    fn read(pairs: &[(&'static str, &str)]) -> Option<(u64, u64, &'static str)> {
        announced(&headers(pairs), UNIX_EPOCH + Duration::from_secs(T))
            .map(|a| (a.remaining, a.reset.as_secs(), a.source))
    }

    #[test]
    fn every_form_the_drafts_and_apis_use() {
        assert_eq!(
            read(&[("ratelimit", "\"default\";r=50;t=30")]),
            Some((50, 30, "ratelimit"))
        );
        // Several quotas: the tightest one.
        assert_eq!(
            read(&[("ratelimit", "\"burst\";r=8;t=1, \"day\";r=2;t=3600")]),
            Some((2, 3600, "ratelimit"))
        );
        assert_eq!(
            read(&[("ratelimit", "day;r=5;t=60;pk=:abc=:")]),
            Some((5, 60, "ratelimit"))
        );
        assert_eq!(
            read(&[("ratelimit", "limit=100, remaining=7, reset=12")]),
            Some((7, 12, "ratelimit"))
        );
        assert_eq!(
            read(&[
                ("ratelimit-limit", "10"),
                ("ratelimit-remaining", "3"),
                ("ratelimit-reset", "9")
            ]),
            Some((3, 9, "ratelimit-remaining"))
        );
        assert_eq!(
            read(&[
                ("x-ratelimit-remaining", "4"),
                ("x-ratelimit-reset", &(T + 20).to_string())
            ]),
            Some((4, 20, "x-ratelimit-remaining"))
        );
        assert_eq!(
            read(&[("x-ratelimit-remaining", "0"), ("x-ratelimit-reset", "2")]),
            Some((0, 2, "x-ratelimit-remaining"))
        );
        // A reset beyond belief is capped: it must not overflow an instant downstream.
        assert_eq!(
            read(&[("ratelimit", "\"d\";r=1;t=18446744073709551615")]),
            Some((1, MAX_RESET.as_secs(), "ratelimit"))
        );
    }

    fn units(pairs: &[(&'static str, &str)]) -> Vec<(&'static str, u64, u64)> {
        let mut v: Vec<_> = every(&headers(pairs), UNIX_EPOCH + Duration::from_secs(T))
            .into_iter()
            .map(|a| (a.unit, a.remaining, a.reset.as_millis() as u64))
            .collect();
        v.sort();
        v
    }

    #[test]
    fn the_vendors_dialects_each_in_its_unit() {
        // OpenAI and Azure OpenAI.
        assert_eq!(
            units(&[
                ("x-ratelimit-limit-requests", "500"),
                ("x-ratelimit-remaining-requests", "499"),
                ("x-ratelimit-reset-requests", "120ms"),
                ("x-ratelimit-limit-tokens", "30000"),
                ("x-ratelimit-remaining-tokens", "29000"),
                ("x-ratelimit-reset-tokens", "6m0s"),
            ]),
            [("requests", 499, 120), ("tokens", 29000, 360_000)]
        );
        // Anthropic, resets as RFC 3339 instants.
        let at = |secs: u64| {
            humantime::format_rfc3339(UNIX_EPOCH + Duration::from_secs(T + secs)).to_string()
        };
        assert_eq!(
            units(&[
                ("anthropic-ratelimit-requests-remaining", "49"),
                ("anthropic-ratelimit-requests-reset", &at(2)),
                ("anthropic-ratelimit-input-tokens-remaining", "20000"),
                ("anthropic-ratelimit-input-tokens-reset", &at(30)),
                ("anthropic-ratelimit-output-tokens-remaining", "700"),
                ("anthropic-ratelimit-output-tokens-reset", &at(45)),
            ]),
            [
                ("input_tokens", 20000, 30_000),
                ("output_tokens", 700, 45_000),
                ("requests", 49, 2_000)
            ]
        );
        // GitHub GraphQL: points; its REST resources: requests.
        let reset = (T + 600).to_string();
        assert_eq!(
            units(&[
                ("x-ratelimit-resource", "graphql"),
                ("x-ratelimit-limit", "5000"),
                ("x-ratelimit-used", "120"),
                ("x-ratelimit-reset", &reset),
            ]),
            [("points", 4880, 600_000)]
        );
        assert_eq!(
            units(&[
                ("x-ratelimit-resource", "core"),
                ("x-ratelimit-remaining", "4999"),
                ("x-ratelimit-reset", &reset),
            ]),
            [("requests", 4999, 600_000)]
        );
        assert_eq!(
            go_duration("1h2m3.5s"),
            Some(Duration::from_millis(3_723_500))
        );
        assert_eq!(go_duration("0s"), Some(Duration::ZERO));
        assert_eq!(go_duration("12"), None);
        assert_eq!(go_duration("5 minutes"), None);
    }

    #[test]
    fn what_cannot_be_read_is_absent() {
        for pairs in [
            &[("ratelimit", "\"default\";r=-1;t=30")][..],
            &[("ratelimit", "\"default\";r=5")],
            &[("ratelimit", "remaining=5")],
            &[("ratelimit", "garbage")],
            &[("ratelimit-remaining", "5")],
            &[
                ("x-ratelimit-remaining", "lots"),
                ("x-ratelimit-reset", "5"),
            ],
            &[
                ("x-ratelimit-remaining", "5"),
                ("x-ratelimit-reset", "soon"),
            ],
            &[],
        ] {
            assert_eq!(read(pairs), None, "{pairs:?}");
        }
        // An unreadable RateLimit falls through to the older fields.
        assert_eq!(
            read(&[
                ("ratelimit", "???"),
                ("x-ratelimit-remaining", "1"),
                ("x-ratelimit-reset", "5")
            ]),
            Some((1, 5, "x-ratelimit-remaining"))
        );
        // A quoted name may hold the separators.
        assert_eq!(
            read(&[("ratelimit", "\"a,b;c\";r=1;t=2")]),
            Some((1, 2, "ratelimit"))
        );
    }
}
