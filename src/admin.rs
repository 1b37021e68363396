//! The admin listener, separate from the proxy port so it can be firewalled apart. Probes,
//! metrics and the status page (`/livez`, `/healthz`, `/readyz`, `/metrics`, `/` and its
//! feed `/status.json`) answer whoever reaches it: kubelet and Prometheus come from
//! outside the pod, and the page shows nothing the metrics do not. The endpoints that change or reveal
//! state (`POST /reload`, `/config` with secrets redacted, `/buckets`) answer loopback
//! clients only, unless `admin_control = "any"`: as linkerd's admin server keeps its
//! shutdown endpoint to localhost, so that a listener opened for probes is not also
//! opened for control. `POST /quitquitquit` (a Job's application ending its sidecar)
//! answers loopback clients only, always. A browser on the operator's machine (a `kubectl port-forward`
//! open) is kept out of them too: they answer only a Host of `localhost` or an IP
//! address (a name a page's DNS could point here is refused: DNS rebinding), refuse a
//! request from another origin, and `POST /reload` refuses the content types a form can
//! send without the browser asking first.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use http::header::{self, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::app::App;
use crate::body::{Body, full};
use crate::config::AdminControl;

/// Admin connections served at once from other hosts. The admin listener keeps its own
/// small share of descriptors, so it answers while the proxy is at its cap.
const MAX_ADMIN_CONNECTIONS: usize = 64;
/// Kept for loopback clients (exec probes, `kubectl port-forward`, the operator in the
/// pod) on top of those: remote clients cannot take them.
const LOOPBACK_CONNECTIONS: usize = 16;
/// Connections from one address at once: one client holding connections open cannot
/// take the others' places (kubelet's and Prometheus's come from other addresses).
const PER_PEER: usize = 8;
/// A request head must come within this: probes and scrapes send theirs at once, and a
/// connection left idle frees its place soon.
const HEAD_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// The admin connections open now. A new connection that finds its class (remote or
/// loopback) or its address full takes the place of the connection idle the longest
/// there (connected or answered, and no request since): a probe sends its head at once
/// and is then busy, while connections held idle, however many and from however many
/// addresses, are the first to go. Only when every one is in a request is the new one
/// refused.
#[derive(Default)]
struct Open {
    conns: HashMap<u64, Conn>,
    next: u64,
}

struct Conn {
    peer: IpAddr,
    loopback: bool,
    state: Arc<ConnState>,
}

/// What the connection's task and its requests tell the registry.
struct ConnState {
    /// Milliseconds since `epoch` of the last request's start or end, or of the accept.
    last: AtomicU64,
    /// In a request now: not to be evicted.
    busy: AtomicBool,
    /// Closes the connection when its place is taken.
    evicted: CancellationToken,
}

impl Open {
    /// A place for `peer`, taken from the longest-idle connection if need be; `None` when
    /// every candidate is in a request.
    fn take(&mut self, peer: IpAddr, now_ms: u64) -> Option<(u64, Arc<ConnState>)> {
        let loopback = is_loopback(peer);
        let cap = if loopback {
            LOOPBACK_CONNECTIONS
        } else {
            MAX_ADMIN_CONNECTIONS
        };
        let (mut class, mut mine) = (0, 0);
        for c in self.conns.values() {
            class += usize::from(c.loopback == loopback);
            mine += usize::from(c.peer == peer);
        }
        // Full for the address: one of its own gives way; full for the class: any.
        let evict_from = if mine >= PER_PEER {
            Some(Some(peer))
        } else if class >= cap {
            Some(None)
        } else {
            None
        };
        if let Some(only) = evict_from {
            let victim = self
                .conns
                .iter()
                .filter(|(_, c)| c.loopback == loopback && only.is_none_or(|p| c.peer == p))
                .filter(|(_, c)| !c.state.busy.load(Ordering::Acquire))
                .min_by_key(|(_, c)| c.state.last.load(Ordering::Relaxed))
                .map(|(id, _)| *id)?;
            if let Some(c) = self.conns.remove(&victim) {
                c.state.evicted.cancel();
            }
        }
        let id = self.next;
        self.next += 1;
        let state = Arc::new(ConnState {
            last: AtomicU64::new(now_ms),
            busy: AtomicBool::new(false),
            evicted: CancellationToken::new(),
        });
        self.conns.insert(
            id,
            Conn {
                peer,
                loopback,
                state: state.clone(),
            },
        );
        Some((id, state))
    }

    fn give_back(&mut self, id: u64) {
        self.conns.remove(&id);
    }
}

/// Marks a connection busy for the life of one request.
struct InRequest<'a> {
    state: &'a ConnState,
    epoch: tokio::time::Instant,
}

impl<'a> InRequest<'a> {
    fn start(state: &'a ConnState, epoch: tokio::time::Instant) -> Self {
        state.busy.store(true, Ordering::Release);
        state.last.store(ms_since(epoch), Ordering::Relaxed);
        InRequest { state, epoch }
    }
}

impl Drop for InRequest<'_> {
    fn drop(&mut self) {
        self.state
            .last
            .store(ms_since(self.epoch), Ordering::Relaxed);
        self.state.busy.store(false, Ordering::Release);
    }
}

fn ms_since(epoch: tokio::time::Instant) -> u64 {
    u64::try_from(epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
}

/// Serves admin requests until `stop` is cancelled.
pub(crate) async fn serve(app: Arc<App>, listener: TcpListener, stop: CancellationToken) {
    let open = Arc::new(parking_lot::Mutex::new(Open::default()));
    let epoch = tokio::time::Instant::now();
    loop {
        let (stream, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(error = %e, "admin accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = stop.cancelled() => return,
        };
        let Some((id, state)) = open.lock().take(peer.ip(), ms_since(epoch)) else {
            continue;
        };
        let app = app.clone();
        let stop = stop.clone();
        let open = open.clone();
        tokio::spawn(async move {
            let in_svc = state.clone();
            let svc = service_fn(move |req| {
                let app = app.clone();
                let state = in_svc.clone();
                async move {
                    let _busy = InRequest::start(&state, epoch);
                    Ok::<_, Infallible>(handle(&app, &req, peer.ip()).await)
                }
            });
            let conn = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEAD_TIMEOUT)
                .serve_connection(TokioIo::new(stream), svc);
            tokio::select! {
                _ = conn => {}
                _ = stop.cancelled() => {}
                _ = state.evicted.cancelled() => {}
            }
            open.lock().give_back(id);
        });
    }
}

/// Endpoints that change or reveal state: `admin_control` says who may use them.
const CONTROL: [&str; 3] = ["/reload", "/config", "/buckets"];

/// The status page: plain HTML, CSS and a little JavaScript, all in this one file,
/// which polls `/status.json` once a second.
const STATUS_PAGE: &str = include_str!("status.html");

/// Partitions shown per upstream on the status page; the rest are counted.
const BUSIEST: usize = 5;

/// Label `name`'s value on each series of `vec` whose value is 1, by its `upstream`
/// (and `family`, empty when it has none) label: the state gauges.
fn states(vec: &prometheus::IntGaugeVec, name: &str) -> HashMap<(String, String), String> {
    use prometheus::core::Collector;
    let mut out = HashMap::new();
    for mf in vec.collect() {
        for m in mf.get_metric() {
            if m.get_gauge().get_value() != 1.0 {
                continue;
            }
            let (u, f, v) = crate::status::labels(m, name);
            out.insert((u.to_string(), f.to_string()), v.to_string());
        }
    }
    out
}

/// What the status page shows, bounded whatever the number of partitions: per upstream
/// and family the configured limits, the last minutes from the sampled history, the
/// breaker; the few partitions with the most waiting; the process's own facts.
fn status_feed(app: &App) -> serde_json::Value {
    use serde_json::json;
    let config = app.config();
    let breakers = states(&app.metrics.breaker_state, "state");
    let family_breakers = states(&app.metrics.family_breaker_state, "state");
    let cluster = states(&app.metrics.cluster_mode, "mode")
        .into_values()
        .next();
    let shares = app.limiter.adaptive_shares();
    let mut busiest = app.limiter.busiest(BUSIEST);
    let upstreams: Vec<serde_json::Value> = config
        .upstreams
        .iter()
        .map(|u| {
            let families = u
                .families
                .iter()
                .map(|f| (f.name.as_str(), &f.limits[..], f.adaptive.is_some(), f.tenant.is_some()))
                .chain([("-", &[][..], u.adaptive.is_some(), false)])
                .map(|(name, limits, adapts, tenants)| {
                    let mut v = app
                        .status
                        .summary(&u.name, name)
                        .unwrap_or_else(|| json!({}));
                    if let Some(o) = v.as_object_mut() {
                        o.insert("family".into(), name.into());
                        o.insert(
                            "limits".into(),
                            limits.iter().map(|l| l.to_string()).collect::<Vec<_>>().into(),
                        );
                        o.insert("tenants".into(), tenants.into());
                        if adapts {
                            let share = shares
                                .get(&(Arc::from(u.name.as_str()), name.to_string()))
                                .copied()
                                .unwrap_or(1.0);
                            o.insert("adaptive_rate_ratio".into(), share.into());
                        }
                        let breaker = family_breakers.get(&(u.name.clone(), name.to_string()));
                        o.insert("breaker".into(), breaker.cloned().into());
                    }
                    v
                })
                .collect::<Vec<_>>();
            let (partitions, others) = busiest.remove(u.name.as_str()).unwrap_or_default();
            json!({
                "name": u.name,
                "limits": u.limits.iter().map(|l| l.to_string()).collect::<Vec<_>>(),
                "learn": u.learn,
                "breaker": breakers.get(&(u.name.clone(), String::new())).map_or("closed", |s| s.as_str()),
                "families": families,
                "partitions": partitions,
                "other_partitions": others,
            })
        })
        .collect();
    json!({
        "version": env!("CARGO_PKG_VERSION"),
        "revision": crate::metrics::REVISION,
        "uptime_seconds": app.status.started.elapsed().as_secs(),
        "config": {
            "path": app.config_path().map(|p| p.display().to_string()),
            "sha256": config.digest,
            "last_reload": app.status.last_reload_public(),
        },
        "cluster": cluster,
        "upstreams": upstreams,
        "unmatched": app.status.summary("unmatched", "-"),
    })
}

/// The configured and effective rate of each upstream that has one, and its partitions
/// pacing to a learned budget, as of this scrape (series of removed upstreams go).
fn rates(app: &App) {
    let m = &app.metrics;
    let config = app.config();
    let paces = app.limiter.learned_paces();
    let shares = app.limiter.adaptive_shares();
    m.configured_rate.reset();
    m.effective_rate.reset();
    m.learned_partitions.reset();
    m.adaptive_share.reset();
    m.upstream_partitions.reset();
    m.max_partitions.reset();
    let live = app.limiter.live_partitions();
    for u in &config.upstreams {
        let configured = u
            .limits
            .iter()
            .filter_map(|l| l.rate_per_second())
            .min_by(f64::total_cmp);
        let l = [u.name.as_str()];
        let n = live.get(u.name.as_str()).copied().unwrap_or(0);
        m.upstream_partitions
            .with_label_values(&l)
            .set(i64::try_from(n).unwrap_or(i64::MAX));
        if u.key.is_some() {
            let cap = crate::limit::max_partitions(u);
            m.max_partitions
                .with_label_values(&l)
                .set(i64::try_from(cap).unwrap_or(i64::MAX));
        }
        if let Some(c) = configured {
            m.configured_rate.with_label_values(&l).set(c);
        }
        let learned = paces.get(u.name.as_str());
        let effective = match (configured, learned) {
            (Some(c), Some((pace, _))) => Some(c.min(*pace)),
            (c, l) => c.or(l.map(|(pace, _)| *pace)),
        };
        if let Some(e) = effective {
            m.effective_rate.with_label_values(&l).set(e);
        }
        let adaptive = u
            .families
            .iter()
            .map(|f| (f.name.as_str(), f.adaptive))
            .chain([(
                "-",
                u.adaptive
                    .filter(|_| u.limits.iter().any(|l| l.rate_per_second().is_some())),
            )]);
        for (family, a) in adaptive {
            if a.is_some() {
                let share = shares
                    .get(&(Arc::from(u.name.as_str()), family.to_string()))
                    .copied()
                    .unwrap_or(1.0);
                m.adaptive_share
                    .with_label_values(&[u.name.as_str(), family])
                    .set(share);
            }
        }
        if u.learn == crate::config::Learn::Headers {
            let n = learned.map_or(0, |(_, n)| *n);
            m.learned_partitions
                .with_label_values(&l)
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
    }
}

fn is_loopback(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_loopback(),
        IpAddr::V6(v6) => {
            v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
    }
}

/// Whether a Host header's value names this listener in a way no page can make a browser
/// send through DNS: `localhost` or an IP literal, with or without a port.
fn host_is_literal(host: &str) -> bool {
    let port_ok = |p: &str| p.parse::<u16>().is_ok();
    if let Some(rest) = host.strip_prefix('[') {
        return rest.split_once(']').is_some_and(|(v6, tail)| {
            v6.parse::<std::net::Ipv6Addr>().is_ok()
                && (tail.is_empty() || tail.strip_prefix(':').is_some_and(port_ok))
        });
    }
    let name = match host.rsplit_once(':') {
        Some((name, port)) if port_ok(port) => name,
        Some(_) => return false,
        None => host,
    };
    name.eq_ignore_ascii_case("localhost") || name.parse::<std::net::Ipv4Addr>().is_ok()
}

/// Why a control request that may come from a browser page is refused, if it is.
fn browser_refusal(req: &Request<Incoming>) -> Option<(StatusCode, String)> {
    let text = |name: header::HeaderName| req.headers().get(name).and_then(|v| v.to_str().ok());
    let host = text(header::HOST);
    if let Some(h) = host
        && !host_is_literal(h)
    {
        return Some((
            StatusCode::FORBIDDEN,
            "control endpoints answer a Host of localhost or an IP address only\n".into(),
        ));
    }
    // A page of this very listener sends its own origin; any other is another site's.
    if let Some(origin) = text(header::ORIGIN)
        && host.is_none_or(|h| origin != format!("http://{h}"))
    {
        return Some((
            StatusCode::FORBIDDEN,
            "control endpoints refuse requests from another origin\n".into(),
        ));
    }
    let simple = [
        "application/x-www-form-urlencoded",
        "multipart/form-data",
        "text/plain",
    ];
    if req.uri().path() == "/reload"
        && let Some(ct) = text(header::CONTENT_TYPE)
        && simple.iter().any(|s| {
            ct.split(';')
                .next()
                .is_some_and(|t| t.trim().eq_ignore_ascii_case(s))
        })
    {
        return Some((
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "POST /reload takes no body: send it without a form content type\n".into(),
        ));
    }
    None
}

pub(crate) async fn handle(
    app: &Arc<App>,
    req: &Request<Incoming>,
    peer: IpAddr,
) -> Response<Body> {
    let get = req.method() == Method::GET || req.method() == Method::HEAD;
    let path = req.uri().path();
    if CONTROL.contains(&path)
        && let Some((status, why)) = browser_refusal(req)
    {
        return reply(status, "text/plain", why);
    }
    if CONTROL.contains(&path)
        && app.config().proxy.admin_control == AdminControl::Loopback
        && !is_loopback(peer)
    {
        return reply(
            StatusCode::FORBIDDEN,
            "text/plain",
            format!(
                "{path} answers loopback clients only (admin_control = \"loopback\"): use it \
                 from inside the pod or through kubectl port-forward, or set \
                 admin_control = \"any\"\n"
            ),
        );
    }
    if path == "/reload" {
        return reload(app, req.method()).await;
    }
    if path == "/quitquitquit" {
        return quit(app, req, peer);
    }
    match (req.uri().path(), get) {
        ("/metrics", true) => metrics(app),
        // Liveness: the process answers. Nothing it depends on (upstreams, Redis) is
        // asked, so a restart is never triggered by what a restart cannot fix.
        ("/livez" | "/healthz", true) => reply(StatusCode::OK, "text/plain", "ok\n".into()),
        ("/readyz", true) if app.is_draining() => reply(
            StatusCode::SERVICE_UNAVAILABLE,
            "text/plain",
            "draining\n".into(),
        ),
        ("/readyz", true) => reply(StatusCode::OK, "text/plain", "ready\n".into()),
        ("/config", true) => config_view(app),
        ("/buckets", true) => {
            let (v, omitted) = app.limiter.snapshot();
            let mut r = json(&v);
            // Past a thousand partitions the list keeps the busiest of each upstream.
            if omitted > 0 {
                r.headers_mut()
                    .insert("sluice-partitions-omitted", HeaderValue::from(omitted));
            }
            r
        }
        ("/", true) => status_page(),
        ("/status.json", true) => json(&status_feed(app)),
        (
            "/metrics" | "/livez" | "/healthz" | "/readyz" | "/config" | "/buckets" | "/"
            | "/status.json",
            false,
        ) => {
            let mut r = reply(
                StatusCode::METHOD_NOT_ALLOWED,
                "text/plain",
                "use GET\n".into(),
            );
            r.headers_mut()
                .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
            r
        }
        _ => reply(
            StatusCode::NOT_FOUND,
            "text/plain",
            "not found; try /metrics /livez /healthz /readyz /config /buckets, POST /reload, \
             POST /quitquitquit\n"
                .into(),
        ),
    }
}

/// `/metrics`, with the gauges read at scrape time brought up to date first.
fn metrics(app: &App) -> Response<Body> {
    let replay = i64::try_from(app.replay_budget.used()).unwrap_or(i64::MAX);
    app.metrics.replay_bytes.set(replay);
    let open = app
        .client_connections
        .load(std::sync::atomic::Ordering::Relaxed);
    app.metrics
        .client_connections
        .set(i64::try_from(open).unwrap_or(i64::MAX));
    let upstream = app.resolver.upstream_connections();
    app.metrics
        .upstream_connections
        .set(i64::try_from(upstream).unwrap_or(i64::MAX));
    rates(app);
    reply(
        StatusCode::OK,
        "text/plain; version=0.0.4",
        app.metrics.render(),
    )
}

/// `/config`: the config in force, secrets redacted, with the addresses bound.
fn config_view(app: &App) -> Response<Body> {
    let mut v = app.config().to_redacted_json();
    if let (Some((proxy, admin)), Some(obj)) = (app.listening.get(), v.as_object_mut()) {
        obj.insert(
            "listening".into(),
            serde_json::json!({ "proxy": proxy.to_string(), "admin": admin.to_string() }),
        );
    }
    json(&v)
}

/// `/`: the status page, which loads nothing from elsewhere.
fn status_page() -> Response<Body> {
    let mut r = reply(
        StatusCode::OK,
        "text/html; charset=utf-8",
        STATUS_PAGE.into(),
    );
    r.headers_mut().insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
             connect-src 'self'; img-src data:",
        ),
    );
    r
}

/// `POST /quitquitquit`: the application in the pod has finished (a Job's, beside a
/// sidecar that Kubernetes does not stop for it), so sluice drains and exits 0, as on
/// SIGTERM but without the shutdown delay. Loopback clients only, whatever
/// `admin_control` says: stopping the proxy is for the pod's own containers, and the
/// browser checks of the control endpoints apply.
fn quit(app: &App, req: &Request<Incoming>, peer: IpAddr) -> Response<Body> {
    if let Some((status, why)) = browser_refusal(req) {
        return reply(status, "text/plain", why);
    }
    if !is_loopback(peer) {
        return reply(
            StatusCode::FORBIDDEN,
            "text/plain",
            "/quitquitquit answers loopback clients only: the pod's own containers\n".into(),
        );
    }
    if req.method() != Method::POST {
        let mut r = reply(
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain",
            "use POST\n".into(),
        );
        r.headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static("POST"));
        return r;
    }
    tracing::info!("POST /quitquitquit: the application has finished; shutting down");
    app.quit.cancel();
    reply(StatusCode::OK, "text/plain", "stopping\n".into())
}

/// `POST /reload`: 200 with what changed, or 400 with why the file was refused.
async fn reload(app: &Arc<App>, method: &Method) -> Response<Body> {
    if method != Method::POST {
        let mut r = reply(
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain",
            "use POST\n".into(),
        );
        r.headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static("POST"));
        return r;
    }
    match crate::reload::reload(app).await {
        Ok(summary) => json(&serde_json::to_value(&summary).unwrap_or_default()),
        Err(error) => {
            let mut r = json(&serde_json::json!({ "error": error }));
            *r.status_mut() = StatusCode::BAD_REQUEST;
            r
        }
    }
}

fn json(v: &serde_json::Value) -> Response<Body> {
    let text =
        serde_json::to_string_pretty(v).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"));
    reply(StatusCode::OK, "application/json", text + "\n")
}

fn reply(status: StatusCode, content_type: &'static str, body: String) -> Response<Body> {
    let mut r = Response::new(full(body));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    /// Places go to newcomers at the expense of the longest idle, per address and per
    /// class, and never at the expense of a connection in a request.
    #[test]
    fn a_newcomer_takes_the_place_of_the_longest_idle() {
        let mut open = Open::default();
        // 8 remote addresses with 8 idle connections each: the remote class is full.
        let mut t = 0;
        for a in 1..=8 {
            for _ in 0..PER_PEER {
                t += 1;
                assert!(open.take(ip(&format!("10.0.0.{a}")), t).is_some());
            }
        }
        // A kubelet from a ninth address gets in, and the oldest idle one goes.
        let (kubelet, _) = open.take(ip("10.0.1.1"), 1000).unwrap();
        assert_eq!(open.conns.len(), MAX_ADMIN_CONNECTIONS);
        assert!(
            !open
                .conns
                .values()
                .any(|c| c.state.last.load(Ordering::Relaxed) == 1)
        );
        assert!(open.conns.contains_key(&kubelet));
        // Loopback has places of its own: a probe from the pod is not a remote's victim.
        for _ in 0..PER_PEER {
            assert!(open.take(ip("127.0.0.1"), 1001).is_some());
        }
        // Its address full: a probe from 127.0.0.1 displaces one of 127.0.0.1's own.
        let before: Vec<u64> = open.conns.keys().copied().collect();
        let (probe, _) = open.take(ip("127.0.0.1"), 1002).unwrap();
        let gone: Vec<&u64> = before
            .iter()
            .filter(|id| !open.conns.contains_key(id))
            .collect();
        assert_eq!(gone.len(), 1);
        assert!(open.conns.contains_key(&probe));
        // Every connection in a request: the newcomer is refused, nothing is evicted.
        for c in open.conns.values() {
            c.state.busy.store(true, Ordering::Release);
        }
        assert!(open.take(ip("10.0.2.1"), 2000).is_none());
        assert!(open.take(ip("127.0.0.1"), 2000).is_none());
        // An idle loopback connection is not taken for a remote newcomer.
        let idle = open
            .conns
            .values()
            .find(|c| c.loopback)
            .unwrap()
            .state
            .clone();
        idle.busy.store(false, Ordering::Release);
        assert!(open.take(ip("10.0.2.1"), 2001).is_none());
        assert!(!idle.evicted.is_cancelled());
    }
}
