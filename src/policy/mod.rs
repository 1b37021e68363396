//! Resilience policies around the limiter: retry decisions and backoff, server wait hints,
//! the retry budget, 429 classification and the circuit breaker. Each is pure in `now`;
//! [`Policies`] holds the per-upstream state the pipeline shares between requests.

pub(crate) mod announced;
pub(crate) mod backoff;
pub(crate) mod breaker;
pub(crate) mod budget;
pub(crate) mod classify;
pub(crate) mod hints;
mod window;

use parking_lot::{Mutex, MutexGuard};
use std::sync::Arc;

use http::Method;
use prometheus::IntGaugeVec;
use tokio::time::Instant;

use breaker::{Breaker, State};
use budget::RetryBudget;

use crate::config::{Action, Config, RetryOn};
use crate::metrics::Metrics;

/// Methods RFC 9110 calls idempotent. POST and PATCH are retried only with an
/// idempotency key: a POST that timed out may have succeeded.
pub(crate) fn is_idempotent(method: &Method) -> bool {
    matches!(
        method.as_str(),
        "GET" | "HEAD" | "OPTIONS" | "TRACE" | "PUT" | "DELETE"
    )
}

/// Whether an attempt's outcome asks for another attempt. A classification rule decides
/// first (`fail` never retries, `retry` and `cooldown` do); otherwise the `retry.on` list:
/// statuses such as 400, 401, 403, 404, 409 or 422 are retried only if listed there.
pub(crate) fn wants_retry(
    status: Option<u16>,
    failure: Option<RetryOn>,
    action: Option<Action>,
    on: &[RetryOn],
) -> bool {
    match action {
        Some(Action::Fail) => false,
        Some(Action::Retry | Action::Cooldown) => true,
        None => status
            .map(RetryOn::Status)
            .or(failure)
            .is_some_and(|o| on.contains(&o)),
    }
}

/// A circuit with the gauge that shows its state.
pub(crate) struct Circuit {
    breaker: Mutex<Breaker>,
    gauge: IntGaugeVec,
    labels: Vec<String>,
}

impl Circuit {
    fn new(breaker: Breaker, gauge: IntGaugeVec, labels: Vec<String>) -> Circuit {
        let c = Circuit {
            breaker: Mutex::new(breaker),
            gauge,
            labels,
        };
        c.show(State::Closed);
        c
    }

    fn show(&self, state: State) {
        for s in ["closed", "open", "half_open"] {
            let mut l: Vec<&str> = self.labels.iter().map(String::as_str).collect();
            l.push(s);
            self.gauge
                .with_label_values(&l)
                .set(i64::from(s == state.name()));
        }
    }

    /// Runs `f` on the breaker and updates the gauge if the state changed.
    pub(crate) fn with<R>(&self, f: impl FnOnce(&mut Breaker) -> R) -> R {
        let mut b = self.breaker.lock();
        let before = b.state();
        let r = f(&mut b);
        let after = b.state();
        if before.name() != after.name() {
            tracing::warn!(circuit = %self.labels.join("/"), from = before.name(), to = after.name(), "circuit breaker changed state");
            self.show(after);
        }
        r
    }
}

/// An upstream's shared policy state. Each piece is shared with the previous config's
/// after a reload that left its settings unchanged, so a reload neither closes an open
/// circuit nor refills a spent retry budget.
pub(crate) struct UpstreamPolicies {
    pub(crate) budget: Arc<Mutex<RetryBudget>>,
    pub(crate) breaker: Arc<Circuit>,
    /// Own circuits of families that set `[breaker]`; `None` shares the upstream's.
    pub(crate) family_breakers: Vec<Option<Arc<Circuit>>>,
}

impl UpstreamPolicies {
    pub(crate) fn circuit(&self, family: Option<usize>) -> &Circuit {
        family
            .and_then(|f| self.family_breakers[f].as_ref())
            .unwrap_or(&self.breaker)
    }

    pub(crate) fn budget(&self) -> MutexGuard<'_, RetryBudget> {
        self.budget.lock()
    }
}

/// Shared policy state of every upstream, by upstream index.
pub(crate) struct Policies {
    pub(crate) upstreams: Vec<UpstreamPolicies>,
}

impl Policies {
    pub(crate) fn new(config: &Config, metrics: &Metrics) -> Policies {
        Policies::carry(config, metrics, None)
    }

    /// The policies of `config`, keeping the state of `previous` (the config being
    /// replaced, with its policies) wherever an upstream's or family's settings are equal.
    pub(crate) fn carry(
        config: &Config,
        metrics: &Metrics,
        previous: Option<(&Config, &Policies)>,
    ) -> Policies {
        let now = Instant::now();
        let upstreams = config
            .upstreams
            .iter()
            .map(|u| {
                let old = previous.and_then(|(c, p)| {
                    let i = c.upstreams.iter().position(|o| o.name == u.name)?;
                    Some((&c.upstreams[i], &p.upstreams[i]))
                });
                let budget = match old {
                    Some((o, p)) if o.policy.retry.budget == u.policy.retry.budget => {
                        p.budget.clone()
                    }
                    _ => Arc::new(Mutex::new(RetryBudget::new(&u.policy.retry.budget, now))),
                };
                let breaker = match old {
                    Some((o, p)) if o.policy.breaker == u.policy.breaker => p.breaker.clone(),
                    _ => Arc::new(Circuit::new(
                        Breaker::new(&u.policy.breaker, now),
                        metrics.breaker_state.clone(),
                        vec![u.name.clone()],
                    )),
                };
                let family_breakers = u
                    .families
                    .iter()
                    .map(|f| {
                        if !f.own_breaker {
                            return None;
                        }
                        let kept = old.and_then(|(o, p)| {
                            let i = o.families.iter().position(|of| of.name == f.name)?;
                            let same = o.families[i].own_breaker
                                && o.families[i].policy.breaker == f.policy.breaker;
                            same.then(|| p.family_breakers[i].clone()).flatten()
                        });
                        Some(kept.unwrap_or_else(|| {
                            Arc::new(Circuit::new(
                                Breaker::new(&f.policy.breaker, now),
                                metrics.family_breaker_state.clone(),
                                vec![u.name.clone(), f.name.clone()],
                            ))
                        }))
                    })
                    .collect();
                UpstreamPolicies {
                    budget,
                    breaker,
                    family_breakers,
                }
            })
            .collect();
        Policies { upstreams }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The retry matrix: method × idempotency key × outcome, with the default `on` list.
    #[test]
    fn retry_matrix() {
        let on = [408, 429, 502, 503, 504].map(RetryOn::Status).to_vec();
        let on = [on, vec![RetryOn::Connect, RetryOn::Reset, RetryOn::Timeout]].concat();
        let methods = [
            "GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE", "POST", "PATCH",
        ];
        for m in methods {
            let method = Method::from_bytes(m.as_bytes()).unwrap();
            for has_key in [false, true] {
                let safe = is_idempotent(&method) || has_key;
                assert_eq!(
                    safe,
                    !matches!(m, "POST" | "PATCH") || has_key,
                    "{m} key={has_key}"
                );
                for status in [
                    200, 301, 400, 401, 403, 404, 408, 409, 422, 429, 500, 502, 503, 504,
                ] {
                    let action = classify::classify(&[], status, None);
                    let retried = safe && wants_retry(Some(status), None, action, &on);
                    let expected = safe && matches!(status, 408 | 429 | 502 | 503 | 504);
                    assert_eq!(retried, expected, "{m} key={has_key} status={status}");
                }
                for failure in [RetryOn::Connect, RetryOn::Reset, RetryOn::Timeout] {
                    assert_eq!(safe && wants_retry(None, Some(failure), None, &on), safe);
                }
            }
        }
        // Listed explicitly, a 409 is retried; a rule saying `fail` wins over the list.
        assert!(wants_retry(Some(409), None, None, &[RetryOn::Status(409)]));
        assert!(!wants_retry(Some(429), None, Some(Action::Fail), &on));
        assert!(wants_retry(Some(500), None, Some(Action::Retry), &[]));
    }
}
