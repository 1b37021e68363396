use http::HeaderMap;
use serde_json::json;

use super::*;
use crate::config::Config;

fn family(cost: &str, limits: &str) -> Config {
    Config::parse(
        &format!(
            "[[upstream]]\nname = \"llm\"\nhosts = [\"api.example\"]\n\
             [[upstream.family]]\nname = \"chat\"\nlimits = [{limits}]\n\
             [upstream.family.cost.tokens]\n{cost}\n"
        ),
        "test",
    )
    .unwrap()
}

fn prices(c: &Config) -> &[Price] {
    &c.upstreams[0].families[0].prices
}

fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (k, v) in pairs {
        h.append(
            http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
            v.parse().unwrap(),
        );
    }
    h
}

const TPM: &str =
    "{ kind = \"token_bucket\", rate = 1000, per = \"1m\", burst = 1000, unit = \"tokens\" }";

#[test]
fn a_declared_cost_wins_and_is_capped_by_max() {
    let c = family("estimate = 10\nmax = 500", TPM);
    let p = prices(&c);
    let none = Declared::default();
    let costs = price(p, &HeaderMap::new(), &none, &BodyView::Unread, "/").unwrap();
    assert_eq!((costs.of(0), costs.of(1)), (1, 10));
    let d = Declared::read(&headers(&[("sluice-cost", "tokens=300, points=2")])).unwrap();
    assert_eq!(
        price(p, &HeaderMap::new(), &d, &BodyView::Unread, "/")
            .unwrap()
            .of(1),
        300
    );
    let d = Declared::read(&headers(&[("sluice-cost", "tokens=501")])).unwrap();
    assert!(matches!(
        price(p, &HeaderMap::new(), &d, &BodyView::Unread, "/"),
        Err(Unpriced::TooLarge {
            cost: 501,
            most: 500,
            ..
        })
    ));
    assert!(Declared::read(&headers(&[("sluice-cost", "tokens")])).is_err());
    assert!(Declared::read(&headers(&[("sluice-cost", "tokens=-3")])).is_err());
    let twice = Declared::read(&headers(&[
        ("sluice-cost", "tokens=3"),
        ("sluice-cost", "tokens=7"),
    ]));
    assert_eq!(twice.unwrap().get("tokens"), Some(7));
}

#[test]
fn a_cost_no_limit_could_hold_is_refused() {
    let c = family("estimate = 1001", TPM);
    let e = price(
        prices(&c),
        &HeaderMap::new(),
        &Declared::default(),
        &BodyView::Unread,
        "/",
    );
    assert!(
        matches!(e, Err(Unpriced::TooLarge { most: 1000, .. })),
        "{e:?}"
    );
}

#[test]
fn header_and_json_estimates_fall_back_or_refuse() {
    let c = family("estimate = \"header:x-weight\"", TPM);
    let p = prices(&c);
    let none = Declared::default();
    let h = headers(&[("x-weight", "25")]);
    assert_eq!(
        price(p, &h, &none, &BodyView::Unread, "/").unwrap().of(1),
        25
    );
    assert!(matches!(
        price(p, &HeaderMap::new(), &none, &BodyView::Unread, "/"),
        Err(Unpriced::Unreadable { .. })
    ));

    let c = family("estimate = \"json:/a+/b/0\"\nfallback = 50", TPM);
    let p = prices(&c);
    assert!(needs_body(p, &none));
    let text = json!({"a": 3, "b": [4.5]}).to_string();
    let body = super::json::Json::parse(text.as_bytes()).unwrap();
    assert_eq!(
        price(p, &HeaderMap::new(), &none, &BodyView::Json(&body), "/")
            .unwrap()
            .of(1),
        8
    );
    let text = json!({"c": 1}).to_string();
    let body = super::json::Json::parse(text.as_bytes()).unwrap();
    assert_eq!(
        price(p, &HeaderMap::new(), &none, &BodyView::Json(&body), "/")
            .unwrap()
            .of(1),
        50
    );
    assert_eq!(
        price(p, &HeaderMap::new(), &none, &BodyView::NotJson, "/")
            .unwrap()
            .of(1),
        50
    );
    let big = BodyView::TooLarge { limit: 10 };
    assert_eq!(
        price(p, &HeaderMap::new(), &none, &big, "/").unwrap().of(1),
        50
    );

    let c = family("estimate = \"json:/a\"", TPM);
    assert!(matches!(
        price(prices(&c), &HeaderMap::new(), &none, &big, "/"),
        Err(Unpriced::BodyTooLarge { limit: 10, .. })
    ));
    let d = Declared::read(&headers(&[("sluice-cost", "tokens=4")])).unwrap();
    assert!(!needs_body(prices(&c), &d), "a declared cost needs no body");
}

#[test]
fn units_are_checked_where_they_are_written() {
    let bad = |text: &str| Config::parse(text, "t").unwrap_err().to_string();
    let head = "[[upstream]]\nname = \"llm\"\nhosts = [\"api.example\"]\n";
    let e = bad(&format!(
        "{head}limits = [{{ kind = \"token_bucket\", rate = 1, per = \"1s\", burst = 1, unit = \"tokens\" }}]\n"
    ));
    assert!(e.contains("prices no tokens"), "{e}");
    let e = bad(&format!(
        "{head}[[upstream.family]]\nname = \"f\"\nlimits = [{{ kind = \"concurrency\", max = 2, unit = \"tokens\" }}]\n\
         [upstream.family.cost.tokens]\nestimate = 1\n"
    ));
    assert!(e.contains("takes no unit"), "{e}");
    let e = bad(&format!(
        "{head}[[upstream.family]]\nname = \"f\"\nlimits = [{{ kind = \"published\", permits = 9, window = \"1m\", unit = \"tokens\" }}]\n\
         [upstream.family.cost.tokens]\nestimate = 1\n"
    ));
    assert!(e.contains("cannot count tokens"), "{e}");
    let e = bad(&format!(
        "{head}[[upstream.family]]\nname = \"f\"\n[upstream.family.cost.tokens]\nestimate = 1\n"
    ));
    assert!(e.contains("no limit of this family"), "{e}");
    let e = bad(&format!(
        "{head}[[upstream.family]]\nname = \"f\"\nlimits = [{TPM}]\n[upstream.family.cost.tokens]\nestimate = \"tiktoken\"\n"
    ));
    assert!(e.contains("openai"), "{e}");
    // An upstream limit of a unit that one family prices: that family pays it in tokens,
    // the others pay nothing of it.
    let ok = Config::parse(
        &format!(
            "{head}limits = [{TPM}]\n[[upstream.family]]\nname = \"chat\"\n\
             [upstream.family.cost.tokens]\nestimate = \"openai\"\n\
             [[upstream.family]]\nname = \"models\"\n"
        ),
        "t",
    )
    .unwrap();
    assert_eq!(ok.upstreams[0].units, ["tokens"]);
    assert_eq!(ok.upstreams[0].limits[0].unit(), 1);
    assert_eq!(ok.upstreams[0].families[0].prices[0].ceiling, Some(1000));
}
