//! What the limit kinds share: the admission id and whole-window arithmetic.

use std::time::Duration;

use tokio::time::Instant;

/// An admission, the same in every limit it paid: its sequence number in the bucket.
pub type Id = u64;

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
