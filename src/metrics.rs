//! Prometheus metrics: typed handles registered once on a registry the caller owns.
//! Names and labels are the contract in PRODUCT.md; label values are bounded (upstream and
//! family names from the config, status codes, reasons), never hosts, URLs or keys.

use std::sync::OnceLock;

use prometheus::{
    CounterVec, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec,
    IntGauge, IntGaugeVec, Opts, Registry,
};

#[derive(Clone)]
pub struct Metrics {
    pub(crate) registry: Registry,
    /// `{upstream, family, outcome}`: one per request, outcome = final status or `sluice_<reason>`.
    pub(crate) requests: IntCounterVec,
    /// `{upstream, family, status}`: one per upstream attempt.
    pub(crate) upstream_responses: IntCounterVec,
    /// `{upstream, family}`: time from sending an attempt to its response headers.
    pub(crate) upstream_duration: HistogramVec,
    /// `{upstream, family}`: time from arrival to admission, zero waits included.
    pub(crate) queue_wait: HistogramVec,
    /// `{upstream, family}`: requests waiting now, over all partitions.
    pub(crate) queue_depth: IntGaugeVec,
    /// `{upstream, family, unit}`: what the waiting requests of a priced family cost.
    pub(crate) queue_cost: IntGaugeVec,
    /// `{upstream, family, unit}`: cost units admitted times the seconds each waited.
    pub(crate) queue_wait_cost: CounterVec,
    /// `{upstream, family, reason}`: requests refused by the limiter's bounds.
    pub(crate) rejections: IntCounterVec,
    /// `{upstream, family, action}`: upstream 429s by what was done about them.
    pub(crate) upstream_429: IntCounterVec,
    /// `{upstream, family, unit, stage}`: cost units paid at admission (`estimated`) and
    /// reported by responses (`actual`).
    pub(crate) cost: IntCounterVec,
    /// `{upstream, family}`: upstream 429s for requests admitted at the instant a rate
    /// limit allowed them: the provider's window edge is later than sluice believed.
    pub(crate) edge_429: IntCounterVec,
    /// `{upstream, family, reason}`: retries made (reason: status or failure) or refused
    /// (`budget_exhausted`).
    pub(crate) retries: IntCounterVec,
    /// `{upstream, state}`: 1 for the current state of each upstream's circuit.
    pub(crate) breaker_state: IntGaugeVec,
    /// `{upstream, family, state}`: the same for families with a circuit of their own.
    pub(crate) family_breaker_state: IntGaugeVec,
    /// Failed TLS handshakes with clients of intercepted tunnels (untrusted CA, ...).
    pub(crate) tls_handshake_failures: prometheus::IntCounter,
    /// Live partitions (sets of buckets) over all upstreams, as of the last sweep.
    pub(crate) partitions: IntGauge,
    /// `{upstream, result}`: requests that asked to switch protocols (`Upgrade`), by
    /// result: `switched`, `refused` (the upstream answered otherwise), `local` (sluice
    /// answered), `failed`.
    pub(crate) upgrades: IntCounterVec,
    /// Upstream connections sluice could not make for want of its own resources.
    pub(crate) local_failures: prometheus::IntCounter,
    /// Upstream connections open now, against their cap (`max_connections`).
    pub(crate) upstream_connections: prometheus::IntGauge,
    /// `{reason}`: CONNECT tunnels to configured upstreams closed because their first
    /// bytes were neither TLS nor HTTP (see `proxy::sniff`).
    pub(crate) tunnels_refused: IntCounterVec,
    /// `{upstream}`: switched connections open now.
    pub(crate) upgraded: IntGaugeVec,
    /// `{upstream}`: its live partitions, as of the last sweep (or the scrape, when few).
    pub(crate) upstream_partitions: IntGaugeVec,
    /// `{upstream}`: a keyed upstream's `max_partitions`.
    pub(crate) max_partitions: IntGaugeVec,
    /// `{upstream}`: requests per second its tightest rate limit allows, as configured.
    pub(crate) configured_rate: GaugeVec,
    /// `{upstream}`: requests per second its slowest partition may send now, by the
    /// provider's announced budget (`learn`); the configured rate when none is slowed.
    pub(crate) effective_rate: GaugeVec,
    /// `{upstream}`: partitions pacing to an announced budget now.
    pub(crate) learned_partitions: IntGaugeVec,
    /// `{upstream, family}`: the lowest share of its configured rate an adaptive family's
    /// partition may send now.
    pub(crate) adaptive_share: GaugeVec,
    /// Request body bytes held for replay, as of the scrape.
    pub(crate) replay_bytes: IntGauge,
    /// Client connections open, as of the scrape.
    pub(crate) client_connections: IntGauge,
    /// Client connections answered 503 because `max_connections` were open.
    pub(crate) connections_refused: prometheus::IntCounter,
    /// `{op}`: Redis script calls (reserve, flush, absorb), from sending to the answer.
    pub(crate) cluster_calls: HistogramVec,
    /// `{kind}`: failed Redis calls, by `cluster::link::Fault` label.
    pub(crate) cluster_errors: IntCounterVec,
    /// `{mode}`: 1 for how global limits are decided now: redis, local, allow or deny.
    pub(crate) cluster_mode: IntGaugeVec,
    /// `{result}`: global admissions: reserved, later (beyond the horizon, asked again),
    /// too_late (beyond max_wait), handed_over, local, allowed, denied.
    pub(crate) cluster_reservations: IntCounterVec,
    /// `{upstream, family}`: time from a request's local admission to its global one.
    pub(crate) cluster_wait: HistogramVec,
    /// `{result}`: reloads by result, success or failure.
    pub(crate) config_reloads: IntCounterVec,
    /// `{sha256}`: 1 for the config in force.
    pub(crate) config_info: IntGaugeVec,
    /// 1 when the last reload (or the start) loaded the file, 0 when it was refused.
    pub(crate) config_last_reload_successful: prometheus::IntGauge,
    pub(crate) log_lines_dropped: prometheus::IntCounter,
}

/// The commit the binary was built from: `SLUICE_REVISION` at build time (the
/// Dockerfile passes its `REVISION` argument), else "unknown".
pub const REVISION: &str = match option_env!("SLUICE_REVISION") {
    Some(r) => r,
    None => "unknown",
};

/// Warns every 10 s while log lines are being dropped (see [`crate::log`]).
pub fn warn_on_dropped_log_lines() {
    let _ = std::thread::Builder::new()
        .name("sluice-log-watch".into())
        .spawn(move || {
            let mut seen = 0;
            loop {
                std::thread::sleep(std::time::Duration::from_secs(10));
                let now = crate::log::dropped_lines();
                if now > seen {
                    tracing::warn!(
                        dropped = now - seen,
                        total = now,
                        "log lines dropped: stderr is not read fast enough"
                    );
                    seen = now;
                }
            }
        });
}

/// One upstream and family's per-request series, resolved when the config is loaded: a
/// lookup by label values hashes every value and takes the vector's lock, three times per
/// request otherwise.
/// Every series is created on first use: one that never counted anything does not appear.
pub(crate) struct RouteMetrics {
    /// `sluice_upstream_duration_seconds`.
    durations: HistogramVec,
    upstream_duration: Lazy<Histogram>,
    /// `sluice_requests_total` by outcome.
    pub(crate) requests: ByOutcome,
    /// `sluice_upstream_responses_total` by status.
    pub(crate) upstream_responses: ByOutcome,
    /// `sluice_cost_total{stage="estimated"}` by unit index, for a priced family.
    pub(crate) cost_estimated: Vec<(u8, IntCounter)>,
}

/// A handle created by its first use.
struct Lazy<T> {
    cell: OnceLock<T>,
}

impl<T> Lazy<T> {
    fn new() -> Lazy<T> {
        Lazy {
            cell: OnceLock::new(),
        }
    }

    fn get(&self, make: impl FnOnce() -> T) -> &T {
        self.cell.get_or_init(make)
    }
}

/// The statuses almost every request ends in, whose counters are kept once created.
const COMMON_OUTCOMES: [&str; 8] = ["200", "201", "204", "304", "404", "429", "502", "503"];

/// A counter vector with its upstream and family labels bound; the common outcomes'
/// counters are created on first use (a series appears only once it counts something)
/// and kept.
pub(crate) struct ByOutcome {
    vec: IntCounterVec,
    upstream: String,
    family: String,
    common: [Lazy<IntCounter>; COMMON_OUTCOMES.len()],
}

impl ByOutcome {
    fn new(vec: &IntCounterVec, upstream: &str, family: &str) -> ByOutcome {
        ByOutcome {
            vec: vec.clone(),
            upstream: upstream.to_owned(),
            family: family.to_owned(),
            common: std::array::from_fn(|_| Lazy::new()),
        }
    }

    pub(crate) fn inc(&self, outcome: &str) {
        let labels = [self.upstream.as_str(), self.family.as_str(), outcome];
        match COMMON_OUTCOMES.iter().position(|c| *c == outcome) {
            Some(i) => self.common[i]
                .get(|| self.vec.with_label_values(&labels))
                .inc(),
            None => self.vec.with_label_values(&labels).inc(),
        }
    }
}

impl RouteMetrics {
    pub(crate) fn new(metrics: &Metrics, upstream: &str, family: &str) -> RouteMetrics {
        RouteMetrics {
            durations: metrics.upstream_duration.clone(),
            upstream_duration: Lazy::new(),
            requests: ByOutcome::new(&metrics.requests, upstream, family),
            upstream_responses: ByOutcome::new(&metrics.upstream_responses, upstream, family),
            cost_estimated: Vec::new(),
        }
    }

    /// With the counters of what a priced family's admissions pay, by unit.
    fn priced(mut self, metrics: &Metrics, prices: &[crate::config::cost::Price]) -> RouteMetrics {
        let (u, f) = (self.requests.upstream.clone(), self.requests.family.clone());
        self.cost_estimated = prices
            .iter()
            .map(|p| {
                let c = metrics
                    .cost
                    .with_label_values(&[&u, &f, &p.unit, "estimated"]);
                (p.index, c)
            })
            .collect();
        self
    }

    /// Records an attempt's time to response headers.
    pub(crate) fn upstream_duration(&self, seconds: f64) {
        let r = &self.requests;
        self.upstream_duration
            .get(|| {
                self.durations
                    .with_label_values(&[r.upstream.as_str(), r.family.as_str()])
            })
            .observe(seconds);
    }
}

/// [`RouteMetrics`] for every route of a config: by upstream index, then family index
/// with requests of no family last; and unmatched requests.
pub(crate) struct RouteTable {
    upstreams: Vec<Vec<RouteMetrics>>,
    unmatched: RouteMetrics,
}

impl RouteTable {
    pub(crate) fn new(config: &crate::config::Config, metrics: &Metrics) -> RouteTable {
        let upstreams = config
            .upstreams
            .iter()
            .map(|u| {
                u.families
                    .iter()
                    .map(|f| {
                        RouteMetrics::new(metrics, &u.name, &f.name).priced(metrics, &f.prices)
                    })
                    .chain([RouteMetrics::new(metrics, &u.name, "-")])
                    .collect()
            })
            .collect();
        RouteTable {
            upstreams,
            unmatched: RouteMetrics::new(metrics, "unmatched", "-"),
        }
    }

    /// The handles of `route` (labelled as [`crate::route::labels`] names it).
    pub(crate) fn get(&self, route: Option<&crate::route::Route>) -> &RouteMetrics {
        let Some(r) = route else {
            return &self.unmatched;
        };
        let families = &self.upstreams[r.upstream];
        match r.family {
            Some(f) => &families[f],
            None => &families[families.len() - 1],
        }
    }
}

/// 1 ms to 60 s, roughly ×2.5 per step: resolves fast APIs and long queue waits alike.
pub(crate) const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// Every metric's name and help text, in one place.
const HELP: &[(&str, &str)] = &[
    (
        "sluice_requests_total",
        "Requests handled, by final outcome",
    ),
    (
        "sluice_upstream_responses_total",
        "Upstream responses, one per attempt",
    ),
    (
        "sluice_upstream_duration_seconds",
        "Time from sending an attempt upstream to its response headers",
    ),
    (
        "sluice_queue_wait_seconds",
        "Time spent waiting for admission",
    ),
    ("sluice_queue_depth", "Requests waiting for admission"),
    (
        "sluice_queue_cost",
        "What the requests waiting for admission cost, in each unit their family prices",
    ),
    (
        "sluice_queue_wait_cost_seconds_total",
        "Seconds waited for admission times what each request cost, in each unit its family prices: over sluice_cost_total{stage=\"estimated\"}, the mean wait per unit",
    ),
    (
        "sluice_rejections_total",
        "Requests refused by the limiter's queue bounds",
    ),
    (
        "sluice_partitions",
        "Live partitions (one per upstream and key value) as of the last idle sweep",
    ),
    (
        "sluice_upgrades_total",
        "Requests that asked to switch protocols (WebSocket), by result: switched, refused (the upstream answered otherwise), local (sluice answered: a refusal of its own, or an upstream it could not reach) or failed (after the 101)",
    ),
    (
        "sluice_local_failures_total",
        "Upstream connections sluice could not make for want of its own resources (its cap on upstream connections, descriptors, socket memory), answered 503 connection_limit and never counted against the upstream",
    ),
    (
        "sluice_upstream_connections",
        "Upstream connections open now, against their cap: max_connections, as for client connections",
    ),
    (
        "sluice_tunnels_refused_total",
        "CONNECT tunnels to configured upstreams closed because what the client sent first was neither TLS nor a complete HTTP request, by reason: not_http, too_slow, too_large, closed",
    ),
    (
        "sluice_upgraded_connections",
        "Connections switched to another protocol (WebSocket) open now",
    ),
    (
        "sluice_upstream_partitions",
        "Live partitions of the upstream, as of the last idle sweep",
    ),
    (
        "sluice_upstream_max_partitions",
        "Partitions a keyed upstream may have live (max_partitions); beyond it new key values are answered 503 partition_limit",
    ),
    (
        "sluice_configured_rate",
        "Requests per second the upstream's tightest rate limit allows, as configured",
    ),
    (
        "sluice_effective_rate",
        "Requests per second the upstream's slowest partition may send now, paced by the budget the provider announces (learn); the configured rate when none is slowed",
    ),
    (
        "sluice_learned_partitions",
        "Partitions pacing to a budget the provider announced, below their configured limits",
    ),
    (
        "sluice_adaptive_rate_ratio",
        "Lowest share of the configured rate an adaptive family's partition may send now, lowered by 429s the provider did not announce (1: not slowed)",
    ),
    (
        "sluice_replay_buffered_bytes",
        "Request body bytes held so that a retry can resend them (bounded by proxy.max_replay_memory)",
    ),
    (
        "sluice_client_connections",
        "Client connections open on the proxy listener, tunnels included",
    ),
    (
        "sluice_connections_refused_total",
        "Client connections answered 503 connection_limit because proxy.max_connections were open",
    ),
    (
        "sluice_upstream_429_total",
        "Upstream 429 responses by the action taken",
    ),
    (
        "sluice_cost_total",
        "Cost units of priced requests: estimated (paid at admission) and actual (as responses reported it)",
    ),
    (
        "sluice_edge_429_total",
        "Upstream 429s for requests admitted at a rate limit's edge: a larger margin would have held them back",
    ),
    (
        "sluice_retries_total",
        "Retries made, by cause, or refused by the budget",
    ),
    (
        "sluice_breaker_state",
        "1 for the current state of the upstream's circuit",
    ),
    (
        "sluice_family_breaker_state",
        "1 for the current state of a family's own circuit",
    ),
    (
        "sluice_tls_handshake_failures_total",
        "Failed TLS handshakes with clients of intercepted tunnels",
    ),
    (
        "sluice_config_reloads_total",
        "Config reloads by result (success or failure)",
    ),
    (
        "sluice_config_info",
        "1 for the config in force, labelled with the SHA-256 of its file",
    ),
    (
        "sluice_config_last_reload_successful",
        "1 when the last reload (or the start) loaded the config file, 0 when it was refused",
    ),
    (
        "sluice_cluster_call_duration_seconds",
        "Redis script calls for shared limits, from sending to the answer",
    ),
    (
        "sluice_cluster_errors_total",
        "Redis calls for shared limits that failed, by kind",
    ),
    (
        "sluice_cluster_mode",
        "1 for how shared limits are decided now: redis, local, allow or deny",
    ),
    (
        "sluice_cluster_reservations_total",
        "Admissions to shared limits, by result",
    ),
    (
        "sluice_cluster_wait_seconds",
        "Time from a request's local admission to its admission by the shared limits",
    ),
    (
        "sluice_log_lines_dropped_total",
        "Log lines dropped because stderr was not read fast enough",
    ),
    (
        "sluice_build_info",
        "Always 1; the version and the source revision of this binary",
    ),
];

/// 100 µs to 1 s: a Redis call on the same network answers in well under a millisecond.
const CLUSTER_CALL_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
];

/// Makes each metric with its help text from [`HELP`] and registers it.
struct Maker<'a>(&'a Registry);

impl Maker<'_> {
    fn opts(name: &str) -> prometheus::Result<Opts> {
        let help = HELP
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, h)| *h)
            .ok_or_else(|| prometheus::Error::Msg(format!("{name} has no help text")))?;
        Ok(Opts::new(name, help))
    }

    fn add<M: prometheus::core::Collector + Clone + 'static>(&self, m: M) -> prometheus::Result<M> {
        self.0.register(Box::new(m.clone()))?;
        Ok(m)
    }

    fn int_counters(&self, name: &str, labels: &[&str]) -> prometheus::Result<IntCounterVec> {
        self.add(IntCounterVec::new(Self::opts(name)?, labels)?)
    }

    fn counters(&self, name: &str, labels: &[&str]) -> prometheus::Result<CounterVec> {
        self.add(CounterVec::new(Self::opts(name)?, labels)?)
    }

    fn int_gauges(&self, name: &str, labels: &[&str]) -> prometheus::Result<IntGaugeVec> {
        self.add(IntGaugeVec::new(Self::opts(name)?, labels)?)
    }

    fn gauges(&self, name: &str, labels: &[&str]) -> prometheus::Result<GaugeVec> {
        self.add(GaugeVec::new(Self::opts(name)?, labels)?)
    }

    fn histograms(
        &self,
        name: &str,
        buckets: &[f64],
        labels: &[&str],
    ) -> prometheus::Result<HistogramVec> {
        let opts = HistogramOpts::from(Self::opts(name)?).buckets(buckets.to_vec());
        self.add(HistogramVec::new(opts, labels)?)
    }

    fn int_gauge(&self, name: &str) -> prometheus::Result<IntGauge> {
        self.add(IntGauge::with_opts(Self::opts(name)?)?)
    }

    fn int_counter(&self, name: &str) -> prometheus::Result<IntCounter> {
        self.add(IntCounter::with_opts(Self::opts(name)?)?)
    }
}

impl Metrics {
    pub fn new(registry: Registry) -> prometheus::Result<Metrics> {
        let m = Maker(&registry);
        let metrics = Metrics {
            requests: m
                .int_counters("sluice_requests_total", &["upstream", "family", "outcome"])?,
            upstream_responses: m.int_counters(
                "sluice_upstream_responses_total",
                &["upstream", "family", "status"],
            )?,
            upstream_duration: m.histograms(
                "sluice_upstream_duration_seconds",
                LATENCY_BUCKETS,
                &["upstream", "family"],
            )?,
            queue_wait: m.histograms(
                "sluice_queue_wait_seconds",
                LATENCY_BUCKETS,
                &["upstream", "family"],
            )?,
            queue_depth: m.int_gauges("sluice_queue_depth", &["upstream", "family"])?,
            queue_cost: m.int_gauges("sluice_queue_cost", &["upstream", "family", "unit"])?,
            queue_wait_cost: m.counters(
                "sluice_queue_wait_cost_seconds_total",
                &["upstream", "family", "unit"],
            )?,
            rejections: m
                .int_counters("sluice_rejections_total", &["upstream", "family", "reason"])?,
            partitions: m.int_gauge("sluice_partitions")?,
            upgrades: m.int_counters("sluice_upgrades_total", &["upstream", "result"])?,
            tunnels_refused: m.int_counters("sluice_tunnels_refused_total", &["reason"])?,
            local_failures: m.int_counter("sluice_local_failures_total")?,
            upstream_connections: m.int_gauge("sluice_upstream_connections")?,
            upgraded: m.int_gauges("sluice_upgraded_connections", &["upstream"])?,
            upstream_partitions: m.int_gauges("sluice_upstream_partitions", &["upstream"])?,
            max_partitions: m.int_gauges("sluice_upstream_max_partitions", &["upstream"])?,
            configured_rate: m.gauges("sluice_configured_rate", &["upstream"])?,
            effective_rate: m.gauges("sluice_effective_rate", &["upstream"])?,
            learned_partitions: m.int_gauges("sluice_learned_partitions", &["upstream"])?,
            adaptive_share: m.gauges("sluice_adaptive_rate_ratio", &["upstream", "family"])?,
            replay_bytes: m.int_gauge("sluice_replay_buffered_bytes")?,
            client_connections: m.int_gauge("sluice_client_connections")?,
            connections_refused: m.int_counter("sluice_connections_refused_total")?,
            upstream_429: m.int_counters(
                "sluice_upstream_429_total",
                &["upstream", "family", "action"],
            )?,
            edge_429: m.int_counters("sluice_edge_429_total", &["upstream", "family"])?,
            cost: m.int_counters(
                "sluice_cost_total",
                &["upstream", "family", "unit", "stage"],
            )?,
            retries: m.int_counters("sluice_retries_total", &["upstream", "family", "reason"])?,
            breaker_state: m.int_gauges("sluice_breaker_state", &["upstream", "state"])?,
            family_breaker_state: m.int_gauges(
                "sluice_family_breaker_state",
                &["upstream", "family", "state"],
            )?,
            tls_handshake_failures: m.int_counter("sluice_tls_handshake_failures_total")?,
            config_reloads: m.int_counters("sluice_config_reloads_total", &["result"])?,
            config_info: m.int_gauges("sluice_config_info", &["sha256"])?,
            config_last_reload_successful: m.int_gauge("sluice_config_last_reload_successful")?,
            cluster_calls: m.histograms(
                "sluice_cluster_call_duration_seconds",
                CLUSTER_CALL_BUCKETS,
                &["op"],
            )?,
            cluster_errors: m.int_counters("sluice_cluster_errors_total", &["kind"])?,
            cluster_mode: m.int_gauges("sluice_cluster_mode", &["mode"])?,
            cluster_reservations: m
                .int_counters("sluice_cluster_reservations_total", &["result"])?,
            cluster_wait: m.histograms(
                "sluice_cluster_wait_seconds",
                LATENCY_BUCKETS,
                &["upstream", "family"],
            )?,
            log_lines_dropped: m.int_counter("sluice_log_lines_dropped_total")?,
            registry: registry.clone(),
        };
        metrics.config_last_reload_successful.set(1);
        // Both results exist from the start, so a rate() over failures is never absent.
        for r in ["success", "failure"] {
            metrics.config_reloads.with_label_values(&[r]);
        }
        // CPU seconds, resident memory, open and maximum descriptors, start time: read
        // from /proc at each scrape, as every Prometheus client library exports them.
        #[cfg(target_os = "linux")]
        registry.register(Box::new(
            prometheus::process_collector::ProcessCollector::for_self(),
        ))?;
        m.int_gauges("sluice_build_info", &["version", "revision"])?
            .with_label_values(&[env!("CARGO_PKG_VERSION"), REVISION])
            .set(1);
        Ok(metrics)
    }

    /// Shows `sha256` as the config in force, in place of `previous`.
    pub(crate) fn config_info(&self, sha256: &str, previous: Option<&str>) {
        if let Some(p) = previous.filter(|p| *p != sha256) {
            let _ = self.config_info.remove_label_values(&[p]);
        }
        self.config_info.with_label_values(&[sha256]).set(1);
    }

    /// Drops the circuit gauges of an upstream a reload removed, so no stale state is
    /// exported for it. Counters and histograms stay: they are history.
    pub(crate) fn forget_upstream(&self, upstream: &str, families: &[&str]) {
        for state in ["closed", "open", "half_open"] {
            let _ = self.breaker_state.remove_label_values(&[upstream, state]);
            for f in families {
                let _ = self
                    .family_breaker_state
                    .remove_label_values(&[upstream, f, state]);
            }
        }
    }

    /// Prometheus text exposition of everything registered.
    pub(crate) fn render(&self) -> String {
        let (now, seen) = (crate::log::dropped_lines(), self.log_lines_dropped.get());
        if now > seen {
            self.log_lines_dropped.inc_by(now - seen);
        }
        let families = self.registry.gather();
        prometheus::TextEncoder::new()
            .encode_to_string(&families)
            .unwrap_or_else(|e| format!("# encoding failed: {e}\n"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::route::Route;

    /// Each route's handles count under the labels `route::labels` gives it, common
    /// outcomes and others alike.
    #[test]
    fn route_handles_count_under_the_route_labels() {
        let config = crate::config::Config::parse(
            "[[upstream]]\nname = \"api\"\nhosts = [\"api.example\"]\n\
             [[upstream.family]]\nname = \"orders\"\npaths = [\"/o/**\"]\n",
            "t.toml",
        )
        .unwrap();
        let metrics = Metrics::new(Registry::new()).unwrap();
        let table = RouteTable::new(&config, &metrics);
        // Building the handles creates no series: one appears once it counts something.
        let empty = metrics.render();
        assert!(!empty.contains("sluice_requests_total{"), "{empty}");
        assert!(
            !empty.contains("sluice_upstream_duration_seconds_bucket{"),
            "{empty}"
        );
        let route = |family| Route {
            upstream: 0,
            family,
            partition: None,
            tenant: None,
        };
        for (r, outcome) in [
            (None, "200"),
            (Some(route(Some(0))), "429"),
            (Some(route(Some(0))), "sluice_queue_full"),
            (Some(route(None)), "200"),
            (Some(route(None)), "200"),
        ] {
            table.get(r.as_ref()).requests.inc(outcome);
            table.get(r.as_ref()).upstream_responses.inc(outcome);
            table.get(r.as_ref()).upstream_duration(0.01);
        }
        for (labels, n) in [
            (["unmatched", "-", "200"], 1),
            (["api", "orders", "429"], 1),
            (["api", "orders", "sluice_queue_full"], 1),
            (["api", "-", "200"], 2),
        ] {
            assert_eq!(metrics.requests.with_label_values(&labels).get(), n);
            assert_eq!(
                metrics.upstream_responses.with_label_values(&labels).get(),
                n
            );
        }
        assert_eq!(
            metrics
                .upstream_duration
                .with_label_values(&["api", "-"])
                .get_sample_count(),
            2
        );
        // Series appear only once they count something.
        let text = metrics.render();
        assert!(!text.contains(r#"outcome="201""#), "{text}");
    }
}
