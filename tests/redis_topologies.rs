//! Shared limits on the Redis topologies users run, each started here on loopback: a
//! primary demoted under load (what a failover looks like to a client still on the old
//! primary), Redis answering errors (`OOM`, `WRONGTYPE`), a three-master Redis Cluster
//! resharded under traffic, and Sentinel failing over. The provider's arrival log must
//! stay within the limit, Redis must never be hammered, and every request is answered as
//! `on_redis_error` says.

use sluice_test_support as support;

use std::time::Duration;

use support::provider::Counter;
use support::redis::Redis;
use tokio::time::Instant;

/// sluice processes sharing limits through one `[cluster]`, in front of one upstream that
/// logs each arrival with the replica and the key it came with.
struct Fleet {
    upstream: support::Upstream,
    replicas: Vec<(support::Sluice, u16, u16)>,
    _dir: tempfile::TempDir,
}

impl Fleet {
    /// `n` replicas; `limits` for the upstream (keyed by `x-key`), `cluster` the whole
    /// `[cluster]` body.
    async fn start(n: usize, limits: &str, cluster: &str) -> Fleet {
        Fleet::start_on(n, 1, limits, cluster).await
    }

    /// As `start`, each replica serving on `workers` threads.
    async fn start_on(n: usize, workers: usize, limits: &str, cluster: &str) -> Fleet {
        let upstream = support::Upstream::start().await;
        let dir = tempfile::tempdir().unwrap();
        let mut replicas = Vec::new();
        for i in 0..n {
            let path = dir.path().join(format!("sluice-{i}.toml"));
            std::fs::write(
                &path,
                format!(
                    "[proxy]\nlisten = \"127.0.0.1:0\"\nadmin = \"127.0.0.1:0\"\n\
                     [[upstream]]\nname = \"api\"\nhosts = [\"127.0.0.1\"]\n\
                     key = \"header:x-key\"\nlimits = [{limits}]\n\
                     [upstream.retry]\nmax_attempts = 1\n[cluster]\n{cluster}"
                ),
            )
            .unwrap();
            let mut s = support::Sluice::spawn(&[
                "run",
                "--workers",
                &workers.to_string(),
                "-c",
                path.to_str().unwrap(),
            ]);
            let (port, admin) = s.listening().await;
            assert!(s.ready(admin).await, "replica {i} became ready");
            replicas.push((s, port, admin));
        }
        Fleet {
            upstream,
            replicas,
            _dir: dir,
        }
    }

    /// One closed-loop client per replica and key until `until`: each answer's status,
    /// how long it took and when it started.
    async fn load(&self, keys: &[String], until: Instant) -> Vec<(u16, Duration, Instant)> {
        let mut tasks = Vec::new();
        for (i, (_, port, _)) in self.replicas.iter().enumerate() {
            for key in keys {
                let client = client_via(*port);
                let url = self.upstream.url("/v1/items");
                let key = key.clone();
                tasks.push(tokio::spawn(async move {
                    let mut out = Vec::new();
                    while Instant::now() < until {
                        let t = Instant::now();
                        let r = client
                            .get(&url)
                            .header("x-replica", i.to_string())
                            .header("x-key", &key)
                            .send()
                            .await;
                        let status = match r {
                            Ok(r) => {
                                let s = r.status().as_u16();
                                let _ = r.bytes().await;
                                s
                            }
                            Err(_) => 0,
                        };
                        out.push((status, t.elapsed(), t));
                        if status != 200 {
                            // A refusal comes at once: do not spin on it.
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                    }
                    out
                }));
            }
        }
        let mut all = Vec::new();
        for t in tasks {
            all.extend(t.await.unwrap());
        }
        all
    }

    /// Arrivals since `from` of each key, in order.
    fn arrivals(&self, from: Instant) -> std::collections::BTreeMap<String, Vec<Instant>> {
        let mut by = std::collections::BTreeMap::<String, Vec<Instant>>::new();
        for s in self.upstream.seen().iter().filter(|s| s.at >= from) {
            let key = s.header("x-key").unwrap_or("-").to_string();
            by.entry(key).or_default().push(s.at);
        }
        for v in by.values_mut() {
            v.sort();
        }
        by
    }

    async fn metrics(&self, i: usize) -> String {
        reqwest::get(format!("http://127.0.0.1:{}/metrics", self.replicas[i].2))
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }
}

fn client_via(port: u16) -> reqwest::Client {
    reqwest::Client::builder()
        .proxy(reqwest::Proxy::all(format!("http://127.0.0.1:{port}")).unwrap())
        .timeout(Duration::from_secs(40))
        .build()
        .unwrap()
}

/// Arrivals over a sliding window's limit, as the provider would refuse them.
fn over(permits: u32, window: Duration, arrivals: &[Instant]) -> usize {
    let mut provider = Counter::sliding(permits, window);
    arrivals.iter().filter(|a| !provider.arrive(**a)).count()
}

/// Each key's arrivals over a sliding window's limit.
fn over_by_key(
    permits: u32,
    window: Duration,
    arrivals: &std::collections::BTreeMap<String, Vec<Instant>>,
) -> Vec<(&str, usize)> {
    arrivals
        .iter()
        .map(|(key, a)| (key.as_str(), over(permits, window, a)))
        .collect()
}

/// A Redis Cluster of `n` nodes, `replicas` per master, made by `redis-cli --cluster
/// create`: the nodes and their addresses.
fn create_cluster(dir: &std::path::Path, n: usize, replicas: u32) -> (Vec<Redis>, Vec<String>) {
    let nodes: Vec<Redis> = (0..n).map(|_| Redis::start_cluster_node(dir)).collect();
    form_cluster(nodes, replicas, &[])
}

/// Makes a Redis Cluster of `nodes` with `redis-cli --cluster create`, `cli` being how
/// redis-cli reaches them (TLS, a password): the nodes and their addresses.
fn form_cluster(nodes: Vec<Redis>, replicas: u32, cli: &[&str]) -> (Vec<Redis>, Vec<String>) {
    let addrs: Vec<String> = nodes
        .iter()
        .map(|n| format!("127.0.0.1:{}", n.port))
        .collect();
    let out = std::process::Command::new("redis-cli")
        .args(cli)
        .args(["--cluster", "create"])
        .args(&addrs)
        .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    (nodes, addrs)
}

/// Whether every node of a Cluster says it is up, within 10 s.
async fn formed(nodes: &[Redis]) -> bool {
    support::eventually(Duration::from_secs(10), || {
        let ok = nodes
            .iter()
            .all(|n| n.cmd(&["CLUSTER", "INFO"]).contains("cluster_state:ok"));
        async move { ok }
    })
    .await
}

/// The test that judges utilisation by the wall clock runs alone; the others share.
static ALONE: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

fn keys(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("key-{i}")).collect()
}

/// The primary sluice uses is demoted (`REPLICAOF`, as a failover leaves a client on the
/// old primary) under load, then promoted again. Every reservation answers `READONLY`
/// meanwhile: the calls stay bounded, the fallback engages, and sluice is back on Redis
/// without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_demoted_primary_is_fallen_back_from_and_followed_back() {
    let _shared = ALONE.read().await;
    support::crypto();
    let primary = Redis::start();
    let other = Redis::start();
    let fleet = Fleet::start(
        2,
        "{ kind = \"sliding_window\", permits = 12, window = \"1s\", scope = \"global\" }",
        &format!(
            "redis = \"{}\"\nreplicas = 2\nopen_for = \"1s\"\n",
            primary.url()
        ),
    )
    .await;
    let t0 = Instant::now();
    let three = keys(3);
    let load = fleet.load(&three, t0 + Duration::from_secs(10));
    let chaos = async {
        tokio::time::sleep_until(t0 + Duration::from_secs(2)).await;
        let before = primary.attempts("evalsha");
        primary.cmd(&["REPLICAOF", "127.0.0.1", &other.port.to_string()]);
        let demoted = Instant::now();
        tokio::time::sleep_until(t0 + Duration::from_secs(6)).await;
        let during = primary.attempts("evalsha") - before;
        primary.cmd(&["REPLICAOF", "NO", "ONE"]);
        (during, Instant::now() - demoted)
    };
    let (answers, (during, demoted_for)) = tokio::join!(load, chaos);
    // Each replica: a few failed calls, then one probe per `open_for` and the calls of
    // requests that gave up on Redis themselves: far below 2 × its request rate + 10/s.
    let requests = answers
        .iter()
        .filter(|a| a.2 >= t0 + Duration::from_secs(2) && a.2 < t0 + Duration::from_secs(6))
        .count() as u64;
    let bound = 2 * requests + 10 * 2 * demoted_for.as_secs();
    eprintln!(
        "demoted for {demoted_for:?}: {during} script calls reached it for {requests} requests"
    );
    assert!(
        during <= bound,
        "{during} calls in {demoted_for:?} for {requests} requests"
    );
    for (key, a) in fleet.arrivals(t0) {
        assert_eq!(
            over(12, Duration::from_secs(1), &a),
            0,
            "key {key}: over the limit"
        );
    }
    assert!(
        answers.iter().all(|a| a.0 == 200 || a.0 == 429),
        "every request answered"
    );
    let slowest = answers.iter().map(|a| a.1).max().unwrap_or_default();
    assert!(slowest < Duration::from_secs(5), "one waited {slowest:?}");
    // Back on Redis and sharing in the last seconds.
    let late: usize = fleet
        .arrivals(t0 + Duration::from_secs(8))
        .values()
        .map(Vec::len)
        .sum();
    assert!(late >= 3 * 12, "about the limit again: {late} in 2 s");
    for i in 0..2 {
        let m = fleet.metrics(i).await;
        assert_eq!(
            support::metric(&m, r#"sluice_cluster_mode{mode="redis"}"#),
            Some(1.0),
            "replica {i} back on Redis"
        );
        assert!(
            support::metric(&m, r#"sluice_cluster_reservations_total{result="local"}"#)
                .is_some_and(|n| n > 0.0),
            "replica {i} fell back"
        );
        assert!(
            support::metric(&m, r#"sluice_cluster_errors_total{kind="readonly"}"#)
                .is_some_and(|n| n > 0.0),
            "replica {i} named the error: {m}"
        );
        let warned = fleet.replicas[i].0.log_lines("readonly");
        assert!(
            !warned.is_empty() && warned.len() < 20,
            "a few warnings naming it: {warned:?}"
        );
    }
}

/// What a test does to Redis to make it answer errors.
type Breaks<'a> = &'a dyn Fn(&Redis);

/// Redis answering an error that no retry cures, under `deny`: each request gets 503
/// `cluster_unavailable` within `timeout × failures` of asking, never after `max_wait`,
/// and Redis sees a bounded number of calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_redis_answers_open_the_breaker_without_a_storm() {
    let _shared = ALONE.read().await;
    support::crypto();
    let filler = vec![b'x'; 64 << 10];
    let cases: [(&str, Redis, Breaks); 3] = [
        ("readonly", Redis::start(), &|r: &Redis| {
            r.cmd(&["REPLICAOF", "127.0.0.1", "1"]);
        }),
        (
            "oom",
            Redis::start_with(&["--maxmemory", "1mb", "--maxmemory-policy", "noeviction"]),
            &|r: &Redis| {
                let mut c = redis::Client::open(r.url())
                    .unwrap()
                    .get_connection()
                    .unwrap();
                // Emptied, then filled until writes are refused. (A script that has
                // already written may write on past `maxmemory`, by Redis's rule for
                // scripts without flags: a partition whose keys exist keeps working.)
                let _: () = redis::cmd("FLUSHALL").query(&mut c).unwrap();
                for i in 0.. {
                    let r: redis::RedisResult<()> = redis::cmd("SET")
                        .arg(format!("filler-{i}"))
                        .arg(&filler)
                        .query(&mut c);
                    if let Err(e) = r {
                        assert_eq!(e.code(), Some("OOM"), "{e}");
                        break;
                    }
                }
            },
        ),
        ("wrongtype", Redis::start(), &|r: &Redis| {
            // Something else wrote the partition's epoch key as a list.
            r.cmd(&["DEL", "{sluice:api:-}:epoch"]);
            assert_eq!(r.cmd(&["RPUSH", "{sluice:api:-}:epoch", "x"]).trim(), "1");
        }),
    ];
    for (kind, redis, break_it) in cases {
        let up = support::Upstream::start().await;
        let proxy = support::Proxy::start(&format!(
            "[[upstream]]\nname = \"api\"\nhosts = [\"127.0.0.1\"]\n\
             limits = [{{ kind = \"sliding_window\", permits = 100, window = \"1s\", scope = \"global\" }}]\n\
             [upstream.retry]\nmax_attempts = 1\n\
             [cluster]\nredis = \"{}\"\non_redis_error = \"deny\"\nopen_for = \"1s\"\n",
            redis.url()
        ))
        .await;
        let client = proxy.client();
        let r = client.get(up.url("/before")).send().await.unwrap();
        assert_eq!(r.status(), 200, "{kind}: fine before");
        break_it(&redis);
        let before = redis.attempts("evalsha");
        let t0 = Instant::now();
        let mut n = 0;
        while t0.elapsed() < Duration::from_secs(3) {
            let t = Instant::now();
            let r = client.get(up.url("/during")).send().await.unwrap();
            let took = t.elapsed();
            assert_eq!(r.status(), 503, "{kind}");
            assert_eq!(
                r.headers()["sluice-reason"],
                "cluster_unavailable",
                "{kind}"
            );
            // timeout × failures is 150 ms; a wide margin for a loaded machine.
            assert!(
                took < Duration::from_secs(2),
                "{kind}: answered in {took:?}"
            );
            n += 1;
        }
        let calls = redis.attempts("evalsha") - before;
        eprintln!("{kind}: {calls} script calls for {n} requests in 3 s");
        assert!(
            calls <= 10 + 2 * 3,
            "{kind}: {calls} calls for {n} requests: the breaker, not a loop, decides"
        );
        let m = reqwest::get(format!("http://{}/metrics", proxy.admin))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert!(
            support::metric(
                &m,
                &format!("sluice_cluster_errors_total{{kind=\"{kind}\"}}")
            )
            .is_some_and(|n| n > 0.0),
            "{kind} counted by its name: {m}"
        );
    }
}

/// A Redis Cluster of three masters, two sluice processes given one seed node each, keys
/// spread over the slots of every master, and a reshard moving slots in the middle of the
/// traffic: no key over its limit, every request answered, every key served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_cluster_resharded_under_traffic() {
    let _shared = ALONE.read().await;
    support::crypto();
    let dir = tempfile::tempdir().unwrap();
    let (nodes, addrs) = create_cluster(dir.path(), 3, 0);
    assert!(formed(&nodes).await, "the cluster formed");
    let fleet = Fleet::start(
        2,
        "{ kind = \"sliding_window\", permits = 3, window = \"1s\", scope = \"global\" }",
        &format!(
            "cluster_nodes = [\"redis://{}\", \"redis://{}\"]\nreplicas = 2\nopen_for = \"1s\"\n",
            addrs[0], addrs[1]
        ),
    )
    .await;
    let keys = keys(24);
    let t0 = Instant::now();
    let load = fleet.load(&keys, t0 + Duration::from_secs(10));
    let reshard = async {
        tokio::time::sleep_until(t0 + Duration::from_secs(3)).await;
        // Every master holds some partition's keys before the reshard.
        let held: Vec<u64> = nodes
            .iter()
            .map(|n| n.cmd(&["DBSIZE"]).trim().parse().unwrap_or(0))
            .collect();
        let id = |n: &Redis| n.cmd(&["CLUSTER", "MYID"]).trim().to_string();
        let out = tokio::process::Command::new("redis-cli")
            .args(["--cluster", "reshard", &addrs[0]])
            .args([
                "--cluster-from",
                &id(&nodes[0]),
                "--cluster-to",
                &id(&nodes[1]),
            ])
            .args(["--cluster-slots", "3000", "--cluster-yes"])
            .output()
            .await
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        held
    };
    let (answers, held) = tokio::join!(load, reshard);
    assert!(
        held.iter().all(|n| *n > 0),
        "keys on every master: {held:?}"
    );
    assert!(
        answers.iter().all(|a| a.0 == 200 || a.0 == 429),
        "every request answered: {:?}",
        answers
            .iter()
            .filter(|a| a.0 != 200 && a.0 != 429)
            .take(5)
            .collect::<Vec<_>>()
    );
    let arrivals = fleet.arrivals(t0);
    assert_eq!(arrivals.len(), keys.len(), "every key served");
    let calls: u64 = nodes
        .iter()
        .map(|n| n.attempts("evalsha") + n.attempts("eval"))
        .sum();
    let requests: usize = arrivals.values().map(Vec::len).sum();
    eprintln!("Redis Cluster, a reshard included: {calls} script calls for {requests} requests");
    for (key, a) in &arrivals {
        assert_eq!(
            over(3, Duration::from_secs(1), a),
            0,
            "key {key} over its limit"
        );
        // 3 a second for 10 s, less the margins; far more than any fallback would give.
        assert!(a.len() >= 15, "key {key}: {} in 10 s", a.len());
    }
    for i in 0..2 {
        let m = fleet.metrics(i).await;
        assert_eq!(
            support::metric(&m, r#"sluice_cluster_reservations_total{result="local"}"#),
            None,
            "replica {i} never fell back: {m}"
        );
    }
}

/// Sentinel with a primary and a replica: the primary is killed under load, Sentinel
/// promotes the replica, and sluice finds it through Sentinel and goes back to Redis
/// within `open_for` and a couple of seconds. What the failover cost is printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_fails_over_and_sluice_follows() {
    let _shared = ALONE.read().await;
    support::crypto();
    let dir = tempfile::tempdir().unwrap();
    let primary = Redis::start();
    let replica = Redis::start();
    replica.cmd(&["REPLICAOF", "127.0.0.1", &primary.port.to_string()]);
    assert!(
        support::eventually(Duration::from_secs(10), || {
            let up = replica
                .cmd(&["INFO", "replication"])
                .contains("master_link_status:up");
            async move { up }
        })
        .await,
        "the replica follows the primary"
    );
    let sentinel = Redis::start_sentinel(dir.path(), &primary);
    let fleet = Fleet::start(
        2,
        "{ kind = \"sliding_window\", permits = 12, window = \"1s\", scope = \"global\" }",
        &format!(
            "sentinels = [\"redis://127.0.0.1:{}\"]\nsentinel_master = \"mymaster\"\n\
             replicas = 2\nopen_for = \"1s\"\n",
            sentinel.port
        ),
    )
    .await;
    let t0 = Instant::now();
    let two = keys(2);
    let load = fleet.load(&two, t0 + Duration::from_secs(14));
    let failover = async {
        tokio::time::sleep_until(t0 + Duration::from_secs(2)).await;
        primary.kill();
        let killed = Instant::now();
        let promoted = loop {
            let addr = sentinel.cmd(&["SENTINEL", "get-master-addr-by-name", "mymaster"]);
            if addr.contains(&replica.port.to_string()) {
                break Instant::now();
            }
            assert!(
                killed.elapsed() < Duration::from_secs(10),
                "Sentinel promoted"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        // Back on Redis: every replica's mode says so, and it reserves again.
        let mut back = Vec::new();
        for i in 0..2 {
            loop {
                let m = fleet.metrics(i).await;
                if support::metric(&m, r#"sluice_cluster_mode{mode="redis"}"#) == Some(1.0)
                    && replica.attempts("evalsha") > 0
                {
                    back.push(Instant::now());
                    break;
                }
                assert!(
                    killed.elapsed() < Duration::from_secs(12),
                    "replica {i} came back"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        (killed, promoted, back)
    };
    let (answers, (killed, promoted, back)) = tokio::join!(load, failover);
    let over_limit: usize = over_by_key(12, Duration::from_secs(1), &fleet.arrivals(t0))
        .iter()
        .map(|k| k.1)
        .sum();
    let last_back = back.iter().max().copied().unwrap_or(promoted);
    eprintln!(
        "Sentinel promoted {:?} after the kill; sluice back on Redis {:?} after that; \
         {over_limit} arrivals over the limit",
        promoted - killed,
        last_back.saturating_duration_since(promoted)
    );
    assert!(
        last_back.saturating_duration_since(promoted)
            < Duration::from_secs(1) + Duration::from_secs(2),
        "followed within open_for + 2 s"
    );
    // Replication is asynchronous: reservations of the last moments may be lost with
    // the primary. At most a few; none here in practice.
    assert!(over_limit <= 2, "{over_limit} over the limit");
    assert!(
        answers.iter().all(|a| a.0 == 200 || a.0 == 429),
        "every request answered"
    );
    let late: usize = fleet
        .arrivals(t0 + Duration::from_secs(11))
        .values()
        .map(Vec::len)
        .sum();
    assert!(
        late >= 2 * 12 * 2,
        "about the limit on the new primary: {late} in 3 s"
    );
}

/// A Redis Cluster of three masters with a replica each: one master is killed under
/// load, the Cluster promotes its replica, and sluice, told only seed nodes, follows the
/// slot to the new master: back on Redis, every request answered, no key over its limit
/// but for the few arrivals the gaps of a failover allow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_cluster_master_failing_over() {
    let _shared = ALONE.read().await;
    support::crypto();
    let dir = tempfile::tempdir().unwrap();
    let (nodes, addrs) = create_cluster(dir.path(), 6, 1);
    let role = |n: &Redis| n.cmd(&["ROLE"]).lines().next().unwrap_or("").to_string();
    assert!(
        support::eventually(Duration::from_secs(15), || {
            // A replica that never synced cannot be promoted.
            let synced = |n: &Redis| {
                n.cmd(&["INFO", "replication"])
                    .contains("master_link_status:up")
            };
            let ok = nodes
                .iter()
                .all(|n| n.cmd(&["CLUSTER", "INFO"]).contains("cluster_state:ok"))
                && nodes.iter().filter(|n| synced(n)).count() == 3;
            async move { ok }
        })
        .await,
        "the cluster formed, with a synced replica per master"
    );
    let fleet = Fleet::start(
        2,
        "{ kind = \"sliding_window\", permits = 3, window = \"1s\", scope = \"global\" }",
        &format!(
            "cluster_nodes = [\"redis://{}\", \"redis://{}\", \"redis://{}\"]\n\
             replicas = 2\nopen_for = \"1s\"\n",
            addrs[0], addrs[1], addrs[2]
        ),
    )
    .await;
    let keys = keys(12);
    let t0 = Instant::now();
    let load = fleet.load(&keys, t0 + Duration::from_secs(14));
    let failover = async {
        tokio::time::sleep_until(t0 + Duration::from_secs(2)).await;
        let master = nodes
            .iter()
            .find(|n| role(n) == "master" && n.cmd(&["DBSIZE"]).trim() != "0")
            .expect("a master holding keys");
        master.kill();
        let killed = Instant::now();
        // Its replica is promoted after cluster-node-timeout (2 s) and an election.
        loop {
            let live = || nodes.iter().filter(|n| n.port != master.port);
            let up = live().all(|n| n.cmd(&["CLUSTER", "INFO"]).contains("cluster_state:ok"));
            if up && live().filter(|n| role(n) == "master").count() == 3 {
                break;
            }
            assert!(
                killed.elapsed() < Duration::from_secs(10),
                "the Cluster failed over"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let promoted = Instant::now();
        // Each sluice back on Redis: its next probe (open_for = 1 s) reads the new slots.
        let mut back = Duration::ZERO;
        for i in 0..2 {
            while support::metric(
                &fleet.metrics(i).await,
                r#"sluice_cluster_mode{mode="redis"}"#,
            ) != Some(1.0)
            {
                assert!(
                    promoted.elapsed() < Duration::from_secs(6),
                    "replica {i} came back"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            back = back.max(promoted.elapsed());
        }
        (killed, promoted - killed, back)
    };
    let (answers, (killed, took, back)) = tokio::join!(load, failover);
    let arrivals = fleet.arrivals(t0);
    let over_keys = over_by_key(3, Duration::from_secs(1), &arrivals);
    let over_limit: usize = over_keys.iter().map(|k| k.1).sum();
    eprintln!(
        "the Cluster promoted a replica {took:?} after its master was killed; \
         sluice back on Redis {back:?} after that; {over_limit} arrivals over the limit"
    );
    // Which gap an arrival over the limit came through shows in when it came and from
    // which replica: printed, as a rare event is seen only in a CI log.
    for (key, _) in over_keys.iter().filter(|k| k.1 > 0) {
        let seen: Vec<String> = fleet
            .upstream
            .seen()
            .iter()
            .filter(|s| s.at >= t0 && s.header("x-key") == Some(*key))
            .map(|s| {
                let since = s.at.saturating_duration_since(killed).as_secs_f64()
                    - killed.saturating_duration_since(s.at).as_secs_f64();
                format!("{since:+.3}s r{}", s.header("x-replica").unwrap_or("-"))
            })
            .collect();
        eprintln!("key {key} over its limit; arrivals since the kill: {seen:?}");
    }
    assert!(
        back < Duration::from_secs(3),
        "followed within open_for + 2 s"
    );
    assert!(
        answers.iter().all(|a| a.0 == 200 || a.0 == 429),
        "every request answered"
    );
    // A failover opens two gaps docs/cluster.md names ("When Redis fails"): reservations
    // the killed master acknowledged in its last moments but had not replicated, and a
    // replica's local share while the other, whose breaker follows its own calls, is
    // back on Redis. At most a few; none in nearly every run.
    assert!(over_limit <= 2, "{over_limit} over the limit");
    // Back on Redis, and every key served in the last seconds.
    let late = fleet.arrivals(t0 + Duration::from_secs(11));
    assert_eq!(late.len(), keys.len(), "every key served at the end");
    for i in 0..2 {
        let m = fleet.metrics(i).await;
        assert_eq!(
            support::metric(&m, r#"sluice_cluster_mode{mode="redis"}"#),
            Some(1.0),
            "replica {i} back on Redis"
        );
    }
}

/// A Redis Cluster speaking only TLS and requiring a password, as managed offerings run
/// it: sluice, given one `rediss://` seed node, the CA (`ca`) and the password
/// (`password_file`), reserves on every master, each key within its limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_cluster_over_tls_with_a_password() {
    let _shared = ALONE.read().await;
    support::crypto();
    let dir = tempfile::tempdir().unwrap();
    let certs = support::certs::for_localhost(dir.path(), &[]);
    let files = (
        certs.cert_path.as_path(),
        certs.key_path.as_path(),
        certs.ca_path.as_path(),
    );
    let nodes: Vec<Redis> = (0..3)
        .map(|_| Redis::start_cluster_node_tls(dir.path(), files, "cluster-secret"))
        .collect();
    let ca = certs.ca_path.to_str().unwrap();
    let cli = [
        "--tls",
        "--cacert",
        ca,
        "-a",
        "cluster-secret",
        "--no-auth-warning",
    ];
    let (nodes, addrs) = form_cluster(nodes, 0, &cli);
    assert!(formed(&nodes).await, "the cluster formed");
    let password = dir.path().join("password");
    std::fs::write(&password, "cluster-secret\n").unwrap();
    let fleet = Fleet::start(
        1,
        "{ kind = \"sliding_window\", permits = 3, window = \"1s\", scope = \"global\" }",
        &format!(
            "cluster_nodes = [\"rediss://{}\"]\nca = {:?}\npassword_file = {:?}\n\
             on_redis_error = \"deny\"\n",
            addrs[0], certs.ca_path, password
        ),
    )
    .await;
    let keys = keys(12);
    let t0 = Instant::now();
    let answers = fleet.load(&keys, t0 + Duration::from_secs(3)).await;
    assert!(
        answers.iter().all(|a| a.0 == 200 || a.0 == 429),
        "every request answered, none refused for Redis: {:?}",
        answers.iter().find(|a| a.0 != 200 && a.0 != 429)
    );
    let arrivals = fleet.arrivals(t0);
    assert_eq!(arrivals.len(), keys.len(), "every key served");
    for (key, a) in &arrivals {
        assert_eq!(over(3, Duration::from_secs(1), a), 0, "key {key}");
    }
    let on: Vec<u64> = nodes.iter().map(|n| n.attempts("evalsha")).collect();
    assert!(
        on.iter().all(|c| *c > 0),
        "script calls on every master: {on:?}"
    );
}

/// Sentinel and the primary behind it both requiring a password, each read from its own
/// file (`sentinel_password_file`, `password_file`): sluice asks Sentinel for the primary
/// with one and reserves on the primary with the other. With the Sentinel's password
/// wrong, Sentinel refuses it: the failure is counted as `auth` and the limit falls back
/// to the replica's share.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_and_primary_with_passwords() {
    let _shared = ALONE.read().await;
    support::crypto();
    let dir = tempfile::tempdir().unwrap();
    let primary = Redis::start_with_password("data-secret");
    let sentinel = Redis::start_sentinel_with_auth(dir.path(), &primary, Some("watch-secret"));
    let (data, watch, wrong) = (
        dir.path().join("data"),
        dir.path().join("watch"),
        dir.path().join("wrong"),
    );
    std::fs::write(&data, "data-secret\n").unwrap();
    std::fs::write(&watch, "watch-secret\n").unwrap();
    std::fs::write(&wrong, "not-it\n").unwrap();
    let limit = "{ kind = \"sliding_window\", permits = 20, window = \"1s\", scope = \"global\" }";
    for (sentinel_password, right) in [(&watch, true), (&wrong, false)] {
        let before = primary.calls("evalsha") + primary.calls("eval");
        let fleet = Fleet::start(
            1,
            limit,
            &format!(
                "sentinels = [\"redis://127.0.0.1:{}\"]\nsentinel_master = \"mymaster\"\n\
                 password_file = \"{}\"\nsentinel_password_file = \"{}\"\n\
                 replicas = 2\nopen_for = \"1s\"\n",
                sentinel.port,
                data.display(),
                sentinel_password.display()
            ),
        )
        .await;
        let t0 = Instant::now();
        let answers = fleet.load(&keys(1), t0 + Duration::from_secs(2)).await;
        assert!(answers.iter().any(|a| a.0 == 200), "requests served");
        let calls = primary.calls("evalsha") + primary.calls("eval") - before;
        let m = fleet.metrics(0).await;
        let auth = support::metric(&m, r#"sluice_cluster_errors_total{kind="auth"}"#);
        if right {
            assert!(calls > 0, "reserved on the primary found through Sentinel");
            assert_eq!(auth, None, "no authentication failure: {m}");
        } else {
            assert_eq!(calls, 0, "nothing reached the primary");
            assert!(auth.is_some_and(|n| n > 0.0), "counted as auth: {m}");
            assert_eq!(
                support::metric(&m, r#"sluice_cluster_mode{mode="local"}"#),
                Some(1.0),
                "fell back to its share"
            );
        }
    }
}

/// Small global limits saturated from two and three replicas, 8 clients each: a token
/// bucket at 10/s with a burst of 1 and a 50 ms margin, and a sliding window of 2 a
/// second with a 400 ms margin. Each request's instant waits on the one before, so a
/// reservation made before that one's answer would pay its margin on every interval
/// (67% and 71% of the limits); with turns, the replica that gets the answer asks next,
/// its correction on the call. The upstream never sees more
/// than the limit, gets nearly all of it, and Redis sees about one call per request.
/// The four cases run at once, each with its own Redis, upstream and runtime (on a thread
/// of its own): a few dozen requests a second in all, which leaves the clocks they are
/// judged by on time, and what one case waits for outside async code (starting Redis,
/// asking it for its counts, stopping its replicas) holds up none of the others'
/// arrivals.
#[test]
fn small_global_limits_are_used_in_full() {
    let _alone = ALONE.blocking_write();
    support::crypto();
    // Margins large enough that paying one on every interval (67% and 71% of the limit)
    // is far from what turns give, even on a loaded machine.
    let bucket = "{ kind = \"token_bucket\", rate = 10, per = \"1s\", burst = 1, margin = \"50ms\", scope = \"global\" }";
    let window = "{ kind = \"sliding_window\", permits = 2, window = \"1s\", margin = \"400ms\", scope = \"global\" }";
    let cases = [(bucket, 10.0), (window, 2.0)]
        .into_iter()
        .flat_map(|(limit, per_second)| [2, 3].map(|n| (limit, per_second, n)));
    let case = |limit: &'static str, per_second: f64, n: usize| async move {
        let redis = Redis::start();
        let cluster = format!("redis = \"{}\"\nreplicas = {n}\n", redis.url());
        let fleet = Fleet::start(n, limit, &cluster).await;
        let t0 = Instant::now();
        let clients = vec!["key-0".to_string(); 8];
        let end = t0 + Duration::from_secs(12);
        let answers = fleet.load(&clients, end).await;
        let all: Vec<Instant> = fleet.arrivals(t0).into_values().flatten().collect();
        let loaded = all
            .iter()
            .filter(|a| **a >= t0 + Duration::from_secs(2) && **a < end)
            .count();
        let used = loaded as f64 / (10.0 * per_second);
        let calls = (redis.calls("evalsha") + redis.calls("eval")) as f64 / all.len() as f64;
        eprintln!(
            "{limit} on {n} replicas: {:.1}% of the limit, {calls:.2} Redis calls per request",
            used * 100.0
        );
        if per_second == 10.0 {
            let mut provider = Counter::token(10, Duration::from_secs(1), 1);
            let refused = all.iter().filter(|a| !provider.arrive(**a)).count();
            assert_eq!(refused, 0, "{limit} on {n} replicas");
        } else {
            assert_eq!(over(2, Duration::from_secs(1), &all), 0, "{limit}");
        }
        assert!(
            answers.iter().all(|a| a.0 == 200 || a.0 == 429),
            "every request answered"
        );
        // The benchmark's figures, with the default margins, are the exact ones (98% and
        // more); a loaded machine gets some slack, still well above what paying each
        // margin would leave.
        let least = 0.85;
        assert!(
            used >= least,
            "{limit} on {n} replicas: {:.1}%",
            used * 100.0
        );
        assert!(
            calls <= 2.0,
            "{limit} on {n} replicas: {calls:.2} calls per request"
        );
    };
    let runs: Vec<_> = cases
        .map(|(limit, per_second, n)| {
            std::thread::spawn(move || {
                tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()
                    .unwrap()
                    .block_on(case(limit, per_second, n))
            })
        })
        .collect();
    for run in runs {
        if let Err(panic) = run.join() {
            std::panic::resume_unwind(panic);
        }
    }
}

/// Costs on a Redis Cluster: a shared limit of 6 units a second, each request priced 2
/// (its family's fallback, as no client declares a cost), through two replicas and many
/// keys spread over the masters: no key passes 3 requests in any second, and each gets
/// nearly all of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weighted_shared_limits_on_a_redis_cluster() {
    let _shared = ALONE.read().await;
    support::crypto();
    let dir = tempfile::tempdir().unwrap();
    let (nodes, addrs) = create_cluster(dir.path(), 3, 0);
    assert!(formed(&nodes).await, "the cluster formed");
    let fleet = Fleet::start(
        2,
        "{ kind = \"sliding_window\", permits = 6, window = \"1s\", scope = \"global\", unit = \"weight\" }",
        &format!(
            "cluster_nodes = [\"redis://{}\", \"redis://{}\"]\nreplicas = 2\n\
             [[upstream.family]]\nname = \"items\"\npaths = [\"/v1/items\"]\n\
             [upstream.family.cost.weight]\nestimate = \"header:x-weight\"\nfallback = 2\n",
            addrs[0], addrs[1]
        ),
    )
    .await;
    let keys = keys(12);
    let t0 = Instant::now();
    let answers = fleet.load(&keys, t0 + Duration::from_secs(6)).await;
    assert!(
        answers.iter().all(|a| a.0 == 200 || a.0 == 429),
        "every request answered"
    );
    let arrivals = fleet.arrivals(t0);
    assert_eq!(arrivals.len(), keys.len(), "every key served");
    for (key, a) in &arrivals {
        assert_eq!(
            over(3, Duration::from_secs(1), a),
            0,
            "key {key} over 6 units a second at 2 each"
        );
        assert!(a.len() >= 9, "key {key}: {} in 6 s", a.len());
    }
}

/// A finite batch, as a new user tries one: 100 requests fired at once, half through
/// each of two replicas (two workers each, so a family's requests take their turns at
/// Redis from two threads) sharing a token bucket of 10/s with a burst of 1. The
/// provider (a GCRA at the same limit) refuses none, and the batch takes little more
/// than the 9.9 s the limit needs for it (docs/BENCHMARKS.md has the figure).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finite_batch_uses_a_shared_limit_in_full() {
    let _alone = ALONE.write().await;
    support::crypto();
    let redis = Redis::start();
    let bucket =
        "{ kind = \"token_bucket\", rate = 10, per = \"1s\", burst = 1, scope = \"global\" }";
    let cluster = format!("redis = \"{}\"\nreplicas = 2\n", redis.url());
    let fleet = Fleet::start_on(2, 2, bucket, &cluster).await;
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..100 {
        let client = client_via(fleet.replicas[c % 2].1);
        let url = fleet.upstream.url("/v1/items");
        tasks.push(tokio::spawn(async move {
            let r = client.get(&url).header("x-key", "batch").send().await;
            r.map(|r| r.status().as_u16()).unwrap_or(0)
        }));
    }
    let mut statuses = Vec::new();
    for t in tasks {
        statuses.push(t.await.unwrap());
    }
    let took = t0.elapsed();
    let all: Vec<Instant> = fleet.arrivals(t0).into_values().flatten().collect();
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    assert_eq!(all.len(), 100);
    let mut provider = Counter::token(10, Duration::from_secs(1), 1);
    let refused = all.iter().filter(|a| !provider.arrive(**a)).count();
    assert_eq!(refused, 0, "the provider refused none");
    let used = 100.0 / (took.as_secs_f64() * 10.0);
    let span = *all.last().unwrap() - all[0];
    eprintln!(
        "a batch of 100 through 2 replicas: {took:?} end to end, first to last arrival {span:?}: {:.1}% of the limit",
        used * 100.0
    );
    // The benchmark's 97-98%, less a loaded machine's slack, as for the small limits
    // above; a family whose requests miss each other's answers across threads uses half.
    assert!(used >= 0.85, "{:.1}% of the limit", used * 100.0);
}
