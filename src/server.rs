//! The wiring of the whole process: binds the proxy and admin listeners, starts the
//! admin listener, the partition sweeper and the reload triggers beside the proxy
//! listener (`proxy::server`), and runs the shutdown sequence: stop being ready,
//! optionally keep accepting for `shutdown_delay`, stop accepting, let work finish for
//! `drain_timeout`.

use std::future::Future;
use std::io;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::runtime::Handle;
use tokio_util::sync::CancellationToken;

use crate::admin;
use crate::app::App;
use crate::config::ListenAddr;
use crate::proxy::lifecycle::Lifecycle;
use crate::proxy::server::spawn_accepting;

pub struct Server {
    app: Arc<App>,
    proxy: TcpListener,
    admin: TcpListener,
    /// Set up at bind, so that no change to the file after `bind` returns is missed.
    reloads: crate::reload::Triggers,
    /// Runtimes that accept and serve clients; none: the runtime `run` is called on.
    workers: Vec<Handle>,
}

#[derive(Debug, thiserror::Error)]
#[error("cannot listen on {addr} ({what}): {source}")]
pub struct BindError {
    addr: ListenAddr,
    what: &'static str,
    #[source]
    source: io::Error,
}

/// Binds `addr`; for [`ListenAddr::AnyFamily`], one IPv6 socket that accepts IPv4 as
/// well, or an IPv4 socket where the host has no IPv6 (a kernel booted with
/// `ipv6.disable=1`, a pod whose IPv6 is off).
pub(crate) async fn bind(addr: ListenAddr) -> io::Result<TcpListener> {
    match addr {
        ListenAddr::Addr(a) => TcpListener::bind(a).await,
        ListenAddr::AnyFamily(port) => match bind_dual_stack(port) {
            Err(e) if no_ipv6(&e) => {
                tracing::info!(port, error = %e, "no IPv6 here: listening on IPv4 only");
                TcpListener::bind((Ipv4Addr::UNSPECIFIED, port)).await
            }
            bound => bound,
        },
    }
}

fn bind_dual_stack(port: u16) -> io::Result<TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::IPV6, Type::STREAM, Some(Protocol::TCP))?;
    // Whatever net.ipv6.bindv6only says: IPv4 clients arrive as ::ffff:a.b.c.d.
    socket.set_only_v6(false)?;
    // As tokio's TcpListener::bind does: a restart rebinds at once past TIME_WAIT.
    socket.set_reuse_address(true)?;
    socket.set_nonblocking(true)?;
    socket.bind(&SocketAddr::from((Ipv6Addr::UNSPECIFIED, port)).into())?;
    socket.listen(1024)?;
    TcpListener::from_std(socket.into())
}

/// The errors of a host without IPv6: no such family, or no IPv6 address to bind.
#[cfg(unix)]
fn no_ipv6(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EAFNOSUPPORT | libc::EPROTONOSUPPORT | libc::EADDRNOTAVAIL)
    )
}

#[cfg(not(unix))]
fn no_ipv6(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::AddrNotAvailable
}

impl Server {
    /// Binds the proxy and admin listeners named in the config (port 0 picks a free port).
    pub async fn bind(app: Arc<App>) -> Result<Server, BindError> {
        let config = app.config();
        let bind = |addr: ListenAddr, what: &'static str| async move {
            bind(addr)
                .await
                .map_err(|source| BindError { addr, what, source })
        };
        let proxy = bind(config.proxy.listen, "proxy listener").await?;
        let admin = bind(config.proxy.admin, "admin listener").await?;
        // Never a destination: a request through the proxy must not reach the admin API
        // or loop back into the proxy.
        app.resolver.set_own(
            [&proxy, &admin]
                .iter()
                .filter_map(|l| l.local_addr().ok())
                .collect(),
        );
        if let (Ok(p), Ok(a)) = (proxy.local_addr(), admin.local_addr()) {
            let _ = app.listening.set((p, a));
        }
        let reloads = crate::reload::Triggers::new(&app);
        Ok(Server {
            app,
            proxy,
            admin,
            reloads,
            workers: Vec::new(),
        })
    }

    /// Serves clients on these runtimes (see [`crate::proxy::server::Workers`]) instead of the caller's.
    pub fn serve_on(mut self, workers: Vec<Handle>) -> Server {
        self.workers = workers;
        self
    }

    pub fn proxy_addr(&self) -> SocketAddr {
        self.proxy
            .local_addr()
            .unwrap_or_else(|_| self.app.config().proxy.listen.local_target())
    }

    pub fn admin_addr(&self) -> SocketAddr {
        self.admin
            .local_addr()
            .unwrap_or_else(|_| self.app.config().proxy.admin.local_target())
    }

    /// Serves until `shutdown` resolves, then drains and returns.
    pub async fn run(self, shutdown: impl Future<Output = ()>) {
        let Server {
            app,
            proxy,
            admin,
            reloads,
            workers,
        } = self;
        let lc = Lifecycle::new();
        let admin_task = tokio::spawn(admin::serve(app.clone(), admin, lc.stop.clone()));
        let sweeper = tokio::spawn(sweep_idle_partitions(app.clone(), lc.stop.clone()));
        let sampler = tokio::spawn(sample_status(app.clone(), lc.stop.clone()));
        reloads.start(&app, &lc.stop);
        let default_cap = crate::rlimit::default_max_connections(crate::rlimit::nofile());
        tracing::info!(
            listen = %proxy.local_addr().map_or("?".into(), |a| a.to_string()),
            max_connections = app.config().proxy.max_connections.unwrap_or(default_cap),
            "sluice is ready"
        );

        let accepting = CancellationToken::new();
        if !workers.is_empty() {
            app.limiter.drive_on(Handle::current());
        }
        let accept = spawn_accepting(
            app.clone(),
            (proxy, default_cap),
            lc.clone(),
            accepting.clone(),
            workers,
        );
        // A signal, or the application's word that it has finished: then no one is
        // left to serve during the shutdown delay.
        let quit = tokio::select! {
            () = shutdown => false,
            () = app.quit.cancelled() => true,
        };

        let config = app.config();
        app.start_draining();
        let delay = if quit {
            Duration::ZERO
        } else {
            config.proxy.shutdown_delay
        };
        tracing::info!(shutdown_delay = ?delay, drain_timeout = ?config.proxy.drain_timeout, "shutdown: not ready any more");
        if !delay.is_zero() {
            tokio::time::sleep(delay).await; // still accepting meanwhile
        }
        accepting.cancel();
        let _ = accept.await; // the listener is closed: new connections are refused

        lc.start_drain();
        lc.tracker.close();
        if tokio::time::timeout(config.proxy.drain_timeout, lc.tracker.wait())
            .await
            .is_err()
        {
            tracing::warn!(
                remaining = lc.tracker.len(),
                "drain_timeout ran out: queued requests get 503 shutting_down, the rest is cut"
            );
            app.limiter.close();
            // Time for those 503s to reach their clients before connections are cut.
            let _ = tokio::time::timeout(Duration::from_secs(1), lc.tracker.wait()).await;
        }
        lc.stop.cancel();
        lc.tracker.wait().await;
        let _ = admin_task.await;
        let _ = sweeper.await;
        let _ = sampler.await;
        tracing::info!("shutdown complete");
    }
}

/// Samples the metrics into the status page's history once a second: a read of a few
/// dozen series, whether anyone watches or not, so the page has a past when opened.
async fn sample_status(app: Arc<App>, stop: CancellationToken) {
    let mut tick = tokio::time::interval(crate::status::EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => app.status.sample(&app.metrics),
            _ = stop.cancelled() => return,
        }
    }
}

/// Drops partitions that are idle and full again, so memory follows active keys.
async fn sweep_idle_partitions(app: Arc<App>, stop: CancellationToken) {
    let mut tick = tokio::time::interval(crate::limit::SWEEP_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {
                let before = app.limiter.partitions();
                // Off the control thread: with many partitions a pass takes a while, and
                // the probes and metrics are answered there.
                let swept = app.clone();
                let Ok(live) = tokio::task::spawn_blocking(move || swept.limiter.sweep()).await else {
                    continue;
                };
                app.idle_conns.expire(tokio::time::Instant::now());
                app.metrics.partitions.set(i64::try_from(live).unwrap_or(i64::MAX));
                if before.saturating_sub(live) >= 1024 {
                    return_freed_memory();
                }
            }
            _ = stop.cancelled() => return,
        }
    }
}

/// After many partitions are dropped, hands the freed heap back to the OS. glibc keeps
/// freed memory in its per-thread arenas otherwise, so a burst of 100k keys would leave
/// the resident size at its peak for good.
#[allow(
    unsafe_code,
    reason = "malloc_trim is a libc call with no safe wrapper"
)]
fn return_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free pages of the allocator's own arenas; it
    // touches no memory in use and may be called from any thread at any time.
    unsafe {
        libc::malloc_trim(0);
    }
}
