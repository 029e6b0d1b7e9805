//! Apply-time and run-time verdicts agree: every fixture the projectors' own tests use
//! (`tests/fixtures/{authorization,http_filter,mesh_config}/{valid,invalid}`, the GAMMA conformance
//! routes) sent to the validating webhook as kube-apiserver would send it (an
//! AdmissionReview v1 CREATE of the object, as JSON) is allowed when it projects and
//! refused on the same field, with the same words, when it does not. Pods: their mesh
//! annotations as the agent reads them.

use std::path::{Path, PathBuf};

use aether_controller::admission::{Verdict, review};
use aether_controller::validate::Validator;
use serde_json::{Value, json};

fn files(dir: &str) -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(dir);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    files
}

/// The YAML documents of a file, as the JSON the API server would hold (a conformance
/// case's objects are in its `routes` text).
fn documents(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap();
    yaml(&text, path)
        .into_iter()
        .flat_map(|d| match d["routes"].as_str() {
            Some(routes) => yaml(routes, path),
            None => vec![d],
        })
        .collect()
}

fn yaml(text: &str, path: &Path) -> Vec<Value> {
    let mut input = text.as_bytes();
    serde_saphyr::read::<_, Value>(&mut input)
        .map(|d| d.unwrap_or_else(|e| panic!("{}: {e}", path.display())))
        .filter(|d| !d.is_null())
        .collect()
}

/// The AdmissionReview kube-apiserver sends for creating `object`.
fn create(object: &Value) -> Vec<u8> {
    let api_version = object["apiVersion"].as_str().unwrap_or_default();
    let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
    let kind = object["kind"].as_str().unwrap_or_default();
    let review = json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "0df28fbd-5f5f-11e8-bc74-36e6bb280816",
            "kind": {"group": group, "version": version, "kind": kind},
            "resource": {"group": group, "version": version, "resource": format!("{}s", kind.to_lowercase())},
            "name": object["metadata"]["name"],
            "namespace": object["metadata"]["namespace"].as_str().unwrap_or("default"),
            "operation": "CREATE",
            "userInfo": {"username": "admin", "groups": ["system:authenticated"]},
            "object": object,
            "oldObject": null,
            "dryRun": false,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"}
        }
    });
    serde_json::to_vec(&review).unwrap()
}

fn verdict(object: &Value) -> Verdict {
    let validator = Validator::default();
    review(&create(object), |r| validator.decide(r)).0
}

fn ours(object: &Value) -> bool {
    let kind = object["kind"].as_str().unwrap_or_default();
    [
        "AuthorizationPolicy",
        "HTTPFilter",
        "MeshConfig",
        "ExternalService",
        "HTTPRoute",
        "GRPCRoute",
    ]
    .contains(&kind)
}

#[test]
fn valid_fixtures_are_allowed() {
    let dirs = [
        "authorization/valid",
        "http_filter/valid",
        "mesh_config/valid",
        "external_service/valid",
        "gamma/conformance",
    ];
    let mut checked = 0;
    for path in dirs.iter().flat_map(|d| files(d)) {
        for object in documents(&path).iter().filter(|o| ours(o)) {
            assert_eq!(verdict(object), Verdict::Allow, "{}: {object}", path.display());
            checked += 1;
        }
    }
    assert!(checked >= 35, "only {checked} objects");
}

#[test]
fn invalid_fixtures_are_refused_on_their_field_with_the_projectors_words() {
    let mut checked = 0;
    for path in [
        "authorization/invalid",
        "http_filter/invalid",
        "mesh_config/invalid",
        "external_service/invalid",
    ]
    .iter()
    .flat_map(|d| files(d))
    {
        let text = std::fs::read_to_string(&path).unwrap();
        let header = text.lines().next().and_then(|l| l.strip_prefix("# refused: "));
        let (field, words) = header.and_then(|h| h.split_once(" | ")).expect("a # refused: line");
        let objects = documents(&path);
        assert_eq!(objects.len(), 1, "{}", path.display());
        let Verdict::Deny(message) = verdict(&objects[0]) else {
            panic!("{}: allowed", path.display())
        };
        let kind = objects[0]["kind"].as_str().unwrap();
        let named = format!("{kind} refused: {field}: ");
        assert!(message.starts_with(&named), "{}: {message}", path.display());
        assert!(message.contains(words), "{}: {message}", path.display());
        checked += 1;
    }
    assert!(checked >= 40, "only {checked} fixtures");
}

#[test]
fn a_route_to_gateways_only_passes_and_a_bad_mesh_route_is_refused() {
    let route = |parent: Value, path: &str| {
        json!({
            "apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
            "metadata": {"name": "r", "namespace": "shop"},
            "spec": {"parentRefs": [parent], "rules": [{"matches": [{"path": {"type": "PathPrefix", "value": path}}]}]}
        })
    };
    let gateway = json!({"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "edge"});
    let service = json!({"group": "", "kind": "Service", "name": "cart"});
    assert_eq!(verdict(&route(gateway, "/")), Verdict::Allow);
    assert_eq!(verdict(&route(service.clone(), "/")), Verdict::Allow);
    let Verdict::Deny(message) = verdict(&route(service, "no-slash")) else {
        panic!("allowed")
    };
    assert!(
        message.starts_with("HTTPRoute refused: spec.rules[0].matches[0].path.value: "),
        "{message}"
    );
}

#[test]
fn tcp_and_tls_routes_are_judged_like_the_other_routes() {
    let route = |kind: &str, hostnames: Value, rules: Value| {
        json!({
            "apiVersion": "gateway.networking.k8s.io/v1alpha2", "kind": kind,
            "metadata": {"name": "r", "namespace": "shop"},
            "spec": {"parentRefs": [{"group": "", "kind": "Service", "name": "db", "port": 5432}],
                     "hostnames": hostnames, "rules": rules}
        })
    };
    let one = json!([{"backendRefs": [{"name": "db-v2", "port": 5432}]}]);
    assert_eq!(verdict(&route("TCPRoute", json!([]), one.clone())), Verdict::Allow);
    assert_eq!(
        verdict(&route("TLSRoute", json!(["*.example.com"]), one.clone())),
        Verdict::Allow
    );
    let two = json!([{"backendRefs": [{"name": "a", "port": 1}]}, {"backendRefs": [{"name": "b", "port": 1}]}]);
    let Verdict::Deny(message) = verdict(&route("TCPRoute", json!([]), two)) else {
        panic!("two rules allowed")
    };
    assert!(
        message.starts_with("TCPRoute refused: spec.rules: 2 rules"),
        "{message}"
    );
    let Verdict::Deny(message) = verdict(&route("TLSRoute", json!(["ok.example.com", "10.0.0.1"]), one)) else {
        panic!("an IP server name allowed")
    };
    assert!(
        message.starts_with("TLSRoute refused: spec.hostnames[1]: "),
        "{message}"
    );
}

#[test]
fn pods_are_judged_by_their_mesh_annotations() {
    let pod = |annotations: Value| json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web", "namespace": "shop", "annotations": annotations}, "spec": {}});
    assert_eq!(verdict(&pod(json!({}))), Verdict::Allow);
    let good = json!({"config.aether.io/upstreams": "cart, pay/api", "security.aether.io/inbound-mtls": "STRICT"});
    assert_eq!(verdict(&pod(good)), Verdict::Allow);
    let uds = json!({"endpoint.aether.io/uds-socket": "sockets/app.sock"});
    assert_eq!(verdict(&pod(uds)), Verdict::Allow);
    let Verdict::Deny(message) = verdict(&pod(json!({"endpoint.aether.io/uds-socket": "app.sock"}))) else {
        panic!("a socket without a volume allowed")
    };
    assert!(
        message.starts_with("Pod refused: endpoint.aether.io/uds-socket: \"app.sock\""),
        "{message}"
    );
    let bad = json!({"config.aether.io/upstreams": "cart, Pay_Api", "security.aether.io/inbound-mtls": "on"});
    assert_eq!(
        verdict(&pod(bad)),
        Verdict::Deny(
            "Pod refused: config.aether.io/upstreams[1]: \"Pay_Api\": \"Pay_Api\" is not a DNS-1123 label (lowercase letters, digits and '-'); security.aether.io/inbound-mtls: \"on\" is not strict or permissive".into()
        )
    );
}

#[test]
fn another_kind_and_a_delete_are_answered_plainly() {
    let config_map = json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c", "namespace": "shop"}});
    let Verdict::Deny(message) = verdict(&config_map) else {
        panic!("allowed")
    };
    assert!(message.contains("not a kind aether-controller validates"), "{message}");
    // A request naming a huge kind for a policy object: the refusal quotes it bounded.
    let policy = json!({"apiVersion": "security.aether.io/v1alpha1", "kind": "AuthorizationPolicy",
        "metadata": {"name": "p", "namespace": "shop"}, "spec": {"action": "AUDIT", "dryRun": true}});
    let mut huge: Value = serde_json::from_slice(&create(&policy)).unwrap();
    huge["request"]["kind"]["kind"] = json!("K".repeat(100_000));
    let validator = Validator::default();
    let body = serde_json::to_vec(&huge).unwrap();
    let Verdict::Deny(message) = review(&body, |r| validator.decide(r)).0 else {
        panic!("allowed")
    };
    assert!(
        message.len() < 600 && message.contains("spec.dryRun"),
        "{} bytes",
        message.len()
    );
    let mut delete: Value = serde_json::from_slice(&create(&config_map)).unwrap();
    delete["request"]["operation"] = json!("DELETE");
    delete["request"]["object"] = Value::Null;
    let validator = Validator::default();
    let body = serde_json::to_vec(&delete).unwrap();
    assert_eq!(review(&body, |r| validator.decide(r)).0, Verdict::Allow);
}
