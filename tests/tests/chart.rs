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

fn values(store: &str, identity: &str) -> Value {
    let replicas = if store == "embedded" { 1 } else { 2 };
    json!({
        "identity": {"provider": identity},
        "otel": {"enabled": true, "endpoint": "http://otel-collector.observability:4317"},
        "registrar": {
            "replicas": replicas,
            "store": {
                "type": store,
                "etcd": {"endpoints": ["http://etcd-0.etcd:2379", "http://etcd-1.etcd:2379"]},
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

fn assert_invariants(r: &Rendered, store: &str, identity: &str) {
    let ctx = format!("store={store} identity={identity}");

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
    if store == "dynamodb" {
        let from = rc.env_from.as_ref().expect("dynamodb credentials");
        assert_eq!(from[0].secret_ref.as_ref().map(|s| s.name.as_str()), Some("aws-creds"));
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
    // The Kubernetes store keeps its VIPs in one ConfigMap: the only namespaced write anywhere in the chart, and
    // every verb but `create` (which cannot be scoped by name) is limited to that ConfigMap.
    if store == "kubernetes" {
        assert_eq!(r.roles.len(), 1, "{ctx}: the registrar's VIP ConfigMap Role");
        assert_eq!(r.role_bindings.len(), 1, "{ctx}");
        let vip_map = format!("{}/aether-registrar-vips", "aether-system");
        assert_eq!(arg(rc, "--kube-vip-configmap"), Some(vip_map.as_str()), "{ctx}");
        for rule in r.roles[0].rules.iter().flatten() {
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
            r.roles.is_empty() && r.role_bindings.is_empty(),
            "{ctx}: no Role without the Kubernetes store"
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

    // OpenTelemetry flags reach every binary.
    for (pod, spec) in r.pod_specs() {
        for c in spec.containers.iter() {
            assert_eq!(
                arg(c, "--otlp-endpoint"),
                Some("http://otel-collector.observability:4317"),
                "{ctx}: {pod}/{}",
                c.name
            );
        }
    }
}

#[test]
fn default_values_render_lint_clean_and_hold_the_invariants() {
    let r = render(json!({}));
    assert_invariants_default(&r);
}

fn assert_invariants_default(r: &Rendered) {
    // Defaults: the Kubernetes store (no extra infrastructure, active/active) and the built-in CA.
    let registrar = r.registrar();
    let rc = &registrar
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .as_ref()
        .unwrap()
        .containers[0];
    assert_eq!(arg(rc, "--store"), Some("kubernetes"));
    assert_eq!(registrar.spec.as_ref().unwrap().replicas, Some(2));
    let agent = r.daemon_set("aether-agent");
    let ac = &agent.spec.as_ref().unwrap().template.spec.as_ref().unwrap().containers[0];
    assert_eq!(arg(ac, "--identity"), Some("builtin"));
    assert_eq!(arg(ac, "--otlp-endpoint"), None, "OTLP is off by default");
}

#[test]
fn every_store_and_identity_combination_renders_and_holds_the_invariants() {
    for store in STORES {
        for identity in IDENTITIES {
            let r = render(values(store, identity));
            assert_invariants(&r, store, identity);
        }
    }
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

/// Every flag the chart passes to a binary is one that binary's `--help` lists, for every combination: the chart
/// and the binaries cannot drift apart unnoticed.
#[test]
fn every_flag_the_chart_passes_is_one_the_binary_accepts() {
    let mut help_cache: std::collections::BTreeMap<Vec<String>, String> = Default::default();
    for store in STORES {
        for identity in IDENTITIES {
            let r = render(values(store, identity));
            for (pod, spec) in r.pod_specs() {
                for c in containers(spec) {
                    let command = c
                        .command
                        .as_ref()
                        .unwrap_or_else(|| panic!("{pod}/{}: no command", c.name));
                    let args = c.args.clone().unwrap_or_default();
                    let subcommands: Vec<String> = args.iter().take_while(|a| !a.starts_with('-')).cloned().collect();
                    let mut key = command.clone();
                    key.extend(subcommands.iter().cloned());
                    let help = help_cache.entry(key).or_insert_with(|| {
                        let out = Command::new(aether_tests::binary(&command[0]))
                            .args(&subcommands)
                            .arg("--help")
                            .output()
                            .expect("run --help");
                        assert!(out.status.success(), "{command:?} {subcommands:?} --help failed");
                        String::from_utf8_lossy(&out.stdout).into_owned()
                    });
                    for flag in args.iter().skip(subcommands.len()) {
                        let name = flag.split('=').next().unwrap();
                        assert!(name.starts_with("--"), "{pod}/{}: {flag} is not a --flag", c.name);
                        let listed = help.lines().any(|line| {
                            line.split(|ch: char| ch.is_whitespace() || ch == ',' || ch == '=' || ch == '<')
                                .any(|word| word == name)
                        });
                        assert!(
                            listed,
                            "{pod}/{}: `{} {}` does not accept {name} (store={store} identity={identity})",
                            c.name,
                            command.join(" "),
                            subcommands.join(" ")
                        );
                    }
                }
            }
        }
    }
}
