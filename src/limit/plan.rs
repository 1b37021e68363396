//! A plan: one upstream's limits as the live config gives them, resolved once per
//! config generation (the spec every partition of the upstream is built from, its shared
//! limits, its metric handles), and how many partitions it may have.

use parking_lot::Mutex;
use std::sync::Arc;
use std::time::Duration;

use prometheus::{Histogram, IntCounter, IntGauge};
use tokio::time::Instant;

use super::bucket::{FamilySpec, PartitionSpec};

use crate::config::{Adaptive, Limit, Priority, Upstream};
use crate::metrics::Metrics;

use super::shared::GlobalLimit;

/// The queue of CONNECT tunnels in `/buckets`; not a valid family name, so it cannot clash.
pub(super) const TUNNEL: &str = "(tunnel)";

/// Metric handles of one (upstream, family), resolved once so the hot path does no
/// label lookups.
pub(super) struct FamilyMetrics {
    pub(super) wait: Histogram,
    pub(super) depth: IntGauge,
    pub(super) queue_full: IntCounter,
    pub(super) queue_timeout: IntCounter,
    pub(super) partition_limit: IntCounter,
    pub(super) edge_429: IntCounter,
    pub(super) cluster_wait: Histogram,
    /// `sluice_queue_cost` by unit index, for the units the family prices.
    pub(super) queue_cost: Vec<(u8, IntGauge)>,
    /// `sluice_queue_wait_cost_seconds_total` by unit index, likewise.
    pub(super) wait_cost: Vec<(u8, prometheus::Counter)>,
    /// When the last edge-429 hint was logged, so that it is logged once a minute.
    pub(super) last_hint: Mutex<Option<Instant>>,
}

/// How often the edge-429 hint may be logged per upstream and family.
pub(super) const HINT_EVERY: Duration = Duration::from_secs(60);

/// An upstream's limits as one config generation has them, with its metric handles.
/// A request keeps the plan of the config it was routed with.
pub struct Plan {
    pub(super) name: Arc<str>,
    /// Later plans have larger numbers: a partition still on an older plan than a
    /// request's moves to the request's first.
    pub(super) generation: u64,
    /// Whether CONNECT tunnels to this upstream pay anything (its concurrency limits).
    pub(super) tunnels: bool,
    pub(super) spec: PartitionSpec,
    pub(super) metrics: Arc<[Arc<FamilyMetrics>]>,
    /// By family index: the limits shared through `[cluster]` that its requests pay
    /// (the upstream's and the family's), left out of the local bucket.
    pub(super) global: Vec<Arc<[Arc<GlobalLimit>]>>,
    /// Keyed partitions it may have live at once (see `cell::max_partitions`).
    pub(super) max_partitions: usize,
    /// Whether any of its queues adapts its rate (`adaptive`).
    pub(super) adapts: bool,
}

impl Plan {
    /// `max_partitions`: the keyed partitions it may have live (`cell::max_partitions`,
    /// which knows what a partition costs).
    pub(crate) fn new(u: &Upstream, metrics: &Metrics, max_partitions: usize) -> Plan {
        let local = |limits: &[Limit]| -> Vec<Limit> {
            limits.iter().filter(|l| !l.is_global()).cloned().collect()
        };
        let upstream_global: Vec<Arc<GlobalLimit>> = u
            .limits
            .iter()
            .enumerate()
            .filter_map(|(i, l)| GlobalLimit::new(format!("u{i}.{}", l.kind_letter()), l))
            .map(Arc::new)
            .collect();
        let mut global: Vec<Arc<[Arc<GlobalLimit>]>> = u
            .families
            .iter()
            .map(|f| {
                let own = f.limits.iter().enumerate().filter_map(|(i, l)| {
                    GlobalLimit::new(format!("f.{}.{i}.{}", f.name, l.kind_letter()), l)
                });
                upstream_global
                    .iter()
                    .cloned()
                    .chain(own.map(Arc::new))
                    .collect()
            })
            .collect();
        // Requests of no family pay the upstream's; tunnels pay no rate limit.
        global.push(upstream_global.into());
        global.push(Arc::from(Vec::new()));
        // What `adaptive` adapts below: the tightest rate the requests pay, and its period.
        let adapts = |adaptive: Option<Adaptive>, own: &[Limit]| {
            let (rate, every) = own
                .iter()
                .chain(&u.limits)
                .filter_map(|l| Some((l.rate_per_second()?, l.period()?)))
                .min_by(|a, b| a.0.total_cmp(&b.0))?;
            adaptive.map(|spec| super::aimd::Adapts { spec, rate, every })
        };
        let mut families: Vec<Arc<FamilySpec>> = u
            .families
            .iter()
            .map(|f| {
                Arc::new(FamilySpec {
                    name: f.name.clone(),
                    priority: f.priority,
                    limits: local(&f.limits),
                    max_queue: f.policy.max_queue,
                    max_wait: f.policy.max_wait,
                    concurrency_only: false,
                    adaptive: adapts(f.adaptive, &f.limits),
                    fair: f.tenant.is_some(),
                    newest_first: f.queue_order == crate::config::QueueOrder::NewestFirst,
                    queue_caps: f
                        .prices
                        .iter()
                        .filter_map(|p| Some((p.index, p.max_queue?)))
                        .collect(),
                    units: f
                        .prices
                        .iter()
                        .map(|p| (p.index, Arc::from(p.unit.as_str())))
                        .collect(),
                })
            })
            .collect();
        // Two queues of our own: requests of no family, and CONNECT tunnels.
        for (name, concurrency_only) in [("-", false), (TUNNEL, true)] {
            families.push(Arc::new(FamilySpec {
                name: name.into(),
                priority: Priority::Normal,
                limits: Vec::new(),
                max_queue: u.policy.max_queue,
                max_wait: u.policy.max_wait,
                concurrency_only,
                adaptive: adapts(u.adaptive, &[]).filter(|_| !concurrency_only),
                fair: false,
                newest_first: false,
                queue_caps: Vec::new(),
                units: Vec::new(),
            }));
        }
        let handles = families
            .iter()
            .map(|f| Arc::new(FamilyMetrics::new(metrics, &u.name, &f.name, &f.units)))
            .collect();
        let adapts = families.iter().any(|f| f.adaptive.is_some());
        static GENERATIONS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        Plan {
            name: Arc::from(u.name.as_str()),
            generation: GENERATIONS.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            tunnels: u
                .limits
                .iter()
                .any(|l| matches!(l, Limit::Concurrency { .. })),
            spec: PartitionSpec {
                upstream_limits: local(&u.limits).into(),
                families,
            },
            metrics: handles,
            global,
            max_partitions,
            adapts,
        }
    }

    /// The shared limits a request of family `index` pays.
    pub(super) fn global(&self, index: usize) -> &Arc<[Arc<GlobalLimit>]> {
        &self.global[index]
    }

    /// The queue index of a route's family: its own, or the one for requests of none.
    pub(super) fn family_index(&self, family: Option<usize>) -> usize {
        family.unwrap_or(self.spec.families.len() - 2)
    }

    pub(super) fn tunnel_index(&self) -> usize {
        self.spec.families.len() - 1
    }
}

impl FamilyMetrics {
    /// Requests costing `costs` joined (`joined`) or left the queue.
    pub(super) fn queued(&self, costs: &crate::limit::costs::Costs, joined: bool) {
        if joined {
            self.depth.inc();
        } else {
            self.depth.dec();
        }
        for (i, g) in &self.queue_cost {
            let n = i64::try_from(costs.of(*i)).unwrap_or(i64::MAX);
            g.add(if joined { n } else { -n });
        }
    }

    pub(super) fn new(
        metrics: &Metrics,
        upstream: &str,
        family: &str,
        units: &[(u8, Arc<str>)],
    ) -> FamilyMetrics {
        // Tunnels match no family: they count under family="-".
        let family = if family == TUNNEL { "-" } else { family };
        let l = [upstream, family];
        FamilyMetrics {
            wait: metrics.queue_wait.with_label_values(&l),
            depth: metrics.queue_depth.with_label_values(&l),
            queue_full: metrics
                .rejections
                .with_label_values(&[upstream, family, "queue_full"]),
            queue_timeout: metrics.rejections.with_label_values(&[
                upstream,
                family,
                "queue_timeout",
            ]),
            partition_limit: metrics.rejections.with_label_values(&[
                upstream,
                family,
                "partition_limit",
            ]),
            edge_429: metrics.edge_429.with_label_values(&l),
            cluster_wait: metrics.cluster_wait.with_label_values(&l),
            wait_cost: units
                .iter()
                .map(|(i, u)| {
                    let l = [upstream, family, u];
                    (*i, metrics.queue_wait_cost.with_label_values(&l))
                })
                .collect(),
            queue_cost: units
                .iter()
                .map(|(i, u)| {
                    (
                        *i,
                        metrics.queue_cost.with_label_values(&[upstream, family, u]),
                    )
                })
                .collect(),
            last_hint: Mutex::new(None),
        }
    }
}

/// One config generation's plans, by upstream index.
pub(crate) type Plans = Arc<[Arc<Plan>]>;
