//! Limits with `scope = "global"`, counted for every replica at once in a shared store,
//! and what the limiter needs from that store: a reservation for a request its local
//! limits admitted, and the reservation told when the request was sent and answered (or
//! never sent), so the store counts it as the provider does. `cluster` implements the
//! store on Redis; the limiter's tests drive a provider-side model of it in memory.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::error::LimitError;
use super::kinds::Pace;
use crate::config::{CounterAlign, Limit, Rounding, WindowAlign};
use crate::route::Partition;

/// Where shared limits are counted.
pub(crate) trait Store: Send + Sync {
    /// What one partition (an upstream, and its key value if partitioned) keeps with this
    /// store; made when the partition first pays a shared limit.
    fn partition(
        self: Arc<Self>,
        upstream: &str,
        partition: Option<Partition>,
    ) -> Arc<dyn StorePartition>;
    /// The store's state, for `/buckets`.
    fn describe(&self) -> serde_json::Value;
}

/// A reservation on its way: `None` when the store lets the request go uncounted (Redis
/// away with `on_redis_error = "allow"`).
pub(crate) type Reserving<'a> =
    Pin<Box<dyn Future<Output = Result<Option<Box<dyn Reservation>>, LimitError>> + Send + 'a>>;

/// One partition's side of the store.
pub(crate) trait StorePartition: Send + Sync {
    /// Reserves an instant for a request its local limits admitted, paying `costs`, under
    /// every limit `limits` gives, FIFO among the requests of `family` on this replica; waits for it.
    /// `limits` is asked again at every try: a reload's limits govern a request that was
    /// waiting when it came. `QueueTimeout` when the instant would be later than
    /// `deadline`.
    fn admit<'a>(
        &'a self,
        family: &'a str,
        limits: LiveLimits<'a>,
        costs: &'a super::costs::Costs,
        deadline: Instant,
    ) -> Reserving<'a>;
    /// What this replica knows of the partition's shared limits, for `/buckets`.
    fn describe(&self) -> serde_json::Value;
}

/// The shared limits a family pays now, as the live config says.
pub(crate) type LiveLimits<'a> = &'a (dyn Fn() -> Arc<[Arc<GlobalLimit>]> + Send + Sync);

/// One request's reservation: what the store must hear of it to count it as the provider
/// does. Dropped without a report, the store keeps counting it at its latest arrival.
pub(crate) trait Reservation: Send + Sync {
    /// Handed to its upstream connection at `at`.
    fn sent(&self, at: Instant);
    /// Answered at `at`, having been sent at `sent`, `took` after.
    fn answered(&self, sent: Instant, at: Instant, took: Duration);
    /// Never handed to a connection: the provider did not see it.
    fn unsent(&self);
    /// Its response said it really cost `w` in unit `unit`.
    fn reweigh(&self, unit: u8, w: u64);
}

/// The kind of a shared limit, one per way of counting a store keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Sliding,
    Fixed,
    /// A fixed window on the clock.
    Calendar,
    /// A sliding window counter; `rounds_down` as the provider compares.
    Counter {
        rounds_down: bool,
    },
    /// A GCRA: `token_bucket`, `leaky_bucket`, `published`.
    Token,
}

/// One limit with `scope = "global"`: its id, and its parameters in a store's units
/// (microseconds).
#[derive(Debug)]
pub struct GlobalLimit {
    /// Unique within the upstream and stable across reloads of the same limit:
    /// `u0.s` (the upstream's first limit, a sliding window), `f.orders.1.t`.
    pub(crate) id: Arc<str>,
    pub(crate) spec: Limit,
    pub(crate) kind: Kind,
    /// Windows and counters: permits; GCRA: the emission interval in microseconds.
    pub(crate) a: f64,
    /// Windows and counters: the window; GCRA: the tolerance.
    pub(crate) b: f64,
    /// Where clock windows start, past multiples of the window since the Unix epoch
    /// (microseconds); `None` for any alignment (counters) or none at all.
    pub(crate) offset: Option<f64>,
    pub(crate) margin: Duration,
    /// How long an admission matters to it: a window (two for a counter, whose previous
    /// window still weighs), or a GCRA's emission interval times its burst.
    pub(crate) span: Duration,
}

impl GlobalLimit {
    /// `None` for a limit that is not global, or that cannot be (concurrency).
    pub fn new(id: String, spec: &Limit) -> Option<GlobalLimit> {
        if !spec.is_global() {
            return None;
        }
        let margin = spec.margin()?;
        let clock = |offset: Option<Duration>| Some(micros(offset.unwrap_or_default()));
        let (kind, a, b, offset, span) = match *spec {
            Limit::SlidingWindow {
                permits, window, ..
            } => (Kind::Sliding, permits.get(), window, None, window),
            Limit::FixedWindow {
                permits,
                window,
                align,
                offset,
                ..
            } => match align {
                WindowAlign::First => (Kind::Fixed, permits.get(), window, None, window),
                WindowAlign::Clock => {
                    (Kind::Calendar, permits.get(), window, clock(offset), window)
                }
            },
            Limit::SlidingCounter {
                permits,
                window,
                align,
                offset,
                rounding,
                ..
            } => (
                Kind::Counter {
                    rounds_down: rounding == Rounding::Down,
                },
                permits.get(),
                window,
                match align {
                    CounterAlign::Any => None,
                    CounterAlign::Clock => clock(offset),
                },
                window * 2,
            ),
            Limit::TokenBucket { .. } | Limit::LeakyBucket { .. } | Limit::Published { .. } => {
                let pace = Pace::of(spec)?;
                let emission = pace.interval_ns() / 1000.0;
                let span =
                    Duration::from_nanos((pace.interval_ns() * pace.burst() as f64).ceil() as u64);
                return Some(GlobalLimit {
                    id: Arc::from(id),
                    spec: spec.clone(),
                    kind: Kind::Token,
                    a: emission,
                    b: pace.tolerance_ns() / 1000.0,
                    offset: None,
                    margin,
                    span,
                });
            }
            Limit::Concurrency { .. } => return None,
        };
        Some(GlobalLimit {
            id: Arc::from(id),
            spec: spec.clone(),
            kind,
            a: f64::from(a),
            b: micros(b),
            offset,
            margin,
            span,
        })
    }

    /// The unit it counts, as an index into its upstream's units (0: requests).
    pub(crate) fn unit(&self) -> u8 {
        self.spec.unit()
    }

    /// Counted in windows, rather than paced.
    pub(crate) fn is_window(&self) -> bool {
        self.kind != Kind::Token
    }
}

/// A duration in microseconds, the unit shared stores count in.
pub(crate) fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1_000_000.0
}
