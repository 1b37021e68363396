//! Real clients through the proxy, as applications use it: `curl -x`, `curl -p -x`
//! (tunnel), Python's urllib with `HTTP_PROXY` set, and its `http.client` sending a large
//! body. `scripts/test` installs curl.

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

/// Python's `http.client` sends a whole body before it reads a word of the answer. An
/// answer that comes first (sluice's own 429 and 403, or an upstream's that did not read
/// the upload) still reaches it: sluice reads away the rest of the body rather than close
/// on a client that is still sending, whose socket would take the reset and lose the
/// answer. Read to its end, the body leaves the connection open for the next request.
#[tokio::test]
async fn a_client_that_sends_its_whole_body_first_hears_an_early_answer() {
    let up = Upstream::start().await;
    let proxy = Proxy::start(
        "unmatched = \"deny\"\n[[upstream]]\nname = \"api\"\nhosts = [\"127.0.0.1\"]\n\
         max_wait = \"0s\"\nlimits = [{ kind = \"fixed_window\", permits = 1, window = \"1m\" }]\n",
    )
    .await;
    // Larger than loopback's socket buffers take: the client is still sending when the
    // answer comes.
    let script = r#"
import http.client, sys
port, urls = int(sys.argv[1]), sys.argv[2:]
body = b"x" * 8_000_000
conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
out = []
for url in urls:
    try:
        conn.request("POST", url, body=body)
        local = conn.sock.getsockname()[1]
        r = conn.getresponse()
        r.read()
        out.append(f"{r.status} {r.getheader('sluice-reason', '-')} {local}")
    except Exception as e:
        out.append(f"{type(e).__name__}")
print("\n".join(out))
"#;
    let (allowed, denied) = (
        up.url("/a"),
        format!("http://localhost:{}/", up.addr.port()),
    );
    let mut cmd = Command::new("python3");
    cmd.args(["-c", script, &proxy.addr.port().to_string()])
        .args([&allowed, &allowed, &denied, &allowed]);
    let out = output(cmd).await;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<Vec<&str>> = text.lines().map(|l| l.split(' ').collect()).collect();
    let answers: Vec<String> = lines
        .iter()
        .map(|l| l[..l.len().min(2)].join(" "))
        .collect();
    assert_eq!(
        answers,
        [
            "200 -",
            "429 queue_timeout",
            "403 denied",
            "429 queue_timeout"
        ],
        "{text}"
    );
    // The upstream that answered without reading and each refusal left the connection
    // open: all four went over the client's first one.
    let ports: std::collections::BTreeSet<&str> =
        lines.iter().filter_map(|l| l.get(2).copied()).collect();
    assert_eq!(ports.len(), 1, "{text}");
    assert_eq!(up.seen().len(), 1);
}
