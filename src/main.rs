//! The `sluice` binary: command line, logging, and the process around the library.

#![deny(unsafe_code)]

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Uri};

use sluice::{App, Config, Server, Workers};
use sluice::{ListenAddr, Overrides};

#[derive(Parser)]
#[command(
    name = "sluice",
    version,
    about = "Rate-limiting forward proxy for the external APIs a service calls"
)]
struct Cli {
    /// Log line format on stderr; RUST_LOG filters (default "info").
    #[arg(
        long,
        global = true,
        value_enum,
        env = "SLUICE_LOG_FORMAT",
        default_value_t = LogFormat::Text
    )]
    log_format: LogFormat,
    /// Log lines that may wait for a slow stderr; beyond them lines are dropped (and
    /// counted in sluice_log_lines_dropped_total), never waited for. Also bounded to 1 KiB per
    /// line on average.
    #[arg(
        long,
        global = true,
        env = "SLUICE_LOG_QUEUE",
        value_name = "LINES",
        default_value_t = 16_384
    )]
    log_queue: usize,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(clap::Args)]
struct ConfigArg {
    /// Config file.
    #[arg(
        short = 'c',
        long = "config",
        env = "SLUICE_CONFIG",
        default_value = "sluice.toml"
    )]
    config: PathBuf,
}

#[derive(Subcommand)]
enum Command {
    /// Run the proxy.
    Run {
        #[command(flatten)]
        config: ConfigArg,
        /// Threads that serve clients, each with its own event loop (default: one per
        /// CPU of --cpu-request-millicores, else one per CPU this process may use: its
        /// affinity, bounded by a cgroup CPU quota).
        #[arg(long, env = "SLUICE_WORKERS", value_parser = clap::value_parser!(u16).range(1..=1024))]
        workers: Option<u16>,
        /// The container's CPU request in millicores, rounded up to whole workers (in a
        /// pod: the downward API's `resourceFieldRef` `requests.cpu` with divisor `1m`);
        /// 0 means none.
        #[arg(long, env = "SLUICE_CPU_REQUEST_MILLICORES", value_name = "MILLICORES")]
        cpu_request_millicores: Option<u64>,
        /// `auto`: each worker is kept on one CPU when the process has an exclusive cpuset
        /// (a cgroup partition, or the static CPU manager's whole CPUs) with one CPU per
        /// worker, else keeps busy workers on different CPUs; `on`: on whatever CPUs it
        /// may use, for a host that runs nothing else; `off`: the scheduler places them.
        #[arg(long, env = "SLUICE_PIN_WORKERS", value_enum, default_value = "auto")]
        pin_workers: PinArg,
        /// Proxy listener, over the file's [proxy] listen: IP:PORT, or :PORT for every
        /// address of every family the host has (a gateway in a pod).
        #[arg(long, env = "SLUICE_LISTEN", value_name = "IP:PORT|:PORT")]
        listen: Option<ListenAddr>,
        /// Admin listener, over the file's [proxy] admin (:9901 in a pod, for probes and
        /// scrapes on whichever families the cluster has; control endpoints stay
        /// loopback-only, see admin_control).
        #[arg(long, env = "SLUICE_ADMIN", value_name = "IP:PORT|:PORT")]
        admin: Option<ListenAddr>,
        /// After SIGTERM, keep accepting this long (e.g. 15s) before draining, over the
        /// file's [proxy] shutdown_delay: for a sidecar stopped together with its app.
        #[arg(long, env = "SLUICE_SHUTDOWN_DELAY", value_name = "DURATION", value_parser = humantime::parse_duration)]
        shutdown_delay: Option<std::time::Duration>,
    },
    /// Validate a config file: exit 0 when valid, 1 with file:line:col: message otherwise.
    Check(ConfigArg),
    /// Wait until sluice is ready (its admin /readyz answers 200): exit 0 then, 1 at the
    /// timeout. For a container that must not start before its sidecar (a postStart
    /// hook, or an application's entrypoint).
    WaitReady {
        /// The admin listener to ask; a wildcard (:9901, 0.0.0.0:9901) is asked on
        /// loopback.
        #[arg(
            long,
            env = "SLUICE_ADMIN",
            value_name = "IP:PORT|:PORT",
            default_value = "127.0.0.1:9901"
        )]
        admin: ListenAddr,
        /// How long to wait, e.g. 60s.
        #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
        timeout: std::time::Duration,
    },
    /// Certificate authority for TLS interception.
    Ca {
        #[command(subcommand)]
        command: CaCommand,
    },
    /// Show the upstream, family, partition, limits and policies a request would get.
    Explain {
        #[command(flatten)]
        config: ConfigArg,
        /// HTTP method, e.g. GET.
        method: String,
        /// Absolute URL, e.g. http://api.example.com/v1/orders.
        url: String,
        /// Request header 'Name: value' (repeatable); key headers pick the partition.
        #[arg(short = 'H', long = "header")]
        headers: Vec<String>,
        /// Request body, or @FILE to read it from a file: a priced family's cost is
        /// estimated from it.
        #[arg(short = 'd', long = "data")]
        data: Option<String>,
    },
}

#[derive(Subcommand)]
enum CaCommand {
    /// Write a new CA (ca.pem, and ca-key.pem with mode 0600) into DIR.
    New {
        #[arg(long)]
        out: PathBuf,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let log = init_logging(cli.log_format, cli.log_queue);
    let result = match cli.command {
        Command::Run {
            config,
            workers,
            cpu_request_millicores,
            pin_workers,
            listen,
            admin,
            shutdown_delay,
        } => run(
            &config.config,
            workers,
            cpu_request_millicores,
            pin_workers,
            Overrides {
                listen,
                admin,
                shutdown_delay,
            },
        ),
        Command::Check(c) => check(&c.config),
        Command::WaitReady { admin, timeout } => wait_ready(admin, timeout),
        Command::Ca {
            command: CaCommand::New { out },
        } => ca_new(&out),
        Command::Explain {
            config,
            method,
            url,
            headers,
            data,
        } => explain(&config.config, &method, &url, &headers, data.as_deref()),
    };
    // Everything logged so far reaches stderr before the process ends (and before a
    // final error, which is written directly).
    drop(log);
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Logs go through one bounded buffer to a writer thread (`sluice::log`): a slow or full
/// stderr pipe never blocks a request. The returned guard writes what is left when
/// dropped. Without a writer thread (it could not start), lines are written directly.
fn init_logging(format: LogFormat, queue: usize) -> Option<sluice::LogGuard> {
    let mut filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // The file watcher traces every inotify event it sees: with RUST_LOG=trace and the
    // log written next to the config file, each line would make another event. Only a
    // filter that names it lets it say more than info.
    let named = std::env::var("RUST_LOG").is_ok_and(|v| v.contains("notify"));
    if !named && let Ok(quiet) = "notify=info".parse() {
        filter = filter.add_directive(quiet);
    }
    // Colours only for a person at a terminal: a pipe (a container runtime, a file) gets
    // plain text, without escape codes around every field.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let guard = match sluice::install_log(queue) {
        Ok(g) => Some(g),
        Err(e) => {
            eprintln!("cannot start the log writer, writing directly: {e}");
            None
        }
    };
    sluice::warn_on_dropped_log_lines();
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(sluice::LogWriter);
    match format {
        // Fields as `name=value` written directly: the default field formatter styles
        // every field name through the colour machinery even with colours off, a third
        // of an access line's cost. Colours at a terminal keep the default.
        LogFormat::Text if !ansi => {
            use tracing_subscriber::field::MakeExt;
            builder
                .fmt_fields(
                    tracing_subscriber::fmt::format::debug_fn(|w, field, value| {
                        if field.name() == "message" {
                            write!(w, "{value:?}")
                        } else {
                            write!(w, "{field}={value:?}")
                        }
                    })
                    .delimited(" "),
                )
                .init()
        }
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
    // The access line, one per request, is formatted by sluice::log in the same layout
    // as the formatter above; colours at a terminal leave it to the formatter.
    use sluice::AccessFormat;
    sluice::set_access_format(
        match (
            tracing::enabled!(target: "sluice::access", tracing::Level::INFO),
            format,
        ) {
            (false, _) => AccessFormat::Off,
            (true, _) if guard.is_none() || ansi => AccessFormat::Tracing,
            (true, LogFormat::Text) => AccessFormat::Text,
            (true, LogFormat::Json) => AccessFormat::Json,
        },
    );
    guard
}

fn ca_new(dir: &Path) -> anyhow::Result<()> {
    let (cert, key) = sluice::write_new_ca(dir)?;
    println!("wrote {} and {}", cert.display(), key.display());
    println!(
        "set [tls] ca_cert = {:?} and ca_key = {:?}; clients must trust {}",
        cert.display(),
        key.display(),
        cert.display()
    );
    Ok(())
}

fn check(path: &Path) -> anyhow::Result<()> {
    let config = Config::load(path)?;
    for w in config.warnings() {
        eprintln!("{}: warning: {w}", path.display());
    }
    println!(
        "{}: ok ({} upstreams, {} families; sha256 {}, as sluice_config_info shows it)",
        path.display(),
        config.upstreams.len(),
        config
            .upstreams
            .iter()
            .map(|u| u.families.len())
            .sum::<usize>(),
        config.digest
    );
    Ok(())
}

fn explain(
    path: &Path,
    method: &str,
    url: &str,
    headers: &[String],
    data: Option<&str>,
) -> anyhow::Result<()> {
    let config = Config::load(path)?;
    for w in config.warnings() {
        eprintln!("warning: {w}");
    }
    let method =
        Method::from_bytes(method.to_ascii_uppercase().as_bytes()).context("invalid method")?;
    let url: Uri = url
        .parse()
        .with_context(|| format!("invalid URL {url:?}"))?;
    let mut map = HeaderMap::new();
    for h in headers {
        let (name, value) = h
            .split_once(':')
            .with_context(|| format!("header {h:?} is not 'Name: value'"))?;
        let name = HeaderName::from_bytes(name.trim().as_bytes()).context("invalid header name")?;
        let value = HeaderValue::from_str(value.trim()).context("invalid header value")?;
        map.append(name, value);
    }
    let body = match data {
        Some(d) => Some(match d.strip_prefix('@') {
            Some(file) => std::fs::read(file).with_context(|| format!("reading {file}"))?,
            None => d.as_bytes().to_vec(),
        }),
        None => None,
    };
    print!(
        "{}",
        sluice::explain_request(&config, &method, &url, &map, body.as_deref())?
    );
    Ok(())
}

/// `--pin-workers`.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum PinArg {
    Auto,
    On,
    Off,
}

fn run(
    path: &Path,
    workers: Option<u16>,
    cpu_request_millis: Option<u64>,
    pin: PinArg,
    overrides: Overrides,
) -> anyhow::Result<()> {
    let config = Config::load(path)?;
    match sluice::raise_nofile() {
        Ok((before, after)) if after > before => {
            tracing::info!(
                from = before,
                to = after,
                "raised the open-file limit to its hard limit"
            )
        }
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "cannot raise the open-file limit"),
    }
    for w in config.warnings() {
        tracing::warn!(config = %path.display(), "{w}");
    }
    let pin = match pin {
        PinArg::Auto => sluice::Pin::Auto,
        PinArg::On => sluice::Pin::On,
        PinArg::Off => sluice::Pin::Off,
    };
    let plan = sluice::plan_workers(&sluice::Machine::probe(), workers, cpu_request_millis, pin);
    let (workers, pinned) = Workers::start(plan.workers, plan.cpus.clone(), plan.spread.clone())
        .context("cannot start the worker threads")?;
    let pinned = pinned.map_or_else(|| "no".to_string(), |cpus| format!("{cpus:?}"));
    // This thread runs what is not per client: signals, reloads, the admin listener, the
    // partition sweep and the shutdown sequence.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the tokio runtime")?;
    runtime.block_on(async {
        let app = App::builder(config)
            .path(path)
            .overrides(overrides)
            .build()?;
        let server = Server::bind(app).await?.serve_on(workers.handles());
        tracing::info!(proxy = %server.proxy_addr(), admin = %server.admin_addr(), config = %path.display(), workers = plan.workers, workers_from = %plan.workers_why, pinned_to_cpus = %pinned, pinning = %plan.pin_why, kept_apart = plan.spread.is_some(), "listening");
        server.run(shutdown_signal()).await;
        Ok(())
    })
}

/// Polls `GET /readyz` on `admin` every 100 ms until it answers 200 or `timeout` passes.
fn wait_ready(admin: ListenAddr, timeout: std::time::Duration) -> anyhow::Result<()> {
    use std::io::{Read, Write};
    let admin = admin.local_target();
    let deadline = tokio::time::Instant::now() + timeout;
    let ask = || -> std::io::Result<bool> {
        let mut conn =
            std::net::TcpStream::connect_timeout(&admin, std::time::Duration::from_secs(1))?;
        conn.set_read_timeout(Some(std::time::Duration::from_secs(1)))?;
        conn.write_all(b"GET /readyz HTTP/1.1\r\nHost: sluice\r\nConnection: close\r\n\r\n")?;
        let mut head = [0u8; 12];
        conn.read_exact(&mut head)?;
        Ok(&head[9..12] == b"200")
    };
    loop {
        let last = match ask() {
            Ok(true) => {
                eprintln!("sluice at {admin} is ready");
                return Ok(());
            }
            Ok(false) => "it answered, not ready yet".to_string(),
            Err(e) => e.to_string(),
        };
        if tokio::time::Instant::now() >= deadline {
            anyhow::bail!(
                "sluice at {admin} was not ready after {} ({last})",
                humantime::format_duration(timeout)
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// Resolves on the first SIGTERM or SIGINT.
async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (mut term, mut int) = match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(t), Ok(i)) => (t, i),
        _ => {
            tracing::error!("cannot install signal handlers; stop with SIGKILL");
            return std::future::pending().await;
        }
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM received"),
        _ = int.recv() => tracing::info!("SIGINT received"),
    }
}
