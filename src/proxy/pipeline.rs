//! The one road from a routed request to an upstream response. The policies nest in the
//! order this file reads, outermost first: total timeout (`run`), retry loop
//! (`retry_loop`), circuit breaker, limiter, attempt timeout (`attempt`), upstream call;
//! docs/architecture.md ("The road a request travels") draws them.
//!
//! Retries sit outside the limiter, so every attempt pays the limits again; the breaker
//! sits inside the retry loop, so a retry never reaches an upstream declared dead.

use std::future::{Future, poll_fn};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::Poll;
use std::time::{Duration, SystemTime};

use http::header::HeaderValue;
use http::{HeaderMap, Method, Request, Response};
use tokio::time::Instant;

use super::discard;
use super::error::ProxyError;
use super::response::{Metered, ResponseBody, peek};
use crate::app::App;
use crate::app::Live;
use crate::body::Body;
use crate::config::{Action, CooldownScope, Learn, Policy};
use crate::limit::costs::Costs;
use crate::limit::{Correction, Permit};
use crate::policy::announced;
use crate::policy::breaker::Admit;
use crate::policy::{Circuit, backoff, classify, hints, is_idempotent, wants_retry};
use crate::route::Route;
use crate::upstream::error::AttemptError;
use crate::upstream::outbound::Outbound;
use crate::upstream::replay::{ClientFault, Replay};
use crate::upstream::{self, AttemptHead, RequestHead, Via, Way};

/// Sends `req` (already stripped and addressed to the upstream), which costs `costs`,
/// under the route's policy. `switching`: it asks to switch protocols (`forward::admit`
/// kept its `Upgrade`), known there without a lookup in its fields.
/// `max_wait`: the client's `sluice-max-wait`, the most its attempts may wait for
/// admission in all. `start`: when the request arrived, which the total timeout counts
/// from. Returns, with the outcome, how long they waited when the route pays a limit.
///
/// The functions here return `async move` blocks rather than being `async fn`s, which
/// would keep a second copy of the request (see `forward::forward`).
#[allow(clippy::manual_async_fn, reason = "see above: arguments stored once")]
pub(crate) fn run<'a>(
    app: &'a App,
    config: &'a Live,
    way: Way<'a>,
    route: Option<&'a Route>,
    (req, costs, switching): (Request<Body>, &'a Costs, bool),
    max_wait: Option<Duration>,
    start: Instant,
) -> impl Future<Output = (Result<Response<Body>, ProxyError>, Option<Duration>)> + 'a {
    // Taken apart before the future is built, so that it holds the parts only once.
    let (parts, body) = req.into_parts();
    let mut head = RequestHead::from_parts(parts);
    async move {
        let Some(route) = route else {
            // Unmatched hosts pass through with [defaults] timeouts: no limits, retries or
            // breaker.
            let p = &config.defaults;
            let body = Replay::new(body, false, 0, &app.replay_budget);
            let once = attempt(
                app,
                config,
                way,
                None,
                p.attempt_timeout,
                (
                    AttemptHead {
                        head: &mut head,
                        last: true,
                    },
                    body.for_attempt(),
                ),
                None,
                // Nothing between the request's arrival and here waits.
                start,
            );
            let result = if p.attempt_timeout <= p.total_timeout {
                // The single attempt's own timer always fires first: a second one would
                // only cost a timer-wheel insert and removal on every request.
                once.await.0
            } else {
                match tokio::time::timeout(p.total_timeout, once).await {
                    Ok((result, _)) => result,
                    Err(_) => return (Err(timed_out(&body, p.total_timeout, true)), None),
                }
            };
            if let Some(own) = way.own() {
                own.conns.recycle(std::mem::take(&mut head.headers));
            }
            return (result.map_err(|e| blame(&body, e)), None);
        };
        let policy = route.policy(&config.config);
        let upstream = &config.upstreams[route.upstream];
        let retry = &policy.retry;
        if upstream.idempotency_generate
            && head.method == Method::POST
            && !head.headers.contains_key(&retry.idempotency_header)
        {
            head.headers
                .insert(retry.idempotency_header.clone(), idempotency_key());
        }
        // A request that asks to switch protocols is sent once: what the upstream does
        // with the connection after a 101 is beyond a retry. So is a gRPC call (always a
        // POST), key or not: whether a method may run twice is in the service's config,
        // which sluice cannot see, and its clients retry by their own policy.
        let safe = (is_idempotent(&head.method)
            || (head.headers.contains_key(&retry.idempotency_header) && !is_grpc(&head.headers)))
            && !switching;
        debug_assert_eq!(switching, head.headers.contains_key(http::header::UPGRADE));
        let keep = safe && retry.max_attempts > 1;
        // Only a safe request has attempts after the first: an empty body is always
        // there to send again, but a POST without a key may have taken effect.
        let attempts = if safe { retry.max_attempts } else { 1 };
        let body = Replay::new(body, keep, config.proxy.max_replay_body, &app.replay_budget);
        let deadline = start + policy.total_timeout;
        let queued = Queued {
            nanos: AtomicU64::new(0),
            most: max_wait,
            costs,
        };
        let looped = retry_loop(
            Tries {
                app,
                config,
                route,
                policy,
            },
            way,
            attempts,
            &mut head,
            &body,
            start,
            deadline,
            &queued,
        );
        // On the client connection's own timer: a tokio timer per request would be a
        // timer-wheel insertion and removal each time, about 800 instructions
        // (docs/BENCHMARKS.md, "CPU per request").
        let result = {
            let mut looped = std::pin::pin!(looped);
            let mut total = way.total_deadline(deadline);
            poll_fn(|cx| match looped.as_mut().poll(cx) {
                Poll::Ready(r) => Poll::Ready(Some(r)),
                Poll::Pending => Pin::new(&mut total).poll(cx).map(|()| None),
            })
            .await
        };
        let result = result.unwrap_or_else(|| Err(timed_out(&body, policy.total_timeout, true)));
        if let Some(own) = way.own() {
            own.conns.recycle(std::mem::take(&mut head.headers));
        }
        let limited = crate::limit::Limiter::limited(&config.plans[route.upstream], route);
        (result, limited.then(|| queued.total()))
    }
}

/// A gRPC call: `application/grpc`, alone or with a subtype (`+proto`, `+json`).
fn is_grpc(headers: &HeaderMap) -> bool {
    headers.get(http::header::CONTENT_TYPE).is_some_and(|v| {
        let v = v.as_bytes();
        v.len() >= 16
            && v[..16].eq_ignore_ascii_case(b"application/grpc")
            && matches!(v.get(16), None | Some(b'+' | b';'))
    })
}

/// How long a request's attempts have waited for admission, and the most they may
/// (`sluice-max-wait`). Read after a timeout too: a wait cut short adds what it lasted.
struct Queued<'a> {
    nanos: AtomicU64,
    most: Option<Duration>,
    /// What each attempt pays the limits.
    costs: &'a Costs,
}

impl Queued<'_> {
    fn total(&self) -> Duration {
        Duration::from_nanos(self.nanos.load(Ordering::Relaxed))
    }

    /// The instant the next admission must come by for the client, if it set a limit.
    fn deadline(&self, now: Instant) -> Option<Instant> {
        // Beyond what an instant can hold, the client's wait is no limit at all.
        self.most
            .and_then(|m| now.checked_add(m.saturating_sub(self.total())))
    }
}

/// Adds the time from its creation to its end, or to its drop when the wait is cut
/// short, to a request's [`Queued`] total.
struct Waiting<'a> {
    queued: &'a Queued<'a>,
    since: Instant,
    ended: bool,
}

impl Waiting<'_> {
    /// Ends the wait now, and returns now: the attempt starts from the same reading.
    fn end(mut self) -> Instant {
        self.ended = true;
        let now = crate::clock::now();
        self.add(now);
        now
    }

    fn add(&self, now: Instant) {
        let took = now.saturating_duration_since(self.since);
        let took = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        self.queued.nanos.fetch_add(took, Ordering::Relaxed);
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if !self.ended {
            self.add(crate::clock::now());
        }
    }
}

/// A failed attempt, charged to the client when its body is what failed.
fn blame(body: &Replay, e: AttemptError) -> ProxyError {
    if let Some(ClientFault::Broken(why)) = body.fault() {
        return ProxyError::ClientBody(why);
    }
    match e {
        AttemptError::Timeout(t) => timed_out(body, t, false),
        e => e.into(),
    }
}

/// A timeout is the client's when it is still sending the body the upstream waits for.
/// Its 408 closes the connection, and the rest of the body is not waited for.
fn timed_out(body: &Replay, after: Duration, total: bool) -> ProxyError {
    match (body.waiting_on_client(), total) {
        (true, _) => {
            discard::forsaking(body.forsake());
            ProxyError::ClientTimeout(after)
        }
        (false, true) => ProxyError::TotalTimeout(after),
        (false, false) => ProxyError::UpstreamTimeout(after),
    }
}

#[allow(
    clippy::too_many_arguments,
    reason = "what all attempts of one request share"
)]
async fn retry_loop(
    tries: Tries<'_>,
    way: Way<'_>,
    attempts: u32,
    head: &mut RequestHead,
    body: &Replay,
    start: Instant,
    deadline: Instant,
    queued: &Queued<'_>,
) -> Result<Response<Body>, ProxyError> {
    tries.shared().budget().record_request(start);
    let mut prev_delay = tries.policy.retry.backoff.base;
    let mut attempt_no = 1u32;
    loop {
        let now = crate::clock::now();
        let mut probe = ProbeGuard {
            circuit: tries.circuit(),
            armed: match tries.circuit().with(|b| b.admit(now)) {
                Admit::Yes => false,
                Admit::Probe => true,
                Admit::No { retry_after } => return Err(ProxyError::BreakerOpen { retry_after }),
            },
        };
        let (permit, admitted) = {
            let waiting = Waiting {
                queued,
                since: now,
                ended: false,
            };
            let permit = tries
                .app
                .limiter
                .acquire_priced(
                    tries.plan(),
                    tries.route,
                    queued.costs,
                    queued.deadline(now),
                )
                .await?;
            (permit, waiting.end())
        };
        tries.paid(queued.costs);
        let feedback = permit.as_ref().and_then(Permit::feedback);
        // No attempt can follow when the body cannot be replayed or this is the last one
        // allowed: a client that needs the head whole may then take it.
        let sent = AttemptHead {
            head: &mut *head,
            last: !body.replayable() || attempt_no >= attempts,
        };
        let (result, now) = attempt(
            tries.app,
            tries.config,
            way,
            Some(tries.route),
            tries.policy.attempt_timeout,
            (sent, body.for_attempt()),
            permit,
            admitted,
        )
        .await;
        let judged = match result {
            Ok(resp) => {
                let status = resp.status().as_u16();
                probe.record(status >= 500, now);
                // Peeked at here: a future of its own would hold the response a second
                // time in this one (48 bytes more, `proxy::sizes`).
                let (resp, action) = if classify::needs_body(&tries.upstream().classify, status) {
                    let (parts, body) = resp.into_parts();
                    let (prefix, body) = peek(body, classify::BODY_LIMIT)
                        .await
                        .map_err(ProxyError::UpstreamUnreachable)?;
                    let action =
                        classify::classify(&tries.upstream().classify, status, Some(&prefix));
                    (Response::from_parts(parts, body), action)
                } else {
                    (
                        resp,
                        classify::classify(&tries.upstream().classify, status, None),
                    )
                };
                tries.response(resp, action, feedback, now, || {
                    backoff_delay(tries.policy, attempt_no, prev_delay)
                })
            }
            Err(e) => tries.failure(e, body, &mut probe, now)?,
        };
        // Arguments rather than locals, which this future would hold across its awaits.
        let Some(delay) = tries.go_again(
            &judged,
            body.replayable() && attempt_no < attempts,
            deadline,
            || backoff_delay(tries.policy, attempt_no, prev_delay),
            attempt_no,
            now,
        ) else {
            return finish(judged.outcome, attempt_no);
        };
        // The response (and its concurrency permit) goes before we wait.
        drop(judged);
        tokio::time::sleep(delay).await;
        prev_delay = delay;
        attempt_no += 1;
    }
}

/// What every attempt of one request shares: the app, the live config, the route and
/// its policy; the rest is looked up from them (four pointers, held across every await
/// of the loop).
#[derive(Clone, Copy)]
struct Tries<'a> {
    app: &'a App,
    config: &'a Live,
    route: &'a Route,
    policy: &'a Policy,
}

/// One attempt's outcome as the retry decision reads it.
struct Judged {
    /// The policy retries this outcome (`retry.on`, the 429 classification).
    wants_retry: bool,
    /// The upstream's own wait, if it gave one.
    hint: Option<hints::Hint>,
    outcome: Result<Response<Body>, AttemptError>,
}

impl<'a> Tries<'a> {
    fn upstream(&self) -> &'a crate::config::Upstream {
        &self.config.upstreams[self.route.upstream]
    }

    fn shared(&self) -> &'a crate::policy::UpstreamPolicies {
        &self.config.policies.upstreams[self.route.upstream]
    }

    fn plan(&self) -> &'a std::sync::Arc<crate::limit::Plan> {
        &self.config.plans[self.route.upstream]
    }

    fn circuit(&self) -> &'a Circuit {
        self.shared().circuit(self.route.family)
    }

    fn labels(&self) -> (&'a str, &'a str) {
        crate::route::labels(&self.config.config, Some(self.route))
    }

    /// An attempt was admitted: a priced request counts what it paid in each unit.
    fn paid(&self, costs: &Costs) {
        let m = self.config.route_metrics.get(Some(self.route));
        for (index, c) in &m.cost_estimated {
            c.inc_by(costs.of(*index));
        }
    }

    /// A response, classified as `action`: the limiter learns whether the rate was
    /// refused, a 429 is counted and may cool the bucket down, and a wait the upstream
    /// gave is read.
    fn response(
        &self,
        resp: Response<Body>,
        action: Option<Action>,
        feedback: Option<crate::limit::Feedback>,
        now: Instant,
        backoff: impl FnOnce() -> Duration,
    ) -> Judged {
        let status = resp.status().as_u16();
        // Only responses that may be retried or cooled down are read for hints.
        let hint = (status == 429 || status >= 500 || action.is_some())
            .then(|| hints::server_hint(resp.headers(), SystemTime::now()))
            .flatten();
        if let Some(f) = feedback {
            // Other 5xx belong to the breaker, and a 429 classified `fail` (a cap that
            // waiting cannot fix) says nothing about the rate.
            let refused = status == 429 && matches!(action, Some(Action::Retry | Action::Cooldown));
            if refused || (status < 500 && status != 429) {
                f.report(refused);
            }
        }
        if let Some(action) = action
            && status == 429
        {
            self.count_429(action);
        }
        if action == Some(Action::Cooldown) {
            self.cool_down(hint.map_or_else(backoff, |h| h.wait), now);
        }
        Judged {
            wants_retry: wants_retry(Some(status), None, action, &self.policy.retry.on),
            hint,
            outcome: Ok(resp),
        }
    }

    fn count_429(&self, action: Action) {
        let name = match action {
            Action::Retry => "retry",
            Action::Cooldown => "cooldown",
            Action::Fail => "fail",
        };
        let (up, fam) = self.labels();
        self.app
            .metrics
            .upstream_429
            .with_label_values(&[up, fam, name])
            .inc();
    }

    /// Pauses the bucket (the upstream's or the family's) for `pause`, at most the cap.
    fn cool_down(&self, pause: Duration, now: Instant) {
        let whole_family = self.upstream().cooldown == CooldownScope::Family;
        let until = now + pause.min(self.policy.retry.cooldown_cap());
        self.app
            .limiter
            .pause(self.plan(), self.route, whole_family, until);
        let (upstream, family) = self.labels();
        tracing::info!(
            upstream,
            family,
            pause_ms = pause.as_millis() as u64,
            scope = if whole_family { "family" } else { "upstream" },
            "429: cooling the bucket down"
        );
    }

    /// A failed attempt: the breaker hears it unless it says nothing about the upstream
    /// (a refusal, a name that does not resolve, which a client can make up under a
    /// wildcard host, sluice's own want of resources, or the client's own failure),
    /// which goes to the client at once.
    fn failure(
        &self,
        e: AttemptError,
        body: &Replay,
        probe: &mut ProbeGuard<'_>,
        now: Instant,
    ) -> Result<Judged, ProxyError> {
        let clients = body.fault().is_some()
            || (matches!(e, AttemptError::Timeout(_)) && body.waiting_on_client());
        if clients
            || matches!(
                e,
                AttemptError::Denied(_) | AttemptError::Resolve(_) | AttemptError::Local(_)
            )
        {
            if matches!(e, AttemptError::Local(_)) {
                self.app.local_failure(&e);
            }
            probe.abandon();
            return Err(blame(body, e));
        }
        probe.record(true, now);
        Ok(Judged {
            wants_retry: wants_retry(None, e.retry_on(), None, &self.policy.retry.on),
            hint: None,
            outcome: Err(e),
        })
    }

    /// The wait before the next attempt, when the retry decision allows one (`may_retry`:
    /// the body can be sent again and attempts are left; `room`: the time left) and the
    /// retry budget has room; logged and counted either way.
    #[allow(
        clippy::too_many_arguments,
        reason = "the attempt's outcome and what the decision weighs it against"
    )]
    fn go_again(
        &self,
        judged: &Judged,
        may_retry: bool,
        deadline: Instant,
        backoff: impl FnOnce() -> Duration,
        attempt: u32,
        now: Instant,
    ) -> Option<Duration> {
        let wants_retry = judged.wants_retry;
        let next = Next {
            wants_retry,
            may_retry,
            hint: judged.hint,
            max_retry_after: self.policy.retry.max_retry_after,
            // Only a retry weighs it: most answers never pay for the difference.
            room: if wants_retry && may_retry {
                deadline.saturating_duration_since(now)
            } else {
                Duration::ZERO
            },
        };
        let verdict = next.verdict(backoff);
        let (upstream, family) = self.labels();
        // Borrowed, not formatted: most outcomes are answered, and the label is for the
        // few that are not.
        let status;
        let reason = match &judged.outcome {
            Ok(resp) => {
                status = resp.status();
                status.as_str()
            }
            Err(e) => e.label(),
        };
        let (delay, why) = match verdict {
            Verdict::Answer => return None,
            Verdict::TooLong { delay, why } => {
                tracing::info!(upstream, family, attempt, outcome = %reason,
                wait_ms = delay.as_millis() as u64, why, "not retrying: the wait is longer than allowed");
                return None;
            }
            Verdict::Retry { delay, why } => (delay, why),
        };
        let retries = &self.app.metrics.retries;
        if !self.shared().budget().try_retry(now) {
            retries
                .with_label_values(&[upstream, family, "budget_exhausted"])
                .inc();
            tracing::warn!(upstream, family, attempt, outcome = %reason,
            "not retrying: the retry budget is exhausted");
            return None;
        }
        retries.with_label_values(&[upstream, family, reason]).inc();
        tracing::info!(upstream, family, attempt, outcome = %reason,
        delay_ms = delay.as_millis() as u64, why, "retrying");
        Some(delay)
    }
}

/// What an attempt's outcome means for the next, decided without the clock, the budget
/// or the network: the loop above asks, then waits, counts and sends.
struct Next {
    /// The outcome is one the policy retries (`retry.on`, the 429 classification).
    wants_retry: bool,
    /// The body can be sent again and attempts are left.
    may_retry: bool,
    /// The upstream's own wait (Retry-After or a reset header), if it gave one.
    hint: Option<hints::Hint>,
    max_retry_after: Duration,
    /// Time left before `total_timeout`.
    room: Duration,
}

#[derive(Debug, PartialEq)]
enum Verdict {
    /// The outcome goes to the client as it is.
    Answer,
    /// A retry would wait longer than allowed: more than `max_retry_after` as the
    /// upstream asks, or past the total timeout.
    TooLong { delay: Duration, why: &'static str },
    /// Retry after `delay`; `why` names where the wait came from.
    Retry { delay: Duration, why: &'static str },
}

impl Next {
    /// `backoff` is the jittered backoff, asked for only when the upstream gave no wait.
    fn verdict(&self, backoff: impl FnOnce() -> Duration) -> Verdict {
        if !(self.wants_retry && self.may_retry) {
            return Verdict::Answer;
        }
        let (delay, why) = match self.hint {
            Some(h) => (h.wait, h.source),
            None => (backoff(), "backoff"),
        };
        if self.hint.is_some_and(|h| h.wait > self.max_retry_after) || delay >= self.room {
            Verdict::TooLong { delay, why }
        } else {
            Verdict::Retry { delay, why }
        }
    }
}

fn backoff_delay(policy: &Policy, attempt_no: u32, prev: Duration) -> Duration {
    backoff::delay(
        &policy.retry.backoff,
        attempt_no,
        prev,
        rand::random::<f64>(),
    )
}

/// The final answer of the loop: the upstream's response (with `sluice-attempts` when it
/// took more than one) or the last failure.
fn finish(
    outcome: Result<Response<Body>, AttemptError>,
    attempts: u32,
) -> Result<Response<Body>, ProxyError> {
    let mut resp = outcome?;
    if attempts > 1 {
        resp.headers_mut()
            .insert("sluice-attempts", HeaderValue::from(attempts));
    }
    Ok(resp)
}

/// A random UUIDv4 for `idempotency_generate`.
fn idempotency_key() -> HeaderValue {
    let mut text = [0u8; uuid::fmt::Hyphenated::LENGTH];
    let key = uuid::Uuid::new_v4().hyphenated().encode_lower(&mut text);
    HeaderValue::from_str(key).unwrap_or(HeaderValue::from_static("sluice-generated"))
}

/// A half-open probe that ends without an outcome (client gone, queue timeout) frees the
/// probe slot for the next request.
struct ProbeGuard<'a> {
    circuit: &'a Circuit,
    armed: bool,
}

impl ProbeGuard<'_> {
    /// The attempt's outcome reaches the breaker, as a probe's if it was one.
    fn record(&mut self, failed: bool, now: Instant) {
        let probe = std::mem::replace(&mut self.armed, false);
        self.circuit.with(|b| b.record(failed, probe, now));
    }

    /// The attempt says nothing about the upstream: a probe slot it held goes back.
    fn abandon(&mut self) {
        self.armed = false;
        self.circuit.with(|b| b.abandon_probe());
    }
}

impl Drop for ProbeGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.circuit.with(|b| b.abandon_probe());
        }
    }
}

/// One upstream attempt: response headers within `timeout`, then a body that may not
/// stall for longer than `timeout` between chunks. Measured per attempt, from `start`.
/// Returns, with the outcome, when it settled: the one clock reading that the limiter,
/// the upstream's latency and the retry decision all take the answer's time from.
#[allow(clippy::manual_async_fn, reason = "see above: arguments stored once")]
#[allow(
    clippy::too_many_arguments,
    reason = "the request, its route and what the attempt is timed by"
)]
fn attempt<'a>(
    app: &'a App,
    config: &'a Live,
    way: Way<'a>,
    route: Option<&'a Route>,
    timeout: Duration,
    (head, body): (AttemptHead<'a>, Body),
    permit: Option<Permit>,
    start: Instant,
) -> impl Future<Output = (Result<Response<Body>, AttemptError>, Instant)> + 'a {
    // The limiter counts the request from when its connection takes it to write (see
    // `Outbound`).
    let hook = permit.as_ref().and_then(Permit::send_hook);
    let body = Outbound::new(body, hook);
    // `start`: a reading the caller took just before (both callers await the attempt at
    // once), which the send also judges idle connections by: no clock read of its own.
    let via = Via {
        own: way
            .own()
            .map(|own| (own, &app.resolver, &config.egress_rules)),
        pooled: app.client_for(config, route.map(|r| r.upstream)),
    };
    let mut send = upstream::send(via, head, body, start);
    // Held while the attempt is out: if the client leaves meanwhile, the provider may still
    // be working on it, and a concurrency limit is the provider's.
    let mut out = Outstanding {
        permit,
        until: start + timeout,
    };
    async move {
        // On the client connection's own timer (see `upstream::timer`).
        let mut deadline = way.attempt_deadline(start + timeout);
        let sent = poll_fn(|cx| match Pin::new(&mut send).poll(cx) {
            Poll::Ready(sent) => Poll::Ready(Some(sent)),
            Poll::Pending => Pin::new(&mut deadline).poll(cx).map(|()| None),
        })
        .await;
        let settled = crate::clock::now();
        // The attempt is settled: its permit is the request's again. On failure it is
        // dropped here: if the request never reached a connection, its rate permits go
        // back (the provider never saw it).
        let mut permit = out.permit.take();
        let resp = match sent {
            Some(Ok(resp)) => resp,
            Some(Err(e)) => return (Err(e), settled),
            None => return (Err(AttemptError::Timeout(timeout)), settled),
        };
        // Taken before the answer settles the permit's ticket.
        let correction = route
            .filter(|r| reads_actual(config, r) || learns_points(config, r))
            .and(permit.as_ref())
            .and_then(Permit::correction);
        if let Some(p) = permit.as_mut() {
            p.answered(resp.status().as_u16(), settled);
            if let Some(r) = route
                && config.upstreams[r.upstream].learn == Learn::Headers
            {
                learn(&config.upstreams[r.upstream], p, resp.headers());
            }
        }
        let metered = match (route, correction) {
            (Some(r), Some(c)) => metered(app, config, r, c, resp.headers()),
            _ => None,
        };
        let m = config.route_metrics.get(route);
        m.upstream_duration(settled.saturating_duration_since(start).as_secs_f64());
        m.upstream_responses.inc(resp.status().as_str());
        let resp = resp.map(|b| ResponseBody::wrap(b, permit, timeout, metered));
        (Ok(resp), settled)
    }
}

/// Every budget the response announces paces the limits of its own unit: requests, or
/// the upstream's priced unit of the same name (`tokens`, `points`); others are ignored.
fn learn(upstream: &crate::config::Upstream, permit: &Permit, headers: &HeaderMap) {
    for a in announced::every(headers, SystemTime::now()) {
        let unit = if a.unit == announced::REQUESTS {
            Some(0)
        } else {
            upstream
                .units
                .iter()
                .position(|u| u == a.unit)
                .map(|i| i + 1)
        };
        if let Some(unit) = unit.and_then(|u| u8::try_from(u).ok()) {
            permit.learn_in(a, unit);
        }
    }
}

/// The unit index of `points` for an upstream that learns from responses: Shopify's
/// GraphQL bodies say what its bucket of points holds.
fn points_unit(config: &Live, route: &Route) -> Option<u8> {
    let u = &config.upstreams[route.upstream];
    if u.learn != Learn::Headers {
        return None;
    }
    let i = u.units.iter().position(|n| n == "points")?;
    u8::try_from(i + 1).ok()
}

fn learns_points(config: &Live, route: &Route) -> bool {
    points_unit(config, route).is_some()
}

/// Whether the route's family reads what its requests really cost from responses.
fn reads_actual(config: &Live, route: &Route) -> bool {
    route.family.is_some_and(|f| {
        config.upstreams[route.upstream].families[f]
            .prices
            .iter()
            .any(|p| p.actual.is_some())
    })
}

/// For a family whose prices read `actual`: corrects the limits the request paid by
/// what the response head reports, and returns what reads the rest from its body.
fn metered(
    app: &App,
    config: &Live,
    route: &Route,
    correction: Correction,
    headers: &HeaderMap,
) -> Option<Box<Metered>> {
    let family = &config.upstreams[route.upstream].families[route.family?];
    let (up, fam) = crate::route::labels(&config.config, Some(route));
    let counter = |index: u8| {
        let unit = family.prices.iter().find(|p| p.index == index)?;
        Some(
            app.metrics
                .cost
                .with_label_values(&[up, fam, &unit.unit, "actual"]),
        )
    };
    let reported = crate::price::usage::from_headers(&family.prices, headers);
    if !reported.is_empty() {
        for &(index, n) in &reported {
            if let Some(c) = counter(index) {
                c.inc_by(n);
            }
        }
        correction.correct(&reported);
    }
    let sse = headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim_start().starts_with("text/event-stream"));
    let points = points_unit(config, route);
    let meter = crate::price::usage::Meter::reading(&family.prices, sse, points.is_some())?;
    let counters = family
        .prices
        .iter()
        .filter_map(|p| Some((p.index, counter(p.index)?)))
        .collect();
    Some(Box::new(Metered {
        meter,
        correction,
        counters,
        points,
    }))
}

/// A permit whose attempt is out. Dropped with it unsettled (the client reset its stream
/// or closed its connection), a permit that holds a concurrency slot keeps it until the
/// attempt would have timed out: the slot is free when the provider has answered, which
/// sluice will not see now, or when the attempt's time is up. Rate permits go as they
/// always do (`Permit::drop`: counted if sent, given back if not).
struct Outstanding {
    permit: Option<Permit>,
    until: Instant,
}

impl Drop for Outstanding {
    fn drop(&mut self) {
        let Some(permit) = self.permit.take() else {
            return;
        };
        if !permit.holds_concurrency() || crate::clock::now() >= self.until {
            return;
        }
        // A runtime is there whenever a request's future is dropped, but for the very
        // end of the process, when the slot no longer matters.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let until = self.until;
            rt.spawn(async move {
                tokio::time::sleep_until(until).await;
                drop(permit);
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Next, Verdict, is_grpc};
    use crate::policy::hints::Hint;
    use std::time::Duration;

    #[test]
    fn grpc_is_told_by_its_content_type() {
        let h = |ct: &'static str| {
            let mut h = http::HeaderMap::new();
            h.insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static(ct),
            );
            h
        };
        for yes in [
            "application/grpc",
            "application/grpc+proto",
            "Application/GRPC;x=1",
        ] {
            assert!(is_grpc(&h(yes)), "{yes}");
        }
        for no in ["application/grpcx", "application/json", "application/grp"] {
            assert!(!is_grpc(&h(no)), "{no}");
        }
        assert!(!is_grpc(&http::HeaderMap::new()));
    }

    /// The retry decision, case by case: when the outcome goes to the client, when a
    /// retry would wait too long, and where the wait comes from.
    #[test]
    fn retry_verdicts() {
        let s = Duration::from_secs;
        let hint = |secs| {
            Some(Hint {
                wait: s(secs),
                source: "retry-after",
            })
        };
        let next = |wants_retry, may_retry, hint, room| Next {
            wants_retry,
            may_retry,
            hint,
            max_retry_after: s(60),
            room: s(room),
        };
        let retry = |secs, why| Verdict::Retry {
            delay: s(secs),
            why,
        };
        let too_long = |secs, why| Verdict::TooLong {
            delay: s(secs),
            why,
        };
        for (case, n, want) in [
            (
                "not a retryable outcome",
                next(false, true, None, 30),
                Verdict::Answer,
            ),
            (
                "no attempts or replay left",
                next(true, false, hint(1), 30),
                Verdict::Answer,
            ),
            (
                "backoff when the upstream says nothing",
                next(true, true, None, 30),
                retry(2, "backoff"),
            ),
            (
                "the upstream's wait wins over backoff",
                next(true, true, hint(5), 30),
                retry(5, "retry-after"),
            ),
            (
                "a wait over max_retry_after",
                next(true, true, hint(61), 600),
                too_long(61, "retry-after"),
            ),
            (
                "a wait past the total timeout",
                next(true, true, hint(5), 5),
                too_long(5, "retry-after"),
            ),
            (
                "backoff past the total timeout",
                next(true, true, None, 1),
                too_long(2, "backoff"),
            ),
        ] {
            assert_eq!(n.verdict(|| s(2)), want, "{case}");
        }
        // Backoff is drawn only when it is used.
        let drawn = std::cell::Cell::new(false);
        next(true, true, hint(1), 30).verdict(|| {
            drawn.set(true);
            s(2)
        });
        assert!(
            !drawn.get(),
            "no backoff drawn when the upstream gave a wait"
        );
    }

    #[test]
    fn generated_keys_are_uuid_v4() {
        let k = super::idempotency_key();
        let s = k.to_str().unwrap();
        assert_eq!(s.len(), 36);
        assert_eq!(&s[14..15], "4");
        assert!(matches!(&s[19..20], "8" | "9" | "a" | "b"), "{s}");
        assert_ne!(super::idempotency_key(), super::idempotency_key());
    }
}
