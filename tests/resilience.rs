//! Retries, 429 classification and cool-down, the circuit breaker and timeouts, through
//! the real proxy against a scripted upstream (`/seq/NAME/STEP,...`, see support).
//! Waits are kept short and margins wide; exact timing is tested with paused time in
//! `src/policy`.

use sluice_test_support as support;

use std::time::Duration;

use support::*;
use tokio::time::Instant;

/// An upstream named "api" for 127.0.0.1 with fast backoff, plus `extra`.
fn config(extra: &str) -> String {
    format!(
        "[defaults.retry]\nbackoff = {{ base = \"50ms\", max = \"200ms\", jitter = \"none\" }}\n\
         [[upstream]]\nname = \"api\"\nhosts = [\"127.0.0.1\"]\n{extra}"
    )
}

fn arrivals(up: &Upstream, path: &str) -> Vec<Instant> {
    up.seen()
        .iter()
        .filter(|s| s.uri == path)
        .map(|s| s.at)
        .collect()
}

#[tokio::test]
async fn a_429_with_retry_after_seconds_is_retried_after_the_stated_delay() {
    let up = Upstream::start().await;
    let proxy = Proxy::start(&config("")).await;
    let resp = proxy
        .client()
        .get(up.url("/seq/a/429ra1,200"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["sluice-attempts"], "2");
    let at = arrivals(&up, "/seq/a/429ra1,200");
    assert_eq!(at.len(), 2);
    assert!(
        at[1] - at[0] >= Duration::from_millis(950),
        "waited {:?}",
        at[1] - at[0]
    );
    let m = proxy.metrics().await;
    assert!(
        m.contains(r#"sluice_retries_total{family="-",reason="429",upstream="api"} 1"#),
        "{m}"
    );
    assert!(
        m.contains(r#"sluice_upstream_429_total{action="cooldown",family="-",upstream="api"} 1"#),
        "{m}"
    );
    assert!(
        m.contains(r#"sluice_upstream_responses_total{family="-",status="429",upstream="api"} 1"#),
        "{m}"
    );
}

#[tokio::test]
async fn a_429_with_an_http_date_is_retried_after_that_date() {
    let up = Upstream::start().await;
    let proxy = Proxy::start(&config("")).await;
    let path = "/seq/b/429date2,200";
    let resp = proxy.client().get(up.url(path)).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let at = arrivals(&up, path);
    // The date has one-second resolution: 2 s after the response's Date is 1-2 s away.
    assert!(
        at[1] - at[0] >= Duration::from_millis(950),
        "waited {:?}",
        at[1] - at[0]
    );
}

#[tokio::test]
async fn a_post_without_an_idempotency_key_is_sent_exactly_once() {
    let up = Upstream::start().await;
    let proxy = Proxy::start(&config("")).await;
    let client = proxy.client();
    let resp = client
        .post(up.url("/seq/c/503,200"))
        .body("order")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 503, "the upstream's answer, not retried");
    assert!(resp.headers().get("sluice-attempts").is_none());
    assert_eq!(arrivals(&up, "/seq/c/503,200").len(), 1);
    // Without a body as well: an empty body can always be sent again, but the POST may
    // have taken effect.
    let resp = client.post(up.url("/seq/c2/503,200")).send().await.unwrap();
    assert_eq!(resp.status(), 503, "an empty POST, not retried");
    assert_eq!(arrivals(&up, "/seq/c2/503,200").len(), 1);

    let resp = client
        .post(up.url("/seq/d/503,200"))
        .header("idempotency-key", "order-17")
        .body("order")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["sluice-attempts"], "2");
    let seen: Vec<_> = up
        .seen()
        .into_iter()
        .filter(|s| s.uri == "/seq/d/503,200")
        .collect();
    assert_eq!(seen.len(), 2);
    assert!(
        seen.iter()
            .all(|s| s.header("idempotency-key") == Some("order-17")),
        "key forwarded unchanged"
    );
}

/// A gRPC call is never retried by sluice, with an idempotency key or without: whether a
/// method may run twice is in the service's config, and gRPC clients retry by their own
/// policy. The same POST in JSON with the key is (above).
#[tokio::test]
async fn a_grpc_call_is_sent_once_whatever_it_carries() {
    let up = Upstream::start().await;
    let proxy = Proxy::start(&config("")).await;
    for ct in ["application/grpc", "application/grpc+proto"] {
        let path = format!("/seq/grpc-{}/503,200", ct.len());
        let resp = proxy
            .client()
            .post(up.url(&path))
            .header("content-type", ct)
            .header("idempotency-key", "call-1")
            .body("\0\0\0\0\x01x")
            .send()
            .await
            .unwrap();
        assert_eq!(
            resp.status(),
            503,
            "{ct}: the upstream's answer, not retried"
        );
        assert_eq!(arrivals(&up, &path).len(), 1, "{ct}");
    }
}

#[tokio::test]
async fn generated_idempotency_keys_make_posts_retryable() {
    let up = Upstream::start().await;
    let proxy = Proxy::start(&config("idempotency_generate = true\n")).await;
    let resp = proxy
        .client()
        .post(up.url("/seq/e/502,200"))
        .body("x")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let seen: Vec<_> = up
        .seen()
        .into_iter()
        .filter(|s| s.uri == "/seq/e/502,200")
        .collect();
    assert_eq!(seen.len(), 2);
    let key = seen[0].header("idempotency-key").expect("a key was added");
    assert_eq!(
        seen[1].header("idempotency-key"),
        Some(key),
        "the same key on every attempt"
    );
}

#[tokio::test]
async fn statuses_that_never_improve_are_not_retried() {
    let up = Upstream::start().await;
    let proxy = Proxy::start(&config("")).await;
    for status in [400, 401, 403, 404, 409, 422] {
        let path = format!("/seq/never{status}/{status},200");
        let resp = proxy.client().get(up.url(&path)).send().await.unwrap();
        assert_eq!(resp.status().as_u16(), status);
        assert_eq!(arrivals(&up, &path).len(), 1, "{status} retried");
    }
}

#[tokio::test]
async fn a_cap_reached_429_is_passed_through_after_one_attempt() {
    let up = Upstream::start().await;
    let proxy = Proxy::start(&config(
        "retry = { backoff = { base = \"5s\", max = \"5s\", jitter = \"none\" } }\n\
         [[upstream.classify]]\nstatus = 429\njson = \"/error/code\"\nequals = [\"unverified_count_cap\"]\naction = \"fail\"\n",
    ))
    .await;
    let path = "/seq/f/429cap,200";
    let resp = proxy.client().get(up.url(path)).send().await.unwrap();
    assert_eq!(resp.status(), 429);
    assert!(
        resp.headers().get("sluice-reason").is_none(),
        "the upstream's own response"
    );
    let body = resp.text().await.unwrap();
    assert_eq!(
        body, r#"{"error": {"code": "unverified_count_cap", "message": "lifetime cap reached"}}"#,
        "relayed unchanged"
    );
    assert_eq!(arrivals(&up, path).len(), 1);
    let m = proxy.metrics().await;
    assert!(
        m.contains(r#"sluice_upstream_429_total{action="fail",family="-",upstream="api"} 1"#),
        "{m}"
    );
    // No cool-down: the next request goes straight through.
    let t0 = Instant::now();
    assert_eq!(
        proxy
            .client()
            .get(up.url("/after"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    // A cool-down without a hint would last the backoff delay, 5 s.
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
}

#[tokio::test]
async fn a_429_pauses_the_whole_bucket_for_the_stated_time() {
    let up = Upstream::start().await;
    let proxy = Proxy::start(&config(
        "[[upstream.family]]\nname = \"orders\"\npaths = [\"/seq/**\", \"/o/**\"]\n\
         limits = [{ kind = \"sliding_window\", permits = 100, window = \"1s\" }]\n",
    ))
    .await;
    let client = proxy.client();
    let first = {
        let c = client.clone();
        let url = up.url("/seq/g/429ra2,200");
        tokio::spawn(async move { c.get(url).send().await.unwrap().status() })
    };
    while arrivals(&up, "/seq/g/429ra2,200").is_empty() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let t429 = arrivals(&up, "/seq/g/429ra2,200")[0];
    tokio::time::sleep(Duration::from_millis(200)).await;
    // Another request of the same family waits out the cool-down too.
    assert_eq!(
        client
            .get(up.url("/o/other"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    let other = arrivals(&up, "/o/other")[0];
    assert!(
        other - t429 >= Duration::from_millis(1900),
        "sent {:?} after the 429",
        other - t429
    );
    assert_eq!(first.await.unwrap(), 200);
    let (_, buckets) = proxy.admin_get("/buckets").await;
    assert!(buckets.contains("\"family\": \"orders\""), "{buckets}");
}

#[tokio::test]
async fn an_always_failing_upstream_opens_the_breaker_then_recovers() {
    let up = Upstream::start().await;
    let proxy = Proxy::start(&config(
        "retry = { max_attempts = 1 }\nbreaker = { failure_ratio = 0.5, min_requests = 4, window = \"10s\", open_for = \"3s\" }\n",
    ))
    .await;
    let client = proxy.client();
    let path = "/seq/h/503,503,503,503,200";
    for _ in 0..4 {
        assert_eq!(client.get(up.url(path)).send().await.unwrap().status(), 503);
    }
    let m = proxy.metrics().await;
    assert!(
        m.contains(r#"sluice_breaker_state{state="open",upstream="api"} 1"#),
        "{m}"
    );
    let t0 = Instant::now();
    let fast = client.get(up.url(path)).send().await.unwrap();
    // Held for the probe, it would wait until the breaker half-opens, 3 s after opening.
    assert!(t0.elapsed() < Duration::from_millis(2000), "fails fast");
    assert_eq!(fast.status(), 503);
    assert_eq!(fast.headers()["sluice-reason"], "breaker_open");
    assert!(
        ["2", "3"].contains(&fast.headers()["retry-after"].to_str().unwrap()),
        "{:?}",
        fast.headers()["retry-after"]
    );
    assert_eq!(arrivals(&up, path).len(), 4, "no traffic while open");

    tokio::time::sleep(Duration::from_millis(3100)).await;
    // The upstream has healed: the half-open probe succeeds and closes the circuit.
    assert_eq!(client.get(up.url(path)).send().await.unwrap().status(), 200);
    assert_eq!(client.get(up.url(path)).send().await.unwrap().status(), 200);
    let m = proxy.metrics().await;
    assert!(
        m.contains(r#"sluice_breaker_state{state="closed",upstream="api"} 1"#),
        "{m}"
    );
}

#[tokio::test]
async fn a_hung_attempt_times_out_and_is_retried() {
    let up = Upstream::start().await;
    let proxy = Proxy::start(&config("attempt_timeout = \"300ms\"\n")).await;
    let resp = proxy
        .client()
        .get(up.url("/seq/i/hang,200"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["sluice-attempts"], "2");

    let resp = proxy
        .client()
        .post(up.url("/seq/j/hang"))
        .body("x")
        .send()
        .await
        .unwrap();
    assert_eq!(
        resp.status(),
        504,
        "not retryable: the attempt timeout is final"
    );
    assert_eq!(resp.headers()["sluice-reason"], "upstream_timeout");
}

/// A client connection times its attempts with one timer moved from request to request:
/// a shorter attempt timeout after a longer one still ends on time, on the same
/// connection.
#[tokio::test]
async fn a_shorter_attempt_timeout_after_a_longer_one_ends_on_time() {
    let up = Upstream::start().await;
    let proxy = Proxy::start(&config(
        "attempt_timeout = \"60s\"\nretry = { max_attempts = 1 }\n\
         [[upstream.family]]\nname = \"short\"\npaths = [\"/seq/short/**\"]\nattempt_timeout = \"300ms\"\n",
    ))
    .await;
    let client = proxy.client();
    let resp = client.get(up.url("/slow/50")).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let t0 = Instant::now();
    let resp = client.get(up.url("/seq/short/hang")).send().await.unwrap();
    assert_eq!(resp.status(), 504);
    assert_eq!(resp.headers()["sluice-reason"], "upstream_timeout");
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
}

#[tokio::test]
async fn total_timeout_covers_the_queue_wait() {
    let up = Upstream::start().await;
    let proxy = Proxy::start(&config(
        "limits = [{ kind = \"concurrency\", max = 1 }]\n\
         [[upstream.family]]\nname = \"short\"\npaths = [\"/queued\"]\ntotal_timeout = \"800ms\"\n",
    ))
    .await;
    let client = proxy.client();
    let holder = {
        let (c, url) = (client.clone(), up.url("/slow/4000"));
        tokio::spawn(async move { c.get(url).send().await.unwrap().status() })
    };
    assert!(
        eventually(Duration::from_secs(10), || async { !up.seen().is_empty() }).await,
        "the holder reached the upstream"
    );
    let t0 = Instant::now();
    let resp = client.get(up.url("/queued")).send().await.unwrap();
    assert_eq!(resp.status(), 504);
    assert_eq!(resp.headers()["sluice-reason"], "total_timeout");
    // Behind the holder it would wait 4 s.
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    assert_eq!(holder.await.unwrap(), 200);
    assert!(
        up.seen().iter().all(|s| s.uri != "/queued"),
        "it never left the queue"
    );
}

#[tokio::test]
async fn an_exhausted_budget_stops_retries() {
    let up = Upstream::start().await;
    let proxy = Proxy::start(&config(
        "retry = { budget = { ratio = 0.0, min_per_second = 0 } }\n",
    ))
    .await;
    let path = "/seq/k/503,200";
    let resp = proxy.client().get(up.url(path)).send().await.unwrap();
    assert_eq!(resp.status(), 503);
    assert_eq!(arrivals(&up, path).len(), 1);
    let m = proxy.metrics().await;
    assert!(
        m.contains(
            r#"sluice_retries_total{family="-",reason="budget_exhausted",upstream="api"} 1"#
        ),
        "{m}"
    );
}

#[tokio::test]
async fn a_retry_after_longer_than_allowed_goes_to_the_client() {
    let up = Upstream::start().await;
    let proxy = Proxy::start(&config("retry = { max_retry_after = \"1s\" }\n")).await;
    let t0 = Instant::now();
    let path = "/seq/l/429ra30,200";
    let resp = proxy.client().get(up.url(path)).send().await.unwrap();
    assert_eq!(resp.status(), 429);
    assert_eq!(resp.headers()["retry-after"], "30");
    // Not retried (one arrival, below); waiting out the hint would take 30 s.
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    assert_eq!(arrivals(&up, path).len(), 1);
}

#[tokio::test]
async fn connect_failures_are_retried_then_reported() {
    let port = closed_port().await;
    let proxy = Proxy::start(&format!(
        "[defaults.retry]\nmax_attempts = 3\nbackoff = {{ base = \"20ms\", max = \"50ms\", jitter = \"none\" }}\n\
         [[upstream]]\nname = \"gone\"\nhosts = [\"127.0.0.1:{}\"]\n",
        port.port()
    ))
    .await;
    let resp = proxy
        .client()
        .get(format!("http://{port}/"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 502);
    assert_eq!(resp.headers()["sluice-reason"], "upstream_unreachable");
    let m = proxy.metrics().await;
    assert!(
        m.contains(r#"sluice_retries_total{family="-",reason="connect",upstream="gone"} 2"#),
        "{m}"
    );
}

#[tokio::test]
async fn cooldown_upstream_pauses_every_family() {
    let up = Upstream::start().await;
    let proxy = Proxy::start(&config(
        "cooldown = \"upstream\"\n\
         [[upstream.family]]\nname = \"a\"\npaths = [\"/seq/**\"]\n\
         [[upstream.family]]\nname = \"b\"\npaths = [\"/b/**\"]\n",
    ))
    .await;
    let client = proxy.client();
    let path = "/seq/m/429ra1,200";
    let first = {
        let (c, url) = (client.clone(), up.url(path));
        tokio::spawn(async move { c.get(url).send().await.unwrap().status() })
    };
    while arrivals(&up, path).is_empty() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let t429 = arrivals(&up, path)[0];
    assert_eq!(
        client.get(up.url("/b/x")).send().await.unwrap().status(),
        200
    );
    let other = arrivals(&up, "/b/x")[0];
    assert!(
        other - t429 >= Duration::from_millis(900),
        "family b went after {:?}",
        other - t429
    );
    assert_eq!(first.await.unwrap(), 200);
}
