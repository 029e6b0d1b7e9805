//! Tests of the harness itself, against real network namespaces, processes and Envoy. Run as root.

use std::io::{ErrorKind, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::process::Command;
use std::time::Duration;

use aether_tests::{
    ChildGuard, Envoy, TestNode, admin_address_json, free_port, http_get, require_root, shared_memory_path,
    unique_base_id,
};
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::{TokioExecutor, TokioIo};

fn netns_list() -> String {
    let out = Command::new("ip")
        .args(["netns", "list"])
        .output()
        .expect("ip netns list");
    assert!(
        out.status.success(),
        "ip netns list: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn netns_exists(name: &str) -> bool {
    netns_list().lines().any(|l| l.split_whitespace().next() == Some(name))
}

fn link_exists(name: &str) -> bool {
    Command::new("ip")
        .args(["link", "show", "dev", name])
        .output()
        .expect("ip link show")
        .status
        .success()
}

fn link_names() -> Vec<String> {
    let out = Command::new("ip").args(["-br", "link"]).output().expect("ip -br link");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(|n| n.split('@').next().unwrap_or_default().to_string())
        .collect()
}

fn sock(ip: Ipv4Addr, port: u16) -> SocketAddr {
    SocketAddr::from((ip, port))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_reach_each_other_over_the_bridge() {
    require_root();
    let node = TestNode::new();
    let a = node.add_pod("a");
    let b = node.add_pod("b");
    assert_ne!(a.ip(), b.ip());
    assert_ne!(a.netns_name(), b.netns_name());
    assert!(a.netns_path().exists(), "{}", a.netns_path().display());

    let server = b.serve_http(sock(b.ip(), 8080), "b");
    assert_eq!(server.addr(), sock(b.ip(), 8080));

    let url = format!("http://{}:8080/hello/world?x=1", b.ip());
    let reply = a.http_get(&url, Some("svc.example")).await.expect("a -> b");
    assert_eq!(reply.status, 200);
    assert_eq!(
        reply.headers.get("content-type").map(String::as_str),
        Some("application/json")
    );
    let json = reply.json();
    assert_eq!(json["pod"], "b");
    assert_eq!(json["method"], "GET");
    assert_eq!(json["path"], "/hello/world");
    assert_eq!(json["query"], "x=1");
    assert_eq!(json["version"], "HTTP/1.1");
    assert_eq!(json["host"], "svc.example");
    assert_eq!(json["headers"]["host"], "svc.example");

    // Without a Host override the URL's authority is sent.
    let json = a.http_get(&url, None).await.expect("a -> b").json();
    assert_eq!(json["host"], format!("{}:8080", b.ip()));

    // The root netns reaches pods through the bridge's gateway address.
    let json = http_get(&url, None).await.expect("root -> b").json();
    assert_eq!(json["pod"], "b");
    assert_eq!(server.requests(), 3);

    // A port nobody serves is refused, promptly.
    let err = a.http_get(&format!("http://{}:8099/", b.ip()), None).await.unwrap_err();
    assert!(err.contains("refused"), "{err}");

    // Dropping the server stops it.
    drop(server);
    let mut stopped = false;
    for _ in 0..100 {
        if a.http_get(&url, None).await.is_err() {
            stopped = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(stopped, "the server still answers after being dropped");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loopback_servers_stay_inside_their_pod() {
    require_root();
    let node = TestNode::new();
    let a = node.add_pod("a");
    let b = node.add_pod("b");
    // A port that is free in the root netns, so a refusal there proves isolation, not a busy port.
    let port = free_port();
    let _public = b.serve_http(sock(b.ip(), 8080), "b");
    let _local = b.serve_http(sock(Ipv4Addr::LOCALHOST, port), "b-local");
    let local_url = format!("http://127.0.0.1:{port}/");

    // Pod B itself reaches its loopback server.
    let json = b
        .http_get(&local_url, None)
        .await
        .expect("b -> its own loopback")
        .json();
    assert_eq!(json["pod"], "b-local");
    // So does a socket created in B by `run` and used synchronously.
    let greeting = b.run(move || {
        let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect in b");
        s.write_all(b"GET /x HTTP/1.0\r\n\r\n").unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    });
    assert!(greeting.starts_with("HTTP/1.0 200"), "{greeting}");
    assert!(greeting.contains("\"pod\":\"b-local\""), "{greeting}");

    // The root netns cannot: its 127.0.0.1 is another loopback.
    let err = TcpStream::connect_timeout(&sock(Ipv4Addr::LOCALHOST, port), Duration::from_secs(2)).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ConnectionRefused, "{err}");
    // Neither can pod A, on its own loopback or on B's address (the server is bound to B's 127.0.0.1 only).
    let err = a.http_get(&local_url, None).await.unwrap_err();
    assert!(err.contains("refused"), "{err}");
    let err = a
        .http_get(&format!("http://{}:{port}/", b.ip()), None)
        .await
        .unwrap_err();
    assert!(err.contains("refused"), "{err}");
    // While B's public server is reachable from A.
    let json = a
        .http_get(&format!("http://{}:8080/", b.ip()), None)
        .await
        .expect("a -> b")
        .json();
    assert_eq!(json["pod"], "b");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_server_speaks_h2c() {
    require_root();
    let node = TestNode::new();
    let a = node.add_pod("a");
    let b = node.add_pod("b");
    let _server = b.serve_http(sock(b.ip(), 8080), "b");
    let target = sock(b.ip(), 8080);
    let stream = a.run(|| std::net::TcpStream::connect(target)).expect("connect a -> b");
    stream.set_nonblocking(true).unwrap();
    let stream = tokio::net::TcpStream::from_std(stream).unwrap();
    let (mut sender, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
        .await
        .expect("h2 handshake");
    tokio::spawn(conn);
    let req = hyper::Request::get("http://grpc.example:9000/pkg.Svc/Call")
        .body(Empty::<Bytes>::new())
        .unwrap();
    let resp = sender.send_request(req).await.expect("h2 request");
    assert_eq!(resp.status(), 200);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(json["pod"], "b");
    assert_eq!(json["version"], "HTTP/2.0");
    assert_eq!(json["host"], "grpc.example:9000");
    assert_eq!(json["path"], "/pkg.Svc/Call");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_echo_greets_then_echoes() {
    require_root();
    let node = TestNode::new();
    let a = node.add_pod("client");
    let b = node.add_pod("echo-b");
    let server = b.serve_tcp_echo(sock(b.ip(), 9000));
    let target = server.addr();
    let got = a.run(move || {
        let mut s = TcpStream::connect(target).expect("connect a -> b");
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut greeting = [0u8; 7];
        s.read_exact(&mut greeting).unwrap();
        s.write_all(b"ping 123").unwrap();
        let mut echo = [0u8; 8];
        s.read_exact(&mut echo).unwrap();
        (
            String::from_utf8_lossy(&greeting).into_owned(),
            String::from_utf8_lossy(&echo).into_owned(),
        )
    });
    assert_eq!(got, ("echo-b\n".to_string(), "ping 123".to_string()));
    assert_eq!(server.connections(), 1);
}

#[test]
fn pods_are_wired_as_described() {
    require_root();
    let node = TestNode::new();
    let pod = node.add_pod("p");
    let (net, len) = node.subnet();
    assert_eq!(len, 24);
    assert_eq!(net.octets()[0], 10);
    assert!((200..=207).contains(&net.octets()[1]), "{net}");
    assert_eq!(node.gateway(), Ipv4Addr::from(u32::from(net) | 1));
    assert!(node.bridge_name().starts_with("aeb") && node.bridge_name().len() <= 15);
    assert!(pod.netns_name().starts_with("aep-"));
    assert_eq!(
        pod.netns_path(),
        std::path::Path::new("/var/run/netns").join(pod.netns_name())
    );

    let addr = pod.exec_ok(&["ip", "-4", "-o", "addr", "show", "dev", "eth0"]);
    assert!(addr.contains(&format!("inet {}/24", pod.ip())), "{addr}");
    let routes = pod.exec_ok(&["ip", "-4", "route"]);
    assert!(
        routes.contains(&format!("default via {} dev eth0", node.gateway())),
        "{routes}"
    );
    let lo = pod.exec_ok(&["ip", "-br", "link", "show", "dev", "lo"]);
    assert!(lo.contains("UNKNOWN") || lo.contains("UP"), "{lo}");
    // Only lo and eth0 live in the pod.
    let links = pod.exec_ok(&["ip", "-br", "link"]);
    let names: Vec<_> = links.lines().filter_map(|l| l.split_whitespace().next()).collect();
    assert_eq!(names.len(), 2, "{links}");
    assert!(
        names.contains(&"lo") && names.iter().any(|n| n.starts_with("eth0")),
        "{links}"
    );
    // The host end is a port of the node's bridge.
    let out = Command::new("ip")
        .args(["-o", "link", "show", "dev", pod.host_veth()])
        .output()
        .unwrap();
    let line = String::from_utf8_lossy(&out.stdout);
    assert!(line.contains(&format!("master {}", node.bridge_name())), "{line}");
    // A failing command's status is returned, not hidden.
    assert!(
        !pod.exec(&["ip", "link", "show", "dev", "nonexistent0"])
            .status
            .success()
    );
    // `run` really executes in the pod: the thread sees the pod's interfaces, not the root's.
    let inside = pod.run(|| std::fs::read_to_string("/proc/thread-self/net/dev").unwrap());
    assert!(
        inside.contains("eth0:") && !inside.contains(node.bridge_name()),
        "{inside}"
    );
}

#[test]
fn nodes_do_not_collide() {
    require_root();
    let nodes: Vec<TestNode> = (0..3).map(|_| TestNode::new()).collect();
    for (i, x) in nodes.iter().enumerate() {
        for y in &nodes[i + 1..] {
            assert_ne!(x.bridge_name(), y.bridge_name());
            assert_ne!(x.subnet(), y.subnet());
        }
    }
    let pods: Vec<_> = (0..5).map(|i| nodes[0].add_pod(&format!("p{i}"))).collect();
    let mut ips: Vec<_> = pods.iter().map(|p| p.ip()).collect();
    ips.sort();
    ips.dedup();
    assert_eq!(ips.len(), 5);
    // Addresses are handed out from .2 up, and a freed one is reused.
    let (net, _) = nodes[0].subnet();
    assert_eq!(ips[0], Ipv4Addr::from(u32::from(net) | 2));
    drop(pods);
    let again = nodes[0].add_pod("again");
    assert_eq!(again.ip(), Ipv4Addr::from(u32::from(net) | 2));
}

#[test]
fn dropping_the_node_leaves_nothing_behind() {
    require_root();
    // Pods dropped before the node.
    let node = TestNode::new();
    let bridge = node.bridge_name().to_string();
    let pods = vec![node.add_pod("a"), node.add_pod("b")];
    let names: Vec<(String, String)> = pods
        .iter()
        .map(|p| (p.netns_name().to_string(), p.host_veth().to_string()))
        .collect();
    for (ns, veth) in &names {
        assert!(netns_exists(ns), "{ns} missing: {}", netns_list());
        assert!(link_exists(veth));
    }
    assert!(link_exists(&bridge));
    drop(pods);
    for (ns, veth) in &names {
        assert!(!netns_exists(ns), "{ns} left behind");
        assert!(!link_exists(veth), "{veth} left behind");
    }
    assert!(link_exists(&bridge), "the bridge went with the pods");
    drop(node);
    assert!(!link_exists(&bridge), "{bridge} left behind");

    // The node dropped while its pods are alive takes them with it; their own drop is then a no-op.
    let node = TestNode::new();
    let bridge = node.bridge_name().to_string();
    let pods = vec![node.add_pod("a"), node.add_pod("b")];
    let names: Vec<(String, String)> = pods
        .iter()
        .map(|p| (p.netns_name().to_string(), p.host_veth().to_string()))
        .collect();
    drop(node);
    let list = netns_list();
    let links = link_names();
    for (ns, veth) in &names {
        assert!(!list.contains(ns.as_str()), "{ns} left behind: {list}");
        assert!(!links.contains(veth), "{veth} left behind: {links:?}");
    }
    assert!(!links.contains(&bridge), "{bridge} left behind: {links:?}");
    drop(pods);
}

#[test]
fn a_panicking_test_cleans_up() {
    require_root();
    let (tx, rx) = std::sync::mpsc::channel();
    let result = std::panic::catch_unwind(move || {
        let node = TestNode::new();
        let pod = node.add_pod("doomed");
        tx.send((
            node.bridge_name().to_string(),
            pod.netns_name().to_string(),
            pod.host_veth().to_string(),
        ))
        .unwrap();
        panic!("test failure inside a test with a node and a pod");
    });
    assert!(result.is_err());
    let (bridge, ns, veth) = rx.recv().unwrap();
    assert!(!netns_exists(&ns), "{ns} left behind");
    assert!(!link_exists(&veth), "{veth} left behind");
    assert!(!link_exists(&bridge), "{bridge} left behind");
}

#[test]
fn objects_of_dead_processes_are_swept() {
    require_root();
    // Objects named as if a test process (here: a sleep) had made them; it is then SIGKILLed, so no Drop runs.
    let mut owner = ChildGuard::spawn("owner", {
        let mut c = Command::new("sleep");
        c.arg("1000");
        c
    });
    let pid = owner.pid();
    let bridge = format!("aeb{pid:06x}01");
    let ns = format!("aep-{pid:06x}0001");
    let pod_veth = format!("aev{pid:06x}0001");
    let veth = format!("aev{pid:06x}0002");
    let peer = format!("aex{pid:06x}0002");
    let ip = |args: &[&str]| {
        let out = Command::new("ip").args(args).output().unwrap();
        assert!(
            out.status.success(),
            "ip {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    ip(&["link", "add", "name", &bridge, "type", "bridge"]);
    ip(&["netns", "add", &ns]);
    ip(&[
        "link", "add", "name", &pod_veth, "type", "veth", "peer", "name", "eth0", "netns", &ns,
    ]);
    ip(&["link", "add", "name", &veth, "type", "veth", "peer", "name", &peer]);
    // While the owner lives, sweeps leave its objects alone.
    aether_tests::sweep_stale();
    assert!(link_exists(&bridge) && netns_exists(&ns) && link_exists(&pod_veth) && link_exists(&veth));

    owner.kill();
    let node = TestNode::new(); // sweeps
    let pod = node.add_pod("alive");
    aether_tests::sweep_stale();
    assert!(!link_exists(&bridge), "{bridge} not swept");
    assert!(!netns_exists(&ns), "{ns} not swept");
    assert!(
        !link_exists(&pod_veth) && !link_exists(&veth) && !link_exists(&peer),
        "veths not swept"
    );
    // This process's own objects survive.
    assert!(link_exists(node.bridge_name()) && netns_exists(pod.netns_name()) && link_exists(pod.host_veth()));
}

#[test]
fn child_guard_kills_its_whole_process_group() {
    // A shell that starts a grandchild and reports its pid.
    let mut cmd = Command::new("sh");
    cmd.args(["-c", "sleep 1000 & echo grandchild=$!; echo to-stderr >&2; wait"]);
    let guard = ChildGuard::spawn("sleeper", cmd);
    let grandchild = wait_for(|| {
        guard
            .logs()
            .lines()
            .find_map(|l| l.strip_prefix("grandchild=").map(|p| p.trim().parse::<u32>().unwrap()))
    });
    wait_for(|| guard.logs().contains("to-stderr").then_some(()));
    let leader = guard.pid();
    assert!(std::path::Path::new(&format!("/proc/{grandchild}")).exists());
    drop(guard);
    // Killed and reaped: the leader is gone; the grandchild (reparented to init or a subreaper) is killed.
    assert!(
        !std::path::Path::new(&format!("/proc/{leader}")).exists(),
        "leader {leader} survived"
    );
    wait_for(|| {
        let stat = std::fs::read_to_string(format!("/proc/{grandchild}/stat")).unwrap_or_default();
        // Gone, or a zombie awaiting its new parent.
        (stat.is_empty() || stat.contains(") Z ")).then_some(())
    });
}

#[test]
fn child_guard_terminate_returns_the_exit_status() {
    let mut cmd = Command::new("sh");
    cmd.args([
        "-c",
        "trap 'echo got-term; exit 7' TERM; echo started; sleep 1000 & wait",
    ]);
    let mut guard = ChildGuard::spawn("trapper", cmd);
    wait_for(|| guard.logs().contains("started").then_some(()));
    let status = guard.terminate();
    assert_eq!(status.code(), Some(7), "{status}; logs: {}", guard.logs());
    assert!(guard.logs().contains("got-term"));
    assert_eq!(guard.try_wait(), Some(status));
}

#[test]
fn free_ports_are_bindable() {
    let port = free_port();
    assert_ne!(port, 0);
    std::net::TcpListener::bind(("127.0.0.1", port)).expect("bind the free port");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_serves_a_static_listener() {
    let admin_port = free_port();
    let listener_port = free_port();
    let bootstrap = hello_bootstrap(admin_port, listener_port);
    let base_id = unique_base_id();
    assert_ne!(base_id, unique_base_id(), "base ids repeat");
    let mut envoy = Envoy::start(&bootstrap, base_id);
    assert_eq!(envoy.admin_addr(), SocketAddr::from((Ipv4Addr::LOCALHOST, admin_port)));

    let reply = http_get(&format!("http://127.0.0.1:{listener_port}/anything"), None)
        .await
        .expect("GET");
    assert_eq!(reply.status, 200);
    assert_eq!(reply.body, "hello");
    assert_eq!(reply.headers.get("server").map(String::as_str), Some("envoy"));
    the_admin_api_shows_the_listener_and_its_request(&envoy, listener_port);

    let shm = shared_memory_path(base_id);
    assert!(shm.exists(), "{} missing", shm.display());

    let status = envoy.terminate();
    assert!(status.success(), "envoy exited with {status}: {}", envoy.logs());
    assert!(
        TcpStream::connect(("127.0.0.1", listener_port)).is_err(),
        "the listener outlived Envoy"
    );
    drop(envoy);
    assert!(!shm.exists(), "{} left behind", shm.display());
}

/// A bootstrap with one static listener `hello` on `listener_port` answering 200 "hello" to everything.
fn hello_bootstrap(admin_port: u16, listener_port: u16) -> serde_json::Value {
    serde_json::json!({
        "admin": admin_address_json(admin_port),
        "static_resources": {
            "listeners": [{
                "name": "hello",
                "address": { "socket_address": { "address": "127.0.0.1", "port_value": listener_port } },
                "filter_chains": [{
                    "filters": [{
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                            "stat_prefix": "hello",
                            "route_config": {
                                "name": "hello",
                                "virtual_hosts": [{
                                    "name": "all",
                                    "domains": ["*"],
                                    "routes": [{
                                        "match": { "prefix": "/" },
                                        "direct_response": { "status": 200, "body": { "inline_string": "hello" } }
                                    }]
                                }]
                            },
                            "http_filters": [{
                                "name": "envoy.filters.http.router",
                                "typed_config": {
                                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                                }
                            }]
                        }
                    }]
                }]
            }]
        }
    })
}

/// The config dump has the listener on its port, the stats count the one 2xx, the log shows Envoy started.
fn the_admin_api_shows_the_listener_and_its_request(envoy: &Envoy, listener_port: u16) {
    let dump = envoy.config_dump();
    let listeners = dump["configs"]
        .as_array()
        .expect("configs")
        .iter()
        .find(|c| c["@type"] == "type.googleapis.com/envoy.admin.v3.ListenersConfigDump")
        .expect("a ListenersConfigDump");
    let hello = listeners["static_listeners"]
        .as_array()
        .expect("static_listeners")
        .iter()
        .find(|l| l["listener"]["name"] == "hello")
        .unwrap_or_else(|| panic!("no listener `hello`: {listeners}"));
    assert_eq!(
        hello["listener"]["address"]["socket_address"]["port_value"],
        listener_port
    );

    let stats: serde_json::Value = serde_json::from_str(&envoy.admin_get("/stats?format=json")).unwrap();
    let rq_2xx = stats["stats"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == "http.hello.downstream_rq_2xx")
        .and_then(|s| s["value"].as_u64());
    assert_eq!(rq_2xx, Some(1), "stats: {stats}");
    assert!(envoy.logs().contains("starting main dispatch loop"), "{}", envoy.logs());
}

/// Polls `f` every 20 ms for up to 10 s until it returns Some.
fn wait_for<T>(mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(std::time::Instant::now() < deadline, "condition not met within 10 s");
        std::thread::sleep(Duration::from_millis(20));
    }
}
