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

use aether_tests::cni::{BareNetns, ConfList, DEBIAN_CNI_DIR, Sandbox, aether_table, bridge_plugin, run_in};
use aether_tests::control_plane::{ControlPlane, READER_ID, node_id};
use aether_tests::identity::TestCa;
use aether_tests::load::{Load, LoadSpec, Protocol};
use aether_tests::process::processes;
use aether_tests::supervisor::metric_sum;
use aether_tests::{ChildGuard, TestNode, free_port, http_get};

mod authorization;
mod bring_up;
mod canary;
mod edge;
mod pod_net;
mod processes;
mod show;
mod teardown;

use pod_net::*;
use processes::*;
pub use processes::{leftovers, sweep_leftovers};

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
pub const STEPS: usize = 19;
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
    /// The edge gateway: its admin, its supervisor's, its Envoy's, and its HTTPS listener.
    edge_admin: u16,
    edge_proxy_admin: u16,
    edge_envoy_admin: u16,
    edge_https: u16,
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
    pub canary: String,
    pub authorization: String,
    pub edge: String,
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
    /// The edge gateway's xDS server and its Envoy's supervisor.
    edge: Option<ChildGuard>,
    edge_proxy: Option<ChildGuard>,
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
                edge_admin: port(),
                edge_proxy_admin: port(),
                edge_envoy_admin: port(),
                edge_https: port(),
            },
            node: None,
            registrar: None,
            control_plane: None,
            agent: None,
            proxy: None,
            mesh_dns: None,
            edge: None,
            edge_proxy: None,
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
        self.bring_up().await?;
        self.show().await
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
             \x20 canary route:   {} (HTTPRoute 90/10; x-version: v2 pinned to the canary)\n\
             \x20 demand scoping: {} clusters in this node's Envoy for {} services in the catalog\n\
             \x20 hot restart:    {} requests during the restart, {} failed\n\
             \x20 unmanaged pod:  left alone (no capture rules, not registered, not in Envoy)\n\
             \x20 authorization:  {}\n\
             \x20 edge gateway:   {}",
            Self::fqdn("backend"),
            f.vip,
            f.spiffe_id,
            spread.join(" "),
            self.options.requests,
            f.canary,
            f.envoy_clusters,
            f.catalog_services,
            f.restart_ok,
            f.restart_failed,
            f.authorization,
            f.edge,
        )
    }
}

impl Drop for Demo {
    fn drop(&mut self) {
        if let Err(e) = self.teardown() {
            eprintln!("aether-demo: {e}");
        }
    }
}
