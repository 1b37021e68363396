//! The link to Redis, whatever its topology: one primary (or a managed endpoint whose
//! name follows the primary), a Redis Cluster, or a primary found through Sentinel. The
//! protocols of the last two are the `redis` crate's; this module builds its clients
//! from `[cluster]`, connects within the call's deadline, and names every failure by
//! what it means for shared limits ([`Fault`]).

use std::time::Duration;

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, RedisError, RedisFuture, Value};

use crate::config::{ClusterConfig, RedisTarget, redact_url};

/// Why a call to Redis failed, as `sluice_cluster_errors_total{kind}` labels it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Fault {
    /// No answer within `timeout`.
    Timeout,
    /// Could not connect, or find the primary through Sentinel.
    Connect,
    /// Refused the credentials (`NOAUTH`, `WRONGPASS`, `NOPERM`).
    Auth,
    /// The connection broke.
    Io,
    /// A replica: the primary moved (a failover, or `REPLICAOF`).
    ReadOnly,
    /// A replica that lost its primary (`replica-serve-stale-data no`).
    MasterDown,
    /// Loading its dataset after a restart.
    Loading,
    /// Running a script that does not end.
    Busy,
    /// `maxmemory` reached with a policy that evicts nothing.
    Oom,
    /// The script is not loaded, even after loading it once.
    NoScript,
    /// A Cluster redirect not resolved within the client's redirects.
    Moved,
    Ask,
    TryAgain,
    ClusterDown,
    CrossSlot,
    /// A key holds another type than the script expects (written by something else).
    WrongType,
    /// Any other error the script or Redis answered.
    Script,
    /// An answer the script never gives.
    Reply,
    /// Not called: the breaker is open.
    BreakerOpen,
}

impl Fault {
    /// Every fault, for the test that their labels are distinct.
    #[cfg(test)]
    pub(crate) const ALL: [Fault; 19] = [
        Fault::Timeout,
        Fault::Connect,
        Fault::Auth,
        Fault::Io,
        Fault::ReadOnly,
        Fault::MasterDown,
        Fault::Loading,
        Fault::Busy,
        Fault::Oom,
        Fault::NoScript,
        Fault::Moved,
        Fault::Ask,
        Fault::TryAgain,
        Fault::ClusterDown,
        Fault::CrossSlot,
        Fault::WrongType,
        Fault::Script,
        Fault::Reply,
        Fault::BreakerOpen,
    ];

    pub(crate) fn label(self) -> &'static str {
        match self {
            Fault::Timeout => "timeout",
            Fault::Connect => "connect",
            Fault::Auth => "auth",
            Fault::Io => "io",
            Fault::ReadOnly => "readonly",
            Fault::MasterDown => "masterdown",
            Fault::Loading => "loading",
            Fault::Busy => "busy",
            Fault::Oom => "oom",
            Fault::NoScript => "noscript",
            Fault::Moved => "moved",
            Fault::Ask => "ask",
            Fault::TryAgain => "tryagain",
            Fault::ClusterDown => "clusterdown",
            Fault::CrossSlot => "crossslot",
            Fault::WrongType => "wrongtype",
            Fault::Script => "script",
            Fault::Reply => "reply",
            Fault::BreakerOpen => "breaker_open",
        }
    }

    /// Whether the connection is dropped and made again for the next call: it is broken
    /// or hung, or it leads to a node that is no longer the primary, which a new
    /// connection finds again (DNS resolved anew, Sentinel asked anew, Cluster slots
    /// read anew).
    pub(crate) fn reconnects(self) -> bool {
        matches!(
            self,
            Fault::Timeout
                | Fault::Connect
                | Fault::Io
                | Fault::ReadOnly
                | Fault::MasterDown
                | Fault::Loading
                | Fault::Moved
                | Fault::Ask
                | Fault::ClusterDown
        )
    }

    /// A failure of a call that reached Redis, by the error's code.
    pub(crate) fn of(e: &RedisError) -> Fault {
        if e.is_timeout() {
            return Fault::Timeout;
        }
        if e.is_connection_refusal() {
            return Fault::Connect;
        }
        if e.is_io_error() || e.is_connection_dropped() {
            return Fault::Io;
        }
        Fault::of_code(e.code().unwrap_or(""))
    }

    fn of_code(code: &str) -> Fault {
        match code {
            "READONLY" => Fault::ReadOnly,
            "MASTERDOWN" => Fault::MasterDown,
            "LOADING" => Fault::Loading,
            "BUSY" => Fault::Busy,
            "OOM" => Fault::Oom,
            "NOSCRIPT" => Fault::NoScript,
            "MOVED" => Fault::Moved,
            "ASK" => Fault::Ask,
            "TRYAGAIN" => Fault::TryAgain,
            "CLUSTERDOWN" => Fault::ClusterDown,
            "CROSSSLOT" => Fault::CrossSlot,
            "WRONGTYPE" => Fault::WrongType,
            "NOAUTH" | "WRONGPASS" | "NOPERM" => Fault::Auth,
            _ => Fault::Script,
        }
    }

    /// A failure to connect: `Connect`, unless Redis answered with a reason. A refused
    /// password comes without a code (the client reports it as its own kind), from a
    /// Sentinel as from the primary.
    pub(crate) fn of_connect(e: &RedisError) -> Fault {
        match e.code().map(Fault::of_code) {
            Some(f) if f != Fault::Script => f,
            _ if e.kind() == redis::ErrorKind::AuthenticationFailed => Fault::Auth,
            _ if e.is_timeout() => Fault::Timeout,
            _ => Fault::Connect,
        }
    }
}

/// The clients for one `[cluster]`, with its secrets read.
pub(crate) enum Link {
    Primary(redis::Client),
    Cluster(redis::cluster::ClusterClient),
    /// Asked for the primary at every connection.
    Sentinel(tokio::sync::Mutex<redis::sentinel::SentinelClient>),
}

/// A connection on any topology: both kinds multiplex, so one is shared by every call.
#[derive(Clone)]
pub(crate) enum Conn {
    Single(MultiplexedConnection),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

/// `[cluster]` with its secrets read: what a reload compares to tell whether the link
/// must be made again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Resolved {
    pub(crate) urls: Vec<String>,
    pub(crate) password: Option<String>,
    pub(crate) sentinel_password: Option<String>,
}

impl Resolved {
    pub(crate) fn of(config: &ClusterConfig) -> Result<Resolved, String> {
        let read = |s: &Option<crate::config::Secret>| s.as_ref().map(|s| s.read()).transpose();
        Ok(Resolved {
            urls: match &config.redis {
                RedisTarget::Primary(source) => vec![source.url()?],
                RedisTarget::Cluster(nodes) => nodes.clone(),
                RedisTarget::Sentinel { sentinels, .. } => sentinels.clone(),
            },
            password: read(&config.password)?,
            sentinel_password: read(&config.sentinel_password)?,
        })
    }
}

/// How many times the Cluster client follows `MOVED`/`ASK` or waits out `TRYAGAIN` and
/// `CLUSTERDOWN` within one call, before the call fails (and counts toward the breaker).
const CLUSTER_RETRIES: u32 = 3;

impl Link {
    pub(crate) fn new(config: &ClusterConfig, r: &Resolved) -> Result<Link, String> {
        let certs = match &config.ca {
            Some(ca) => Some(redis::TlsCertificates {
                client_tls: None,
                root_cert: Some(
                    std::fs::read(ca)
                        .map_err(|e| format!("cannot read cluster.ca {}: {e}", ca.display()))?,
                ),
            }),
            None => None,
        };
        let bad = |e: RedisError| format!("{} is not usable: {e}", config.redis);
        match &config.redis {
            RedisTarget::Primary(_) => {
                let url = r.urls.first().map(String::as_str).unwrap_or_default();
                let client = match certs {
                    Some(c) => redis::Client::build_with_tls(url, c),
                    None => redis::Client::open(url),
                };
                client.map(Link::Primary).map_err(bad)
            }
            RedisTarget::Cluster(_) => {
                let mut b = redis::cluster::ClusterClientBuilder::new(r.urls.iter().cloned())
                    .connection_timeout(config.timeout)
                    .response_timeout(config.timeout)
                    .retries(CLUSTER_RETRIES)
                    // Waits between a call's own retries: short, as the whole call is
                    // bounded by `timeout` anyway.
                    .min_retry_wait(1)
                    .max_retry_wait(u64::try_from(config.timeout.as_millis() / 4).unwrap_or(10));
                if let Some(p) = &r.password {
                    b = b.password(p);
                }
                if let Some(c) = certs {
                    b = b.certs(c);
                }
                b.build().map(Link::Cluster).map_err(bad)
            }
            RedisTarget::Sentinel { master, .. } => {
                let addrs = r
                    .urls
                    .iter()
                    .map(|u| {
                        redis::IntoConnectionInfo::into_connection_info(u.as_str())
                            .map(|i| i.addr().clone())
                            .map_err(|e| format!("{}: {e}", redact_url(u)))
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                let tls = r.urls.iter().any(|u| u.starts_with("rediss://"));
                let mut b = redis::sentinel::SentinelClientBuilder::new(
                    addrs,
                    master,
                    redis::sentinel::SentinelServerType::Master,
                )
                .map_err(bad)?;
                if let Some(p) = &r.password {
                    b = b.set_client_to_redis_password(p);
                }
                if let Some(p) = sentinel_password(r) {
                    b = b.set_client_to_sentinel_password(p);
                }
                if tls {
                    b = b
                        .set_client_to_sentinel_tls_mode(redis::TlsMode::Secure)
                        .set_client_to_redis_tls_mode(redis::TlsMode::Secure);
                    if let Some(c) = certs {
                        b = b
                            .set_client_to_sentinel_certificates(c.clone())
                            .set_client_to_redis_certificates(c);
                    }
                }
                b.build()
                    .map(|c| Link::Sentinel(tokio::sync::Mutex::new(c)))
                    .map_err(bad)
            }
        }
    }

    /// A new connection: DNS resolved again, the Sentinels asked again, the Cluster's
    /// slots read again.
    pub(crate) async fn connect(&self, timeout: Duration) -> Result<Conn, RedisError> {
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout));
        match self {
            Link::Primary(client) => client
                .get_multiplexed_async_connection_with_config(&config)
                .await
                .map(Conn::Single),
            Link::Cluster(client) => client.get_async_connection().await.map(Conn::Cluster),
            Link::Sentinel(client) => client
                .lock()
                .await
                .get_async_connection_with_config(&config)
                .await
                .map(Conn::Single),
        }
    }
}

/// The Sentinels' password: its own setting, else the one in their URLs.
fn sentinel_password(r: &Resolved) -> Option<String> {
    r.sentinel_password.clone().or_else(|| {
        r.urls.iter().find_map(|u| {
            redis::IntoConnectionInfo::into_connection_info(u.as_str())
                .ok()
                .and_then(|i| i.redis_settings().password().map(str::to_string))
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_code_has_its_fault() {
        for (code, fault) in [
            ("READONLY", Fault::ReadOnly),
            ("MASTERDOWN", Fault::MasterDown),
            ("LOADING", Fault::Loading),
            ("BUSY", Fault::Busy),
            ("OOM", Fault::Oom),
            ("NOSCRIPT", Fault::NoScript),
            ("MOVED", Fault::Moved),
            ("ASK", Fault::Ask),
            ("TRYAGAIN", Fault::TryAgain),
            ("CLUSTERDOWN", Fault::ClusterDown),
            ("WRONGTYPE", Fault::WrongType),
            ("WRONGPASS", Fault::Auth),
            ("ERR", Fault::Script),
        ] {
            assert_eq!(Fault::of_code(code), fault, "{code}");
        }
        let refused = RedisError::from((
            redis::ErrorKind::AuthenticationFailed,
            "Password authentication failed",
        ));
        assert_eq!(Fault::of_connect(&refused), Fault::Auth);
        let labels: std::collections::HashSet<_> = Fault::ALL.iter().map(|f| f.label()).collect();
        assert_eq!(labels.len(), Fault::ALL.len(), "one label each");
    }
}
