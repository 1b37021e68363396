use std::time::Duration;

use super::*;

fn err(text: &str) -> String {
    match Config::parse(text, "s.toml") {
        Ok(_) => panic!("expected an error for:\n{text}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn product_example_parses() {
    let text = include_str!("../../tests/fixtures/product-example.toml");
    let c = Config::parse(text, "product-example.toml").unwrap();
    assert_eq!(c.proxy.listen.to_string(), "127.0.0.1:3128");
    assert_eq!(c.proxy.max_replay_body, 1 << 20);
    assert_eq!(c.proxy.drain_timeout, Duration::from_secs(25));
    let m = &c.upstreams[0];
    assert_eq!(m.name, "marketplace");
    assert_eq!(m.tls, TlsMode::Intercept);
    assert_eq!(m.families.len(), 2);
    assert_eq!(m.families[0].priority, Priority::High);
    assert_eq!(m.families[1].limits.len(), 2);
    assert_eq!(m.classify[0].action, Action::Fail);
    assert_eq!(m.policy.retry.backoff.max, Duration::from_secs(30));
    assert_eq!(c.cluster.as_ref().unwrap().replicas, Some(3));
}

#[test]
fn defaults_inherit_and_override_per_level() {
    let c = Config::parse(
        r#"
[defaults]
max_wait = "5s"
[defaults.retry]
max_attempts = 3
backoff = { base = "100ms", max = "2s" }

[[upstream]]
name = "a"
hosts = ["a.example"]
max_wait = "1s"
retry = { backoff = { jitter = "none" } }
  [[upstream.family]]
  name = "f"
  max_queue = 5
  retry = { max_attempts = 1 }
  breaker = { open_for = "1m" }
"#,
        "s.toml",
    )
    .unwrap();
    assert_eq!(c.defaults.max_wait, Duration::from_secs(5));
    let u = &c.upstreams[0];
    assert_eq!(u.policy.max_wait, Duration::from_secs(1));
    assert_eq!(u.policy.retry.max_attempts, 3);
    assert_eq!(u.policy.retry.backoff.base, Duration::from_millis(100));
    assert_eq!(u.policy.retry.backoff.jitter, Jitter::None);
    assert!(!u.families.is_empty());
    let f = &u.families[0];
    assert_eq!(f.policy.max_queue, 5);
    assert_eq!(f.policy.max_wait, Duration::from_secs(1));
    assert_eq!(f.policy.retry.max_attempts, 1);
    assert_eq!(f.policy.retry.backoff.jitter, Jitter::None);
    assert_eq!(f.policy.breaker.open_for, Duration::from_secs(60));
    assert_eq!(f.policy.breaker.min_requests, 20);
    assert!(f.own_breaker);
}

#[test]
fn empty_file_gives_builtin_defaults() {
    let c = Config::parse("", "empty.toml").unwrap();
    assert_eq!(c.proxy.admin.to_string(), "127.0.0.1:9901");
    assert_eq!(c.proxy.unmatched, Unmatched::Pass);
    assert_eq!(c.defaults.max_queue, 1000);
    assert!(c.upstreams.is_empty());
}

#[test]
fn errors_name_line_and_column() {
    assert!(err("[proxy]\nlisten = \"127.0.0.1:3128\"\nlisen = 1\n").starts_with("s.toml:3:1: "));
    let e = err("[proxy]\nunmatched = \"maybe\"\n");
    assert!(e.starts_with("s.toml:2:13: "), "{e}");
    assert!(e.contains("unknown variant"), "{e}");
    let e = err("[proxy]\ndrain_timeout = \"soon\"\n");
    assert!(
        e.starts_with("s.toml:2:17: ") && e.contains("invalid duration"),
        "{e}"
    );
    let e = err("[proxy]\nmax_replay_body = \"1 lightyear\"\n");
    assert!(e.contains("unknown size unit"), "{e}");
    let e = err("[proxy]\nlisten = \"localhost\"\n");
    assert!(
        e.starts_with("s.toml:2:10: ") && e.contains("is not a listen address"),
        "{e}"
    );
    let e = err("[proxy\n");
    assert!(e.starts_with("s.toml:1:"), "{e}");
}

#[test]
fn every_rule_is_checked() {
    let up = |body: &str| format!("[[upstream]]\nname = \"a\"\nhosts = [\"a.example\"]\n{body}");
    let cases: &[(String, &str)] = &[
        (
            up("limits = [{ kind = \"sliding_window\", permits = 0, window = \"1s\" }]"),
            "nonzero",
        ),
        (
            up("limits = [{ kind = \"sliding_window\", permits = 3, window = \"0s\" }]"),
            "greater than zero",
        ),
        (
            up("limits = [{ kind = \"leaky\", permits = 3 }]"),
            "unknown variant",
        ),
        (
            up("limits = [{ kind = \"concurrency\", max = 3, extra = 1 }]"),
            "unknown field",
        ),
        (
            up("limits = [{ kind = \"token_bucket\", rate = 3, per = \"1s\" }]"),
            "burst",
        ),
        (
            up("[[upstream.family]]\nname = \"f\"\npaths = [\"/v1/ord*\"]"),
            "whole segment",
        ),
        (
            up("[[upstream.family]]\nname = \"f\"\npaths = [\"v1\"]"),
            "start with '/'",
        ),
        (
            up("[[upstream.family]]\nname = \"f\"\nmethods = [\"G ET\"]"),
            "not an HTTP method",
        ),
        (up("[[upstream.family]]\nname = \"-\""), "reserved"),
        (
            up("[[upstream.family]]\nname = \"f\"\n[[upstream.family]]\nname = \"f\""),
            "duplicate family",
        ),
        (
            up("") + "[[upstream]]\nname = \"a\"\nhosts = [\"b.example\"]\n",
            "duplicate upstream",
        ),
        (
            up("") + "[[upstream]]\nname = \"b\"\nhosts = [\"A.example\"]\n",
            "already claimed",
        ),
        (up("key = \"cookie:x\""), "header:NAME"),
        (
            up("retry = { backoff = { base = \"2s\", max = \"1s\" } }"),
            "longer than its max",
        ),
        (up("retry = { on = [200, 999] }"), "not an HTTP status"),
        (up("retry = { on = [\"sometimes\"] }"), "invalid value"),
        (up("breaker = { failure_ratio = 1.5 }"), "failure_ratio"),
        (up("max_queue = 0"), "nonzero"),
        (
            up("[[upstream.classify]]\nstatus = 429\njson = \"/e\"\naction = \"fail\""),
            "equals",
        ),
        (
            up("[[upstream.classify]]\naction = \"fail\""),
            "matches nothing",
        ),
        (
            "[[upstream]]\nname = \"a b\"\nhosts = [\"a.example\"]\n".to_string(),
            "must be 1-64",
        ),
        (
            "[[upstream]]\nname = \"unmatched\"\nhosts = [\"a.example\"]\n".to_string(),
            "reserved",
        ),
        (
            "[[upstream]]\nname = \"a\"\nhosts = []\n".to_string(),
            "at least one host",
        ),
        (
            "[[upstream]]\nname = \"a\"\nhosts = [\"a.*.example\"]\n".to_string(),
            "invalid host pattern",
        ),
        ("[cluster]\nredis = \"http://x\"\n".to_string(), "redis://"),
        (
            up(
                "limits = [{ kind = \"sliding_window\", permits = 3, window = \"1s\", margin = \"600ms\" }]",
            ),
            "margin 600ms is more than half the window (1s)",
        ),
        (
            up(
                "limits = [{ kind = \"fixed_window\", permits = 3, window = \"1s\", margin = \"60%\" }]",
            ),
            "more than half the window",
        ),
        (
            up(
                "limits = [{ kind = \"token_bucket\", rate = 10, per = \"1s\", burst = 1, margin = \"2s\" }]",
            ),
            "longer than the bucket's period",
        ),
        (
            up(
                "limits = [{ kind = \"sliding_window\", permits = 3, window = \"1s\", margin = \"100ms\", margin_max = \"50ms\" }]",
            ),
            "margin_max 50ms is less than the margin (100ms)",
        ),
        (
            up(
                "limits = [{ kind = \"sliding_window\", permits = 3, window = \"1s\", margin_max = \"700ms\" }]",
            ),
            "margin_max 700ms is more than half the window",
        ),
        (
            up(
                "limits = [{ kind = \"sliding_window\", permits = 3, window = \"1s\", margin = \"lots\" }]",
            ),
            "invalid margin",
        ),
        (
            up("limits = [{ kind = \"concurrency\", max = 3, margin = \"10ms\" }]"),
            "unknown field `margin`",
        ),
        (
            up(
                "limits = [{ kind = \"fixed_window\", permits = 3, window = \"1m\", offset = \"5s\" }]",
            ),
            "offset places windows on the clock: it needs align = \"clock\"",
        ),
        (
            up(
                "limits = [{ kind = \"fixed_window\", permits = 3, window = \"1m\", align = \"clock\", offset = \"1m\" }]",
            ),
            "offset 1m must be shorter than the window (1m)",
        ),
        (
            up(
                "limits = [{ kind = \"fixed_window\", permits = 3, window = \"1m\", align = \"any\" }]",
            ),
            "unknown variant `any`, expected `first` or `clock`",
        ),
        (
            up(
                "limits = [{ kind = \"sliding_counter\", permits = 3, window = \"1m\", align = \"first\" }]",
            ),
            "unknown variant `first`, expected `any` or `clock`",
        ),
        (
            up(
                "limits = [{ kind = \"sliding_counter\", permits = 3, window = \"1m\", offset = \"1s\" }]",
            ),
            "needs align = \"clock\"",
        ),
        (
            up(
                "limits = [{ kind = \"sliding_counter\", permits = 3, window = \"1s\", rounding = \"up\" }]",
            ),
            "unknown variant `up`",
        ),
        (
            up("limits = [{ kind = \"leaky_bucket\", rate = 1, per = \"2000s\" }]"),
            "below the slowest rate nginx counts",
        ),
        (
            up("limits = [{ kind = \"leaky_bucket\", rate = 10, per = \"1s\", burst = -1 }]"),
            "invalid value",
        ),
        (
            up(
                "limits = [{ kind = \"published\", permits = 10, window = \"1s\", margin = \"600ms\" }]",
            ),
            "more than half the window",
        ),
        (
            up("limits = [{ kind = \"published\", permits = 10, window = \"1s\", burst = 2 }]"),
            "unknown field `burst`",
        ),
    ];
    for (text, needle) in cases {
        let e = err(text);
        assert!(
            e.contains(needle),
            "error {e:?} should mention {needle:?}\n---\n{text}"
        );
        assert!(e.starts_with("s.toml:"), "{e}");
    }
}

#[test]
fn position_points_at_the_offending_value() {
    let text = "[[upstream]]\nname = \"a\"\nhosts = [\"a.example\"]\n[[upstream]]\nname = \"a\"\nhosts = [\"b.example\"]\n";
    assert!(
        err(text).starts_with("s.toml:5:8: duplicate upstream name"),
        "{}",
        err(text)
    );
}

#[test]
fn redis_password_is_redacted() {
    let c = Config::parse(
        "[cluster]\nredis = \"redis://app:s3cret@10.0.0.1:6379/0\"\nreplicas = 2\n",
        "s.toml",
    )
    .unwrap();
    let json = c.to_redacted_json().to_string();
    assert!(!json.contains("s3cret"), "{json}");
    assert!(json.contains("redis://app:***@10.0.0.1:6379/0"), "{json}");
    assert_eq!(redact_url("redis://127.0.0.1/0"), "redis://127.0.0.1/0");
    // From a variable or a file, only the name shows.
    let c = Config::parse(
        "[cluster]\nredis_env = \"SLUICE_TEST_REDIS\"\non_redis_error = \"deny\"\n",
        "s.toml",
    )
    .unwrap();
    let json = c.to_redacted_json().to_string();
    assert!(
        json.contains(r#""redis":"env:SLUICE_TEST_REDIS""#),
        "{json}"
    );
    let cluster = c.cluster.unwrap();
    let RedisTarget::Primary(source) = &cluster.redis else {
        panic!("one primary: {:?}", cluster.redis);
    };
    assert!(source.url().unwrap_err().contains("SLUICE_TEST_REDIS"));
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("url");
    std::fs::write(&file, "rediss://:pw@redis.internal:6380/1\n").unwrap();
    assert_eq!(
        RedisSource::File(file).url().unwrap(),
        "rediss://:pw@redis.internal:6380/1"
    );
    assert_eq!(cluster.timeout, Duration::from_millis(50));
    assert_eq!(
        (cluster.failures, cluster.open_for),
        (3, Duration::from_secs(5))
    );
}

#[test]
fn global_limits_need_a_cluster_and_a_rate() {
    let up = |limit: &str| {
        format!("[[upstream]]\nname = \"a\"\nhosts = [\"a.example\"]\nlimits = [{limit}]\n")
    };
    let sliding = "{ kind = \"sliding_window\", permits = 3, window = \"1s\", scope = \"global\" }";
    let e = err(&up(sliding));
    assert!(
        e.starts_with("s.toml:4:11: scope = \"global\" needs a [cluster]"),
        "{e}"
    );
    let cluster = "[cluster]\nredis = \"redis://127.0.0.1:6379\"\nreplicas = 3\n";
    let c = Config::parse(&format!("{}{cluster}", up(sliding)), "s.toml").unwrap();
    assert!(
        !c.warnings()
            .iter()
            .any(|w| w.contains("cluster") || w.contains("replicas")),
        "{:?}",
        c.warnings()
    );
    let small =
        up("{ kind = \"sliding_window\", permits = 2, window = \"1s\", scope = \"global\" }");
    let c = Config::parse(&format!("{small}{cluster}"), "s.toml").unwrap();
    let w = c.warnings().join("\n");
    assert!(
        w.contains("smaller than its 3 replicas")
            && w.contains("1 request per 2s")
            && w.contains("up to 3 requests in one 1s window (limit 2)"),
        "the worst case as a number: {w}"
    );
    let bucket =
        up("{ kind = \"token_bucket\", rate = 10, per = \"1s\", burst = 1, scope = \"global\" }");
    let c = Config::parse(&format!("{bucket}{cluster}"), "s.toml").unwrap();
    let w = c.warnings().join("\n");
    assert!(w.contains("up to 3 requests at once (burst 1)"), "{w}");
    let c = Config::parse(&format!("{}{cluster}", up("")), "s.toml").unwrap();
    assert!(c.warnings().iter().any(|w| w.contains("nothing is shared")));
    let e = err(&format!(
        "{}{cluster}",
        up("{ kind = \"concurrency\", max = 3, scope = \"global\" }")
    ));
    assert!(e.contains("a concurrency limit cannot be global"), "{e}");
    let e = err("[cluster]\nredis = \"redis://127.0.0.1:6379\"\n");
    assert!(e.contains("set replicas = N"), "{e}");
    let e = err("[cluster]\nreplicas = 2\n");
    assert!(e.contains("exactly one of redis"), "{e}");
    let e = err("[cluster]\nredis = \"redis://x\"\nredis_env = \"X\"\nreplicas = 2\n");
    assert!(e.contains("exactly one of redis"), "{e}");
}

#[test]
fn margins_default_to_a_fifth_of_the_window_capped_at_a_second() {
    let c = Config::parse(
        r#"
[[upstream]]
name = "a"
hosts = ["a.example"]
limits = [
  { kind = "sliding_window", permits = 5, window = "1s" },
  { kind = "fixed_window", permits = 300, window = "1m" },
  { kind = "token_bucket", rate = 4, per = "1s", burst = 2, margin = "10%" },
  { kind = "fixed_window", permits = 5, window = "1s", margin = "15ms", margin_max = "40%" },
  { kind = "concurrency", max = 2 },
  { kind = "sliding_counter", permits = 100, window = "1m", align = "clock", offset = "30s" },
  { kind = "leaky_bucket", rate = 10, per = "1s", burst = 5 },
  { kind = "published", permits = 100, window = "1m" },
  { kind = "fixed_window", permits = 1000, window = "1h", align = "clock" },
]
"#,
        "s.toml",
    )
    .unwrap();
    let margins: Vec<_> = c.upstreams[0].limits.iter().map(Limit::margin).collect();
    let ms = |v| Some(Duration::from_millis(v));
    // A bucket's and a published limit's share is of the interval between two requests.
    assert_eq!(
        margins,
        [
            ms(200),
            ms(1000),
            ms(25),
            ms(15),
            None,
            ms(1000),
            ms(20),
            ms(120),
            ms(1000)
        ]
    );
    assert_eq!(c.upstreams[0].limits[3].margin_max(), ms(400));
    // `/config` shows what was written, and only that, with the defaults it took.
    let json = c.to_redacted_json().to_string();
    assert!(json.contains(r#""margin":"10%""#), "{json}");
    assert!(json.contains(r#""margin_max":"40%""#), "{json}");
    for written in [
        r#""align":"clock","kind":"sliding_counter","offset":"30s""#,
        r#""rounding":"down""#,
        r#""burst":5,"kind":"leaky_bucket""#,
        r#""align":"clock","kind":"fixed_window""#,
    ] {
        assert!(json.contains(written), "{written} in {json}");
    }
}

#[test]
fn a_generated_ca_is_validated_with_its_place() {
    let e = err(
        "[tls]\nca_cert = \"a.pem\"\nca_key = \"k.pem\"\ngenerate_ca = true\ntrust_dir = \"/t\"\n",
    );
    assert!(
        e.contains("s.toml:4:") && e.contains("remove ca_cert"),
        "{e}"
    );
    let e = err("[tls]\ngenerate_ca = true\n");
    assert!(
        e.contains("s.toml:2:") && e.contains("needs trust_dir"),
        "{e}"
    );
    let e = err("[tls]\nkey_dir = \"/k\"\ntrust_dir = \"/t\"\n");
    assert!(e.contains("needs generate_ca"), "{e}");
    let ok = Config::parse(
        "[tls]\ngenerate_ca = true\ntrust_dir = \"/t\"\nkey_dir = \"/k\"\n\
         [[upstream]]\nname = \"a\"\nhosts = [\"a.example\"]\ntls = \"intercept\"\n",
        "test.toml",
    )
    .unwrap();
    assert_eq!(ok.intercept_without_ca(), None);
}

#[test]
fn access_log_is_a_share_of_requests() {
    let c = |v: &str| {
        format!("[[upstream]]\nname = \"a\"\nhosts = [\"a.example\"]\naccess_log = {v}\n")
    };
    for (v, share) in [("1", 1.0), ("0", 0.0), ("0.25", 0.25)] {
        let config = Config::parse(&c(v), "s.toml").unwrap();
        assert_eq!(config.upstreams[0].access_log, share, "{v}");
    }
    let e = err(&c("1.5"));
    assert!(
        e.contains("s.toml:4:") && e.contains("share of requests"),
        "{e}"
    );
    let default = Config::parse(&c("1").replace("access_log = 1\n", ""), "s.toml").unwrap();
    assert_eq!(default.upstreams[0].access_log, 1.0);
}

#[test]
fn learn_and_adaptive_parse_inherit_and_are_checked() {
    let text = "[[upstream]]\nname = \"a\"\nhosts = [\"a.example\"]\nlearn = \"headers\"\n\
                adaptive = { decrease = 0.7 }\n\
                limits = [{ kind = \"token_bucket\", rate = 10, per = \"1s\", burst = 10 }]\n\
                [[upstream.family]]\nname = \"own\"\nadaptive = { floor = 0.5, successes = 3 }\n\
                [[upstream.family]]\nname = \"inherits\"\n";
    let c = Config::parse(text, "a.toml").unwrap();
    let u = &c.upstreams[0];
    assert_eq!(u.learn, Learn::Headers);
    let up = Adaptive {
        decrease: 0.7,
        increase: 0.05,
        floor: 0.1,
        successes: 10,
    };
    assert_eq!(u.adaptive, Some(up));
    assert_eq!(
        u.families[0].adaptive,
        Some(Adaptive {
            decrease: 0.5,
            floor: 0.5,
            successes: 3,
            ..up
        })
    );
    assert_eq!(u.families[1].adaptive, Some(up));

    let up = |body: &str| format!("[[upstream]]\nname = \"a\"\nhosts = [\"a.example\"]\n{body}");
    for (text, needle) in [
        (up("learn = \"yes\"\n"), "unknown variant"),
        (
            up(
                "adaptive = { decrease = 1.5 }\nlimits = [{ kind = \"sliding_window\", permits = 1, window = \"1s\" }]\n",
            ),
            "decrease must be between 0 and 1",
        ),
        (
            up(
                "adaptive = { floor = 0 }\nlimits = [{ kind = \"sliding_window\", permits = 1, window = \"1s\" }]\n",
            ),
            "floor must be above 0",
        ),
        (up("adaptive = { step = 1 }\n"), "unknown field"),
        (
            up("adaptive = {}\nlimits = [{ kind = \"concurrency\", max = 1 }]\n"),
            "needs a rate limit",
        ),
        (
            up(
                "[[upstream.family]]\nname = \"f\"\nadaptive = {}\nlimits = [{ kind = \"concurrency\", max = 1 }]\n",
            ),
            "family \"f\" adapts (adaptive) but pays no rate limit",
        ),
    ] {
        let e = err(&text);
        assert!(
            e.contains(needle) && e.starts_with("s.toml:"),
            "{needle}: {e}"
        );
    }
}

#[test]
fn one_redis_topology_named_exactly_once() {
    let c = Config::parse(
        "[cluster]\ncluster_nodes = [\"redis://:pw@10.0.0.1:6379\", \"redis://10.0.0.2:6379\"]\n\
         password_env = \"REDIS_PASSWORD\"\non_redis_error = \"deny\"\n",
        "s.toml",
    )
    .unwrap();
    let cluster = c.cluster.as_ref().unwrap();
    assert_eq!(
        cluster.redis,
        RedisTarget::Cluster(vec![
            "redis://:pw@10.0.0.1:6379".into(),
            "redis://10.0.0.2:6379".into()
        ])
    );
    assert_eq!(cluster.password, Some(Secret::Env("REDIS_PASSWORD".into())));
    let json = c.to_redacted_json().to_string();
    assert!(!json.contains("pw@"), "{json}");
    assert!(json.contains("env:REDIS_PASSWORD"), "{json}");

    let c = Config::parse(
        "[cluster]\nsentinels = [\"redis://127.0.0.1:26379\"]\nsentinel_master = \"mymaster\"\n\
         on_redis_error = \"deny\"\n",
        "s.toml",
    )
    .unwrap();
    assert_eq!(
        c.cluster.unwrap().redis.to_string(),
        "sentinel:mymaster@redis://127.0.0.1:26379"
    );

    for (toml, says) in [
        (
            "redis = \"redis://a:6379\"\ncluster_nodes = [\"redis://b:6379\"]\n",
            "exactly one of redis",
        ),
        (
            "redis_env = \"U\"\nsentinels = [\"redis://s:26379\"]\nsentinel_master = \"m\"\n",
            "exactly one of redis",
        ),
        ("", "exactly one of redis"),
        ("sentinels = [\"redis://s:26379\"]\n", "go together"),
        ("cluster_nodes = []\n", "names no node"),
        ("cluster_nodes = [\"http://b:6379\"]\n", "is not a redis://"),
        (
            "redis = \"redis://a:6379\"\npassword_env = \"P\"\n",
            "the URL carries the password",
        ),
        (
            "cluster_nodes = [\"redis://b:6379\"]\npassword_env = \"P\"\npassword_file = \"/p\"\n",
            "one of password_env and password_file",
        ),
    ] {
        let e = err(&format!("[cluster]\n{toml}on_redis_error = \"deny\"\n"));
        assert!(e.contains(says), "{toml:?}: {e}");
    }
}

/// The published hash leaves secrets out: two files that differ only in the password of
/// an inline Redis URL publish the same one (a replica's hash is no test of a guessed
/// password), any other change shows, and neither is the file's own SHA-256.
#[test]
fn the_published_hash_leaves_secrets_out() {
    let with = |password: &str, replicas: u32| {
        format!(
            "[cluster]\nredis = \"redis://:{password}@redis.shop.svc:6379/0\"\nreplicas = {replicas}\n"
        )
    };
    let a = Config::parse(&with("hunter2", 2), "a.toml").unwrap();
    let b = Config::parse(&with("correct-horse", 2), "b.toml").unwrap();
    let c = Config::parse(&with("hunter2", 3), "c.toml").unwrap();
    assert_eq!(a.digest, b.digest, "only the password differs");
    assert_ne!(a.sha256, b.sha256, "the files differ");
    assert_ne!(a.digest, c.digest, "replicas differ");
    assert_ne!(a.digest, a.sha256);
    assert_eq!(a.digest.len(), 64);
}

#[test]
fn max_partitions_needs_a_key_and_a_positive_count() {
    let up = "[[upstream]]\nname = \"u\"\nhosts = [\"u.example\"]\n";
    let e = err(&format!("{up}max_partitions = 10\n"));
    assert!(
        e.starts_with("s.toml:4:18: ") && e.contains("no key"),
        "{e}"
    );
    let e = err(&format!("{up}key = \"header:A\"\nmax_partitions = 0\n"));
    assert!(e.contains("nonzero"), "{e}");
    let c = Config::parse(
        &format!("{up}key = \"header:A\"\nmax_partitions = 10\n"),
        "s.toml",
    )
    .unwrap();
    assert_eq!(c.upstreams[0].max_partitions, Some(10));
    assert_eq!(crate::limit::max_partitions(&c.upstreams[0]), 10);
    // Unset: as many as fit in the memory kept for them.
    let c = Config::parse(&format!("{up}key = \"header:A\"\n"), "s.toml").unwrap();
    let u = &c.upstreams[0];
    assert_eq!(
        crate::limit::max_partitions(u),
        crate::limit::PARTITION_MEMORY / crate::limit::partition_bytes(u)
    );
}

#[test]
fn upgrades_name_protocols_and_never_h2c() {
    let c = Config::parse("", "s.toml").unwrap();
    assert_eq!(c.proxy.upgrades, ["websocket"]);
    let c = Config::parse(
        "[proxy]\nupgrades = [\"WebSocket\", \"x-tail\"]\n",
        "s.toml",
    )
    .unwrap();
    assert_eq!(c.proxy.upgrades, ["websocket", "x-tail"]);
    let c = Config::parse("[proxy]\nupgrades = []\n", "s.toml").unwrap();
    assert!(c.proxy.upgrades.is_empty());
    for bad in ["h2c", "web socket", ""] {
        let e = err(&format!("[proxy]\nupgrades = [{bad:?}]\n"));
        assert!(
            e.starts_with("s.toml:2:12: ") && e.contains("upgrades"),
            "{e}"
        );
    }
}
