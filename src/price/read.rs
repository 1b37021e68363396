//! Numbers as requests and responses write costs: whole, non-negative, from a header's
//! text or a JSON value (a fraction rounds up), and summed over JSON pointers.

use serde_json::Value;

/// The sum of the numbers at `pointers` in `v`, those absent counting nothing; `None`
/// when none is there.
pub(crate) fn sum_pointers(v: &Value, pointers: &[String]) -> Option<u64> {
    let found: Vec<u64> = pointers
        .iter()
        .filter_map(|p| v.pointer(p).and_then(value_number))
        .collect();
    (!found.is_empty()).then(|| found.iter().fold(0u64, |a, b| a.saturating_add(*b)))
}

/// A JSON number as a whole, non-negative cost (a fraction rounds up).
pub(crate) fn value_number(v: &Value) -> Option<u64> {
    match v {
        Value::Number(n) => n
            .as_u64()
            .or_else(|| n.as_f64().filter(|f| *f >= 0.0).map(|f| f.ceil() as u64)),
        Value::String(s) => number(s),
        _ => None,
    }
}

/// A header's value as a whole, non-negative number.
pub(crate) fn number(text: &str) -> Option<u64> {
    text.trim().parse().ok()
}
