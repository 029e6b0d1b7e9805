//! A whole node of the mesh for end-to-end tests: the registrar binary (embedded
//! store), `aether-agent run` with the static pod source, and a real Envoy fed by
//! the agent over its xDS socket; pods are network namespaces on a bridge.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use aether_proto::cni::v1::cni_plugin_client::CniPluginClient;
use aether_proto::cni::v1::{
    AddPodRequest, AddPodResponse, CheckPodRequest, CheckPodResponse, PodRef, RemovePodRequest, RemovePodResponse,
};
use serde_json::json;
use tonic::transport::{Channel, Endpoint};

use std::sync::Arc;

use crate::control_plane::ControlPlane;
use crate::identity::TestCa;
use crate::spire::FakeSpire;
use crate::{
    ChildGuard, Envoy, HttpServer, TestNode, TestPod, admin_address_json, binary, free_port, http_get, unique_base_id,
};

/// Where the test pods' apps listen, inside their netns.
pub const APP: &str = "127.0.0.1:8080";

pub const NAMESPACE: &str = "demo";
pub const MESH_DOMAIN: &str = "aether.internal";
/// The node Envoy's drain time: `aether-agent proxy --drain-time`'s default. A chain that changes
/// (an inbound filter added) reaches its open connections when they drain, within this.
pub const ENVOY_DRAIN_TIME: std::time::Duration = std::time::Duration::from_secs(10);

pub struct Mesh {
    pub dir: tempfile::TempDir,
    pub node: TestNode,
    pub registrar: ChildGuard,
    pub registrar_url: String,
    pub registrar_admin: SocketAddr,
    pub agent: Option<ChildGuard>,
    pub agent_admin: SocketAddr,
    pub envoy: Option<Envoy>,
    /// Extra flags for `aether-agent run`.
    pub agent_args: Vec<String>,
    /// The agent's registrar link flags (its CA, the registrar's name, its bootstrap token).
    pub link_args: Vec<String>,
    /// Envoy's ADS flavour: `DELTA_GRPC` (default) or `GRPC` (state of the world).
    pub ads_api: &'static str,
    /// Envoy run by `aether-agent proxy` from the shipped bootstrap ([`Mesh::start_with_proxy`]).
    pub proxy: Option<crate::supervisor::ProxySupervisor>,
    /// The mesh's CA (the built-in provider's files, or what the fake SPIRE signs with).
    pub ca: Arc<TestCa>,
    /// The fake SPIRE agent, with `MeshIdentity::Spire`.
    pub spire: Option<FakeSpire>,
    /// The registrar's mTLS: its certificate, the node CA, the fake API server that
    /// reviews the agent's bootstrap token.
    pub control_plane: ControlPlane,
}

/// How the mesh's pods get their identity.
#[derive(Clone, Copy, Debug)]
pub enum MeshIdentity {
    /// The built-in CA (the product default), SVIDs valid for the TTL.
    Builtin { ttl: Duration },
    /// A fake SPIRE agent's Delegated Identity API issuing SVIDs valid for the TTL.
    Spire { ttl: Duration },
    /// `--identity none`: plaintext between pods (NOT FOR PRODUCTION; benches, stand-ins).
    Plaintext,
}

impl MeshIdentity {
    pub const DEFAULT: Self = Self::Builtin {
        ttl: Duration::from_secs(3600),
    };
}

/// How the mesh's agent gets its node certificate (what it presents to the registrar).
#[derive(Clone, Debug)]
pub enum NodeIdentity {
    /// The registrar's bootstrap, with a token the fake API server vouches for (the default).
    Bootstrap,
    /// `--node-identity spire`: its own SVID from the SPIFFE Workload API at this socket.
    Spire { workload_socket: PathBuf },
}

impl NodeIdentity {
    /// The agent's link flags: the control plane's bootstrap ones, or with SPIRE the same
    /// registrar CA and name but the node identity from the Workload API.
    fn link_args(&self, bootstrap: Vec<String>) -> Vec<String> {
        let NodeIdentity::Spire { workload_socket } = self else {
            return bootstrap;
        };
        let mut args: Vec<String> = bootstrap
            .chunks(2)
            .filter(|pair| !matches!(pair[0].as_str(), "--node-identity" | "--bootstrap-token"))
            .flatten()
            .cloned()
            .collect();
        args.extend(["--node-identity".into(), "spire".into()]);
        args.extend(["--spire-workload-socket".into(), workload_socket.display().to_string()]);
        args
    }
}

impl Mesh {
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    pub fn cni_socket(&self) -> PathBuf {
        self.path("run/cni.sock")
    }

    pub fn xds_socket(&self) -> PathBuf {
        self.path("run/xds.sock")
    }

    /// Registrar and agent running, Envoy connected and ready.
    pub async fn start() -> Mesh {
        Self::start_with(&[]).await
    }

    /// [`Mesh::start`] with extra agent flags (mTLS with the built-in CA unless they
    /// name `--identity`).
    pub async fn start_with(agent_args: &[&str]) -> Mesh {
        Self::start_identity(MeshIdentity::DEFAULT, agent_args).await
    }

    /// [`Mesh::start`] with plaintext between pods (`--identity none`).
    pub async fn start_plaintext() -> Mesh {
        Self::start_identity(MeshIdentity::Plaintext, &[]).await
    }

    /// [`Mesh::start`] with the given identity provider and extra agent flags.
    pub async fn start_identity(identity: MeshIdentity, agent_args: &[&str]) -> Mesh {
        Self::start_all(identity, agent_args, &[]).await
    }

    /// [`Mesh::start_with`], with extra flags for the registrar too.
    pub async fn start_with_registrar(agent_args: &[&str], registrar_args: &[&str]) -> Mesh {
        Self::start_all(MeshIdentity::DEFAULT, agent_args, registrar_args).await
    }

    async fn start_all(identity: MeshIdentity, agent_args: &[&str], registrar_args: &[&str]) -> Mesh {
        Self::start_node_identity(identity, NodeIdentity::Bootstrap, agent_args, registrar_args).await
    }

    /// [`Mesh::start_identity`] with the agent's node certificate from `node_identity`
    /// and extra registrar flags (with SPIRE: `--client-ca` holding SPIRE's bundle).
    pub async fn start_node_identity(
        identity: MeshIdentity,
        node_identity: NodeIdentity,
        agent_args: &[&str],
        registrar_args: &[&str],
    ) -> Mesh {
        crate::require_root();
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("pods")).unwrap();
        let ca = Arc::new(TestCa::new("aether test CA"));
        let mut spire = None;
        let mut args: Vec<String> = Vec::new();
        if !agent_args.contains(&"--identity") {
            let td = crate::identity::TRUST_DOMAIN.to_string();
            match identity {
                MeshIdentity::Builtin { ttl } => {
                    let (cert, key) = ca.write(&dir.path().join("ca"));
                    args.extend(["--identity".into(), "builtin".into(), "--trust-domain".into(), td]);
                    args.extend(["--ca-cert".into(), cert.display().to_string()]);
                    args.extend(["--ca-key".into(), key.display().to_string()]);
                    args.extend(["--svid-ttl".into(), format!("{}ms", ttl.as_millis())]);
                }
                MeshIdentity::Spire { ttl } => {
                    let fake = FakeSpire::start(dir.path(), ca.clone(), ttl);
                    args.extend(["--identity".into(), "spire".into(), "--trust-domain".into(), td]);
                    args.extend(["--spire-admin-socket".into(), fake.socket.display().to_string()]);
                    spire = Some(fake);
                }
                MeshIdentity::Plaintext => args.extend(["--identity".into(), "none".into()]),
            }
        }
        args.extend(agent_args.iter().map(|a| a.to_string()));
        let control_plane = ControlPlane::new(dir.path());
        let link_args = node_identity.link_args(control_plane.agent_args("test-node"));
        // Tests and benches register stand-in endpoints straight at the registrar, with no
        // agent to refresh them: they must outlive a long run (agents refresh theirs).
        let mut extra = vec!["--endpoint-ttl", "1h"];
        extra.extend_from_slice(registrar_args);
        let registrar = control_plane
            .spawn_registrar(&dir.path().join("registrar"), &extra)
            .await;
        let mut mesh = Mesh {
            node: TestNode::new(),
            registrar: registrar.child,
            registrar_url: registrar.url,
            registrar_admin: registrar.admin,
            agent: None,
            agent_admin: format!("127.0.0.1:{}", free_port()).parse().unwrap(),
            envoy: None,
            agent_args: args,
            link_args,
            ads_api: "DELTA_GRPC",
            proxy: None,
            ca,
            spire,
            control_plane,
            dir,
        };
        mesh.start_agent().await;
        mesh.start_envoy();
        mesh
    }

    /// [`Mesh::start`] with Envoy on state-of-the-world ADS.
    pub async fn start_sotw() -> Mesh {
        let mut mesh = Self::start_with(&[]).await;
        mesh.envoy = None;
        mesh.ads_api = "GRPC";
        mesh.start_envoy();
        mesh
    }

    pub async fn start_agent(&mut self) {
        let mut cmd = Command::new(binary("aether-agent"));
        cmd.arg("run")
            .args(["--node-name", "test-node", "--registrar", &self.registrar_url])
            .arg("--state-dir")
            .arg(self.path("state"))
            .arg("--cni-socket")
            .arg(self.cni_socket())
            .arg("--xds-socket")
            .arg(self.xds_socket())
            .args(["--admin", &self.agent_admin.to_string()])
            .arg("--pod-dir")
            .arg(self.path("pods"))
            .args(["--zone", "z1", "--region", "r1"])
            .args(&self.agent_args)
            .args(&self.link_args)
            .env("RUST_LOG", "info,aether_agent=debug");
        let agent = ChildGuard::spawn("agent", cmd);
        wait_ready(self.agent_admin, &agent).await;
        self.agent = Some(agent);
    }

    /// Starts the node's Envoy with the drain time `aether-agent proxy` gives it in production, so a
    /// changed chain's open connections close when they would on a real node.
    pub fn start_envoy(&mut self) {
        let bootstrap = self.envoy_bootstrap(free_port());
        let drain = ENVOY_DRAIN_TIME.as_secs().to_string();
        self.envoy = Some(Envoy::start_with_args(
            &bootstrap,
            unique_base_id(),
            &["--drain-time-s", &drain],
        ));
    }

    /// The bootstrap [`Mesh::start_envoy`] runs, with Envoy's admin on `127.0.0.1:admin_port` (tests add stats
    /// config to it).
    pub fn envoy_bootstrap(&self, admin_port: u16) -> serde_json::Value {
        json!({
            "node": {"id": "test-node", "cluster": "aether"},
            "admin": admin_address_json(admin_port),
            // As proxy/bootstrap.yaml: a cluster's traffic stats are created when first used.
            "deferred_stat_options": {"enable_deferred_creation_stats": true},
            // As proxy/bootstrap.yaml: route regexes up to the agent's RE2 budget compile.
            "layered_runtime": {"layers": [
                {"name": "static", "static_layer": {
                    "re2.max_program_size.error_level": 1000,
                    "re2.max_program_size.warn_level": 500
                }},
                {"name": "admin", "admin_layer": {}}
            ]},
            "bootstrap_extensions": [{"name": "envoy.bootstrap.internal_listener", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.bootstrap.internal_listener.v3.InternalListener"
            }}],
            "dynamic_resources": {
                "ads_config": {
                    "api_type": self.ads_api,
                    "transport_api_version": "V3",
                    "grpc_services": [{"envoy_grpc": {"cluster_name": "aether_xds"}}],
                    "set_node_on_first_message_only": true
                },
                "cds_config": {"ads": {}, "resource_api_version": "V3"},
                "lds_config": {"ads": {}, "resource_api_version": "V3"}
            },
            "static_resources": {"clusters": [{
                "name": "aether_xds",
                "type": "STATIC",
                "connect_timeout": "1s",
                "typed_extension_protocol_options": {
                    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                        "explicit_http_config": {"http2_protocol_options": {}}
                    }
                },
                "load_assignment": {"cluster_name": "aether_xds", "endpoints": [{"lb_endpoints": [{"endpoint": {
                    "address": {"pipe": {"path": self.xds_socket().to_string_lossy()}}
                }}]}]}
            }]}
        })
    }

    /// Registrar and agent running, and Envoy run by the supervisor (`aether-agent proxy`) from the shipped
    /// bootstrap template, LIVE at epoch 0 (instead of the test-built bootstrap of [`Mesh::start`]).
    pub async fn start_with_proxy(agent_args: &[&str]) -> Mesh {
        let mut mesh = Self::start_with(agent_args).await;
        mesh.envoy = None;
        mesh.start_proxy().await;
        mesh
    }

    /// The supervisor options this mesh uses: its xDS socket, node name, state dir and template copy under
    /// `<dir>/proxy/`. A successor supervisor uses [`crate::supervisor::ProxyOptions::successor`] of these.
    pub fn proxy_options(&self) -> crate::supervisor::ProxyOptions {
        match &self.proxy {
            Some(proxy) => proxy.options.clone(),
            None => crate::supervisor::ProxyOptions::new(&self.path("proxy"), "test-node", &self.xds_socket()),
        }
    }

    /// Starts the supervisor with [`Mesh::proxy_options`] and waits for epoch 0 LIVE.
    pub async fn start_proxy(&mut self) {
        let options = self.proxy_options();
        self.proxy = Some(crate::supervisor::ProxySupervisor::start(&options, 0).await);
    }

    pub fn envoy(&self) -> &Envoy {
        self.envoy.as_ref().expect("envoy running")
    }

    /// Writes the pod's manifest for the static pod source.
    pub fn describe_pod(
        &self,
        pod: &TestPod,
        name: &str,
        service_account: &str,
        upstreams: &str,
        ports: &[(&str, u16)],
    ) {
        self.save_manifest(name, manifest(pod, name, service_account, upstreams, ports));
    }

    /// [`Mesh::describe_pod`] in another namespace.
    pub fn describe_pod_in(
        &self,
        namespace: &str,
        pod: &TestPod,
        name: &str,
        service_account: &str,
        upstreams: &str,
        ports: &[(&str, u16)],
    ) {
        let mut manifest = manifest(pod, name, service_account, upstreams, ports);
        manifest["metadata"]["namespace"] = json!(namespace);
        self.save_manifest(name, manifest);
    }

    /// [`Mesh::describe_pod`] with more annotations.
    pub fn describe_pod_annotated(
        &self,
        pod: &TestPod,
        name: &str,
        service_account: &str,
        ports: &[(&str, u16)],
        annotations: &[(&str, &str)],
    ) {
        let mut manifest = manifest(pod, name, service_account, "", ports);
        for (key, value) in annotations {
            manifest["metadata"]["annotations"][*key] = json!(value);
        }
        self.save_manifest(name, manifest);
    }

    /// The uid the pod's manifest gives it.
    pub fn pod_uid(pod: &TestPod) -> String {
        format!("uid-{}", pod.netns_name())
    }

    /// The pod's manifest with a deletionTimestamp: it is terminating.
    pub fn describe_terminating_pod(&self, pod: &TestPod, name: &str, service_account: &str, ports: &[(&str, u16)]) {
        let mut manifest = manifest(pod, name, service_account, "", ports);
        manifest["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
        self.save_manifest(name, manifest);
    }

    fn save_manifest(&self, name: &str, manifest: serde_json::Value) {
        std::fs::write(
            self.path(&format!("pods/{name}.json")),
            serde_json::to_vec(&manifest).unwrap(),
        )
        .unwrap();
    }

    pub async fn cni(&self) -> CniPluginClient<Channel> {
        let channel = Endpoint::from_shared(format!("unix:{}", self.cni_socket().display()))
            .unwrap()
            .connect()
            .await
            .expect("connecting to the agent's CNI socket");
        CniPluginClient::new(channel)
    }

    /// AddPod that must succeed; on failure the panic carries the agent's log.
    pub async fn add_pod_ok(&self, pod: &TestPod, name: &str) {
        let added = self.add_pod(pod, name).await.unwrap_or_else(|s| {
            let logs = self.agent.as_ref().map(ChildGuard::logs).unwrap_or_default();
            panic!("AddPod {name}: {s:?}\nagent:\n{logs}")
        });
        assert_eq!(
            added.outcome,
            aether_proto::cni::v1::Outcome::Success as i32,
            "{added:?}"
        );
    }

    /// The usual two-pod mesh: `frontend` (upstreams: backend) and one `backend` replica, each serving HTTP on
    /// [`APP`] (echoing its pod name), described and added (backend first).
    pub async fn frontend_and_backend(&self) -> (TestPod, TestPod, Vec<HttpServer>) {
        let frontend = self.node.add_pod("frontend");
        let backend = self.node.add_pod("backend");
        let apps = vec![
            frontend.serve_http(APP.parse().unwrap(), "frontend"),
            backend.serve_http(APP.parse().unwrap(), "backend"),
        ];
        self.describe_pod(&frontend, "frontend", "frontend", "backend", &[("http", 8080)]);
        self.describe_pod(&backend, "backend", "backend", "", &[("http", 8080)]);
        self.add_pod_ok(&backend, "backend").await;
        self.add_pod_ok(&frontend, "frontend").await;
        (frontend, backend, apps)
    }

    pub async fn add_pod(&self, pod: &TestPod, name: &str) -> Result<AddPodResponse, tonic::Status> {
        self.add_pod_in(NAMESPACE, pod, name).await
    }

    /// [`Mesh::add_pod`] in another namespace.
    pub async fn add_pod_in(
        &self,
        namespace: &str,
        pod: &TestPod,
        name: &str,
    ) -> Result<AddPodResponse, tonic::Status> {
        self.cni()
            .await
            .add_pod(AddPodRequest {
                container_id: format!("sandbox-{}", pod.netns_name()),
                netns_path: pod.netns_path().to_string_lossy().into(),
                interface_name: "eth0".into(),
                pod: Some(PodRef {
                    namespace: namespace.into(),
                    name: name.into(),
                    uid: format!("uid-{}", pod.netns_name()),
                }),
                ips: vec![pod.ip().to_string()],
                capture: None,
            })
            .await
            .map(|r| r.into_inner())
    }

    pub async fn remove_pod(&self, pod: &TestPod, name: &str) -> Result<RemovePodResponse, tonic::Status> {
        self.cni()
            .await
            .remove_pod(RemovePodRequest {
                container_id: format!("sandbox-{}", pod.netns_name()),
                pod: Some(PodRef {
                    namespace: NAMESPACE.into(),
                    name: name.into(),
                    uid: String::new(),
                }),
            })
            .await
            .map(|r| r.into_inner())
    }

    pub async fn check_pod(&self, pod: &TestPod, name: &str) -> Result<CheckPodResponse, tonic::Status> {
        self.cni()
            .await
            .check_pod(CheckPodRequest {
                container_id: format!("sandbox-{}", pod.netns_name()),
                netns_path: pod.netns_path().to_string_lossy().into(),
                pod: Some(PodRef {
                    namespace: NAMESPACE.into(),
                    name: name.into(),
                    uid: format!("uid-{}", pod.netns_name()),
                }),
            })
            .await
            .map(|r| r.into_inner())
    }

    /// Points this mesh's agent (at its next start) at `other`'s registrar, with a
    /// bootstrap token `other`'s API server vouches for.
    pub fn use_registrar_of(&mut self, other: &Mesh) {
        self.registrar_url = other.registrar_url.clone();
        self.link_args = other.control_plane.agent_args("test-node");
    }

    /// A registrar client with the tests' reader identity (List, Watch).
    pub async fn registrar(&self) -> aether_proto::registrar::v1::registrar_client::RegistrarClient<Channel> {
        self.control_plane.reader(&self.registrar_url).await
    }

    /// A registrar client acting as the agent of `node`: it may register endpoints of
    /// that node (stand-ins for pods elsewhere).
    pub async fn registrar_as(
        &self,
        node: &str,
    ) -> aether_proto::registrar::v1::registrar_client::RegistrarClient<Channel> {
        self.control_plane.client_as(&self.registrar_url, node).await
    }

    /// The mesh VIP of `demo/<service>`.
    pub async fn vip(&self, service: &str) -> String {
        self.registrar()
            .await
            .list_endpoints(aether_proto::registrar::v1::ListEndpointsRequest {
                service: format!("{NAMESPACE}/{service}"),
            })
            .await
            .expect("list endpoints")
            .into_inner()
            .service
            .expect("service")
            .vip
    }

    /// `aether <args>` (the CLI binary) against this mesh's agent: its stdout.
    pub async fn aether(&self, args: &[&str]) -> String {
        let out = tokio::process::Command::new(crate::binary("aether"))
            .args(["--agent", &self.agent_admin.to_string()])
            .args(args)
            .output()
            .await
            .expect("running aether");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `aether -o json explain <pod> <target>` against this mesh's agent.
    pub async fn explain(&self, pod: &str, target: &str) -> serde_json::Value {
        let out = self.aether(&["-o", "json", "explain", pod, target]).await;
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("explain: {e}: {out}"))
    }

    pub async fn agent_get(&self, path: &str) -> String {
        http_get(&format!("http://{}{path}", self.agent_admin), None)
            .await
            .expect("agent admin")
            .body
    }

    /// The names of Envoy's dynamic clusters, sorted.
    pub fn envoy_clusters(&self) -> Vec<String> {
        let dump = self.envoy().config_dump();
        let mut names = Vec::new();
        for config in dump["configs"].as_array().into_iter().flatten() {
            for c in config["dynamic_active_clusters"].as_array().into_iter().flatten() {
                names.push(c["cluster"]["name"].as_str().unwrap_or_default().to_owned());
            }
        }
        names.sort();
        names
    }
}

/// A managed pod in [`NAMESPACE`] for the static pod source.
fn manifest(
    pod: &TestPod,
    name: &str,
    service_account: &str,
    upstreams: &str,
    ports: &[(&str, u16)],
) -> serde_json::Value {
    let ports: Vec<_> = ports
        .iter()
        .map(|(n, p)| json!({"name": n, "containerPort": p}))
        .collect();
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": name, "namespace": NAMESPACE, "uid": Mesh::pod_uid(pod),
            "labels": {"aether.io/managed": "true"},
            "annotations": {"config.aether.io/upstreams": upstreams}
        },
        "spec": {"serviceAccountName": service_account, "containers": [{"name": "app", "ports": ports}]}
    })
}

pub fn fqdn(service: &str) -> String {
    format!("{service}.{NAMESPACE}.{MESH_DOMAIN}")
}

/// Until `admin`'s /ready answers 200 (20 s at most; the child's log on failure).
pub async fn wait_ready(admin: SocketAddr, child: &ChildGuard) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(reply) = http_get(&format!("http://{admin}/ready"), None).await
            && reply.status == 200
        {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{} did not become ready:\n{}",
            child.name(),
            child.logs()
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Writes `yaml` to `file` in a config directory the way an editor would (a rename, so the
/// registrar never reads half a file), or with `None` removes it.
pub fn put_config(dir: &std::path::Path, file: &str, yaml: Option<&str>) {
    let path = dir.join(file);
    match yaml {
        Some(yaml) => {
            let staged = dir.join(format!(".{file}.partial"));
            std::fs::write(&staged, yaml).unwrap();
            std::fs::rename(staged, path).unwrap();
        }
        None => std::fs::remove_file(path).unwrap(),
    }
}
