//! Real clients through sluice in its three modes: forward proxy (http:// and ws://),
//! interception (https:// and wss:// with `tls = "intercept"`) and blind tunnels. The
//! clients are the libraries users have, run as themselves: Python's requests, httpx
//! (HTTP/1.1 and HTTP/2), urllib, aiohttp and websockets (`interop/python_clients.py`).
//! curl's cases are in tests/tls.rs and tests/proxy.rs. `scripts/test` installs the
//! Python packages; where one is missing the test says so and stops without failing,
//! so that `cargo test` alone runs on a machine without them.

use sluice_test_support as support;

use std::net::SocketAddr;
use std::process::Command;

use support::*;

/// Everything a client suite runs against: the upstreams, sluice, and the plan file that
/// tells the suite where they are.
struct World {
    _dir: tempfile::TempDir,
    _upstreams: Vec<Upstream>,
    proxy: Proxy,
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
    let (ca_cert, ca_key) = sluice::write_new_ca(&dir.path().join("ca")).unwrap();
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
        proxy,
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
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_clients_in_every_mode() {
    if !present(
        "python3",
        &[
            "-c",
            "import requests, httpx, h2, aiohttp, websockets, websocket",
        ],
    ) {
        eprintln!(
            "SKIPPED: the Python clients (requests, httpx[http2], aiohttp, websockets, \
             websocket-client) are not installed; scripts/test installs them"
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
        &[
            "requests",
            "httpx",
            "urllib",
            "aiohttp",
            "websockets",
            "websocket-client",
        ],
    )
    .await;
    // Every ws:// handshake went through sluice, websocket-client's through CONNECT:
    // aiohttp, websockets and websocket-client, each once.
    let m = world.proxy.metrics().await;
    assert_eq!(
        metric(
            &m,
            r#"sluice_upgrades_total{result="switched",upstream="ws"}"#
        ),
        Some(3.0),
        "{m}"
    );
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

/// The NO_PROXY the shipped manifests give the application (deploy/proxy-env, as
/// rendered in deploy/example/rendered.yaml), with the kubelet's `$(VAR)` expansion of
/// the API server's address.
fn shipped_no_proxy(api_server: &str) -> String {
    let rendered = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/deploy/example/rendered.yaml"
    ))
    .unwrap();
    let value_of = |name: &str| {
        let mut lines = rendered.lines();
        lines.find(|l| l.trim() == format!("- name: {name}"));
        let value = lines.next().unwrap().trim();
        value.strip_prefix("value: ").unwrap().to_string()
    };
    let upper = value_of("NO_PROXY");
    assert_eq!(upper, value_of("no_proxy"), "both spellings alike");
    upper.replace("$(KUBERNETES_SERVICE_HOST)", api_server)
}

/// Which hosts each client sends past sluice with the shipped NO_PROXY: the cloud
/// metadata and credential endpoints, the API server and namespace-qualified service
/// names go direct for every client; bare service names cannot be matched by any
/// client (docs/kubernetes.md says to list them); the pod and service ranges go direct
/// only for the clients that read CIDRs. Each client decides with its own code
/// (`interop/no_proxy.py`), sluice's access log confirms what reached it, and nothing
/// leaves loopback.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shipped_no_proxy_sends_infrastructure_direct() {
    if !present("python3", &["-c", "import requests, httpx, aiohttp"])
        || !present("wget", &["--version"])
    {
        eprintln!(
            "SKIPPED: wget or the Python clients (requests, httpx, aiohttp) are not \
             installed; scripts/test installs them"
        );
        return;
    }
    crypto();
    const CLIENTS: [&str; 9] = [
        "curl", "wget", "urllib", "requests", "httpx", "aiohttp", "go", "axios", "undici",
    ];
    // P: through sluice, D: direct, 4: sluice answered 400 (httpx 0.28 writes an IPv6
    // literal without its brackets in the request line). Columns: CLIENTS, then Go's
    // net/http, axios and undici where Go and the Node modules are installed, then Java's
    // default ProxySelector with the docs' JAVA_TOOL_OPTIONS where a JDK is.
    let expected: &[(&str, &str)] = &[
        ("api.example.com", "PPPPPPPPPP"),
        ("169.254.169.254", "DDDDDDDDDD"),
        ("169.254.170.2", "DDDDDDDDDD"),
        ("169.254.170.23", "DDDDDDDDDD"),
        ("[fd00:ec2::254]", "DDPDDDDPPD"),
        ("metadata.google.internal", "DDDDDDDDDD"),
        ("metadata", "DDDDDDDDDD"),
        ("168.63.129.16", "DDDDDDDDDD"),
        ("10.96.0.1", "DDDDDDDDDD"),
        ("kubernetes", "DDDDDDDDDD"),
        ("kubernetes.default", "DDDDDDDDDD"),
        ("kubernetes.default.svc", "DDDDDDDDDD"),
        ("billing.shop.svc", "DDDDDDDDDD"),
        ("billing.shop.svc.cluster.local", "DDDDDDDDDD"),
        ("billing", "PPPPPPPPPP"),
        ("billing.shop", "PPPPPPPPPP"),
        ("10.244.1.7", "DPPDPPDPPD"),
        ("172.20.3.4", "DPPDPPDPPD"),
        ("100.64.3.4", "DPPDPPDPPP"),
        ("[fd12::7]", "PPPP4PPPPP"),
    ];
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("sluice.toml");
    // Every host refused with 403, so nothing is forwarded anywhere.
    std::fs::write(&config, "[proxy]\nunmatched = \"deny\"\n").unwrap();
    let mut sluice = Sluice::spawn(&[
        "run",
        "-c",
        config.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
        "--admin",
        "127.0.0.1:0",
        "--log-format",
        "json",
    ]);
    let (proxy, admin) = sluice.listening().await;
    assert!(sluice.ready(admin).await);
    let plan = serde_json::json!({
        "proxy": format!("http://127.0.0.1:{proxy}"),
        "no_proxy": shipped_no_proxy("10.96.0.1"),
        "hosts": expected.iter().map(|(h, _)| *h).collect::<Vec<_>>(),
    });
    let plan_path = dir.path().join("plan.json");
    std::fs::write(&plan_path, plan.to_string()).unwrap();
    let plan_copy = plan_path.clone();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/interop/no_proxy.py");
    let out = tokio::task::spawn_blocking(move || {
        Command::new("python3")
            .arg(script)
            .arg(&plan_path)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let mut stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "interop/no_proxy.py broke: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    let node_dir = concat!(env!("CARGO_MANIFEST_DIR"), "/interop/node");
    let mut absent = Vec::new();
    for (present_, program, args, dir, clients) in [
        (
            present("go", &["version"]),
            "go",
            vec!["run", "no_proxy.go"],
            concat!(env!("CARGO_MANIFEST_DIR"), "/interop/go"),
            &["go"][..],
        ),
        (
            present("node", &["--version"])
                && std::path::Path::new(node_dir)
                    .join("node_modules/undici")
                    .exists(),
            "node",
            vec!["no_proxy.mjs"],
            node_dir,
            &["axios", "undici"][..],
        ),
    ] {
        if !present_ {
            eprintln!(
                "SKIPPED: the {clients:?} columns ({program} or its modules are not installed)"
            );
            absent.extend(clients.iter().map(|c| c.to_string()));
            continue;
        }
        let mut cmd = Command::new(program);
        cmd.args(&args).arg(&plan_copy).current_dir(dir);
        let out = tokio::task::spawn_blocking(move || cmd.output().unwrap())
            .await
            .unwrap();
        assert!(
            out.status.success(),
            "{program} {args:?} broke: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        stdout.push_str(&String::from_utf8_lossy(&out.stdout));
    }
    let got: std::collections::HashMap<(String, String), String> = stdout
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .map(|v| {
            let via = v["via"].as_str().unwrap();
            let code = match via {
                "proxy" => "P".to_string(),
                "direct" => "D".to_string(),
                "error: 400" => "4".to_string(),
                other => other.to_string(),
            };
            let key = (
                v["client"].as_str().unwrap().to_string(),
                v["host"].as_str().unwrap().to_string(),
            );
            (key, code)
        })
        .collect();
    sluice.signal("TERM");
    let (_, lines) = sluice.exit().await;
    let seen: std::collections::HashSet<(String, String)> = lines
        .iter()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["target"] == "sluice::access")
        .filter_map(|v| {
            let client = v["path"].as_str()?.strip_prefix("/probe/")?.to_string();
            Some((client, v["host"].as_str()?.to_string()))
        })
        .collect();
    let mut table = format!("{:32} {}\n", "host", CLIENTS.join(" "));
    let mut wrong = Vec::new();
    for (host, want) in expected {
        table.push_str(&format!("{host:32}"));
        for (client, want) in CLIENTS.iter().zip(want.chars()) {
            if absent.contains(&client.to_string()) {
                table.push_str(&format!(" {:>w$}", "-", w = client.len()));
                continue;
            }
            let key = (client.to_string(), host.to_string());
            let via = got.get(&key).map_or("missing", String::as_str);
            table.push_str(&format!(" {via:>w$}", w = client.len()));
            if via != want.to_string() {
                wrong.push(format!("{client} {host}: {via}, expected {want}"));
            }
            // sluice logs the host without an IPv6 literal's brackets.
            let logged = (
                client.to_string(),
                host.trim_matches(['[', ']']).to_string(),
            );
            if (via == "P") != seen.contains(&logged) {
                wrong.push(format!(
                    "{client} {host}: {via}, but sluice's log disagrees"
                ));
            }
        }
        table.push('\n');
    }
    eprintln!("{table}");
    let hosts: Vec<&str> = expected.iter().map(|(h, _)| *h).collect();
    match java_no_proxy(&hosts).await {
        None => eprintln!("SKIPPED: Java's column (no JDK here)"),
        Some(java) => {
            for ((host, want), got) in expected.iter().zip(java) {
                let want = want.chars().last().unwrap().to_string();
                if got != format!("{host} {want}") {
                    wrong.push(format!("java: {got}, expected {want}"));
                }
            }
        }
    }
    assert!(wrong.is_empty(), "{}\n{table}", wrong.join("\n"));
}

/// Java's verdict for each host ("HOST P" or "HOST D"), with the `JAVA_TOOL_OPTIONS` of
/// docs/kubernetes.md ("Java"), or None without a JDK.
async fn java_no_proxy(hosts: &[&str]) -> Option<Vec<String>> {
    if !present("java", &["-version"]) {
        return None;
    }
    let docs = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/kubernetes.md"))
        .unwrap();
    let options = docs
        .lines()
        .find_map(|l| l.trim().strip_prefix("value: \"-Dhttp.proxyHost"))
        .map(|rest| format!("-Dhttp.proxyHost{}", rest.trim_end_matches('"')))
        .expect("the JAVA_TOOL_OPTIONS block in docs/kubernetes.md");
    let source = concat!(env!("CARGO_MANIFEST_DIR"), "/interop/java/NoProxy.java");
    let mut cmd = Command::new("java");
    cmd.arg(source).args(hosts).env(
        "JAVA_TOOL_OPTIONS",
        options.replace("$(KUBERNETES_SERVICE_HOST)", "10.96.0.1"),
    );
    let out = tokio::task::spawn_blocking(move || cmd.output().unwrap())
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(String::from)
            .collect(),
    )
}

/// nginx as an HTTP/2 upstream (Debian 12's 1.22, over TLS, h2 agreed by ALPN), reached
/// by TLS origination: the request goes with `:authority` and no `host` field, which
/// nginx before 1.25 refuses as a duplicate ("client sent duplicate host header", 400,
/// for every request before the fix). A POST's body and a query pass too.
#[tokio::test]
async fn nginx_as_an_http2_upstream() {
    crypto();
    if !present("nginx", &["-v"]) {
        eprintln!("skipped: no nginx (scripts/test installs it)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let certs = certs::for_localhost(dir.path(), &[]);
    let port = free_port();
    let d = dir.path().display().to_string();
    std::fs::write(
        dir.path().join("nginx.conf"),
        format!(
            "daemon off;\nmaster_process off;\nworker_processes 1;\npid {d}/nginx.pid;\n\
             error_log {d}/error.log;\nevents {{ worker_connections 64; }}\n\
             http {{\n  access_log {d}/access.log;\n  client_body_temp_path {d}/body;\n  \
             server {{\n    listen 127.0.0.1:{port} ssl http2;\n    \
             ssl_certificate {};\n    ssl_certificate_key {};\n    \
             location / {{ return 200 \"$request_method $host $request_uri $server_protocol\\n\"; }}\n  \
             }}\n}}\n",
            certs.cert_path.display(),
            certs.key_path.display()
        ),
    )
    .unwrap();
    let conf = format!("{d}/nginx.conf");
    let mut nginx = Command::new("nginx")
        .args(["-p", &format!("{d}/"), "-c", &conf, "-e", "stderr"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let _reap = KillOnDrop(nginx.id());
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    assert!(
        eventually(std::time::Duration::from_secs(20), || async move {
            tokio::net::TcpStream::connect(addr).await.is_ok()
        })
        .await,
        "nginx listens"
    );
    let proxy = Proxy::start(&format!(
        "[[upstream]]\nname = \"nginx\"\nhosts = [\"localhost:{port}\"]\nscheme = \"https\"\n\
         upstream_ca = {:?}\n",
        certs.ca_path
    ))
    .await;
    let client = proxy.client();
    let get = client
        .get(format!("http://localhost:{port}/v1/orders?page=2"))
        .send()
        .await
        .unwrap();
    assert_eq!(get.status(), 200);
    assert_eq!(
        get.text().await.unwrap(),
        "GET localhost /v1/orders?page=2 HTTP/2.0\n"
    );
    let post = client
        .post(format!("http://localhost:{port}/v1/orders"))
        .body("{\"sku\": 1}")
        .send()
        .await
        .unwrap();
    assert_eq!(post.status(), 200);
    assert_eq!(
        post.text().await.unwrap(),
        "POST localhost /v1/orders HTTP/2.0\n"
    );
    let _ = nginx.kill();
    let _ = nginx.wait();
}

/// gRPC (grpcio, C-core, on both sides) through sluice's CONNECT, as `grpc_proxy` or
/// `https_proxy` sends it: intercepted (sluice terminates TLS and speaks HTTP/2 to the
/// server over its own TLS), carried blind, and in plain text (h2c with prior knowledge,
/// served as HTTP/2). Unary calls with trailing metadata, an error status, a server
/// stream: each needs `te: trailers` to reach the server and the trailers to come back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_through_interception_a_tunnel_and_h2c() {
    crypto();
    if !present("python3", &["-c", "import grpc"]) {
        eprintln!("skipped: no grpcio (scripts/test installs it)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let certs = certs::for_localhost(dir.path(), &[]);
    let (tls_port, plain_port) = (free_port(), free_port());
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/interop/grpc_echo.py");
    let mut server = Command::new("python3")
        .arg(script)
        .args(["serve", &tls_port.to_string(), &plain_port.to_string()])
        .arg(&certs.cert_path)
        .arg(&certs.key_path)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let _reap = KillOnDrop(server.id());
    for port in [tls_port, plain_port] {
        let addr: SocketAddr = ([127, 0, 0, 1], port).into();
        assert!(
            eventually(std::time::Duration::from_secs(30), || async move {
                tokio::net::TcpStream::connect(addr).await.is_ok()
            })
            .await,
            "the gRPC server listens on {addr}"
        );
    }
    let (ca_cert, ca_key) = sluice::write_new_ca(&dir.path().join("ca")).unwrap();
    let proxy = Proxy::start(&format!(
        "[tls]\nca_cert = {ca_cert:?}\nca_key = {ca_key:?}\n\
         [[upstream]]\nname = \"grpc_intercept\"\nhosts = [\"localhost:{tls_port}\"]\n\
         tls = \"intercept\"\nupstream_ca = {0:?}\n\
         [[upstream]]\nname = \"grpc_tunnel\"\nhosts = [\"127.0.0.1:{tls_port}\"]\n\
         [[upstream]]\nname = \"grpc_h2c\"\nhosts = [\"127.0.0.1:{plain_port}\"]\n",
        certs.ca_path
    ))
    .await;
    let plan = dir.path().join("grpc.json");
    std::fs::write(
        &plan,
        serde_json::json!({
            "proxy": proxy.url(),
            "sluice_ca": ca_cert,
            "upstream_ca": certs.ca_path,
            "intercept": format!("localhost:{tls_port}"),
            "tunnel": format!("127.0.0.1:{tls_port}"),
            "h2c": format!("127.0.0.1:{plain_port}"),
        })
        .to_string(),
    )
    .unwrap();
    let mut cmd = Command::new("python3");
    cmd.arg(script)
        .arg("client")
        .arg(&plan)
        .env_remove("http_proxy")
        .env_remove("https_proxy")
        .env_remove("grpc_proxy")
        .env_remove("no_proxy")
        .env_remove("NO_PROXY");
    let out = tokio::task::spawn_blocking(move || cmd.output().unwrap())
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    let results: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(results.len(), 9, "{stdout}");
    let failed: Vec<_> = results.iter().filter(|r| r["ok"] != true).collect();
    assert!(failed.is_empty(), "{failed:#?}");
    // The intercepted and h2c calls went upstream as requests sluice sent, one each.
    let m = proxy.metrics().await;
    for upstream in ["grpc_intercept", "grpc_h2c"] {
        let served: f64 = m
            .lines()
            .filter(|l| {
                l.starts_with("sluice_upstream_responses_total{")
                    && l.contains(&format!("upstream=\"{upstream}\""))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        assert_eq!(served, 3.0, "{upstream}: {m}");
    }
    let _ = server.kill();
    let _ = server.wait();
}
