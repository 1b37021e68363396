//! Absolute-form requests (`GET http://host/path HTTP/1.1`): parse the target, route it,
//! apply the egress rules, rewrite it for the upstream (hop-by-hop fields out, `Host` set
//! to the target), hand it to the pipeline, and relay the answer with its body streamed.

use std::borrow::Cow;
use std::future::Future;
use std::net::IpAddr;

use http::header::{self, HeaderValue};
use http::uri::{Authority, PathAndQuery};
use http::{Method, Request, Response, StatusCode, Uri, Version};
use hyper::body::Incoming;
use tokio::time::Instant;

use super::access::{Record, finish};
use super::error::ProxyError;
use super::headers::{HopByHop, append_via, strip_hop_by_hop, strip_scanned};
use super::lifecycle::Lifecycle;
use super::response::peek;
use super::{discard, pipeline, upgrade};
use crate::app::App;
use crate::app::Live;
use crate::body::{Body, empty, stream};
use crate::config::cost::Price;
use crate::config::{Scheme, Unmatched};
use crate::limit::costs::Costs;
use crate::price::{self, BodyView, Declared};
use crate::route::{Route, authority_parts, normal_host};
use crate::upstream::Way;
use crate::upstream::pinned::{Own, PinnedConns};
use crate::upstream::timer::Timers;

/// Where an absolute-form request is going.
#[derive(Debug, Clone)]
pub(crate) struct Target {
    /// Whether the upstream is reached over TLS (intercepted tunnels, `scheme = "https"`).
    pub(crate) https: bool,
    /// Normalised for routing (see [`Target::host`]).
    host: Normal,
    /// The host's address when it is an IP literal: the egress rules check it before the
    /// request is queued.
    pub(crate) ip: Option<IpAddr>,
    pub(crate) port: u16,
    /// What goes into `Host`: the URI's host and explicit port, without any userinfo.
    /// Shares the request line's bytes when the URL wrote it that way, as most do.
    pub(crate) host_header: Authority,
    /// Where the host as the URL wrote it (IPv6 in brackets) is in `host_header`: what a
    /// connection of the client's own is dialled and kept by.
    written: (u32, u32),
    /// Shares the request line's bytes rather than copying them.
    pub(crate) path_and_query: PathAndQuery,
}

/// The normalised host: where it is in `host_header` when the URL wrote it in normal form
/// already (no allocation for it), else its own text.
#[derive(Debug, Clone)]
enum Normal {
    Within(usize, usize),
    Own(String),
}

impl Target {
    pub(crate) fn from_uri(uri: &Uri) -> Result<Target, ProxyError> {
        let scheme = uri.scheme_str().ok_or(ProxyError::NotProxyRequest)?;
        match scheme {
            // `ws://` as some WebSocket clients send it to a proxy: HTTP until the 101.
            "http" | "ws" => {}
            "https" | "wss" => {
                return Err(ProxyError::BadRequest(format!(
                    "{scheme}:// URLs go through a CONNECT tunnel (HTTPS_PROXY), not a plain \
                     request"
                )));
            }
            other => {
                return Err(ProxyError::BadRequest(format!(
                    "unsupported scheme {other:?}"
                )));
            }
        }
        let no_host = || ProxyError::BadRequest("the URL has no host".into());
        let authority = uri.authority().ok_or_else(no_host)?;
        let text = authority.as_str();
        let (raw_host, port) = authority_parts(text);
        if raw_host.is_empty() {
            return Err(no_host());
        }
        let (normal, ip) = normal_host(raw_host);
        // The authority as written is the Host value, unless it carries user info (never
        // forwarded) or an empty port.
        let (host_header, host, written) = if !text.contains('@') && !text.ends_with(':') {
            let host = match normal {
                // A slice of `text`: its offset is where it starts in the authority
                // (checked all the same, so that a change elsewhere cannot make it point
                // outside).
                Cow::Borrowed(h) => (h.as_ptr() as usize)
                    .checked_sub(text.as_ptr() as usize)
                    .filter(|&at| text.get(at..at + h.len()) == Some(h))
                    .map_or_else(
                        || Normal::Own(h.to_string()),
                        |at| Normal::Within(at, at + h.len()),
                    ),
                Cow::Owned(h) => Normal::Own(h),
            };
            // With no user info the authority starts with the host.
            (authority.clone(), host, (0, len32(raw_host)))
        } else {
            let written = match port {
                Some(p) => format!("{raw_host}:{p}"),
                None => raw_host.to_string(),
            };
            (
                host_value(written)?,
                Normal::Own(normal.into_owned()),
                (0, len32(raw_host)),
            )
        };
        Ok(Target {
            https: false,
            host,
            ip,
            port: port.unwrap_or(80),
            host_header,
            written,
            path_and_query: path_and_query(uri),
        })
    }

    /// The target of the requests inside a tunnel to `host:port` (their path aside).
    /// `https`: TLS inside the tunnel (interception), else plain HTTP sent through it.
    fn in_tunnel(host: &str, port: u16, https: bool) -> Result<Target, ProxyError> {
        let bare = if host.contains(':') {
            format!("[{host}]")
        } else {
            host.to_string()
        };
        let at = usize::from(bare.len() != host.len());
        let default_port = if https { 443 } else { 80 };
        Ok(Target {
            https,
            host: Normal::Within(at, at + host.len()),
            ip: host.parse().ok(),
            port,
            written: (0, len32(&bare)),
            host_header: host_value(if port == default_port {
                bare
            } else {
                format!("{bare}:{port}")
            })?,
            path_and_query: PathAndQuery::from_static("/"),
        })
    }

    /// Lower-case, no brackets, no trailing dot.
    pub(crate) fn host(&self) -> &str {
        match &self.host {
            Normal::Within(from, to) => self.host_header.as_str().get(*from..*to).unwrap_or(""),
            Normal::Own(h) => h,
        }
    }

    /// The host as the URL wrote it, without IPv6 brackets: what the client connection's
    /// own upstream connections are dialled and kept by (the URI sent names the same).
    pub(crate) fn written_host(&self) -> &str {
        let (from, to) = self.written;
        let h = (self.host_header.as_str())
            .get(from as usize..to as usize)
            .unwrap_or("");
        h.strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(h)
    }

    /// TLS origination: the client asked for http://, the upstream is reached over https
    /// (on 443 unless the URL named a port).
    fn originate_tls(&mut self, explicit_port: bool) {
        self.https = true;
        if !explicit_port {
            self.port = 443;
        }
    }

    pub(crate) fn path(&self) -> &str {
        self.path_and_query.path()
    }
}

/// A host's length as [`Target`] keeps it: a request head is far shorter than 4 GiB,
/// and a length that is not gives an empty host, which is refused.
fn len32(host: &str) -> u32 {
    u32::try_from(host.len()).unwrap_or(0)
}

/// A `Host` value sluice writes itself (user info dropped, a tunnel's target).
fn host_value(text: String) -> Result<Authority, ProxyError> {
    Authority::try_from(text)
        .map_err(|_| ProxyError::BadRequest("the URL's host is not a valid Host value".into()))
}

/// The request target an origin server gets: an empty path is `/`, before a query too
/// (RFC 9112 §3.2.1: `http://host?x=1` is `/?x=1`). The URI parser already reads
/// `http://host` as `http://host/`, so an `OPTIONS` for the server as a whole cannot be
/// told from one for `/` and goes as `OPTIONS /`, not `OPTIONS *` (RFC 9112 §3.2.4).
fn path_and_query(uri: &Uri) -> PathAndQuery {
    match uri.path_and_query() {
        Some(pq) if pq.as_str().starts_with('/') || pq.as_str() == "*" => pq.clone(),
        Some(pq) if !pq.as_str().is_empty() => PathAndQuery::try_from(format!("/{}", pq.as_str()))
            .unwrap_or_else(|_| PathAndQuery::from_static("/")),
        _ => PathAndQuery::from_static("/"),
    }
}

/// The plain functions here return `async move` blocks rather than being `async fn`s: an
/// `async fn` stores a second copy of each argument it moves on, and a request's future is
/// copied whole at every level that builds it (docs/architecture.md, "Request futures
/// kept small"; `proxy/sizes.rs` holds them to their sizes).
pub(crate) fn forward<'a>(
    app: &'a App,
    lc: &'a Lifecycle,
    upstreams: &'a PinnedConns,
    req: Request<Incoming>,
) -> impl Future<Output = Response<Body>> + 'a {
    let start = crate::clock::now();
    let target = Target::from_uri(req.uri());
    route_and_send(app, Lent::Own(upstreams), lc, req, target, start)
}

/// The answer to a request whose target cannot be read.
fn unaddressable<B>(app: &App, req: &Request<B>, start: Instant, e: ProxyError) -> Response<Body> {
    let config = app.config();
    let record = Record {
        route: None,
        method: req.method(),
        host: "-",
        path: "-",
        start,
    };
    finish(&config, &record, Err(e))
}

/// A request inside a tunnel, to `target` (from [`Tunnel::target`]): intercepted (sent
/// on over verified TLS) or plain HTTP a client sent through CONNECT; routed and limited
/// exactly like a request to the forward proxy. `timers`: the tunnel's.
pub(crate) fn intercepted<'a, B>(
    app: &'a App,
    lc: &'a Lifecycle,
    timers: &'a Timers,
    req: Request<B>,
    target: Result<Target, ProxyError>,
) -> impl Future<Output = Response<Body>> + 'a
where
    B: http_body::Body<Data = bytes::Bytes> + Send + Unpin + 'static,
    B::Error: Into<crate::body::BoxError>,
{
    route_and_send(
        app,
        Lent::Tunnel(timers),
        lc,
        req,
        target,
        crate::clock::now(),
    )
}

/// What a client connection lends each of its requests: its own plain-HTTP upstream
/// connections (and their timers), or inside a tunnel, whose requests take the pooled
/// client, the tunnel's timers.
#[derive(Clone, Copy)]
pub(crate) enum Lent<'a> {
    Own(&'a PinnedConns),
    Tunnel(&'a Timers),
}

/// Where every request inside one tunnel goes, worked out once for the tunnel: a request
/// adds its path, and copies nothing else. `None`: the tunnel's host cannot be a `Host`
/// value, and each request inside is answered 400.
#[derive(Clone)]
pub(crate) struct Tunnel(Option<Target>);

impl Tunnel {
    /// To `host:port`, over TLS when `https` (interception), else plain HTTP.
    pub(crate) fn new(host: &str, port: u16, https: bool) -> Tunnel {
        Tunnel(Target::in_tunnel(host, port, https).ok())
    }

    /// Where `req` goes.
    pub(crate) fn target<B>(&self, req: &Request<B>) -> Result<Target, ProxyError> {
        // A tunnel leads to one origin: a CONNECT inside it asks for another tunnel,
        // which the origin (in authority-form, where it would lose its port) cannot give.
        if req.method() == Method::CONNECT {
            return Err(ProxyError::BadRequest(
                "CONNECT inside a tunnel: send it to the proxy".into(),
            ));
        }
        let path_and_query = path_and_query(req.uri());
        // The asterisk-form names the server as a whole, for OPTIONS alone (RFC 9112
        // §3.2.4).
        if path_and_query == "*" && req.method() != Method::OPTIONS {
            return Err(ProxyError::BadRequest(
                "`*` is a request target for OPTIONS only".into(),
            ));
        }
        match &self.0 {
            Some(t) => Ok(Target {
                path_and_query,
                ..t.clone()
            }),
            None => Err(ProxyError::BadRequest(
                "the URL's host is not a valid Host value".into(),
            )),
        }
    }
}

/// `lent`: what the client connection lends its requests; `lc`: its lifecycle, which a
/// switched protocol (see `upgrade`) lives in.
#[allow(clippy::manual_async_fn, reason = "see above: arguments stored once")]
pub(crate) fn route_and_send<'a, B>(
    app: &'a App,
    lent: Lent<'a>,
    lc: &'a Lifecycle,
    req: Request<B>,
    mut target: Result<Target, ProxyError>,
    start: Instant,
) -> impl Future<Output = Response<Body>> + 'a
where
    B: http_body::Body<Data = bytes::Bytes> + Send + Unpin + 'static,
    B::Error: Into<crate::body::BoxError>,
{
    async move {
        // A target that cannot be read is answered here rather than by a second future
        // type beside this one: the request's future is moved whole (2.5 KiB) at every
        // level that wraps it, and an `Either` is one level more. Borrowed, not moved
        // out: a local would hold a second copy in the future.
        let target = match &mut target {
            Ok(target) => target,
            Err(e) => {
                let e = std::mem::replace(e, ProxyError::NotProxyRequest);
                let resp = unaddressable(app, &req, start, e);
                discard::rest_of(req);
                return resp;
            }
        };
        let config = app.config();
        let method = req.method().clone();
        let route = config.route(
            target.host(),
            target.port,
            &method,
            target.path(),
            req.headers(),
        );
        if let Some(r) = &route
            && !target.https
            && config.upstreams[r.upstream].scheme == Scheme::Https
        {
            target.originate_tls(req.uri().port_u16().is_some());
        }
        let done = |result| {
            let record = Record {
                route: route.as_ref(),
                method: &method,
                host: target.host(),
                path: target.path(),
                start,
            };
            finish(&config, &record, result)
        };
        // Not a `match` around the await: its scrutinee (the request, 240 bytes) would
        // stay in the future while the upstream answers.
        let (mut req, max_wait, switching) = match admit(app, &config, route.as_ref(), target, req)
        {
            Ok(admitted) => admitted,
            Err(e) => return done(Err(e)),
        };
        // A priced family's request learns its cost first (boxed: the rarer path, whose
        // future would otherwise size every request's). The request is put back where it
        // was: one that is not priced is not moved again.
        let mut costs = None;
        if let Some(r) = &route
            && let Some(prices) = prices_of(&config, r)
        {
            req = match Box::pin(price_request((app, &config), r, prices, req, target.path())).await
            {
                Ok((req, c)) => {
                    costs = Some(Box::new(c));
                    req
                }
                Err(e) => return done(Err(e)),
            };
        }
        let own;
        let way = match lent {
            Lent::Own(conns) => {
                own = Own {
                    conns,
                    host: target.written_host(),
                    port: target.port,
                };
                Way::Own(&own)
            }
            Lent::Tunnel(timers) => Way::Tunnel(timers),
        };
        let (result, waited) = pipeline::run(
            app,
            &config,
            way,
            route.as_ref(),
            (
                req,
                costs.as_deref().unwrap_or(&Costs::ONE),
                switching.is_some(),
            ),
            max_wait,
            start,
        )
        .await;
        let answered = result.is_ok();
        let mut resp = done(result.map(from_upstream));
        if let Some(switching) = switching {
            let (upstream, _) = crate::route::labels(&config.config, route.as_ref());
            if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
                let idle = config.proxy.tunnel_idle_timeout;
                resp = upgrade::switch(lc, &app.metrics, upstream, idle, resp, *switching);
            } else {
                // Refused by the upstream, or answered by sluice itself (a queue's
                // refusal, an unreachable upstream): sluice_requests_total says which.
                let result = if answered { "refused" } else { "local" };
                app.metrics
                    .upgrades
                    .with_label_values(&[upstream, result])
                    .inc();
            }
        }
        if let Some(waited) = waited {
            // Whole milliseconds: what a client needs to decide whether to shed work.
            let ms = u64::try_from(waited.as_millis()).unwrap_or(u64::MAX);
            // Most requests do not wait: that answer is built without an allocation.
            let value = match ms {
                0 => HeaderValue::from_static("0"),
                ms => HeaderValue::from(ms),
            };
            resp.headers_mut().insert(QUEUE_WAIT.clone(), value);
        }
        if let Some(r) = &route
            && config.upstreams[r.upstream].ratelimit_headers
        {
            describe_bucket(app, &config, r, resp.headers_mut());
        }
        resp
    }
}

/// The prices of the route's family, if it has any.
fn prices_of<'c>(config: &'c Live, r: &Route) -> Option<&'c [Price]> {
    let f = &config.upstreams[r.upstream].families[r.family?];
    (!f.prices.is_empty()).then_some(f.prices.as_slice())
}

/// What a priced family's request costs (see `price`): declared with `sluice-cost`,
/// which is removed here, else estimated from its headers or body. A body is read up to
/// `proxy.max_replay_body`, within the route's `total_timeout` and what is left of
/// `proxy.max_replay_memory` (held until the body has gone on), and goes on whole.
async fn price_request(
    (app, config): (&App, &Live),
    route: &Route,
    prices: &[Price],
    req: Request<Body>,
    path: &str,
) -> Result<(Request<Body>, Costs), ProxyError> {
    let (mut parts, body) = req.into_parts();
    let declared = Declared::read(&parts.headers)?;
    parts.headers.remove(price::DECLARED);
    if !price::needs_body(prices, &declared) {
        let costs = price::price(prices, &parts.headers, &declared, &BodyView::Unread, path)?;
        return Ok((Request::from_parts(parts, body), costs));
    }
    let limit = config.proxy.max_replay_body;
    let most = usize::try_from(limit).unwrap_or(usize::MAX);
    // As much of the budget as the body can take: its length when it says, else the most
    // that is read.
    let reading = http_body::Body::size_hint(&body)
        .exact()
        .map_or(limit.saturating_add(1), |n| n.min(limit.saturating_add(1)));
    let Some(hold) = app.replay_budget.hold(reading) else {
        return Err(ProxyError::LocalResources(
            "max_replay_memory is taken by bodies held for retries and pricing: this \
             request's body cannot be read to price it now"
                .into(),
        ));
    };
    let timeout = route.policy(&config.config).total_timeout;
    let (prefix, body) = match discard::within(timeout, peek(body, most.saturating_add(1))).await {
        None => return Err(ProxyError::ClientTimeout(timeout)),
        Some(Err(e)) => {
            return Err(ProxyError::ClientBody(format!(
                "the request body broke while sluice read it to price it: {}",
                crate::upstream::error::chain(&*e)
            )));
        }
        Some(Ok(read)) => read,
    };
    let json = (prefix.len() <= most)
        .then(|| price::json::Json::parse(&prefix).ok())
        .flatten();
    let view = match &json {
        _ if prefix.len() > most => BodyView::TooLarge { limit },
        Some(v) => BodyView::Json(v),
        None => BodyView::NotJson,
    };
    let costs = price::price(prices, &parts.headers, &declared, &view, path)?;
    let body = stream(crate::upstream::replay::HeldBody {
        body,
        hold: Some(hold),
    });
    Ok((Request::from_parts(parts, body), costs))
}

/// `ratelimit_headers`: the sluice bucket the request paid, as `RateLimit-Policy` and
/// `RateLimit`, in place of any the upstream sent (the client talks to sluice's limits
/// now; the upstream's own fields are what `learn` reads).
fn describe_bucket(app: &App, config: &Live, route: &Route, headers: &mut http::HeaderMap) {
    let plan = &config.plans[route.upstream];
    let Some((policy, current)) = app.limiter.ratelimit_fields(plan, route) else {
        return;
    };
    if let (Ok(p), Ok(c)) = (
        HeaderValue::from_str(&policy),
        HeaderValue::from_str(&current),
    ) {
        headers.insert("ratelimit-policy", p);
        headers.insert("ratelimit", c);
    }
}

/// On every response to a request that paid a limit, the time it waited for admission
/// over all its attempts, in milliseconds (sluice's own 429s included).
static QUEUE_WAIT: header::HeaderName = header::HeaderName::from_static("sluice-queue-wait");

/// The longest a client is willing to wait for admission, capped by its family's
/// `max_wait`; read and removed here, never forwarded.
const MAX_WAIT: &str = "sluice-max-wait";

/// A `sluice-max-wait` value: a duration as the config writes one (`"250ms"`, `"2s"`), or
/// whole seconds as `Retry-After` writes them.
fn parse_max_wait(value: &HeaderValue) -> Result<std::time::Duration, ProxyError> {
    let text = value.to_str().unwrap_or("").trim();
    if let Ok(secs) = text.parse::<u64>() {
        return Ok(std::time::Duration::from_secs(secs));
    }
    crate::config::units::parse_duration(text)
        .map_err(|e| ProxyError::BadRequest(format!("{MAX_WAIT}: {e}")))
}

/// The egress rules, then the request as the upstream will see it, and the client's
/// `sluice-max-wait`.
fn admit<B>(
    app: &App,
    config: &Live,
    route: Option<&Route>,
    target: &Target,
    req: Request<B>,
) -> Result<Admitted, ProxyError>
where
    B: http_body::Body<Data = bytes::Bytes> + Send + Unpin + 'static,
    B::Error: Into<crate::body::BoxError>,
{
    let refused = if route.is_none() && config.proxy.unmatched == Unmatched::Deny {
        Some(ProxyError::UnmatchedDenied)
    } else if let Some(ip) = target.ip {
        // A literal address is refused before it is queued; names are checked once resolved.
        app.resolver
            .check(&config.egress_rules, target.host(), ip, target.port)
            .map_err(ProxyError::Egress)
            .err()
    } else {
        None
    };
    if let Some(e) = refused {
        discard::rest_of(req);
        return Err(e);
    }
    let priced = route.is_some_and(|r| prices_of(config, r).is_some());
    to_upstream(req, target, &config.proxy.upgrades, priced)
}

/// The request as the upstream will see it, the client's `sluice-max-wait`, and the
/// protocol switch it asks for, if `upgrades` allows it (boxed: rare, and the request's
/// future holds it while the upstream answers).
type Admitted = (
    Request<Body>,
    Option<std::time::Duration>,
    Option<Box<upgrade::Switching>>,
);

/// `priced`: the route's family prices its requests, and reads `sluice-cost` itself
/// (`price_request`); elsewhere the header is only removed.
fn to_upstream<B>(
    req: Request<B>,
    target: &Target,
    upgrades: &[String],
    priced: bool,
) -> Result<Admitted, ProxyError>
where
    B: http_body::Body<Data = bytes::Bytes> + Send + Unpin + 'static,
    B::Error: Into<crate::body::BoxError>,
{
    let (mut parts, body) = req.into_parts();
    let received = parts.version;
    // Most requests carry no `Upgrade`: the scan says so without a lookup.
    let hop = HopByHop::scan(&parts.headers);
    let protocol = if hop.upgrade() {
        upgrade::asked(&parts.headers).filter(|p| upgrade::allowed(p, upgrades))
    } else {
        None
    };
    // `TE: trailers` from an HTTP/2 client (gRPC's, which its server requires) goes on;
    // from HTTP/1.1 it belongs to the client's connection, like every other TE.
    if strip_scanned(&mut parts.headers, hop) && received == Version::HTTP_2 {
        parts
            .headers
            .insert(header::TE, HeaderValue::from_static("trailers"));
    }
    let switching = match protocol {
        Some(protocol) => {
            let client = parts.extensions.remove::<hyper::upgrade::OnUpgrade>();
            client.map(|client| {
                parts
                    .headers
                    .insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
                parts.headers.insert(header::UPGRADE, protocol.clone());
                Box::new(upgrade::Switching { protocol, client })
            })
        }
        None => None,
    };
    // One look at the names rather than a hashed lookup for each: a client sends `Host`
    // as the URL has it (as curl and HTTP_PROXY clients do), and rarely `Expect` or
    // `sluice-max-wait`.
    let (mut hosts, mut host_as_url, mut expect, mut declared) = (0, false, false, false);
    let mut max_wait: Option<Result<std::time::Duration, ProxyError>> = None;
    for (name, value) in &parts.headers {
        if name == header::HOST {
            hosts += 1;
            host_as_url = value.as_bytes() == target.host_header.as_str().as_bytes();
        } else if name == header::EXPECT {
            expect = true;
        } else if name.as_str() == MAX_WAIT {
            // Sent twice, the shorter wait holds (and a bad one is refused).
            let wait = parse_max_wait(value);
            max_wait = Some(match (max_wait, wait) {
                (Some(Ok(w)), Ok(wait)) => Ok(w.min(wait)),
                (Some(Err(e)), _) | (_, Err(e)) => Err(e),
                (None, Ok(wait)) => Ok(wait),
            });
        } else if name.as_str() == price::DECLARED {
            declared = true;
        }
    }
    // Most requests have no body; an empty one is boxed without an allocation. From here
    // on a refusal drops the body wrapped, and what the client still sends is discarded.
    let body = if http_body::Body::is_end_stream(&body) {
        empty()
    } else if received == Version::HTTP_2 {
        stream(body)
    } else {
        stream(discard::Rest::new(body, expect))
    };
    let max_wait = max_wait.transpose()?;
    if declared && !priced {
        parts.headers.remove(price::DECLARED);
    }
    if expect {
        // hyper has already answered `100 Continue` to the client when we started reading
        // the body; passing the expectation on would make the upstream wait for another.
        parts.headers.remove(header::EXPECT);
    }
    if max_wait.is_some() {
        parts.headers.remove(MAX_WAIT);
    }
    if !(hosts == 1 && host_as_url) {
        let host = HeaderValue::from_str(target.host_header.as_str()).map_err(|_| {
            ProxyError::BadRequest("the URL's host is not a valid Host value".into())
        })?;
        parts.headers.insert(header::HOST, host);
    }
    append_via(&mut parts.headers, received);
    // A plain absolute-form request already names exactly what is forwarded; only TLS
    // origination, requests inside a tunnel and URLs with user info need a new URI.
    let unchanged = !target.https
        && parts.uri.scheme_str() == Some("http")
        && parts
            .uri
            .authority()
            .is_some_and(|a| a.as_str() == target.host_header.as_str())
        && parts
            .uri
            .path_and_query()
            .is_some_and(|p| *p == target.path_and_query);
    if !unchanged {
        // From its parts, each already checked: written out and parsed again, it would
        // cost a formatting and a second parse of every byte.
        let mut uri = http::uri::Parts::default();
        uri.scheme = Some(if target.https {
            http::uri::Scheme::HTTPS
        } else {
            http::uri::Scheme::HTTP
        });
        uri.authority = Some(target.host_header.clone());
        uri.path_and_query = Some(target.path_and_query.clone());
        parts.uri = Uri::from_parts(uri)
            .map_err(|_| ProxyError::BadRequest("the URL cannot be forwarded".into()))?;
    }
    // HTTP/1.1 to upstreams (the pooled client speaks HTTP/2 over TLS where ALPN agrees),
    // except what came as h2c with prior knowledge through a tunnel: its client knew the
    // origin speaks HTTP/2 in plain text (gRPC's does), and so it is spoken to.
    parts.version = if received == Version::HTTP_2 && !target.https {
        Version::HTTP_2
    } else {
        Version::HTTP_11
    };
    Ok((Request::from_parts(parts, body), max_wait, switching))
}

fn from_upstream(mut resp: Response<Body>) -> Response<Body> {
    // In place: taking it apart and putting it together would copy it twice.
    let version = resp.version();
    let headers = resp.headers_mut();
    // A response's TE means nothing (RFC 9110 §10.1.4 defines it for requests).
    let _ = strip_hop_by_hop(headers);
    append_via(headers, version);
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets() {
        let t = Target::from_uri(
            &"http://User:pw@API.Example.com:8080/a/b?q=1"
                .parse()
                .unwrap(),
        )
        .unwrap();
        assert_eq!(t.host(), "api.example.com");
        assert_eq!(t.port, 8080);
        assert_eq!(t.host_header.as_str(), "API.Example.com:8080");
        assert_eq!(t.path(), "/a/b");
        assert_eq!(t.path_and_query, "/a/b?q=1");

        // The normal host as a slice of the authority, or its own text; the address of a
        // literal, as the egress rules read it.
        for (url, host, ip, header) in [
            (
                "http://api.example.com:8080/",
                "api.example.com",
                None,
                "api.example.com:8080",
            ),
            (
                "http://api.example.com./",
                "api.example.com",
                None,
                "api.example.com.",
            ),
            (
                "http://127.0.0.1:80/",
                "127.0.0.1",
                Some("127.0.0.1"),
                "127.0.0.1:80",
            ),
            ("http://127.1/", "127.0.0.1", Some("127.0.0.1"), "127.1"),
            ("http://[::1]:8080/", "::1", Some("::1"), "[::1]:8080"),
            (
                "http://u@Api.Example:81/",
                "api.example",
                None,
                "Api.Example:81",
            ),
            (
                "http://u@10.0.0.1:/",
                "10.0.0.1",
                Some("10.0.0.1"),
                "10.0.0.1",
            ),
        ] {
            let t = Target::from_uri(&url.parse().unwrap()).unwrap();
            assert_eq!(
                (t.host(), t.ip, t.host_header.as_str()),
                (host, ip.map(|a: &str| a.parse().unwrap()), header),
                "{url}"
            );
        }

        let t = Target::from_uri(&"http://[::1]/".parse().unwrap()).unwrap();
        assert_eq!(
            (t.host(), t.port, t.host_header.as_str()),
            ("::1", 80, "[::1]")
        );

        assert!(matches!(
            Target::from_uri(&"/path".parse().unwrap()),
            Err(ProxyError::NotProxyRequest)
        ));
        assert!(matches!(
            Target::from_uri(&"*".parse().unwrap()),
            Err(ProxyError::NotProxyRequest)
        ));
        assert!(matches!(
            Target::from_uri(&"https://a.example/".parse().unwrap()),
            Err(ProxyError::BadRequest(_))
        ));
    }
}
