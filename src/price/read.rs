//! Numbers as requests and responses write costs: whole, non-negative, from a header's
//! text or a JSON value (a fraction rounds up), and summed over JSON pointers.

use super::json::Json;

/// The sum of the numbers at `pointers` in `v`, those absent counting nothing; `None`
/// when none is there.
pub(crate) fn sum_pointers(v: &Json<'_>, pointers: &[String]) -> Option<u64> {
    let found: Vec<u64> = pointers
        .iter()
        .filter_map(|p| v.pointer(p).and_then(Json::number))
        .collect();
    (!found.is_empty()).then(|| found.iter().fold(0u64, |a, b| a.saturating_add(*b)))
}

/// A header's value as a whole, non-negative number.
pub(crate) fn number(text: &str) -> Option<u64> {
    text.trim().parse().ok()
}
