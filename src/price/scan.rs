//! Reads numbers at chosen JSON pointers from a document streamed to it chunk by chunk,
//! holding only the path to the value being read and that value's token (both bounded),
//! never the document: a response body is read as it passes to the client. Values are
//! taken as `serde_json` would give them from the whole document: a key written twice
//! counts its last value, and a document that turns out malformed, or ends unfinished,
//! reports nothing.

/// A key longer than this matches no pointer (pointers name short keys).
const MAX_KEY: usize = 128;
/// A number or string value longer than this at a pointer reads as no number.
const MAX_VALUE: usize = 64;
/// Paths deeper than this are followed by their brackets alone: no pointer goes that deep.
const MAX_DEPTH: usize = 32;
/// A document nested deeper than this is refused, as `serde_json` refuses it: the
/// brackets followed stay bounded whatever the body.
const MAX_NESTING: usize = 128;

pub(crate) struct Scanner {
    /// Each pointer's reference tokens, unescaped (`~1` is `/`, `~0` is `~`).
    targets: Vec<Vec<String>>,
    /// The last number found at each pointer.
    found: Vec<Option<u64>>,
    /// Where the value being read sits: a key in an object, an index in an array.
    path: Vec<Step>,
    /// Containers deeper than `MAX_DEPTH`, followed by count alone; their brackets.
    deep: Vec<u8>,
    state: State,
    /// The key, number or string being read.
    token: Vec<u8>,
    /// The value being read is at one of the pointers: (index, whether it is a string).
    at: Option<usize>,
    /// Escapes inside the string being read: after a backslash, or the `\u` digits left.
    escape: Escape,
    /// The token outgrew its bound: a key matches nothing, a value is no number.
    long: bool,
    done: bool,
    failed: bool,
}

#[derive(Debug, Clone)]
enum Step {
    /// A key in an object, once read (`None`: too long to match, or not read yet).
    Key(Option<String>),
    Index(usize),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// A value comes next (the document's, an array element, an object member's).
    Value,
    /// An object's first key or its end.
    KeyOrEnd,
    /// An object's next key after a comma.
    Key,
    /// A key being read.
    KeyString,
    Colon,
    /// A string value being read.
    String,
    Number,
    /// `true`, `false` or `null`.
    Literal,
    /// A comma or the container's end, after a value.
    After,
    /// An array's first element or its end.
    ElementOrEnd,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Escape {
    None,
    Backslash,
    Unicode(u8),
}

impl Scanner {
    /// A scanner for `pointers` (RFC 6901, each starting with `/`).
    pub(crate) fn new(pointers: &[&str]) -> Scanner {
        let targets = pointers
            .iter()
            .map(|p| {
                p.split('/')
                    .skip(1)
                    .map(|t| t.replace("~1", "/").replace("~0", "~"))
                    .collect()
            })
            .collect();
        Scanner {
            targets,
            found: vec![None; pointers.len()],
            path: Vec::new(),
            deep: Vec::new(),
            state: State::Value,
            token: Vec::new(),
            at: None,
            escape: Escape::None,
            long: false,
            done: false,
            failed: false,
        }
    }

    /// The next part of the document.
    pub(crate) fn feed(&mut self, data: &[u8]) {
        for &b in data {
            if self.failed {
                return;
            }
            self.byte(b);
        }
    }

    /// The document ended: the number at each pointer, if the document was whole and
    /// well-formed and held one there.
    pub(crate) fn finish(mut self) -> Vec<Option<u64>> {
        if self.state == State::Number && self.path.is_empty() && self.deep.is_empty() {
            self.end_scalar();
            self.done = true;
        }
        if self.failed || !self.done {
            return vec![None; self.found.len()];
        }
        self.found
    }

    fn fail(&mut self) {
        self.failed = true;
    }

    fn byte(&mut self, b: u8) {
        match self.state {
            State::String | State::KeyString => self.string_byte(b),
            State::Number => {
                if matches!(b, b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E') {
                    self.push_token(b);
                } else {
                    self.end_scalar();
                    self.after_value();
                    self.byte(b);
                }
            }
            State::Literal => {
                if b.is_ascii_lowercase() {
                    self.push_token(b);
                } else {
                    if !matches!(&self.token[..], b"true" | b"false" | b"null") {
                        return self.fail();
                    }
                    self.after_value();
                    self.byte(b);
                }
            }
            _ if b.is_ascii_whitespace() => {}
            State::Value => self.value(b),
            State::ElementOrEnd => {
                if b == b']' {
                    self.close(b'[');
                } else {
                    self.value(b);
                }
            }
            State::KeyOrEnd | State::Key => match b {
                b'"' => {
                    self.token.clear();
                    self.long = false;
                    self.state = State::KeyString;
                }
                b'}' if self.state == State::KeyOrEnd => self.close(b'{'),
                _ => self.fail(),
            },
            State::Colon => {
                if b == b':' {
                    self.state = State::Value;
                } else {
                    self.fail();
                }
            }
            State::After => match (b, self.innermost()) {
                (b',', Some(b'{')) => self.state = State::Key,
                (b',', Some(b'[')) => {
                    if self.deep.is_empty()
                        && let Some(Step::Index(i)) = self.path.last_mut()
                    {
                        *i += 1;
                    }
                    self.state = State::Value;
                }
                (b'}', Some(b'{')) => self.close(b'{'),
                (b']', Some(b'[')) => self.close(b'['),
                _ => self.fail(),
            },
        }
    }

    /// The bracket of the innermost open container, if any.
    fn innermost(&self) -> Option<u8> {
        if let Some(b) = self.deep.last() {
            return Some(*b);
        }
        match self.path.last() {
            Some(Step::Key(_)) => Some(b'{'),
            Some(Step::Index(_)) => Some(b'['),
            None => None,
        }
    }

    fn value(&mut self, b: u8) {
        if self.done {
            // Something after the document's one value.
            return self.fail();
        }
        // A value here replaces whatever an earlier one of the same key held, at this
        // pointer and below it.
        if self.deep.is_empty() {
            for k in 0..self.targets.len() {
                if self.under(&self.targets[k]) {
                    self.found[k] = None;
                }
            }
        }
        self.at = self.target();
        self.token.clear();
        self.long = false;
        match b {
            b'{' | b'[' => {
                self.at = None;
                if self.path.len() + self.deep.len() >= MAX_NESTING {
                    return self.fail();
                }
                if self.path.len() < MAX_DEPTH && self.deep.is_empty() {
                    self.path.push(if b == b'{' {
                        Step::Key(None)
                    } else {
                        Step::Index(0)
                    });
                } else {
                    self.deep.push(b);
                }
                self.state = if b == b'{' {
                    State::KeyOrEnd
                } else {
                    State::ElementOrEnd
                };
            }
            b'"' => self.state = State::String,
            b'-' | b'0'..=b'9' => {
                self.token.push(b);
                self.state = State::Number;
            }
            b't' | b'f' | b'n' => {
                self.at = None;
                self.token.push(b);
                self.state = State::Literal;
            }
            _ => self.fail(),
        }
    }

    fn close(&mut self, open: u8) {
        if self.deep.pop().is_none() {
            match (self.path.pop(), open) {
                (Some(Step::Key(_)), b'{') | (Some(Step::Index(_)), b'[') => {}
                _ => return self.fail(),
            }
        }
        self.after_value();
    }

    /// A value ended: a comma or its container's end comes next, or the document ended.
    fn after_value(&mut self) {
        if self.path.is_empty() && self.deep.is_empty() {
            self.done = true;
        }
        self.state = State::After;
    }

    fn string_byte(&mut self, b: u8) {
        match self.escape {
            Escape::Backslash => {
                self.escape = if b == b'u' {
                    Escape::Unicode(4)
                } else {
                    Escape::None
                };
                let plain = match b {
                    b'"' | b'\\' | b'/' => Some(b),
                    b'b' => Some(8),
                    b'f' => Some(12),
                    b'n' => Some(b'\n'),
                    b'r' => Some(b'\r'),
                    b't' => Some(b'\t'),
                    b'u' => None,
                    _ => return self.fail(),
                };
                match plain {
                    Some(c) => self.push_token(c),
                    // A \u escape in a key or number is read as no match: pointers name
                    // plain keys.
                    None => self.long = true,
                }
            }
            Escape::Unicode(n) => {
                if !b.is_ascii_hexdigit() {
                    return self.fail();
                }
                self.escape = if n > 1 {
                    Escape::Unicode(n - 1)
                } else {
                    Escape::None
                };
            }
            Escape::None => match b {
                b'\\' => self.escape = Escape::Backslash,
                b'"' => {
                    if self.state == State::KeyString {
                        let key = (!self.long)
                            .then(|| String::from_utf8(std::mem::take(&mut self.token)).ok())
                            .flatten();
                        if self.deep.is_empty()
                            && let Some(Step::Key(k)) = self.path.last_mut()
                        {
                            *k = key;
                        }
                        self.state = State::Colon;
                    } else {
                        self.end_scalar();
                        self.after_value();
                    }
                }
                0..=0x1f => self.fail(),
                _ => self.push_token(b),
            },
        }
    }

    fn push_token(&mut self, b: u8) {
        let cap = if self.state == State::KeyString {
            MAX_KEY
        } else {
            MAX_VALUE
        };
        if self.token.len() < cap {
            self.token.push(b);
        } else {
            self.long = true;
        }
    }

    /// A number or string value ended: noted if it sits at a pointer and reads as a
    /// whole, non-negative number (a fraction rounds up), as a cost does.
    fn end_scalar(&mut self) {
        if self.state == State::Number
            && !self.long
            && !std::str::from_utf8(&self.token).is_ok_and(is_number)
        {
            return self.fail();
        }
        let Some(i) = self.at.take() else {
            return;
        };
        if self.long {
            self.found[i] = None;
            return;
        }
        let text = std::str::from_utf8(&self.token).ok();
        let n = match self.state {
            State::String => text.and_then(super::read::number),
            _ => text.and_then(|t| {
                t.parse::<u64>().ok().or_else(|| {
                    t.parse::<f64>()
                        .ok()
                        .filter(|f| *f >= 0.0 && f.is_finite())
                        .map(|f| f.ceil() as u64)
                })
            }),
        };
        for (k, t) in self.targets.iter().enumerate() {
            if k == i || self.matches(t) {
                self.found[k] = n;
            }
        }
    }

    /// The first pointer the value about to be read sits at.
    fn target(&self) -> Option<usize> {
        if !self.deep.is_empty() {
            return None;
        }
        self.targets.iter().position(|t| self.matches(t))
    }

    fn matches(&self, tokens: &[String]) -> bool {
        tokens.len() == self.path.len() && self.under(tokens)
    }

    /// Whether the pointer `tokens` is at the current path or below it.
    fn under(&self, tokens: &[String]) -> bool {
        tokens.len() >= self.path.len()
            && tokens.iter().zip(&self.path).all(|(t, s)| match s {
                Step::Key(Some(k)) => k == t,
                Step::Key(None) => false,
                // As RFC 6901 writes an index: digits, no leading zero.
                Step::Index(i) => {
                    t.bytes().all(|b| b.is_ascii_digit())
                        && (t.len() == 1 || !t.starts_with('0'))
                        && t.parse::<usize>().ok() == Some(*i)
                }
            })
    }
}

/// Whether `t` is a JSON number: `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`.
fn is_number(t: &str) -> bool {
    let b = t.as_bytes();
    let mut i = usize::from(b.first() == Some(&b'-'));
    let digits = |i: &mut usize| {
        let start = *i;
        while b.get(*i).is_some_and(u8::is_ascii_digit) {
            *i += 1;
        }
        *i - start
    };
    match b.get(i) {
        Some(b'0') => i += 1,
        Some(b'1'..=b'9') => {
            digits(&mut i);
        }
        _ => return false,
    }
    if b.get(i) == Some(&b'.') {
        i += 1;
        if digits(&mut i) == 0 {
            return false;
        }
    }
    if matches!(b.get(i), Some(b'e' | b'E')) {
        i += 1;
        if matches!(b.get(i), Some(b'+' | b'-')) {
            i += 1;
        }
        if digits(&mut i) == 0 {
            return false;
        }
    }
    i == b.len()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn scan(doc: &[u8], pointers: &[&str], chunk: usize) -> Vec<Option<u64>> {
        let mut s = Scanner::new(pointers);
        for part in doc.chunks(chunk.max(1)) {
            s.feed(part);
        }
        s.finish()
    }

    /// A JSON value as a whole, non-negative cost, as pricing reads one.
    fn value_number(v: &serde_json::Value) -> Option<u64> {
        match v {
            serde_json::Value::Number(n) => n
                .as_u64()
                .or_else(|| n.as_f64().filter(|f| *f >= 0.0).map(|f| f.ceil() as u64)),
            serde_json::Value::String(s) => super::super::read::number(s),
            _ => None,
        }
    }

    /// What `serde_json` reads at each pointer of the whole document, as a cost.
    fn whole(doc: &[u8], pointers: &[&str]) -> Vec<Option<u64>> {
        match serde_json::from_slice::<serde_json::Value>(doc) {
            Ok(v) => pointers
                .iter()
                .map(|p| v.pointer(p).and_then(value_number))
                .collect(),
            Err(_) => vec![None; pointers.len()],
        }
    }

    #[test]
    fn usage_is_read_at_its_pointers_in_any_chunks() {
        let doc = br#"{"id":"x","choices":[{"text":"a \"quoted\" }{ ]["}],"usage":{"prompt_tokens":12,"completion_tokens":30.2,"total_tokens":"43"},"extra":[1,[2,{"usage":{"total_tokens":9}}]]}"#;
        let pointers = [
            "/usage/prompt_tokens",
            "/usage/completion_tokens",
            "/usage/total_tokens",
            "/extra/1/1/usage/total_tokens",
            "/missing",
        ];
        for chunk in 1..doc.len() {
            assert_eq!(
                scan(doc, &pointers, chunk),
                [Some(12), Some(31), Some(43), Some(9), None],
                "chunks of {chunk}"
            );
        }
    }

    #[test]
    fn a_broken_or_unfinished_document_reports_nothing() {
        let p = ["/usage/total_tokens"];
        assert_eq!(scan(br#"{"usage":{"total_tokens":5}"#, &p, 3), [None]);
        assert_eq!(scan(br#"{"usage":{"total_tokens":5}}}"#, &p, 3), [None]);
        assert_eq!(scan(br#"{"usage":{"total_tokens":5},}"#, &p, 3), [None]);
        assert_eq!(scan(br#"{"usage":{"total_tokens":5}} x"#, &p, 3), [None]);
        assert_eq!(scan(br#"{"usage":{"total_tokens":5}}"#, &p, 3), [Some(5)]);
        assert_eq!(scan(b"7", &[""], 1), [Some(7)], "the whole document");
        let deep = format!("{}1{}", "[".repeat(200), "]".repeat(200));
        assert_eq!(
            scan(deep.as_bytes(), &[""], 7),
            whole(deep.as_bytes(), &[""]),
            "nested past serde_json's limit: refused, as serde_json refuses it"
        );
        let mut s = Scanner::new(&["/a"]);
        s.feed("[".repeat(1 << 20).as_bytes());
        assert!(
            s.deep.len() < MAX_NESTING,
            "a flood of brackets holds nothing"
        );
    }

    /// Any JSON document, cut into any chunks, reads as `serde_json` reads the whole.
    fn json() -> impl Strategy<Value = serde_json::Value> {
        let leaf = prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(serde_json::Value::from),
            (0u64..1_000_000).prop_map(serde_json::Value::from),
            (-5.0f64..5000.0).prop_map(serde_json::Value::from),
            "[a-z~/\"\\\\ ]{0,6}".prop_map(serde_json::Value::from),
            "[0-9]{1,4}".prop_map(serde_json::Value::from),
        ];
        leaf.prop_recursive(5, 40, 5, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..5).prop_map(serde_json::Value::from),
                prop::collection::vec(("[a-c~/]{1,2}", inner), 0..5)
                    .prop_map(|kv| { serde_json::Value::Object(kv.into_iter().collect()) }),
            ]
        })
    }

    proptest! {
        #[test]
        fn streaming_reads_what_the_whole_document_holds(
            v in json(),
            chunk in 1usize..20,
            pretty in any::<bool>(),
            pointers in prop::collection::vec(
                prop::collection::vec(prop_oneof!["[a-c~/]{1,2}", "[0-4]"], 1..4), 1..4),
            cut in prop::option::of(0usize..200),
        ) {
            let mut doc = if pretty {
                serde_json::to_vec_pretty(&v).unwrap()
            } else {
                serde_json::to_vec(&v).unwrap()
            };
            if let Some(c) = cut {
                doc.truncate(c.min(doc.len()));
            }
            let pointers: Vec<String> = pointers
                .iter()
                .map(|p| p.iter().map(|t| format!("/{}", t.replace('~', "~0").replace('/', "~1"))).collect())
                .collect();
            let refs: Vec<&str> = pointers.iter().map(String::as_str).collect();
            prop_assert_eq!(scan(&doc, &refs, chunk), whole(&doc, &refs));
        }
    }
}
