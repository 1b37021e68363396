//! Admission precision (run by bench/admission.sh): how late, after the instant its
//! limit allows it, does a queued request reach the upstream?
//!
//! An upstream on loopback stamps every arrival. The release `sluice` binary sits in front
//! with a token bucket of `rate`/s and a burst of 5, and 64 clients keep its queue full,
//! so after the first burst the k-th admission is due exactly at T0 + (k - 4)·T, whatever
//! the lateness of the ones before it (GCRA keeps its schedule while it has credit). The
//! gap of request k is its arrival minus that instant, with the schedule anchored on the
//! earliest arrival relative to it: the gap is the limiter's timer lateness plus the
//! forwarding time, less the fastest forwarding seen in the run.

use sluice_test_support::{bench, upstream};

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

const PROXY: &str = "127.0.0.1:13168";
const ADMIN: &str = "127.0.0.1:19941";
const BURST: usize = 5;
const CLIENTS: usize = 64;

#[tokio::main]
async fn main() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let args: Vec<String> = std::env::args().collect();
    let secs: u64 = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(10);
    let rates: Vec<u32> = args
        .get(2)
        .map(|r| r.split(',').filter_map(|x| x.parse().ok()).collect())
        .unwrap_or_else(|| vec![50, 200, 1000]);
    let sluice = std::env::var("SLUICE_BIN").unwrap_or_else(|_| "target/release/sluice".into());
    let dir = tempfile::tempdir().expect("tempdir");

    println!("\n| rate | requests | gap p50 | gap p99 | gap max | forwarding p50 (unqueued) |");
    println!("| --- | --- | --- | --- | --- | --- |");
    for rate in rates {
        let (addr, arrivals) = upstream::start().await;
        let config = dir.path().join("sluice.toml");
        std::fs::write(
            &config,
            format!(
                "[proxy]\nlisten = \"{PROXY}\"\nadmin = \"{ADMIN}\"\n\
                 [[upstream]]\nname = \"limited\"\nhosts = [\"{addr}\"]\nmax_queue = 100000\nmax_wait = \"1h\"\n\
                 limits = [{{ kind = \"token_bucket\", rate = {rate}, per = \"1s\", burst = {BURST} }}]\n"
            ),
        )
        .expect("config");
        let child = bench::Child(
            Command::new(&sluice)
                .args(["run", "-c", config.to_str().expect("path")])
                .env("RUST_LOG", "error")
                .stdout(Stdio::null())
                .spawn()
                .expect("start sluice"),
        );
        bench::ready(ADMIN).await;
        let client = reqwest::Client::builder()
            .proxy(reqwest::Proxy::all(format!("http://{PROXY}")).expect("proxy"))
            .build()
            .expect("client");
        let url = format!("http://{addr}/");

        // Unqueued forwarding time: one request at a time, each within the burst's credit.
        let mut fwd = Vec::new();
        for _ in 0..20 {
            tokio::time::sleep(Duration::from_secs_f64(1.5 / f64::from(rate))).await;
            let before = arrivals.lock().len();
            let t = Instant::now();
            client.get(&url).send().await.expect("request");
            let arrived = arrivals.lock()[before].0;
            fwd.push((arrived - t).as_secs_f64() * 1000.0);
        }
        fwd.sort_by(f64::total_cmp);
        // Let the bucket fill up again, then forget the probes.
        tokio::time::sleep(Duration::from_secs_f64(
            f64::from(BURST as u32 + 1) / f64::from(rate),
        ))
        .await;
        arrivals.lock().clear();

        let total = rate as usize * secs as usize + BURST;
        let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let tasks: Vec<_> = (0..CLIENTS)
            .map(|_| {
                let (c, u, next) = (client.clone(), url.clone(), next.clone());
                tokio::spawn(async move {
                    while next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < total {
                        let r = c.get(&u).send().await.expect("request");
                        assert_eq!(r.status(), 200);
                        r.bytes().await.expect("body");
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.expect("client task");
        }
        drop(child);

        let mut seen: Vec<Instant> = arrivals.lock().iter().map(|a| a.0).collect();
        seen.sort();
        let period = Duration::from_secs(1) / rate;
        // Request k >= BURST is due at T0 + (k - BURST + 1)·T.
        let offsets: Vec<(Instant, Duration)> = seen
            .iter()
            .enumerate()
            .skip(BURST)
            .map(|(k, at)| (*at, period * (k - BURST + 1) as u32))
            .collect();
        let anchor = offsets
            .iter()
            .map(|(at, off)| *at - *off)
            .min()
            .expect("arrivals");
        let mut gaps: Vec<f64> = offsets
            .iter()
            .map(|(at, off)| (*at - (anchor + *off)).as_secs_f64() * 1000.0)
            .collect();
        gaps.sort_by(f64::total_cmp);
        println!(
            "| {rate}/s | {} | {:.3} ms | {:.3} ms | {:.3} ms | {:.3} ms |",
            seen.len(),
            bench::pct(&gaps, 0.5),
            bench::pct(&gaps, 0.99),
            gaps[gaps.len() - 1],
            bench::pct(&fwd, 0.5),
        );
    }
}
