//! Real clients through sluice in its three modes: forward proxy (http:// and ws://),
//! interception (https:// and wss:// with `tls = "intercept"`) and blind tunnels. The
//! clients are the libraries users have, run as themselves: Python's requests, httpx
//! (HTTP/1.1 and HTTP/2), urllib, aiohttp and websockets (`interop/python_clients.py`).
//! curl's cases are in tests/tls.rs and tests/proxy.rs. `scripts/test` installs the
//! Python packages; where one is missing the test says so and stops without failing,
//! so that `cargo test` alone runs on a machine without them.

mod support;

use std::net::SocketAddr;
use std::process::Command;

use support::*;

/// Everything a client suite runs against: the upstreams, sluice, and the plan file that
/// tells the suite where they are.
struct World {
    _dir: tempfile::TempDir,
    _upstreams: Vec<Upstream>,
    _proxy: Proxy,
    plan: std::path::PathBuf,
    /// sluice's CA and the upstreams', for clients that trust a bundle file.
    bundle: std::path::PathBuf,
}

async fn world() -> World {
    crypto();
    let dir = tempfile::tempdir().unwrap();
    let certs = certs::for_localhost(dir.path(), &[b"h2", b"http/1.1"]);
    let plain = Upstream::start().await;
    let intercepted = Upstream::start_tls(certs.server.clone()).await;
    let tunnelled = Upstream::start_tls(certs.server.clone()).await;
    let ws = ws_echo(None).await;
    let wss_intercepted = ws_echo(Some(certs.server.clone())).await;
    let wss_tunnelled = ws_echo(Some(certs.server.clone())).await;
    let (ca_cert, ca_key) = sluice::tls::ca::write_new_ca(&dir.path().join("ca")).unwrap();
    let up_ca = certs.ca_path.display().to_string();
    let upstream = |name: &str, addr: SocketAddr, mode: &str| {
        format!(
            "[[upstream]]\nname = \"{name}\"\nhosts = [\"127.0.0.1:{0}\", \"localhost:{0}\"]\n\
             tls = \"{mode}\"\n\
             upstream_ca = {up_ca:?}\n\
             retry = {{ backoff = {{ base = \"50ms\", max = \"200ms\" }} }}\n",
            addr.port(),
        )
    };
    let config = format!(
        "[tls]\nca_cert = {ca_cert:?}\nca_key = {ca_key:?}\n{}{}{}{}{}{}",
        upstream("plain", plain.addr, "tunnel"),
        upstream("intercepted", intercepted.addr, "intercept"),
        upstream("tunnelled", tunnelled.addr, "tunnel"),
        upstream("ws", ws, "tunnel"),
        upstream("wss_intercepted", wss_intercepted, "intercept"),
        upstream("wss_tunnelled", wss_tunnelled, "tunnel"),
    );
    let proxy = Proxy::start(&config).await;
    let plan = serde_json::json!({
        "proxy": proxy.url(),
        "sluice_ca": ca_cert,
        "upstream_ca": certs.ca_path,
        "denied_url": "http://169.254.169.254/latest/meta-data/",
        "modes": {
            "forward": {
                "base": format!("http://{}", plain.addr),
                "base_named": format!("http://localhost:{}", plain.addr.port()),
                "ws": format!("ws://{ws}/"),
                "ws_named": format!("ws://localhost:{}/", ws.port()),
            },
            "intercept": {
                "base": format!("https://{}", intercepted.addr),
                "base_named": format!("https://localhost:{}", intercepted.addr.port()),
                "ws": format!("wss://{wss_intercepted}/"),
                "ws_named": format!("wss://localhost:{}/", wss_intercepted.port()),
            },
            "tunnel": {
                "base": format!("https://{}", tunnelled.addr),
                "base_named": format!("https://localhost:{}", tunnelled.addr.port()),
                "ws": format!("wss://{wss_tunnelled}/"),
                "ws_named": format!("wss://localhost:{}/", wss_tunnelled.port()),
            },
        },
    });
    let plan_path = dir.path().join("plan.json");
    std::fs::write(&plan_path, plan.to_string()).unwrap();
    let bundle = dir.path().join("bundle.pem");
    let pems = [
        std::fs::read_to_string(&ca_cert).unwrap(),
        std::fs::read_to_string(&certs.ca_path).unwrap(),
    ];
    std::fs::write(&bundle, pems.join("\n")).unwrap();
    World {
        _dir: dir,
        _upstreams: vec![plain, intercepted, tunnelled],
        _proxy: proxy,
        plan: plan_path,
        bundle,
    }
}

/// Runs a client suite (`program` and its arguments, then the plan) and asserts every
/// check it reports, and that each of `clients` ran in every mode.
async fn suite(
    world: &World,
    program: &str,
    args: &[&str],
    env: &[(&str, &std::path::Path)],
    clients: &[&str],
) {
    let mut cmd = Command::new(program);
    cmd.args(args).arg(&world.plan);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = tokio::task::spawn_blocking(move || cmd.output().unwrap())
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the client suite broke: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    let results: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let failed: Vec<String> = results
        .iter()
        .filter(|r| r["ok"] != true)
        .map(|r| {
            format!(
                "{} / {} / {}: {}",
                r["client"], r["mode"], r["check"], r["detail"]
            )
        })
        .collect();
    eprintln!("{} checks, {} failed", results.len(), failed.len());
    assert!(failed.is_empty(), "{}", failed.join("\n"));
    for client in clients {
        for mode in ["forward", "intercept", "tunnel"] {
            assert!(
                results
                    .iter()
                    .any(|r| r["client"] == *client && r["mode"] == mode),
                "{client} in {mode} mode"
            );
        }
    }
}

fn present(program: &str, args: &[&str]) -> bool {
    Command::new(program)
        .args(args)
        .status()
        .is_ok_and(|s| s.success())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_clients_in_every_mode() {
    if !present(
        "python3",
        &["-c", "import requests, httpx, h2, aiohttp, websockets"],
    ) {
        eprintln!(
            "SKIPPED: the Python clients (requests, httpx[http2], aiohttp, websockets) are not \
             installed; scripts/test installs them"
        );
        return;
    }
    let world = world().await;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/interop/python_clients.py");
    suite(
        &world,
        "python3",
        &[script],
        &[],
        &["requests", "httpx", "urllib", "aiohttp", "websockets"],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_clients_in_every_mode() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/interop/node");
    if !std::path::Path::new(dir)
        .join("node_modules/undici")
        .exists()
    {
        eprintln!(
            "SKIPPED: interop/node has no node_modules (undici, axios, ws); scripts/test runs \
             `npm ci` there when Node.js is installed"
        );
        return;
    }
    let world = world().await;
    let script = format!("{dir}/clients.mjs");
    // As docs/https.md tells Node users to trust sluice's CA.
    let env = [("NODE_EXTRA_CA_CERTS", world.bundle.as_path())];
    suite(&world, "node", &[&script], &env, &["undici", "axios", "ws"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn java_http_client_in_every_mode() {
    if !present("javac", &["-version"]) {
        eprintln!("SKIPPED: no JDK (javac) on this machine; Java's HttpClient was not run");
        return;
    }
    let world = world().await;
    let classes = world._dir.path().join("classes");
    let source = concat!(env!("CARGO_MANIFEST_DIR"), "/interop/java/Clients.java");
    let compiled = Command::new("javac")
        .arg("-d")
        .arg(&classes)
        .arg(source)
        .output()
        .unwrap();
    assert!(
        compiled.status.success(),
        "{}",
        String::from_utf8_lossy(&compiled.stderr)
    );
    let cp = classes.display().to_string();
    let env = [("SLUICE_INTEROP_BUNDLE", world.bundle.as_path())];
    suite(
        &world,
        "java",
        &["-cp", &cp, "Clients"],
        &env,
        &["java HttpClient"],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn go_net_http_in_every_mode() {
    if !present("go", &["version"]) {
        eprintln!(
            "SKIPPED: no Go toolchain on this machine, and scripts/test does not install one \
             (Debian's golang-go takes 335 MB); Go's net/http was not run"
        );
        return;
    }
    let world = world().await;
    let source = concat!(env!("CARGO_MANIFEST_DIR"), "/interop/go/clients.go");
    let env = [("SLUICE_INTEROP_BUNDLE", world.bundle.as_path())];
    suite(&world, "go", &["run", source], &env, &["go net/http"]).await;
}
