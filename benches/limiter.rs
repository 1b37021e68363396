//! Limiter micro-benchmarks: admissions per second uncontended, under 64 tasks on one
//! bucket, and the cost of an admission while 10k waiters are queued. An admission to a
//! rate limit is followed through its life as a request's is: admitted, handed to its
//! connection (the send hook), answered, dropped. Then each kind on its own, saturated:
//! what deciding one admission and the next instant costs when a window holds `permits`
//! sends (a sliding counter at any alignment looks at every send of its last two
//! windows).

use std::sync::Arc;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use prometheus::Registry;
use sluice::Config;
use sluice::Metrics;
use sluice::Route;
use sluice::{Limiter, Plan};

fn limiter(limits: &str) -> Arc<Limiter> {
    let text = format!(
        "[[upstream]]\nname = \"u\"\nhosts = [\"u.example\"]\nmax_queue = 100000\nmax_wait = \"1h\"\n{limits}"
    );
    let config = Config::parse(&text, "bench.toml").expect("bench config");
    Arc::new(Limiter::new(
        &config,
        &Metrics::new(Registry::new()).expect("metrics"),
    ))
}

const ROUTE: Route = Route {
    upstream: 0,
    family: None,
    partition: None,
    tenant: None,
};
/// One request's whole dealing with the limiter: admitted, sent, answered, done.
async fn admit_send_answer(l: &Limiter, plan: &Arc<Plan>, route: &Route) {
    if let Ok(Some(mut permit)) = l.acquire(plan, route).await {
        if let Some(hook) = permit.send_hook() {
            hook.fire();
        }
        permit.answered(200, tokio::time::Instant::now());
    }
}

const GENEROUS: &str = "limits = [{ kind = \"token_bucket\", rate = 1000000000, per = \"1s\", burst = 1000000000 }, \
                        { kind = \"sliding_window\", permits = 1000000000, window = \"1ms\" }]\n";

fn uncontended(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let l = limiter(GENEROUS);
    // A request holds its config's plan already; looking it up is not the limiter's cost.
    let plan = l.plans()[0].clone();
    let mut g = c.benchmark_group("limiter");
    g.throughput(Throughput::Elements(1));
    g.bench_function("uncontended admission", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let start = tokio::time::Instant::now();
                for _ in 0..iters {
                    admit_send_answer(&l, &plan, &ROUTE).await;
                }
                start.elapsed()
            })
        })
    });

    let rt2 = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    g.bench_function("64 tasks, one bucket", |b| {
        b.iter_custom(|iters| {
            rt2.block_on(async {
                let per_task = iters.div_ceil(64);
                let start = tokio::time::Instant::now();
                let tasks: Vec<_> = (0..64)
                    .map(|_| {
                        let (l, plan) = (l.clone(), plan.clone());
                        tokio::spawn(async move {
                            for _ in 0..per_task {
                                admit_send_answer(&l, &plan, &ROUTE).await;
                            }
                        })
                    })
                    .collect();
                for t in tasks {
                    t.await.expect("task");
                }
                start
                    .elapsed()
                    .mul_f64(iters as f64 / (per_task * 64) as f64)
            })
        })
    });
    g.finish();
}

/// 10k tasks wait on a concurrency limit of 1; each admitted one releases at once, so
/// the queue drains one by one. Time per admission includes the waiter's wake-up.
fn ten_thousand_waiters(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let l = limiter("limits = [{ kind = \"concurrency\", max = 1 }]\n");
    let plan = l.plans()[0].clone();
    let mut g = c.benchmark_group("limiter");
    g.sample_size(10);
    g.throughput(Throughput::Elements(10_000));
    g.bench_function("drain 10k queued waiters", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let gate = l.acquire(&plan, &ROUTE).await;
                    let tasks: Vec<_> = (0..10_000)
                        .map(|_| {
                            let (l, plan) = (l.clone(), plan.clone());
                            tokio::spawn(async move { drop(l.acquire(&plan, &ROUTE).await) })
                        })
                        .collect();
                    // Let every task queue up before the clock starts.
                    for _ in 0..4 {
                        tokio::task::yield_now().await;
                    }
                    let start = tokio::time::Instant::now();
                    drop(gate);
                    for t in tasks {
                        t.await.expect("task");
                    }
                    total += start.elapsed();
                }
                total
            })
        })
    });
    g.finish();
}

/// A reload with 100k live partitions (each holding a sliding-window admission): every
/// one is reconfigured in place under the registry's write lock, so this is how long new
/// partitions wait during a reload.
fn reload_100k_partitions(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let keyed = |permits: u32| {
        format!(
            "key = \"header:Authorization\"\nlimits = [{{ kind = \"sliding_window\", permits = {permits}, window = \"1h\" }}]\n"
        )
    };
    let l = limiter(&keyed(5));
    let metrics = Metrics::new(Registry::new()).expect("metrics");
    let other: Vec<Config> = [5, 6]
        .iter()
        .map(|p| {
            Config::parse(
                &format!("[[upstream]]\nname = \"u\"\nhosts = [\"u.example\"]\nmax_queue = 100000\nmax_wait = \"1h\"\n{}", keyed(*p)),
                "bench.toml",
            )
            .expect("bench config")
        })
        .collect();
    let plan = l.plans()[0].clone();
    let n = if cfg!(debug_assertions) {
        1_000
    } else {
        100_000
    };
    rt.block_on(async {
        for i in 0..n as u32 {
            let r = Route {
                upstream: 0,
                family: None,
                partition: Some(sluice::Partition::of(&i.to_be_bytes())),
                tenant: None,
            };
            admit_send_answer(&l, &plan, &r).await;
        }
    });
    let mut g = c.benchmark_group("limiter");
    g.sample_size(10);
    let mut flip = 0;
    g.bench_function("reload with 100k live partitions", |b| {
        b.iter(|| {
            flip ^= 1;
            l.reload(sluice::plans(&other[flip], &metrics));
        })
    });
    g.finish();
}

/// A kind saturated at `permits` per second for three seconds, one send a millisecond
/// answered a millisecond later: then the cost of the check a request arriving at the
/// full limit pays (`available`), and of the instant it must wait for (`ready_at`).
fn kinds(c: &mut Criterion) {
    use sluice::LimitState;
    use tokio::time::Instant;
    let mut g = c.benchmark_group("kinds");
    for permits in [100, 1000] {
        for (name, extra) in [
            ("sliding_window", ""),
            ("sliding_counter clock", ", align = \"clock\""),
            ("sliding_counter any", ""),
            ("fixed_window clock", ", align = \"clock\""),
            ("published", ""),
        ] {
            let kind = name.split(' ').next().unwrap_or(name);
            let text = format!(
                "[[upstream]]\nname = \"u\"\nhosts = [\"u\"]\nlimits = [{{ kind = \"{kind}\", \
                 permits = {permits}, window = \"1s\"{extra} }}]\n"
            );
            let config = Config::parse(&text, "bench.toml").expect("bench config");
            let spec = &config.upstreams[0].limits[0];
            let t0 = Instant::now();
            let mut l = LimitState::new(spec, t0);
            let mut now = t0;
            let mut id = 0;
            while now < t0 + Duration::from_secs(3) {
                while l.can_take(now) {
                    l.take(now);
                    l.sent(id, Some(0), now);
                    l.answered(id, now + Duration::from_millis(1), Duration::ZERO);
                    id += 1;
                }
                now += Duration::from_millis(1);
            }
            g.bench_function(format!("{name}, {permits}/s: available"), |b| {
                b.iter(|| l.available(now))
            });
            g.bench_function(format!("{name}, {permits}/s: ready_at"), |b| {
                b.iter(|| l.ready_at(1, now))
            });
        }
    }
    g.finish();
}

criterion_group!(
    benches,
    uncontended,
    ten_thousand_waiters,
    reload_100k_partitions,
    kinds
);
criterion_main!(benches);
