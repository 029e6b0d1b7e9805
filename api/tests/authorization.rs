//! AuthorizationPolicy: the fixtures of `tests/fixtures/authorization` (valid ones project
//! and pass `validate`; each invalid one is refused on the field its first line names),
//! what the projection holds, what `validate` refuses in a projected policy, and the one
//! check left to the enforcer, `l7_on_non_http`.

use std::fs;
use std::path::{Path, PathBuf};

use aether_api::authorization::{
    AuthorizationPolicy, ProjectOptions, l7_on_non_http, parse_documents, project, validate,
};
use aether_proto::registry::v1::{AuthorizationAction, AuthorizationPolicy as Projected, PatternKind};

fn fixtures(kind: &str) -> Vec<(PathBuf, String)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/authorization")
        .join(kind);
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

fn projected(yaml: &str) -> Vec<Projected> {
    let options = ProjectOptions::default();
    let objects = parse_documents(yaml)
        .into_iter()
        .map(|d| d.unwrap_or_else(|e| panic!("{e}")));
    objects
        .map(|o| project(&o, &options).unwrap_or_else(|e| panic!("{e}")))
        .collect()
}

#[test]
fn valid_fixtures_project_and_validate() {
    let files = fixtures("valid");
    assert!(files.len() >= 5);
    for (path, text) in files {
        let policies = projected(&text);
        assert!(!policies.is_empty(), "{}", path.display());
        for policy in policies {
            assert_eq!(validate(&policy), Ok(()), "{}", path.display());
        }
    }
}

#[test]
fn invalid_fixtures_are_refused_on_their_field() {
    let files = fixtures("invalid");
    assert!(files.len() >= 25);
    for (path, text) in files {
        let header = text.lines().next().and_then(|l| l.strip_prefix("# refused: "));
        let (field, fragment) = header.and_then(|h| h.split_once(" | ")).expect("a # refused: line");
        let mut documents = parse_documents(&text);
        assert_eq!(documents.len(), 1, "{}", path.display());
        let (got_field, message) = match documents.remove(0) {
            Err(e) => (e.field, e.message),
            Ok(object) => {
                let refusal = project(&object, &ProjectOptions::default()).expect_err(&path.display().to_string());
                (refusal.field, refusal.message)
            }
        };
        assert_eq!(got_field, field, "{}: {message}", path.display());
        assert!(
            message.contains(fragment),
            "{}: {message:?} lacks {fragment:?}",
            path.display()
        );
        assert!(message.len() < 1024, "{}: the message quotes bounded", path.display());
    }
}

#[test]
fn the_projection_holds_what_the_object_says() {
    let text = fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/authorization/valid/deny-and-audit.yaml"),
    )
    .unwrap();
    let [deny, audit] = <[Projected; 2]>::try_from(projected(&text)).unwrap();
    assert_eq!(deny.action(), AuthorizationAction::Deny);
    let target = deny.target.as_ref().unwrap();
    assert_eq!(
        (target.mesh_wide, target.services.as_slice()),
        (false, &["shop/cart".to_owned()][..])
    );
    let to = &deny.rules[0].to[0];
    assert_eq!(
        (to.ports.as_slice(), to.paths[0].kind()),
        (&[8080][..], PatternKind::Prefix)
    );
    assert_eq!(to.paths[0].value, "/admin");
    assert_eq!(deny.rules[0].from[0].not_namespaces, ["shop"]);
    assert_eq!(audit.action(), AuthorizationAction::Audit);
    let hosts = &audit.rules[0].to[0].hosts;
    assert_eq!(
        (hosts[0].kind(), hosts[0].value.as_str()),
        (PatternKind::Suffix, ".shop.aether.internal")
    );
    assert_eq!(
        (hosts[1].kind(), hosts[1].value.as_str()),
        (PatternKind::Exact, "cart.shop")
    );
    assert!(audit.target.as_ref().unwrap().match_labels.is_empty());
}

#[test]
fn the_root_namespace_makes_a_policy_mesh_wide() {
    let yaml = "apiVersion: security.aether.io/v1alpha1\nkind: AuthorizationPolicy\n\
                metadata: {name: p, namespace: mesh-root}\nspec: {rules: [{from: [{source: {ipBlocks: [10.1.2.3]}}]}]}\n";
    let object: AuthorizationPolicy = parse_documents(yaml).remove(0).unwrap();
    let default = project(&object, &ProjectOptions::default()).unwrap();
    assert!(!default.target.unwrap().mesh_wide);
    let options = ProjectOptions {
        root_namespace: "mesh-root".to_owned(),
    };
    let rooted = project(&object, &options).unwrap();
    assert!(rooted.target.unwrap().mesh_wide);
    assert_eq!(rooted.rules[0].from[0].ip_blocks, ["10.1.2.3/32"]);
    let mut unnamed = object.clone();
    unnamed.metadata.namespace = None;
    unnamed.metadata.generation = Some(7);
    let projected = project(&unnamed, &options).unwrap();
    assert_eq!((projected.namespace.as_str(), projected.generation), ("default", 7));
}

/// A change to a projected policy that the projector would never make.
type Breakage = fn(&mut Projected);

#[test]
fn validate_refuses_what_the_projector_never_writes() {
    let text = fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/authorization/valid/principals.yaml"),
    )
    .unwrap();
    let good = projected(&text).remove(0);
    let cases: [(&str, Breakage); 8] = [
        ("action", |p| p.action = 0),
        ("target", |p| p.target = None),
        ("rules[0].from[0].principals[1]", |p| {
            p.rules[0].from[0].principals[1].value.push('*')
        }),
        ("rules[0].from[0].principals[0]", |p| {
            p.rules[0].from[0].principals[0].kind = 0
        }),
        ("rules[0].from[1].ip_blocks[0]", |p| {
            p.rules[0].from[1].ip_blocks[0] = "10.8.0.1/16".into()
        }),
        ("rules[0].to[0].ports[0]", |p| p.rules[0].to[0].ports[0] = 65536),
        ("target.services[0]", |p| {
            let target = p.target.as_mut().unwrap();
            target.match_labels.clear();
            target.services = vec!["other/svc".into()];
        }),
        ("dry_run", |p| {
            p.action = AuthorizationAction::Audit.into();
            p.dry_run = true;
        }),
    ];
    for (field, break_it) in cases {
        let mut policy = good.clone();
        break_it(&mut policy);
        assert_eq!(validate(&policy).map_err(|e| e.field), Err(field.to_owned()));
    }
}

#[test]
fn l7_fields_on_a_non_http_port_are_named() {
    let policy = projected(
        "apiVersion: security.aether.io/v1alpha1\nkind: AuthorizationPolicy\nmetadata: {name: p, namespace: shop}\n\
         spec: {rules: [{to: [{operation: {ports: [5432]}}]}, \
                        {to: [{operation: {ports: [8080]}}, {operation: {notPorts: [5432], paths: [/a]}}]}]}\n",
    )
    .remove(0);
    let http = |port: u32| port != 5432;
    // An L4-only rule on a TCP port and L7 fields on HTTP ports are fine.
    assert_eq!(l7_on_non_http(&policy, &[8080, 5432], http), None);
    // Without ports, the operation applies to every port of the workload.
    let refusal = l7_on_non_http(&policy, &[8080, 9000], |p| p == 8080).unwrap();
    assert_eq!(refusal.field, "rules[1].to[1].paths");
    assert!(refusal.message.contains("port 9000 is not an HTTP port"));
    let mut explicit = policy.clone();
    explicit.rules[1].to[0].methods = vec!["GET".into()];
    explicit.rules[1].to[0].ports = vec![8080, 5432];
    let refusal = l7_on_non_http(&explicit, &[8080], http).unwrap();
    assert_eq!(refusal.field, "rules[1].to[0].methods");
    assert!(refusal.message.contains("port 5432"));
}
