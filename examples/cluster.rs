//! Shared limits across replicas (run by bench/cluster.sh): three release `sluice`
//! processes share one Redis and one upstream that logs every arrival with the replica
//! it came through.
//!
//! 1. Saturation, for each kind: each replica's clients offer about three times the
//!    whole limit for `seconds`. Reported: windows of the arrival log over the limit
//!    (judged by the provider counters of crates/test-support/src/provider.rs), utilisation (the
//!    accepted arrivals over what the limit allows across their span: a window's permits
//!    per window, or the burst plus the rate), each replica's share, and Redis calls per
//!    request (`INFO commandstats`).
//! 2. Added latency: one client, one request at a time, through a replica to a generous
//!    limit that never makes anyone wait, global and then local: the difference is the
//!    Redis round trip.
//! 3. Failover: Redis killed and started again under load; when the replicas noticed,
//!    from `sluice_cluster_mode`.
//!
//! Needs `redis-server` and `redis-cli` on the PATH (bench/cluster.sh installs them).
//! Usage: cluster [seconds of saturation per kind] [saturation|latency|failover]

use sluice_test_support::{bench, provider, upstream};

use std::process::{Command, Stdio};
use std::time::Duration;

use provider::Counter;
use tokio::time::Instant;

/// How many requests a limit allows over a span of arrivals.
type Allowed = Box<dyn Fn(Duration) -> f64>;

async fn upstream() -> (u16, upstream::Log) {
    let (addr, log) = upstream::start().await;
    (addr.port(), log)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

struct Redis {
    port: u16,
    child: Option<std::process::Child>,
}

impl Redis {
    fn start(port: u16) -> Redis {
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .spawn()
            .expect("redis-server");
        let r = Redis {
            port,
            child: Some(child),
        };
        for _ in 0..200 {
            if r.cli(&["PING"]).contains("PONG") {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        r
    }

    fn cli(&self, args: &[&str]) -> String {
        Command::new("redis-cli")
            .args(["-p", &self.port.to_string()])
            .args(args)
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default()
    }

    fn calls(&self) -> u64 {
        let info = self.cli(&["INFO", "commandstats"]);
        ["evalsha", "eval"]
            .iter()
            .filter_map(|c| {
                let prefix = format!("cmdstat_{c}:calls=");
                info.lines()
                    .find_map(|l| l.strip_prefix(prefix.as_str()))
                    .and_then(|rest| rest.split(',').next())
                    .and_then(|n| n.parse::<u64>().ok())
            })
            .sum()
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.kill();
    }
}

struct Replica {
    _child: bench::Child,
    port: u16,
    admin: String,
}

async fn replicas(
    sluice: &str,
    dir: &std::path::Path,
    limit: &str,
    redis: u16,
    upstream: u16,
    n: usize,
) -> Vec<Replica> {
    let mut out = Vec::new();
    for i in 0..n {
        let (port, admin) = (free_port(), format!("127.0.0.1:{}", free_port()));
        let path = dir.join(format!("sluice-{i}.toml"));
        std::fs::write(
            &path,
            format!(
                "[proxy]\nlisten = \"127.0.0.1:{port}\"\nadmin = \"{admin}\"\n\
                 [[upstream]]\nname = \"api\"\nhosts = [\"127.0.0.1:{upstream}\"]\n\
                 max_queue = 100000\nlimits = [{limit}]\n[upstream.retry]\nmax_attempts = 1\n\
                 [cluster]\nredis = \"redis://127.0.0.1:{redis}/0\"\nreplicas = {n}\nopen_for = \"1s\"\n"
            ),
        )
        .expect("config");
        // As shipped: default log level, stderr read through a pipe.
        let mut child = Command::new(sluice)
            .args(["run", "-c", path.to_str().expect("path")])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start sluice");
        if let Some(stderr) = child.stderr.take() {
            std::thread::spawn(move || {
                use std::io::BufRead;
                for _ in std::io::BufReader::new(stderr)
                    .lines()
                    .map_while(Result::ok)
                {}
            });
        }
        bench::ready(&admin).await;
        out.push(Replica {
            _child: bench::Child(child),
            port,
            admin,
        });
    }
    out
}

fn client(port: u16) -> reqwest::Client {
    reqwest::Client::builder()
        .proxy(reqwest::Proxy::all(format!("http://127.0.0.1:{port}")).expect("proxy"))
        .build()
        .expect("client")
}

/// `per_replica` closed-loop clients on each replica until `until`.
async fn load(replicas: &[Replica], upstream: u16, per_replica: usize, until: Instant) {
    let mut tasks = Vec::new();
    for (i, r) in replicas.iter().enumerate() {
        for _ in 0..per_replica {
            let c = client(r.port);
            let url = format!("http://127.0.0.1:{upstream}/v1/items");
            tasks.push(tokio::spawn(async move {
                while Instant::now() < until {
                    if let Ok(resp) = c.get(&url).header("x-replica", i.to_string()).send().await {
                        let _ = resp.bytes().await;
                    }
                }
            }));
        }
    }
    for t in tasks {
        let _ = t.await;
    }
}

async fn metric(admin: &str, series: &str) -> Option<f64> {
    let text = reqwest::get(format!("http://{admin}/metrics"))
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

#[tokio::main]
async fn main() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let args: Vec<String> = std::env::args().collect();
    let seconds: u64 = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(20);
    // Which parts to run: "saturation", "latency", "failover"; all by default.
    let only = args.get(2).cloned().unwrap_or_default();
    let part = |name: &str| only.is_empty() || only == name;
    let sluice = std::env::var("SLUICE_BIN").unwrap_or_else(|_| "target/release/sluice".into());
    let dir = tempfile::tempdir().expect("tempdir");
    if part("saturation") {
        saturation(&sluice, dir.path(), seconds).await;
    }
    if part("latency") {
        latency(&sluice, dir.path()).await;
    }
    if part("failover") {
        failover(&sluice, dir.path()).await;
    }
}

async fn saturation(sluice: &str, dir: &std::path::Path, seconds: u64) {
    println!("\n## Saturation: {seconds} s, default margin\n");
    println!(
        "| limit | replicas | requests | windows over the limit | utilisation | shares (after 2 s) | Redis calls per request |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    // LIMITS=burst: only the limits whose text contains it.
    let filter = std::env::var("LIMITS").unwrap_or_default();
    let second = Duration::from_secs(1);
    let kinds: [(&str, Counter, Allowed); 5] = [
        (
            "{ kind = \"sliding_window\", permits = 50, window = \"1s\", scope = \"global\" }",
            Counter::sliding(50, second),
            Box::new(|span: Duration| 50.0 * (span.as_secs_f64() + 1.0)),
        ),
        (
            "{ kind = \"fixed_window\", permits = 50, window = \"1s\", scope = \"global\" }",
            Counter::fixed(50, second),
            Box::new(|span: Duration| 50.0 * (span.as_secs_f64() + 1.0)),
        ),
        (
            "{ kind = \"token_bucket\", rate = 50, per = \"1s\", burst = 10, scope = \"global\" }",
            Counter::token(50, second, 10),
            Box::new(|span: Duration| 10.0 + 50.0 * span.as_secs_f64()),
        ),
        // Small limits, where each reservation's margin would cost most.
        (
            "{ kind = \"token_bucket\", rate = 10, per = \"1s\", burst = 1, scope = \"global\" }",
            Counter::token(10, second, 1),
            Box::new(|span: Duration| 1.0 + 10.0 * span.as_secs_f64()),
        ),
        (
            "{ kind = \"sliding_window\", permits = 2, window = \"1s\", scope = \"global\" }",
            Counter::sliding(2, second),
            Box::new(|span: Duration| 2.0 * (span.as_secs_f64() + 1.0)),
        ),
    ];
    let runs = kinds.into_iter().flat_map(|(limit, counter, allowed)| {
        // The small limits on two replicas as well: how turns go with fewer to take them.
        let small = limit.contains("burst = 1,") || limit.contains("permits = 2,");
        let counts: &[usize] = if small { &[2, 3] } else { &[3] };
        let allowed = std::rc::Rc::new(allowed);
        counts
            .iter()
            .map(move |n| (limit, counter.clone(), allowed.clone(), *n))
            .collect::<Vec<_>>()
    });
    for (limit, mut counter, allowed, n_replicas) in runs {
        if !limit.contains(filter.as_str()) {
            continue;
        }
        let redis = Redis::start(free_port());
        let (up, log) = upstream().await;
        let reps = replicas(sluice, dir, limit, redis.port, up, n_replicas).await;
        let start = Instant::now();
        // 3 × 16 clients: each replica alone offers about three times the whole limit.
        load(&reps, up, 16, start + Duration::from_secs(seconds)).await;
        let calls = redis.calls();
        let mut arrivals = log.lock().clone();
        arrivals.sort();
        let over = arrivals
            .iter()
            .filter(|(at, _)| !counter.arrive(*at))
            .count();
        // Utilisation while the clients send: the requests still queued when they stop
        // go out as the replicas' queues run dry, no longer saturating the limit.
        let end = start + Duration::from_secs(seconds);
        let loaded: Vec<&(Instant, usize)> = arrivals.iter().filter(|a| a.0 < end).collect();
        let span = match (loaded.first(), loaded.last()) {
            (Some(a), Some(b)) => b.0 - a.0,
            _ => Duration::ZERO,
        };
        let n = arrivals.len() as f64;
        // Shares once every replica is under way: the first to start may take the first
        // window alone.
        let settled: Vec<&(Instant, usize)> = arrivals
            .iter()
            .filter(|a| {
                arrivals
                    .first()
                    .is_some_and(|f| a.0 >= f.0 + Duration::from_secs(2))
            })
            .collect();
        let shares: Vec<String> = (0..n_replicas)
            .map(|r| {
                let mine = settled.iter().filter(|a| a.1 == r).count() as f64;
                format!("{:.1}%", 100.0 * mine / settled.len().max(1) as f64)
            })
            .collect();
        println!(
            "| `{limit}` | {n_replicas} | {} | {over} | {:.1}% | {} | {:.2} |",
            arrivals.len(),
            100.0 * loaded.len() as f64 / allowed(span),
            shares.join(" / "),
            calls as f64 / n
        );
    }
}

async fn latency(sluice: &str, dir: &std::path::Path) {
    println!("\n## Added latency, uncontended (one client, one request at a time)\n");
    println!("| limit | requests | p50 ms | p99 ms | Redis calls per request |");
    println!("| --- | --- | --- | --- | --- |");
    let mut p = Vec::new();
    for scope in ["global", "local"] {
        let redis = Redis::start(free_port());
        let (up, _) = upstream().await;
        let limit = format!(
            "{{ kind = \"token_bucket\", rate = 1000000, per = \"1s\", burst = 1000000, scope = \"{scope}\" }}"
        );
        let reps = replicas(sluice, dir, &limit, redis.port, up, 3).await;
        let c = client(reps[0].port);
        let url = format!("http://127.0.0.1:{up}/one");
        for _ in 0..200 {
            let _ = c.get(&url).send().await.map(|r| r.bytes());
        }
        let before = redis.calls();
        let mut took = Vec::new();
        for _ in 0..3000 {
            let t = Instant::now();
            if let Ok(r) = c.get(&url).send().await {
                let _ = r.bytes().await;
            }
            took.push(t.elapsed().as_secs_f64() * 1000.0);
        }
        took.sort_by(f64::total_cmp);
        let calls = (redis.calls() - before) as f64 / took.len() as f64;
        println!(
            "| {scope} | {} | {:.3} | {:.3} | {calls:.2} |",
            took.len(),
            bench::pct(&took, 0.5),
            bench::pct(&took, 0.99)
        );
        p.push((bench::pct(&took, 0.5), bench::pct(&took, 0.99)));
    }
    println!(
        "\nAdded by the shared limit: p50 {:.3} ms, p99 {:.3} ms\n",
        p[0].0 - p[1].0,
        p[0].1 - p[1].1
    );
}

async fn failover(sluice: &str, dir: &std::path::Path) {
    println!("## Failover: Redis killed, then started again, under load\n");
    let mut redis = Redis::start(free_port());
    let redis_port = redis.port;
    let (up, _) = upstream().await;
    let reps = replicas(
        sluice,
        dir,
        "{ kind = \"sliding_window\", permits = 50, window = \"1s\", scope = \"global\" }",
        redis_port,
        up,
        3,
    )
    .await;
    let t0 = Instant::now();
    let loader = load(&reps, up, 8, t0 + Duration::from_secs(8));
    let watch = async {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let killed = Instant::now();
        redis.kill();
        // The first failed call comes when a request next needs Redis (or a correction is
        // flushed); from there the breaker decides.
        let (mut first_error, mut fell_back) = (None, None);
        while fell_back.is_none() && killed.elapsed() < Duration::from_secs(5) {
            let text = match reqwest::get(format!("http://{}/metrics", reps[0].admin)).await {
                Ok(r) => r.text().await.unwrap_or_default(),
                Err(_) => String::new(),
            };
            let errors: f64 = text
                .lines()
                .filter(|l| l.starts_with("sluice_cluster_errors_total"))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum();
            if first_error.is_none() && errors > 0.0 {
                first_error = Some(killed.elapsed());
            }
            if text.contains("sluice_cluster_mode{mode=\"local\"} 1") {
                fell_back = Some(killed.elapsed());
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        let restarted = Instant::now();
        let r2 = Redis::start(redis_port);
        let mut back = None;
        while back.is_none() && restarted.elapsed() < Duration::from_secs(10) {
            if metric(&reps[0].admin, r#"sluice_cluster_mode{mode="redis"}"#).await == Some(1.0) {
                back = Some(restarted.elapsed());
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        (first_error, fell_back, back, r2)
    };
    let ((), (first_error, fell_back, back, _r2)) = tokio::join!(loader, watch);
    let ms = |d: Option<Duration>| {
        d.map_or("–".into(), |d| {
            format!("{:.0} ms", d.as_secs_f64() * 1000.0)
        })
    };
    println!("| replica 0 | after | bound |");
    println!("| --- | --- | --- |");
    println!(
        "| first failed call after Redis was killed | {} | the next request that needs Redis |",
        ms(first_error)
    );
    println!(
        "| on its local share | {} ({} after the first failure) | timeout × failures = 150 ms after it |",
        ms(fell_back),
        ms(fell_back.zip(first_error).map(|(a, b)| a.saturating_sub(b)))
    );
    println!(
        "| on Redis again after it restarted | {} | open_for = 1 s |",
        ms(back)
    );
}
