//! Token estimates for the LLM APIs users call most, from the request body alone, as
//! the providers' rate limiters charge at arrival: the prompt's tokens plus the most the
//! reply may use (OpenAI: "the maximum of max_tokens and the estimated number of tokens
//! based on the character count"; Anthropic: output estimated from `max_tokens` until
//! the request ends).
//!
//! The prompt is counted without a tokenizer: every four ASCII characters are one token
//! (OpenAI's published rule of thumb for English), every other character one token, four
//! tokens of framing per message, and each image as 1,600 tokens. How far off it is:
//! - English prose and JSON: within about 15% of tiktoken's count, usually above it;
//! - CJK text: near (about one token a character), above it for common words;
//! - accented Latin text: above, by up to 2x (each accented letter counts a token);
//! - code, random identifiers and base64: below, by up to 2x (they tokenize at 2-3
//!   characters a token).
//!
//! The output part is the request's `max_completion_tokens`, `max_output_tokens` or
//! `max_tokens`, else the family's `default_output`; embeddings have none.

use super::json::Json;

use crate::config::cost::{Llm, LlmPart};

/// Tokens an image in a prompt is counted as: above OpenAI's high-detail tile count for
/// a 1024×1024 image (765) and Anthropic's for a 1.15-megapixel one (about 1,600).
const IMAGE: u64 = 1600;

/// Framing each message adds (role and separators).
const PER_MESSAGE: u64 = 4;

/// The estimate of `part` of a request `body` to `llm` at `path`; `default_output` when
/// the body names no maximum output.
pub(crate) fn estimate(
    llm: Llm,
    part: LlmPart,
    body: &Json<'_>,
    path: &str,
    default_output: u64,
) -> u64 {
    let input = || match llm {
        Llm::OpenAi => openai_input(body),
        Llm::Anthropic => anthropic_input(body),
    };
    let output = || {
        if path.trim_end_matches('/').ends_with("/embeddings") {
            return 0;
        }
        ["max_completion_tokens", "max_output_tokens", "max_tokens"]
            .iter()
            .find_map(|k| body.get(k).and_then(Json::number))
            .unwrap_or(default_output)
    };
    match part {
        LlmPart::All => input().saturating_add(output()),
        LlmPart::Input => input(),
        LlmPart::Output => output(),
    }
}

/// Chat `messages`, responses `input` and `instructions`, embeddings and completions
/// `input`/`prompt` (text, or token arrays), and the tools' schemas.
fn openai_input(body: &Json<'_>) -> u64 {
    let mut n = 0u64;
    if let Some(Json::Array(messages)) = body.get("messages") {
        n += messages.len() as u64 * PER_MESSAGE + 3;
        n += messages.iter().map(text_tokens).sum::<u64>();
    }
    for key in ["input", "prompt"] {
        match body.get(key) {
            Some(Json::Array(items)) => {
                n += items
                    .iter()
                    .map(|i| match i {
                        // A token id, or an array of them (embeddings).
                        Json::Number(_) => 1,
                        Json::Array(ids) if ids.iter().all(Json::is_number) => ids.len() as u64,
                        Json::Object(_) => PER_MESSAGE + text_tokens(i),
                        other => text_tokens(other),
                    })
                    .sum::<u64>()
            }
            Some(v) => n += text_tokens(v),
            None => {}
        }
    }
    for key in [
        "instructions",
        "tools",
        "functions",
        "response_format",
        "text",
    ] {
        if let Some(v) = body.get(key) {
            n += schema_tokens(v);
        }
    }
    n
}

/// `system` (text or blocks), `messages`, and the tools' schemas.
fn anthropic_input(body: &Json<'_>) -> u64 {
    let mut n = 0u64;
    if let Some(system) = body.get("system") {
        n += text_tokens(system);
    }
    if let Some(Json::Array(messages)) = body.get("messages") {
        n += messages.len() as u64 * PER_MESSAGE + 3;
        n += messages.iter().map(text_tokens).sum::<u64>();
    }
    if let Some(tools) = body.get("tools") {
        n += schema_tokens(tools);
    }
    n
}

/// The text a value carries: its strings, images at [`IMAGE`] each, and nothing for the
/// keys and numbers that only frame them.
fn text_tokens(v: &Json<'_>) -> u64 {
    match v {
        Json::String(s) => str_tokens(s),
        Json::Array(items) => items.iter().map(text_tokens).sum(),
        Json::Object(members) => {
            let image = matches!(
                v.get("type").and_then(Json::as_str),
                Some("image" | "image_url" | "input_image")
            );
            if image {
                return IMAGE;
            }
            members
                .iter()
                .filter(|(k, _)| !matches!(&**k, "role" | "type" | "id" | "name"))
                .map(|(_, v)| text_tokens(v))
                .sum::<u64>()
                + u64::from(v.get("name").is_some())
        }
        _ => 0,
    }
}

/// A schema or instruction counted whole, keys included: the provider renders it into
/// the prompt.
fn schema_tokens(v: &Json<'_>) -> u64 {
    match v {
        Json::String(s) => str_tokens(s),
        Json::Array(items) => items.iter().map(schema_tokens).sum(),
        Json::Object(members) => members
            .iter()
            .map(|(k, v)| str_tokens(k) + schema_tokens(v))
            .sum(),
        Json::Number(_) | Json::Bool(_) => 1,
        Json::Null => 0,
    }
}

/// Four ASCII characters a token, any other character a token of its own. Counted on
/// the bytes: a byte of 0x80 or above is not ASCII, and a character that is not ASCII
/// starts with a byte of 0xC0 or above.
pub(crate) fn str_tokens(s: &str) -> u64 {
    let (high, lead) = high_and_lead_bytes(s.as_bytes());
    (s.len() as u64 - high).div_ceil(4) + lead
}

/// The bytes with the top bit set, and those with the two top bits set, eight at a time
/// in the lanes of a word (a prompt is read on every request that prices it).
fn high_and_lead_bytes(bytes: &[u8]) -> (u64, u64) {
    const ONES: u64 = 0x0101_0101_0101_0101;
    // The sum of a word's eight byte lanes, each at most 255.
    let lanes = |x: u64| {
        let pairs = (x & 0x00FF_00FF_00FF_00FF) + ((x >> 8) & 0x00FF_00FF_00FF_00FF);
        pairs.wrapping_mul(0x0001_0001_0001_0001) >> 48
    };
    let (mut high, mut lead) = (0u64, 0u64);
    let mut chunks = bytes.chunks_exact(8);
    let (mut h, mut l, mut n) = (0u64, 0u64, 0u32);
    for c in &mut chunks {
        let Ok(word) = <[u8; 8]>::try_from(c) else {
            continue;
        };
        let x = u64::from_le_bytes(word);
        h += (x >> 7) & ONES;
        l += (x >> 7) & (x >> 6) & ONES;
        n += 1;
        // A lane holds at most 255.
        if n == 255 {
            (high, lead) = (high + lanes(h), lead + lanes(l));
            (h, l, n) = (0, 0, 0);
        }
    }
    (high, lead) = (high + lanes(h), lead + lanes(l));
    for b in chunks.remainder() {
        high += u64::from(*b >= 0x80);
        lead += u64::from(*b >= 0xC0);
    }
    (high, lead)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// `estimate` of a body written with `json!`, parsed as pricing parses it.
    fn est(llm: Llm, part: LlmPart, body: &serde_json::Value, path: &str, default: u64) -> u64 {
        let text = body.to_string();
        let v = Json::parse(text.as_bytes()).unwrap();
        estimate(llm, part, &v, path, default)
    }

    #[test]
    fn text_counts_four_ascii_characters_a_token_and_others_one() {
        assert_eq!(str_tokens(""), 0);
        assert_eq!(str_tokens("abcd"), 1);
        assert_eq!(str_tokens("abcde"), 2);
        assert_eq!(str_tokens("日本語"), 3);
        assert_eq!(str_tokens("café"), 2);
    }

    proptest::proptest! {
        #[test]
        fn words_of_bytes_count_as_bytes_one_by_one(s in "\\PC{0,3000}") {
            let b = s.as_bytes();
            let high = b.iter().filter(|x| **x >= 0x80).count() as u64;
            let lead = b.iter().filter(|x| **x >= 0xC0).count() as u64;
            proptest::prop_assert_eq!(high_and_lead_bytes(b), (high, lead));
            proptest::prop_assert_eq!(lead, s.chars().filter(|c| !c.is_ascii()).count() as u64);
        }
    }

    #[test]
    fn long_text_is_counted_in_words_exactly() {
        let s = "é".repeat(5000) + &"a".repeat(3001);
        assert_eq!(high_and_lead_bytes(s.as_bytes()), (10_000, 5000));
    }

    #[test]
    fn openai_chat_counts_messages_and_max_output() {
        let body = json!({
            "model": "gpt-4o-mini",
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": [{"type": "text", "text": "Say hello in one word"},
                                              {"type": "image_url", "image_url": {"url": "data:..."}}]}
            ],
            "max_completion_tokens": 100
        });
        let input = 2 * PER_MESSAGE
            + 3
            + str_tokens("You are terse.")
            + str_tokens("Say hello in one word")
            + IMAGE;
        let e = |part| est(Llm::OpenAi, part, &body, "/v1/chat/completions", 4096);
        assert_eq!(e(LlmPart::Input), input);
        assert_eq!(e(LlmPart::Output), 100);
        assert_eq!(e(LlmPart::All), input + 100);
        let no_max = json!({"messages": [{"role": "user", "content": "hi"}]});
        assert_eq!(
            est(
                Llm::OpenAi,
                LlmPart::Output,
                &no_max,
                "/v1/chat/completions",
                777
            ),
            777,
            "the family's default when the request names no maximum"
        );
    }

    #[test]
    fn openai_embeddings_and_responses() {
        let emb = json!({"model": "text-embedding-3-small", "input": ["abcdabcd", [1, 2, 3]]});
        assert_eq!(
            est(Llm::OpenAi, LlmPart::All, &emb, "/v1/embeddings", 4096),
            2 + 3,
            "no output for embeddings; token arrays count their length"
        );
        let resp = json!({"model": "o4-mini", "input": "abcdabcd", "instructions": "be brief", "max_output_tokens": 50});
        assert_eq!(
            est(Llm::OpenAi, LlmPart::All, &resp, "/v1/responses", 4096),
            2 + 2 + 50
        );
    }

    #[test]
    fn anthropic_counts_system_messages_and_max_tokens() {
        let body = json!({
            "model": "claude-sonnet-4-5",
            "system": [{"type": "text", "text": "abcdabcd"}],
            "messages": [{"role": "user", "content": "abcd"}],
            "max_tokens": 1024
        });
        let e = |part| est(Llm::Anthropic, part, &body, "/v1/messages", 4096);
        assert_eq!(e(LlmPart::Input), 2 + PER_MESSAGE + 3 + 1);
        assert_eq!(e(LlmPart::Output), 1024);
    }
}
