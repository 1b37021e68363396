//! HTTPS through sluice with real TLS on both sides: a rustls upstream with its own test
//! CA, sluice intercepting with a CA from `write_new_ca`, and curl as the client.

use sluice_test_support as support;

use std::process::Command;
use std::time::Duration;

use support::Proxy;
use support::certs::{h2_tunnel, intercepting, tls_upstream};
use support::connect_tunnel;
use tokio::time::Instant;

/// Runs curl with `args`, returning (exit ok, stdout, stderr).
async fn curl(args: Vec<String>) -> (bool, String, String) {
    tokio::task::spawn_blocking(move || {
        let out = Command::new("curl")
            .args(&args)
            .output()
            .expect("curl runs");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    })
    .await
    .unwrap()
}

fn strs(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

#[tokio::test]
async fn intercepted_https_is_limited_like_plain_http_over_h1_and_h2() {
    let dir = tempfile::tempdir().unwrap();
    let up = tls_upstream(dir.path()).await;
    let (proxy, ca_cert) = intercepting(
        dir.path(),
        &up,
        "[[upstream.family]]\nname = \"items\"\npaths = [\"/v1/**\"]\n\
         limits = [{ kind = \"sliding_window\", permits = 3, window = \"1s\" }]\n",
    )
    .await;
    let url = format!("https://{}/v1/items", up.addr);
    let base = vec![
        "-sS".to_string(),
        "--max-time".into(),
        "20".into(),
        "-x".into(),
        proxy.url(),
        "--cacert".into(),
        ca_cert.display().to_string(),
    ];

    let t0 = Instant::now();
    let mut runs = Vec::new();
    for i in 0..9 {
        let mut args = base.clone();
        if i % 2 == 1 {
            args.push("--http1.1".into());
        }
        args.extend(["-w".into(), " %{http_version}".into(), url.clone()]);
        runs.push(tokio::spawn(curl(args)));
    }
    let mut versions = Vec::new();
    for r in runs {
        let (ok, out, err) = r.await.unwrap();
        assert!(ok, "curl failed: {err}");
        assert!(out.starts_with("secure hello"), "{out}");
        versions.push(out.rsplit(' ').next().unwrap().to_string());
    }
    assert!(
        versions.contains(&"2".to_string()) && versions.contains(&"1.1".to_string()),
        "{versions:?}"
    );
    assert!(
        t0.elapsed() >= Duration::from_millis(1900),
        "9 at 3/s take 2 s: {:?}",
        t0.elapsed()
    );
    let arrivals: Vec<Instant> = up.seen.lock().iter().map(|s| s.0).collect();
    assert_eq!(arrivals.len(), 9);
    let most = arrivals
        .iter()
        .map(|a| {
            arrivals
                .iter()
                .filter(|b| **b >= *a && **b < *a + Duration::from_millis(950))
                .count()
        })
        .max();
    assert_eq!(most, Some(3), "the family limit holds inside the tunnel");

    let m = proxy.metrics().await;
    assert!(
        m.contains(r#"sluice_requests_total{family="items",outcome="200",upstream="secure"} 9"#),
        "{m}"
    );

    // A client that does not trust sluice's CA fails its handshake; it is counted.
    let (ok, _, _) = curl(strs(&["-sS", "--max-time", "10", "-x", &proxy.url(), &url])).await;
    assert!(!ok);
    assert!(
        support::metric_reaches(&proxy, "sluice_tls_handshake_failures_total", 1.0).await,
        "{}",
        proxy.metrics().await
    );
}

#[tokio::test]
async fn an_untrusted_upstream_certificate_is_a_502() {
    let dir = tempfile::tempdir().unwrap();
    let up = tls_upstream(dir.path()).await;
    let (ca_cert, ca_key) = sluice::write_new_ca(&dir.path().join("ca")).unwrap();
    // No upstream_ca: the upstream's private CA is not trusted.
    let proxy = Proxy::start(&format!(
        "[tls]\nca_cert = {ca_cert:?}\nca_key = {ca_key:?}\n\
         [[upstream]]\nname = \"secure\"\nhosts = [\"127.0.0.1\"]\ntls = \"intercept\"\n"
    ))
    .await;
    let url = format!("https://{}/x", up.addr);
    let (ok, out, err) = curl(strs(&[
        "-sS",
        "--max-time",
        "10",
        "-x",
        &proxy.url(),
        "--cacert",
        ca_cert.to_str().unwrap(),
        "-w",
        " %{http_code}",
        &url,
    ]))
    .await;
    assert!(ok, "{err}");
    assert!(out.ends_with(" 502"), "{out}");
    assert!(out.contains("sluice_upstream_unreachable"), "{out}");
    assert!(up.seen.lock().is_empty());
}

#[tokio::test]
async fn tls_origination_for_plain_http_requests() {
    let dir = tempfile::tempdir().unwrap();
    let up = tls_upstream(dir.path()).await;
    let proxy = Proxy::start(&format!(
        "[[upstream]]\nname = \"secure\"\nhosts = [\"127.0.0.1\"]\nscheme = \"https\"\nupstream_ca = {:?}\n",
        up.ca_path
    ))
    .await;
    let resp = proxy
        .client()
        .get(format!("http://{}/plain", up.addr))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.text().await.unwrap(), "secure hello");
    assert_eq!(up.seen.lock().len(), 1);
}

/// A request for the server as a whole (`OPTIONS *`, RFC 9112 §3.2.4) inside an
/// intercepted tunnel reaches the origin as such, over HTTP/1.1 and HTTP/2, and only
/// OPTIONS may ask for `*`.
#[tokio::test]
async fn options_asterisk_inside_interception_reaches_the_origin() {
    let dir = tempfile::tempdir().unwrap();
    let up = tls_upstream(dir.path()).await;
    let (proxy, ca_cert) = intercepting(dir.path(), &up, "").await;
    let url = format!("https://{}/", up.addr);
    let via_proxy = |args: &[&str]| {
        let mut all = strs(&["-sS", "--max-time", "10", "-x", &proxy.url(), "--cacert"]);
        all.push(ca_cert.display().to_string());
        all.extend(strs(args));
        all.extend(strs(&["--request-target", "*", &url]));
        curl(all)
    };
    for version in ["--http1.1", "--http2"] {
        let (ok, out, err) = via_proxy(&[version, "-X", "OPTIONS"]).await;
        assert!(ok, "{version}: {err}");
        assert_eq!(out, "secure hello", "{version}");
        let last = up.seen.lock().last().map(|s| s.1.clone());
        assert!(
            last.as_deref().is_some_and(|l| l.ends_with(" *")),
            "{version}: the origin saw {last:?}"
        );
    }
    let seen = up.seen.lock().len();
    let (ok, out, err) = via_proxy(&["--http1.1", "-o", "/dev/null", "-w", "%{http_code}"]).await;
    assert!(ok, "{err}");
    assert_eq!(out, "400", "GET * is refused");
    assert_eq!(up.seen.lock().len(), seen, "and never reaches the origin");
}

#[tokio::test]
async fn a_tunnel_to_an_unmatched_host_still_works() {
    let dir = tempfile::tempdir().unwrap();
    let up = tls_upstream(dir.path()).await;
    let proxy = Proxy::start("").await;
    let url = format!("https://{}/blind", up.addr);
    let (ok, out, err) = curl(strs(&[
        "-sS",
        "--max-time",
        "10",
        "-x",
        &proxy.url(),
        "--cacert",
        up.ca_path.to_str().unwrap(),
        &url,
    ]))
    .await;
    assert!(ok, "{err}");
    assert_eq!(out, "secure hello");
}

#[tokio::test]
async fn reqwest_with_the_ca_added_over_http1_and_http2() {
    let dir = tempfile::tempdir().unwrap();
    let up = tls_upstream(dir.path()).await;
    let (proxy, ca_cert) = intercepting(dir.path(), &up, "").await;
    let ca = reqwest::Certificate::from_pem(&std::fs::read(&ca_cert).unwrap()).unwrap();
    for http2 in [false, true] {
        let mut b = reqwest::Client::builder()
            .proxy(reqwest::Proxy::all(proxy.url()).unwrap())
            .tls_certs_only([ca.clone()]);
        b = if http2 {
            b.http2_prior_knowledge()
        } else {
            b.http1_only()
        };
        let resp = b
            .build()
            .unwrap()
            .get(format!("https://{}/r", up.addr))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        assert_eq!(
            resp.version(),
            if http2 {
                http::Version::HTTP_2
            } else {
                http::Version::HTTP_11
            }
        );
        assert_eq!(resp.text().await.unwrap(), "secure hello");
    }
    assert_eq!(up.seen.lock().len(), 2);
}

/// Inside interception, a request's attempt and total deadlines run on its tunnel's
/// shared timer: each request to an upstream that never answers gets its 504 at its own
/// deadline, neither early nor never. Over HTTP/1.1 one after another on a keep-alive
/// connection, over HTTP/2 side by side on one connection, started 200 ms apart, and
/// with each kind of deadline the one that runs out.
#[tokio::test]
async fn intercepted_requests_time_out_on_their_own_deadlines_over_h1_and_h2() {
    let dir = tempfile::tempdir().unwrap();
    let up = tls_upstream(dir.path()).await;
    let (proxy, ca_cert) = intercepting(
        dir.path(),
        &up,
        "attempt_timeout = \"600ms\"\nretry = { max_attempts = 1 }\n\
         [[upstream.family]]\nname = \"short\"\npaths = [\"/total/**\"]\n\
         attempt_timeout = \"5s\"\ntotal_timeout = \"400ms\"\n",
    )
    .await;
    let ca = reqwest::Certificate::from_pem(&std::fs::read(&ca_cert).unwrap()).unwrap();
    for http2 in [false, true] {
        let b = reqwest::Client::builder()
            .proxy(reqwest::Proxy::all(proxy.url()).unwrap())
            .tls_certs_only([ca.clone()]);
        let client = if http2 {
            b.http2_prior_knowledge()
        } else {
            b.http1_only()
        }
        .build()
        .unwrap();
        // A path under /total/ runs out its total deadline (400 ms), any other its
        // attempt deadline (600 ms).
        let one = |path: &'static str, after: u64| {
            let (client, url) = (client.clone(), format!("https://{}{path}", up.addr));
            async move {
                tokio::time::sleep(Duration::from_millis(after)).await;
                let t0 = Instant::now();
                let resp = tokio::time::timeout(Duration::from_secs(20), client.get(url).send())
                    .await
                    .unwrap_or_else(|_| panic!("{path}: no answer in 20 s"))
                    .unwrap();
                let reason = resp.headers()["sluice-reason"]
                    .to_str()
                    .unwrap()
                    .to_string();
                (path, resp.status().as_u16(), reason, t0.elapsed())
            }
        };
        let runs = if http2 {
            let (a, b, c) = tokio::join!(
                one("/stall/a", 0),
                one("/stall/b", 200),
                one("/total/stall", 100)
            );
            vec![a, b, c]
        } else {
            vec![
                one("/stall/a", 0).await,
                one("/total/stall", 0).await,
                one("/stall/b", 0).await,
            ]
        };
        for (path, status, reason, took) in runs {
            let (want, least) = if path.starts_with("/total/") {
                ("total_timeout", 400)
            } else {
                ("upstream_timeout", 600)
            };
            assert_eq!(
                (status, reason.as_str()),
                (504, want),
                "http2 {http2}, {path}"
            );
            assert!(
                took >= Duration::from_millis(least) && took < Duration::from_secs(10),
                "http2 {http2}, {path}: {want} after {took:?}"
            );
        }
        let resp = client
            .get(format!("https://{}/after", up.addr))
            .send()
            .await
            .unwrap();
        assert_eq!(
            resp.status(),
            200,
            "http2 {http2}: a request after the timeouts is served"
        );
    }
}

/// `generate_ca`: sluice makes its CA at start, keeps the key to itself, and writes the
/// CA and a bundle (public roots + CA) where the application can read them; a client
/// that trusts only that bundle gets intercepted HTTPS through. A reload that leaves
/// [tls] as it was keeps the CA; with key_dir, a restart does too.
#[tokio::test]
async fn a_generated_ca_is_trusted_through_the_bundle_it_writes() {
    let dir = tempfile::tempdir().unwrap();
    let up = tls_upstream(dir.path()).await;
    let trust = dir.path().join("trust");
    let config = |comment: &str| {
        format!(
            "[proxy]\nlisten = \"127.0.0.1:0\"\nadmin = \"127.0.0.1:0\"\n# {comment}\n\
             [tls]\ngenerate_ca = true\ntrust_dir = {trust:?}\n\
             [[upstream]]\nname = \"secure\"\nhosts = [\"127.0.0.1\"]\ntls = \"intercept\"\nupstream_ca = {:?}\n\
             [egress]\nallow = [\"127.0.0.0/8\"]\nconnect_ports = [\"1-65535\"]\n",
            up.ca_path
        )
    };
    let path = dir.path().join("sluice.toml");
    std::fs::write(&path, config("first")).unwrap();
    let proxy = Proxy::from_file(&path).await;

    let bundle = std::fs::read(trust.join("ca-bundle.pem")).unwrap();
    let ca = std::fs::read_to_string(trust.join("ca.pem")).unwrap();
    let text = String::from_utf8_lossy(&bundle);
    assert!(
        text.matches("BEGIN CERTIFICATE").count() > 100,
        "public roots too"
    );
    assert!(text.ends_with(&ca), "the CA last");
    for f in std::fs::read_dir(&trust).unwrap() {
        let body = std::fs::read_to_string(f.unwrap().path()).unwrap();
        assert!(
            !body.contains("PRIVATE KEY"),
            "no key in the shared directory"
        );
    }
    let roots = reqwest::Certificate::from_pem_bundle(&bundle).unwrap();
    let client = reqwest::Client::builder()
        .proxy(reqwest::Proxy::all(proxy.url()).unwrap())
        .tls_certs_only(roots)
        .build()
        .unwrap();
    let resp = client
        .get(format!("https://{}/r", up.addr))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.text().await.unwrap(), "secure hello");

    // An edit elsewhere in the file: reloaded, the same CA.
    std::fs::write(&path, config("second")).unwrap();
    let (status, body) = proxy.admin_post("/reload").await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"changed\": true"), "{body}");
    assert_eq!(std::fs::read_to_string(trust.join("ca.pem")).unwrap(), ca);
    let resp = client
        .get(format!("https://{}/again", up.addr))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);

    // With key_dir, a restarted sluice finds the CA it made before.
    let keys = dir.path().join("keys");
    let first = sluice::Authority::generate_in(&keys).unwrap();
    let again = sluice::Authority::generate_in(&keys).unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    first.write_trust(&a).unwrap();
    again.write_trust(&b).unwrap();
    assert_eq!(
        std::fs::read(a.join("ca.pem")).unwrap(),
        std::fs::read(b.join("ca.pem")).unwrap()
    );
    let fresh = sluice::Authority::generate().unwrap();
    fresh.write_trust(&b).unwrap();
    assert_ne!(
        std::fs::read(a.join("ca.pem")).unwrap(),
        std::fs::read(b.join("ca.pem")).unwrap()
    );
}

/// A CONNECT to an intercepted host, answered 200, on a plain TCP stream.
async fn intercepted_tunnel(proxy: &Proxy) -> tokio::net::TcpStream {
    connect_tunnel(proxy.addr, "127.0.0.1:443").await
}

/// How long until the peer closes `s` (a read returns nothing or fails), at most 10 s.
async fn closed_after<S: tokio::io::AsyncRead + Unpin>(s: &mut S) -> Duration {
    use tokio::io::AsyncReadExt;
    let t = Instant::now();
    let mut b = [0u8; 64];
    loop {
        match tokio::time::timeout(Duration::from_secs(10), s.read(&mut b)).await {
            Ok(Ok(0) | Err(_)) => return t.elapsed(),
            Ok(Ok(_)) => {}
            Err(_) => panic!("still open after 10 s"),
        }
    }
}

/// Intercepted connections are bounded like blind tunnels: a client that never sends its
/// ClientHello, and one that completes the handshake (HTTP/1.1 or h2 by ALPN) and then
/// sends nothing, are closed after `tunnel_idle_timeout`, freeing their connection slot.
#[tokio::test]
async fn silent_intercepted_connections_are_closed() {
    let dir = tempfile::tempdir().unwrap();
    let (ca_cert, ca_key) = sluice::write_new_ca(&dir.path().join("ca")).unwrap();
    let proxy = Proxy::start(&format!(
        "tunnel_idle_timeout = \"1s\"\n[tls]\nca_cert = {ca_cert:?}\nca_key = {ca_key:?}\n\
         [[upstream]]\nname = \"secure\"\nhosts = [\"127.0.0.1\"]\ntls = \"intercept\"\n"
    ))
    .await;
    let mut silent = intercepted_tunnel(&proxy).await;
    let took = closed_after(&mut silent).await;
    assert!(
        took >= Duration::from_millis(800),
        "closed for the silence: {took:?}"
    );

    for alpn in [b"http/1.1".to_vec(), b"h2".to_vec()] {
        let connector = support::certs::connector(&ca_cert, &[&alpn]);
        let tunnel = intercepted_tunnel(&proxy).await;
        let name = rustls_pki_types::ServerName::try_from("127.0.0.1").unwrap();
        let mut tls = connector.connect(name, tunnel).await.unwrap();
        assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&alpn[..]));
        let took = closed_after(&mut tls).await;
        assert!(
            took >= Duration::from_millis(800),
            "{}: closed for the silence, {took:?}",
            String::from_utf8_lossy(&alpn)
        );
    }
}

/// Intercepted clients that offer only ALPN `http/1.0`, or no ALPN at all, are served:
/// the handshake completes and a request inside gets sluice's answer in the version it
/// was asked in (here a 502, since nothing listens behind 127.0.0.1:443).
#[tokio::test]
async fn intercepted_clients_offering_http_1_0_or_no_alpn_are_served() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = tempfile::tempdir().unwrap();
    let (ca_cert, ca_key) = sluice::write_new_ca(&dir.path().join("ca")).unwrap();
    let proxy = Proxy::start(&format!(
        "[tls]\nca_cert = {ca_cert:?}\nca_key = {ca_key:?}\n\
         [[upstream]]\nname = \"secure\"\nhosts = [\"127.0.0.1\"]\ntls = \"intercept\"\n\
         retry = {{ max_attempts = 1 }}\n"
    ))
    .await;
    use rustls_pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(rustls_pki_types::CertificateDer::from_pem_file(&ca_cert).unwrap())
        .unwrap();
    for (alpn, request, answer) in [
        (
            Some(b"http/1.0".to_vec()),
            "GET / HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n",
            "HTTP/1.0 502",
        ),
        (
            None,
            "GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
            "HTTP/1.1 502",
        ),
    ] {
        let mut config = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots.clone())
        .with_no_client_auth();
        config.alpn_protocols = alpn.iter().cloned().collect();
        let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config));
        let tunnel = intercepted_tunnel(&proxy).await;
        let name = rustls_pki_types::ServerName::try_from("127.0.0.1").unwrap();
        let mut tls = connector
            .connect(name, tunnel)
            .await
            .unwrap_or_else(|e| panic!("{alpn:?}: {e}"));
        assert_eq!(tls.get_ref().1.alpn_protocol(), alpn.as_deref());
        tls.write_all(request.as_bytes()).await.unwrap();
        let mut got = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(10), tls.read_to_end(&mut got)).await;
        let text = String::from_utf8_lossy(&got);
        assert!(text.starts_with(answer), "{alpn:?}: {text}");
        assert!(
            text.to_ascii_lowercase()
                .contains("sluice-reason: upstream_unreachable"),
            "{text}"
        );
    }
}

/// `Expect: 100-continue` inside interception behaves the same over HTTP/1.1 and HTTP/2:
/// `100` comes once the request is admitted, and a request the queue refuses gets its
/// 429 without a `100` (its body is never sent). curl waits 30 s for a `100` here, so a
/// missing one would show as a stall.
#[tokio::test]
async fn expect_100_continue_inside_interception_over_h1_and_h2() {
    let dir = tempfile::tempdir().unwrap();
    let up = tls_upstream(dir.path()).await;
    let (proxy, ca_cert) = intercepting(
        dir.path(),
        &up,
        "max_wait = \"100ms\"\n\
         limits = [{ kind = \"fixed_window\", permits = 2, window = \"1m\" }]\n",
    )
    .await;
    let upload = dir.path().join("upload");
    std::fs::write(&upload, vec![b'x'; 200_000]).unwrap();
    let run = |version: &str| {
        let args = vec![
            "-sS".to_string(),
            "-v".into(),
            "--max-time".into(),
            "60".into(),
            "--expect100-timeout".into(),
            "30".into(),
            version.into(),
            "-x".into(),
            proxy.url(),
            "--cacert".into(),
            ca_cert.display().to_string(),
            "-H".into(),
            "Expect: 100-continue".into(),
            "--data-binary".into(),
            format!("@{}", upload.display()),
            "-w".into(),
            "%{http_code}".into(),
            format!("https://{}/upload", up.addr),
        ];
        curl(args)
    };
    // Two admitted (the window's two permits), one over each version; then one refused.
    for version in ["--http1.1", "--http2"] {
        let t = Instant::now();
        let (ok, out, err) = run(version).await;
        assert!(ok, "{version}: {err}");
        assert!(out.ends_with("200"), "{version}: {out}");
        assert!(
            err.contains("< HTTP/1.1 100") || err.contains("< HTTP/2 100"),
            "{version}: a 100 came: {err}"
        );
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "{version}: {:?}",
            t.elapsed()
        );
    }
    for version in ["--http1.1", "--http2"] {
        let (ok, out, err) = run(version).await;
        assert!(ok, "{version}: {err}");
        assert!(out.ends_with("429"), "{version}: {out}");
        assert!(
            !err.contains("< HTTP/1.1 100") && !err.contains("< HTTP/2 100"),
            "{version}: refused without a 100: {err}"
        );
    }
}

/// HTTP/2 inside interception is served by sluice's own loop over the `h2` crate: a
/// client that opens streams and resets them at once (the "rapid reset" flood) is cut
/// off by the connection's reset bounds and never reaches the upstream more than a
/// handful of times, and other clients are served meanwhile.
#[tokio::test]
async fn a_rapid_reset_flood_inside_interception_is_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let up = tls_upstream(dir.path()).await;
    let (proxy, ca_cert) = intercepting(dir.path(), &up, "").await;
    let target = up.addr;
    let tls = h2_tunnel(proxy.addr, &ca_cert, target).await;
    let (mut send, conn) = h2::client::handshake(tls).await.unwrap();
    let conn = tokio::spawn(conn);
    let mut sent = 0;
    for _ in 0..5000 {
        let Ok(ready) = send.clone().ready().await else {
            break;
        };
        send = ready;
        let req = http::Request::get(format!("https://{target}/flood"))
            .body(())
            .unwrap();
        let Ok((_, mut stream)) = send.send_request(req, true) else {
            break;
        };
        stream.send_reset(h2::Reason::CANCEL);
        sent += 1;
    }
    // The connection ends (GOAWAY) well before the flood could, or the flood's streams
    // were cancelled before their requests were sent on.
    let ended = tokio::time::timeout(Duration::from_secs(10), conn).await;
    let reached = up.seen.lock().len();
    eprintln!(
        "rapid reset: {sent} streams opened and reset, {reached} reached the upstream, connection {ended:?}"
    );
    assert!(
        sent < 5000 || ended.is_ok(),
        "{sent} streams opened and reset"
    );
    assert!(
        reached < 200,
        "{reached} of {sent} reset requests reached the upstream"
    );
    // Others are served.
    let client = reqwest::Client::builder()
        .proxy(reqwest::Proxy::all(proxy.url()).unwrap())
        .add_root_certificate(
            reqwest::Certificate::from_pem(&std::fs::read(&ca_cert).unwrap()).unwrap(),
        )
        .build()
        .unwrap();
    let r = client
        .get(format!("https://{target}/after"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
}

/// `openssl req -x509` makes a self-signed certificate with CA:TRUE, which webpki refuses
/// as a server's own (CaUsedAsEndEntity). Named in `upstream_ca`, it is accepted as a
/// pin, against a real `openssl s_server` presenting it: those exact bytes, for the
/// name, within their validity. A server presenting another such certificate is still
/// refused.
#[tokio::test]
async fn a_self_signed_upstream_certificate_named_in_upstream_ca_is_pinned() {
    if Command::new("openssl").arg("version").output().is_err() {
        eprintln!("SKIPPED: no openssl command here");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let make = |name: &str| {
        let (cert, key) = (
            dir.path().join(format!("{name}.pem")),
            dir.path().join(format!("{name}-key.pem")),
        );
        let out = Command::new("openssl")
            .args([
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
                "-nodes",
            ])
            .arg("-keyout")
            .arg(&key)
            .arg("-out")
            .arg(&cert)
            .args(["-days", "2", "-subj", "/CN=localhost"])
            .args(["-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        let text = Command::new("openssl")
            .args(["x509", "-noout", "-text", "-in"])
            .arg(&cert)
            .output()
            .unwrap();
        assert!(String::from_utf8_lossy(&text.stdout).contains("CA:TRUE"));
        (cert, key)
    };
    let (pinned, pinned_key) = make("pinned");
    let (other, _) = make("other");
    // s_server answers one connection at a time: enough for one request per upstream.
    let port = support::free_port();
    let mut server = tokio::process::Command::new("openssl")
        .args([
            "s_server",
            "-accept",
            &format!("127.0.0.1:{port}"),
            "-www",
            "-quiet",
        ])
        .arg("-cert")
        .arg(&pinned)
        .arg("-key")
        .arg(&pinned_key)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_err()
    {
        assert!(Instant::now() < deadline, "openssl s_server did not listen");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let config = |ca: &std::path::Path, host: &str| {
        format!(
            "[[upstream]]\nname = \"selfsigned\"\nhosts = [\"{host}:{port}\"]\nscheme = \"https\"\n\
             upstream_ca = {ca:?}\n"
        )
    };
    for (ca, host, want) in [
        (&pinned, "127.0.0.1", 200),
        (&pinned, "localhost", 200),
        (&other, "127.0.0.1", 502),
    ] {
        let proxy = Proxy::start(&config(ca, host)).await;
        let resp = proxy
            .client()
            .get(format!("http://{host}:{port}/"))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), want, "{host} trusting {ca:?}");
    }
    server.kill().await.unwrap();
}

fn runs(program: &str, arg: &str) -> bool {
    Command::new(program)
        .arg(arg)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The trust recipes of docs/https.md, run as written: wget trusts sluice's CA with
/// `--ca-certificate` and not with `SSL_CERT_FILE`; the Java store made from a copy of
/// the JDK's `cacerts` keeps every public root and lets Java's HttpClient through an
/// intercepted tunnel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_trust_recipes_work() {
    let dir = tempfile::tempdir().unwrap();
    let up = tls_upstream(dir.path()).await;
    let (proxy, ca_cert) = intercepting(dir.path(), &up, "").await;
    let url = format!("https://{}/recipe", up.addr);
    let blocking = |mut cmd: Command| async move {
        tokio::task::spawn_blocking(move || cmd.output().unwrap())
            .await
            .unwrap()
    };

    if runs("wget", "--version") {
        let wget = |extra: &[&str], env: Option<&std::path::Path>| {
            let mut cmd = Command::new("wget");
            cmd.args(["-q", "-O", "-", "--tries=1", "--timeout=10"])
                .args(extra)
                .arg(&url)
                .env("https_proxy", proxy.url())
                .env_remove("SSL_CERT_FILE");
            if let Some(file) = env {
                cmd.env("SSL_CERT_FILE", file);
            }
            cmd
        };
        let with_option = format!("--ca-certificate={}", ca_cert.display());
        let out = blocking(wget(&[&with_option], None)).await;
        assert!(out.status.success(), "{out:?}");
        assert_eq!(String::from_utf8_lossy(&out.stdout), "secure hello");
        // 5: an SSL verification failure. GnuTLS's wget does not read SSL_CERT_FILE.
        let out = blocking(wget(&[], Some(&ca_cert))).await;
        assert_eq!(out.status.code(), Some(5), "{out:?}");
    } else {
        eprintln!("SKIPPED: wget's recipe (no wget here)");
    }

    if !runs("java", "-version") || !runs("keytool", "-help") {
        eprintln!("SKIPPED: Java's recipe (no JDK here)");
        return;
    }
    let java = std::fs::canonicalize(
        String::from_utf8(
            Command::new("sh")
                .args(["-c", "command -v java"])
                .output()
                .unwrap()
                .stdout,
        )
        .unwrap()
        .trim(),
    )
    .unwrap();
    let java_home = java.parent().unwrap().parent().unwrap();
    let docs =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/https.md")).unwrap();
    let block: String = docs
        .split("```sh\n")
        .find(|b| b.starts_with("cp \"$JAVA_HOME/lib/security/cacerts\""))
        .expect("the Java block in docs/https.md")
        .split("```")
        .next()
        .unwrap()
        .to_string();
    std::fs::copy(&ca_cert, dir.path().join("ca.pem")).unwrap();
    let mut sh = Command::new("sh");
    sh.args(["-ec", &block])
        .current_dir(dir.path())
        .env("JAVA_HOME", java_home);
    let out = blocking(sh).await;
    assert!(out.status.success(), "{block}\n{out:?}");
    let entries = |store: std::path::PathBuf| {
        let out = Command::new("keytool")
            .args(["-list", "-storepass", "changeit", "-keystore"])
            .arg(store)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout)
            .matches("trustedCertEntry")
            .count()
    };
    let public = entries(java_home.join("lib/security/cacerts"));
    assert!(public > 50, "the JDK's cacerts has {public} roots");
    assert_eq!(entries(dir.path().join("truststore.jks")), public + 1);
    let mut cmd = Command::new("java");
    cmd.arg(format!(
        "-Djavax.net.ssl.trustStore={}",
        dir.path().join("truststore.jks").display()
    ))
    .arg("-Djavax.net.ssl.trustStorePassword=changeit")
    .arg(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/interop/java/TrustStoreGet.java"
    ))
    .arg(proxy.addr.port().to_string())
    .arg(&url);
    let out = blocking(cmd).await;
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "200 secure hello",
        "{out:?}"
    );
}

/// An upload the upstream answers without reading it, inside interception. Over HTTP/1.1
/// (curl) the client reads the whole answer. Over HTTP/2 (the `h2` crate, as hyper and
/// reqwest use it) the client reads the whole answer too, and then its stream is reset
/// with NO_ERROR (RFC 9113 §8.1): it stops sending, and the stream holds nothing after
/// its answer. curl 7.88 is not used for HTTP/2 here: it spins on such a reset until its
/// `--max-time`, and direct to hyper it loses the answer (curl/curl#11165).
#[tokio::test]
async fn an_upload_the_upstream_answers_early_ends_over_h1_and_h2() {
    let dir = tempfile::tempdir().unwrap();
    let up = tls_upstream(dir.path()).await;
    let (proxy, ca_cert) = intercepting(dir.path(), &up, "").await;
    let upload = dir.path().join("upload");
    std::fs::write(&upload, vec![b'x'; 8 << 20]).unwrap();
    let (ok, out, err) = curl(vec![
        "-sS".to_string(),
        "--max-time".into(),
        "30".into(),
        "--http1.1".into(),
        "-x".into(),
        proxy.url(),
        "--cacert".into(),
        ca_cert.display().to_string(),
        "-H".into(),
        "Expect:".into(),
        "--data-binary".into(),
        format!("@{}", upload.display()),
        "-w".into(),
        " %{http_code}".into(),
        format!("https://{}/upload", up.addr),
    ])
    .await;
    assert!(ok && out == "secure hello 200", "HTTP/1.1: {out} {err}");

    let tls = h2_tunnel(proxy.addr, &ca_cert, up.addr).await;
    let (send, conn) = h2::client::handshake(tls).await.unwrap();
    tokio::spawn(conn);
    let mut send = send.ready().await.unwrap();
    let req = http::Request::post(format!("https://{}/upload", up.addr))
        .body(())
        .unwrap();
    let (resp, mut stream) = send.send_request(req, false).unwrap();
    // Sends for as long as the window lets it, until the stream is reset.
    let upload = tokio::spawn(async move {
        let mut sent = 0usize;
        loop {
            stream.reserve_capacity(1 << 14);
            let room = std::future::poll_fn(|cx| match stream.poll_reset(cx) {
                std::task::Poll::Ready(reset) => std::task::Poll::Ready(Err(reset)),
                std::task::Poll::Pending => stream.poll_capacity(cx).map(Ok),
            })
            .await;
            match room {
                Ok(Some(Ok(n))) => {
                    let chunk = bytes::Bytes::from(vec![b'x'; n]);
                    if let Err(e) = stream.send_data(chunk, false) {
                        return (sent, Err(e));
                    }
                    sent += n;
                }
                Ok(other) => panic!("the window failed without a reset: {other:?}"),
                Err(reset) => return (sent, reset),
            }
        }
    });
    let resp = tokio::time::timeout(Duration::from_secs(10), resp)
        .await
        .expect("answered while the upload goes on")
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let mut got = Vec::new();
    while let Some(chunk) = body.data().await {
        got.extend_from_slice(&chunk.unwrap());
    }
    assert_eq!(got, b"secure hello");
    let (sent, reset) = tokio::time::timeout(Duration::from_secs(10), upload)
        .await
        .expect("the stream is reset after its answer")
        .unwrap();
    eprintln!("HTTP/2: {sent} bytes sent before the reset {reset:?}");
    assert_eq!(reset.ok(), Some(h2::Reason::NO_ERROR));
    assert!(sent < 8 << 20, "{sent}");
}
