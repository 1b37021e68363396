//! Reload without a restart: each trigger (POST /reload, the file watcher through rename,
//! delete-and-recreate and a kubelet-style `..data` symlink swap, SIGHUP on the binary),
//! bad files refused while traffic flows, limits moved under a full queue, and a hundred
//! reloads in a row under load without one failed request.

use sluice_test_support as support;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use support::*;

/// A config for one upstream on 127.0.0.1 with `limits`, listening on `listen`/`admin`.
fn config_on(listen: &str, admin: &str, limits: &str, extra: &str) -> String {
    format!(
        "[proxy]\nlisten = \"{listen}\"\nadmin = \"{admin}\"\ndrain_timeout = \"3s\"\n\
         [[upstream]]\nname = \"api\"\nhosts = [\"127.0.0.1\"]\nmax_queue = 1000\nmax_wait = \"60s\"\n\
         limits = [{limits}]\n{extra}"
    )
}

fn config(limits: &str, extra: &str) -> String {
    config_on("127.0.0.1:0", "127.0.0.1:0", limits, extra)
}

fn window(permits: u32, window: &str) -> String {
    format!("{{ kind = \"sliding_window\", permits = {permits}, window = \"{window}\" }}")
}

/// Replaces the file the way editors do: write beside it, rename over it.
fn rename_over(path: &Path, text: &str) {
    let tmp = path.with_extension("toml.tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

async fn reloads(proxy: &Proxy, result: &str) -> f64 {
    metric(
        &proxy.metrics().await,
        &format!("sluice_config_reloads_total{{result=\"{result}\"}}"),
    )
    .unwrap_or(-1.0)
}

async fn live_permits(proxy: &Proxy) -> u64 {
    let (_, text) = proxy.admin_get("/config").await;
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["upstreams"][0]["limits"][0]["permits"].as_u64().unwrap()
}

/// A proxy started on `text` written to `sluice.toml` in a new directory, which lives as
/// long as the returned guard.
async fn proxy_on_file(text: &str) -> (tempfile::TempDir, std::path::PathBuf, Proxy) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sluice.toml");
    std::fs::write(&path, text).unwrap();
    let proxy = Proxy::from_file(&path).await;
    (dir, path, proxy)
}

/// Whether the live limit becomes `n` permits within `within`.
async fn permits_become(proxy: &Proxy, n: u64, within: Duration) -> bool {
    eventually(within, || async { live_permits(proxy).await == n }).await
}

#[tokio::test]
async fn post_reload_answers_what_changed_and_refuses_bad_files() {
    let up = Upstream::start().await;
    let (_dir, path, proxy) = proxy_on_file(&config(&window(2, "1s"), "")).await;

    let (status, body) = proxy.admin_post("/reload").await;
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["changed"], false, "{body}");

    let good = config(
        &window(5, "1s"),
        "[[upstream]]\nname = \"other\"\nhosts = [\"other.example\"]\n",
    );
    std::fs::write(&path, &good).unwrap();
    let (status, body) = proxy.admin_post("/reload").await;
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["changed"], true, "{body}");
    assert_eq!(v["modified"], serde_json::json!(["api"]), "{body}");
    assert_eq!(v["added"], serde_json::json!(["other"]), "{body}");
    assert_eq!(v["restart_needed"], serde_json::json!([]), "{body}");
    assert_eq!(live_permits(&proxy).await, 5);
    // Published without the file's secrets: as `sluice check` prints it.
    let sha = sluice::Config::load(&path).unwrap().digest;

    let bad = [
        ("not toml", format!("{good}\n[[upstream]\n"), "expected"),
        (
            "bad value",
            good.replace("permits = 5", "permits = 0"),
            "nonzero",
        ),
        (
            "unknown key",
            good.replace("max_queue = 1000", "max_queue = 1000\nbogus = 1"),
            "unknown field `bogus`",
        ),
    ];
    for (what, text, needle) in &bad {
        std::fs::write(&path, text).unwrap();
        let (status, body) = proxy.admin_post("/reload").await;
        assert_eq!(status, 400, "{what}: {body}");
        let err = serde_json::from_str::<serde_json::Value>(&body).unwrap()["error"]
            .as_str()
            .unwrap()
            .to_string();
        // file:line:col: message
        let place = err.strip_prefix(&format!("{}:", path.display())).unwrap();
        let mut parts = place.splitn(3, ':');
        assert!(
            parts.next().unwrap().parse::<u32>().is_ok(),
            "{what}: {err}"
        );
        assert!(
            parts.next().unwrap().parse::<u32>().is_ok(),
            "{what}: {err}"
        );
        assert!(err.contains(needle), "{what}: {err}");
        assert_eq!(live_permits(&proxy).await, 5, "{what}: old config in force");
    }
    let m = proxy.metrics().await;
    assert_eq!(
        metric(&m, "sluice_config_reloads_total{result=\"failure\"}"),
        Some(3.0)
    );
    assert_eq!(
        metric(&m, "sluice_config_reloads_total{result=\"success\"}"),
        Some(2.0)
    );
    assert_eq!(
        metric(&m, &format!("sluice_config_info{{sha256=\"{sha}\"}}")),
        Some(1.0)
    );
    assert_eq!(m.matches("sluice_config_info{").count(), 1, "{m}");
    // The last reload was refused: 0 for as long as the bad file stays.
    assert_eq!(
        metric(&m, "sluice_config_last_reload_successful"),
        Some(0.0)
    );

    // Listen addresses need a restart: reported, and the proxy keeps its sockets.
    std::fs::write(
        &path,
        config_on("127.0.0.1:1", "127.0.0.1:0", &window(5, "1s"), ""),
    )
    .unwrap();
    let (status, body) = proxy.admin_post("/reload").await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("proxy.listen"), "{body}");
    let m = proxy.metrics().await;
    assert_eq!(
        metric(&m, "sluice_config_last_reload_successful"),
        Some(1.0)
    );
    let resp = proxy.client().get(up.url("/x")).send().await.unwrap();
    assert_eq!(resp.status(), 200);

    let resp = reqwest::get(format!("http://{}/reload", proxy.admin))
        .await
        .unwrap();
    assert_eq!(resp.status(), 405);
}

/// Bad TOML, a bad value and an unknown key, one after the other while 24 requests queue
/// on 4/s (five seconds of work, so the three refusals have ample time to land):
/// each is refused and counted, the limits in force stay exactly as they were.
#[tokio::test]
async fn invalid_rewrites_keep_the_old_limits_under_live_traffic() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sluice.toml");
    let good = config(&window(4, "1s"), "");
    std::fs::write(&path, &good).unwrap();
    let proxy = Proxy::from_file(&path).await;
    let client = proxy.client();

    let start = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..24 {
        let (c, url) = (client.clone(), up.url(&format!("/r?n={i}")));
        tasks.push(tokio::spawn(async move {
            c.get(url).send().await.unwrap().status()
        }));
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let bad = [
        format!("{good}\n[[upstream]\n"),
        good.replace("permits = 4", "permits = 0"),
        good.replace("max_queue", "max_queu"),
    ];
    for (i, text) in bad.iter().enumerate() {
        // The watcher reads each, refuses it and counts it.
        rename_over(&path, text);
        let want = (i + 1) as f64;
        assert!(
            eventually(Duration::from_secs(5), || async {
                reloads(&proxy, "failure").await == want
            })
            .await,
            "the watcher refused bad file {i}"
        );
        assert_eq!(live_permits(&proxy).await, 4);
    }
    assert!(
        start.elapsed() < Duration::from_millis(4900),
        "the bad files landed while requests were still queued"
    );
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    // 24 requests at 4 per second: the last goes at 5 s, as before the bad files.
    assert!(start.elapsed() >= Duration::from_millis(4900));
    let seen: Vec<Duration> = up.seen().iter().map(|s| s.at - start).collect();
    for w in seen.windows(5) {
        assert!(
            w[4] - w[0] >= Duration::from_millis(900),
            "never more than 4 in a second: {seen:?}"
        );
    }
    assert_eq!(reloads(&proxy, "success").await, 0.0);
}

#[tokio::test]
async fn a_configmap_symlink_swap_is_picked_up() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let mut cm = ConfigMapDir::new(dir.path(), "sluice.toml", &config(&window(1, "30s"), ""));
    let proxy = Proxy::from_file(&cm.path("sluice.toml")).await;
    let client = proxy.client();
    assert_eq!(client.get(up.url("/a")).send().await.unwrap().status(), 200);

    cm.update("sluice.toml", &config(&window(100, "30s"), ""));
    assert!(
        eventually(Duration::from_secs(5), || async {
            reloads(&proxy, "success").await == 1.0
        })
        .await,
        "the swap was seen"
    );
    assert_eq!(live_permits(&proxy).await, 100);
    // Under the old limit the next request would wait 30 s.
    let t0 = Instant::now();
    for _ in 0..5 {
        assert_eq!(client.get(up.url("/b")).send().await.unwrap().status(), 200);
    }
    assert!(t0.elapsed() < Duration::from_secs(5));

    // The watch survives the swap: a second update is seen too.
    cm.update("sluice.toml", &config(&window(7, "30s"), ""));
    assert!(
        eventually(Duration::from_secs(5), || async {
            reloads(&proxy, "success").await == 2.0
        })
        .await
    );
    assert_eq!(live_permits(&proxy).await, 7);
    assert_eq!(reloads(&proxy, "failure").await, 0.0);
}

/// A refused edit rolled back (`kubectl rollout undo`, or the previous ConfigMap applied
/// again) puts the live config back on disk: the reload-failed gauge returns to 1, or
/// the alert on it would fire for ever with a good file in place.
#[tokio::test]
async fn restoring_the_live_file_after_a_refused_edit_clears_the_failure() {
    let dir = tempfile::tempdir().unwrap();
    let good = config(&window(3, "30s"), "");
    let mut cm = ConfigMapDir::new(dir.path(), "sluice.toml", &good);
    let proxy = Proxy::from_file(&cm.path("sluice.toml")).await;
    let gauge = |proxy: &Proxy| {
        let proxy = proxy.admin;
        async move {
            let m = reqwest::get(format!("http://{proxy}/metrics"))
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
            metric(&m, "sluice_config_last_reload_successful")
        }
    };
    cm.update("sluice.toml", "[proxy\n");
    assert!(
        eventually(Duration::from_secs(5), || async {
            reloads(&proxy, "failure").await == 1.0
        })
        .await
    );
    assert_eq!(gauge(&proxy).await, Some(0.0));
    cm.update("sluice.toml", &good);
    assert!(
        eventually(Duration::from_secs(5), || async {
            gauge(&proxy).await == Some(1.0)
        })
        .await,
        "the live config is back on disk"
    );
    assert_eq!(live_permits(&proxy).await, 3);
    assert_eq!(reloads(&proxy, "failure").await, 1.0);
}

#[tokio::test]
async fn rename_over_and_delete_and_recreate_are_picked_up_and_other_files_ignored() {
    let (dir, path, proxy) = proxy_on_file(&config(&window(1, "1s"), "")).await;

    rename_over(&path, &config(&window(2, "1s"), ""));
    assert!(permits_become(&proxy, 2, Duration::from_secs(5)).await);

    std::fs::remove_file(&path).unwrap();
    tokio::time::sleep(Duration::from_millis(30)).await;
    std::fs::write(&path, config(&window(3, "1s"), "")).unwrap();
    assert!(permits_become(&proxy, 3, Duration::from_secs(5)).await);
    assert_eq!(reloads(&proxy, "success").await, 2.0);

    // An editor's swap file coming and going beside it changes nothing.
    let swap = dir.path().join(".sluice.toml.swp");
    std::fs::write(&swap, "junk").unwrap();
    std::fs::remove_file(&swap).unwrap();
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(reloads(&proxy, "success").await, 2.0);
    assert_eq!(reloads(&proxy, "failure").await, 0.0);
}

#[tokio::test]
async fn a_symlinked_config_edited_where_it_lives_is_picked_up() {
    let real = tempfile::tempdir().unwrap();
    let linked = tempfile::tempdir().unwrap();
    let target = real.path().join("sluice.toml");
    std::fs::write(&target, config(&window(1, "1s"), "")).unwrap();
    let path = linked.path().join("sluice.toml");
    std::os::unix::fs::symlink(&target, &path).unwrap();
    let proxy = Proxy::from_file(&path).await;
    // After the watcher's first look at the file (one debounce after start).
    tokio::time::sleep(sluice::RELOAD_DEBOUNCE * 3).await;
    // Written in place, in the other directory: nothing happens beside the symlink.
    std::fs::write(&target, config(&window(9, "1s"), "")).unwrap();
    assert!(
        permits_become(&proxy, 9, Duration::from_secs(5)).await,
        "the edit to the symlink's target was seen"
    );
}

/// A config rewritten in place by a writer that pauses mid-file is read when the writer
/// closes it, not when its first half has been quiet for the debounce, nor MAX_DELAY after
/// its first change; one written whole and left open is read after WRITER_GONE.
#[tokio::test]
async fn a_file_written_in_place_is_read_when_its_writer_closes_it() {
    use sluice::{
        RELOAD_DEBOUNCE as DEBOUNCE, RELOAD_MAX_DELAY as MAX_DELAY,
        RELOAD_WRITER_GONE as WRITER_GONE,
    };
    use std::io::Write;
    let (_dir, path, proxy) = proxy_on_file(&config(&window(2, "1s"), "")).await;
    // After the watcher's first look at the file (one debounce after start).
    tokio::time::sleep(DEBOUNCE * 3).await;

    let text = config(&window(5, "1s"), "");
    // Cut inside the limit: the first part alone is not a valid config.
    let (head, tail) = text.split_at(text.find("permits").unwrap());
    let mut file = std::fs::File::create(&path).unwrap();
    file.write_all(head.as_bytes()).unwrap();
    tokio::time::sleep(MAX_DELAY + Duration::from_secs(1)).await;
    assert_eq!(
        reloads(&proxy, "failure").await,
        0.0,
        "the first part was read"
    );
    assert_eq!(reloads(&proxy, "success").await, 0.0);
    file.write_all(tail.as_bytes()).unwrap();
    drop(file);
    assert!(
        eventually(Duration::from_secs(5), || async {
            reloads(&proxy, "success").await == 1.0
        })
        .await,
        "the closed file was read"
    );
    assert_eq!(live_permits(&proxy).await, 5);
    assert_eq!(reloads(&proxy, "failure").await, 0.0);

    let mut file = std::fs::File::create(&path).unwrap();
    file.write_all(config(&window(7, "1s"), "").as_bytes())
        .unwrap();
    let written = Instant::now();
    assert!(
        permits_become(&proxy, 7, WRITER_GONE + Duration::from_secs(5)).await,
        "a file left open is read once its writer has been quiet for WRITER_GONE"
    );
    // The wait starts at the write's event, which may be seen just before `written`.
    assert!(written.elapsed() > WRITER_GONE - Duration::from_millis(500));
    assert_eq!(reloads(&proxy, "failure").await, 0.0);
    drop(file);
}

/// 200 requests queued on 20/s; raised to 100/s at 1.2 s, lowered to 20/s at 1.7 s. None
/// is lost, the raise lets a crowd through at once, the lower holds the rest back
/// counting what the raised limit let through.
#[tokio::test]
async fn limits_raised_and_lowered_with_200_queued_lose_nothing() {
    let up = Upstream::start().await;
    let (_dir, path, proxy) = proxy_on_file(&config(&window(20, "1s"), "")).await;
    let client = proxy.client();

    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..200 {
        let (c, url) = (client.clone(), up.url(&format!("/q?n={i}")));
        tasks.push(tokio::spawn(async move {
            let resp = c.get(url).send().await.expect("a response");
            (resp.status().as_u16(), resp.text().await.expect("a body"))
        }));
    }
    tokio::time::sleep_until(t0 + Duration::from_millis(1200)).await;
    std::fs::write(&path, config(&window(100, "1s"), "")).unwrap();
    assert_eq!(proxy.admin_post("/reload").await.0, 200);
    tokio::time::sleep_until(t0 + Duration::from_millis(1700)).await;
    std::fs::write(&path, config(&window(20, "1s"), "")).unwrap();
    assert_eq!(proxy.admin_post("/reload").await.0, 200);

    for t in tasks {
        assert_eq!(t.await.unwrap(), (200, "hello".to_string()));
    }
    let seen: Vec<Duration> = up.seen().iter().map(|s| s.at - t0).collect();
    assert_eq!(seen.len(), 200, "each request reached the upstream once");
    let by = |t: u64| {
        seen.iter()
            .filter(|s| **s < Duration::from_millis(t))
            .count()
    };
    // 20 + 20 + 80 at the raise: 120 by 2.1 s; at 20/s it would be 60.
    assert!(by(2100) >= 100, "the raise let more through: {}", by(2100));
    // Lowered to 20/s with 100 in the window: nothing until 2.2 s, then 20 a second, so
    // 60 remain after 2.6 s. Had the raised limit stayed, all would be through by 2.2 s.
    assert!(
        200 - by(2600) >= 40,
        "the lower held requests back: {} after 2.6 s",
        200 - by(2600)
    );
}

#[tokio::test]
async fn a_hundred_reloads_under_load_fail_no_request() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sluice.toml");
    let family = "[[upstream.family]]\nname = \"orders\"\npaths = [\"/orders/**\"]\n\
                  limits = [{ kind = \"concurrency\", max = 4 }]\n";
    let variant = |i: u32| {
        let limits = format!(
            "{{ kind = \"token_bucket\", rate = {}, per = \"1s\", burst = 50 }}, {{ kind = \"concurrency\", max = {} }}",
            1000 + 1000 * (i % 2),
            8 + 8 * (i % 3)
        );
        config(&limits, if i.is_multiple_of(2) { family } else { "" })
    };
    std::fs::write(&path, variant(0)).unwrap();
    let proxy = Proxy::from_file(&path).await;
    let client = proxy.client();
    let stop = Arc::new(AtomicBool::new(false));
    let mut load = Vec::new();
    for w in 0..8 {
        let (c, stop) = (client.clone(), stop.clone());
        let url = up.url(if w % 2 == 0 { "/orders/1" } else { "/catalog" });
        load.push(tokio::spawn(async move {
            let mut statuses = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let r = c.get(&url).send().await;
                statuses.push(r.map(|r| r.status().as_u16()).unwrap_or(0));
            }
            statuses
        }));
    }
    for i in 1..=100 {
        // Replaced as editors and the kubelet do: written in place, the watcher could read
        // it half-written, an empty file being a valid config with no upstreams.
        rename_over(&path, &variant(i));
        let (status, body) = proxy.admin_post("/reload").await;
        assert_eq!(status, 200, "reload {i}: {body}");
    }
    stop.store(true, Ordering::Relaxed);
    let mut total = 0;
    for l in load {
        let statuses = l.await.unwrap();
        assert!(
            statuses.iter().all(|s| *s == 200),
            "every request succeeded: {:?}",
            statuses.iter().filter(|s| **s != 200).collect::<Vec<_>>()
        );
        total += statuses.len();
    }
    assert!(total >= 100, "load ran through the reloads ({total})");
    assert!(reloads(&proxy, "success").await >= 100.0);
    assert_eq!(reloads(&proxy, "failure").await, 0.0);
}

/// The binary under live traffic: a ConfigMap-style swap shows its new rate within 2 s,
/// SIGHUP reloads, an invalid swap changes nothing but the failure counter, and SIGTERM
/// with a full queue ends with every client holding a complete response.
#[tokio::test]
async fn the_binary_reloads_under_traffic_and_shuts_down_with_a_full_queue() {
    crypto();
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let text = |limits: &str| config(limits, "");
    let mut cm = ConfigMapDir::new(dir.path(), "sluice.toml", &text(&window(2, "1s")));
    let mut sluice = Sluice::spawn(&["run", "-c", cm.path("sluice.toml").to_str().unwrap()]);
    let (port, admin) = sluice.listening().await;
    assert!(sluice.ready(admin).await);
    let admin_url = format!("http://127.0.0.1:{admin}");
    let get = |path: &str| {
        let url = format!("{admin_url}{path}");
        async move {
            match reqwest::get(url).await {
                Ok(r) => r.text().await.unwrap_or_default(),
                Err(_) => String::new(),
            }
        }
    };
    let count = |m: &str, result: &str| {
        metric(
            m,
            &format!("sluice_config_reloads_total{{result=\"{result}\"}}"),
        )
    };

    let client = reqwest::Client::builder()
        .proxy(reqwest::Proxy::all(format!("http://127.0.0.1:{port}")).unwrap())
        .build()
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let mut load = Vec::new();
    for _ in 0..16 {
        let (c, stop, url) = (client.clone(), stop.clone(), up.url("/live"));
        load.push(tokio::spawn(async move {
            let mut statuses = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                match c.get(&url).send().await {
                    Ok(r) => statuses.push(r.status().as_u16()),
                    Err(e) => panic!("request failed: {e}"),
                }
            }
            statuses
        }));
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let swapped = Instant::now();
    cm.update("sluice.toml", &text(&window(40, "1s")));
    // The new rate within 2 s: count what reaches the upstream from 1 s to 2 s after.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let before = up.seen().len();
    tokio::time::sleep_until(swapped + Duration::from_millis(2000)).await;
    let in_second = up.seen().len() - before;
    assert!(
        in_second >= 25,
        "{in_second} requests in the second second after the swap (old rate 2/s, new 40/s)"
    );
    assert_eq!(count(&get("/metrics").await, "success"), Some(1.0));

    // SIGHUP with the file as it is: a reload, counted, nothing changed.
    sluice.signal("HUP");
    assert!(
        eventually(Duration::from_secs(5), || async {
            count(&get("/metrics").await, "success") == Some(2.0)
        })
        .await,
        "SIGHUP reloaded"
    );

    // An invalid swap: the failure counter moves, the rate does not.
    cm.update("sluice.toml", &text("{ kind = \"sliding_window\" }"));
    assert!(
        eventually(Duration::from_secs(5), || async {
            count(&get("/metrics").await, "failure") == Some(1.0)
        })
        .await,
        "the invalid file was refused"
    );
    let before = up.seen().len();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let in_second = up.seen().len() - before;
    assert!(in_second >= 25, "still the new rate: {in_second}");

    // A full queue (1/s for 16 clients) and SIGTERM: everyone gets a whole answer.
    cm.update("sluice.toml", &text(&window(1, "1s")));
    assert!(
        eventually(Duration::from_secs(5), || async {
            count(&get("/metrics").await, "success") == Some(3.0)
        })
        .await
    );
    stop.store(true, Ordering::Relaxed);
    tokio::time::sleep(Duration::from_millis(300)).await;
    sluice.signal("TERM");
    let mut statuses = Vec::new();
    for l in load {
        statuses.extend(l.await.unwrap());
    }
    assert!(
        statuses.iter().all(|s| *s == 200 || *s == 503),
        "only whole answers: {statuses:?}"
    );
    let (code, log) = sluice.exit().await;
    assert_eq!(code, Some(0));
    let log = log.join("\n");
    assert!(log.contains("SIGHUP received"), "{log}");
    assert!(log.contains("config reload failed"), "{log}");
    assert!(
        !log.contains('\x1b'),
        "colour codes in a log read through a pipe: {log}"
    );
}

/// Another file in the config's directory that never stops changing (a log, a lock
/// file) does not hold a reload back, and a config file that keeps changing is still
/// read within MAX_DELAY of its first change.
#[tokio::test]
async fn busy_neighbours_and_a_restless_file_never_starve_a_reload() {
    let (dir, path, proxy) = proxy_on_file(&config(&window(2, "1s"), "")).await;
    let churn = Arc::new(AtomicBool::new(true));
    let neighbour = {
        let (churn, file) = (churn.clone(), dir.path().join("app.log"));
        tokio::spawn(async move {
            let mut n = 0u64;
            while churn.load(Ordering::Relaxed) {
                n += 1;
                std::fs::write(&file, n.to_string()).unwrap();
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    rename_over(&path, &config(&window(3, "1s"), ""));
    let changed = permits_become(&proxy, 3, Duration::from_secs(5)).await;
    assert!(changed, "the neighbour's writes held the reload back");

    // The config file itself rewritten every 100 ms, for longer than MAX_DELAY.
    let started = Instant::now();
    let restless = {
        let path = path.clone();
        tokio::spawn(async move {
            for i in 0..40u32 {
                rename_over(&path, &config(&window(10 + i, "1s"), ""));
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    let read = eventually(Duration::from_secs(4), || async {
        live_permits(&proxy).await >= 10
    })
    .await;
    assert!(read, "no reload while the file kept changing");
    assert!(started.elapsed() < Duration::from_secs(4));
    restless.await.unwrap();
    churn.store(false, Ordering::Relaxed);
    neighbour.await.unwrap();
    let last = permits_become(&proxy, 49, Duration::from_secs(5)).await;
    assert!(last, "the last version is read once the file settles");
}

/// RUST_LOG=trace with the log written into the config's directory: the watcher must not
/// feed on its own log lines (it did, at 100% CPU).
#[tokio::test]
async fn trace_logging_into_the_config_directory_is_quiet() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sluice.toml");
    std::fs::write(&path, config(&window(2, "1s"), "")).unwrap();
    let log = dir.path().join("sluice.log");
    let mut sh = std::process::Command::new("sh");
    sh.arg("-c")
        .arg(format!(
            "RUST_LOG=trace exec \"$0\" \"$@\" 2>>{}",
            log.display()
        ))
        .arg(env!("CARGO_BIN_EXE_sluice"));
    let sluice = Sluice::spawn_shell(sh, &["run", "-c", path.to_str().unwrap()]);
    // Its stderr goes to the file: the "listening" line is read from there.
    let mut admin = 0;
    assert!(
        eventually(Duration::from_secs(30), || {
            let found = std::fs::read_to_string(&log)
                .unwrap_or_default()
                .lines()
                .find_map(listening_ports);
            if let Some((_, a)) = found {
                admin = a;
            }
            async move { found.is_some() }
        })
        .await,
        "sluice wrote its \"listening\" line"
    );
    assert!(sluice.ready(admin).await);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let cpu = |pid: u32| -> u64 {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        let fields: Vec<&str> = stat
            .rsplit_once(')')
            .unwrap()
            .1
            .split_whitespace()
            .collect();
        fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
    };
    let (before, lines_before) = (
        cpu(sluice.pid()),
        std::fs::read_to_string(&log).unwrap().lines().count(),
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (after, lines_after) = (
        cpu(sluice.pid()),
        std::fs::read_to_string(&log).unwrap().lines().count(),
    );
    // Idle, it should use next to nothing: the loop used all of it (200 ticks in 2 s).
    assert!(
        after - before < 50,
        "{} ticks of CPU in 2 s idle",
        after - before
    );
    assert!(
        lines_after - lines_before < 100,
        "{} log lines in 2 s idle",
        lines_after - lines_before
    );
    // And a change is still seen.
    std::fs::write(&path, config(&window(7, "1s"), "")).unwrap();
    let seen = eventually(Duration::from_secs(5), || async {
        let c = reqwest::get(format!("http://127.0.0.1:{admin}/config")).await;
        match c {
            Ok(r) => {
                let v: serde_json::Value =
                    serde_json::from_str(&r.text().await.unwrap_or_default()).unwrap_or_default();
                v["upstreams"][0]["limits"][0]["permits"] == 7
            }
            Err(_) => false,
        }
    })
    .await;
    assert!(seen);
    sluice.signal("TERM");
    let _ = sluice.exit().await;
}
