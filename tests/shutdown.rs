//! Shutdown with a full queue: in-flight and queued requests carry on during the drain;
//! whatever is still queued when it ends gets 503 `shutting_down`; no client sees a
//! reset connection. Idle connections close when the drain starts.

use sluice_test_support as support;

use std::time::Duration;

use support::*;

#[tokio::test]
async fn fifty_queued_clients_all_get_a_complete_response_when_the_drain_runs_out() {
    let up = Upstream::start().await;
    let mut proxy = Proxy::start(
        "drain_timeout = \"700ms\"\n\
         [[upstream]]\nname = \"api\"\nhosts = [\"127.0.0.1\"]\nlimits = [{ kind = \"concurrency\", max = 1 }]\n",
    )
    .await;
    let client = proxy.client();
    let mut clients = Vec::new();
    for i in 0..50 {
        let (c, url) = (client.clone(), up.url(&format!("/slow/300?n={i}")));
        clients.push(tokio::spawn(async move {
            let resp = c.get(url).send().await.expect("a response, not a reset");
            let status = resp.status().as_u16();
            let reason = resp
                .headers()
                .get("sluice-reason")
                .map(|v| v.to_str().unwrap().to_string());
            let body = resp.text().await.expect("a complete body");
            (status, reason, body)
        }));
    }
    // One in flight, the rest queued behind it.
    assert!(
        metric_reaches(
            &proxy,
            r#"sluice_queue_depth{family="-",upstream="api"}"#,
            49.0
        )
        .await,
        "all queued"
    );
    proxy.shutdown();

    let mut ok = 0;
    let mut refused = 0;
    for c in clients {
        let (status, reason, body) = c.await.unwrap();
        match status {
            200 => {
                assert_eq!(body, "slow");
                ok += 1;
            }
            503 => {
                assert_eq!(reason.as_deref(), Some("shutting_down"));
                assert!(body.contains("sluice_shutting_down"), "{body}");
                refused += 1;
            }
            other => panic!("unexpected status {other}"),
        }
    }
    assert!(
        ok >= 2,
        "requests admitted during the drain finished ({ok})"
    );
    assert!(
        refused >= 1,
        "the ones still queued at the end were refused ({refused})"
    );
    tokio::time::timeout(Duration::from_secs(5), proxy.task.take().unwrap())
        .await
        .expect("the server stops")
        .unwrap();
}

/// An idle keep-alive connection is closed as soon as the drain starts, not when the
/// drain time runs out: the connection's task has to look at it although its socket is
/// quiet.
#[tokio::test]
async fn an_idle_keep_alive_connection_is_closed_when_the_drain_starts() {
    let up = Upstream::start().await;
    let mut proxy = Proxy::start("drain_timeout = \"30s\"\n").await;
    let mut conn = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    assert_eq!(get(&mut conn, &up.url("/"), false).await.status, 200);
    proxy.shutdown();
    let mut buf = [0u8; 64];
    let read = tokio::time::timeout(
        Duration::from_secs(10),
        tokio::io::AsyncReadExt::read(&mut conn, &mut buf),
    )
    .await
    .expect("closed within the drain, not at its end");
    assert_eq!(read.unwrap(), 0, "closed, with nothing more sent");
    tokio::time::timeout(Duration::from_secs(10), proxy.task.take().unwrap())
        .await
        .expect("the server stops")
        .unwrap();
}
