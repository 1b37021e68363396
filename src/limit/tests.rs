//! The async limiter under paused tokio time: admission instants are exact, and every
//! way a waiter can leave is checked for leaked permits.

use std::sync::Arc;
use std::time::Duration;

use prometheus::Registry;
use tokio::time::Instant;

use super::*;
use crate::config::Config;
use crate::metrics::Metrics;
use crate::route::Route;
use serde_json::json;

fn limiter(limits_toml: &str) -> (Arc<Limiter>, Metrics) {
    let text = format!("[[upstream]]\nname = \"u\"\nhosts = [\"u.example\"]\n{limits_toml}");
    let config = Config::parse(&text, "t.toml").unwrap_or_else(|e| panic!("{e}"));
    let metrics = Metrics::new(Registry::new()).unwrap();
    (Arc::new(Limiter::new(&config, &metrics)), metrics)
}

/// The limiter as a request of the live config sees it.
impl Limiter {
    /// Admitted, then sent and answered at once: the provider counted it on admission.
    async fn take(&self, r: &Route) -> Result<Option<Permit>, LimitError> {
        self.go(&self.plans()[r.upstream], r).await
    }

    /// As `take`, for a request routed with `plan`.
    async fn go(&self, plan: &Arc<Plan>, r: &Route) -> Result<Option<Permit>, LimitError> {
        let mut permit = self.acquire(plan, r).await?;
        if let Some(p) = permit.as_mut() {
            sent_and_answered(p);
        }
        Ok(permit)
    }

    fn hold(&self, r: &Route, family: bool, until: Instant) {
        self.pause(&self.plans()[r.upstream], r, family, until)
    }
}

fn sent_and_answered(p: &mut Permit) {
    if let Some(hook) = p.send_hook() {
        hook.fire();
    }
    p.answered(200, Instant::now());
}

fn route(family: Option<usize>) -> Route {
    Route {
        upstream: 0,
        family,
        partition: None,
        tenant: None,
    }
}

/// Starts `n` acquirers in order and returns the instant each was admitted, holding
/// each permit for `hold`.
async fn admissions(l: &Arc<Limiter>, r: Route, n: usize, hold: Duration) -> Vec<Duration> {
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..n {
        let l = l.clone();
        tasks.push(tokio::spawn(async move {
            let p = l.take(&r).await.unwrap();
            let at = Instant::now() - t0;
            tokio::time::sleep(hold).await;
            drop(p);
            at
        }));
        // Let it queue before the next one arrives, so arrival order is defined.
        tokio::task::yield_now().await;
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

fn secs(v: &[Duration]) -> Vec<f64> {
    v.iter()
        .map(|d| (d.as_secs_f64() * 1000.0).round() / 1000.0)
        .collect()
}

#[tokio::test(start_paused = true)]
async fn sliding_window_shapes_a_burst() {
    let (l, m) =
        limiter("limits = [{ kind = \"sliding_window\", permits = 3, window = \"1s\" }]\n");
    let got = admissions(&l, route(None), 9, Duration::from_secs(5)).await;
    assert_eq!(secs(&got), [0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0]);
    let wait = m.queue_wait.with_label_values(&["u", "-"]);
    assert_eq!(wait.get_sample_count(), 9);
    assert!(
        (wait.get_sample_sum() - 9.0).abs() < 0.01,
        "3×0 + 3×1 + 3×2 s"
    );
    assert_eq!(m.queue_depth.with_label_values(&["u", "-"]).get(), 0);
}

#[tokio::test(start_paused = true)]
async fn concurrency_permit_is_held_until_dropped() {
    let (l, _) = limiter("limits = [{ kind = \"concurrency\", max = 2 }]\n");
    let got = admissions(&l, route(None), 6, Duration::from_millis(300)).await;
    assert_eq!(secs(&got), [0.0, 0.0, 0.3, 0.3, 0.6, 0.6]);
}

#[tokio::test(start_paused = true)]
async fn fixed_window_and_token_bucket_together() {
    let (l, _) = limiter(
        "limits = [{ kind = \"fixed_window\", permits = 4, window = \"10s\" }]\n\
         [[upstream.family]]\nname = \"f\"\nlimits = [{ kind = \"token_bucket\", rate = 2, per = \"1s\", burst = 2 }]\n",
    );
    let got = admissions(&l, route(Some(0)), 6, Duration::ZERO).await;
    // Token bucket: 2 at once, then one per 500 ms; the fixed window caps 4 per 10 s from
    // the first admission.
    assert_eq!(secs(&got), [0.0, 0.0, 0.5, 1.0, 10.0, 10.0]);
}

#[tokio::test(start_paused = true)]
async fn a_waiter_that_leaves_takes_nothing_and_the_queue_moves_on() {
    let (l, m) =
        limiter("limits = [{ kind = \"sliding_window\", permits = 1, window = \"1s\" }]\n");
    let first = l.take(&route(None)).await.unwrap();
    drop(first);
    let leaver = {
        let l = l.clone();
        tokio::spawn(async move { l.take(&route(None)).await.map(|_| ()) })
    };
    tokio::task::yield_now().await;
    let stayer = {
        let l = l.clone();
        tokio::spawn(async move {
            l.take(&route(None)).await.unwrap();
            Instant::now()
        })
    };
    tokio::task::yield_now().await;
    assert_eq!(m.queue_depth.with_label_values(&["u", "-"]).get(), 2);
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_millis(500)).await;
    leaver.abort();
    assert!(leaver.await.unwrap_err().is_cancelled());
    assert_eq!(m.queue_depth.with_label_values(&["u", "-"]).get(), 1);
    let at = stayer.await.unwrap();
    assert_eq!(
        at - t0,
        Duration::from_secs(1),
        "the next in line gets the permit the leaver would have had"
    );
    assert_eq!(m.queue_depth.with_label_values(&["u", "-"]).get(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_grant_that_is_never_received_is_given_back() {
    use std::future::Future;
    use std::task::{Context, Poll};

    let (l, _) = limiter(
        "limits = [{ kind = \"concurrency\", max = 1 }, { kind = \"sliding_window\", permits = 5, window = \"1m\" }]\n",
    );
    let held = l.take(&route(None)).await.unwrap();
    let r = route(None);
    let mut waiting = Box::pin(l.take(&r));
    let waker = std::task::Waker::noop();
    assert!(matches!(
        waiting.as_mut().poll(&mut Context::from_waker(waker)),
        Poll::Pending
    ));
    // Releasing admits the waiter and sends its grant; the waiter is dropped before it
    // ever looks at it.
    drop(held);
    drop(waiting);
    let cell = l.cell(&l.plans()[0], &route(None)).unwrap();
    let mut st = cell.lock();
    let now = Instant::now();
    assert_eq!(
        st.bucket.upstream[0].available(now),
        1,
        "concurrency permit back"
    );
    assert_eq!(
        st.bucket.upstream[1].available(now),
        4,
        "only the first request counted in the window"
    );
}

#[tokio::test(start_paused = true)]
async fn queue_bounds_answer_at_once() {
    let (l, m) = limiter(
        "max_queue = 2\nmax_wait = \"3s\"\nlimits = [{ kind = \"sliding_window\", permits = 1, window = \"1s\" }]\n",
    );
    let _p = l.take(&route(None)).await.unwrap();
    let mut queued = Vec::new();
    for _ in 0..2 {
        let l = l.clone();
        queued.push(tokio::spawn(async move {
            l.take(&route(None)).await.map(|_| ())
        }));
        tokio::task::yield_now().await;
    }
    // Positions would wait 1 s, 2 s; a third would wait 3 s, but the queue holds 2.
    let t0 = Instant::now();
    let full = l.take(&route(None)).await.err();
    assert_eq!(
        full,
        Some(LimitError::QueueFull {
            retry_after: Duration::from_secs(3)
        })
    );
    assert_eq!(Instant::now(), t0, "answered at once");
    assert_eq!(
        m.rejections
            .with_label_values(&["u", "-", "queue_full"])
            .get(),
        1
    );
    for q in queued {
        q.await.unwrap().unwrap();
    }
}

#[tokio::test(start_paused = true)]
async fn an_unknowable_wait_ends_at_max_wait() {
    let (l, m) = limiter("max_wait = \"2s\"\nlimits = [{ kind = \"concurrency\", max = 1 }]\n");
    let held = l.take(&route(None)).await.unwrap();
    let t0 = Instant::now();
    let r = l.take(&route(None)).await;
    assert!(matches!(r, Err(LimitError::QueueTimeout { .. })), "{r:?}");
    assert_eq!(Instant::now() - t0, Duration::from_secs(2));
    assert_eq!(
        m.rejections
            .with_label_values(&["u", "-", "queue_timeout"])
            .get(),
        1
    );
    assert_eq!(m.queue_depth.with_label_values(&["u", "-"]).get(), 0);
    drop(held);
    assert!(
        l.take(&route(None)).await.is_ok(),
        "the timed-out waiter took nothing"
    );
}

#[tokio::test(start_paused = true)]
async fn a_known_wait_beyond_max_wait_is_refused_at_once() {
    let (l, _) = limiter(
        "max_wait = \"1500ms\"\nlimits = [{ kind = \"fixed_window\", permits = 1, window = \"1m\" }]\n",
    );
    let _p = l.take(&route(None)).await.unwrap();
    let t0 = Instant::now();
    let r = l.take(&route(None)).await;
    assert_eq!(
        r.err(),
        Some(LimitError::QueueTimeout {
            retry_after: Duration::from_secs(60)
        })
    );
    assert_eq!(Instant::now(), t0);
}

#[tokio::test(start_paused = true)]
async fn a_client_deadline_shortens_max_wait_and_never_lengthens_it() {
    let (l, _) = limiter(
        "max_wait = \"5s\"\nlimits = [{ kind = \"sliding_window\", permits = 1, window = \"3s\" }]\n",
    );
    let plan = l.plans()[0].clone();
    let _p = l.take(&route(None)).await.unwrap();
    let t0 = Instant::now();
    // The next permit is 3 s away: a client that waits 2 s at most is refused at once...
    let r = l
        .acquire_by(&plan, &route(None), Some(t0 + Duration::from_secs(2)))
        .await;
    assert!(matches!(r, Err(LimitError::QueueTimeout { .. })), "{r:?}");
    assert_eq!(Instant::now(), t0);
    // ...one that waits 4 s is admitted when the permit comes back...
    let p = l
        .acquire_by(&plan, &route(None), Some(t0 + Duration::from_secs(4)))
        .await;
    assert!(p.is_ok());
    assert_eq!(Instant::now() - t0, Duration::from_secs(3));
    drop(p);
    // ...and one that would wait an hour still waits no longer than max_wait (5 s) when
    // the wait cannot be known.
    let (l, _) = limiter("max_wait = \"5s\"\nlimits = [{ kind = \"concurrency\", max = 1 }]\n");
    let plan = l.plans()[0].clone();
    let _held = l.take(&route(None)).await.unwrap();
    let t1 = Instant::now();
    let r = l
        .acquire_by(&plan, &route(None), Some(t1 + Duration::from_secs(3600)))
        .await;
    assert!(matches!(r, Err(LimitError::QueueTimeout { .. })), "{r:?}");
    assert_eq!(Instant::now() - t1, Duration::from_secs(5));
    let r = l
        .acquire_by(
            &plan,
            &route(None),
            Some(Instant::now() + Duration::from_millis(700)),
        )
        .await;
    assert!(matches!(r, Err(LimitError::QueueTimeout { .. })), "{r:?}");
    assert_eq!(Instant::now() - t1, Duration::from_millis(5700));
}

#[tokio::test(start_paused = true)]
async fn an_announced_budget_below_ours_paces_the_queue_until_the_reset() {
    use crate::policy::announced::Announced;
    let (l, _) =
        limiter("limits = [{ kind = \"sliding_window\", permits = 100, window = \"1m\" }]\n");
    let first = l.take(&route(None)).await.unwrap().unwrap();
    let said = |remaining, secs| Announced {
        remaining,
        reset: Duration::from_secs(secs),
        source: "ratelimit",
        unit: "requests",
    };
    // 99 left by our count and 200 by the provider's: nothing to learn.
    first.learn(said(200, 60));
    assert_eq!(l.learned_paces().len(), 0);
    // 3 left by the provider's, over 6 s: one every 2 s, then the provider's new window.
    first.learn(said(3, 6));
    assert_eq!(l.learned_paces()[&Arc::from("u")], (0.5, 1));
    let got = admissions(&l, route(None), 6, Duration::ZERO).await;
    assert_eq!(secs(&got), [0.0, 2.0, 4.0, 6.0, 6.0, 6.0]);
    assert_eq!(l.learned_paces().len(), 0);
    // A partition pacing is not swept while the pace lasts.
    first.learn(said(0, 5));
    drop(first);
    assert_eq!(l.sweep(), 1);
    tokio::time::sleep(Duration::from_secs(61)).await;
    assert_eq!(l.sweep(), 0);
}

#[tokio::test(start_paused = true)]
async fn an_unannounced_429_spaces_an_adaptive_familys_admissions() {
    let (l, _) = limiter(
        "adaptive = { decrease = 0.5, increase = 0.5, successes = 2 }\n\
         limits = [{ kind = \"token_bucket\", rate = 4, per = \"1s\", burst = 100 }]\n",
    );
    let first = l.take(&route(None)).await.unwrap().unwrap();
    let feedback = first.feedback().expect("the family adapts");
    drop(first);
    // 4 per second, halved: one every 500 ms instead of the burst of 100.
    feedback.report(true);
    let got = admissions(&l, route(None), 4, Duration::ZERO).await;
    assert_eq!(secs(&got), [0.0, 0.5, 1.0, 1.5]);
    // Two successes add half the configured rate back: the burst is allowed again.
    for _ in 0..2 {
        let p = l.take(&route(None)).await.unwrap().unwrap();
        p.feedback().unwrap().report(false);
    }
    let got = admissions(&l, route(None), 4, Duration::ZERO).await;
    assert_eq!(secs(&got), [0.0, 0.0, 0.0, 0.0]);
}

#[tokio::test(start_paused = true)]
async fn tenants_take_turns_so_a_bulk_backlog_does_not_hold_one_request() {
    let (l, _) = limiter(
        "max_wait = \"5s\"\nlimits = [{ kind = \"token_bucket\", rate = 10, per = \"1s\", burst = 1 }]\n\
         [[upstream.family]]\nname = \"f\"\ntenant = \"header:x-tenant\"\n",
    );
    let tenant = |t| Route {
        upstream: 0,
        family: Some(0),
        partition: None,
        tenant: Some(t),
    };
    let t0 = Instant::now();
    let mut bulk = Vec::new();
    for _ in 0..40 {
        let l = l.clone();
        bulk.push(tokio::spawn(async move {
            l.take(&tenant(1)).await.map(|_| Instant::now() - t0)
        }));
        tokio::task::yield_now().await;
    }
    // 40 ahead at 10/s: FIFO, this request would wait about 4 s; in turns, one.
    let ui = l.take(&tenant(2)).await;
    assert!(ui.is_ok());
    assert_eq!(Instant::now() - t0, Duration::from_millis(200));
    let admitted: Vec<_> = futures_join(bulk).await;
    // The bulk tenant's own order is kept; past max_wait (5 s) none is admitted late.
    let ok: Vec<Duration> = admitted
        .iter()
        .filter_map(|r| r.as_ref().ok().copied())
        .collect();
    assert!(ok.windows(2).all(|w| w[0] <= w[1]), "{ok:?}");
    assert_eq!(ok.len(), 40, "{admitted:?}");
    // Arriving behind a backlog that max_wait could not cover, a new tenant is still
    // admitted on its turn, where FIFO would refuse it at once.
    let mut bulk = Vec::new();
    for _ in 0..80 {
        let l = l.clone();
        bulk.push(tokio::spawn(
            async move { l.take(&tenant(1)).await.is_ok() },
        ));
        tokio::task::yield_now().await;
    }
    assert!(l.take(&tenant(3)).await.is_ok());
    let refused = futures_join(bulk).await.iter().filter(|ok| !**ok).count();
    assert!(
        refused >= 25,
        "the bulk tenant's own backlog is bounded by max_wait: {refused}"
    );
}

async fn futures_join<T>(tasks: Vec<tokio::task::JoinHandle<T>>) -> Vec<T> {
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

#[tokio::test(start_paused = true)]
async fn pause_stops_admission_until_the_instant() {
    let (l, _) =
        limiter("limits = [{ kind = \"token_bucket\", rate = 10, per = \"1s\", burst = 2 }]\n");
    let t0 = Instant::now();
    l.hold(&route(None), false, t0 + Duration::from_secs(3));
    let got = admissions(&l, route(None), 4, Duration::ZERO).await;
    assert_eq!(secs(&got), [3.0, 3.0, 3.1, 3.2], "the burst, then the rate");
}

#[tokio::test(start_paused = true)]
async fn idle_partitions_are_dropped() {
    let (l, _) = limiter(
        "key = \"header:Authorization\"\nlimits = [{ kind = \"sliding_window\", permits = 5, window = \"10s\" }]\n",
    );
    for i in 0..10_000u32 {
        let r = Route {
            upstream: 0,
            family: None,
            partition: Some(crate::route::Partition::of(&i.to_be_bytes())),
            tenant: None,
        };
        drop(l.take(&r).await.unwrap());
    }
    assert_eq!(l.partitions(), 10_000);
    assert_eq!(l.sweep(), 10_000, "still counting their windows");
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(l.sweep(), 0, "full again and unused: gone");
}

fn keyed(i: u32, family: Option<usize>) -> Route {
    Route {
        upstream: 0,
        family,
        partition: Some(crate::route::Partition::of(&i.to_be_bytes())),
        tenant: None,
    }
}

#[tokio::test(start_paused = true)]
async fn new_keys_beyond_max_partitions_are_refused_until_one_is_dropped() {
    let (l, m) = limiter(
        "key = \"header:Authorization\"\nmax_partitions = 3\n\
         limits = [{ kind = \"fixed_window\", permits = 5, window = \"10s\" }]\n",
    );
    for i in 0..3 {
        drop(l.take(&keyed(i, None)).await.unwrap());
    }
    let t0 = Instant::now();
    assert_eq!(
        l.take(&keyed(3, None)).await.err(),
        Some(LimitError::PartitionLimit {
            retry_after: SWEEP_EVERY
        })
    );
    assert_eq!(Instant::now(), t0, "answered at once");
    assert_eq!(
        m.rejections
            .with_label_values(&["u", "-", "partition_limit"])
            .get(),
        1
    );
    // Keys that have a partition go on; so do requests without the header.
    drop(l.take(&keyed(0, None)).await.unwrap());
    drop(l.take(&route(None)).await.unwrap());
    assert_eq!(l.partitions(), 4);
    // Their windows end, the sweep drops them, and new keys get partitions again.
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(l.sweep(), 0);
    for i in 3..6 {
        drop(l.take(&keyed(i, None)).await.unwrap());
    }
    assert!(l.take(&keyed(6, None)).await.is_err());
}

/// Past `FRESH_UP_TO` partitions, `/buckets` and the status page show the busiest of
/// each upstream as the last sweep found them, and say how many they leave out.
#[tokio::test(start_paused = true)]
async fn the_views_of_many_partitions_are_bounded_and_show_the_busiest() {
    let (l, _) = limiter(
        "key = \"header:Authorization\"\n\
         limits = [{ kind = \"concurrency\", max = 1 }]\n",
    );
    let n = registry::FRESH_UP_TO as u32 + 500;
    let mut held = Vec::new();
    for i in 0..n {
        held.push(l.take(&keyed(i, None)).await.unwrap());
    }
    // Partition 7 has two requests waiting, partition 9 one.
    let mut waiting = Vec::new();
    for i in [7, 7, 9] {
        let l = l.clone();
        waiting.push(tokio::spawn(async move {
            l.take(&keyed(i, None)).await.map(|_| ())
        }));
        tokio::task::yield_now().await;
    }
    assert_eq!(l.sweep(), n as usize);
    let (v, omitted) = l.snapshot();
    let shown: std::collections::HashSet<&str> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["partition"].as_str().unwrap())
        .collect();
    assert_eq!(shown.len(), registry::KEPT);
    assert_eq!(omitted, n as usize - registry::KEPT);
    let busiest = l.busiest(2);
    let (shown, others) = &busiest[&Arc::from("u")];
    assert_eq!(*others, n as usize - 2);
    let depth = |p: &serde_json::Value| p[0]["queue_depth"].as_u64().unwrap();
    assert_eq!(depth(&shown[0]), 2, "{shown:?}");
    assert_eq!(depth(&shown[1]), 1, "{shown:?}");
    assert_eq!(
        shown[0][0]["partition"],
        keyed(7, None).partition.unwrap().short()
    );
    drop(held);
    for w in waiting {
        w.await.unwrap().unwrap();
    }
}

#[tokio::test(start_paused = true)]
async fn snapshot_lists_buckets_without_raw_keys() {
    let (l, _) = limiter(
        "key = \"header:Authorization\"\nlimits = [{ kind = \"sliding_window\", permits = 5, window = \"10s\" }]\n\
         [[upstream.family]]\nname = \"f\"\nlimits = [{ kind = \"concurrency\", max = 3 }]\n",
    );
    let p = crate::route::Partition::of(b"Bearer secret");
    let _permit = l
        .take(&Route {
            upstream: 0,
            family: Some(0),
            partition: Some(p),
            tenant: None,
        })
        .await
        .unwrap();
    l.hold(
        &Route {
            upstream: 0,
            family: Some(0),
            partition: Some(p),
            tenant: None,
        },
        true,
        Instant::now() + Duration::from_secs(4),
    );
    let v = l.snapshot().0;
    let text = v.to_string();
    assert!(!text.contains("secret"));
    let arr = v.as_array().unwrap();
    assert_eq!(arr.len(), 2, "{v}");
    assert_eq!(arr[0]["partition"], p.short());
    assert_eq!(arr[0]["limits"][0]["available"], 4);
    assert_eq!(
        arr[0]["limits"][0]["margin"], "1s",
        "a fifth of 10 s, capped at 1 s"
    );
    assert_eq!(arr[0]["limits"][0]["unsent"], 0);
    assert_eq!(arr[1]["family"], "f");
    assert_eq!(arr[1]["limits"][0]["available"], 2);
    assert_eq!(arr[1]["paused_for_seconds"], 4.0);
}

#[tokio::test(start_paused = true)]
async fn a_panicking_handler_gives_its_permit_back() {
    let (l, _) = limiter("limits = [{ kind = \"concurrency\", max = 1 }]\n");
    let task = {
        let l = l.clone();
        tokio::spawn(async move {
            let _permit = l.take(&route(None)).await.unwrap();
            panic!("handler bug");
        })
    };
    assert!(task.await.unwrap_err().is_panic());
    let t0 = Instant::now();
    let again = l.take(&route(None)).await.unwrap();
    assert_eq!(
        Instant::now(),
        t0,
        "admitted at once: the permit came back during unwinding"
    );
    drop(again);
}

fn config(limits_toml: &str) -> Config {
    let text = format!(
        "[[upstream]]\nname = \"u\"\nhosts = [\"u.example\"]\nmax_queue = 1000\nmax_wait = \"1h\"\n{limits_toml}"
    );
    Config::parse(&text, "t.toml").unwrap_or_else(|e| panic!("{e}"))
}

fn window(permits: u32) -> String {
    format!("limits = [{{ kind = \"sliding_window\", permits = {permits}, window = \"1s\" }}]\n")
}

/// 200 requests queue on 10/s; the limit is raised to 40 and then lowered to 5 while they
/// wait. Every one is admitted, in arrival order, at exactly the instants the limits in
/// force allow, counting what the earlier limit had already let through.
#[tokio::test(start_paused = true)]
async fn limits_raised_and_lowered_under_200_queued_keep_order_and_lose_none() {
    let metrics = Metrics::new(Registry::new()).unwrap();
    let l = Arc::new(Limiter::new(&config(&window(10)), &metrics));
    let first_plan = l.plans()[0].clone();
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..200 {
        let (l, plan) = (l.clone(), first_plan.clone());
        tasks.push(tokio::spawn(async move {
            // Every request was routed by the first config: the reloads find them by name.
            let p = l.go(&plan, &route(None)).await.unwrap();
            (i, Instant::now() - t0, p)
        }));
        tokio::task::yield_now().await;
    }
    tokio::time::sleep(Duration::from_millis(2500)).await;
    l.reload(crate::limit::plans(&config(&window(40)), &metrics));
    tokio::time::sleep(Duration::from_millis(1700)).await;
    l.reload(crate::limit::plans(&config(&window(5)), &metrics));
    let mut got = Vec::new();
    for t in tasks {
        let (i, at, _permit) = t.await.unwrap();
        got.push((i, at));
    }
    assert!(
        got.windows(2).all(|w| w[0].1 <= w[1].1),
        "admitted in arrival order"
    );
    let mut per_instant = std::collections::BTreeMap::<u64, usize>::new();
    for (_, at) in &got {
        *per_instant.entry(at.as_millis() as u64).or_default() += 1;
    }
    let mut expected: Vec<(u64, usize)> = vec![
        (0, 10),
        (1000, 10),
        (2000, 10),
        // Raised to 40 with 10 taken in the window: 30 more at once.
        (2500, 30),
        (3000, 10),
        (3500, 30),
        (4000, 10),
    ];
    // Lowered to 5 at 4.2 s with 40 in the window: none until it has emptied, at 5 s.
    expected.extend((0..18).map(|s| (5000 + s * 1000, 5)));
    assert_eq!(per_instant.into_iter().collect::<Vec<_>>(), expected);
    assert_eq!(metrics.queue_depth.with_label_values(&["u", "-"]).get(), 0);
}

/// A family removed by a reload: its queue is served under its old limits, new requests
/// routed by the new config wait with the requests of no family.
#[tokio::test(start_paused = true)]
async fn a_removed_family_finishes_its_queue_under_the_old_limits() {
    let metrics = Metrics::new(Registry::new()).unwrap();
    let fam = "[[upstream.family]]\nname = \"slow\"\npaths = [\"/slow\"]\nlimits = [{ kind = \"sliding_window\", permits = 1, window = \"1s\" }]\n";
    let l = Arc::new(Limiter::new(&config(fam), &metrics));
    let old = l.plans()[0].clone();
    let mut tasks = Vec::new();
    for _ in 0..3 {
        let (l, plan) = (l.clone(), old.clone());
        tasks.push(tokio::spawn(async move {
            let t0 = Instant::now();
            l.go(&plan, &route(Some(0))).await.unwrap();
            Instant::now() - t0
        }));
        tokio::task::yield_now().await;
    }
    l.reload(crate::limit::plans(&config(""), &metrics));
    let snapshot = l.snapshot().0.to_string();
    assert!(snapshot.contains("\"retired\":true"), "{snapshot}");
    let new = l.plans()[0].clone();
    let t0 = Instant::now();
    drop(l.go(&new, &route(None)).await.unwrap());
    assert_eq!(Instant::now(), t0, "the new config's requests do not wait");
    let mut waits = Vec::new();
    for t in tasks {
        waits.push(t.await.unwrap());
    }
    assert_eq!(secs(&waits), [0.0, 1.0, 2.0]);
    assert_eq!(
        metrics.queue_depth.with_label_values(&["u", "slow"]).get(),
        0
    );
}

/// A request routed by the new config can reach a partition before the reload's sweep
/// over all partitions does: it moves the partition to the new limits itself.
#[tokio::test(start_paused = true)]
async fn a_request_of_the_new_config_moves_a_partition_the_reload_has_not_reached() {
    let metrics = Metrics::new(Registry::new()).unwrap();
    let l = Arc::new(Limiter::new(&config(&window(1)), &metrics));
    let old = l.plans()[0].clone();
    drop(l.go(&old, &route(None)).await.unwrap());
    // The new config's plans, not yet handed to the limiter.
    let new = crate::limit::plans(&config(&window(3)), &metrics)[0].clone();
    let t0 = Instant::now();
    drop(l.go(&new, &route(None)).await.unwrap());
    drop(l.go(&new, &route(None)).await.unwrap());
    assert_eq!(
        Instant::now(),
        t0,
        "two more fit at once under 3 per second"
    );
    // A request still holding the old plan does not move it back.
    let r = route(None);
    let late = l.go(&old, &r);
    tokio::pin!(late);
    assert!(
        futures_util::poll!(&mut late).is_pending(),
        "the window is full under the new limit"
    );
    late.await.unwrap();
    assert_eq!(Instant::now(), t0 + Duration::from_secs(1));
}

/// A request admitted the instant a rate limit allowed it, then refused by the provider:
/// the provider's window ends later than sluice believed. Counted; with `margin_max` the
/// limit's margin grows to cover the slowest answer seen beyond it.
#[tokio::test(start_paused = true)]
async fn a_429_at_a_limit_edge_is_counted_and_grows_the_margin_up_to_its_max() {
    let (l, m) = limiter(
        "limits = [{ kind = \"sliding_window\", permits = 1, window = \"1s\", margin = \"0s\", margin_max = \"300ms\" }]\n",
    );
    let edge = m.edge_429.with_label_values(&["u", "-"]);
    let plan = l.plans()[0].clone();
    let t0 = Instant::now();
    let mut first = l.acquire(&plan, &route(None)).await.unwrap().unwrap();
    first.send_hook().unwrap().fire();
    // Answered 150 ms after its send: slower than the margin of 0.
    tokio::time::sleep(Duration::from_millis(150)).await;
    first.answered(200, Instant::now());
    drop(first);
    let mut second = l.acquire(&plan, &route(None)).await.unwrap().unwrap();
    // With no margin the permit came back a window after the send, whatever the answer.
    assert_eq!(Instant::now() - t0, Duration::from_secs(1), "at the edge");
    second.send_hook().unwrap().fire();
    tokio::time::sleep(Duration::from_millis(5)).await;
    second.answered(429, Instant::now());
    assert_eq!(edge.get(), 1);
    let v = l.snapshot().0;
    assert_eq!(v[0]["limits"][0]["margin"], "150ms", "{v}");

    // Refused without having waited: not an edge, nothing grows.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut third = l.acquire(&plan, &route(None)).await.unwrap().unwrap();
    third.send_hook().unwrap().fire();
    third.answered(429, Instant::now());
    assert_eq!(edge.get(), 1);
}

/// Without `margin_max` an edge 429 is counted and the margin stays as written.
#[tokio::test(start_paused = true)]
async fn without_margin_max_the_margin_never_grows() {
    let (l, m) = limiter(
        "limits = [{ kind = \"fixed_window\", permits = 1, window = \"1s\", margin = \"10ms\" }]\n",
    );
    let _ = l.take(&route(None)).await.unwrap();
    let plan = l.plans()[0].clone();
    let mut p = l.acquire(&plan, &route(None)).await.unwrap().unwrap();
    p.send_hook().unwrap().fire();
    p.answered(429, Instant::now());
    assert_eq!(m.edge_429.with_label_values(&["u", "-"]).get(), 1);
    assert_eq!(l.snapshot().0[0]["limits"][0]["margin"], "10ms");
}

/// A store counted where the provider counts: every replica's shared limits in one place,
/// each kept by the limit kinds themselves at the instants the replicas report. A model
/// of what any store must do for the limiter (envoy's ratelimit keeps its algorithms
/// apart from its cache the same way), not of Redis: `cluster` has its own tests.
#[derive(Default)]
struct Memory {
    /// Each shared limit's count, with the parameters it counts by now: a changed limit
    /// (a reload) carries its count over to its new parameters, as the store on Redis
    /// applies each call's parameters to the state it holds.
    limits: parking_lot::Mutex<
        std::collections::HashMap<Arc<str>, (crate::config::Limit, super::kinds::LimitState)>,
    >,
    /// One admission at a time per family and replica, as the trait promises FIFO.
    gates: parking_lot::Mutex<std::collections::HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    next: std::sync::atomic::AtomicU64,
    /// Every send, as the provider would see it arrive.
    sends: parking_lot::Mutex<Vec<(Instant, usize)>>,
}

/// One replica's handle on the shared [`Memory`].
struct Replica(Arc<Memory>, usize);

struct MemoryPartition {
    store: Arc<Memory>,
    replica: usize,
}

struct MemoryReservation {
    store: Arc<Memory>,
    id: super::kinds::Id,
    /// Each limit paid, with its unit.
    ids: Vec<(Arc<str>, u8)>,
    costs: parking_lot::Mutex<super::costs::Costs>,
    replica: usize,
}

impl shared::Store for Replica {
    fn partition(
        self: Arc<Self>,
        _upstream: &str,
        _partition: Option<crate::route::Partition>,
    ) -> Arc<dyn shared::StorePartition> {
        Arc::new(MemoryPartition {
            store: self.0.clone(),
            replica: self.1,
        })
    }

    fn describe(&self) -> serde_json::Value {
        json!({ "mode": "memory" })
    }
}

impl shared::StorePartition for MemoryPartition {
    fn admit<'a>(
        &'a self,
        family: &'a str,
        live: shared::LiveLimits<'a>,
        costs: &'a super::costs::Costs,
        deadline: Instant,
    ) -> shared::Reserving<'a> {
        Box::pin(async move {
            let store = &self.store;
            let gate = store
                .gates
                .lock()
                .entry(format!("{}/{family}", self.replica))
                .or_default()
                .clone();
            let _turn = gate.lock().await;
            loop {
                let limits = &live();
                let now = Instant::now();
                let wake = {
                    let mut states = store.limits.lock();
                    for l in limits.iter() {
                        let (spec, state) = states.entry(l.id.clone()).or_insert_with(|| {
                            (l.spec.clone(), super::kinds::LimitState::new(&l.spec, now))
                        });
                        if *spec != l.spec {
                            let old = std::mem::replace(
                                state,
                                super::kinds::LimitState::new(&l.spec, now),
                            );
                            *state = old.carry(&l.spec, now, 0);
                            *spec = l.spec.clone();
                        }
                    }
                    let w = |l: &shared::GlobalLimit| costs.of(l.unit());
                    if limits.iter().all(|l| {
                        states
                            .get_mut(&l.id)
                            .is_some_and(|(_, s)| s.can_take_n(w(l), now))
                    }) {
                        for l in limits.iter() {
                            if let Some((_, s)) = states.get_mut(&l.id) {
                                s.take_n(w(l), now);
                            }
                        }
                        let id = store
                            .next
                            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        return Ok(Some(Box::new(MemoryReservation {
                            store: store.clone(),
                            id,
                            ids: limits.iter().map(|l| (l.id.clone(), l.unit())).collect(),
                            costs: parking_lot::Mutex::new(*costs),
                            replica: self.replica,
                        })
                            as Box<dyn shared::Reservation>));
                    }
                    limits
                        .iter()
                        .filter_map(|l| states.get_mut(&l.id)?.1.ready_at(w(l), now))
                        .max()
                        .unwrap_or(now)
                };
                if wake > deadline {
                    return Err(LimitError::QueueTimeout {
                        retry_after: bucket::retry_after(wake - now),
                    });
                }
                tokio::time::sleep_until(wake).await;
            }
        })
    }

    fn describe(&self) -> serde_json::Value {
        json!({})
    }
}

impl MemoryReservation {
    /// `f` on each limit paid, with the unit it counts and what the request weighs there.
    fn each(&self, f: impl Fn(&mut super::kinds::LimitState, u8, u64)) {
        let costs = *self.costs.lock();
        let mut states = self.store.limits.lock();
        for (id, unit) in &self.ids {
            if let Some((_, s)) = states.get_mut(id) {
                f(s, *unit, costs.of(*unit));
            }
        }
    }
}

impl shared::Reservation for MemoryReservation {
    fn sent(&self, at: Instant) {
        self.each(|s, _, w| s.sent_n(self.id, w, Some(0), at));
        self.store.sends.lock().push((at, self.replica));
    }

    fn answered(&self, _sent: Instant, at: Instant, took: Duration) {
        self.each(|s, _, _| s.answered(self.id, at, took));
    }

    fn unsent(&self) {
        self.each(|s, _, w| s.unsent_n(w, 0));
    }

    fn reweigh(&self, unit: u8, w: u64) {
        let was = self.costs.lock().of(unit);
        self.each(|s, u, _| {
            if u == unit {
                s.reweigh(self.id, was, w, 0, Instant::now());
            }
        });
        let mut costs = self.costs.lock();
        *costs = costs.with(unit, w);
    }
}

/// Three replicas' limiters share each kind of global limit through the store above.
/// Clients on each replica send at once, a little later, or never (they leave), and the
/// provider sees at most the limit by its own count (a sliding log, or GCRA for the
/// paced kinds), nearly all of it, shared about equally: the limiter tells the store of
/// every send and every request that never went, whichever way it ends.
#[tokio::test(start_paused = true)]
async fn replicas_sharing_a_store_keep_its_limits() {
    let s = Duration::from_secs(1);
    for (limit, judge) in [
        (
            "{ kind = \"sliding_window\", permits = 10, window = \"1s\", scope = \"global\" }",
            Judge::Window(10, s),
        ),
        (
            "{ kind = \"fixed_window\", permits = 10, window = \"1s\", scope = \"global\" }",
            Judge::Fixed(10, s),
        ),
        (
            "{ kind = \"token_bucket\", rate = 10, per = \"1s\", burst = 3, scope = \"global\" }",
            Judge::Gcra(s / 10, 3),
        ),
        (
            "{ kind = \"published\", permits = 10, window = \"1s\", scope = \"global\" }",
            Judge::Gcra(s / 10, 1),
        ),
    ] {
        let store = Arc::new(Memory::default());
        let mut replicas = Vec::new();
        for r in 0..3 {
            let (l, _) = limiter(&format!(
                "limits = [{limit}]\n\
                 [cluster]\nredis = \"redis://127.0.0.1:1\"\nreplicas = 3\n"
            ));
            l.set_store(Some(
                Arc::new(Replica(store.clone(), r)) as Arc<dyn shared::Store>
            ));
            replicas.push(l);
        }
        let t0 = Instant::now();
        let end = t0 + Duration::from_secs(20);
        let mut tasks = Vec::new();
        for l in replicas.iter() {
            for c in 0..4u64 {
                let l = l.clone();
                tasks.push(tokio::spawn(async move {
                    let plan = l.plans()[0].clone();
                    let mut n = c;
                    while Instant::now() < end {
                        n = n
                            .wrapping_mul(6364136223846793005)
                            .wrapping_add(1442695040888963407);
                        let mut p = match l.acquire(&plan, &route(None)).await {
                            Ok(Some(p)) => p,
                            Ok(None) => panic!("a permit for a limited family"),
                            Err(_) => continue,
                        };
                        match (n >> 33) % 5 {
                            // The client left before its request went.
                            0 => drop(p),
                            late => {
                                tokio::time::sleep(Duration::from_millis(late * 3)).await;
                                if let Some(hook) = p.send_hook() {
                                    hook.fire();
                                }
                                tokio::time::sleep(Duration::from_millis(2)).await;
                                p.answered(200, Instant::now());
                            }
                        }
                    }
                }));
            }
        }
        for t in tasks {
            t.await.unwrap();
        }
        let sends = store.sends.lock().clone();
        let at: Vec<Instant> = sends.iter().map(|(t, _)| *t).collect();
        if let Some(k) = judge.first_refused(&at) {
            panic!("{limit}: the provider refuses send {k} of {}", at.len());
        }
        let per_second = sends.len() as f64 / 20.0;
        assert!(per_second > 8.5, "{limit}: {per_second:.2} a second of 10");
        for r in 0..3 {
            let share = sends.iter().filter(|(_, x)| *x == r).count() as f64 / sends.len() as f64;
            assert!(share > 0.25, "{limit}: replica {r} had {share:.2}");
        }
    }
}

/// How a provider counts, written apart from the limit kinds it judges.
enum Judge {
    /// At most `n` in any window of this length.
    Window(usize, Duration),
    /// At most `n` in a window that opens at the first arrival after the last one ended.
    Fixed(usize, Duration),
    /// GCRA: one per interval, `burst` at once.
    Gcra(Duration, u32),
}

impl Judge {
    fn first_refused(&self, at: &[Instant]) -> Option<usize> {
        let mut at = at.to_vec();
        at.sort();
        match *self {
            Judge::Window(n, w) => {
                (0..at.len()).find(|&i| at[..=i].iter().filter(|t| **t + w > at[i]).count() > n)
            }
            Judge::Fixed(n, w) => {
                let (mut opened, mut count) = (at.first().copied()?, 0);
                at.iter().position(|&a| {
                    if a >= opened + w {
                        (opened, count) = (a, 0);
                    }
                    count += 1;
                    count > n
                })
            }
            Judge::Gcra(t, burst) => {
                let tolerance = t * (burst - 1);
                let mut tat = at.first().copied()?;
                at.iter().position(|&a| {
                    if a + tolerance < tat {
                        return true;
                    }
                    tat = tat.max(a) + t;
                    false
                })
            }
        }
    }
}

#[tokio::test(start_paused = true)]
async fn an_announced_budget_of_tokens_paces_what_requests_cost_in_tokens() {
    use crate::policy::announced::Announced;
    let (l, _) = limiter(
        "limits = [{ kind = \"sliding_window\", permits = 100000, window = \"1m\", unit = \"tokens\" }]\n\
         [[upstream.family]]\nname = \"chat\"\n[upstream.family.cost.tokens]\nestimate = 1000\n",
    );
    let plan = l.plans()[0].clone();
    let r = route(Some(0));
    let cost = costs::Costs::ONE.with(1, 1000);
    let mut first = l
        .acquire_priced(&plan, &r, &cost, None)
        .await
        .unwrap()
        .unwrap();
    sent_and_answered(&mut first);
    // 2,000 tokens left by the provider's count over 4 s, 98,999 by ours: 2 ms a token,
    // so a 1,000-token request every 2 s, then its new window.
    first.learn_in(
        Announced {
            remaining: 2000,
            reset: Duration::from_secs(4),
            source: "x-ratelimit-remaining-tokens",
            unit: "tokens",
        },
        1,
    );
    let t0 = Instant::now();
    let mut at = Vec::new();
    for _ in 0..4 {
        let mut p = l
            .acquire_priced(&plan, &r, &cost, None)
            .await
            .unwrap()
            .unwrap();
        sent_and_answered(&mut p);
        at.push((Instant::now() - t0).as_secs_f64());
    }
    assert_eq!(at, [0.0, 2.0, 4.0, 4.0]);
}

#[tokio::test(start_paused = true)]
async fn views_say_what_waits_in_each_unit() {
    let text = "[[upstream]]\nname = \"u\"\nhosts = [\"u.example\"]\n\
        [[upstream.family]]\nname = \"chat\"\n\
        limits = [{ kind = \"token_bucket\", rate = 100, per = \"1s\", burst = 100, unit = \"tokens\" }]\n\
        [upstream.family.cost.tokens]\nestimate = 60\n";
    let config = Config::parse(text, "t.toml").unwrap();
    let metrics = Metrics::new(Registry::new()).unwrap();
    let l = Arc::new(Limiter::new(&config, &metrics));
    let plan = l.plans()[0].clone();
    let r = route(Some(0));
    let cost = costs::Costs::ONE.with(1, 60);
    let mut first = l
        .acquire_priced(&plan, &r, &cost, None)
        .await
        .unwrap()
        .unwrap();
    sent_and_answered(&mut first);
    let waiting = {
        let (l, plan) = (l.clone(), plan.clone());
        tokio::spawn(async move {
            let cost = costs::Costs::ONE.with(1, 60);
            l.acquire_priced(&plan, &route(Some(0)), &cost, None).await
        })
    };
    tokio::task::yield_now().await;
    let (buckets, _) = l.snapshot();
    let family = buckets
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["family"] == "chat")
        .unwrap()
        .clone();
    assert_eq!(family["queued_cost"], json!({"tokens": 60}), "{family}");
    assert_eq!(family["limits"][0]["unit"], "tokens");
    let text = metrics.render();
    assert!(
        text.contains("sluice_queue_cost{family=\"chat\",unit=\"tokens\",upstream=\"u\"} 60"),
        "{text}"
    );
    let (policy, _) = l.ratelimit_fields(&plan, &r).unwrap();
    assert_eq!(policy, "\"u/chat\";q=100;w=1;qu=\"tokens\"");
    let mut second = waiting.await.unwrap().unwrap().unwrap();
    sent_and_answered(&mut second);
    let text = metrics.render();
    assert!(
        text.contains("sluice_queue_cost{family=\"chat\",unit=\"tokens\",upstream=\"u\"} 0"),
        "{text}"
    );
    // The second waited for 20 tokens at 100 a second: 0.2 s times its 60 tokens.
    let series =
        "sluice_queue_wait_cost_seconds_total{family=\"chat\",unit=\"tokens\",upstream=\"u\"} ";
    let waited: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix(series))
        .unwrap_or_else(|| panic!("{text}"))
        .parse()
        .unwrap();
    assert!((waited - 12.0).abs() < 0.1, "{waited} token-seconds");
}
