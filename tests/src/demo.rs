//! `make demo`: one node of the mesh brought up the way it runs in a cluster, then shown working.
//!
//! The registrar on its embedded store, `aether-agent run` with the built-in CA and the static pod source,
//! `aether-agent proxy` supervising Envoy from the shipped bootstrap, `aether-mesh-dns` on the node bridge's
//! gateway, and pods that are network namespaces wired by Debian's `bridge` + `host-local` CNI plugins with
//! `aether-cni` chained, executed as a runtime does. Every step prints one progress line, checks its result and
//! fails with a message naming what went wrong.
//!
//! Nothing outlives the demo: everything it creates lives under `/tmp/aether-demo-<pid>` or is named after its pid
//! (netns `aen-<pid>…`, bridge `aeb<pid>…`), children die with it (`PR_SET_PDEATHSIG`) and are stopped by process
//! group, and [`Demo::teardown`] (also run by `Drop`) deletes pods through CNI DEL, stops the processes, removes
//! Envoy's shared memory, the bridge and the work dir. The next run sweeps what a killed run left.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::fmt::Display;
use std::io::Write;
use std::net::{Ipv4Addr, SocketAddr};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use aether_proto::registrar::v1::registrar_client::RegistrarClient;
use aether_proto::registrar::v1::{ListEndpointsRequest, ListServicesRequest, RegisterEndpointRequest};
use aether_proto::registry::v1::{Endpoint, Health, Locality, PodInfo, Port, Protocol as PortProtocol};
use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::{Value, json};
use tokio::task::{JoinHandle, JoinSet};

use crate::cni::{BareNetns, ConfList, DEBIAN_CNI_DIR, Sandbox, aether_table, bridge_plugin, run_in};
use crate::control_plane::{ControlPlane, READER_ID, node_id};
use crate::identity::TestCa;
use crate::load::{Load, LoadSpec, Protocol};
use crate::supervisor::metric_sum;
use crate::{ChildGuard, TestNode, free_port, http_get};

pub const NAMESPACE: &str = "demo";
pub const MESH_DOMAIN: &str = "aether.internal";
/// The chart's default trust domain.
pub const TRUST_DOMAIN: &str = "cluster.local";
pub const NODE_NAME: &str = "demo-node";
pub const MESH_DNS_PORT: u16 = 18054;
/// The cluster DNS address pods' resolv.conf names; the capture rules DNAT any :53 to mesh-dns.
pub const CLUSTER_DNS: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
pub const APP_PORT: u16 = 8080;
/// Every run works under `<WORK_BASE>/<WORK_PREFIX><pid>` (not `$TMPDIR`: the binary points that into the work dir).
pub const WORK_BASE: &str = "/tmp";
pub const WORK_PREFIX: &str = "aether-demo-";
/// The numbered steps of a run (teardown included).
pub const STEPS: usize = 16;
/// Prefix of the pod netns [`BareNetns`] creates: `aen-<pid as 6 hex><seq as 4 hex>`.
const NETNS_PREFIX: &str = "aen-";
const READY_TIMEOUT: Duration = Duration::from_secs(30);
const CONVERGE_TIMEOUT: Duration = Duration::from_secs(20);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
const STOP_TIMEOUT: Duration = Duration::from_secs(10);
const TEAMS: [&str; 5] = ["shop", "billing", "search", "identity", "media"];
const SERVICES: [&str; 10] = [
    "api", "worker", "cache", "gateway", "ledger", "index", "auth", "thumbs", "events", "reports",
];

#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error("{0}")]
    Failed(String),
    /// A piece of the product the demo needs is not there (not built, or not implemented yet).
    #[error("{component} is missing: {detail}")]
    Missing { component: &'static str, detail: String },
    #[error("interrupted by {0}")]
    Interrupted(&'static str),
}

fn fail(msg: impl Into<String>) -> DemoError {
    DemoError::Failed(msg.into())
}

/// What the user can tune.
#[derive(Clone, Debug)]
pub struct Options {
    /// Services of other teams registered in the catalog (demand scoping keeps them out of this node's Envoy).
    pub extra_services: usize,
    /// Requests for the load-spread step.
    pub requests: usize,
    /// How long traffic runs before and after the hot restart.
    pub restart_load: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            extra_services: 40,
            requests: 50,
            restart_load: Duration::from_secs(2),
        }
    }
}

/// `/tmp/aether-demo-<pid>` of this process.
pub fn work_dir() -> PathBuf {
    Path::new(WORK_BASE).join(format!("{WORK_PREFIX}{}", std::process::id()))
}

/// The directory holding the workspace binaries (`aether-agent`, `aether-cni`, …): the one this executable is in,
/// or its parent when run from `deps/` (a test).
pub fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let dir = exe.parent().expect("exe has a dir").to_path_buf();
    if dir.ends_with("deps") {
        dir.parent().expect("deps has a parent").to_path_buf()
    } else {
        dir
    }
}

/// One line per step: `[ 3/16] starting … ok (120 ms)`, then indented details.
#[derive(Default)]
struct Progress {
    n: usize,
    started: Option<Instant>,
}

impl Progress {
    fn begin(&mut self, what: impl Display) {
        self.n += 1;
        print!("[{:>2}/{STEPS}] {what} ... ", self.n);
        let _ = std::io::stdout().flush();
        self.started = Some(Instant::now());
    }

    fn end(&mut self, result: Result<Vec<String>, DemoError>) -> Result<(), DemoError> {
        let ms = self.started.take().map(|s| s.elapsed().as_millis()).unwrap_or(0);
        match result {
            Ok(lines) => {
                println!("ok ({ms} ms)");
                for line in lines {
                    println!("        {line}");
                }
                Ok(())
            }
            Err(e) => {
                println!("FAILED ({ms} ms)");
                Err(e)
            }
        }
    }
}

struct Pod {
    name: String,
    service_account: String,
    upstreams: String,
    managed: bool,
    netns: Option<BareNetns>,
    sandbox: Sandbox,
    /// The chain's result once ADD succeeded (what the runtime caches for CHECK/DEL).
    result: Option<Value>,
    ip: Option<Ipv4Addr>,
}

impl Pod {
    fn netns_path(&self) -> PathBuf {
        self.sandbox.netns.clone()
    }
}

/// A pod's app: HTTP on `0.0.0.0:8080` in its netns answering every request with its pod name and what arrived.
struct App {
    task: JoinHandle<()>,
}

#[derive(Clone, Copy, Debug)]
struct Ports {
    registrar_grpc: u16,
    registrar_admin: u16,
    agent_admin: u16,
    proxy_admin: u16,
    envoy_admin: u16,
    dns_admin: u16,
}

/// The key facts a run established (printed in the summary, checked by the end-to-end test).
#[derive(Clone, Debug, Default)]
pub struct Facts {
    pub vip: String,
    pub spiffe_id: String,
    pub per_replica: BTreeMap<String, u64>,
    pub restart_ok: u64,
    pub restart_failed: u64,
    pub envoy_clusters: usize,
    pub catalog_services: usize,
}

pub struct Demo {
    options: Options,
    progress: Progress,
    work: PathBuf,
    bins: PathBuf,
    envoy_bin: PathBuf,
    ports: Ports,
    node: Option<TestNode>,
    registrar: Option<ChildGuard>,
    /// The registrar's mTLS and the node bootstrap (a stand-in API server reviews tokens).
    control_plane: Option<ControlPlane>,
    agent: Option<ChildGuard>,
    proxy: Option<ChildGuard>,
    mesh_dns: Option<ChildGuard>,
    conflist: Option<ConfList>,
    pods: Vec<Pod>,
    apps: Vec<App>,
    envoy_base_id: Option<u32>,
    pub facts: Facts,
    torn_down: bool,
}

impl Demo {
    /// A demo working under `work` (created here, removed by the teardown).
    pub fn new(work: PathBuf, options: Options) -> Result<Demo, DemoError> {
        std::fs::create_dir_all(&work).map_err(|e| fail(format!("creating {}: {e}", work.display())))?;
        let port = || free_port();
        Ok(Demo {
            options,
            progress: Progress::default(),
            work,
            bins: bin_dir(),
            envoy_bin: PathBuf::new(),
            ports: Ports {
                registrar_grpc: port(),
                registrar_admin: port(),
                agent_admin: port(),
                proxy_admin: port(),
                envoy_admin: port(),
                dns_admin: port(),
            },
            node: None,
            registrar: None,
            control_plane: None,
            agent: None,
            proxy: None,
            mesh_dns: None,
            conflist: None,
            pods: Vec::new(),
            apps: Vec::new(),
            envoy_base_id: None,
            facts: Facts::default(),
            torn_down: false,
        })
    }

    pub fn work(&self) -> &Path {
        &self.work
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.work.join(rel)
    }

    fn gateway(&self) -> Ipv4Addr {
        self.node
            .as_ref()
            .map(TestNode::gateway)
            .unwrap_or(Ipv4Addr::UNSPECIFIED)
    }

    fn mesh_dns_addr(&self) -> SocketAddr {
        SocketAddr::from((self.gateway(), MESH_DNS_PORT))
    }

    fn fqdn(service: &str) -> String {
        format!("{service}.{NAMESPACE}.{MESH_DOMAIN}")
    }

    /// Every step up to (not including) the teardown.
    pub async fn run(&mut self) -> Result<(), DemoError> {
        println!(
            "Aether demo: one node of the mesh, as it runs in a cluster (work dir {})",
            self.work.display()
        );
        self.progress
            .begin("checking prerequisites and sweeping leftovers of earlier runs");
        let r = self.prerequisites();
        self.progress.end(r)?;

        self.progress
            .begin("creating the node network (a Linux bridge, as a cluster's primary CNI would)");
        let r = self.create_node();
        self.progress.end(r)?;

        self.progress.begin(format!(
            "starting aether-registrar (embedded store) on 127.0.0.1:{}",
            self.ports.registrar_grpc
        ));
        let r = self.start_registrar().await;
        self.progress.end(r)?;

        self.progress.begin(format!(
            "registering {} services of other teams in the catalog",
            self.options.extra_services
        ));
        let r = self.register_other_services().await;
        self.progress.end(r)?;

        self.progress.begin(format!(
            "starting aether-agent run (built-in CA, trust domain {TRUST_DOMAIN}, static pod source)"
        ));
        let r = self.start_agent().await;
        self.progress.end(r)?;

        self.progress
            .begin("starting aether-agent proxy (Envoy from the shipped proxy/bootstrap.yaml)");
        let r = self.start_proxy().await;
        self.progress.end(r)?;

        self.progress
            .begin(format!("starting aether-mesh-dns on {}", self.mesh_dns_addr()));
        let r = self.start_mesh_dns().await;
        self.progress.end(r)?;

        self.progress
            .begin("creating 4 pods through CNI (bridge + host-local, aether-cni chained)");
        let r = self.create_pods().await;
        self.progress.end(r)?;

        self.progress
            .begin(format!("frontend resolves {} through DNS", Self::fqdn("backend")));
        let r = self.resolve_by_name().await;
        self.progress.end(r)?;

        self.progress
            .begin(format!("frontend calls http://{}:{APP_PORT}/", Self::fqdn("backend")));
        let r = self.call_by_name().await;
        self.progress.end(r)?;

        self.progress.begin(format!(
            "{} requests from frontend spread over the backend replicas",
            self.options.requests
        ));
        let r = self.spread().await;
        self.progress.end(r)?;

        self.progress
            .begin("demand scoping keeps this node's Envoy config small");
        let r = self.demand_scoping().await;
        self.progress.end(r)?;

        self.progress
            .begin("hot restart of Envoy (SIGHUP to the supervisor) under traffic");
        let r = self.hot_restart().await;
        self.progress.end(r)?;

        self.progress.begin("the unmanaged pod is left alone");
        let r = self.unmanaged_left_alone().await;
        self.progress.end(r)?;

        self.progress.begin("where to look next");
        let r = self.where_to_look().await;
        self.progress.end(r)?;
        Ok(())
    }

    /// The facts, in plain words.
    pub fn summary(&self) -> String {
        let f = &self.facts;
        let spread: Vec<String> = f.per_replica.iter().map(|(k, v)| format!("{k}={v}")).collect();
        format!(
            "What the demo showed:\n\
             \x20 by name:        frontend -> {} -> VIP {} -> Envoy (mTLS) -> a backend replica\n\
             \x20 backend saw:    {}\n\
             \x20 load spread:    {} (of {} requests)\n\
             \x20 demand scoping: {} clusters in this node's Envoy for {} services in the catalog\n\
             \x20 hot restart:    {} requests during the restart, {} failed\n\
             \x20 unmanaged pod:  left alone (no capture rules, not registered, not in Envoy)",
            Self::fqdn("backend"),
            f.vip,
            f.spiffe_id,
            spread.join(" "),
            self.options.requests,
            f.envoy_clusters,
            f.catalog_services,
            f.restart_ok,
            f.restart_failed,
        )
    }

    // ---- steps -------------------------------------------------------------------------------------------------

    fn prerequisites(&mut self) -> Result<Vec<String>, DemoError> {
        crate::require_root();
        let mut lines = Vec::new();
        let swept = sweep_leftovers();
        lines.push(match swept.len() {
            0 => "no leftovers of earlier runs".to_owned(),
            _ => format!("removed leftovers of killed runs: {}", swept.join(", ")),
        });
        for plugin in ["bridge", "host-local"] {
            let path = Path::new(DEBIAN_CNI_DIR).join(plugin);
            if !path.is_file() {
                return Err(DemoError::Missing {
                    component: "Debian containernetworking-plugins",
                    detail: format!("{} does not exist: run `make setup`", path.display()),
                });
            }
        }
        for (tool, flag, component) in [
            ("nft", "--version", "nftables"),
            ("dig", "-v", "bind9-dnsutils (dig)"),
            ("curl", "--version", "curl"),
        ] {
            if Command::new(tool).arg(flag).output().is_err() {
                return Err(DemoError::Missing {
                    component,
                    detail: format!("`{tool}` is not installed: run `make setup`"),
                });
            }
        }
        for (bin, component) in [
            ("aether-registrar", "the registrar (registrar/)"),
            ("aether-agent", "the agent (agent/)"),
            ("aether-cni", "the CNI plugin (cni-plugin/, issue 5)"),
            ("aether-mesh-dns", "mesh-dns (mesh-dns/, issue 8)"),
        ] {
            let path = self.bins.join(bin);
            if !path.is_file() {
                return Err(DemoError::Missing {
                    component,
                    detail: format!("{} is not built: run `cargo build --workspace --bins`", path.display()),
                });
            }
        }
        // The pieces other issues deliver, recognised by their flags.
        let help = |args: &[&str]| -> String {
            Command::new(self.bins.join("aether-agent"))
                .args(args)
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr))
                .unwrap_or_default()
        };
        let run_help = help(&["run", "--help"]);
        for (flag, component) in [
            (
                "--ca-cert",
                "workload identity with the built-in CA (issue 7: aether-agent run --identity builtin)",
            ),
            ("--mesh-dns", "DNS capture (issue 5/8: aether-agent run --mesh-dns)"),
            (
                "--netns-pin-dir",
                "netns pins of the CNI plugin (issue 5: aether-agent run --netns-pin-dir)",
            ),
        ] {
            if !run_help.contains(flag) {
                return Err(DemoError::Missing {
                    component,
                    detail: format!("`aether-agent run --help` has no {flag}"),
                });
            }
        }
        if !help(&["proxy", "--help"]).contains("--bootstrap-template") {
            return Err(DemoError::Missing {
                component: "the Envoy supervisor (issue 6: aether-agent proxy)",
                detail: "`aether-agent proxy --help` has no --bootstrap-template".into(),
            });
        }
        let template = crate::supervisor::shipped_template();
        if !template.is_file() {
            return Err(DemoError::Missing {
                component: "the shipped Envoy bootstrap (issue 6)",
                detail: format!("{} does not exist", template.display()),
            });
        }
        self.envoy_bin = crate::envoy_bin();
        lines.push(format!("Envoy {}", self.envoy_bin.display()));
        Ok(lines)
    }

    fn create_node(&mut self) -> Result<Vec<String>, DemoError> {
        let node = TestNode::new();
        let (subnet, len) = node.subnet();
        let line = format!(
            "bridge {} with gateway {} on {subnet}/{len}; pods get .100-.250 from host-local",
            node.bridge_name(),
            node.gateway()
        );
        let ours = json!({
            "type": "aether-cni",
            "agentSocket": self.path("run/cni.sock"),
            "stateDir": self.path("cni"),
            "logFile": self.path("cni.log"),
            "logLevel": "info",
        });
        self.conflist = Some(ConfList::new(
            json!({"cniVersion": "1.0.0", "name": "aether-demo", "plugins": [
                bridge_plugin(node.bridge_name(), subnet, node.gateway(), &self.path("ipam")),
                ours,
            ]}),
            vec![PathBuf::from(DEBIAN_CNI_DIR), self.bins.clone()],
        ));
        self.node = Some(node);
        for dir in ["run", "pods", "cni", "ca", "agent", "proxy"] {
            std::fs::create_dir_all(self.path(dir)).map_err(|e| fail(format!("creating {dir}: {e}")))?;
        }
        Ok(vec![line])
    }

    async fn start_registrar(&mut self) -> Result<Vec<String>, DemoError> {
        let control_plane = self.control_plane.insert(ControlPlane::new(&self.work));
        let mut cmd = Command::new(self.bins.join("aether-registrar"));
        cmd.args(["--listen", &format!("127.0.0.1:{}", self.ports.registrar_grpc)])
            .args(control_plane.registrar_args())
            .envs(control_plane.registrar_env())
            .args(["--admin", &format!("127.0.0.1:{}", self.ports.registrar_admin)])
            .args(["--store", "embedded"])
            .arg("--data-dir")
            .arg(self.path("registrar"))
            // The other teams' endpoints below are registered once; keep them for the whole run.
            .args(["--endpoint-ttl", "1h"]);
        let child = spawn("registrar", cmd);
        let child = self.registrar.insert(child);
        wait_ready(self.ports.registrar_admin, child).await?;
        Ok(vec![
            format!("catalog on a redb file under {}", self.path("registrar").display()),
            "gRPC over mTLS only: agents get node certificates by showing a ServiceAccount token (reviewed by a \
             stand-in Kubernetes API), and each may write only its own node's endpoints"
                .into(),
        ])
    }

    fn registrar_url(&self) -> String {
        format!("https://127.0.0.1:{}", self.ports.registrar_grpc)
    }

    fn control_plane(&self) -> &ControlPlane {
        self.control_plane.as_ref().expect("the registrar was started")
    }

    /// A client with the demo's reader identity (List and Watch).
    async fn registrar_client(&self) -> Result<RegistrarClient<tonic::transport::Channel>, DemoError> {
        let leaf = self.control_plane().node_ca.issue(READER_ID, Duration::from_secs(3600));
        self.control_plane()
            .client_with(&self.registrar_url(), Some(&leaf))
            .await
            .map_err(|e| fail(format!("connecting to the registrar: {e}")))
    }

    /// A client acting as the agent of `node`, for the stand-in endpoints of other nodes.
    async fn registrar_client_as(&self, node: &str) -> Result<RegistrarClient<tonic::transport::Channel>, DemoError> {
        let leaf = self
            .control_plane()
            .node_ca
            .issue(&node_id(node), Duration::from_secs(3600));
        self.control_plane()
            .client_with(&self.registrar_url(), Some(&leaf))
            .await
            .map_err(|e| fail(format!("connecting to the registrar as the agent of {node}: {e}")))
    }

    async fn register_other_services(&mut self) -> Result<Vec<String>, DemoError> {
        let mut client = self.registrar_client().await?;
        // The two replicas of each service run on two other nodes, whose agents register them.
        let mut agents = [
            self.registrar_client_as("node-2").await?,
            self.registrar_client_as("node-3").await?,
        ];
        let mut names = Vec::new();
        for i in 0..self.options.extra_services {
            let team = TEAMS[i % TEAMS.len()];
            let name = format!(
                "{}-{}",
                SERVICES[(i / TEAMS.len()) % SERVICES.len()],
                i / (TEAMS.len() * SERVICES.len()) + 1
            );
            let service = format!("{team}/{name}");
            for replica in 0..2u8 {
                let endpoint = Endpoint {
                    service: service.clone(),
                    address: format!("10.250.{}.{}", i / 100, (i % 100) * 2 + usize::from(replica) + 2),
                    ports: vec![Port {
                        name: "http".into(),
                        port: 8080,
                        protocol: PortProtocol::Http as i32,
                    }],
                    locality: Some(Locality {
                        region: "r1".into(),
                        zone: format!("z{}", replica + 1),
                        subzone: String::new(),
                    }),
                    weight: 1,
                    health: Health::Healthy as i32,
                    pod: Some(PodInfo {
                        namespace: team.into(),
                        name: format!("{name}-{replica}"),
                        uid: format!("uid-{team}-{name}-{replica}"),
                        service_account: name.clone(),
                    }),
                    node: format!("node-{}", replica + 2),
                    ..Default::default()
                };
                agents[usize::from(replica)]
                    .register_endpoint(RegisterEndpointRequest {
                        endpoint: Some(endpoint),
                    })
                    .await
                    .map_err(|s| fail(format!("registering {service}: {}", s.message())))?;
            }
            names.push(service);
        }
        let listed = client
            .list_services(ListServicesRequest {})
            .await
            .map_err(|s| fail(format!("listing services: {}", s.message())))?
            .into_inner()
            .services;
        if listed.len() < self.options.extra_services {
            return Err(fail(format!(
                "the catalog lists {} services, expected {}",
                listed.len(),
                names.len()
            )));
        }
        let shown: Vec<&str> = names.iter().take(4).map(String::as_str).collect();
        Ok(vec![format!(
            "{} services with 2 endpoints each on other nodes ({}, ...), each with its own VIP",
            listed.len(),
            shown.join(", ")
        )])
    }

    async fn start_agent(&mut self) -> Result<Vec<String>, DemoError> {
        let ca = TestCa::new("aether demo CA");
        let (cert, key) = ca.write(&self.path("ca"));
        let mut cmd = Command::new(self.bins.join("aether-agent"));
        cmd.arg("run")
            .args(["--node-name", NODE_NAME])
            .args(["--registrar", &self.registrar_url()])
            .args(self.control_plane().agent_args(NODE_NAME))
            .arg("--state-dir")
            .arg(self.path("agent"))
            .arg("--cni-socket")
            .arg(self.path("run/cni.sock"))
            .arg("--xds-socket")
            .arg(self.path("run/xds.sock"))
            .args(["--admin", &format!("127.0.0.1:{}", self.ports.agent_admin)])
            .args(["--pod-source", "static"])
            .arg("--pod-dir")
            .arg(self.path("pods"))
            .arg("--netns-pin-dir")
            .arg(self.path("cni/netns"))
            .args(["--mesh-domain", MESH_DOMAIN])
            .args(["--mesh-dns", &self.mesh_dns_addr().to_string()])
            .args(["--region", "r1", "--zone", "z1"])
            .args(["--identity", "builtin", "--trust-domain", TRUST_DOMAIN])
            .arg("--ca-cert")
            .arg(&cert)
            .arg("--ca-key")
            .arg(&key)
            .args(["--envoy-admin", &format!("127.0.0.1:{}", self.ports.envoy_admin)])
            .env("RUST_LOG", "info");
        let child = spawn("agent", cmd);
        let child = self.agent.insert(child);
        wait_ready(self.ports.agent_admin, child).await?;
        Ok(vec![
            format!("a fresh CA made with rcgen for this run: {}", cert.display()),
            format!(
                "pods are read from {}; DNS from pods goes to {}",
                self.path("pods").display(),
                self.mesh_dns_addr()
            ),
        ])
    }

    async fn start_proxy(&mut self) -> Result<Vec<String>, DemoError> {
        let mut cmd = Command::new(self.bins.join("aether-agent"));
        cmd.arg("proxy")
            .args(["--node-name", NODE_NAME])
            .arg("--envoy-bin")
            .arg(&self.envoy_bin)
            .arg("--bootstrap-template")
            .arg(crate::supervisor::shipped_template())
            .arg("--state-dir")
            .arg(self.path("proxy/state"))
            .arg("--xds-socket")
            .arg(self.path("run/xds.sock"))
            .args(["--envoy-admin", &format!("127.0.0.1:{}", self.ports.envoy_admin)])
            .args(["--admin", &format!("127.0.0.1:{}", self.ports.proxy_admin)])
            .args([
                "--drain-time",
                "1s",
                "--parent-shutdown-time",
                "2s",
                "--concurrency",
                "1",
            ])
            .env("RUST_LOG", "info");
        let child = spawn("proxy", cmd);
        self.proxy = Some(child);
        self.wait_envoy_live(0).await?;
        let info = self.envoy_server_info().await.map_err(fail)?;
        self.envoy_base_id = info["command_line_options"]["base_id"]
            .as_str()
            .and_then(|s| s.parse().ok())
            .or_else(|| info["command_line_options"]["base_id"].as_u64().map(|b| b as u32));
        Ok(vec![format!(
            "Envoy {} LIVE at epoch 0 (pid {}, base id {}), fed over ADS on {}",
            info["version"].as_str().unwrap_or("?").split('/').nth(1).unwrap_or("?"),
            self.envoy_pids().first().copied().unwrap_or(0),
            self.envoy_base_id.map(|b| b.to_string()).unwrap_or_else(|| "?".into()),
            self.path("run/xds.sock").display()
        )])
    }

    async fn start_mesh_dns(&mut self) -> Result<Vec<String>, DemoError> {
        let mut cmd = Command::new(self.bins.join("aether-mesh-dns"));
        cmd.args(["--listen", &self.mesh_dns_addr().to_string()])
            .arg("--records")
            .arg(self.path("agent/mesh-dns/records"))
            .args(["--mesh-domain", MESH_DOMAIN])
            .args(["--admin", &format!("127.0.0.1:{}", self.ports.dns_admin)])
            .args(["--workers", "1"])
            .env("RUST_LOG", "info");
        let child = spawn("mesh-dns", cmd);
        let child = self.mesh_dns.insert(child);
        wait_ready(self.ports.dns_admin, child).await?;
        Ok(vec![format!(
            "serving the agent's record file {} (services with their VIPs)",
            self.path("agent/mesh-dns/records").display()
        )])
    }

    async fn create_pods(&mut self) -> Result<Vec<String>, DemoError> {
        let pid = std::process::id();
        // Servers before their client, as a rollout usually goes.
        let specs = [
            ("backend-1", "backend", "", true),
            ("backend-2", "backend", "", true),
            ("frontend", "frontend", "backend", true),
            ("legacy", "legacy", "", false),
        ];
        let mut lines = Vec::new();
        for (name, sa, upstreams, managed) in specs {
            let netns = BareNetns::new();
            write_pod_resolv_conf(netns.name())?;
            let sandbox = Sandbox::new(&format!("{WORK_PREFIX}{pid}-{name}"), &netns.path(), NAMESPACE, name);
            self.pods.push(Pod {
                name: name.into(),
                service_account: sa.into(),
                upstreams: upstreams.into(),
                managed,
                netns: Some(netns),
                sandbox,
                result: None,
                ip: None,
            });
            let index = self.pods.len() - 1;
            self.write_manifest(index)?;
            let conflist = self.conflist.clone().expect("node created");
            let sandbox = self.pods[index].sandbox.clone();
            let results = conflist.add(&sandbox).map_err(|run| {
                fail(format!(
                    "CNI ADD of pod {name} failed in {}: {} {}\ncni log (tail):\n{}\nagent log (tail):\n{}\n\
                     supervisor and Envoy log (tail):\n{}",
                    run.plugin,
                    run.stdout.trim(),
                    run.stderr.trim(),
                    tail(&std::fs::read_to_string(self.path("cni.log")).unwrap_or_default(), 15),
                    tail(&self.agent.as_ref().map(ChildGuard::logs).unwrap_or_default(), 15),
                    tail(&self.proxy.as_ref().map(ChildGuard::logs).unwrap_or_default(), 15),
                ))
            })?;
            let result = results.last().cloned().unwrap_or_default();
            if results.len() != 2 || results[1] != results[0] {
                return Err(fail(format!(
                    "aether-cni did not pass bridge's result through unchanged: {results:?}"
                )));
            }
            let ip: Ipv4Addr = result["ips"][0]["address"]
                .as_str()
                .and_then(|a| a.split('/').next())
                .and_then(|a| a.parse().ok())
                .ok_or_else(|| fail(format!("no IPv4 address in the result of pod {name}: {result}")))?;
            let pod = &mut self.pods[index];
            pod.result = Some(result);
            pod.ip = Some(ip);
            let captured = aether_table(&pod.netns_path()).is_some();
            if captured != managed {
                return Err(fail(format!(
                    "pod {name}: capture rules {} but the pod is {}managed",
                    if captured { "present" } else { "absent" },
                    if managed { "" } else { "not " }
                )));
            }
            // The app container starts once the network is up.
            let app = serve_echo(&pod.netns_path(), name)?;
            self.apps.push(app);
            let what = match (managed, upstreams) {
                (false, _) => "unmanaged (no aether.io/managed label): plugin ran, agent ignored it".to_owned(),
                (true, "") => format!("service {NAMESPACE}/{sa}, captured"),
                (true, u) => format!("service {NAMESPACE}/{sa}, upstreams: {u}, captured"),
            };
            lines.push(format!(
                "{name:<10} {ip:<15} netns {:<16} {what}",
                self.pods[index].sandbox.netns.display()
            ));
        }
        Ok(lines)
    }

    fn write_manifest(&self, index: usize) -> Result<(), DemoError> {
        let pod = &self.pods[index];
        let (_, _, uid) = pod.sandbox.pod.clone().expect("sandbox with pod args");
        let mut labels = serde_json::Map::new();
        labels.insert("app".into(), json!(pod.service_account));
        if pod.managed {
            labels.insert("aether.io/managed".into(), json!("true"));
        }
        let manifest = json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {
                "name": pod.name, "namespace": NAMESPACE, "uid": uid, "labels": labels,
                "annotations": {"config.aether.io/upstreams": pod.upstreams}
            },
            "spec": {
                "nodeName": NODE_NAME,
                "serviceAccountName": pod.service_account,
                "containers": [{"name": "app", "ports": [{"name": "http", "containerPort": APP_PORT}]}]
            }
        });
        let path = self.path(&format!("pods/{}.json", pod.name));
        std::fs::write(&path, serde_json::to_vec_pretty(&manifest).expect("JSON"))
            .map_err(|e| fail(format!("writing {}: {e}", path.display())))
    }

    fn pod(&self, name: &str) -> &Pod {
        self.pods.iter().find(|p| p.name == name).expect("pod exists")
    }

    async fn backend_vip(&self) -> Result<Ipv4Addr, DemoError> {
        let service = self
            .registrar_client()
            .await?
            .list_endpoints(ListEndpointsRequest {
                service: format!("{NAMESPACE}/backend"),
            })
            .await
            .map_err(|s| {
                fail(format!(
                    "the registrar does not know {NAMESPACE}/backend: {}",
                    s.message()
                ))
            })?
            .into_inner()
            .service
            .ok_or_else(|| fail("the registrar returned no service for demo/backend"))?;
        service
            .vip
            .parse()
            .map_err(|_| fail(format!("demo/backend has no IPv4 VIP: {:?}", service.vip)))
    }

    async fn resolve_by_name(&mut self) -> Result<Vec<String>, DemoError> {
        let vip = self.backend_vip().await?;
        self.facts.vip = vip.to_string();
        let name = Self::fqdn("backend");
        let netns = self.pod("frontend").netns.as_ref().expect("netns").name().to_owned();
        let queries_before = self.dns_queries().await;
        let deadline = Instant::now() + CONVERGE_TIMEOUT;
        let answer = loop {
            let out = Command::new("ip")
                .args(["netns", "exec", &netns, "dig", "+short", "+time=2", "+tries=1"])
                .arg(format!("@{CLUSTER_DNS}"))
                .args([name.as_str(), "A"])
                .output()
                .map_err(|e| fail(format!("running dig in the frontend's netns: {e}")))?;
            let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
            let answer: Option<Ipv4Addr> = stdout.lines().filter_map(|l| l.trim().parse().ok()).next_back();
            if answer == Some(vip) {
                break answer.expect("some");
            }
            if Instant::now() > deadline {
                return Err(fail(format!(
                    "dig @{CLUSTER_DNS} {name} in the frontend's netns answered {:?} (stderr {:?}), not the VIP {vip}\n\
                     mesh-dns log (tail):\n{}",
                    stdout.trim(),
                    String::from_utf8_lossy(&out.stderr).trim(),
                    tail(&self.mesh_dns.as_ref().map(ChildGuard::logs).unwrap_or_default(), 15)
                )));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        let queries_after = self.dns_queries().await;
        if queries_after <= queries_before {
            return Err(fail(format!(
                "the answer did not come from aether-mesh-dns (its query count stayed at {queries_after})"
            )));
        }
        Ok(vec![
            format!("dig @{CLUSTER_DNS} {name} (the pod's resolver) -> {answer}, the service's mesh VIP"),
            format!(
                "the :53 query was DNAT'ed by the capture rules to aether-mesh-dns at {} (its query count went {} -> {})",
                self.mesh_dns_addr(),
                queries_before,
                queries_after
            ),
        ])
    }

    async fn dns_queries(&self) -> f64 {
        match http_get(&format!("http://127.0.0.1:{}/metrics", self.ports.dns_admin), None).await {
            Ok(reply) => metric_sum(&reply.body, "aether_mesh_dns_queries_total"),
            Err(_) => 0.0,
        }
    }

    fn backend_target(&self) -> Result<SocketAddr, DemoError> {
        let vip: Ipv4Addr = self
            .facts
            .vip
            .parse()
            .map_err(|_| fail("no backend VIP resolved yet"))?;
        Ok(SocketAddr::from((vip, APP_PORT)))
    }

    /// `curl http://backend.demo.aether.internal:8080/hello` in the frontend's netns, resolving the name itself
    /// through the pod's resolv.conf (the cluster DNS address, captured to mesh-dns; the search-path expansions
    /// `ndots:5` tries first are answered NXDOMAIN by mesh-dns without leaving the node).
    async fn call_by_name(&mut self) -> Result<Vec<String>, DemoError> {
        let target = self.backend_target()?;
        let url = format!("http://{}:{APP_PORT}/hello", Self::fqdn("backend"));
        let netns = self.pod("frontend").netns.as_ref().expect("netns").name().to_owned();
        let deadline = Instant::now() + CONVERGE_TIMEOUT;
        let body = loop {
            let out = tokio::process::Command::new("ip")
                .args([
                    "netns",
                    "exec",
                    &netns,
                    "curl",
                    "-sS",
                    "--max-time",
                    "5",
                    "-w",
                    "\n%{http_code} %{remote_ip}",
                ])
                .arg(&url)
                .output()
                .await
                .map_err(|e| fail(format!("running curl in the frontend's netns: {e}")))?;
            let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
            let (body, status) = stdout.rsplit_once('\n').unwrap_or(("", stdout.as_str()));
            if status == format!("200 {}", target.ip()) {
                break serde_json::from_str::<Value>(body)
                    .map_err(|e| fail(format!("the answer to {url} is not the echo JSON ({e}): {body}")))?;
            }
            if Instant::now() > deadline {
                return Err(fail(format!(
                    "curl {url} from frontend did not get 200 from the VIP {} (got {status:?}, stderr {:?})\n\
                     agent log (tail):\n{}",
                    target.ip(),
                    String::from_utf8_lossy(&out.stderr).trim(),
                    tail(&self.agent.as_ref().map(ChildGuard::logs).unwrap_or_default(), 15)
                )));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        let served_by = body["pod"].as_str().unwrap_or_default().to_owned();
        if !served_by.starts_with("backend-") {
            return Err(fail(format!("the answer did not come from a backend replica: {body}")));
        }
        let xfcc = body["headers"]["x-forwarded-client-cert"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let uris = peer_uris(&xfcc);
        let expected = format!("spiffe://{TRUST_DOMAIN}/ns/{NAMESPACE}/sa/frontend");
        if uris != [expected.clone()] {
            return Err(fail(format!(
                "the backend did not see the frontend's SPIFFE ID {expected} (mTLS with the pod's own identity); \
                 x-forwarded-client-cert: {xfcc:?}"
            )));
        }
        self.facts.spiffe_id = expected.clone();
        Ok(vec![
            format!(
                "curl {url} in frontend's netns: the name resolved through the pod's resolv.conf (mesh-dns) to {}",
                target.ip()
            ),
            format!(
                "frontend -> {target} (VIP) -> captured to Envoy's :18001 in frontend's netns -> mTLS -> {served_by}:18008 -> 127.0.0.1:{APP_PORT}"
            ),
            format!("answered by {served_by} with 200"),
            format!("SPIFFE ID the backend saw (x-forwarded-client-cert): {expected}"),
        ])
    }

    async fn spread(&mut self) -> Result<Vec<String>, DemoError> {
        let target = self.backend_target()?;
        let host = format!("{}:{APP_PORT}", Self::fqdn("backend"));
        let netns = self.pod("frontend").netns_path();
        let mut counts: BTreeMap<String, u64> = BTreeMap::from([("backend-1".into(), 0), ("backend-2".into(), 0)]);
        for i in 0..self.options.requests {
            let reply = get_in(&netns, target, &host, &format!("/spread/{i}"))
                .await
                .map_err(|e| fail(format!("request {i} from frontend to {host}: {e}")))?;
            if reply.status != 200 {
                return Err(fail(format!("request {i} answered {}: {}", reply.status, reply.body)));
            }
            let pod = reply.json()?["pod"].as_str().unwrap_or_default().to_owned();
            *counts
                .get_mut(&pod)
                .ok_or_else(|| fail(format!("request {i} was answered by {pod:?}, not a backend replica")))? += 1;
        }
        if let Some((idle, _)) = counts.iter().find(|(_, n)| **n == 0) {
            return Err(fail(format!(
                "{idle} served none of {} requests: {counts:?}",
                self.options.requests
            )));
        }
        let lines = counts.iter().map(|(pod, n)| format!("{pod}: {n} requests")).collect();
        self.facts.per_replica = counts;
        Ok(lines)
    }

    async fn demand_scoping(&mut self) -> Result<Vec<String>, DemoError> {
        let catalog = self
            .registrar_client()
            .await?
            .list_services(ListServicesRequest {})
            .await
            .map_err(|s| fail(format!("listing services: {}", s.message())))?
            .into_inner()
            .services;
        let reply = http_get(
            &format!(
                "http://127.0.0.1:{}/config_dump?resource=dynamic_active_clusters",
                self.ports.envoy_admin
            ),
            None,
        )
        .await
        .map_err(|e| fail(format!("Envoy admin config_dump: {e}")))?;
        let dump: Value =
            serde_json::from_str(&reply.body).map_err(|e| fail(format!("config_dump is not JSON: {e}")))?;
        let mut clusters: Vec<String> = dump["configs"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|c| c["cluster"]["name"].as_str().map(str::to_owned))
            .collect();
        clusters.sort();
        if !clusters.iter().any(|c| c.contains("backend")) {
            return Err(fail(format!(
                "Envoy has no cluster for the frontend's upstream backend: {clusters:?}"
            )));
        }
        let foreign: Vec<&String> = clusters
            .iter()
            .filter(|c| {
                TEAMS
                    .iter()
                    .any(|t| c.contains(&format!(".{t}.")) || c.contains(&format!("{t}/")))
            })
            .collect();
        if !foreign.is_empty() {
            return Err(fail(format!(
                "Envoy got clusters of services no pod here needs: {foreign:?}"
            )));
        }
        if clusters.len() >= catalog.len() {
            return Err(fail(format!(
                "{} clusters for {} catalog services: nothing was scoped",
                clusters.len(),
                catalog.len()
            )));
        }
        self.facts.envoy_clusters = clusters.len();
        self.facts.catalog_services = catalog.len();
        Ok(vec![
            format!(
                "catalog: {} services; this node's Envoy: {} clusters",
                catalog.len(),
                clusters.len()
            ),
            format!("clusters: {}", clusters.join(", ")),
            "only what this node's pods call (frontend's upstreams) and serve; the other teams' services stay out \
             (still reachable on demand over HTTP)"
                .into(),
        ])
    }

    async fn hot_restart(&mut self) -> Result<Vec<String>, DemoError> {
        let target = self.backend_target()?;
        let load = Load::start(LoadSpec {
            target,
            host: format!("{}:{APP_PORT}", Self::fqdn("backend")),
            path: "/load".into(),
            protocol: Protocol::Http1,
            connections: 4,
            streams: 1,
            netns: Some(self.pod("frontend").netns_path()),
        });
        let settle = self.options.restart_load / 2;
        tokio::time::sleep(settle).await;
        let before = load.report();
        if before.ok == 0 {
            let report = load.stop().await;
            return Err(fail(format!("no traffic flows before the restart: {report:?}")));
        }
        let old = self.envoy_pids();
        let supervisor = self
            .proxy
            .as_ref()
            .map(ChildGuard::pid)
            .ok_or_else(|| fail("no supervisor"))?;
        kill(Pid::from_raw(supervisor as i32), Signal::SIGHUP)
            .map_err(|e| fail(format!("SIGHUP to the supervisor: {e}")))?;
        let started = Instant::now();
        if let Err(e) = self.wait_envoy_live(1).await {
            let _ = load.stop().await;
            return Err(e);
        }
        let handoff = started.elapsed();
        // The old epoch drains and exits (parent shutdown) while traffic keeps flowing.
        let deadline = Instant::now() + CONVERGE_TIMEOUT;
        while self.envoy_pids().iter().any(|p| old.contains(p)) {
            if Instant::now() > deadline {
                let _ = load.stop().await;
                return Err(fail(format!(
                    "the old Envoy (pids {old:?}) did not exit after the hot restart"
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tokio::time::sleep(settle).await;
        let report = load.stop().await;
        self.facts.restart_ok = report.ok;
        self.facts.restart_failed = report.failed + report.connect_failures;
        if report.failed != 0 || report.connect_failures != 0 || report.ok <= before.ok {
            return Err(fail(format!("requests failed across the hot restart: {report:#?}")));
        }
        Ok(vec![
            format!(
                "epoch 0 (pid {}) -> epoch 1 (pid {}) LIVE {} ms after SIGHUP; the old epoch drained and exited",
                old.first().copied().unwrap_or(0),
                self.envoy_pids().first().copied().unwrap_or(0),
                handoff.as_millis()
            ),
            format!(
                "{} requests over 4 keep-alive connections from frontend, {} failed ({} reconnects, {} resent never-written)",
                report.ok,
                report.failed + report.connect_failures,
                report.connects.saturating_sub(4),
                report.retried_unsent
            ),
        ])
    }

    async fn unmanaged_left_alone(&mut self) -> Result<Vec<String>, DemoError> {
        let legacy = self.pod("legacy");
        let (netns, ip) = (legacy.netns_path(), legacy.ip.expect("legacy has an IP"));
        if let Some(table) = aether_table(&netns) {
            return Err(fail(format!("the unmanaged pod got capture rules:\n{table}")));
        }
        let pods = http_get(&format!("http://127.0.0.1:{}/debug/pods", self.ports.agent_admin), None)
            .await
            .map_err(|e| fail(format!("agent /debug/pods: {e}")))?
            .body;
        if pods.contains("demo/legacy") {
            return Err(fail(format!("the agent manages the unmanaged pod: {pods}")));
        }
        let registered = self
            .registrar_client()
            .await?
            .list_endpoints(ListEndpointsRequest {
                service: format!("{NAMESPACE}/legacy"),
            })
            .await
            .map(|r| r.into_inner().endpoints.len())
            .unwrap_or(0);
        if registered != 0 {
            return Err(fail("the unmanaged pod was registered in the catalog"));
        }
        // The frontend can still talk to it directly: plain TCP to its pod IP, never through Envoy.
        let reply = get_in(
            &self.pod("frontend").netns_path(),
            SocketAddr::from((ip, APP_PORT)),
            &format!("{ip}:{APP_PORT}"),
            "/direct",
        )
        .await
        .map_err(|e| fail(format!("frontend -> legacy at {ip}:{APP_PORT}: {e}")))?;
        let body = reply.json()?;
        if body["pod"] != "legacy" || body["headers"].get("x-forwarded-client-cert").is_some() {
            return Err(fail(format!(
                "the direct call to legacy did not reach it untouched: {body}"
            )));
        }
        Ok(vec![
            "no nftables table in its netns, not in the agent's pods, not in the catalog".into(),
            format!(
                "frontend -> {ip}:{APP_PORT} (pod IP, not a VIP) reaches legacy directly: no Envoy, no client certificate"
            ),
        ])
    }

    async fn where_to_look(&mut self) -> Result<Vec<String>, DemoError> {
        let p = self.ports;
        let urls = [
            ("agent", format!("http://127.0.0.1:{}/debug/pods", p.agent_admin)),
            (
                "agent",
                format!("http://127.0.0.1:{}/debug/dependencies", p.agent_admin),
            ),
            ("agent", format!("http://127.0.0.1:{}/debug/xds", p.agent_admin)),
            ("agent", format!("http://127.0.0.1:{}/metrics", p.agent_admin)),
            ("registrar", format!("http://127.0.0.1:{}/metrics", p.registrar_admin)),
            (
                "proxy supervisor",
                format!("http://127.0.0.1:{}/debug/proxy", p.proxy_admin),
            ),
            (
                "proxy supervisor",
                format!("http://127.0.0.1:{}/metrics", p.proxy_admin),
            ),
            ("Envoy admin", format!("http://127.0.0.1:{}/config_dump", p.envoy_admin)),
            (
                "Envoy admin",
                format!("http://127.0.0.1:{}/stats/prometheus", p.envoy_admin),
            ),
            ("mesh-dns", format!("http://127.0.0.1:{}/debug/records", p.dns_admin)),
            ("mesh-dns", format!("http://127.0.0.1:{}/metrics", p.dns_admin)),
        ];
        let mut lines = Vec::new();
        for (who, url) in urls {
            let reply = http_get(&url, None)
                .await
                .map_err(|e| fail(format!("{who} {url}: {e}")))?;
            if reply.status != 200 {
                return Err(fail(format!("{who} {url} answered {}", reply.status)));
            }
            lines.push(format!("{who:<17} {url}"));
        }
        lines.push(format!(
            "pod manifests in {}, CNI log {}",
            self.path("pods").display(),
            self.path("cni.log").display()
        ));
        lines.push(
            "these addresses and files disappear when the demo ends; `target/debug/aether-demo --hold` \
                    keeps the node up until Ctrl-C"
                .into(),
        );
        Ok(lines)
    }

    // ---- helpers -----------------------------------------------------------------------------------------------

    async fn envoy_server_info(&self) -> Result<Value, String> {
        let reply = http_get(
            &format!("http://127.0.0.1:{}/server_info", self.ports.envoy_admin),
            None,
        )
        .await?;
        if reply.status != 200 {
            return Err(format!("Envoy /server_info answered {}", reply.status));
        }
        serde_json::from_str(&reply.body).map_err(|e| format!("/server_info is not JSON: {e}"))
    }

    async fn wait_envoy_live(&mut self, epoch: u64) -> Result<(), DemoError> {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let last = self.envoy_server_info().await;
            if let Ok(info) = &last
                && info["state"] == "LIVE"
                && info["command_line_options"]["restart_epoch"].as_u64() == Some(epoch)
            {
                return Ok(());
            }
            let proxy = self
                .proxy
                .as_mut()
                .ok_or_else(|| fail("the supervisor is not running"))?;
            if let Some(status) = proxy.try_wait() {
                return Err(fail(format!(
                    "aether-agent proxy exited ({status}) before Envoy epoch {epoch} was LIVE; log (tail):\n{}",
                    tail(&proxy.logs(), 20)
                )));
            }
            if Instant::now() > deadline {
                return Err(fail(format!(
                    "Envoy not LIVE at epoch {epoch} within {READY_TIMEOUT:?} (last: {last:?}); supervisor log (tail):\n{}",
                    tail(&proxy.logs(), 20)
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Live Envoy processes of the supervisor's process group.
    fn envoy_pids(&self) -> Vec<u32> {
        let Some(proxy) = &self.proxy else { return Vec::new() };
        let pgid = proxy.pid();
        processes()
            .into_iter()
            .filter(|p| p.pgid == pgid && p.pid != pgid && !p.zombie)
            .map(|p| p.pid)
            .collect()
    }

    /// Stops the apps (their sockets keep pod netns alive), then everything else: see [`Demo::teardown`].
    pub async fn shutdown(&mut self) -> Result<Vec<String>, DemoError> {
        for app in self.apps.drain(..) {
            app.task.abort();
            let _ = app.task.await;
        }
        self.teardown()
    }

    /// Deletes the pods through CNI DEL (as the runtime does), stops mesh-dns, the supervisor (Envoy drains), the
    /// agent and the registrar, removes Envoy's shared memory, the pod netns, the bridge and the work dir; then
    /// checks that nothing of this run is left. Idempotent; `Drop` calls it too.
    pub fn teardown(&mut self) -> Result<Vec<String>, DemoError> {
        if self.torn_down {
            return Ok(Vec::new());
        }
        self.torn_down = true;
        for app in self.apps.drain(..) {
            app.task.abort();
        }
        let mut problems = Vec::new();
        if let Some(conflist) = self.conflist.clone() {
            for pod in self.pods.iter().rev() {
                let Some(result) = &pod.result else { continue };
                if let Err(run) = conflist.del(&pod.sandbox, Some(result)) {
                    problems.push(format!(
                        "CNI DEL of {}: {} {}",
                        pod.name,
                        run.stdout.trim(),
                        run.stderr.trim()
                    ));
                }
            }
        }
        for pod in &mut self.pods {
            if let Some(netns) = pod.netns.take()
                && let Err(e) = remove_pod_resolv_conf(netns.name())
            {
                problems.push(e);
            }
        }
        let base_id = self.envoy_base_id.or_else(|| read_base_id(&self.path("proxy/state")));
        for (name, child) in [
            ("mesh-dns", self.mesh_dns.take()),
            ("proxy", self.proxy.take()),
            ("agent", self.agent.take()),
            ("registrar", self.registrar.take()),
        ] {
            if let Some(mut child) = child {
                child.signal(Signal::SIGTERM);
                if child.wait_timeout(STOP_TIMEOUT).is_none() {
                    problems.push(format!("{name} ignored SIGTERM for {STOP_TIMEOUT:?}; killed"));
                }
                child.kill();
            }
        }
        if let Some(base_id) = base_id {
            let _ = std::fs::remove_file(shm_path(base_id));
        }
        self.node = None;
        unmount_under(&self.work);
        if let Err(e) = std::fs::remove_dir_all(&self.work)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            problems.push(format!("removing {}: {e}", self.work.display()));
        }
        let left = leftovers(std::process::id(), &self.work, base_id);
        problems.extend(left);
        if problems.is_empty() {
            Ok(vec![
                "pods deleted through CNI DEL (capture rules, pins, endpoints, veths, addresses)".into(),
                "mesh-dns, Envoy (drained), the supervisor, the agent and the registrar stopped".into(),
                format!(
                    "nothing left behind: no netns, bridge, mount, process or file of this run ({})",
                    self.work.display()
                ),
            ])
        } else {
            Err(fail(format!(
                "cleanup left things behind:\n  {}",
                problems.join("\n  ")
            )))
        }
    }

    /// The teardown as a numbered step.
    pub async fn teardown_step(&mut self) -> Result<(), DemoError> {
        self.progress.n = self.progress.n.max(STEPS - 1);
        self.progress.begin("tearing the node down");
        let r = self.shutdown().await;
        self.progress.end(r)
    }
}

impl Drop for Demo {
    fn drop(&mut self) {
        if let Err(e) = self.teardown() {
            eprintln!("aether-demo: {e}");
        }
    }
}

// ---- processes ------------------------------------------------------------------------------------------------

/// Spawns a product process in its own process group that dies with the demo (`PR_SET_PDEATHSIG`), logging to a
/// file under `$TMPDIR` (the work dir).
fn spawn(name: &str, mut cmd: Command) -> ChildGuard {
    #[allow(unsafe_code)]
    // SAFETY: the closure runs between fork and exec and only calls prctl(2), which is async-signal-safe.
    unsafe {
        cmd.pre_exec(|| nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).map_err(std::io::Error::from));
    }
    ChildGuard::spawn(name, cmd)
}

async fn wait_ready(admin_port: u16, child: &mut ChildGuard) -> Result<(), DemoError> {
    let deadline = Instant::now() + READY_TIMEOUT;
    let url = format!("http://127.0.0.1:{admin_port}/ready");
    loop {
        if let Ok(reply) = http_get(&url, None).await
            && reply.status == 200
        {
            return Ok(());
        }
        if let Some(status) = child.try_wait() {
            return Err(fail(format!(
                "{} exited ({status}) before it was ready; log (tail):\n{}",
                child.name(),
                tail(&child.logs(), 20)
            )));
        }
        if Instant::now() > deadline {
            return Err(fail(format!(
                "{} not ready at {url} within {READY_TIMEOUT:?}; log (tail):\n{}",
                child.name(),
                tail(&child.logs(), 20)
            )));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

struct Process {
    pid: u32,
    pgid: u32,
    zombie: bool,
    cmdline: String,
}

fn processes() -> Vec<Process> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // pid (comm) state ppid pgrp …; comm may hold spaces, so split after the last ')'.
        let Some(rest) = stat.rfind(')').map(|i| &stat[i + 2..]) else {
            continue;
        };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let cmdline = std::fs::read(entry.path().join("cmdline"))
            .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
            .unwrap_or_default();
        out.push(Process {
            pid,
            pgid: fields.get(2).and_then(|p| p.parse().ok()).unwrap_or(0),
            zombie: fields.first() == Some(&"Z"),
            cmdline,
        });
    }
    out
}

fn shm_path(base_id: u32) -> PathBuf {
    PathBuf::from(format!("/dev/shm/envoy_shared_memory_{}", u64::from(base_id) * 10))
}

/// The base id the supervisor recorded in its state dir.
fn read_base_id(state_dir: &Path) -> Option<u32> {
    let text = std::fs::read_to_string(state_dir.join("proxy-state.json")).ok()?;
    let state: Value = serde_json::from_str(&text).ok()?;
    state["base_id"].as_u64().map(|b| b as u32)
}

/// Mount points under `dir` (netns pins), deepest first.
fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    // With the trailing slash: `/tmp/aether-demo-12` must not match `/tmp/aether-demo-123/…`.
    let prefix = format!("{}/", dir.display());
    let mut mounts: Vec<PathBuf> = std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_whitespace().nth(4))
        .filter(|m| m.starts_with(&prefix))
        .map(PathBuf::from)
        .collect();
    mounts.sort_by_key(|m| std::cmp::Reverse(m.as_os_str().len()));
    mounts
}

fn unmount_under(dir: &Path) {
    for mount in mounts_under(dir) {
        let _ = nix::mount::umount2(&mount, nix::mount::MntFlags::MNT_DETACH);
    }
}

/// This run's netns names (`aen-<pid>…`).
fn run_netns(pid: u32) -> Vec<String> {
    let prefix = format!("{NETNS_PREFIX}{pid:06x}");
    std::fs::read_dir(crate::netns::NETNS_DIR)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&prefix) && n.len() == prefix.len() + 4)
        .collect()
}

/// What a run of process `pid` working in `work` left behind, described (empty: nothing).
pub fn leftovers(pid: u32, work: &Path, base_id: Option<u32>) -> Vec<String> {
    let mut left = Vec::new();
    for ns in run_netns(pid) {
        left.push(format!("netns {ns}"));
    }
    let prefix = format!("{NETNS_PREFIX}{pid:06x}");
    for entry in std::fs::read_dir(ETC_NETNS).into_iter().flatten().flatten() {
        if entry.file_name().to_string_lossy().starts_with(&prefix) {
            left.push(format!("pod resolv.conf {}", entry.path().display()));
        }
    }
    let links = Command::new("ip")
        .args(["-o", "link", "show"])
        .output()
        .map(|o| o.stdout)
        .unwrap_or_default();
    let bridge = format!("aeb{pid:06x}");
    for line in String::from_utf8_lossy(&links).lines() {
        if let Some(name) = line.split_whitespace().nth(1)
            && name.starts_with(&bridge)
        {
            left.push(format!("link {}", name.trim_end_matches(':')));
        }
    }
    for mount in mounts_under(work) {
        left.push(format!("mount {}", mount.display()));
    }
    let work_str = format!("{}/", work.display());
    for p in processes() {
        if p.pid != std::process::id() && !p.zombie && p.cmdline.contains(&work_str) {
            left.push(format!(
                "process {} ({})",
                p.pid,
                p.cmdline.chars().take(80).collect::<String>()
            ));
        }
    }
    if work.exists() {
        left.push(format!("directory {}", work.display()));
    }
    if let Some(base_id) = base_id
        && shm_path(base_id).exists()
    {
        left.push(format!("Envoy shared memory {}", shm_path(base_id).display()));
    }
    left
}

/// Removes what runs killed without cleaning up left (their pid is gone): processes working in their dir, netns
/// pins and their netns, Envoy's shared memory, the dir. Returns what it removed. Bridges and veths of dead
/// processes are swept by [`TestNode::new`].
pub fn sweep_leftovers() -> Vec<String> {
    let mut swept = Vec::new();
    let tmp = Path::new(WORK_BASE);
    let alive = |pid: u32| Path::new(&format!("/proc/{pid}")).exists();
    for entry in std::fs::read_dir(tmp).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name.strip_prefix(WORK_PREFIX).and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if pid == std::process::id() || alive(pid) {
            continue;
        }
        let dir = entry.path();
        let dir_str = format!("{}/", dir.display());
        for p in processes() {
            // Each process on its own (not its group: a shell that merely names the dir must not lose its group).
            if p.cmdline.contains(&dir_str) && p.pid != std::process::id() {
                let _ = kill(Pid::from_raw(p.pid as i32), Signal::SIGKILL);
            }
        }
        if let Some(base_id) = read_base_id(&dir.join("proxy/state")) {
            let _ = std::fs::remove_file(shm_path(base_id));
        }
        unmount_under(&dir);
        let _ = std::fs::remove_dir_all(&dir);
        swept.push(dir_str);
    }
    // Pod netns of dead processes (`aen-<pid>…`).
    for entry in std::fs::read_dir(crate::netns::NETNS_DIR)
        .into_iter()
        .flatten()
        .flatten()
    {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix(NETNS_PREFIX) else {
            continue;
        };
        let Some(pid) = rest.get(..6).and_then(|p| u32::from_str_radix(p, 16).ok()) else {
            continue;
        };
        if rest.len() == 10 && rest.chars().all(|c| c.is_ascii_hexdigit()) && !alive(pid) {
            let _ = Command::new("ip").args(["netns", "del", &name]).output();
            swept.push(format!("netns {name}"));
        }
    }
    // Their pods' resolv.conf (`/etc/netns/aen-<pid>…`).
    for entry in std::fs::read_dir(ETC_NETNS).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix(NETNS_PREFIX)
            .and_then(|rest| rest.get(..6))
            .and_then(|p| u32::from_str_radix(p, 16).ok())
        else {
            continue;
        };
        if !alive(pid) && std::fs::remove_dir_all(entry.path()).is_ok() {
            swept.push(format!("pod resolv.conf {}", entry.path().display()));
        }
    }
    swept
}

/// Where `ip netns exec <name>` finds per-netns files it bind-mounts over `/etc` (here: the pod's resolv.conf).
const ETC_NETNS: &str = "/etc/netns";

/// The resolv.conf kubelet gives a pod (`dnsPolicy: ClusterFirst`): the cluster DNS, the namespace's search path.
/// Commands run with `ip netns exec` in the pod see it as /etc/resolv.conf.
fn write_pod_resolv_conf(netns: &str) -> Result<(), DemoError> {
    let dir = Path::new(ETC_NETNS).join(netns);
    let conf = format!(
        "nameserver {CLUSTER_DNS}\nsearch {NAMESPACE}.svc.cluster.local svc.cluster.local cluster.local\noptions ndots:5\n"
    );
    std::fs::create_dir_all(&dir)
        .and_then(|()| std::fs::write(dir.join("resolv.conf"), conf))
        .map_err(|e| fail(format!("writing {}/resolv.conf: {e}", dir.display())))
}

fn remove_pod_resolv_conf(netns: &str) -> Result<(), String> {
    let dir = Path::new(ETC_NETNS).join(netns);
    match std::fs::remove_dir_all(&dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(format!("removing {}: {e}", dir.display())),
    }
}

// ---- pods' apps and client --------------------------------------------------------------------------------------

fn serve_echo(netns: &Path, name: &str) -> Result<App, DemoError> {
    let listener = run_in(netns, || std::net::TcpListener::bind((Ipv4Addr::UNSPECIFIED, APP_PORT)))
        .map_err(|e| fail(format!("pod {name}: bind :{APP_PORT}: {e}")))?;
    listener
        .set_nonblocking(true)
        .map_err(|e| fail(format!("pod {name}: {e}")))?;
    let listener = tokio::net::TcpListener::from_std(listener).map_err(|e| fail(format!("pod {name}: {e}")))?;
    let name: Arc<str> = Arc::from(name);
    let served = Arc::new(AtomicU64::new(0));
    let task = tokio::spawn(async move {
        let mut connections = JoinSet::new();
        loop {
            tokio::select! {
                accepted = listener.accept() => {
                    let Ok((stream, _)) = accepted else { continue };
                    let (name, served) = (name.clone(), served.clone());
                    connections.spawn(async move {
                        let service = service_fn(move |req| {
                            served.fetch_add(1, Ordering::Relaxed);
                            echo(name.clone(), req)
                        });
                        let _ = auto::Builder::new(TokioExecutor::new())
                            .serve_connection(TokioIo::new(stream), service)
                            .await;
                    });
                }
                Some(_) = connections.join_next(), if !connections.is_empty() => {}
            }
        }
    });
    Ok(App { task })
}

async fn echo(name: Arc<str>, req: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    let mut headers: BTreeMap<String, String> = BTreeMap::new();
    for (k, v) in req.headers() {
        let v = String::from_utf8_lossy(v.as_bytes()).into_owned();
        headers
            .entry(k.as_str().to_owned())
            .and_modify(|old| {
                old.push_str(", ");
                old.push_str(&v);
            })
            .or_insert(v);
    }
    let body = json!({
        "pod": &*name,
        "method": req.method().as_str(),
        "path": req.uri().path(),
        "headers": headers,
    });
    Ok(Response::builder()
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("response"))
}

#[derive(Debug)]
struct Reply {
    status: u16,
    body: String,
}

impl Reply {
    fn json(&self) -> Result<Value, DemoError> {
        serde_json::from_str(&self.body)
            .map_err(|e| fail(format!("the answer is not the app's JSON ({e}): {}", self.body)))
    }
}

/// An HTTP/1.1 GET whose socket lives in the netns at `netns` (the pod's app making a call).
async fn get_in(netns: &Path, addr: SocketAddr, host: &str, path: &str) -> Result<Reply, String> {
    let stream = run_in(netns, move || {
        std::net::TcpStream::connect_timeout(&addr, REQUEST_TIMEOUT)
    })
    .map_err(|e| format!("connect {addr}: {e}"))?;
    stream.set_nonblocking(true).map_err(|e| e.to_string())?;
    let stream = tokio::net::TcpStream::from_std(stream).map_err(|e| e.to_string())?;
    let exchange = async {
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| format!("handshake: {e}"))?;
        let driver = tokio::spawn(conn);
        let req = Request::get(path)
            .header(hyper::header::HOST, host)
            .body(Empty::<Bytes>::new())
            .map_err(|e| e.to_string())?;
        let resp = sender.send_request(req).await.map_err(|e| format!("request: {e}"))?;
        let status = resp.status().as_u16();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("body: {e}"))?
            .to_bytes();
        driver.abort();
        Ok(Reply {
            status,
            body: String::from_utf8_lossy(&body).into_owned(),
        })
    };
    tokio::time::timeout(REQUEST_TIMEOUT, exchange)
        .await
        .map_err(|_| format!("no answer within {REQUEST_TIMEOUT:?}"))?
}

/// The `URI=` values of an x-forwarded-client-cert header.
fn peer_uris(xfcc: &str) -> Vec<String> {
    xfcc.split([';', ','])
        .filter_map(|kv| kv.trim().strip_prefix("URI="))
        .map(|v| v.trim_matches('"').to_owned())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xfcc_uris_are_extracted() {
        let xfcc =
            "By=spiffe://cluster.local/ns/demo/sa/backend;Hash=ab;URI=spiffe://cluster.local/ns/demo/sa/frontend";
        assert_eq!(peer_uris(xfcc), ["spiffe://cluster.local/ns/demo/sa/frontend"]);
        assert!(peer_uris("Hash=ab").is_empty());
    }

    #[test]
    fn tail_keeps_the_last_lines() {
        assert_eq!(tail("a\nb\nc", 2), "b\nc");
        assert_eq!(tail("a", 5), "a");
    }
}
