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

pub struct App {
    config: watch::Sender<Arc<Config>>,
    pub metrics: Metrics,
    pub limiter: Limiter,
    pub policies: Policies,
    pub(crate) client: UpstreamClient,
    pub(crate) resolver: Resolver,
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

    pub fn build(self) -> prometheus::Result<Arc<App>> {
        let metrics = Metrics::new(self.registry)?;
        let limiter = Limiter::new(&self.config, &metrics);
        let policies = Policies::new(&self.config, &metrics);
        let (config, _) = watch::channel(Arc::new(self.config));
        Ok(Arc::new(App {
            config,
            metrics,
            limiter,
            policies,
            client: UpstreamClient::new(self.resolver.clone()),
            resolver: self.resolver,
            draining: AtomicBool::new(false),
        }))
    }
}

impl App {
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
