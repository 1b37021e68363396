//! Partitions from a client-chosen key: what one costs in memory, measured with a
//! counting allocator, against the estimate `max_partitions` is derived from; and the
//! registry's count staying true while sweeps race requests.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use prometheus::Registry;
use sluice::Config;
use sluice::Metrics;
use sluice::{Limiter, PARTITION_MEMORY, max_partitions, partition_bytes};
use sluice::{Partition, Route};

/// Bytes the process holds on the heap now, as glibc's malloc lays them out: each
/// allocation takes its size plus an 8-byte header, rounded up to 16, at least 32.
struct Counting;

fn chunk(size: usize) -> usize {
    ((size + 8 + 15) & !15).max(32)
}

static HELD: AtomicUsize = AtomicUsize::new(0);

// SAFETY: each call is passed to the system allocator unchanged; only the sizes are added up.
#[allow(unsafe_code, reason = "a global allocator is an unsafe trait")]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        HELD.fetch_add(chunk(layout.size()), Ordering::Relaxed);
        // SAFETY: the caller's layout, as the trait requires.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        HELD.fetch_sub(chunk(layout.size()), Ordering::Relaxed);
        // SAFETY: `ptr` came from `alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new: usize) -> *mut u8 {
        HELD.fetch_add(chunk(new), Ordering::Relaxed);
        HELD.fetch_sub(chunk(layout.size()), Ordering::Relaxed);
        // SAFETY: as for `dealloc`, and `new` is the caller's.
        unsafe { System.realloc(ptr, layout, new) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn limiter(toml: &str) -> (Config, Limiter) {
    let config = Config::parse(toml, "t.toml").unwrap_or_else(|e| panic!("{e}"));
    let metrics = Metrics::new(Registry::new()).unwrap();
    let limiter = Limiter::new(&config, &metrics);
    (config, limiter)
}

fn keyed(i: u64, family: Option<usize>) -> Route {
    Route {
        upstream: 0,
        family,
        partition: Some(Partition::of(&i.to_be_bytes())),
        tenant: None,
    }
}

/// One request, sent and answered, in each of `keys` new partitions.
async fn one_request_each(l: &Limiter, keys: std::ops::Range<u64>, family: Option<usize>) {
    let plan = l.plans()[0].clone();
    for i in keys {
        let mut permit = l
            .acquire(&plan, &keyed(i, family))
            .await
            .unwrap_or_else(|e| panic!("key {i}: {e}"));
        if let Some(p) = permit.as_mut() {
            if let Some(hook) = p.send_hook() {
                hook.fire();
            }
            p.answered(200, tokio::time::Instant::now());
        }
    }
}

const BUNDLED_SHAPE: &str = r#"
[[upstream]]
name = "marketplace"
hosts = ["api.marketplace.example"]
key = "header:Authorization"
limits = [{ kind = "fixed_window", permits = 300, window = "1m" }]
  [[upstream.family]]
  name = "orders"
  methods = ["POST"]
  limits = [{ kind = "sliding_window", permits = 12, window = "1s" }]
  [[upstream.family]]
  name = "catalog"
  paths = ["/v1/catalog/**"]
  limits = [
    { kind = "token_bucket", rate = 3, per = "1s", burst = 6 },
    { kind = "concurrency", max = 4 },
  ]
"#;

const ONE_WINDOW: &str = r#"
[[upstream]]
name = "api"
hosts = ["api.example"]
key = "header:Authorization"
limits = [{ kind = "fixed_window", permits = 300, window = "1m" }]
"#;

/// The measured bytes per partition against the estimate, for shapes with one limit and
/// with families of every kind; and what the default cap then holds.
#[tokio::test(flavor = "current_thread")]
async fn a_partition_costs_what_the_cap_is_derived_from() {
    const N: u64 = 20_000;
    for (toml, family, name) in [
        (ONE_WINDOW, None, "one fixed window"),
        (BUNDLED_SHAPE, Some(0), "the bundled config's shape, orders"),
        (
            BUNDLED_SHAPE,
            Some(1),
            "the bundled config's shape, catalog",
        ),
    ] {
        let (config, l) = limiter(toml);
        let u = &config.upstreams[0];
        // The first request builds what every partition shares (metrics, tables).
        one_request_each(&l, 0..1, family).await;
        let before = HELD.load(Ordering::Relaxed);
        one_request_each(&l, 1..N + 1, family).await;
        let held = HELD.load(Ordering::Relaxed).saturating_sub(before);
        assert_eq!(l.partitions(), N as usize + 1);
        let measured = held as f64 / N as f64;
        let estimate = partition_bytes(u) as f64;
        eprintln!(
            "{name}: {measured:.0} bytes a partition measured, {estimate} estimated, \
             default max_partitions {}",
            max_partitions(u)
        );
        assert!(
            (0.7..=1.3).contains(&(measured / estimate)),
            "{name}: {measured:.0} bytes measured, {estimate} estimated"
        );
        // The default cap keeps the upstream's partitions near PARTITION_MEMORY.
        let at_cap = measured * max_partitions(u) as f64;
        assert!(
            at_cap <= PARTITION_MEMORY as f64 * 1.3,
            "{name}: {at_cap:.0} bytes at the cap"
        );
    }
}

/// Sweeps on another thread while requests make, use and leave partitions: the count the
/// cap is checked against stays equal to the partitions there are.
#[test]
fn the_count_stays_true_while_sweeps_race_requests() {
    let (_, l) = limiter(&ONE_WINDOW.replace(
        "permits = 300, window = \"1m\"",
        "permits = 1, window = \"1ms\"",
    ));
    let l = Arc::new(l);
    let stop = Arc::new(AtomicBool::new(false));
    let sweeper = {
        let (l, stop) = (l.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut sweeps = 0;
            while !stop.load(Ordering::Relaxed) {
                l.sweep();
                sweeps += 1;
            }
            sweeps
        })
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    rt.block_on(async {
        // Few keys, used over and over: partitions are dropped and made again all along.
        let plan = l.plans()[0].clone();
        for round in 0..20_000u64 {
            let r = keyed(round % 64, None);
            // A window of 1 per ms: some are refused with queue_timeout, which is fine.
            let wait =
                tokio::time::timeout(std::time::Duration::from_millis(5), l.acquire(&plan, &r));
            if let Ok(Ok(Some(mut p))) = wait.await {
                if let Some(hook) = p.send_hook() {
                    hook.fire();
                }
                p.answered(200, tokio::time::Instant::now());
            }
        }
    });
    stop.store(true, Ordering::Relaxed);
    let sweeps = sweeper.join().unwrap();
    assert!(sweeps > 10, "{sweeps} sweeps ran");
    // Every partition idle now: a sweep after the windows end leaves none, and the count
    // it reports is the count kept.
    std::thread::sleep(std::time::Duration::from_millis(20));
    assert_eq!(l.sweep(), 0);
    assert_eq!(l.partitions(), 0);
}
