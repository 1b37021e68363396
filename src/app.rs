//! The application: the live config with everything built from it, the metrics, the
//! limiter and the resolver, shared by every connection. A reload builds a whole new
//! [`Live`] beside the old one and swaps it in only when every part of it succeeded.
//! Tests build their own app with [`App::builder`].

use parking_lot::Mutex;
use std::ops::Deref;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use prometheus::Registry;
use tokio::sync::watch;

use crate::cluster::{Cluster, ClusterError};
use crate::config::{Config, Overrides};
use crate::egress::{Lookup, Resolver, Rules};
use crate::limit::shared::Store;
use crate::limit::{Limiter, Plans};
use crate::metrics::Metrics;
use crate::policy::Policies;
use crate::route::{Route, Router};
use crate::tls::HandshakeLog;
use crate::tls::TlsError;
use crate::tls::ca::Authority;
use crate::upstream::pooled::UpstreamClient;

/// One config and everything built from it. A request takes the `Arc<Live>` in force when
/// it arrives and keeps it to its end, so its route, limits, policies and clients always
/// come from the same config.
pub(crate) struct Live {
    pub(crate) config: Config,
    /// The config's hosts, indexed for routing.
    pub(crate) router: Router,
    /// The limiter's view of each upstream, by upstream index.
    pub(crate) plans: Plans,
    pub(crate) policies: Policies,
    /// The client for upstreams without an `upstream_ca`: carried across reloads, with
    /// its pooled connections, unless the egress rules changed (connections they would
    /// now refuse must not be reused).
    client: UpstreamClient,
    /// Clients for upstreams that trust an extra CA (`upstream_ca`), by upstream index.
    upstream_clients: Vec<Option<UpstreamClient>>,
    /// The interception CA, when an upstream intercepts.
    pub(crate) authority: Option<Arc<Authority>>,
    /// Where shared limits are decided, with `[cluster]`.
    pub(crate) cluster: Option<Arc<Cluster>>,
    /// `[egress]` with the upstreams' host names, as the resolver applies them.
    pub(crate) egress_rules: Arc<Rules>,
    /// Each route's per-request metric handles.
    pub(crate) route_metrics: crate::metrics::RouteTable,
}

impl Live {
    /// Routes a request with this config (see [`Router::route`]).
    pub(crate) fn route(
        &self,
        host: &str,
        port: u16,
        method: &http::Method,
        path: &str,
        headers: &http::HeaderMap,
    ) -> Option<Route> {
        self.router
            .route(&self.config, host, port, method, path, headers)
    }
}

impl Deref for Live {
    type Target = Config;

    fn deref(&self) -> &Config {
        &self.config
    }
}

pub struct App {
    live: watch::Sender<Arc<Live>>,
    pub(crate) metrics: Metrics,
    pub(crate) limiter: Limiter,
    /// Client connections open now (proxy listener), against `proxy.max_connections`.
    pub(crate) client_connections: Arc<std::sync::atomic::AtomicUsize>,
    /// Replay copies of request bodies, against `proxy.max_replay_memory`.
    pub(crate) replay_budget: Arc<crate::upstream::replay::ReplayBudget>,
    /// Plain-HTTP upstream connections whose client connection has closed.
    pub(crate) idle_conns: Arc<crate::upstream::pinned::IdleConns>,
    pub(crate) resolver: Resolver,
    pub(crate) handshake_log: HandshakeLog,
    /// When a failure for want of sluice's own resources was last logged, in seconds of
    /// the process's life (0: never): one line every 10 s, every one counted.
    local_failures_logged: std::sync::atomic::AtomicU64,
    draining: AtomicBool,
    /// Set by `POST /quitquitquit`: the application beside sluice has finished (a Job's),
    /// so the server stops as on SIGTERM, without the shutdown delay.
    pub(crate) quit: tokio_util::sync::CancellationToken,
    /// The file reloads read, when the config came from one.
    path: Option<PathBuf>,
    /// Applied to every load of the file (reloads).
    overrides: Overrides,
    /// One reload at a time, whichever trigger started it.
    reloading: Mutex<()>,
    /// The addresses the proxy and admin listeners bound (port 0 in the config names
    /// none in advance); `/config` shows them.
    pub(crate) listening: std::sync::OnceLock<(std::net::SocketAddr, std::net::SocketAddr)>,
    /// The status page's recent history and what it shows of the process.
    pub(crate) status: crate::status::Status,
}

pub struct AppBuilder {
    config: Config,
    registry: Registry,
    resolver: Resolver,
    path: Option<PathBuf>,
    overrides: Overrides,
}

impl AppBuilder {
    /// Replaces name resolution (the egress rules still apply to what it returns).
    pub fn lookup(mut self, lookup: Arc<dyn Lookup>) -> Self {
        self.resolver = Resolver::new(lookup);
        self
    }

    /// The file the config was loaded from; reloads read it again.
    pub fn path(mut self, path: impl Into<PathBuf>) -> Self {
        self.path = Some(path.into());
        self
    }

    /// Settings from the command line or environment, over the file's: applied to the
    /// config now and to every reload.
    pub fn overrides(mut self, overrides: Overrides) -> Self {
        overrides.apply(&mut self.config);
        self.overrides = overrides;
        self
    }

    pub fn build(self) -> Result<Arc<App>, BuildError> {
        let metrics = Metrics::new(self.registry)?;
        let client = UpstreamClient::new(
            self.resolver.clone(),
            crate::tls::client::client_config(None)?,
        );
        let limiter = Limiter::new(&self.config, &metrics);
        let (upstream_clients, authority) = build_tls(&self.config, &self.resolver, None)?;
        let cluster = build_cluster(&self.config, None, &metrics)?;
        limiter.set_store(cluster.clone().map(|c| c as Arc<dyn Store>));
        let policies = Policies::new(&self.config, &metrics);
        metrics.config_info(&self.config.digest, None);
        let egress_rules = Arc::new(Rules::new(&self.config));
        self.resolver.set_rules(egress_rules.clone());
        self.resolver
            .set_upstream_cap(upstream_cap(self.config.proxy.max_connections));
        let replay_limit = self.config.proxy.max_replay_memory;
        let live = Live {
            route_metrics: crate::metrics::RouteTable::new(&self.config, &metrics),
            egress_rules,
            client,
            plans: limiter.plans(),
            router: Router::new(&self.config.upstreams),
            config: self.config,
            policies,
            upstream_clients,
            authority,
            cluster,
        };
        let (live, _) = watch::channel(Arc::new(live));
        Ok(Arc::new(App {
            live,
            metrics,
            limiter,
            client_connections: Arc::default(),
            replay_budget: Arc::new(crate::upstream::replay::ReplayBudget::new(replay_limit)),
            idle_conns: Arc::default(),
            resolver: self.resolver,
            handshake_log: HandshakeLog::default(),
            local_failures_logged: std::sync::atomic::AtomicU64::new(0),
            draining: AtomicBool::new(false),
            quit: tokio_util::sync::CancellationToken::new(),
            path: self.path,
            overrides: self.overrides,
            reloading: Mutex::new(()),
            listening: std::sync::OnceLock::new(),
            status: crate::status::Status::default(),
        }))
    }
}

/// The cluster of `config`: the running one when nothing about it changed (its
/// connection and breaker carry on), else a new one.
fn build_cluster(
    config: &Config,
    running: Option<&Arc<Cluster>>,
    metrics: &Metrics,
) -> Result<Option<Arc<Cluster>>, BuildError> {
    let Some(c) = &config.cluster else {
        return Ok(None);
    };
    if let Some(r) = running
        && r.same(c)
    {
        return Ok(Some(r.clone()));
    }
    Ok(Some(Cluster::new(c, metrics)?))
}

/// Per-upstream clients with an extra CA, and the interception CA.
type TlsParts = (Vec<Option<UpstreamClient>>, Option<Arc<Authority>>);

/// The parts of a config that talk TLS and can fail to build.
/// `reuse`: the [tls] section in force and its CA, which a reload keeps when the section
/// is unchanged.
fn build_tls(
    config: &Config,
    resolver: &Resolver,
    reuse: Option<(&crate::config::TlsConfig, &Arc<Authority>)>,
) -> Result<TlsParts, BuildError> {
    let upstream_clients = config
        .upstreams
        .iter()
        .map(|u| match &u.upstream_ca {
            Some(ca) => Ok(Some(UpstreamClient::new(
                resolver.clone(),
                crate::tls::client::client_config(Some(ca))?,
            ))),
            None => Ok(None),
        })
        .collect::<Result<Vec<_>, TlsError>>()?;
    if let Some(name) = config.intercept_without_ca() {
        return Err(BuildError::NoCa(name.to_string()));
    }
    let authority = match (&config.tls, reuse) {
        // A reload that leaves a generate_ca section as it was keeps the CA: the
        // application trusts this one and no other. A CA read from files is read again,
        // so a rotated Secret takes effect.
        (Some(tls), Some((old, authority))) if tls.generate_ca && old == tls => {
            Some(authority.clone())
        }
        (Some(tls), _) => {
            let authority = match (&tls.ca_cert, &tls.ca_key, &tls.key_dir) {
                (Some(cert), Some(key), _) => Some(Authority::load(cert, key)?),
                _ if !tls.generate_ca => None,
                (_, _, Some(dir)) => Some(Authority::generate_in(dir)?),
                (_, _, None) => Some(Authority::generate()?),
            };
            if let (Some(a), Some(dir)) = (&authority, &tls.trust_dir) {
                a.write_trust(dir)?;
                tracing::info!(trust_dir = %dir.display(), "wrote the interception CA and a trust bundle");
            }
            authority.map(Arc::new)
        }
        (None, _) => None,
    };
    Ok((upstream_clients, authority))
}

#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("cannot register metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error(
        "upstream {0:?} has tls = \"intercept\" but [tls] ca_cert and ca_key are not set; create a CA with `sluice ca new --out DIR`"
    )]
    NoCa(String),
    #[error(transparent)]
    Cluster(#[from] ClusterError),
}

/// Why a reload left the old config in force.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ReloadError {
    #[error("no config file to reload: the config was not loaded from a file")]
    NoFile,
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error(transparent)]
    Build(#[from] BuildError),
}

/// What a successful reload changed, for the log and `POST /reload`.
#[derive(Debug, Clone, serde::Serialize)]
pub(crate) struct ReloadSummary {
    pub(crate) sha256: String,
    /// False when the file's bytes are those of the live config: nothing was swapped.
    pub(crate) changed: bool,
    pub(crate) added: Vec<String>,
    pub(crate) removed: Vec<String>,
    /// Upstreams whose settings differ (limits, families, policies, hosts, ...).
    pub(crate) modified: Vec<String>,
    /// Settings that differ but only take effect after a restart; left as they were.
    pub(crate) restart_needed: Vec<String>,
}

impl App {
    pub fn builder(config: Config) -> AppBuilder {
        AppBuilder {
            config,
            registry: Registry::new(),
            resolver: Resolver::default(),
            path: None,
            overrides: Overrides::default(),
        }
    }

    /// The config in force now, with everything built from it. A request keeps the `Arc`
    /// it started with.
    pub(crate) fn config(&self) -> Arc<Live> {
        self.live.borrow().clone()
    }

    /// The client for an upstream of `live`: its own when it trusts an extra CA.
    pub(crate) fn client_for<'a>(
        &'a self,
        live: &'a Live,
        upstream: Option<usize>,
    ) -> &'a UpstreamClient {
        upstream
            .and_then(|u| live.upstream_clients.get(u)?.as_ref())
            .unwrap_or(&live.client)
    }

    /// Plain-HTTP upstream connections parked by clients that left, waiting for the next.
    pub fn idle_upstream_connections(&self) -> usize {
        self.idle_conns.len()
    }

    pub(crate) fn config_path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// Reads the config file again and applies it: the one code path of every trigger
    /// (file change, SIGHUP, `POST /reload`). Logged and counted either way; on error the
    /// old config stays in force, untouched.
    pub(crate) fn reload(&self) -> Result<ReloadSummary, ReloadError> {
        let result = match &self.path {
            Some(path) => Config::load(path)
                .map(|mut c| {
                    self.overrides.apply(&mut c);
                    c
                })
                .map_err(ReloadError::from)
                .and_then(|c| self.apply(c)),
            None => Err(ReloadError::NoFile),
        };
        self.status
            .reloaded(result.as_ref().err().map(ToString::to_string));
        let outcome = if result.is_ok() { "success" } else { "failure" };
        self.metrics
            .config_reloads
            .with_label_values(&[outcome])
            .inc();
        self.metrics
            .config_last_reload_successful
            .set(i64::from(result.is_ok()));
        match &result {
            Ok(s) if !s.changed => {
                tracing::info!(sha256 = %s.sha256, "config reload: file unchanged")
            }
            Ok(s) => tracing::info!(
                sha256 = %s.sha256,
                added = ?s.added,
                removed = ?s.removed,
                modified = ?s.modified,
                restart_needed = ?s.restart_needed,
                "config reloaded"
            ),
            Err(e) => tracing::error!("config reload failed, the old config stays in force: {e}"),
        }
        result
    }

    /// Validates and builds everything `config` needs, then swaps it in. Settings that
    /// cannot change live keep their running values.
    pub(crate) fn apply(&self, mut config: Config) -> Result<ReloadSummary, ReloadError> {
        let _one = self.reloading.lock();
        let old = self.config();
        let summary = diff(&old, &config);
        if !summary.changed {
            return Ok(summary);
        }
        // Listeners are bound once; the running addresses stay what the live config says.
        config.proxy.listen = old.proxy.listen;
        config.proxy.admin = old.proxy.admin;
        for w in config.warnings() {
            tracing::warn!("{w}");
        }

        // Everything that can fail, before anything changes.
        let reuse = old.tls.as_ref().zip(old.authority.as_ref());
        let (upstream_clients, authority) = build_tls(&config, &self.resolver, reuse)?;
        let cluster = build_cluster(&config, old.cluster.as_ref(), &self.metrics)?;
        let egress_rules = Arc::new(Rules::new(&config));
        let client = if *egress_rules == *old.egress_rules {
            old.client.clone()
        } else {
            let tls = crate::tls::client::client_config(None).map_err(BuildError::from)?;
            UpstreamClient::new(self.resolver.clone(), tls)
        };

        let policies = Policies::carry(&config, &self.metrics, Some((&old, &old.policies)));
        let plans = crate::limit::plans(&config, &self.metrics);
        self.limiter
            .set_store(cluster.clone().map(|c| c as Arc<dyn Store>));
        self.limiter.reload(plans.clone());
        self.metrics.config_info(&config.digest, Some(&old.digest));
        for u in old
            .upstreams
            .iter()
            .filter(|u| summary.removed.contains(&u.name))
        {
            let families: Vec<&str> = u.families.iter().map(|f| f.name.as_str()).collect();
            self.metrics.forget_upstream(&u.name, &families);
        }
        self.resolver.set_rules(egress_rules.clone());
        self.resolver
            .set_upstream_cap(upstream_cap(config.proxy.max_connections));
        self.replay_budget.set_limit(config.proxy.max_replay_memory);
        self.live.send_replace(Arc::new(Live {
            route_metrics: crate::metrics::RouteTable::new(&config, &self.metrics),
            egress_rules,
            client,
            router: Router::new(&config.upstreams),
            config,
            plans,
            policies,
            upstream_clients,
            authority,
            cluster,
        }));
        Ok(summary)
    }

    /// An upstream connection sluice could not make for want of its own resources
    /// (descriptors, socket memory): counted, and logged every 10 s at most, as sluice's
    /// failure; the upstream's breaker never hears of it.
    pub(crate) fn local_failure(&self, e: &dyn std::fmt::Display) {
        self.metrics.local_failures.inc();
        let now = self.status.started.elapsed().as_secs() + 1;
        let last = self.local_failures_logged.load(Ordering::Relaxed);
        if (last == 0 || now >= last + 10)
            && self
                .local_failures_logged
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            tracing::warn!(
                error = %e,
                upstream_connections = self.resolver.upstream_connections(),
                "sluice ran out of its own resources for an upstream connection: answered \
                 503 connection_limit, not counted against the upstream (logged every 10 s)"
            );
        }
    }

    pub(crate) fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    pub(crate) fn start_draining(&self) {
        self.draining.store(true, Ordering::Release);
    }
}

/// What differs between the live config and a new one, by upstream name.
fn diff(old: &Config, new: &Config) -> ReloadSummary {
    let names = |c: &Config| {
        c.upstreams
            .iter()
            .map(|u| u.name.clone())
            .collect::<Vec<_>>()
    };
    let (old_names, new_names) = (names(old), names(new));
    let added = new_names
        .iter()
        .filter(|n| !old_names.contains(n))
        .cloned()
        .collect();
    let removed = old_names
        .iter()
        .filter(|n| !new_names.contains(n))
        .cloned()
        .collect();
    // The effective settings, as `/config` shows them, tell whether an upstream changed.
    let modified = new
        .upstreams
        .iter()
        .filter(|u| {
            old.upstreams.iter().any(|o| {
                o.name == u.name && serde_json::to_value(o).ok() != serde_json::to_value(u).ok()
            })
        })
        .map(|u| u.name.clone())
        .collect();
    let mut restart_needed = Vec::new();
    if old.proxy.listen != new.proxy.listen {
        restart_needed.push(format!(
            "proxy.listen ({} -> {})",
            old.proxy.listen, new.proxy.listen
        ));
    }
    if old.proxy.admin != new.proxy.admin {
        restart_needed.push(format!(
            "proxy.admin ({} -> {})",
            old.proxy.admin, new.proxy.admin
        ));
    }
    ReloadSummary {
        sha256: new.digest.clone(),
        changed: old.sha256 != new.sha256,
        added,
        removed,
        modified,
        restart_needed,
    }
}

/// The cap on upstream connections: the client connections' (`max_connections`, or the
/// default from the open-file limit), so that the two together stay within the limit.
fn upstream_cap(max_connections: Option<u64>) -> usize {
    let cap = max_connections
        .unwrap_or_else(|| crate::rlimit::default_max_connections(crate::rlimit::nofile()));
    usize::try_from(cap).unwrap_or(usize::MAX)
}
