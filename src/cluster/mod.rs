//! Shared limits through Redis: the `scope = "global"` limits of every replica connected
//! to the same `[cluster]` Redis are one budget.
//!
//! A request pays its local limits first, FIFO in its family's queue as always. Then the
//! family's head, one request at a time per replica and family ([`partition::Shared`]'s
//! gate), runs one script (`reserve.lua`) that decides on Redis's clock the earliest
//! instant at which *all* of the request's global limits admit it, records it, and
//! returns it; the replica sleeps until then. One call per request; the order of calls
//! is the order of admissions, so replicas share by demand and none starves. An instant
//! further away than the horizon is not reserved (asked again later); one beyond
//! `max_wait` is refused at once; a request that leaves hands its reservation to the next
//! one in line.
//!
//! A reserved request counts, in Redis, as reaching the provider between its instant and
//! that plus the limit's margin. What the replica then sees (sent late, answered sooner,
//! never sent) goes back to Redis as corrections, carried by the replica's next call or
//! flushed shortly after, so shared windows free a permit when the provider does, as
//! local ones do.
//!
//! Every call is bounded by `timeout`; `failures` failures in a row open a breaker that
//! probes again after `open_for`. Meanwhile `on_redis_error` decides: `local` (each
//! replica holds `limit / replicas` itself, starting drained), `allow` or `deny`. When
//! Redis is back, or has lost its data (its epoch key changed), each replica writes back
//! what it admitted in the windows still running before it reserves again.

mod breaker;
pub mod partition;

use parking_lot::Mutex;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use tokio::time::Instant;

use crate::config::{ClusterConfig, CounterAlign, Limit, OnRedisError, Rounding, WindowAlign};
use crate::limit::kinds::Pace;
use crate::metrics::Metrics;
use breaker::Breaker;

/// The script every call runs.
pub const SCRIPT: &str = include_str!("reserve.lua");

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("cluster: {0}")]
    Url(String),
    #[error("cluster: the Redis URL is not valid: {0}")]
    Client(#[source] redis::RedisError),
}

/// A failed call, by what the metrics call it.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    #[error("no answer within the cluster timeout")]
    Timeout,
    #[error("cannot connect: {0}")]
    Connect(#[source] redis::RedisError),
    #[error("the connection failed: {0}")]
    Io(#[source] redis::RedisError),
    #[error("the script failed: {0}")]
    Script(#[source] redis::RedisError),
    #[error("unexpected answer: {0}")]
    Reply(String),
    #[error("the breaker around Redis is open")]
    BreakerOpen,
}

impl CallError {
    fn kind(&self) -> &'static str {
        match self {
            CallError::Timeout => "timeout",
            CallError::Connect(_) => "connect",
            CallError::Io(_) => "io",
            CallError::Script(_) | CallError::Reply(_) => "script",
            CallError::BreakerOpen => "breaker_open",
        }
    }
}

/// How global limits are decided at a given moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Redis,
    Local,
    Allow,
    Deny,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Redis => "redis",
            Mode::Local => "local",
            Mode::Allow => "allow",
            Mode::Deny => "deny",
        }
    }

    const ALL: [Mode; 4] = [Mode::Redis, Mode::Local, Mode::Allow, Mode::Deny];
}

/// The kind of a global limit as the script knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
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

/// One global limit: its key suffix, and its parameters as each call passes them.
#[derive(Debug)]
pub struct GlobalLimit {
    /// Unique within the upstream and stable across reloads of the same limit:
    /// `u0.s` (the upstream's first limit, a sliding window), `f.orders.1.t`.
    pub id: Arc<str>,
    pub spec: Limit,
    pub kind: Kind,
    /// Windows and counters: permits; GCRA: the emission interval in microseconds.
    a: f64,
    /// Windows and counters: the window; GCRA: the tolerance.
    b: f64,
    /// Where clock windows start, past multiples of the window since the Unix epoch
    /// (microseconds); `None` for any alignment (counters) or none at all.
    offset: Option<f64>,
    pub margin: Duration,
    /// How long an admission matters to it: a window (two for a counter, whose previous
    /// window still weighs), or a GCRA's emission interval times its burst.
    pub span: Duration,
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

    /// The limit as the script takes it: kind, a, b and c (see `reserve.lua`).
    pub fn script_args(&self) -> [String; 4] {
        let kind = match self.kind {
            Kind::Sliding => "s",
            Kind::Fixed => "f",
            Kind::Calendar => "k",
            Kind::Counter { rounds_down: true } => "c",
            Kind::Counter { rounds_down: false } => "u",
            Kind::Token => "t",
        };
        // A clock window's offset, `any` for a counter at any alignment, else unused.
        let c = match (self.kind, self.offset) {
            (_, Some(o)) => format!("{o:.0}"),
            (Kind::Counter { .. }, None) => "any".into(),
            _ => "0".into(),
        };
        [
            kind.into(),
            format!("{:.3}", self.a),
            format!("{:.3}", self.b),
            c,
        ]
    }

    fn is_window(&self) -> bool {
        self.kind != Kind::Token
    }
}

pub(crate) fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1_000_000.0
}

/// What one call returned.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    /// Reserved `wait` from Redis's `now` (microseconds); `openings`: for each fixed
    /// window of the call, the instant its window opened.
    Reserved {
        wait: Duration,
        now: f64,
        epoch: String,
        openings: Vec<f64>,
    },
    /// Further than the horizon: not reserved.
    Later { wait: Duration, epoch: String },
    /// Further than max wait, or not found within the script's rounds.
    TooLate { wait: Duration, epoch: String },
    /// Redis holds another epoch than the caller knew: it lost its data. Nothing done.
    EpochChanged { epoch: String },
    /// A flush or a write-back went through.
    Done { now: f64, epoch: String },
}

impl Reply {
    fn parse(v: redis::Value, op: &str) -> Result<Reply, CallError> {
        let bad = |what: &str| CallError::Reply(format!("{op}: {what}"));
        let redis::Value::Array(items) = v else {
            return Err(bad("not an array"));
        };
        let int = |v: Option<&redis::Value>| match v {
            Some(redis::Value::Int(i)) => Ok(*i),
            _ => Err(bad("expected an integer")),
        };
        let text = |v: Option<&redis::Value>| match v {
            Some(redis::Value::BulkString(b)) => Ok(String::from_utf8_lossy(b).into_owned()),
            Some(redis::Value::SimpleString(s)) => Ok(s.clone()),
            _ => Err(bad("expected a string")),
        };
        let status = int(items.first())?;
        let wait = Duration::from_micros(u64::try_from(int(items.get(1))?).unwrap_or(0));
        let epoch = text(items.get(2))?;
        let now: f64 = text(items.get(3))?
            .parse()
            .map_err(|_| bad("now is not a number"))?;
        Ok(match (op, status) {
            ("reserve", 0) => Reply::Reserved {
                wait,
                now,
                epoch,
                openings: items[4.min(items.len())..]
                    .iter()
                    .map(|v| text(Some(v)).map(|s| s.parse().unwrap_or(0.0)))
                    .collect::<Result<_, _>>()?,
            },
            (_, 0) => Reply::Done { now, epoch },
            (_, 1) => Reply::Later { wait, epoch },
            (_, 2) => Reply::TooLate { wait, epoch },
            (_, 3) => Reply::EpochChanged { epoch },
            _ => return Err(bad("unknown status")),
        })
    }
}

/// The Redis side of shared limits: the connection, the script, the breaker, the mode.
pub struct Cluster {
    config: ClusterConfig,
    /// The URL it was built with, to tell whether a reload changes it.
    url: String,
    client: redis::Client,
    /// One multiplexed connection for every worker, made again after a failure.
    conn: tokio::sync::Mutex<Option<MultiplexedConnection>>,
    script: redis::Script,
    breaker: Mutex<Breaker>,
    metrics: Metrics,
    /// Prefix of this process's reservation ids, random per start.
    replica: String,
    seq: AtomicU64,
    /// The mode last shown in `sluice_cluster_mode`.
    shown: AtomicU8,
    /// A failed call is being confirmed (see `confirm`).
    confirming: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("redis", &self.config.redis.to_string())
            .finish()
    }
}

impl Cluster {
    pub fn new(config: &ClusterConfig, metrics: &Metrics) -> Result<Arc<Cluster>, ClusterError> {
        let url = config.redis.url().map_err(ClusterError::Url)?;
        // redis-rs builds its TLS config from the process's default provider: the same
        // ring that every other TLS connection of sluice uses.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let client = match &config.ca {
            Some(ca) => {
                let pem = std::fs::read(ca).map_err(|e| {
                    ClusterError::Url(format!("cannot read cluster.ca {}: {e}", ca.display()))
                })?;
                redis::Client::build_with_tls(
                    url.as_str(),
                    redis::TlsCertificates {
                        client_tls: None,
                        root_cert: Some(pem),
                    },
                )
            }
            None => redis::Client::open(url.as_str()),
        }
        .map_err(ClusterError::Client)?;
        let c = Cluster {
            config: config.clone(),
            url,
            client,
            conn: tokio::sync::Mutex::new(None),
            script: redis::Script::new(SCRIPT),
            breaker: Mutex::new(Breaker::new(config.failures, config.open_for)),
            metrics: metrics.clone(),
            replica: format!("{:08x}", rand::random::<u32>()),
            seq: AtomicU64::new(0),
            shown: AtomicU8::new(u8::MAX),
            confirming: std::sync::atomic::AtomicBool::new(false),
        };
        c.show(Mode::Redis);
        Ok(Arc::new(c))
    }

    pub fn config(&self) -> &ClusterConfig {
        &self.config
    }

    /// Whether `config` describes this very cluster (the same settings, and the same URL
    /// where it is read from a variable or a file).
    pub fn same(&self, config: &ClusterConfig) -> bool {
        self.config == *config && config.redis.url().is_ok_and(|u| u == self.url)
    }

    /// A reservation id unique to this process.
    fn member(&self) -> String {
        format!(
            "{}:{}",
            self.replica,
            self.seq.fetch_add(1, Ordering::Relaxed)
        )
    }

    fn breaker(&self) -> parking_lot::MutexGuard<'_, Breaker> {
        self.breaker.lock()
    }

    /// How global limits are decided now: through Redis while the breaker lets calls
    /// through, else as `on_redis_error` says.
    pub fn mode(&self, now: Instant) -> Mode {
        let m = if self.breaker().state(now) == breaker::State::Closed {
            Mode::Redis
        } else {
            self.fallback_mode()
        };
        self.show(m);
        m
    }

    fn fallback_mode(&self) -> Mode {
        match self.config.on_redis_error {
            OnRedisError::Local => Mode::Local,
            OnRedisError::Allow => Mode::Allow,
            OnRedisError::Deny => Mode::Deny,
        }
    }

    /// Keeps `sluice_cluster_mode` at 1 for `m` and 0 for the others.
    fn show(&self, m: Mode) {
        let i = m as u8;
        if self.shown.swap(i, Ordering::Relaxed) != i {
            for other in Mode::ALL {
                self.metrics
                    .cluster_mode
                    .with_label_values(&[other.as_str()])
                    .set(i64::from(other == m));
            }
        }
    }

    /// The last outage during which replicas may have admitted without Redis: when the
    /// breaker opened, and when Redis answered again if it has (`None` under `deny`,
    /// where nothing is admitted without Redis).
    pub fn outage(&self) -> Option<(Instant, Option<Instant>)> {
        match self.config.on_redis_error {
            OnRedisError::Deny => None,
            OnRedisError::Local | OnRedisError::Allow => self.breaker().outage(),
        }
    }

    /// When the breaker lets a call through again, if it is holding them back.
    pub fn reopens_at(&self) -> Option<Instant> {
        self.breaker().open_until()
    }

    /// Runs one script call, bounded by `timeout`, through the breaker.
    async fn run(
        self: &Arc<Self>,
        op: &'static str,
        inv: redis::ScriptInvocation<'_>,
    ) -> Result<Reply, CallError> {
        if !self.breaker().allow(Instant::now()) {
            self.metrics
                .cluster_errors
                .with_label_values(&["breaker_open"])
                .inc();
            return Err(CallError::BreakerOpen);
        }
        let start = Instant::now();
        let result = tokio::time::timeout(self.config.timeout, async {
            let mut conn = self.connection().await?;
            let v: redis::Value = inv.invoke_async(&mut conn).await.map_err(|e| {
                if e.is_io_error() || e.is_connection_dropped() || e.is_timeout() {
                    CallError::Io(e)
                } else {
                    CallError::Script(e)
                }
            })?;
            Reply::parse(v, op)
        })
        .await
        .unwrap_or(Err(CallError::Timeout));
        self.metrics
            .cluster_calls
            .with_label_values(&[op])
            .observe(start.elapsed().as_secs_f64());
        match &result {
            Ok(_) => self.breaker().success(Instant::now()),
            Err(e) => {
                self.metrics
                    .cluster_errors
                    .with_label_values(&[e.kind()])
                    .inc();
                // A connection that failed or hung is not used again: its pipeline may
                // hold answers to calls that gave up.
                if !matches!(e, CallError::Script(_) | CallError::Reply(_))
                    && let Ok(mut conn) = self.conn.try_lock()
                {
                    *conn = None;
                }
                self.failed(e);
                self.confirm();
            }
        }
        result
    }

    /// Counts a failure; the one that opens the breaker is logged.
    fn failed(&self, e: &CallError) {
        if self.breaker().failure(Instant::now()) {
            tracing::warn!(
                redis = %self.config.redis, error = %e,
                fallback = self.fallback_mode().as_str(),
                retry_in = %crate::config::units::fmt_duration(self.config.open_for),
                "Redis failed {} times in a row: shared limits fall back", self.config.failures
            );
        } else {
            tracing::debug!(error = %e, "a Redis call failed");
        }
    }

    /// After a failed call, asks Redis again at once (PING) until it answers or the
    /// breaker opens. Calls come at the pace of requests that need Redis, which may be
    /// slow while replicas sleep on reservations; this keeps a dead Redis from being
    /// noticed late: within `timeout × failures` of the first failure.
    fn confirm(self: &Arc<Self>) {
        if self.confirming.swap(true, Ordering::AcqRel) {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            self.confirming.store(false, Ordering::Release);
            return;
        };
        let me = self.clone();
        rt.spawn(async move {
            while me.breaker().state(Instant::now()) == breaker::State::Closed {
                let ping = tokio::time::timeout(me.config.timeout, async {
                    let mut conn = me.connection().await?;
                    redis::cmd("PING")
                        .query_async::<String>(&mut conn)
                        .await
                        .map_err(CallError::Io)
                })
                .await
                .unwrap_or(Err(CallError::Timeout));
                match ping {
                    Ok(_) => {
                        me.breaker().success(Instant::now());
                        break;
                    }
                    Err(e) => {
                        me.metrics
                            .cluster_errors
                            .with_label_values(&[e.kind()])
                            .inc();
                        if let Ok(mut conn) = me.conn.try_lock() {
                            *conn = None;
                        }
                        me.failed(&e);
                    }
                }
            }
            me.mode(Instant::now());
            me.confirming.store(false, Ordering::Release);
        });
    }

    async fn connection(&self) -> Result<MultiplexedConnection, CallError> {
        let mut slot = self.conn.lock().await;
        if let Some(c) = &*slot {
            return Ok(c.clone());
        }
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.config.timeout))
            .set_response_timeout(Some(self.config.timeout));
        let conn = self
            .client
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .map_err(CallError::Connect)?;
        *slot = Some(conn.clone());
        Ok(conn)
    }

    /// For `/buckets` and `explain`.
    pub fn describe(&self) -> serde_json::Value {
        let now = Instant::now();
        serde_json::json!({
            "redis": self.config.redis.to_string(),
            "mode": self.mode(now).as_str(),
            "on_redis_error": self.fallback_mode().as_str(),
            "replicas": self.config.replicas,
        })
    }
}
