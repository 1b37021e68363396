//! HTTPS benchmark driver (run by bench/https.sh): starts a TLS and a plain upstream on
//! loopback, runs the release `sluice` binary with interception, and measures requests
//! per second and latency through it for plain HTTP, intercepted HTTPS over keep-alive
//! connections, and intercepted HTTPS with a new tunnel and TLS handshake per request
//! (leaf certificate cache warm). Targets interleave over several rounds.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair, SanType};
use rustls_pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::net::TcpListener;
use tokio::time::Instant;

const PROXY: &str = "127.0.0.1:13158";
const ADMIN: &str = "127.0.0.1:19931";

async fn serve(listener: TcpListener, tls: Option<tokio_rustls::TlsAcceptor>) {
    loop {
        let Ok((tcp, _)) = listener.accept().await else {
            return;
        };
        let tls = tls.clone();
        tokio::spawn(async move {
            let svc = service_fn(|_req| async {
                Ok::<_, Infallible>(hyper::Response::new(Full::new(Bytes::from_static(
                    b"hello\n",
                ))))
            });
            let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
            match tls {
                Some(a) => {
                    if let Ok(s) = a.accept(tcp).await {
                        let _ = builder.serve_connection(TokioIo::new(s), svc).await;
                    }
                }
                None => {
                    let _ = builder.serve_connection(TokioIo::new(tcp), svc).await;
                }
            }
        });
    }
}

/// 32 tasks send requests for `secs`; returns (req/s, p50 ms, p99 ms).
async fn load(client: reqwest::Client, url: String, secs: u64) -> (f64, f64, f64) {
    let end = Instant::now() + Duration::from_secs(secs);
    let tasks: Vec<_> = (0..32)
        .map(|_| {
            let (c, u) = (client.clone(), url.clone());
            tokio::spawn(async move {
                let mut lat = Vec::new();
                while Instant::now() < end {
                    let t = Instant::now();
                    let r = c
                        .get(&u)
                        .send()
                        .await
                        .unwrap_or_else(|e| panic!("request failed: {e}"));
                    assert_eq!(r.status(), 200);
                    r.bytes()
                        .await
                        .unwrap_or_else(|e| panic!("body failed: {e}"));
                    lat.push(t.elapsed());
                }
                lat
            })
        })
        .collect();
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.expect("task"));
    }
    all.sort();
    let pct =
        |p: f64| all[((all.len() as f64 * p) as usize).min(all.len() - 1)].as_secs_f64() * 1000.0;
    (all.len() as f64 / secs as f64, pct(0.5), pct(0.99))
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

#[tokio::main]
async fn main() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let args: Vec<String> = std::env::args().collect();
    let rounds: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(3);
    let secs: u64 = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(10);
    let sluice = std::env::var("SLUICE_BIN").unwrap_or_else(|_| "target/release/sluice".into());
    let dir = tempfile::tempdir().expect("tempdir");

    // The upstream's own CA and certificate for 127.0.0.1.
    let ca_key = KeyPair::generate().expect("key");
    let mut ca_params = CertificateParams::default();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_cert = ca_params.self_signed(&ca_key).expect("ca");
    let up_ca = dir.path().join("upstream-ca.pem");
    std::fs::write(&up_ca, ca_cert.pem()).expect("write");
    let issuer = Issuer::new(ca_params, ca_key);
    let key = KeyPair::generate().expect("key");
    let mut params = CertificateParams::default();
    params.subject_alt_names = vec![SanType::IpAddress("127.0.0.1".parse().expect("ip"))];
    let cert = params.signed_by(&key, &issuer).expect("leaf");
    let mut server = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("versions")
    .with_no_client_auth()
    .with_single_cert(
        vec![cert.der().clone()],
        PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
    )
    .expect("server config");
    server.alpn_protocols = vec![b"http/1.1".to_vec()];
    let tls_listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let plain_listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let (tls_addr, plain_addr): (SocketAddr, SocketAddr) = (
        tls_listener.local_addr().expect("addr"),
        plain_listener.local_addr().expect("addr"),
    );
    tokio::spawn(serve(
        tls_listener,
        Some(tokio_rustls::TlsAcceptor::from(Arc::new(server))),
    ));
    tokio::spawn(serve(plain_listener, None));

    let (ca, ca_key_path) = sluice::write_new_ca(&dir.path().join("ca")).expect("sluice CA");
    let config = dir.path().join("sluice.toml");
    std::fs::write(
        &config,
        format!(
            "[proxy]\nlisten = \"{PROXY}\"\nadmin = \"{ADMIN}\"\n[tls]\nca_cert = {ca:?}\nca_key = {ca_key_path:?}\n\
             [[upstream]]\nname = \"tls\"\nhosts = [\"{tls_addr}\"]\ntls = \"intercept\"\nupstream_ca = {up_ca:?}\n\
             [[upstream]]\nname = \"plain\"\nhosts = [\"{plain_addr}\"]\n"
        ),
    )
    .expect("config");
    // As users run it: the default log level (an access line per request), stderr read
    // through a pipe in large reads, as a container runtime reads it.
    let mut child = Command::new(&sluice)
        .args(["run", "-c", config.to_str().expect("path")])
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start sluice");
    if let Some(mut stderr) = child.stderr.take() {
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 1 << 16];
            while matches!(std::io::Read::read(&mut stderr, &mut buf), Ok(n) if n > 0) {}
        });
    }
    for _ in 0..100 {
        if reqwest::get(format!("http://{ADMIN}/readyz")).await.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let sluice_ca = reqwest::Certificate::from_pem(&std::fs::read(&ca).expect("ca")).expect("pem");
    let through = |pool: bool| {
        let mut b = reqwest::Client::builder()
            .proxy(reqwest::Proxy::all(format!("http://{PROXY}")).expect("proxy"))
            .tls_certs_only([sluice_ca.clone()])
            .http1_only();
        if !pool {
            b = b.pool_max_idle_per_host(0);
        }
        b.build().expect("client")
    };
    // HTTP/2 by ALPN inside the tunnel: the 32 clients share one connection, as an
    // HTTP/2 client does.
    let through_h2 = reqwest::Client::builder()
        .proxy(reqwest::Proxy::all(format!("http://{PROXY}")).expect("proxy"))
        .tls_certs_only([sluice_ca.clone()])
        .build()
        .expect("client");
    let targets = [
        (
            "plain HTTP through sluice, keep-alive",
            through(true),
            format!("http://{plain_addr}/"),
        ),
        (
            "intercepted HTTPS, keep-alive",
            through(true),
            format!("https://{tls_addr}/"),
        ),
        (
            "intercepted HTTPS over HTTP/2, one connection",
            through_h2,
            format!("https://{tls_addr}/"),
        ),
        (
            "intercepted HTTPS, new tunnel + TLS per request",
            through(false),
            format!("https://{tls_addr}/"),
        ),
    ];
    // Warm the leaf cache and the pools.
    for (_, c, u) in &targets {
        c.get(u).send().await.expect("warm-up");
    }
    let mut results: Vec<Vec<(f64, f64, f64)>> = vec![Vec::new(); targets.len()];
    for round in 0..rounds {
        for (i, (name, c, u)) in targets.iter().enumerate() {
            let r = load(c.clone(), u.clone(), secs).await;
            eprintln!("round {} {name}: {:.0} req/s", round + 1, r.0);
            results[i].push(r);
        }
    }
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let _ = child.wait();

    println!("\n32 concurrent clients, {rounds} rounds × {secs} s interleaved; medians\n");
    println!("| target | req/s | % of plain | p50 ms | p99 ms |");
    println!("| --- | --- | --- | --- | --- |");
    let plain = median(&mut results[0].iter().map(|r| r.0).collect::<Vec<_>>());
    for (i, (name, _, _)) in targets.iter().enumerate() {
        let rps = median(&mut results[i].iter().map(|r| r.0).collect::<Vec<_>>());
        let p50 = median(&mut results[i].iter().map(|r| r.1).collect::<Vec<_>>());
        let p99 = median(&mut results[i].iter().map(|r| r.2).collect::<Vec<_>>());
        println!(
            "| {name} | {rps:.0} | {:.0}% | {p50:.2} | {p99:.2} |",
            rps / plain * 100.0
        );
    }
}
