//! Switching protocols through the forward proxy (WebSocket): a request that asks for a
//! protocol `proxy.upgrades` allows keeps its `Upgrade` and `Connection: upgrade`, pays
//! its limits like any request and is sent once. After the upstream's `101`, the client's
//! connection and the upstream's are spliced as a CONNECT tunnel is (idle timeout, cut at
//! the end of the drain), and a concurrency permit the request holds stays held until
//! both close. `h2c` is never passed on: sluice speaks HTTP/1.1 to upstreams.

use http::header::{self, HeaderMap, HeaderValue};
use http::{Response, StatusCode};
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use tokio::io::AsyncWriteExt;

use super::lifecycle::Lifecycle;
use super::splice::{Ended, splice};
use crate::body::{Body, empty};
use crate::metrics::Metrics;
use crate::upstream::switched::{Side, UpstreamSide};

/// The protocols a request asks to switch to: its `Upgrade` field, every line of it
/// joined, when `Connection` names `upgrade` too.
pub(crate) fn asked(headers: &HeaderMap) -> Option<HeaderValue> {
    let mut lines = headers.get_all(header::UPGRADE).iter();
    let first = lines.next()?;
    let says_upgrade = headers.get_all(header::CONNECTION).iter().any(|v| {
        v.to_str().is_ok_and(|s| {
            s.split(',')
                .any(|t| t.trim().eq_ignore_ascii_case("upgrade"))
        })
    });
    if !says_upgrade {
        return None;
    }
    let mut joined = first.as_bytes().to_vec();
    for more in lines {
        joined.extend_from_slice(b", ");
        joined.extend_from_slice(more.as_bytes());
    }
    HeaderValue::from_bytes(&joined).ok()
}

/// Whether every protocol `offer` names (without its version) is one of `allowed`.
/// `h2c` never is. All, not the first: the upstream picks among the offers, and one
/// that may switch to HTTP/2 would serve any number of requests on one admission.
pub(crate) fn allowed(offer: &HeaderValue, allowed: &[String]) -> bool {
    let Ok(text) = offer.to_str() else {
        return false;
    };
    let mut any = false;
    for token in text.split(',') {
        let name = token.split('/').next().map_or("", str::trim);
        if name.is_empty()
            || name.eq_ignore_ascii_case("h2c")
            || !allowed.iter().any(|a| a.eq_ignore_ascii_case(name))
        {
            return false;
        }
        any = true;
    }
    any
}

/// A request on its way to switching: the protocol, and the client's side once hyper has
/// written the `101`.
pub(crate) struct Switching {
    pub(crate) protocol: HeaderValue,
    pub(crate) client: OnUpgrade,
}

/// The upstream answered `101` to `switching`: the client gets the `101` (with the
/// upstream's fields and the protocol), and a task joins the two connections. `resp` is
/// the upstream's response; its body, which holds the request's permits, is held until
/// the splice ends. Without the upstream's side (it went elsewhere), a 502.
pub(crate) fn switch(
    lc: &Lifecycle,
    metrics: &Metrics,
    upstream: &str,
    idle: std::time::Duration,
    resp: Response<Body>,
    switching: Switching,
) -> Response<Body> {
    let (mut parts, held) = resp.into_parts();
    let Some(side) = parts
        .extensions
        .remove::<UpstreamSide>()
        .and_then(|s| s.take())
    else {
        metrics
            .upgrades
            .with_label_values(&[upstream, "failed"])
            .inc();
        let mut r = Response::new(empty());
        *r.status_mut() = StatusCode::BAD_GATEWAY;
        return r;
    };
    parts
        .headers
        .insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    parts.headers.insert(header::UPGRADE, switching.protocol);
    let open = metrics.upgraded.with_label_values(&[upstream]);
    let counted = metrics.upgrades.clone();
    let (upstream, stop) = (upstream.to_string(), lc.stop.clone());
    lc.tracker.spawn(async move {
        let _held = held;
        let client = match switching.client.await {
            Ok(c) => c,
            Err(e) => {
                counted.with_label_values(&[&upstream, "failed"]).inc();
                tracing::debug!(error = %e, "the client's side of an upgrade failed");
                return;
            }
        };
        let mut client = TokioIo::new(client);
        let ended = match side {
            Side::Own(io, rest) => {
                counted.with_label_values(&[&upstream, "switched"]).inc();
                open.inc();
                // What the upstream sent right behind its 101 goes first.
                match client.write_all(&rest).await {
                    Ok(()) => splice(&mut client, io, idle, &stop).await,
                    Err(e) => Ended::Failed(e),
                }
            }
            Side::Hyper(on) => match on.await {
                Ok(io) => {
                    counted.with_label_values(&[&upstream, "switched"]).inc();
                    open.inc();
                    splice(&mut client, TokioIo::new(io), idle, &stop).await
                }
                Err(e) => {
                    counted.with_label_values(&[&upstream, "failed"]).inc();
                    tracing::debug!(error = %e, "the upstream's side of an upgrade failed");
                    return;
                }
            },
        };
        open.dec();
        match ended {
            Ended::Closed(up, down) => {
                tracing::debug!(
                    bytes_up = up,
                    bytes_down = down,
                    "upgraded connection closed"
                );
            }
            Ended::Failed(e) => {
                tracing::debug!(error = %e, "upgraded connection ended with an error")
            }
            Ended::Idle => tracing::debug!(?idle, "upgraded connection closed: idle"),
            Ended::Cut => tracing::debug!("upgraded connection cut at the end of the drain"),
        }
    });
    Response::from_parts(parts, empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_asks_and_what_is_allowed() {
        let mut h = HeaderMap::new();
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        assert_eq!(asked(&h), None, "no Connection: upgrade");
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, Upgrade"),
        );
        assert_eq!(asked(&h), Some(HeaderValue::from_static("websocket")));
        let ws = vec!["websocket".to_string()];
        assert!(allowed(&HeaderValue::from_static("WebSocket"), &ws));
        assert!(!allowed(&HeaderValue::from_static("h2c"), &ws));
        let h2c = vec!["h2c".to_string()];
        assert!(
            !allowed(&HeaderValue::from_static("h2c"), &h2c),
            "never h2c"
        );
        assert!(!allowed(&HeaderValue::from_static("foo/2, websocket"), &ws));
        assert!(!allowed(&HeaderValue::from_static("websocket, h2c"), &ws));
        assert!(!allowed(&HeaderValue::from_static("websocket, "), &ws));
        assert!(allowed(
            &HeaderValue::from_static("websocket/13, WebSocket"),
            &ws
        ));
        assert!(!allowed(&HeaderValue::from_static(""), &ws));
        h.append(header::UPGRADE, HeaderValue::from_static("h2c"));
        let both = asked(&h).unwrap();
        assert_eq!(both, "websocket, h2c");
        assert!(!allowed(&both, &ws), "a second line is read too");
    }
}
