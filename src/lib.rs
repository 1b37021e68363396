//! sluice: an HTTP forward-proxy sidecar that keeps a service inside the rate limits of
//! the external APIs it calls.
//!
//! Module map, in the order a request meets them:
//!
//! - [`server`]: the process's wiring: listeners, admin, reloads, the shutdown sequence.
//! - [`proxy::server`]: accept loop, per-connection HTTP/1.1, graceful drain.
//! - [`proxy::forward`] / [`proxy::connect`]: absolute-form requests and CONNECT tunnels;
//!   hop-by-hop handling; egress checks ([`egress`]); [`proxy::intercept`] for
//!   intercepted tunnels, with [`tls`] for the interception CA and trust towards upstreams.
//! - [`route`]: host → upstream, method + path → family, key header → partition.
//! - [`proxy::pipeline`]: the single function through which every request reaches an
//!   upstream, its policies nested as docs/architecture.md draws them (total timeout,
//!   retries, breaker, limiter, attempt timeout, upstream call); [`proxy::access`] records
//!   every request.
//! - [`upstream`]: everything that talks to upstreams, behind [`upstream::send`]: the
//!   client connection's own plain-HTTP connections with sluice's HTTP/1.1 client side,
//!   and the pooled TLS client; [`body`]: the body type both ways.
//! - [`limit`]: the limiter (limit kinds, per-partition buckets and queues, the async
//!   driver); [`policy`]: backoff, wait hints, retry budget, classification, breaker.
//! - [`config`]: the TOML file, validated into an immutable [`config::Config`].
//! - [`explain`]: `sluice explain`, through the same routing code.
//! - [`log`]: the access line and the buffer every stderr line goes through; process-wide,
//!   as stderr is.
//! - [`clock`]: the monotonic clock as the request path reads it, once per task poll on a
//!   worker.
//! - [`admin`] and [`metrics`]: the operator's side; [`reload`]: the file watcher and
//!   SIGHUP, which with `POST /reload` end in [`app::App::reload`].
//! - [`app::App`]: the state every part shares (the live config with its router, plans
//!   and clients; limiter; metrics); no globals, tests build their own.
//!
//! Modules depend downward only (docs/architecture.md, "Layers"); there are no import
//! cycles.

#![deny(unsafe_code)]
#![warn(unreachable_pub)]

pub(crate) mod admin;
pub(crate) mod app;
pub(crate) mod body;
pub(crate) mod clock;
pub(crate) mod cluster;
pub(crate) mod config;
pub(crate) mod cpus;
pub(crate) mod egress;
pub(crate) mod explain;
pub(crate) mod limit;
pub(crate) mod log;
pub(crate) mod metrics;
pub(crate) mod policy;
pub(crate) mod price;
pub(crate) mod proxy;
pub(crate) mod reload;
pub(crate) mod rlimit;
pub(crate) mod route;
pub(crate) mod server;
pub(crate) mod status;
pub(crate) mod tls;
pub(crate) mod upstream;

// The crate's public surface: what the binary (main.rs), the integration tests, the
// benchmarks, the fuzz targets and the examples use. Every module above is pub(crate), and
// `unreachable_pub` (an error under `clippy -D warnings`) keeps items inside them from
// claiming a wider visibility than this list gives them.

// Running the proxy.
pub use app::App;
pub use body::BoxError;
pub use config::{ClassifyRule, Config, ConfigError, ListenAddr, Overrides};
pub use proxy::server::Workers;
pub use server::Server;

// The other subcommands and the process's set-up.
pub use cpus::{Machine, Pin, plan as plan_workers};
pub use explain::{explain, explain_request};
pub use log::{
    AccessFormat, Guard as LogGuard, Stderr as LogWriter, install as install_log, set_access_format,
};
pub use metrics::{Metrics, REVISION, warn_on_dropped_log_lines};
pub use rlimit::raise_nofile;
pub use tls::ca::{Authority, write_new_ca};

// The pieces tests, benchmarks and fuzz targets drive without a proxy around them.
pub use cluster::{script as cluster_script, script_args};
pub use config::pattern::{HostPattern, PathGlob, ip_literal, normalize_path};
pub use config::spec::{Action, CounterAlign, LimitSpec as Limit, Rounding, Scope, WindowAlign};
pub use config::units::Margin;
pub use egress::Lookup;
pub use limit::exposure::{Algorithm, exposure};
pub use limit::kinds::LimitState;
pub use limit::shared::GlobalLimit;
pub use limit::{Limiter, PARTITION_MEMORY, Plan, max_partitions, partition_bytes, plans};
pub use policy::classify::{classify, needs_body};
pub use policy::hints::server_hint;
pub use reload::{
    DEBOUNCE as RELOAD_DEBOUNCE, MAX_DELAY as RELOAD_MAX_DELAY, WRITER_GONE as RELOAD_WRITER_GONE,
};
pub use route::{Partition, Route, Router, authority_parts, normalize_host};
pub use upstream::h1;
