//! Configuration: the TOML file is read into `spec` structs (unknown keys rejected), then
//! validated and resolved into an immutable [`Config`] in which every upstream and family
//! carries its complete policy (`[defaults]` ← `[[upstream]]` ← `[[upstream.family]]`).
//! Every error names `file:line:col`.

pub(crate) mod cost;
mod listen;
pub(crate) mod pattern;
pub(crate) mod spec;
pub(crate) mod units;

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

use http::{HeaderName, Method};
use serde::{Serialize, Serializer};
use sha2::{Digest, Sha256};

pub use listen::ListenAddr;
pub(crate) use pattern::{HostPattern, PathGlob};
pub(crate) use spec::{
    Action, AdminControl, CooldownScope, CounterAlign, Jitter, Learn, LimitSpec as Limit,
    OnRedisError, Priority, QueueOrder, RetryOn, Rounding, Scheme, TlsMode, Unmatched, WindowAlign,
};
use spec::{AdaptiveSpec, BreakerSpec, ConfigSpec, PolicySpec, RetrySpec};
pub(crate) use units::Margin;
use units::{ser_duration, ser_opt_duration};

/// A config that could not be loaded; `Display` gives `file:line:col: message`.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}: cannot read config: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}:{line}:{col}: {message}")]
    Invalid {
        path: String,
        line: usize,
        col: usize,
        message: String,
    },
}

/// A validation failure before it is placed in a file.
struct Invalid {
    span: Option<Range<usize>>,
    message: String,
}

fn invalid(span: impl Into<Option<Range<usize>>>, message: impl Into<String>) -> Invalid {
    Invalid {
        span: span.into(),
        message: message.into(),
    }
}

type Result<T, E = Invalid> = std::result::Result<T, E>;

#[derive(Debug, Serialize)]
pub struct Config {
    pub proxy: ProxyConfig,
    pub(crate) defaults: Policy,
    pub upstreams: Vec<Upstream>,
    pub(crate) tls: Option<TlsConfig>,
    pub(crate) cluster: Option<ClusterConfig>,
    pub(crate) egress: EgressConfig,
    /// SHA-256 of the file's bytes: a reload of an unchanged file does nothing.
    pub(crate) sha256: String,
    /// What is published of the config in force (`sluice_config_info`, `/status.json`,
    /// `sluice check`): a SHA-256 of the effective config with its secrets redacted, so
    /// that replicas with the same config agree while the hash is no test of a guessed
    /// password written in the file.
    #[serde(skip)]
    pub digest: String,
}

#[derive(Debug, Serialize)]
pub struct ProxyConfig {
    pub listen: ListenAddr,
    pub admin: ListenAddr,
    pub(crate) unmatched: Unmatched,
    pub(crate) max_replay_body: u64,
    /// Replay copies held at once across the process; beyond it requests are not retried.
    pub(crate) max_replay_memory: u64,
    /// Client connections served at once; `None`: from the open-file limit (`rlimit`).
    pub(crate) max_connections: Option<u64>,
    /// A CONNECT tunnel with no bytes either way for this long is closed.
    #[serde(serialize_with = "ser_duration")]
    pub(crate) tunnel_idle_timeout: Duration,
    /// Protocols a forwarded request may switch to (`Upgrade`), lower case.
    pub(crate) upgrades: Vec<String>,
    /// How long a write to a client may stay blocked (nginx's `send_timeout`).
    #[serde(serialize_with = "ser_duration")]
    pub(crate) send_timeout: Duration,
    #[serde(serialize_with = "ser_duration")]
    pub(crate) drain_timeout: Duration,
    #[serde(serialize_with = "ser_duration")]
    pub(crate) shutdown_delay: Duration,
    pub(crate) admin_control: AdminControl,
}

/// What the command line or the environment sets over the file (`--listen`,
/// `SLUICE_LISTEN`, ...): what differs between a laptop and a pod. Applied to every load
/// of the file, reloads included, so a reload never sees them as a change.
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    pub listen: Option<ListenAddr>,
    pub admin: Option<ListenAddr>,
    /// For a sidecar that receives SIGTERM together with its application (no native
    /// sidecars): keep serving while the application finishes.
    pub shutdown_delay: Option<Duration>,
}

impl Overrides {
    pub(crate) fn apply(&self, config: &mut Config) {
        if let Some(d) = self.shutdown_delay {
            config.proxy.shutdown_delay = d;
        }
        if let Some(a) = self.listen {
            config.proxy.listen = a;
        }
        if let Some(a) = self.admin {
            config.proxy.admin = a;
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Policy {
    pub(crate) max_queue: u32,
    #[serde(serialize_with = "ser_duration")]
    pub(crate) max_wait: Duration,
    #[serde(serialize_with = "ser_duration")]
    pub(crate) attempt_timeout: Duration,
    #[serde(serialize_with = "ser_duration")]
    pub(crate) total_timeout: Duration,
    pub(crate) retry: RetryPolicy,
    pub(crate) breaker: BreakerPolicy,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct RetryPolicy {
    pub(crate) max_attempts: u32,
    pub(crate) backoff: Backoff,
    pub(crate) on: Vec<RetryOn>,
    #[serde(serialize_with = "ser_duration")]
    pub(crate) max_retry_after: Duration,
    /// The longest a 429 may pause the bucket; `None`: `max_retry_after`.
    #[serde(serialize_with = "ser_opt_duration")]
    pub(crate) max_cooldown: Option<Duration>,
    #[serde(serialize_with = "ser_header_name")]
    pub(crate) idempotency_header: HeaderName,
    pub(crate) budget: BudgetPolicy,
}

impl RetryPolicy {
    /// How long a provider's wait hint may pause a bucket: a bogus `Retry-After: 86400`
    /// must not freeze a queue for a day.
    pub(crate) fn cooldown_cap(&self) -> Duration {
        self.max_cooldown.unwrap_or(self.max_retry_after)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct BudgetPolicy {
    pub(crate) ratio: f64,
    pub(crate) min_per_second: u32,
    #[serde(serialize_with = "ser_duration")]
    pub(crate) window: Duration,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Backoff {
    #[serde(serialize_with = "ser_duration")]
    pub(crate) base: Duration,
    #[serde(serialize_with = "ser_duration")]
    pub(crate) max: Duration,
    pub(crate) jitter: Jitter,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct BreakerPolicy {
    pub(crate) failure_ratio: f64,
    pub(crate) min_requests: u32,
    #[serde(serialize_with = "ser_duration")]
    pub(crate) window: Duration,
    #[serde(serialize_with = "ser_duration")]
    pub(crate) open_for: Duration,
}

#[derive(Debug, Serialize)]
pub struct Upstream {
    pub(crate) name: String,
    pub hosts: Vec<HostPattern>,
    pub(crate) key: Option<KeySource>,
    /// Live partitions `key` may make at most; `None`: as many as fit in
    /// `limit::PARTITION_MEMORY`.
    pub(crate) max_partitions: Option<u32>,
    pub(crate) tls: TlsMode,
    pub(crate) scheme: Scheme,
    pub upstream_ca: Option<PathBuf>,
    pub limits: Vec<Limit>,
    pub families: Vec<Family>,
    /// The units its families price, by index less one (index 0 is requests).
    pub(crate) units: Vec<String>,
    pub(crate) classify: Vec<ClassifyRule>,
    pub(crate) idempotency_generate: bool,
    pub(crate) cooldown: CooldownScope,
    /// Whether the provider's announced budget slows this upstream's partitions down.
    pub(crate) learn: Learn,
    /// AIMD for its families that set none of their own, and for requests of no family.
    pub(crate) adaptive: Option<Adaptive>,
    /// Whether responses describe the sluice bucket they paid in `RateLimit` and
    /// `RateLimit-Policy` fields.
    pub(crate) ratelimit_headers: bool,
    /// The share of this upstream's requests that get an access-log line: 1 (all, the
    /// default), 0 (none), or a sample in between for very hot paths.
    pub(crate) access_log: f64,
    pub(crate) policy: Policy,
}

#[derive(Debug, Serialize)]
pub struct Family {
    pub(crate) name: String,
    /// `None` matches every method.
    #[serde(serialize_with = "ser_methods")]
    pub(crate) methods: Option<Vec<Method>>,
    /// Empty matches every path.
    pub(crate) paths: Vec<PathGlob>,
    pub(crate) priority: Priority,
    pub(crate) limits: Vec<Limit>,
    /// Whether the family set `[breaker]` itself (its own circuit) or inherits the upstream's.
    pub(crate) own_breaker: bool,
    /// Its own `adaptive`, else the upstream's.
    pub(crate) adaptive: Option<Adaptive>,
    /// Where a request's tenant comes from: its queue then serves tenants in turns.
    pub(crate) tenant: Option<KeySource>,
    /// What its requests cost in each unit it prices.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(crate) prices: Vec<cost::Price>,
    pub(crate) queue_order: spec::QueueOrder,
    pub(crate) policy: Policy,
}

/// AIMD on unannounced 429s: each 429 that classification retries or cools down
/// multiplies the family's effective rate by `decrease`; each run of `successes`
/// answers without one adds `increase` of the configured rate; never above the
/// configured rate, never below `floor` of it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub(crate) struct Adaptive {
    pub(crate) decrease: f64,
    pub(crate) increase: f64,
    pub(crate) floor: f64,
    pub(crate) successes: u32,
}

impl Family {
    pub(crate) fn matches(&self, method: &Method, path: &str) -> bool {
        self.methods.as_ref().is_none_or(|m| m.contains(method))
            && (self.paths.is_empty() || self.paths.iter().any(|g| g.matches(path)))
    }
}

/// Where a request's partition key comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum KeySource {
    Header(HeaderName),
}

impl fmt::Display for KeySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeySource::Header(h) => write!(f, "header:{h}"),
        }
    }
}

impl Serialize for KeySource {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct ClassifyRule {
    pub status: Option<u16>,
    pub json: Option<String>,
    pub equals: Vec<String>,
    pub body_contains: Option<String>,
    pub action: Action,
}

#[derive(Debug, PartialEq, Serialize)]
pub(crate) struct TlsConfig {
    pub(crate) ca_cert: Option<PathBuf>,
    pub(crate) ca_key: Option<PathBuf>,
    /// Make the interception CA at start instead of reading one.
    pub(crate) generate_ca: bool,
    /// Where the CA certificate and a bundle of the public roots plus it are written,
    /// for the application to trust (a volume it shares with sluice).
    pub(crate) trust_dir: Option<PathBuf>,
    /// Where a generated CA's key is kept across restarts (a volume only sluice mounts);
    /// without it the key lives in memory only.
    pub(crate) key_dir: Option<PathBuf>,
}

/// `[egress]`, see `egress::Rules` for how it combines with the built-in list.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct EgressConfig {
    pub(crate) allow: Vec<ipnet::IpNet>,
    pub(crate) deny: Vec<ipnet::IpNet>,
    /// Ports CONNECT may open besides those an upstream's host pattern names.
    pub(crate) connect_ports: Vec<PortRange>,
}

/// Inclusive; one port is a range of one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PortRange(pub u16, pub u16);

impl PortRange {
    pub(crate) fn contains(&self, port: u16) -> bool {
        (self.0..=self.1).contains(&port)
    }
}

impl fmt::Display for PortRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0 == self.1 {
            write!(f, "{}", self.0)
        } else {
            write!(f, "{}-{}", self.0, self.1)
        }
    }
}

impl Serialize for PortRange {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct ClusterConfig {
    pub(crate) redis: RedisTarget,
    /// The data nodes' password (`cluster_nodes`, `sentinels`).
    pub(crate) password: Option<Secret>,
    /// The Sentinels' own password.
    pub(crate) sentinel_password: Option<Secret>,
    /// Extra CA for `rediss://`, besides the public roots.
    pub(crate) ca: Option<PathBuf>,
    pub(crate) on_redis_error: OnRedisError,
    /// How many replicas share the budget; `local` fallback gives each `limit / replicas`.
    pub(crate) replicas: Option<u32>,
    /// Every Redis call, connecting included, ends within this.
    #[serde(serialize_with = "ser_duration")]
    pub(crate) timeout: Duration,
    /// Consecutive failed calls that open the breaker around Redis.
    pub(crate) failures: u32,
    /// How long the breaker stays open before one call probes Redis again.
    #[serde(serialize_with = "ser_duration")]
    pub(crate) open_for: Duration,
}

/// Where the Redis URL comes from. The URL may hold a password: only `/config`'s redacted
/// form of it, or the name of the variable or file, is ever shown.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RedisSource {
    Url(String),
    /// An environment variable holding the URL.
    Env(String),
    /// A file holding the URL (a mounted Secret), read again at each reload.
    File(PathBuf),
}

impl RedisSource {
    /// The URL, read from where it lives.
    pub(crate) fn url(&self) -> std::result::Result<String, String> {
        let url = match self {
            RedisSource::Url(u) => u.clone(),
            RedisSource::Env(name) => std::env::var(name).map_err(|_| {
                format!("the environment variable {name} (cluster.redis_env) is not set")
            })?,
            RedisSource::File(path) => read_capped(path, 64 << 10)
                .map_err(|e| format!("cannot read {} (cluster.redis_file): {e}", path.display()))?,
        };
        let url = url.trim().to_string();
        if !is_redis_url(&url) {
            return Err(format!("{self} does not hold a redis:// or rediss:// URL"));
        }
        Ok(url)
    }
}

/// The Redis topology shared limits live on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RedisTarget {
    /// One primary, or a managed endpoint whose name follows the primary across failovers.
    Primary(RedisSource),
    /// A Redis Cluster, found from these seed nodes.
    Cluster(Vec<String>),
    /// The primary that Sentinels name `master`.
    Sentinel {
        sentinels: Vec<String>,
        master: String,
    },
}

impl fmt::Display for RedisTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let list = |urls: &[String]| {
            urls.iter()
                .map(|u| redact_url(u))
                .collect::<Vec<_>>()
                .join(",")
        };
        match self {
            RedisTarget::Primary(source) => source.fmt(f),
            RedisTarget::Cluster(nodes) => write!(f, "cluster:{}", list(nodes)),
            RedisTarget::Sentinel { sentinels, master } => {
                write!(f, "sentinel:{master}@{}", list(sentinels))
            }
        }
    }
}

impl Serialize for RedisTarget {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// A secret kept out of the config file: the variable or the file that holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Secret {
    Env(String),
    File(PathBuf),
}

impl Secret {
    fn of(
        env: Option<String>,
        file: Option<String>,
        what: &str,
        span: Range<usize>,
    ) -> Result<Option<Secret>> {
        match (env, file) {
            (None, None) => Ok(None),
            (Some(e), None) => Ok(Some(Secret::Env(e))),
            (None, Some(f)) => Ok(Some(Secret::File(PathBuf::from(f)))),
            (Some(_), Some(_)) => Err(invalid(
                span,
                format!("[cluster] takes one of {what}_env and {what}_file"),
            )),
        }
    }

    /// The secret, read from where it lives (a file again at each reload).
    pub(crate) fn read(&self) -> std::result::Result<String, String> {
        match self {
            Secret::Env(name) => std::env::var(name)
                .map_err(|_| format!("the environment variable {name} is not set")),
            Secret::File(path) => read_capped(path, 64 << 10)
                .map(|s| s.trim().to_string())
                .map_err(|e| format!("cannot read {}: {e}", path.display())),
        }
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Secret::Env(name) => write!(f, "env:{name}"),
            Secret::File(path) => write!(f, "file:{}", path.display()),
        }
    }
}

impl Serialize for Secret {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

fn is_redis_url(url: &str) -> bool {
    url.starts_with("redis://") || url.starts_with("rediss://")
}

impl fmt::Display for RedisSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RedisSource::Url(u) => f.write_str(&redact_url(u)),
            RedisSource::Env(name) => write!(f, "env:{name}"),
            RedisSource::File(path) => write!(f, "file:{}", path.display()),
        }
    }
}

impl Serialize for RedisSource {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

fn ser_header_name<S: Serializer>(h: &HeaderName, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(h.as_str())
}

fn ser_methods<S: Serializer>(m: &Option<Vec<Method>>, s: S) -> Result<S::Ok, S::Error> {
    match m {
        None => s.serialize_none(),
        Some(v) => s.collect_seq(v.iter().map(Method::as_str)),
    }
}

/// `redis://user:secret@host/0` → `redis://user:***@host/0`: a password in the URL must not
/// leave the process through `/config`.
pub(crate) fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let (auth, host) = match rest.rsplit_once('@') {
        Some(parts) => parts,
        None => return url.to_string(),
    };
    let user = auth.split_once(':').map_or("", |(u, _)| u);
    format!("{scheme}://{user}:***@{host}")
}

/// The largest config file read. Real ones are a few KiB; the cap makes `-c /dev/zero` or a
/// log file named by mistake fail at once instead of reading until memory runs out.
pub(crate) const MAX_CONFIG_BYTES: u64 = 4 << 20;

/// Reads a UTF-8 file of at most `cap` bytes; a longer one is an error, not truncated.
pub(crate) fn read_capped(path: &Path, cap: u64) -> std::io::Result<String> {
    use std::io::Read;
    let mut bytes = Vec::new();
    std::fs::File::open(path)?
        .take(cap + 1)
        .read_to_end(&mut bytes)?;
    if bytes.len() as u64 > cap {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("larger than {} bytes", cap),
        ));
    }
    String::from_utf8(bytes)
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, "not UTF-8"))
}

/// The SHA-256 a config made from `text` reports as `sha256`.
pub(crate) fn text_sha256(text: &str) -> String {
    hex(&Sha256::digest(text.as_bytes()))
}

impl Config {
    /// Reads and validates a config file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = read_capped(path, MAX_CONFIG_BYTES).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Config::parse(&text, &path.display().to_string())
    }

    /// Validates config text; `origin` names the file in error messages.
    pub fn parse(text: &str, origin: &str) -> Result<Config, ConfigError> {
        let place = |span: Option<Range<usize>>, message: String| {
            let (line, col) = line_col(text, span.map_or(0, |s| s.start));
            ConfigError::Invalid {
                path: origin.to_string(),
                line,
                col,
                message,
            }
        };
        let spec: ConfigSpec = toml::from_str(text)
            .map_err(|e| place(e.span(), e.message().trim_end().to_string()))?;
        let mut config = build(spec, text_sha256(text)).map_err(|e| place(e.span, e.message))?;
        let mut published = config.to_redacted_json();
        if let Some(o) = published.as_object_mut() {
            o.remove("sha256");
        }
        config.digest = text_sha256(&published.to_string());
        Ok(config)
    }

    /// The first upstream that intercepts TLS while no CA is configured: `sluice run`
    /// refuses to start then, `sluice check` warns.
    pub(crate) fn intercept_without_ca(&self) -> Option<&str> {
        let has_ca = self
            .tls
            .as_ref()
            .is_some_and(|t| (t.ca_cert.is_some() && t.ca_key.is_some()) || t.generate_ca);
        self.upstreams
            .iter()
            .find(|u| u.tls == TlsMode::Intercept && !has_ca)
            .map(|u| u.name.as_str())
    }

    /// Things that are valid but probably not what the operator meant.
    pub fn warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        if let Some(name) = self.intercept_without_ca() {
            out.push(format!(
                "upstream {name:?} has tls = \"intercept\", which needs [tls] ca_cert and ca_key; \
                 `sluice run` will refuse to start (create a CA with `sluice ca new --out DIR`)"
            ));
        }
        for u in &self.upstreams {
            let request_limits = u
                .limits
                .iter()
                .chain(u.families.iter().flat_map(|f| f.limits.iter()))
                .any(|l| !matches!(l, Limit::Concurrency { .. }));
            if u.tls == TlsMode::Tunnel
                && u.scheme == Scheme::Http
                && (request_limits || !u.families.is_empty())
            {
                out.push(format!(
                    "upstream {:?}: https:// requests reach it through blind CONNECT tunnels, where its \
                     families and request limits cannot apply (only concurrency limits count tunnels); \
                     set tls = \"intercept\", or scheme = \"https\" for clients that send http://",
                    u.name
                ));
            }
        }
        self.cluster_warnings(&mut out);
        out
    }

    /// Warnings about `[cluster]`: nothing to share, or limits too small to split between
    /// the replicas when Redis is away.
    fn cluster_warnings(&self, out: &mut Vec<String>) {
        let Some(c) = &self.cluster else {
            return;
        };
        let global = || {
            self.upstreams.iter().flat_map(|u| {
                u.limits
                    .iter()
                    .chain(u.families.iter().flat_map(|f| f.limits.iter()))
                    .filter(|l| l.is_global())
                    .map(move |l| (u, l))
            })
        };
        if global().next().is_none() {
            out.push(
                "[cluster] is set but no limit has scope = \"global\": nothing is shared".into(),
            );
        }
        if let (OnRedisError::Local, Some(n)) = (c.on_redis_error, c.replicas) {
            for (u, l) in global() {
                if matches!(l, Limit::Concurrency { .. }) {
                    continue;
                }
                let count = l.burst().unwrap_or(0);
                if count < n {
                    let window = l
                        .window_limit()
                        .filter(|_| !matches!(l, Limit::Published { .. }));
                    let what = match window {
                        Some((p, w)) => format!(
                            "each replica holds 1 request per {} (its long-run share), and \
                             the provider may see up to {n} requests in one {} window \
                             (limit {p})",
                            units::fmt_duration(w * n.div_ceil(p.max(1))),
                            units::fmt_duration(w),
                        ),
                        None => format!(
                            "each replica holds a burst of 1 at 1/{n} of the rate, and the \
                             provider may see up to {n} requests at once (burst {count})"
                        ),
                    };
                    out.push(format!(
                        "upstream {:?}: {l} is smaller than its {n} replicas: while Redis is \
                         away (on_redis_error = \"local\") {what}; a smaller replicas \
                         split or on_redis_error = \"deny\" avoids that (docs/cluster.md)",
                        u.name
                    ));
                }
            }
        }
    }

    /// The effective config as JSON with secrets redacted, for `/config`.
    pub fn to_redacted_json(&self) -> serde_json::Value {
        serde_json::to_value(self).unwrap_or_else(|e| serde_json::json!({ "error": e.to_string() }))
    }
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
}

/// 1-based line and column (in characters) of a byte offset.
fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let offset = offset.min(text.len());
    let before = text.get(..offset).unwrap_or(text);
    let line = before.matches('\n').count() + 1;
    let col = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, col)
}

fn builtin_policy() -> Policy {
    Policy {
        max_queue: 1000,
        max_wait: Duration::from_secs(30),
        attempt_timeout: Duration::from_secs(10),
        total_timeout: Duration::from_secs(60),
        retry: RetryPolicy {
            max_attempts: 4,
            backoff: Backoff {
                base: Duration::from_millis(500),
                max: Duration::from_secs(30),
                jitter: Jitter::Full,
            },
            on: vec![
                RetryOn::Status(408),
                RetryOn::Status(429),
                RetryOn::Status(502),
                RetryOn::Status(503),
                RetryOn::Status(504),
                RetryOn::Connect,
                RetryOn::Reset,
                RetryOn::Timeout,
            ],
            max_retry_after: Duration::from_secs(60),
            max_cooldown: None,
            idempotency_header: HeaderName::from_static("idempotency-key"),
            budget: BudgetPolicy {
                ratio: 0.2,
                min_per_second: 10,
                window: Duration::from_secs(10),
            },
        },
        breaker: BreakerPolicy {
            failure_ratio: 0.5,
            min_requests: 20,
            window: Duration::from_secs(30),
            open_for: Duration::from_secs(15),
        },
    }
}

/// Applies the keys set at one level on top of the level above it.
fn merge_policy(base: &Policy, over: &PolicySpec) -> Result<Policy> {
    Ok(Policy {
        max_queue: over.max_queue.map_or(base.max_queue, |v| v.get()),
        max_wait: over.max_wait.map_or(base.max_wait, |v| v.0),
        attempt_timeout: over.attempt_timeout.map_or(base.attempt_timeout, |v| v.0),
        total_timeout: over.total_timeout.map_or(base.total_timeout, |v| v.0),
        retry: match &over.retry {
            Some(r) => merge_retry(&base.retry, r)?,
            None => base.retry.clone(),
        },
        breaker: match &over.breaker {
            Some(b) => merge_breaker(&base.breaker, b)?,
            None => base.breaker.clone(),
        },
    })
}

fn merge_retry(base: &RetryPolicy, over: &RetrySpec) -> Result<RetryPolicy> {
    let mut backoff = base.backoff.clone();
    if let Some(b) = &over.backoff {
        let spec = b.get_ref();
        backoff.base = spec.base.map_or(backoff.base, |d| d.0);
        backoff.max = spec.max.map_or(backoff.max, |d| d.0);
        backoff.jitter = spec.jitter.unwrap_or(backoff.jitter);
        if backoff.base > backoff.max {
            return Err(invalid(
                b.span(),
                format!(
                    "backoff base ({}) is longer than its max ({})",
                    units::fmt_duration(backoff.base),
                    units::fmt_duration(backoff.max)
                ),
            ));
        }
    }
    let idempotency_header = match &over.idempotency_header {
        Some(h) => HeaderName::from_bytes(h.get_ref().as_bytes()).map_err(|_| {
            invalid(
                h.span(),
                format!("{:?} is not a valid header name", h.get_ref()),
            )
        })?,
        None => base.idempotency_header.clone(),
    };
    let mut budget = base.budget.clone();
    if let Some(b) = &over.budget {
        if let Some(r) = &b.ratio {
            let v = *r.get_ref();
            if !(0.0..=10.0).contains(&v) {
                return Err(invalid(
                    r.span(),
                    format!("budget ratio must be in [0, 10], got {v}"),
                ));
            }
            budget.ratio = v;
        }
        budget.min_per_second = b.min_per_second.unwrap_or(budget.min_per_second);
        budget.window = b.window.map_or(budget.window, |d| d.0);
    }
    Ok(RetryPolicy {
        max_attempts: over.max_attempts.map_or(base.max_attempts, |v| v.get()),
        backoff,
        on: over.on.clone().unwrap_or_else(|| base.on.clone()),
        max_retry_after: over.max_retry_after.map_or(base.max_retry_after, |d| d.0),
        max_cooldown: over.max_cooldown.map(|d| d.0).or(base.max_cooldown),
        idempotency_header,
        budget,
    })
}

fn merge_breaker(base: &BreakerPolicy, over: &BreakerSpec) -> Result<BreakerPolicy> {
    let failure_ratio = match &over.failure_ratio {
        Some(r) => {
            let v = *r.get_ref();
            if !(v > 0.0 && v <= 1.0) {
                return Err(invalid(
                    r.span(),
                    format!("failure_ratio must be in (0, 1], got {v}"),
                ));
            }
            v
        }
        None => base.failure_ratio,
    };
    Ok(BreakerPolicy {
        failure_ratio,
        min_requests: over.min_requests.map_or(base.min_requests, |v| v.get()),
        window: over.window.map_or(base.window, |d| d.0),
        open_for: over.open_for.map_or(base.open_for, |d| d.0),
    })
}

/// Names end up in metric labels and in `/buckets`, so they stay short and plain.
fn check_name(name: &toml::Spanned<String>, what: &str) -> Result<String> {
    let n = name.get_ref();
    let ok = !n.is_empty()
        && n.len() <= 64
        && n.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
    if !ok {
        return Err(invalid(
            name.span(),
            format!("{what} name {n:?} must be 1-64 characters of [A-Za-z0-9_.-]"),
        ));
    }
    Ok(n.clone())
}

fn check_tls(t: spec::TlsSpec) -> Result<TlsConfig> {
    let span = t.generate_ca.as_ref().map(|g| g.span());
    let generate_ca = t.generate_ca.is_some_and(|g| *g.get_ref());
    if generate_ca && (t.ca_cert.is_some() || t.ca_key.is_some()) {
        return Err(invalid(
            span,
            "generate_ca = true makes the CA: remove ca_cert and ca_key, or generate_ca",
        ));
    }
    if generate_ca && t.trust_dir.is_none() {
        return Err(invalid(
            span,
            "generate_ca = true needs trust_dir, where the application finds the CA to trust",
        ));
    }
    if t.key_dir.is_some() && !generate_ca {
        return Err(invalid(
            span,
            "key_dir keeps a generated CA's key: it needs generate_ca = true",
        ));
    }
    Ok(TlsConfig {
        ca_cert: t.ca_cert.map(PathBuf::from),
        ca_key: t.ca_key.map(PathBuf::from),
        generate_ca,
        trust_dir: t.trust_dir.map(PathBuf::from),
        key_dir: t.key_dir.map(PathBuf::from),
    })
}

fn parse_addr(v: &Option<toml::Spanned<String>>, default: &str) -> Result<ListenAddr> {
    match v {
        None => default
            .parse()
            .map_err(|_| invalid(None, format!("bad built-in address {default}"))),
        Some(s) => s
            .get_ref()
            .parse()
            .map_err(|e: listen::BadListenAddr| invalid(s.span(), e.to_string())),
    }
}

fn build(spec: ConfigSpec, sha256: String) -> Result<Config> {
    let proxy = check_proxy(&spec.proxy)?;
    let defaults = merge_policy(&builtin_policy(), &spec.defaults)?;

    let has_cluster = spec.cluster.is_some();
    let mut upstreams = Vec::with_capacity(spec.upstream.len());
    let mut names: HashSet<String> = HashSet::new();
    let mut hosts_seen: HashMap<HostPattern, String> = HashMap::new();
    for u in spec.upstream {
        upstreams.push(check_upstream(
            u,
            &defaults,
            has_cluster,
            &mut names,
            &mut hosts_seen,
        )?);
    }
    let tls = match spec.tls {
        None => None,
        Some(t) => Some(check_tls(t)?),
    };
    let cluster = match spec.cluster {
        None => None,
        Some(c) => Some(check_cluster(c)?),
    };

    let egress = check_egress(&spec.egress)?;

    Ok(Config {
        proxy,
        defaults,
        upstreams,
        tls,
        cluster,
        egress,
        sha256,
        digest: String::new(),
    })
}

/// `[proxy]`.
fn check_proxy(p: &spec::ProxySpec) -> Result<ProxyConfig> {
    let proxy = ProxyConfig {
        listen: parse_addr(&p.listen, "127.0.0.1:3128")?,
        admin: parse_addr(&p.admin, "127.0.0.1:9901")?,
        unmatched: p.unmatched.unwrap_or_default(),
        max_replay_body: p.max_replay_body.map_or(1 << 20, |b| b.0),
        max_replay_memory: p.max_replay_memory.map_or(64 << 20, |b| b.0),
        max_connections: p.max_connections.map(|n| n.get()),
        tunnel_idle_timeout: p
            .tunnel_idle_timeout
            .map_or(Duration::from_secs(300), |d| d.0),
        upgrades: match &p.upgrades {
            None => vec!["websocket".to_string()],
            Some(list) => {
                let mut names = Vec::new();
                for name in list.get_ref() {
                    let lower = name.to_ascii_lowercase();
                    let token = !lower.is_empty()
                        && lower
                            .bytes()
                            .all(|b| b.is_ascii_alphanumeric() || b"-._".contains(&b));
                    if !token || lower == "h2c" {
                        return Err(invalid(
                            list.span(),
                            format!(
                                "upgrades names protocols a request may switch to, such as \
                                 \"websocket\"; {name:?} is not one (h2c never is: upstreams \
                                 are spoken to in HTTP/1.1)"
                            ),
                        ));
                    }
                    names.push(lower);
                }
                names
            }
        },
        send_timeout: p.send_timeout.map_or(Duration::from_secs(30), |d| d.0),
        drain_timeout: p.drain_timeout.map_or(Duration::from_secs(25), |d| d.0),
        shutdown_delay: p.shutdown_delay.map_or(Duration::ZERO, |d| d.0),
        admin_control: p.admin_control.unwrap_or_default(),
    };
    if let (Some(l), Some(a)) = (&p.listen, &p.admin)
        && proxy.listen == proxy.admin
        && proxy.listen.port() != 0
    {
        return Err(invalid(
            a.span(),
            format!("admin and listen are both {}", l.get_ref()),
        ));
    }
    Ok(proxy)
}

/// The upstream's name and hosts, each unique in the file: the name is taken in `names`
/// and each host in `hosts_seen`.
fn claim(
    u: &spec::UpstreamSpec,
    names: &mut HashSet<String>,
    hosts_seen: &mut HashMap<HostPattern, String>,
) -> Result<String> {
    let name = check_name(&u.name, "upstream")?;
    if name == "unmatched" {
        return Err(invalid(
            u.name.span(),
            "\"unmatched\" is reserved for requests no upstream matches",
        ));
    }
    if !names.insert(name.clone()) {
        return Err(invalid(
            u.name.span(),
            format!("duplicate upstream name {name:?}"),
        ));
    }
    if u.hosts.get_ref().is_empty() {
        return Err(invalid(
            u.hosts.span(),
            format!("upstream {name:?} needs at least one host"),
        ));
    }
    for h in u.hosts.get_ref() {
        if let Some(other) = hosts_seen.insert(h.get_ref().clone(), name.clone()) {
            return Err(invalid(
                h.span(),
                format!(
                    "host {} is already claimed by upstream {other:?}",
                    h.get_ref()
                ),
            ));
        }
    }
    Ok(name)
}

/// One `[[upstream]]`, over `defaults`; `names` and `hosts_seen` are what the upstreams
/// before it claimed.
fn check_upstream(
    u: spec::UpstreamSpec,
    defaults: &Policy,
    has_cluster: bool,
    names: &mut HashSet<String>,
    hosts_seen: &mut HashMap<HostPattern, String>,
) -> Result<Upstream> {
    let name = claim(&u, names, hosts_seen)?;
    let key = match &u.key {
        None => None,
        Some(k) => Some(parse_key(k)?),
    };
    if let Some(m) = &u.max_partitions
        && key.is_none()
    {
        return Err(invalid(
            m.span(),
            "max_partitions bounds the partitions that `key` makes: this upstream has no key",
        ));
    }
    let policy = merge_policy(defaults, &u.policy())?;

    // The units its families price, numbered in name order from 1 (0 is requests).
    let mut units: Vec<String> = u
        .family
        .iter()
        .flat_map(|f| f.cost.keys().cloned())
        .collect();
    units.sort();
    units.dedup();
    if units.len() > cost::MAX_PRICED {
        return Err(invalid(
            u.name.span(),
            format!(
                "upstream {name:?} prices {} units ({}); at most {} beside requests",
                units.len(),
                units.join(", "),
                cost::MAX_PRICED
            ),
        ));
    }
    let mut limits = check_limits(&u.limits, has_cluster)?;
    let priced: Vec<&str> = units.iter().map(String::as_str).collect();
    resolve_units(
        &mut limits,
        &u.limits,
        &units,
        &priced,
        "any of its families",
    )?;
    let adaptive = u.adaptive.as_ref().map(check_adaptive).transpose()?;
    let mut families = Vec::with_capacity(u.family.len());
    let mut fam_names: HashSet<String> = HashSet::new();
    for f in &u.family {
        families.push(check_family(
            f,
            &name,
            (&policy, adaptive, &limits),
            (has_cluster, &units),
            &mut fam_names,
        )?);
    }
    // Requests of no family adapt against the upstream's own rate; each family that
    // inherits `adaptive` was checked above for a rate of its own or the upstream's.
    if let Some(a) = &u.adaptive
        && families.is_empty()
        && !limits.iter().any(|l| l.rate_per_second().is_some())
    {
        return Err(invalid(
            a.span(),
            "adaptive needs a rate limit (token_bucket, sliding_window or fixed_window) to \
             adapt: give this upstream or its families one",
        ));
    }
    let classify = u
        .classify
        .iter()
        .map(check_classify)
        .collect::<Result<Vec<_>>>()?;

    Ok(Upstream {
        name,
        hosts: u
            .hosts
            .into_inner()
            .into_iter()
            .map(|h| h.into_inner())
            .collect(),
        key,
        max_partitions: u.max_partitions.as_ref().map(|m| m.get_ref().get()),
        tls: u.tls,
        scheme: u.scheme,
        upstream_ca: u.upstream_ca.map(PathBuf::from),
        limits,
        families,
        units,
        classify,
        idempotency_generate: u.idempotency_generate.unwrap_or(false),
        access_log: match &u.access_log {
            None => 1.0,
            Some(a) if (0.0..=1.0).contains(a.get_ref()) => *a.get_ref(),
            Some(a) => {
                return Err(invalid(
                    a.span(),
                    "access_log is the share of requests logged: 1 (all), 0 (none), or \
                     a fraction in between",
                ));
            }
        },
        cooldown: u.cooldown.unwrap_or_default(),
        learn: u.learn,
        adaptive,
        ratelimit_headers: u.ratelimit_headers.unwrap_or(false),
        policy,
    })
}

/// One `[[upstream.family]]` of upstream `name`, whose policy it inherits; `names` are
/// the family names seen so far in that upstream.
/// An `adaptive` table with its defaults filled in, each value in its range.
fn check_adaptive(a: &toml::Spanned<AdaptiveSpec>) -> Result<Adaptive> {
    let spec = a.get_ref();
    let share = |v: Option<f64>, default: f64, what: &str, top_open: bool| {
        let v = v.unwrap_or(default);
        let ok = v > 0.0 && if top_open { v < 1.0 } else { v <= 1.0 };
        if ok {
            Ok(v)
        } else {
            let range = if top_open {
                "between 0 and 1"
            } else {
                "above 0, at most 1"
            };
            Err(invalid(
                a.span(),
                format!("adaptive {what} must be {range}, not {v}"),
            ))
        }
    };
    Ok(Adaptive {
        decrease: share(spec.decrease, 0.5, "decrease", true)?,
        increase: share(spec.increase, 0.05, "increase", false)?,
        floor: share(spec.floor, 0.1, "floor", false)?,
        successes: spec.successes.map_or(10, |n| n.get()),
    })
}

/// One `[[upstream.family]]` of upstream `name`, whose policy, `adaptive` and limits
/// (`up`) it inherits or pays with its own.
fn check_family(
    f: &spec::FamilySpec,
    name: &str,
    up: (&Policy, Option<Adaptive>, &[Limit]),
    (has_cluster, units): (bool, &[String]),
    names: &mut HashSet<String>,
) -> Result<Family> {
    let (policy, up_adaptive, up_limits) = up;
    let fname = check_name(&f.name, "family")?;
    if fname == "-" {
        // `family="-"` in metrics means "no family matched".
        return Err(invalid(
            f.name.span(),
            "family name \"-\" is reserved for requests that match no family",
        ));
    }
    if !names.insert(fname.clone()) {
        return Err(invalid(
            f.name.span(),
            format!("duplicate family name {fname:?} in upstream {name:?}"),
        ));
    }
    let methods = match &f.methods {
        None => None,
        Some(ms) => Some(ms.iter().map(parse_method).collect::<Result<Vec<_>>>()?),
    };
    let mut limits = check_limits(&f.limits, has_cluster)?;
    let priced: Vec<&str> = f.cost.keys().map(String::as_str).collect();
    resolve_units(&mut limits, &f.limits, units, &priced, "this family")?;
    let prices = check_prices(f, units, &limits, up_limits)?;
    if f.queue_order == spec::QueueOrder::NewestFirst
        && let Some(t) = &f.tenant
    {
        return Err(invalid(
            t.span(),
            "a family's queue takes tenants in turns (tenant) or serves the newest first \
             (queue_order = \"newest_first\"), not both",
        ));
    }
    let own = f.adaptive.as_ref().map(check_adaptive).transpose()?;
    let adaptive = own.or(up_adaptive);
    if adaptive.is_some()
        && !limits
            .iter()
            .chain(up_limits)
            .any(|l| l.rate_per_second().is_some())
    {
        let at = f.adaptive.as_ref().map_or(f.name.span(), |a| a.span());
        return Err(invalid(
            at,
            format!(
                "family {fname:?} adapts (adaptive) but pays no rate limit (token_bucket, \
                 sliding_window or fixed_window), here or on its upstream"
            ),
        ));
    }
    Ok(Family {
        name: fname,
        methods,
        paths: f.paths.clone().unwrap_or_default(),
        priority: f.priority,
        limits,
        own_breaker: f.breaker.is_some(),
        adaptive,
        tenant: f.tenant.as_ref().map(parse_key).transpose()?,
        prices,
        queue_order: f.queue_order,
        policy: merge_policy(policy, &f.policy())?,
    })
}

/// Numbers each limit's unit among the upstream's `units`; a unit must be one that
/// `priced` (the family's cost tables, or any family's for an upstream's limit) prices.
fn resolve_units(
    limits: &mut [Limit],
    written: &[toml::Spanned<Limit>],
    units: &[String],
    priced: &[&str],
    whose: &str,
) -> Result<()> {
    for (limit, w) in limits.iter_mut().zip(written) {
        let Some(name) = limit.unit_ref().name.clone() else {
            continue;
        };
        match limit {
            Limit::Concurrency { .. } => {
                return Err(invalid(
                    w.span(),
                    "a concurrency limit counts requests in flight: it takes no unit",
                ));
            }
            Limit::LeakyBucket { .. } | Limit::Published { .. } => {
                return Err(invalid(
                    w.span(),
                    format!(
                        "a {} limit paces requests one by one and cannot count {name}: use a                          token_bucket or a window",
                        if matches!(limit, Limit::LeakyBucket { .. }) {
                            "leaky_bucket"
                        } else {
                            "published"
                        }
                    ),
                ));
            }
            _ => {}
        }
        let index = units.iter().position(|u| *u == name);
        match index {
            Some(i) if priced.contains(&name.as_str()) => {
                limit.unit_mut().index = u8::try_from(i + 1).unwrap_or(u8::MAX);
            }
            _ => {
                return Err(invalid(
                    w.span(),
                    format!(
                        "this limit counts {name}, but {whose} prices no {name}: add                          [upstream.family.cost.{name}] saying what a request costs"
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// A family's cost tables, resolved; a `max` that no limit of its unit could ever admit
/// is refused here rather than request by request.
fn check_prices(
    f: &spec::FamilySpec,
    units: &[String],
    own: &[Limit],
    up: &[Limit],
) -> Result<Vec<cost::Price>> {
    let mut prices = Vec::with_capacity(f.cost.len());
    for (name, c) in &f.cost {
        let at = c.span();
        let spec = c.get_ref();
        if !cost::is_unit_name(name) || name == "requests" {
            return Err(invalid(
                at,
                format!(
                    "[cost.{name}]: a priced unit is a name of lowercase letters, digits and                      _, other than \"requests\" (every request costs one request)"
                ),
            ));
        }
        let index = units.iter().position(|u| u == name).map_or(0, |i| i + 1);
        let index = u8::try_from(index).unwrap_or(u8::MAX);
        let estimate = cost::Estimate::parse(&spec.estimate)
            .map_err(|e| invalid(at.clone(), format!("[cost.{name}] {e}")))?;
        let actual = spec
            .actual
            .as_deref()
            .map(cost::Source::parse)
            .transpose()
            .map_err(|e| invalid(at.clone(), format!("[cost.{name}] actual {e}")))?;
        let ceiling = own
            .iter()
            .chain(up)
            .filter(|l| l.unit() == index)
            .filter_map(|l| l.burst())
            .min();
        if ceiling.is_none() {
            return Err(invalid(
                at,
                format!(
                    "[cost.{name}] prices {name}, but no limit of this family or its upstream \
                     counts them: add unit = \"{name}\" to one"
                ),
            ));
        }
        prices.push(cost::Price {
            unit: name.clone(),
            index,
            estimate,
            actual,
            max: spec.max.map(|m| m.get()),
            fallback: spec.fallback,
            default_output: spec.default_output.unwrap_or(cost::DEFAULT_OUTPUT),
            max_queue: spec.max_queue.map(|m| m.get()),
            ceiling: ceiling.map(u64::from),
        });
    }
    Ok(prices)
}

fn check_egress(e: &spec::EgressSpec) -> Result<EgressConfig> {
    let nets = |list: &Option<Vec<toml::Spanned<String>>>| -> Result<Vec<ipnet::IpNet>> {
        let Some(list) = list else {
            return Ok(Vec::new());
        };
        list.iter()
            .map(|s| {
                let text = s.get_ref().trim();
                text.parse::<ipnet::IpNet>()
                    .or_else(|_| text.parse::<std::net::IpAddr>().map(ipnet::IpNet::from))
                    .map(|n| n.trunc())
                    .map_err(|_| {
                        invalid(
                            s.span(),
                            format!(
                                "{text:?} is not an address or CIDR range like \"10.0.0.0/8\" \
                                 or \"::1\""
                            ),
                        )
                    })
            })
            .collect()
    };
    let connect_ports = match &e.connect_ports {
        None => vec![PortRange(443, 443)],
        Some(ports) => ports
            .iter()
            .map(|p| {
                let range = match p.get_ref() {
                    spec::PortSpec::One(n) => Some(PortRange(*n, *n)),
                    spec::PortSpec::Range(r) => r.split_once('-').and_then(|(lo, hi)| {
                        Some(PortRange(lo.trim().parse().ok()?, hi.trim().parse().ok()?))
                    }),
                };
                match range {
                    Some(r) if r.0 != 0 && r.0 <= r.1 => Ok(r),
                    _ => Err(invalid(
                        p.span(),
                        "a port is a number from 1 to 65535 or a range \"8000-8999\" \
                         (\"1-65535\" for any)",
                    )),
                }
            })
            .collect::<Result<_>>()?,
    };
    Ok(EgressConfig {
        allow: nets(&e.allow)?,
        deny: nets(&e.deny)?,
        connect_ports,
    })
}

/// Limits as written, with the margins checked against what they are a margin of, and a
/// global scope against what can be shared.
fn check_limits(limits: &[toml::Spanned<Limit>], has_cluster: bool) -> Result<Vec<Limit>> {
    limits
        .iter()
        .map(|l| {
            let limit = l.get_ref();
            let fmt = units::fmt_duration;
            if limit.is_global() {
                if matches!(limit, Limit::Concurrency { .. }) {
                    return Err(invalid(
                        l.span(),
                        "a concurrency limit cannot be global: requests in flight are counted \
                         by each replica (docs/cluster.md); give each replica its share, or \
                         limit the rate globally instead",
                    ));
                }
                if !has_cluster {
                    return Err(invalid(
                        l.span(),
                        "scope = \"global\" needs a [cluster] section naming the Redis that \
                         the replicas share (docs/cluster.md)",
                    ));
                }
            }
            if let (Some(max), Some(margin)) = (limit.margin_max(), limit.margin())
                && max < margin
            {
                return Err(invalid(
                    l.span(),
                    format!(
                        "margin_max {} is less than the margin ({})",
                        fmt(max),
                        fmt(margin)
                    ),
                ));
            }
            check_edges(l)?;
            let margins = [
                ("margin", limit.margin()),
                ("margin_max", limit.margin_max()),
            ];
            for (key, margin) in margins.into_iter().filter_map(|(k, m)| Some((k, m?))) {
                match limit {
                    // Past half the window, a send could be unsure of two window edges at
                    // once, and the window would mostly be margin anyway.
                    Limit::SlidingWindow { window, .. }
                    | Limit::FixedWindow { window, .. }
                    | Limit::SlidingCounter { window, .. }
                    | Limit::Published { window, .. }
                        if margin > *window / 2 =>
                    {
                        return Err(invalid(
                            l.span(),
                            format!(
                                "{key} {} is more than half the window ({}); size it from the \
                                 round trip to the provider (docs/config.md)",
                                fmt(margin),
                                fmt(*window)
                            ),
                        ));
                    }
                    Limit::TokenBucket { per, .. } | Limit::LeakyBucket { per, .. }
                        if margin > *per =>
                    {
                        return Err(invalid(
                            l.span(),
                            format!(
                                "{key} {} is longer than the bucket's period ({}); size it from \
                                 the round trip to the provider (docs/config.md)",
                                fmt(margin),
                                fmt(*per)
                            ),
                        ));
                    }
                    _ => {}
                }
            }
            Ok(limit.clone())
        })
        .collect()
}

/// Where a limit's windows fall, and a rate nginx can count.
fn check_edges(l: &toml::Spanned<Limit>) -> Result<()> {
    let (offset, clock, window) = match l.get_ref() {
        Limit::FixedWindow {
            offset,
            align,
            window,
            ..
        } => (offset, *align == WindowAlign::Clock, window),
        Limit::SlidingCounter {
            offset,
            align,
            window,
            ..
        } => (offset, *align == CounterAlign::Clock, window),
        Limit::LeakyBucket { rate, per, .. } => {
            // nginx keeps rates in thousandths of a request per second, truncated.
            if u128::from(rate.get()) * 1_000 * 1_000_000_000 < per.as_nanos() {
                return Err(invalid(
                    l.span(),
                    format!(
                        "leaky_bucket {rate} per {} is below the slowest rate nginx counts \
                         (one request in 1000 s)",
                        units::fmt_duration(*per)
                    ),
                ));
            }
            return Ok(());
        }
        _ => return Ok(()),
    };
    match offset {
        Some(_) if !clock => Err(invalid(
            l.span(),
            "offset places windows on the clock: it needs align = \"clock\"",
        )),
        Some(o) if o >= window => Err(invalid(
            l.span(),
            format!(
                "offset {} must be shorter than the window ({})",
                units::fmt_duration(*o),
                units::fmt_duration(*window)
            ),
        )),
        _ => Ok(()),
    }
}

/// Where the Redis is: one primary (its URL, or a variable or file holding it), a Redis
/// Cluster's seed nodes, or Sentinels and the primary they watch; exactly one.
fn redis_target(c: &spec::ClusterSpec, span: &std::ops::Range<usize>) -> Result<RedisTarget> {
    let urls = |list: &toml::Spanned<Vec<String>>, key: &str| -> Result<Vec<String>> {
        if list.get_ref().is_empty() {
            return Err(invalid(list.span(), format!("cluster.{key} names no node")));
        }
        match list.get_ref().iter().find(|u| !is_redis_url(u)) {
            Some(bad) => Err(invalid(
                list.span(),
                format!(
                    "cluster.{key}: {} is not a redis:// or rediss:// URL",
                    redact_url(bad)
                ),
            )),
            None => Ok(list.get_ref().clone()),
        }
    };
    let named = [
        c.redis.is_some() || c.redis_env.is_some() || c.redis_file.is_some(),
        c.cluster_nodes.is_some(),
        c.sentinels.is_some(),
    ];
    if named.iter().filter(|n| **n).count() != 1 {
        return Err(invalid(
            span.clone(),
            "[cluster] needs exactly one of redis (one primary: the URL, or redis_env / \
             redis_file holding it), cluster_nodes (a Redis Cluster's seed nodes) or sentinels \
             (with sentinel_master)",
        ));
    }
    if c.sentinel_master.is_some() != c.sentinels.is_some() {
        return Err(invalid(
            c.sentinel_master
                .as_ref()
                .map_or(span.clone(), |m| m.span()),
            "sentinels and sentinel_master go together: the Sentinels' URLs and the name of \
             the primary they watch",
        ));
    }
    let redis = if let Some(nodes) = &c.cluster_nodes {
        RedisTarget::Cluster(urls(nodes, "cluster_nodes")?)
    } else if let (Some(sentinels), Some(master)) = (&c.sentinels, &c.sentinel_master) {
        RedisTarget::Sentinel {
            sentinels: urls(sentinels, "sentinels")?,
            master: master.get_ref().clone(),
        }
    } else {
        RedisTarget::Primary(match [&c.redis, &c.redis_env, &c.redis_file] {
            [Some(url), None, None] => {
                if !is_redis_url(url.get_ref()) {
                    return Err(invalid(
                        url.span(),
                        "cluster.redis must be a redis:// or rediss:// URL",
                    ));
                }
                RedisSource::Url(url.get_ref().clone())
            }
            [None, Some(name), None] => RedisSource::Env(name.get_ref().clone()),
            [None, None, Some(path)] => RedisSource::File(PathBuf::from(path.get_ref())),
            _ => {
                return Err(invalid(
                    span.clone(),
                    "[cluster] needs exactly one of redis (the URL), redis_env (a variable \
                     holding it) or redis_file (a file holding it)",
                ));
            }
        })
    };
    Ok(redis)
}

fn check_cluster(c: toml::Spanned<spec::ClusterSpec>) -> Result<ClusterConfig> {
    let span = c.span();
    let c = c.into_inner();
    let redis = redis_target(&c, &span)?;
    let password = Secret::of(c.password_env, c.password_file, "password", span.clone())?;
    let sentinel_password = Secret::of(
        c.sentinel_password_env,
        c.sentinel_password_file,
        "sentinel_password",
        span.clone(),
    )?;
    if password.is_some() && matches!(redis, RedisTarget::Primary(_)) {
        return Err(invalid(
            span,
            "password_env / password_file are for cluster_nodes and sentinels; with redis, \
             the URL carries the password (keep it in redis_env or redis_file)",
        ));
    }
    if sentinel_password.is_some() && !matches!(redis, RedisTarget::Sentinel { .. }) {
        return Err(invalid(
            span,
            "sentinel_password_env / sentinel_password_file need sentinels",
        ));
    }
    if c.on_redis_error == OnRedisError::Local && c.replicas.is_none() {
        return Err(invalid(
            span,
            "on_redis_error = \"local\" (the default) gives each replica limit / replicas while \
             Redis is away: set replicas = N, or on_redis_error = \"allow\" or \"deny\"",
        ));
    }
    Ok(ClusterConfig {
        redis,
        password,
        sentinel_password,
        ca: c.ca.map(PathBuf::from),
        on_redis_error: c.on_redis_error,
        replicas: c.replicas.map(|r| r.get()),
        timeout: c.timeout.map_or(Duration::from_millis(50), |d| d.0),
        failures: c.failures.map_or(3, |f| f.get()),
        open_for: c.open_for.map_or(Duration::from_secs(5), |d| d.0),
    })
}

fn parse_key(k: &toml::Spanned<String>) -> Result<KeySource> {
    let raw = k.get_ref();
    match raw.split_once(':') {
        Some(("header", name)) => HeaderName::from_bytes(name.trim().as_bytes())
            .map(KeySource::Header)
            .map_err(|_| invalid(k.span(), format!("{name:?} is not a valid header name"))),
        _ => Err(invalid(
            k.span(),
            format!("key {raw:?} is not understood; write it as \"header:NAME\""),
        )),
    }
}

fn parse_method(m: &toml::Spanned<String>) -> Result<Method> {
    let upper = m.get_ref().to_ascii_uppercase();
    Method::from_bytes(upper.as_bytes())
        .map_err(|_| invalid(m.span(), format!("{:?} is not an HTTP method", m.get_ref())))
}

fn check_classify(c: &toml::Spanned<spec::ClassifySpec>) -> Result<ClassifyRule> {
    let r = c.get_ref();
    let fail = |msg: &str| Err(invalid(c.span(), msg.to_string()));
    if let Some(s) = r.status
        && !(100..=599).contains(&s)
    {
        return fail("classify status must be an HTTP status code (100-599)");
    }
    match (&r.json, &r.equals) {
        (Some(p), Some(_)) if !(p.is_empty() || p.starts_with('/')) => {
            return fail("classify json must be a JSON pointer such as \"/error/code\"");
        }
        (Some(_), None) => return fail("classify json needs equals = [...] values to compare"),
        (None, Some(_)) => return fail("classify equals needs json = \"/pointer\" to read"),
        _ => {}
    }
    if r.status.is_none() && r.json.is_none() && r.body_contains.is_none() {
        return fail("classify rule matches nothing: give status, json + equals, or body_contains");
    }
    Ok(ClassifyRule {
        status: r.status,
        json: r.json.clone(),
        equals: r.equals.clone().unwrap_or_default(),
        body_contains: r.body_contains.clone(),
        action: r.action,
    })
}

#[cfg(test)]
mod tests;
