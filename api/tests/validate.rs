//! `validate` catches what a store or a stream could carry corrupted, naming the proto field.

use aether_api::{RouteObject, parse_documents, project, validate};
use aether_proto::registry::v1::route_filter::Filter;
use aether_proto::registry::v1::{Route, RouteKind, RouteRetry};

fn projected() -> Route {
    let text = include_str!("fixtures/mesh-routes.yaml");
    let object: RouteObject = parse_documents(text)
        .into_iter()
        .map(Result::unwrap)
        .find(|o| o.name() == "cart-redirects")
        .unwrap();
    project(&object).unwrap().unwrap()
}

#[test]
fn each_corruption_is_caught_on_its_field() {
    type Corrupt = fn(&mut Route);
    let cases: &[(Corrupt, &str)] = &[
        (|r| r.kind = RouteKind::Unspecified.into(), "kind"),
        (|r| r.name = "Not/A/Name".into(), "name"),
        (|r| r.parents.clear(), "parents"),
        (|r| r.parents[0].service = "no-slash".into(), "parents[0].service"),
        (|r| r.rules.clear(), "rules"),
        (
            |r| r.rules[1].matches[0].path.as_mut().unwrap().value = "relative".into(),
            "rules[1].matches[0].path.value",
        ),
        (
            |r| {
                let path = r.rules[1].matches[0].path.as_mut().unwrap();
                path.r#type = 3;
                path.value = "(".into();
            },
            "rules[1].matches[0].path.value",
        ),
        (
            |r| r.rules[0].matches[0].method = "get".into(),
            "rules[0].matches[0].method",
        ),
        (
            |r| {
                if let Some(Filter::RequestRedirect(redirect)) = &mut r.rules[1].filters[0].filter {
                    redirect.status_code = 200;
                }
            },
            "rules[1].filters[0].status_code",
        ),
        (|r| r.rules[0].filters[0].filter = None, "rules[0].filters[0]"),
        (
            |r| {
                r.rules[0].backends = vec![Default::default()];
            },
            "rules[0].backends[0].service",
        ),
        (
            |r| {
                r.rules[0].retry = Some(RouteRetry {
                    attempts: 99,
                    ..Default::default()
                })
            },
            "rules[0].retry.attempts",
        ),
        (
            |r| (r.rules[0].request_timeout_ms, r.rules[0].backend_request_timeout_ms) = (1, 2),
            "rules[0].backend_request_timeout_ms",
        ),
    ];
    let good = projected();
    validate(&good).unwrap();
    for (corrupt, field) in cases {
        let mut route = good.clone();
        corrupt(&mut route);
        let invalid = validate(&route).expect_err(field);
        assert_eq!(invalid.field, *field, "{invalid}");
    }
}

#[test]
fn a_backend_weight_out_of_range_and_an_upper_case_header_are_caught() {
    let text = include_str!("fixtures/mesh-routes.yaml");
    let object = parse_documents(text)
        .into_iter()
        .map(Result::unwrap)
        .find(|o| o.name() == "cart-rewrites")
        .unwrap();
    let good = project(&object).unwrap().unwrap();
    let mut heavy = good.clone();
    heavy.rules[0].backends[0].weight = 1_000_001;
    assert_eq!(validate(&heavy).unwrap_err().field, "rules[0].backends[0].weight");
    let mut shouting = good;
    if let Some(Filter::RequestHeaderModifier(m)) = &mut shouting.rules[0].filters[1].filter {
        m.set[0].name = "X-Set".into();
    }
    assert_eq!(validate(&shouting).unwrap_err().field, "rules[0].filters[1]");
}
