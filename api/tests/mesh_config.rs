//! The MeshConfig projector: what a good object projects into, every refusal with its
//! field, the proto re-validation, and how a namespace's settings are decided.

use aether_api::authorization::ProjectOptions;
use aether_api::authorization::{AuthzRequest, Verdict, Workload, decide};
use aether_api::mesh_config::{ResilienceSettings, default_deny, effective, parse_documents, project, validate};
use aether_api::pod::InboundMtls;
use aether_proto::registry::v1::{DefaultAuthorization, InboundMtlsMode, MeshConfig, Resilience};
use proptest::prelude::*;

fn options() -> ProjectOptions {
    ProjectOptions {
        root_namespace: "aether-system".into(),
    }
}

fn one(yaml: &str) -> Result<MeshConfig, String> {
    let mut objects = parse_documents(yaml);
    assert_eq!(objects.len(), 1, "{yaml}");
    let object = objects.remove(0).map_err(|e| format!("{}: {}", e.field, e.message))?;
    project(&object, &options()).map_err(|r| r.to_string())
}

fn config(namespace: &str, spec: &str) -> String {
    format!(
        "apiVersion: mesh.aether.io/v1alpha1\nkind: MeshConfig\nmetadata:\n  name: default\n  namespace: {namespace}\n  generation: 4\nspec:\n{spec}"
    )
}

#[test]
fn a_whole_mesh_config_projects_field_by_field() {
    let spec = "  mtls:\n    mode: PERMISSIVE\n  authorization:\n    defaultAction: DENY\n  resilience:\n    connectTimeout: 250ms\n    requestTimeout: 1m30s\n    retries:\n      attempts: 0\n    outlierDetection:\n      consecutiveGatewayErrors: 5\n      maxEjectionPercent: 20\n    circuitBreaker:\n      maxConnections: 100\n      maxPendingRequests: 10\n      maxRequests: 1000\n";
    let projected = one(&config("shop", spec)).unwrap();
    assert_eq!(
        projected,
        MeshConfig {
            namespace: "shop".into(),
            name: "default".into(),
            generation: 4,
            mesh_wide: false,
            inbound_mtls: InboundMtlsMode::Permissive.into(),
            default_authorization: DefaultAuthorization::Deny.into(),
            resilience: Some(Resilience {
                connect_timeout_ms: Some(250),
                request_timeout_ms: Some(90_000),
                retry_attempts: Some(0),
                consecutive_gateway_errors: Some(5),
                max_ejection_percent: Some(20),
                max_connections: Some(100),
                max_pending_requests: Some(10),
                max_requests: Some(1000),
            }),
            mesh_domain: String::new(),
        }
    );
    assert_eq!(validate(&projected), Ok(()));
}

#[test]
fn the_root_namespace_config_is_mesh_wide_and_unset_fields_stay_unset() {
    let projected = one(&config("aether-system", "  mtls: {}\n")).unwrap();
    assert!(projected.mesh_wide);
    assert_eq!(projected.inbound_mtls(), InboundMtlsMode::Unspecified);
    assert_eq!(projected.default_authorization(), DefaultAuthorization::Unspecified);
    assert_eq!(projected.resilience, None);
}

/// `tests/fixtures/mesh_config/<kind>/*.yaml`, by name.
fn fixtures(kind: &str) -> Vec<(String, String)> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/mesh_config")
        .join(kind);
    let mut files: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    files.sort();
    let name = |p: &std::path::Path| p.file_stem().unwrap().to_string_lossy().into_owned();
    files
        .iter()
        .map(|p| (name(p), std::fs::read_to_string(p).unwrap()))
        .collect()
}

#[test]
fn valid_fixtures_project_and_validate() {
    let files = fixtures("valid");
    assert!(files.len() >= 5);
    for (name, text) in files {
        let projected = one(&text).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(validate(&projected), Ok(()), "{name}");
    }
}

#[test]
fn invalid_fixtures_are_refused_on_their_field() {
    let files = fixtures("invalid");
    assert!(files.len() >= 15);
    for (name, text) in files {
        let header = text.lines().next().and_then(|l| l.strip_prefix("# refused: "));
        let (field, words) = header.and_then(|h| h.split_once(" | ")).expect("a # refused: line");
        let refusal = one(&text).expect_err(&name);
        assert!(refusal.starts_with(&format!("{field}: ")), "{name}: {refusal}");
        assert!(refusal.contains(words), "{name}: {refusal}");
    }
}

#[test]
fn an_unknown_version_is_refused_naming_api_version() {
    let yaml = config("shop", "  mtls: {}\n").replace("v1alpha1", "v1");
    let refusal = one(&yaml).unwrap_err();
    assert!(
        refusal.contains("apiVersion") && refusal.contains("mesh.aether.io/v1alpha1"),
        "{refusal}"
    );
}

#[test]
fn validate_refuses_what_a_store_could_hold_out_of_range() {
    let mut config = one(&config("shop", "  mtls:\n    mode: STRICT\n")).unwrap();
    config.inbound_mtls = 9;
    assert_eq!(validate(&config).unwrap_err().field, "inbound_mtls");
    config.inbound_mtls = 0;
    config.resilience = Some(Resilience {
        max_ejection_percent: Some(400),
        ..Default::default()
    });
    let refusal = validate(&config).unwrap_err();
    assert_eq!(
        refusal.to_string(),
        "resilience.max_ejection_percent: 400 is out of range (0 to 100)"
    );
    config.resilience = None;
    config.name = "other".into();
    assert_eq!(validate(&config).unwrap_err().field, "name");
    config.name = "default".into();

    // A mesh domain only where the projector puts one: mesh-wide, a domain.
    config.mesh_domain = "corp.internal".into();
    assert_eq!(
        validate(&config).unwrap_err().to_string(),
        "mesh_domain: is set on a MeshConfig that is not mesh-wide"
    );
    config.mesh_wide = true;
    assert_eq!(validate(&config), Ok(()));
    config.mesh_domain = "corp".into();
    assert!(validate(&config).unwrap_err().message.contains("has one label"));
}

#[test]
fn the_mesh_domain_is_the_mesh_wide_configs_alone() {
    let mut mesh = one(&config("aether-system", "  meshDomain: corp.internal\n")).unwrap();
    assert_eq!(mesh.mesh_domain, "corp.internal");
    let shop = one(&config("shop", "  mtls: {}\n")).unwrap();
    assert_eq!(
        effective([&mesh, &shop], "shop").mesh_domain.as_deref(),
        Some("corp.internal")
    );
    assert_eq!(effective([&mesh], "").mesh_domain.as_deref(), Some("corp.internal"));
    assert_eq!(effective([&shop], "shop").mesh_domain, None);
    mesh.mesh_domain.clear();
    assert_eq!(effective([&mesh, &shop], "shop").mesh_domain, None, "unset: none");
}

fn projected(namespace: &str, mesh_wide: bool, mtls: InboundMtlsMode, action: DefaultAuthorization) -> MeshConfig {
    MeshConfig {
        namespace: namespace.into(),
        name: "default".into(),
        mesh_wide,
        inbound_mtls: mtls.into(),
        default_authorization: action.into(),
        ..Default::default()
    }
}

#[test]
fn a_namespace_overrides_the_mesh_field_by_field() {
    let none = effective([], "shop");
    assert_eq!(none.inbound_mtls, None, "the node's flag decides");
    assert_eq!(none.default_authorization, DefaultAuthorization::Allow);
    assert_eq!(none.resilience, ResilienceSettings::default());

    let mut mesh = projected(
        "aether-system",
        true,
        InboundMtlsMode::Strict,
        DefaultAuthorization::Deny,
    );
    mesh.resilience = Some(Resilience {
        connect_timeout_ms: Some(300),
        retry_attempts: Some(1),
        ..Default::default()
    });
    let mut shop = projected("shop", false, InboundMtlsMode::Unspecified, DefaultAuthorization::Allow);
    shop.resilience = Some(Resilience {
        retry_attempts: Some(0),
        ..Default::default()
    });
    let other = projected(
        "other",
        false,
        InboundMtlsMode::Permissive,
        DefaultAuthorization::Unspecified,
    );
    let all = [&mesh, &shop, &other];

    let settings = effective(all, "shop");
    assert_eq!(settings.inbound_mtls, Some(InboundMtls::Strict), "the mesh's");
    assert_eq!(
        settings.default_authorization,
        DefaultAuthorization::Allow,
        "the namespace's own"
    );
    assert_eq!(settings.resilience.retry_attempts, 0, "the namespace's own, even 0");
    assert_eq!(settings.resilience.connect_timeout_ms, 300, "the mesh's");
    assert_eq!(
        settings.resilience.max_requests,
        ResilienceSettings::default().max_requests
    );

    let settings = effective(all, "other");
    assert_eq!(settings.inbound_mtls, Some(InboundMtls::Permissive));
    assert_eq!(settings.default_authorization, DefaultAuthorization::Deny, "the mesh's");
    assert_eq!(settings.resilience.retry_attempts, 1);

    let settings = effective([&shop], "shop");
    assert_eq!(settings.inbound_mtls, None, "no mesh-wide config: the node's flag");
}

#[test]
fn default_deny_admits_only_what_an_allow_policy_allows_and_only_in_its_namespace() {
    let request = |namespace: &str| AuthzRequest {
        workload: Workload {
            namespace: namespace.into(),
            ..Default::default()
        },
        principal: Some("spiffe://cluster.local/ns/web/sa/frontend".into()),
        trust_domain: "cluster.local".into(),
        peer_ip: [10, 0, 0, 1].into(),
        port: 8080,
        http: None,
    };
    let deny = default_deny("shop");
    assert_eq!(decide(&[&deny], &request("shop")).verdict, Verdict::Deny);
    assert_eq!(
        decide(&[&deny], &request("other")).verdict,
        Verdict::Allow,
        "another namespace"
    );
    let allow_web = aether_proto::registry::v1::AuthorizationPolicy {
        namespace: "shop".into(),
        name: "allow-web".into(),
        target: Some(Default::default()),
        action: aether_proto::registry::v1::AuthorizationAction::Allow.into(),
        rules: vec![aether_proto::registry::v1::AuthorizationRule {
            from: vec![aether_proto::registry::v1::AuthorizationSource {
                namespaces: vec!["web".into()],
                ..Default::default()
            }],
            ..Default::default()
        }],
        ..Default::default()
    };
    assert_eq!(decide(&[&deny, &allow_web], &request("shop")).verdict, Verdict::Allow);
    // No policy of the catalog can be taken for it: its name is not one a user can give.
    assert_eq!(aether_api::authorization::validate(&deny).unwrap_err().field, "name");
}

proptest! {
    /// Whatever numbers an object holds, the projector either refuses it or projects
    /// something the proto's validation accepts: apply-time and run-time agree.
    #[test]
    fn what_projects_validates(
        attempts in -3i64..20,
        percent in -5i64..120,
        errors in -2i64..1200,
        requests in -1i64..1_200_000,
        connect in 0u64..70_000,
    ) {
        let spec = format!(
            "  resilience:\n    connectTimeout: {connect}ms\n    retries:\n      attempts: {attempts}\n    outlierDetection:\n      consecutiveGatewayErrors: {errors}\n      maxEjectionPercent: {percent}\n    circuitBreaker:\n      maxRequests: {requests}\n"
        );
        if let Ok(projected) = one(&config("shop", &spec)) {
            prop_assert_eq!(validate(&projected), Ok(()));
        }
    }
}
