//! `sluice explain`: what a request would get — upstream, family, partition, limits and
//! policies — computed by the same routing code the proxy uses.

use std::fmt::{self, Write};

use http::{HeaderMap, Method, Uri};

use crate::config::units::fmt_duration;
use crate::config::{
    Config, CounterAlign, Family, Jitter, Limit, Policy, Priority, RetryOn, Rounding, TlsMode,
    Unmatched, Upstream, WindowAlign,
};
use crate::policy::is_idempotent;
use crate::route::{Route, Router, normalize_host};

impl fmt::Display for Limit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let on_clock = |offset: &Option<std::time::Duration>| match offset {
            Some(o) if !o.is_zero() => format!(", on the clock + {}", fmt_duration(*o)),
            _ => ", on the clock".to_string(),
        };
        let text = match self {
            Limit::TokenBucket {
                rate, per, burst, ..
            } => format!(
                "token_bucket {rate} per {} (burst {burst})",
                fmt_duration(*per)
            ),
            Limit::SlidingWindow {
                permits, window, ..
            } => format!("sliding_window {permits} per {}", fmt_duration(*window)),
            Limit::FixedWindow {
                permits,
                window,
                align,
                offset,
                ..
            } => {
                let edges = match align {
                    WindowAlign::First => String::new(),
                    WindowAlign::Clock => on_clock(offset),
                };
                format!(
                    "fixed_window {permits} per {}{edges}",
                    fmt_duration(*window)
                )
            }
            Limit::SlidingCounter {
                permits,
                window,
                align,
                offset,
                rounding,
                ..
            } => {
                let edges = match align {
                    CounterAlign::Any => ", any alignment".to_string(),
                    CounterAlign::Clock => on_clock(offset),
                };
                let rounding = match rounding {
                    Rounding::Down => "",
                    Rounding::None => ", unrounded",
                };
                format!(
                    "sliding_counter {permits} per {}{edges}{rounding}",
                    fmt_duration(*window)
                )
            }
            Limit::LeakyBucket {
                rate, per, burst, ..
            } => format!(
                "leaky_bucket {rate} per {} (burst {burst})",
                fmt_duration(*per)
            ),
            Limit::Published {
                permits, window, ..
            } => format!("published {permits} per {}", fmt_duration(*window)),
            Limit::Concurrency { max, .. } => format!("concurrency {max} in flight"),
        };
        f.write_str(&text)?;
        if let Some(unit) = &self.unit_ref().name {
            write!(f, ", in {unit}")?;
        }
        if let Some(m) = self.margin() {
            write!(f, ", margin {}", fmt_duration(m))?;
            if self.margin_spec().is_none() {
                f.write_str(" (default)")?;
            }
        }
        if self.is_global() {
            f.write_str(" (global)")?;
        }
        Ok(())
    }
}

/// The provider algorithms a limit keeps within at its own numbers, and those it can
/// overrun with the worst it lets through (`limit::exposure`).
fn against(l: &Limit) -> Vec<String> {
    let Some(verdicts) = crate::limit::exposure::exposure(l) else {
        return Vec::new();
    };
    let (within, over): (Vec<_>, Vec<_>) = verdicts.iter().partition(|v| v.within());
    let mut out = Vec::new();
    if !within.is_empty() {
        let names: Vec<_> = within.iter().map(|v| v.algorithm.name()).collect();
        out.push(format!("  within {}", names.join(", ")));
    }
    out.extend(
        over.iter()
            .map(|v| format!("  overruns {}: {}", v.algorithm.name(), v.overrun())),
    );
    out
}

#[derive(Debug, thiserror::Error)]
pub enum ExplainError {
    #[error("URL must be absolute (http://host/path or https://host/path)")]
    NotAbsolute,
    #[error("unsupported scheme {0:?}")]
    Scheme(String),
}

/// What the egress rules say about the destination, as far as is known without a lookup
/// (names are checked on the addresses they resolve to when the request is made).
fn egress(config: &Config, scheme: &str, host: &str, port: u16) -> String {
    let rules = crate::egress::Rules::new(config);
    // An https:// URL reaches sluice as CONNECT.
    if scheme == "https"
        && let Err(e) = rules.connect_port(host, port)
    {
        return format!("refused with 403 sluice_denied: {e}");
    }
    match host.parse::<std::net::IpAddr>() {
        Ok(ip) => match crate::egress::Resolver::default().check(&rules, host, ip, port) {
            Ok(()) => "allowed".into(),
            Err(e) => format!("refused with 403 sluice_denied: {e}"),
        },
        Err(_) => format!("checked on the addresses {host} resolves to, when it is requested"),
    }
}

pub fn explain(
    config: &Config,
    method: &Method,
    url: &Uri,
    headers: &HeaderMap,
) -> Result<String, ExplainError> {
    explain_request(config, method, url, headers, None)
}

/// As [`explain`], for a request with `body` (`sluice explain -d`): a priced family's
/// cost is estimated from it.
pub fn explain_request(
    config: &Config,
    method: &Method,
    url: &Uri,
    headers: &HeaderMap,
    body: Option<&[u8]>,
) -> Result<String, ExplainError> {
    let (scheme, host) = match (url.scheme_str(), url.host()) {
        (Some(s), Some(h)) => (s, normalize_host(h)),
        _ => return Err(ExplainError::NotAbsolute),
    };
    let port = match (scheme, url.port_u16()) {
        (_, Some(p)) => p,
        ("http", None) => 80,
        ("https", None) => 443,
        (other, None) => return Err(ExplainError::Scheme(other.to_string())),
    };
    let path = url.path();
    let mut out = String::new();
    line(&mut out, "request", &format!("{method} {url}"));
    line(&mut out, "egress", &egress(config, scheme, &host, port));

    let router = Router::new(&config.upstreams);
    let Some(upstream_idx) = router.upstream(&host, port) else {
        let what = match config.proxy.unmatched {
            Unmatched::Pass => "none: unmatched = \"pass\", forwarded without limits",
            Unmatched::Deny => "none: unmatched = \"deny\", refused with 403 sluice_denied",
        };
        line(&mut out, "upstream", what);
        return Ok(out);
    };
    let u = &config.upstreams[upstream_idx];
    let pattern = u
        .hosts
        .iter()
        .find(|p| p.matches(&host, port))
        .map(|p| p.to_string());
    line(
        &mut out,
        "upstream",
        &format!("{} (host pattern {})", u.name, pattern.unwrap_or_default()),
    );

    // A blind tunnel carries no method or path: only upstream-level limits could apply.
    let tunnelled = scheme == "https" && u.tls == TlsMode::Tunnel;
    let route_method = if tunnelled {
        Method::CONNECT
    } else {
        method.clone()
    };
    let route = router
        .route(
            config,
            &host,
            port,
            &route_method,
            if tunnelled { "" } else { path },
            headers,
        )
        .ok_or(ExplainError::NotAbsolute)?;
    let at = Matched {
        config,
        upstream: u,
        family: route.family.map(|f| &u.families[f]),
        tunnelled,
    };
    at.family(&mut out);
    at.partition(&mut out, &route);
    at.limits(&mut out);
    at.cost(&mut out, headers, body, path);
    at.learning(&mut out);
    at.policy(&mut out, method, headers);
    if scheme == "https" {
        let tls = match u.tls {
            TlsMode::Tunnel => {
                "tunnel (CONNECT carried blind; family limits, retries and breaker cannot apply)"
            }
            TlsMode::Intercept => {
                "intercept (requests inside the tunnel go through the full pipeline)"
            }
        };
        line(&mut out, "tls", tls);
    }
    Ok(out)
}

fn line(out: &mut String, k: &str, v: &str) {
    let _ = writeln!(out, "{k:<11} {v}");
}

/// A request matched to an upstream (and perhaps a family): what `explain` says of it,
/// one section per method.
struct Matched<'a> {
    config: &'a Config,
    upstream: &'a Upstream,
    family: Option<&'a Family>,
    tunnelled: bool,
}

impl Matched<'_> {
    fn family(&self, out: &mut String) {
        match self.family {
            Some(f) => {
                let priority = match f.priority {
                    Priority::High => "high",
                    Priority::Normal => "normal",
                    Priority::Low => "low",
                };
                line(
                    out,
                    "family",
                    &format!(
                        "{} (first match in file order, priority {priority})",
                        f.name
                    ),
                )
            }
            None if self.tunnelled => line(
                out,
                "family",
                "- (https through a blind CONNECT tunnel: method and path are not visible)",
            ),
            None => line(
                out,
                "family",
                "- (no family matches; only the upstream's limits apply)",
            ),
        }
    }

    fn partition(&self, out: &mut String, route: &Route) {
        let u = self.upstream;
        match (&u.key, route.partition) {
            (None, _) => line(
                out,
                "partition",
                "- (no key configured: one set of buckets)",
            ),
            (Some(k), Some(p)) => line(
                out,
                "partition",
                &format!(
                    "{p} (from {k}; the value is never shown); up to {} live at once, about {} \
                     bytes each",
                    crate::limit::max_partitions(u),
                    crate::limit::partition_bytes(u)
                ),
            ),
            (Some(k), None) => line(
                out,
                "partition",
                &format!("- ({k} absent: the unkeyed partition)"),
            ),
        }
    }

    fn limits(&self, out: &mut String) {
        let (u, family) = (self.upstream, self.family);
        let mut limits: Vec<String> = Vec::new();
        let paid = u.limits.iter().map(|l| (l, "upstream".to_string())).chain(
            family
                .iter()
                .flat_map(|f| f.limits.iter().map(|l| (l, format!("family {}", f.name)))),
        );
        for (l, at) in paid {
            limits.push(format!("{l}  [{at}]"));
            limits.extend(against(l));
        }
        if limits.is_empty() {
            limits.push("none".into());
        }
        for (i, l) in limits.iter().enumerate() {
            line(out, if i == 0 { "limits" } else { "" }, l);
        }
        let pays_global = u
            .limits
            .iter()
            .chain(family.iter().flat_map(|f| f.limits.iter()))
            .any(Limit::is_global);
        if pays_global && let Some(c) = &self.config.cluster {
            let fallback = match (c.on_redis_error, c.replicas) {
                (crate::config::OnRedisError::Local, Some(n)) => {
                    format!("each replica holds 1/{n} of each global limit")
                }
                (crate::config::OnRedisError::Allow, _) => "global limits are not applied".into(),
                _ => "503 cluster_unavailable".into(),
            };
            line(
                out,
                "cluster",
                &format!(
                    "global limits shared through {}; while it is away: {fallback}",
                    c.redis
                ),
            );
        }
    }

    /// What a priced family's request costs, estimated as the proxy would from the headers
    /// and `body`; and a warning where corrections assume the provider reconciles.
    fn cost(&self, out: &mut String, headers: &HeaderMap, body: Option<&[u8]>, path: &str) {
        use crate::price::{BodyView, Declared};
        let Some(f) = self.family.filter(|f| !f.prices.is_empty()) else {
            return;
        };
        let limit = self.config.proxy.max_replay_body;
        let json = body.and_then(|b| crate::price::json::Json::parse(b).ok());
        let view = match (body, &json) {
            (None, _) => BodyView::Unread,
            (Some(b), _) if b.len() as u64 > limit => BodyView::TooLarge { limit },
            (Some(_), Some(v)) => BodyView::Json(v),
            (Some(_), None) => BodyView::NotJson,
        };
        let priced = Declared::read(headers)
            .and_then(|d| crate::price::price(&f.prices, headers, &d, &view, path));
        let text = match priced {
            Ok(costs) => {
                let units: Vec<String> = f
                    .prices
                    .iter()
                    .map(|p| format!("{} {} (estimate {})", costs.of(p.index), p.unit, p.estimate))
                    .collect();
                format!("1 request, {}", units.join(", "))
            }
            Err(e) => {
                let (reason, status) = e.answer();
                let hint = if body.is_none() {
                    " (give the body with -d @file)"
                } else {
                    ""
                };
                format!("answered {status} sluice_{reason}: {e}{hint}")
            }
        };
        line(out, "cost", &text);
        for p in f.prices.iter() {
            if let Some(a) = &p.actual {
                line(
                    out,
                    "",
                    &format!(
                        "{} corrected after the response from {a}: right only if the provider \
                         reconciles its count too (Anthropic, Shopify); against one that keeps \
                         its estimate (OpenAI, GitHub) this admits more than it allows",
                        p.unit
                    ),
                );
            }
        }
    }

    /// What the upstream learns from the provider, how the family's queue turns between
    /// tenants, how its rate adapts.
    fn learning(&self, out: &mut String) {
        let (u, family) = (self.upstream, self.family);
        if u.learn == crate::config::Learn::Headers && !self.tunnelled {
            line(
                out,
                "learns",
                "the provider's announced budget (RateLimit, RateLimit-Remaining/-Reset, \
                 X-RateLimit-Remaining/-Reset): when it has fewer requests left than these limits \
                 allow, each partition paces to it until the provider's reset",
            );
        }
        if let Some(t) = family.and_then(|f| f.tenant.as_ref()) {
            line(
                out,
                "tenants",
                &format!(
                    "by {t}: the family's queue serves tenants in turns, FIFO within each; \
                     max_queue bounds each tenant's waiting requests"
                ),
            );
        }
        let adaptive = family.map_or(u.adaptive, |f| f.adaptive);
        if let Some(a) = adaptive.filter(|_| !self.tunnelled) {
            line(
                out,
                "adapts",
                &format!(
                    "a 429 the provider did not announce cuts this family's rate to {}x (once per \
                     period of its tightest rate limit); each {} answers without one add back {}% \
                     of the configured rate; never below {}% of it",
                    a.decrease,
                    a.successes,
                    a.increase * 100.0,
                    a.floor * 100.0
                ),
            );
        }
    }

    /// The queue bounds, timeouts, retries and breaker the request runs under.
    fn policy(&self, out: &mut String, method: &Method, headers: &HeaderMap) {
        let (u, family) = (self.upstream, self.family);
        let policy: &Policy = family.map_or(&u.policy, |f| &f.policy);
        line(
            out,
            "queue",
            &format!(
                "max_queue {}, max_wait {} (a request's sluice-max-wait can shorten it)",
                policy.max_queue,
                fmt_duration(policy.max_wait)
            ),
        );
        line(
            out,
            "timeouts",
            &format!(
                "attempt {}, total {}",
                fmt_duration(policy.attempt_timeout),
                fmt_duration(policy.total_timeout)
            ),
        );
        let r = &policy.retry;
        let key_name = &r.idempotency_header;
        let retryable = is_idempotent(method) || headers.contains_key(key_name);
        let retry = if self.tunnelled {
            "no: inside a blind tunnel".to_string()
        } else if !retryable && u.idempotency_generate && *method == Method::POST {
            format!("yes: {key_name} is generated for this POST (idempotency_generate = true)")
        } else if !retryable {
            format!("no: {method} without {key_name} may have succeeded; it is sent once")
        } else if r.max_attempts <= 1 {
            "no: max_attempts = 1".to_string()
        } else {
            let on: Vec<String> =
                r.on.iter()
                    .map(|o| match o {
                        RetryOn::Status(s) => s.to_string(),
                        RetryOn::Connect => "connect".into(),
                        RetryOn::Reset => "reset".into(),
                        RetryOn::Timeout => "timeout".into(),
                    })
                    .collect();
            let jitter = match r.backoff.jitter {
                Jitter::Full => "full",
                Jitter::Equal => "equal",
                Jitter::Decorrelated => "decorrelated",
                Jitter::None => "no",
            };
            format!(
                "yes: up to {} attempts on {}; backoff {}..{} with {jitter} jitter; Retry-After waited up to {}",
                r.max_attempts,
                on.join(" "),
                fmt_duration(r.backoff.base),
                fmt_duration(r.backoff.max),
                fmt_duration(r.max_retry_after),
            )
        };
        line(out, "retry", &retry);
        let b = &policy.breaker;
        let scope = match family {
            Some(f) if f.own_breaker => format!("family {}", f.name),
            _ => format!("upstream {}", u.name),
        };
        line(
            out,
            "breaker",
            &format!(
                "{scope}: opens at {}% failures of >= {} attempts in {}, stays open {}",
                b.failure_ratio * 100.0,
                b.min_requests,
                fmt_duration(b.window),
                fmt_duration(b.open_for)
            ),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn says_when_an_upstream_learns_from_the_provider() {
        let c = Config::parse(
            "[[upstream]]\nname = \"u\"\nhosts = [\"u.example\"]\nlearn = \"headers\"\n",
            "l.toml",
        )
        .unwrap();
        let url: Uri = "http://u.example/x".parse().unwrap();
        let out = explain(&c, &Method::GET, &url, &HeaderMap::new()).unwrap();
        assert!(
            out.contains("learns      the provider's announced budget"),
            "{out}"
        );
        assert!(out.contains("sluice-max-wait can shorten it"), "{out}");
        assert!(!out.contains("adapts"), "{out}");
        let c = Config::parse(
            "[[upstream]]\nname = \"u\"\nhosts = [\"u.example\"]\nadaptive = {}\n\
             limits = [{ kind = \"fixed_window\", permits = 10, window = \"1s\" }]\n",
            "l.toml",
        )
        .unwrap();
        let out = explain(&c, &Method::GET, &url, &HeaderMap::new()).unwrap();
        assert!(
            out.contains(
                "adapts      a 429 the provider did not announce cuts this family's rate to 0.5x"
            ),
            "{out}"
        );
    }

    #[test]
    fn names_each_kind_as_written() {
        let c = Config::parse(
            "[[upstream]]\nname = \"u\"\nhosts = [\"u.example\"]\nlimits = [\n\
             { kind = \"sliding_counter\", permits = 100, window = \"1m\" },\n\
             { kind = \"sliding_counter\", permits = 10, window = \"1s\", align = \"clock\", \
             rounding = \"none\" },\n\
             { kind = \"fixed_window\", permits = 1000, window = \"1h\", align = \"clock\", \
             offset = \"30m\" },\n\
             { kind = \"leaky_bucket\", rate = 10, per = \"1s\", burst = 5 },\n\
             { kind = \"published\", permits = 100, window = \"1m\" },\n]\n",
            "k.toml",
        )
        .unwrap();
        let names: Vec<String> = c.upstreams[0]
            .limits
            .iter()
            .map(|l| l.to_string())
            .collect();
        assert_eq!(
            names,
            [
                "sliding_counter 100 per 1m, any alignment, margin 1s (default)",
                "sliding_counter 10 per 1s, on the clock, unrounded, margin 200ms (default)",
                "fixed_window 1000 per 1h, on the clock + 30m, margin 1s (default)",
                "leaky_bucket 10 per 1s (burst 5), margin 20ms (default)",
                "published 100 per 1m, margin 120ms (default)",
            ]
        );
    }

    #[test]
    fn explains_the_product_example() {
        let c = Config::parse(
            include_str!("../tests/fixtures/product-example.toml"),
            "p.toml",
        )
        .unwrap();
        let mut h = HeaderMap::new();
        h.insert("authorization", "Bearer sk_live_123".parse().unwrap());
        let url: Uri = "http://api.marketplace.example/v1/orders/9"
            .parse()
            .unwrap();
        let out = explain(&c, &Method::POST, &url, &h).unwrap();
        assert!(out.contains("upstream    marketplace"), "{out}");
        assert!(out.contains("family      orders"), "{out}");
        assert!(
            out.contains("fixed_window 300 per 1m, margin 1s (default)  [upstream]"),
            "{out}"
        );
        assert!(
            out.contains("sliding_window 12 per 1s, margin 200ms (default)  [family orders]"),
            "{out}"
        );
        // Each limit against the algorithms providers run at its numbers.
        assert!(
            out.contains(
                "              within a sliding log, fixed windows on the clock, fixed windows \
                 from the first request, a token bucket as deep as the limit\n              \
                 overruns a sliding window counter: an estimate of 24 (12 allowed)\n"
            ),
            "{out}"
        );
        assert!(
            out.contains("overruns a sliding log: 599 in one window (300 allowed)"),
            "{out}"
        );
        assert!(out.contains("no: POST without idempotency-key"), "{out}");
        assert!(!out.contains("sk_live_123"), "{out}");
        assert!(!out.contains("learns"), "{out}");

        h.insert("idempotency-key", "k1".parse().unwrap());
        let out = explain(&c, &Method::POST, &url, &h).unwrap();
        assert!(out.contains("retry       yes: up to 4 attempts"), "{out}");

        let out = explain(
            &c,
            &Method::GET,
            &"http://elsewhere.example/".parse().unwrap(),
            &h,
        )
        .unwrap();
        assert!(out.contains("unmatched = \"pass\""), "{out}");
        assert!(
            out.contains("egress      checked on the addresses elsewhere.example resolves to"),
            "{out}"
        );
        for (url, verdict) in [
            (
                "http://127.1:6379/",
                "refused with 403 sluice_denied: destination 127.0.0.1:6379 is a loopback address",
            ),
            (
                "https://example.org:22/",
                "refused with 403 sluice_denied: CONNECT to port 22",
            ),
            (
                "http://[64:ff9b::a9fe:a9fe]/",
                "refused with 403 sluice_denied: destination 169.254.169.254:80 is a link-local",
            ),
            ("https://93.184.216.34/", "allowed"),
        ] {
            let out = explain(&c, &Method::GET, &url.parse().unwrap(), &h).unwrap();
            assert!(out.contains(&format!("egress      {verdict}")), "{out}");
        }
    }

    #[test]
    fn shows_shared_limits_and_where_they_are_decided() {
        let c = Config::parse(
            "[[upstream]]\nname = \"a\"\nhosts = [\"a.example\"]\n\
             limits = [{ kind = \"fixed_window\", permits = 300, window = \"1m\", scope = \"global\" }]\n\
             [cluster]\nredis = \"redis://app:s3cret@10.0.0.1:6379/0\"\nreplicas = 3\n",
            "c.toml",
        )
        .unwrap();
        let out = explain(
            &c,
            &Method::GET,
            &"http://a.example/x".parse().unwrap(),
            &HeaderMap::new(),
        )
        .unwrap();
        assert!(
            out.contains("fixed_window 300 per 1m, margin 1s (default) (global)  [upstream]"),
            "{out}"
        );
        assert!(
            out.contains(
                "cluster     global limits shared through redis://app:***@10.0.0.1:6379/0; \
                 while it is away: each replica holds 1/3 of each global limit"
            ),
            "{out}"
        );
        assert!(!out.contains("s3cret"), "{out}");
    }

    #[test]
    fn prices_a_request_from_its_body_and_warns_of_corrections() {
        let c = Config::parse(
            "[[upstream]]\nname = \"anthropic\"\nhosts = [\"api.anthropic.com\"]\n\
             [[upstream.family]]\nname = \"messages\"\npaths = [\"/v1/messages\"]\n\
             limits = [{ kind = \"token_bucket\", rate = 8000, per = \"1m\", burst = 8000, unit = \"output_tokens\" }]\n\
             [upstream.family.cost.output_tokens]\nestimate = \"anthropic:output\"\n\
             actual = \"json:/usage/output_tokens\"\n",
            "t",
        )
        .unwrap();
        let url: Uri = "http://api.anthropic.com/v1/messages".parse().unwrap();
        let body = br#"{"max_tokens": 1200, "messages": [{"role": "user", "content": "hi"}]}"#;
        let out = explain_request(&c, &Method::POST, &url, &HeaderMap::new(), Some(body)).unwrap();
        assert!(out.contains("in output_tokens"), "{out}");
        assert!(
            out.contains("cost        1 request, 1200 output_tokens (estimate anthropic:output)"),
            "{out}"
        );
        assert!(
            out.contains("right only if the provider reconciles"),
            "{out}"
        );
        let mut h = HeaderMap::new();
        h.insert("sluice-cost", "output_tokens=9000".parse().unwrap());
        let out = explain_request(&c, &Method::POST, &url, &h, None).unwrap();
        assert!(out.contains("answered 413 sluice_cost_too_large"), "{out}");
        let out = explain(&c, &Method::POST, &url, &HeaderMap::new()).unwrap();
        assert!(out.contains("give the body with -d @file"), "{out}");
    }
}
