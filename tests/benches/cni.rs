//! ADD latency of `aether-cni` alone (`cargo bench -p aether-tests --bench cni`, as root, after
//! `cargo build --workspace --bins --release`): the main plugin is left out — each ADD gets a synthetic
//! `prevResult` for a pre-made network namespace — and runs against the real agent, registrar and Envoy (the
//! `Mesh` fixture), so one ADD is: process start, config parse, netns pin, AddPod over the UDS (the agent registers
//! the endpoint, programs the nftables capture in the netns and waits for Envoy to ACK the pod's listeners), exit.
//!
//! Prints p50/p99/max of ADD wall time measured around the plugin process, one at a time
//! (AETHER_BENCH_CNI_SINGLE, default 100 ADDs), 16 at a time and 50 at a time (AETHER_BENCH_CNI_PARALLEL, default
//! 16,50; AETHER_BENCH_CNI_ROUNDS rounds each, default 3). Goals (issue 16): p99 < 10 ms one at a time, < 50 ms at 16,
//! < 150 ms at 50. The floor, in the same run and the same shapes: Debian's `bridge` + `host-local` ADD on the
//! node's bridge (what a pod's network costs before any mesh). Every sandbox is DELeted (untimed) before the next
//! round.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use aether_tests::bench::{cpu_time, percentile, xds_ack_means};
use aether_tests::binary;
use aether_tests::cni::{
    BareNetns, ConfList, DEBIAN_CNI_DIR, PinSweeper, PluginRun, Sandbox, bridge_plugin, exec_plugin,
};
use aether_tests::mesh::{Mesh, NAMESPACE};
use serde_json::json;

fn knob(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1e3)
}

struct Bench {
    plugin: PathBuf,
    conf: serde_json::Value,
}

impl Bench {
    fn stdin(&self, sandbox: &Sandbox, ip: &str) -> Vec<u8> {
        let mut conf = self.conf.clone();
        conf["prevResult"] = json!({
            "cniVersion": "1.1.0",
            "interfaces": [{"name": "eth0", "mac": "0a:58:0a:00:00:01", "sandbox": sandbox.netns}],
            "ips": [{"address": format!("{ip}/16"), "gateway": "10.251.0.1", "interface": 0}]
        });
        serde_json::to_vec(&conf).unwrap()
    }

    fn run(&self, command: &str, sandbox: &Sandbox, ip: &str) -> (Duration, PluginRun) {
        let mut env = sandbox.env();
        env.push(("CNI_PATH".into(), "/usr/lib/cni".into()));
        let stdin = self.stdin(sandbox, ip);
        let started = Instant::now();
        let run = exec_plugin(&self.plugin, command, &env, &stdin);
        (started.elapsed(), run)
    }
}

fn describe(mesh: &Mesh, name: &str, uid: &str) {
    let manifest = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE, "uid": uid, "labels": {"aether.io/managed": "true"}},
        "spec": {"serviceAccountName": "bench", "containers": [{"name": "app", "ports": [{"name": "http", "containerPort": 8080}]}]}
    });
    std::fs::write(
        mesh.path(&format!("pods/{name}.json")),
        serde_json::to_vec(&manifest).unwrap(),
    )
    .unwrap();
}

fn report(label: &str, mut samples: Vec<Duration>, goal: &str) {
    samples.sort();
    println!(
        "{label}: n {}, p50 {}, p99 {}, max {} (goal p99 < {goal})",
        samples.len(),
        ms(percentile(&samples, 0.5)),
        ms(percentile(&samples, 0.99)),
        ms(samples.last().copied().unwrap_or_default()),
    );
}

fn main() {
    aether_tests::require_root();
    let single = knob("AETHER_BENCH_CNI_SINGLE", 100);
    let batches: Vec<usize> = std::env::var("AETHER_BENCH_CNI_PARALLEL")
        .unwrap_or_else(|_| "16,50".into())
        .split(',')
        .map(|n| {
            n.trim()
                .parse()
                .expect("AETHER_BENCH_CNI_PARALLEL: comma-separated counts")
        })
        .collect();
    let parallel = batches.iter().copied().max().unwrap_or(0);
    let rounds = knob("AETHER_BENCH_CNI_ROUNDS", 3);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let _pins = PinSweeper(state.join("netns"));
    let mesh = rt.block_on(Mesh::start_with(&[
        "--netns-pin-dir",
        &state.join("netns").display().to_string(),
    ]));
    let bench = Bench {
        plugin: binary("aether-cni"),
        conf: json!({
            "cniVersion": "1.1.0", "name": "bench", "type": "aether-cni",
            "agentSocket": mesh.cni_socket(), "stateDir": state,
            "logFile": dir.path().join("cni.log"), "meshDns": "10.251.0.1:18054",
        }),
    };
    let netns: Vec<BareNetns> = (0..single.max(parallel)).map(|_| BareNetns::new()).collect();
    let sandboxes: Vec<(Sandbox, String)> = netns
        .iter()
        .enumerate()
        .map(|(i, ns)| described_sandbox(&mesh, i, ns))
        .collect();
    warm_up(&bench, &mesh, &sandboxes[0]);
    let cpu = CpuMeter::new(&mesh);
    add_one_at_a_time(&bench, &sandboxes[..single.min(sandboxes.len())]);
    cpu.report_per_add(single);
    for &batch in &batches {
        let cpu = CpuMeter::new(&mesh);
        add_in_parallel(&bench, &sandboxes[..batch.min(sandboxes.len())], rounds);
        cpu.report_per_add(batch * rounds);
    }
    version_floor(&bench);
    bridge_floor(&mesh, dir.path(), single, &batches, rounds);
    print_agent_phases(&rt.block_on(mesh.agent_get("/metrics")));
}

/// CPU time the agent and Envoy spent over a stretch of ADDs (each followed by its untimed DEL).
struct CpuMeter {
    pids: [(&'static str, u32); 2],
    at_start: [Duration; 2],
}

impl CpuMeter {
    fn new(mesh: &Mesh) -> CpuMeter {
        let pids = [
            ("agent", mesh.agent.as_ref().expect("agent running").pid()),
            ("Envoy", mesh.envoy().child().pid()),
        ];
        CpuMeter {
            at_start: pids.map(|(_, pid)| cpu_time(pid)),
            pids,
        }
    }

    fn report_per_add(&self, adds: usize) {
        let per_add: Vec<String> = self
            .pids
            .iter()
            .zip(self.at_start)
            .map(|((name, pid), start)| format!("{name} {}", ms((cpu_time(*pid) - start) / adds.max(1) as u32)))
            .collect();
        println!("  CPU per ADD + DEL: {}", per_add.join(", "));
    }
}

/// Sandbox `i` in `ns`, described to the pod source, with what the main plugin would have left: eth0 with the
/// pod's address (Envoy binds the pod's inbound listener on it). The sandbox and the address.
fn described_sandbox(mesh: &Mesh, i: usize, ns: &BareNetns) -> (Sandbox, String) {
    let name = format!("bench-{i}");
    let sb = Sandbox::new(&format!("ctr-{}", ns.name()), &ns.path(), NAMESPACE, &name);
    describe(mesh, &name, &sb.pod.as_ref().unwrap().2);
    let ip = format!("10.251.{}.{}", i / 250, i % 250 + 2);
    for cmd in [
        vec!["link", "add", "eth0", "type", "veth", "peer", "name", "peer0"],
        vec!["link", "set", "peer0", "up"],
        vec!["addr", "add", &format!("{ip}/16"), "dev", "eth0"],
        vec!["link", "set", "eth0", "up"],
    ] {
        let out = ns.exec(&[&["ip"][..], &cmd[..]].concat());
        assert!(
            out.status.success(),
            "ip {cmd:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    (sb, ip)
}

/// Warm up (the pod source picks the manifests up; first-connection costs).
fn warm_up(bench: &Bench, mesh: &Mesh, (sb, ip): &(Sandbox, String)) {
    let (_, run) = bench.run("ADD", sb, ip);
    assert!(
        run.success,
        "warm-up ADD failed: {run:?}\nagent:\n{}",
        mesh.agent.as_ref().unwrap().logs()
    );
    bench.run("DEL", sb, ip);
}

fn add_one_at_a_time(bench: &Bench, sandboxes: &[(Sandbox, String)]) {
    let check = |run: &PluginRun, what: &str| {
        assert!(run.success, "{what} failed: {run:?}");
    };
    let mut samples = Vec::new();
    for (sb, ip) in sandboxes {
        let (took, run) = bench.run("ADD", sb, ip);
        check(&run, "ADD");
        samples.push(took);
        check(&bench.run("DEL", sb, ip).1, "DEL");
    }
    report("aether-cni ADD, one at a time", samples, "10 ms");
}

/// `rounds` batches: every sandbox ADDed at once, then DELed at once.
fn add_in_parallel(bench: &Bench, sandboxes: &[(Sandbox, String)], rounds: usize) {
    let parallel = sandboxes.len();
    let mut samples = Vec::new();
    let mut wall = Vec::new();
    for _ in 0..rounds {
        let started = Instant::now();
        let took: Vec<Duration> = std::thread::scope(|s| {
            let handles: Vec<_> = sandboxes
                .iter()
                .map(|(sb, ip)| {
                    s.spawn(move || {
                        let (took, run) = bench.run("ADD", sb, ip);
                        assert!(run.success, "parallel ADD failed: {run:?}");
                        took
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        wall.push(started.elapsed());
        samples.extend(took);
        std::thread::scope(|s| {
            for (sb, ip) in sandboxes {
                s.spawn(move || assert!(bench.run("DEL", sb, ip).1.success));
            }
        });
    }
    let goal = if parallel <= 16 { "50 ms" } else { "150 ms" };
    report(
        &format!("aether-cni ADD, {parallel} in parallel ({rounds} rounds)"),
        samples,
        goal,
    );
    wall.sort();
    println!(
        "  whole batch of {parallel}: best {}, worst {}",
        ms(wall[0]),
        ms(*wall.last().unwrap())
    );
}

/// Debian's `bridge` + `host-local` ADD on the node's bridge, in the shapes measured above: the cost of a pod's
/// network before the mesh, on fresh network namespaces of its own.
fn bridge_floor(mesh: &Mesh, dir: &std::path::Path, single: usize, batches: &[usize], rounds: usize) {
    let (subnet, _) = mesh.node.subnet();
    let bridge = ConfList::new(
        json!({"cniVersion": "1.0.0", "name": "bench-bridge", "plugins": [
            bridge_plugin(mesh.node.bridge_name(), subnet, mesh.node.gateway(), &dir.join("ipam")),
        ]}),
        vec![PathBuf::from(DEBIAN_CNI_DIR)],
    );
    let most = batches.iter().copied().max().unwrap_or(0).max(1);
    let netns: Vec<BareNetns> = (0..most).map(|_| BareNetns::new()).collect();
    let sandboxes: Vec<Sandbox> = netns
        .iter()
        .map(|ns| Sandbox::new(&format!("bridge-{}", ns.name()), &ns.path(), NAMESPACE, "bridge-floor"))
        .collect();
    let add = |sb: &Sandbox| {
        let started = Instant::now();
        bridge
            .add(sb)
            .unwrap_or_else(|run| panic!("bridge ADD failed: {run:?}"));
        started.elapsed()
    };
    let del = |sb: &Sandbox| {
        bridge
            .del(sb, None)
            .unwrap_or_else(|run| panic!("bridge DEL failed: {run:?}"))
    };
    let mut samples = Vec::new();
    for _ in 0..single {
        samples.push(add(&sandboxes[0]));
        del(&sandboxes[0]);
    }
    report("floor: bridge + host-local ADD, one at a time", samples, "-");
    for &batch in batches {
        let mut samples = Vec::new();
        for _ in 0..rounds {
            let batch = &sandboxes[..batch.min(sandboxes.len())];
            std::thread::scope(|s| {
                let handles: Vec<_> = batch.iter().map(|sb| s.spawn(move || add(sb))).collect();
                samples.extend(handles.into_iter().map(|h| h.join().unwrap()));
            });
            std::thread::scope(|s| {
                for sb in batch {
                    s.spawn(move || del(sb));
                }
            });
        }
        report(
            &format!("floor: bridge + host-local ADD, {batch} in parallel ({rounds} rounds)"),
            samples,
            "-",
        );
    }
}

/// The plugin's own start-up: VERSION (no agent call).
fn version_floor(bench: &Bench) {
    let mut version = Vec::new();
    for _ in 0..50 {
        let started = Instant::now();
        let run = exec_plugin(&bench.plugin, "VERSION", &[], br#"{"cniVersion":"1.1.0"}"#);
        version.push(started.elapsed());
        assert!(run.success);
    }
    report("aether-cni VERSION (process start-up floor)", version, "-");
}

/// Where the agent's AddPod time went (its phases run concurrently; `total` is the slowest plus the set-up).
fn print_agent_phases(metrics: &str) {
    let series = |name: &str, phase: &str| {
        let prefix = format!("aether_agent_cni_add_phase_seconds_{name}{{phase=\"{phase}\"}} ");
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(prefix.as_str()))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or_else(|| panic!("no {prefix} in the agent's /metrics"))
    };
    let means: Vec<String> = ["register", "envoy", "capture", "total"]
        .iter()
        .map(|phase| format!("{phase} {:.1} ms", 1e3 * series("sum", phase) / series("count", phase)))
        .collect();
    println!("agent AddPod mean per phase, all ADDs above: {}", means.join(", "));
    // Where the envoy phase goes: from each xDS response sent to Envoy's ACK, by type.
    println!("xDS response → Envoy's ACK, mean by type: {}", xds_ack_means(metrics));
}
