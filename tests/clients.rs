//! Real clients through the proxy, as applications use it: `curl -x`, `curl -p -x`
//! (tunnel), and Python's urllib with `HTTP_PROXY` set. `scripts/test` installs curl.

use sluice_test_support as support;

use std::process::Command;

use support::*;

/// Runs a blocking command off the runtime so the in-process proxy keeps serving.
async fn output(mut cmd: Command) -> std::process::Output {
    tokio::task::spawn_blocking(move || cmd.output().expect("command runs (is it installed?)"))
        .await
        .unwrap()
}

#[tokio::test]
async fn curl_through_the_proxy() {
    let up = Upstream::start().await;
    let proxy = Proxy::start("").await;
    let mut cmd = Command::new("curl");
    cmd.args([
        "-sS",
        "--max-time",
        "10",
        "-D",
        "-",
        "-x",
        &proxy.url(),
        &up.url("/via-curl"),
    ]);
    let out = output(cmd).await;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(text.ends_with("hello"), "{text}");
    assert_eq!(up.seen()[0].uri, "/via-curl");
}

#[tokio::test]
async fn curl_post_with_body() {
    let up = Upstream::start().await;
    let proxy = Proxy::start("").await;
    let mut cmd = Command::new("curl");
    cmd.args([
        "-sS",
        "--max-time",
        "10",
        "-x",
        &proxy.url(),
        "--data-binary",
        "order=42",
        &up.url("/echo"),
    ]);
    let out = output(cmd).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.stdout, b"order=42");
    assert_eq!(up.seen()[0].method, "POST");
}

#[tokio::test]
async fn curl_tunnels_with_connect() {
    let up = Upstream::start().await;
    let proxy = Proxy::start("").await;
    let mut cmd = Command::new("curl");
    cmd.args([
        "-sS",
        "-v",
        "--max-time",
        "10",
        "-p",
        "-x",
        &proxy.url(),
        &up.url("/tunnelled"),
    ]);
    let out = output(cmd).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("CONNECT"), "curl used a tunnel: {stderr}");
    assert_eq!(out.stdout, b"hello");
    // Inside the tunnel the request is the client's own: no Via from sluice.
    let seen = &up.seen()[0];
    assert_eq!(seen.uri, "/tunnelled");
    assert_eq!(seen.header("via"), None);
}

#[tokio::test]
async fn python_urllib_with_http_proxy() {
    let up = Upstream::start().await;
    let proxy = Proxy::start("").await;
    let script = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())";
    let mut cmd = Command::new("python3");
    cmd.args(["-c", script, &up.url("/from-python")])
        .env("HTTP_PROXY", proxy.url())
        .env("http_proxy", proxy.url())
        .env_remove("NO_PROXY")
        .env_remove("no_proxy");
    let out = output(cmd).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "hello");
    assert_eq!(
        up.seen()[0].header("via"),
        Some("1.1 sluice"),
        "went through sluice"
    );
}
