//! A request body as the estimates read it: JSON parsed by `serde_json` into values that
//! borrow their strings from the body (a prompt of kilobytes is counted where it lies,
//! not copied) and keep an object's members in a list. Pricing parses a body on every
//! request of a priced family, and this is most of what it costs.
//!
//! An object's key written twice keeps both members: `get` and pointers find the last,
//! as `serde_json` would keep it; sums over all members count both, an overestimate.

use std::borrow::Cow;
use std::fmt;

use serde::de::{Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Json<'a> {
    Null,
    Bool(bool),
    Number(Number),
    String(Cow<'a, str>),
    Array(Vec<Json<'a>>),
    Object(Vec<(Cow<'a, str>, Json<'a>)>),
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Number {
    Whole(u64),
    Negative(i64),
    Float(f64),
}

impl<'a> Json<'a> {
    /// Parses a whole document.
    pub(crate) fn parse(bytes: &'a [u8]) -> serde_json::Result<Json<'a>> {
        serde_json::from_slice(bytes)
    }

    /// An object's member `key` (the last, if written twice).
    pub(crate) fn get(&self, key: &str) -> Option<&Json<'a>> {
        match self {
            Json::Object(members) => members.iter().rev().find(|(k, _)| k == key).map(|m| &m.1),
            _ => None,
        }
    }

    pub(crate) fn as_str(&self) -> Option<&str> {
        match self {
            Json::String(s) => Some(s),
            _ => None,
        }
    }

    pub(crate) fn is_number(&self) -> bool {
        matches!(self, Json::Number(_))
    }

    /// The value at an RFC 6901 pointer.
    pub(crate) fn pointer(&self, pointer: &str) -> Option<&Json<'a>> {
        if pointer.is_empty() {
            return Some(self);
        }
        let rest = pointer.strip_prefix('/')?;
        rest.split('/').try_fold(self, |v, token| {
            let token = token.replace("~1", "/").replace("~0", "~");
            match v {
                Json::Object(_) => v.get(&token),
                Json::Array(items) => {
                    if token.starts_with('+') || (token.starts_with('0') && token.len() > 1) {
                        return None;
                    }
                    items.get(token.parse::<usize>().ok()?)
                }
                _ => None,
            }
        })
    }

    /// As a whole, non-negative cost: a number (a fraction rounds up) or a string
    /// holding one.
    pub(crate) fn number(&self) -> Option<u64> {
        match self {
            Json::Number(Number::Whole(n)) => Some(*n),
            Json::Number(Number::Negative(_)) => None,
            Json::Number(Number::Float(f)) => (*f >= 0.0).then(|| f.ceil() as u64),
            // As a header writes one.
            Json::String(s) => s.trim().parse().ok(),
            _ => None,
        }
    }
}

impl<'de> Deserialize<'de> for Json<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Json<'de>, D::Error> {
        d.deserialize_any(JsonVisitor)
    }
}

struct JsonVisitor;

impl<'de> Visitor<'de> for JsonVisitor {
    type Value = Json<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, b: bool) -> Result<Json<'de>, E> {
        Ok(Json::Bool(b))
    }

    fn visit_u64<E>(self, n: u64) -> Result<Json<'de>, E> {
        Ok(Json::Number(Number::Whole(n)))
    }

    fn visit_i64<E>(self, n: i64) -> Result<Json<'de>, E> {
        Ok(Json::Number(match u64::try_from(n) {
            Ok(n) => Number::Whole(n),
            Err(_) => Number::Negative(n),
        }))
    }

    fn visit_f64<E>(self, f: f64) -> Result<Json<'de>, E> {
        Ok(Json::Number(Number::Float(f)))
    }

    fn visit_borrowed_str<E>(self, s: &'de str) -> Result<Json<'de>, E> {
        Ok(Json::String(Cow::Borrowed(s)))
    }

    fn visit_str<E>(self, s: &str) -> Result<Json<'de>, E> {
        Ok(Json::String(Cow::Owned(s.to_owned())))
    }

    fn visit_string<E>(self, s: String) -> Result<Json<'de>, E> {
        Ok(Json::String(Cow::Owned(s)))
    }

    fn visit_unit<E>(self) -> Result<Json<'de>, E> {
        Ok(Json::Null)
    }

    fn visit_none<E>(self) -> Result<Json<'de>, E> {
        Ok(Json::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Json<'de>, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(64));
        while let Some(v) = seq.next_element()? {
            items.push(v);
        }
        Ok(Json::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Json<'de>, A::Error> {
        let mut members = Vec::new();
        while let Some(Key(k)) = map.next_key()? {
            members.push((k, map.next_value()?));
        }
        Ok(Json::Object(members))
    }
}

/// An object's key, borrowed from the body when it has no escapes.
struct Key<'a>(Cow<'a, str>);

impl<'de> Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Key<'de>, D::Error> {
        struct KeyVisitor;
        impl<'de> Visitor<'de> for KeyVisitor {
            type Value = Key<'de>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object key")
            }

            fn visit_borrowed_str<E>(self, s: &'de str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Borrowed(s)))
            }

            fn visit_str<E>(self, s: &str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(s.to_owned())))
            }

            fn visit_string<E>(self, s: String) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(s)))
            }
        }
        d.deserialize_str(KeyVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn strings_are_borrowed_unless_escaped() {
        let body = br#"{"a":"plain","b\n":"esc\"aped","n":[1,-2,2.5,"7"]}"#;
        let v = Json::parse(body).unwrap();
        assert!(matches!(
            v.get("a"),
            Some(Json::String(Cow::Borrowed("plain")))
        ));
        assert_eq!(v.get("b\n").and_then(Json::as_str), Some("esc\"aped"));
        let n = |p| v.pointer(p).and_then(Json::number);
        assert_eq!(
            (n("/n/0"), n("/n/1"), n("/n/2"), n("/n/3")),
            (Some(1), None, Some(3), Some(7))
        );
        assert_eq!(v.pointer("/n/01"), None);
        assert_eq!(
            Json::parse(br#"{"k":1,"k":2}"#)
                .unwrap()
                .get("k")
                .and_then(Json::number),
            Some(2)
        );
    }

    proptest! {
        /// Pointers read what `serde_json`'s own values give, on any document.
        #[test]
        fn pointers_read_what_serde_json_reads(
            text in r#"\{("[a-c]{1,2}":(0|[1-9][0-9]{0,2}|"[a-z0-9]{0,3}"|\[(0|[1-9])(,(0|[1-9][0-9]?)){0,3}\]|null),){0,5}"z":0\}"#,
            pointer in "(/[a-c0-3z]{1,2}){0,2}",
        ) {
            let ours = Json::parse(text.as_bytes()).unwrap();
            let theirs: serde_json::Value = serde_json::from_str(&text).unwrap();
            let want = theirs.pointer(&pointer).and_then(|v| match v {
                serde_json::Value::Number(n) => n.as_u64(),
                serde_json::Value::String(s) => s.trim().parse().ok(),
                _ => None,
            });
            prop_assert_eq!(ours.pointer(&pointer).and_then(Json::number), want);
        }
    }
}
