//! What a response says its request really cost (`actual`): a header, read with the
//! response head, or JSON pointers read from the body as it passes to the client,
//! streamed through a scanner that holds the path to the value being read, never the
//! body. A JSON body counts once it has ended whole; a Server-Sent Events stream is read
//! one `data:` line at a time, where usage arrives in the last events (OpenAI's
//! `stream_options.include_usage`, Anthropic's `message_start` and `message_delta`), the
//! last value at each pointer counting. Nothing is held back from the client.

use http::HeaderMap;

use super::scan::Scanner;
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
    /// Every pointer read: the readers' in order, then Shopify's throttle status.
    pointers: Vec<String>,
    sse: bool,
    /// The body's scanner (JSON), or the current `data:` line's (SSE).
    scanner: Option<Scanner>,
    /// SSE: where the current line stands.
    line: Line,
    /// Shopify's `extensions.cost.throttleStatus`, when asked for: currently available,
    /// maximum available, restore rate.
    throttle: Option<[Option<u64>; 3]>,
}

/// An event stream's current line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Line {
    /// This many bytes of it, all of them a start of `data:`.
    Start(usize),
    /// A `data:` line, its payload going through the scanner.
    Data,
    /// Any other line.
    Skip,
}

const DATA: &[u8] = b"data:";

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
    /// The last number seen at each of its pointers.
    seen: Vec<Option<u64>>,
}

impl Meter {
    /// A meter for the prices that read a JSON body, on a body that is an event stream
    /// (`sse`) or one JSON document; `None` when no price reads the body.
    #[cfg(test)]
    pub(crate) fn new(prices: &[Price], sse: bool) -> Option<Meter> {
        Meter::reading(prices, sse, false)
    }

    /// As `new`, also reading Shopify's `throttleStatus` when `throttle` (then a meter is
    /// made even if no price reads the body).
    pub(crate) fn reading(prices: &[Price], sse: bool, throttle: bool) -> Option<Meter> {
        let mut pointers = Vec::new();
        let readers: Vec<Reader> = prices
            .iter()
            .filter_map(|p| match &p.actual {
                Some(Source::Json(ps)) => {
                    pointers.extend(ps.iter().cloned());
                    Some(Reader {
                        index: p.index,
                        seen: vec![None; ps.len()],
                    })
                }
                _ => None,
            })
            .collect();
        let throttle = (throttle && !sse).then_some([None; 3]);
        if throttle.is_some() {
            pointers.extend(THROTTLE.iter().map(|p| p.to_string()));
        }
        if readers.is_empty() && throttle.is_none() {
            return None;
        }
        let mut m = Meter {
            readers,
            pointers,
            sse,
            scanner: None,
            line: Line::Start(0),
            throttle,
        };
        if !sse {
            m.scanner = Some(m.scanner());
        }
        Some(m)
    }

    fn scanner(&self) -> Scanner {
        let refs: Vec<&str> = self.pointers.iter().map(String::as_str).collect();
        Scanner::new(&refs)
    }

    pub(crate) fn feed(&mut self, mut data: &[u8]) {
        if !self.sse {
            if let Some(s) = &mut self.scanner {
                s.feed(data);
            }
            return;
        }
        while !data.is_empty() {
            let end = data.iter().position(|b| *b == b'\n');
            let part = &data[..end.unwrap_or(data.len())];
            self.line_part(part);
            if end.is_some() {
                self.end_line();
                data = &data[part.len() + 1..];
            } else {
                data = &[];
            }
        }
    }

    fn line_part(&mut self, mut part: &[u8]) {
        if let Line::Start(n) = self.line {
            let take = (DATA.len() - n).min(part.len());
            if part[..take] != DATA[n..n + take] {
                self.line = Line::Skip;
                return;
            }
            part = &part[take..];
            if n + take < DATA.len() {
                self.line = Line::Start(n + take);
                return;
            }
            self.line = Line::Data;
            self.scanner = Some(self.scanner());
        }
        if self.line == Line::Data
            && let Some(s) = &mut self.scanner
        {
            s.feed(part);
        }
    }

    /// One line of the stream ended: a `data:` line's numbers count.
    fn end_line(&mut self) {
        if self.line == Line::Data
            && let Some(s) = self.scanner.take()
        {
            self.note(s.finish());
        }
        self.line = Line::Start(0);
    }

    /// Values a whole document held, at each of `pointers`: each one found replaces
    /// what an earlier one said.
    fn note(&mut self, found: Vec<Option<u64>>) {
        let mut found = found.into_iter();
        for r in &mut self.readers {
            for seen in &mut r.seen {
                if let Some(Some(n)) = found.next() {
                    *seen = Some(n);
                }
            }
        }
        if let Some(t) = &mut self.throttle {
            for seen in t.iter_mut() {
                if let Some(Some(n)) = found.next() {
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
        if self.sse {
            // A last line without its newline.
            self.end_line();
        } else if let Some(s) = self.scanner.take() {
            self.note(s.finish());
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
            let mut m = Meter::new(&[price(1, "json:/usage/total_tokens")], false).unwrap();
            m.feed(&body[..cut]);
            m.feed(&body[cut..]);
            assert_eq!(m.finish(), vec![(1, 42)]);
            let mut m = Meter::new(&[price(1, "json:/usage/total_tokens")], false).unwrap();
            m.feed(&body[..cut]);
            assert_eq!(m.finish(), vec![], "cut off: the estimate stands");
        }
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
            let mut m = Meter::new(&prices, true).unwrap();
            m.feed(&stream.as_bytes()[..cut]);
            m.feed(&stream.as_bytes()[cut..]);
            assert_eq!(m.finish(), vec![(1, 40)], "cut at {cut}");
        }
        let mut m = Meter::new(&prices, true).unwrap();
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
        let mut m = Meter::reading(&prices, false, true).unwrap();
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
        let mut m = Meter::reading(&[], false, true).unwrap();
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
