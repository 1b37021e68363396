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
//! With several quotas the one with the fewest requests left wins. A field that cannot
//! be read counts as absent: a provider's typo must not stop traffic.

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
}

/// Reads the budget a response announces, if it announces one. `now` is the local wall
/// clock, for resets written as timestamps in a response without `Date`.
pub(crate) fn announced(h: &HeaderMap, now: SystemTime) -> Option<Announced> {
    read(h, now).map(|a| Announced {
        reset: a.reset.min(MAX_RESET),
        ..a
    })
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
