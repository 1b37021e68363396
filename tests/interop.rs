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

use futures_util::{SinkExt, StreamExt};
use support::*;
use tokio::net::TcpListener;

/// A WebSocket server that sends every message back, over TLS when `tls` is given.
async fn ws_echo(tls: Option<std::sync::Arc<rustls::ServerConfig>>) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let tls = tls.clone();
            tokio::spawn(async move {
                match tls {
                    Some(config) => {
                        let acceptor = tokio_rustls::TlsAcceptor::from(config);
                        if let Ok(s) = acceptor.accept(tcp).await {
                            echo(s).await;
                        }
                    }
                    None => echo(tcp).await,
                }
            });
        }
    });
    addr
}

async fn echo<S>(s: S)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let Ok(mut ws) = tokio_tungstenite::accept_async(s).await else {
        return;
    };
    while let Some(Ok(m)) = ws.next().await {
        if (m.is_text() || m.is_binary()) && ws.send(m).await.is_err() {
            return;
        }
    }
}

fn python_clients_present() -> bool {
    Command::new("python3")
        .args(["-c", "import requests, httpx, h2, aiohttp, websockets"])
        .status()
        .is_ok_and(|s| s.success())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_clients_in_every_mode() {
    if !python_clients_present() {
        eprintln!(
            "SKIPPED: the Python clients (requests, httpx[http2], aiohttp, websockets) are not \
             installed; scripts/test installs them"
        );
        return;
    }
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
            "[[upstream]]\nname = \"{name}\"\nhosts = [\"127.0.0.1:{}\"]\ntls = \"{mode}\"\n\
             upstream_ca = {up_ca:?}\n\
             retry = {{ backoff = {{ base = \"50ms\", max = \"200ms\" }} }}\n",
            addr.port()
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
            "forward": { "base": format!("http://{}", plain.addr), "ws": format!("ws://{ws}/") },
            "intercept": {
                "base": format!("https://{}", intercepted.addr),
                "ws": format!("wss://{wss_intercepted}/"),
            },
            "tunnel": {
                "base": format!("https://{}", tunnelled.addr),
                "ws": format!("wss://{wss_tunnelled}/"),
            },
        },
    });
    let plan_path = dir.path().join("plan.json");
    std::fs::write(&plan_path, plan.to_string()).unwrap();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/interop/python_clients.py");
    let out = tokio::task::spawn_blocking(move || {
        Command::new("python3")
            .arg(script)
            .arg(&plan_path)
            .output()
            .unwrap()
    })
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
    // Every client ran in every mode.
    for client in ["requests", "httpx", "urllib", "aiohttp", "websockets"] {
        for mode in ["forward", "intercept", "tunnel"] {
            assert!(
                results
                    .iter()
                    .any(|r| r["client"] == client && r["mode"] == mode),
                "{client} in {mode} mode"
            );
        }
    }
}
