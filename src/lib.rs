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
//! - [`admin`] and [`metrics`]: the operator's side; [`reload`]: the file watcher and
//!   SIGHUP, which with `POST /reload` end in [`app::App::reload`].
//! - [`app::App`]: the state every part shares (the live config with its router, plans
//!   and clients; limiter; metrics); no globals, tests build their own.
//!
//! Modules depend downward only (docs/architecture.md, "Layers"); there are no import
//! cycles.

#![deny(unsafe_code)]

pub mod admin;
pub mod app;
pub mod body;
pub mod cluster;
pub mod config;
pub mod cpus;
pub mod egress;
pub mod explain;
pub mod limit;
pub mod log;
pub mod metrics;
pub mod policy;
pub mod proxy;
pub mod reload;
pub mod rlimit;
pub mod route;
pub mod server;
pub mod status;
pub mod tls;
pub mod upstream;

pub use app::App;
pub use config::Config;
pub use server::Server;
