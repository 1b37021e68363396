//! The real `sluice` binary: `check`, `explain`, and `run` with a SIGTERM that lets the
//! request in flight finish. Logs are read back to check that secrets never reach them.

use sluice_test_support as support;

use std::process::Command;
use std::time::Duration;

use support::*;

const BIN: &str = env!("CARGO_BIN_EXE_sluice");

fn sluice(args: &[&str]) -> std::process::Output {
    Command::new(BIN)
        .args(args)
        .env_remove("SLUICE_CONFIG")
        .output()
        .unwrap()
}

#[test]
fn check_accepts_the_bundled_and_product_configs() {
    for file in ["config/sluice.toml", "tests/fixtures/product-example.toml"] {
        let out = sluice(&["check", "-c", file]);
        assert!(
            out.status.success(),
            "{file}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(String::from_utf8_lossy(&out.stdout).contains("ok"));
    }
}

#[test]
fn check_reports_file_line_col_and_fails() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.toml");
    std::fs::write(
        &path,
        "[proxy]\nlisten = \"127.0.0.1:3128\"\n\n[[upstream]]\nname = \"m\"\nhosts = [\"a.example\"]\nburst = 3\n",
    )
    .unwrap();
    let out = sluice(&["check", "-c", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.starts_with(&format!("{}:7:1: ", path.display())),
        "{err}"
    );
    assert!(err.contains("unknown field `burst`"), "{err}");

    let out = sluice(&["check", "-c", "/nonexistent/sluice.toml"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot read config"));

    // A shared limit with nothing to share it through.
    std::fs::write(
        &path,
        "[[upstream]]\nname = \"m\"\nhosts = [\"a.example\"]\n\
         limits = [{ kind = \"fixed_window\", permits = 300, window = \"1m\", scope = \"global\" }]\n",
    )
    .unwrap();
    let out = sluice(&["check", "-c", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.starts_with(&format!(
            "{}:4:11: scope = \"global\" needs a [cluster]",
            path.display()
        )),
        "{err}"
    );
}

#[test]
fn config_path_comes_from_the_environment() {
    let out = Command::new(BIN)
        .arg("check")
        .env("SLUICE_CONFIG", "config/sluice.toml")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn explain_prints_route_limits_and_policies_without_the_key() {
    let out = sluice(&[
        "explain",
        "-c",
        "config/sluice.toml",
        "POST",
        "http://api.marketplace.example/v1/orders/17",
        "-H",
        "Authorization: Bearer sk_live_topsecret",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    for needle in [
        "upstream    marketplace",
        "family      orders",
        "partition   ",
        "fixed_window 300 per 1m",
        "sliding_window 12 per 1s",
        "retry       no: POST without idempotency-key",
        "breaker     upstream marketplace",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in\n{text}");
    }
    assert!(!text.contains("topsecret"), "{text}");

    let out = sluice(&["explain", "-c", "config/sluice.toml", "GET", "/relative"]);
    assert!(!out.status.success());
}

#[tokio::test]
async fn run_serves_logs_safely_and_drains_on_sigterm() {
    support::crypto();
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("sluice.toml");
    std::fs::write(
        &config,
        "[proxy]\nlisten = \"127.0.0.1:0\"\nadmin = \"127.0.0.1:0\"\ndrain_timeout = \"10s\"\n\
         [[upstream]]\nname = \"local\"\nhosts = [\"127.0.0.1\"]\nkey = \"header:Authorization\"\n",
    )
    .unwrap();
    let mut sluice = Sluice::spawn(&[
        "--log-format",
        "json",
        "run",
        "--workers",
        "3",
        "-c",
        config.to_str().unwrap(),
    ]);
    let (port, admin) = sluice.listening().await;
    assert!(sluice.ready(admin).await, "the binary became ready");

    let client = reqwest::Client::builder()
        .proxy(reqwest::Proxy::all(format!("http://127.0.0.1:{port}")).unwrap())
        .build()
        .unwrap();
    let resp = client
        .get(up.url("/orders?token=query-secret"))
        .header("authorization", "Bearer header-secret")
        .header("cookie", "session=cookie-secret")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);

    // A slow request in flight when SIGTERM arrives still gets its whole response.
    let slow = tokio::spawn({
        let client = client.clone();
        let url = up.url("/slow/800");
        async move { client.get(url).send().await.unwrap() }
    });
    while up.seen().len() < 2 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    sluice.signal("TERM");
    let resp = slow.await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.text().await.unwrap(), "slow");

    let (code, lines) = sluice.exit().await;
    assert_eq!(code, Some(0), "clean exit after the drain");
    let all = lines.join("\n");
    for secret in ["query-secret", "header-secret", "cookie-secret"] {
        assert!(
            !all.contains(secret),
            "{secret} leaked into the log:\n{all}"
        );
    }
    let access: Vec<serde_json::Value> = lines
        .iter()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["target"] == "sluice::access")
        .collect();
    assert_eq!(access.len(), 2, "one access line per request:\n{all}");
    let first = &access[0];
    assert_eq!(first["method"], "GET");
    assert_eq!(first["upstream"], "local");
    assert_eq!(first["family"], "-");
    assert_eq!(first["status"], 200);
    assert_eq!(first["path"], "/orders");
    assert!(first["duration_ms"].is_number());
    assert!(all.contains("SIGTERM received"), "{all}");
    let listening = lines
        .iter()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["message"] == "listening")
        .unwrap_or_else(|| panic!("no listening line:\n{all}"));
    assert_eq!(listening["workers"], 3, "{listening}");
}

#[test]
fn run_refuses_zero_workers() {
    let out = Command::new(BIN)
        .args(["run", "-c", "config/sluice.toml"])
        .env("SLUICE_WORKERS", "0")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--workers"), "{err}");
}

/// The CPUs a thread may run on, from its `Cpus_allowed_list` (`0-1,3`).
#[cfg(target_os = "linux")]
fn allowed_cpus(status: &str) -> Vec<usize> {
    let list = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .unwrap()
        .trim();
    let mut cpus = Vec::new();
    for part in list.split(',') {
        match part.split_once('-') {
            Some((a, b)) => cpus.extend(a.parse::<usize>().unwrap()..=b.parse().unwrap()),
            None => cpus.push(part.parse().unwrap()),
        }
    }
    cpus
}

/// Each worker thread of `pid` and the CPUs it may run on.
#[cfg(target_os = "linux")]
fn worker_cpus(pid: u32) -> Vec<Vec<usize>> {
    let mut workers = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let dir = task.unwrap().path();
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap();
        if comm.starts_with("sluice-worker-") {
            let status = std::fs::read_to_string(dir.join("status")).unwrap();
            workers.push(allowed_cpus(&status));
        }
    }
    workers
}

/// Workers are pinned one per CPU only when the process's CPUs are shown to be its own
/// (an exclusive cpuset) or with `--pin-workers on`: an affinity narrowed by `taskset`
/// inside a wider cgroup is no such proof, whatever the CPU request says. The
/// `listening` line says how many workers, why, and whether they were pinned.
#[cfg(target_os = "linux")]
#[tokio::test]
async fn workers_are_pinned_only_to_a_cpuset_of_their_own_or_when_asked() {
    support::crypto();
    let ours = allowed_cpus(&std::fs::read_to_string("/proc/self/status").unwrap());
    let online = allowed_cpus(&format!(
        "Cpus_allowed_list: {}",
        std::fs::read_to_string("/sys/devices/system/cpu/online").unwrap()
    ))
    .len();
    let n = ours.len().to_string();
    let more = (ours.len() + 1).to_string();
    let first = ours[0].to_string();
    // (taskset CPU, arguments, the CPUs pinned, workers_from)
    type Case<'a> = (Option<&'a str>, Vec<&'a str>, Option<Vec<usize>>, &'a str);
    let mut cases: Vec<Case> = vec![
        (None, vec!["--workers", &n], None, "set by --workers"),
        (
            None,
            vec!["--workers", &n, "--pin-workers", "on"],
            Some(ours.clone()),
            "set by --workers",
        ),
        (
            None,
            vec!["--workers", &n, "--pin-workers", "off"],
            None,
            "set by --workers",
        ),
        (
            None,
            vec!["--workers", &more, "--pin-workers", "on"],
            None,
            "set by --workers",
        ),
        (
            None,
            vec!["--cpu-request-millicores", "50"],
            None,
            "CPU request 50m",
        ),
    ];
    if online > 1 && ours.len() > 1 {
        // One CPU of several by taskset: narrowed, but not the cgroup's cpuset, so not
        // its own, even with a request of exactly one whole CPU; pinned when asked.
        cases.push((Some(&first), vec![], None, "cpuset of 1 of the machine's"));
        cases.push((
            Some(&first),
            vec!["--cpu-request-millicores", "1000"],
            None,
            "CPU request 1000m",
        ));
        cases.push((
            Some(&first),
            vec!["--pin-workers", "on"],
            Some(vec![ours[0]]),
            "cpuset of 1 of the machine's",
        ));
    } else {
        eprintln!("one CPU to this test: no affinity narrower than its cgroup to try");
    }
    for (taskset, args, pinned, why) in cases {
        let mut command = std::process::Command::new("sh");
        command.arg("-c");
        match taskset {
            Some(cpu) => command.arg(format!("exec taskset -c {cpu} \"$0\" \"$@\"")),
            None => command.arg("exec \"$0\" \"$@\""),
        };
        command.arg(env!("CARGO_BIN_EXE_sluice"));
        let run = [
            &["run"][..],
            &args[..],
            &[
                "-c",
                "config/sluice.toml",
                "--listen",
                "127.0.0.1:0",
                "--admin",
                "127.0.0.1:0",
            ],
        ]
        .concat();
        let mut sluice = Sluice::spawn_shell(command, &run);
        let (_, admin) = sluice.listening().await;
        assert!(sluice.ready(admin).await);
        let mut workers = worker_cpus(sluice.pid());
        workers.sort();
        let allowed = taskset.map_or(ours.clone(), |_| vec![ours[0]]);
        match &pinned {
            Some(cpus) => {
                let each: Vec<Vec<usize>> = cpus.iter().map(|&c| vec![c]).collect();
                assert_eq!(workers, each, "{taskset:?} {args:?}: one CPU each");
            }
            None => assert!(
                workers.iter().all(|w| *w == allowed),
                "{args:?}: {workers:?}"
            ),
        }
        sluice.signal("TERM");
        let (code, lines) = sluice.exit().await;
        assert_eq!(code, Some(0));
        let listening = lines.iter().find(|l| l.contains("listening")).unwrap();
        let said = match &pinned {
            Some(cpus) => format!("pinned_to_cpus={cpus:?}"),
            None => "pinned_to_cpus=no".to_string(),
        };
        assert!(listening.contains(&said), "{args:?}: {said} in {listening}");
        assert!(
            listening.contains(&format!("workers_from={why}")),
            "{listening}"
        );
        assert!(listening.contains("pinning="), "{listening}");
        // Unpinned workers are kept on different CPUs unless told off, when there are
        // two or more of each.
        let workers_n: usize = listening
            .split_once(" workers=")
            .and_then(|(_, rest)| rest.split(' ').next()?.parse().ok())
            .unwrap_or_else(|| panic!("no workers= in {listening}"));
        let apart = pinned.is_none()
            && !args.contains(&"off")
            && workers_n >= 2
            && (if taskset.is_some() { 1 } else { ours.len() }) >= 2;
        assert!(
            listening.contains(&format!("kept_apart={apart}")),
            "{args:?}: kept_apart={apart} in {listening}"
        );
        if taskset.is_some() && pinned.is_none() {
            assert!(listening.contains("not shown to be its own"), "{listening}");
        }
    }
}

/// `sluice wait-ready` returns once the admin listener's /readyz answers 200 (as a
/// postStart hook it holds the next container back until then), and fails with the
/// reason at its timeout.
#[tokio::test]
async fn wait_ready_waits_for_readyz() {
    support::crypto();
    let closed = support::closed_port().await;
    let out = tokio::process::Command::new(BIN)
        .args([
            "wait-ready",
            "--admin",
            &closed.to_string(),
            "--timeout",
            "300ms",
        ])
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not ready after 300ms"), "{err}");

    let mut sluice = Sluice::spawn(&[
        "run",
        "-c",
        "config/sluice.toml",
        "--listen",
        "127.0.0.1:0",
        "--admin",
        "127.0.0.1:0",
    ]);
    let (_, admin) = sluice.listening().await;
    // An unspecified address is asked on loopback, as SLUICE_ADMIN=0.0.0.0:9901 in a pod.
    let out = tokio::process::Command::new(BIN)
        .args(["wait-ready", "--timeout", "30s"])
        .env("SLUICE_ADMIN", format!("0.0.0.0:{admin}"))
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    sluice.signal("TERM");
    let _ = sluice.exit().await;
}
