//! Prometheus metrics: typed handles registered once on a registry the caller owns.
//! Names and labels are the contract in PRODUCT.md; label values are bounded (upstream and
//! family names from the config, status codes, reasons), never hosts, URLs or keys.

use std::sync::OnceLock;

use prometheus::{
    GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry,
};

#[derive(Clone)]
pub struct Metrics {
    pub registry: Registry,
    /// `{upstream, family, outcome}`: one per request, outcome = final status or `sluice_<reason>`.
    pub requests: IntCounterVec,
    /// `{upstream, family, status}`: one per upstream attempt.
    pub upstream_responses: IntCounterVec,
    /// `{upstream, family}`: time from sending an attempt to its response headers.
    pub upstream_duration: HistogramVec,
    /// `{upstream, family}`: time from arrival to admission, zero waits included.
    pub queue_wait: HistogramVec,
    /// `{upstream, family}`: requests waiting now, over all partitions.
    pub queue_depth: IntGaugeVec,
    /// `{upstream, family, reason}`: requests refused by the limiter's bounds.
    pub rejections: IntCounterVec,
    /// `{upstream, family, action}`: upstream 429s by what was done about them.
    pub upstream_429: IntCounterVec,
    /// `{upstream, family}`: upstream 429s for requests admitted at the instant a rate
    /// limit allowed them: the provider's window edge is later than sluice believed.
    pub edge_429: IntCounterVec,
    /// `{upstream, family, reason}`: retries made (reason: status or failure) or refused
    /// (`budget_exhausted`).
    pub retries: IntCounterVec,
    /// `{upstream, state}`: 1 for the current state of each upstream's circuit.
    pub breaker_state: IntGaugeVec,
    /// `{upstream, family, state}`: the same for families with a circuit of their own.
    pub family_breaker_state: IntGaugeVec,
    /// Failed TLS handshakes with clients of intercepted tunnels (untrusted CA, ...).
    pub tls_handshake_failures: prometheus::IntCounter,
    /// Live partitions (sets of buckets) over all upstreams, as of the last sweep.
    pub partitions: IntGauge,
    /// `{upstream, result}`: requests that asked to switch protocols (`Upgrade`), by
    /// result: `switched`, `refused` (the upstream answered otherwise), `failed`.
    pub upgrades: IntCounterVec,
    /// `{upstream}`: switched connections open now.
    pub upgraded: IntGaugeVec,
    /// `{upstream}`: its live partitions, as of the last sweep (or the scrape, when few).
    pub upstream_partitions: IntGaugeVec,
    /// `{upstream}`: a keyed upstream's `max_partitions`.
    pub max_partitions: IntGaugeVec,
    /// `{upstream}`: requests per second its tightest rate limit allows, as configured.
    pub configured_rate: GaugeVec,
    /// `{upstream}`: requests per second its slowest partition may send now, by the
    /// provider's announced budget (`learn`); the configured rate when none is slowed.
    pub effective_rate: GaugeVec,
    /// `{upstream}`: partitions pacing to an announced budget now.
    pub learned_partitions: IntGaugeVec,
    /// `{upstream, family}`: the lowest share of its configured rate an adaptive family's
    /// partition may send now.
    pub adaptive_share: GaugeVec,
    /// Request body bytes held for replay, as of the scrape.
    pub replay_bytes: IntGauge,
    /// Client connections open, as of the scrape.
    pub client_connections: IntGauge,
    /// Client connections answered 503 because `max_connections` were open.
    pub connections_refused: prometheus::IntCounter,
    /// `{op}`: Redis script calls (reserve, flush, absorb), from sending to the answer.
    pub cluster_calls: HistogramVec,
    /// `{kind}`: failed Redis calls, by `cluster::link::Fault` label.
    pub cluster_errors: IntCounterVec,
    /// `{mode}`: 1 for how global limits are decided now: redis, local, allow or deny.
    pub cluster_mode: IntGaugeVec,
    /// `{result}`: global admissions: reserved, later (beyond the horizon, asked again),
    /// too_late (beyond max_wait), handed_over, local, allowed, denied.
    pub cluster_reservations: IntCounterVec,
    /// `{upstream, family}`: time from a request's local admission to its global one.
    pub cluster_wait: HistogramVec,
    /// `{result}`: reloads by result, success or failure.
    pub config_reloads: IntCounterVec,
    /// `{sha256}`: 1 for the config in force.
    pub config_info: IntGaugeVec,
    /// 1 when the last reload (or the start) loaded the file, 0 when it was refused.
    pub config_last_reload_successful: prometheus::IntGauge,
    pub log_lines_dropped: prometheus::IntCounter,
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
pub struct RouteMetrics {
    /// `sluice_upstream_duration_seconds`.
    durations: HistogramVec,
    upstream_duration: Lazy<Histogram>,
    /// `sluice_requests_total` by outcome.
    pub requests: ByOutcome,
    /// `sluice_upstream_responses_total` by status.
    pub upstream_responses: ByOutcome,
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
pub struct ByOutcome {
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

    pub fn inc(&self, outcome: &str) {
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
    pub fn new(metrics: &Metrics, upstream: &str, family: &str) -> RouteMetrics {
        RouteMetrics {
            durations: metrics.upstream_duration.clone(),
            upstream_duration: Lazy::new(),
            requests: ByOutcome::new(&metrics.requests, upstream, family),
            upstream_responses: ByOutcome::new(&metrics.upstream_responses, upstream, family),
        }
    }

    /// Records an attempt's time to response headers.
    pub fn upstream_duration(&self, seconds: f64) {
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
pub struct RouteTable {
    upstreams: Vec<Vec<RouteMetrics>>,
    unmatched: RouteMetrics,
}

impl RouteTable {
    pub fn new(config: &crate::config::Config, metrics: &Metrics) -> RouteTable {
        let upstreams = config
            .upstreams
            .iter()
            .map(|u| {
                u.families
                    .iter()
                    .map(|f| f.name.as_str())
                    .chain(["-"])
                    .map(|f| RouteMetrics::new(metrics, &u.name, f))
                    .collect()
            })
            .collect();
        RouteTable {
            upstreams,
            unmatched: RouteMetrics::new(metrics, "unmatched", "-"),
        }
    }

    /// The handles of `route` (labelled as [`crate::route::labels`] names it).
    pub fn get(&self, route: Option<&crate::route::Route>) -> &RouteMetrics {
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
pub const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

impl Metrics {
    pub fn new(registry: Registry) -> prometheus::Result<Metrics> {
        let requests = IntCounterVec::new(
            Opts::new(
                "sluice_requests_total",
                "Requests handled, by final outcome",
            ),
            &["upstream", "family", "outcome"],
        )?;
        let upstream_responses = IntCounterVec::new(
            Opts::new(
                "sluice_upstream_responses_total",
                "Upstream responses, one per attempt",
            ),
            &["upstream", "family", "status"],
        )?;
        let upstream_duration = HistogramVec::new(
            HistogramOpts::new(
                "sluice_upstream_duration_seconds",
                "Time from sending an attempt upstream to its response headers",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
            &["upstream", "family"],
        )?;
        let queue_wait = HistogramVec::new(
            HistogramOpts::new(
                "sluice_queue_wait_seconds",
                "Time spent waiting for admission",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
            &["upstream", "family"],
        )?;
        let queue_depth = IntGaugeVec::new(
            Opts::new("sluice_queue_depth", "Requests waiting for admission"),
            &["upstream", "family"],
        )?;
        let rejections = IntCounterVec::new(
            Opts::new(
                "sluice_rejections_total",
                "Requests refused by the limiter's queue bounds",
            ),
            &["upstream", "family", "reason"],
        )?;
        let partitions = IntGauge::new(
            "sluice_partitions",
            "Live partitions (one per upstream and key value) as of the last idle sweep",
        )?;
        let upgrades = IntCounterVec::new(
            Opts::new(
                "sluice_upgrades_total",
                "Requests that asked to switch protocols (WebSocket), by result: switched, \
                 refused (the upstream answered otherwise) or failed",
            ),
            &["upstream", "result"],
        )?;
        let upgraded = IntGaugeVec::new(
            Opts::new(
                "sluice_upgraded_connections",
                "Connections switched to another protocol (WebSocket) open now",
            ),
            &["upstream"],
        )?;
        let upstream_partitions = IntGaugeVec::new(
            Opts::new(
                "sluice_upstream_partitions",
                "Live partitions of the upstream, as of the last idle sweep",
            ),
            &["upstream"],
        )?;
        let max_partitions = IntGaugeVec::new(
            Opts::new(
                "sluice_upstream_max_partitions",
                "Partitions a keyed upstream may have live (max_partitions); beyond it new key \
                 values are answered 503 partition_limit",
            ),
            &["upstream"],
        )?;
        let configured_rate = GaugeVec::new(
            Opts::new(
                "sluice_configured_rate",
                "Requests per second the upstream's tightest rate limit allows, as configured",
            ),
            &["upstream"],
        )?;
        let effective_rate = GaugeVec::new(
            Opts::new(
                "sluice_effective_rate",
                "Requests per second the upstream's slowest partition may send now, paced by \
                 the budget the provider announces (learn); the configured rate when none is slowed",
            ),
            &["upstream"],
        )?;
        let learned_partitions = IntGaugeVec::new(
            Opts::new(
                "sluice_learned_partitions",
                "Partitions pacing to a budget the provider announced, below their configured limits",
            ),
            &["upstream"],
        )?;
        let adaptive_share = GaugeVec::new(
            Opts::new(
                "sluice_adaptive_rate_ratio",
                "Lowest share of the configured rate an adaptive family's partition may send \
                 now, lowered by 429s the provider did not announce (1: not slowed)",
            ),
            &["upstream", "family"],
        )?;
        let replay_bytes = IntGauge::new(
            "sluice_replay_buffered_bytes",
            "Request body bytes held so that a retry can resend them (bounded by proxy.max_replay_memory)",
        )?;
        let client_connections = IntGauge::new(
            "sluice_client_connections",
            "Client connections open on the proxy listener, tunnels included",
        )?;
        let connections_refused = prometheus::IntCounter::new(
            "sluice_connections_refused_total",
            "Client connections answered 503 connection_limit because proxy.max_connections were open",
        )?;
        let upstream_429 = IntCounterVec::new(
            Opts::new(
                "sluice_upstream_429_total",
                "Upstream 429 responses by the action taken",
            ),
            &["upstream", "family", "action"],
        )?;
        let edge_429 = IntCounterVec::new(
            Opts::new(
                "sluice_edge_429_total",
                "Upstream 429s for requests admitted at a rate limit's edge: a larger margin \
                 would have held them back",
            ),
            &["upstream", "family"],
        )?;
        let retries = IntCounterVec::new(
            Opts::new(
                "sluice_retries_total",
                "Retries made, by cause, or refused by the budget",
            ),
            &["upstream", "family", "reason"],
        )?;
        let breaker_state = IntGaugeVec::new(
            Opts::new(
                "sluice_breaker_state",
                "1 for the current state of the upstream's circuit",
            ),
            &["upstream", "state"],
        )?;
        let family_breaker_state = IntGaugeVec::new(
            Opts::new(
                "sluice_family_breaker_state",
                "1 for the current state of a family's own circuit",
            ),
            &["upstream", "family", "state"],
        )?;
        let tls_handshake_failures = prometheus::IntCounter::new(
            "sluice_tls_handshake_failures_total",
            "Failed TLS handshakes with clients of intercepted tunnels",
        )?;
        let config_reloads = IntCounterVec::new(
            Opts::new(
                "sluice_config_reloads_total",
                "Config reloads by result (success or failure)",
            ),
            &["result"],
        )?;
        let config_info = IntGaugeVec::new(
            Opts::new(
                "sluice_config_info",
                "1 for the config in force, labelled with the SHA-256 of its file",
            ),
            &["sha256"],
        )?;
        let config_last_reload_successful = prometheus::IntGauge::new(
            "sluice_config_last_reload_successful",
            "1 when the last reload (or the start) loaded the config file, 0 when it was refused",
        )?;
        config_last_reload_successful.set(1);
        let cluster_calls = HistogramVec::new(
            HistogramOpts::new(
                "sluice_cluster_call_duration_seconds",
                "Redis script calls for shared limits, from sending to the answer",
            )
            .buckets(vec![
                0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
            ]),
            &["op"],
        )?;
        let cluster_errors = IntCounterVec::new(
            Opts::new(
                "sluice_cluster_errors_total",
                "Redis calls for shared limits that failed, by kind",
            ),
            &["kind"],
        )?;
        let cluster_mode = IntGaugeVec::new(
            Opts::new(
                "sluice_cluster_mode",
                "1 for how shared limits are decided now: redis, local, allow or deny",
            ),
            &["mode"],
        )?;
        let cluster_reservations = IntCounterVec::new(
            Opts::new(
                "sluice_cluster_reservations_total",
                "Admissions to shared limits, by result",
            ),
            &["result"],
        )?;
        let cluster_wait = HistogramVec::new(
            HistogramOpts::new(
                "sluice_cluster_wait_seconds",
                "Time from a request's local admission to its admission by the shared limits",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
            &["upstream", "family"],
        )?;
        registry.register(Box::new(cluster_calls.clone()))?;
        registry.register(Box::new(cluster_errors.clone()))?;
        registry.register(Box::new(cluster_mode.clone()))?;
        registry.register(Box::new(cluster_reservations.clone()))?;
        registry.register(Box::new(cluster_wait.clone()))?;
        // Both results exist from the start, so a rate() over failures is never absent.
        for r in ["success", "failure"] {
            config_reloads.with_label_values(&[r]);
        }
        registry.register(Box::new(config_reloads.clone()))?;
        registry.register(Box::new(config_info.clone()))?;
        registry.register(Box::new(config_last_reload_successful.clone()))?;
        registry.register(Box::new(tls_handshake_failures.clone()))?;
        registry.register(Box::new(upstream_429.clone()))?;
        registry.register(Box::new(edge_429.clone()))?;
        registry.register(Box::new(retries.clone()))?;
        registry.register(Box::new(breaker_state.clone()))?;
        registry.register(Box::new(family_breaker_state.clone()))?;
        registry.register(Box::new(partitions.clone()))?;
        registry.register(Box::new(upstream_partitions.clone()))?;
        registry.register(Box::new(upgrades.clone()))?;
        registry.register(Box::new(upgraded.clone()))?;
        registry.register(Box::new(max_partitions.clone()))?;
        registry.register(Box::new(configured_rate.clone()))?;
        registry.register(Box::new(effective_rate.clone()))?;
        registry.register(Box::new(learned_partitions.clone()))?;
        registry.register(Box::new(adaptive_share.clone()))?;
        registry.register(Box::new(replay_bytes.clone()))?;
        registry.register(Box::new(client_connections.clone()))?;
        registry.register(Box::new(connections_refused.clone()))?;
        registry.register(Box::new(requests.clone()))?;
        registry.register(Box::new(upstream_responses.clone()))?;
        registry.register(Box::new(upstream_duration.clone()))?;
        registry.register(Box::new(queue_wait.clone()))?;
        registry.register(Box::new(queue_depth.clone()))?;
        registry.register(Box::new(rejections.clone()))?;
        let log_lines_dropped = prometheus::IntCounter::new(
            "sluice_log_lines_dropped_total",
            "Log lines dropped because stderr was not read fast enough",
        )?;
        registry.register(Box::new(log_lines_dropped.clone()))?;
        // CPU seconds, resident memory, open and maximum descriptors, start time: read
        // from /proc at each scrape, as every Prometheus client library exports them.
        #[cfg(target_os = "linux")]
        registry.register(Box::new(
            prometheus::process_collector::ProcessCollector::for_self(),
        ))?;
        let build_info = IntGaugeVec::new(
            Opts::new(
                "sluice_build_info",
                "Always 1; the version and the source revision of this binary",
            ),
            &["version", "revision"],
        )?;
        build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION"), REVISION])
            .set(1);
        registry.register(Box::new(build_info))?;
        Ok(Metrics {
            registry,
            log_lines_dropped,
            requests,
            upstream_responses,
            upstream_duration,
            queue_wait,
            queue_depth,
            rejections,
            partitions,
            upstream_partitions,
            max_partitions,
            upgrades,
            upgraded,
            configured_rate,
            effective_rate,
            learned_partitions,
            adaptive_share,
            replay_bytes,
            client_connections,
            connections_refused,
            upstream_429,
            edge_429,
            retries,
            breaker_state,
            family_breaker_state,
            tls_handshake_failures,
            cluster_calls,
            cluster_errors,
            cluster_mode,
            cluster_reservations,
            cluster_wait,
            config_reloads,
            config_info,
            config_last_reload_successful,
        })
    }

    /// Shows `sha256` as the config in force, in place of `previous`.
    pub fn config_info(&self, sha256: &str, previous: Option<&str>) {
        if let Some(p) = previous.filter(|p| *p != sha256) {
            let _ = self.config_info.remove_label_values(&[p]);
        }
        self.config_info.with_label_values(&[sha256]).set(1);
    }

    /// Drops the circuit gauges of an upstream a reload removed, so no stale state is
    /// exported for it. Counters and histograms stay: they are history.
    pub fn forget_upstream(&self, upstream: &str, families: &[&str]) {
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
    pub fn render(&self) -> String {
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
