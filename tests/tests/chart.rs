//! The Helm chart (`charts/aether`), linted and rendered by Helm's own code (helm-python-sdk, which embeds Helm v4:
//! no `helm` binary is installable here) for the default values and every store × identity combination. Every
//! rendered object, and every CRD of its `crds/`, must deserialize into its k8s-openapi type without losing a field
//! (so a misspelt key fails), and the invariants the product relies on are asserted on the typed objects. The control plane's mTLS material the
//! chart generates is checked with the real registrar: an agent-like client bootstraps a node certificate with a
//! token shaped as the rendered projected volume, and calls the registrar with it.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use aether_api::{authorization, external_service, http_filter, mesh_config};
use aether_common::tls::{self, CertSlot, Connector, PeerIdentity, ServerIdentity};
use aether_fakes::kube::{ApiServer, TokenInfo};
use aether_proto::registrar::v1::node_bootstrap_client::NodeBootstrapClient;
use aether_proto::registrar::v1::registrar_client::RegistrarClient;
use aether_proto::registrar::v1::{IssueNodeCertificateRequest, ListServicesRequest};
use aether_tests::envoy::workspace_root;
use aether_tests::{ChildGuard, free_port};
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
    ValidatingWebhookConfiguration,
};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, KeyToPath, PersistentVolumeClaim, PodSpec, Secret, Service, ServiceAccount, Volume,
};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use serde_json::{Value, json};
use tonic::transport::{Channel, Endpoint};

const STORES: [&str; 4] = ["embedded", "etcd", "dynamodb", "kubernetes"];
const IDENTITIES: [&str; 2] = ["builtin", "spire"];

/// What one `helm lint` + `helm template` produced, typed.
#[derive(Default)]
struct Rendered {
    daemon_sets: Vec<DaemonSet>,
    deployments: Vec<Deployment>,
    services: Vec<Service>,
    service_accounts: Vec<ServiceAccount>,
    cluster_roles: Vec<ClusterRole>,
    cluster_role_bindings: Vec<ClusterRoleBinding>,
    roles: Vec<Role>,
    role_bindings: Vec<RoleBinding>,
    pdbs: Vec<PodDisruptionBudget>,
    pvcs: Vec<PersistentVolumeClaim>,
    secrets: Vec<Secret>,
    config_maps: Vec<ConfigMap>,
    network_policies: Vec<NetworkPolicy>,
    validating_webhooks: Vec<ValidatingWebhookConfiguration>,
    admission_policies: Vec<ValidatingAdmissionPolicy>,
    admission_policy_bindings: Vec<ValidatingAdmissionPolicyBinding>,
    mutating_webhooks: Vec<MutatingWebhookConfiguration>,
    /// The chart's `crds/`, which Helm applies as they are (never templated) before the templates.
    crds: Vec<CustomResourceDefinition>,
    /// Our own objects the chart renders (the mesh-wide MeshConfig), as JSON.
    mesh_configs: Vec<Value>,
    /// Gateway API objects (the GatewayClass `aether`), as JSON: their CRDs are not ours, no k8s-openapi type.
    gateway_classes: Vec<Value>,
    hpas: Vec<HorizontalPodAutoscaler>,
    /// Every object as rendered, for checks on any string in them.
    raw: Vec<Value>,
}

fn python() -> PathBuf {
    let venv = std::env::var_os("AETHER_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join(".venv"));
    let python = venv.join("bin/python");
    assert!(
        python.is_file(),
        "{} is missing: run `make setup` (it installs helm-python-sdk and PyYAML into the venv)",
        python.display()
    );
    python
}

/// Runs scripts/render-chart.py: `Ok((objects, crds))` or `Err(helm's error)` for a values set the chart refuses.
/// With `lint_clean`, `helm lint --strict` must report nothing above info level.
fn render_raw(values: &Value, lint_clean: bool) -> Result<(Vec<Value>, Vec<Value>), String> {
    let root = workspace_root();
    let out = Command::new(python())
        .arg(root.join("scripts/render-chart.py"))
        .arg(root.join("charts/aether"))
        .arg(values.to_string())
        .output()
        .expect("run scripts/render-chart.py");
    assert!(
        out.status.success(),
        "render-chart.py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_slice(&out.stdout).expect("render-chart.py prints JSON");
    let lint = &report["lint"];
    if lint_clean {
        assert_lint_clean(values, lint);
    }
    match report["error"].as_str() {
        Some(error) => Err(error.to_owned()),
        None => Ok((
            report["objects"]
                .as_array()
                .expect("objects")
                .iter()
                .map(|o| o["object"].clone())
                .collect(),
            report["crds"].as_array().expect("crds").clone(),
        )),
    }
}

fn assert_lint_clean(values: &Value, lint: &Value) {
    assert_eq!(lint["errors"], json!([]), "helm lint errors for {values}: {lint}");
    for message in lint["messages"].as_array().expect("lint messages") {
        // 1 = info (e.g. "icon is recommended"); warnings and errors fail.
        assert!(
            message["severity"].as_u64() <= Some(1),
            "helm lint for {values}: {message}"
        );
    }
}

/// Deserializes `object` as `T` and checks nothing was dropped on the way (a misspelt or misplaced key would be).
fn typed<T: serde::de::DeserializeOwned + serde::Serialize>(object: &Value) -> T {
    let value: T = serde_json::from_value(object.clone())
        .unwrap_or_else(|e| panic!("{} does not deserialize: {e}\n{object:#}", object["kind"]));
    let back = strip_nulls(serde_json::to_value(&value).expect("serialize"));
    let original = strip_nulls(object.clone());
    assert_eq!(
        back, original,
        "{} {} lost or changed fields in a k8s-openapi round trip",
        object["kind"], object["metadata"]["name"]
    );
    value
}

/// Nulls dropped and numbers compared as floats: k8s-openapi holds a schema's `minimum` as an f64, so `1` reads back
/// as `1.0`.
fn strip_nulls(value: Value) -> Value {
    match value {
        Value::Object(map) => Value::Object(
            map.into_iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| (k, strip_nulls(v)))
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.into_iter().map(strip_nulls).collect()),
        Value::Number(n) => json!(n.as_f64()),
        other => other,
    }
}

fn render(values: Value) -> Rendered {
    let (objects, crds) = render_raw(&values, true).unwrap_or_else(|e| panic!("the chart refused {values}: {e}"));
    let mut r = Rendered {
        crds: crds.iter().map(typed).collect(),
        ..Rendered::default()
    };
    for object in &objects {
        match object["kind"].as_str().expect("kind") {
            "DaemonSet" => r.daemon_sets.push(typed(object)),
            "Deployment" => r.deployments.push(typed(object)),
            "Service" => r.services.push(typed(object)),
            "ServiceAccount" => r.service_accounts.push(typed(object)),
            "ClusterRole" => r.cluster_roles.push(typed(object)),
            "ClusterRoleBinding" => r.cluster_role_bindings.push(typed(object)),
            "Role" => r.roles.push(typed(object)),
            "RoleBinding" => r.role_bindings.push(typed(object)),
            "PodDisruptionBudget" => r.pdbs.push(typed(object)),
            "PersistentVolumeClaim" => r.pvcs.push(typed(object)),
            "Secret" => r.secrets.push(typed(object)),
            "ConfigMap" => r.config_maps.push(typed(object)),
            "NetworkPolicy" => r.network_policies.push(typed(object)),
            "ValidatingWebhookConfiguration" => r.validating_webhooks.push(typed(object)),
            "ValidatingAdmissionPolicy" => r.admission_policies.push(typed(object)),
            "ValidatingAdmissionPolicyBinding" => r.admission_policy_bindings.push(typed(object)),
            "MutatingWebhookConfiguration" => r.mutating_webhooks.push(typed(object)),
            "MeshConfig" => r.mesh_configs.push(object.clone()),
            "GatewayClass" => r.gateway_classes.push(object.clone()),
            "HorizontalPodAutoscaler" => r.hpas.push(typed(object)),
            // cert-manager's kind: no k8s-openapi type; checked in `raw`.
            "Certificate" => {}
            other => panic!("unexpected kind {other} rendered: {object:#}"),
        }
    }
    r.raw = objects;
    r
}

/// Memory limits set by [`values`] per component, to check that `resources` values are applied.
const LIMITS: [(&str, &str); 5] = [
    ("aether-agent", "300Mi"),
    ("aether-proxy", "900Mi"),
    ("aether-mesh-dns", "80Mi"),
    ("aether-registrar", "700Mi"),
    ("aether-controller", "120Mi"),
];

fn values(store: &str, identity: &str) -> Value {
    let replicas = if store == "embedded" { 1 } else { 2 };
    let spire_bundle = if identity == "spire" { "spire-bundle" } else { "" };
    let limits = |name: &str| json!({"limits": {"memory": LIMITS.iter().find(|(n, _)| *n == name).unwrap().1}});
    json!({
        "agent": {"resources": limits("aether-agent")},
        "proxy": {"resources": limits("aether-proxy")},
        "meshDns": {"resources": limits("aether-mesh-dns")},
        "identity": {"provider": identity},
        "otel": {"enabled": true, "endpoint": "http://otel-collector.observability:4317"},
        "controller": {"resources": limits("aether-controller")},
        "registrar": {
            "resources": limits("aether-registrar"),
            "replicas": replicas,
            // SPIRE's trust bundle, which verifies agents' SVIDs (identity=spire); unused otherwise.
            "clientCa": {"configMapName": spire_bundle, "key": "bundle.crt"},
            "store": {
                "type": store,
                "etcd": {"endpoints": ["https://etcd-0.etcd:2379", "https://etcd-1.etcd:2379"],
                         "credentialsSecretName": "etcd-creds", "tlsSecretName": "etcd-tls"},
                "dynamodb": {"endpointUrl": "http://dynamodb.local:8000", "credentialsSecretName": "aws-creds"}
            }
        }
    })
}

impl Rendered {
    fn daemon_set(&self, name: &str) -> &DaemonSet {
        self.daemon_sets
            .iter()
            .find(|d| d.metadata.name.as_deref() == Some(name))
            .unwrap_or_else(|| panic!("no DaemonSet {name}"))
    }

    fn secret(&self, name: &str) -> Option<&Secret> {
        self.secrets.iter().find(|s| s.metadata.name.as_deref() == Some(name))
    }

    fn config_map(&self, name: &str) -> Option<&ConfigMap> {
        self.config_maps
            .iter()
            .find(|c| c.metadata.name.as_deref() == Some(name))
    }

    fn registrar(&self) -> &Deployment {
        self.deployment("aether-registrar")
    }

    fn deployment(&self, name: &str) -> &Deployment {
        self.deployments
            .iter()
            .find(|d| d.metadata.name.as_deref() == Some(name))
            .unwrap_or_else(|| panic!("no Deployment {name}"))
    }

    fn pod_specs(&self) -> Vec<(&str, &PodSpec)> {
        let ds = self.daemon_sets.iter().map(|d| {
            (
                d.metadata.name.as_deref().unwrap(),
                d.spec.as_ref().unwrap().template.spec.as_ref().unwrap(),
            )
        });
        let deploy = self.deployments.iter().map(|d| {
            (
                d.metadata.name.as_deref().unwrap(),
                d.spec.as_ref().unwrap().template.spec.as_ref().unwrap(),
            )
        });
        ds.chain(deploy).collect()
    }
}

fn containers(spec: &PodSpec) -> impl Iterator<Item = &Container> {
    spec.init_containers.iter().flatten().chain(spec.containers.iter())
}

fn added_caps(c: &Container) -> BTreeSet<String> {
    c.security_context
        .as_ref()
        .and_then(|s| s.capabilities.as_ref())
        .and_then(|caps| caps.add.clone())
        .unwrap_or_default()
        .into_iter()
        .collect()
}

fn arg<'a>(c: &'a Container, flag: &str) -> Option<&'a str> {
    let prefix = format!("{flag}=");
    c.args.iter().flatten().find_map(|a| a.strip_prefix(prefix.as_str()))
}

fn assert_invariants(r: &Rendered, store: &str, identity: &str, otel: bool) {
    let ctx = format!("store={store} identity={identity} otel={otel}");
    assert_every_container_is_locked_down(r, &ctx);
    assert_the_agent_runs_on_the_host_with_two_capabilities(r, identity, &ctx);
    assert_the_proxy_rolls_with_a_surge_under_its_supervisor(r, &ctx);
    assert_mesh_dns_is_unprivileged_and_never_cold(r, &ctx);
    assert_the_registrar_scales_and_gets_credentials_by_secret(r, store, &ctx);
    let services: Vec<_> = r.services.iter().map(|s| s.metadata.name.as_deref().unwrap()).collect();
    assert_eq!(
        services,
        ["aether-controller", "aether-registrar"],
        "{ctx}: the Services"
    );
    assert_the_controller_serves_the_webhooks(r, &ctx);
    assert_cluster_roles_are_read_only_and_minimal(r, store, identity, &ctx);
    let agent_role = assert_the_agent_role_reads_only_its_daemon_set(r, &ctx);
    assert_only_the_kubernetes_store_writes_its_vip_config_map(r, store, agent_role, &ctx);
    assert_only_api_clients_mount_a_token(r, &ctx);
    assert_otel_flags_reach_every_binary(r, otel, &ctx);
    assert_wiring(r, &ctx);
    assert_control_plane_tls(r, identity, &ctx);
}

/// Every container: no privilege, nothing but the named capabilities, a memory limit, a read-only root.
fn assert_every_container_is_locked_down(r: &Rendered, ctx: &str) {
    for (pod, spec) in r.pod_specs() {
        for c in containers(spec) {
            let sc = c
                .security_context
                .as_ref()
                .unwrap_or_else(|| panic!("{pod}/{}: no securityContext", c.name));
            assert_ne!(sc.privileged, Some(true), "{ctx}: {pod}/{} is privileged", c.name);
            assert_eq!(sc.allow_privilege_escalation, Some(false), "{ctx}: {pod}/{}", c.name);
            assert_eq!(sc.read_only_root_filesystem, Some(true), "{ctx}: {pod}/{}", c.name);
            let drop = sc
                .capabilities
                .as_ref()
                .and_then(|caps| caps.drop.clone())
                .unwrap_or_default();
            assert_eq!(drop, vec!["ALL".to_owned()], "{ctx}: {pod}/{} must drop ALL", c.name);
            let limits = c.resources.as_ref().and_then(|r| r.limits.as_ref());
            assert!(
                limits.is_some_and(|l| l.contains_key("memory")),
                "{ctx}: {pod}/{} has no memory limit",
                c.name
            );
        }
    }
}

/// The agent: host network, readiness gated on its admin /ready, the CNI installer as a native sidecar, and
/// only NET_ADMIN + SYS_ADMIN (nftables and setns into pod netns).
fn assert_the_agent_runs_on_the_host_with_two_capabilities(r: &Rendered, identity: &str, ctx: &str) {
    let agent = r.daemon_set("aether-agent");
    let spec = agent.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    assert_eq!(spec.host_network, Some(true), "{ctx}: agent hostNetwork");
    let install = &spec.init_containers.as_ref().expect("init containers")[0];
    assert_eq!(install.name, "cni-install");
    assert_eq!(
        install.restart_policy.as_deref(),
        Some("Always"),
        "{ctx}: cni-install keeps watching"
    );
    assert!(
        added_caps(install).is_empty(),
        "{ctx}: cni-install needs no capabilities"
    );
    let agent_c = &spec.containers[0];
    assert_eq!(
        added_caps(agent_c),
        BTreeSet::from(["NET_ADMIN".to_owned(), "SYS_ADMIN".to_owned()]),
        "{ctx}"
    );
    let probe = agent_c
        .readiness_probe
        .as_ref()
        .and_then(|p| p.http_get.as_ref())
        .expect("agent readiness");
    assert_eq!(probe.path.as_deref(), Some("/ready"));
    assert_eq!(
        probe.host.as_deref(),
        Some("127.0.0.1"),
        "{ctx}: the admin server is loopback-only"
    );
    assert_eq!(arg(agent_c, "--identity"), Some(identity), "{ctx}");
    match identity {
        "builtin" => {
            assert!(arg(agent_c, "--ca-key").is_some(), "{ctx}: builtin needs the CA key");
            let ca = spec
                .volumes
                .iter()
                .flatten()
                .find(|v| v.name == "ca")
                .expect("ca volume");
            assert_eq!(
                ca.secret.as_ref().and_then(|s| s.default_mode),
                Some(0o400),
                "{ctx}: CA key 0400"
            );
        }
        _ => assert!(arg(agent_c, "--spire-admin-socket").is_some(), "{ctx}"),
    }
    // mTLS, never plaintext (the wiring of certificates and trust: assert_control_plane_tls).
    assert_eq!(
        arg(agent_c, "--registrar"),
        Some("https://aether-registrar.aether-system.svc:18090"),
        "{ctx}"
    );
}

/// The proxy: surge rollout for hot-restart handoff, the supervisor as PID 1, Envoy admin on loopback.
fn assert_the_proxy_rolls_with_a_surge_under_its_supervisor(r: &Rendered, ctx: &str) {
    let proxy = r.daemon_set("aether-proxy");
    let strategy = proxy.spec.as_ref().unwrap().update_strategy.as_ref().unwrap();
    let rolling = strategy.rolling_update.as_ref().expect("rollingUpdate");
    assert_eq!(strategy.type_.as_deref(), Some("RollingUpdate"));
    assert_eq!(
        format!("{:?}", rolling.max_surge),
        "Some(Int(1))",
        "{ctx}: proxy maxSurge 1"
    );
    assert_eq!(
        format!("{:?}", rolling.max_unavailable),
        "Some(Int(0))",
        "{ctx}: proxy maxUnavailable 0"
    );
    let pspec = proxy.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    assert_eq!(pspec.host_network, Some(true));
    assert_eq!(
        pspec.automount_service_account_token,
        Some(false),
        "{ctx}: the proxy never talks to the API"
    );
    let supervisor = &pspec.containers[0];
    assert_eq!(supervisor.command.as_deref(), Some(&["aether-agent".to_owned()][..]));
    assert_eq!(supervisor.args.as_ref().unwrap()[0], "proxy");
    assert!(
        arg(supervisor, "--envoy-admin").is_some_and(|a| a.starts_with("127.0.0.1:")),
        "{ctx}: Envoy admin must stay on loopback"
    );
    assert!(
        pspec.termination_grace_period_seconds.unwrap_or(30) > 25,
        "{ctx}: grace period covers drain + parent shutdown"
    );
}

/// mesh-dns: its own DaemonSet, non-root, no capabilities, surge roll (SO_REUSEPORT overlap).
fn assert_mesh_dns_is_unprivileged_and_never_cold(r: &Rendered, ctx: &str) {
    let dns = r.daemon_set("aether-mesh-dns");
    let dspec = dns.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    assert_eq!(
        dspec.security_context.as_ref().and_then(|s| s.run_as_non_root),
        Some(true)
    );
    assert!(added_caps(&dspec.containers[0]).is_empty());
    let dstrategy = dns.spec.as_ref().unwrap().update_strategy.as_ref().unwrap();
    let drolling = dstrategy.rolling_update.as_ref().unwrap();
    assert_eq!(
        format!("{:?}", drolling.max_unavailable),
        "Some(Int(0))",
        "{ctx}: DNS never goes cold"
    );
}

/// The registrar: replicas per store, the store flag, credentials only by Secret.
fn assert_the_registrar_scales_and_gets_credentials_by_secret(r: &Rendered, store: &str, ctx: &str) {
    let rspec = r.registrar().spec.as_ref().unwrap();
    let rc = &rspec.template.spec.as_ref().unwrap().containers[0];
    assert_eq!(arg(rc, "--store"), Some(store), "{ctx}");
    let want_replicas = if store == "embedded" { 1 } else { 2 };
    assert_eq!(rspec.replicas, Some(want_replicas), "{ctx}");
    let registrar_pdbs = r
        .pdbs
        .iter()
        .filter(|p| p.metadata.name.as_deref() == Some("aether-registrar"));
    assert_eq!(
        registrar_pdbs.count(),
        usize::from(want_replicas > 1),
        "{ctx}: a PDB with active/active replicas"
    );
    assert_eq!(
        r.pvcs.len(),
        usize::from(store == "embedded"),
        "{ctx}: a volume only for the embedded store"
    );
    for env in rc.env.iter().flatten() {
        assert!(
            !env.name.contains("SECRET") || env.value_from.is_some(),
            "{ctx}: {} must come from a Secret, not a literal",
            env.name
        );
    }
    let credentials = rc
        .env_from
        .iter()
        .flatten()
        .filter_map(|f| f.secret_ref.as_ref())
        .map(|s| s.name.as_str());
    let want: &[&str] = match store {
        "dynamodb" => &["aws-creds"],
        "etcd" => &["etcd-creds"],
        _ => &[],
    };
    assert_eq!(
        credentials.collect::<Vec<_>>(),
        want,
        "{ctx}: store credentials by Secret"
    );
    if store == "etcd" {
        assert_etcd_tls_is_a_group_readable_secret_volume(rspec.template.spec.as_ref().unwrap(), rc, ctx);
    }
}

/// TLS material from a Secret volume readable by the registrar's group only, at the paths the flags name.
fn assert_etcd_tls_is_a_group_readable_secret_volume(rspec: &PodSpec, rc: &Container, ctx: &str) {
    let volume = rspec
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == "etcd-tls")
        .expect("etcd-tls volume");
    let secret = volume.secret.as_ref().expect("a Secret volume");
    assert_eq!(secret.secret_name.as_deref(), Some("etcd-tls"), "{ctx}");
    assert_eq!(secret.default_mode, Some(0o440), "{ctx}");
    let mount = rc
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.name == "etcd-tls")
        .expect("etcd-tls mount");
    for (flag_name, file) in [
        ("--etcd-ca-file", "ca.crt"),
        ("--etcd-cert-file", "tls.crt"),
        ("--etcd-key-file", "tls.key"),
    ] {
        assert_eq!(
            arg(rc, flag_name),
            Some(format!("{}/{file}", mount.mount_path).as_str()),
            "{ctx}"
        );
    }
}

/// RBAC: read-only, only what each component reads, never Secrets. The exceptions are the registrar's
/// TokenReview `create` (it reads and changes nothing), checked in assert_control_plane_tls, and its writes of
/// route, policy and HTTP filter status (never of the objects), checked in assert_the_registrar_writes_only_route_status
/// and assert_the_registrar_watches_and_writes_only_status.
fn assert_cluster_roles_are_read_only_and_minimal(r: &Rendered, store: &str, identity: &str, ctx: &str) {
    for role in &r.cluster_roles {
        for rule in role.rules.iter().flatten() {
            if is_token_review_rule(rule) || is_route_status_rule(rule) || is_status_rule(rule) {
                continue;
            }
            // The readiness taint, held to it by the admission policy (see its test): the agent reads and patches
            // its own Node, the controller lists Nodes and patches them.
            let taint_verbs = match role.metadata.name.as_deref() {
                Some("aether-agent") => Some(["get", "patch"]),
                Some("aether-controller") => Some(["list", "patch"]),
                _ => None,
            };
            if let Some(verbs) = taint_verbs.filter(|_| is_node_rule(rule)) {
                assert_eq!(rule.verbs, verbs, "{ctx}: {:?} on Nodes", role.metadata.name);
                continue;
            }
            let verbs: BTreeSet<&str> = rule.verbs.iter().map(String::as_str).collect();
            assert!(
                verbs.is_subset(&BTreeSet::from(["get", "list", "watch"])),
                "{ctx}: {:?} grants {verbs:?}",
                role.metadata.name
            );
            assert!(
                !rule.resources.iter().flatten().any(|res| res == "secrets"),
                "{ctx}: no Secret reads"
            );
        }
    }
    let role_names: BTreeSet<&str> = r
        .cluster_roles
        .iter()
        .filter_map(|c| c.metadata.name.as_deref())
        .collect();
    let mut want = BTreeSet::from(["aether-agent", "aether-controller"]);
    if identity == "builtin" {
        // The node bootstrap's TokenReviews (with SPIRE, agents present their SVIDs instead).
        want.insert("aether-registrar-tokenreview");
    }
    if store == "kubernetes" {
        want.insert("aether-registrar");
    }
    // Routes, Services and our own objects are read with every store (registrar.fromKubernetes is on by default).
    want.insert("aether-registrar-routing");
    want.extend(OBJECTS_WITH_STATUS.map(|(role, _, _)| role));
    assert_eq!(role_names, want, "{ctx}: ClusterRoles");
    assert_eq!(r.cluster_role_bindings.len(), want.len(), "{ctx}");
    assert_the_registrar_writes_only_route_status(r, store, ctx);
    for (name, group, resource) in OBJECTS_WITH_STATUS {
        assert_the_registrar_watches_and_writes_only_status(r, name, group, resource, ctx);
    }
}

/// The registrar's sources of our own objects: its ClusterRole, the API group and the resource.
const OBJECTS_WITH_STATUS: [(&str, &str, &str); 4] = [
    (
        "aether-registrar-authorization",
        authorization::GROUP,
        "authorizationpolicies",
    ),
    ("aether-registrar-http-filters", http_filter::GROUP, "httpfilters"),
    ("aether-registrar-mesh-configs", mesh_config::GROUP, "meshconfigs"),
    (
        "aether-registrar-external-services",
        external_service::GROUP,
        "externalservices",
    ),
];

/// The registrar's AuthorizationPolicy and HTTPFilter sources list and watch their objects in every namespace and
/// merge-patch their `/status` (the Accepted condition): no `get`, no `update`, no write of an object itself.
fn assert_the_registrar_watches_and_writes_only_status(
    r: &Rendered,
    name: &str,
    group: &str,
    resource: &str,
    ctx: &str,
) {
    let role = r
        .cluster_roles
        .iter()
        .find(|c| c.metadata.name.as_deref() == Some(name))
        .unwrap_or_else(|| panic!("{ctx}: no {name} ClusterRole"));
    let rules: Vec<(Vec<String>, Vec<String>, Vec<String>)> = role
        .rules
        .iter()
        .flatten()
        .map(|rule| {
            assert_eq!((&rule.resource_names, &rule.non_resource_urls), (&None, &None), "{ctx}");
            (
                rule.api_groups.clone().unwrap_or_default(),
                rule.resources.clone().unwrap_or_default(),
                rule.verbs.clone(),
            )
        })
        .collect();
    let strings = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    let group = strings(&[group]);
    let status = format!("{resource}/status");
    assert_eq!(
        rules,
        [
            (group.clone(), strings(&[resource]), strings(&["list", "watch"])),
            (group, strings(&[&status]), strings(&["patch"])),
        ],
        "{ctx}"
    );
    let binding = r
        .cluster_role_bindings
        .iter()
        .find(|b| b.role_ref.name == name)
        .unwrap_or_else(|| panic!("{ctx}: {name} is not bound"));
    let subjects: Vec<_> = binding
        .subjects
        .iter()
        .flatten()
        .map(|s| (s.kind.as_str(), s.name.as_str()))
        .collect();
    assert_eq!(subjects, [("ServiceAccount", "aether-registrar")], "{ctx}");
}

/// The registrar watches HTTPRoutes and GRPCRoutes and may write only their `/status`, and reads Services; with a
/// writable store it is told to read them (the kubernetes store always does).
fn assert_the_registrar_writes_only_route_status(r: &Rendered, store: &str, ctx: &str) {
    let role = r
        .cluster_roles
        .iter()
        .find(|c| c.metadata.name.as_deref() == Some("aether-registrar-routing"))
        .unwrap_or_else(|| panic!("{ctx}: no routing ClusterRole"));
    let rules: Vec<(Vec<String>, Vec<String>, Vec<String>)> = role
        .rules
        .iter()
        .flatten()
        .map(|rule| {
            let list = |v: &Option<Vec<String>>| v.clone().unwrap_or_default();
            (list(&rule.api_groups), list(&rule.resources), rule.verbs.clone())
        })
        .collect();
    let strings = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    let group = strings(&["gateway.networking.k8s.io"]);
    assert_eq!(
        rules,
        [
            (
                group.clone(),
                strings(&["httproutes", "grpcroutes", "tcproutes", "tlsroutes"]),
                strings(&["get", "list", "watch"])
            ),
            (
                group,
                strings(&[
                    "httproutes/status",
                    "grpcroutes/status",
                    "tcproutes/status",
                    "tlsroutes/status"
                ]),
                strings(&["patch", "update"])
            ),
            (
                strings(&[""]),
                strings(&["services"]),
                strings(&["get", "list", "watch"])
            ),
        ],
        "{ctx}"
    );
    let rc = container(pod_spec(r, "aether-registrar"), "registrar");
    let flagged = rc.args.iter().flatten().any(|a| a == "--from-kubernetes");
    assert_eq!(flagged, store != "kubernetes", "{ctx}: --from-kubernetes");
}

/// The agent's CNI installer reads its own DaemonSet (uninstall or rollout?), by name, nothing else.
fn assert_the_agent_role_reads_only_its_daemon_set<'a>(r: &'a Rendered, ctx: &str) -> &'a Role {
    let agent_role = r
        .roles
        .iter()
        .find(|role| role.metadata.name.as_deref() == Some("aether-agent"))
        .unwrap_or_else(|| panic!("{ctx}: no Role for the agent"));
    let rules = agent_role.rules.as_deref().unwrap_or_default();
    assert_eq!(rules.len(), 1, "{ctx}");
    assert_eq!(
        rules[0].resources.as_deref(),
        Some(&["daemonsets".to_owned()][..]),
        "{ctx}"
    );
    assert_eq!(
        rules[0].resource_names.as_deref(),
        Some(&["aether-agent".to_owned()][..]),
        "{ctx}"
    );
    assert_eq!(rules[0].verbs, ["get"], "{ctx}");
    let install = container(pod_spec(r, "aether-agent"), "cni-install");
    assert_eq!(
        arg(install, "--owner-daemonset"),
        Some("aether-system/aether-agent"),
        "{ctx}: the installer names its own DaemonSet"
    );
    agent_role
}

/// A rule's resources, verbs and resource names.
type RuleShape = (Vec<String>, Vec<String>, Option<Vec<String>>);

/// The controller's Role: its Lease (`create`, and `get`/`update` on its name only) and listing the agents' pods.
fn assert_the_controller_role_holds_its_lease_only<'a>(r: &'a Rendered, ctx: &str) -> &'a Role {
    let role = r
        .roles
        .iter()
        .find(|role| role.metadata.name.as_deref() == Some("aether-controller"))
        .unwrap_or_else(|| panic!("{ctx}: the controller's Role"));
    let rules: Vec<RuleShape> = role
        .rules
        .iter()
        .flatten()
        .map(|rule| {
            (
                rule.resources.clone().unwrap_or_default(),
                rule.verbs.clone(),
                rule.resource_names.clone(),
            )
        })
        .collect();
    let strings = |items: &[&str]| items.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let want = vec![
        (strings(&["leases"]), strings(&["create"]), None),
        (
            strings(&["leases"]),
            strings(&["get", "update"]),
            Some(strings(&["aether-controller"])),
        ),
        (strings(&["pods"]), strings(&["list"]), None),
    ];
    assert_eq!(rules, want, "{ctx}: the controller's Role");
    role
}

/// The controller's other Role: reading the mesh-wide MeshConfig (`default` in the mesh root namespace), nothing else.
fn assert_the_controller_reads_the_mesh_wide_mesh_config_only<'a>(r: &'a Rendered, ctx: &str) -> &'a Role {
    let role = r
        .roles
        .iter()
        .find(|role| role.metadata.name.as_deref() == Some("aether-controller-mesh-config"))
        .unwrap_or_else(|| panic!("{ctx}: the controller's MeshConfig Role"));
    assert_eq!(
        role.metadata.namespace.as_deref(),
        Some("aether-system"),
        "{ctx}: the mesh root namespace"
    );
    let rules = role.rules.as_deref().unwrap_or_default();
    let strings = |items: &[&str]| items.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let groups: Vec<_> = rules.iter().map(|rule| rule.api_groups.clone()).collect();
    assert_eq!(
        groups,
        [Some(strings(&["mesh.aether.io"]))],
        "{ctx}: the controller's MeshConfig Role"
    );
    let rules: Vec<RuleShape> = (rules.iter())
        .map(|rule| {
            (
                rule.resources.clone().unwrap_or_default(),
                rule.verbs.clone(),
                rule.resource_names.clone(),
            )
        })
        .collect();
    let want: RuleShape = (
        strings(&["meshconfigs"]),
        strings(&["get", "list", "watch"]),
        Some(strings(&["default"])),
    );
    assert_eq!(rules, [want], "{ctx}: the controller's MeshConfig Role");
    let controller = container(pod_spec(r, "aether-controller"), "controller");
    assert!(has_flag(controller, "--follow-mesh-config"), "{ctx}");
    role
}

/// The Kubernetes store keeps its VIPs in one ConfigMap: the only namespaced write anywhere in the chart besides the
/// controller's Lease, and every verb but `create` (which cannot be scoped by name) is limited to that ConfigMap.
fn assert_only_the_kubernetes_store_writes_its_vip_config_map(r: &Rendered, store: &str, agent_role: &Role, ctx: &str) {
    let controller_roles = [
        assert_the_controller_role_holds_its_lease_only(r, ctx),
        assert_the_controller_reads_the_mesh_wide_mesh_config_only(r, ctx),
    ];
    let others = |role: &&Role| {
        !std::ptr::eq(*role, agent_role) && !controller_roles.iter().any(|mine| std::ptr::eq(*role, *mine))
    };
    let registrar_roles: Vec<&Role> = r.roles.iter().filter(others).collect();
    if store != "kubernetes" {
        assert!(
            registrar_roles.is_empty() && r.role_bindings.len() == 3,
            "{ctx}: no registrar Role without the Kubernetes store"
        );
        return;
    }
    assert_eq!(registrar_roles.len(), 1, "{ctx}: the registrar's VIP ConfigMap Role");
    assert_eq!(r.role_bindings.len(), 4, "{ctx}");
    let rc = container(pod_spec(r, "aether-registrar"), "registrar");
    let vip_map = format!("{}/aether-registrar-vips", "aether-system");
    assert_eq!(arg(rc, "--kube-vip-configmap"), Some(vip_map.as_str()), "{ctx}");
    for rule in registrar_roles[0].rules.iter().flatten() {
        assert_eq!(rule.resources.as_deref(), Some(&["configmaps".to_owned()][..]), "{ctx}");
        if rule.verbs != ["create"] {
            assert_eq!(
                rule.resource_names.as_deref(),
                Some(&["aether-registrar-vips".to_owned()][..]),
                "{ctx}: {:?} must be limited to the VIP ConfigMap",
                rule.verbs
            );
        }
    }
}

/// The registrar reviews agents' tokens (the bootstrap), reads Pods with the Kubernetes store, and routes with any
/// store; no one else but the agent talks to the API.
fn assert_only_api_clients_mount_a_token(r: &Rendered, ctx: &str) {
    for sa in &r.service_accounts {
        let name = sa.metadata.name.as_deref().unwrap();
        // The registrar reviews tokens (builtin identity), reads Pods (kubernetes store), and reads routes and
        // Services with every store (registrar.fromKubernetes is on by default): it always talks to the API.
        // The controller: its Lease and the Nodes' readiness taint (controller.nodeTaints, on by default), and the
        // mesh-wide MeshConfig (controller.followMeshConfig, on by default).
        let talks_to_api = ["aether-agent", "aether-registrar", "aether-controller"].contains(&name);
        assert_eq!(
            sa.automount_service_account_token,
            Some(talks_to_api),
            "{ctx}: {name} token"
        );
    }
}

/// OpenTelemetry flags reach every binary (when on).
fn assert_otel_flags_reach_every_binary(r: &Rendered, otel: bool, ctx: &str) {
    for (pod, spec) in r.pod_specs() {
        for c in spec.containers.iter() {
            let want = otel.then_some("http://otel-collector.observability:4317");
            assert_eq!(arg(c, "--otlp-endpoint"), want, "{ctx}: {pod}/{}", c.name);
            assert_eq!(has_flag(c, "--otel-enabled"), otel, "{ctx}: {pod}/{}", c.name);
        }
    }
}

fn has_flag(c: &Container, flag: &str) -> bool {
    c.args.iter().flatten().any(|a| a == flag)
}

fn pod_spec<'a>(r: &'a Rendered, name: &str) -> &'a PodSpec {
    r.pod_specs()
        .into_iter()
        .find(|(n, _)| *n == name)
        .unwrap_or_else(|| panic!("no workload {name}"))
        .1
}

fn container<'a>(spec: &'a PodSpec, name: &str) -> &'a Container {
    containers(spec)
        .find(|c| c.name == name)
        .unwrap_or_else(|| panic!("no container {name}"))
}

fn flag<'a>(c: &'a Container, name: &str) -> &'a str {
    arg(c, name).unwrap_or_else(|| panic!("{}: no {name} in {:?}", c.name, c.args))
}

/// The host directory `path` lives in, if `c` mounts it from a hostPath volume of `spec`.
fn host_path_of(spec: &PodSpec, c: &Container, path: &str) -> Option<String> {
    let mount = c
        .volume_mounts
        .iter()
        .flatten()
        .filter(|m| path.starts_with(&format!("{}/", m.mount_path)) || path == m.mount_path)
        .max_by_key(|m| m.mount_path.len())?;
    let volume = spec.volumes.iter().flatten().find(|v| v.name == mount.name)?;
    let host = &volume.host_path.as_ref()?.path;
    Some(format!("{host}{}", &path[mount.mount_path.len()..]))
}

/// A path in `c`'s own pod-local (emptyDir) volume.
fn in_empty_dir(spec: &PodSpec, c: &Container, path: &str) -> bool {
    c.volume_mounts.iter().flatten().any(|m| {
        path.starts_with(&format!("{}/", m.mount_path))
            && spec
                .volumes
                .iter()
                .flatten()
                .any(|v| v.name == m.name && v.empty_dir.is_some())
    })
}

/// The components find each other through host paths and node ports: every pair must agree, and every path must be
/// on a hostPath volume both sides mount.
/// The controller: spread replicas under a disruption budget, its generated certificate (for the Service name
/// kube-apiserver dials) behind a Service on 443, called by both webhook configurations with the CA that signed it;
/// our CRDs fail closed, pods and routes open; pods mutated only in namespaces labelled aether.io/mesh=enabled, on
/// CREATE; managed pods' annotations validated; short timeouts; no side effects.
fn assert_the_controller_serves_the_webhooks(r: &Rendered, ctx: &str) {
    let spec = r.deployment("aether-controller").spec.as_ref().unwrap();
    assert_eq!(spec.replicas, Some(2), "{ctx}");
    assert!(
        r.pdbs
            .iter()
            .any(|p| p.metadata.name.as_deref() == Some("aether-controller")),
        "{ctx}: the controller's PDB"
    );
    let pod = spec.template.spec.as_ref().unwrap();
    let c = container(pod, "controller");
    let registrar = &pod_spec(r, "aether-registrar").containers[0];
    assert_eq!(
        arg(c, "--mesh-root-namespace"),
        arg(registrar, "--mesh-root-namespace"),
        "{ctx}: root namespace"
    );
    let cert = secret_file(pod, c, flag(c, "--tls-cert"), ctx);
    let serving_pem = secret_text(r, &cert.secret, &cert.key, ctx);
    let der = CertificateDer::from_pem_slice(serving_pem.as_bytes()).unwrap();
    let host = "aether-controller.aether-system.svc".to_owned();
    let names = PeerIdentity::from_leaf(&der).unwrap().dns_names;
    assert!(
        names.contains(&host),
        "{ctx}: the controller's certificate lacks {host}: {names:?}"
    );
    let ca = secret_text(r, &cert.secret, "ca.crt", ctx);
    assert_the_webhooks_call_the_controller(r, &ca, ctx);
}

/// Both webhook configurations call the controller's Service with `ca` as caBundle; failure policies, paths and the
/// mutating webhook's selection as the chart documents them.
fn assert_the_webhooks_call_the_controller(r: &Rendered, ca: &str, ctx: &str) {
    let [validating] = &r.validating_webhooks[..] else {
        panic!("{ctx}: one ValidatingWebhookConfiguration")
    };
    let [mutating] = &r.mutating_webhooks[..] else {
        panic!("{ctx}: one MutatingWebhookConfiguration")
    };
    let configs = validating
        .webhooks
        .iter()
        .flatten()
        .map(|w| (&w.client_config, w.timeout_seconds, &w.side_effects));
    let configs = configs.chain(
        mutating
            .webhooks
            .iter()
            .flatten()
            .map(|w| (&w.client_config, w.timeout_seconds, &w.side_effects)),
    );
    for (client, timeout, side_effects) in configs {
        let service = client.service.as_ref().expect("a Service reference");
        assert_eq!(
            (service.name.as_str(), service.port),
            ("aether-controller", Some(443)),
            "{ctx}"
        );
        let bundle = client.ca_bundle.as_ref().expect("a caBundle");
        assert_eq!(
            String::from_utf8_lossy(&bundle.0),
            ca,
            "{ctx}: caBundle is the serving certificate's CA"
        );
        assert!(timeout.is_some_and(|t| t <= 5), "{ctx}: short timeouts");
        assert_eq!(side_effects, "None", "{ctx}");
    }
    let policies: Vec<(&str, &str, &str)> = validating
        .webhooks
        .iter()
        .flatten()
        .map(|w| {
            let path = w.client_config.service.as_ref().unwrap().path.as_deref().unwrap();
            (w.name.as_str(), w.failure_policy.as_deref().unwrap(), path)
        })
        .collect();
    let want = [
        ("objects.validate.aether.io", "Fail", "/validate"),
        ("routes.validate.aether.io", "Ignore", "/validate"),
        ("pods.validate.aether.io", "Ignore", "/validate"),
    ];
    assert_eq!(policies, want, "{ctx}: our CRDs fail closed, pods and routes open");
    assert_the_objects_webhook_covers_our_crds(r, validating, ctx);
    let [mutate] = &mutating.webhooks.as_deref().unwrap() else {
        panic!("{ctx}: one mutating webhook")
    };
    let path = mutate.client_config.service.as_ref().unwrap().path.as_deref();
    assert_eq!(
        (mutate.failure_policy.as_deref(), path),
        (Some("Ignore"), Some("/mutate/pods")),
        "{ctx}"
    );
    let selector = mutate
        .namespace_selector
        .as_ref()
        .and_then(|s| s.match_labels.clone())
        .unwrap_or_default();
    assert_eq!(
        selector.get("aether.io/mesh").map(String::as_str),
        Some("enabled"),
        "{ctx}"
    );
    let operations = mutate
        .rules
        .iter()
        .flatten()
        .flat_map(|r| r.operations.iter().flatten())
        .collect::<Vec<_>>();
    assert_eq!(operations, ["CREATE"], "{ctx}");
}

/// Every kind of ours the chart ships (its `crds/`) is validated on CREATE and UPDATE, and nothing else is.
fn assert_the_objects_webhook_covers_our_crds(r: &Rendered, validating: &ValidatingWebhookConfiguration, ctx: &str) {
    let objects = &validating.webhooks.as_deref().unwrap()[0];
    let validated: BTreeSet<(String, String)> = (objects.rules.iter().flatten())
        .flat_map(|rule| {
            let groups = rule.api_groups.clone().unwrap_or_default();
            let resources = rule.resources.clone().unwrap_or_default();
            assert_eq!(
                rule.operations.as_deref(),
                Some(&["CREATE".to_owned(), "UPDATE".to_owned()][..])
            );
            groups
                .into_iter()
                .flat_map(move |g| resources.clone().into_iter().map(move |r| (g.clone(), r)))
        })
        .collect();
    let shipped: BTreeSet<(String, String)> = (r.crds.iter())
        .map(|crd| (crd.spec.group.clone(), crd.spec.names.plural.clone()))
        .collect();
    assert_eq!(validated, shipped, "{ctx}: the objects webhook covers exactly our CRDs");
}

fn assert_wiring(r: &Rendered, ctx: &str) {
    let (agent_spec, proxy_spec, dns_spec, registrar_spec) = (
        pod_spec(r, "aether-agent"),
        pod_spec(r, "aether-proxy"),
        pod_spec(r, "aether-mesh-dns"),
        pod_spec(r, "aether-registrar"),
    );
    let agent = container(agent_spec, "agent");
    let install = container(agent_spec, "cni-install");
    let proxy = container(proxy_spec, "proxy");
    let dns = container(dns_spec, "mesh-dns");
    let registrar = &registrar_spec.containers[0];
    // Where a container's path is on the host (through its hostPath volumes).
    let host = |spec: &PodSpec, c: &Container, path: &str| {
        host_path_of(spec, c, path).unwrap_or_else(|| panic!("{ctx}: {}: {path} is not on a hostPath volume", c.name))
    };
    // Envoy's ADS: the agent serves the socket the supervisor bootstraps Envoy with.
    assert_eq!(
        host(agent_spec, agent, flag(agent, "--xds-socket")),
        host(proxy_spec, proxy, flag(proxy, "--xds-socket")),
        "{ctx}: xDS socket"
    );
    // The CNI plugin runs on the host (kubelet), with the host paths the installer wrote into its config: the
    // agent's socket, and pins under <state dir>/netns that the agent and the proxy (Envoy binds in pod netns) see.
    assert_eq!(
        host(agent_spec, agent, flag(agent, "--cni-socket")),
        flag(install, "--agent-socket"),
        "{ctx}: CNI socket"
    );
    // `aether status`/`check`, run in the agent container, read the conflist the installer keeps.
    let env = agent.env.iter().flatten().find(|e| e.name == "AETHER_CNI_CONF_DIR");
    let cli_dir = env.and_then(|e| e.value.as_deref()).expect("AETHER_CNI_CONF_DIR");
    assert_eq!(
        host(agent_spec, agent, cli_dir),
        host(agent_spec, install, flag(install, "--conf-dir")),
        "{ctx}: the CLI's CNI config dir"
    );
    let pins = format!("{}/netns", flag(install, "--state-dir"));
    assert_eq!(
        host(agent_spec, agent, flag(agent, "--netns-pin-dir")),
        pins,
        "{ctx}: netns pins"
    );
    assert_eq!(host(proxy_spec, proxy, &pins), pins, "{ctx}: the proxy sees the pins");
    // The agent writes mesh-dns's record file.
    let records = format!("{}/mesh-dns/records", flag(agent, "--state-dir"));
    assert_eq!(
        host(agent_spec, agent, &records),
        host(dns_spec, dns, flag(dns, "--records")),
        "{ctx}: mesh-dns records"
    );
    // Pods' DNS is DNAT'ed to where mesh-dns listens; Envoy's admin is where the agent reads request metrics.
    assert_eq!(
        flag(agent, "--mesh-dns"),
        flag(dns, "--listen"),
        "{ctx}: mesh-dns address"
    );
    assert_eq!(
        flag(agent, "--envoy-admin"),
        flag(proxy, "--envoy-admin"),
        "{ctx}: Envoy admin"
    );
    // One VIP range and one mesh domain everywhere.
    assert_eq!(
        flag(agent, "--mesh-vip-cidr"),
        flag(registrar, "--vip-cidr"),
        "{ctx}: VIP range"
    );
    assert_eq!(
        flag(agent, "--mesh-domain"),
        flag(dns, "--mesh-domain"),
        "{ctx}: mesh domain"
    );
    assert_eq!(
        flag(agent, "--registrar").rsplit(':').next(),
        flag(registrar, "--listen").rsplit(':').next()
    );
    assert_surge_rolled_pods_are_ready_by_a_pod_local_file(r, ctx);
}

/// Host-network pods rolled with a surge: readiness is a file in the pod's own volume, not the shared port.
fn assert_surge_rolled_pods_are_ready_by_a_pod_local_file(r: &Rendered, ctx: &str) {
    let (proxy_spec, dns_spec) = (pod_spec(r, "aether-proxy"), pod_spec(r, "aether-mesh-dns"));
    let (proxy, dns) = (container(proxy_spec, "proxy"), container(dns_spec, "mesh-dns"));
    for (spec, c) in [(proxy_spec, proxy), (dns_spec, dns)] {
        let ready = flag(c, "--ready-file");
        assert!(
            in_empty_dir(spec, c, ready),
            "{ctx}: {}: {ready} must be pod-local",
            c.name
        );
        let probe = c
            .readiness_probe
            .as_ref()
            .and_then(|p| p.exec.as_ref())
            .and_then(|e| e.command.clone());
        assert_eq!(
            probe,
            Some(vec!["test".to_owned(), "-e".to_owned(), ready.to_owned()]),
            "{ctx}: {}",
            c.name
        );
    }
    // mesh-dns forwards to the cluster DNS, where pods' queries went before capture.
    assert_eq!(dns_spec.dns_policy.as_deref(), Some("ClusterFirstWithHostNet"), "{ctx}");
}

/// The rule that lets the registrar ask the API server about a token: `create` on `tokenreviews`, nothing else.
/// `patch`/`update` of route status only: what the registrar writes on Gateway API routes.
fn is_route_status_rule(rule: &PolicyRule) -> bool {
    rule.api_groups.as_deref() == Some(&["gateway.networking.k8s.io".to_owned()][..])
        && rule.resources.iter().flatten().all(|r| r.ends_with("routes/status"))
        && rule.verbs.iter().all(|v| v == "patch" || v == "update")
}

/// `patch` of AuthorizationPolicy, HTTPFilter or MeshConfig status only: the registrar's Accepted condition.
fn is_status_rule(rule: &PolicyRule) -> bool {
    OBJECTS_WITH_STATUS.iter().any(|(_, group, resource)| {
        rule.api_groups.as_deref() == Some(&[(*group).to_owned()][..])
            && rule.resources.as_deref() == Some(&[format!("{resource}/status")][..])
            && rule.verbs == ["patch"]
    })
}

fn is_node_rule(rule: &PolicyRule) -> bool {
    rule.resources.as_deref() == Some(&["nodes".to_owned()][..])
}

/// The agent's and the controller's Node patches are held to the readiness taint: the agent on its own Node only,
/// the controller on any. The rendered policy's CEL, evaluated as kube-apiserver would: changing our taint passes;
/// another taint, another Node (for the agent), a label or cordoning is refused; the binding denies.
#[test]
fn only_the_readiness_taint_may_change_and_the_agent_only_on_its_own_node() {
    let r = render(json!({}));
    let [policy] = &r.admission_policies[..] else {
        panic!("one ValidatingAdmissionPolicy")
    };
    let [binding] = &r.admission_policy_bindings[..] else {
        panic!("one binding")
    };
    let spec = binding.spec.as_ref().unwrap();
    assert_eq!(spec.policy_name.as_deref(), policy.metadata.name.as_deref());
    assert_eq!(spec.validation_actions.as_deref(), Some(&["Deny".to_owned()][..]));
    let policy = policy.spec.as_ref().unwrap();
    assert_eq!(policy.failure_policy.as_deref(), Some("Fail"));
    let ours = json!({"key": "aether.io/agent-not-ready", "effect": "NoSchedule"});
    let gpu = json!({"key": "dedicated", "value": "gpu", "effect": "NoSchedule"});
    let node = |taints: Value, labels: Value, unschedulable: bool| json!({"metadata": {"name": "node-a", "labels": labels}, "spec": {"taints": taints, "unschedulable": unschedulable}});
    let old = node(json!([gpu, ours]), json!({"zone": "a"}), false);
    let agent = |on: &str| {
        json!({"username": "system:serviceaccount:aether-system:aether-agent",
               "extra": {"authentication.kubernetes.io/node-name": [on]}})
    };
    let verdict = |object: Value, user: Value| -> Vec<bool> {
        let request = json!({"userInfo": user});
        let matched = policy
            .match_conditions
            .iter()
            .flatten()
            .all(|c| cel_true(&c.expression, &object, &old, &request));
        assert!(matched, "the policy matches the agent's requests");
        let validations = policy.validations.iter().flatten();
        validations
            .map(|v| cel_true(&v.expression, &object, &old, &request))
            .collect()
    };
    let removed = node(json!([gpu]), json!({"zone": "a"}), false);
    assert_eq!(verdict(removed.clone(), agent("node-a")), [true, true, true]);
    assert_eq!(verdict(removed, agent("node-b")), [false, true, true], "another node");
    let other_gone = node(json!([ours]), json!({"zone": "a"}), false);
    assert_eq!(
        verdict(other_gone, agent("node-a")),
        [true, false, true],
        "another taint"
    );
    let relabelled = node(json!([gpu]), json!({"zone": "b"}), false);
    assert_eq!(verdict(relabelled, agent("node-a")), [true, true, false], "a label");
    let cordoned = node(json!([gpu]), json!({"zone": "a"}), true);
    assert_eq!(verdict(cordoned, agent("node-a")), [true, true, false], "cordoned");
    // The controller puts the taint back on any node (and may take it off), nothing else.
    let controller = json!({"username": "system:serviceaccount:aether-system:aether-controller", "extra": {}});
    let untainted = node(json!([gpu]), json!({"zone": "a"}), false);
    assert_eq!(
        verdict(
            node(json!([gpu, ours]), json!({"zone": "a"}), false),
            controller.clone()
        ),
        [true, true, true]
    );
    assert_eq!(verdict(untainted, controller.clone()), [true, true, true]);
    assert_eq!(
        verdict(node(json!([ours]), json!({"zone": "a"}), false), controller),
        [true, false, true]
    );
}

/// A CEL expression of the policy, with `object`, `oldObject` and `request` bound.
fn cel_true(expression: &str, object: &Value, old: &Value, request: &Value) -> bool {
    let program = cel::Program::compile(expression).unwrap_or_else(|e| panic!("{expression}: {e}"));
    let mut context = cel::Context::default();
    context.add_variable("object", object.clone()).unwrap();
    context.add_variable("oldObject", old.clone()).unwrap();
    context.add_variable("request", request.clone()).unwrap();
    match program.execute(&context) {
        Ok(cel::Value::Bool(b)) => b,
        other => panic!("{expression}: {other:?}"),
    }
}

fn is_token_review_rule(rule: &PolicyRule) -> bool {
    rule.api_groups.as_deref() == Some(&["authentication.k8s.io".to_owned()][..])
        && rule.resources.as_deref() == Some(&["tokenreviews".to_owned()][..])
        && rule.verbs == ["create"]
        && rule.resource_names.is_none()
        && rule.non_resource_urls.is_none()
}

/// The volume that provides `path` to `c` (the deepest mount holding it) and the file's path inside that volume.
fn volume_of<'a>(spec: &'a PodSpec, c: &Container, path: &str) -> Option<(&'a Volume, String)> {
    let mount = c
        .volume_mounts
        .iter()
        .flatten()
        .filter(|m| path.starts_with(&format!("{}/", m.mount_path)))
        .max_by_key(|m| m.mount_path.len())?;
    let volume = spec.volumes.iter().flatten().find(|v| v.name == mount.name)?;
    Some((volume, path[mount.mount_path.len() + 1..].to_owned()))
}

/// The key a Secret or ConfigMap volume shows as `file` (through its `items`, if it lists any).
fn key_of(items: Option<&[KeyToPath]>, file: &str) -> Option<String> {
    match items {
        Some(items) => items.iter().find(|i| i.path == file).map(|i| i.key.clone()),
        None => Some(file.to_owned()),
    }
}

/// A file from a Secret volume: the Secret, its key, the volume's mode.
#[derive(Debug, PartialEq)]
struct SecretFile {
    secret: String,
    key: String,
    mode: Option<i32>,
}

fn secret_file(spec: &PodSpec, c: &Container, path: &str, ctx: &str) -> SecretFile {
    let (volume, file) = volume_of(spec, c, path).unwrap_or_else(|| panic!("{ctx}: {}: nothing mounts {path}", c.name));
    let secret = volume
        .secret
        .as_ref()
        .unwrap_or_else(|| panic!("{ctx}: {}: {path} is not from a Secret volume", c.name));
    SecretFile {
        secret: secret.secret_name.clone().expect("secretName"),
        key: key_of(secret.items.as_deref(), &file).unwrap_or_else(|| panic!("{ctx}: {path}: no item {file}")),
        mode: secret.default_mode,
    }
}

/// The text of `key` in the rendered Secret `name`.
fn secret_text(r: &Rendered, name: &str, key: &str, ctx: &str) -> String {
    let secret = r
        .secret(name)
        .unwrap_or_else(|| panic!("{ctx}: the chart renders no Secret {name}"));
    let bytes = secret
        .data
        .as_ref()
        .and_then(|d| d.get(key))
        .unwrap_or_else(|| panic!("{ctx}: Secret {name} has no {key}"));
    String::from_utf8(bytes.0.clone()).expect("PEM text")
}

/// Every string in `value` (keys and values).
fn strings(value: &Value, out: &mut Vec<String>) {
    match value {
        Value::String(s) => out.push(s.clone()),
        Value::Array(items) => items.iter().for_each(|v| strings(v, out)),
        Value::Object(map) => {
            for (k, v) in map {
                out.push(k.clone());
                strings(v, out);
            }
        }
        _ => {}
    }
}

/// The two ends of the control plane in a rendering: the agent's and the registrar's pod and container.
struct Ends<'a> {
    r: &'a Rendered,
    agent_spec: &'a PodSpec,
    agent: &'a Container,
    registrar_spec: &'a PodSpec,
    registrar: &'a Container,
    ctx: &'a str,
}

/// The registrar's gRPC port is mTLS only, and the chart wires both ends by default: the registrar's serving
/// certificate from a Secret it generates (group-readable only) and the agent's trust in it from a ConfigMap holding
/// the CA alone. The agent's node certificate comes from the bootstrap (the default): the node CA in a second
/// generated Secret, the agent's proof of node (a projected, audience-bound token) and the registrar's right to
/// check it (TokenReview, nothing more). With `identity=spire` the agent presents its SPIRE SVID instead, which the
/// registrar verifies with SPIRE's bundle, and none of the bootstrap is rendered. Nothing plaintext is rendered.
fn assert_control_plane_tls(r: &Rendered, identity: &str, ctx: &str) {
    let (agent_spec, registrar_spec) = (pod_spec(r, "aether-agent"), pod_spec(r, "aether-registrar"));
    let ends = Ends {
        r,
        agent_spec,
        agent: container(agent_spec, "agent"),
        registrar_spec,
        registrar: container(registrar_spec, "registrar"),
        ctx,
    };
    let host = assert_nothing_plaintext(&ends);
    // The registrar's serving certificate names what agents check.
    let (serving_pem, _, serving_secret) = ends.tls_pair("--tls-cert", "--tls-key");
    let serving_der = CertificateDer::from_pem_slice(serving_pem.as_bytes())
        .unwrap_or_else(|e| panic!("{ctx}: the registrar's certificate: {e}"));
    let names = PeerIdentity::from_leaf(&serving_der).unwrap().dns_names;
    assert!(
        names.contains(&host),
        "{ctx}: the registrar's certificate lacks {host}: {names:?}"
    );
    assert_agents_trust_the_registrar_ca_and_no_key_leaves_it(&ends, &serving_secret);
    assert_eq!(
        arg(ends.registrar, "--trust-domain"),
        arg(ends.agent, "--trust-domain"),
        "{ctx}: one trust domain"
    );
    let roles = assert_registrar_cluster_roles_read_or_review(&ends);
    let reviews_anywhere = r
        .cluster_roles
        .iter()
        .flat_map(|c| c.rules.iter().flatten())
        .filter(|rule| rule.resources.iter().flatten().any(|res| res == "tokenreviews"))
        .count();
    if identity == "spire" {
        assert_spire_svids_replace_the_bootstrap(&ends, reviews_anywhere);
        return;
    }
    // The node CA: a second generated Secret, which loads as the registrar loads it (an issuer).
    let (node_ca_pem, node_ca_key, node_ca_secret) = ends.tls_pair("--node-ca-cert", "--node-ca-key");
    assert_ne!(
        node_ca_secret, serving_secret,
        "{ctx}: the node CA is not the serving certificate"
    );
    let node_ca_key = rcgen::KeyPair::from_pem(&node_ca_key).unwrap_or_else(|e| panic!("{ctx}: the node CA key: {e}"));
    rcgen::Issuer::from_ca_cert_pem(&node_ca_pem, node_ca_key).unwrap_or_else(|e| panic!("{ctx}: the node CA: {e}"));
    assert_the_agent_proves_its_node_with_a_projected_token(&ends);
    assert_the_registrar_may_only_review_tokens(&ends, &roles, reviews_anywhere);
}

/// No plaintext registrar and no --insecure, in any string of any object, and a Service with the TLS port alone;
/// the registrar's host as agents name it.
fn assert_nothing_plaintext(ends: &Ends) -> String {
    let ctx = ends.ctx;
    let mut all = Vec::new();
    ends.r.raw.iter().for_each(|o| strings(o, &mut all));
    for s in &all {
        assert!(
            !s.contains("http://aether-registrar"),
            "{ctx}: plaintext registrar URL in {s:?}"
        );
        assert!(!s.contains("--insecure"), "{ctx}: {s:?}");
        assert!(!s.contains("AETHER_REGISTRAR_INSECURE"), "{ctx}: {s:?}");
    }
    let url = flag(ends.agent, "--registrar");
    let host = url
        .strip_prefix("https://")
        .and_then(|rest| rest.rsplit_once(':'))
        .map(|(host, _)| host)
        .unwrap_or_else(|| panic!("{ctx}: --registrar {url} is not https://host:port"));
    assert_eq!(host, "aether-registrar.aether-system.svc", "{ctx}");
    // The Service exposes the (TLS) gRPC port alone: no second, plaintext port.
    let registrar = ends
        .r
        .services
        .iter()
        .find(|s| s.metadata.name.as_deref() == Some("aether-registrar"));
    let ports: Vec<i32> = registrar
        .expect("the registrar's Service")
        .spec
        .as_ref()
        .and_then(|s| s.ports.as_ref())
        .into_iter()
        .flatten()
        .map(|p| p.port)
        .collect();
    assert_eq!(ports, [18090], "{ctx}: the registrar Service");
    host.to_owned()
}

impl Ends<'_> {
    /// A certificate + key pair from one mounted Secret the chart generated, 0440 (the registrar's group): the
    /// certificate's and the key's text, and the Secret's name.
    fn tls_pair(&self, cert_flag: &str, key_flag: &str) -> (String, String, String) {
        let (r, ctx) = (self.r, self.ctx);
        let cert = secret_file(
            self.registrar_spec,
            self.registrar,
            flag(self.registrar, cert_flag),
            ctx,
        );
        let key = secret_file(self.registrar_spec, self.registrar, flag(self.registrar, key_flag), ctx);
        assert_eq!(
            cert.secret, key.secret,
            "{ctx}: {cert_flag} and {key_flag} from one Secret"
        );
        for file in [&cert, &key] {
            assert_eq!(
                file.mode,
                Some(0o440),
                "{ctx}: {} readable by the registrar's group only",
                file.secret
            );
            let secret = r
                .secret(&file.secret)
                .unwrap_or_else(|| panic!("{ctx}: {} is not rendered", file.secret));
            assert_eq!(secret.type_.as_deref(), Some("kubernetes.io/tls"), "{ctx}");
        }
        assert!(
            secret_text(r, &key.secret, &key.key, ctx).contains("PRIVATE KEY"),
            "{ctx}: {key_flag}"
        );
        (
            secret_text(r, &cert.secret, &cert.key, ctx),
            secret_text(r, &key.secret, &key.key, ctx),
            cert.secret,
        )
    }
}

/// The agent trusts the CA that signed the registrar's certificate, from a ConfigMap: no key reaches it, and only
/// the registrar mounts the chart's Secrets.
fn assert_agents_trust_the_registrar_ca_and_no_key_leaves_it(ends: &Ends, serving_secret: &str) {
    let (r, ctx) = (ends.r, ends.ctx);
    let ca_path = flag(ends.agent, "--registrar-ca");
    let (volume, file) =
        volume_of(ends.agent_spec, ends.agent, ca_path).unwrap_or_else(|| panic!("{ctx}: nothing mounts {ca_path}"));
    let cm = volume
        .config_map
        .as_ref()
        .unwrap_or_else(|| panic!("{ctx}: {ca_path} is not from a ConfigMap"));
    let key = key_of(cm.items.as_deref(), &file).expect("the CA's item");
    let ca_text = r
        .config_map(&cm.name)
        .and_then(|c| c.data.as_ref())
        .and_then(|d| d.get(&key))
        .unwrap_or_else(|| panic!("{ctx}: ConfigMap {} with {key} is not rendered", cm.name));
    assert_eq!(
        ca_text,
        &secret_text(r, serving_secret, "ca.crt", ctx),
        "{ctx}: agents trust the registrar's CA"
    );
    for c in &r.config_maps {
        for v in c.data.iter().flat_map(|d| d.values()) {
            assert!(
                !v.contains("PRIVATE KEY"),
                "{ctx}: a key in ConfigMap {:?}",
                c.metadata.name
            );
        }
    }
    for (pod, spec) in r.pod_specs() {
        for v in spec.volumes.iter().flatten() {
            if let Some(name) = v.secret.as_ref().and_then(|s| s.secret_name.as_deref())
                && r.secret(name).is_some()
            {
                // Each generated key stays with its owner: the controller's serving key with the controller.
                let owner = match name {
                    "aether-controller-tls" => "aether-controller",
                    _ => "aether-registrar",
                };
                assert_eq!(pod, owner, "{ctx}: {pod} mounts {name}");
            }
        }
    }
}

/// The ClusterRoles bound to the registrar's ServiceAccount: each rule reads, or reviews tokens, and none has a
/// wildcard.
fn assert_registrar_cluster_roles_read_or_review<'a>(ends: &Ends<'a>) -> Vec<&'a ClusterRole> {
    let (r, ctx) = (ends.r, ends.ctx);
    let registrar_sa = ends.registrar_spec.service_account_name.as_deref().unwrap();
    let bound_to_registrar = |subjects: &Option<Vec<k8s_openapi::api::rbac::v1::Subject>>| {
        subjects.iter().flatten().any(|s| {
            s.kind == "ServiceAccount" && s.name == registrar_sa && s.namespace.as_deref() == Some("aether-system")
        })
    };
    let roles: Vec<&ClusterRole> = r
        .cluster_role_bindings
        .iter()
        .filter(|b| bound_to_registrar(&b.subjects))
        .map(|b| {
            assert_eq!(b.role_ref.kind, "ClusterRole", "{ctx}");
            r.cluster_roles
                .iter()
                .find(|c| c.metadata.name.as_deref() == Some(b.role_ref.name.as_str()))
                .unwrap_or_else(|| panic!("{ctx}: {} binds a ClusterRole not rendered", b.role_ref.name))
        })
        .collect();
    for role in &roles {
        for rule in role.rules.iter().flatten() {
            assert!(
                is_token_review_rule(rule)
                    || is_route_status_rule(rule)
                    || is_status_rule(rule)
                    || rule
                        .verbs
                        .iter()
                        .all(|v| ["get", "list", "watch"].contains(&v.as_str())),
                "{ctx}: {:?} grants the registrar {:?}",
                role.metadata.name,
                rule.verbs
            );
            let mut fields = rule.verbs.iter().chain(rule.resources.iter().flatten());
            assert!(
                !fields.any(|v| v == "*") && !rule.api_groups.iter().flatten().any(|g| g == "*"),
                "{ctx}: a wildcard in {:?}",
                role.metadata.name
            );
        }
    }
    roles
}

/// The agent's SPIRE SVID, verified by the registrar with SPIRE's bundle: no bootstrap at all.
fn assert_spire_svids_replace_the_bootstrap(ends: &Ends, reviews_anywhere: usize) {
    let (agent, registrar, ctx) = (ends.agent, ends.registrar, ends.ctx);
    assert_eq!(arg(agent, "--node-identity"), Some("spire"), "{ctx}");
    assert!(arg(agent, "--spire-workload-socket").is_some(), "{ctx}");
    assert_eq!(arg(agent, "--bootstrap-token"), None, "{ctx}");
    assert!(
        !ends.agent_spec.volumes.iter().flatten().any(|v| v.projected.is_some()),
        "{ctx}: no bootstrap token"
    );
    for f in [
        "--node-ca-cert",
        "--node-ca-key",
        "--bootstrap-audience",
        "--agent-service-account",
    ] {
        assert_eq!(arg(registrar, f), None, "{ctx}: {f} without the bootstrap");
    }
    let client_ca = flag(registrar, "--client-ca");
    let (volume, file) = volume_of(ends.registrar_spec, registrar, client_ca)
        .unwrap_or_else(|| panic!("{ctx}: nothing mounts {client_ca}"));
    let cm = volume.config_map.as_ref().expect("SPIRE's bundle from a ConfigMap");
    assert_eq!(
        (cm.name.as_str(), key_of(cm.items.as_deref(), &file).as_deref()),
        ("spire-bundle", Some("bundle.crt")),
        "{ctx}"
    );
    assert_eq!(reviews_anywhere, 0, "{ctx}: no TokenReviews without the bootstrap");
    assert!(
        ends.r.secret("aether-registrar-node-ca").is_none(),
        "{ctx}: no node CA without the bootstrap"
    );
}

/// The agent's proof of node: a projected token with the registrar's audience, at the path the flag names; only
/// the agent's ServiceAccount gets node certificates.
fn assert_the_agent_proves_its_node_with_a_projected_token(ends: &Ends) {
    let (agent, registrar, ctx) = (ends.agent, ends.registrar, ends.ctx);
    assert_eq!(arg(agent, "--node-identity"), Some("bootstrap"), "{ctx}");
    let token_path = flag(agent, "--bootstrap-token");
    let (volume, file) =
        volume_of(ends.agent_spec, agent, token_path).unwrap_or_else(|| panic!("{ctx}: nothing mounts {token_path}"));
    let token = volume
        .projected
        .as_ref()
        .and_then(|p| p.sources.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|s| s.service_account_token.as_ref())
        .find(|t| t.path == file)
        .unwrap_or_else(|| panic!("{ctx}: {token_path} is not a projected ServiceAccount token"));
    assert_eq!(token.audience.as_deref(), Some("aether-registrar"), "{ctx}");
    assert_eq!(
        token.audience.as_deref(),
        arg(registrar, "--bootstrap-audience"),
        "{ctx}: the registrar requires the audience the token carries"
    );
    assert_eq!(token.expiration_seconds, Some(3600), "{ctx}");
    // The registrar names the agents' real ServiceAccount.
    let agent_ds = ends.r.daemon_set("aether-agent");
    let agent_sa = format!(
        "{}/{}",
        agent_ds.metadata.namespace.as_deref().unwrap(),
        ends.agent_spec.service_account_name.as_deref().unwrap()
    );
    assert_eq!(agent_sa, "aether-system/aether-agent", "{ctx}");
    assert_eq!(
        arg(registrar, "--agent-service-account"),
        Some(agent_sa.as_str()),
        "{ctx}"
    );
}

/// The registrar may create TokenReviews, through a ClusterRole that grants nothing else, and mounts its token.
fn assert_the_registrar_may_only_review_tokens(ends: &Ends, roles: &[&ClusterRole], reviews_anywhere: usize) {
    let ctx = ends.ctx;
    let reviewers: Vec<&&ClusterRole> = roles
        .iter()
        .filter(|c| c.rules.iter().flatten().any(is_token_review_rule))
        .collect();
    let registrar_sa = ends.registrar_spec.service_account_name.as_deref().unwrap();
    let automount = ends
        .r
        .service_accounts
        .iter()
        .find(|sa| sa.metadata.name.as_deref() == Some(registrar_sa))
        .and_then(|sa| sa.automount_service_account_token);
    assert_eq!(
        reviewers.len(),
        1,
        "{ctx}: one ClusterRole lets the registrar review tokens"
    );
    assert_eq!(
        reviewers[0].rules.as_ref().map(Vec::len),
        Some(1),
        "{ctx}: the TokenReview ClusterRole grants nothing else"
    );
    assert_eq!(reviews_anywhere, 1, "{ctx}: nobody else reviews tokens");
    assert_eq!(
        automount,
        Some(true),
        "{ctx}: the registrar needs its token for TokenReviews"
    );
}

/// Defaults: the Kubernetes store (no extra infrastructure, active/active), the built-in CA, OTLP off.
#[test]
fn default_values_render_lint_clean_and_hold_the_invariants() {
    let r = render(json!({}));
    assert_invariants(&r, "kubernetes", "builtin", false);
    assert!(r.network_policies.is_empty(), "the NetworkPolicy is off by default");
}

#[test]
fn every_store_and_identity_combination_renders_and_holds_the_invariants() {
    for store in STORES {
        for identity in IDENTITIES {
            let r = render(values(store, identity));
            assert_invariants(&r, store, identity, true);
            assert!(
                r.network_policies.is_empty(),
                "store={store} identity={identity}: no NetworkPolicy"
            );
            // Every component's resources come from its values.
            for (pod, spec) in r.pod_specs() {
                let want = LIMITS.iter().find(|(n, _)| *n == pod).unwrap().1;
                let c = &spec.containers[0];
                let limit = c
                    .resources
                    .as_ref()
                    .and_then(|r| r.limits.as_ref())
                    .and_then(|l| l.get("memory"));
                assert_eq!(
                    limit.map(|q| q.0.as_str()),
                    Some(want),
                    "{pod}: resources.limits.memory"
                );
            }
        }
    }
}

/// An etcd whose TLS Secret holds only `ca.crt` (server verification, no client certificate).
#[test]
fn etcd_tls_without_a_client_certificate_passes_only_the_ca() {
    let mut v = values("etcd", "builtin");
    v["registrar"]["store"]["etcd"]["clientCertificate"] = json!(false);
    let r = render(v);
    let rc = &r
        .registrar()
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .as_ref()
        .unwrap()
        .containers[0];
    assert_eq!(arg(rc, "--etcd-ca-file"), Some("/etc/aether/etcd-tls/ca.crt"));
    assert_eq!(arg(rc, "--etcd-cert-file"), None);
    assert_eq!(arg(rc, "--etcd-key-file"), None);
}

#[test]
fn the_chart_refuses_values_that_cannot_work() {
    let cases = [
        (
            json!({"registrar": {"replicas": 2, "store": {"type": "embedded"}}}),
            "registrar.replicas=1",
        ),
        (
            json!({"registrar": {"store": {"type": "etcd"}}}),
            "registrar.store.etcd.endpoints",
        ),
        (json!({"identity": {"provider": "vault"}}), "provider"),
        (json!({"registrar": {"store": {"type": "consul"}}}), "type"),
        (json!({"otel": {"enabled": true}}), "otel.endpoint"),
        (json!({"meshDomain": "Not A Domain"}), "meshDomain"),
        (json!({"inboundMtls": "off"}), "inboundMtls"),
        (json!({"meshRootNamespace": "Mesh_Root"}), "meshRootNamespace"),
        // etcd is TLS by default: a plaintext endpoint needs tlsSecretName "" said out loud, and https:// a CA.
        (
            json!({"registrar": {"store": {"type": "etcd", "etcd": {"endpoints": ["http://etcd:2379"]}}}}),
            "tlsSecretName",
        ),
        (
            json!({"registrar": {"store": {"type": "etcd", "etcd": {"endpoints": ["https://etcd:2379"], "tlsSecretName": ""}}}}),
            "tlsSecretName",
        ),
        // Agents are on the host network: a policy without the nodes' addresses would lock them out.
        (
            json!({"registrar": {"networkPolicy": {"enabled": true}}}),
            "registrar.networkPolicy.nodeCidrs",
        ),
        (json!({"agent": {"nodeIdentity": "plaintext"}}), "nodeIdentity"),
        // Agents' SPIRE SVIDs need SPIRE's bundle at the registrar, and SPIRE.
        (
            json!({"identity": {"provider": "spire"}}),
            "registrar.clientCa.configMapName",
        ),
        (
            json!({"agent": {"nodeIdentity": "spire"}, "registrar": {"clientCa": {"configMapName": "b"}}}),
            "identity.provider=spire",
        ),
    ];
    for (values, needle) in cases {
        match render_raw(&values, false) {
            Ok(_) => panic!("the chart accepted {values}"),
            Err(e) => assert!(e.contains(needle), "refusing {values} should name {needle}: {e}"),
        }
    }
}

/// Our CRDs in the chart's `crds/`, by name: one namespaced kind of `group` served and stored in one version, with
/// the status subresource the registrar writes the Accepted condition through; their printer columns as
/// `(name, jsonPath, priority)`.
fn our_crd<'a>(
    r: &'a Rendered,
    name: &str,
    (group, kind, version): (&str, &str, &str),
) -> Vec<(&'a str, &'a str, i32)> {
    let crd = (r.crds.iter())
        .find(|c| c.metadata.name.as_deref() == Some(name))
        .unwrap_or_else(|| panic!("no {name} in crds/"));
    let spec = &crd.spec;
    assert_eq!(
        (spec.group.as_str(), spec.names.kind.as_str(), spec.scope.as_str()),
        (group, kind, "Namespaced")
    );
    assert_eq!(format!("{}.{group}", spec.names.plural), name);
    let [served] = &spec.versions[..] else {
        panic!("{name}: one version")
    };
    assert_eq!(
        (served.name.as_str(), served.served, served.storage),
        (version, true, true)
    );
    let subresources = served.subresources.as_ref().expect("subresources");
    assert!(subresources.status.is_some() && subresources.scale.is_none());
    let schema = served.schema.as_ref().and_then(|s| s.open_api_v3_schema.as_ref());
    let properties = schema.and_then(|s| s.properties.as_ref()).expect("a schema");
    assert!(properties.contains_key("spec") && properties.contains_key("status"));
    (served.additional_printer_columns.iter().flatten())
        .map(|c| (c.name.as_str(), c.json_path.as_str(), c.priority.unwrap_or(0)))
        .collect()
}

const ACCEPTED: &str = r#".status.conditions[?(@.type=="Accepted")]"#;

/// The AuthorizationPolicy, HTTPFilter, MeshConfig and ExternalService CRDs ship in the chart's `crds/` whatever the values, with columns that
/// show each object's verdict. Without the cluster as a source (`registrar.fromKubernetes=false`, a writable store)
/// no RBAC for them is rendered.
#[test]
fn our_crds_ship_in_crds_with_their_status_and_columns() {
    let r = render(json!({}));
    assert_eq!(
        r.crds.len(),
        4,
        "crds/: AuthorizationPolicy, HTTPFilter, MeshConfig and ExternalService"
    );
    let policy = (authorization::GROUP, authorization::KIND, authorization::VERSION);
    let columns = our_crd(&r, "authorizationpolicies.security.aether.io", policy);
    let (status, message) = (format!("{ACCEPTED}.status"), format!("{ACCEPTED}.message"));
    assert_eq!(
        columns,
        [
            ("Action", ".spec.action", 0),
            ("Dry-Run", ".spec.dryRun", 0),
            ("Accepted", status.as_str(), 0),
            ("Age", ".metadata.creationTimestamp", 0),
            ("Message", message.as_str(), 1),
        ]
    );
    let filter = (http_filter::GROUP, http_filter::KIND, http_filter::VERSION);
    let columns = our_crd(&r, "httpfilters.networking.aether.io", filter);
    assert_eq!(
        columns,
        [
            ("Attach", ".spec.attach", 0),
            ("Order", ".spec.order", 0),
            ("Accepted", status.as_str(), 0),
            ("Age", ".metadata.creationTimestamp", 0),
            ("Message", message.as_str(), 1),
        ]
    );
    let config = (mesh_config::GROUP, mesh_config::KIND, mesh_config::VERSION);
    let columns = our_crd(&r, "meshconfigs.mesh.aether.io", config);
    assert_eq!(
        columns,
        [
            ("mTLS", ".spec.mtls.mode", 0),
            ("Authorization", ".spec.authorization.defaultAction", 0),
            ("Accepted", status.as_str(), 0),
            ("Age", ".metadata.creationTimestamp", 0),
            ("Message", message.as_str(), 1),
        ]
    );
    let external = (
        external_service::GROUP,
        external_service::KIND,
        external_service::VERSION,
    );
    let columns = our_crd(&r, "externalservices.networking.aether.io", external);
    assert_eq!(
        columns,
        [
            ("Hosts", ".spec.hosts", 0),
            ("Accepted", status.as_str(), 0),
            ("Age", ".metadata.creationTimestamp", 0),
            ("Message", message.as_str(), 1),
        ]
    );
    let short_names = |name: &str| {
        let crd = r.crds.iter().find(|c| c.metadata.name.as_deref() == Some(name));
        crd.and_then(|c| c.spec.names.short_names.clone())
    };
    assert_eq!(
        short_names("authorizationpolicies.security.aether.io"),
        Some(vec!["azp".to_owned()])
    );

    let without = render(json!({"registrar": {"fromKubernetes": false, "replicas": 1, "store": {"type": "embedded"}}}));
    assert_eq!(without.crds.len(), 4, "crds/ does not depend on values");
    for (role, _, _) in OBJECTS_WITH_STATUS {
        assert!(
            (without.cluster_roles.iter()).all(|c| c.metadata.name.as_deref() != Some(role)),
            "no source of them, no {role}"
        );
    }
}

/// `meshConfig` renders the mesh-wide MeshConfig, in the mesh root namespace, that the projector takes as mesh-wide;
/// without it, none.
#[test]
fn the_mesh_wide_mesh_config_is_rendered_in_the_root_namespace() {
    assert!(render(json!({})).mesh_configs.is_empty());
    let spec = json!({"mtls": {"mode": "PERMISSIVE"}, "authorization": {"defaultAction": "DENY"},
                      "resilience": {"requestTimeout": "10s", "retries": {"attempts": 1}}});
    for (values, root) in [
        (json!({"meshConfig": spec}), "aether-system"),
        (
            json!({"meshConfig": spec, "meshRootNamespace": "mesh-admin"}),
            "mesh-admin",
        ),
    ] {
        let r = render(values);
        let [config] = &r.mesh_configs[..] else {
            panic!("one MeshConfig: {:?}", r.mesh_configs)
        };
        let object: mesh_config::MeshConfig = serde_json::from_value(config.clone()).unwrap();
        let options = authorization::ProjectOptions {
            root_namespace: root.to_owned(),
        };
        let projected = mesh_config::project(&object, &options).unwrap();
        assert!(projected.mesh_wide, "{root}");
        assert_eq!(
            projected.default_authorization(),
            aether_proto::registry::v1::DefaultAuthorization::Deny
        );
        let resilience = projected.resilience.unwrap();
        assert_eq!(
            (resilience.request_timeout_ms, resilience.retry_attempts),
            (Some(10_000), Some(1))
        );
    }
}

/// Authorization's mesh-wide settings reach the binaries: the agent's default inbound mTLS mode and the registrar's
/// mesh root namespace (the release namespace unless set).
#[test]
fn inbound_mtls_and_the_mesh_root_namespace_reach_the_binaries() {
    for (values, mtls, root) in [
        (json!({}), "strict", "aether-system"),
        (
            json!({"inboundMtls": "permissive", "meshRootNamespace": "mesh-policy"}),
            "permissive",
            "mesh-policy",
        ),
    ] {
        let r = render(values.clone());
        let agent = container(pod_spec(&r, "aether-agent"), "agent");
        let registrar = container(pod_spec(&r, "aether-registrar"), "registrar");
        assert_eq!(flag(agent, "--inbound-mtls"), mtls, "{values}");
        assert_eq!(flag(registrar, "--mesh-root-namespace"), root, "{values}");
    }
}

/// Every command line the chart gives a binary is one that binary parses, for the defaults and every combination:
/// the binary runs with the rendered arguments (kubelet's `$(VAR)` expansion done with plausible values) plus one
/// unknown flag at the end, so it must get through every rendered argument and stop exactly at that one. A flag that
/// does not exist, takes no value or gets a malformed one fails here, as it would on the node.
#[test]
fn every_command_line_the_chart_renders_is_one_the_binary_parses() {
    let expand = |arg: &str| arg.replace("$(NODE_NAME)", "node-a").replace("$(HOST_IP)", "10.0.0.7");
    let mut renders = vec![("defaults".to_owned(), render(json!({})))];
    for store in STORES {
        for identity in IDENTITIES {
            renders.push((
                format!("store={store} identity={identity}"),
                render(values(store, identity)),
            ));
        }
    }
    let mut checked = 0;
    for (ctx, r) in &renders {
        for (pod, spec) in r.pod_specs() {
            for c in containers(spec) {
                assert_command_line_parses(&format!("{ctx}: {pod}"), c, expand);
                checked += 1;
            }
        }
    }
    assert_eq!(
        checked,
        renders.len() * 6,
        "agent, cni-install, proxy, mesh-dns, registrar, controller per render"
    );
}

/// Plaintext etcd is still possible, but only said out loud (`tlsSecretName: ""`): no TLS flags, no volume.
#[test]
fn etcd_without_tls_only_when_asked() {
    let r = render(json!({"registrar": {"store": {"type": "etcd",
        "etcd": {"endpoints": ["http://etcd:2379"], "tlsSecretName": ""}}}}));
    let rc = container(pod_spec(&r, "aether-registrar"), "registrar");
    assert_eq!(arg(rc, "--etcd-ca-file"), None);
    assert!(!rc.volume_mounts.iter().flatten().any(|m| m.name == "etcd-tls"));
    // The default Secret name: TLS unless told otherwise.
    let r = render(json!({"registrar": {"store": {"type": "etcd", "etcd": {"endpoints": ["https://etcd:2379"]}}}}));
    let spec = pod_spec(&r, "aether-registrar");
    let rc = container(spec, "registrar");
    assert_eq!(
        secret_file(spec, rc, flag(rc, "--etcd-ca-file"), "etcd default").secret,
        "aether-etcd-tls"
    );
}

/// The NetworkPolicy (off by default) selects the registrar pods and admits, on the gRPC port, only agents (by pod
/// label and, as they are on the host network, by node address) and the pods named in the values; on the admin port
/// only the nodes and the peers named.
#[test]
fn the_network_policy_admits_only_agents_and_named_clients_to_the_registrar() {
    let r = render(json!({"registrar": {"networkPolicy": {
        "enabled": true,
        "nodeCidrs": ["10.0.0.0/16", "fd00::/64"],
        "extraClientPodLabels": [{"app.kubernetes.io/component": "controller"}],
        "adminFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    }}}));
    assert_invariants(&r, "kubernetes", "builtin", false);
    assert_eq!(r.network_policies.len(), 1);
    let policy = &r.network_policies[0];
    assert_eq!(policy.metadata.namespace.as_deref(), Some("aether-system"));
    let spec = policy.spec.as_ref().unwrap();
    let pod_selector = spec.pod_selector.as_ref().expect("podSelector");
    assert!(
        selects(pod_selector, &template_labels(&r, "aether-registrar")),
        "selects the registrar pods"
    );
    for other in ["aether-agent", "aether-proxy", "aether-mesh-dns"] {
        assert!(!selects(pod_selector, &template_labels(&r, other)), "selects {other}");
    }
    assert_eq!(spec.policy_types.as_deref(), Some(&["Ingress".to_owned()][..]));
    let rules = spec.ingress.as_deref().unwrap_or_default();
    assert_eq!(rules.len(), 2, "gRPC and admin, nothing else");
    let grpc = peers_on(rules, 18090);
    assert_eq!(ip_blocks(grpc), ["10.0.0.0/16", "fd00::/64"]);
    let pod_peers: Vec<_> = grpc.iter().filter_map(|p| p.pod_selector.as_ref()).collect();
    assert_eq!(pod_peers.len(), 2, "agents and the controller");
    assert!(selects(pod_peers[0], &template_labels(&r, "aether-agent")), "agents");
    assert_eq!(
        pod_peers[1]
            .match_labels
            .as_ref()
            .unwrap()
            .get("app.kubernetes.io/component")
            .map(String::as_str),
        Some("controller")
    );
    assert!(
        grpc.iter().all(|p| p.namespace_selector.is_none()),
        "pods of the release namespace only"
    );
    let admin = peers_on(rules, 18091);
    assert_eq!(
        ip_blocks(admin),
        ["10.0.0.0/16", "fd00::/64"],
        "kubelet probes from the nodes"
    );
    assert!(
        admin.iter().any(|p| p.namespace_selector.is_some()),
        "the monitoring peer"
    );
}

type Labels = std::collections::BTreeMap<String, String>;

/// The pod template labels of the workload `name`.
fn template_labels(r: &Rendered, name: &str) -> Labels {
    let template = match name {
        "aether-registrar" => &r.registrar().spec.as_ref().unwrap().template,
        other => &r.daemon_set(other).spec.as_ref().unwrap().template,
    };
    template.metadata.as_ref().unwrap().labels.clone().unwrap_or_default()
}

/// Whether `selector` (match labels only, never empty) selects pods labelled `labels`.
fn selects(selector: &k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector, labels: &Labels) -> bool {
    assert!(selector.match_expressions.is_none());
    let want = selector.match_labels.clone().unwrap_or_default();
    !want.is_empty() && want.iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// The one port an ingress rule admits.
fn port_of(rule: &k8s_openapi::api::networking::v1::NetworkPolicyIngressRule) -> i32 {
    let ports = rule.ports.as_deref().expect("every rule names its port");
    assert_eq!(ports.len(), 1);
    match ports[0].port {
        Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(p)) => p,
        ref other => panic!("port {other:?}"),
    }
}

/// The peers the rule for `port` admits.
fn peers_on(
    rules: &[k8s_openapi::api::networking::v1::NetworkPolicyIngressRule],
    port: i32,
) -> &[k8s_openapi::api::networking::v1::NetworkPolicyPeer] {
    let rule = rules
        .iter()
        .find(|rule| port_of(rule) == port)
        .unwrap_or_else(|| panic!("no rule for {port}"));
    rule.from.as_deref().expect("a rule without `from` admits everyone")
}

fn ip_blocks(peers: &[k8s_openapi::api::networking::v1::NetworkPolicyPeer]) -> Vec<String> {
    peers
        .iter()
        .filter_map(|p| p.ip_block.as_ref().map(|b| b.cidr.clone()))
        .collect()
}

/// With `controller.tls.secretName`, the controller mounts that Secret; the caBundle is read from it at install.
fn assert_the_controller_serves_its_own_certificate(r: &Rendered) {
    let controller_spec = pod_spec(r, "aether-controller");
    let c = container(controller_spec, "controller");
    assert_eq!(
        secret_file(controller_spec, c, flag(c, "--tls-cert"), "controller").secret,
        "controller-cert"
    );
    // The caBundle is read from that Secret at install (lookup): `helm template` cannot look, so it shows none.
    let bundles = r.validating_webhooks[0]
        .webhooks
        .iter()
        .flatten()
        .map(|w| &w.client_config.ca_bundle);
    assert!(bundles.into_iter().all(Option::is_none));
}

/// The webhook certificate the chart generates works as kube-apiserver uses it: the real controller serves the
/// rendered Secret, and a client that trusts only the webhook configuration's caBundle and dials the Service's name
/// gets its AdmissionReview answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_generated_webhook_certificate_is_trusted_through_the_ca_bundle() {
    let r = render(json!({}));
    let spec = pod_spec(&r, "aether-controller");
    let c = container(spec, "controller");
    let cert = secret_file(spec, c, flag(c, "--tls-cert"), "controller");
    let key = secret_file(spec, c, flag(c, "--tls-key"), "controller");
    let webhook = &r.validating_webhooks[0].webhooks.as_ref().unwrap()[0];
    let bundle = String::from_utf8(webhook.client_config.ca_bundle.clone().unwrap().0).unwrap();
    let service = webhook.client_config.service.as_ref().unwrap();
    assert_eq!(
        format!("{}.{}.svc", service.name, service.namespace),
        aether_tests::controller::SERVICE_NAME,
        "the name the test client dials"
    );
    let controller = aether_tests::controller::Controller::serving(
        &secret_text(&r, &cert.secret, &cert.key, "cert"),
        &secret_text(&r, &key.secret, &key.key, "key"),
        &bundle,
        &[],
        &[],
    )
    .await;
    let pod = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web", "namespace": "shop"}, "spec": {}});
    let review = aether_tests::controller::admission_review("CREATE", ("", "v1", "Pod"), &pod);
    let answer = controller
        .connect()
        .await
        .review(service.path.as_deref().unwrap(), &review)
        .await;
    assert_eq!(answer["response"]["allowed"], true, "{answer}");
}

/// With cert-manager, a Certificate for the Service's names replaces the generated Secret, and its CA injector fills
/// both webhook configurations' caBundle (the chart renders none); without the controller, none of it renders.
#[test]
fn cert_manager_issues_the_webhook_certificate_and_the_controller_can_be_left_out() {
    let issuer = json!({"enabled": true, "issuerKind": "ClusterIssuer", "issuerName": "mesh-ca"});
    let r = render(json!({"controller": {"tls": {"certManager": issuer}}}));
    assert!(r.secret("aether-controller-tls").is_none(), "nothing generated");
    let certificate = r
        .raw
        .iter()
        .find(|o| o["kind"] == "Certificate")
        .expect("a Certificate");
    assert_eq!(certificate["spec"]["secretName"], "aether-controller-tls");
    assert_eq!(
        certificate["spec"]["issuerRef"],
        json!({"kind": "ClusterIssuer", "name": "mesh-ca"})
    );
    assert_eq!(
        certificate["spec"]["dnsNames"][0],
        "aether-controller.aether-system.svc"
    );
    let inject = |meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta| {
        meta.annotations
            .clone()
            .unwrap_or_default()
            .get("cert-manager.io/inject-ca-from")
            .cloned()
    };
    assert_eq!(
        inject(&r.validating_webhooks[0].metadata).as_deref(),
        Some("aether-system/aether-controller")
    );
    assert_eq!(
        inject(&r.mutating_webhooks[0].metadata).as_deref(),
        Some("aether-system/aether-controller")
    );
    let webhooks = r.validating_webhooks[0].webhooks.iter().flatten();
    assert!(webhooks.clone().all(|w| w.client_config.ca_bundle.is_none()));

    let r = render(json!({"controller": {"enabled": false}}));
    assert!(r.validating_webhooks.is_empty() && r.mutating_webhooks.is_empty());
    assert!(
        r.deployments
            .iter()
            .all(|d| d.metadata.name.as_deref() != Some("aether-controller"))
    );
    assert!(
        r.service_accounts
            .iter()
            .all(|s| s.metadata.name.as_deref() != Some("aether-controller"))
    );
}

/// Certificates of the user's own (cert-manager, trust-manager) replace the generated ones: nothing is generated,
/// the registrar mounts the named Secrets, and agents get only the CA certificate of the registrar's Secret (or the
/// named ConfigMap), never its key.
#[test]
fn user_provided_certificates_replace_the_generated_ones() {
    let tls = json!({"secretName": "registrar-cert", "identity": "spiffe://cluster.local/aether/registrar"});
    let r = render(json!({"registrar": {"tls": tls, "nodeCa": {"secretName": "my-node-ca"},
        "clientCa": {"configMapName": "spire-bundle", "key": "bundle.crt"},
        "readerIds": ["spiffe://cluster.local/ns/aether-system/sa/aether-controller"]},
        "controller": {"tls": {"secretName": "controller-cert"}}}));
    assert!(r.secrets.is_empty() && r.config_maps.is_empty(), "nothing generated");
    assert_the_controller_serves_its_own_certificate(&r);
    let registrar_spec = pod_spec(&r, "aether-registrar");
    let rc = container(registrar_spec, "registrar");
    for (flag_name, secret, key) in [
        ("--tls-cert", "registrar-cert", "tls.crt"),
        ("--tls-key", "registrar-cert", "tls.key"),
        ("--node-ca-cert", "my-node-ca", "tls.crt"),
        ("--node-ca-key", "my-node-ca", "tls.key"),
    ] {
        let file = secret_file(registrar_spec, rc, flag(rc, flag_name), flag_name);
        assert_eq!(
            file,
            SecretFile {
                secret: secret.into(),
                key: key.into(),
                mode: Some(0o440)
            }
        );
    }
    let client_ca = flag(rc, "--client-ca");
    let (volume, file) = volume_of(registrar_spec, rc, client_ca).expect("--client-ca is mounted");
    let cm = volume.config_map.as_ref().expect("from a ConfigMap");
    assert_eq!(cm.name, "spire-bundle");
    assert_eq!(key_of(cm.items.as_deref(), &file).as_deref(), Some("bundle.crt"));
    assert_eq!(
        arg(rc, "--reader-ids"),
        Some("spiffe://cluster.local/ns/aether-system/sa/aether-controller")
    );
    let agent_spec = pod_spec(&r, "aether-agent");
    let agent = container(agent_spec, "agent");
    assert_eq!(
        arg(agent, "--registrar-identity"),
        Some("spiffe://cluster.local/aether/registrar")
    );
    let ca = secret_file(agent_spec, agent, flag(agent, "--registrar-ca"), "agent");
    assert_eq!(ca.secret, "registrar-cert");
    assert_eq!(ca.key, "ca.crt");
    let volume = agent_spec
        .volumes
        .iter()
        .flatten()
        .find(|v| v.secret.as_ref().and_then(|s| s.secret_name.as_deref()) == Some("registrar-cert"))
        .unwrap();
    let items: Vec<&str> = volume
        .secret
        .as_ref()
        .unwrap()
        .items
        .iter()
        .flatten()
        .map(|i| i.key.as_str())
        .collect();
    assert_eq!(items, ["ca.crt"], "agents never see the registrar's key");

    // A CA ConfigMap of the user's (trust-manager) instead.
    let mut tls = tls;
    tls["caConfigMapName"] = json!("registrar-ca-bundle");
    let r = render(json!({"registrar": {"tls": tls, "nodeCa": {"secretName": "my-node-ca"}}}));
    let agent_spec = pod_spec(&r, "aether-agent");
    let agent = container(agent_spec, "agent");
    let (volume, file) = volume_of(agent_spec, agent, flag(agent, "--registrar-ca")).unwrap();
    let cm = volume.config_map.as_ref().expect("from the ConfigMap");
    assert_eq!(cm.name, "registrar-ca-bundle");
    assert_eq!(key_of(cm.items.as_deref(), &file).as_deref(), Some("ca.crt"));
    assert!(
        !agent_spec
            .volumes
            .iter()
            .flatten()
            .any(|v| v.secret.as_ref().and_then(|s| s.secret_name.as_deref()) == Some("registrar-cert")),
        "the registrar's Secret stays away from agents"
    );
}

/// Writes what a container's volumes from the chart's own Secrets and ConfigMaps would show under `root` + their
/// mount paths (Secrets the user creates, like the built-in CA's, are not rendered and not needed here).
fn materialize(r: &Rendered, spec: &PodSpec, c: &Container, root: &Path) {
    for mount in c.volume_mounts.iter().flatten() {
        let volume = spec.volumes.iter().flatten().find(|v| v.name == mount.name).unwrap();
        let files: Vec<(String, Vec<u8>)> = if let Some(s) = &volume.secret {
            let Some(secret) = r.secret(s.secret_name.as_deref().unwrap()) else {
                continue;
            };
            secret
                .data
                .iter()
                .flatten()
                .filter_map(|(k, v)| {
                    let path = match &s.items {
                        Some(items) => items.iter().find(|i| &i.key == k)?.path.clone(),
                        None => k.clone(),
                    };
                    Some((path, v.0.clone()))
                })
                .collect()
        } else if let Some(m) = &volume.config_map {
            let map = r.config_map(&m.name).expect("a rendered ConfigMap");
            map.data
                .iter()
                .flatten()
                .filter_map(|(k, v)| {
                    let path = match &m.items {
                        Some(items) => items.iter().find(|i| &i.key == k)?.path.clone(),
                        None => k.clone(),
                    };
                    Some((path, v.clone().into_bytes()))
                })
                .collect()
        } else {
            continue;
        };
        let dir = under(root, &mount.mount_path);
        std::fs::create_dir_all(&dir).unwrap();
        for (path, bytes) in files {
            std::fs::write(dir.join(path), bytes).unwrap();
        }
    }
}

/// `path` (absolute, in a container) under the test's `root`.
fn under(root: &Path, path: &str) -> PathBuf {
    root.join(path.trim_start_matches('/'))
}

/// mTLS to the registrar at `port`, verifying it as an agent does (the rendered CA file and URL host), presenting
/// `cert` (nothing while empty). Retries while the registrar starts.
async fn registrar_channel(port: u16, ca: &Path, host: &str, cert: CertSlot, registrar: &mut ChildGuard) -> Channel {
    let roots = tls::roots("--registrar-ca", tls::read_certs("--registrar-ca", ca).unwrap()).unwrap();
    let identity: ServerIdentity = host.parse().unwrap();
    let config = tls::client_config(roots, identity, cert).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let connected = Endpoint::from_shared(format!("http://127.0.0.1:{port}"))
            .unwrap()
            .connect_timeout(Duration::from_secs(2))
            .connect_with_connector(Connector::new(config.clone()))
            .await;
        match connected {
            Ok(channel) => return channel,
            Err(e) => {
                assert!(
                    registrar.try_wait().is_none() && Instant::now() < deadline,
                    "cannot reach the registrar ({e:?}):\n{}",
                    registrar.logs()
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// The agent pod's token on node-a as its projected volume asks for it, and another ServiceAccount's for the same
/// audience.
fn agent_and_stranger_tokens(kube: &ApiServer, agent_spec: &PodSpec, agent: &Container) -> (String, String) {
    let (volume, _) = volume_of(agent_spec, agent, flag(agent, "--bootstrap-token")).unwrap();
    let projected = volume.projected.as_ref().unwrap().sources.as_ref().unwrap()[0]
        .service_account_token
        .clone()
        .unwrap();
    let agent_user = format!(
        "system:serviceaccount:aether-system:{}",
        agent_spec.service_account_name.as_deref().unwrap()
    );
    let token = kube.mint(TokenInfo {
        username: agent_user,
        node: Some("node-a".into()),
        audiences: vec![projected.audience.clone().unwrap()],
    });
    let stranger = kube.mint(TokenInfo {
        username: "system:serviceaccount:aether-system:aether-mesh-dns".into(),
        node: Some("node-a".into()),
        audiences: vec![projected.audience.unwrap()],
    });
    (token, stranger)
}

/// The registrar with its rendered command line: container paths under `root`, local ports, `kube` as its API server.
fn spawn_rendered_registrar(rc: &Container, root: &Path, (port, admin): (u16, u16), kube: &ApiServer) -> ChildGuard {
    let args: Vec<String> = rc
        .args
        .iter()
        .flatten()
        .map(|a| match a.split_once('=') {
            Some(("--listen", _)) => format!("--listen=127.0.0.1:{port}"),
            Some(("--admin", _)) => format!("--admin=127.0.0.1:{admin}"),
            Some((name, value)) if value.starts_with('/') => {
                format!("{name}={}", under(root, value).display())
            }
            _ => a.clone(),
        })
        .collect();
    std::fs::create_dir_all(under(root, flag(rc, "--data-dir"))).unwrap();
    let mut cmd = std::process::Command::new(aether_tests::binary("aether-registrar"));
    cmd.args(&args)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("KUBECONFIG", kube.write_kubeconfig(root));
    ChildGuard::spawn("registrar", cmd)
}

/// The PKI the chart generates works with the real binaries' TLS: the registrar starts with the rendered flags
/// and files (its certificate, the node CA, the agents' ServiceAccount, the audience); a client holding only what
/// the agent pod holds (the CA file, the URL, a token shaped as the projected volume, checked by a stand-in API
/// server's TokenReview) verifies the registrar, gets a node certificate and calls the registrar with it. Anything
/// else is refused: no certificate, or the token of another ServiceAccount.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_generated_pki_lets_an_agent_bootstrap_and_call_the_registrar() {
    let r = render(json!({"registrar": {"replicas": 1, "store": {"type": "embedded"}}}));
    let root = tempfile::tempdir().unwrap();
    let (agent_spec, registrar_spec) = (pod_spec(&r, "aether-agent"), pod_spec(&r, "aether-registrar"));
    let (agent, rc) = (container(agent_spec, "agent"), container(registrar_spec, "registrar"));
    materialize(&r, agent_spec, agent, root.path());
    materialize(&r, registrar_spec, rc, root.path());

    // The API server the registrar asks about tokens (KUBECONFIG), knowing the agent pod's token on node-a.
    let kube = ApiServer::start();
    let (token, stranger) = agent_and_stranger_tokens(&kube, agent_spec, agent);

    // The registrar with its rendered command line: container paths under the temp root, local ports.
    let (port, admin) = (free_port(), free_port());
    let mut registrar = spawn_rendered_registrar(rc, root.path(), (port, admin), &kube);

    // The agent's side: what its pod mounts and its flags.
    let ca = under(root.path(), flag(agent, "--registrar-ca"));
    let url = flag(agent, "--registrar");
    let host = url.trim_start_matches("https://").rsplit_once(':').unwrap().0;
    let anonymous = registrar_channel(port, &ca, host, CertSlot::default(), &mut registrar).await;
    let key = rcgen::KeyPair::generate().unwrap();
    let csr = rcgen::CertificateParams::default().serialize_request(&key).unwrap();
    let issue = |token: &str| IssueNodeCertificateRequest {
        token: token.to_owned(),
        csr_der: csr.der().to_vec(),
    };
    let refused = NodeBootstrapClient::new(anonymous.clone())
        .issue_node_certificate(issue(&stranger))
        .await
        .expect_err("another ServiceAccount's token gets no node certificate");
    assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused:?}");
    let issued = NodeBootstrapClient::new(anonymous.clone())
        .issue_node_certificate(issue(&token))
        .await
        .unwrap_or_else(|e| panic!("bootstrap: {e:?}\n{}", registrar.logs()))
        .into_inner();
    assert_eq!(issued.spiffe_id, "spiffe://cluster.local/aether/node/node-a");
    let chain = CertificateDer::pem_slice_iter(issued.cert_chain_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    assert_eq!(
        PeerIdentity::from_leaf(&chain[0]).unwrap().spiffe_id.as_deref(),
        Some(issued.spiffe_id.as_str())
    );

    // Without a certificate the catalog is closed; with the node certificate it answers.
    let denied = RegistrarClient::new(anonymous)
        .list_services(ListServicesRequest::default())
        .await
        .expect_err("no certificate, no catalog");
    assert!(
        matches!(
            denied.code(),
            tonic::Code::Unauthenticated | tonic::Code::PermissionDenied
        ),
        "{denied:?}"
    );
    let slot = CertSlot::default();
    slot.set(tls::certified_key(chain, PrivateKeyDer::Pkcs8(key.serialize_der().into())).unwrap());
    let channel = registrar_channel(port, &ca, host, slot, &mut registrar).await;
    RegistrarClient::new(channel)
        .list_services(ListServicesRequest::default())
        .await
        .unwrap_or_else(|e| panic!("the agent of node-a lists services: {e:?}\n{}", registrar.logs()));
    assert_eq!(kube.reviews().len(), 2, "both tokens were reviewed");
}

/// One edge gateway as the README shows it: `public` in the release namespace on 80 and 443, two replicas, its
/// certificates in its own namespace and in `certs`.
fn public_gateway() -> Value {
    json!({"name": "public", "namespace": "aether-system", "ports": [80, 443], "replicas": 2,
           "service": {"type": "LoadBalancer"}, "certificateNamespaces": ["aether-system", "certs"]})
}

/// `base` with the edge enabled for `gateways`.
fn with_edge(mut base: Value, gateways: Value) -> Value {
    base["edge"] = json!({"enabled": true, "gateways": gateways});
    base
}

/// A rule's API groups, resources and verbs, for comparing rules as a whole.
type RuleTriple = (Vec<String>, Vec<String>, Vec<String>);

fn rule_triples(rules: Option<&Vec<PolicyRule>>) -> Vec<RuleTriple> {
    rules
        .into_iter()
        .flatten()
        .map(|rule| {
            assert_eq!(rule.resource_names, None, "no resourceNames in these rules");
            let list = |v: &Option<Vec<String>>| v.clone().unwrap_or_default();
            (list(&rule.api_groups), list(&rule.resources), rule.verbs.clone())
        })
        .collect()
}

fn owned(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| (*s).to_owned()).collect()
}

/// The Gateway API kinds the edge and the controller read.
const GATEWAY_KINDS: [&str; 7] = [
    "gatewayclasses",
    "gateways",
    "httproutes",
    "grpcroutes",
    "tlsroutes",
    "tcproutes",
    "referencegrants",
];

/// The objects of the edge: anything labelled with its component.
fn edge_objects(r: &Rendered) -> Vec<&Value> {
    (r.raw.iter())
        .filter(|o| o["metadata"]["labels"]["app.kubernetes.io/component"] == "edge")
        .collect()
}

/// Off by default, and off even with gateways listed: no GatewayClass, no edge object, no Gateway rights for the
/// controller (its token stays as the rest of its values want it).
#[test]
fn with_the_edge_disabled_nothing_of_it_renders() {
    let gateways = json!([public_gateway()]);
    for values in [json!({}), json!({"edge": {"enabled": false, "gateways": gateways}})] {
        let r = render(values.clone());
        assert!(r.gateway_classes.is_empty(), "{values}: no GatewayClass");
        assert_eq!(edge_objects(&r), Vec::<&Value>::new(), "{values}: edge objects");
        assert!(r.hpas.is_empty(), "{values}");
        let names: Vec<&str> = (r.raw.iter())
            .filter_map(|o| o["metadata"]["name"].as_str())
            .filter(|name| name.contains("edge") || name.contains("gateway"))
            .collect();
        assert_eq!(names, Vec::<&str>::new(), "{values}: objects named for the edge");
        let controller = container(pod_spec(&r, "aether-controller"), "controller");
        assert_eq!(
            arg(controller, "--gateway-status"),
            Some("false"),
            "{values}: no Gateway status without RBAC"
        );
        for role in &r.cluster_roles {
            for rule in role.rules.iter().flatten() {
                assert!(
                    !rule
                        .resources
                        .iter()
                        .flatten()
                        .any(|res| res == "secrets" || res == "gateways"),
                    "{values}: {:?}",
                    role.metadata.name
                );
            }
        }
        assert_invariants(&r, "kubernetes", "builtin", false);
    }
}

/// An edge gateway's pod: `aether-agent edge` and `aether-agent proxy` sharing the xDS socket in a pod-local volume,
/// one non-root UID (the socket is 0600), locked down like every container; the edge reaches the registrar and gets
/// its SVID exactly as the agent does, as its own ServiceAccount; probes on both admin servers; Envoy's admin on
/// loopback; the API token and the CA key in the edge container only.
#[test]
fn an_edge_gateway_runs_its_xds_server_and_envoy_on_one_socket() {
    for identity in IDENTITIES {
        let base = if identity == "spire" {
            values("kubernetes", "spire")
        } else {
            json!({})
        };
        let r = render(with_edge(base, json!([public_gateway()])));
        let ctx = format!("identity={identity}");
        assert_every_container_is_locked_down(&r, &ctx);
        let [class] = &r.gateway_classes[..] else {
            panic!("{ctx}: one GatewayClass")
        };
        assert_eq!(class["apiVersion"], "gateway.networking.k8s.io/v1", "{ctx}");
        assert_eq!(class["metadata"]["name"], "aether", "{ctx}");
        assert_eq!(
            class["spec"]["controllerName"],
            aether_api::edge::CONTROLLER_NAME,
            "{ctx}"
        );

        let deployment = r.deployment("aether-edge-public").spec.as_ref().unwrap();
        assert_eq!(deployment.replicas, Some(2), "{ctx}");
        let spec = deployment.template.spec.as_ref().unwrap();
        let names: Vec<&str> = containers(spec).map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["edge", "proxy"], "{ctx}");
        let (edge, proxy) = (container(spec, "edge"), container(spec, "proxy"));
        assert_eq!(edge.args.as_ref().unwrap()[0], "edge", "{ctx}");
        assert_eq!(proxy.args.as_ref().unwrap()[0], "proxy", "{ctx}");
        assert_eq!(flag(edge, "--gateway"), "aether-system/public", "{ctx}");
        assert!(has_flag(edge, "--from-kubernetes"), "{ctx}");
        assert_eq!(flag(edge, "--certificate-namespaces"), "aether-system,certs", "{ctx}");
        assert_eq!(flag(edge, "--port-offset"), "10000", "{ctx}");
        if identity != "spire" {
            // The registrar bootstraps the edge's own ServiceAccount as a reader (never the agents').
            let registrar = r.deployment("aether-registrar").spec.as_ref().unwrap();
            let registrar = container(registrar.template.spec.as_ref().unwrap(), "registrar");
            assert_eq!(
                flag(registrar, "--edge-service-accounts"),
                "aether-system/aether-edge-public",
                "{ctx}"
            );
        }

        // One socket, in one pod-local volume both mount, served by the edge and dialled by the supervisor.
        let socket = flag(edge, "--xds-socket");
        assert_eq!(flag(proxy, "--xds-socket"), socket, "{ctx}: xDS socket");
        let (edge_volume, file) = volume_of(spec, edge, socket).expect("the edge mounts its socket's directory");
        let (proxy_volume, proxy_file) = volume_of(spec, proxy, socket).expect("the proxy mounts it too");
        assert_eq!(edge_volume.name, proxy_volume.name, "{ctx}: one volume");
        assert_eq!(file, proxy_file, "{ctx}");
        assert!(edge_volume.empty_dir.is_some(), "{ctx}: the socket is pod-local");
        let pod_security = spec.security_context.as_ref().expect("a pod securityContext");
        assert_eq!(pod_security.run_as_non_root, Some(true), "{ctx}");
        assert!(pod_security.run_as_user.is_some_and(|uid| uid != 0), "{ctx}");
        for c in [edge, proxy] {
            let sc = c.security_context.as_ref().unwrap();
            assert_eq!(
                (sc.run_as_user, sc.run_as_group),
                (None, None),
                "{ctx}: {}: the pod's UID",
                c.name
            );
            assert!(added_caps(c).is_empty(), "{ctx}: {}: no capabilities", c.name);
        }
        assert_ne!(spec.host_network, Some(true), "{ctx}: the pod network");

        // Its identity: its own ServiceAccount, named in its flags.
        assert_eq!(
            spec.service_account_name.as_deref(),
            Some("aether-edge-public"),
            "{ctx}"
        );
        assert_eq!(flag(edge, "--service-account"), "aether-edge-public", "{ctx}");
        assert_eq!(flag(edge, "--namespace"), "$(POD_NAMESPACE)", "{ctx}");
        assert_eq!(flag(edge, "--pod-name"), "$(POD_NAME)", "{ctx}");
        let sa = (r.service_accounts.iter())
            .find(|s| s.metadata.name.as_deref() == Some("aether-edge-public"))
            .expect("the edge's ServiceAccount");
        assert_eq!(sa.metadata.namespace.as_deref(), Some("aether-system"), "{ctx}");
        assert_eq!(sa.automount_service_account_token, Some(false), "{ctx}");
        assert_eq!(spec.automount_service_account_token, Some(false), "{ctx}");
        let token = "/var/run/secrets/kubernetes.io/serviceaccount/token";
        let (api, _) = volume_of(spec, edge, token).expect("the edge's API token");
        assert!(api.projected.is_some(), "{ctx}");
        assert!(
            volume_of(spec, proxy, token).is_none(),
            "{ctx}: Envoy gets no API token"
        );

        // The registrar and the SVIDs, as the agent.
        let agent = container(pod_spec(&r, "aether-agent"), "agent");
        for name in [
            "--registrar",
            "--registrar-ca",
            "--node-identity",
            "--bootstrap-token",
            "--identity",
            "--trust-domain",
            "--svid-ttl",
            "--ca-cert",
            "--ca-key",
            "--spire-admin-socket",
            "--spire-workload-socket",
            "--mesh-domain",
        ] {
            assert_eq!(arg(edge, name), arg(agent, name), "{ctx}: {name} as the agent's");
        }
        let agent_spec = pod_spec(&r, "aether-agent");
        let registrar_ca = flag(edge, "--registrar-ca");
        assert_eq!(
            volume_of(spec, edge, registrar_ca).map(|(v, f)| (v.config_map.clone(), f)),
            volume_of(agent_spec, agent, registrar_ca).map(|(v, f)| (v.config_map.clone(), f)),
            "{ctx}: the registrar's CA"
        );
        match identity {
            "builtin" => {
                let key = secret_file(spec, edge, flag(edge, "--ca-key"), &ctx);
                assert_eq!((key.secret.as_str(), key.mode), ("aether-ca", Some(0o440)), "{ctx}");
                assert!(
                    volume_of(spec, proxy, flag(edge, "--ca-key")).is_none(),
                    "{ctx}: the CA key stays out of Envoy's container"
                );
                let token = flag(edge, "--bootstrap-token");
                let (volume, _) = volume_of(spec, edge, token).expect("the bootstrap token");
                let audience = (volume.projected.as_ref().unwrap().sources.iter().flatten())
                    .find_map(|s| s.service_account_token.as_ref())
                    .and_then(|t| t.audience.clone());
                assert_eq!(audience.as_deref(), Some("aether-registrar"), "{ctx}");
            }
            _ => {
                for socket in ["--spire-admin-socket", "--spire-workload-socket"] {
                    let agent_host = host_path_of(agent_spec, agent, flag(agent, socket));
                    assert_eq!(
                        host_path_of(spec, edge, flag(edge, socket)),
                        agent_host,
                        "{ctx}: {socket}"
                    );
                }
            }
        }

        // Probes on each admin server, which listens where kubelet reaches it (the pod IP); Envoy's admin on loopback.
        for (c, path) in [(edge, "/ready"), (proxy, "/ready")] {
            let probe = c.readiness_probe.as_ref().and_then(|p| p.http_get.as_ref());
            let probe = probe.unwrap_or_else(|| panic!("{ctx}: {}: an HTTP readiness probe", c.name));
            assert_eq!(probe.path.as_deref(), Some(path), "{ctx}");
            assert_eq!(probe.host, None, "{ctx}: kubelet probes the pod IP");
            let k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(port) = &probe.port else {
                panic!("{ctx}: a named port")
            };
            let number = (c.ports.iter().flatten())
                .find(|p| p.name.as_deref() == Some(port))
                .map(|p| p.container_port);
            let admin = flag(c, "--admin");
            assert_eq!(
                admin.strip_prefix("0.0.0.0:").and_then(|p| p.parse().ok()),
                number,
                "{ctx}: {}: probed where it listens",
                c.name
            );
            assert!(c.liveness_probe.as_ref().is_some_and(|p| p.http_get.is_some()), "{ctx}");
        }
        assert!(flag(proxy, "--envoy-admin").starts_with("127.0.0.1:"), "{ctx}");
        let pre_stop = proxy.lifecycle.as_ref().and_then(|l| l.pre_stop.as_ref());
        let sleep = pre_stop.and_then(|h| h.sleep.as_ref()).map(|s| s.seconds);
        assert_eq!(sleep, Some(5), "{ctx}: Envoy keeps serving while it leaves the Service");
        assert!(
            spec.termination_grace_period_seconds.unwrap_or(30) > 5 + 10,
            "{ctx}: the grace period covers the pre-stop sleep and the drain"
        );
    }
}

/// The Service of a Gateway: its type, port P to Envoy's P + 10000, the Gateway's name as a label, and the edge's
/// pods as its endpoints; a disruption budget with two replicas; the registrar's NetworkPolicy lets the edge in.
#[test]
fn the_gateway_service_maps_its_ports_to_the_offset_and_names_the_gateway() {
    let values = with_edge(
        json!({"registrar": {"networkPolicy": {"enabled": true, "nodeCidrs": ["10.0.0.0/16"]}}}),
        json!([public_gateway()]),
    );
    let r = render(values);
    let service = (r.services.iter())
        .find(|s| s.metadata.name.as_deref() == Some("aether-edge-public"))
        .expect("the Gateway's Service");
    let labels = service.metadata.labels.clone().unwrap_or_default();
    assert_eq!(
        labels.get("gateway.networking.k8s.io/gateway-name").map(String::as_str),
        Some("public")
    );
    assert_eq!(
        labels.get("aether.io/gateway-namespace").map(String::as_str),
        Some("aether-system")
    );
    let spec = service.spec.as_ref().unwrap();
    assert_eq!(spec.type_.as_deref(), Some("LoadBalancer"));
    let ports: Vec<(i32, String, String)> = (spec.ports.iter().flatten())
        .map(|p| {
            let target = match &p.target_port {
                Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(t)) => *t,
                other => panic!("a numeric targetPort: {other:?}"),
            };
            (p.port, target.to_string(), p.protocol.clone().unwrap_or_default())
        })
        .collect();
    assert_eq!(
        ports,
        [
            (80, "10080".to_owned(), "TCP".to_owned()),
            (443, "10443".to_owned(), "TCP".to_owned())
        ]
    );
    // The selector picks this gateway's pods, whose Envoy exposes those ports.
    let deployment = r.deployment("aether-edge-public").spec.as_ref().unwrap();
    let pod_labels = deployment
        .template
        .metadata
        .as_ref()
        .unwrap()
        .labels
        .clone()
        .unwrap_or_default();
    let selector = spec.selector.clone().unwrap_or_default();
    assert!(
        !selector.is_empty() && selector.iter().all(|(k, v)| pod_labels.get(k) == Some(v)),
        "the Service selects the edge's pods"
    );
    let proxy = container(deployment.template.spec.as_ref().unwrap(), "proxy");
    let exposed: Vec<i32> = (proxy.ports.iter().flatten()).map(|p| p.container_port).collect();
    assert!(exposed.contains(&10080) && exposed.contains(&10443), "{exposed:?}");

    let pdb = (r.pdbs.iter())
        .find(|p| p.metadata.name.as_deref() == Some("aether-edge-public"))
        .expect("a PDB with two replicas");
    let pdb_spec = pdb.spec.as_ref().unwrap();
    assert_eq!(
        format!("{:?}", pdb_spec.min_available),
        "Some(Int(1))",
        "minAvailable 1"
    );
    assert!(selects(pdb_spec.selector.as_ref().unwrap(), &pod_labels));

    let policy = &r.network_policies[0];
    let rules = policy.spec.as_ref().unwrap().ingress.as_deref().unwrap_or_default();
    let grpc = peers_on(rules, 18090);
    assert!(
        (grpc.iter().filter_map(|p| p.pod_selector.as_ref())).any(|s| selects(s, &pod_labels)),
        "the edge reaches the registrar"
    );
}

/// Least privilege: the edge reads the Gateway API kinds and Namespaces cluster-wide and Secrets only in its
/// certificate namespaces (a Role there, bound to its ServiceAccount); no ClusterRole lists or watches Secrets; the
/// controller reads the same kinds, `get`s Secrets, and writes only their `/status`, as the leader of its Lease.
#[test]
fn edge_rbac_reads_secrets_only_in_the_certificate_namespaces() {
    let r = render(with_edge(json!({}), json!([public_gateway()])));
    let secret_roles: Vec<(&str, &str)> = (r.roles.iter())
        .filter(|role| {
            (role.rules.iter().flatten()).any(|rule| rule.resources.iter().flatten().any(|x| x == "secrets"))
        })
        .map(|role| {
            assert_eq!(
                rule_triples(role.rules.as_ref()),
                [(owned(&[""]), owned(&["secrets"]), owned(&["get", "list", "watch"]))]
            );
            (
                role.metadata.namespace.as_deref().unwrap(),
                role.metadata.name.as_deref().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        secret_roles,
        [
            ("aether-system", "aether-edge-public-certificates"),
            ("certs", "aether-edge-public-certificates")
        ],
        "Secret reads only in the certificate namespaces"
    );
    for (namespace, name) in &secret_roles {
        let binding = (r.role_bindings.iter())
            .find(|b| b.metadata.namespace.as_deref() == Some(*namespace) && b.role_ref.name == *name)
            .unwrap_or_else(|| panic!("{namespace}/{name} is not bound"));
        let subjects: Vec<_> = (binding.subjects.iter().flatten())
            .map(|s| (s.kind.as_str(), s.name.as_str(), s.namespace.as_deref()))
            .collect();
        assert_eq!(
            subjects,
            [("ServiceAccount", "aether-edge-public", Some("aether-system"))]
        );
    }
    for role in &r.cluster_roles {
        for rule in role.rules.iter().flatten() {
            if rule.resources.iter().flatten().any(|x| x == "secrets") {
                assert_eq!(
                    rule.verbs,
                    ["get"],
                    "{:?}: no ClusterRole lists or watches Secrets",
                    role.metadata.name
                );
            }
        }
    }
    let cluster_role = |name: &str| {
        (r.cluster_roles.iter())
            .find(|c| c.metadata.name.as_deref() == Some(name))
            .unwrap_or_else(|| panic!("no ClusterRole {name}"))
    };
    let gateway_api = owned(&["gateway.networking.k8s.io"]);
    let read = owned(&["get", "list", "watch"]);
    assert_eq!(
        rule_triples(cluster_role("aether-edge").rules.as_ref()),
        [
            (gateway_api.clone(), owned(&GATEWAY_KINDS), read.clone()),
            (owned(&[""]), owned(&["namespaces"]), read.clone()),
        ],
        "the edge reads, never writes"
    );
    let binding = (r.cluster_role_bindings.iter())
        .find(|b| b.role_ref.name == "aether-edge")
        .expect("the edge's ClusterRoleBinding");
    let subjects: Vec<_> = (binding.subjects.iter().flatten()).map(|s| s.name.as_str()).collect();
    assert_eq!(subjects, ["aether-edge-public"]);

    let statuses: Vec<String> = GATEWAY_KINDS[..6].iter().map(|k| format!("{k}/status")).collect();
    assert_eq!(
        rule_triples(cluster_role("aether-controller-gateways").rules.as_ref()),
        [
            (gateway_api.clone(), owned(&GATEWAY_KINDS), read.clone()),
            (gateway_api, statuses, owned(&["update", "patch"])),
            (owned(&[""]), owned(&["services", "namespaces"]), read),
            (owned(&[""]), owned(&["secrets"]), owned(&["get"])),
        ],
        "the controller writes status only"
    );
    let controller = container(pod_spec(&r, "aether-controller"), "controller");
    assert!(has_flag(controller, "--gateway-status"));
    let binding = (r.cluster_role_bindings.iter())
        .find(|b| b.role_ref.name == "aether-controller-gateways")
        .expect("bound");
    assert_eq!(binding.subjects.as_ref().unwrap()[0].name, "aether-controller");

    // The leader's Lease and the controller's token, even without the node taints and the MeshConfig.
    let mut values = with_edge(json!({}), json!([public_gateway()]));
    values["controller"] = json!({"nodeTaints": {"enabled": false}, "followMeshConfig": false});
    let r = render(values);
    let lease = (r.roles.iter())
        .find(|role| role.metadata.name.as_deref() == Some("aether-controller"))
        .expect("the controller's Lease Role");
    let resources: Vec<_> = (lease.rules.iter().flatten())
        .flat_map(|rule| rule.resources.clone().unwrap_or_default())
        .collect();
    assert_eq!(resources, ["leases", "leases"], "its Lease only");
    let sa = (r.service_accounts.iter())
        .find(|s| s.metadata.name.as_deref() == Some("aether-controller"))
        .unwrap();
    assert_eq!(sa.automount_service_account_token, Some(true));
}

/// Replicas: one replica has no disruption budget; an `hpa` owns the replica count (none in the Deployment) and
/// scales on CPU, with a budget when it keeps two or more; a NodePort Service with fixed node ports; certificates in
/// the Gateway's own namespace by default; two gateways, two of everything.
#[test]
fn edge_replicas_scale_with_an_hpa_and_services_are_configurable() {
    let r = render(with_edge(
        json!({}),
        json!([
            {"name": "single", "ports": [8080], "replicas": 1,
             "service": {"type": "NodePort", "nodePorts": {"8080": 30080}, "externalTrafficPolicy": "Local"}},
            {"name": "scaled", "namespace": "web", "ports": [443],
             "hpa": {"minReplicas": 2, "maxReplicas": 6, "targetCPUUtilizationPercentage": 60}}
        ]),
    ));
    let pdbs: Vec<_> = (r.pdbs.iter()).filter_map(|p| p.metadata.name.as_deref()).collect();
    assert!(!pdbs.contains(&"aether-edge-single"), "one replica: no PDB");
    assert!(pdbs.contains(&"aether-edge-scaled"), "an HPA keeping two: a PDB");
    assert_eq!(
        r.deployment("aether-edge-single").spec.as_ref().unwrap().replicas,
        Some(1)
    );
    assert_eq!(
        r.deployment("aether-edge-scaled").spec.as_ref().unwrap().replicas,
        None,
        "the HPA owns the replica count"
    );
    let [hpa] = &r.hpas[..] else { panic!("one HPA") };
    let spec = hpa.spec.as_ref().unwrap();
    assert_eq!(
        (spec.scale_target_ref.kind.as_str(), spec.scale_target_ref.name.as_str()),
        ("Deployment", "aether-edge-scaled")
    );
    assert_eq!((spec.min_replicas, spec.max_replicas), (Some(2), 6));
    let metric = &spec.metrics.as_ref().unwrap()[0];
    let resource = metric.resource.as_ref().expect("a resource metric");
    assert_eq!(
        (resource.name.as_str(), resource.target.average_utilization),
        ("cpu", Some(60))
    );
    // CPU utilization needs CPU requests on every container.
    for c in &pod_spec(&r, "aether-edge-scaled").containers {
        let requests = c.resources.as_ref().and_then(|r| r.requests.as_ref());
        assert!(
            requests.is_some_and(|r| r.contains_key("cpu")),
            "{}: a CPU request",
            c.name
        );
    }

    let single = (r.services.iter())
        .find(|s| s.metadata.name.as_deref() == Some("aether-edge-single"))
        .unwrap()
        .spec
        .as_ref()
        .unwrap();
    assert_eq!(single.type_.as_deref(), Some("NodePort"));
    assert_eq!(single.external_traffic_policy.as_deref(), Some("Local"));
    let port = &single.ports.as_ref().unwrap()[0];
    assert_eq!((port.port, port.node_port), (8080, Some(30080)));

    let edge = container(pod_spec(&r, "aether-edge-single"), "edge");
    assert_eq!(
        flag(edge, "--certificate-namespaces"),
        "aether-system",
        "the Gateway's namespace"
    );
    assert_eq!(
        flag(edge, "--gateway"),
        "aether-system/single",
        "the release namespace by default"
    );
    let scaled = container(pod_spec(&r, "aether-edge-scaled"), "edge");
    assert_eq!(flag(scaled, "--gateway"), "web/scaled");
    assert_eq!(
        flag(scaled, "--certificate-namespaces"),
        "web",
        "the Gateway's namespace by default"
    );
    let secret_roles: Vec<_> = (r.roles.iter())
        .filter(|role| {
            role.metadata
                .name
                .as_deref()
                .is_some_and(|n| n.ends_with("-certificates"))
        })
        .map(|role| {
            (
                role.metadata.namespace.as_deref().unwrap(),
                role.metadata.name.as_deref().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        secret_roles,
        [
            ("aether-system", "aether-edge-single-certificates"),
            ("web", "aether-edge-scaled-certificates")
        ]
    );
    let binding = (r.cluster_role_bindings.iter())
        .find(|b| b.role_ref.name == "aether-edge")
        .unwrap();
    let subjects: Vec<_> = (binding.subjects.iter().flatten()).map(|s| s.name.as_str()).collect();
    assert_eq!(subjects, ["aether-edge-single", "aether-edge-scaled"]);
    assert_eq!(r.gateway_classes.len(), 1, "one GatewayClass for every gateway");
}

#[test]
fn the_chart_refuses_edge_values_that_cannot_work() {
    let edge = |gateways: Value| json!({"edge": {"enabled": true, "gateways": gateways}});
    let cases = [
        (
            edge(json!([{"name": "a", "ports": [80]}, {"name": "a", "namespace": "b", "ports": [80]}])),
            "listed twice",
        ),
        (edge(json!([{"name": "a", "ports": [60000]}])), "above 65535"),
        (edge(json!([{"name": "a", "ports": []}])), "ports"),
        (edge(json!([{"name": "a"}])), "ports"),
        (edge(json!([{"name": "A_b", "ports": [80]}])), "name"),
        (edge(json!([{"name": "a", "ports": [80], "replica": 2}])), "replica"),
        (
            edge(json!([{"name": "a", "ports": [80], "service": {"type": "ExternalName"}}])),
            "type",
        ),
        (
            edge(json!([{"name": "a", "ports": [80], "service": {"type": "ClusterIP", "nodePorts": {"80": 30080}}}])),
            "need type LoadBalancer or NodePort",
        ),
        (
            edge(json!([{"name": "a", "ports": [80], "service": {"nodePorts": {"81": 30081}}}])),
            "not one of its ports",
        ),
        (
            edge(json!([{"name": "a", "ports": [80], "hpa": {"minReplicas": 3, "maxReplicas": 2}}])),
            "minReplicas is above maxReplicas",
        ),
        (
            edge(json!([{"name": "a", "ports": [80], "hpa": {"maxReplicas": 2}}])),
            "minReplicas",
        ),
        (
            edge(json!([{"name": "a", "ports": [80], "certificateNamespaces": []}])),
            "certificateNamespaces",
        ),
        (json!({"edge": {"enabled": true, "gateway": []}}), "gateway"),
    ];
    for (values, needle) in cases {
        match render_raw(&values, false) {
            Ok(_) => panic!("the chart accepted {values}"),
            Err(e) => assert!(e.contains(needle), "refusing {values} should name {needle}: {e}"),
        }
    }
}

/// Runs container `c`'s command line, its `$(VAR)`s replaced by `expand`, with an unknown flag at the end: the
/// binary must parse every flag the chart gave it and stop at that one.
fn assert_command_line_parses(ctx: &str, c: &Container, expand: impl Fn(&str) -> String) {
    const PROBE: &str = "--aether-chart-test-unknown-flag";
    let command = c
        .command
        .as_ref()
        .unwrap_or_else(|| panic!("{ctx}/{}: no command", c.name));
    let args: Vec<String> = c.args.iter().flatten().map(|a| expand(a)).collect();
    for a in &args {
        assert!(!a.contains("$("), "{ctx}/{}: {a} refers to an unknown variable", c.name);
    }
    let out = Command::new(aether_tests::binary(&command[0]))
        .args(&command[1..])
        .args(&args)
        .arg(PROBE)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .output()
        .expect("run the binary");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains(&format!("unexpected argument '{PROBE}'")),
        "{ctx}/{}: `{} {}` did not parse up to the probe flag:\n{stderr}",
        c.name,
        command.join(" "),
        args.join(" ")
    );
}

/// The edge's, the controller's and the registrar's command lines with the edge on parse, as in
/// [`every_command_line_the_chart_renders_is_one_the_binary_parses`].
#[test]
fn every_edge_command_line_is_one_the_binary_parses() {
    let expand = |arg: &str| {
        arg.replace("$(POD_NAME)", "aether-edge-public-5d8f-x2x9q")
            .replace("$(POD_NAMESPACE)", "aether-system")
    };
    let mut checked = 0;
    for identity in IDENTITIES {
        let base = if identity == "spire" {
            values("kubernetes", "spire")
        } else {
            json!({})
        };
        let r = render(with_edge(base, json!([public_gateway()])));
        let edge_spec = pod_spec(&r, "aether-edge-public");
        let controller = container(pod_spec(&r, "aether-controller"), "controller");
        let registrar = container(pod_spec(&r, "aether-registrar"), "registrar");
        for c in containers(edge_spec).chain([controller, registrar]) {
            assert_command_line_parses(identity, c, expand);
            checked += 1;
        }
    }
    assert_eq!(
        checked,
        IDENTITIES.len() * 4,
        "edge, proxy, controller, registrar per identity"
    );
}
