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
//! local ones do. A small limit, whose next instant waits on an answer not yet in, is
//! taken in turns: the replica that gets the answer asks next, its correction riding on
//! the call, for a run of its waiting requests; the others are told when to come back.
//! Turns decide who asks when, never what is admitted.
//!
//! Redis is one primary, a Sentinel-watched primary or a Redis Cluster ([`link`]). Every
//! call is bounded by `timeout` and never retried in a loop: a request gives up on Redis
//! after two failed calls of its own, and `failures` failures in a row open a breaker
//! that probes again after `open_for`. Meanwhile `on_redis_error` decides: `local` (each
//! replica holds its share of each limit itself, starting drained), `allow` or `deny`. When
//! Redis is back, or has lost its data (its epoch key changed), each replica writes back
//! what it admitted in the windows still running before it reserves again.

mod breaker;
pub(crate) mod link;
pub(crate) mod partition;

use parking_lot::Mutex;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use crate::config::{ClusterConfig, OnRedisError};
pub(crate) use crate::limit::shared::{GlobalLimit, Kind, micros};
use crate::metrics::Metrics;
use breaker::Breaker;
use link::{Conn, Fault, Link, Resolved};

/// The script every call runs, as written.
const SOURCE: &str = include_str!("reserve.lua");

/// The script as Redis gets it: without its comment lines, which would take about half
/// of the memory Redis keeps for it (a Redis with a tight `maxmemory` counts it).
pub fn script() -> &'static str {
    static STRIPPED: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    STRIPPED.get_or_init(|| {
        SOURCE
            .lines()
            .filter(|l| {
                let l = l.trim_start();
                !l.is_empty() && !l.starts_with("--")
            })
            .collect::<Vec<_>>()
            .join("\n")
    })
}

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("cluster: {0}")]
    Config(String),
}

/// A failed call.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CallError {
    #[error("no answer within the cluster timeout")]
    Timeout,
    #[error("cannot connect: {1}")]
    Connect(Fault, #[source] redis::RedisError),
    #[error("{1}")]
    Redis(Fault, #[source] redis::RedisError),
    #[error("unexpected answer: {0}")]
    Reply(String),
    #[error("the breaker around Redis is open")]
    BreakerOpen,
}

impl CallError {
    fn fault(&self) -> Fault {
        match self {
            CallError::Timeout => Fault::Timeout,
            CallError::Connect(f, _) | CallError::Redis(f, _) => *f,
            CallError::Reply(_) => Fault::Reply,
            CallError::BreakerOpen => Fault::BreakerOpen,
        }
    }
}

/// How global limits are decided at a given moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    Redis,
    Local,
    Allow,
    Deny,
}

impl Mode {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Mode::Redis => "redis",
            Mode::Local => "local",
            Mode::Allow => "allow",
            Mode::Deny => "deny",
        }
    }

    const ALL: [Mode; 4] = [Mode::Redis, Mode::Local, Mode::Allow, Mode::Deny];
}

/// The limit as the script takes it: kind, a, b and c (see `reserve.lua`).
pub fn script_args(l: &GlobalLimit) -> [String; 4] {
    let kind = match l.kind {
        Kind::Sliding => "s",
        Kind::Fixed => "f",
        Kind::Calendar => "k",
        Kind::Counter { rounds_down: true } => "c",
        Kind::Counter { rounds_down: false } => "u",
        Kind::Token => "t",
    };
    // A clock window's offset, `any` for a counter at any alignment, else unused.
    let c = match (l.kind, l.offset) {
        (_, Some(o)) => format!("{o:.0}"),
        (Kind::Counter { .. }, None) => "any".into(),
        _ => "0".into(),
    };
    [kind.into(), format!("{:.3}", l.a), format!("{:.3}", l.b), c]
}

/// What one call returned.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Reply {
    /// Reserved `wait` from Redis's `now` (microseconds); `openings`: for each fixed
    /// window of the call, the instant its window opened.
    Reserved {
        wait: Duration,
        now: f64,
        epoch: String,
        openings: Vec<f64>,
        /// The next request would wait on this one's answer: ask for it once the answer
        /// is in.
        chained: bool,
        /// Other replicas wait for their turn: send this one's answer at once.
        contended: bool,
        /// This replica's run is over: its next request asks no sooner than this.
        comes_back: Option<Duration>,
    },
    /// Further than the horizon: not reserved.
    Later { wait: Duration, epoch: String },
    /// Further than max wait, or not found within the script's rounds.
    TooLate { wait: Duration, epoch: String },
    /// Redis holds another epoch than the caller knew: it lost its data. Nothing done.
    EpochChanged { epoch: String },
    /// Not reserved: it waits on an answer not yet in, or on another replica's turn.
    /// Come back `wait` from now.
    Turn { wait: Duration, epoch: String },
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
            ("reserve" | "settle", 0) => {
                let flags = text(items.get(4))?;
                let back = u64::try_from(int(items.get(5))?).unwrap_or(0);
                Reply::Reserved {
                    wait,
                    now,
                    epoch,
                    comes_back: (back > 0).then(|| Duration::from_micros(back)),
                    openings: items[6.min(items.len())..]
                        .iter()
                        .map(|v| text(Some(v)).map(|s| s.parse().unwrap_or(0.0)))
                        .collect::<Result<_, _>>()?,
                    chained: flags.contains('c'),
                    contended: flags.contains('w'),
                }
            }
            (_, 0) => Reply::Done { now, epoch },
            (_, 1) => Reply::Later { wait, epoch },
            (_, 2) => Reply::TooLate { wait, epoch },
            (_, 3) => Reply::EpochChanged { epoch },
            (_, 4) => Reply::Turn { wait, epoch },
            _ => return Err(bad("unknown status")),
        })
    }
}

/// The Redis side of shared limits: the connection, the script, the breaker, the mode.
pub(crate) struct Cluster {
    config: ClusterConfig,
    /// The settings with their secrets read, to tell whether a reload changes them.
    resolved: Resolved,
    link: Link,
    /// One multiplexed connection for every worker, made again after a failure that
    /// may have left it broken or pointed at a node that is no longer the primary.
    conn: tokio::sync::Mutex<Option<Conn>>,
    script: redis::Script,
    breaker: Mutex<Breaker>,
    metrics: Metrics,
    /// Prefix of this process's reservation ids, random per start.
    replica: String,
    seq: AtomicU64,
    /// The mode last shown in `sluice_cluster_mode`.
    shown: AtomicU8,
    /// When each kind of failure was last logged, and how many since went unlogged.
    warned: Mutex<std::collections::HashMap<Fault, (Instant, u64)>>,
}

/// Failed calls after which a request gives up on Redis and opens the breaker, even if
/// other calls succeed (one node of a Redis Cluster failing, say). With the breaker,
/// this bounds a replica's calls to about twice its request rate whatever Redis
/// answers.
pub(crate) const OWN_FAILURES: u32 = 2;

/// A kind of failure is logged at most this often; the line says how many it stands for.
const WARN_EVERY: Duration = Duration::from_secs(10);

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("redis", &self.config.redis.to_string())
            .finish()
    }
}

impl Cluster {
    pub(crate) fn new(
        config: &ClusterConfig,
        metrics: &Metrics,
    ) -> Result<Arc<Cluster>, ClusterError> {
        let resolved = Resolved::of(config).map_err(ClusterError::Config)?;
        // redis-rs builds its TLS config from the process's default provider: the same
        // ring that every other TLS connection of sluice uses.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let link = Link::new(config, &resolved).map_err(ClusterError::Config)?;
        let c = Cluster {
            config: config.clone(),
            resolved,
            link,
            conn: tokio::sync::Mutex::new(None),
            script: redis::Script::new(script()),
            breaker: Mutex::new(Breaker::new(config.failures, config.open_for)),
            metrics: metrics.clone(),
            replica: format!("{:08x}", rand::random::<u32>()),
            seq: AtomicU64::new(0),
            shown: AtomicU8::new(u8::MAX),
            warned: Mutex::default(),
        };
        c.show(Mode::Redis);
        Ok(Arc::new(c))
    }

    /// Whether `config` describes this very cluster (the same settings, and the same URLs
    /// and passwords where they are read from a variable or a file).
    pub(crate) fn same(&self, config: &ClusterConfig) -> bool {
        self.config == *config && Resolved::of(config).is_ok_and(|r| r == self.resolved)
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
    pub(crate) fn mode(&self, now: Instant) -> Mode {
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
    pub(crate) fn outage(&self) -> Option<(Instant, Option<Instant>)> {
        match self.config.on_redis_error {
            OnRedisError::Deny => None,
            OnRedisError::Local | OnRedisError::Allow => self.breaker().outage(),
        }
    }

    /// When the breaker lets a call through again, if it is holding them back.
    pub(crate) fn reopens_at(&self) -> Option<Instant> {
        self.breaker().open_until()
    }

    /// Runs one script call, bounded by `timeout`, through the breaker. A failure is
    /// never retried here: the caller decides, within its own bound (see
    /// [`OWN_FAILURES`]), so that whatever Redis answers, a request costs a
    /// few calls at most and the breaker, not a loop, decides when to stop asking.
    async fn run(
        self: &Arc<Self>,
        op: &'static str,
        inv: redis::ScriptInvocation<'_>,
    ) -> Result<Reply, CallError> {
        if !self.breaker().allow(Instant::now()) {
            self.metrics
                .cluster_errors
                .with_label_values(&[Fault::BreakerOpen.label()])
                .inc();
            return Err(CallError::BreakerOpen);
        }
        let start = Instant::now();
        let result = tokio::time::timeout(self.config.timeout, async {
            let mut conn = self.connection().await?;
            let v: redis::Value = inv
                .invoke_async(&mut conn)
                .await
                .map_err(|e| CallError::Redis(Fault::of(&e), e))?;
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
                let fault = e.fault();
                self.metrics
                    .cluster_errors
                    .with_label_values(&[fault.label()])
                    .inc();
                // A connection that failed or hung is not used again: its pipeline may
                // hold answers to calls that gave up. One that leads to a replica is
                // made again to find the primary.
                if fault.reconnects()
                    && let Ok(mut conn) = self.conn.try_lock()
                {
                    *conn = None;
                }
                self.failed(e);
            }
        }
        result
    }

    /// Opens the breaker now: a request gave up on Redis after failed calls of its own.
    pub(crate) fn trip(&self, now: Instant) {
        if self.breaker().trip(now) {
            tracing::warn!(
                redis = %self.config.redis,
                fallback = self.fallback_mode().as_str(),
                retry_in = %crate::config::units::fmt_duration(self.config.open_for),
                "a request's Redis calls failed {} times: shared limits fall back",
                OWN_FAILURES.min(self.config.failures)
            );
        }
    }

    /// Counts a failure; the one that opens the breaker is logged, and each kind of
    /// failure at most every [`WARN_EVERY`].
    fn failed(&self, e: &CallError) {
        let now = Instant::now();
        if self.breaker().failure(now) {
            tracing::warn!(
                redis = %self.config.redis, kind = e.fault().label(), error = %e,
                fallback = self.fallback_mode().as_str(),
                retry_in = %crate::config::units::fmt_duration(self.config.open_for),
                "Redis failed {} times in a row: shared limits fall back", self.config.failures
            );
            return;
        }
        let unlogged = {
            let mut warned = self.warned.lock();
            match warned.get_mut(&e.fault()) {
                Some((at, n)) if now < *at + WARN_EVERY => {
                    *n += 1;
                    None
                }
                Some((at, n)) => {
                    *at = now;
                    Some(std::mem::take(n))
                }
                None => {
                    warned.insert(e.fault(), (now, 0));
                    Some(0)
                }
            }
        };
        if let Some(unlogged) = unlogged {
            tracing::warn!(
                redis = %self.config.redis, kind = e.fault().label(), error = %e, unlogged,
                "a Redis call failed"
            );
        }
    }

    async fn connection(&self) -> Result<Conn, CallError> {
        let mut slot = self.conn.lock().await;
        if let Some(c) = &*slot {
            return Ok(c.clone());
        }
        let conn = self
            .link
            .connect(self.config.timeout)
            .await
            .map_err(|e| CallError::Connect(Fault::of_connect(&e), e))?;
        *slot = Some(conn.clone());
        Ok(conn)
    }

    /// For `/buckets` and `explain`.
    pub(crate) fn describe(&self) -> serde_json::Value {
        let now = Instant::now();
        serde_json::json!({
            "redis": self.config.redis.to_string(),
            "mode": self.mode(now).as_str(),
            "on_redis_error": self.fallback_mode().as_str(),
            "replicas": self.config.replicas,
        })
    }
}
