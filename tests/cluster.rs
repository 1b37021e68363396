//! Shared limits through a real `redis-server`. First the script on its own, driven with
//! its clock override: it reserves exactly what the local limiter would admit, and a
//! provider counting at arrival never refuses what it reserved, corrections included.
//! Then sluice processes sharing limits, and Redis failing under them.

use sluice_test_support as support;

use std::time::Duration;

use proptest::prelude::*;
use sluice::LimitState;
use sluice::{CounterAlign, Limit, Margin, Rounding, Scope, WindowAlign};
use sluice::{GlobalLimit, script_args};
use support::provider::{Clock, Counter};
use support::redis::Redis;
use tokio::time::Instant;

/// One limit as the script takes it, with the same limit for the local model.
#[derive(Debug, Clone)]
struct Shape {
    /// The script's kind, with `C` for a counter on the clock (the script's `c` with an
    /// offset), `l` a leaky bucket and `p` a published limit (both the script's `t`).
    kind: char,
    permits: u32,
    window_us: u64,
    burst: u32,
    margin_us: u64,
    /// Windows on the clock start this far past whole windows.
    offset_us: u64,
}

/// Script calls give their own `now`, in microseconds; windows on the clock fall by it.
const BASE_US: u64 = 1_000_000_000;

impl Shape {
    fn limit(&self) -> Limit {
        let nz = |v| std::num::NonZeroU32::new(v).unwrap();
        let window = Duration::from_micros(self.window_us);
        let margin = Some(Margin::Duration(Duration::from_micros(self.margin_us)));
        let offset = Some(Duration::from_micros(self.offset_us % self.window_us));
        let scope = Scope::Global;
        let permits = nz(self.permits);
        let counter = |align, rounding| Limit::SlidingCounter {
            permits,
            window,
            align,
            offset: (align == CounterAlign::Clock).then_some(offset).flatten(),
            rounding,
            margin,
            margin_max: None,
            scope,
            unit: Default::default(),
        };
        match self.kind {
            's' => Limit::SlidingWindow {
                permits,
                window,
                margin,
                margin_max: None,
                scope,
                unit: Default::default(),
            },
            'f' | 'k' => Limit::FixedWindow {
                align: if self.kind == 'k' {
                    WindowAlign::Clock
                } else {
                    WindowAlign::First
                },
                offset: if self.kind == 'k' { offset } else { None },
                permits,
                window,
                margin,
                margin_max: None,
                scope,
                unit: Default::default(),
            },
            'c' => counter(CounterAlign::Any, Rounding::Down),
            'C' => counter(CounterAlign::Clock, Rounding::Down),
            'u' => counter(CounterAlign::Clock, Rounding::None),
            'l' => Limit::LeakyBucket {
                rate: permits,
                per: window,
                burst: self.burst - 1,
                margin,
                margin_max: None,
                scope,
                unit: Default::default(),
            },
            'p' => Limit::Published {
                permits,
                window,
                margin,
                margin_max: None,
                scope,
                unit: Default::default(),
            },
            _ => Limit::TokenBucket {
                rate: permits,
                per: window,
                burst: nz(self.burst),
                margin,
                margin_max: None,
                scope,
                unit: Default::default(),
            },
        }
    }

    /// The script's arguments for the limit, as sluice passes them.
    fn args(&self) -> [String; 4] {
        script_args(&GlobalLimit::new("l".into(), &self.limit()).expect("a global rate limit"))
    }

    fn provider(&self, t0: Instant) -> Counter {
        let window = Duration::from_micros(self.window_us);
        let clock = Clock {
            t0,
            unix0: Duration::from_micros(BASE_US),
        };
        let offset = Duration::from_micros(self.offset_us % self.window_us);
        let p = self.permits;
        match self.kind {
            's' => Counter::sliding(p, window),
            'f' => Counter::fixed(p, window),
            'k' => Counter::calendar(p, window, offset, clock),
            'c' => Counter::haproxy(p, window, clock),
            // Windows on the clock without an offset: the providers' own.
            'C' | 'u' => Counter::weighted(p, window, shifted(clock, offset), self.kind == 'C'),
            'l' => Counter::nginx(p, window, self.burst - 1, clock),
            'p' => Counter::All(vec![
                Counter::sliding(p, window),
                Counter::fixed(p, window),
                Counter::calendar(p, window, offset, clock),
                Counter::haproxy(p, window, clock),
                Counter::weighted(p, window, clock, true),
                Counter::token(p, window, 1),
                Counter::nginx(p, window, 0, clock),
            ]),
            _ => Counter::token(p, window, self.burst),
        }
    }
}

/// The clock of a provider whose windows start `offset` later.
fn shifted(clock: Clock, offset: Duration) -> Clock {
    Clock {
        t0: clock.t0,
        unix0: clock.unix0 - offset,
    }
}

/// One limit's keys in Redis, and the script that keeps them.
struct Keys<'a> {
    script: &'a redis::Script,
    tag: String,
    shape: &'a Shape,
}

impl Keys<'_> {
    /// Calls the script synchronously: a reservation at `now` (microseconds) for
    /// `member`, carrying `corrections` (member, value; "" for never sent). `settle`: one
    /// that takes its instant without turns.
    fn reserve(
        &self,
        con: &mut redis::Connection,
        now: u64,
        member: &str,
        corrections: &[(String, String)],
        settle: bool,
    ) -> Vec<redis::Value> {
        let op = if settle { "settle" } else { "reserve" };
        call(con, self, op, now, member, corrections, 3)
    }
}

fn call(
    con: &mut redis::Connection,
    keys: &Keys<'_>,
    op: &str,
    now: u64,
    member: &str,
    corrections: &[(String, String)],
    queued: usize,
) -> Vec<redis::Value> {
    let corrections: Vec<(String, String, String)> = corrections
        .iter()
        .map(|(m, v)| (m.clone(), v.clone(), String::new()))
        .collect();
    call_weighed(con, keys, op, now, (member, None), &corrections, queued)
}

/// A call for `member` weighing `w` in a limit of a unit (`None`: a limit of requests),
/// carrying `corrections` (member as last named, value, weight; "" for unchanged).
fn call_weighed(
    con: &mut redis::Connection,
    keys: &Keys<'_>,
    op: &str,
    now: u64,
    (member, w): (&str, Option<u64>),
    corrections: &[(String, String, String)],
    queued: usize,
) -> Vec<redis::Value> {
    let (tag, shape) = (&keys.tag, keys.shape);
    let mut inv = keys.script.prepare_invoke();
    inv.key(format!("{tag}:epoch"))
        .key(format!("{tag}:l"))
        .key(format!("{tag}:l:o"))
        .key(format!("{tag}:run"))
        .key(format!("{tag}:claims"))
        .arg(op)
        .arg(now)
        .arg("")
        .arg("e1")
        .arg(member)
        .arg(u64::MAX / 4)
        .arg(u64::MAX / 4)
        .arg(queued)
        .arg(1)
        .arg(&shape.args()[..])
        .arg(shape.margin_us)
        .arg("1")
        .arg(w.map(|w| w.to_string()).unwrap_or_default())
        .arg(corrections.len());
    for (m, v, cw) in corrections {
        inv.arg(1).arg(m).arg(v).arg(cw);
    }
    inv.invoke(con).expect("the script runs")
}

fn int(v: &redis::Value) -> i64 {
    match v {
        redis::Value::Int(i) => *i,
        other => panic!("expected an integer, got {other:?}"),
    }
}

fn shape() -> impl Strategy<Value = Shape> {
    (
        prop_oneof![
            Just('s'),
            Just('f'),
            Just('t'),
            Just('k'),
            Just('c'),
            Just('C'),
            Just('u'),
            Just('l'),
            Just('p')
        ],
        1..5u32,
        prop_oneof![Just(100_000u64), Just(1_000_000)],
        1..4u32,
        0..=400u64,
        0..1_000_000u64,
    )
        .prop_map(|(kind, permits, window_us, burst, m, offset_us)| Shape {
            kind,
            permits,
            window_us,
            burst,
            // Up to 40% of half the window: the same bound sluice check puts on it.
            margin_us: window_us / 2 * m / 1000,
            offset_us,
        })
}

#[derive(Debug, Clone)]
struct Req {
    gap_us: u64,
    /// Where in [T, T + margin] it reaches the provider, in [0, 1].
    delay: f64,
    /// After its arrival; `None`: never answered.
    answer_us: Option<u64>,
    /// Never went out.
    unsent: bool,
    /// The replica that asks.
    replica: u8,
}

fn req() -> impl Strategy<Value = Req> {
    (
        prop_oneof![2 => Just(0u64), 1 => 0..300_000u64],
        prop_oneof![Just(0.0), Just(1.0), 0.0..=1.0f64],
        prop_oneof![Just(None), (0..200_000u64).prop_map(Some)],
        prop::bool::weighted(0.1),
        0..3u8,
    )
        .prop_map(|(gap_us, delay, answer_us, unsent, replica)| Req {
            gap_us,
            delay,
            answer_us,
            unsent,
            replica,
        })
}

fn redis() -> &'static (Redis, parking_lot::Mutex<redis::Connection>) {
    static R: std::sync::OnceLock<(Redis, parking_lot::Mutex<redis::Connection>)> =
        std::sync::OnceLock::new();
    R.get_or_init(|| {
        let r = Redis::start_for_process();
        let con = redis::Client::open(r.url())
            .unwrap()
            .get_connection()
            .unwrap();
        (r, parking_lot::Mutex::new(con))
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Reservations without corrections are the local limiter's admissions: the same
    /// instants, to the microsecond, for sliding windows, counters and every GCRA kind,
    /// requests queued FIFO. (Fixed windows differ by design: the script, choosing the
    /// instant itself, never reserves one that may reach the provider in a window that
    /// is already full.)
    #[test]
    fn the_script_reserves_what_the_local_limiter_admits(
        shape in shape().prop_filter("no fixed windows", |s| s.kind != 'f' && s.kind != 'k'),
        gaps in prop::collection::vec(prop_oneof![2 => Just(0u64), 1 => 0..300_000u64], 1..40),
    ) {
        let script = redis::Script::new(sluice::cluster_script());
        let (_, con) = redis();
        let mut con = con.lock();
        let keys = Keys { script: &script, tag: format!("{{m{}}}", rand_id()), shape: &shape };
        let t0 = Instant::now();
        let base = BASE_US;
        let mut local = LimitState::on_clock(&shape.limit(), t0, 0, Duration::from_micros(base));
        let (mut now, mut prev) = (base, base);
        for (i, gap) in gaps.iter().enumerate() {
            now += gap;
            let reply = keys.reserve(&mut con, now, &format!("r:{i}"), &[], true);
            prop_assert_eq!(int(&reply[0]), 0);
            let reserved = now + int(&reply[1]) as u64;
            // The local model: FIFO, each sent the instant it is admitted, never answered.
            let mut t = t0 + Duration::from_micros(now.max(prev) - base);
            while !local.can_take(t) {
                t = local.ready_at(1, t).unwrap();
            }
            local.take(t);
            local.sent(i as u64, Some(0), t);
            let admitted = base + (t - t0).as_nanos().div_ceil(1000) as u64;
            // The script works in whole microseconds, each reservation rounded up, so it
            // may run up to a microsecond per request behind the exact local arithmetic.
            prop_assert!(
                reserved >= admitted.saturating_sub(1) && reserved <= admitted + i as u64 + 1,
                "request {}: the script reserved {} us, the local limiter admits at {} us",
                i, reserved - base, admitted - base
            );
            prev = reserved;
        }
    }

    /// Calls from many replicas, each at its own pace (a call may come long before the
    /// instants already reserved), each request reaching the provider anywhere between its
    /// instant and the margin after, answers that come sooner and requests that never go
    /// out, corrected as sluice corrects them: the provider refuses none.
    #[test]
    fn the_provider_never_refuses_what_the_script_reserved(
        shape in shape(),
        reqs in prop::collection::vec(req(), 1..50),
    ) {
        let script = redis::Script::new(sluice::cluster_script());
        let (_, con) = redis();
        let mut con = con.lock();
        let keys = Keys { script: &script, tag: format!("{{p{}}}", rand_id()), shape: &shape };
        let base = BASE_US;
        let mut now = base;
        // Corrections known by `now`, waiting for the next call: (due, member, value).
        let mut due: Vec<(u64, String, String)> = Vec::new();
        let mut arrivals: Vec<u64> = Vec::new();
        for (i, r) in reqs.iter().enumerate() {
            now += r.gap_us;
            let member = format!("{}:{i}", r.replica);
            // Told to come back for its turn: it does, then settles as sluice does.
            let mut turns = 0;
            let reply = loop {
                let ready: Vec<(String, String)> = due
                    .iter()
                    .filter(|d| d.0 <= now)
                    .map(|d| (d.1.clone(), d.2.clone()))
                    .collect();
                due.retain(|d| d.0 > now);
                let reply = keys.reserve(&mut con, now, &member, &ready, turns >= 8);
                if int(&reply[0]) != 4 {
                    break reply;
                }
                turns += 1;
                now += int(&reply[1]) as u64;
            };
            prop_assert_eq!(int(&reply[0]), 0);
            let t = now + int(&reply[1]) as u64;
            // The next call may come before this instant: another replica, or this one
            // with its next request.
            if r.unsent {
                due.push((t, member, String::new()));
                continue;
            }
            let arrival = t + (r.delay * shape.margin_us as f64) as u64;
            arrivals.push(arrival);
            if let Some(a) = r.answer_us {
                let answered = arrival + a;
                if answered < t + shape.margin_us {
                    due.push((answered, member, answered.to_string()));
                }
            }
        }
        arrivals.sort();
        let t0 = Instant::now();
        let mut provider = shape.provider(t0);
        for (k, a) in arrivals.iter().enumerate() {
            prop_assert!(
                provider.arrive(t0 + Duration::from_micros(a - base)),
                "the provider refused arrival {} at {} us", k, a - base
            );
        }
    }
}

/// A limit of a unit (tokens, points), with room for requests of several weights.
fn weighed_shape(kinds: &'static [char]) -> impl Strategy<Value = Shape> {
    (shape(), prop::sample::select(kinds), 2..12u32).prop_map(|(mut s, kind, permits)| {
        s.kind = kind;
        s.permits = permits;
        // A bucket's burst holds at least a request's largest weight.
        s.burst = s.burst.max(permits / 2);
        s
    })
}

/// The largest weight `shape` admits at all: more is answered 413 before it queues.
fn capacity(shape: &Shape) -> u64 {
    u64::from(if shape.kind == 't' {
        shape.burst
    } else {
        shape.permits
    })
}

fn reply_wait(reply: &[redis::Value]) -> u64 {
    int(&reply[1]) as u64
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Weighted reservations without corrections are the local limiter's weighted
    /// admissions, to the microsecond, for sliding windows, counters and token buckets:
    /// a request of weight w waits until w units are free.
    #[test]
    fn weighted_reservations_are_what_the_local_limiter_admits(
        shape in weighed_shape(&['s', 't', 'c', 'C', 'u']),
        reqs in prop::collection::vec((prop_oneof![2 => Just(0u64), 1 => 0..300_000u64], 1..=12u64), 1..30),
    ) {
        let script = redis::Script::new(sluice::cluster_script());
        let (_, con) = redis();
        let mut con = con.lock();
        let keys = Keys { script: &script, tag: format!("{{wm{}}}", rand_id()), shape: &shape };
        let t0 = Instant::now();
        let base = BASE_US;
        let mut local = LimitState::on_clock(&shape.limit(), t0, 0, Duration::from_micros(base));
        let (mut now, mut prev) = (base, base);
        for (i, (gap, w)) in reqs.iter().enumerate() {
            let w = (*w).min(capacity(&shape));
            now += gap;
            let member = format!("r:{i}");
            let reply = call_weighed(&mut con, &keys, "settle", now, (&member, Some(w)), &[], 3);
            prop_assert_eq!(int(&reply[0]), 0);
            let reserved = now + reply_wait(&reply);
            let mut t = t0 + Duration::from_micros(now.max(prev) - base);
            while !local.can_take_n(w, t) {
                t = local.ready_at(w, t).unwrap();
            }
            local.take_n(w, t);
            local.sent_n(i as u64, w, Some(0), t);
            let admitted = base + (t - t0).as_nanos().div_ceil(1000) as u64;
            prop_assert!(
                reserved >= admitted.saturating_sub(1) && reserved <= admitted + i as u64 + 1,
                "request {} (weight {}): the script reserved {} us, the local limiter admits at {} us",
                i, w, reserved - base, admitted - base
            );
            prev = reserved;
        }
    }

    /// Weighted reservations from many replicas, each reaching the provider anywhere in
    /// its margin, answered sooner or never sent, and corrected to what it really cost
    /// once answered, as sluice sends it (the answer's instant and the new weight, in
    /// either order): a provider counting the same costs refuses none. Where the provider
    /// reconciles (a sliding log, a GCRA: Python `limits`' moving window, Anthropic's
    /// buckets), the true cost is anything up to the estimate, which is an upper bound as
    /// `max_tokens` is; where it keeps what it counted at arrival, the script is told of
    /// costs above it, which hold permits longer (sluice's docs say correcting
    /// downwards would over-admit there).
    #[test]
    fn weighted_reservations_never_overrun_a_provider_counting_costs(
        shape in weighed_shape(&['s', 't', 'f', 'k', 'C', 'u']),
        reqs in prop::collection::vec((req(), 1..=12u64, 0..=24u64, any::<bool>()), 1..40),
    ) {
        let script = redis::Script::new(sluice::cluster_script());
        let (_, con) = redis();
        let mut con = con.lock();
        let keys = Keys { script: &script, tag: format!("{{wp{}}}", rand_id()), shape: &shape };
        let reconciles = matches!(shape.kind, 's' | 't');
        let base = BASE_US;
        let mut now = base;
        // Corrections known by `now`, waiting for the next call: (due, member, value, weight).
        let mut due: Vec<(u64, String, String, String)> = Vec::new();
        // What the provider sees: arrivals (at, weight) and settlements (at, arrived, was, is).
        let mut arrivals: Vec<(u64, u64)> = Vec::new();
        let mut settles: Vec<(u64, u64, u64, u64)> = Vec::new();
        let cap = capacity(&shape);
        for (i, (r, w, actual, weight_first)) in reqs.iter().enumerate() {
            let w = (*w).min(cap);
            now += r.gap_us;
            let member = format!("{}:{i}", r.replica);
            let mut turns = 0;
            let reply = loop {
                let ready: Vec<(String, String, String)> = due
                    .iter()
                    .filter(|d| d.0 <= now)
                    .map(|d| (d.1.clone(), d.2.clone(), d.3.clone()))
                    .collect();
                due.retain(|d| d.0 > now);
                let op = if turns >= 8 { "settle" } else { "reserve" };
                let reply = call_weighed(&mut con, &keys, op, now, (&member, Some(w)), &ready, 3);
                if int(&reply[0]) != 4 {
                    break reply;
                }
                turns += 1;
                now += reply_wait(&reply);
            };
            prop_assert_eq!(int(&reply[0]), 0);
            let t = now + reply_wait(&reply);
            let name = |w: u64| if w == 1 { member.clone() } else { format!("{member}*{w}") };
            if r.unsent {
                due.push((t, name(w), String::new(), String::new()));
                continue;
            }
            let arrival = t + (r.delay * shape.margin_us as f64) as u64;
            arrivals.push((arrival, w));
            let Some(a) = r.answer_us else { continue };
            let answered = arrival + a;
            // The true cost, as the response reports it when the request ends.
            let is = if reconciles { actual % (w + 1) } else { w + actual % 3 };
            let sooner = answered < t + shape.margin_us;
            let at = answered.to_string();
            if is != w {
                if reconciles {
                    settles.push((answered, arrival, w, is));
                }
                if *weight_first {
                    due.push((answered, name(w), "k".into(), format!("{is} {answered}")));
                    if sooner {
                        due.push((answered, name(is), at, String::new()));
                    }
                } else {
                    if sooner {
                        due.push((answered, name(w), at, String::new()));
                    }
                    due.push((answered, name(w), "k".into(), format!("{is} {answered}")));
                }
            } else if sooner {
                due.push((answered, name(w), at, String::new()));
            }
        }
        // The provider's events in time order; at one instant, settlements first (an
        // answer is in before the next arrival the script let go on it).
        let mut events: Vec<(u64, u8, usize)> = arrivals
            .iter()
            .enumerate()
            .map(|(k, a)| (a.0, 1, k))
            .chain(settles.iter().enumerate().map(|(k, s)| (s.0, 0, k)))
            .collect();
        events.sort();
        let t0 = Instant::now();
        let at = |us: u64| t0 + Duration::from_micros(us - base);
        let mut provider = shape.provider(t0);
        for (us, what, k) in events {
            if what == 0 {
                let (_, arrived, was, is) = settles[k];
                provider.settle(at(arrived), at(us), was, is);
            } else {
                let w = arrivals[k].1;
                prop_assert!(
                    provider.arrive_n(at(us), w),
                    "the provider refused arrival {} (weight {}) at {} us", k, w, us - base
                );
            }
        }
    }
}

/// Two replicas with requests always waiting, on a token bucket of 10/s with a burst of
/// 1 and a 20 ms margin, each request answered 1 ms after its instant, the replicas
/// following the script's answers as sluice does: a reservation whose next waits on its
/// answer is followed by a call once the answer is in, carrying its correction; one told
/// to come back does; the last of a run sends its correction at once. Driven with the
/// script's clock: 5 s of saturation use the bucket in full (paying each margin would
/// leave 83%), with about one call per request, each replica getting its turns, and a
/// provider counting at arrival refusing nothing.
#[test]
fn small_limits_take_turns_and_pay_no_margin() {
    let shape = Shape {
        kind: 't',
        permits: 10,
        window_us: 1_000_000,
        burst: 1,
        margin_us: 20_000,
        offset_us: 0,
    };
    let script = redis::Script::new(sluice::cluster_script());
    let (_, con) = redis();
    let mut con = con.lock();
    let keys = Keys {
        script: &script,
        tag: format!("{{turns{}}}", rand_id()),
        shape: &shape,
    };
    const ANSWER_US: u64 = 1000;
    const SPAN_US: u64 = 5_000_000;
    let base = BASE_US;
    // Per replica: when its next request asks, corrections waiting (due, member, value),
    // turns taken by the request asking.
    let mut next = [base, base];
    let mut pending: [Vec<(u64, String, String)>; 2] = [Vec::new(), Vec::new()];
    let mut turns = [0u32; 2];
    let (mut calls, mut seq) = (0u32, 0u32);
    let mut sent: Vec<(u64, usize)> = Vec::new();
    while let Some(r) = (0..2)
        .filter(|r| next[*r] < base + SPAN_US)
        .min_by_key(|r| next[*r])
    {
        let now = next[r];
        let ready: Vec<(String, String)> = pending[r]
            .iter()
            .filter(|p| p.0 <= now)
            .map(|p| (p.1.clone(), p.2.clone()))
            .collect();
        pending[r].retain(|p| p.0 > now);
        let member = format!("{r}:{seq}");
        seq += 1;
        let op = if turns[r] >= 8 { "settle" } else { "reserve" };
        let reply = call(&mut con, &keys, op, now, &member, &ready, 15);
        calls += 1;
        let wait = int(&reply[1]) as u64;
        match int(&reply[0]) {
            0 => {
                turns[r] = 0;
                let at = now + wait;
                sent.push((at, r));
                let answered = at + ANSWER_US;
                let flags = match &reply[4] {
                    redis::Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
                    other => panic!("flags: {other:?}"),
                };
                let back = int(&reply[5]) as u64;
                let correction = (answered, member, answered.to_string());
                if back > 0 {
                    // The run is over: its last correction goes at once, on its own.
                    call(
                        &mut con,
                        &keys,
                        "flush",
                        answered,
                        "",
                        &[(correction.1, correction.2)],
                        0,
                    );
                    calls += 1;
                    next[r] = (now + back).max(at);
                } else {
                    pending[r].push(correction);
                    next[r] = if flags.contains('c') { answered } else { at };
                }
            }
            4 => {
                turns[r] += 1;
                next[r] = now + wait;
            }
            other => panic!("status {other} at {now}"),
        }
    }
    let t0 = Instant::now();
    let mut provider = Counter::token(10, Duration::from_secs(1), 1);
    sent.sort();
    for (at, _) in &sent {
        assert!(
            provider.arrive(t0 + Duration::from_micros(at - base)),
            "the provider refused an arrival at {} us",
            at - base
        );
    }
    let n = sent.len() as f64;
    let first = sent.iter().filter(|s| s.1 == 0).count();
    eprintln!("{n} requests ({first} from replica 0) for {calls} calls in 5 s");
    // 10 a second and the first at once: 51 in 5 s.
    assert!(n >= 49.0, "{n} requests in 5 s of a 10/s bucket");
    assert!(
        f64::from(calls) / n <= 1.2,
        "{calls} calls for {n} requests"
    );
    for r in 0..2 {
        let mine = sent.iter().filter(|s| s.1 == r).count() as f64;
        assert!(mine / n >= 0.4, "replica {r}: {mine} of {n}");
    }
}

fn rand_id() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

/// Three sluice processes sharing one Redis, each with its own clients, in front of
/// one upstream that logs every arrival with the replica it came through.
struct Three {
    redis: Redis,
    upstream: support::Upstream,
    replicas: Vec<(support::Sluice, u16, u16)>,
    /// Holds the replicas' config files.
    _dir: tempfile::TempDir,
}

impl Three {
    async fn start(limit: &str, cluster_extra: &str) -> Three {
        let redis = Redis::start();
        let upstream = support::Upstream::start_apart().await;
        let dir = tempfile::tempdir().unwrap();
        let mut replicas = Vec::new();
        for i in 0..3 {
            let path = dir.path().join(format!("sluice-{i}.toml"));
            std::fs::write(
                &path,
                format!(
                    "[proxy]\nlisten = \"127.0.0.1:0\"\nadmin = \"127.0.0.1:0\"\n\
                     [[upstream]]\nname = \"api\"\nhosts = [\"127.0.0.1\"]\n\
                     limits = [{limit}]\n[upstream.retry]\nmax_attempts = 1\n\
                     [cluster]\nredis = \"{}\"\nreplicas = 3\n{cluster_extra}",
                    redis.url()
                ),
            )
            .unwrap();
            let mut s =
                support::Sluice::spawn(&["run", "--workers", "1", "-c", path.to_str().unwrap()]);
            let (port, admin) = s.listening().await;
            assert!(s.ready(admin).await, "replica {i} became ready");
            replicas.push((s, port, admin));
        }
        Three {
            redis,
            upstream,
            replicas,
            _dir: dir,
        }
    }

    /// `clients` closed-loop clients per replica until `until`; each response's status
    /// by replica.
    async fn load(&self, clients: usize, until: Instant) -> Vec<Vec<u16>> {
        self.load_timed(clients, until)
            .await
            .into_iter()
            .map(|r| r.into_iter().map(|(s, _)| s).collect())
            .collect()
    }

    /// As `load`, with how long each request took.
    async fn load_timed(&self, clients: usize, until: Instant) -> Vec<Vec<(u16, Duration)>> {
        let mut tasks = Vec::new();
        for (i, (_, port, _)) in self.replicas.iter().enumerate() {
            for _ in 0..clients {
                let client = reqwest::Client::builder()
                    .proxy(reqwest::Proxy::all(format!("http://127.0.0.1:{port}")).unwrap())
                    .timeout(Duration::from_secs(40))
                    .build()
                    .unwrap();
                let url = self.upstream.url("/v1/items");
                tasks.push(tokio::spawn(async move {
                    let mut statuses = Vec::new();
                    while Instant::now() < until {
                        let t = Instant::now();
                        match client
                            .get(&url)
                            .header("x-replica", i.to_string())
                            .send()
                            .await
                        {
                            Ok(r) => {
                                let status = r.status().as_u16();
                                let _ = r.bytes().await;
                                statuses.push((status, t.elapsed()));
                            }
                            Err(_) => statuses.push((0, t.elapsed())),
                        }
                    }
                    (i, statuses)
                }));
            }
        }
        let mut by = vec![Vec::new(); 3];
        for t in tasks {
            let (i, s) = t.await.unwrap();
            by[i].extend(s);
        }
        by
    }

    /// The upstream's arrivals since `from`, with the replica each came through.
    fn arrivals(&self, from: Instant) -> Vec<(Instant, usize)> {
        let mut a: Vec<(Instant, usize)> = self
            .upstream
            .seen()
            .iter()
            .filter(|s| s.at >= from)
            .map(|s| {
                let r = s
                    .header("x-replica")
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(9);
                (s.at, r)
            })
            .collect();
        a.sort();
        a
    }
}

/// The wall clock, as a provider on this machine reads it.
fn wall() -> Clock {
    Clock {
        t0: Instant::now(),
        unix0: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap(),
    }
}

/// Judges arrivals as the provider would: the first refused, if any.
fn first_refused(provider: &mut Counter, arrivals: &[(Instant, usize)]) -> Option<usize> {
    arrivals.iter().position(|(at, _)| !provider.arrive(*at))
}

/// Three replicas, each offered far more than the whole limit, for each kind: the
/// upstream never sees more than the limit as the provider's algorithm counts it, gets
/// close to it (`published`, one request at a time, less so: shared, it pays its margin
/// on most intervals), and the replicas share it about equally.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_share_each_limit_kind() {
    support::crypto();
    let kinds = [
        (
            "{ kind = \"sliding_window\", permits = 20, window = \"1s\", scope = \"global\" }",
            Counter::sliding(20, Duration::from_secs(1)),
            20.0,
            0.8,
        ),
        (
            "{ kind = \"fixed_window\", permits = 20, window = \"1s\", scope = \"global\" }",
            Counter::fixed(20, Duration::from_secs(1)),
            20.0,
            0.8,
        ),
        (
            "{ kind = \"token_bucket\", rate = 20, per = \"1s\", burst = 5, scope = \"global\" }",
            Counter::token(20, Duration::from_secs(1), 5),
            20.0,
            0.8,
        ),
        // Judged by haproxy's counter (windows from the first arrival) and a counter on
        // Redis's clock, this machine's.
        (
            "{ kind = \"sliding_counter\", permits = 20, window = \"1s\", scope = \"global\" }",
            Counter::All(vec![
                Counter::haproxy(20, Duration::from_secs(1), wall()),
                Counter::weighted(20, Duration::from_secs(1), wall(), true),
            ]),
            20.0,
            0.8,
        ),
        // The margin is the jitter between a send and the provider's stamp that a
        // published limit tolerates; the default (a fifth of the 50 ms interval) is less
        // than two cores running fifteen replicas, five Redis servers and sixty clients
        // can delay a stamp, so the limit names the margin this bench needs, as a user
        // names the one their network needs.
        (
            "{ kind = \"published\", permits = 20, window = \"1s\", margin = \"20ms\", scope = \"global\" }",
            Counter::All(vec![
                Counter::sliding(20, Duration::from_secs(1)),
                Counter::haproxy(20, Duration::from_secs(1), wall()),
                Counter::token(20, Duration::from_secs(1), 1),
            ]),
            20.0,
            // One at a time, each reservation held for its margin until its answer's
            // correction reaches Redis: the margin is paid on most intervals.
            0.6,
        ),
    ];
    let seconds = 6;
    let runs = kinds
        .iter()
        .map(|(limit, counter, rate, least)| async move {
            let three = Three::start(limit, "").await;
            let from = Instant::now();
            let statuses = three.load(4, from + Duration::from_secs(seconds)).await;
            let arrivals = three.arrivals(from);
            let calls = three.redis.calls("evalsha") + three.redis.calls("eval");
            (
                limit,
                counter.clone(),
                *rate,
                *least,
                statuses,
                arrivals,
                calls,
            )
        });
    for (limit, mut counter, rate, least, statuses, arrivals, calls) in
        futures_util::future::join_all(runs).await
    {
        let refused = first_refused(&mut counter, &arrivals);
        if let Some(k) = refused {
            let t0 = arrivals[0].0;
            let around: Vec<String> = arrivals[k.saturating_sub(25)..(k + 3).min(arrivals.len())]
                .iter()
                .map(|(at, r)| format!("{:.1}ms/r{r}", (*at - t0).as_secs_f64() * 1000.0))
                .collect();
            panic!("{limit}: a window held more than the limit: arrival {k}, around it {around:?}");
        }
        let ok: usize = statuses
            .iter()
            .map(|s| s.iter().filter(|c| **c == 200).count())
            .sum();
        assert_eq!(
            ok,
            arrivals.len(),
            "{limit}: every arrival answered its client"
        );
        let span = arrivals.last().unwrap().0 - arrivals[0].0;
        let used = arrivals.len() as f64 / (rate * (span.as_secs_f64() + 1.0));
        // Shares once every replica's clients are under way (the first to start may
        // take the first window alone).
        let settled: Vec<&(Instant, usize)> = arrivals
            .iter()
            .filter(|a| a.0 >= arrivals[0].0 + Duration::from_millis(1500))
            .collect();
        let shares: Vec<f64> = (0..3)
            .map(|r| settled.iter().filter(|a| a.1 == r).count() as f64 / settled.len() as f64)
            .collect();
        eprintln!(
            "{limit}: {} requests, {:.1}% of the limit, shares {:.2?}, {:.2} Redis calls per request",
            arrivals.len(),
            used * 100.0,
            shares,
            calls as f64 / arrivals.len() as f64
        );
        assert!(used > least, "{limit}: {:.1}% of the limit", used * 100.0);
        assert!(
            shares.iter().all(|s| *s > 0.2),
            "{limit}: shares {shares:?}"
        );
    }
}

/// Redis killed and started again empty, frozen with SIGSTOP so that calls hang, and
/// flushed, under three replicas' load, with `on_redis_error = "local"`: every window
/// of the upstream's arrivals holds at most the limit throughout, no request waits past
/// its timeouts, and the replicas are back on Redis, sharing, at the end.
///
/// Each of these is an outage every replica sees; one only some replicas see is not
/// covered by the local fallback (docs/cluster.md, "Where this ends"), so on a violation
/// the replicas' logs say which replica fell back when.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_failing_under_load_never_lets_the_limit_through() {
    support::crypto();
    let three = Three::start(
        "{ kind = \"sliding_window\", permits = 12, window = \"1s\", scope = \"global\" }",
        "open_for = \"1s\"\n",
    )
    .await;
    let t0 = Instant::now();
    let load = {
        let three = &three;
        async move { three.load_timed(3, t0 + Duration::from_secs(12)).await }
    };
    let chaos = async {
        tokio::time::sleep_until(t0 + Duration::from_secs(2)).await;
        three.redis.kill();
        tokio::time::sleep_until(t0 + Duration::from_secs(4)).await;
        three.redis.restart();
        tokio::time::sleep_until(t0 + Duration::from_secs(6)).await;
        three.redis.freeze();
        tokio::time::sleep_until(t0 + Duration::from_millis(7500)).await;
        three.redis.thaw();
        tokio::time::sleep_until(t0 + Duration::from_secs(9)).await;
        three.redis.cmd(&["FLUSHALL"]);
    };
    let (statuses, ()) = tokio::join!(load, chaos);
    let arrivals = three.arrivals(t0);
    let mut provider = Counter::sliding(12, Duration::from_secs(1));
    if let Some(k) = first_refused(&mut provider, &arrivals) {
        let at: Vec<(f64, usize)> = arrivals[k.saturating_sub(13)..=k]
            .iter()
            .map(|a| ((a.0 - t0).as_secs_f64(), a.1))
            .collect();
        // When each replica fell back and came back, to tell a partial outage.
        for (i, (s, _, _)) in three.replicas.iter().enumerate() {
            eprintln!("replica {i}: {:#?}", s.log_lines("Redis"));
        }
        panic!("more than 12 in a second at arrival {k} (seconds, replica): {at:?}");
    }
    let all: Vec<(u16, Duration)> = statuses.into_iter().flatten().collect();
    assert!(
        all.iter().all(|(s, _)| *s == 200 || *s == 429),
        "only answers: {all:?}"
    );
    // Hung calls end at the cluster timeout; the drained fallback waits out a window.
    let slowest = all.iter().map(|(_, d)| *d).max().unwrap_or_default();
    assert!(
        slowest < Duration::from_secs(5),
        "a request waited {slowest:?}"
    );
    // Back on Redis and sharing in the last seconds.
    let last: Vec<&(Instant, usize)> = arrivals
        .iter()
        .filter(|a| a.0 >= t0 + Duration::from_secs(10))
        .collect();
    assert!(
        last.len() >= 12,
        "about the limit again: {} in 2 s",
        last.len()
    );
    assert!(
        (0..3).all(|r| last.iter().any(|a| a.1 == r)),
        "every replica shares"
    );
    for (_, _, admin) in &three.replicas {
        let m = reqwest::get(format!("http://127.0.0.1:{admin}/metrics"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert_eq!(
            support::metric(&m, r#"sluice_cluster_mode{mode="redis"}"#),
            Some(1.0),
            "{m}"
        );
        assert!(
            support::metric(&m, r#"sluice_cluster_reservations_total{result="local"}"#)
                .is_some_and(|n| n > 0.0),
            "the local fallback admitted some"
        );
    }
}

/// A replica that fell back while Redis was frozen but admitted nothing itself (its
/// share was still drained) comes back to a Redis that knows nothing of what the other
/// replicas admitted locally meanwhile. It must not spend a whole window on top of
/// them: it writes back first, which fills the window as after any fallback, so its
/// first request after the outage waits a window (nothing real is in it) instead of
/// going at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn back_from_an_outage_having_admitted_nothing_a_replica_starts_drained() {
    support::crypto();
    let redis = Redis::start();
    let up = support::Upstream::start().await;
    let proxy = support::Proxy::start(&format!(
        "[[upstream]]\nname = \"api\"\nhosts = [\"127.0.0.1\"]\n\
         limits = [{{ kind = \"sliding_window\", permits = 12, window = \"3s\", scope = \"global\" }}]\n\
         [upstream.retry]\nmax_attempts = 1\n\
         [cluster]\nredis = \"{}\"\nreplicas = 3\nopen_for = \"1s\"\n",
        redis.url()
    ))
    .await;
    let client = proxy.client();
    assert_eq!(redis.cmd(&["PING"]).trim(), "PONG");
    redis.freeze();
    // Its calls hang until the breaker opens; the drained share admits nothing for a
    // window, and the client gives up first.
    let during = client
        .get(up.url("/during"))
        .timeout(Duration::from_secs(1))
        .send()
        .await;
    assert!(during.is_err(), "admitted during the outage: {during:?}");
    redis.thaw();
    // Past `open_for`: the next request's call probes, and Redis answers.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let t = Instant::now();
    let r = client
        .get(up.url("/after"))
        .timeout(Duration::from_secs(30))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let waited = t.elapsed();
    assert!(
        waited >= Duration::from_millis(2500),
        "the window was filled before reserving: waited {waited:?}"
    );
    let paths: Vec<String> = up.seen().iter().map(|s| s.uri.clone()).collect();
    assert_eq!(paths, ["/after"]);
}

fn client_via(port: u16, timeout: Duration) -> reqwest::Client {
    reqwest::Client::builder()
        .proxy(reqwest::Proxy::all(format!("http://127.0.0.1:{port}")).unwrap())
        .timeout(timeout)
        .build()
        .unwrap()
}

/// `on_redis_error = "deny"` answers 503 `cluster_unavailable` with `Retry-After` while
/// Redis is away, at once; `"allow"` lets requests through without the shared limit.
/// Both are back on Redis, and limited, once it returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deny_and_allow_while_redis_is_away() {
    support::crypto();
    let limit = "{ kind = \"sliding_window\", permits = 5, window = \"1s\", scope = \"global\" }";
    let (deny, allow) = tokio::join!(
        Three::start(limit, "on_redis_error = \"deny\"\nopen_for = \"1s\"\n"),
        Three::start(limit, "on_redis_error = \"allow\"\nopen_for = \"1s\"\n"),
    );
    deny.redis.kill();
    allow.redis.kill();
    let d = client_via(deny.replicas[0].1, Duration::from_secs(30));
    let a = client_via(allow.replicas[0].1, Duration::from_secs(30));
    // The first calls are refused at once (nothing listens): the breaker opens.
    let t = Instant::now();
    let r = d.get(deny.upstream.url("/x")).send().await.unwrap();
    assert_eq!(r.status(), 503);
    assert_eq!(r.headers()["sluice-reason"], "cluster_unavailable");
    assert!(r.headers().contains_key("retry-after"));
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    let body: serde_json::Value = serde_json::from_slice(&r.bytes().await.unwrap()).unwrap();
    assert_eq!(body["error"]["code"], "sluice_cluster_unavailable");
    // Allow: more than the limit goes through within a second.
    let t = Instant::now();
    for _ in 0..12 {
        let r = a.get(allow.upstream.url("/x")).send().await.unwrap();
        assert_eq!(r.status(), 200);
    }
    // Limited to 5 a second, the 12 would take 2 s.
    assert!(
        t.elapsed() < Duration::from_millis(1800),
        "unlimited: {:?}",
        t.elapsed()
    );
    // Still ready: the replicas keep serving whatever the fallback.
    for three in [&deny, &allow] {
        let ready = reqwest::get(format!("http://127.0.0.1:{}/readyz", three.replicas[0].2))
            .await
            .unwrap();
        assert_eq!(ready.status(), 200);
    }

    deny.redis.restart();
    allow.redis.restart();
    // The breaker probes after open_for; from then on, limited again.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    for (three, c) in [(&deny, &d), (&allow, &a)] {
        let from = Instant::now();
        let mut tasks = Vec::new();
        for _ in 0..10 {
            let (c, url) = (c.clone(), three.upstream.url("/y"));
            tasks.push(tokio::spawn(async move {
                c.get(url).send().await.unwrap().status()
            }));
        }
        for t in tasks {
            assert_eq!(t.await.unwrap(), 200);
        }
        let arrivals = three.arrivals(from);
        assert_eq!(arrivals.len(), 10);
        let mut provider = Counter::sliding(5, Duration::from_secs(1));
        assert_eq!(first_refused(&mut provider, &arrivals), None);
    }
}

/// Clients that give up while their requests hold reservations: each reservation goes
/// to the next request in line, or back, and nothing leaks: the limit holds, and once
/// they are gone the next requests go at the limit's pace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_leaving_with_reservations_hand_them_on() {
    support::crypto();
    let three = Three::start(
        "{ kind = \"fixed_window\", permits = 4, window = \"1s\", scope = \"global\" }",
        "",
    )
    .await;
    let impatient = client_via(three.replicas[0].1, Duration::from_millis(300));
    let from = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let (c, url) = (impatient.clone(), three.upstream.url("/z"));
        tasks.push(tokio::spawn(async move {
            c.get(url).send().await.map(|r| r.status())
        }));
    }
    let mut gave_up = 0;
    for t in tasks {
        if t.await.unwrap().is_err() {
            gave_up += 1;
        }
    }
    assert!(gave_up >= 8, "most gave up waiting: {gave_up}");
    // Patient clients now, on every replica: the limit holds, at the limit's pace.
    let statuses = three.load(2, Instant::now() + Duration::from_secs(4)).await;
    assert!(statuses.iter().flatten().all(|s| *s == 200), "{statuses:?}");
    let arrivals = three.arrivals(from);
    let mut provider = Counter::fixed(4, Duration::from_secs(1));
    assert_eq!(first_refused(&mut provider, &arrivals), None);
    let late = arrivals
        .iter()
        .filter(|a| a.0 >= from + Duration::from_secs(2))
        .count();
    assert!(late >= 8, "the limit's pace after they left: {late}");
}

/// `rediss://`: the same limits through a Redis that speaks only TLS, whose certificate
/// a private CA signs (`ca`), with `on_redis_error = "deny"` so that any failure to talk
/// to it would show as a 503. The URL comes from a file, as from a mounted Secret.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_limits_over_tls() {
    let dir = tempfile::tempdir().unwrap();
    let certs = support::certs::for_localhost(dir.path(), &[]);
    let redis = Redis::start_tls(&certs.cert_path, &certs.key_path);
    let url_file = dir.path().join("redis-url");
    std::fs::write(&url_file, redis.url()).unwrap();
    let up = support::Upstream::start().await;
    let proxy = support::Proxy::start(&format!(
        "[[upstream]]\nname = \"api\"\nhosts = [\"127.0.0.1\"]\n\
         limits = [{{ kind = \"sliding_window\", permits = 4, window = \"1s\", scope = \"global\" }}]\n\
         [cluster]\nredis_file = {:?}\nca = {:?}\non_redis_error = \"deny\"\n",
        url_file, certs.ca_path
    ))
    .await;
    let client = proxy.client();
    let from = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (c, url) = (client.clone(), up.url("/tls"));
        tasks.push(tokio::spawn(async move {
            c.get(url).send().await.unwrap().status()
        }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    assert!(
        from.elapsed() >= Duration::from_millis(900),
        "8 at 4/s take a second"
    );
    let m = proxy.metrics().await;
    assert_eq!(
        support::metric(
            &m,
            r#"sluice_cluster_reservations_total{result="reserved"}"#
        ),
        Some(8.0),
        "{m}"
    );
    assert!(redis.cmd(&["KEYS", "*"]).contains("{sluice:api:-}"));
    let (_, config) = proxy.admin_get("/config").await;
    assert!(config.contains("file:"), "{config}");
}

/// A reload that lowers a shared limit governs every request already waiting, as it does
/// a local limit: 40 clients queue behind a global 20/s, the file is rewritten to 2/s and
/// reloaded, and from a second after the reload the upstream sees no more than 2 in any
/// second (one reservation made under the old limit may still land). Before, requests
/// queued before the reload reserved under the plan they were routed with: 20/s went on
/// for 8 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lowered_shared_limit_governs_the_requests_already_waiting() {
    support::crypto();
    let redis = Redis::start();
    let upstream = support::Upstream::start_apart().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sluice.toml");
    let config = |permits: u32| {
        format!(
            "[proxy]\nlisten = \"127.0.0.1:0\"\nadmin = \"127.0.0.1:0\"\n\
             [[upstream]]\nname = \"api\"\nhosts = [\"127.0.0.1\"]\nmax_wait = \"60s\"\n\
             limits = [{{ kind = \"sliding_window\", permits = {permits}, window = \"1s\", scope = \"global\" }}]\n\
             [upstream.retry]\nmax_attempts = 1\n\
             [cluster]\nredis = \"{}\"\nreplicas = 1\n",
            redis.url()
        )
    };
    std::fs::write(&path, config(20)).unwrap();
    let mut s = support::Sluice::spawn(&["run", "-c", path.to_str().unwrap()]);
    let (port, admin) = s.listening().await;
    assert!(s.ready(admin).await);
    let client = client_via(port, Duration::from_secs(60));
    let stop = Instant::now() + Duration::from_secs(7);
    let mut tasks = Vec::new();
    for _ in 0..40 {
        let (c, url) = (client.clone(), upstream.url("/q"));
        tasks.push(tokio::spawn(async move {
            while Instant::now() < stop {
                if c.get(&url).send().await.is_err() {
                    return;
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    std::fs::write(&path, config(2)).unwrap();
    let reloaded = reqwest::Client::new()
        .post(format!("http://127.0.0.1:{admin}/reload"))
        .send()
        .await
        .unwrap();
    assert_eq!(reloaded.status(), 200);
    let at = Instant::now();
    tokio::time::sleep(Duration::from_secs(5)).await;
    for t in tasks {
        t.abort();
    }
    let arrivals: Vec<Instant> = upstream
        .seen()
        .iter()
        .map(|a| a.at)
        .filter(|a| *a >= at + Duration::from_secs(1) && *a < at + Duration::from_secs(5))
        .collect();
    assert!(!arrivals.is_empty(), "requests went on at the new limit");
    for (i, a) in arrivals.iter().enumerate() {
        let in_second = arrivals[i..]
            .iter()
            .take_while(|b| **b < *a + Duration::from_secs(1))
            .count();
        assert!(
            in_second <= 3,
            "{in_second} arrivals in the second from {:?} after the reload",
            *a - at
        );
    }
    let before = upstream.seen().iter().filter(|a| a.at < at).count();
    assert!(before >= 15, "the old limit was in use: {before}");
    s.signal("TERM");
    let _ = s.exit().await;
}
