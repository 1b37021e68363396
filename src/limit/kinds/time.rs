//! What the limit kinds share: the admission id and whole-window arithmetic.

use std::time::Duration;

use tokio::time::Instant;

/// An admission, the same in every limit it paid: its sequence number in the bucket.
pub(crate) type Id = u64;

/// `turns` whole windows after `at`, saturating far in the future rather than
/// overflowing (a long queue on a long window).
pub(super) fn turns_after(at: Instant, window: Duration, turns: u64) -> Instant {
    const FAR: Duration = Duration::from_secs(100 * 365 * 24 * 3600);
    u32::try_from(turns)
        .ok()
        .and_then(|t| window.checked_mul(t))
        .and_then(|d| at.checked_add(d.min(FAR)))
        .unwrap_or(at + FAR)
}

/// `t - from` in nanoseconds, negative when `t` is earlier.
pub(super) fn ns_between(from: Instant, t: Instant) -> i128 {
    if t >= from {
        (t - from).as_nanos() as i128
    } else {
        -((from - t).as_nanos() as i128)
    }
}

/// `at` moved by `ns` nanoseconds, saturating rather than overflowing.
pub(super) fn shifted(at: Instant, ns: i128) -> Instant {
    let d = Duration::from_nanos(u64::try_from(ns.unsigned_abs()).unwrap_or(u64::MAX));
    if ns >= 0 {
        at.checked_add(d).unwrap_or(at)
    } else {
        at.checked_sub(d).unwrap_or(at)
    }
}

/// The time since the Unix epoch at `now`, from the system clock: where windows on the
/// clock fall. Read when a limit is created or reloaded; the monotonic clock carries it
/// from there.
pub(crate) fn unix_at(now: Instant) -> Duration {
    let wall = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let mono = Instant::now();
    if now >= mono {
        wall + (now - mono)
    } else {
        wall.saturating_sub(mono - now)
    }
}

/// A window edge on the clock: the first instant at or after `now` whose Unix time, less
/// `offset`, is a whole number of `window`s, given the Unix time `unix` at `now`.
pub(super) fn edge_after(
    now: Instant,
    unix: Duration,
    window: Duration,
    offset: Duration,
) -> Instant {
    let w = window.as_nanos().max(1);
    let since = unix.as_nanos() as i128 - offset.as_nanos() as i128;
    let phase = since.rem_euclid(w as i128) as u128;
    shifted(now, ((w - phase) % w) as i128)
}

/// How long from `now` to the next edge of windows of `window` that start at `origin`.
pub(super) fn to_next_edge(origin: Instant, window: Duration, now: Instant) -> Duration {
    let w = window.as_nanos().max(1) as i128;
    let phase = ns_between(origin, now).rem_euclid(w);
    Duration::from_nanos((w - phase) as u64)
}
