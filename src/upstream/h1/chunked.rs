//! The chunked transfer coding of a response body (RFC 9112 §7.1), decoded from a buffer
//! that the connection fills: data chunks come out as they are, without a copy.

use bytes::{Bytes, BytesMut};
use http::HeaderMap;
use http::header::{HeaderName, HeaderValue};

use super::Error;

/// A chunk-size line (with extensions) or the whole trailer section longer than this is
/// refused: hyper's limits are of the same order.
const MAX_LINE: usize = 4096;
const MAX_TRAILERS: usize = 16 * 1024;
const MAX_TRAILER_FIELDS: usize = 64;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Expecting a chunk-size line.
    Size,
    /// Inside a chunk's data, this many bytes left.
    Data(u64),
    /// After a chunk's data, expecting its CRLF.
    DataEnd,
    /// After the last chunk: trailer fields, then an empty line.
    Trailers,
    Done,
}

/// What one step of decoding produced.
#[derive(Debug)]
pub enum Decoded {
    Data(Bytes),
    /// The body ended; the trailer fields, if it had any.
    End(Option<HeaderMap>),
    /// More bytes are needed.
    More,
}

#[derive(Debug)]
pub struct Decoder {
    state: State,
}

impl Default for Decoder {
    fn default() -> Self {
        Decoder { state: State::Size }
    }
}

impl Decoder {
    /// Decodes what `buf` holds, consuming it: data, the end, or a need for more.
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Decoded, Error> {
        loop {
            match self.state {
                State::Size => {
                    let Some(end) = line_end(buf)? else {
                        return Ok(Decoded::More);
                    };
                    let size = chunk_size(&buf[..end])?;
                    let _ = buf.split_to(end + 2);
                    self.state = if size == 0 {
                        State::Trailers
                    } else {
                        State::Data(size)
                    };
                }
                State::Data(left) => {
                    if buf.is_empty() {
                        return Ok(Decoded::More);
                    }
                    let n = usize::try_from(left).unwrap_or(usize::MAX).min(buf.len());
                    let left = left - n as u64;
                    self.state = if left == 0 {
                        State::DataEnd
                    } else {
                        State::Data(left)
                    };
                    return Ok(Decoded::Data(buf.split_to(n).freeze()));
                }
                State::DataEnd => {
                    if buf.len() < 2 {
                        return Ok(Decoded::More);
                    }
                    if &buf[..2] != b"\r\n" {
                        return Err(Error::Chunk("chunk data longer than its size"));
                    }
                    let _ = buf.split_to(2);
                    self.state = State::Size;
                }
                State::Trailers => {
                    if buf.starts_with(b"\r\n") {
                        let _ = buf.split_to(2);
                        self.state = State::Done;
                        return Ok(Decoded::End(None));
                    }
                    let mut slots = [httparse::EMPTY_HEADER; MAX_TRAILER_FIELDS];
                    match httparse::parse_headers(buf, &mut slots) {
                        Ok(httparse::Status::Complete((len, fields))) => {
                            let mut map = HeaderMap::with_capacity(fields.len());
                            for f in fields.iter() {
                                let (Ok(name), Ok(value)) = (
                                    HeaderName::from_bytes(f.name.as_bytes()),
                                    HeaderValue::from_bytes(f.value),
                                ) else {
                                    return Err(Error::Chunk("invalid trailer field"));
                                };
                                map.append(name, value);
                            }
                            let _ = buf.split_to(len);
                            self.state = State::Done;
                            return Ok(Decoded::End(Some(map)));
                        }
                        Ok(httparse::Status::Partial) if buf.len() > MAX_TRAILERS => {
                            return Err(Error::Chunk("trailer section too large"));
                        }
                        Ok(httparse::Status::Partial) => return Ok(Decoded::More),
                        Err(_) => return Err(Error::Chunk("invalid trailer section")),
                    }
                }
                State::Done => return Ok(Decoded::End(None)),
            }
        }
    }
}

/// Where the line at the front of `buf` ends (its CR), if it has.
fn line_end(buf: &[u8]) -> Result<Option<usize>, Error> {
    let window = &buf[..buf.len().min(MAX_LINE)];
    match window.windows(2).position(|w| w == b"\r\n") {
        Some(i) => Ok(Some(i)),
        None if buf.len() >= MAX_LINE => Err(Error::Chunk("chunk-size line too long")),
        None => Ok(None),
    }
}

/// `chunk-size [ chunk-ext ]`: hex digits, then nothing, or extensions after `;` (which
/// are ignored, as the RFC allows).
fn chunk_size(line: &[u8]) -> Result<u64, Error> {
    let digits = line.iter().take_while(|b| b.is_ascii_hexdigit()).count();
    if digits == 0 || digits > 15 {
        return Err(Error::Chunk("invalid chunk size"));
    }
    let rest = line[digits..].trim_ascii_start();
    if !(rest.is_empty() || rest[0] == b';') || rest.iter().any(|&b| b == b'\n' || b == b'\r') {
        return Err(Error::Chunk("invalid chunk size"));
    }
    Ok(line[..digits].iter().fold(0u64, |n, &d| {
        let v = (d as char).to_digit(16).unwrap_or(0);
        n * 16 + u64::from(v)
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Feeds `wire` in pieces of `step` bytes; the data and trailers decoded.
    fn run(wire: &[u8], step: usize) -> Result<(Vec<u8>, Option<HeaderMap>, usize), Error> {
        let mut d = Decoder::default();
        let mut buf = BytesMut::new();
        let mut data = Vec::new();
        let mut fed = 0;
        loop {
            match d.decode(&mut buf)? {
                Decoded::Data(b) => data.extend_from_slice(&b),
                Decoded::End(t) => return Ok((data, t, buf.len() + wire.len() - fed)),
                Decoded::More => {
                    if fed == wire.len() {
                        return Err(Error::Closed("ended"));
                    }
                    let n = step.min(wire.len() - fed);
                    buf.extend_from_slice(&wire[fed..fed + n]);
                    fed += n;
                }
            }
        }
    }

    #[test]
    fn decodes_chunks_extensions_and_trailers_byte_by_byte() {
        let wire = b"5;name=val\r\nhello\r\n1\r\n \r\nA\r\n0123456789\r\n0\r\nx-sum: 9\r\n\r\nNEXT";
        for step in [1, 3, 7, wire.len()] {
            let (data, trailers, left) = run(wire, step).unwrap();
            assert_eq!(data, b"hello 0123456789");
            assert_eq!(trailers.unwrap()["x-sum"], "9");
            assert_eq!(left, 4, "the next response's bytes stay in the buffer");
        }
        let (data, trailers, _) = run(b"0\r\n\r\n", 1).unwrap();
        assert!(data.is_empty() && trailers.is_none());
    }

    #[test]
    fn refuses_what_is_not_chunked_coding() {
        for bad in [
            &b"x\r\n"[..],
            b"5\r\nhelloXX",
            b"-1\r\n",
            b"1000000000000000\r\n",
            b"5 x\r\nhello\r\n",
            b"0\r\nbad trailer\r\n\r\n",
        ] {
            assert!(
                matches!(run(bad, 1), Err(Error::Chunk(_))),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
        let long = [b"1".repeat(MAX_LINE + 1), b"\r\n".to_vec()].concat();
        assert!(matches!(run(&long, 100), Err(Error::Chunk(_))));
    }

    proptest! {
        /// Any body, any chunking, any split of the wire: the same bytes come out, and
        /// nothing after the body is consumed.
        #[test]
        fn round_trips(
            parts in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 1..40), 0..8),
            step in 1usize..50,
        ) {
            let mut wire = Vec::new();
            for p in &parts {
                wire.extend_from_slice(format!("{:x}\r\n", p.len()).as_bytes());
                wire.extend_from_slice(p);
                wire.extend_from_slice(b"\r\n");
            }
            wire.extend_from_slice(b"0\r\n\r\nHTTP/1.1");
            let (data, _, left) = run(&wire, step).unwrap();
            prop_assert_eq!(data, parts.concat());
            prop_assert_eq!(left, 8);
        }
    }
}
