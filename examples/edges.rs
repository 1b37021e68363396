//! Limits as the provider counts them (run by bench/edges.sh): how many 429s does a
//! provider answer to traffic that the release `sluice` shapes to its exact limit, and
//! how much of the limit does that traffic use?
//!
//! The provider counts each request at its arrival in its own code (a strict sliding
//! window, or a fixed window opened by its first arrival: crates/test-support/src/provider.rs) and
//! refuses beyond the limit. Between sluice and it, a relay delays each new connection:
//! either its TLS handshake (sluice reaches the provider over TLS, `scheme = "https"`, and
//! waits the delay out before it sends), or, for plain HTTP, the first request itself
//! (after sluice has sent it, where it cannot see the delay); every request is also
//! jittered by up to 3 ms. `clients` clients, each on its own connection to sluice, keep
//! the queue full; retries are off, so every provider 429 reaches a client. sluice runs
//! as shipped: its default config values and log level, stderr read through a pipe.
//!
//! Utilisation is the accepted requests over the most the limit allows across the span
//! of their arrivals: `permits` per window, one window per `window` from the first
//! arrival to the last.

use sluice_test_support::{bench, certs, provider};

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use provider::{Counter, Delays, Provider, Relay};
use tokio::time::Instant;

const PROXY: &str = "127.0.0.1:13178";
const ADMIN: &str = "127.0.0.1:19951";
const PERMITS: u32 = 12;
const WINDOW: Duration = Duration::from_secs(1);

struct Case {
    kind: &'static str,
    /// Handshake delay (TLS) or unseen first-request delay (plain HTTP).
    delay: Duration,
    tls: bool,
}

struct Result {
    accepted: usize,
    refused: usize,
    utilisation: f64,
    connections: usize,
    edge_hints: usize,
    log_lines: usize,
}

async fn run(sluice: &str, case: &Case, windows: u32, clients: usize, margin: &str) -> Result {
    let dir = tempfile::tempdir().expect("tempdir");
    let certs = case
        .tls
        .then(|| certs::for_localhost(dir.path(), &[b"http/1.1"]));
    let counter = match case.kind {
        "sliding_window" => Counter::sliding(PERMITS, WINDOW),
        _ => Counter::fixed(PERMITS, WINDOW),
    };
    let provider = Provider::start(counter, certs.as_ref().map(|c| c.server.clone())).await;
    let jitter = Duration::from_millis(3);
    let delays = if case.tls {
        Delays {
            handshake: case.delay,
            jitter,
            ..Delays::default()
        }
    } else {
        Delays {
            first_request: case.delay,
            jitter,
            ..Delays::default()
        }
    };
    let relay = Relay::start(provider.addr, delays).await;
    let origin = match &certs {
        Some(c) => format!("scheme = \"https\"\nupstream_ca = {:?}\n", c.ca_path),
        None => String::new(),
    };
    let config = dir.path().join("sluice.toml");
    std::fs::write(
        &config,
        format!(
            "[proxy]\nlisten = \"{PROXY}\"\nadmin = \"{ADMIN}\"\n\
             [[upstream]]\nname = \"provider\"\nhosts = [\"127.0.0.1\"]\n{origin}\
             limits = [{{ kind = \"{}\", permits = {PERMITS}, window = \"1s\"{margin} }}]\n\
             [upstream.retry]\nmax_attempts = 1\n",
            case.kind
        ),
    )
    .expect("config");
    let mut child = bench::Child(
        Command::new(sluice)
            .args(["run", "-c", config.to_str().expect("path")])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start sluice"),
    );
    // A reader drains stderr as a container runtime would, counting what it sees.
    let stderr = child.0.stderr.take().expect("stderr");
    let reader = std::thread::spawn(move || {
        let (mut lines, mut hints) = (0, 0);
        for line in BufReader::new(stderr).lines().map_while(|l| l.ok()) {
            lines += 1;
            if line.contains("edge of this limit") {
                hints += 1;
                eprintln!("  {line}");
            }
        }
        (lines, hints)
    });
    bench::ready(ADMIN).await;

    let url = format!("http://{}/v1/orders", relay.addr);
    let total = (PERMITS * windows) as usize;
    let next = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..clients)
        .map(|_| {
            let client = reqwest::Client::builder()
                .proxy(reqwest::Proxy::all(format!("http://{PROXY}")).expect("proxy"))
                .build()
                .expect("client");
            let (url, next) = (url.clone(), next.clone());
            tokio::spawn(async move {
                while next.fetch_add(1, Ordering::Relaxed) < total {
                    let r = client.get(&url).send().await.expect("request");
                    r.bytes().await.expect("body");
                }
                // Kept until every client is done, so no connection is handed on early.
                client
            })
        })
        .collect();
    let mut done = Vec::new();
    for t in tasks {
        done.push(t.await.expect("client task"));
    }
    drop(child);
    let (log_lines, edge_hints) = reader.join().expect("stderr reader");

    let log = provider.log.lock().clone();
    let accepted: Vec<Instant> = log.iter().filter(|e| e.1).map(|e| e.0).collect();
    let span = match (accepted.first(), accepted.last()) {
        (Some(a), Some(b)) => *b - *a + WINDOW,
        _ => WINDOW,
    };
    let allowed = f64::from(PERMITS) * span.as_secs_f64() / WINDOW.as_secs_f64();
    Result {
        accepted: accepted.len(),
        refused: log.len() - accepted.len(),
        utilisation: accepted.len() as f64 / allowed,
        connections: relay.connections.load(Ordering::Relaxed),
        edge_hints,
        log_lines,
    }
}

#[tokio::main]
async fn main() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let args: Vec<String> = std::env::args().collect();
    let windows: u32 = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(12);
    let clients: usize = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(60);
    // Appended to the limit, e.g. `, margin = "0s"`; empty: the default margin.
    let margin = args.get(3).cloned().unwrap_or_default();
    let sluice = std::env::var("SLUICE_BIN").unwrap_or_else(|_| "target/release/sluice".into());

    println!(
        "\n{PERMITS} per 1 s at the provider and in sluice{margin}; {windows} windows' worth of requests; {clients} clients\n"
    );
    println!(
        "| limit | new-connection delay | provider 429s | accepted | utilisation | connections | edge hints logged | log lines |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    for tls in [true, false] {
        for kind in ["sliding_window", "fixed_window"] {
            for ms in [0, 50, 150] {
                let case = Case {
                    kind,
                    delay: Duration::from_millis(ms),
                    tls,
                };
                let r = run(&sluice, &case, windows, clients, &margin).await;
                let how = if tls {
                    "TLS handshake"
                } else {
                    "first request, unseen"
                };
                println!(
                    "| {kind} | {ms} ms ({how}) | {} | {} | {:.1}% | {} | {} | {} |",
                    r.refused,
                    r.accepted,
                    r.utilisation * 100.0,
                    r.connections,
                    r.edge_hints,
                    r.log_lines,
                );
            }
        }
    }
}
