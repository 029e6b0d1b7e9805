//! The Helm chart (`charts/aether`), linted and rendered by Helm's own code (helm-python-sdk, which embeds Helm v4:
//! no `helm` binary is installable here) for the default values and every store × identity combination. Every
//! rendered object must deserialize into its k8s-openapi type without losing a field (so a misspelt key fails), and
//! the invariants the product relies on are asserted on the typed objects.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;

use aether_tests::envoy::workspace_root;
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{Container, PersistentVolumeClaim, PodSpec, Service, ServiceAccount};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use serde_json::{Value, json};

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

/// Runs scripts/render-chart.py: `Ok(objects)` or `Err(helm's error)` for a values set the chart refuses.
/// With `lint_clean`, `helm lint --strict` must report nothing above info level.
fn render_raw(values: &Value, lint_clean: bool) -> Result<Vec<Value>, String> {
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
        None => Ok(report["objects"]
            .as_array()
            .expect("objects")
            .iter()
            .map(|o| o["object"].clone())
            .collect()),
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

fn strip_nulls(value: Value) -> Value {
    match value {
        Value::Object(map) => Value::Object(
            map.into_iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| (k, strip_nulls(v)))
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.into_iter().map(strip_nulls).collect()),
        other => other,
    }
}

fn render(values: Value) -> Rendered {
    let objects = render_raw(&values, true).unwrap_or_else(|e| panic!("the chart refused {values}: {e}"));
    let mut r = Rendered::default();
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
            other => panic!("unexpected kind {other} rendered: {object:#}"),
        }
    }
    r
}

/// Memory limits set by [`values`] per component, to check that `resources` values are applied.
const LIMITS: [(&str, &str); 4] = [
    ("aether-agent", "300Mi"),
    ("aether-proxy", "900Mi"),
    ("aether-mesh-dns", "80Mi"),
    ("aether-registrar", "700Mi"),
];

fn values(store: &str, identity: &str) -> Value {
    let replicas = if store == "embedded" { 1 } else { 2 };
    let limits = |name: &str| json!({"limits": {"memory": LIMITS.iter().find(|(n, _)| *n == name).unwrap().1}});
    json!({
        "agent": {"resources": limits("aether-agent")},
        "proxy": {"resources": limits("aether-proxy")},
        "meshDns": {"resources": limits("aether-mesh-dns")},
        "identity": {"provider": identity},
        "otel": {"enabled": true, "endpoint": "http://otel-collector.observability:4317"},
        "registrar": {
            "resources": limits("aether-registrar"),
            "replicas": replicas,
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

    fn registrar(&self) -> &Deployment {
        assert_eq!(self.deployments.len(), 1, "exactly one Deployment (the registrar)");
        &self.deployments[0]
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

    // Every container: no privilege, nothing but the named capabilities, a memory limit, a read-only root.
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

    // The agent: host network, readiness gated on its admin /ready, the CNI installer as a native sidecar, and
    // only NET_ADMIN + SYS_ADMIN (nftables and setns into pod netns).
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
    assert_eq!(
        arg(agent_c, "--registrar"),
        Some("http://aether-registrar.aether-system.svc:18090"),
        "{ctx}"
    );

    // The proxy: surge rollout for hot-restart handoff, the supervisor as PID 1, Envoy admin on loopback.
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

    // mesh-dns: its own DaemonSet, non-root, no capabilities, surge roll (SO_REUSEPORT overlap).
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

    // The registrar: replicas per store, the store flag, credentials only by Secret.
    let registrar = r.registrar();
    let rspec = registrar.spec.as_ref().unwrap();
    let rc = &rspec.template.spec.as_ref().unwrap().containers[0];
    assert_eq!(arg(rc, "--store"), Some(store), "{ctx}");
    let want_replicas = if store == "embedded" { 1 } else { 2 };
    assert_eq!(rspec.replicas, Some(want_replicas), "{ctx}");
    assert_eq!(
        r.pdbs.len(),
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
        // TLS material from a Secret volume readable by the registrar's group only, at the paths the flags name.
        let rspec = rspec.template.spec.as_ref().unwrap();
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
    assert_eq!(r.services.len(), 1, "{ctx}: one Service, the registrar's");

    // RBAC: read-only, only what each component reads, never Secrets.
    for role in &r.cluster_roles {
        for rule in role.rules.iter().flatten() {
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
    let mut want = BTreeSet::from(["aether-agent"]);
    if store == "kubernetes" {
        want.insert("aether-registrar");
    }
    assert_eq!(role_names, want, "{ctx}: ClusterRoles");
    assert_eq!(r.cluster_role_bindings.len(), want.len(), "{ctx}");
    // The agent's CNI installer reads its own DaemonSet (uninstall or rollout?), by name, nothing else.
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
    assert_eq!(
        arg(install, "--owner-daemonset"),
        Some("aether-system/aether-agent"),
        "{ctx}: the installer names its own DaemonSet"
    );
    let registrar_roles: Vec<&Role> = r.roles.iter().filter(|role| !std::ptr::eq(*role, agent_role)).collect();
    // The Kubernetes store keeps its VIPs in one ConfigMap: the only namespaced write anywhere in the chart, and
    // every verb but `create` (which cannot be scoped by name) is limited to that ConfigMap.
    if store == "kubernetes" {
        assert_eq!(registrar_roles.len(), 1, "{ctx}: the registrar's VIP ConfigMap Role");
        assert_eq!(r.role_bindings.len(), 2, "{ctx}");
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
    } else {
        assert!(
            registrar_roles.is_empty() && r.role_bindings.len() == 1,
            "{ctx}: no registrar Role without the Kubernetes store"
        );
    }
    for sa in &r.service_accounts {
        let name = sa.metadata.name.as_deref().unwrap();
        let talks_to_api = name == "aether-agent" || (name == "aether-registrar" && store == "kubernetes");
        assert_eq!(
            sa.automount_service_account_token,
            Some(talks_to_api),
            "{ctx}: {name} token"
        );
    }

    // OpenTelemetry flags reach every binary (when on).
    for (pod, spec) in r.pod_specs() {
        for c in spec.containers.iter() {
            let want = otel.then_some("http://otel-collector.observability:4317");
            assert_eq!(arg(c, "--otlp-endpoint"), want, "{ctx}: {pod}/{}", c.name);
            assert_eq!(has_flag(c, "--otel-enabled"), otel, "{ctx}: {pod}/{}", c.name);
        }
    }

    assert_wiring(r, &ctx);
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
    // Host-network pods rolled with a surge: readiness is a file in the pod's own volume, not the shared port.
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

/// Defaults: the Kubernetes store (no extra infrastructure, active/active), the built-in CA, OTLP off.
#[test]
fn default_values_render_lint_clean_and_hold_the_invariants() {
    let r = render(json!({}));
    assert_invariants(&r, "kubernetes", "builtin", false);
}

#[test]
fn every_store_and_identity_combination_renders_and_holds_the_invariants() {
    for store in STORES {
        for identity in IDENTITIES {
            let r = render(values(store, identity));
            assert_invariants(&r, store, identity, true);
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
    ];
    for (values, needle) in cases {
        match render_raw(&values, false) {
            Ok(_) => panic!("the chart accepted {values}"),
            Err(e) => assert!(e.contains(needle), "refusing {values} should name {needle}: {e}"),
        }
    }
}

/// Every command line the chart gives a binary is one that binary parses, for the defaults and every combination:
/// the binary runs with the rendered arguments (kubelet's `$(VAR)` expansion done with plausible values) plus one
/// unknown flag at the end, so it must get through every rendered argument and stop exactly at that one. A flag that
/// does not exist, takes no value or gets a malformed one fails here, as it would on the node.
#[test]
fn every_command_line_the_chart_renders_is_one_the_binary_parses() {
    const PROBE: &str = "--aether-chart-test-unknown-flag";
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
                let command = c
                    .command
                    .as_ref()
                    .unwrap_or_else(|| panic!("{pod}/{}: no command", c.name));
                let args: Vec<String> = c.args.iter().flatten().map(|a| expand(a)).collect();
                for a in &args {
                    assert!(
                        !a.contains("$("),
                        "{ctx}: {pod}/{}: {a} refers to an unknown variable",
                        c.name
                    );
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
                    "{ctx}: {pod}/{}: `{} {}` did not parse up to the probe flag:\n{stderr}",
                    c.name,
                    command.join(" "),
                    args.join(" ")
                );
                checked += 1;
            }
        }
    }
    assert_eq!(
        checked,
        renders.len() * 5,
        "agent, cni-install, proxy, mesh-dns, registrar per render"
    );
}
