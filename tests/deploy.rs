//! How sluice behaves run the way a pod runs it: listeners from the environment, probes
//! and metrics open to the pod network, control endpoints kept to loopback.

use sluice_test_support as support;

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
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sluice.toml");
    // The file says loopback; the environment opens both listeners on every address.
    std::fs::write(
        &path,
        "[proxy]\nlisten = \"127.0.0.1:1\"\nadmin = \"127.0.0.1:2\"\n",
    )
    .unwrap();
    // `:0` as the manifests write it (`:9901`): every address of every family.
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"));
    command
        .env("SLUICE_LISTEN", ":0")
        .env("SLUICE_ADMIN", ":0")
        .env("SLUICE_LOG_FORMAT", "json");
    let mut sluice = Sluice::spawn_shell(command, &["run", "-c", path.to_str().unwrap()]);
    let (port, admin) = sluice.listening().await;
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
    assert_eq!(config["proxy"]["admin"], "*:0", "as the environment set it");
    assert_eq!(
        config["listening"]["admin"],
        format!("[::]:{admin}"),
        "and as bound: one socket for both families"
    );
    assert_eq!(config["listening"]["proxy"], format!("[::]:{port}"));
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

/// Whether `/readyz` answers on `ip:port`.
async fn answers(ip: &str, port: u16) -> bool {
    crypto();
    let ip: IpAddr = ip.parse().unwrap();
    let url = format!("http://{}/readyz", std::net::SocketAddr::new(ip, port));
    reqwest::get(url).await.is_ok_and(|r| r.status() == 200)
}

/// Each way to write a listener binds and answers on the families it names: one
/// address, an IPv4 or IPv6 wildcard, and `:PORT`, every family (what the manifests
/// use, so that one manifest works on IPv4-only, IPv6-only and dual-stack clusters).
#[tokio::test]
async fn every_listen_form_binds_and_answers_on_its_families() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sluice.toml");
    std::fs::write(&path, "[proxy]\nlisten = \"127.0.0.1:0\"\n").unwrap();
    let path = path.to_str().unwrap();
    // (form, bound as, reached on, not reached on)
    let cases: [(&str, &str, &[&str], &[&str]); 5] = [
        ("127.0.0.1:0", "127.0.0.1", &["127.0.0.1"], &["::1"]),
        ("[::1]:0", "[::1]", &["::1"], &["127.0.0.1"]),
        ("0.0.0.0:0", "0.0.0.0", &["127.0.0.1"], &["::1"]),
        ("[::]:0", "[::]", &["::1"], &[]),
        (":0", "[::]", &["127.0.0.1", "::1"], &[]),
    ];
    for (form, bound, reached, not_reached) in cases {
        let mut sluice = Sluice::spawn(&["run", "-c", path, "--admin", form]);
        let (_, admin) = sluice.listening().await;
        let line = sluice.log_lines("listening").join("\n");
        assert!(
            line.contains(&format!("admin={bound}:{admin}")),
            "{form}: {line}"
        );
        for ip in reached {
            assert!(answers(ip, admin).await, "{form}: /readyz on {ip}");
        }
        for ip in not_reached {
            assert!(!answers(ip, admin).await, "{form}: nothing on {ip}");
        }
        sluice.signal("TERM");
        assert_eq!(sluice.exit().await.0, Some(0), "{form}");
    }
}

/// Where the kernel has no IPv6 at all (booted with `ipv6.disable=1`: every IPv6 socket
/// is refused with EAFNOSUPPORT), `:PORT` listens on IPv4 and says so, while an IPv6
/// address written out fails to bind with the address named. The refusal comes from a
/// shim preloaded in front of libc's socket(), which answers for AF_INET6 exactly what
/// such a kernel answers.
#[tokio::test]
async fn without_ipv6_every_family_means_ipv4() {
    let dir = tempfile::tempdir().unwrap();
    let shim = dir.path().join("no_ipv6.c");
    std::fs::write(
        &shim,
        "#define _GNU_SOURCE\n#include <dlfcn.h>\n#include <errno.h>\n#include <sys/socket.h>\n\
         int socket(int domain, int type, int protocol) {\n\
           static int (*real)(int, int, int);\n\
           if (!real) real = (int (*)(int, int, int))dlsym(RTLD_NEXT, \"socket\");\n\
           if (domain == AF_INET6) { errno = EAFNOSUPPORT; return -1; }\n\
           return real(domain, type, protocol);\n}\n",
    )
    .unwrap();
    let so = dir.path().join("no_ipv6.so");
    let built = std::process::Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(&so)
        .arg(&shim)
        .arg("-ldl")
        .status()
        .expect("a C compiler (cc) builds the shim");
    assert!(built.success());
    let path = dir.path().join("sluice.toml");
    std::fs::write(&path, "[proxy]\nlisten = \"127.0.0.1:0\"\n").unwrap();
    let path = path.to_str().unwrap();
    let without_ipv6 = || {
        let mut c = std::process::Command::new(binary());
        c.env("LD_PRELOAD", &so);
        c
    };

    let mut sluice = Sluice::spawn_shell(without_ipv6(), &["run", "-c", path, "--admin", ":0"]);
    let (_, admin) = sluice.listening().await;
    assert!(answers("127.0.0.1", admin).await);
    let line = sluice.log_lines("listening").join("\n");
    assert!(line.contains(&format!("admin=0.0.0.0:{admin}")), "{line}");
    assert_eq!(sluice.log_lines("no IPv6 here").len(), 1);
    sluice.signal("TERM");
    assert_eq!(sluice.exit().await.0, Some(0));

    let sluice = Sluice::spawn_shell(without_ipv6(), &["run", "-c", path, "--admin", "[::]:0"]);
    let (code, log) = sluice.exit().await;
    assert_ne!(code, Some(0));
    let log = log.join("\n");
    assert!(
        log.contains("cannot listen on [::]:0 (admin listener)"),
        "{log}"
    );
}

/// IPv6 turned off the way a pod's network may have it (the interfaces' disable_ipv6,
/// in a network namespace of its own): the kernel still has the family, so `:PORT`
/// binds its one socket and IPv4 clients reach it. Needs root for the namespace, as CI
/// has.
#[tokio::test]
async fn with_ipv6_disabled_on_the_interfaces_every_family_still_answers_ipv4() {
    if !is_root() {
        eprintln!("skipped: a network namespace needs root");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sluice.toml");
    std::fs::write(&path, "[proxy]\nlisten = \"127.0.0.1:0\"\n").unwrap();
    let mut unshare = std::process::Command::new("unshare");
    unshare.args([
        "--net",
        "sh",
        "-c",
        "ip link set lo up && sysctl -qw net.ipv6.conf.all.disable_ipv6=1 \
         net.ipv6.conf.default.disable_ipv6=1 net.ipv6.conf.lo.disable_ipv6=1 && \
         exec \"$0\" \"$@\"",
    ]);
    unshare.arg(binary());
    let mut sluice = Sluice::spawn_shell(
        unshare,
        &["run", "-c", path.to_str().unwrap(), "--admin", ":0"],
    );
    let (_, admin) = sluice.listening().await;
    // From inside its namespace, with the same client a classic sidecar's hook runs.
    let ready = std::process::Command::new("nsenter")
        .args(["--net", "--target", &sluice.pid().to_string()])
        .arg(binary())
        .args([
            "wait-ready",
            "--admin",
            &format!(":{admin}"),
            "--timeout",
            "10s",
        ])
        .output()
        .unwrap();
    assert!(
        ready.status.success(),
        "{}",
        String::from_utf8_lossy(&ready.stderr)
    );
    assert!(
        String::from_utf8_lossy(&ready.stderr).contains(&format!("127.0.0.1:{admin}")),
        "asked on IPv4 loopback"
    );
    sluice.signal("TERM");
    assert_eq!(sluice.exit().await.0, Some(0));
}

/// admin_control = "any" opens the control endpoints to every client of the listener.
#[tokio::test]
async fn admin_control_any_opens_control_to_the_network() {
    crypto();
    let pod_ip = non_loopback_address().expect("an address other than loopback");
    let dir = tempfile::tempdir().unwrap();
    let path = binary_config(dir.path(), "admin_control = \"any\"");
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"));
    command.env("SLUICE_ADMIN", "0.0.0.0:0");
    let mut sluice = Sluice::spawn_shell(command, &["run", "-c", path.to_str().unwrap()]);
    let (_, admin) = sluice.listening().await;
    assert!(sluice.ready(admin).await);
    let url = format!("http://{pod_ip}:{admin}/config");
    assert_eq!(status(reqwest::Method::GET, &url).await, 200);
    sluice.signal("TERM");
    sluice.exit().await;
}

/// What a platform team's dashboards expect next to sluice's own series: the process's
/// CPU, memory, descriptors and start time, and which build is running.
#[tokio::test]
async fn metrics_carry_the_process_and_the_build() {
    let proxy = Proxy::start("").await;
    let m = proxy.metrics().await;
    for series in [
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
        "process_open_fds",
        "process_max_fds",
        "process_start_time_seconds",
    ] {
        let v = metric(&m, series).unwrap_or_else(|| panic!("{series}: {m}"));
        assert!(v >= 0.0, "{series} {v}");
    }
    assert!(metric(&m, "process_resident_memory_bytes").unwrap() > 1e6);
    let build = format!(
        "sluice_build_info{{revision=\"{}\",version=\"{}\"}}",
        sluice::REVISION,
        env!("CARGO_PKG_VERSION")
    );
    assert_eq!(metric(&m, &build), Some(1.0), "{m}");
}

/// A directory laid out as the image and a pod give it, for the binary run as uid 65532.
struct ImageRoot {
    _root: tempfile::TempDir,
    dir: std::path::PathBuf,
    bin: std::path::PathBuf,
}

fn set_mode(p: &std::path::Path, m: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap()
}

impl ImageRoot {
    fn new() -> ImageRoot {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().to_path_buf();
        set_mode(&dir, 0o755);
        // The binary, where the image has it. Copied by `cp`, not `std::fs::copy`: a
        // copy made here holds a writable descriptor that a child forked by a test on
        // another thread inherits until its exec, and while any process holds one,
        // executing the file fails with ETXTBSY. `cp` has exited before we exec.
        let bin = dir.join("sluice");
        let cp = std::process::Command::new("cp")
            .arg(env!("CARGO_BIN_EXE_sluice"))
            .arg(&bin)
            .status()
            .unwrap();
        assert!(cp.success(), "cp: {cp}");
        set_mode(&bin, 0o755);
        ImageRoot {
            _root: root,
            dir,
            bin,
        }
    }

    /// Where a TLS test upstream keeps its certificates, readable by uid 65532.
    fn upstream_dir(&self) -> std::path::PathBuf {
        let d = self.dir.join("upstream");
        std::fs::create_dir(&d).unwrap();
        set_mode(&d, 0o755);
        d
    }

    /// The image's config with `extra`, read-only, as a ConfigMap directory gives it.
    fn config(&self, extra: &str) -> std::path::PathBuf {
        let etc = self.dir.join("etc");
        std::fs::create_dir(&etc).unwrap();
        let base = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/config/container.toml"
        ))
        .unwrap();
        let config = etc.join("sluice.toml");
        std::fs::write(&config, format!("{base}\n{extra}")).unwrap();
        set_mode(&config, 0o444);
        set_mode(&etc, 0o555);
        config
    }

    /// The binary as uid and gid 65532, with 65532 as its supplementary group (a pod's
    /// fsGroup), listening on loopback ports.
    async fn run(&self, config: &std::path::Path) -> (Sluice, u16) {
        let mut command = std::process::Command::new("setpriv");
        command
            .args(["--reuid", "65532", "--regid", "65532", "--groups", "65532"])
            .arg(&self.bin)
            .env("SLUICE_CONFIG", config)
            .env("SLUICE_LISTEN", "127.0.0.1:0")
            .env("SLUICE_ADMIN", "127.0.0.1:0")
            .current_dir(&self.dir);
        let mut sluice = Sluice::spawn_shell(command, &["run"]);
        let (port, admin) = sluice.listening().await;
        assert!(sluice.ready(admin).await, "started as uid 65532");
        let status = std::fs::read_to_string(format!("/proc/{}/status", sluice.pid())).unwrap();
        assert!(
            status
                .lines()
                .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("65532")),
            "{status}"
        );
        (sluice, port)
    }
}

/// An HTTPS request through the proxy on `port` to `up`, trusting only `roots` (PEM).
async fn intercepted(port: u16, up: &support::certs::TlsUpstream, roots: &[u8]) -> String {
    let client = reqwest::Client::builder()
        .proxy(reqwest::Proxy::all(format!("http://127.0.0.1:{port}")).unwrap())
        .tls_certs_only(reqwest::Certificate::from_pem_bundle(roots).unwrap())
        .build()
        .unwrap();
    let r = client
        .get(format!("https://{}/through", up.addr))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.text().await.unwrap()
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// The image's promise, kept without a container engine: the binary runs as uid 65532
/// (distroless `nonroot`) with the supplementary group a pod's `fsGroup` gives, its config
/// read-only, and the interception CA in the layout a Secret volume gives (`..data`
/// symlinks, the key 0440 owned by root and the fsGroup). It starts, proxies, intercepts
/// HTTPS for a client that trusts that CA, and drains on SIGTERM. Changing uid needs
/// root: CI runs as root.
#[tokio::test]
async fn runs_as_the_image_does_non_root_read_only_with_a_secret_mounted_ca() {
    use std::os::unix::fs::{chown, symlink};
    crypto();
    if !is_root() {
        eprintln!("skipped: changing to uid 65532 needs root");
        return;
    }
    let up = Upstream::start().await;
    let image = ImageRoot::new();
    let dir = &image.dir;
    let tls_up = support::certs::tls_upstream(&image.upstream_dir()).await;
    // The CA as a Secret volume lays it out: files in a timestamped directory, `..data`
    // pointing at it, each name a link through `..data`.
    let made = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(&image.bin)
        .args(["ca", "new", "--out"])
        .arg(made.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let secret = dir.join("ca");
    let stamp = secret.join("..2026_12_01_00_00_00.000000001");
    std::fs::create_dir_all(&stamp).unwrap();
    for name in ["ca.pem", "ca-key.pem"] {
        std::fs::copy(made.path().join(name), stamp.join(name)).unwrap();
        chown(stamp.join(name), Some(0), Some(65532)).unwrap();
        set_mode(&stamp.join(name), 0o440);
        symlink(format!("..data/{name}"), secret.join(name)).unwrap();
    }
    symlink(stamp.file_name().unwrap(), secret.join("..data")).unwrap();
    set_mode(&stamp, 0o755);
    set_mode(&secret, 0o755);
    let config = image.config(&format!(
        "[tls]\nca_cert = \"{ca}/ca.pem\"\nca_key = \"{ca}/ca-key.pem\"\n\
         [[upstream]]\nname = \"api\"\nhosts = [\"127.0.0.1:{port}\"]\n\
         [[upstream]]\nname = \"secure\"\nhosts = [\"127.0.0.1:{tls_port}\"]\ntls = \"intercept\"\n\
         upstream_ca = {upstream_ca:?}\n",
        ca = secret.display(),
        port = up.addr.port(),
        tls_port = tls_up.addr.port(),
        upstream_ca = tls_up.ca_path,
    ));

    let (sluice, port) = image.run(&config).await;
    let r = client_via(port)
        .get(up.url("/through"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let ca = std::fs::read(made.path().join("ca.pem")).unwrap();
    assert_eq!(intercepted(port, &tls_up, &ca).await, "secure hello");
    sluice.signal("TERM");
    let (code, log) = sluice.exit().await;
    assert_eq!(code, Some(0), "{log:?}");

    // A key others can read (a Secret's default mode, 0644) is still refused.
    set_mode(&stamp.join("ca-key.pem"), 0o644);
    let out = std::process::Command::new(&image.bin)
        .args(["run", "-c"])
        .arg(&config)
        .env("SLUICE_LISTEN", "127.0.0.1:0")
        .env("SLUICE_ADMIN", "127.0.0.1:0")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("defaultMode"), "{err}");

    // A Secret volume without fsGroup: the key is root's, 0400, and uid 65532 cannot
    // read it. The refusal names fsGroup.
    chown(stamp.join("ca-key.pem"), Some(0), Some(0)).unwrap();
    set_mode(&stamp.join("ca-key.pem"), 0o400);
    let out = std::process::Command::new("setpriv")
        .args(["--reuid", "65532", "--regid", "65532", "--clear-groups"])
        .arg(&image.bin)
        .args(["run", "-c"])
        .arg(&config)
        .env("SLUICE_LISTEN", "127.0.0.1:0")
        .env("SLUICE_ADMIN", "127.0.0.1:0")
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("permission denied") && err.contains("fsGroup") && err.contains("uid 0"),
        "{err}"
    );
}

/// The pod without hand-made certificates: sluice, as uid 65532 with a read-only config,
/// makes its CA at start and writes the trust bundle into a volume it shares with the
/// application (an emptyDir owned by the fsGroup); a client that trusts only that bundle
/// gets intercepted HTTPS through.
#[tokio::test]
async fn runs_as_the_image_does_with_a_generated_ca_and_a_shared_trust_volume() {
    use std::os::unix::fs::chown;
    crypto();
    if !is_root() {
        eprintln!("skipped: changing to uid 65532 needs root");
        return;
    }
    let image = ImageRoot::new();
    let tls_up = support::certs::tls_upstream(&image.upstream_dir()).await;
    let trust = image.dir.join("trust");
    std::fs::create_dir(&trust).unwrap();
    chown(&trust, Some(0), Some(65532)).unwrap();
    set_mode(&trust, 0o2775);
    let config = image.config(&format!(
        "[tls]\ngenerate_ca = true\ntrust_dir = {trust:?}\n\
         [[upstream]]\nname = \"secure\"\nhosts = [\"127.0.0.1:{}\"]\ntls = \"intercept\"\n\
         upstream_ca = {:?}\n",
        tls_up.addr.port(),
        tls_up.ca_path,
    ));
    let (sluice, port) = image.run(&config).await;
    let bundle = std::fs::read(trust.join("ca-bundle.pem")).unwrap();
    assert_eq!(intercepted(port, &tls_up, &bundle).await, "secure hello");
    sluice.signal("TERM");
    let (code, log) = sluice.exit().await;
    assert_eq!(code, Some(0), "{log:?}");
}

/// Every metric the alert rules and the dashboard in deploy/monitoring-rules name exists in
/// sluice's /metrics, once traffic has made each series appear: a renamed metric breaks
/// this test, not a team's alerts in production.
#[tokio::test]
async fn the_monitoring_names_only_metrics_sluice_exports() {
    let up = Upstream::start().await;
    let no_redis = closed_port().await;
    let proxy = Proxy::start(&format!(
        "[[upstream]]\nname = \"api\"\nhosts = [\"127.0.0.1:{}\"]\nmax_queue = 1\n\
         retry = {{ max_attempts = 2, backoff = {{ base = \"10ms\", max = \"20ms\" }} }}\n\
         limits = [{{ kind = \"concurrency\", max = 1 }}]\n\
         [[upstream.family]]\nname = \"all\"\npaths = [\"/**\"]\nbreaker = {{ min_requests = 100 }}\n\
         [cluster]\nredis = \"redis://127.0.0.1:{}\"\non_redis_error = \"local\"\nreplicas = 2\n",
        up.addr.port(),
        // Shared limits whose Redis is not there: sluice_cluster_mode says "local".
        no_redis.port()
    ))
    .await;
    let client = proxy.client();
    // A retry, a provider 429, and a queue that overflows.
    assert_eq!(
        client
            .get(up.url("/seq/r/503,200"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    client.get(up.url("/status/429")).send().await.unwrap();
    let burst: Vec<_> = (0..3)
        .map(|_| client.get(up.url("/slow/300")).send())
        .collect();
    let statuses: Vec<u16> = futures_util::future::join_all(burst)
        .await
        .into_iter()
        .map(|r| r.unwrap().status().as_u16())
        .collect();
    assert!(statuses.contains(&429), "{statuses:?}");
    // A reload that fails (this proxy has no file).
    proxy.admin_post("/reload").await;
    let exported = proxy.metrics().await;

    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/monitoring-rules");
    let mut used = std::collections::BTreeSet::new();
    for file in ["prometheusrule.yaml", "dashboard.json"] {
        let text = std::fs::read_to_string(dir.join(file)).unwrap();
        for (i, _) in text
            .match_indices("sluice_")
            .chain(text.match_indices("process_"))
        {
            let name: String = text[i..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            // Prose such as "sluice_<reason>" names no metric.
            if !name.ends_with('_') {
                used.insert(name);
            }
        }
    }
    assert!(used.len() >= 10, "{used:?}");
    let missing: Vec<&String> = used
        .iter()
        .filter(|name| {
            !exported
                .lines()
                .any(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
        })
        .collect();
    assert!(
        missing.is_empty(),
        "not in /metrics: {missing:?}\n{exported}"
    );

    // And every label a selector names on them. Target labels are Prometheus's (job,
    // namespace, pod) and the PodMonitor's (workload); `le` is a histogram's.
    let target = ["job", "namespace", "pod", "workload", "le"];
    let mut wrong = Vec::new();
    for file in ["prometheusrule.yaml", "dashboard.json", "rules-test.yaml"] {
        let text = std::fs::read_to_string(dir.join(file))
            .unwrap()
            .replace("\\\"", "\"");
        for (i, _) in text.match_indices("sluice_") {
            let name: String = text[i..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            let Some(selector) = text[i + name.len()..].strip_prefix('{') else {
                continue;
            };
            let selector = &selector[..selector.find('}').unwrap_or(0)];
            for label in selector
                .split(',')
                .filter_map(|m| m.split(['=', '!']).next())
                .map(str::trim)
                .filter(|l| !l.is_empty() && !target.contains(l))
            {
                let has = exported.lines().any(|l| {
                    l.starts_with(&format!("{name}{{")) && l.contains(&format!("{label}=\""))
                });
                if !has {
                    wrong.push(format!("{file}: {name} has no label {label}"));
                }
            }
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
}

/// SLUICE_SHUTDOWN_DELAY, for a sidecar that gets SIGTERM together with its application:
/// not ready at once, yet still accepting and proxying for the delay, then gone.
#[tokio::test]
async fn the_shutdown_delay_from_the_environment_keeps_serving_after_sigterm() {
    crypto();
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let path = binary_config(
        dir.path(),
        &format!(
            "[[upstream]]\nname = \"api\"\nhosts = [\"127.0.0.1:{}\"]\n",
            up.addr.port()
        ),
    );
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"));
    command.env("SLUICE_SHUTDOWN_DELAY", "5s");
    let mut sluice = Sluice::spawn_shell(command, &["run", "-c", path.to_str().unwrap()]);
    let (port, admin) = sluice.listening().await;
    assert!(sluice.ready(admin).await);
    let started = tokio::time::Instant::now();
    sluice.signal("TERM");
    let readyz = format!("http://127.0.0.1:{admin}/readyz");
    assert!(
        eventually(std::time::Duration::from_secs(1), || async {
            reqwest::get(&readyz).await.is_ok_and(|r| r.status() == 503)
        })
        .await,
        "not ready after SIGTERM"
    );
    // A new client connection, after SIGTERM, within the delay.
    let r = client_via(port)
        .get(up.url("/after-term"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(started.elapsed() < std::time::Duration::from_secs(5));
    let (code, _) = sluice.exit().await;
    assert_eq!(code, Some(0));
    assert!(
        started.elapsed() >= std::time::Duration::from_secs(5),
        "waited the delay"
    );
}

/// A Job's application beside the classic sidecar: nothing stops sluice when the
/// application ends, so the pod never completes unless the application says so. `POST
/// /quitquitquit` from inside the pod (curl, as a Job's command would run it) drains
/// and exits 0 without waiting out the shutdown delay; from the pod network it is
/// refused, whatever `admin_control` says, and a GET changes nothing.
#[tokio::test]
async fn a_job_ends_its_classic_sidecar_with_quitquitquit() {
    crypto();
    let pod_ip = non_loopback_address()
        .expect("this machine has an address other than loopback, as a pod has");
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sluice.toml");
    std::fs::write(
        &path,
        format!(
            "[proxy]\nlisten = \"127.0.0.1:0\"\nadmin_control = \"any\"\n\
             [egress]\nallow = [\"127.0.0.0/8\"]\n\
             [[upstream]]\nname = \"api\"\nhosts = [\"127.0.0.1:{}\"]\n",
            up.addr.port()
        ),
    )
    .unwrap();
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"));
    command
        .env("SLUICE_SHUTDOWN_DELAY", "30s")
        .env("SLUICE_ADMIN", ":0");
    let mut sluice = Sluice::spawn_shell(command, &["run", "-c", path.to_str().unwrap()]);
    let (port, admin) = sluice.listening().await;
    assert!(sluice.ready(admin).await);
    let r = client_via(port).get(up.url("/work")).send().await.unwrap();
    assert_eq!(r.status(), 200);

    let outside = format!("http://{pod_ip}:{admin}/quitquitquit");
    assert_eq!(status(reqwest::Method::POST, &outside).await, 403);
    let inside = format!("http://127.0.0.1:{admin}/quitquitquit");
    assert_eq!(status(reqwest::Method::GET, &inside).await, 405);
    assert!(sluice.ready(admin).await, "still serving");

    let started = tokio::time::Instant::now();
    let curl = tokio::process::Command::new("curl")
        .args(["-sS", "-f", "-X", "POST", &inside])
        .output()
        .await
        .unwrap();
    assert!(curl.status.success(), "{curl:?}");
    assert_eq!(String::from_utf8_lossy(&curl.stdout), "stopping\n");
    let (code, log) = sluice.exit().await;
    assert_eq!(code, Some(0), "{log:#?}");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(20),
        "the 30 s shutdown delay is not waited out: {:?}",
        started.elapsed()
    );
    assert!(log.iter().any(|l| l.contains("quitquitquit")), "{log:#?}");
}

/// The image's baked config, used when a pod mounts none, is no relay for anyone outside
/// the pod: its proxy listens on loopback only (the application beside it shares that),
/// while probes and metrics stay reachable on every address of every family.
#[test]
fn the_image_config_is_no_open_relay() {
    let text = include_str!("../config/container.toml");
    let c = sluice::Config::parse(text, "container.toml").unwrap();
    assert!(c.proxy.listen.is_loopback(), "{}", c.proxy.listen);
    assert_eq!(c.proxy.admin, sluice::ListenAddr::AnyFamily(9901));
}
