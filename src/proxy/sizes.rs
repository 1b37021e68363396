//! The size of the request path's futures, asserted: each level that builds a request's
//! future copies it whole, and every level above holds it, so a change that grows one
//! (an `async fn` where a plain function returning `async move` was, a large value held
//! across an `.await`, a `match` around an `.await`, a step no longer boxed) costs every
//! request, at every level (docs/architecture.md, "Request futures kept small"). The
//! budgets are the sizes in the test profile, rounded up to the next 64 bytes; a change
//! that passes one should shrink the future back, or, when the growth is worth it, raise
//! the budget in the same commit and say why.

use std::sync::Arc;

use http::Request;
use tokio::time::Instant;

use super::lifecycle::Lifecycle;
use super::pipeline;
use crate::app::App;
use crate::body::empty;
use crate::config::Config;
use crate::upstream::h1::conn::{Conn, Home, Outgoing, exchange};
use crate::upstream::outbound::Outbound;
use crate::upstream::pinned::{IdleConns, PinnedConns};

struct Nowhere;

impl Home for Nowhere {
    fn take_back(self, _conn: Conn) {}
}

fn within(name: &str, size: usize, budget: usize) -> Option<String> {
    (size > budget).then(|| format!("{name}: {size} bytes, over its budget of {budget}"))
}

#[tokio::test]
async fn the_request_paths_futures_stay_within_their_budgets() {
    let config = Config::parse(
        "[[upstream]]\nname = \"api\"\nhosts = [\"127.0.0.1\"]\n\
         limits = [{ kind = \"token_bucket\", rate = 10, per = \"1s\", burst = 10 }]\n",
        "sizes",
    )
    .unwrap();
    let app = App::builder(config).build().unwrap();
    let live = app.config();
    let upstreams = PinnedConns::new(Arc::new(IdleConns::default()), 0);
    let lc = Lifecycle::new();
    let req = || {
        Request::builder()
            .uri("http://127.0.0.1:1/v1/orders")
            .body(empty())
            .unwrap()
    };
    let now = Instant::now();

    let mut over = Vec::new();
    let target = super::forward::Target::from_uri(req().uri());
    let f = super::forward::route_and_send(
        &app,
        super::forward::Lent::Own(&upstreams),
        &lc,
        req(),
        target,
        now,
    );
    over.extend(within(
        "forward::route_and_send",
        size_of_val(&f),
        ROUTE_AND_SEND,
    ));
    drop(f);
    let one = crate::limit::costs::Costs::ONE;
    let own = crate::upstream::pinned::Own {
        conns: &upstreams,
        host: "127.0.0.1",
        port: 1,
    };
    let f = pipeline::run(
        &app,
        &live,
        crate::upstream::Way::Own(&own),
        None,
        (req(), &one, false),
        None,
        now,
    );
    over.extend(within("pipeline::run", size_of_val(&f), RUN));
    drop(f);
    let (parts, body) = req().into_parts();
    let mut head = crate::upstream::RequestHead::from_parts(parts);
    let f = upstreams.send(
        (&app.resolver, &live.egress_rules),
        ("127.0.0.1", 1),
        crate::upstream::AttemptHead {
            head: &mut head,
            last: false,
        },
        Outbound::from(body),
        now,
    );
    over.extend(within("PinnedConns::send", size_of_val(&f), SEND));
    drop(f);

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let io = tokio::net::TcpStream::connect(listener.local_addr().unwrap())
        .await
        .unwrap();
    let out = Outgoing::of(req().map(Outbound::from), "/");
    let f = exchange(Conn::new(io), out, Nowhere);
    over.extend(within("h1::conn::exchange", size_of_val(&f), EXCHANGE));
    drop(f);
    assert!(over.is_empty(), "{}", over.join("\n"));
}

// Measured 2544, 1936, 744 and 200 bytes (the connection carries its place under the
// cap on upstream connections, 8 bytes; a request carries what it costs, and a priced
// family's request the pricing step, boxed, 64 bytes in all; the client connection's
// handle carries the timer of its requests' total_timeout, 8 bytes, which saves a
// timer-wheel insertion and removal per request; the send holds the head it encodes
// where the pipeline keeps it, a pointer, and the request until it is encoded, 24 bytes,
// where it held the head's target and URI: a retryable request's head is never copied).
const ROUTE_AND_SEND: usize = 2592;
const RUN: usize = 1984;
const SEND: usize = 768;
const EXCHANGE: usize = 200;
