//! What an upstream response means for the retry loop: `[[upstream.classify]]` rules,
//! first match in file order, on status, a JSON pointer into the body, or a substring.
//! A 429 no rule matches means "rate limited": cool down.

use crate::config::{Action, ClassifyRule};

/// How much of a body classification may read; the rest streams on untouched.
pub(crate) const BODY_LIMIT: usize = 64 * 1024;

/// Whether some rule for this status needs the body.
pub fn needs_body(rules: &[ClassifyRule], status: u16) -> bool {
    rules.iter().any(|r| {
        r.status.is_none_or(|s| s == status) && (r.json.is_some() || r.body_contains.is_some())
    })
}

/// The action for a response, or `None` when no rule applies and it is not a 429.
/// `body` is the first `BODY_LIMIT` bytes, when a rule needed them.
pub fn classify(rules: &[ClassifyRule], status: u16, body: Option<&[u8]>) -> Option<Action> {
    let json: Option<serde_json::Value> = body.and_then(|b| serde_json::from_slice(b).ok());
    let matched = rules.iter().find(|r| {
        r.status.is_none_or(|s| s == status)
            && r.json.as_ref().is_none_or(|ptr| {
                json.as_ref().and_then(|j| j.pointer(ptr)).is_some_and(|v| {
                    let text = match v {
                        serde_json::Value::String(s) => s.clone(),
                        other => other.to_string(),
                    };
                    r.equals.contains(&text)
                })
            })
            && r.body_contains.as_ref().is_none_or(|needle| {
                body.is_some_and(|b| {
                    b.windows(needle.len().max(1))
                        .any(|w| w == needle.as_bytes())
                })
            })
    });
    match matched {
        Some(r) => Some(r.action),
        None if status == 429 => Some(Action::Cooldown),
        None => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(
        status: Option<u16>,
        json: Option<&str>,
        equals: &[&str],
        contains: Option<&str>,
        action: Action,
    ) -> ClassifyRule {
        ClassifyRule {
            status,
            json: json.map(String::from),
            equals: equals.iter().map(|s| s.to_string()).collect(),
            body_contains: contains.map(String::from),
            action,
        }
    }

    #[test]
    fn rules_in_order_then_the_429_default() {
        let rules = vec![
            rule(
                Some(429),
                Some("/error/code"),
                &["unverified_count_cap"],
                None,
                Action::Fail,
            ),
            rule(Some(429), None, &[], Some("slow down"), Action::Retry),
            rule(
                Some(503),
                Some("/retryable"),
                &["true"],
                None,
                Action::Retry,
            ),
        ];
        let cap = br#"{"error": {"code": "unverified_count_cap"}}"#;
        assert_eq!(classify(&rules, 429, Some(cap)), Some(Action::Fail));
        assert_eq!(
            classify(&rules, 429, Some(b"please slow down")),
            Some(Action::Retry)
        );
        assert_eq!(classify(&rules, 429, Some(b"{}")), Some(Action::Cooldown));
        assert_eq!(classify(&rules, 429, None), Some(Action::Cooldown));
        assert_eq!(
            classify(&rules, 503, Some(br#"{"retryable": true}"#)),
            Some(Action::Retry)
        );
        assert_eq!(classify(&rules, 503, Some(b"not json")), None);
        assert_eq!(classify(&rules, 200, Some(cap)), None);
        assert!(needs_body(&rules, 429));
        assert!(!needs_body(&rules, 500));
    }
}
