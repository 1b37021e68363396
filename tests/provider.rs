//! Limits as the provider counts them. First a model check: the limit kinds driven
//! through random traffic (queueing, slow connects, connects that fail, sends that reach
//! the provider anywhere within the margin, slow and missing answers) while a provider
//! that counts at each request's arrival judges every request. Then the real thing: many
//! clients through sluice, set to a provider's exact limit, to an HTTP provider that
//! counts at arrival in its own code, behind a relay whose new connections are slow.

use sluice_test_support as support;

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use proptest::prelude::*;
use sluice::LimitState;
use sluice::{Algorithm, exposure};
use sluice::{CounterAlign, Limit, Margin, Rounding, Scope, WindowAlign};
use support::Proxy;
use support::provider::{Clock, Counter, Delays, Provider, Relay};
use tokio::time::Instant;

#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    Sliding,
    Fixed,
    Token {
        burst: u32,
    },
    /// `sliding_counter` at any alignment, judged by haproxy's counter.
    CounterAny,
    /// `sliding_counter` on the clock, judged by Python `limits`' counter (or the same
    /// counter comparing unrounded).
    CounterClock {
        rounds_down: bool,
    },
    /// `fixed_window` on the clock, judged by a clock window with the same offset.
    Calendar {
        offset_ms: u64,
    },
    /// `leaky_bucket`, judged by nginx: `permits` r/s, or `per_minute` r/m.
    Leaky {
        burst: u32,
        per_minute: bool,
    },
    /// `published`, judged by every algorithm above at the same numbers at once.
    Published,
    /// A clock window (`counter`: a counter on the clock) whose edges sluice's clock
    /// misplaces, moved to an edge the provider announced, `error` thousandths of the
    /// slack (a tenth of the window) off its real edge (`offset_ms` thousandths of the
    /// window past the clock's, further than twice the slack: an announcement within it is
    /// taken to agree with the edges written).
    Announced {
        counter: bool,
        offset_permille: u64,
        error: i64,
    },
}

#[derive(Debug, Clone)]
struct Shape {
    kind: Kind,
    permits: u32,
    window_ms: u64,
    /// In thousandths of half the window (the most a window's margin may be).
    margin_permille: u64,
    /// The Unix time at the start, past a round number: where the clock's windows fall.
    phase_ns: u64,
}

impl Shape {
    fn window(&self) -> Duration {
        Duration::from_millis(self.window_ms)
    }

    fn margin(&self) -> Duration {
        self.window() / 2 * self.margin_permille as u32 / 1000
    }

    fn unix0(&self) -> Duration {
        Duration::from_secs(1_700_000_000) + Duration::from_nanos(self.phase_ns)
    }

    /// A leaky bucket's rate and period as nginx writes them.
    fn nginx_rate(&self, per_minute: bool) -> (u32, Duration) {
        if per_minute {
            (self.permits * 13 + 1, Duration::from_secs(60))
        } else {
            (self.permits, Duration::from_secs(1))
        }
    }

    fn limit(&self) -> Limit {
        let nz = |v| NonZeroU32::new(v).unwrap();
        let margin = Some(Margin::Duration(self.margin()));
        let scope = Scope::Local;
        let (permits, window) = (nz(self.permits), self.window());
        let fixed = |align, offset| Limit::FixedWindow {
            align,
            offset,
            permits,
            window,
            margin,
            margin_max: None,
            scope,
            unit: Default::default(),
        };
        let counter = |align, rounding| Limit::SlidingCounter {
            permits,
            window,
            align,
            offset: None,
            rounding,
            margin,
            margin_max: None,
            scope,
            unit: Default::default(),
        };
        match self.kind {
            Kind::Sliding => Limit::SlidingWindow {
                permits,
                window,
                margin,
                margin_max: None,
                scope,
                unit: Default::default(),
            },
            Kind::Fixed => fixed(WindowAlign::First, None),
            Kind::Token { burst } => Limit::TokenBucket {
                rate: permits,
                per: window,
                burst: nz(burst),
                margin,
                margin_max: None,
                scope,
                unit: Default::default(),
            },
            Kind::CounterAny => counter(CounterAlign::Any, Rounding::Down),
            Kind::CounterClock { rounds_down } => counter(
                CounterAlign::Clock,
                if rounds_down {
                    Rounding::Down
                } else {
                    Rounding::None
                },
            ),
            Kind::Calendar { offset_ms } => fixed(
                WindowAlign::Clock,
                Some(Duration::from_millis(offset_ms % self.window_ms)),
            ),
            Kind::Leaky { burst, per_minute } => {
                let (rate, per) = self.nginx_rate(per_minute);
                Limit::LeakyBucket {
                    rate: nz(rate),
                    per,
                    burst,
                    // A share of the interval, as the other kinds' share of the window.
                    margin: Some(Margin::Duration(
                        per / rate * self.margin_permille as u32 / 1000,
                    )),
                    margin_max: None,
                    scope,
                    unit: Default::default(),
                }
            }
            Kind::Published => Limit::Published {
                permits,
                window,
                margin,
                margin_max: None,
                scope,
                unit: Default::default(),
            },
            Kind::Announced { counter: false, .. } => fixed(WindowAlign::Clock, None),
            Kind::Announced { counter: true, .. } => counter(CounterAlign::Clock, Rounding::Down),
        }
    }

    /// Where the provider announces an edge, for a limit whose edges must move there,
    /// and how far from the real one it may be.
    fn announced(&self, t0: Instant) -> Option<(Instant, Duration)> {
        let Kind::Announced {
            offset_permille,
            error,
            ..
        } = self.kind
        else {
            return None;
        };
        let w = self.window().as_nanos() as i128;
        let slack = self.window() / 10;
        // The provider's edge after t0: `offset_permille` of the window past the clock's,
        // which fall on whole windows of Unix time; then off by `error` of the slack.
        let offset = (self.window() * offset_permille as u32 / 1000).as_nanos() as i128;
        let edge = (offset - self.unix0().as_nanos() as i128).rem_euclid(w);
        let at = edge + slack.as_nanos() as i128 * error as i128 / 1000;
        let at = if at >= 0 {
            t0 + Duration::from_nanos(at as u64)
        } else {
            t0 - Duration::from_nanos((-at) as u64)
        };
        Some((at, slack))
    }

    fn provider(&self, t0: Instant) -> Counter {
        let clock = Clock {
            t0,
            unix0: self.unix0(),
        };
        let (p, w) = (self.permits, self.window());
        match self.kind {
            Kind::Sliding => Counter::sliding(p, w),
            Kind::Fixed => Counter::fixed(p, w),
            Kind::Token { burst } => Counter::token(p, w, burst),
            Kind::CounterAny => Counter::haproxy(p, w, clock),
            Kind::CounterClock { rounds_down } => Counter::weighted(p, w, clock, rounds_down),
            Kind::Calendar { offset_ms } => Counter::calendar(
                p,
                w,
                Duration::from_millis(offset_ms % self.window_ms),
                clock,
            ),
            Kind::Leaky { burst, per_minute } => {
                let (rate, per) = self.nginx_rate(per_minute);
                Counter::nginx(rate, per, burst, clock)
            }
            Kind::Announced {
                counter,
                offset_permille,
                ..
            } => {
                let offset = self.window() * offset_permille as u32 / 1000;
                if counter {
                    let shifted = Clock {
                        t0,
                        unix0: self.unix0() - offset,
                    };
                    Counter::weighted(p, w, shifted, true)
                } else {
                    Counter::calendar(p, w, offset, clock)
                }
            }
            Kind::Published => Counter::All(vec![
                Counter::sliding(p, w),
                Counter::fixed(p, w),
                Counter::calendar(p, w, Duration::ZERO, clock),
                Counter::haproxy(p, w, clock),
                Counter::weighted(p, w, clock, true),
                Counter::token(p, w, 1),
                Counter::nginx(p, w, 0, clock),
            ]),
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Fate {
    /// Handed to its connection `connect_ms` after admission.
    Sent,
    /// The connect failed: never sent.
    Failed,
    /// Given back as unsent, but the send raced the cancellation and went out anyway.
    SentAfterGivingUp,
}

#[derive(Debug, Clone)]
struct Req {
    /// After the previous request joined the queue.
    gap_ms: u64,
    connect_ms: u64,
    fate: Fate,
    /// Where in [send, send + margin] it reaches the provider, in [0, 1].
    delay: f64,
    /// After its arrival; `None`: no answer ever comes (a timeout).
    answer_ms: Option<u64>,
    /// The units it costs (1: a limit of requests), at most what the limit can admit.
    cost: u64,
    /// What its answer says it really cost, as a share of `cost` (1: as estimated).
    actual: f64,
}

fn shape() -> impl Strategy<Value = Shape> {
    let kind = prop_oneof![
        Just(Kind::Sliding),
        Just(Kind::Fixed),
        (1..4u32).prop_map(|burst| Kind::Token { burst }),
        Just(Kind::CounterAny),
        any::<bool>().prop_map(|rounds_down| Kind::CounterClock { rounds_down }),
        (0..1000u64).prop_map(|offset_ms| Kind::Calendar { offset_ms }),
        (0..4u32, any::<bool>()).prop_map(|(burst, per_minute)| Kind::Leaky { burst, per_minute }),
        Just(Kind::Published),
        (any::<bool>(), 201..800u64, -1000..=1000i64).prop_map(
            |(counter, offset_permille, error)| Kind::Announced {
                counter,
                offset_permille,
                error,
            }
        ),
    ];
    (
        kind,
        1..6u32,
        prop_oneof![Just(100u64), Just(250), Just(1000)],
        prop_oneof![Just(0u64), Just(1000), 0..1000u64],
        prop_oneof![Just(0u64), 0..120_000_000_000u64],
    )
        .prop_map(
            |(kind, permits, window_ms, margin_permille, phase_ns)| Shape {
                kind,
                permits,
                window_ms,
                margin_permille,
                phase_ns,
            },
        )
}

fn req() -> impl Strategy<Value = Req> {
    (
        prop_oneof![3 => Just(0u64), 2 => 0..400u64],
        prop_oneof![3 => Just(0u64), 1 => 0..300u64],
        prop_oneof![
            8 => Just(Fate::Sent),
            1 => Just(Fate::Failed),
            1 => Just(Fate::SentAfterGivingUp)
        ],
        prop_oneof![Just(0.0), Just(1.0), 0.0..=1.0f64],
        prop_oneof![
            3 => Just(Some(0u64)),
            3 => (0..600u64).prop_map(Some),
            1 => Just(None)
        ],
    )
        .prop_map(|(gap_ms, connect_ms, fate, delay, answer_ms)| Req {
            gap_ms,
            connect_ms,
            fate,
            delay,
            answer_ms,
            cost: 1,
            actual: 1.0,
        })
}

/// The kinds whose providers count costs (`Counter::arrive_n`).
fn weighted_shape() -> impl Strategy<Value = Shape> {
    shape().prop_filter("a provider that counts costs", |s| {
        matches!(
            s.kind,
            Kind::Sliding
                | Kind::Fixed
                | Kind::Token { .. }
                | Kind::CounterClock { .. }
                | Kind::Calendar { .. }
        )
    })
}

/// A request costing 1 to 5 units.
fn weighted_req() -> impl Strategy<Value = Req> {
    (req(), prop_oneof![2 => Just(1u64), 3 => 2..=5u64]).prop_map(|(r, cost)| Req { cost, ..r })
}

impl Shape {
    /// The most one request can cost and still be admitted: the window's permits, the
    /// bucket's burst.
    fn capacity(&self) -> u64 {
        match self.kind {
            Kind::Token { burst } => u64::from(burst),
            _ => u64::from(self.permits),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    Join(usize),
    Send(usize),
    GiveUp(usize),
    Answer(usize),
    Wake,
}

/// What one run produced: each sent request's arrival at the provider, each answer that
/// corrected its cost, and how many were admitted; the limit, once every event is past.
struct Run {
    arrivals: Vec<(u64, usize)>,
    /// When, and at which step of the run (arrivals and answers at one instant happen
    /// in step order), each answer corrected its request's cost.
    answers: Vec<(u64, u64, usize)>,
    /// The step each request was sent at.
    sent_at: std::collections::HashMap<usize, u64>,
    admitted: usize,
    limit: LimitState,
    end: Instant,
}

/// Drives one limit through `reqs` in event time (microseconds), admitting FIFO whenever
/// it allows, and returns where each sent request reached the provider.
fn simulate(shape: &Shape, reqs: &[Req]) -> Result<Run, TestCaseError> {
    let t0 = Instant::now();
    let at = |us: u64| t0 + Duration::from_micros(us);
    let mut l = LimitState::on_clock(&shape.limit(), t0, 0, shape.unix0());
    let cost = |i: usize| reqs[i].cost.min(shape.capacity());
    let actual = |i: usize| (cost(i) as f64 * reqs[i].actual).round() as u64;
    if let Some((edge, slack)) = shape.announced(t0) {
        l.realign(edge, slack);
    }
    let margin_us = shape.limit().margin().unwrap_or_default().as_micros() as u64;
    let mut events = BinaryHeap::new();
    let mut seq = 0u64;
    let mut push = |events: &mut BinaryHeap<_>, t: u64, ev: Ev| {
        seq += 1;
        events.push(Reverse((t, seq, ev)));
    };
    let mut t = 0;
    for (i, r) in reqs.iter().enumerate() {
        t += r.gap_ms * 1000;
        push(&mut events, t, Ev::Join(i));
    }
    let mut queue = VecDeque::new();
    let mut arrivals = Vec::new();
    let mut answers = Vec::new();
    let mut sent_at = std::collections::HashMap::new();
    let mut admitted = 0;
    let mut last = 0;
    let mut step = 0u64;
    let mut next_wake = None;
    while let Some(Reverse((t, _, ev))) = events.pop() {
        let now = at(t);
        last = t;
        step += 1;
        match ev {
            Ev::Join(i) => queue.push_back(i),
            Ev::Send(i) => {
                sent_at.insert(i, step);
                l.sent_n(i as u64, cost(i), Some(0), now);
                let arrival = t + (reqs[i].delay * margin_us as f64) as u64;
                arrivals.push((arrival, i));
                if let Some(a) = reqs[i].answer_ms {
                    push(&mut events, arrival + a * 1000, Ev::Answer(i));
                }
            }
            Ev::GiveUp(i) => {
                l.unsent_n(cost(i), 0);
                if let Fate::SentAfterGivingUp = reqs[i].fate {
                    sent_at.insert(i, step);
                    l.sent_n(i as u64, cost(i), None, now);
                    let arrival = t + (reqs[i].delay * margin_us as f64) as u64;
                    arrivals.push((arrival, i));
                }
            }
            Ev::Answer(i) => {
                l.answered(i as u64, now, Duration::ZERO);
                let is = actual(i);
                if is != cost(i) {
                    l.reweigh(i as u64, cost(i), is, 0, now);
                    answers.push((t, step, i));
                }
            }
            Ev::Wake => {}
        }
        while let Some(&head) = queue.front()
            && l.can_take_n(cost(head), now)
        {
            let i = queue.pop_front().unwrap();
            l.take_n(cost(i), now);
            admitted += 1;
            let later = t + reqs[i].connect_ms * 1000;
            match reqs[i].fate {
                Fate::Sent => push(&mut events, later, Ev::Send(i)),
                Fate::Failed | Fate::SentAfterGivingUp => push(&mut events, later, Ev::GiveUp(i)),
            }
        }
        if let Some(&head) = queue.front() {
            let ready = l.ready_at(cost(head), now);
            prop_assert!(ready.is_some(), "a rate limit always knows a next instant");
            let ready = ready.unwrap();
            prop_assert!(ready > now, "nothing admits now, yet ready_at says now");
            let us = (ready - t0).as_nanos().div_ceil(1000) as u64;
            if next_wake.is_none_or(|w| w <= t || us < w) {
                next_wake = Some(us);
                push(&mut events, us, Ev::Wake);
            }
        }
    }
    prop_assert!(queue.is_empty(), "{} requests never admitted", queue.len());
    arrivals.sort();
    Ok(Run {
        arrivals,
        answers,
        sent_at,
        admitted,
        limit: l,
        end: at(last),
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Whatever the connects, the answers and where within the margin each request
    /// reaches the provider, the provider never refuses one.
    #[test]
    fn the_provider_never_refuses_a_request(
        shape in shape(),
        reqs in prop::collection::vec(req(), 1..80),
    ) {
        let run = simulate(&shape, &reqs)?;
        prop_assert_eq!(run.admitted, reqs.len());
        let t0 = Instant::now();
        let mut provider = shape.provider(t0);
        for (us, i) in &run.arrivals {
            prop_assert!(
                provider.arrive(t0 + Duration::from_micros(*us)),
                "the provider refused request {} arriving at {} us", i, us
            );
        }
        // And every other algorithm `sluice explain` says the limit keeps within.
        for (algorithm, mut provider) in claimed(&shape, t0) {
            for (us, i) in &run.arrivals {
                prop_assert!(
                    provider.arrive(t0 + Duration::from_micros(*us)),
                    "{} refused request {} arriving at {} us", algorithm.name(), i, us
                );
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Requests that cost several units (tokens, points), admitted FIFO whenever the
    /// limit has room for all of one: a provider that counts the same costs refuses none,
    /// whatever the connects and answers, and every request is admitted in the end.
    #[test]
    fn the_provider_never_refuses_a_weighted_request(
        shape in weighted_shape(),
        reqs in prop::collection::vec(weighted_req(), 1..60),
    ) {
        let run = simulate(&shape, &reqs)?;
        prop_assert_eq!(run.admitted, reqs.len());
        let t0 = Instant::now();
        let mut provider = shape.provider(t0);
        for (us, i) in &run.arrivals {
            let cost = reqs[*i].cost.min(shape.capacity());
            prop_assert!(
                provider.arrive_n(t0 + Duration::from_micros(*us), cost),
                "the provider refused request {} costing {} arriving at {} us", i, cost, us
            );
        }
    }
}

/// A request costing 1 to 5 units whose answer says it cost a share of that: from
/// nothing to all of it (the estimate is an upper bound, as `max_tokens` is).
fn corrected_req() -> impl Strategy<Value = Req> {
    (weighted_req(), 0.0..=1.0f64).prop_map(|(r, actual)| Req { actual, ..r })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Requests corrected after their answers to what they really cost, against a
    /// provider that reconciles the same way (a moving window's entry shrinks, a GCRA
    /// gives back): the provider refuses none, and once everything is past the limit is
    /// whole again (no correction leaks or mints a permit).
    #[test]
    fn corrections_never_overrun_a_reconciling_provider_nor_leak(
        shape in weighted_shape().prop_filter("a provider that reconciles", |s| {
            matches!(s.kind, Kind::Sliding | Kind::Token { .. })
        }),
        reqs in prop::collection::vec(corrected_req(), 1..60),
    ) {
        let mut run = simulate(&shape, &reqs)?;
        prop_assert_eq!(run.admitted, reqs.len());
        let t0 = Instant::now();
        let at = |us: u64| t0 + Duration::from_micros(us);
        let end = run.end;
        let cost = |i: usize| reqs[i].cost.min(shape.capacity());
        let mut provider = shape.provider(t0);
        // Arrivals and settlements in time order, and at one instant in the order the run
        // made them.
        let mut events: Vec<(u64, u64, u8, usize)> = run
            .arrivals
            .iter()
            .map(|(t, i)| (*t, run.sent_at[i], 1, *i))
            .collect();
        events.extend(run.answers.iter().map(|(t, step, i)| (*t, *step, 0, *i)));
        events.sort();
        let arrived: std::collections::HashMap<usize, u64> =
            run.arrivals.iter().map(|(t, i)| (*i, *t)).collect();
        for (t, _, what, i) in events {
            if what == 1 {
                prop_assert!(
                    provider.arrive_n(at(t), cost(i)),
                    "the provider refused request {} costing {} at {} us", i, cost(i), t
                );
            } else {
                let is = (cost(i) as f64 * reqs[i].actual).round() as u64;
                provider.settle(at(arrived[&i]), at(t), cost(i), is);
            }
        }
        let later = end + shape.window() * 3 + Duration::from_secs(5);
        prop_assert_eq!(
            run.limit.available(later),
            shape.capacity(),
            "the limit is not whole once everything is past: {:?}", run.limit
        );
    }
}

/// The algorithms `limit::exposure` says the shape's limit keeps within, each as a
/// provider counting at the limit's own numbers.
fn claimed(shape: &Shape, t0: Instant) -> Vec<(Algorithm, Counter)> {
    let limit = shape.limit();
    let (p, w) = match (limit.window_limit(), &limit) {
        (Some(pw), _) => pw,
        (None, Limit::TokenBucket { rate, per, .. } | Limit::LeakyBucket { rate, per, .. }) => {
            (rate.get(), *per)
        }
        (None, other) => panic!("no numbers for {other:?}"),
    };
    let clock = Clock {
        t0,
        unix0: shape.unix0(),
    };
    // Clock windows where the limit's own are (the provider's, once announced), or
    // anywhere for a limit that has none.
    let offset = match (shape.kind, &limit) {
        (
            Kind::Announced {
                offset_permille, ..
            },
            _,
        ) => shape.window() * offset_permille as u32 / 1000,
        (
            _,
            Limit::FixedWindow {
                align: WindowAlign::Clock,
                offset,
                ..
            }
            | Limit::SlidingCounter {
                align: CounterAlign::Clock,
                offset,
                ..
            },
        ) => offset.unwrap_or_default(),
        _ => Duration::from_nanos(shape.phase_ns % w.as_nanos() as u64),
    };
    exposure(&limit)
        .unwrap()
        .into_iter()
        .filter(|v| v.within())
        .map(|v| {
            let judge = match v.algorithm {
                Algorithm::SlidingLog => Counter::sliding(p, w),
                Algorithm::SlidingCounter => Counter::All(vec![
                    Counter::haproxy(p, w, clock),
                    Counter::weighted(p, w, clock, true),
                ]),
                Algorithm::ClockWindows => Counter::calendar(p, w, offset, clock),
                Algorithm::FirstRequestWindows => Counter::fixed(p, w),
                Algorithm::FullBucket => Counter::token(p, w, p),
                Algorithm::Pacing => Counter::token(p, w, 1),
            };
            (v.algorithm, judge)
        })
        .collect()
}

/// Saturated for many windows with a provider that answers within a millisecond: the
/// default margin (a fifth of the window) costs next to nothing, since a permit comes
/// back from the response rather than from the margin. 12 per second for 20 s is 240;
/// every cycle loses the millisecond to the answer.
#[test]
fn with_fast_answers_the_default_margin_costs_little() {
    let kinds = [
        (
            "kind = \"sliding_window\", permits = 12, window = \"1s\"",
            238,
        ),
        (
            "kind = \"fixed_window\", permits = 12, window = \"1s\"",
            238,
        ),
        (
            "kind = \"fixed_window\", permits = 12, window = \"1s\", align = \"clock\"",
            238,
        ),
        (
            "kind = \"sliding_counter\", permits = 12, window = \"1s\"",
            238,
        ),
        (
            "kind = \"sliding_counter\", permits = 12, window = \"1s\", align = \"clock\"",
            238,
        ),
        // Unrounded, a counter that is full at the end of each window admits one less.
        (
            "kind = \"sliding_counter\", permits = 12, window = \"1s\", align = \"clock\", \
             rounding = \"none\"",
            218,
        ),
        // One at a time, a little over 1/12 s apart, each after the previous answer.
        ("kind = \"published\", permits = 12, window = \"1s\"", 234),
        // nginx's 12 r/s with a burst of 11: 12 at once, then 12 a second.
        (
            "kind = \"leaky_bucket\", rate = 12, per = \"1s\", burst = 11",
            248,
        ),
    ];
    for (limit, least) in kinds {
        let config = sluice::Config::parse(
            &format!("[[upstream]]\nname = \"u\"\nhosts = [\"u\"]\nlimits = [{{ {limit} }}]\n"),
            "t.toml",
        )
        .unwrap();
        let spec = &config.upstreams[0].limits[0];
        assert_eq!(
            spec.margin(),
            spec.span().map(|s| s / 5),
            "{limit}: the default"
        );
        let t0 = Instant::now();
        let mut l = LimitState::on_clock(spec, t0, 0, Duration::from_secs(1_700_000_000));
        let mut now = t0;
        let mut admitted = 0u64;
        let end = t0 + Duration::from_secs(20);
        while now < end {
            while l.can_take(now) {
                l.take(now);
                l.sent(admitted, Some(0), now);
                l.answered(admitted, now + Duration::from_millis(1), Duration::ZERO);
                admitted += 1;
            }
            now = l.ready_at(1, now).unwrap();
        }
        assert!(admitted >= least, "{limit}: {admitted}");
    }
}

const PERMITS: u32 = 10;
const WINDOWS: usize = 6;
const CLIENTS: usize = 40;

struct Outcome {
    /// Statuses the clients got, in no order.
    statuses: Vec<u16>,
    /// Requests the provider accepted and refused.
    accepted: usize,
    refused: usize,
    elapsed: Duration,
    relay_connections: usize,
    /// sluice's `/metrics` and `/buckets` at the end.
    metrics: String,
    buckets: serde_json::Value,
}

/// `CLIENTS` clients, each on its own connection to sluice, send `PERMITS × WINDOWS`
/// requests between them, as fast as sluice lets them, through sluice set to exactly
/// the provider's limit (`kind`, `PERMITS` per second) with retries off, so every 429 the
/// provider answers reaches a client. `tls`: sluice reaches the provider over TLS
/// (`scheme = "https"`), so a slow handshake delays its sends.
async fn at_the_exact_limit(kind: &str, tls: bool, delays: Delays, margin: &str) -> Outcome {
    let dir = tempfile::tempdir().unwrap();
    let certs = tls.then(|| support::certs::for_localhost(dir.path(), &[b"http/1.1"]));
    let window = Duration::from_secs(1);
    let counter = match kind {
        "sliding_window" => Counter::sliding(PERMITS, window),
        _ => Counter::fixed(PERMITS, window),
    };
    let provider = Provider::start(counter, certs.as_ref().map(|c| c.server.clone())).await;
    let relay = Relay::start(provider.addr, delays).await;
    let origin = match &certs {
        Some(c) => format!("scheme = \"https\"\nupstream_ca = {:?}\n", c.ca_path),
        None => String::new(),
    };
    let proxy = Proxy::start(&format!(
        "[[upstream]]\nname = \"provider\"\nhosts = [\"127.0.0.1\"]\n{origin}\
         limits = [{{ kind = \"{kind}\", permits = {PERMITS}, window = \"1s\"{margin} }}]\n\
         [upstream.retry]\nmax_attempts = 1\n"
    ))
    .await;
    let url = format!("http://{}/v1/orders", relay.addr);
    let total = PERMITS as usize * WINDOWS;
    let next = Arc::new(AtomicUsize::new(0));
    // Every client is built, and waiting, before any sends: building one (TLS roots
    // included) takes long enough on a busy machine that the first clients used to send
    // their later requests before the last ones had sent their first, and took their turns.
    let start = Arc::new(tokio::sync::Barrier::new(CLIENTS));
    let built: Vec<reqwest::Client> = (0..CLIENTS).map(|_| proxy.client()).collect();
    let t0 = Instant::now();
    let mut clients = Vec::new();
    for client in built {
        let (url, next, start) = (url.clone(), next.clone(), start.clone());
        clients.push(tokio::spawn(async move {
            start.wait().await;
            let mut statuses = Vec::new();
            while next.fetch_add(1, Ordering::Relaxed) < total {
                let resp = client.get(&url).send().await.unwrap();
                statuses.push(resp.status().as_u16());
                resp.bytes().await.unwrap();
            }
            // The client, and its connection, stay until every client is done: one that
            // closed would hand its upstream connection to a client still waiting.
            (statuses, client)
        }));
    }
    let mut statuses = Vec::new();
    let mut done = Vec::new();
    for c in clients {
        let (s, client) = c.await.unwrap();
        statuses.extend(s);
        done.push(client);
    }
    let elapsed = t0.elapsed();
    let (accepted, refused) = provider.counts();
    Outcome {
        statuses,
        accepted,
        refused,
        elapsed,
        relay_connections: relay.connections.load(Ordering::Relaxed),
        metrics: proxy.metrics().await,
        buckets: serde_json::from_str(&proxy.admin_get("/buckets").await.1).unwrap(),
    }
}

fn assert_no_provider_429(kind: &str, o: &Outcome) {
    let total = PERMITS as usize * WINDOWS;
    assert_eq!(
        o.refused, 0,
        "{kind}: the provider refused {} requests",
        o.refused
    );
    assert_eq!(o.accepted, total, "{kind}");
    assert!(
        o.statuses.iter().all(|s| *s == 200),
        "{kind}: {:?}",
        o.statuses
    );
    // Near the limit, not far below it: six windows' worth in about five seconds
    // (the first window is free), with a wide allowance for a loaded machine.
    assert!(
        o.elapsed < Duration::from_secs(WINDOWS as u64 + 3),
        "{kind}: {:?}",
        o.elapsed
    );
}

/// The first request on each new connection held back 100 ms after sluice sent it,
/// where sluice cannot see it; every request jittered by up to 3 ms.
fn unseen_first_requests() -> Delays {
    Delays {
        first_request: Duration::from_millis(100),
        jitter: Duration::from_millis(3),
        ..Delays::default()
    }
}

/// Each new TLS connection costs 100 ms before sluice can send on it (the first
/// window's requests open ten of them; later ones reuse them), and every request is
/// jittered by up to 3 ms on its way. sluice counts from its sends, after the handshakes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_provider_429s_behind_slow_tls_handshakes() {
    let delays = Delays {
        handshake: Duration::from_millis(100),
        jitter: Duration::from_millis(3),
        ..Delays::default()
    };
    let (sliding, fixed) = tokio::join!(
        at_the_exact_limit("sliding_window", true, delays, ""),
        at_the_exact_limit("fixed_window", true, delays, ""),
    );
    assert_no_provider_429("sliding_window", &sliding);
    assert_no_provider_429("fixed_window", &fixed);
    assert!(
        sliding.relay_connections >= 2,
        "fresh connections were opened"
    );
}

/// The first request on each new connection reaches the provider 100 ms after sluice
/// sent it, where sluice cannot see the delay: its clients' first requests pay it, their
/// later ones, on the same connections, do not. The default margin covers it; the
/// response, coming back 100 ms late, keeps the permit that long.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_provider_429s_when_first_requests_are_delayed_unseen() {
    let delays = unseen_first_requests();
    let (sliding, fixed) = tokio::join!(
        at_the_exact_limit("sliding_window", false, delays, ""),
        at_the_exact_limit("fixed_window", false, delays, ""),
    );
    assert_no_provider_429("sliding_window", &sliding);
    assert_no_provider_429("fixed_window", &fixed);
    assert_eq!(
        sliding.relay_connections, CLIENTS,
        "each client's first request had a fresh upstream connection"
    );
}

/// The same traffic with no margin: the window after the last fresh connections is
/// refused by the provider, since their requests reached it 100 ms after sluice sent
/// them. This is what the margin is for, and shows the tests above can fail. sluice
/// counts those refusals as edge 429s; with `margin_max` it grows the margin to cover
/// the slowest answer it saw.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_margin_the_provider_refuses_at_window_edges() {
    let delays = unseen_first_requests();
    let (fixed, growing) = tokio::join!(
        at_the_exact_limit("sliding_window", false, delays, ", margin = \"0s\""),
        at_the_exact_limit(
            "sliding_window",
            false,
            delays,
            ", margin = \"0s\", margin_max = \"300ms\""
        ),
    );
    for o in [&fixed, &growing] {
        assert!(o.refused > 0, "no provider 429 without a margin");
        assert_eq!(
            o.statuses.iter().filter(|s| **s == 429).count(),
            o.refused,
            "each reached its client (retries are off)"
        );
        // The first refusals come at a window edge; later ones may follow the cool-down
        // those 429s started, which is no limit's edge.
        let edge = support::metric(
            &o.metrics,
            r#"sluice_edge_429_total{family="-",upstream="provider"}"#,
        )
        .unwrap_or(0.0);
        assert!(
            edge >= 1.0 && edge <= o.refused as f64,
            "{edge} of {}",
            o.refused
        );
    }
    assert_eq!(fixed.buckets[0]["limits"][0]["margin"], "0s");
    let grown = growing.buckets[0]["limits"][0]["margin"]
        .as_str()
        .unwrap()
        .to_string();
    let grown = humantime::parse_duration(&grown).unwrap();
    assert!(
        grown >= Duration::from_millis(100) && grown <= Duration::from_millis(300),
        "grown to cover the 100 ms the first requests took: {grown:?}"
    );
}
