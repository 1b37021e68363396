//! Units and prices: the unit a limit counts (`unit = "tokens"`), and what a family's
//! request costs in it (`[upstream.family.cost.<unit>]`), as written and as resolved.
//! An upstream numbers its priced units 1 to 3 (0 is requests) in name order, so a
//! request's costs fit `limit::costs::Costs`.

use std::fmt;

use http::HeaderName;
use serde::{Deserialize, Serialize, Serializer, de};

/// The most priced units an upstream may have, beside requests (`limit::costs` holds
/// them all).
pub(crate) const MAX_PRICED: usize = 3;

/// What a request is charged in a unit when nothing else says.
pub(crate) const DEFAULT_OUTPUT: u64 = 4096;

/// The unit a limit counts: requests (the default), or a priced unit by name; `index` is
/// its number among its upstream's units once the config is resolved.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Unit {
    pub(crate) name: Option<String>,
    pub(crate) index: u8,
}

impl Unit {
    pub(crate) fn is_requests(&self) -> bool {
        self.name.is_none()
    }

    /// The name as a metric label or a config value writes it.
    pub(crate) fn label(&self) -> &str {
        self.name.as_deref().unwrap_or("requests")
    }
}

impl<'de> Deserialize<'de> for Unit {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Unit, D::Error> {
        let name = String::deserialize(d)?;
        if name == "requests" {
            return Ok(Unit::default());
        }
        if !is_unit_name(&name) {
            return Err(de::Error::custom(format!(
                "unit {name:?}: a unit is \"requests\" or a name of lowercase letters, digits \
                 and _ that its family prices in [upstream.family.cost.<unit>]"
            )));
        }
        Ok(Unit {
            name: Some(name),
            index: 0,
        })
    }
}

impl Serialize for Unit {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.label())
    }
}

/// A unit's name: it becomes a metric label and a `sluice-cost` key.
pub(crate) fn is_unit_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 32
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
}

/// `[upstream.family.cost.<unit>]` as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct CostSpec {
    pub(crate) estimate: EstimateSpec,
    pub(crate) actual: Option<String>,
    pub(crate) max: Option<std::num::NonZeroU64>,
    pub(crate) fallback: Option<u64>,
    pub(crate) default_output: Option<u64>,
    pub(crate) max_queue: Option<std::num::NonZeroU64>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(crate) enum EstimateSpec {
    Fixed(u64),
    Text(String),
}

/// What one request of a family costs in one unit, resolved.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Price {
    pub(crate) unit: String,
    /// Its number among its upstream's units.
    #[serde(skip)]
    pub(crate) index: u8,
    pub(crate) estimate: Estimate,
    /// Where the response says what the request really cost.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) actual: Option<Source>,
    /// A larger cost is refused at once with 413 `cost_too_large`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) max: Option<u64>,
    /// The cost when the estimate cannot be read (no header, a body that is not JSON or
    /// too large to read); without it such a request is refused.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) fallback: Option<u64>,
    /// The output an LLM estimator counts when the request names no maximum.
    pub(crate) default_output: u64,
    /// The most of the unit the family's queue holds waiting: an arrival that would pass
    /// it is answered 429 `queue_full` (one that finds the queue empty may always wait).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) max_queue: Option<u64>,
    /// The most the smallest limit of the unit that the family pays ever holds: a larger
    /// cost could never be admitted.
    #[serde(skip)]
    pub(crate) ceiling: Option<u64>,
}

/// How a request's cost is estimated before it is sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Estimate {
    Fixed(u64),
    Read(Source),
    Llm(Llm, LlmPart),
}

/// A built-in estimator for an LLM API's request bodies (`price::llm`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Llm {
    /// OpenAI chat completions, responses and embeddings (and Azure OpenAI's).
    OpenAi,
    /// Anthropic messages.
    Anthropic,
}

/// Which tokens an LLM estimate counts: all, the prompt's, or the most the reply may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LlmPart {
    All,
    Input,
    Output,
}

/// A number read from a request or response: a header, or the sum of JSON pointers into
/// the body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Source {
    Header(HeaderName),
    Json(Vec<String>),
}

impl Source {
    pub(crate) fn parse(text: &str) -> Result<Source, String> {
        if let Some(name) = text.strip_prefix("header:") {
            return HeaderName::from_bytes(name.trim().as_bytes())
                .map(Source::Header)
                .map_err(|_| format!("{name:?} is not a header name"));
        }
        if let Some(pointers) = text.strip_prefix("json:") {
            let list: Vec<String> = pointers.split('+').map(|p| p.trim().to_owned()).collect();
            if let Some(bad) = list.iter().find(|p| !p.starts_with('/')) {
                return Err(format!(
                    "{bad:?} is not a JSON pointer: each starts with / (\"json:/usage/total_tokens\", \
                     several joined by +)"
                ));
            }
            return Ok(Source::Json(list));
        }
        Err(format!(
            "{text:?}: write \"header:NAME\" or \"json:/pointer\" (several pointers joined by +)"
        ))
    }
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Header(h) => write!(f, "header:{h}"),
            Source::Json(p) => write!(f, "json:{}", p.join("+")),
        }
    }
}

impl Serialize for Source {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl Estimate {
    pub(crate) fn parse(spec: &EstimateSpec) -> Result<Estimate, String> {
        let text = match spec {
            EstimateSpec::Fixed(n) => return Ok(Estimate::Fixed(*n)),
            EstimateSpec::Text(t) => t.trim(),
        };
        let (name, part) = text.split_once(':').unwrap_or((text, ""));
        let llm = match name {
            "openai" => Some(Llm::OpenAi),
            "anthropic" => Some(Llm::Anthropic),
            _ => None,
        };
        if let Some(llm) = llm {
            let part = match part {
                "" => LlmPart::All,
                "input" => LlmPart::Input,
                "output" => LlmPart::Output,
                other => {
                    return Err(format!(
                        "{name}:{other}: an estimator counts all tokens, or :input or :output"
                    ));
                }
            };
            return Ok(Estimate::Llm(llm, part));
        }
        Source::parse(text).map(Estimate::Read).map_err(|e| {
            format!(
                "estimate {e}, an integer, or \"openai\" / \"anthropic\" (with :input or :output)"
            )
        })
    }
}

impl fmt::Display for Estimate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Estimate::Fixed(n) => write!(f, "{n}"),
            Estimate::Read(s) => write!(f, "{s}"),
            Estimate::Llm(llm, part) => {
                f.write_str(match llm {
                    Llm::OpenAi => "openai",
                    Llm::Anthropic => "anthropic",
                })?;
                f.write_str(match part {
                    LlmPart::All => "",
                    LlmPart::Input => ":input",
                    LlmPart::Output => ":output",
                })
            }
        }
    }
}

impl Serialize for Estimate {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn estimates_and_sources_read_as_written() {
        let e = |t: &str| Estimate::parse(&EstimateSpec::Text(t.into()));
        assert_eq!(e("openai"), Ok(Estimate::Llm(Llm::OpenAi, LlmPart::All)));
        assert_eq!(
            e("anthropic:output"),
            Ok(Estimate::Llm(Llm::Anthropic, LlmPart::Output))
        );
        assert!(e("anthropic:cache").is_err());
        assert_eq!(
            e("json:/a/b + /c").unwrap().to_string(),
            "json:/a/b+/c",
            "pointers summed"
        );
        assert_eq!(e("header:X-Cost").unwrap().to_string(), "header:x-cost");
        assert!(e("json:a").is_err());
        assert!(e("tiktoken").is_err());
        assert_eq!(
            Estimate::parse(&EstimateSpec::Fixed(25)),
            Ok(Estimate::Fixed(25))
        );
        assert!(is_unit_name("input_tokens"));
        assert!(!is_unit_name("Tokens") && !is_unit_name("") && !is_unit_name("a b"));
    }
}
