//! How sluice behaves run the way a pod runs it: listeners from the environment, probes
//! and metrics open to the pod network, control endpoints kept to loopback.

mod support;

use std::net::{IpAddr, UdpSocket};

use support::*;

/// An address of this machine that is not loopback, as a pod IP is: the source address
/// the kernel would pick for a route off the host (no packet is sent).
fn non_loopback_address() -> Option<IpAddr> {
    // Documentation addresses (RFC 5737, RFC 3849): never answered, and nothing is sent.
    ["198.51.100.1:9", "[2001:db8::1]:9"]
        .iter()
        .find_map(|off_host| {
            let bind = if off_host.starts_with('[') {
                "[::]:0"
            } else {
                "0.0.0.0:0"
            };
            let s = UdpSocket::bind(bind).ok()?;
            s.connect(off_host).ok()?;
            Some(s.local_addr().ok()?.ip()).filter(|ip| !ip.is_loopback() && !ip.is_unspecified())
        })
}

async fn status(method: reqwest::Method, url: &str) -> u16 {
    reqwest::Client::new()
        .request(method, url)
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

/// SLUICE_LISTEN and SLUICE_ADMIN set the listeners over the file's; on an address other
/// than loopback, probes and metrics answer and the control endpoints do not, while
/// loopback clients keep them. A reload does not count the overrides as a change.
#[tokio::test]
async fn probes_answer_the_pod_network_and_control_stays_on_loopback() {
    crypto();
    let pod_ip = non_loopback_address()
        .expect("this machine has an address other than loopback, as a pod has");
    let (port, admin) = (free_port(), free_port());
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sluice.toml");
    // The file says loopback; the environment opens both listeners on every address.
    std::fs::write(
        &path,
        "[proxy]\nlisten = \"127.0.0.1:1\"\nadmin = \"127.0.0.1:2\"\n",
    )
    .unwrap();
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"));
    command
        .env("SLUICE_LISTEN", format!("0.0.0.0:{port}"))
        .env("SLUICE_ADMIN", format!("0.0.0.0:{admin}"))
        .env("SLUICE_LOG_FORMAT", "json");
    let sluice = Sluice::spawn_shell(command, &["run", "-c", path.to_str().unwrap()]);
    assert!(sluice.ready(admin).await);

    let outside = |p: &str| format!("http://{pod_ip}:{admin}{p}");
    let inside = |p: &str| format!("http://127.0.0.1:{admin}{p}");
    for probe in ["/livez", "/healthz", "/readyz", "/metrics"] {
        assert_eq!(
            status(reqwest::Method::GET, &outside(probe)).await,
            200,
            "{probe}"
        );
    }
    for control in ["/config", "/buckets"] {
        assert_eq!(
            status(reqwest::Method::GET, &outside(control)).await,
            403,
            "{control}"
        );
        assert_eq!(
            status(reqwest::Method::GET, &inside(control)).await,
            200,
            "{control}"
        );
    }
    assert_eq!(
        status(reqwest::Method::POST, &outside("/reload")).await,
        403
    );
    let reload = reqwest::Client::new()
        .post(inside("/reload"))
        .send()
        .await
        .unwrap();
    assert_eq!(reload.status(), 200);
    let summary: serde_json::Value = serde_json::from_str(&reload.text().await.unwrap()).unwrap();
    assert_eq!(
        summary["restart_needed"],
        serde_json::json!([]),
        "{summary}"
    );

    // The proxy listener is open on the pod address too.
    let s = tokio::net::TcpStream::connect((pod_ip, port)).await;
    assert!(s.is_ok(), "proxy on {pod_ip}:{port}");

    let config: serde_json::Value = serde_json::from_str(
        &reqwest::get(inside("/config"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap(),
    )
    .unwrap();
    assert_eq!(config["proxy"]["admin"], format!("0.0.0.0:{admin}"));
    assert_eq!(config["proxy"]["admin_control"], "loopback");

    sluice.signal("TERM");
    let (code, log) = sluice.exit().await;
    assert_eq!(code, Some(0));
    // SLUICE_LOG_FORMAT=json: every line is a JSON object.
    assert!(!log.is_empty());
    for line in &log {
        assert!(
            serde_json::from_str::<serde_json::Value>(line).is_ok(),
            "{line}"
        );
    }
}

/// admin_control = "any" opens the control endpoints to every client of the listener.
#[tokio::test]
async fn admin_control_any_opens_control_to_the_network() {
    crypto();
    let pod_ip = non_loopback_address().expect("an address other than loopback");
    let (port, admin) = (free_port(), free_port());
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sluice.toml");
    std::fs::write(
        &path,
        format!(
            "[proxy]\nlisten = \"127.0.0.1:{port}\"\nadmin = \"0.0.0.0:{admin}\"\n\
             admin_control = \"any\"\n"
        ),
    )
    .unwrap();
    let sluice = Sluice::spawn(&["run", "-c", path.to_str().unwrap()]);
    assert!(sluice.ready(admin).await);
    let url = format!("http://{pod_ip}:{admin}/config");
    assert_eq!(status(reqwest::Method::GET, &url).await, 200);
    sluice.signal("TERM");
    sluice.exit().await;
}
