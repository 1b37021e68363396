//! The config file exactly as written (`*Spec`): serde structs that reject unknown keys.
//! Everything optional here is resolved against `[defaults]` in `config::build`.

use std::num::NonZeroU32;

use serde::{Deserialize, Serialize, de};
use toml::Spanned;

use super::cost::{CostSpec, Unit};
use super::pattern::{HostPattern, PathGlob};
use super::units::{Bytes, Dur, Margin, PosDur};

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ConfigSpec {
    #[serde(default)]
    pub(crate) proxy: ProxySpec,
    #[serde(default)]
    pub(crate) defaults: PolicySpec,
    #[serde(default)]
    pub(crate) upstream: Vec<UpstreamSpec>,
    pub(crate) tls: Option<TlsSpec>,
    pub(crate) cluster: Option<Spanned<ClusterSpec>>,
    #[serde(default)]
    pub(crate) egress: EgressSpec,
}

/// `[egress]`: which destinations the proxy may connect to (docs/security.md).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct EgressSpec {
    pub(crate) allow: Option<Vec<Spanned<String>>>,
    pub(crate) deny: Option<Vec<Spanned<String>>>,
    pub(crate) connect_ports: Option<Vec<Spanned<PortSpec>>>,
}

/// `443` or `"8000-8999"`.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub(crate) enum PortSpec {
    One(u16),
    Range(String),
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ProxySpec {
    pub(crate) listen: Option<Spanned<String>>,
    pub(crate) admin: Option<Spanned<String>>,
    pub(crate) unmatched: Option<Unmatched>,
    pub(crate) max_replay_body: Option<Bytes>,
    pub(crate) max_replay_memory: Option<Bytes>,
    pub(crate) max_connections: Option<std::num::NonZeroU64>,
    pub(crate) tunnel_idle_timeout: Option<PosDur>,
    pub(crate) upgrades: Option<Spanned<Vec<String>>>,
    pub(crate) send_timeout: Option<PosDur>,
    pub(crate) drain_timeout: Option<Dur>,
    pub(crate) shutdown_delay: Option<Dur>,
    pub(crate) admin_control: Option<AdminControl>,
}

/// Who may use the admin endpoints that change or reveal state (`POST /reload`,
/// `/config`, `/buckets`); probes and `/metrics` are served to anyone who reaches the
/// admin listener.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum AdminControl {
    /// Clients connecting from a loopback address: the pod itself, `kubectl
    /// port-forward`, a shell on the host.
    #[default]
    Loopback,
    /// Every client that reaches the admin listener.
    Any,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Unmatched {
    #[default]
    Pass,
    Deny,
}

/// The policy keys that `[defaults]`, `[[upstream]]` and `[[upstream.family]]` share.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct PolicySpec {
    pub(crate) max_queue: Option<NonZeroU32>,
    pub(crate) max_wait: Option<Dur>,
    pub(crate) attempt_timeout: Option<PosDur>,
    pub(crate) total_timeout: Option<PosDur>,
    pub(crate) retry: Option<RetrySpec>,
    pub(crate) breaker: Option<BreakerSpec>,
}

#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RetrySpec {
    pub(crate) max_attempts: Option<NonZeroU32>,
    pub(crate) backoff: Option<Spanned<BackoffSpec>>,
    pub(crate) on: Option<Vec<RetryOn>>,
    pub(crate) max_retry_after: Option<Dur>,
    pub(crate) max_cooldown: Option<Dur>,
    pub(crate) idempotency_header: Option<Spanned<String>>,
    pub(crate) budget: Option<BudgetSpec>,
}

/// Retry budget: retries may add `ratio` of the requests plus `min_per_second`.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct BudgetSpec {
    pub(crate) ratio: Option<Spanned<f64>>,
    pub(crate) min_per_second: Option<u32>,
    pub(crate) window: Option<PosDur>,
}

#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct BackoffSpec {
    pub(crate) base: Option<PosDur>,
    pub(crate) max: Option<PosDur>,
    pub(crate) jitter: Option<Jitter>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Jitter {
    Full,
    Equal,
    Decorrelated,
    None,
}

/// One entry of `retry.on`: a status code or a transport failure class.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RetryOn {
    Status(u16),
    Connect,
    Reset,
    Timeout,
}

impl<'de> Deserialize<'de> for RetryOn {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl de::Visitor<'_> for V {
            type Value = RetryOn;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a status code (100-599) or one of \"connect\", \"reset\", \"timeout\"")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<RetryOn, E> {
                match u16::try_from(v) {
                    Ok(s @ 100..=599) => Ok(RetryOn::Status(s)),
                    _ => Err(E::custom(format!(
                        "{v} is not an HTTP status code (100-599)"
                    ))),
                }
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<RetryOn, E> {
                match v {
                    "connect" => Ok(RetryOn::Connect),
                    "reset" => Ok(RetryOn::Reset),
                    "timeout" => Ok(RetryOn::Timeout),
                    _ => Err(E::invalid_value(de::Unexpected::Str(v), &self)),
                }
            }
        }
        d.deserialize_any(V)
    }
}

impl Serialize for RetryOn {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            RetryOn::Status(c) => s.serialize_u16(*c),
            RetryOn::Connect => s.serialize_str("connect"),
            RetryOn::Reset => s.serialize_str("reset"),
            RetryOn::Timeout => s.serialize_str("timeout"),
        }
    }
}

#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct BreakerSpec {
    pub(crate) failure_ratio: Option<Spanned<f64>>,
    pub(crate) min_requests: Option<NonZeroU32>,
    pub(crate) window: Option<PosDur>,
    pub(crate) open_for: Option<PosDur>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct UpstreamSpec {
    pub(crate) name: Spanned<String>,
    pub(crate) hosts: Spanned<Vec<Spanned<HostPattern>>>,
    pub(crate) key: Option<Spanned<String>>,
    pub(crate) max_partitions: Option<Spanned<std::num::NonZeroU32>>,
    #[serde(default)]
    pub(crate) tls: TlsMode,
    #[serde(default)]
    pub(crate) scheme: Scheme,
    pub(crate) upstream_ca: Option<String>,
    #[serde(default)]
    pub(crate) limits: Vec<Spanned<LimitSpec>>,
    #[serde(default)]
    pub(crate) family: Vec<FamilySpec>,
    #[serde(default)]
    pub(crate) classify: Vec<Spanned<ClassifySpec>>,
    pub(crate) idempotency_generate: Option<bool>,
    pub(crate) cooldown: Option<CooldownScope>,
    #[serde(default)]
    pub(crate) learn: Learn,
    pub(crate) ratelimit_headers: Option<bool>,
    pub(crate) adaptive: Option<Spanned<AdaptiveSpec>>,
    pub(crate) access_log: Option<Spanned<f64>>,
    // Policy overrides; listed one by one because serde cannot flatten with
    // `deny_unknown_fields`.
    pub(crate) max_queue: Option<NonZeroU32>,
    pub(crate) max_wait: Option<Dur>,
    pub(crate) attempt_timeout: Option<PosDur>,
    pub(crate) total_timeout: Option<PosDur>,
    pub(crate) retry: Option<RetrySpec>,
    pub(crate) breaker: Option<BreakerSpec>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct FamilySpec {
    pub(crate) name: Spanned<String>,
    pub(crate) methods: Option<Vec<Spanned<String>>>,
    pub(crate) paths: Option<Vec<PathGlob>>,
    #[serde(default)]
    pub(crate) priority: Priority,
    #[serde(default)]
    pub(crate) limits: Vec<Spanned<LimitSpec>>,
    pub(crate) adaptive: Option<Spanned<AdaptiveSpec>>,
    pub(crate) tenant: Option<Spanned<String>>,
    /// `[upstream.family.cost.<unit>]`: what a request costs in each unit it is priced in.
    #[serde(default)]
    pub(crate) cost: std::collections::BTreeMap<String, Spanned<CostSpec>>,
    /// Which waiter of the family's queue goes first: the oldest (FIFO) or the newest.
    #[serde(default)]
    pub(crate) queue_order: QueueOrder,
    pub(crate) max_queue: Option<NonZeroU32>,
    pub(crate) max_wait: Option<Dur>,
    pub(crate) attempt_timeout: Option<PosDur>,
    pub(crate) total_timeout: Option<PosDur>,
    pub(crate) retry: Option<RetrySpec>,
    pub(crate) breaker: Option<BreakerSpec>,
}

/// `adaptive = { ... }`: AIMD on unannounced 429s (`docs/adaptive.md`); every key optional.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct AdaptiveSpec {
    pub(crate) decrease: Option<f64>,
    pub(crate) increase: Option<f64>,
    pub(crate) floor: Option<f64>,
    pub(crate) successes: Option<NonZeroU32>,
}

/// Gathers the policy keys an upstream or a family sets, to merge over the level above.
macro_rules! policy_of {
    ($t:ty) => {
        impl $t {
            pub(crate) fn policy(&self) -> PolicySpec {
                PolicySpec {
                    max_queue: self.max_queue,
                    max_wait: self.max_wait,
                    attempt_timeout: self.attempt_timeout,
                    total_timeout: self.total_timeout,
                    retry: self.retry.clone(),
                    breaker: self.breaker.clone(),
                }
            }
        }
    };
}

policy_of!(UpstreamSpec);
policy_of!(FamilySpec);

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum TlsMode {
    #[default]
    Tunnel,
    Intercept,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Scheme {
    #[default]
    Http,
    Https,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Priority {
    High,
    #[default]
    Normal,
    Low,
}

/// The order a family's queue serves its waiters in (the seeds' `QueueProcessingOrder`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum QueueOrder {
    #[default]
    OldestFirst,
    NewestFirst,
}

/// What an upstream's responses teach the limiter: nothing, or the budget the provider
/// announces in its `RateLimit` / `X-RateLimit-*` fields (`docs/adaptive.md`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Learn {
    #[default]
    Off,
    Headers,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum CooldownScope {
    #[default]
    Family,
    Upstream,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Scope {
    #[default]
    Local,
    Global,
}

/// Where a window's edges fall. `First`: a window opens with the first request after the
/// previous one closed. `Clock`: windows start at multiples of the window since the Unix
/// epoch, shifted by `offset`, as a provider that resets "every minute" does.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WindowAlign {
    #[default]
    First,
    Clock,
}

/// Where a sliding counter's windows fall at the provider: on the clock, or unknown (a
/// counter anchored at its first request, as haproxy's is), in which case sluice keeps
/// every possible alignment within the limit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CounterAlign {
    #[default]
    Any,
    Clock,
}

/// Whether the provider rounds a sliding counter's weighted estimate down before comparing
/// it with the limit (haproxy's `sc_http_req_rate`, Python `limits`), or compares it as is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Rounding {
    #[default]
    Down,
    None,
}

/// One limit, tagged by `kind`. Counts are non-zero by type, so `permits = 0` is refused
/// where it is written.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum LimitSpec {
    TokenBucket {
        rate: NonZeroU32,
        #[serde(with = "pos_dur_serde")]
        per: std::time::Duration,
        burst: NonZeroU32,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        margin: Option<Margin>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        margin_max: Option<Margin>,
        #[serde(default)]
        scope: Scope,
        #[serde(default, skip_serializing_if = "Unit::is_requests")]
        unit: Unit,
    },
    SlidingWindow {
        permits: NonZeroU32,
        #[serde(with = "pos_dur_serde")]
        window: std::time::Duration,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        margin: Option<Margin>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        margin_max: Option<Margin>,
        #[serde(default)]
        scope: Scope,
        #[serde(default, skip_serializing_if = "Unit::is_requests")]
        unit: Unit,
    },
    FixedWindow {
        permits: NonZeroU32,
        #[serde(with = "pos_dur_serde")]
        window: std::time::Duration,
        #[serde(default)]
        align: WindowAlign,
        #[serde(
            default,
            with = "opt_dur_serde",
            skip_serializing_if = "Option::is_none"
        )]
        offset: Option<std::time::Duration>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        margin: Option<Margin>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        margin_max: Option<Margin>,
        #[serde(default)]
        scope: Scope,
        #[serde(default, skip_serializing_if = "Unit::is_requests")]
        unit: Unit,
    },
    /// The weighted two-window counter: a request is admitted while the previous window's
    /// count, weighted by the share of it still inside the last `window`, plus the
    /// current window's count stays under `permits`.
    SlidingCounter {
        permits: NonZeroU32,
        #[serde(with = "pos_dur_serde")]
        window: std::time::Duration,
        #[serde(default)]
        align: CounterAlign,
        #[serde(
            default,
            with = "opt_dur_serde",
            skip_serializing_if = "Option::is_none"
        )]
        offset: Option<std::time::Duration>,
        #[serde(default)]
        rounding: Rounding,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        margin: Option<Margin>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        margin_max: Option<Margin>,
        #[serde(default)]
        scope: Scope,
        #[serde(default, skip_serializing_if = "Unit::is_requests")]
        unit: Unit,
    },
    /// nginx `limit_req`: `rate` per `per` (nginx's `r/s` or `r/m`), and `burst` requests
    /// of excess beyond it, counted in nginx's own units (see `limit::kinds::leaky`).
    LeakyBucket {
        rate: NonZeroU32,
        #[serde(with = "pos_dur_serde")]
        per: std::time::Duration,
        #[serde(default)]
        burst: u32,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        margin: Option<Margin>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        margin_max: Option<Margin>,
        #[serde(default)]
        scope: Scope,
        #[serde(default, skip_serializing_if = "Unit::is_requests")]
        unit: Unit,
    },
    /// A published "`permits` per `window`" whose algorithm is unknown: requests paced
    /// evenly, so that every common algorithm at those numbers accepts them.
    Published {
        permits: NonZeroU32,
        #[serde(with = "pos_dur_serde")]
        window: std::time::Duration,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        margin: Option<Margin>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        margin_max: Option<Margin>,
        #[serde(default)]
        scope: Scope,
        #[serde(default, skip_serializing_if = "Unit::is_requests")]
        unit: Unit,
    },
    Concurrency {
        max: NonZeroU32,
        #[serde(default)]
        scope: Scope,
        #[serde(default, skip_serializing_if = "Unit::is_requests")]
        unit: Unit,
    },
}

/// The margin a limit gets when it names none: a fifth of its window or emission
/// interval, at most [`DEFAULT_MARGIN_CAP`]. It only costs throughput when the provider
/// answers more slowly than the margin (see `LimitSpec::margin`).
pub(crate) const DEFAULT_MARGIN: Margin = Margin::Fraction(200_000);
pub(crate) const DEFAULT_MARGIN_CAP: std::time::Duration = std::time::Duration::from_secs(1);

impl LimitSpec {
    /// The unit it counts, as an index into its upstream's units (0: requests).
    pub(crate) fn unit(&self) -> u8 {
        self.unit_ref().index
    }

    /// The unit it counts, as written and resolved.
    pub(crate) fn unit_ref(&self) -> &Unit {
        match self {
            LimitSpec::TokenBucket { unit, .. }
            | LimitSpec::SlidingWindow { unit, .. }
            | LimitSpec::FixedWindow { unit, .. }
            | LimitSpec::SlidingCounter { unit, .. }
            | LimitSpec::LeakyBucket { unit, .. }
            | LimitSpec::Published { unit, .. }
            | LimitSpec::Concurrency { unit, .. } => unit,
        }
    }

    pub(crate) fn unit_mut(&mut self) -> &mut Unit {
        match self {
            LimitSpec::TokenBucket { unit, .. }
            | LimitSpec::SlidingWindow { unit, .. }
            | LimitSpec::FixedWindow { unit, .. }
            | LimitSpec::SlidingCounter { unit, .. }
            | LimitSpec::LeakyBucket { unit, .. }
            | LimitSpec::Published { unit, .. }
            | LimitSpec::Concurrency { unit, .. } => unit,
        }
    }

    /// A letter for the kind, one per state machine: a reload carries a limit's state,
    /// and a shared limit keeps its Redis key, only while it stays the same.
    pub(crate) fn kind_letter(&self) -> char {
        match self {
            LimitSpec::TokenBucket { .. } => 't',
            LimitSpec::SlidingWindow { .. } => 's',
            LimitSpec::FixedWindow {
                align: WindowAlign::Clock,
                ..
            } => 'k',
            LimitSpec::FixedWindow { .. } => 'f',
            LimitSpec::SlidingCounter { .. } => 'w',
            LimitSpec::LeakyBucket { .. } => 'l',
            LimitSpec::Published { .. } => 'p',
            LimitSpec::Concurrency { .. } => 'c',
        }
    }

    /// `permits` per `window` for the kinds written that way.
    pub fn window_limit(&self) -> Option<(u32, std::time::Duration)> {
        match *self {
            LimitSpec::SlidingWindow {
                permits, window, ..
            }
            | LimitSpec::FixedWindow {
                permits, window, ..
            }
            | LimitSpec::SlidingCounter {
                permits, window, ..
            }
            | LimitSpec::Published {
                permits, window, ..
            } => Some((permits.get(), window)),
            _ => None,
        }
    }

    /// The period a rate is written over: the window, or `per`; `None` for concurrency.
    pub(crate) fn period(&self) -> Option<std::time::Duration> {
        match *self {
            LimitSpec::TokenBucket { per, .. } | LimitSpec::LeakyBucket { per, .. } => Some(per),
            LimitSpec::Concurrency { .. } => None,
            _ => self.window_limit().map(|(_, w)| w),
        }
    }

    /// Requests per second over the limit's own period; `None` for concurrency.
    pub(crate) fn rate_per_second(&self) -> Option<f64> {
        match *self {
            LimitSpec::TokenBucket { rate, per, .. } | LimitSpec::LeakyBucket { rate, per, .. } => {
                Some(f64::from(rate.get()) / per.as_secs_f64())
            }
            LimitSpec::Concurrency { .. } => None,
            _ => self
                .window_limit()
                .map(|(p, w)| f64::from(p) / w.as_secs_f64()),
        }
    }

    /// How many requests may go at once from rest, as the provider allows them.
    pub(crate) fn burst(&self) -> Option<u32> {
        match *self {
            LimitSpec::TokenBucket { burst, .. } => Some(burst.get()),
            LimitSpec::LeakyBucket { burst, .. } => Some(burst.saturating_add(1)),
            LimitSpec::Published { .. } => Some(1),
            LimitSpec::Concurrency { max, .. } => Some(max.get()),
            _ => self.window_limit().map(|(p, _)| p),
        }
    }

    pub(crate) fn scope(&self) -> Scope {
        match *self {
            LimitSpec::TokenBucket { scope, .. }
            | LimitSpec::SlidingWindow { scope, .. }
            | LimitSpec::FixedWindow { scope, .. }
            | LimitSpec::SlidingCounter { scope, .. }
            | LimitSpec::LeakyBucket { scope, .. }
            | LimitSpec::Published { scope, .. }
            | LimitSpec::Concurrency { scope, .. } => scope,
        }
    }

    pub(crate) fn is_global(&self) -> bool {
        self.scope() == Scope::Global
    }

    /// The span a fractional margin is a share of: the window, or the interval between two
    /// requests at the limit's pace (`per / rate` of a bucket, `window / permits` of a
    /// published limit); `None` for concurrency.
    pub fn span(&self) -> Option<std::time::Duration> {
        match *self {
            LimitSpec::TokenBucket { rate, per, .. } | LimitSpec::LeakyBucket { rate, per, .. } => {
                Some(per / rate.get())
            }
            LimitSpec::Published {
                permits, window, ..
            } => Some(window / permits.get()),
            LimitSpec::Concurrency { .. } => None,
            _ => self.window_limit().map(|(_, w)| w),
        }
    }

    /// The margin as written, if any.
    pub(crate) fn margin_spec(&self) -> Option<Margin> {
        match *self {
            LimitSpec::TokenBucket { margin, .. }
            | LimitSpec::SlidingWindow { margin, .. }
            | LimitSpec::FixedWindow { margin, .. }
            | LimitSpec::SlidingCounter { margin, .. }
            | LimitSpec::LeakyBucket { margin, .. }
            | LimitSpec::Published { margin, .. } => margin,
            LimitSpec::Concurrency { .. } => None,
        }
    }

    /// How far an edge 429 may grow the margin (see `limit::Cell::refused_at_edge`);
    /// `None`: it never grows.
    pub(crate) fn margin_max(&self) -> Option<std::time::Duration> {
        let span = self.span()?;
        match *self {
            LimitSpec::TokenBucket { margin_max, .. }
            | LimitSpec::SlidingWindow { margin_max, .. }
            | LimitSpec::FixedWindow { margin_max, .. }
            | LimitSpec::SlidingCounter { margin_max, .. }
            | LimitSpec::LeakyBucket { margin_max, .. }
            | LimitSpec::Published { margin_max, .. } => margin_max.map(|m| m.of(span)),
            LimitSpec::Concurrency { .. } => None,
        }
    }

    /// How much later than sluice handed a request to its connection the provider may
    /// count it: the written margin, else the default. `None` for concurrency, which
    /// counts nothing in time.
    pub fn margin(&self) -> Option<std::time::Duration> {
        let span = self.span()?;
        Some(match self.margin_spec() {
            Some(m) => m.of(span),
            None => DEFAULT_MARGIN.of(span).min(DEFAULT_MARGIN_CAP),
        })
    }
}

mod opt_dur_serde {
    use crate::config::units::{Dur, ser_opt_duration};
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<Duration>, D::Error> {
        Dur::deserialize(d).map(|p| Some(p.0))
    }
    pub(super) fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        ser_opt_duration(d, s)
    }
}

mod pos_dur_serde {
    use crate::config::units::{PosDur, ser_duration};
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        PosDur::deserialize(d).map(|p| p.0)
    }
    pub(super) fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        ser_duration(d, s)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    Retry,
    Cooldown,
    Fail,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ClassifySpec {
    pub(crate) status: Option<u16>,
    pub(crate) json: Option<String>,
    pub(crate) equals: Option<Vec<String>>,
    pub(crate) body_contains: Option<String>,
    pub(crate) action: Action,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct TlsSpec {
    pub(crate) ca_cert: Option<String>,
    pub(crate) ca_key: Option<String>,
    pub(crate) generate_ca: Option<Spanned<bool>>,
    pub(crate) trust_dir: Option<String>,
    pub(crate) key_dir: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ClusterSpec {
    /// The URL itself; or where to read it, so that a password stays out of the file.
    pub(crate) redis: Option<Spanned<String>>,
    pub(crate) redis_env: Option<Spanned<String>>,
    pub(crate) redis_file: Option<Spanned<String>>,
    /// A Redis Cluster: seed nodes, `redis://host:port` each.
    pub(crate) cluster_nodes: Option<Spanned<Vec<String>>>,
    /// Sentinel: the Sentinels' URLs, and the name of the primary they watch.
    pub(crate) sentinels: Option<Spanned<Vec<String>>>,
    pub(crate) sentinel_master: Option<Spanned<String>>,
    /// The data nodes' password for `cluster_nodes` and `sentinels`, from a variable or
    /// a file, so that it stays out of the config.
    pub(crate) password_env: Option<String>,
    pub(crate) password_file: Option<String>,
    /// The Sentinels' own password, if they require one.
    pub(crate) sentinel_password_env: Option<String>,
    pub(crate) sentinel_password_file: Option<String>,
    /// A PEM file of the CA that signs a `rediss://` server's certificate, when it is not
    /// one of the public roots.
    pub(crate) ca: Option<String>,
    #[serde(default)]
    pub(crate) on_redis_error: OnRedisError,
    pub(crate) replicas: Option<NonZeroU32>,
    pub(crate) timeout: Option<PosDur>,
    pub(crate) failures: Option<NonZeroU32>,
    pub(crate) open_for: Option<PosDur>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum OnRedisError {
    #[default]
    Local,
    Allow,
    Deny,
}
