//! Test fixtures on 127.0.0.1:0: a scripted upstream that records what reaches it, a TCP
//! echo server for tunnels, the proxy started in-process or as the real binary, a raw
//! HTTP/1.1 client for the cases well-behaved clients never send, and a config directory
//! updated the way the kubelet updates a mounted ConfigMap. Shared by the integration
//! tests (`use sluice_test_support as support;`) and the benchmark drivers in examples/.

pub mod bench;
pub mod certs;
pub mod provider;
pub mod redis;
pub mod upstream;

use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use sluice::BoxError;
use sluice::Lookup;
use sluice::{App, Config, Server};

/// reqwest's TLS needs a process-wide rustls provider; sluice itself uses ring.
pub fn crypto() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// What the upstream saw of one request.
#[derive(Debug, Clone)]
pub struct Seen {
    pub at: tokio::time::Instant,
    pub method: String,
    pub uri: String,
    pub version: http::Version,
    pub headers: Vec<(String, String)>,
}

impl Seen {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// A hyper server answering by path:
/// `/echo` streams the request body back; `/inspect/...` answers JSON describing the
/// request (method, path, query, fields, body length and SHA-256); `/read` reads the whole body, then answers its
/// length (400 if it broke); `/chunked/N` sends N chunks without a length;
/// `/big/N` sends N KiB; `/status/NNN` answers that status; `/slow/MS` waits before answering; `/drip/N/MS`
/// sends N chunks MS milliseconds apart; anything else
/// answers 200 `hello`. Every response carries hop-by-hop fields sluice must strip.
pub struct Upstream {
    pub addr: SocketAddr,
    pub seen: Arc<Mutex<Vec<Seen>>>,
    pub connections: Arc<AtomicUsize>,
    task: tokio::task::AbortHandle,
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

type TestBody = http_body_util::combinators::BoxBody<Bytes, BoxError>;

impl Upstream {
    pub async fn start() -> Upstream {
        Upstream::serve(None).await
    }

    /// The same server on a thread and runtime of its own. A provider is another
    /// machine: the instant it stamps on an arrival must not wait for the test's own
    /// clients to yield a worker thread.
    pub async fn start_apart() -> Upstream {
        let (tx, rx) = oneshot::channel();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let (addr, seen, connections, accept) = Upstream::accept_loop(None, false).await;
                let task = tokio::spawn(accept);
                let _ = tx.send(Upstream {
                    addr,
                    seen,
                    connections,
                    task: task.abort_handle(),
                });
                // Until the `Upstream` is dropped, which aborts the loop.
                let _ = task.await;
            });
        });
        rx.await.unwrap()
    }

    /// The same server behind TLS with `config` (HTTP/2 or 1.1 by ALPN).
    pub async fn start_tls(config: Arc<rustls::ServerConfig>) -> Upstream {
        Upstream::serve(Some(tokio_rustls::TlsAcceptor::from(config))).await
    }

    /// The same server in plain text speaking HTTP/1.1 or, to a client that starts with
    /// the HTTP/2 preface, h2c (prior knowledge), as gRPC servers do.
    pub async fn start_h2c() -> Upstream {
        let (addr, seen, connections, accept) = Upstream::accept_loop(None, true).await;
        Upstream {
            addr,
            seen,
            connections,
            task: tokio::spawn(accept).abort_handle(),
        }
    }

    async fn serve(tls: Option<tokio_rustls::TlsAcceptor>) -> Upstream {
        let (addr, seen, connections, accept) = Upstream::accept_loop(tls, false).await;
        Upstream {
            addr,
            seen,
            connections,
            task: tokio::spawn(accept).abort_handle(),
        }
    }

    /// A bound listener and the loop that serves it, not yet spawned.
    async fn accept_loop(
        tls: Option<tokio_rustls::TlsAcceptor>,
        h2c: bool,
    ) -> (
        SocketAddr,
        Arc<Mutex<Vec<Seen>>>,
        Arc<AtomicUsize>,
        impl std::future::Future<Output = ()> + Send + 'static,
    ) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let connections = Arc::new(AtomicUsize::new(0));
        let (s, c) = (seen.clone(), connections.clone());
        let accept = async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                c.fetch_add(1, Ordering::SeqCst);
                let (s, tls) = (s.clone(), tls.clone());
                tokio::spawn(async move {
                    let svc = service_fn(move |req| {
                        let s = s.clone();
                        async move { Ok::<_, Infallible>(respond(req, &s).await) }
                    });
                    match tls {
                        None if h2c => {
                            let _ = hyper_util::server::conn::auto::Builder::new(
                                hyper_util::rt::TokioExecutor::new(),
                            )
                            .serve_connection(TokioIo::new(stream), svc)
                            .await;
                        }
                        None => {
                            let _ = http1::Builder::new()
                                .serve_connection(TokioIo::new(stream), svc)
                                .await;
                        }
                        Some(acceptor) => {
                            let Ok(stream) = acceptor.accept(stream).await else {
                                return;
                            };
                            let _ = hyper_util::server::conn::auto::Builder::new(
                                hyper_util::rt::TokioExecutor::new(),
                            )
                            .serve_connection(TokioIo::new(stream), svc)
                            .await;
                        }
                    }
                });
            }
        };
        (addr, seen, connections, accept)
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().clone()
    }
}

async fn respond(req: Request<Incoming>, seen: &Mutex<Vec<Seen>>) -> Response<TestBody> {
    seen.lock().push(Seen {
        at: tokio::time::Instant::now(),
        method: req.method().to_string(),
        uri: req.uri().to_string(),
        version: req.version(),
        headers: req
            .headers()
            .iter()
            .map(|(k, v)| {
                (
                    k.to_string(),
                    String::from_utf8_lossy(v.as_bytes()).into_owned(),
                )
            })
            .collect(),
    });
    let path = req.uri().path().to_string();
    let head_only = req.method() == http::Method::HEAD;
    let mut parts = path.trim_start_matches('/').splitn(2, '/');
    let (head, arg) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let mut resp = match head {
        "echo" => Response::new(req.into_body().map_err(Into::into).boxed()),
        "inspect" => {
            // What arrived, as JSON: method, path, query, fields, and the body's length
            // and SHA-256.
            use sha2::Digest;
            let (parts, body) = req.into_parts();
            let body = body
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            let headers: serde_json::Map<String, serde_json::Value> = parts
                .headers
                .iter()
                .map(|(k, v)| (k.to_string(), String::from_utf8_lossy(v.as_bytes()).into()))
                .collect();
            let digest: String = sha2::Sha256::digest(&body)
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect();
            let v = serde_json::json!({
                "method": parts.method.as_str(),
                "path": parts.uri.path(),
                "query": parts.uri.query(),
                "version": format!("{:?}", parts.version),
                "headers": headers,
                "body_len": body.len(),
                "body_sha256": digest,
            });
            let mut r = Response::new(
                Full::new(Bytes::from(v.to_string()))
                    .map_err(|n| match n {})
                    .boxed(),
            );
            r.headers_mut()
                .insert("content-type", "application/json".parse().unwrap());
            r
        }
        "read" => match req.into_body().collect().await {
            Ok(b) => Response::new(
                Full::new(Bytes::from(b.to_bytes().len().to_string()))
                    .map_err(|n| match n {})
                    .boxed(),
            ),
            Err(_) => {
                let mut r = text("broken body");
                *r.status_mut() = StatusCode::BAD_REQUEST;
                r
            }
        },
        "chunked" => {
            let n: usize = arg.parse().unwrap_or(3);
            let chunks =
                (0..n).map(|i| Ok::<_, BoxError>(Frame::data(Bytes::from(format!("chunk-{i};")))));
            Response::new(BodyExt::boxed(StreamBody::new(futures_util::stream::iter(
                chunks,
            ))))
        }
        "big" => {
            // N KiB in 64 KiB chunks, made as they are read.
            let kib: usize = arg.parse().unwrap_or(1024);
            let chunk = Bytes::from(vec![b'x'; 64 * 1024]);
            let chunks = futures_util::stream::iter(
                (0..kib.div_ceil(64)).map(move |_| Ok::<_, BoxError>(Frame::data(chunk.clone()))),
            );
            Response::new(BodyExt::boxed(StreamBody::new(chunks)))
        }
        "drip" => {
            let (n, gap) = arg.split_once('/').unwrap_or(("3", "100"));
            let (n, gap): (u64, u64) = (n.parse().unwrap_or(3), gap.parse().unwrap_or(100));
            let chunks = futures_util::stream::unfold(0, move |i| async move {
                if i == n {
                    return None;
                }
                tokio::time::sleep(Duration::from_millis(gap)).await;
                Some((
                    Ok::<_, BoxError>(Frame::data(Bytes::from(format!("drip-{i};")))),
                    i + 1,
                ))
            });
            Response::new(BodyExt::boxed(StreamBody::new(chunks)))
        }
        "seq" => {
            // Like most APIs, it reads the request before it answers: an answer before the
            // body has arrived is another scenario (sluice relays it at once).
            let _ = req.into_body().collect().await;
            // Its turn among the requests for this path: by path, since over HTTP/2 the
            // URI is in absolute form. Counted here only: a scan of every request seen
            // would make a test of thousands of requests quadratic.
            let nth = seen
                .lock()
                .iter()
                .filter(|x| {
                    x.uri
                        .parse::<http::Uri>()
                        .is_ok_and(|u| u.path() == path.as_str())
                })
                .count();
            return scripted(arg, nth).await;
        }
        "status" => {
            let mut r = text("status");
            *r.status_mut() = StatusCode::from_u16(arg.parse().unwrap_or(500)).unwrap();
            r
        }
        "slow" => {
            tokio::time::sleep(Duration::from_millis(arg.parse().unwrap_or(100))).await;
            text("slow")
        }
        _ => text("hello"),
    };
    // No content for HEAD, 204 and 304, as RFC 9110 says (HTTP/2 clients check).
    if head_only || matches!(resp.status().as_u16(), 204 | 304) {
        *resp.body_mut() = Full::new(Bytes::new()).map_err(|n| match n {}).boxed();
    }
    let h = resp.headers_mut();
    h.insert("connection", "x-upstream-private".parse().unwrap());
    h.insert("x-upstream-private", "secret-hop".parse().unwrap());
    h.insert("keep-alive", "timeout=30".parse().unwrap());
    h.insert("x-upstream", "yes".parse().unwrap());
    resp
}

/// `/seq/NAME/STEP,STEP,...`: the n-th request to that path plays step n (the last one
/// repeats). A step is a status with optional suffixes: `ra2` adds `Retry-After: 2`,
/// `date2` adds `Retry-After` as an HTTP date 2 s after the response's `Date`, `cap` a
/// JSON body saying a lifetime cap is reached. The step `hang` never answers.
async fn scripted(arg: &str, nth: usize) -> Response<TestBody> {
    let steps: Vec<&str> = arg
        .split_once('/')
        .map_or("200", |(_, s)| s)
        .split(',')
        .collect();
    let step = steps[(nth.max(1) - 1).min(steps.len() - 1)];
    if step == "hang" {
        tokio::time::sleep(Duration::from_secs(3600)).await;
    }
    let digits: String = step.chars().take_while(|c| c.is_ascii_digit()).collect();
    let rest = &step[digits.len()..];
    let body = if rest == "cap" {
        r#"{"error": {"code": "unverified_count_cap", "message": "lifetime cap reached"}}"#
    } else {
        "scripted"
    };
    let mut r = Response::new(Full::new(Bytes::from(body)).map_err(|n| match n {}).boxed());
    *r.status_mut() = StatusCode::from_u16(digits.parse().unwrap_or(200)).unwrap();
    let now = std::time::SystemTime::now();
    if let Some(secs) = rest.strip_prefix("ra") {
        r.headers_mut().insert("retry-after", secs.parse().unwrap());
    }
    if let Some(secs) = rest.strip_prefix("date") {
        let at = now + Duration::from_secs(secs.parse().unwrap());
        r.headers_mut()
            .insert("date", httpdate::fmt_http_date(now).parse().unwrap());
        r.headers_mut()
            .insert("retry-after", httpdate::fmt_http_date(at).parse().unwrap());
    }
    r
}

fn text(s: &'static str) -> Response<TestBody> {
    Response::new(
        Full::new(Bytes::from_static(s.as_bytes()))
            .map_err(|n| match n {})
            .boxed(),
    )
}

/// A CONNECT to `target` through the proxy at `proxy`, answered 200, on a plain TCP
/// stream; nothing past the answer's head is read.
pub async fn connect_tunnel(proxy: SocketAddr, target: impl std::fmt::Display) -> TcpStream {
    let mut s = TcpStream::connect(proxy).await.unwrap();
    s.write_all(format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        assert_eq!(s.read(&mut b).await.unwrap(), 1, "the proxy answers");
        head.push(b[0]);
    }
    assert!(
        head.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&head)
    );
    s
}

/// A WebSocket server that sends every message back, over TLS when `tls` is given.
pub async fn ws_echo(tls: Option<std::sync::Arc<rustls::ServerConfig>>) -> SocketAddr {
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
                            ws_echo_one(s).await;
                        }
                    }
                    None => ws_echo_one(tcp).await,
                }
            });
        }
    });
    addr
}

async fn ws_echo_one<S>(s: S)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let Ok(mut ws) = tokio_tungstenite::accept_async(s).await else {
        return;
    };
    while let Some(Ok(m)) = futures_util::StreamExt::next(&mut ws).await {
        if (m.is_text() || m.is_binary()) && futures_util::SinkExt::send(&mut ws, m).await.is_err()
        {
            return;
        }
    }
}

/// A TCP server that echoes every byte back, for tunnels.
pub async fn echo_server() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    addr
}

/// A port that refuses connections for as long as this lives.
///
/// A released port goes back to the kernel's pool: the next `bind(0)`, often the proxy's
/// own listener, can take it, and the "closed" upstream becomes sluice itself. A socket
/// bound without `listen` holds the port (no `SO_REUSEADDR`, so nothing else can bind it)
/// while connections to it are refused.
pub struct ClosedPort {
    pub addr: SocketAddr,
    _held: tokio::net::TcpSocket,
}

impl ClosedPort {
    pub fn port(&self) -> u16 {
        self.addr.port()
    }
}

impl std::fmt::Display for ClosedPort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.addr.fmt(f)
    }
}

pub async fn closed_port() -> ClosedPort {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    ClosedPort {
        addr: socket.local_addr().unwrap(),
        _held: socket,
    }
}

/// sluice running in-process on free ports.
pub struct Proxy {
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    pub app: Arc<App>,
    stop: Option<oneshot::Sender<()>>,
    pub task: Option<JoinHandle<()>>,
}

/// Test upstreams live on loopback, which the egress rules refuse unless an upstream names
/// them: tests that do not test those rules allow loopback and any CONNECT port.
pub fn test_config(extra: &str) -> String {
    let egress = if extra.contains("[egress]") {
        ""
    } else {
        "[egress]\nallow = [\"127.0.0.0/8\", \"::1\"]\nconnect_ports = [\"1-65535\"]\n"
    };
    format!("[proxy]\nlisten = \"127.0.0.1:0\"\nadmin = \"127.0.0.1:0\"\n{extra}\n{egress}")
}

impl Proxy {
    /// `extra` is appended to a config that listens on 127.0.0.1:0.
    pub async fn start(extra: &str) -> Proxy {
        Proxy::start_with(extra, None).await
    }

    pub async fn start_with(extra: &str, lookup: Option<Arc<dyn Lookup>>) -> Proxy {
        crypto();
        let text = test_config(extra);
        let config = Config::parse(&text, "test.toml").unwrap_or_else(|e| panic!("{e}"));
        let mut builder = App::builder(config);
        if let Some(l) = lookup {
            builder = builder.lookup(l);
        }
        Proxy::serve(builder.build().unwrap()).await
    }

    /// From a config file, which reloads read again (and a watcher follows).
    pub async fn from_file(path: &std::path::Path) -> Proxy {
        crypto();
        let config = Config::load(path).unwrap_or_else(|e| panic!("{e}"));
        Proxy::serve(App::builder(config).path(path).build().unwrap()).await
    }

    /// Served thread-per-core on `workers`, as the binary does.
    pub async fn on_workers(extra: &str, workers: &sluice::Workers) -> Proxy {
        crypto();
        let text = test_config(extra);
        let config = Config::parse(&text, "test.toml").unwrap_or_else(|e| panic!("{e}"));
        let app = App::builder(config).build().unwrap();
        let server = Server::bind(app.clone())
            .await
            .unwrap()
            .serve_on(workers.handles());
        Proxy::serving(app, server)
    }

    async fn serve(app: Arc<App>) -> Proxy {
        let server = Server::bind(app.clone()).await.unwrap();
        Proxy::serving(app, server)
    }

    fn serving(app: Arc<App>, server: Server) -> Proxy {
        let (addr, admin) = (server.proxy_addr(), server.admin_addr());
        let (tx, rx) = oneshot::channel();
        let task = tokio::spawn(server.run(async {
            let _ = rx.await;
        }));
        Proxy {
            addr,
            admin,
            app,
            stop: Some(tx),
            task: Some(task),
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A reqwest client that sends everything through this proxy.
    pub fn client(&self) -> reqwest::Client {
        reqwest::Client::builder()
            .proxy(reqwest::Proxy::all(self.url()).unwrap())
            .build()
            .unwrap()
    }

    /// Starts the shutdown sequence; await `task` to see it finish.
    pub fn shutdown(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
    }

    pub async fn admin_get(&self, path: &str) -> (u16, String) {
        let resp = reqwest::get(format!("http://{}{}", self.admin, path))
            .await
            .unwrap();
        (resp.status().as_u16(), resp.text().await.unwrap())
    }

    pub async fn metrics(&self) -> String {
        self.admin_get("/metrics").await.1
    }

    pub async fn admin_post(&self, path: &str) -> (u16, String) {
        let resp = reqwest::Client::new()
            .post(format!("http://{}{}", self.admin, path))
            .send()
            .await
            .unwrap();
        (resp.status().as_u16(), resp.text().await.unwrap())
    }
}

/// The value of the sample `series` (name and labels exactly as exported), if present.
/// Waits (up to 10 s) until `series` in the proxy's metrics reaches `at_least`.
pub async fn metric_reaches(proxy: &Proxy, series: &str, at_least: f64) -> bool {
    eventually(Duration::from_secs(10), || async {
        metric(&proxy.metrics().await, series).is_some_and(|v| v >= at_least)
    })
    .await
}

pub fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// Polls `f` every 20 ms until it holds or `within` has passed.
pub async fn eventually<F, Fut>(within: Duration, mut f: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let end = tokio::time::Instant::now() + within;
    loop {
        if f().await {
            return true;
        }
        if tokio::time::Instant::now() >= end {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A directory laid out and updated as the kubelet does for a mounted ConfigMap: the
/// files live in a timestamped directory, `..data` points at it, and each visible file is
/// a symlink through `..data`. An update writes a new timestamped directory, points a
/// `..data_tmp` symlink at it, renames that over `..data` (the atomic step), and removes
/// the old directory.
pub struct ConfigMapDir {
    pub dir: std::path::PathBuf,
    generation: u32,
}

impl ConfigMapDir {
    pub fn new(dir: &std::path::Path, file: &str, content: &str) -> ConfigMapDir {
        let mut c = ConfigMapDir {
            dir: dir.to_path_buf(),
            generation: 0,
        };
        c.update(file, content);
        std::os::unix::fs::symlink(format!("..data/{file}"), dir.join(file)).unwrap();
        c
    }

    pub fn path(&self, file: &str) -> std::path::PathBuf {
        self.dir.join(file)
    }

    pub fn update(&mut self, file: &str, content: &str) {
        self.generation += 1;
        let ts = format!("..2026_12_01_00_00_00.{:09}", self.generation);
        let new = self.dir.join(&ts);
        std::fs::create_dir(&new).unwrap();
        std::fs::write(new.join(file), content).unwrap();
        let old = std::fs::read_link(self.dir.join("..data")).ok();
        let tmp = self.dir.join("..data_tmp");
        std::os::unix::fs::symlink(&ts, &tmp).unwrap();
        std::fs::rename(&tmp, self.dir.join("..data")).unwrap();
        if let Some(old) = old {
            std::fs::remove_dir_all(self.dir.join(old)).unwrap();
        }
    }
}

/// `command` run with `args` and `env` (and `RUST_LOG=info`), its stderr a pipe handed to
/// the caller, killed when the returned guard drops.
pub fn piped(
    mut command: std::process::Command,
    args: &[&str],
    env: &[(&str, &str)],
) -> (std::process::Child, std::process::ChildStderr, KillOnDrop) {
    let mut child = command
        .args(args)
        .env("RUST_LOG", "info")
        .envs(env.iter().copied())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let reaper = KillOnDrop(child.id());
    let stderr = child.stderr.take().unwrap();
    (child, stderr, reaper)
}

/// The real `sluice` binary, run with `args`; its stderr is collected line by line.
/// The `sluice` binary cargo built beside the running test or example: cargo builds a
/// package's binaries before its integration tests and examples, into the directory
/// above their own (`target/<profile>/deps/`, `target/<profile>/examples/`).
/// `CARGO_BIN_EXE_sluice` would say the same but is set only while compiling the test
/// crate itself, not this one.
pub fn binary() -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("the test's own path");
    let mut dir = exe.parent().expect("the test's directory").to_path_buf();
    if dir.ends_with("deps") || dir.ends_with("examples") {
        dir.pop();
    }
    let bin = dir.join(format!("sluice{}", std::env::consts::EXE_SUFFIX));
    assert!(bin.exists(), "{} is not built", bin.display());
    bin
}

pub struct Sluice {
    child: std::process::Child,
    /// Reads stderr into `lines` until the process closes it.
    log: Option<std::thread::JoinHandle<()>>,
    /// Every line so far: a test may look before the process ends.
    lines: Arc<parking_lot::Mutex<Vec<String>>>,
    /// The proxy and admin ports from the "listening" line, once.
    listening: Option<tokio::sync::oneshot::Receiver<(u16, u16)>>,
    // Declared last: if an assertion fails first, the binary must not outlive the test.
    _reaper: KillOnDrop,
}

impl Sluice {
    pub fn spawn(args: &[&str]) -> Sluice {
        Sluice::spawn_command(std::process::Command::new(binary()), args)
    }

    /// Runs with the open-file limit (soft and hard) set to `nofile`, through the shell's
    /// `ulimit`; the shell execs the binary, so the PID is sluice's.
    pub fn spawn_with_nofile(nofile: u32, args: &[&str]) -> Sluice {
        let mut sh = std::process::Command::new("sh");
        sh.arg("-c")
            .arg(format!("ulimit -n {nofile} && exec \"$0\" \"$@\""))
            .arg(binary());
        Sluice::spawn_command(sh, args)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Runs `command` (a shell that execs the binary) with `args`.
    pub fn spawn_shell(command: std::process::Command, args: &[&str]) -> Sluice {
        Sluice::spawn_command(command, args)
    }

    fn spawn_command(command: std::process::Command, args: &[&str]) -> Sluice {
        use std::io::BufRead;
        let (child, stderr, reaper) = piped(command, args, &[]);
        let (tx, rx) = tokio::sync::oneshot::channel();
        let so_far: Arc<parking_lot::Mutex<Vec<String>>> = Arc::default();
        let shared = so_far.clone();
        let log = std::thread::spawn(move || {
            let mut tx = Some(tx);
            for line in std::io::BufReader::new(stderr)
                .lines()
                .map_while(Result::ok)
            {
                // The line is kept before the ports are announced, so that a test that
                // has its ports finds the line too.
                let ports = listening_ports(&line);
                shared.lock().push(line);
                if let Some(ports) = ports
                    && let Some(tx) = tx.take()
                {
                    let _ = tx.send(ports);
                }
            }
        });
        Sluice {
            child,
            log: Some(log),
            lines: so_far,
            listening: Some(rx),
            _reaper: reaper,
        }
    }

    /// Its log lines so far that contain `needle`.
    pub fn log_lines(&self, needle: &str) -> Vec<String> {
        self.lines
            .lock()
            .iter()
            .filter(|l| l.contains(needle))
            .cloned()
            .collect()
    }

    /// The ports its listeners bound, from its "listening" line: a config that says port
    /// 0 for both lets the kernel pick, so no test races another process for a port.
    pub async fn listening(&mut self) -> (u16, u16) {
        let rx = self.listening.take().expect("asked once");
        match tokio::time::timeout(Duration::from_secs(30), rx).await {
            Ok(Ok(ports)) => ports,
            _ => panic!("sluice wrote no \"listening\" line within 30 s"),
        }
    }

    /// Waits until `/readyz` on the admin port answers 200.
    pub async fn ready(&self, admin: u16) -> bool {
        let url = format!("http://127.0.0.1:{admin}/readyz");
        eventually(Duration::from_secs(10), || async {
            reqwest::get(&url).await.is_ok_and(|r| r.status() == 200)
        })
        .await
    }

    /// Sends a signal by name (`TERM`, `HUP`, ...).
    pub fn signal(&self, name: &str) {
        let ok = std::process::Command::new("kill")
            .args([&format!("-{name}"), &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(ok.success(), "kill -{name}");
    }

    /// Waits for the exit; returns its code and every log line.
    pub async fn exit(self) -> (Option<i32>, Vec<String>) {
        let Sluice {
            mut child,
            log,
            lines,
            _reaper: reaper,
            ..
        } = self;
        let status = tokio::task::spawn_blocking(move || child.wait().unwrap())
            .await
            .unwrap();
        // It has exited: nothing is left to kill.
        std::mem::forget(reaper);
        if let Some(l) = log {
            l.join().unwrap();
        }
        let log = std::mem::take(&mut *lines.lock());
        (status.code(), log)
    }
}

/// Kills a child process when dropped, so a failed assertion leaves no binary behind.
pub struct KillOnDrop(pub u32);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = std::process::Command::new("kill")
            .args(["-KILL", &self.0.to_string()])
            .status();
    }
}

/// Reads `stderr` up to the "listening" line, byte by byte so that nothing after it is
/// taken from the pipe; the ports it names.
pub fn listening_from(stderr: &mut impl std::io::Read) -> (u16, u16) {
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    loop {
        match stderr.read(&mut byte) {
            Ok(1) if byte[0] == b'\n' => {
                if let Some(ports) = listening_ports(&String::from_utf8_lossy(&line)) {
                    return ports;
                }
                line.clear();
            }
            Ok(1) => line.push(byte[0]),
            _ => panic!("sluice ended before its \"listening\" line"),
        }
    }
}

/// The proxy and admin ports of a "listening" line, in the text or the JSON format.
pub fn listening_ports(line: &str) -> Option<(u16, u16)> {
    if !line.contains("listening") {
        return None;
    }
    let port = |key: &str| -> Option<u16> {
        let at = line
            .find(&format!("{key}="))
            .map(|i| i + key.len() + 1)
            .or_else(|| {
                line.find(&format!("\"{key}\":\""))
                    .map(|i| i + key.len() + 4)
            })?;
        let addr: String = line[at..]
            .chars()
            .take_while(|c| !c.is_whitespace() && *c != '"')
            .collect();
        addr.parse::<std::net::SocketAddr>().ok().map(|a| a.port())
    };
    Some((port("proxy")?, port("admin")?))
}

/// A port no one listens on now, for a process the test starts to bind. Taken below the
/// kernel's ephemeral range (32768-60999 on Linux), from which outgoing connections pick
/// their source ports: a port from bind(":0") is in that range, and under load a client
/// connection could take it between this call and the child's bind. Ports are handed out
/// in turn from a start that differs per process, so parallel tests never get the same.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    const LOW: u32 = 20_000;
    const SPAN: u32 = 12_000;
    static NEXT: std::sync::OnceLock<AtomicU32> = std::sync::OnceLock::new();
    let next = NEXT.get_or_init(|| {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        AtomicU32::new(nanos.wrapping_add(std::process::id().wrapping_mul(7919)))
    });
    // Each probe's listener is closed when the closure returns, before the next one.
    let free = |ip: &str, port: u16| std::net::TcpListener::bind((ip, port)).is_ok();
    for _ in 0..SPAN {
        let port = (LOW + next.fetch_add(1, Ordering::Relaxed) % SPAN) as u16;
        if free("127.0.0.1", port) && free("0.0.0.0", port) {
            return port;
        }
    }
    panic!("no free port in {LOW}..{}", LOW + SPAN)
}

/// Name resolution from a fixed table, to point a name at an address of the test's choice.
pub struct StaticLookup(pub BTreeMap<String, Vec<std::net::IpAddr>>);

impl Lookup for StaticLookup {
    fn lookup(
        &self,
        host: String,
    ) -> std::pin::Pin<
        Box<dyn std::future::Future<Output = std::io::Result<Vec<std::net::IpAddr>>> + Send>,
    > {
        let r = self
            .0
            .get(&host)
            .cloned()
            .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::NotFound, "no such host"));
        Box::pin(async move { r })
    }
}

/// A response read off a raw connection.
#[derive(Debug)]
pub struct RawResponse {
    pub status: u16,
    pub head: String,
    pub body: Vec<u8>,
}

impl RawResponse {
    pub fn header(&self, name: &str) -> Option<String> {
        self.head.lines().skip(1).find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim()
                .eq_ignore_ascii_case(name)
                .then(|| v.trim().to_string())
        })
    }
}

/// Reads one response with a Content-Length (or none, for CONNECT 200) off `stream`.
pub async fn read_response(stream: &mut TcpStream) -> RawResponse {
    let mut buf = Vec::new();
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let mut chunk = [0u8; 4096];
        let n = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut chunk))
            .await
            .expect("response head in time")
            .unwrap();
        assert!(
            n > 0,
            "connection closed before a response head; got {:?}",
            String::from_utf8_lossy(&buf)
        );
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let status = head.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap();
    let mut resp = RawResponse {
        status,
        head,
        body: buf[head_end..].to_vec(),
    };
    if let Some(len) = resp
        .header("content-length")
        .and_then(|l| l.parse::<usize>().ok())
    {
        while resp.body.len() < len {
            let mut chunk = vec![0u8; len - resp.body.len()];
            let n = stream.read(&mut chunk).await.unwrap();
            assert!(n > 0, "body cut short");
            resp.body.extend_from_slice(&chunk[..n]);
        }
    }
    resp
}

/// Reads a response head only: for responses that carry no body (HEAD, 204, 304).
pub async fn read_head(stream: &mut TcpStream) -> RawResponse {
    let mut buf = Vec::new();
    while !buf.ends_with(b"\r\n\r\n") {
        let mut byte = [0u8; 1];
        let n = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut byte))
            .await
            .expect("response head in time")
            .unwrap();
        assert!(n > 0, "connection closed before a response head");
        buf.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&buf).into_owned();
    let status = head.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap();
    RawResponse {
        status,
        head,
        body: Vec::new(),
    }
}

/// Sends raw bytes on a new connection and reads one response.
/// A GET for absolute `url` on an open connection to the proxy, and its response;
/// `close` asks for the connection to end after it.
pub async fn get(s: &mut TcpStream, url: &str, close: bool) -> RawResponse {
    let conn = if close { "Connection: close\r\n" } else { "" };
    let req = format!("GET {url} HTTP/1.1\r\nHost: x\r\n{conn}\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    read_response(s).await
}

pub async fn raw(addr: SocketAddr, request: &[u8]) -> RawResponse {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(request).await.unwrap();
    read_response(&mut s).await
}

/// A body streamed from a channel, for the proxy's request bodies.
pub fn body_channel() -> (
    tokio::sync::mpsc::Sender<Result<Bytes, BoxError>>,
    reqwest::Body,
) {
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let stream =
        futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|c| (c, rx)) });
    (tx, reqwest::Body::wrap_stream(stream))
}

/// A config for the binary on ports the kernel picks (see [`Sluice::listening`]), with
/// `extra` appended.
pub fn binary_config(dir: &std::path::Path, extra: &str) -> std::path::PathBuf {
    let path = dir.join("sluice.toml");
    std::fs::write(
        &path,
        format!(
            "[proxy]\nlisten = \"127.0.0.1:0\"\nadmin = \"127.0.0.1:0\"\n{extra}\n\
             [egress]\nallow = [\"127.0.0.0/8\"]\n"
        ),
    )
    .unwrap();
    path
}

/// A client whose requests go through the proxy on `port`.
pub fn client_via(port: u16) -> reqwest::Client {
    reqwest::Client::builder()
        .proxy(reqwest::Proxy::http(format!("http://127.0.0.1:{port}")).unwrap())
        .build()
        .unwrap()
}

/// The body of an admin endpoint of the binary.
pub async fn admin_text(admin: u16, path: &str) -> String {
    reqwest::get(format!("http://127.0.0.1:{admin}{path}"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}
