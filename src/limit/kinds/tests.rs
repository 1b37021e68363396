//! Each kind stepped by hand: admitted, sent, answered and undone at chosen instants.

use std::num::NonZeroU32;
use std::time::Duration;

use tokio::time::Instant;

use super::*;
use crate::config::Margin;

fn nz(v: u32) -> NonZeroU32 {
    NonZeroU32::new(v).unwrap()
}

fn ms(v: u64) -> Duration {
    Duration::from_millis(v)
}

fn margin(m: u64) -> Option<Margin> {
    Some(Margin::Duration(ms(m)))
}

fn token_spec(rate: u32, per: Duration, burst: u32, m: u64) -> Limit {
    Limit::TokenBucket {
        rate: nz(rate),
        per,
        burst: nz(burst),
        margin: margin(m),
        margin_max: None,
        scope: Default::default(),
        unit: Default::default(),
    }
}

fn sliding_spec(permits: u32, window: u64, m: u64) -> Limit {
    Limit::SlidingWindow {
        permits: nz(permits),
        window: ms(window),
        margin: margin(m),
        margin_max: None,
        scope: Default::default(),
        unit: Default::default(),
    }
}

fn fixed_spec(permits: u32, window: u64, m: u64) -> Limit {
    Limit::FixedWindow {
        align: Default::default(),
        offset: None,
        permits: nz(permits),
        window: ms(window),
        margin: margin(m),
        margin_max: None,
        scope: Default::default(),
        unit: Default::default(),
    }
}

fn conc_spec(max: u32) -> Limit {
    Limit::Concurrency {
        max: nz(max),
        scope: Default::default(),
        unit: Default::default(),
    }
}

/// Admitted, sent and answered at `now`: the provider counted it at once.
fn go(l: &mut LimitState, id: Id, now: Instant) {
    l.take(now);
    l.sent(id, Some(0), now);
    l.answered(id, now, Duration::ZERO);
}

/// Admits greedily every millisecond over `span`, each sent and answered at once, and
/// returns the admission instants.
fn drive(l: &mut LimitState, start: Instant, span: Duration) -> Vec<Instant> {
    let mut out = Vec::new();
    let mut now = start;
    while now < start + span {
        while l.can_take(now) {
            go(l, out.len() as Id, now);
            out.push(now);
        }
        now += ms(1);
    }
    out
}

#[test]
fn token_bucket_bursts_then_refills_at_rate() {
    let t0 = Instant::now();
    let mut l = LimitState::new(&token_spec(3, Duration::from_secs(1), 6, 0), t0);
    assert_eq!(l.available(t0), 6);
    let got = drive(&mut l, t0, Duration::from_secs(10));
    assert_eq!(
        got.iter().filter(|t| **t == t0).count(),
        6,
        "the burst at once"
    );
    // Then one every 333.33 ms: 6 + 3 per second over 10 s (the last refill lands at 9.999 s).
    assert_eq!(got.len(), 6 + 29);
    assert_eq!(
        got[6],
        t0 + ms(334),
        "the first refill, rounded up to the next ms"
    );
    assert_eq!(
        l.ready_at(1, t0 + ms(10_000)),
        Some(t0 + Duration::from_nanos(10_000_000_000))
    );
}

#[test]
fn token_bucket_exact_with_awkward_rates() {
    let t0 = Instant::now();
    let mut l = LimitState::new(&token_spec(7, Duration::from_secs(3), 1, 0), t0);
    go(&mut l, 0, t0);
    // Emission interval 3/7 s = 428571428.57 ns: ready at the next whole nanosecond.
    assert_eq!(
        l.ready_at(1, t0),
        Some(t0 + Duration::from_nanos(428_571_429))
    );
    assert!(!l.can_take(t0 + Duration::from_nanos(428_571_428)));
    assert!(l.can_take(t0 + Duration::from_nanos(428_571_429)));
    assert_eq!(l.ready_at(7, t0), Some(t0 + Duration::from_secs(3)));
}

#[test]
fn token_bucket_counts_from_the_send_and_its_margin() {
    let t0 = Instant::now();
    // 10/s, burst 1: one every 100 ms as the provider sees them, margin 20 ms.
    let mut l = LimitState::new(&token_spec(10, Duration::from_secs(1), 1, 20), t0);
    l.take(t0);
    assert!(!l.can_take(t0), "the admitted request holds the token");
    assert_eq!(l.ready_at(1, t0), Some(t0 + ms(100)), "a lower bound");
    // Sent 50 ms after admission (a connect): counted from the send, plus the margin.
    l.sent(0, Some(0), t0 + ms(50));
    assert_eq!(l.ready_at(1, t0 + ms(50)), Some(t0 + ms(170)));
    // The response came back after 5 ms: it had arrived by then.
    l.answered(0, t0 + ms(55), Duration::ZERO);
    assert_eq!(l.ready_at(1, t0 + ms(55)), Some(t0 + ms(155)));
    assert!(!l.can_take(t0 + ms(154)));
    assert!(l.can_take(t0 + ms(155)));

    // With a burst the margin comes out of the tolerance, not out of the rate.
    let mut b = LimitState::new(&token_spec(10, Duration::from_secs(1), 5, 20), t0);
    let got = drive(&mut b, t0, Duration::from_secs(3));
    assert_eq!(got.iter().filter(|t| **t == t0).count(), 5);
    assert_eq!(got.len(), 5 + 29, "10/s sustained");
}

#[test]
fn sliding_window_returns_each_permit_window_after_it_was_sent() {
    let t0 = Instant::now();
    let mut l = LimitState::new(&sliding_spec(3, 1000, 0), t0);
    go(&mut l, 0, t0);
    go(&mut l, 1, t0 + ms(100));
    go(&mut l, 2, t0 + ms(400));
    assert!(!l.can_take(t0 + ms(999)));
    assert_eq!(l.ready_at(1, t0 + ms(500)), Some(t0 + ms(1000)));
    assert_eq!(l.ready_at(2, t0 + ms(500)), Some(t0 + ms(1100)));
    assert_eq!(l.ready_at(3, t0 + ms(500)), Some(t0 + ms(1400)));
    assert_eq!(l.ready_at(4, t0 + ms(500)), Some(t0 + ms(2000)));
    assert!(l.can_take(t0 + ms(1000)));
    assert_eq!(l.available(t0 + ms(1100)), 2);
}

#[test]
fn a_sliding_permit_is_held_until_sent_and_returns_after_the_latest_arrival() {
    let t0 = Instant::now();
    let mut l = LimitState::new(&sliding_spec(2, 1000, 50), t0);
    l.take(t0);
    l.take(t0);
    assert_eq!(l.available(t0 + ms(5000)), 0, "unsent: no return in sight");
    assert_eq!(
        l.ready_at(1, t0 + ms(10)),
        Some(t0 + ms(1010)),
        "at best sent now"
    );
    // One connects for 300 ms and gets no answer: back 1 s after its send plus margin.
    l.sent(0, Some(0), t0 + ms(300));
    // The other goes at 310 ms and is answered 12 ms later: back 1 s after the answer.
    l.sent(1, Some(0), t0 + ms(310));
    l.answered(1, t0 + ms(322), Duration::ZERO);
    assert_eq!(l.ready_at(1, t0 + ms(400)), Some(t0 + ms(1322)));
    assert_eq!(l.ready_at(2, t0 + ms(400)), Some(t0 + ms(1350)));
    assert_eq!(l.available(t0 + ms(1321)), 0);
    assert_eq!(l.available(t0 + ms(1322)), 1);
    assert_eq!(l.available(t0 + ms(1350)), 2);
    assert!(l.is_pristine(t0 + ms(1350)));
}

#[test]
fn an_unsent_admission_gives_its_permit_back_and_a_late_send_still_counts() {
    let t0 = Instant::now();
    for spec in [
        token_spec(1, ms(1000), 1, 0),
        sliding_spec(1, 1000, 0),
        fixed_spec(1, 1000, 0),
    ] {
        let mut l = LimitState::new(&spec, t0);
        l.take(t0);
        assert!(!l.can_take(t0), "{spec:?}");
        l.unsent(0);
        assert!(
            l.can_take(t0),
            "a connect that failed costs nothing: {spec:?}"
        );
        assert!(l.is_pristine(t0), "{spec:?}");
        // The send raced its own cancellation and went out anyway: the provider sees it.
        l.sent(7, None, t0 + ms(1));
        assert!(!l.can_take(t0 + ms(1)), "{spec:?}");
    }
}

#[test]
fn fixed_window_opens_at_the_first_send() {
    let t0 = Instant::now();
    let mut l = LimitState::new(&fixed_spec(2, 1000, 0), t0);
    // Admitted at t0, but connecting took 300 ms: the window opens when the first
    // request goes out, as it does at the provider.
    l.take(t0);
    l.take(t0);
    assert!(!l.can_take(t0));
    let first = t0 + ms(300);
    l.sent(0, Some(0), first);
    l.answered(0, first, Duration::ZERO);
    l.sent(1, Some(0), first + ms(10));
    l.answered(1, first + ms(10), Duration::ZERO);
    assert!(!l.can_take(t0 + ms(1299)));
    assert_eq!(l.ready_at(1, t0 + ms(500)), Some(first + ms(1000)));
    assert_eq!(l.ready_at(3, t0 + ms(500)), Some(first + ms(2000)));
    assert!(l.can_take(first + ms(1000)));
    // The next window opens at the next send, not on a clock boundary.
    let second = t0 + ms(5000);
    go(&mut l, 2, second);
    go(&mut l, 3, second);
    assert!(!l.can_take(second + ms(999)));
    assert!(l.can_take(second + ms(1000)));
}

#[test]
fn a_fixed_window_closes_a_margin_after_its_opening_unless_answered_sooner() {
    let t0 = Instant::now();
    let mut l = LimitState::new(&fixed_spec(1, 1000, 40), t0);
    l.take(t0);
    l.sent(0, Some(0), t0);
    // The provider opened its window between t0 and t0 + 40 ms.
    assert_eq!(l.ready_at(1, t0), Some(t0 + ms(1040)));
    l.answered(0, t0 + ms(3), Duration::ZERO);
    assert_eq!(l.ready_at(1, t0 + ms(3)), Some(t0 + ms(1003)));
    assert!(!l.can_take(t0 + ms(1002)));
    assert!(l.can_take(t0 + ms(1003)));
}

#[test]
fn a_send_near_the_end_of_a_fixed_window_counts_in_the_next_one_too() {
    let t0 = Instant::now();
    let mut l = LimitState::new(&fixed_spec(3, 1000, 40), t0);
    go(&mut l, 0, t0);
    // Sent 980 ms in: it may reach the provider after its window closed.
    l.take(t0 + ms(980));
    l.sent(1, Some(0), t0 + ms(980));
    assert_eq!(l.available(t0 + ms(990)), 1);
    // Once the first window is over, the unsure send is in the next one, which may have
    // opened with it: 2 left, until a window after its latest arrival.
    assert_eq!(l.available(t0 + ms(1000)), 2);
    go(&mut l, 2, t0 + ms(1000));
    go(&mut l, 3, t0 + ms(1000));
    assert!(!l.can_take(t0 + ms(1500)));
    assert_eq!(
        l.ready_at(1, t0 + ms(1500)),
        Some(t0 + ms(980 + 40 + 1000)),
        "until a window after the latest the unsure send could have opened it"
    );

    // Answered before the window could have closed: it arrived inside, nothing carried.
    let mut l = LimitState::new(&fixed_spec(3, 1000, 40), t0);
    go(&mut l, 0, t0);
    l.take(t0 + ms(980));
    l.sent(1, Some(0), t0 + ms(980));
    l.answered(1, t0 + ms(985), Duration::ZERO);
    assert_eq!(l.available(t0 + ms(1000)), 3);
}

#[test]
fn concurrency_holds_until_release() {
    let t0 = Instant::now();
    let mut l = LimitState::new(&conc_spec(2), t0);
    l.take(t0);
    l.take(t0);
    assert!(
        !l.can_take(t0 + Duration::from_secs(3600)),
        "time alone frees nothing"
    );
    assert_eq!(l.ready_at(1, t0), None);
    l.sent(0, Some(0), t0);
    l.release(1, 0);
    assert!(l.can_take(t0));
    l.release(1, 0);
    assert!(l.is_pristine(t0));
}

#[test]
fn undo_restores_the_untaken_state() {
    let t0 = Instant::now();
    let specs = [
        token_spec(1, ms(1000), 2, 0),
        sliding_spec(2, 1000, 0),
        fixed_spec(2, 1000, 0),
        conc_spec(2),
    ];
    for spec in &specs {
        let mut l = LimitState::new(spec, t0);
        l.take(t0 + ms(10));
        l.undo(1, 0);
        assert!(l.is_pristine(t0 + ms(20)), "{spec:?} -> {l:?}");
        assert_eq!(l.available(t0 + ms(20)), 2, "{spec:?}");
    }
}

#[test]
fn pristine_again_once_time_has_passed() {
    let t0 = Instant::now();
    let mut l = LimitState::new(&token_spec(10, ms(1000), 5, 0), t0);
    for i in 0..5 {
        go(&mut l, i, t0);
    }
    assert!(!l.is_pristine(t0 + ms(499)));
    assert!(l.is_pristine(t0 + ms(500)));
}

#[test]
fn a_carried_token_bucket_keeps_its_debt_in_permits() {
    let t0 = Instant::now();
    let sec = Duration::from_secs(1);
    let mut l = LimitState::new(&token_spec(10, sec, 10, 0), t0);
    for i in 0..5 {
        go(&mut l, i, t0);
    }
    // Five taken; a burst of three admits nothing until two are left (300 ms at 10/s).
    let mut lower = l.clone().carry(&token_spec(10, sec, 3, 0), t0, 1);
    assert_eq!(lower.available(t0), 0);
    assert_eq!(lower.ready_at(1, t0), Some(t0 + ms(300)));
    let mut higher = l.clone().carry(&token_spec(10, sec, 20, 0), t0, 1);
    assert_eq!(higher.available(t0), 15);
    // The debt of five permits now drains at the new rate, one a second.
    let mut slower = l.carry(&token_spec(1, sec, 10, 0), t0, 1);
    assert_eq!(slower.available(t0), 5);
    assert_eq!(slower.available(t0 + ms(999)), 5);
    assert_eq!(slower.available(t0 + ms(1000)), 6);
}

#[test]
fn carried_windows_and_concurrency_keep_what_was_taken() {
    let t0 = Instant::now();
    let mut l = LimitState::new(&sliding_spec(5, 1000, 0), t0);
    for i in 0..4 {
        go(&mut l, i, t0 + ms(10 * i));
    }
    let mut lower = l.clone().carry(&sliding_spec(2, 1000, 0), t0 + ms(100), 1);
    assert_eq!(lower.available(t0 + ms(100)), 0);
    // Two of four must expire: the third admission's instant plus the window.
    assert_eq!(lower.ready_at(1, t0 + ms(100)), Some(t0 + ms(1020)));
    assert_eq!(lower.ready_at(2, t0 + ms(100)), Some(t0 + ms(1030)));
    assert_eq!(
        l.clone()
            .carry(&sliding_spec(10, 1000, 0), t0 + ms(100), 1)
            .available(t0 + ms(100)),
        6
    );
    // A shorter window forgets what falls out of it.
    assert_eq!(
        l.carry(&sliding_spec(5, 200, 0), t0 + ms(500), 1)
            .available(t0 + ms(500)),
        5
    );

    let mut f = LimitState::new(&fixed_spec(5, 1000, 0), t0);
    for i in 0..3 {
        go(&mut f, i, t0);
    }
    let mut lower = f.clone().carry(&fixed_spec(2, 1000, 0), t0 + ms(100), 1);
    assert_eq!(lower.available(t0 + ms(100)), 0);
    assert_eq!(
        lower.available(t0 + ms(1000)),
        2,
        "the next window is whole"
    );
    assert_eq!(
        f.carry(&fixed_spec(10, 1000, 0), t0 + ms(100), 1)
            .available(t0),
        7
    );

    let counter = |permits: u32| {
        written(&format!(
            "kind = \"sliding_counter\"\npermits = {permits}\nwindow = \"1s\"\nmargin = \"0s\""
        ))
    };
    let mut w = LimitState::new(&counter(5), t0);
    for i in 0..4 {
        go(&mut w, i, t0);
    }
    assert!(w.same_kind(&counter(2)));
    let mut lower = w.clone().carry(&counter(2), t0 + ms(100), 1);
    assert_eq!(lower.available(t0 + ms(100)), 0);
    assert_eq!(
        w.carry(&counter(10), t0 + ms(100), 1)
            .available(t0 + ms(100)),
        6
    );

    let mut c = LimitState::new(&conc_spec(4), t0);
    for _ in 0..3 {
        c.take(t0);
    }
    let mut lower = c.carry(&conc_spec(2), t0, 1);
    assert_eq!(lower.available(t0), 0);
    lower.release(1, 0);
    assert_eq!(lower.available(t0), 0);
    lower.release(1, 0);
    assert_eq!(lower.available(t0), 1);
    // A limit born in epoch 1 was never paid by a permit of epoch 0.
    let mut born = LimitState::new_in(&conc_spec(2), t0, 1);
    born.take(t0);
    born.release(1, 0);
    assert_eq!(born.available(t0), 1);
    born.release(1, 1);
    assert_eq!(born.available(t0), 2);
}

#[test]
fn a_limit_newer_than_an_admission_does_not_count_its_send_against_its_own() {
    let t0 = Instant::now();
    // Created by the reload of epoch 1, with one admission of its own unsent.
    let mut l = LimitState::new_in(&sliding_spec(2, 1000, 0), t0, 1);
    l.take(t0);
    // An admission of epoch 0 (before the reload) is sent: it counts, but it does not
    // stand for the pending admission of epoch 1.
    l.sent(9, Some(0), t0);
    assert_eq!(l.available(t0), 0);
    l.unsent(0);
    assert_eq!(l.available(t0), 0, "epoch 0 never took from this limit");
    l.unsent(1);
    assert_eq!(l.available(t0), 1);
}

#[test]
fn a_changed_kind_starts_fresh() {
    let t0 = Instant::now();
    let mut l = LimitState::new(&token_spec(1, Duration::from_secs(1), 1, 0), t0);
    go(&mut l, 0, t0);
    let spec = sliding_spec(3, 1000, 0);
    assert!(!l.same_kind(&spec));
    assert_eq!(l.carry(&spec, t0, 1).available(t0), 3);
    // The same GCRA underneath, but another kind as written: fresh too.
    let mut l = LimitState::new(&token_spec(1, Duration::from_secs(1), 1, 0), t0);
    go(&mut l, 0, t0);
    let leaky = written("kind = \"leaky_bucket\"\nrate = 1\nper = \"1s\"\nmargin = \"0s\"");
    assert!(!l.same_kind(&leaky));
    assert_eq!(l.carry(&leaky, t0, 1).available(t0), 1);
    // A fixed window from the first request and one on the clock are not the same kind.
    let l = LimitState::new(&fixed_spec(1, 1000, 0), t0);
    assert!(!l.same_kind(&written(
        "kind = \"fixed_window\"\npermits = 1\nwindow = \"1s\"\nalign = \"clock\""
    )));
}

/// A limit as written in the file, `kind` and keys one per line.
fn written(text: &str) -> Limit {
    toml::from_str(text).unwrap_or_else(|e| panic!("{e}\n{text}"))
}

/// A limit created when the Unix time is `unix_ms`.
fn at_unix(text: &str, t0: Instant, unix_ms: u64) -> LimitState {
    LimitState::on_clock(&written(text), t0, 0, ms(unix_ms))
}

/// A Unix time on a whole minute, in milliseconds.
const ROUND: u64 = 1_699_999_980_000;

#[test]
fn a_counter_on_the_clock_weighs_the_previous_window_by_what_is_left_of_it() {
    let t0 = Instant::now();
    let text = "kind = \"sliding_counter\"\npermits = 10\nwindow = \"1s\"\nalign = \"clock\"\n\
                margin = \"0s\"";
    // A window starts at t0.
    let mut l = at_unix(text, t0, ROUND);
    for i in 0..10 {
        go(&mut l, i, t0);
    }
    assert_eq!(l.available(t0 + ms(999)), 0, "the current window is full");
    // The next window: the previous one weighs all of it (the provider's clock may read
    // a millisecond early), then falls; rounded down, 10 x 0.999 leaves room for one.
    assert_eq!(l.available(t0 + ms(1000)), 0);
    assert_eq!(l.available(t0 + ms(1001)), 0);
    assert_eq!(
        l.ready_at(1, t0 + ms(1000)),
        Some(t0 + ms(1001) + Duration::from_nanos(1))
    );
    assert_eq!(l.available(t0 + ms(1501)), 5, "10 x 0.5 leaves 5");
    assert_eq!(
        l.ready_at(5, t0 + ms(1000)),
        Some(t0 + ms(1401) + Duration::from_nanos(1)),
        "10 x (1 - 0.4) + 4 < 10"
    );
    // Unrounded, the same estimate must leave a whole request: one less at 5.005.
    let mut u = at_unix(&format!("{text}\nrounding = \"none\""), t0, ROUND);
    for i in 0..10 {
        go(&mut u, i, t0);
    }
    let x = t0 + ms(1500) + Duration::from_micros(500);
    assert_eq!((l.available(x), u.available(x)), (5, 4));
    // Two windows later nothing counts.
    assert_eq!(l.available(t0 + ms(2000)), 10);
}

#[test]
fn a_counter_at_any_alignment_holds_a_burst_for_a_whole_window() {
    let t0 = Instant::now();
    let any = "kind = \"sliding_counter\"\npermits = 10\nwindow = \"1s\"\nmargin = \"0s\"";
    let mut l = at_unix(any, t0, ROUND);
    for i in 0..10 {
        go(&mut l, i, t0);
    }
    // Whatever the edges: had a window started just after the burst, the burst weighs
    // fully until that window is a millisecond old.
    let free = t0 + ms(1001) + Duration::from_nanos(1);
    assert_eq!(l.ready_at(1, t0), Some(free));
    assert!(!l.can_take(free - Duration::from_nanos(1)));
    assert!(l.can_take(free));
    // On the clock with an edge 500 ms after the burst, it frees half a window sooner.
    let clock = format!("{any}\nalign = \"clock\"");
    let mut c = at_unix(&clock, t0, ROUND + 500);
    for i in 0..10 {
        go(&mut c, i, t0);
    }
    assert_eq!(
        c.ready_at(1, t0),
        Some(t0 + ms(501) + Duration::from_nanos(1))
    );
    // Two windows after the burst (the longest any placement keeps it), all of it.
    assert_eq!(l.available(t0 + ms(2000)), 10);
}

#[test]
fn a_counter_counts_a_send_at_the_latest_its_margin_allows() {
    let t0 = Instant::now();
    let text = "kind = \"sliding_counter\"\npermits = 2\nwindow = \"1s\"\nalign = \"clock\"\n\
                margin = \"100ms\"";
    let mut l = at_unix(text, t0, ROUND + 850);
    // Sent 100 ms before the edge, unanswered: it may arrive after it, fully counted there.
    l.take(t0 + ms(50));
    l.sent(0, Some(0), t0 + ms(50));
    l.take(t0 + ms(60));
    l.sent(1, Some(0), t0 + ms(60));
    assert_eq!(l.available(t0 + ms(200)), 0);
    // Answered before the edge: they arrived in the window before, and weigh less there.
    l.answered(0, t0 + ms(70), Duration::ZERO);
    l.answered(1, t0 + ms(80), Duration::ZERO);
    assert_eq!(
        l.available(t0 + ms(151)),
        0,
        "a millisecond in, they weigh fully"
    );
    assert_eq!(l.available(t0 + ms(152)), 1, "2 x 0.999 rounds down to 1");
}

#[test]
fn a_fixed_window_on_the_clock_resets_at_its_edge() {
    let t0 = Instant::now();
    // Windows start 250 ms past each second; t0 is 100 ms past one: the edge is 150 ms on.
    let text = "kind = \"fixed_window\"\npermits = 2\nwindow = \"1s\"\nalign = \"clock\"\n\
                offset = \"250ms\"\nmargin = \"40ms\"";
    let mut l = at_unix(text, t0, ROUND + 100);
    go(&mut l, 0, t0);
    go(&mut l, 1, t0);
    assert!(!l.can_take(t0 + ms(149)));
    assert_eq!(l.ready_at(1, t0), Some(t0 + ms(150)));
    assert_eq!(
        l.ready_at(3, t0),
        Some(t0 + ms(1150)),
        "two more windows on"
    );
    go(&mut l, 2, t0 + ms(150));
    // Sent 10 ms before the next edge: within its margin it may land after it.
    l.take(t0 + ms(1140));
    l.sent(3, Some(0), t0 + ms(1140));
    assert_eq!(
        l.available(t0 + ms(1150)),
        1,
        "it counts in the next window too"
    );
    // Answered before the edge: it landed in the window that closed.
    l.answered(3, t0 + ms(1145), Duration::ZERO);
    assert_eq!(l.available(t0 + ms(1150)), 2);
    // Admitted but not sent: it holds a permit in every window from now on.
    l.take(t0 + ms(1150));
    assert_eq!(l.available(t0 + ms(9000)), 1);
}

#[test]
fn a_leaky_bucket_counts_as_nginx_does() {
    let t0 = Instant::now();
    let leaky = |rate: u32, per: &str, burst: u32| {
        written(&format!(
            "kind = \"leaky_bucket\"\nrate = {rate}\nper = \"{per}\"\nburst = {burst}\n\
             margin = \"0s\""
        ))
    };
    // rate=10r/s burst=5: six at once (nginx's excess reaches 5), then one every 100 ms.
    let mut l = LimitState::new(&leaky(10, "1s", 5), t0);
    assert_eq!(l.available(t0), 6);
    let got = drive(&mut l, t0, Duration::from_secs(1));
    assert_eq!(got.len(), 6 + 9);
    assert_eq!(got[6], t0 + ms(100));
    // rate=3r/s: nginx drains 3 thousandths a millisecond and counts whole ones, so it
    // takes 334 ms, not 333.3, to drain a request.
    let mut l = LimitState::new(&leaky(3, "1s", 0), t0);
    go(&mut l, 0, t0);
    assert_eq!(l.ready_at(1, t0), Some(t0 + ms(334)));
    // rate=100r/m: nginx keeps 1.666 a second (truncated), and each drain truncates too:
    // a request costs 1.001, 601 ms; the burst of 2 is 1200 ms of excess, two at once.
    let mut l = LimitState::new(&leaky(100, "1m", 2), t0);
    assert_eq!(l.available(t0), 2);
    go(&mut l, 0, t0);
    go(&mut l, 1, t0);
    assert_eq!(l.ready_at(1, t0), Some(t0 + ms(2)));
    assert_eq!(l.ready_at(2, t0), Some(t0 + ms(603)));
}

#[test]
fn published_paces_for_every_common_algorithm() {
    let t0 = Instant::now();
    let published = |permits: u32, window: &str| {
        written(&format!(
            "kind = \"published\"\npermits = {permits}\nwindow = \"{window}\"\nmargin = \"0s\""
        ))
    };
    let next = |spec: &Limit| {
        let mut l = LimitState::new(spec, t0);
        assert_eq!(l.available(t0), 1, "no burst");
        go(&mut l, 0, t0);
        l.ready_at(1, t0).unwrap() - t0
    };
    // Just over (1 s + 1 ms) / 10 apart: a counter reading whole milliseconds stays
    // under 10 at any alignment.
    assert_eq!(
        next(&published(10, "1s")),
        ms(100) + Duration::from_micros(100) + Duration::from_nanos(1)
    );
    // 1 s / 3 is 333.3 ms, which a bucket counting whole milliseconds reads as 333.
    assert_eq!(next(&published(3, "1s")), ms(334));
    assert_eq!(
        next(&published(1000, "1s")),
        Duration::from_micros(1001) + Duration::from_nanos(1)
    );
}

#[test]
fn margins_resolve_per_kind() {
    let t0 = Instant::now();
    let default = Limit::SlidingWindow {
        permits: nz(10),
        window: Duration::from_secs(1),
        margin: None,
        margin_max: None,
        scope: Default::default(),
        unit: Default::default(),
    };
    assert_eq!(LimitState::new(&default, t0).margin(), Some(ms(200)));
    let minute = Limit::FixedWindow {
        align: Default::default(),
        offset: None,
        permits: nz(300),
        window: Duration::from_secs(60),
        margin: None,
        margin_max: None,
        scope: Default::default(),
        unit: Default::default(),
    };
    assert_eq!(
        LimitState::new(&minute, t0).margin(),
        Some(ms(1000)),
        "capped"
    );
    let token = Limit::TokenBucket {
        rate: nz(10),
        per: Duration::from_secs(1),
        burst: nz(1),
        margin: Some(Margin::Fraction(100_000)),
        margin_max: None,
        scope: Default::default(),
        unit: Default::default(),
    };
    assert_eq!(
        LimitState::new(&token, t0).margin(),
        Some(ms(10)),
        "10% of 100 ms"
    );
    assert_eq!(LimitState::new(&conc_spec(1), t0).margin(), None);
}

#[test]
fn clock_edges_move_to_an_announced_reset_and_allow_for_its_seconds() {
    let t0 = Instant::now();
    let text = "kind = \"fixed_window\"\npermits = 2\nwindow = \"1m\"\nalign = \"clock\"\n\
                margin = \"0s\"";
    // sluice's clock puts an edge 40 s from t0; the provider's window ends 13 s from t0.
    let mut l = at_unix(text, t0, ROUND + 20_000);
    assert_eq!(l.clock_edges(t0), Some((ms(40_000), Duration::ZERO)));
    go(&mut l, 0, t0);
    go(&mut l, 1, t0);
    assert_eq!(l.ready_at(1, t0), Some(t0 + ms(40_000)));
    let slack = Duration::from_secs(2);
    assert!(l.realign(t0 + ms(13_000), slack));
    assert_eq!(l.clock_edges(t0), Some((ms(13_000), slack)));
    // Sends may land anywhere within the slack of an edge: the next window is free once
    // a send there cannot fall in the last one.
    assert_eq!(l.ready_at(1, t0), Some(t0 + ms(15_000)));
    assert_eq!(l.available(t0 + ms(13_500)), 0);
    assert_eq!(l.available(t0 + ms(15_000)), 2);
    // An announcement within the slack of the edges already kept moves nothing.
    assert!(!l.realign(t0 + ms(14_500), slack));
    assert!(!l.realign(t0 + ms(73_000), slack));
    // A counter on the clock moves too; one at any alignment has no edges to move.
    let counter = "kind = \"sliding_counter\"\npermits = 2\nwindow = \"1m\"\nalign = \"clock\"";
    let mut c = at_unix(counter, t0, ROUND);
    assert!(c.realign(t0 + ms(13_000), slack));
    assert_eq!(c.clock_edges(t0), Some((ms(13_000), slack)));
    let any = "kind = \"sliding_counter\"\npermits = 2\nwindow = \"1m\"";
    assert!(!at_unix(any, t0, ROUND).realign(t0 + ms(13_000), slack));
}

/// Weighted admissions (a request that costs `w` units) and their corrections, kind by
/// kind: the units taken, what a refund gives back and what a surcharge owes.
#[test]
fn costs_are_taken_whole_and_corrected_where_they_were_counted() {
    let t0 = Instant::now();
    // A token bucket of 10 a second, burst 10: 8 taken and sent leave 2.
    let mut l = LimitState::new(&token_spec(10, ms(1000), 10, 0), t0);
    assert!(l.can_take_n(8, t0) && !l.can_take_n(11, t0));
    l.take_n(8, t0);
    assert!(!l.can_take_n(3, t0));
    l.sent_n(1, 8, Some(0), t0);
    assert_eq!(l.available(t0), 2);
    // It cost 3: 5 come back at once.
    l.reweigh(1, 8, 3, 0, t0);
    assert_eq!(l.available(t0), 7);
    // It cost 17: the bucket owes 7, and admits nothing until time has paid them.
    l.reweigh(1, 3, 17, 0, t0);
    assert_eq!(l.available(t0), 0);
    assert_eq!(l.ready_at(1, t0), Some(t0 + ms(800)));
    // A refund never fills the bucket beyond full.
    let mut l = LimitState::new(&token_spec(10, ms(1000), 10, 0), t0);
    l.take_n(2, t0);
    l.sent_n(1, 2, Some(0), t0);
    l.reweigh(1, 2, 0, 0, t0 + ms(500));
    assert_eq!(l.available(t0 + ms(500)), 10);

    // A sliding log: the entry shrinks or grows in place, and frees a window after it.
    let mut l = LimitState::new(&sliding_spec(10, 1000, 0), t0);
    l.take_n(6, t0);
    l.sent_n(1, 6, Some(0), t0);
    l.take_n(1, t0);
    l.sent_n(2, 1, Some(0), t0 + ms(100));
    assert_eq!(l.available(t0 + ms(100)), 3);
    l.reweigh(1, 6, 2, 0, t0 + ms(200));
    assert_eq!(l.available(t0 + ms(200)), 7);
    l.reweigh(1, 2, 9, 0, t0 + ms(200));
    assert_eq!(l.available(t0 + ms(200)), 0);
    // The 3 units a new request needs: from the first entry's end on.
    assert_eq!(l.ready_at(3, t0 + ms(200)), Some(t0 + ms(1000)));
    assert_eq!(
        l.available(t0 + ms(1000)),
        9,
        "the entry of 9 freed with its window"
    );

    // A fixed window from the first request: more is charged to the open window; a
    // refund comes back for the send that opened it, not for one it cannot place.
    let mut l = LimitState::new(&fixed_spec(10, 1000, 0), t0);
    l.take_n(4, t0);
    l.sent_n(1, 4, Some(0), t0);
    l.take_n(4, t0);
    l.sent_n(2, 4, Some(0), t0 + ms(10));
    assert_eq!(l.available(t0 + ms(10)), 2);
    l.reweigh(2, 4, 1, 0, t0 + ms(20));
    assert_eq!(
        l.available(t0 + ms(20)),
        2,
        "not the anchor: the estimate stands"
    );
    l.reweigh(1, 4, 1, 0, t0 + ms(20));
    assert_eq!(l.available(t0 + ms(20)), 5, "the anchor's refund");
    l.reweigh(2, 4, 9, 0, t0 + ms(20));
    assert_eq!(l.available(t0 + ms(20)), 0);
    assert_eq!(
        l.available(t0 + ms(1000)),
        10,
        "the next window starts afresh"
    );

    // A correction for a limit made after the admission (a reload) does nothing.
    let mut l = LimitState::new_in(&sliding_spec(10, 1000, 0), t0, 3);
    l.take_n(4, t0);
    l.sent_n(1, 4, Some(3), t0);
    l.reweigh(1, 4, 1, 2, t0);
    assert_eq!(l.available(t0), 6);
    // Concurrency counts requests, whatever they cost elsewhere.
    let mut c = LimitState::new(&conc_spec(2), t0);
    assert!(c.can_take_n(1, t0));
    c.take_n(1, t0);
    c.release(1, 0);
    assert_eq!(c.available(t0), 2);
}
