//! Our CRDs (`charts/aether/crds/`: AuthorizationPolicy, HTTPFilter, MeshConfig, ExternalService) against their one
//! projector each (`aether_api::authorization`, `aether_api::http_filter`, `aether_api::mesh_config`,
//! `aether_api::external_service`): what a `kubectl apply` would be refused for (the API
//! server's served versions and name rule, the CRD's openAPIV3Schema as JSON Schema, its `x-kubernetes-validations`
//! CEL rules) and what the registrar refuses must agree, on the same field, on every fixture of
//! `tests/fixtures/<api>/` the schema can judge; the fixtures only the projector can judge are named with the reason.
//! The schema must never refuse what the projector accepts, must name exactly the typed object's fields, and must keep
//! unknown fields for the projector to refuse by name.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use aether_api::authorization::{
    self, Action, AuthorizationPolicy, AuthorizationPolicySpec, Operation, ProjectOptions, Rule, RuleFrom, RuleTo,
    Source, TargetRef, Unsupported, WorkloadSelector,
};
use aether_api::external_service::{self, ExternalService};
use aether_api::http_filter::{self, HttpFilter};
use aether_api::mesh_config::{self, MeshConfig};
use aether_common::names::dns_label;
use jsonschema::error::ValidationErrorKind;
use jsonschema::paths::LocationSegment;
use serde_json::{Value, json};

/// A refusal: the field (the projector's notation, `spec.rules[0].to[0].operation.paths[1]`) and why.
type Refusal = (String, String);

/// One of our APIs: its CRD, its fixtures and its projector.
struct Api {
    crd: &'static str,
    /// Under `tests/fixtures/`.
    fixtures: &'static str,
    group: &'static str,
    kind: &'static str,
    /// The projector's verdict on each object of this kind in a text (a decoding error counts as a refusal).
    projector: fn(&str) -> Vec<Option<Refusal>>,
    /// Invalid fixtures only the projector refuses, and why no schema can.
    projector_only: &'static [(&'static str, &'static str)],
    /// How many invalid fixtures there are at least.
    invalid_at_least: usize,
}

const AUTHORIZATION: Api = Api {
    crd: "charts/aether/crds/authorizationpolicies.security.aether.io.yaml",
    fixtures: "authorization",
    group: authorization::GROUP,
    kind: authorization::KIND,
    projector: authorization_verdicts,
    projector_only: &AUTHORIZATION_ONLY,
    invalid_at_least: 25,
};

const HTTP_FILTER: Api = Api {
    crd: "charts/aether/crds/httpfilters.networking.aether.io.yaml",
    fixtures: "http_filter",
    group: http_filter::GROUP,
    kind: http_filter::KIND,
    projector: http_filter_verdicts,
    projector_only: &HTTP_FILTER_ONLY,
    invalid_at_least: 25,
};

const MESH_CONFIG: Api = Api {
    crd: "charts/aether/crds/meshconfigs.mesh.aether.io.yaml",
    fixtures: "mesh_config",
    group: mesh_config::GROUP,
    kind: mesh_config::KIND,
    projector: mesh_config_verdicts,
    projector_only: &MESH_CONFIG_ONLY,
    invalid_at_least: 15,
};

const EXTERNAL_SERVICE: Api = Api {
    crd: "charts/aether/crds/externalservices.networking.aether.io.yaml",
    fixtures: "external_service",
    group: external_service::GROUP,
    kind: external_service::KIND,
    projector: external_service_verdicts,
    projector_only: &EXTERNAL_SERVICE_ONLY,
    invalid_at_least: 15,
};

const EXTERNAL_SERVICE_ONLY: [(&str, &str); 7] = [
    ("address", "an address's octets are beyond a character pattern"),
    ("ca-not-pem", "PEM blocks are beyond a pattern the schema could state"),
    ("duplicate-host", "a list of strings cannot be a set by a key"),
    (
        "duplicate-port",
        "the ports are an atomic list: the schema keys nothing in them",
    ),
    (
        "originate-on-tls",
        "a rule across two fields of a port, kept out of CEL",
    ),
    ("unknown-field", UNKNOWN_FIELD),
    ("unknown-port-field", UNKNOWN_FIELD),
];

const AUTHORIZATION_ONLY: [(&str, &str); 8] = [
    ("bad-cidr", "an address's octets are beyond a character pattern"),
    (
        "cidr-host-bits",
        "host bits need the prefix length applied to the address",
    ),
    ("label-key", "a structural schema cannot constrain the keys of a map"),
    (
        "match-expressions",
        "an unknown field, kept for the projector to refuse by name",
    ),
    (
        "mesh-wide-targets",
        "the mesh root namespace is the registrar's --mesh-root-namespace",
    ),
    (
        "target-mixed",
        "a rule across the list's items: the projector names the item, a CEL fieldPath cannot",
    ),
    (
        "target-namespace",
        "an unknown field, kept for the projector to refuse by name",
    ),
    (
        "when-condition",
        "an unknown field, kept for the projector to refuse by name",
    ),
];

const UNKNOWN_FIELD: &str = "an unknown field, kept for the projector to refuse by name";
const DURATION_BOUNDS: &str = "a duration's bounds: the schema states its syntax only";
const ROOT_NAMESPACE: &str = "the mesh root namespace is a flag of the registrar and the controller, not the schema's";

const HTTP_FILTER_ONLY: [(&str, &str); 11] = [
    ("fill-interval-short", DURATION_BOUNDS),
    ("grpc-path-prefix", UNKNOWN_FIELD),
    (
        "rbac-identity-callers",
        "whether rbac.rules may name identities depends on spec.attach, which the schema does not relate",
    ),
    (
        "rbac-ports",
        "rbac.rules is AuthorizationPolicy's schema, where ports are allowed",
    ),
    ("rbac-selector", UNKNOWN_FIELD),
    ("rbac-when", UNKNOWN_FIELD),
    ("route-ref-namespace", UNKNOWN_FIELD),
    ("target-namespace", UNKNOWN_FIELD),
    ("timeout-long", DURATION_BOUNDS),
    ("timeout-zero", DURATION_BOUNDS),
    ("unknown-field", UNKNOWN_FIELD),
];

const MESH_CONFIG_ONLY: [(&str, &str); 7] = [
    ("connect-timeout-long", DURATION_BOUNDS),
    ("connect-timeout-zero", DURATION_BOUNDS),
    ("mesh-domain", ROOT_NAMESPACE),
    ("per-try-timeout", UNKNOWN_FIELD),
    ("request-timeout-long", DURATION_BOUNDS),
    ("unknown-field", UNKNOWN_FIELD),
    ("unknown-mtls-field", UNKNOWN_FIELD),
];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn documents(text: &str) -> Vec<Value> {
    let mut input = text.as_bytes();
    let documents = serde_saphyr::read::<_, Value>(&mut input);
    documents.map(|d| d.expect("YAML")).collect()
}

/// The API server's judge of one kind's documents, from its CRD.
struct ApplyTime {
    served: Vec<String>,
    /// The openAPIV3Schema as written, with its `x-kubernetes-*` keys.
    open_api: Value,
    validator: jsonschema::Validator,
}

impl ApplyTime {
    fn new(api: &Api) -> Self {
        let text = std::fs::read_to_string(root().join(api.crd)).expect("the CRD");
        let [crd] = &documents(&text)[..] else {
            panic!("{}: one document", api.crd)
        };
        let versions = crd["spec"]["versions"].as_array().expect("versions");
        let served = versions.iter().filter(|v| v["served"] == json!(true));
        let open_api = versions[0]["schema"]["openAPIV3Schema"].clone();
        let validator = jsonschema::draft4::new(&without_kubernetes_keys(&open_api)).expect("a JSON Schema");
        ApplyTime {
            served: served.map(|v| v["name"].as_str().unwrap().to_owned()).collect(),
            open_api,
            validator,
        }
    }

    /// The first reason the API server would refuse `document`, in the order it checks.
    fn refusal(&self, document: &Value) -> Option<Refusal> {
        let api_version = document["apiVersion"].as_str().unwrap_or_default();
        let version = api_version.rsplit_once('/').map_or("", |(_, v)| v);
        if !self.served.iter().any(|v| v == version) {
            return Some(("apiVersion".to_owned(), format!("{api_version} is not served")));
        }
        let name = document["metadata"]["name"].as_str().unwrap_or_default();
        if !(name.len() <= 253 && name.split('.').all(|l| dns_label(l).is_ok())) {
            return Some(("metadata.name".to_owned(), "is not a DNS-1123 subdomain".to_owned()));
        }
        if let Some(error) = self.validator.iter_errors(document).next() {
            let mut at = field(error.instance_path().iter());
            // The API server names a missing field itself (`spec.targetRefs: Required value`), as the projector does.
            if let ValidationErrorKind::Required { property } = error.kind() {
                let name = property.as_str().expect("a property name");
                at = if at.is_empty() {
                    name.to_owned()
                } else {
                    format!("{at}.{name}")
                };
            }
            return Some((at, error.to_string()));
        }
        cel_refusal(&self.open_api, document, "")
    }
}

/// JSON Schema from OpenAPI: the `x-kubernetes-*` extensions dropped (CEL rules are run by [`cel_refusal`]).
fn without_kubernetes_keys(schema: &Value) -> Value {
    match schema {
        Value::Object(map) => (map.iter())
            .filter(|(key, _)| !key.starts_with("x-kubernetes-"))
            .map(|(key, value)| (key.clone(), without_kubernetes_keys(value)))
            .collect(),
        Value::Array(items) => items.iter().map(without_kubernetes_keys).collect(),
        other => other.clone(),
    }
}

/// A JSON pointer's segments as the projector names a field.
fn field<'a>(segments: impl Iterator<Item = LocationSegment<'a>>) -> String {
    let mut out = String::new();
    for segment in segments {
        match segment {
            LocationSegment::Index(i) => out.push_str(&format!("[{i}]")),
            LocationSegment::Property(name) if out.is_empty() => out.push_str(&name),
            LocationSegment::Property(name) => out.push_str(&format!(".{name}")),
        }
    }
    out
}

/// The first `x-kubernetes-validations` rule that `instance` breaks, at its `fieldPath`, walking `schema` as the API
/// server does: each rule with `self` bound to the value of the node that declares it.
fn cel_refusal(schema: &Value, instance: &Value, at: &str) -> Option<Refusal> {
    for rule in schema["x-kubernetes-validations"].as_array().into_iter().flatten() {
        let text = rule["rule"].as_str().expect("a rule");
        let program = cel::Program::compile(text).unwrap_or_else(|e| panic!("{text}: {e}"));
        let mut context = cel::Context::default();
        context.add_variable("self", instance.clone()).expect("self");
        match program.execute(&context) {
            Ok(cel::Value::Bool(true)) => {}
            Ok(cel::Value::Bool(false)) => {
                // A root rule's `.metadata.name` is the API server's `metadata.name`.
                let path = format!("{at}{}", rule["fieldPath"].as_str().unwrap_or_default());
                let path = path.trim_start_matches('.').to_owned();
                return Some((path, rule["message"].as_str().unwrap_or_default().to_owned()));
            }
            other => panic!("{text} on {instance}: {other:?}"),
        }
    }
    let join = |key: &str| {
        if at.is_empty() {
            key.to_owned()
        } else {
            format!("{at}.{key}")
        }
    };
    match instance {
        Value::Object(map) => map.iter().find_map(|(key, value)| {
            let property = schema["properties"].get(key)?;
            cel_refusal(property, value, &join(key))
        }),
        Value::Array(items) => {
            (items.iter().enumerate()).find_map(|(i, item)| cel_refusal(&schema["items"], item, &format!("{at}[{i}]")))
        }
        _ => None,
    }
}

/// The AuthorizationPolicy projector's verdict on each policy of `text`.
fn authorization_verdicts(text: &str) -> Vec<Option<Refusal>> {
    let options = ProjectOptions::default();
    let verdict = |document: Result<AuthorizationPolicy, _>| match document {
        Err(aether_api::yaml::ParseError { field, message, .. }) => Some((field, message)),
        Ok(object) => (authorization::project(&object, &options).err()).map(|r| (r.field, r.message)),
    };
    authorization::parse_documents(text).into_iter().map(verdict).collect()
}

/// The HTTPFilter projector's verdict on each filter of `text`.
fn http_filter_verdicts(text: &str) -> Vec<Option<Refusal>> {
    let verdict = |document: Result<HttpFilter, _>| match document {
        Err(aether_api::yaml::ParseError { field, message, .. }) => Some((field, message)),
        Ok(object) => (http_filter::project(&object).err()).map(|r| (r.field, r.message)),
    };
    http_filter::parse_documents(text).into_iter().map(verdict).collect()
}

/// The MeshConfig projector's verdict on each MeshConfig of `text`.
fn mesh_config_verdicts(text: &str) -> Vec<Option<Refusal>> {
    let options = ProjectOptions::default();
    let verdict = |document: Result<MeshConfig, _>| match document {
        Err(aether_api::yaml::ParseError { field, message, .. }) => Some((field, message)),
        Ok(object) => (mesh_config::project(&object, &options).err()).map(|r| (r.field, r.message)),
    };
    mesh_config::parse_documents(text).into_iter().map(verdict).collect()
}

/// The ExternalService projector's verdict on each declaration of `text`.
fn external_service_verdicts(text: &str) -> Vec<Option<Refusal>> {
    let verdict = |document: Result<ExternalService, _>| match document {
        Err(aether_api::yaml::ParseError { field, message, .. }) => Some((field, message)),
        Ok(object) => (external_service::project(&object).err()).map(|r| (r.field, r.message)),
    };
    external_service::parse_documents(text)
        .into_iter()
        .map(verdict)
        .collect()
}

/// The documents `parse_documents` reads: our group and kind, any version.
fn is_ours(api: &Api, document: &Value) -> bool {
    let group = document["apiVersion"]
        .as_str()
        .and_then(|v| v.split_once('/'))
        .map(|(g, _)| g);
    group == Some(api.group) && document["kind"] == api.kind
}

fn fixtures(api: &Api, kind: &str) -> Vec<(String, String)> {
    let dir = root().join("tests/fixtures").join(api.fixtures).join(kind);
    let mut files: Vec<PathBuf> = (std::fs::read_dir(&dir).expect("fixtures"))
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    let name = |path: &Path| path.file_stem().unwrap().to_string_lossy().into_owned();
    files
        .iter()
        .map(|path| (name(path), std::fs::read_to_string(path).unwrap()))
        .collect()
}

/// Both verdicts on every object of `text`.
fn verdicts(api: &Api, apply: &ApplyTime, text: &str) -> Vec<(Option<Refusal>, Option<Refusal>)> {
    let ours: Vec<Value> = documents(text).into_iter().filter(|d| is_ours(api, d)).collect();
    let projected = (api.projector)(text);
    assert_eq!(ours.len(), projected.len(), "the same documents");
    ours.iter().map(|d| apply.refusal(d)).zip(projected).collect()
}

fn assert_valid_fixtures_pass_the_schema_and_the_projector(api: &Api) {
    let apply = ApplyTime::new(api);
    let files = fixtures(api, "valid");
    assert!(files.len() >= 5);
    for (name, text) in files {
        for (at_apply, at_projection) in verdicts(api, &apply, &text) {
            assert_eq!((at_apply, at_projection), (None, None), "{name}");
        }
    }
}

#[test]
fn valid_fixtures_pass_the_schema_and_the_projector() {
    assert_valid_fixtures_pass_the_schema_and_the_projector(&AUTHORIZATION);
    assert_valid_fixtures_pass_the_schema_and_the_projector(&HTTP_FILTER);
    assert_valid_fixtures_pass_the_schema_and_the_projector(&MESH_CONFIG);
    assert_valid_fixtures_pass_the_schema_and_the_projector(&EXTERNAL_SERVICE);
}

/// An invalid fixture the schema refuses is refused on the projector's field; the others are exactly the API's
/// `projector_only`.
fn assert_invalid_fixtures_are_refused_on_the_same_field(api: &Api) {
    let apply = ApplyTime::new(api);
    let files = fixtures(api, "invalid");
    assert!(files.len() >= api.invalid_at_least);
    let mut projector_only = BTreeSet::new();
    for (name, text) in files {
        let [(at_apply, at_projection)] = &verdicts(api, &apply, &text)[..] else {
            panic!("{name}: one object")
        };
        let (field, message) = at_projection
            .clone()
            .unwrap_or_else(|| panic!("{name}: the projector accepts it"));
        match at_apply {
            Some((apply_field, apply_message)) => {
                assert_eq!(
                    *apply_field, field,
                    "{name}: at apply {apply_message}; projected {message}"
                )
            }
            None => {
                let why = (api.projector_only.iter())
                    .find(|(n, _)| *n == name)
                    .map_or("not listed", |(_, why)| why);
                println!("only the projector judges {name}: {field}: {message} ({why})");
                projector_only.insert(name);
            }
        }
    }
    let listed: BTreeSet<String> = api.projector_only.iter().map(|(n, _)| (*n).to_owned()).collect();
    assert_eq!(
        projector_only, listed,
        "the {} fixtures only the projector refuses",
        api.kind
    );
}

#[test]
fn the_schema_and_the_projector_refuse_invalid_fixtures_on_the_same_field() {
    assert_invalid_fixtures_are_refused_on_the_same_field(&AUTHORIZATION);
    assert_invalid_fixtures_are_refused_on_the_same_field(&HTTP_FILTER);
    assert_invalid_fixtures_are_refused_on_the_same_field(&MESH_CONFIG);
    assert_invalid_fixtures_are_refused_on_the_same_field(&EXTERNAL_SERVICE);
}

/// One policy with `value` at `field`: a source or operation list, a label value, a targetRef's name or group.
fn policy_with(field: &str, value: &Value) -> Value {
    let spec = match field {
        "matchLabels" => json!({"selector": {"matchLabels": {"app": value}}}),
        "targetRefs.name" => json!({"targetRefs": [{"kind": "Service", "name": value}]}),
        "targetRefs.group" => json!({"targetRefs": [{"group": value, "kind": "Service", "name": "cart"}]}),
        "ports" | "notPorts" | "methods" | "notMethods" | "paths" | "notPaths" | "hosts" | "notHosts" => {
            json!({"rules": [{"to": [{"operation": {field: [value]}}]}]})
        }
        _ => json!({"rules": [{"from": [{"source": {field: [value]}}]}]}),
    };
    json!({"apiVersion": "security.aether.io/v1alpha1", "kind": "AuthorizationPolicy",
           "metadata": {"name": "p", "namespace": "shop"}, "spec": spec})
}

fn projector_refuses(document: &Value) -> bool {
    match serde_json::from_value::<AuthorizationPolicy>(document.clone()) {
        Ok(object) => authorization::project(&object, &ProjectOptions::default()).is_err(),
        Err(_) => true,
    }
}

/// Values at the edges of each field's rule, and whether the schema's rule is the projector's exactly.
type Edges = Vec<(&'static str, bool, Value)>;

fn long(c: &str, n: usize) -> Value {
    json!(c.repeat(n))
}

fn source_edges() -> Edges {
    let principals = json!([
        "*",
        "spiffe://td",
        "spiffe://td/ns/a/sa/b",
        "spiffe://cluster.local/ns/a/*",
        "*/sa/b",
        "spiffe://TD/x",
        "spiffe://td/a//b",
        "spiffe://td/a/../b",
        "spiffe://td/",
        "spiffe://",
        "spiffe://td/a?b",
        "http://td/*",
        "*/sa/b c",
        "**",
        "spiffe://td/*/x",
        "cluster.local/ns/a"
    ]);
    let accounts = json!([
        "shop/cart-sa",
        "shop/a.b",
        "0/9",
        "shop",
        "shop/*",
        "Shop/a",
        "shop/a/b",
        "-a/b",
        "a/"
    ]);
    let namespaces = json!([
        "shop",
        "9",
        "team-*",
        "Shop",
        "-a",
        "a-",
        "",
        long("a", 63),
        long("a", 64)
    ]);
    let blocks = json!([
        "10.0.0.0/8",
        "10.1.2.3",
        "fd00::/8",
        "::ffff:1.2.3.4",
        "10.0.0.1/8",
        "10.0.0.0/33",
        "ten"
    ]);
    vec![
        ("principals", false, principals),
        ("notServiceAccounts", false, accounts),
        ("namespaces", true, namespaces),
        ("ipBlocks", false, blocks),
    ]
}

fn operation_edges() -> Edges {
    let methods = json!(["GET", "PURGE_X-Y", "get", "G ET", "", long("A", 32), long("A", 33)]);
    let paths = json!([
        "/",
        "/a/b",
        "/a*",
        "/*",
        "*.json",
        "*",
        "a",
        "a*",
        "/a?x=1",
        "/a#f",
        "/a b",
        "**",
        "*/x*",
        "/a*b",
        "",
        "/é",
        long("/", 1025),
        long("/", 1026)
    ]);
    let hosts = json!([
        "*.example.com",
        "api.local:8080",
        "Api.Local",
        "[::1]:80",
        "prefix.*",
        "*",
        "a b",
        "",
        "**",
        "a*b",
        "*a*",
        "é.local",
        long("a", 259),
        long("a", 260)
    ]);
    vec![
        ("notPorts", true, json!([1, 8080, 65535, 0, 65536, -1, "http"])),
        ("methods", true, methods),
        ("paths", false, paths),
        ("notHosts", true, hosts),
    ]
}

fn target_edges() -> Edges {
    let labels = json!([
        "web",
        "",
        "A.b_c-9",
        "a b",
        "-a",
        "a-",
        "_a",
        long("a", 63),
        long("a", 64)
    ]);
    let names = json!(["cart", "Cart", "a.b", "-a", long("a", 63), long("a", 64)]);
    let groups = json!(["", "core", "Core", "gateway.networking.k8s.io"]);
    vec![
        ("matchLabels", true, labels),
        ("targetRefs.name", true, names),
        ("targetRefs.group", true, groups),
    ]
}

/// The schema's patterns and bounds never refuse a value the projector accepts (a looser rule is fine: the projector
/// still refuses); where the schema states the projector's rule exactly, both refuse the same values.
#[test]
fn the_schema_never_refuses_what_the_projector_accepts() {
    let apply = ApplyTime::new(&AUTHORIZATION);
    let mut refused_by_both = 0;
    let edges = [source_edges(), operation_edges(), target_edges()].concat();
    for (field, exact, values) in edges {
        for value in values.as_array().unwrap() {
            let document = policy_with(field, value);
            let (at_apply, at_projection) = (apply.refusal(&document), projector_refuses(&document));
            assert!(
                at_apply.is_none() || at_projection,
                "{field} {value}: the schema refuses what the projector accepts: {at_apply:?}"
            );
            if exact {
                assert_eq!(at_apply.is_some(), at_projection, "{field} {value}: {at_apply:?}");
            }
            refused_by_both += usize::from(at_apply.is_some());
        }
    }
    assert!(
        refused_by_both >= 40,
        "the edge values exercise the schema: {refused_by_both}"
    );
}

/// A spec with every field of the typed object set (selector and targetRefs together: only names matter here).
fn every_field() -> AuthorizationPolicySpec {
    let some = |v: &str| vec![v.to_owned()];
    let source = Source {
        principals: some("*"),
        not_principals: some("*"),
        service_accounts: some("a/b"),
        not_service_accounts: some("a/b"),
        namespaces: some("a"),
        not_namespaces: some("a"),
        ip_blocks: some("10.0.0.0/8"),
        not_ip_blocks: some("10.0.0.0/8"),
        unsupported: Unsupported::new(),
    };
    let operation = Operation {
        ports: vec![80],
        not_ports: vec![80],
        methods: some("GET"),
        not_methods: some("GET"),
        paths: some("/"),
        not_paths: some("/"),
        hosts: some("a"),
        not_hosts: some("a"),
        unsupported: Unsupported::new(),
    };
    let rule = Rule {
        from: vec![RuleFrom {
            source,
            unsupported: Unsupported::new(),
        }],
        to: vec![RuleTo {
            operation,
            unsupported: Unsupported::new(),
        }],
        unsupported: Unsupported::new(),
    };
    let target = TargetRef {
        group: String::new(),
        kind: "Service".to_owned(),
        name: "a".to_owned(),
        unsupported: Unsupported::new(),
    };
    AuthorizationPolicySpec {
        selector: Some(WorkloadSelector {
            match_labels: [("app".to_owned(), "a".to_owned())].into(),
            unsupported: Unsupported::new(),
        }),
        target_refs: vec![target],
        action: Action::Deny,
        dry_run: true,
        rules: vec![rule],
        unsupported: Unsupported::new(),
    }
}

/// Walks the typed object's JSON beside its schema: each mapping names the schema's properties exactly and keeps
/// unknown fields (so the projector sees them), each scalar has the schema's type.
fn same_fields(schema: &Value, typed: &Value, at: &str) {
    match typed {
        Value::Object(map) if schema.get("properties").is_some() => {
            let declared: BTreeSet<&String> = schema["properties"].as_object().unwrap().keys().collect();
            assert_eq!(
                declared,
                map.keys().collect(),
                "{at}: the schema's fields are the typed object's"
            );
            let preserved = &schema["x-kubernetes-preserve-unknown-fields"];
            assert_eq!(preserved, &json!(true), "{at}: unknown fields must reach the projector");
            for (key, value) in map {
                same_fields(&schema["properties"][key], value, &format!("{at}.{key}"));
            }
        }
        Value::Object(map) => {
            assert_eq!(schema["type"], "object", "{at}");
            map.values()
                .for_each(|v| same_fields(&schema["additionalProperties"], v, &format!("{at}[]")));
        }
        Value::Array(items) => {
            assert_eq!(schema["type"], "array", "{at}");
            items
                .iter()
                .for_each(|item| same_fields(&schema["items"], item, &format!("{at}[]")));
        }
        Value::String(_) => assert_eq!(schema["type"], "string", "{at}"),
        Value::Number(_) => assert_eq!(schema["type"], "integer", "{at}"),
        Value::Bool(_) => assert_eq!(schema["type"], "boolean", "{at}"),
        Value::Null => panic!("{at}: null"),
    }
}

#[test]
fn the_schema_names_exactly_the_fields_of_the_typed_object() {
    let apply = ApplyTime::new(&AUTHORIZATION);
    let spec = serde_json::to_value(every_field()).unwrap();
    same_fields(&apply.open_api["properties"]["spec"], &spec, "spec");
}

/// The status the registrar writes (policies/kubernetes/status.rs) fits each status schema, accepted or refused.
#[test]
fn the_status_the_registrar_writes_fits_the_schema() {
    let objects = [
        (&AUTHORIZATION, policy_with("namespaces", &json!("shop"))),
        (&HTTP_FILTER, filter_with("order", &json!(0))),
        (&MESH_CONFIG, every_mesh_config_field()),
        (&EXTERNAL_SERVICE, every_external_service_field()),
    ];
    for (api, object) in objects {
        let apply = ApplyTime::new(api);
        for (status, reason, message) in [
            ("True", "Accepted", "accepted: enforced as written"),
            (
                "False",
                "Invalid",
                "spec.action: \"PERMIT\" is not ALLOW, DENY or AUDIT; the last accepted version stays",
            ),
        ] {
            let mut object = object.clone();
            object["status"] = json!({"observedGeneration": 3, "conditions": [{
                "type": "Accepted", "status": status, "reason": reason, "message": message,
                "observedGeneration": 3, "lastTransitionTime": "2026-05-01T10:00:00Z"}]});
            assert_eq!(apply.refusal(&object), None, "{} {status}", api.kind);
        }
        let mut unknown = object.clone();
        unknown["status"] = json!({"conditions": [{"type": "Accepted", "status": "Maybe"}]});
        assert!(
            apply.refusal(&unknown).is_some(),
            "{}: a condition's status is True, False or Unknown",
            api.kind
        );
    }
}

/// One HTTPFilter with `value` at `field`, in a filter that is valid otherwise.
fn filter_with(field: &str, value: &Value) -> Value {
    let grpc = json!({"host": "authz", "port": 9000});
    let rate = json!({"maxTokens": 10, "fillInterval": "1s"});
    let mut spec = match field {
        "host" | "port" => json!({"extAuthz": {"grpc": {"host": "authz", "port": 9000, field: value}}}),
        "pathPrefix" => json!({"extAuthz": {"http": {"host": "authz", "port": 80, "pathPrefix": value}}}),
        "allowedHeaders" => json!({"extAuthz": {"http": {"host": "authz", "port": 80, "allowedHeaders": [value]}}}),
        "timeout" | "statusOnError" | "maxRequestBytes" => json!({"extAuthz": {"grpc": grpc, field: value}}),
        "maxTokens" | "fillInterval" | "status" => {
            let mut rate = rate.clone();
            rate[field] = value.clone();
            json!({"localRateLimit": rate})
        }
        "header" | "key" | "metadataNamespace" => {
            let mut rule = json!({"header": "x-a", "key": "a"});
            rule[field] = value.clone();
            json!({"headerToMetadata": {"rules": [rule]}})
        }
        "routeRef.name" => json!({"attach": "Route", "routeRef": {"kind": "HTTPRoute", "name": value}}),
        "routeRef.kind" => json!({"attach": "Route", "routeRef": {"kind": value, "name": "r"}}),
        "attach" | "order" => json!({field: value}),
        _ => panic!("no edge for {field}"),
    };
    if ["routeRef.name", "routeRef.kind", "attach", "order"].contains(&field) {
        spec["localRateLimit"] = rate;
    }
    spec["targetRefs"] = json!([{"kind": "Service", "name": "orders"}]);
    json!({"apiVersion": "networking.aether.io/v1alpha1", "kind": "HTTPFilter",
           "metadata": {"name": "f", "namespace": "shop"}, "spec": spec})
}

fn ext_authz_edges() -> Edges {
    let hosts = json!([
        "authz.shop.svc.cluster.local",
        "authz",
        "10.0.0.1",
        "fd00::1",
        "FD00::1",
        "::ffff:1.2.3.4",
        "1.2.3.4.5",
        "Authz",
        "authz_svc",
        "http://authz",
        "authz:9000",
        "[fd00::1]",
        "a..b",
        "-a",
        "",
        "fd00::1::2",
        "gg::1",
        long("a", 63),
        long("a", 64)
    ]);
    let prefixes = json!([
        "/check",
        "/a/b",
        "/a.b",
        "",
        "/",
        "/check/",
        "check",
        "//a",
        "/a//b",
        "/a b",
        "/a#b",
        "/a?b",
        "/.",
        "/a/..",
        "/%2f",
        "/%zz",
        long("/a", 512),
        long("/a", 513)
    ]);
    let statuses = json!([400, 403, 429, 503, 511, 0, 200, 302, 418, 509, 600, -1, "403"]);
    let timeouts = json!([
        "1ms", "200ms", "10s", "1m", "0s", "11s", "10001ms", "1.5s", "1d", "", "200 ms"
    ]);
    vec![
        ("host", false, hosts),
        ("port", true, json!([1, 9000, 65535, 0, 65536, -1, "grpc"])),
        ("pathPrefix", false, prefixes),
        ("allowedHeaders", true, headers()),
        ("statusOnError", true, statuses),
        ("maxRequestBytes", true, json!([0, 1, 1_048_576, 1_048_577, -1])),
        ("timeout", false, timeouts),
    ]
}

fn headers() -> Value {
    json!([
        "x-user",
        "authorization",
        "a!#$%&'*+.^_`|~-9",
        "X-User",
        ":path",
        "",
        "a b",
        "é",
        long("a", 256),
        long("a", 257)
    ])
}

fn filter_edges() -> Edges {
    let names = json!([
        "tenant",
        "a.b_c-9",
        "A",
        "a b",
        "a/b",
        "",
        long("a", 256),
        long("a", 257)
    ]);
    let routes = json!([
        "r",
        "orders-split",
        "a.b",
        "Orders",
        "-a",
        "a_b",
        "",
        long("a", 63),
        long("a", 64)
    ]);
    vec![
        (
            "maxTokens",
            true,
            json!([1, 100, 4_294_967_295_u64, 0, 4_294_967_296_u64, -1]),
        ),
        (
            "fillInterval",
            false,
            json!(["50ms", "1s", "1h", "1m30s", "49ms", "61m", "1d", ""]),
        ),
        ("status", true, json!([429, 503, 0, 200, 418])),
        ("header", true, headers()),
        ("key", true, names.clone()),
        ("metadataNamespace", true, names),
        ("order", true, json!([-1000, 0, 1000, -1001, 1001, "1"])),
        ("routeRef.name", false, routes),
        (
            "routeRef.kind",
            true,
            json!(["HTTPRoute", "GRPCRoute", "TCPRoute", "httproute", ""]),
        ),
        (
            "attach",
            true,
            json!(["Inbound", "Callers", "Route", "inbound", "Outbound", ""]),
        ),
    ]
}

/// As for AuthorizationPolicy: the HTTPFilter schema never refuses a value the projector accepts, and refuses the
/// same values where it states the projector's rule exactly.
#[test]
fn the_http_filter_schema_never_refuses_what_the_projector_accepts() {
    let apply = ApplyTime::new(&HTTP_FILTER);
    let mut refused_by_both = 0;
    for (field, exact, values) in [ext_authz_edges(), filter_edges()].concat() {
        for value in values.as_array().unwrap() {
            let document = filter_with(field, value);
            let at_apply = apply.refusal(&document);
            let [at_projection] = &http_filter_verdicts(&document.to_string())[..] else {
                panic!("one filter")
            };
            assert!(
                at_apply.is_none() || at_projection.is_some(),
                "{field} {value}: the schema refuses what the projector accepts: {at_apply:?}"
            );
            if exact {
                assert_eq!(
                    at_apply.is_some(),
                    at_projection.is_some(),
                    "{field} {value}: {at_apply:?}"
                );
            }
            refused_by_both += usize::from(at_apply.is_some());
        }
    }
    assert!(
        refused_by_both >= 60,
        "the edge values exercise the schema: {refused_by_both}"
    );
}

/// An HTTPFilter spec with every field of the typed object set (every filter kind at once: only names matter here).
fn every_filter_field() -> http_filter::HttpFilterSpec {
    use http_filter::{Attach, ExtAuthz, GrpcService, HeaderRule, HeaderToMetadata, HttpService, LocalRateLimit, Rbac};
    let rule = HeaderRule {
        header: "x-a".to_owned(),
        key: "a".to_owned(),
        metadata_namespace: Some("a".to_owned()),
        remove: true,
        unsupported: Unsupported::new(),
    };
    let policy = every_field();
    http_filter::HttpFilterSpec {
        target_refs: policy.target_refs,
        attach: Attach::Route,
        route_ref: Some(http_filter::RouteRef {
            group: "gateway.networking.k8s.io".to_owned(),
            kind: "HTTPRoute".to_owned(),
            name: "r".to_owned(),
            unsupported: Unsupported::new(),
        }),
        order: 1,
        ext_authz: Some(ExtAuthz {
            grpc: Some(GrpcService {
                host: "a".to_owned(),
                port: 1,
                unsupported: Unsupported::new(),
            }),
            http: Some(HttpService {
                host: "a".to_owned(),
                port: 1,
                path_prefix: "/a".to_owned(),
                allowed_headers: vec!["a".to_owned()],
                unsupported: Unsupported::new(),
            }),
            timeout: Some("1s".to_owned()),
            fail_open: true,
            status_on_error: Some(403),
            max_request_bytes: 1,
            unsupported: Unsupported::new(),
        }),
        local_rate_limit: Some(LocalRateLimit {
            max_tokens: 1,
            tokens_per_fill: Some(1),
            fill_interval: "1s".to_owned(),
            status: Some(429),
            unsupported: Unsupported::new(),
        }),
        header_to_metadata: Some(HeaderToMetadata {
            rules: vec![rule],
            unsupported: Unsupported::new(),
        }),
        rbac: Some(Rbac {
            action: Action::Deny,
            rules: policy.rules,
            unsupported: Unsupported::new(),
        }),
        unsupported: Unsupported::new(),
    }
}

#[test]
fn the_http_filter_schema_names_exactly_the_fields_of_the_typed_object() {
    let apply = ApplyTime::new(&HTTP_FILTER);
    let spec = serde_json::to_value(every_filter_field()).unwrap();
    same_fields(&apply.open_api["properties"]["spec"], &spec, "spec");
}

/// A MeshConfig with every field set, as JSON.
fn every_mesh_config_field() -> Value {
    let text = std::fs::read_to_string(root().join("tests/fixtures/mesh_config/valid/resilience-all.yaml")).unwrap();
    let mut object: MeshConfig = mesh_config::parse_documents(&text).remove(0).expect("the fixture");
    object.spec.mtls = Some(mesh_config::Mtls {
        mode: Some(mesh_config::MtlsMode::Strict),
        ..Default::default()
    });
    object.spec.authorization = Some(mesh_config::Authorization {
        default_action: Some(mesh_config::DefaultAction::Deny),
        ..Default::default()
    });
    object.spec.mesh_domain = Some("corp.internal".into());
    let mut value = serde_json::to_value(object).unwrap();
    value["apiVersion"] = json!("mesh.aether.io/v1alpha1");
    value["kind"] = json!("MeshConfig");
    value
}

#[test]
fn the_mesh_config_schema_names_exactly_the_fields_of_the_typed_object() {
    let apply = ApplyTime::new(&MESH_CONFIG);
    let object = every_mesh_config_field();
    same_fields(&apply.open_api["properties"]["spec"], &object["spec"], "spec");
    assert_eq!(apply.refusal(&object), None);
}

/// An ExternalService with every field set, as JSON.
fn every_external_service_field() -> Value {
    let text = std::fs::read_to_string(root().join("tests/fixtures/external_service/valid/own-ca.yaml")).unwrap();
    let mut object: ExternalService = external_service::parse_documents(&text).remove(0).expect("the fixture");
    object.spec.addresses = vec!["203.0.113.7".into()];
    for (i, port) in object.spec.ports.iter_mut().enumerate() {
        port.target_port = Some(443);
        port.originate_tls = Some(true);
        port.name = Some(format!("http-{i}"));
    }
    object.spec.tls.as_mut().unwrap().server_name = Some("api.payments.example".into());
    let mut value = serde_json::to_value(object).unwrap();
    value["apiVersion"] = json!("networking.aether.io/v1alpha1");
    value["kind"] = json!("ExternalService");
    value
}

#[test]
fn the_external_service_schema_names_exactly_the_fields_of_the_typed_object() {
    let apply = ApplyTime::new(&EXTERNAL_SERVICE);
    let object = every_external_service_field();
    same_fields(&apply.open_api["properties"]["spec"], &object["spec"], "spec");
    assert_eq!(apply.refusal(&object), None);
    assert_eq!(external_service_verdicts(&object.to_string()), [None]);
}

/// A schema without its descriptions.
fn without_descriptions(schema: &Value) -> Value {
    match schema {
        Value::Object(map) => (map.iter())
            .filter(|(key, _)| *key != "description")
            .map(|(key, value)| (key.clone(), without_descriptions(value)))
            .collect(),
        Value::Array(items) => items.iter().map(without_descriptions).collect(),
        other => other.clone(),
    }
}

/// `spec.rbac.rules` is AuthorizationPolicy's `spec.rules`: one rule language, refused alike at apply time.
#[test]
fn the_http_filter_rbac_rules_are_the_authorization_policy_rules() {
    let policy = ApplyTime::new(&AUTHORIZATION).open_api;
    let filter = ApplyTime::new(&HTTP_FILTER).open_api;
    let rules = |schema: &Value, pointer: &str| without_descriptions(schema.pointer(pointer).expect(pointer));
    assert_eq!(
        rules(&filter, "/properties/spec/properties/rbac/properties/rules"),
        rules(&policy, "/properties/spec/properties/rules")
    );
}
