//! Traffic capture inside a pod's netns: the agent (not the CNI plugin) renders an
//! nftables ruleset per pod and applies it in one `nft -f -` transaction inside the
//! pod's pinned netns, so the rules are atomic, idempotent and repairable after an
//! agent restart.
//!
//! The ruleset (own table `inet aether`, NAT output hook):
//! - Envoy's own sockets (socket mark) and loopback are never touched;
//! - configured destination CIDRs and ports are never touched;
//! - TCP to the mesh VIP CIDR is redirected to the capture listener (`127.0.0.1:18001`);
//! - TCP to a mesh service's ClusterIP (the named set `mesh_cluster_ips`) is redirected
//!   there too, so a call to `<svc>.<ns>.svc.cluster.local` is routed like one to the VIP;
//!   both redirects count into the named counter `captured` (a NAT chain sees only a
//!   connection's first packet, so its packets are the connections captured), which
//!   `aether explain` reads to tell whether the pod's calls reach the mesh at all;
//! - DNS (UDP and TCP `:53`) is DNATed to mesh-dns, when an address is configured;
//! - in STRICT inbound mTLS, an input chain refuses TCP that does not come through the
//!   mesh or from the node (see `inbound`).
//!
//! The rendered ruleset of every captured pod is kept in `<state>/capture/<container id>.nft`
//! (the desired state); a fingerprint comment on the first rule lets a check tell whether
//! the pod's netns still holds exactly that ruleset. Its first line, an nft comment,
//! records the [`PodCapture`] it was rendered from, so a change of the pod's inbound mTLS
//! mode re-renders the whole table from it.
//!
//! The ClusterIP set's elements are not part of the desired state: they are the node's
//! current set of mesh ClusterIPs (see `cluster_ips`), added on every apply and repair and
//! replaced in every captured pod, atomically, when the set changes. Only ClusterIPs of
//! mesh services are captured, never a service CIDR: Envoy's upstream connections leave
//! from the node, so a non-mesh ClusterIP must stay the pod's own business.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use aether_common::quote::quote;
use aether_proto::cni::v1::{CaptureMode, CaptureOptions};
use futures::TryStreamExt;
use ipnet::IpNet;
use tokio::io::AsyncWriteExt;

/// The nftables table the agent owns in every captured pod's netns.
pub const TABLE: &str = "inet aether";
/// Default mesh VIP range (the range Istio uses for auto-allocated VIPs).
pub const DEFAULT_VIP_CIDR: &str = "240.240.0.0/16";
/// Default mark Envoy's upstream sockets carry (`SO_MARK`); such traffic is never captured.
pub const DEFAULT_PROXY_MARK: u32 = 0x4145;
/// How long one `nft` invocation may take.
const NFT_TIMEOUT: Duration = Duration::from_secs(10);
/// Sub-directory of the state dir holding the desired ruleset per pod.
const STATE_SUBDIR: &str = "capture";
/// The comment prefix that carries the ruleset's fingerprint.
const FINGERPRINT: &str = "aether-capture";
/// The named set of mesh ClusterIPs in [`TABLE`].
pub const CLUSTER_IP_SET: &str = "mesh_cluster_ips";
/// The comment prefix of the desired state's first line, the pod's [`PodCapture`].
const SPEC: &str = "# aether-spec ";
/// The named counter of connections the redirects captured.
pub const CAPTURED_COUNTER: &str = "captured";

pub mod cluster_ips;
pub mod inbound;
pub use cluster_ips::ClusterIps;
pub use inbound::InboundMtls;

#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    #[error("capture.mesh_dns: {} is not an ip:port address", quote(.0))]
    MeshDns(String),
    #[error("capture.excluded_cidrs[{index}]: {} is not a CIDR", quote(.value))]
    Cidr { index: usize, value: String },
    #[error("capture.excluded_ports[{index}]: {value} is not a port (1..=65535)")]
    Port { index: usize, value: u32 },
    #[error("capture.mode: {0} is not a known capture mode")]
    Mode(i32),
    #[error("running `{command}` in {netns}: {source}")]
    Spawn {
        command: String,
        netns: String,
        source: std::io::Error,
    },
    #[error("`{command}` in {netns} failed: {stderr}")]
    Nft {
        command: String,
        netns: String,
        stderr: String,
    },
    #[error("`{command}` in {netns} did not finish within {NFT_TIMEOUT:?}")]
    Timeout { command: String, netns: String },
    #[error("capture state {path}: {source}")]
    State { path: String, source: std::io::Error },
    #[error("capture state {path}: no pod capture recorded (written before inbound mTLS modes); re-add the pod")]
    NoSpec { path: String },
    #[error("reading the addresses of {netns}: {source}")]
    Netlink {
        netns: String,
        source: aether_common::netns::NetlinkError,
    },
}

/// Node-wide capture settings (agent flags).
#[derive(Clone, Debug)]
pub struct CaptureConfig {
    pub vip_cidr: IpNet,
    /// mesh-dns on this node; a pod's own option overrides it.
    pub mesh_dns: Option<SocketAddr>,
    pub proxy_mark: u32,
    /// Where the desired rulesets live (`<state>/capture`).
    pub state_dir: PathBuf,
    /// The `nft` binary.
    pub nft: PathBuf,
    /// The node's mesh ClusterIPs, shared by every clone (what every captured pod's set holds).
    pub cluster_ips: ClusterIps,
    /// The node's default inbound mTLS mode (a pod's annotation overrides it).
    pub inbound_mtls: InboundMtls,
}

impl CaptureConfig {
    pub fn new(state_dir: &Path, vip_cidr: IpNet, mesh_dns: Option<SocketAddr>, proxy_mark: u32) -> Self {
        CaptureConfig {
            vip_cidr,
            mesh_dns,
            proxy_mark,
            state_dir: state_dir.join(STATE_SUBDIR),
            nft: PathBuf::from("nft"),
            cluster_ips: ClusterIps::default(),
            inbound_mtls: InboundMtls::default(),
        }
    }

    pub fn with_inbound_mtls(self, inbound_mtls: InboundMtls) -> Self {
        CaptureConfig { inbound_mtls, ..self }
    }
}

/// One pod's capture, validated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodCapture {
    pub vip_cidr: IpNet,
    pub mesh_dns: Option<SocketAddr>,
    pub proxy_mark: u32,
    pub excluded_ports: Vec<u16>,
    pub excluded_cidrs: Vec<IpNet>,
    /// The pod's effective mode ([`inbound::effective`]); the node's default until the
    /// pod is known.
    pub inbound_mtls: InboundMtls,
}

/// A [`PodCapture`] as the desired state's first line records it (JSON).
#[derive(serde::Serialize, serde::Deserialize)]
struct Spec {
    vip_cidr: String,
    mesh_dns: Option<SocketAddr>,
    proxy_mark: u32,
    excluded_ports: Vec<u16>,
    excluded_cidrs: Vec<String>,
    inbound_mtls: InboundMtls,
}

impl PodCapture {
    fn spec_line(&self) -> String {
        let spec = Spec {
            vip_cidr: self.vip_cidr.to_string(),
            mesh_dns: self.mesh_dns,
            proxy_mark: self.proxy_mark,
            excluded_ports: self.excluded_ports.clone(),
            excluded_cidrs: self.excluded_cidrs.iter().map(IpNet::to_string).collect(),
            inbound_mtls: self.inbound_mtls,
        };
        format!("{SPEC}{}\n", serde_json::to_string(&spec).expect("a spec serialises"))
    }

    /// The capture a desired ruleset was rendered from (`None`: none recorded).
    fn from_ruleset(ruleset: &str) -> Option<PodCapture> {
        let spec: Spec = serde_json::from_str(ruleset.lines().next()?.strip_prefix(SPEC)?).ok()?;
        Some(PodCapture {
            vip_cidr: spec.vip_cidr.parse().ok()?,
            mesh_dns: spec.mesh_dns,
            proxy_mark: spec.proxy_mark,
            excluded_ports: spec.excluded_ports,
            excluded_cidrs: spec
                .excluded_cidrs
                .iter()
                .map(|c| c.parse().ok())
                .collect::<Option<_>>()?,
            inbound_mtls: spec.inbound_mtls,
        })
    }
}

/// Validates a request's options against the node's settings. `None`: the pod is not captured.
pub fn pod_capture(
    config: &CaptureConfig,
    options: Option<&CaptureOptions>,
) -> Result<Option<PodCapture>, CaptureError> {
    let default = CaptureOptions::default();
    let options = options.unwrap_or(&default);
    match CaptureMode::try_from(options.mode) {
        Ok(CaptureMode::None) => return Ok(None),
        Ok(CaptureMode::Vip | CaptureMode::Unspecified) => {}
        Err(_) => return Err(CaptureError::Mode(options.mode)),
    }
    let mesh_dns = if options.mesh_dns.is_empty() {
        config.mesh_dns
    } else {
        Some(
            options
                .mesh_dns
                .parse()
                .map_err(|_| CaptureError::MeshDns(options.mesh_dns.clone()))?,
        )
    };
    let mut excluded_ports = Vec::new();
    for (index, &value) in options.excluded_ports.iter().enumerate() {
        match u16::try_from(value) {
            Ok(p) if p != 0 => excluded_ports.push(p),
            _ => return Err(CaptureError::Port { index, value }),
        }
    }
    let mut excluded_cidrs = Vec::new();
    for (index, value) in options.excluded_cidrs.iter().enumerate() {
        let cidr = value
            .parse::<IpNet>()
            .or_else(|_| value.parse::<IpAddr>().map(IpNet::from))
            .map_err(|_| CaptureError::Cidr {
                index,
                value: value.clone(),
            })?;
        excluded_cidrs.push(cidr.trunc());
    }
    excluded_ports.sort_unstable();
    excluded_ports.dedup();
    excluded_cidrs.sort();
    excluded_cidrs.dedup();
    Ok(Some(PodCapture {
        vip_cidr: config.vip_cidr,
        mesh_dns,
        proxy_mark: config.proxy_mark,
        excluded_ports,
        excluded_cidrs,
        inbound_mtls: config.inbound_mtls,
    }))
}

fn family(net: &IpNet) -> &'static str {
    match net {
        IpNet::V4(_) => "ip",
        IpNet::V6(_) => "ip6",
    }
}

/// The rules of the table's output chain, one statement per line (nft 1.0.6 rejects
/// several on one line).
fn rules(capture: &PodCapture) -> Vec<String> {
    let mut rules = vec![
        format!("meta mark {:#x} return", capture.proxy_mark),
        "ip daddr 127.0.0.0/8 return".to_owned(),
        "ip6 daddr ::1 return".to_owned(),
    ];
    for cidr in &capture.excluded_cidrs {
        rules.push(format!("{} daddr {cidr} return", family(cidr)));
    }
    for port in &capture.excluded_ports {
        rules.push(format!("tcp dport {port} return"));
        rules.push(format!("udp dport {port} return"));
    }
    let port = crate::xds::resources::CAPTURE_PORT;
    let (family, vips) = (family(&capture.vip_cidr), capture.vip_cidr);
    rules.push(format!(
        "{family} daddr {vips} meta l4proto tcp counter name {CAPTURED_COUNTER} redirect to :{port}"
    ));
    rules.push(format!(
        "ip daddr @{CLUSTER_IP_SET} meta l4proto tcp counter name {CAPTURED_COUNTER} redirect to :{port}"
    ));
    if let Some(dns) = capture.mesh_dns {
        let (nfproto, fam, target) = match dns {
            SocketAddr::V4(a) => ("ipv4", "ip", a.to_string()),
            SocketAddr::V6(a) => ("ipv6", "ip6", format!("[{}]:{}", a.ip(), a.port())),
        };
        for proto in ["udp", "tcp"] {
            rules.push(format!(
                "meta nfproto {nfproto} {proto} dport 53 dnat {fam} to {target}"
            ));
        }
    }
    rules
}

fn fingerprint(rules: &[String]) -> String {
    let hash = aether_common::hash::fnv1a(rules.join("\n").as_bytes());
    format!("{FINGERPRINT} {hash:016x}")
}

/// Replaces whatever table is there: create-then-delete never fails, and the table is
/// re-added with its complete contents, atomically.
fn replacing() -> String {
    format!("table {TABLE} {{\n}}\ndelete table {TABLE}\n")
}

/// Only where the table is not (a new pod's netns): the transaction fails, changing
/// nothing, if it is. It spares what deleting a table costs: the kernel waits for an RCU
/// grace period when nft's netlink socket closes (~10 ms of every ADD, measured).
fn creating() -> String {
    format!("create table {TABLE}\n")
}

/// The whole `nft -f` transaction, idempotent (see [`replacing`]).
/// `node` are the node's addresses, which a STRICT pod's input chain admits.
pub fn render(capture: &PodCapture, node: &[IpAddr]) -> String {
    let rules = rules(capture);
    let inbound = (capture.inbound_mtls == InboundMtls::Strict).then(|| inbound::rules(node));
    let fp = fingerprint(&[rules.as_slice(), inbound.as_deref().unwrap_or_default()].concat());
    let mut out = capture.spec_line();
    out.push_str(&replacing());
    out.push_str(&format!("table {TABLE} {{\n"));
    if let Some(inbound) = &inbound {
        out.push_str(&inbound::render(inbound));
    }
    // IPv4 only: the capture listener is on 127.0.0.1.
    out.push_str(&format!(
        "  counter {CAPTURED_COUNTER} {{\n  }}\n  set {CLUSTER_IP_SET} {{\n    type ipv4_addr\n  }}\n  chain output {{\n"
    ));
    out.push_str("    type nat hook output priority -100\n    policy accept\n");
    for (i, rule) in rules.iter().enumerate() {
        if i == 0 {
            out.push_str(&format!("    {rule} comment \"{fp}\"\n"));
        } else {
            out.push_str(&format!("    {rule}\n"));
        }
    }
    out.push_str("  }\n}\n");
    out
}

/// The fingerprint comment a rendered ruleset carries.
fn fingerprint_of(ruleset: &str) -> Option<&str> {
    let start = ruleset.find(FINGERPRINT)?;
    let rest = &ruleset[start..];
    let end = rest.find('"')?;
    Some(&rest[..end])
}

/// Removing the table: idempotent (an absent table is created first).
fn render_removal() -> String {
    format!("table {TABLE} {{\n}}\ndelete table {TABLE}\n")
}

pub(crate) async fn nft(
    config: &CaptureConfig,
    netns: &Path,
    args: &[&str],
    stdin: Option<&str>,
) -> Result<String, CaptureError> {
    let command = format!("nft {}", args.join(" "));
    let netns_s = netns.display().to_string();
    let mut cmd = tokio::process::Command::new("nsenter");
    cmd.arg(format!("--net={}", netns.display()))
        .arg("--")
        .arg(&config.nft)
        .args(args)
        .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let mut child = cmd.spawn().map_err(|source| CaptureError::Spawn {
        command: command.clone(),
        netns: netns_s.clone(),
        source,
    })?;
    if let Some(input) = stdin {
        let mut pipe = child.stdin.take().expect("stdin is piped");
        pipe.write_all(input.as_bytes())
            .await
            .map_err(|source| CaptureError::Spawn {
                command: command.clone(),
                netns: netns_s.clone(),
                source,
            })?;
        drop(pipe);
    }
    let output = tokio::time::timeout(NFT_TIMEOUT, child.wait_with_output())
        .await
        .map_err(|_| CaptureError::Timeout {
            command: command.clone(),
            netns: netns_s.clone(),
        })?
        .map_err(|source| CaptureError::Spawn {
            command: command.clone(),
            netns: netns_s.clone(),
            source,
        })?;
    if !output.status.success() {
        return Err(CaptureError::Nft {
            command,
            netns: netns_s,
            stderr: String::from_utf8_lossy(&output.stderr).trim().to_owned(),
        });
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

fn state_path(config: &CaptureConfig, container_id: &str) -> PathBuf {
    config.state_dir.join(format!("{container_id}.nft"))
}

/// Applies `capture` inside `netns` and records it as the pod's desired state.
pub async fn apply(
    config: &CaptureConfig,
    container_id: &str,
    netns: &Path,
    capture: &PodCapture,
) -> Result<(), CaptureError> {
    let node = match capture.inbound_mtls {
        InboundMtls::Strict => inbound::node_addresses().await?,
        InboundMtls::Permissive => Vec::new(),
    };
    let ruleset = render(capture, &node);
    let path = state_path(config, container_id);
    // The desired state is written (fsynced) while nft runs; a failure of either
    // fails the ADD, which removes both.
    let record = {
        let (dir, path, ruleset) = (config.state_dir.clone(), path.clone(), ruleset.clone());
        tokio::task::spawn_blocking(move || {
            std::fs::create_dir_all(&dir)?;
            aether_common::fs::write_atomic(&path, ruleset.as_bytes(), 0o600)
        })
    };
    let elements = config.cluster_ips.get();
    let with_elements = format!("{ruleset}{}", cluster_ips::render_elements(&elements));
    let (applied, recorded) = tokio::join!(create_or_replace(config, netns, &with_elements), record);
    applied?;
    recorded
        .unwrap_or_else(|e| Err(std::io::Error::other(e)))
        .map_err(|source| CaptureError::State {
            path: path.display().to_string(),
            source,
        })?;
    // The set changed while this pod was applied: the sync may have listed the pods
    // before its state was recorded, so the newer set is put in here.
    let current = config.cluster_ips.get();
    if current != elements {
        cluster_ips::replace(config, netns, &current).await?;
    }
    Ok(())
}

/// A rendered ruleset as the transaction for a netns without the table.
fn as_new(ruleset: &str) -> String {
    ruleset.replacen(&replacing(), &creating(), 1)
}

/// Applies a rendered `ruleset` as a new table, or, when the netns already has one (a
/// retried ADD), as the idempotent replacement it was rendered as.
async fn create_or_replace(config: &CaptureConfig, netns: &Path, ruleset: &str) -> Result<(), CaptureError> {
    match nft(config, netns, &["-f", "-"], Some(&as_new(ruleset))).await {
        Err(CaptureError::Nft { stderr, .. }) if stderr.contains("File exists") => {
            nft(config, netns, &["-f", "-"], Some(ruleset)).await.map(drop)
        }
        applied => applied.map(drop),
    }
}

/// The capture the pod's desired state was rendered from; `None`: not captured.
pub fn applied(config: &CaptureConfig, container_id: &str) -> Result<Option<PodCapture>, CaptureError> {
    let Some(ruleset) = desired(config, container_id)? else {
        return Ok(None);
    };
    PodCapture::from_ruleset(&ruleset)
        .map(Some)
        .ok_or_else(|| CaptureError::NoSpec {
            path: state_path(config, container_id).display().to_string(),
        })
}

/// Re-applies a captured pod's table, atomically, if its inbound mTLS mode is not
/// `mode` any more (its annotation changed). Returns whether it did.
pub async fn set_inbound_mtls(
    config: &CaptureConfig,
    container_id: &str,
    netns: &Path,
    mode: InboundMtls,
) -> Result<bool, CaptureError> {
    match applied(config, container_id)? {
        Some(capture) if capture.inbound_mtls != mode => {
            let capture = PodCapture {
                inbound_mtls: mode,
                ..capture
            };
            apply(config, container_id, netns, &capture).await?;
            Ok(true)
        }
        _ => Ok(false),
    }
}

/// A known pod's metadata or its namespace's mode (`namespace`, from MeshConfig)
/// changed: its table follows its (maybe new) effective mode.
pub async fn follow_inbound_mtls(config: &CaptureConfig, pod: &crate::pod::LocalPod, namespace: Option<InboundMtls>) {
    let mode = inbound::effective(config.inbound_mtls, namespace, &pod.info);
    match set_inbound_mtls(config, &pod.container_id, &pod.netns, mode).await {
        Ok(true) => {
            tracing::info!(pod = %pod.id(), inbound_mtls = %mode, "inbound mTLS mode changed; rules re-applied")
        }
        Ok(false) => {}
        Err(error) => tracing::warn!(pod = %pod.id(), %error, "applying the pod's inbound mTLS mode failed"),
    }
}

/// Removes the pod's table (if its netns still exists) and its desired state. Idempotent.
pub async fn remove(config: &CaptureConfig, container_id: &str, netns: &Path) -> Result<(), CaptureError> {
    if netns.exists() {
        nft(config, netns, &["-f", "-"], Some(&render_removal())).await?;
    }
    forget(config, container_id)
}

/// Drops the pod's desired state only (its netns is gone).
pub fn forget(config: &CaptureConfig, container_id: &str) -> Result<(), CaptureError> {
    let path = state_path(config, container_id);
    match std::fs::remove_file(&path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(CaptureError::State {
            path: path.display().to_string(),
            source,
        }),
    }
}

/// What a check found.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The pod is not captured (no desired state).
    NotCaptured,
    /// The netns holds the desired ruleset; what its counters read.
    Intact(Counters),
    /// The table is missing or differs.
    Drifted,
}

/// The table's named counters, since it was last applied.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Connections redirected to Envoy (to a VIP or a mesh ClusterIP).
    pub captured: u64,
    /// Connections the STRICT input chain refused; `None` without that chain.
    pub refused_plaintext: Option<u64>,
}

impl Counters {
    fn of(listing: &str) -> Counters {
        Counters {
            captured: packets(listing, CAPTURED_COUNTER).unwrap_or_default(),
            refused_plaintext: packets(listing, inbound::REFUSED_COUNTER),
        }
    }
}

/// The packet count of the named counter in an `nft list table` listing.
fn packets(listing: &str, counter: &str) -> Option<u64> {
    let block = &listing[listing.find(&format!("counter {counter} {{"))?..];
    let rest = &block[block.find("packets ")? + "packets ".len()..];
    rest.split_whitespace().next()?.parse().ok()
}

/// Does the pod's netns still hold its desired ruleset?
pub async fn check(config: &CaptureConfig, container_id: &str, netns: &Path) -> Result<Verdict, CaptureError> {
    let Some(desired) = desired(config, container_id)? else {
        return Ok(Verdict::NotCaptured);
    };
    let Some(want) = fingerprint_of(&desired) else {
        return Ok(Verdict::Drifted);
    };
    match nft(config, netns, &["list", "table", "inet", "aether"], None).await {
        Ok(listing) if fingerprint_of(&listing) == Some(want) => Ok(Verdict::Intact(Counters::of(&listing))),
        Ok(_) => Ok(Verdict::Drifted),
        Err(CaptureError::Nft { stderr, .. }) if stderr.contains("No such file or directory") => Ok(Verdict::Drifted),
        Err(e) => Err(e),
    }
}

pub(crate) fn desired(config: &CaptureConfig, container_id: &str) -> Result<Option<String>, CaptureError> {
    let path = state_path(config, container_id);
    match std::fs::read_to_string(&path) {
        Ok(s) => Ok(Some(s)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(CaptureError::State {
            path: path.display().to_string(),
            source,
        }),
    }
}

/// Checks the pod's rules and re-applies the desired ruleset if they drifted. Returns
/// whether a repair was needed.
pub async fn repair(config: &CaptureConfig, container_id: &str, netns: &Path) -> Result<bool, CaptureError> {
    match check(config, container_id, netns).await? {
        Verdict::NotCaptured | Verdict::Intact(_) => Ok(false),
        Verdict::Drifted => {
            let ruleset = desired(config, container_id)?.unwrap_or_default();
            let elements = cluster_ips::render_elements(&config.cluster_ips.get());
            nft(config, netns, &["-f", "-"], Some(&format!("{ruleset}{elements}"))).await?;
            Ok(true)
        }
    }
}

/// Desired-state files whose pod the agent no longer knows (e.g. the agent died between
/// forgetting a pod and dropping its state).
pub fn orphans(config: &CaptureConfig, known: &[String]) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(&config.state_dir) else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str()?.strip_suffix(".nft").map(str::to_owned))
        .filter(|id| !known.contains(id))
        .collect()
}

/// Unmounts and deletes a netns pin the CNI plugin made, if `netns` is under `pin_dir`
/// (anything else, e.g. an `ip netns` name, is not ours to remove). Idempotent.
pub fn unpin(pin_dir: &Path, netns: &Path) -> std::io::Result<bool> {
    if netns.parent() != Some(pin_dir) {
        return Ok(false);
    }
    match nix::mount::umount2(netns, nix::mount::MntFlags::MNT_DETACH) {
        Ok(()) | Err(nix::errno::Errno::EINVAL) | Err(nix::errno::Errno::ENOENT) => {}
        Err(e) => return Err(std::io::Error::from(e)),
    }
    match std::fs::remove_file(netns) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

/// The pod's global addresses, read with netlink inside its netns (loopback and
/// link-local skipped): the fallback when AddPod carries no IPs.
pub async fn pod_addresses(netns: &Path) -> Result<Vec<IpAddr>, CaptureError> {
    aether_common::netns::query(netns, read_addresses)
        .await
        .map_err(|source| CaptureError::Netlink {
            netns: netns.display().to_string(),
            source,
        })
}

/// The address dump of a pod's netns failed.
#[derive(Debug, thiserror::Error)]
#[error("address dump: {0}")]
struct AddressDump(rtnetlink::Error);

async fn read_addresses(handle: rtnetlink::Handle) -> Result<Vec<IpAddr>, AddressDump> {
    let mut out = Vec::new();
    let mut addrs = handle.address().get().execute();
    while let Some(msg) = addrs.try_next().await.map_err(AddressDump)? {
        for attr in &msg.attributes {
            if let netlink_packet_route::address::AddressAttribute::Address(ip) = attr
                && is_pod_address(ip)
            {
                out.push(*ip);
            }
        }
    }
    out.sort();
    out.dedup();
    Ok(out)
}

fn is_pod_address(ip: &IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => !v4.is_loopback() && !v4.is_link_local(),
        IpAddr::V6(v6) => !v6.is_loopback() && !v6.is_unicast_link_local(),
    }
}

/// Start-up: every known pod's capture is checked and repaired; desired state left by
/// pods that are gone is dropped.
pub async fn reconcile(config: &CaptureConfig, pods: &[crate::pod::LocalPod]) {
    let mut repaired = 0;
    for pod in pods {
        match repair(config, &pod.container_id, &pod.netns).await {
            Ok(true) => {
                repaired += 1;
                tracing::warn!(pod = %pod.id(), "capture rules were missing or changed; repaired");
            }
            Ok(false) => {}
            Err(error) => tracing::error!(pod = %pod.id(), %error, "checking the pod's capture rules failed"),
        }
    }
    let known: Vec<String> = pods.iter().map(|p| p.container_id.clone()).collect();
    for id in orphans(config, &known) {
        let _ = forget(config, &id);
    }
    tracing::info!(pods = pods.len(), repaired, "capture rules reconciled");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> CaptureConfig {
        CaptureConfig::new(
            Path::new("/tmp/x"),
            DEFAULT_VIP_CIDR.parse().unwrap(),
            Some("10.0.0.1:18054".parse().unwrap()),
            DEFAULT_PROXY_MARK,
        )
    }

    #[test]
    fn the_default_ruleset_captures_vips_and_dns_one_statement_per_line() {
        let capture = pod_capture(&config(), None).unwrap().unwrap();
        let text = render(&capture, &[]);
        assert!(text.contains("\ntable inet aether {\n}\ndelete table inet aether\ntable inet aether {\n"));
        assert!(text.contains("    type nat hook output priority -100\n    policy accept\n"));
        assert!(text.contains("    meta mark 0x4145 return comment \"aether-capture "));
        assert!(
            text.contains("    ip daddr 240.240.0.0/16 meta l4proto tcp counter name captured redirect to :18001\n")
        );
        assert!(text.contains("  counter captured {\n  }\n  set mesh_cluster_ips {\n    type ipv4_addr\n  }\n"));
        assert!(
            text.contains("    ip daddr @mesh_cluster_ips meta l4proto tcp counter name captured redirect to :18001\n")
        );
        assert!(text.contains("    meta nfproto ipv4 udp dport 53 dnat ip to 10.0.0.1:18054\n"));
        assert!(text.contains("    meta nfproto ipv4 tcp dport 53 dnat ip to 10.0.0.1:18054\n"));
        for line in text.lines() {
            assert!(line.matches(';').count() == 0, "{line}");
        }
        // Exclusions come before the capture rules.
        let exclusion = text.find("127.0.0.0/8 return").unwrap();
        assert!(exclusion < text.find("redirect").unwrap());
    }

    #[test]
    fn options_override_and_are_validated_with_the_field_named() {
        let options = CaptureOptions {
            mode: CaptureMode::Vip as i32,
            mesh_dns: "[fd00::1]:53".into(),
            excluded_ports: vec![15000, 80, 80],
            excluded_cidrs: vec!["10.1.2.3/8".into(), "192.0.2.7".into()],
        };
        let capture = pod_capture(&config(), Some(&options)).unwrap().unwrap();
        assert_eq!(capture.excluded_ports, vec![80, 15000]);
        let text = render(&capture, &[]);
        assert!(text.contains("    ip daddr 10.0.0.0/8 return\n"));
        assert!(text.contains("    ip daddr 192.0.2.7/32 return\n"));
        assert!(text.contains("    tcp dport 15000 return\n"));
        assert!(text.contains("dnat ip6 to [fd00::1]:53\n"));
        let bad = |o: CaptureOptions| pod_capture(&config(), Some(&o)).unwrap_err().to_string();
        assert_eq!(
            bad(CaptureOptions {
                mesh_dns: "nope".into(),
                ..Default::default()
            }),
            "capture.mesh_dns: \"nope\" is not an ip:port address"
        );
        assert_eq!(
            bad(CaptureOptions {
                excluded_ports: vec![1, 70000],
                ..Default::default()
            }),
            "capture.excluded_ports[1]: 70000 is not a port (1..=65535)"
        );
        assert_eq!(
            bad(CaptureOptions {
                excluded_cidrs: vec!["10.0.0.0/33".into()],
                ..Default::default()
            }),
            "capture.excluded_cidrs[0]: \"10.0.0.0/33\" is not a CIDR"
        );
        assert_eq!(
            bad(CaptureOptions {
                mode: 9,
                ..Default::default()
            }),
            "capture.mode: 9 is not a known capture mode"
        );
        let none = CaptureOptions {
            mode: CaptureMode::None as i32,
            ..Default::default()
        };
        assert_eq!(pod_capture(&config(), Some(&none)).unwrap(), None);
    }

    #[test]
    fn counters_are_read_from_the_table_listing_by_name() {
        let listing = "table inet aether {\n\tcounter refused_plaintext {\n\t\tpackets 2 bytes 120\n\t}\n\n\tcounter captured {\n\t\tpackets 7 bytes 420\n\t}\n\tchain output {\n\t\tip daddr 240.240.0.0/16 meta l4proto tcp counter name \"captured\" redirect to :18001\n\t}\n}\n";
        let want = Counters {
            captured: 7,
            refused_plaintext: Some(2),
        };
        assert_eq!(Counters::of(listing), want);
        let permissive = "table inet aether {\n\tcounter captured {\n\t\tpackets 0 bytes 0\n\t}\n}\n";
        assert_eq!(Counters::of(permissive), Counters::default());
    }

    #[test]
    fn the_fingerprint_follows_the_rules() {
        let a = render(&pod_capture(&config(), None).unwrap().unwrap(), &[]);
        let mut other = config();
        other.mesh_dns = None;
        let b = render(&pod_capture(&other, None).unwrap().unwrap(), &[]);
        assert_ne!(fingerprint_of(&a), fingerprint_of(&b));
        assert_eq!(fingerprint_of(&a), fingerprint_of(&a.clone()));
        assert!(!b.contains("dport 53"));
    }

    #[test]
    fn strict_adds_the_input_chain_permissive_does_not_and_the_fingerprint_tells_them_apart() {
        let strict = pod_capture(&config(), None).unwrap().unwrap();
        assert_eq!(strict.inbound_mtls, InboundMtls::Strict, "the node default is strict");
        let node = ["10.200.1.1".parse().unwrap()];
        let text = render(&strict, &node);
        let table = text.find("table inet aether {\n  ").unwrap();
        assert!(text[table..].contains("  chain inbound {\n    type filter hook input priority 0\n"));
        assert!(text.contains("    ip saddr { 10.200.1.1 } accept\n"));
        assert!(text.contains("    meta l4proto tcp counter name refused_plaintext reject with tcp reset\n"));
        let permissive = PodCapture {
            inbound_mtls: InboundMtls::Permissive,
            ..strict.clone()
        };
        let open = render(&permissive, &node);
        assert!(
            !open.contains("chain inbound") && !open.contains("refused_plaintext"),
            "{open}"
        );
        assert_ne!(fingerprint_of(&text), fingerprint_of(&open));
        let other_node = render(&strict, &["10.200.2.1".parse().unwrap()]);
        assert_ne!(fingerprint_of(&text), fingerprint_of(&other_node));
    }

    #[test]
    fn a_new_pods_transaction_creates_the_table_and_deletes_nothing() {
        let text = render(&pod_capture(&config(), None).unwrap().unwrap(), &[]);
        assert_eq!(text.matches("delete table inet aether\n").count(), 1, "{text}");
        let new = as_new(&text);
        assert!(new.contains("create table inet aether\ntable inet aether {\n"), "{new}");
        assert!(!new.contains("delete"), "{new}");
        assert_eq!(new.replacen(&creating(), &replacing(), 1), text);
    }

    #[test]
    fn the_desired_state_records_the_capture_it_was_rendered_from() {
        let options = CaptureOptions {
            excluded_ports: vec![9000],
            excluded_cidrs: vec!["10.1.0.0/16".into(), "fd00::/8".into()],
            ..Default::default()
        };
        let capture = PodCapture {
            inbound_mtls: InboundMtls::Permissive,
            ..pod_capture(&config(), Some(&options)).unwrap().unwrap()
        };
        let text = render(&capture, &[]);
        assert!(text.starts_with("# aether-spec {"), "{text}");
        assert_eq!(text.lines().next().unwrap().matches('\n').count(), 0);
        assert_eq!(PodCapture::from_ruleset(&text), Some(capture));
        assert_eq!(PodCapture::from_ruleset("table inet aether {\n}\n"), None);
    }

    #[test]
    fn only_pins_under_the_pin_dir_are_removed() {
        assert!(!unpin(Path::new("/var/run/aether/netns"), Path::new("/var/run/netns/x")).unwrap());
    }

    proptest::proptest! {
        #[test]
        fn cidr_options_never_panic(s in "\\PC{0,24}") {
            let o = CaptureOptions { excluded_cidrs: vec![s], ..Default::default() };
            let _ = pod_capture(&config(), Some(&o));
        }
    }
}
