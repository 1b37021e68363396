//! What a response says its request really cost (`actual`): a header, read with the
//! response head, or JSON pointers read from the body as it passes to the client. A
//! JSON body is copied aside up to a cap and read at its end; a Server-Sent Events
//! stream is read one `data:` line at a time, where usage arrives in the last events
//! (OpenAI's `stream_options.include_usage`, Anthropic's `message_start` and
//! `message_delta`), the last value at each pointer counting. Nothing is held back from
//! the client.

use http::HeaderMap;

use crate::config::cost::{Price, Source};

/// The actual costs `headers` report, by unit index, for the prices read from a header.
pub(crate) fn from_headers(prices: &[Price], headers: &HeaderMap) -> Vec<(u8, u64)> {
    prices
        .iter()
        .filter_map(|p| match &p.actual {
            Some(Source::Header(h)) => {
                let n = super::read::number(headers.get(h)?.to_str().ok()?)?;
                Some((p.index, n))
            }
            _ => None,
        })
        .collect()
}

/// Reads the actual costs from a response body fed to it chunk by chunk.
pub(crate) struct Meter {
    readers: Vec<Reader>,
    sse: bool,
    /// SSE: the line so far; JSON: the body so far.
    buf: Vec<u8>,
    /// The most `buf` holds: a longer JSON body, or SSE line, is not read.
    cap: usize,
    /// The JSON body, or the SSE line being read, outgrew `cap`.
    over: bool,
    /// Shopify's `extensions.cost.throttleStatus`, when asked for: currently available,
    /// maximum available, restore rate.
    throttle: Option<[Option<u64>; 3]>,
}

/// Where a Shopify GraphQL response says what its bucket of points holds.
const THROTTLE: [&str; 3] = [
    "/extensions/cost/throttleStatus/currentlyAvailable",
    "/extensions/cost/throttleStatus/maximumAvailable",
    "/extensions/cost/throttleStatus/restoreRate",
];

/// A Shopify bucket's state as a response reported it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Throttle {
    pub(crate) available: u64,
    pub(crate) maximum: u64,
    /// Points restored each second.
    pub(crate) restore: u64,
}

struct Reader {
    index: u8,
    pointers: Vec<String>,
    /// The last number seen at each pointer.
    seen: Vec<Option<u64>>,
}

impl Meter {
    /// A meter for the prices that read a JSON body, on a body that is an event stream
    /// (`sse`) or one JSON document; `None` when no price reads the body.
    #[cfg(test)]
    pub(crate) fn new(prices: &[Price], sse: bool, cap: usize) -> Option<Meter> {
        Meter::reading(prices, sse, cap, false)
    }

    /// As `new`, also reading Shopify's `throttleStatus` when `throttle` (then a meter is
    /// made even if no price reads the body).
    pub(crate) fn reading(
        prices: &[Price],
        sse: bool,
        cap: usize,
        throttle: bool,
    ) -> Option<Meter> {
        let readers: Vec<Reader> = prices
            .iter()
            .filter_map(|p| match &p.actual {
                Some(Source::Json(pointers)) => Some(Reader {
                    index: p.index,
                    pointers: pointers.clone(),
                    seen: vec![None; pointers.len()],
                }),
                _ => None,
            })
            .collect();
        let throttle = (throttle && !sse).then_some([None; 3]);
        (!readers.is_empty() || throttle.is_some()).then_some(Meter {
            readers,
            sse,
            buf: Vec::new(),
            cap,
            over: false,
            throttle,
        })
    }

    pub(crate) fn feed(&mut self, mut data: &[u8]) {
        if !self.sse {
            if self.buf.len() + data.len() > self.cap {
                self.over = true;
                self.buf = Vec::new();
            }
            if !self.over {
                self.buf.extend_from_slice(data);
            }
            return;
        }
        while let Some(nl) = data.iter().position(|b| *b == b'\n') {
            self.line_part(&data[..nl]);
            if !self.over {
                let line = std::mem::take(&mut self.buf);
                self.line(&line);
                self.buf = line;
            }
            self.buf.clear();
            self.over = false;
            data = &data[nl + 1..];
        }
        self.line_part(data);
    }

    fn line_part(&mut self, part: &[u8]) {
        if self.over || self.buf.len() + part.len() > self.cap {
            self.over = true;
            return;
        }
        self.buf.extend_from_slice(part);
    }

    /// One complete SSE line.
    fn line(&mut self, line: &[u8]) {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(data) = line.strip_prefix(b"data:") else {
            return;
        };
        if let Ok(v) = serde_json::from_slice::<serde_json::Value>(data) {
            self.read(&v);
        }
    }

    fn read(&mut self, v: &serde_json::Value) {
        if let Some(t) = &mut self.throttle {
            for (p, seen) in THROTTLE.iter().zip(t.iter_mut()) {
                if let Some(n) = v.pointer(p).and_then(super::read::value_number) {
                    *seen = Some(n);
                }
            }
        }
        for r in &mut self.readers {
            for (p, seen) in r.pointers.iter().zip(&mut r.seen) {
                if let Some(n) = v.pointer(p).and_then(super::read::value_number) {
                    *seen = Some(n);
                }
            }
        }
    }

    /// What the body said of Shopify's bucket (after `finish`).
    pub(crate) fn throttle(&self) -> Option<Throttle> {
        let [Some(available), Some(maximum), Some(restore)] = self.throttle? else {
            return None;
        };
        Some(Throttle {
            available,
            maximum,
            restore,
        })
    }

    /// The body ended (or was cut off): the actual cost per unit index, for the units
    /// the body reported.
    pub(crate) fn finish(&mut self) -> Vec<(u8, u64)> {
        if !self.sse && !self.over && !self.buf.is_empty() {
            let body = std::mem::take(&mut self.buf);
            if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&body) {
                self.read(&v);
            }
        }
        self.readers
            .iter_mut()
            .filter(|r| r.seen.iter().any(Option::is_some))
            .map(|r| {
                let sum = r
                    .seen
                    .iter()
                    .flatten()
                    .fold(0u64, |a, b| a.saturating_add(*b));
                r.seen.iter_mut().for_each(|s| *s = None);
                (r.index, sum)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::cost::{Estimate, Price};

    fn price(index: u8, actual: &str) -> Price {
        Price {
            unit: "tokens".into(),
            index,
            estimate: Estimate::Fixed(1),
            actual: Some(Source::parse(actual).unwrap()),
            max: None,
            fallback: None,
            default_output: 0,
            max_queue: None,
            ceiling: None,
        }
    }

    #[test]
    fn a_json_body_is_read_at_its_end_whatever_its_chunks() {
        let body =
            br#"{"id":"x","usage":{"prompt_tokens":12,"completion_tokens":30,"total_tokens":42}}"#;
        for cut in 0..body.len() {
            let mut m =
                Meter::new(&[price(1, "json:/usage/total_tokens")], false, 1 << 20).unwrap();
            m.feed(&body[..cut]);
            m.feed(&body[cut..]);
            assert_eq!(m.finish(), vec![(1, 42)]);
        }
        let mut m = Meter::new(&[price(1, "json:/usage/total_tokens")], false, 10).unwrap();
        m.feed(body);
        assert_eq!(m.finish(), vec![], "over the cap: the estimate stands");
    }

    #[test]
    fn an_event_stream_keeps_the_last_value_at_each_pointer() {
        // Anthropic: input tokens in message_start, output tokens growing in message_delta.
        let stream = "event: message_start\n\
            data: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":25,\"output_tokens\":1}}}\n\n\
            event: content_block_delta\n\
            data: {\"type\":\"content_block_delta\",\"delta\":{\"text\":\"hi\"}}\n\n\
            event: message_delta\r\n\
            data: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":15}}\r\n\r\n";
        let prices = [price(
            1,
            "json:/message/usage/input_tokens+/usage/output_tokens",
        )];
        for cut in 0..stream.len() {
            let mut m = Meter::new(&prices, true, 4096).unwrap();
            m.feed(&stream.as_bytes()[..cut]);
            m.feed(&stream.as_bytes()[cut..]);
            assert_eq!(m.finish(), vec![(1, 40)], "cut at {cut}");
        }
        let mut m = Meter::new(&prices, true, 4096).unwrap();
        m.feed(b"data: {\"choices\":[]}\n\n");
        assert_eq!(
            m.finish(),
            vec![],
            "a stream that never reports keeps the estimate"
        );
    }

    #[test]
    fn shopify_says_what_its_bucket_holds() {
        let body = br#"{"data":{},"extensions":{"cost":{"requestedQueryCost":101,"actualQueryCost":46,
            "throttleStatus":{"maximumAvailable":1000.0,"currentlyAvailable":954,"restoreRate":50.0}}}}"#;
        let prices = [price(1, "json:/extensions/cost/actualQueryCost")];
        let mut m = Meter::reading(&prices, false, 1 << 16, true).unwrap();
        m.feed(body);
        assert_eq!(m.finish(), vec![(1, 46)]);
        assert_eq!(
            m.throttle(),
            Some(Throttle {
                available: 954,
                maximum: 1000,
                restore: 50
            })
        );
        let mut m = Meter::reading(&[], false, 1 << 16, true).unwrap();
        m.feed(b"{}");
        assert_eq!((m.finish(), m.throttle()), (vec![], None));
    }

    #[test]
    fn headers_report_too() {
        let mut h = HeaderMap::new();
        h.insert("x-cost", "17".parse().unwrap());
        let prices = [price(2, "header:x-cost"), price(1, "json:/n")];
        assert_eq!(from_headers(&prices, &h), vec![(2, 17)]);
    }
}
