//! An edge gateway next to a test [`Mesh`]: `aether-agent edge` serving the Gateway `edge/edge` from a config
//! directory, and its own real Envoy under `aether-agent proxy`, its listeners bound on a loopback address of its
//! own so parallel tests never collide. Clients call it from the root netns (the outside of the mesh).
//!
//! The standard world ([`EdgeWorld`]) is written into the config directory as one file: the `aether`
//! GatewayClass, the Gateway (an HTTP listener on 80 and an HTTPS one on 443 with two certificates), the
//! namespaces' labels and the certificates' Secrets, made from a CA of the edge's own.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::identity::TestCa;
use crate::mesh::Mesh;
use crate::supervisor::{ProxyOptions, ProxySupervisor};
use crate::{ChildGuard, binary, free_port};

pub const GATEWAY_NAMESPACE: &str = "edge";
pub const GATEWAY_NAME: &str = "edge";
/// The gateway's own service account: its SPIFFE ID in the mesh.
pub const SERVICE_ACCOUNT: &str = "edge-gateway";
/// The world file's name in the config directory.
pub const WORLD_FILE: &str = "00-edge-world.yaml";
/// The standard listeners, as the Gateway's `spec.listeners`.
pub const STANDARD_LISTENERS: &str = r#"
- name: http
  port: 80
  protocol: HTTP
  allowedRoutes: {namespaces: {from: All}}
- name: https
  port: 443
  protocol: HTTPS
  tls:
    mode: Terminate
    certificateRefs: [{name: edge-cert}, {name: edge-cert-org}]
  allowedRoutes: {namespaces: {from: All}}
"#;

/// The objects every edge test starts from.
pub struct EdgeWorld {
    /// Signs the listeners' certificates; clients trust it.
    pub ca: TestCa,
    /// `edge-cert`: `example.com`, `*.example.com`.
    pub example_com: crate::identity::Leaf,
    /// `edge-cert-org`: `example.org`, `*.example.org`.
    pub example_org: crate::identity::Leaf,
}

impl EdgeWorld {
    pub fn new() -> EdgeWorld {
        let ca = TestCa::new("aether edge test CA");
        let ttl = Duration::from_secs(86400);
        let example_com = ca.issue_server_names(&["example.com", "*.example.com"], ttl);
        let example_org = ca.issue_server_names(&["example.org", "*.example.org"], ttl);
        EdgeWorld {
            ca,
            example_com,
            example_org,
        }
    }

    /// The world's YAML with `listeners` (a YAML list, as [`STANDARD_LISTENERS`]) as the Gateway's.
    pub fn yaml(&self, listeners: &str) -> String {
        let indented: String = listeners
            .trim_matches('\n')
            .lines()
            .map(|l| format!("    {l}\n"))
            .collect();
        format!(
            r#"apiVersion: gateway.networking.k8s.io/v1
kind: GatewayClass
metadata: {{name: aether}}
spec: {{controllerName: aether.io/edge}}
---
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {{name: {GATEWAY_NAME}, namespace: {GATEWAY_NAMESPACE}, generation: 1}}
spec:
  gatewayClassName: aether
  listeners:
{indented}---
apiVersion: v1
kind: Namespace
metadata: {{name: {GATEWAY_NAMESPACE}}}
---
apiVersion: v1
kind: Namespace
metadata: {{name: demo, labels: {{edge-access: denied}}}}
---
apiVersion: v1
kind: Namespace
metadata: {{name: other, labels: {{edge-access: allowed}}}}
---
{}---
{}"#,
            secret("edge-cert", &self.example_com),
            secret("edge-cert-org", &self.example_org),
        )
    }
}

impl Default for EdgeWorld {
    fn default() -> Self {
        Self::new()
    }
}

/// A kubernetes.io/tls Secret in the gateway's namespace.
pub fn secret(name: &str, leaf: &crate::identity::Leaf) -> String {
    let quoted = |text: &str| serde_json::to_string(text).expect("a string");
    format!(
        "apiVersion: v1\nkind: Secret\nmetadata: {{name: {name}, namespace: {GATEWAY_NAMESPACE}}}\ntype: kubernetes.io/tls\nstringData:\n  tls.crt: {}\n  tls.key: {}\n",
        quoted(&leaf.cert_pem),
        quoted(&leaf.key_pem)
    )
}

/// `aether-agent edge` and its Envoy, run as in production by `aether-agent proxy` from the shipped bootstrap (hot
/// restarts, drain).
pub struct EdgeGateway {
    // The proxy before the edge: Envoy must not outlive its xDS server by much.
    pub proxy: ProxySupervisor,
    pub process: ChildGuard,
    pub admin: SocketAddr,
    /// Where the listeners bind.
    pub address: IpAddr,
    pub config_dir: PathBuf,
}

impl EdgeGateway {
    /// Starts the edge for `mesh`, reading `config_dir`, and waits until its Envoy is live.
    pub async fn start(mesh: &Mesh, config_dir: &Path) -> EdgeGateway {
        let address = unique_loopback();
        let admin: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let xds = mesh.path("run/edge-xds.sock");
        let mut cmd = Command::new(binary("aether-agent"));
        cmd.arg("edge")
            .args(["--gateway", &format!("{GATEWAY_NAMESPACE}/{GATEWAY_NAME}")])
            .arg("--config-dir")
            .arg(config_dir)
            .args(["--registrar", &mesh.registrar_url])
            .args(mesh.control_plane.edge_args(GATEWAY_NAMESPACE, SERVICE_ACCOUNT))
            .args(["--pod-name", "test-edge", "--namespace", GATEWAY_NAMESPACE])
            .args(["--service-account", SERVICE_ACCOUNT])
            .arg("--xds-socket")
            .arg(&xds)
            .args(["--admin", &admin.to_string()])
            .args(["--bind-address", &address.to_string()])
            .args(identity_args(&mesh.agent_args))
            .env("RUST_LOG", "info,aether_agent=debug");
        let process = ChildGuard::spawn("edge", cmd);
        crate::mesh::wait_ready(admin, &process).await;
        let options = ProxyOptions::new(&mesh.path("edge-proxy"), "test-edge", &xds);
        let proxy = ProxySupervisor::start(&options, 0).await;
        EdgeGateway {
            proxy,
            process,
            admin,
            address,
            config_dir: config_dir.to_owned(),
        }
    }

    /// A listener's address (the Gateway's port).
    pub fn addr(&self, port: u16) -> SocketAddr {
        SocketAddr::new(self.address, port)
    }

    /// The projection's verdict (`/debug/edge`).
    pub async fn status(&self) -> serde_json::Value {
        let url = format!("http://{}/debug/edge", self.admin);
        let reply = crate::http_get(&url, None).await.unwrap_or_else(|e| panic!("{e}"));
        serde_json::from_str(&reply.body).unwrap_or_else(|e| panic!("/debug/edge: {e}: {}", reply.body))
    }

    /// Polls `check` on the verdict until it holds, or panics with the last verdict after `deadline`.
    pub async fn wait_status(&self, what: &str, deadline: Duration, check: impl Fn(&serde_json::Value) -> bool) {
        let until = Instant::now() + deadline;
        loop {
            let status = self.status().await;
            if check(&status) {
                return;
            }
            assert!(
                Instant::now() < until,
                "edge status never showed {what}: {status:#}\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The edge's and its Envoy's last lines, for failure messages.
    pub fn logs(&self) -> String {
        let tail = |logs: String| {
            let lines: Vec<&str> = logs.lines().collect();
            lines[lines.len().saturating_sub(30)..].join("\n")
        };
        format!(
            "edge:\n{}\n\nedge proxy:\n{}",
            tail(self.process.logs()),
            tail(self.proxy.child.logs())
        )
    }
}

/// The mesh agent's identity flags (the same CA or SPIRE, the same trust domain).
fn identity_args(agent_args: &[String]) -> Vec<String> {
    const FLAGS: [&str; 6] = [
        "--identity",
        "--trust-domain",
        "--ca-cert",
        "--ca-key",
        "--svid-ttl",
        "--spire-admin-socket",
    ];
    let mut out = Vec::new();
    let mut args = agent_args.iter();
    while let Some(arg) = args.next() {
        if FLAGS.contains(&arg.as_str())
            && let Some(value) = args.next()
        {
            out.extend([arg.clone(), value.clone()]);
        }
    }
    out
}

/// A loopback address of this edge's own (`127.64.0.0/10`: the test process's pid and a counter), so listeners on
/// ports 80 and 443 never collide with another test's, in this process or another.
fn unique_loopback() -> IpAddr {
    static NEXT: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);
    let edge = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) & 0x3f;
    let pid = std::process::id();
    IpAddr::V4(Ipv4Addr::new(127, 64 | edge, (pid >> 8) as u8, pid as u8))
}
