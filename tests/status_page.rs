//! The status page on the admin listener: its JSON feed's shape, and the page itself
//! rendered by a real headless Chromium (Debian's `chromium`, which `scripts/test`
//! installs) while a burst queues behind a limit and a breaker is open. What the page
//! shows must match `/metrics`.

use sluice_test_support as support;

use std::process::Command;
use std::time::Duration;

use support::*;

/// A proxy with `api` (one request at a time, the holder answering in 20 s) and `down`
/// (a closed port, a breaker that opens after two failures), three requests queued on
/// `api` and `down`'s breaker open. Returns what must be dropped last.
async fn busy() -> (Proxy, Upstream, Vec<tokio::task::JoinHandle<()>>) {
    let up = Upstream::start().await;
    let closed = closed_port().await;
    let proxy = Proxy::start(&format!(
        "[[upstream]]\nname = \"api\"\nhosts = [\"127.0.0.1:{}\"]\n\
         limits = [{{ kind = \"concurrency\", max = 1 }}]\n\
         [[upstream]]\nname = \"down\"\nhosts = [\"127.0.0.1:{}\"]\n\
         retry = {{ max_attempts = 1 }}\n\
         breaker = {{ min_requests = 2, failure_ratio = 0.5, window = \"30s\", open_for = \"5m\" }}\n",
        up.addr.port(),
        closed.port()
    ))
    .await;
    let client = proxy.client();
    let mut held = Vec::new();
    for (i, path) in ["/slow/20000", "/a", "/b", "/c"].into_iter().enumerate() {
        let (client, url) = (client.clone(), up.url(path));
        held.push(tokio::spawn(async move {
            let _ = client.get(url).send().await;
        }));
        if i == 0 {
            // The holder takes the only permit before the others queue behind it.
            assert!(eventually(Duration::from_secs(5), || async { up.seen().len() == 1 }).await);
        }
    }
    for _ in 0..3 {
        let _ = client.get(format!("http://{closed}/")).send().await;
    }
    assert!(
        eventually(Duration::from_secs(5), || async {
            let m = proxy.metrics().await;
            metric(&m, r#"sluice_queue_depth{family="-",upstream="api"}"#) == Some(3.0)
                && metric(&m, r#"sluice_breaker_state{state="open",upstream="down"}"#) == Some(1.0)
        })
        .await,
        "{}",
        proxy.metrics().await
    );
    // Real time, not paused: the waiters must be seconds old and the history (sampled
    // once a second) must have seen them.
    tokio::time::sleep(Duration::from_millis(2200)).await;
    (proxy, up, held)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_feed_says_which_bucket_waits_and_why() {
    let (proxy, _up, held) = busy().await;
    let (status, text) = proxy.admin_get("/status.json").await;
    assert_eq!(status, 200);
    let s: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(s["version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(s["config"]["sha256"].as_str().unwrap().len(), 64);
    assert!(s["uptime_seconds"].as_u64().is_some());
    let upstream = |name: &str| {
        s["upstreams"]
            .as_array()
            .unwrap()
            .iter()
            .find(|u| u["name"] == name)
            .unwrap()
            .clone()
    };
    let api = upstream("api");
    assert_eq!(api["breaker"], "closed");
    assert_eq!(api["limits"][0], "concurrency 1 in flight");
    let none = &api["families"][0];
    assert_eq!(none["family"], "-");
    assert_eq!(none["queue_depth"], 3, "{text}");
    let depths = none["history"]["queue_depth"].as_array().unwrap();
    assert_eq!(depths.last(), Some(&serde_json::json!(3)), "{text}");
    // The busiest partition, with its waiters' age.
    let p = &api["partitions"][0];
    let family = p
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["family"] == "-")
        .unwrap();
    assert_eq!(family["queue_depth"], 3);
    assert!(
        family["oldest_wait_seconds"].as_f64().unwrap() >= 2.0,
        "{text}"
    );
    assert_eq!(api["other_partitions"], 0);
    assert_eq!(upstream("down")["breaker"], "open");
    // Bounded: a proxy this small says all of it in a few kilobytes.
    assert!(text.len() < 16 * 1024, "{} bytes", text.len());
    for h in held {
        h.abort();
    }
}

#[tokio::test]
async fn the_page_is_self_contained() {
    let proxy = Proxy::start("").await;
    let resp = reqwest::get(format!("http://{}/", proxy.admin))
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert!(
        resp.headers()["content-security-policy"]
            .to_str()
            .unwrap()
            .contains("default-src 'none'")
    );
    let page = resp.text().await.unwrap();
    assert!(page.contains("status.json"));
    // No scripts, styles, fonts or images from anywhere else.
    for outside in ["src=\"http", "href=\"http", "@import", "url(http", "//cdn"] {
        assert!(!page.contains(outside), "{outside}");
    }
}

/// Runs headless Chromium on `url`: the DOM after its scripts ran, and a screenshot at
/// `shot` when given.
fn chromium(url: &str, shot: Option<&std::path::Path>) -> String {
    let mut cmd = Command::new("chromium");
    cmd.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--virtual-time-budget=3000",
    ]);
    let profile = tempfile::tempdir().unwrap();
    cmd.arg(format!("--user-data-dir={}", profile.path().display()));
    match shot {
        Some(path) => cmd.args([
            format!("--screenshot={}", path.display()),
            "--window-size=1280,900".into(),
        ]),
        None => cmd.args(["--dump-dom".to_string()]),
    };
    let out = cmd.arg(url).output().unwrap_or_else(|e| {
        panic!("cannot run chromium ({e}); scripts/test installs it (apt-get install chromium)")
    });
    assert!(
        out.status.success(),
        "chromium failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The first run of text inside the element carrying `data-upstream=u` (and
/// `data-family=f`) and `data-field=field` in `dom`, tags skipped.
fn shown(dom: &str, u: &str, f: Option<&str>, field: &str) -> Option<String> {
    let family = f.map_or(String::new(), |f| format!(" data-family=\"{f}\""));
    let marker = format!("data-upstream=\"{u}\"{family} data-field=\"{field}\">");
    let rest = &dom[dom.find(&marker)? + marker.len()..];
    let mut text = String::new();
    let mut in_tag = false;
    for c in rest.chars() {
        match c {
            '<' if !text.trim().is_empty() => break,
            '<' => in_tag = true,
            '>' if in_tag => in_tag = false,
            c if !in_tag => text.push(c),
            _ => {}
        }
    }
    Some(text.trim().to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chromium_renders_what_metrics_says() {
    let (proxy, _up, held) = busy().await;
    let url = format!("http://{}/", proxy.admin);
    let dom = tokio::task::spawn_blocking({
        let url = url.clone();
        move || chromium(&url, None)
    })
    .await
    .unwrap();
    let m = proxy.metrics().await;
    let depth = metric(&m, r#"sluice_queue_depth{family="-",upstream="api"}"#).unwrap();
    let on_page = shown(&dom, "api", Some("-"), "queue_depth").expect("queue depth shown");
    assert_eq!(on_page.trim().parse::<f64>().ok(), Some(depth), "{dom}");
    assert_eq!(depth, 3.0);
    for (name, state) in [("api", "closed"), ("down", "open")] {
        let series = format!(r#"sluice_breaker_state{{state="{state}",upstream="{name}"}}"#);
        assert_eq!(metric(&m, &series), Some(1.0), "{m}");
        let on_page = shown(&dom, name, None, "breaker").expect("breaker shown");
        assert_eq!(on_page.trim(), state, "{dom}");
    }
    // The picture in docs/operations.md: SLUICE_SCREENSHOT=docs/status.png cargo test --test
    // status_page chromium
    if let Ok(path) = std::env::var("SLUICE_SCREENSHOT") {
        let path = std::path::PathBuf::from(path);
        let path = if path.is_absolute() {
            path
        } else {
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
        };
        tokio::task::spawn_blocking(move || chromium(&url, Some(&path)))
            .await
            .unwrap();
    }
    for h in held {
        h.abort();
    }
}
