//! The application: the live config, the metrics, the upstream client and the resolver,
//! built once and shared by every connection. Tests build their own with [`App::builder`].

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use prometheus::Registry;
use tokio::sync::watch;

use crate::config::Config;
use crate::egress::{Lookup, Resolver};
use crate::limit::Limiter;
use crate::metrics::Metrics;
use crate::policy::Policies;
use crate::proxy::client::UpstreamClient;
use crate::tls::TlsError;
use crate::tls::ca::Authority;
use crate::tls::intercept::HandshakeLog;

pub struct App {
    config: watch::Sender<Arc<Config>>,
    pub metrics: Metrics,
    pub limiter: Limiter,
    pub policies: Policies,
    pub(crate) client: UpstreamClient,
    /// Clients for upstreams that trust an extra CA (`upstream_ca`), by upstream index.
    upstream_clients: Vec<Option<UpstreamClient>>,
    pub(crate) resolver: Resolver,
    /// The interception CA, when an upstream intercepts.
    pub(crate) authority: Option<Arc<Authority>>,
    pub(crate) handshake_log: HandshakeLog,
    draining: AtomicBool,
}

pub struct AppBuilder {
    config: Config,
    registry: Registry,
    resolver: Resolver,
}

impl AppBuilder {
    pub fn registry(mut self, registry: Registry) -> Self {
        self.registry = registry;
        self
    }

    /// Replaces name resolution (the egress rules still apply to what it returns).
    pub fn lookup(mut self, lookup: Arc<dyn Lookup>) -> Self {
        self.resolver = Resolver::new(lookup);
        self
    }

    pub fn build(self) -> Result<Arc<App>, BuildError> {
        let metrics = Metrics::new(self.registry)?;
        let client = UpstreamClient::new(
            self.resolver.clone(),
            crate::tls::client::client_config(None)?,
        );
        let upstream_clients = self
            .config
            .upstreams
            .iter()
            .map(|u| match &u.upstream_ca {
                Some(ca) => Ok(Some(UpstreamClient::new(
                    self.resolver.clone(),
                    crate::tls::client::client_config(Some(ca))?,
                ))),
                None => Ok(None),
            })
            .collect::<Result<Vec<_>, TlsError>>()?;
        if let Some(name) = self.config.intercept_without_ca() {
            return Err(BuildError::NoCa(name.to_string()));
        }
        let authority = match &self.config.tls {
            Some(crate::config::TlsConfig {
                ca_cert: Some(cert),
                ca_key: Some(key),
            }) => Some(Arc::new(Authority::load(cert, key)?)),
            _ => None,
        };
        let limiter = Limiter::new(&self.config, &metrics);
        let policies = Policies::new(&self.config, &metrics);
        let (config, _) = watch::channel(Arc::new(self.config));
        Ok(Arc::new(App {
            config,
            metrics,
            limiter,
            policies,
            client,
            upstream_clients,
            resolver: self.resolver,
            authority,
            handshake_log: HandshakeLog::default(),
            draining: AtomicBool::new(false),
        }))
    }
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
}

impl App {
    /// The client for an upstream: its own when it trusts an extra CA.
    pub(crate) fn client_for(&self, upstream: Option<usize>) -> &UpstreamClient {
        upstream
            .and_then(|u| self.upstream_clients.get(u)?.as_ref())
            .unwrap_or(&self.client)
    }

    pub fn builder(config: Config) -> AppBuilder {
        AppBuilder {
            config,
            registry: Registry::new(),
            resolver: Resolver::default(),
        }
    }

    /// The config in force now. A request keeps the `Arc` it started with.
    pub fn config(&self) -> Arc<Config> {
        self.config.borrow().clone()
    }

    /// Subscribe to config changes (reload).
    pub fn watch_config(&self) -> watch::Receiver<Arc<Config>> {
        self.config.subscribe()
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    pub(crate) fn start_draining(&self) {
        self.draining.store(true, Ordering::Release);
    }
}
