//! Egress rules end to end: what a client of the proxy can and cannot reach through it.
//! Every test here writes an `[egress]` section (possibly empty), so the built-in
//! defaults apply instead of the test harness's loopback allowance.

use sluice_test_support as support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use support::*;

/// A plain request for `url` through the proxy, its status and `sluice-reason`.
async fn status(proxy: &Proxy, method: &str, url: &str) -> (u16, Option<String>) {
    let host = url.split('/').nth(2).unwrap_or("x");
    let req = format!("{method} {url} HTTP/1.1\r\nHost: {host}\r\nContent-Length: 0\r\n\r\n");
    let resp = tokio::time::timeout(Duration::from_secs(5), raw(proxy.addr, req.as_bytes()))
        .await
        .expect("answered at once");
    (resp.status, resp.header("sluice-reason"))
}

async fn connect(proxy: &Proxy, target: &str) -> (u16, Option<String>) {
    let req = format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n");
    let resp = tokio::time::timeout(Duration::from_secs(5), raw(proxy.addr, req.as_bytes()))
        .await
        .expect("answered at once");
    (resp.status, resp.header("sluice-reason"))
}

fn denied() -> (u16, Option<String>) {
    (403, Some("denied".into()))
}

/// The attacks of the review: a local Redis through CONNECT, sluice's own admin API
/// through a plain request, in every spelling of loopback.
#[tokio::test]
async fn loopback_services_and_own_listeners_are_refused_by_default() {
    let echo = echo_server().await; // stands in for a local Redis
    let proxy = Proxy::start("[egress]\n").await;
    let port = echo.port();
    for target in [
        format!("127.0.0.1:{port}"),
        format!("localhost:{port}"),
        "127.0.0.1:443".to_string(),
    ] {
        assert_eq!(connect(&proxy, &target).await, denied(), "{target}");
    }
    let admin = proxy.admin.port();
    for host in [
        "127.0.0.1",
        "0.0.0.0",
        "127.1",
        "2130706433",
        "0x7f000001",
        "0177.0.0.1",
        "[::ffff:127.0.0.1]",
        "[::1]",
        "localhost",
    ] {
        let url = format!("http://{host}:{admin}/reload");
        assert_eq!(status(&proxy, "POST", &url).await, denied(), "{url}");
    }
    let url = format!("http://127.0.0.1:{}/", proxy.addr.port());
    assert_eq!(
        status(&proxy, "GET", &url).await,
        denied(),
        "the proxy itself"
    );
    let m = proxy.metrics().await;
    for result in ["success", "failure"] {
        let series = format!("sluice_config_reloads_total{{result=\"{result}\"}}");
        assert_eq!(metric(&m, &series), Some(0.0), "no reload ran");
    }
}

/// Naming a destination in an `[[upstream]]` is what lets it through; `[egress] allow`
/// widens the rules but never to sluice's own listeners.
#[tokio::test]
async fn named_upstreams_and_allow_let_through_but_never_to_own_listeners() {
    let up = Upstream::start().await;
    let echo = echo_server().await;
    let proxy = Proxy::start(&format!(
        "[[upstream]]\nname = \"local\"\nhosts = [\"127.0.0.1:{}\", \"127.0.0.1:{}\"]\n\
         [egress]\n",
        up.addr.port(),
        echo.port()
    ))
    .await;
    assert_eq!(status(&proxy, "GET", &up.url("/")).await, (200, None));
    // The same address on a port no upstream names is still loopback.
    let other = echo_server().await;
    let url = format!("http://127.0.0.1:{}/", other.port());
    assert_eq!(status(&proxy, "GET", &url).await, denied());
    // CONNECT to a named host:port is allowed, tunnel and all.
    assert_eq!(connect(&proxy, &echo.to_string()).await.0, 200);
    assert_eq!(connect(&proxy, &other.to_string()).await, denied());

    let wide = Proxy::start(
        "[egress]\nallow = [\"127.0.0.0/8\", \"::1\"]\nconnect_ports = [\"1-65535\"]\n",
    )
    .await;
    assert_eq!(status(&wide, "GET", &up.url("/")).await, (200, None));
    assert_eq!(connect(&wide, &other.to_string()).await.0, 200);
    for url in [
        format!("http://127.0.0.1:{}/reload", wide.admin.port()),
        format!("http://0.0.0.0:{}/reload", wide.admin.port()),
        format!("http://127.1:{}/", wide.addr.port()),
    ] {
        assert_eq!(status(&wide, "POST", &url).await, denied(), "{url}");
    }
    let admin = format!("127.0.0.1:{}", wide.admin.port());
    assert_eq!(connect(&wide, &admin).await, denied());
}

/// CONNECT's target is read as the forward path reads an authority: a bracketed IPv6
/// literal with its port is dialled, and a target with userinfo or without a usable port is
/// a 400, not a tunnel to some part of it.
#[tokio::test]
async fn connect_targets_are_read_like_request_authorities() {
    let echo = echo_server().await;
    let port = echo.port();
    let proxy = Proxy::start(&format!(
        "[[upstream]]\nname = \"local\"\nhosts = [\"127.0.0.1:{port}\"]\n[egress]\n\
         allow = [\"127.0.0.0/8\", \"::1\"]\nconnect_ports = [\"1-65535\"]\n"
    ))
    .await;
    assert_eq!(connect(&proxy, &format!("127.0.0.1:{port}")).await.0, 200);
    // The echo server listens on IPv4 only, so the bracketed target is read, passes the
    // egress check and is dialled, and only the dial fails.
    assert_eq!(
        connect(&proxy, &format!("[::1]:{port}")).await,
        (502, Some("upstream_unreachable".into()))
    );
    for target in [
        format!("user@127.0.0.1:{port}"),
        format!("user:pw@127.0.0.1:{port}"),
        "127.0.0.1".to_string(),
        "127.0.0.1:".to_string(),
        "127.0.0.1:65536".to_string(),
        "[::1]".to_string(),
    ] {
        assert_eq!(connect(&proxy, &target).await.0, 400, "CONNECT {target}");
    }
}

/// CONNECT opens 443 and the ports upstreams name, unless `connect_ports` says otherwise;
/// the port is checked before any name is resolved or address tried.
#[tokio::test]
async fn connect_is_limited_to_allowed_ports() {
    let lookup = StaticLookup(BTreeMap::from([(
        "public.test".to_string(),
        vec!["93.184.216.34".parse().unwrap()],
    )]));
    let proxy = Proxy::start_with("[egress]\n", Some(Arc::new(lookup))).await;
    for target in ["public.test:22", "public.test:6379", "93.184.216.34:25"] {
        assert_eq!(connect(&proxy, target).await, denied(), "{target}");
    }
}

/// Every known metadata endpoint and every IPv6 form of one, literally or behind a name,
/// is refused before any connection is tried.
#[tokio::test]
async fn metadata_endpoints_in_every_form_are_refused() {
    let lookup = StaticLookup(BTreeMap::from([
        (
            "metadata.test".to_string(),
            vec!["169.254.169.254".parse().unwrap()],
        ),
        (
            "imds6.test".to_string(),
            vec!["fd00:ec2::254".parse().unwrap()],
        ),
        (
            "mixed.test".to_string(),
            vec!["93.184.216.34".parse().unwrap(), "fe80::1".parse().unwrap()],
        ),
        (
            "rebind.example.test".to_string(),
            vec!["127.0.0.1".parse().unwrap()],
        ),
    ]));
    let proxy = Proxy::start_with(
        "[[upstream]]\nname = \"wild\"\nhosts = [\"*.example.test\"]\n[egress]\n",
        Some(Arc::new(lookup)),
    )
    .await;
    for host in [
        "169.254.169.254",
        "169.254.170.2",
        "100.100.100.200",
        "168.63.129.16",
        "[fd00:ec2::254]",
        "[::ffff:169.254.169.254]",
        "[::ffff:a9fe:a9fe]",
        "[::a9fe:a9fe]",
        "[64:ff9b::a9fe:a9fe]",
        "[64:ff9b:1::a9fe:a9fe]",
        "[2002:a9fe:a9fe::1]",
        "[fe80::1]",
        "2852039166",
        "0xa9.0xfe.0xa9.0xfe",
        "metadata.test",
        "imds6.test",
        "mixed.test",
    ] {
        let url = format!("http://{host}/latest/meta-data/");
        assert_eq!(status(&proxy, "GET", &url).await, denied(), "{url}");
        let target = format!("{host}:443");
        assert_eq!(connect(&proxy, &target).await, denied(), "CONNECT {target}");
    }
    // A wildcard upstream does not vouch for what its names resolve to.
    let rebind = status(&proxy, "GET", "http://rebind.example.test/").await;
    assert_eq!(rebind, denied());
    let m = proxy.metrics().await;
    assert_eq!(
        metric(
            &m,
            r#"sluice_requests_total{family="-",outcome="sluice_denied",upstream="unmatched"}"#
        ),
        Some(34.0), // 17 hosts, each as GET and CONNECT
        "{m}"
    );
    assert_eq!(
        metric(
            &m,
            r#"sluice_requests_total{family="-",outcome="sluice_denied",upstream="wild"}"#
        ),
        Some(1.0),
        "{m}"
    );
}

/// `[egress] deny` narrows even what an upstream names, and catches the IPv6 forms of the
/// addresses it lists.
#[tokio::test]
async fn deny_narrows_named_upstreams_too() {
    let up = Upstream::start().await;
    let proxy = Proxy::start(&format!(
        "[[upstream]]\nname = \"local\"\nhosts = [\"127.0.0.1:{}\"]\n\
         [egress]\ndeny = [\"127.0.0.0/8\"]\n",
        up.addr.port()
    ))
    .await;
    assert_eq!(status(&proxy, "GET", &up.url("/")).await, denied());
    let url = format!("http://[::ffff:127.0.0.1]:{}/", up.addr.port());
    assert_eq!(status(&proxy, "GET", &url).await, denied());
    assert!(up.seen().is_empty());
}

/// A reload swaps the rules for literal addresses and for names alike.
#[tokio::test]
async fn a_reload_applies_new_rules() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sluice.toml");
    let base = format!(
        "[proxy]\nlisten = \"127.0.0.1:0\"\nadmin = \"127.0.0.1:0\"\n\
         [[upstream]]\nname = \"local\"\nhosts = [\"127.0.0.1:{0}\", \"localhost:{0}\"]\n",
        up.addr.port()
    );
    std::fs::write(&path, format!("{base}[egress]\n")).unwrap();
    let proxy = Proxy::from_file(&path).await;
    let by_name = format!("http://localhost:{}/", up.addr.port());
    assert_eq!(status(&proxy, "GET", &up.url("/")).await, (200, None));
    assert_eq!(status(&proxy, "GET", &by_name).await, (200, None));

    std::fs::write(
        &path,
        format!("{base}[egress]\ndeny = [\"127.0.0.0/8\", \"::1\"]\n"),
    )
    .unwrap();
    let (code, body) = proxy.admin_post("/reload").await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(status(&proxy, "GET", &up.url("/")).await, denied());
    // Connection: close above, so the name is resolved and checked again.
    assert_eq!(status(&proxy, "GET", &by_name).await, denied());
}
