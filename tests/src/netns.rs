//! A test "node": a Linux bridge in the root network namespace with a private /24, and "pods" that are network
//! namespaces plugged into it with a veth pair.
//!
//! Every object created here is named after the creating process (`aeb<pid><seq>` bridges, `aep-<pid><seq>`
//! namespaces, `aev<pid><seq>` host veths), owned by a guard whose `Drop` deletes it, and swept by the next
//! [`TestNode::new`] if its process died without unwinding (SIGKILL, abort). Commands are run with iproute2's `ip`;
//! a failing command panics with its command line and stderr.

use parking_lot::{Mutex, MutexGuard};
use std::collections::{BTreeMap, BTreeSet};
use std::fs::{File, OpenOptions};
use std::hash::{BuildHasher, Hasher, RandomState};
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use nix::sched::{CloneFlags, setns};

/// Where `ip netns` keeps its named namespaces.
pub const NETNS_DIR: &str = "/var/run/netns";
/// Serialises subnet choice, namespace creation and sweeping between concurrently running test processes.
const LOCK_PATH: &str = "/run/aether-tests-netns.lock";
const BRIDGE_PREFIX: &str = "aeb";
const NETNS_PREFIX: &str = "aep-";
const VETH_PREFIX: &str = "aev";
/// Test subnets are /24s inside 10.200.0.0/13 (10.200.0.0 – 10.207.255.255).
const SUBNET_SECOND_OCTETS: std::ops::RangeInclusive<u8> = 200..=207;
const SUBNET_ATTEMPTS: usize = 128;

/// Per-process sequence for unique names; the pid part makes them unique across processes.
static SEQ: AtomicU32 = AtomicU32::new(0);

/// Panics unless the process runs as root and iproute2's `ip` is usable: these tests need root and network
/// namespaces, and a test that cannot get them must fail, not pass silently.
pub fn require_root() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "these tests need root and network namespaces: run them as root (euid is {})",
        nix::unistd::geteuid()
    );
    match Command::new("ip").arg("-V").output() {
        Ok(out) if out.status.success() => {}
        Ok(out) => panic!(
            "these tests need root and network namespaces: `ip -V` failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ),
        Err(e) => panic!("these tests need root and network namespaces: cannot run iproute2's `ip`: {e}"),
    }
}

/// A bridge in the root netns with a /24 and its gateway (`.1`) on it. Pods are added with [`TestNode::add_pod`].
///
/// Dropping the node deletes the bridge and every pod of it that is still alive (a pod that outlives its node is
/// inert: its own drop then does nothing).
pub struct TestNode {
    shared: Arc<NodeShared>,
}

struct NodeShared {
    bridge: String,
    /// The network address of the node's /24.
    subnet: Ipv4Addr,
    state: Mutex<NodeState>,
}

#[derive(Default)]
struct NodeState {
    /// Host parts in use (1 is the gateway).
    hosts: BTreeSet<u8>,
    /// Live pods: netns name -> host veth name.
    pods: BTreeMap<String, String>,
    torn_down: bool,
}

impl NodeShared {
    fn state(&self) -> MutexGuard<'_, NodeState> {
        self.state.lock()
    }
}

impl TestNode {
    /// Creates the bridge on a free /24 of 10.200.0.0/13. Panics (after cleaning up) if anything fails.
    #[expect(
        clippy::new_without_default,
        reason = "creating a node has side effects; no implicit Default"
    )]
    pub fn new() -> TestNode {
        require_root();
        sweep_stale();
        let _lock = global_lock();
        let subnet = pick_subnet();
        let bridge = create_unique(BRIDGE_PREFIX, 2, |name| {
            ip_try(&["link", "add", "name", name, "type", "bridge"])
        });
        // From here on the guard owns the bridge: a later failure unwinds through its Drop.
        let node = TestNode {
            shared: Arc::new(NodeShared {
                bridge,
                subnet,
                state: Mutex::new(NodeState {
                    hosts: BTreeSet::from([1]),
                    ..NodeState::default()
                }),
            }),
        };
        let bridge = node.bridge_name();
        ip(&["addr", "add", &format!("{}/24", node.gateway()), "dev", bridge]);
        ip(&["link", "set", "dev", bridge, "up"]);
        node
    }

    /// The bridge's interface name (`aeb` + 8 hex digits).
    pub fn bridge_name(&self) -> &str {
        &self.shared.bridge
    }

    /// The node's subnet as (network address, prefix length).
    pub fn subnet(&self) -> (Ipv4Addr, u8) {
        (self.shared.subnet, 24)
    }

    /// The gateway address (`.1`), held by the bridge in the root netns.
    pub fn gateway(&self) -> Ipv4Addr {
        host_addr(self.shared.subnet, 1)
    }

    /// Creates a pod: a netns `aep-…` with `lo` and `eth0` up, `eth0` holding the next free address of the node's
    /// /24 and a default route via the gateway; the host end of its veth is a port of the bridge.
    pub fn add_pod(&self, name: &str) -> TestPod {
        let host = {
            let mut state = self.shared.state();
            assert!(!state.torn_down, "add_pod({name}): the node is torn down");
            let host = (2..=254u8)
                .find(|h| !state.hosts.contains(h))
                .unwrap_or_else(|| panic!("add_pod({name}): no free address left in {}/24", self.shared.subnet));
            state.hosts.insert(host);
            host
        };
        let (netns_name, seq) = {
            let _lock = global_lock();
            let netns = create_unique(NETNS_PREFIX, 4, |ns| ip_try(&["netns", "add", ns]));
            let seq = netns[NETNS_PREFIX.len()..].to_string();
            (netns, seq)
        };
        let veth = format!("{VETH_PREFIX}{seq}");
        self.shared.state().pods.insert(netns_name.clone(), veth.clone());
        // From here on the pod guard owns the namespace, the veth and the address.
        let pod = TestPod {
            name: name.to_string(),
            netns_name,
            veth,
            ip: host_addr(self.shared.subnet, host),
            host,
            gateway: self.gateway(),
            node: Arc::clone(&self.shared),
        };
        let ns = pod.netns_name.as_str();
        ip(&[
            "link", "add", "name", &pod.veth, "type", "veth", "peer", "name", "eth0", "netns", ns,
        ]);
        ip(&["link", "set", "dev", &pod.veth, "master", self.bridge_name()]);
        ip(&["link", "set", "dev", &pod.veth, "up"]);
        ip(&["-n", ns, "addr", "add", &format!("{}/24", pod.ip), "dev", "eth0"]);
        ip(&["-n", ns, "link", "set", "dev", "lo", "up"]);
        ip(&["-n", ns, "link", "set", "dev", "eth0", "up"]);
        ip(&["-n", ns, "route", "add", "default", "via", &pod.gateway.to_string()]);
        pod
    }
}

impl Drop for TestNode {
    fn drop(&mut self) {
        let pods = {
            let mut state = self.shared.state();
            state.torn_down = true;
            std::mem::take(&mut state.pods)
        };
        for (netns, veth) in &pods {
            delete_pod_objects(netns, veth);
        }
        cleanup(&["link", "del", "dev", &self.shared.bridge]);
    }
}

/// A pod: a named network namespace plugged into its node's bridge. Dropping it deletes the namespace and the host
/// veth (which takes the pod's `eth0` with it) and frees its address.
pub struct TestPod {
    name: String,
    netns_name: String,
    veth: String,
    ip: Ipv4Addr,
    host: u8,
    gateway: Ipv4Addr,
    node: Arc<NodeShared>,
}

impl TestPod {
    /// The name the test gave the pod (used by the test servers as their identity).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The `ip netns` name (`aep-…`).
    pub fn netns_name(&self) -> &str {
        &self.netns_name
    }

    /// `/var/run/netns/<netns_name>`.
    pub fn netns_path(&self) -> PathBuf {
        Path::new(NETNS_DIR).join(&self.netns_name)
    }

    /// The pod's address on `eth0`.
    pub fn ip(&self) -> Ipv4Addr {
        self.ip
    }

    /// The pod's default gateway (the node's bridge address).
    pub fn gateway(&self) -> Ipv4Addr {
        self.gateway
    }

    /// The host end of the pod's veth pair (a port of the node's bridge).
    pub fn host_veth(&self) -> &str {
        &self.veth
    }

    /// Runs `f` on a fresh OS thread that has entered the pod's network namespace and returns its result (a panic
    /// in `f` propagates). Sockets created in `f` belong to the pod's netns for their whole life, wherever they are
    /// used afterwards.
    pub fn run<F, R>(&self, f: F) -> R
    where
        F: FnOnce() -> R + Send,
        R: Send,
    {
        let path = self.netns_path();
        let file =
            File::open(&path).unwrap_or_else(|e| panic!("pod {}: cannot open {}: {e}", self.name, path.display()));
        std::thread::scope(|scope| {
            let thread = scope.spawn(move || {
                setns(&file, CloneFlags::CLONE_NEWNET)
                    .unwrap_or_else(|e| panic!("setns(CLONE_NEWNET) into {}: {e}", path.display()));
                f()
            });
            match thread.join() {
                Ok(r) => r,
                Err(panic) => std::panic::resume_unwind(panic),
            }
        })
    }

    /// Runs `cmd` inside the pod with `ip netns exec` and returns its output, whatever its exit status.
    pub fn exec(&self, cmd: &[&str]) -> Output {
        assert!(!cmd.is_empty(), "exec: empty command");
        self.command(cmd[0])
            .args(&cmd[1..])
            .output()
            .unwrap_or_else(|e| panic!("pod {}: cannot run `{}`: {e}", self.name, cmd.join(" ")))
    }

    /// Like [`TestPod::exec`], but panics (with stderr) unless the command succeeds; returns its stdout.
    pub fn exec_ok(&self, cmd: &[&str]) -> String {
        let out = self.exec(cmd);
        assert!(
            out.status.success(),
            "pod {} ({}): `{}` failed ({}): {}",
            self.name,
            self.netns_name,
            cmd.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// A `Command` that runs `program` inside the pod (`ip netns exec <ns> program`); add arguments and spawn it,
    /// e.g. with [`crate::ChildGuard::spawn`]. `ip netns exec` execs the program, so the child's pid is the
    /// program's.
    pub fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.netns_name, program]);
        cmd
    }
}

impl Drop for TestPod {
    fn drop(&mut self) {
        let mut state = self.node.state();
        // Absent when the node was torn down first: it already deleted everything.
        if state.pods.remove(&self.netns_name).is_some() {
            delete_pod_objects(&self.netns_name, &self.veth);
            state.hosts.remove(&self.host);
        }
    }
}

impl std::fmt::Debug for TestPod {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestPod")
            .field("name", &self.name)
            .field("netns", &self.netns_name)
            .field("ip", &self.ip)
            .finish()
    }
}

impl std::fmt::Debug for TestNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestNode")
            .field("bridge", &self.shared.bridge)
            .field("subnet", &format_args!("{}/24", self.shared.subnet))
            .finish()
    }
}

/// Deletes the bridges, namespaces and host veths this harness left behind in processes that are gone (killed
/// without unwinding). Objects of live processes, including this one, are left alone. [`TestNode::new`] calls it.
pub fn sweep_stale() {
    let _lock = global_lock();
    let me = std::process::id();
    let stale = |name: &str, prefix: &str| -> bool {
        let Some(rest) = name.strip_prefix(prefix) else {
            return false;
        };
        let Some(pid) = rest.get(..6).and_then(|p| u32::from_str_radix(p, 16).ok()) else {
            return false;
        };
        rest.chars().all(|c| c.is_ascii_hexdigit()) && pid != me && !Path::new(&format!("/proc/{pid}")).exists()
    };
    for ns in ip(&["netns", "list"])
        .lines()
        .filter_map(|l| l.split_whitespace().next())
    {
        if stale(ns, NETNS_PREFIX) {
            cleanup(&["netns", "del", ns]);
        }
    }
    for line in ip(&["-o", "link", "show"]).lines() {
        // "12: aev0012ab0001@if2: <BROADCAST,...> ..."
        let Some(name) = line.split_whitespace().nth(1) else {
            continue;
        };
        let name = name.trim_end_matches(':').split('@').next().unwrap_or_default();
        if stale(name, BRIDGE_PREFIX) || stale(name, VETH_PREFIX) {
            cleanup(&["link", "del", "dev", name]);
        }
    }
}

fn delete_pod_objects(netns: &str, veth: &str) {
    // The host veth first: it takes the pod's eth0 with it even if something (a socket, a process) keeps the
    // namespace itself alive after its name is gone.
    cleanup(&["link", "del", "dev", veth]);
    cleanup(&["netns", "del", netns]);
}

/// Creates an object named `<prefix><pid as 6 hex><seq as seq_hex_digits hex>`, retrying with the next sequence
/// number when the name exists (left by an earlier process with the same pid).
fn create_unique(prefix: &str, seq_hex_digits: usize, create: impl Fn(&str) -> Result<(), String>) -> String {
    let pid = std::process::id();
    let modulus = 1u32 << (4 * seq_hex_digits);
    let mut last_err = String::new();
    for _ in 0..64 {
        let seq = SEQ.fetch_add(1, Ordering::Relaxed) % modulus;
        let name = format!("{prefix}{pid:06x}{seq:0seq_hex_digits$x}");
        match create(&name) {
            Ok(()) => return name,
            Err(e) if e.contains("File exists") => last_err = e,
            Err(e) => panic!("{e}"),
        }
    }
    panic!("cannot find a free {prefix}… name: {last_err}")
}

fn host_addr(subnet: Ipv4Addr, host: u8) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(subnet) | u32::from(host))
}

/// A random /24 of 10.200.0.0/13 that overlaps no address or route of the root netns.
fn pick_subnet() -> Ipv4Addr {
    let used = used_ipv4_prefixes();
    let seconds = u64::from(*SUBNET_SECOND_OCTETS.end() - *SUBNET_SECOND_OCTETS.start()) + 1;
    for _ in 0..SUBNET_ATTEMPTS {
        let r = random_u64();
        let second = *SUBNET_SECOND_OCTETS.start() + (r % seconds) as u8;
        let third = (r >> 8) as u8;
        let candidate = Ipv4Addr::new(10, second, third, 0);
        if !used
            .iter()
            .any(|&(net, len)| overlaps((u32::from(candidate), 24), (net, len)))
        {
            return candidate;
        }
    }
    panic!("no free /24 in 10.200.0.0/13 after {SUBNET_ATTEMPTS} attempts; in use: {used:?}")
}

/// Every IPv4 prefix the root netns has as an address or in any routing table.
fn used_ipv4_prefixes() -> Vec<(u32, u8)> {
    const ROUTE_TYPES: [&str; 10] = [
        "unicast",
        "local",
        "broadcast",
        "multicast",
        "anycast",
        "blackhole",
        "unreachable",
        "prohibit",
        "throw",
        "nat",
    ];
    let mut out = Vec::new();
    for line in ip(&["-4", "-o", "addr", "show"]).lines() {
        let mut words = line.split_whitespace();
        if words.any(|w| w == "inet")
            && let Some(p) = words.next().and_then(parse_prefix)
        {
            out.push(p);
        }
    }
    for line in ip(&["-4", "route", "show", "table", "all"]).lines() {
        let mut words = line.split_whitespace();
        let mut dst = words.next().unwrap_or_default();
        if ROUTE_TYPES.contains(&dst) {
            dst = words.next().unwrap_or_default();
        }
        if let Some(p) = parse_prefix(dst) {
            out.push(p);
        }
    }
    out
}

fn parse_prefix(s: &str) -> Option<(u32, u8)> {
    let (addr, len) = match s.split_once('/') {
        Some((a, l)) => (a, l.parse().ok()?),
        None => (s, 32),
    };
    Some((u32::from(addr.parse::<Ipv4Addr>().ok()?), len))
}

fn overlaps((a, alen): (u32, u8), (b, blen): (u32, u8)) -> bool {
    let len = alen.min(blen);
    len == 0 || (a ^ b) >> (32 - u32::from(len)) == 0
}

fn random_u64() -> u64 {
    let mut h = RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.write_u32(SEQ.fetch_add(1, Ordering::Relaxed));
    if let Ok(d) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        h.write_u128(d.as_nanos());
    }
    h.finish()
}

/// An exclusive lock shared by all test processes on the machine; released when dropped.
struct GlobalLock(File);

impl Drop for GlobalLock {
    fn drop(&mut self) {
        let _ = self.0.unlock();
    }
}

fn global_lock() -> GlobalLock {
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(LOCK_PATH)
        .unwrap_or_else(|e| panic!("cannot open {LOCK_PATH}: {e}"));
    file.lock().unwrap_or_else(|e| panic!("cannot lock {LOCK_PATH}: {e}"));
    GlobalLock(file)
}

fn command_line(args: &[&str]) -> String {
    format!("ip {}", args.join(" "))
}

/// Runs `ip args…`; Err carries the command line and stderr.
fn ip_try(args: &[&str]) -> Result<(), String> {
    ip_output(args).map(drop)
}

fn ip_output(args: &[&str]) -> Result<String, String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("`{}`: cannot run: {e}", command_line(args)))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "`{}` failed ({}): {}",
            command_line(args),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Runs `ip args…` and returns its stdout; panics with the command line and stderr on failure.
fn ip(args: &[&str]) -> String {
    ip_output(args).unwrap_or_else(|e| panic!("{e}"))
}

/// Runs a deleting `ip` command; "does not exist" is success. Any other failure panics, or, while the thread is
/// already unwinding (where a second panic would abort), is printed.
fn cleanup(args: &[&str]) {
    let Err(e) = ip_try(args) else { return };
    let gone = ["Cannot find device", "No such file or directory", "does not exist"];
    if gone.iter().any(|g| e.contains(g)) {
        return;
    }
    if std::thread::panicking() {
        eprintln!("aether-tests cleanup: {e}");
    } else {
        panic!("aether-tests cleanup: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_overlap_when_one_contains_the_other() {
        let p = |s: &str| parse_prefix(s).unwrap();
        assert!(overlaps(p("10.200.3.0/24"), p("10.200.3.7")));
        assert!(overlaps(p("10.200.3.0/24"), p("10.0.0.0/8")));
        assert!(overlaps(p("10.200.3.0/24"), p("0.0.0.0/0")));
        assert!(!overlaps(p("10.200.3.0/24"), p("10.200.4.0/24")));
        assert!(!overlaps(p("10.200.3.0/24"), p("192.0.2.0/24")));
        assert_eq!(parse_prefix("default"), None);
    }
}
