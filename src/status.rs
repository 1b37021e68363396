//! What the status page (`GET /` on the admin listener) shows beyond the limiter's
//! state now: the last few minutes of each upstream and family, sampled from the
//! metrics once a second into a bounded ring, and the process's own facts (uptime, the
//! last reload). The page and its JSON feed are built in `admin`.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, SystemTime};

use tokio::time::Instant;

use parking_lot::Mutex;
use prometheus::core::Collector;

use crate::metrics::Metrics;

/// Samples kept per upstream and family: three minutes at one a second.
pub(crate) const HISTORY: usize = 180;

/// How often the ring is sampled.
pub(crate) const EVERY: Duration = Duration::from_secs(1);

/// One upstream and family's counters at one instant, as the metrics have them.
#[derive(Debug, Clone, Default)]
pub(crate) struct Sample {
    /// Admissions so far (`sluice_queue_wait_seconds` count).
    pub(crate) admitted: u64,
    /// Waiting now (`sluice_queue_depth`).
    pub(crate) depth: i64,
    /// Refused by the queue bounds so far (`sluice_rejections_total`).
    pub(crate) rejected: u64,
    /// Cumulative wait histogram buckets, by upper bound in seconds.
    pub(crate) wait_buckets: Vec<(f64, u64)>,
    /// Upstream answers so far by status (`sluice_upstream_responses_total`).
    pub(crate) statuses: HashMap<String, u64>,
}

/// Labels `upstream` and `family` of a collected series, and the value of `extra`
/// (each empty when the series has none).
pub(crate) fn labels<'a>(
    m: &'a prometheus::proto::Metric,
    extra: &str,
) -> (&'a str, &'a str, &'a str) {
    let (mut u, mut f, mut x) = ("", "", "");
    for l in m.get_label() {
        match l.name() {
            "upstream" => u = l.value(),
            "family" => f = l.value(),
            n if n == extra => x = l.value(),
            _ => {}
        }
    }
    (u, f, x)
}

type Key = (String, String);

#[derive(Debug)]
pub(crate) struct Status {
    pub(crate) started: Instant,
    last_reload: Mutex<Option<Reloaded>>,
    ring: Mutex<HashMap<Key, VecDeque<Sample>>>,
}

/// The last reload's outcome, as the page shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub(crate) struct Reloaded {
    pub(crate) at: String,
    pub(crate) result: &'static str,
    /// The file's position and what is wrong there, when it failed.
    pub(crate) error: Option<String>,
}

impl Default for Status {
    fn default() -> Status {
        Status {
            started: Instant::now(),
            last_reload: Mutex::new(None),
            ring: Mutex::new(HashMap::new()),
        }
    }
}

impl Status {
    /// A reload ended: `error` is `None` when it succeeded.
    pub(crate) fn reloaded(&self, error: Option<String>) {
        *self.last_reload.lock() = Some(Reloaded {
            at: httpdate::fmt_http_date(SystemTime::now()),
            result: if error.is_none() {
                "success"
            } else {
                "failure"
            },
            error,
        });
    }

    pub(crate) fn last_reload(&self) -> Option<Reloaded> {
        self.last_reload.lock().clone()
    }

    /// The last reload as anyone who reaches the admin port may see it: where the file is
    /// wrong and what kind of error, without the values the message quotes (an API key
    /// pasted into the wrong field would be one). `POST /reload` and the log say all.
    pub(crate) fn last_reload_public(&self) -> Option<Reloaded> {
        self.last_reload().map(|mut r| {
            r.error = r.error.map(|e| without_values(&e));
            r
        })
    }

    /// Reads the metrics once and appends a sample for every upstream and family they
    /// have series for; those gone from the metrics (a reload removed them) leave the ring.
    /// Reading never creates a series.
    pub(crate) fn sample(&self, m: &Metrics) {
        let mut now: HashMap<Key, Sample> = HashMap::new();
        let key = |u: &str, f: &str| (u.to_string(), f.to_string());
        for mf in m.queue_wait.collect() {
            for s in mf.get_metric() {
                let (u, f, _) = labels(s, "");
                let h = s.get_histogram();
                let e = now.entry(key(u, f)).or_default();
                e.admitted = h.get_sample_count();
                e.wait_buckets = h
                    .get_bucket()
                    .iter()
                    .map(|b| (b.upper_bound(), b.cumulative_count()))
                    .collect();
            }
        }
        for mf in m.queue_depth.collect() {
            for s in mf.get_metric() {
                let (u, f, _) = labels(s, "");
                now.entry(key(u, f)).or_default().depth = s.get_gauge().get_value() as i64;
            }
        }
        for mf in m.rejections.collect() {
            for s in mf.get_metric() {
                let (u, f, _) = labels(s, "");
                now.entry(key(u, f)).or_default().rejected += s.get_counter().get_value() as u64;
            }
        }
        for mf in m.upstream_responses.collect() {
            for s in mf.get_metric() {
                let (u, f, status) = labels(s, "status");
                *now.entry(key(u, f))
                    .or_default()
                    .statuses
                    .entry(status.to_string())
                    .or_default() += s.get_counter().get_value() as u64;
            }
        }
        let mut ring = self.ring.lock();
        ring.retain(|k, _| now.contains_key(k));
        for (k, sample) in now {
            let r = ring.entry(k).or_default();
            if r.len() == HISTORY {
                r.pop_front();
            }
            r.push_back(sample);
        }
    }

    /// What the page shows of `upstream`/`family` from its history, if it has one.
    pub(crate) fn summary(&self, upstream: &str, family: &str) -> Option<serde_json::Value> {
        let ring = self.ring.lock();
        let r = ring.get(&(upstream.to_string(), family.to_string()))?;
        let last = r.back()?;
        // Rates over the last 10 s; the wait percentiles and answers over the last minute.
        let ago = |n: usize| &r[r.len().saturating_sub(n + 1)];
        let span = |n: usize| (r.len() - 1).min(n).max(1) as f64 * EVERY.as_secs_f64();
        let ten = ago(10);
        let minute = ago(60);
        let per_s = |now: u64, then: u64, n| now.saturating_sub(then) as f64 / span(n);
        let waits: Vec<(f64, u64)> = last
            .wait_buckets
            .iter()
            .zip(
                minute
                    .wait_buckets
                    .iter()
                    .chain(std::iter::repeat(&(0.0, 0))),
            )
            .map(|(&(le, now), &(_, then))| (le, now.saturating_sub(then)))
            .collect();
        let mut statuses: Vec<(String, f64)> = last
            .statuses
            .iter()
            .map(|(s, n)| {
                let then = minute.statuses.get(s).copied().unwrap_or(0);
                (s.clone(), n.saturating_sub(then) as f64 * 60.0 / span(60))
            })
            .filter(|(_, n)| *n > 0.0)
            .collect();
        statuses.sort_by(|a, b| a.0.cmp(&b.0));
        let history: Vec<(u64, i64)> = r
            .iter()
            .zip(r.iter().skip(1))
            .map(|(a, b)| (b.admitted.saturating_sub(a.admitted), b.depth))
            .collect();
        Some(serde_json::json!({
            "queue_depth": last.depth,
            "admitted_per_second": per_s(last.admitted, ten.admitted, 10),
            "rejected_per_second": per_s(last.rejected, ten.rejected, 10),
            "wait_p50_ms": quantile(&waits, 0.5).map(|s| s * 1000.0),
            "wait_p99_ms": quantile(&waits, 0.99).map(|s| s * 1000.0),
            "answers_per_minute": statuses.into_iter().map(|(k, v)| (k, serde_json::Value::from(v))).collect::<serde_json::Map<_, _>>(),
            "history": {
                "admitted_per_second": history.iter().map(|h| h.0).collect::<Vec<_>>(),
                "queue_depth": history.iter().map(|h| h.1).collect::<Vec<_>>(),
            },
        }))
    }
}

/// The `q` quantile of a histogram's bucket counts (cumulative, by upper bound), as
/// Prometheus's `histogram_quantile` estimates it: linear within the bucket. `None`
/// with no observations.
pub(crate) fn quantile(buckets: &[(f64, u64)], q: f64) -> Option<f64> {
    let total = buckets.last()?.1;
    if total == 0 {
        return None;
    }
    let rank = q * total as f64;
    let mut lower = (0.0, 0u64);
    for &(le, count) in buckets {
        if count as f64 >= rank {
            let within = count - lower.1;
            let share = if within == 0 {
                0.0
            } else {
                (rank - lower.1 as f64) / within as f64
            };
            return Some(lower.0 + (le - lower.0) * share);
        }
        lower = (le, count);
    }
    Some(lower.0)
}

/// `message` with what it quotes (between double quotes or backticks) left out.
fn without_values(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    let mut open: Option<char> = None;
    for c in message.chars() {
        match open {
            Some(q) if c == q => {
                out.push('…');
                out.push(c);
                open = None;
            }
            Some(_) => {}
            None => {
                out.push(c);
                if c == '"' || c == '`' {
                    open = Some(c);
                }
            }
        }
    }
    if open.is_some() {
        out.push('…');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus::Registry;

    #[test]
    fn reload_errors_keep_the_place_and_kind_not_the_values() {
        assert_eq!(
            without_values(
                "sluice.toml:3:9: invalid type: string \"sk_live_4242\", expected a duration"
            ),
            "sluice.toml:3:9: invalid type: string \"…\", expected a duration"
        );
        assert_eq!(
            without_values("a.toml:1:1: unknown field `tokn`, expected `token`"),
            "a.toml:1:1: unknown field `…`, expected `…`"
        );
        assert_eq!(without_values("cut \"sk_live"), "cut \"…");
        assert_eq!(without_values("no quotes: 3:4"), "no quotes: 3:4");
    }

    #[test]
    fn quantiles_interpolate_within_a_bucket() {
        let b = [(0.01, 50), (0.1, 90), (1.0, 100)];
        assert_eq!(quantile(&b, 0.5), Some(0.01));
        assert!((quantile(&b, 0.7).unwrap() - 0.055).abs() < 1e-9);
        assert!((quantile(&b, 0.99).unwrap() - 0.91).abs() < 1e-9);
        assert_eq!(quantile(&[(0.1, 0)], 0.5), None);
    }

    #[test]
    fn the_ring_is_bounded_and_reading_creates_no_series() {
        let m = Metrics::new(Registry::new()).unwrap();
        let s = Status::default();
        s.sample(&m);
        assert!(s.summary("api", "-").is_none());
        assert!(
            !m.render().contains("sluice_queue_depth{"),
            "no series made up"
        );
        m.queue_depth.with_label_values(&["api", "-"]).set(7);
        for i in 0..(HISTORY as u64 + 20) {
            m.queue_wait.with_label_values(&["api", "-"]).observe(0.002);
            if i % 2 == 0 {
                m.upstream_responses
                    .with_label_values(&["api", "-", "200"])
                    .inc();
            }
            s.sample(&m);
        }
        let v = s.summary("api", "-").unwrap();
        assert_eq!(v["queue_depth"], 7);
        assert_eq!(
            v["history"]["admitted_per_second"]
                .as_array()
                .unwrap()
                .len(),
            HISTORY - 1
        );
        assert_eq!(v["admitted_per_second"], 1.0);
        assert_eq!(v["answers_per_minute"]["200"], 30.0);
        let p99 = v["wait_p99_ms"].as_f64().unwrap();
        assert!((1.0..=5.0).contains(&p99), "{v}");
    }
}
