//! HTTPFilter: the fixtures of `tests/fixtures/http_filter` (valid ones project, pass
//! `validate` and survive a round trip; each invalid one is refused on the field its first
//! line names), what the projection holds, and what `validate` refuses in a projected
//! filter.

use std::fs;
use std::path::{Path, PathBuf};

use aether_api::http_filter::{HttpFilter, key, parse_documents, project, validate};
use aether_proto::registry::v1::{
    AuthorizationAction, AuthorizationSource, ExtAuthzProtocol, HttpFilter as Projected, HttpFilterAttachment,
    http_filter::Filter,
};

fn fixture_dir(kind: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/http_filter")
        .join(kind)
}

fn fixtures(kind: &str) -> Vec<(PathBuf, String)> {
    let dir = fixture_dir(kind);
    let mut files: Vec<_> = fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.unwrap().path())
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|p| (p.clone(), fs::read_to_string(&p).unwrap()))
        .collect()
}

fn objects(yaml: &str) -> Vec<HttpFilter> {
    let documents = parse_documents(yaml).into_iter();
    documents.map(|d| d.unwrap_or_else(|e| panic!("{e}"))).collect()
}

fn projected(file: &str) -> Vec<Projected> {
    let text = fs::read_to_string(fixture_dir("valid").join(file)).unwrap();
    let objects = objects(&text).into_iter();
    objects.map(|o| project(&o).unwrap_or_else(|e| panic!("{e}"))).collect()
}

#[test]
fn valid_fixtures_project_validate_and_round_trip() {
    let files = fixtures("valid");
    assert!(files.len() >= 5);
    let mut kinds = std::collections::HashSet::new();
    for (path, text) in files {
        let at = path.display();
        let objects = objects(&text);
        assert!(!objects.is_empty(), "{at}");
        for object in objects {
            let filter = project(&object).unwrap_or_else(|e| panic!("{at}: {e}"));
            assert_eq!(validate(&filter), Ok(()), "{at}");
            // The object as the API server serves it back (JSON, which is YAML) reads and
            // projects the same.
            let mut json = serde_json::to_value(&object).unwrap();
            json["apiVersion"] = "networking.aether.io/v1alpha1".into();
            json["kind"] = "HTTPFilter".into();
            let again = parse_documents(&json.to_string()).remove(0).unwrap();
            assert_eq!((&again, project(&again).as_ref()), (&object, Ok(&filter)), "{at}");
            kinds.insert(std::mem::discriminant(filter.filter.as_ref().unwrap()));
        }
    }
    assert_eq!(kinds.len(), 4, "every filter kind has a valid fixture");
}

#[test]
fn invalid_fixtures_are_refused_on_their_field() {
    let files = fixtures("invalid");
    assert!(files.len() >= 45);
    for (path, text) in files {
        let at = path.display();
        let header = text.lines().next().and_then(|l| l.strip_prefix("# refused: "));
        let (field, fragment) = header.and_then(|h| h.split_once(" | ")).expect("a # refused: line");
        let mut documents = parse_documents(&text);
        assert_eq!(documents.len(), 1, "{at}");
        let (got_field, message) = match documents.remove(0) {
            Err(e) => (e.field, e.message),
            Ok(object) => {
                let refusal = project(&object).expect_err(&at.to_string());
                (refusal.field, refusal.message)
            }
        };
        assert_eq!(got_field, field, "{at}: {message}");
        assert!(message.contains(fragment), "{at}: {message:?} lacks {fragment:?}");
        assert!(message.len() < 1024, "{at}: the message quotes bounded");
    }
}

#[test]
fn ext_authz_projects_its_service_and_bounds_and_leaves_defaults_unset() {
    let [grpc] = <[Projected; 1]>::try_from(projected("ext-authz-grpc.yaml")).unwrap();
    assert_eq!(key(&grpc), "shop/check-orders");
    assert_eq!(
        (grpc.generation, grpc.order, grpc.attach()),
        (4, 100, HttpFilterAttachment::Inbound)
    );
    assert_eq!(
        (grpc.services.as_slice(), grpc.route.as_str()),
        (&["shop/orders".to_owned()][..], "")
    );
    let Some(Filter::ExtAuthz(e)) = &grpc.filter else {
        panic!("ext_authz")
    };
    assert_eq!(
        (e.host.as_str(), e.port, e.protocol()),
        ("authz.shop.svc.cluster.local", 9000, ExtAuthzProtocol::Grpc)
    );
    assert_eq!(
        (e.timeout_ms, e.status_on_error, e.max_request_bytes, e.fail_open),
        (250, 503, 8192, false)
    );

    let [http] = <[Projected; 1]>::try_from(projected("ext-authz-http.yaml")).unwrap();
    assert_eq!(
        (http.attach(), http.services.as_slice()),
        (HttpFilterAttachment::Callers, &["shop/payments".to_owned()][..])
    );
    let Some(Filter::ExtAuthz(e)) = &http.filter else {
        panic!("ext_authz")
    };
    // The address canonical; what the object left unset stays 0 for the agent's defaults.
    assert_eq!(
        (e.host.as_str(), e.port, e.protocol()),
        ("fd00::10", 8000, ExtAuthzProtocol::Http)
    );
    assert_eq!(
        (e.path_prefix.as_str(), e.allowed_headers.as_slice()),
        ("/check", &["x-user".to_owned(), "authorization".to_owned()][..])
    );
    assert_eq!(
        (e.timeout_ms, e.status_on_error, e.max_request_bytes, e.fail_open),
        (0, 0, 0, true)
    );
}

#[test]
fn rate_limits_header_rules_and_rbac_project_as_written() {
    let [search, all] = <[Projected; 2]>::try_from(projected("local-rate-limit.yaml")).unwrap();
    assert_eq!(search.services, ["shop/search", "shop/catalog"]);
    let Some(Filter::LocalRateLimit(l)) = &search.filter else {
        panic!("local_rate_limit")
    };
    assert_eq!(
        (l.max_tokens, l.tokens_per_fill, l.fill_interval_ms, l.status),
        (100, 10, 90_000, 503)
    );
    assert_eq!((key(&all), all.order), ("default/limit-all".to_owned(), 0));
    let Some(Filter::LocalRateLimit(l)) = &all.filter else {
        panic!("local_rate_limit")
    };
    assert_eq!(
        (l.max_tokens, l.tokens_per_fill, l.fill_interval_ms, l.status),
        (1, 0, 50, 0)
    );

    let [tenant] = <[Projected; 1]>::try_from(projected("header-to-metadata-route.yaml")).unwrap();
    assert_eq!(
        (tenant.attach(), tenant.route.as_str()),
        (HttpFilterAttachment::Route, "http/shop/orders-split")
    );
    let Some(Filter::HeaderToMetadata(h)) = &tenant.filter else {
        panic!("header_to_metadata")
    };
    let rules: Vec<_> = h
        .rules
        .iter()
        .map(|r| {
            (
                r.header.as_str(),
                r.metadata_namespace.as_str(),
                r.key.as_str(),
                r.remove,
            )
        })
        .collect();
    assert_eq!(
        rules,
        [
            ("x-tenant", "aether.tenant", "tenant", true),
            ("x-request-class", "", "class", false)
        ]
    );

    let [deny, allow] = <[Projected; 2]>::try_from(projected("rbac.yaml")).unwrap();
    assert_eq!(deny.route, "grpc/shop/orders-grpc");
    let Some(Filter::Rbac(r)) = &deny.filter else {
        panic!("rbac")
    };
    assert_eq!(
        (r.action(), r.rules[0].to[0].methods.as_slice()),
        (AuthorizationAction::Deny, &["DELETE".to_owned()][..])
    );
    assert_eq!(r.rules[0].to[0].paths[0].value, "/admin");
    let Some(Filter::Rbac(r)) = &allow.filter else {
        panic!("rbac")
    };
    // ALLOW when unset; hosts lower-cased as AuthorizationPolicy's projector does.
    assert_eq!(
        (r.action(), r.rules[0].to[0].hosts[0].value.as_str()),
        (AuthorizationAction::Allow, "catalog.shop")
    );
}

/// A change to a projected filter that the projector would never make.
type Breakage = fn(&mut Projected);

fn ext_authz(filter: &mut Projected) -> &mut aether_proto::registry::v1::ExtAuthz {
    match &mut filter.filter {
        Some(Filter::ExtAuthz(e)) => e,
        _ => panic!("ext_authz"),
    }
}

#[test]
fn validate_refuses_what_the_projector_never_writes() {
    let good = projected("ext-authz-http.yaml").remove(0);
    let cases: [(&str, Breakage); 14] = [
        ("name", |f| f.name = "Bad_Name".into()),
        ("services", |f| f.services.clear()),
        ("services[0]", |f| f.services[0] = "other/payments".into()),
        ("services[1]", |f| f.services.push("shop/payments".into())),
        ("attach", |f| f.attach = 0),
        ("route", |f| f.route = "http/shop/r".into()),
        ("route", |f| {
            f.attach = HttpFilterAttachment::Route.into();
            f.route = "http/other/r".into();
        }),
        ("order", |f| f.order = -1001),
        ("filter", |f| f.filter = None),
        ("ext_authz.host", |f| ext_authz(f).host = "FD00::10".into()),
        ("ext_authz.path_prefix", |f| {
            ext_authz(f).protocol = ExtAuthzProtocol::Grpc.into()
        }),
        ("ext_authz.timeout_ms", |f| ext_authz(f).timeout_ms = 10_001),
        ("ext_authz.status_on_error", |f| ext_authz(f).status_on_error = 418),
        ("ext_authz.allowed_headers[1]", |f| {
            ext_authz(f).allowed_headers[1] = "X-User".into()
        }),
    ];
    for (field, break_it) in cases {
        let mut filter = good.clone();
        break_it(&mut filter);
        assert_eq!(validate(&filter).map_err(|e| e.field), Err(field.to_owned()));
    }
    // Callers by identity: only an Inbound rbac filter sees a caller's certificate.
    let [_, mut callers] = <[Projected; 2]>::try_from(projected("rbac.yaml")).unwrap();
    let Some(Filter::Rbac(rbac)) = callers.filter.as_mut() else {
        panic!("rbac.yaml holds rbac filters")
    };
    rbac.rules[0].from.push(AuthorizationSource {
        not_namespaces: vec!["shop".into()],
        ..Default::default()
    });
    let field = "rbac.rules[0].from[0].not_namespaces".to_owned();
    assert_eq!(validate(&callers).map_err(|e| e.field), Err(field));
    callers.attach = HttpFilterAttachment::Inbound.into();
    assert_eq!(validate(&callers), Ok(()));
}

#[test]
fn validate_checks_every_filter_kind() {
    let [limit, _] = <[Projected; 2]>::try_from(projected("local-rate-limit.yaml")).unwrap();
    let [headers] = <[Projected; 1]>::try_from(projected("header-to-metadata-route.yaml")).unwrap();
    let [deny, _] = <[Projected; 2]>::try_from(projected("rbac.yaml")).unwrap();
    let cases: [(&Projected, &str, Breakage); 9] = [
        (&limit, "local_rate_limit.max_tokens", |f| rate_limit(f).max_tokens = 0),
        (&limit, "local_rate_limit.tokens_per_fill", |f| {
            rate_limit(f).tokens_per_fill = 101
        }),
        (&limit, "local_rate_limit.fill_interval_ms", |f| {
            rate_limit(f).fill_interval_ms = 49
        }),
        (&limit, "local_rate_limit.status", |f| rate_limit(f).status = 200),
        (&headers, "header_to_metadata.rules[0].metadata_namespace", |f| {
            header_rules(f)[0].metadata_namespace = "a/b".into()
        }),
        (&headers, "header_to_metadata.rules", |f| header_rules(f).clear()),
        (&deny, "rbac.action", |f| {
            rbac(f).action = AuthorizationAction::Audit.into()
        }),
        (&deny, "rbac.rules[0].to[0].ports", |f| {
            rbac(f).rules[0].to[0].ports = vec![8080]
        }),
        (&deny, "rbac.rules[0].to[0].methods[0]", |f| {
            rbac(f).rules[0].to[0].methods[0] = "delete".into()
        }),
    ];
    for (good, field, break_it) in cases {
        assert_eq!(validate(good), Ok(()));
        let mut filter = good.clone();
        break_it(&mut filter);
        assert_eq!(validate(&filter).map_err(|e| e.field), Err(field.to_owned()));
    }
}

fn rate_limit(filter: &mut Projected) -> &mut aether_proto::registry::v1::LocalRateLimit {
    match &mut filter.filter {
        Some(Filter::LocalRateLimit(l)) => l,
        _ => panic!("local_rate_limit"),
    }
}

fn header_rules(filter: &mut Projected) -> &mut Vec<aether_proto::registry::v1::HeaderToMetadataRule> {
    match &mut filter.filter {
        Some(Filter::HeaderToMetadata(h)) => &mut h.rules,
        _ => panic!("header_to_metadata"),
    }
}

fn rbac(filter: &mut Projected) -> &mut aether_proto::registry::v1::RbacFilter {
    match &mut filter.filter {
        Some(Filter::Rbac(r)) => r,
        _ => panic!("rbac"),
    }
}
