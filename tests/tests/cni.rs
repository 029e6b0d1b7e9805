//! `aether-cni` chained after Debian's `bridge` + `host-local`, executed as a runtime does, against the real agent,
//! the real registrar and a real Envoy: capture, DNS, CHECK, DEL, GC, STATUS, agent outages and 50 pods at once.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use aether_tests::binary;
use aether_tests::cni::{
    BareNetns, ConfList, DEBIAN_CNI_DIR, DnsStandIn, PinSweeper, PluginRun, Sandbox, aether_table, bridge_plugin,
    http_get_in, is_pin_of, tcp_exchange_in, udp_exchange_in,
};
use aether_tests::mesh::{Mesh, NAMESPACE, fqdn};
use serde_json::{Value, json};

const APP: &str = "127.0.0.1:8080";
/// What a pod's resolv.conf would point at (a cluster DNS service IP); captured to mesh-dns.
const CLUSTER_DNS: &str = "10.96.0.10:53";

struct CniMesh {
    mesh: Mesh,
    /// bridge + host-local, then ours (CNI 1.0.0: what Debian's plugins speak).
    conflist: ConfList,
    /// Ours alone at CNI 1.1.0, for GC and STATUS (which 1.0.0 lists never get).
    ours_only: ConfList,
    state: PathBuf,
    dns: DnsStandIn,
    // Dropped last: pins a failed test left keep netns (and veths) alive.
    _pins: PinSweeper,
    _dir: tempfile::TempDir,
}

impl CniMesh {
    async fn start() -> CniMesh {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        let pin_dir = state.join("netns");
        let pins = PinSweeper(pin_dir.clone());
        let mesh = Mesh::start_with(&["--netns-pin-dir", &pin_dir.display().to_string()]).await;
        let dns = DnsStandIn::start(mesh.node.gateway().into());
        let (subnet, _) = mesh.node.subnet();
        let ours = json!({
            "type": "aether-cni",
            "agentSocket": mesh.cni_socket(),
            "stateDir": state,
            "logFile": dir.path().join("cni.log"),
            "logLevel": "debug",
            "meshDns": dns.addr.to_string(),
            "agentAttempts": 3,
        });
        let plugin_dir = binary("aether-cni").parent().unwrap().to_owned();
        let cni_path = vec![PathBuf::from(DEBIAN_CNI_DIR), plugin_dir];
        let conflist = ConfList::new(
            json!({"cniVersion": "1.0.0", "name": "aether-test", "plugins": [
                bridge_plugin(mesh.node.bridge_name(), subnet, mesh.node.gateway(), &dir.path().join("ipam")),
                ours.clone(),
            ]}),
            cni_path.clone(),
        );
        let ours_only = ConfList::new(
            json!({"cniVersion": "1.1.0", "name": "aether-test", "plugins": [ours]}),
            cni_path,
        );
        CniMesh {
            mesh,
            conflist,
            ours_only,
            state,
            dns,
            _pins: pins,
            _dir: dir,
        }
    }

    fn pin(&self, sandbox: &Sandbox) -> PathBuf {
        self.state.join("netns").join(&sandbox.container_id)
    }

    fn cni_log(&self) -> String {
        std::fs::read_to_string(self._dir.path().join("cni.log")).unwrap_or_default()
    }

    fn agent_logs(&self) -> String {
        self.mesh.agent.as_ref().map(|a| a.logs()).unwrap_or_default()
    }

    /// The static pod source's manifest for a CNI pod (uid as [`Sandbox::new`] sets it).
    fn describe(&self, sandbox: &Sandbox, service_account: &str, upstreams: &str) {
        let (ns, name, uid) = sandbox.pod.clone().unwrap();
        let manifest = json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "uid": uid,
                "labels": {"aether.io/managed": "true"},
                "annotations": {"config.aether.io/upstreams": upstreams}},
            "spec": {"serviceAccountName": service_account,
                "containers": [{"name": "app", "ports": [{"name": "http", "containerPort": 8080}]}]}
        });
        std::fs::write(
            self.mesh.path(&format!("pods/{name}.json")),
            serde_json::to_vec(&manifest).unwrap(),
        )
        .unwrap();
    }

    async fn add(&self, sandbox: &Sandbox) -> Result<Vec<Value>, PluginRun> {
        let (list, sb) = (self.conflist.clone(), sandbox.clone());
        tokio::task::spawn_blocking(move || list.add(&sb)).await.unwrap()
    }

    async fn add_ok(&self, sandbox: &Sandbox) -> Vec<Value> {
        self.add(sandbox).await.unwrap_or_else(|run| {
            panic!(
                "ADD {} failed: {run:?}\ncni log:\n{}\nagent:\n{}",
                sandbox.container_id,
                self.cni_log(),
                self.agent_logs()
            )
        })
    }

    /// CHECK through the whole chain, off the runtime's threads.
    async fn check(&self, sandbox: &Sandbox, cached: &Value) -> Result<(), PluginRun> {
        let (list, sb, cached) = (self.conflist.clone(), sandbox.clone(), cached.clone());
        tokio::task::spawn_blocking(move || list.check(&sb, &cached))
            .await
            .unwrap()
    }

    /// DEL through the whole chain (with the cached result, if any), off the runtime's threads.
    async fn del(&self, sandbox: &Sandbox, cached: Option<&Value>) -> Result<(), PluginRun> {
        let (list, sb, cached) = (self.conflist.clone(), sandbox.clone(), cached.cloned());
        tokio::task::spawn_blocking(move || list.del(&sb, cached.as_ref()))
            .await
            .unwrap()
    }

    /// Our plugin's CHECK alone, with `cached` as its prevResult.
    fn check_ours(&self, sandbox: &Sandbox, cached: &Value) -> PluginRun {
        let ours = self.conflist.plugins()[1].clone();
        self.conflist
            .run(&ours, "CHECK", Some(sandbox), &[("prevResult", cached.clone())])
    }

    async fn endpoints(&self, service: &str) -> Vec<String> {
        self.mesh
            .registrar()
            .await
            .list_endpoints(aether_proto::registrar::v1::ListEndpointsRequest {
                service: format!("{NAMESPACE}/{service}"),
            })
            .await
            .map(|r| r.into_inner().endpoints.into_iter().map(|e| e.address).collect())
            .unwrap_or_default()
    }

    async fn debug_pods(&self) -> Value {
        serde_json::from_str(&self.mesh.agent_get("/debug/pods").await).unwrap()
    }
}

fn pod_ip(result: &Value) -> String {
    result["ips"][0]["address"]
        .as_str()
        .and_then(|a| a.split('/').next())
        .expect("an address in the result")
        .to_owned()
}

fn sandbox(name: &str, ns: &BareNetns) -> Sandbox {
    Sandbox::new(&format!("ctr-{}", ns.name()), &ns.path(), NAMESPACE, name)
}

async fn eventually<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chained_add_captures_the_pod_and_del_undoes_everything() {
    let mut env = CniMesh::start().await;
    // The service's pod (added over the agent's API, as the agent tests do).
    let backend = env.mesh.node.add_pod("backend");
    let _app = backend.serve_http(APP.parse().unwrap(), "backend");
    env.mesh
        .describe_pod(&backend, "backend", "backend", "", &[("http", 8080)]);
    env.mesh.add_pod(&backend, "backend").await.expect("backend added");

    // The client pod, wired by bridge + host-local + aether-cni.
    let ns = BareNetns::new();
    let sb = sandbox("client", &ns);
    env.describe(&sb, "client", "backend");
    let results = env.add_ok(&sb).await;
    assert_eq!(results.len(), 2);
    assert_eq!(
        results[1], results[0],
        "ADD must pass the main plugin's result through unchanged"
    );
    let cached = results[1].clone();

    assert_pinned_captured_and_registered(&env, &ns, &sb, &pod_ip(&results[0])).await;
    let vip = assert_the_vip_is_served_by_the_backend(&env, &ns.path()).await;
    assert_dns_reaches_mesh_dns(&env, &ns.path());
    // Envoy's own (marked) traffic to a VIP is not captured; the same connection unmarked is.
    assert!(
        connects_at_once(&ns.path(), vip, None),
        "an unmarked connection to the VIP was not captured"
    );
    assert!(
        !connects_at_once(&ns.path(), vip, Some(0x4145)),
        "a socket with Envoy's mark was captured"
    );
    // CHECK: the whole chain agrees.
    env.check(&sb, &cached)
        .await
        .unwrap_or_else(|run| panic!("CHECK: {run:?}\n{}", env.cni_log()));
    check_sees_an_address_gone_from_the_interface(&env, &ns, &sb, &cached);
    check_fails_on_drifted_rules_until_an_agent_restart_repairs_them(&mut env, &ns, &sb, &cached).await;
    del_undoes_everything_and_is_idempotent(&env, ns, &sb, &cached).await;
}

/// Pinned, captured, registered.
async fn assert_pinned_captured_and_registered(env: &CniMesh, ns: &BareNetns, sb: &Sandbox, ip: &str) {
    let pin = env.pin(sb);
    assert!(
        is_pin_of(&pin, &ns.path()),
        "{} is not a pin of {}",
        pin.display(),
        ns.path().display()
    );
    let table = aether_table(&ns.path()).expect("the agent programmed the capture table");
    assert!(
        table.contains("ip daddr 240.240.0.0/16 meta l4proto tcp counter name \"captured\" redirect to :18001"),
        "{table}"
    );
    assert!(table.contains(&format!("dnat ip to {}", env.dns.addr)), "{table}");
    assert!(table.contains("meta mark 0x00004145 return"), "{table}");
    assert_eq!(env.endpoints("client").await, vec![ip.to_owned()]);
    let pods = env.debug_pods().await;
    let entry = pods["pods"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["pod"] == "demo/client")
        .expect("client known");
    assert_eq!(entry["netns"], json!(pin));
    assert_eq!(entry["ips"], json!([ip]));
}

/// A connection to the backend's VIP is captured and served by the backend pod; the VIP.
async fn assert_the_vip_is_served_by_the_backend(env: &CniMesh, netns: &Path) -> SocketAddr {
    let vip: SocketAddr = format!("{}:8080", env.mesh.vip("backend").await).parse().unwrap();
    let host = format!("{}:8080", fqdn("backend"));
    let reply = eventually("the VIP to answer through Envoy", || {
        let reply = http_get_in(netns, vip, "/via-cni", &host);
        let ok = reply.as_ref().ok().filter(|r| r.starts_with("HTTP/1.1 200")).cloned();
        if ok.is_none() {
            eprintln!("VIP {vip}: {reply:?}");
        }
        ok
    })
    .await;
    assert!(reply.contains("\"pod\":\"backend\""), "{reply}");
    assert!(reply.contains("/via-cni"), "{reply}");
    vip
}

/// DNS (UDP and TCP :53) reaches the configured mesh-dns address.
fn assert_dns_reaches_mesh_dns(env: &CniMesh, netns: &Path) {
    let cluster_dns: SocketAddr = CLUSTER_DNS.parse().unwrap();
    let (answer, from) = udp_exchange_in(netns, cluster_dns, b"query-udp").expect("UDP DNS captured");
    assert_eq!(answer, b"dns-stand-in:query-udp");
    assert_eq!(
        from, cluster_dns,
        "the reply is un-NATed back to the address the pod asked"
    );
    let answer = tcp_exchange_in(netns, cluster_dns, b"query-tcp").expect("TCP DNS captured");
    assert_eq!(answer, b"dns-stand-in:query-tcp");
    assert_eq!(env.dns.served.load(std::sync::atomic::Ordering::SeqCst), 2);
}

/// Our CHECK sees an address gone from the interface; the address and route are put back after.
fn check_sees_an_address_gone_from_the_interface(env: &CniMesh, ns: &BareNetns, sb: &Sandbox, cached: &Value) {
    let prefix = cached["ips"][0]["address"].as_str().unwrap().to_owned();
    assert!(ns.exec(&["ip", "addr", "del", &prefix, "dev", "eth0"]).status.success());
    let run = env.check_ours(sb, cached);
    assert_eq!(run.code(), 999);
    assert!(
        run.msg().starts_with(&format!(
            "CHECK: address {prefix} from prevResult is not on eth0 in {}",
            ns.path().display()
        )),
        "{}",
        run.msg()
    );
    assert!(ns.exec(&["ip", "addr", "add", &prefix, "dev", "eth0"]).status.success());
    let gateway = env.mesh.node.gateway().to_string();
    assert!(
        ns.exec(&["ip", "route", "replace", "default", "via", &gateway])
            .status
            .success()
    );
}

/// Drifted capture rules fail CHECK, and an agent restart repairs them.
async fn check_fails_on_drifted_rules_until_an_agent_restart_repairs_them(
    env: &mut CniMesh,
    ns: &BareNetns,
    sb: &Sandbox,
    cached: &Value,
) {
    assert!(ns.exec(&["nft", "delete", "table", "inet", "aether"]).status.success());
    let run = env.check_ours(sb, cached);
    assert_eq!(run.code(), 999, "{run:?}");
    assert!(
        run.msg().contains("capture: the nftables table inet aether in"),
        "{}",
        run.msg()
    );
    env.mesh.agent = None;
    env.mesh.start_agent().await;
    let netns = ns.path();
    let repaired = eventually("the restarted agent to repair the capture", || aether_table(&netns)).await;
    assert!(repaired.contains("redirect to :18001"), "{repaired}");
    // CHECK passes again once Envoy has re-ACKed the pod's listeners from the new agent.
    let mut last = None;
    let ok = eventually("CHECK to pass after the restart", || {
        let run = env.check_ours(sb, cached);
        let ok = run.success.then_some(());
        last = Some(run);
        ok
    });
    let deadline = tokio::time::timeout(Duration::from_secs(15), ok).await;
    assert!(deadline.is_ok(), "{last:?}");
}

/// DEL: rules, pin, endpoint and listeners gone; the address goes back to host-local. Idempotent: again, and once
/// the netns itself is gone.
async fn del_undoes_everything_and_is_idempotent(env: &CniMesh, ns: BareNetns, sb: &Sandbox, cached: &Value) {
    env.del(sb, Some(cached))
        .await
        .unwrap_or_else(|run| panic!("DEL: {run:?}"));
    assert_eq!(aether_table(&ns.path()), None, "the capture table outlived DEL");
    assert!(!env.pin(sb).exists(), "the pin outlived DEL");
    assert!(env.endpoints("client").await.is_empty());
    assert!(!env.mesh.envoy().admin_get("/listeners").contains("demo/client"));
    let pods = env.debug_pods().await;
    assert!(!pods.to_string().contains("demo/client"), "{pods}");
    env.del(sb, None).await.expect("second DEL");
    drop(ns);
    env.del(sb, None).await.expect("DEL after the netns is gone");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn add_fails_closed_while_the_agent_is_down_and_the_retry_succeeds() {
    let mut env = CniMesh::start().await;
    let ns = BareNetns::new();
    let sb = sandbox("web", &ns);
    env.describe(&sb, "web", "");
    env.mesh.agent = None;
    let run = env.add(&sb).await.expect_err("ADD must fail while the agent is down");
    assert!(run.plugin.ends_with("aether-cni"), "{run:?}");
    assert_eq!(run.code(), 11);
    assert!(
        run.msg().starts_with(&format!(
            "the aether agent at {} is unavailable (3 attempts)",
            env.mesh.cni_socket().display()
        )),
        "{}",
        run.msg()
    );
    // What the runtime does after a failed ADD: DEL (host-local frees the address).
    env.del(&sb, None).await.expect("cleanup DEL");
    assert!(!env.pin(&sb).exists(), "a failed ADD left its pin");
    assert_eq!(aether_table(&ns.path()), None, "a failed ADD left capture rules");

    // STATUS says not ready meanwhile.
    let run = env.ours_only.status().expect_err("STATUS with the agent down");
    assert_eq!(run.code(), 50);

    env.mesh.start_agent().await;
    env.ours_only.status().expect("STATUS with the agent up");
    let results = env.add_ok(&sb).await;
    assert!(aether_table(&ns.path()).is_some());
    assert_eq!(env.endpoints("web").await, vec![pod_ip(&results[0])]);
    env.del(&sb, Some(&results[1])).await.expect("DEL");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_removes_sandboxes_the_runtime_no_longer_has() {
    let env = CniMesh::start().await;
    let (keep_ns, gone_ns, stray_ns) = (BareNetns::new(), BareNetns::new(), BareNetns::new());
    let keep = sandbox("keep", &keep_ns);
    let gone = sandbox("gone", &gone_ns);
    env.describe(&keep, "keep", "");
    env.describe(&gone, "gone", "");
    env.add_ok(&keep).await;
    let gone_result = env.add_ok(&gone).await;
    // A pin left by an ADD that died before reaching the agent.
    let stray = env.state.join("netns").join("ctr-stray");
    std::fs::write(&stray, b"").unwrap();
    nix::mount::mount(
        Some(&stray_ns.path()),
        &stray,
        None::<&str>,
        nix::mount::MsFlags::MS_BIND,
        None::<&str>,
    )
    .unwrap();
    assert!(is_pin_of(&stray, &stray_ns.path()));

    env.ours_only
        .gc(&[&keep])
        .unwrap_or_else(|run| panic!("GC: {run:?}\n{}", env.cni_log()));
    assert!(
        env.pin(&keep).exists() && aether_table(&keep_ns.path()).is_some(),
        "GC removed a valid sandbox"
    );
    assert!(!env.pin(&gone).exists(), "GC left the pin of a sandbox that is gone");
    assert!(!stray.exists(), "GC left a stray pin");
    assert_eq!(aether_table(&gone_ns.path()), None);
    assert!(env.endpoints("gone").await.is_empty());
    assert_eq!(env.endpoints("keep").await.len(), 1);
    let pods = env.debug_pods().await.to_string();
    assert!(pods.contains("demo/keep") && !pods.contains("demo/gone"), "{pods}");
    // host-local still holds gone's address until the runtime's DEL; that one is fine too.
    env.del(&gone, Some(&gone_result[1])).await.expect("DEL after GC");
    // GC with an empty list empties the node.
    env.ours_only.gc(&[]).expect("GC all");
    assert!(!env.pin(&keep).exists());
    assert!(env.endpoints("keep").await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_pods_added_in_parallel_are_all_captured_and_registered() {
    const PODS: usize = 50;
    let env = CniMesh::start().await;
    let netns: Vec<BareNetns> = (0..PODS).map(|_| BareNetns::new()).collect();
    let sandboxes: Vec<Sandbox> = netns
        .iter()
        .enumerate()
        .map(|(i, ns)| sandbox(&format!("swarm-{i}"), ns))
        .collect();
    for sb in &sandboxes {
        env.describe(sb, "swarm", "");
    }
    let started = Instant::now();
    let results: Vec<Result<Vec<Value>, PluginRun>> = std::thread::scope(|s| {
        let handles: Vec<_> = sandboxes
            .iter()
            .map(|sb| {
                let list = env.conflist.clone();
                s.spawn(move || list.add(sb))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let elapsed = started.elapsed();
    let mut ips = Vec::new();
    for (sb, r) in sandboxes.iter().zip(&results) {
        let r = r
            .as_ref()
            .unwrap_or_else(|run| panic!("ADD {}: {run:?}\n{}", sb.container_id, env.agent_logs()));
        ips.push(pod_ip(&r[0]));
    }
    eprintln!("{PODS} chained ADDs in parallel took {elapsed:?}");
    for (sb, ns) in sandboxes.iter().zip(&netns) {
        assert!(is_pin_of(&env.pin(sb), &ns.path()), "{} not pinned", sb.container_id);
        let table = aether_table(&ns.path()).unwrap_or_else(|| panic!("{} not captured", sb.container_id));
        assert!(table.contains("redirect to :18001"));
    }
    let mut registered = env.endpoints("swarm").await;
    registered.sort();
    ips.sort();
    assert_eq!(registered, ips);
    assert_eq!(env.debug_pods().await["pods"].as_array().unwrap().len(), PODS);

    // And all of them DEL in parallel.
    std::thread::scope(|s| {
        for (sb, r) in sandboxes.iter().zip(&results) {
            let list = env.conflist.clone();
            let cached = r.as_ref().unwrap()[1].clone();
            s.spawn(move || list.del(sb, Some(&cached)).unwrap_or_else(|run| panic!("DEL: {run:?}")));
        }
    });
    assert!(env.endpoints("swarm").await.is_empty());
    for sb in &sandboxes {
        assert!(!env.pin(sb).exists());
    }
    assert!(env.debug_pods().await["pods"].as_array().unwrap().is_empty());
}

/// Our plugin must be last in the chain (it needs prevResult): the main plugin's result passes through, and a list
/// with ours first fails with the spec's code.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ours_alone_or_first_is_refused() {
    let env = CniMesh::start().await;
    let ns = BareNetns::new();
    let sb = sandbox("lonely", &ns);
    let plugins = env.conflist.plugins();
    let wrong = ConfList::new(
        json!({"cniVersion": "1.0.0", "name": "wrong", "plugins": [plugins[1].clone(), plugins[0].clone()]}),
        env.conflist.cni_path.clone(),
    );
    let run = tokio::task::spawn_blocking(move || wrong.add(&sb))
        .await
        .unwrap()
        .expect_err("ours first");
    assert_eq!(run.code(), 7);
    assert!(run.msg().starts_with("prevResult: missing"), "{}", run.msg());
}

/// A non-blocking connect from inside the netns: is it established within 300 ms? A captured connection is (it is
/// redirected to the local capture listener); one that leaves the pod for a VIP nobody routes is not.
fn connects_at_once(netns: &Path, to: SocketAddr, mark: Option<u32>) -> bool {
    use nix::sys::socket::{
        AddressFamily, SockFlag, SockType, SockaddrIn, connect, getpeername, setsockopt, socket, sockopt,
    };
    use std::os::fd::AsRawFd;
    let SocketAddr::V4(v4) = to else { panic!("IPv4 only") };
    aether_tests::cni::run_in(netns, move || {
        let fd = socket(AddressFamily::Inet, SockType::Stream, SockFlag::SOCK_NONBLOCK, None).unwrap();
        if let Some(mark) = mark {
            setsockopt(&fd, sockopt::Mark, &mark).unwrap();
        }
        let _ = connect(fd.as_raw_fd(), &SockaddrIn::from(v4));
        std::thread::sleep(Duration::from_millis(300));
        getpeername::<SockaddrIn>(fd.as_raw_fd()).is_ok()
    })
}
