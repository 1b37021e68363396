//! Where log lines go: every line the binary writes to stderr, access lines and tracing's
//! alike, is appended to one bounded buffer that a writer thread empties; a worker holds
//! its lines and appends them a batch at a time, whenever it runs out of work
//! ([`batch_thread`]). A worker never waits for stderr: when the buffer is full (no one
//! reads the pipe), lines are dropped and counted. The access line is formatted here by
//! hand, the one line per request.
//!
//! Why not tracing-appender's non-blocking writer, which this replaced: it allocates a
//! buffer per line and sends each through a channel to a thread that writes it on its own,
//! and an access line formatted by tracing-subscriber (a visitor per field, a timestamp
//! formatted from scratch) cost about 10k instructions, a quarter of a whole proxied
//! request. Appending to a shared buffer and formatting a known set of fields directly
//! costs a small fraction of that (docs/BENCHMARKS.md, "The access log as shipped").
//!
//! The writer wakes on the first line after it went idle, lingers briefly so that lines
//! arriving meanwhile share one `write(2)`, swaps the buffer for its spare and writes
//! outside the lock. Dropping the [`Guard`] writes what is left (waiting at most 2 s for a
//! stderr that takes nothing); a line logged after that is written directly.

use parking_lot::{Condvar, Mutex, MutexGuard};
use std::io::Write;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::time::{Duration, SystemTime};
use tokio::time::Instant;

/// How long the writer waits after waking for more lines to join the same write. Bounds
/// how late a line reaches stderr, and how many writes a busy proxy makes (100 a second).
const LINGER: Duration = Duration::from_millis(10);

/// Bytes a queued line may take on average before lines are dropped for size; a line is
/// usually under 300 bytes, an access line with a long path can be several KiB.
const BYTES_PER_LINE: usize = 1024;

/// The writer's spare buffer is shrunk back to this after a burst grew it.
const KEEP_CAPACITY: usize = 256 << 10;

struct Sink {
    state: Mutex<State>,
    wake: Condvar,
    /// Signalled when the writer has stopped.
    stopped: Condvar,
    max_lines: usize,
    max_bytes: usize,
}

#[derive(Default)]
struct State {
    buf: Vec<u8>,
    lines: usize,
    /// The writer waits for a line: the next one must wake it.
    idle: bool,
    /// The guard was dropped: the writer writes what is left and stops.
    stop: bool,
    /// The writer has stopped: lines are written directly.
    closed: bool,
}

static SINK: OnceLock<Sink> = OnceLock::new();
static DROPPED: AtomicU64 = AtomicU64::new(0);

/// Lines dropped so far because stderr was not read fast enough.
pub(crate) fn dropped_lines() -> u64 {
    DROPPED.load(Ordering::Relaxed)
}

fn lock(sink: &Sink) -> MutexGuard<'_, State> {
    // Not poisoned by a panic (parking_lot): the buffer holds whole lines at every step.
    sink.state.lock()
}

impl Sink {
    /// Appends `lines` whole lines (`text` ends with a newline), or drops them when the
    /// buffer is full.
    fn push(&self, text: &[u8], lines: usize) {
        let mut st = lock(self);
        if st.closed {
            let _ = std::io::stderr().write_all(text);
            return;
        }
        if st.lines + lines > self.max_lines || st.buf.len() + text.len() > self.max_bytes {
            drop(st);
            DROPPED.fetch_add(lines.max(1) as u64, Ordering::Relaxed);
            return;
        }
        st.buf.extend_from_slice(text);
        st.lines += lines;
        if st.idle {
            st.idle = false;
            drop(st);
            self.wake.notify_one();
        }
    }

    fn run(&self) {
        let mut out = std::io::stderr();
        let mut spare = Vec::with_capacity(64 << 10);
        let mut st = lock(self);
        loop {
            while st.buf.is_empty() && !st.stop {
                st.idle = true;
                self.wake.wait(&mut st);
            }
            st.idle = false;
            if st.buf.is_empty() {
                // Stopped with nothing left: from now on a line is written directly.
                st.closed = true;
                self.stopped.notify_all();
                return;
            }
            if !st.stop {
                drop(st);
                std::thread::sleep(LINGER);
                st = lock(self);
            }
            std::mem::swap(&mut st.buf, &mut spare);
            let lines = std::mem::take(&mut st.lines);
            drop(st);
            // A full pipe blocks here, not in a worker; a closed one loses the lines.
            if out.write_all(&spare).is_err() {
                DROPPED.fetch_add(lines as u64, Ordering::Relaxed);
            }
            spare.clear();
            spare.shrink_to(KEEP_CAPACITY);
            st = lock(self);
        }
    }
}

/// How long the process waits at exit for the writer to write what is queued. A pipe that
/// no one reads would otherwise keep the process from exiting at all.
const EXIT_WAIT: Duration = Duration::from_secs(2);

/// Stops the writer when dropped, after it wrote every line queued so far, or after
/// `EXIT_WAIT` (2 s) if stderr takes nothing.
pub struct Guard {
    started: bool,
}

impl Drop for Guard {
    fn drop(&mut self) {
        let Some(sink) = SINK.get().filter(|_| self.started) else {
            return;
        };
        let mut st = lock(sink);
        st.stop = true;
        sink.wake.notify_one();
        sink.stopped
            .wait_while_for(&mut st, |st| !st.closed, EXIT_WAIT);
    }
}

/// Starts the writer thread; `queue` lines may wait for stderr before lines are dropped.
/// Call once, before anything logs; a second call only returns a guard that does nothing.
pub fn install(queue: usize) -> std::io::Result<Guard> {
    let queue = queue.max(1);
    let sink = Sink {
        state: Mutex::new(State::default()),
        wake: Condvar::new(),
        stopped: Condvar::new(),
        max_lines: queue,
        max_bytes: queue.saturating_mul(BYTES_PER_LINE),
    };
    if SINK.set(sink).is_err() {
        return Ok(Guard { started: false });
    }
    widen_pipe(&std::io::stderr(), PIPE_BYTES);
    let spawned = std::thread::Builder::new()
        .name("sluice-log".into())
        .spawn(|| {
            if let Some(sink) = SINK.get() {
                sink.run();
            }
        });
    if let Err(e) = spawned {
        // No writer: lines are written directly, as after the writer stops.
        if let Some(sink) = SINK.get() {
            lock(sink).closed = true;
        }
        return Err(e);
    }
    Ok(Guard { started: true })
}

/// What a pipe on stderr is widened to: a busy proxy's batch of [`LINGER`] (about 150 KiB
/// at 80k requests a second) fits in it, so the writer hands it over in one `write(2)`
/// instead of blocking until the reader has taken the first 64 KiB (Linux's default),
/// and a reader that stalls for tens of milliseconds costs no line. 1 MiB is the most an
/// unprivileged process may ask for by default (`/proc/sys/fs/pipe-max-size`).
const PIPE_BYTES: usize = 1 << 20;

/// Widens `out` to `bytes` when it is a narrower pipe; anything else (a file, a
/// terminal, a pipe someone made wider, a refusal) is left as it is.
#[cfg(target_os = "linux")]
fn widen_pipe(out: &impl std::os::fd::AsFd, bytes: usize) {
    if rustix::pipe::fcntl_getpipe_size(out).is_ok_and(|n| n < bytes) {
        let _ = rustix::pipe::fcntl_setpipe_size(out, bytes);
    }
}

#[cfg(not(target_os = "linux"))]
fn widen_pipe(_: &impl std::os::fd::AsFd, _: usize) {}

/// tracing-subscriber's writer: its lines go through the same buffer as access lines, so
/// the two never interleave within a line and keep their order.
#[derive(Clone, Copy, Default)]
pub struct Stderr;

impl Write for Stderr {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        // The formatter hands over a whole event in one call.
        let lines = buf.iter().filter(|&&b| b == b'\n').count();
        // A worker's other lines join its batch of access lines, in their order.
        let held = LINE
            .try_with(|line| match line.try_borrow_mut() {
                Ok(mut line) if line.batching => {
                    let held = line.buf.len();
                    line.buf.extend_from_slice(buf);
                    line.appended(held, lines, SINK.get());
                    true
                }
                _ => false,
            })
            .unwrap_or(false);
        if held {
            return Ok(buf.len());
        }
        match SINK.get() {
            Some(sink) => sink.push(buf, lines),
            None => std::io::stderr().write_all(buf)?,
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Stderr {
    type Writer = Stderr;

    fn make_writer(&'a self) -> Stderr {
        Stderr
    }
}

/// How access lines are written, decided once the log is set up.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(u8)]
pub enum AccessFormat {
    /// Through tracing like any event: a library user's subscriber, or colours at a
    /// terminal. The default until the binary chooses.
    Tracing = 0,
    /// `RUST_LOG` leaves `sluice::access` out.
    Off = 1,
    /// The text format, without colours, formatted here.
    Text = 2,
    /// The JSON format, formatted here.
    Json = 3,
}

static ACCESS: AtomicU8 = AtomicU8::new(AccessFormat::Tracing as u8);

/// Chooses how access lines are written. The binary calls it after installing its
/// subscriber; direct formats need [`install`] to have run.
pub fn set_access_format(format: AccessFormat) {
    ACCESS.store(format as u8, Ordering::Relaxed);
}

fn access_format() -> AccessFormat {
    match ACCESS.load(Ordering::Relaxed) {
        1 => AccessFormat::Off,
        2 => AccessFormat::Text,
        3 => AccessFormat::Json,
        _ => AccessFormat::Tracing,
    }
}

/// One request's access line.
pub(crate) struct Access<'a> {
    pub(crate) method: &'a str,
    pub(crate) host: &'a str,
    pub(crate) path: &'a str,
    pub(crate) upstream: &'a str,
    pub(crate) family: &'a str,
    pub(crate) status: u16,
    pub(crate) outcome: &'a str,
    pub(crate) duration: Duration,
    /// When the request ended (the reading `duration` was taken from): the line's
    /// timestamp is derived from it rather than from another clock read.
    pub(crate) at: Instant,
}

/// Writes `a`'s access line in the chosen format.
pub(crate) fn access(a: &Access<'_>) {
    let format = access_format();
    match format {
        AccessFormat::Off => {}
        AccessFormat::Tracing => tracing::info!(
            target: "sluice::access",
            method = %a.method,
            host = %a.host,
            path = %a.path,
            upstream = %a.upstream,
            family = %a.family,
            status = a.status,
            outcome = %a.outcome,
            duration_ms = a.duration.as_secs_f64() * 1000.0,
        ),
        AccessFormat::Text | AccessFormat::Json => LINE.with_borrow_mut(|line| {
            let held = line.buf.len();
            let now = line
                .clock
                .wall(a.at, || (Instant::now(), SystemTime::now()));
            if format == AccessFormat::Text {
                line.stamp(now);
                a.text(&mut line.buf);
            } else {
                line.buf.extend_from_slice(b"{\"timestamp\":\"");
                line.stamp(now);
                a.json(&mut line.buf);
            }
            line.appended(held, 1, SINK.get());
        }),
    }
}

thread_local! {
    static LINE: std::cell::RefCell<Line> = std::cell::RefCell::new(Line::default());
}

/// Makes the calling thread hold its log lines and hand them to the writer a batch at a
/// time: at [`flush_thread`], when a batch reaches 64 lines or 16 KiB, and when the thread
/// ends. For the workers, which flush whenever they run out of work (before they wait for
/// events) and when a client connection ends: each line appended to the shared buffer
/// took its lock, whose cache line then moved between the workers' cores, 0.2 µs per
/// request (the git history of docs/BENCHMARKS.md). A worker's lines keep their order; lines of different
/// workers can reach stderr out of order by as much as one batch of work.
pub(crate) fn batch_thread() {
    LINE.with_borrow_mut(|line| line.batching = true);
}

/// Hands the calling thread's held lines to the writer (see [`batch_thread`]).
pub(crate) fn flush_thread() {
    let _ = LINE.try_with(|line| {
        if let Ok(mut line) = line.try_borrow_mut() {
            line.hand_over(SINK.get());
        }
    });
}

/// The most lines and bytes a thread holds before handing them over.
const BATCH_LINES: usize = 64;
const BATCH_BYTES: usize = 16 << 10;

/// A thread's line buffer (and, with [`batch_thread`], the lines it holds), and the date
/// and time to the second it last wrote: the part of the timestamp that changes once a
/// second is formatted once a second.
#[derive(Default)]
struct Line {
    buf: Vec<u8>,
    /// Lines in `buf`.
    lines: usize,
    batching: bool,
    second: u64,
    prefix: [u8; 20],
    clock: Clock,
}

impl Line {
    /// Called after `lines` lines were appended to the `held` bytes already there: hands
    /// them over to `sink` (stderr when there is none) at once, unless this thread
    /// batches and the batch has room.
    fn appended(&mut self, held: usize, lines: usize, sink: Option<&Sink>) {
        // A batch never holds more than the queue takes, lines or bytes: the queue would
        // drop it whole. So a line that would make it too long sends the others first.
        let (most_lines, most_bytes) = sink.map_or((1, 0), |s| {
            (s.max_lines.min(BATCH_LINES), s.max_bytes.min(BATCH_BYTES))
        });
        if let Some(sink) = sink
            && self.batching
            && held > 0
            && self.buf.len() > most_bytes
        {
            sink.push(&self.buf[..held], self.lines);
            self.buf.drain(..held);
            self.lines = 0;
        }
        self.lines += lines;
        if !self.batching || self.lines >= most_lines || self.buf.len() >= most_bytes {
            self.hand_over(sink);
        }
    }

    fn hand_over(&mut self, sink: Option<&Sink>) {
        if self.buf.is_empty() {
            return;
        }
        match sink {
            Some(sink) => sink.push(&self.buf, self.lines),
            None => {
                let _ = std::io::stderr().write_all(&self.buf);
            }
        }
        self.buf.clear();
        self.lines = 0;
    }
}

impl Drop for Line {
    /// A thread that ends hands over what it holds.
    fn drop(&mut self) {
        self.hand_over(SINK.get());
    }
}

/// Wall-clock time for a monotonic reading, from a pair of readings of both clocks taken
/// at most a second earlier: the request's end is already read to time it, and a second
/// clock read per line was a tenth of the line's cost. A step of the wall clock shows
/// within a second; a slew (at most 0.5 ms a second) moves a timestamp by less. The wall
/// time is kept as the time since the Unix epoch, the form the timestamp is written from:
/// one difference of monotonic readings and one sum per line.
#[derive(Default)]
struct Clock {
    base: Option<(Instant, Duration)>,
}

impl Clock {
    const REFRESH: Duration = Duration::from_secs(1);

    /// The wall-clock time at `at`, since the Unix epoch; `read` gives both clocks now,
    /// called when the pair is missing, older than a second, or later than `at`.
    fn wall(&mut self, at: Instant, read: impl FnOnce() -> (Instant, SystemTime)) -> Duration {
        if let Some((mono, wall)) = self.base
            && let Some(after) = at.checked_duration_since(mono)
            && after < Self::REFRESH
        {
            return wall + after;
        }
        let (mono, wall) = read();
        // A clock set before 1970 writes the epoch rather than failing the line.
        let wall = wall
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default();
        self.base = Some((mono, wall));
        match at.checked_duration_since(mono) {
            Some(after) => wall + after,
            None => wall.saturating_sub(mono - at),
        }
    }
}

impl Line {
    /// `2026-12-01T20:19:58.394773Z`, UTC with microseconds, as tracing-subscriber writes,
    /// for `since` the Unix epoch.
    fn stamp(&mut self, since: Duration) {
        let secs = since.as_secs();
        if secs != self.second || self.prefix[0] == 0 {
            self.second = secs;
            let t = time::OffsetDateTime::from_unix_timestamp(secs as i64)
                .unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
            let mut p = [0u8; 20];
            let mut w = &mut p[..];
            let _ = write!(
                w,
                "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.",
                t.year(),
                u8::from(t.month()),
                t.day(),
                t.hour(),
                t.minute(),
                t.second()
            );
            self.prefix = p;
        }
        let mut rest = [b'Z'; 7];
        rest[..6].copy_from_slice(&digits::<6>(since.subsec_micros()));
        self.buf.extend_from_slice(&self.prefix);
        self.buf.extend_from_slice(&rest);
    }
}

/// The last `W` decimal digits of `n`, zero-padded: a fixed width needs neither a
/// formatter nor padding, and the divisions by ten unroll into multiplications.
fn digits<const W: usize>(mut n: u32) -> [u8; W] {
    let mut out = [b'0'; W];
    for d in out.iter_mut().rev() {
        *d = b'0' + (n % 10) as u8;
        n /= 10;
    }
    out
}

/// A status code: three digits (RFC 9110 §15), anything else as it is.
fn push_status(buf: &mut Vec<u8>, status: u16) {
    if (100..1000).contains(&status) {
        buf.extend_from_slice(&digits::<3>(u32::from(status)));
    } else {
        buf.extend_from_slice(itoa::Buffer::new().format(status).as_bytes());
    }
}

/// Milliseconds with three decimals (microseconds), e.g. `8.212`. In 64 bits: the
/// `u128` of `Duration::as_micros` costs a wide division and formatting.
fn push_millis(buf: &mut Vec<u8>, d: Duration) {
    let millis = d
        .as_secs()
        .saturating_mul(1000)
        .saturating_add(u64::from(d.subsec_millis()));
    buf.extend_from_slice(itoa::Buffer::new().format(millis).as_bytes());
    let [a, b, c] = digits::<3>(d.subsec_micros() % 1000);
    buf.extend_from_slice(&[b'.', a, b, c]);
}

// The two formats are written out separately, each field name fused with the separator
// before it into one static string: one generic writer over a format description was
// tried and cost about 1k more instructions per line (small copies for quotes and
// separators), on every request.
impl Access<'_> {
    /// The line tracing-subscriber's text format writes without colours.
    fn text(&self, buf: &mut Vec<u8>) {
        buf.extend_from_slice(b"  INFO sluice::access: method=");
        push_plain(buf, self.method);
        buf.extend_from_slice(b" host=");
        push_text(buf, self.host);
        buf.extend_from_slice(b" path=");
        push_text(buf, self.path);
        for (next, value) in [
            (&b" upstream="[..], self.upstream),
            (b" family=", self.family),
        ] {
            buf.extend_from_slice(next);
            push_plain(buf, value);
        }
        buf.extend_from_slice(b" status=");
        push_status(buf, self.status);
        buf.extend_from_slice(b" outcome=");
        push_plain(buf, self.outcome);
        buf.extend_from_slice(b" duration_ms=");
        push_millis(buf, self.duration);
        buf.push(b'\n');
    }

    /// The object tracing-subscriber's JSON format writes (flattened, target last),
    /// starting after the timestamp's digits.
    fn json(&self, buf: &mut Vec<u8>) {
        buf.extend_from_slice(b"\",\"level\":\"INFO\",\"method\":\"");
        push_plain(buf, self.method);
        buf.extend_from_slice(b"\",\"host\":");
        push_json(buf, self.host);
        buf.extend_from_slice(b",\"path\":");
        push_json(buf, self.path);
        for (next, value) in [
            (&b",\"upstream\":\""[..], self.upstream),
            (b"\",\"family\":\"", self.family),
        ] {
            buf.extend_from_slice(next);
            push_plain(buf, value);
        }
        buf.extend_from_slice(b"\",\"status\":");
        push_status(buf, self.status);
        buf.extend_from_slice(b",\"outcome\":\"");
        push_plain(buf, self.outcome);
        buf.push(b'"');
        buf.extend_from_slice(b",\"duration_ms\":");
        push_millis(buf, self.duration);
        buf.extend_from_slice(b",\"target\":\"sluice::access\"}\n");
    }
}

/// A value sluice vouches for, as it is in a text line and inside a JSON string: the
/// method (a token, RFC 9110 §9.1), upstream and family names (`[A-Za-z0-9_.-]`, as
/// `config::check_name` holds them) and the outcome (a status code or sluice's own word)
/// hold no space, quote, backslash or control character, so they need no look at each
/// byte. Debug builds check.
fn push_plain(buf: &mut Vec<u8>, s: &str) {
    debug_assert!(
        !s.is_empty() && !any_byte(s, |b| !b.is_ascii_graphic() || b == b'"' || b == b'\\'),
        "{s:?} is not plain"
    );
    buf.extend_from_slice(s.as_bytes());
}

/// A value in a text line. Hosts and paths reach the log as URI text, which has no spaces
/// or control characters; anything else a value might hold is escaped rather than allowed
/// to break the line into two or forge a field.
fn push_text(buf: &mut Vec<u8>, s: &str) {
    if !any_byte(s, |b| !b.is_ascii_graphic() || b == b'"' || b == b'\\') {
        buf.extend_from_slice(s.as_bytes());
    } else {
        let _ = write!(buf, "{s:?}");
    }
}

/// Whether any byte of `s` is `bad`. Without the early exit of `Iterator::any` the
/// compiler checks many bytes per instruction; values are short and almost always clean.
fn any_byte(s: &str, bad: impl Fn(u8) -> bool) -> bool {
    s.bytes().fold(false, |found, b| found | bad(b))
}

/// A JSON string, quoted and escaped.
fn push_json(buf: &mut Vec<u8>, s: &str) {
    buf.push(b'"');
    if !any_byte(s, |b| b < 0x20 || b == b'"' || b == b'\\') {
        buf.extend_from_slice(s.as_bytes());
    } else {
        for c in s.chars() {
            match c {
                '"' => buf.extend_from_slice(b"\\\""),
                '\\' => buf.extend_from_slice(b"\\\\"),
                '\n' => buf.extend_from_slice(b"\\n"),
                '\r' => buf.extend_from_slice(b"\\r"),
                '\t' => buf.extend_from_slice(b"\\t"),
                c if (c as u32) < 0x20 => {
                    let _ = write!(buf, "\\u{:04x}", c as u32);
                }
                c => {
                    let mut b = [0u8; 4];
                    buf.extend_from_slice(c.encode_utf8(&mut b).as_bytes());
                }
            }
        }
    }
    buf.push(b'"');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample<'a>(path: &'a str, host: &'a str) -> Access<'a> {
        Access {
            method: "GET",
            host,
            path,
            upstream: "api",
            family: "-",
            status: 200,
            outcome: "200",
            duration: Duration::from_micros(8_211_631 / 1000),
            at: Instant::now(),
        }
    }

    fn stamped(a: &Access<'_>, json: bool) -> String {
        let mut line = Line::default();
        let at = Duration::from_micros(1_796_156_398_394_773);
        if json {
            line.buf.extend_from_slice(b"{\"timestamp\":\"");
            line.stamp(at);
            a.json(&mut line.buf);
        } else {
            line.stamp(at);
            a.text(&mut line.buf);
        }
        String::from_utf8(std::mem::take(&mut line.buf)).unwrap()
    }

    #[test]
    fn text_line_matches_the_text_format() {
        assert_eq!(
            stamped(&sample("/a/b", "api.example"), false),
            "2026-12-01T20:19:58.394773Z  INFO sluice::access: method=GET host=api.example \
             path=/a/b upstream=api family=- status=200 outcome=200 duration_ms=8.211\n"
        );
    }

    #[test]
    fn json_line_parses_with_every_field() {
        let line = stamped(&sample("/a\"b\\c\u{1}", "h"), true);
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["timestamp"], "2026-12-01T20:19:58.394773Z");
        assert_eq!(v["level"], "INFO");
        assert_eq!(v["path"], "/a\"b\\c\u{1}");
        assert_eq!(v["status"], 200);
        assert_eq!(v["outcome"], "200");
        assert_eq!(v["duration_ms"], 8.211);
        assert_eq!(v["target"], "sluice::access");
    }

    #[test]
    fn a_value_cannot_break_a_text_line_or_forge_a_field() {
        let line = stamped(&sample("/x status=500\nforged", "h"), false);
        assert_eq!(line.matches('\n').count(), 1, "{line}");
        assert!(line.contains(r#"path="/x status=500\nforged""#), "{line}");
    }

    #[test]
    fn timestamps_carry_microseconds_and_follow_the_second() {
        let mut line = Line::default();
        for (micros, want) in [
            (0, "1970-01-01T00:00:00.000000Z"),
            (1_000_001, "1970-01-01T00:00:01.000001Z"),
            (86_400_000_000 + 999_999, "1970-01-02T00:00:00.999999Z"),
        ] {
            line.buf.clear();
            line.stamp(Duration::from_micros(micros));
            assert_eq!(std::str::from_utf8(&line.buf).unwrap(), want);
        }
        line.buf.clear();
    }

    #[test]
    fn wall_time_follows_the_monotonic_reading_and_is_read_again_each_second() {
        let mut clock = Clock::default();
        let t0 = Instant::now();
        let epoch = Duration::from_secs(1_796_156_398);
        let w0 = SystemTime::UNIX_EPOCH + epoch;
        let ms = Duration::from_millis;
        // The first line reads both clocks; a pair read just after the request ended
        // puts the end that much earlier.
        assert_eq!(clock.wall(t0, || (t0 + ms(2), w0)), epoch - ms(2));
        // Within the second the pair is reused: no read.
        assert_eq!(clock.wall(t0 + ms(5), || unreachable!()), epoch + ms(3));
        let at = t0 + ms(900);
        assert_eq!(clock.wall(at, || unreachable!()), epoch + ms(898));
        // A second on, or a reading from before the pair, reads again; here the wall
        // clock was stepped back by an hour meanwhile.
        let hour = Duration::from_secs(3600);
        let at = t0 + ms(2100);
        assert_eq!(clock.wall(at, || (at, w0 - hour)), epoch - hour);
        assert_eq!(clock.wall(t0, || (t0, w0)), epoch);
        // A wall clock before 1970 writes the epoch.
        let mut clock = Clock::default();
        let before = SystemTime::UNIX_EPOCH - hour;
        assert_eq!(clock.wall(t0, || (t0, before)), Duration::ZERO);
    }

    #[test]
    fn millis_keep_three_decimals() {
        for (us, want) in [
            (0, "0.000"),
            (7, "0.007"),
            (1_234_567, "1234.567"),
            (86_400_000_999, "86400000.999"),
        ] {
            let mut b = Vec::new();
            push_millis(&mut b, Duration::from_micros(us));
            assert_eq!(String::from_utf8(b).unwrap(), want);
        }
    }

    #[test]
    fn microseconds_and_statuses_keep_their_width() {
        for (us, want) in [(42, "000042"), (0, "000000"), (999_999, "999999")] {
            let mut line = Line::default();
            line.stamp(Duration::from_micros(1_796_156_398_000_000 + us));
            let text = String::from_utf8(std::mem::take(&mut line.buf)).unwrap();
            assert_eq!(text, format!("2026-12-01T20:19:58.{want}Z"));
        }
        for (status, want) in [
            (200, "200"),
            (100, "100"),
            (999, "999"),
            (99, "99"),
            (1000, "1000"),
        ] {
            let mut b = Vec::new();
            push_status(&mut b, status);
            assert_eq!(String::from_utf8(b).unwrap(), want);
        }
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_pipe_on_stderr_is_widened_and_nothing_else_is_touched() {
        use rustix::pipe::{fcntl_getpipe_size, fcntl_setpipe_size};
        let max: usize = std::fs::read_to_string("/proc/sys/fs/pipe-max-size")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(PIPE_BYTES);
        let (_reader, writer) = std::io::pipe().unwrap();
        let before = fcntl_getpipe_size(&writer).unwrap();
        assert!(before < PIPE_BYTES);
        widen_pipe(&writer, PIPE_BYTES);
        let after = fcntl_getpipe_size(&writer).unwrap();
        // Beyond the system's maximum only a privileged process may go; a refusal leaves
        // the pipe as it was.
        assert!(
            after == PIPE_BYTES || (max < PIPE_BYTES && after == before),
            "{before} -> {after}, max {max}"
        );

        // A pipe its creator made wider than asked for stays as wide.
        let (_reader, writer) = std::io::pipe().unwrap();
        let wide = fcntl_setpipe_size(&writer, 256 << 10).unwrap();
        widen_pipe(&writer, 128 << 10);
        assert_eq!(fcntl_getpipe_size(&writer).unwrap(), wide);

        // A file is no pipe: left as it is, without an error.
        let file = tempfile::tempfile().unwrap();
        widen_pipe(&file, PIPE_BYTES);
        assert!(fcntl_getpipe_size(&file).is_err());
    }

    fn test_sink(max_lines: usize) -> Sink {
        Sink {
            state: Mutex::new(State::default()),
            wake: Condvar::new(),
            stopped: Condvar::new(),
            max_lines,
            max_bytes: 1 << 20,
        }
    }

    #[test]
    fn a_batching_thread_hands_over_its_lines_in_order_at_a_flush_or_a_full_batch() {
        let sink = test_sink(1000);
        let mut line = Line::default();
        line.batching = true;
        line.buf.extend_from_slice(b"a\n");
        line.appended(0, 1, Some(&sink));
        line.buf.extend_from_slice(b"b\nc\n");
        line.appended(2, 2, Some(&sink));
        assert!(lock(&sink).buf.is_empty(), "held until a flush");
        line.hand_over(Some(&sink));
        assert_eq!(lock(&sink).buf, b"a\nb\nc\n");
        assert_eq!(lock(&sink).lines, 3);
        // A full batch goes without a flush.
        for _ in 0..BATCH_LINES {
            let held = line.buf.len();
            line.buf.extend_from_slice(b"x\n");
            line.appended(held, 1, Some(&sink));
        }
        assert!(line.buf.is_empty());
        assert_eq!(lock(&sink).lines, 3 + BATCH_LINES);
        // So does a batch as long as the whole queue, which could not take a longer one.
        let small = test_sink(2);
        line.buf.extend_from_slice(b"y\n");
        line.appended(0, 1, Some(&small));
        assert!(lock(&small).buf.is_empty());
        line.buf.extend_from_slice(b"z\n");
        line.appended(2, 1, Some(&small));
        assert_eq!(lock(&small).buf, b"y\nz\n");
        // A thread that does not batch hands each line over at once.
        line.batching = false;
        line.buf.extend_from_slice(b"w\n");
        line.appended(0, 1, Some(&sink));
        assert!(lock(&sink).buf.ends_with(b"x\nw\n"));
    }

    #[test]
    fn a_line_that_would_overfill_the_queue_with_its_batch_sends_the_batch_first() {
        // A queue of 16 lines takes 16 KiB: a batch of two lines of 10 KiB would be
        // dropped whole, even into an empty queue.
        let sink = Sink {
            max_bytes: 16 << 10,
            ..test_sink(16)
        };
        let long = [b'a'; 10 << 10];
        let mut line = Line::default();
        line.batching = true;
        line.buf.extend_from_slice(&long);
        line.buf.push(b'\n');
        line.appended(0, 1, Some(&sink));
        assert!(lock(&sink).buf.is_empty(), "one line is held");
        line.buf.extend_from_slice(&long);
        line.buf.push(b'\n');
        line.appended(long.len() + 1, 1, Some(&sink));
        assert_eq!(lock(&sink).lines, 1, "the first went ahead of the second");
        assert_eq!(line.buf.len(), long.len() + 1, "the second is held");
        // The writer empties the queue; the second line then fits.
        *lock(&sink) = State::default();
        line.hand_over(Some(&sink));
        assert_eq!(lock(&sink).lines, 1);
        assert_eq!(lock(&sink).buf.len(), long.len() + 1);
    }

    #[test]
    fn a_full_sink_drops_and_counts_whole_lines() {
        let sink = test_sink(2);
        let before = dropped_lines();
        for _ in 0..5 {
            sink.push(b"line\n", 1);
        }
        assert_eq!(lock(&sink).buf, b"line\nline\n");
        assert!(dropped_lines() - before >= 3);
    }
}
