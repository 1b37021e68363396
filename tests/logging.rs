//! The access log as shipped: one line per request on stderr, written off the request
//! path, complete at SIGTERM, and never able to block a request when no one reads it.

use sluice_test_support as support;

use std::io::Read;
use std::time::Duration;

use support::*;

/// A config for the binary, with `up` as an upstream.
fn config_for(dir: &std::path::Path, up: &Upstream) -> std::path::PathBuf {
    binary_config(
        dir,
        &format!(
            "[[upstream]]\nname = \"api\"\nhosts = [\"127.0.0.1:{}\"]\n",
            up.addr.port()
        ),
    )
}

/// The binary on `path` with its stderr piped to the test (a `Sluice` reads the whole
/// pipe itself; these tests hold it or read it as it comes).
fn spawn_piped(
    path: &std::path::Path,
    env: &[(&str, &str)],
) -> (std::process::Child, std::process::ChildStderr, KillOnDrop) {
    let binary = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"));
    piped(binary, &["run", "-c", path.to_str().unwrap()], env)
}

/// Every request of a run that ends in SIGTERM has its access line, with stderr read
/// through a pipe as a container runtime reads it.
#[tokio::test]
async fn every_access_line_reaches_the_pipe_by_the_end_of_a_sigterm() {
    crypto();
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let path = config_for(dir.path(), &up);
    let mut sluice = Sluice::spawn(&["run", "-c", path.to_str().unwrap()]);
    let (port, admin) = sluice.listening().await;
    assert!(sluice.ready(admin).await);
    let client = client_via(port);
    const N: usize = 500;
    for i in 0..N {
        let r = client.get(up.url(&format!("/n/{i}"))).send().await.unwrap();
        assert_eq!(r.status(), 200);
    }
    sluice.signal("TERM");
    let (code, log) = sluice.exit().await;
    assert_eq!(code, Some(0));
    let access: Vec<&String> = log
        .iter()
        .filter(|l| l.contains("sluice::access"))
        .collect();
    assert_eq!(access.len(), N, "one line per request");
    for i in [0, N / 2, N - 1] {
        let path = format!("path=/n/{i} ");
        assert!(access.iter().any(|l| l.contains(&path)), "{path}");
    }
}

/// With stderr a pipe that no one reads, requests go on at full speed: log lines beyond
/// the queue are dropped and counted, never waited for.
#[tokio::test]
async fn a_stalled_log_pipe_never_blocks_a_request() {
    crypto();
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let path = config_for(dir.path(), &up);
    // stderr held, never read after the "listening" line: the pipe (widened to 1 MiB by
    // sluice) fills after about 900 lines of a KiB each.
    let (mut child, mut stderr, _reaper) = spawn_piped(&path, &[("SLUICE_LOG_QUEUE", "1000")]);
    let (port, admin) = listening_from(&mut stderr);
    let url = format!("http://127.0.0.1:{admin}/readyz");
    assert!(
        eventually(Duration::from_secs(10), || async {
            reqwest::get(&url).await.is_ok_and(|r| r.status() == 200)
        })
        .await
    );
    // Twice the lines the pipe and the queue (1000 lines here, or 1 MiB) hold together,
    // from four clients at once, each line over a KiB for its path. Written in the
    // request's path, this stops at a full pipe.
    let done = tokio::time::timeout(Duration::from_secs(60), async {
        let tasks: Vec<_> = (0..4)
            .map(|_| {
                let client = client_via(port);
                let url = up.url(&format!("/{}", "a".repeat(1024)));
                tokio::spawn(async move {
                    for _ in 0..1000 {
                        let r = client.get(&url).send().await.unwrap();
                        assert_eq!(r.status(), 200);
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
    })
    .await;
    assert!(done.is_ok(), "requests went on while no one read stderr");
    let m = admin_text(admin, "/metrics").await;
    let dropped = metric(&m, "sluice_log_lines_dropped_total").unwrap_or(0.0);
    assert!(dropped > 0.0, "dropped lines are counted: {dropped}");
    // Reading again lets the writer go on.
    let mut buf = vec![0u8; 1 << 16];
    let n = stderr.read(&mut buf).unwrap();
    assert!(n > 0);
    // With the pipe full again and still not read, SIGTERM still ends the process: the
    // exit waits a bounded time for the writer, not for a reader that never comes.
    let status = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let exited = tokio::task::spawn_blocking(move || {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while tokio::time::Instant::now() < deadline {
            if let Some(status) = child.try_wait().unwrap() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    })
    .await
    .unwrap();
    drop(stderr);
    assert!(
        exited.is_some_and(|s| s.success()),
        "sluice exits on SIGTERM with an unread stderr: {exited:?}"
    );
}

/// `access_log` per upstream: 0 turns its lines off, a fraction samples them; requests
/// are counted in the metrics all the same.
#[tokio::test]
async fn access_lines_can_be_sampled_or_turned_off_per_upstream() {
    crypto();
    let (quiet, sampled) = (Upstream::start().await, Upstream::start().await);
    let dir = tempfile::tempdir().unwrap();
    let path = binary_config(
        dir.path(),
        &format!(
            "[[upstream]]\nname = \"quiet\"\nhosts = [\"127.0.0.1:{}\"]\naccess_log = 0\n\
             [[upstream]]\nname = \"sampled\"\nhosts = [\"127.0.0.1:{}\"]\naccess_log = 0.5\n",
            quiet.addr.port(),
            sampled.addr.port()
        ),
    );
    let mut sluice = Sluice::spawn(&["run", "-c", path.to_str().unwrap()]);
    let (port, admin) = sluice.listening().await;
    assert!(sluice.ready(admin).await);
    let client = client_via(port);
    const N: usize = 400;
    for _ in 0..N {
        client.get(quiet.url("/")).send().await.unwrap();
        client.get(sampled.url("/")).send().await.unwrap();
    }
    let m = admin_text(admin, "/metrics").await;
    assert_eq!(
        metric(
            &m,
            r#"sluice_requests_total{family="-",outcome="200",upstream="quiet"}"#
        ),
        Some(N as f64)
    );
    sluice.signal("TERM");
    let (_, log) = sluice.exit().await;
    let lines = |name: &str| {
        let field = format!("upstream={name} ");
        log.iter()
            .filter(|l| l.contains("sluice::access") && l.contains(&field))
            .count()
    };
    assert_eq!(lines("quiet"), 0);
    // Half of 400, with a margin no fair coin misses (over 10 standard deviations).
    let n = lines("sampled");
    assert!((100..=300).contains(&n), "{n} of {N} sampled at 0.5");
}

/// A line is written while sluice runs, not held until a batch fills or the process
/// exits: one request's access line reaches a reader of the pipe soon after it is
/// answered (within about 10 ms; the bound here is wide for a busy machine).
#[tokio::test]
async fn a_lone_access_line_reaches_the_pipe_while_sluice_runs() {
    crypto();
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let path = config_for(dir.path(), &up);
    let (mut child, mut stderr, _reaper) = spawn_piped(&path, &[]);
    let (port, admin) = listening_from(&mut stderr);
    let rx = lines_of(stderr);
    let url = format!("http://127.0.0.1:{admin}/readyz");
    assert!(
        eventually(Duration::from_secs(10), || async {
            reqwest::get(&url).await.is_ok_and(|r| r.status() == 200)
        })
        .await
    );
    let r = client_via(port).get(up.url("/lone")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let found = tokio::task::spawn_blocking(move || {
        access_line_within(&rx, Duration::from_secs(5), "path=/lone ")
    })
    .await
    .unwrap();
    assert!(found, "the access line was written while sluice runs");
    child.kill().unwrap();
    child.wait().unwrap();
}

/// A request head hyper refuses by itself (not HTTP at all, or too large) never reaches
/// the service, yet gets its access line with its status and reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_refused_before_the_service_get_access_lines() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    crypto();
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let path = config_for(dir.path(), &up);
    let (mut child, mut stderr, _reaper) = spawn_piped(&path, &[]);
    let (port, _admin) = listening_from(&mut stderr);
    let rx = lines_of(stderr);
    let big = format!(
        "GET http://127.0.0.1/ HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\n\r\n",
        "a".repeat(100 * 1024)
    );
    for (wire, status) in [
        (b"NOT HTTP AT ALL\r\n\r\n".to_vec(), "status=400"),
        (big.into_bytes(), "status=431"),
    ] {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap();
        let _ = s.write_all(&wire).await;
        let mut answer = Vec::new();
        let _ = s.read_to_end(&mut answer).await;
        let found =
            tokio::task::block_in_place(|| access_line_within(&rx, Duration::from_secs(5), status));
        assert!(found, "an access line with {status}");
    }
    child.kill().unwrap();
    child.wait().unwrap();
}

/// stderr's lines, read on a thread of their own.
fn lines_of(stderr: std::process::ChildStderr) -> std::sync::mpsc::Receiver<String> {
    use std::io::BufRead;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    rx
}

/// Whether an access line containing `needle` comes within `within` (blocking).
fn access_line_within(
    rx: &std::sync::mpsc::Receiver<String>,
    within: Duration,
    needle: &str,
) -> bool {
    let deadline = tokio::time::Instant::now() + within;
    while let Some(left) = deadline.checked_duration_since(tokio::time::Instant::now()) {
        match rx.recv_timeout(left) {
            Ok(line) if line.contains("sluice::access") && line.contains(needle) => return true,
            Ok(_) => {}
            Err(_) => return false,
        }
    }
    false
}
