//! `aether-agent proxy` end to end: the supervisor runs a real Envoy from the shipped bootstrap, fed over xDS by a
//! real agent; traffic flows from a pod through the node Envoy's outbound listener (bound in the pod's netns) to a
//! backend pod while Envoy is hot-restarted, poisoned, killed and handed over.

use std::time::{Duration, Instant};

use aether_proto::cni::v1::Outcome;
use aether_tests::load::{Load, LoadReport, LoadSpec, Protocol};
use aether_tests::mesh::{Mesh, fqdn};
use aether_tests::supervisor::{LIVE_TIMEOUT, ProxySupervisor};
use aether_tests::{HttpServer, TestPod};
use nix::sys::signal::Signal;

const OUTBOUND: &str = "127.0.0.1:18081";

/// A mesh with Envoy under the supervisor, a frontend (upstreams: backend) and a backend pod, both added; returns
/// once the frontend reaches the backend through Envoy.
async fn mesh_with_pods() -> (Mesh, TestPod, TestPod, Vec<HttpServer>) {
    let mesh = Mesh::start_with_proxy(&[]).await;
    let (frontend, backend, apps) = mesh.frontend_and_backend().await;
    let reply = served(&frontend).await;
    assert_eq!(reply.json()["pod"], "backend");
    (mesh, frontend, backend, apps)
}

fn backend_host() -> String {
    format!("{}:8080", fqdn("backend"))
}

/// A GET from the frontend to the backend through Envoy, retried until 200 (config propagates asynchronously).
async fn served(frontend: &TestPod) -> aether_tests::HttpReply {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let reply = frontend
            .http_get(&format!("http://{OUTBOUND}/ping"), Some(&backend_host()))
            .await;
        if let Ok(reply) = &reply
            && reply.status == 200
        {
            return reply.clone();
        }
        assert!(Instant::now() < deadline, "frontend cannot reach backend: {reply:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn load(frontend: &TestPod, protocol: Protocol, connections: usize, streams: usize) -> Load {
    Load::start(LoadSpec {
        target: OUTBOUND.parse().unwrap(),
        host: backend_host(),
        path: "/load".into(),
        protocol,
        connections,
        streams,
        netns: Some(frontend.netns_path()),
    })
}

fn proxy(mesh: &Mesh) -> &ProxySupervisor {
    mesh.proxy.as_ref().expect("proxy supervisor running")
}

fn proxy_mut(mesh: &mut Mesh) -> &mut ProxySupervisor {
    mesh.proxy.as_mut().expect("proxy supervisor running")
}

/// Waits until the supervisor runs exactly one Envoy (every retired epoch has exited).
async fn wait_one_envoy(proxy: &ProxySupervisor) {
    let deadline = Instant::now() + Duration::from_secs(15);
    while proxy.envoy_pids().len() != 1 {
        assert!(
            Instant::now() < deadline,
            "old epochs did not exit: {:?}; logs:\n{}",
            proxy.envoy_pids(),
            proxy.child.logs()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn print_report(what: &str, report: &LoadReport) {
    eprintln!(
        "{what}: ok {} failed {} retried-unsent {} connects {} connect-failures {} in {:?}",
        report.ok, report.failed, report.retried_unsent, report.connects, report.connect_failures, report.elapsed
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_hot_restarts_under_http1_and_http2_load_lose_no_request() {
    let (mut mesh, frontend, _backend, _apps) = mesh_with_pods().await;
    let h1 = load(&frontend, Protocol::Http1, 4, 1);
    let h2 = load(&frontend, Protocol::Http2, 2, 4);
    h1.wait_ok(100, Duration::from_secs(10)).await;
    h2.wait_ok(100, Duration::from_secs(10)).await;
    for epoch in 1..=20u64 {
        let proxy = proxy_mut(&mut mesh);
        proxy.signal(Signal::SIGHUP);
        proxy.wait_epoch_live(epoch, LIVE_TIMEOUT).await;
        // Both kinds of traffic flow through the new epoch before the next restart.
        h1.wait_ok(50, Duration::from_secs(10)).await;
        h2.wait_ok(50, Duration::from_secs(10)).await;
    }
    // Let the last old epoch drain and exit under load too.
    wait_one_envoy(proxy(&mesh)).await;
    h1.wait_ok(50, Duration::from_secs(10)).await;
    let (h1, h2) = (h1.stop().await, h2.stop().await);
    print_report("HTTP/1.1", &h1);
    print_report("HTTP/2", &h2);
    h1.assert_clean(1000);
    h2.assert_clean(1000);
    // Every epoch reconnected the clients at least once (the old epochs really went away).
    assert!(h1.connects >= 4 * 20, "{h1:#?}");
    let proxy = proxy(&mesh);
    assert_eq!(proxy.metric("aether_proxy_hot_restarts_total").await, 20.0);
    assert_eq!(proxy.metric("aether_proxy_epoch").await, 20.0);
    assert_eq!(proxy.metric("aether_proxy_envoy_crashes_total").await, 0.0);
    assert_eq!(proxy.status().await["epoch"], 20);
}

/// Polls `f` until it holds, failing with `what` after `timeout`.
async fn until<F: AsyncFnMut() -> bool>(what: &str, timeout: Duration, mut f: F) {
    let deadline = Instant::now() + timeout;
    while !f().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poisoned_bootstrap_never_replaces_the_running_envoy() {
    let (mut mesh, frontend, _backend, _apps) = mesh_with_pods().await;
    let h1 = load(&frontend, Protocol::Http1, 2, 1);
    h1.wait_ok(50, Duration::from_secs(10)).await;
    let proxy = proxy_mut(&mut mesh);
    let envoys = proxy.envoy_pids();
    assert_eq!(envoys.len(), 1, "{envoys:?}");
    let good = std::fs::read_to_string(&proxy.options.template).unwrap();

    // A field Envoy does not know: the template changes, validation refuses it.
    let poisoned = good.replace("connect_timeout: 1s", "connect_timeout: 1s\n      no_such_field: 1");
    assert_ne!(poisoned, good, "the shipped template changed shape; update this test");
    std::fs::write(&proxy.options.template, &poisoned).unwrap();
    until("a validation failure", Duration::from_secs(20), async || {
        proxy.metric("aether_proxy_validation_failures_total").await >= 1.0
    })
    .await;
    let metrics = proxy.metrics().await;
    assert!(
        metrics.contains("aether_proxy_validation_failures_total{reason=\"invalid_bootstrap\"} 1"),
        "{metrics}"
    );
    let status = proxy.status().await;
    let error = status["last_error"].as_str().unwrap_or_default();
    assert!(error.contains("no_such_field"), "{status}");
    assert!(
        proxy.child.logs().contains("refusing the new bootstrap"),
        "{}",
        proxy.child.logs()
    );
    // SIGHUP onto the same poison is refused too.
    proxy.signal(Signal::SIGHUP);
    until("a second validation failure", Duration::from_secs(20), async || {
        proxy.metric("aether_proxy_validation_failures_total").await >= 2.0
    })
    .await;
    // A placeholder the renderer does not know is refused before Envoy sees it.
    std::fs::write(
        &proxy.options.template,
        format!("{good}\n# trailing\nx: {{{{nodeid}}}}\n"),
    )
    .unwrap();
    until("a template failure", Duration::from_secs(20), async || {
        proxy.metrics().await.contains("reason=\"template\"")
    })
    .await;
    assert!(
        proxy.status().await["last_error"]
            .as_str()
            .unwrap_or_default()
            .contains("{{nodeid}}")
    );

    // Nothing restarted: the same Envoy at epoch 0 serves on.
    assert_eq!(proxy.envoy_pids(), envoys);
    assert_eq!(proxy.envoy_epoch().await.unwrap(), ("LIVE".to_owned(), 0));
    assert_eq!(proxy.metric("aether_proxy_hot_restarts_total").await, 0.0);
    h1.wait_ok(50, Duration::from_secs(10)).await;
    assert_eq!(served(&frontend).await.json()["pod"], "backend");

    // A good template again (edited, so it differs from what runs): picked up and hot-restarted onto.
    std::fs::write(&proxy.options.template, format!("{good}\n# edited after the poison\n")).unwrap();
    proxy.wait_epoch_live(1, LIVE_TIMEOUT).await;
    h1.wait_ok(50, Duration::from_secs(10)).await;
    let report = h1.stop().await;
    print_report("HTTP/1.1", &report);
    report.assert_clean(100);
    assert!(proxy.status().await["last_error"].is_null());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_envoy_binary_with_another_hot_restart_version_is_refused() {
    let mut mesh = Mesh::start_with(&[]).await;
    mesh.envoy = None;
    // The real Envoy behind a wrapper the test can "upgrade" in place.
    let mut options = mesh.proxy_options();
    let wrapper = mesh.path("proxy/envoy");
    let real = aether_tests::envoy_bin();
    let write_wrapper = |version: Option<&str>| {
        let fake = version.map_or(String::new(), |v| {
            format!("if [ \"$1\" = --hot-restart-version ]; then echo {v}; exit 0; fi\n")
        });
        let tmp = wrapper.with_extension("tmp");
        std::fs::write(&tmp, format!("#!/bin/sh\n{fake}exec {} \"$@\"\n", real.display())).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::rename(&tmp, &wrapper).unwrap();
    };
    write_wrapper(None);
    options.envoy_bin = wrapper.clone();
    mesh.proxy = Some(ProxySupervisor::start(&options, 0).await);
    let proxy = proxy_mut(&mut mesh);
    let envoys = proxy.envoy_pids();

    write_wrapper(Some("99.1"));
    until("an incompatible-binary refusal", Duration::from_secs(20), async || {
        proxy.metrics().await.contains("reason=\"incompatible_binary\"")
    })
    .await;
    let error = proxy.status().await["last_error"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(error.contains("99.1"), "{error}");
    assert_eq!(proxy.envoy_pids(), envoys);
    assert_eq!(proxy.envoy_epoch().await.unwrap(), ("LIVE".to_owned(), 0));

    // A compatible binary (the same version again) is hot-restarted onto.
    write_wrapper(None);
    proxy.wait_epoch_live(1, LIVE_TIMEOUT).await;
    let metrics = proxy.metrics().await;
    assert!(
        metrics.contains("aether_proxy_hot_restarts_total{trigger=\"binary_changed\"} 1"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_envoy_serves_again_with_config_resynced_from_the_agent() {
    let (mut mesh, frontend, _backend, _apps) = mesh_with_pods().await;
    let proxy = proxy_mut(&mut mesh);
    let envoys = proxy.envoy_pids();
    assert_eq!(envoys.len(), 1, "{envoys:?}");
    let killed_at = Instant::now();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(envoys[0] as i32), Signal::SIGKILL).unwrap();
    // Served again, through a new Envoy whose listeners and clusters came from the agent.
    let deadline = killed_at + Duration::from_secs(10);
    let serving_again = loop {
        let reply = frontend
            .http_get(&format!("http://{OUTBOUND}/again"), Some(&backend_host()))
            .await;
        if let Ok(reply) = &reply
            && reply.status == 200
        {
            assert_eq!(reply.json()["pod"], "backend");
            break killed_at.elapsed();
        }
        assert!(
            Instant::now() < deadline,
            "not served again within 10 s: {reply:?}\n{}",
            proxy.child.logs()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    eprintln!("served again {serving_again:?} after kill -9");
    assert!(
        serving_again <= Duration::from_secs(2),
        "the issue's bound: serving again within 2 s of kill -9, took {serving_again:?}"
    );
    let now = proxy.envoy_pids();
    assert_eq!(now.len(), 1);
    assert_ne!(now, envoys, "the same Envoy?");
    let dump = proxy.envoy_get("/config_dump").await;
    assert!(dump.contains(&fqdn("backend")), "backend cluster missing after restart");
    assert!(
        dump.contains("demo/frontend"),
        "frontend's listeners missing after restart"
    );
    assert_eq!(proxy.metric("aether_proxy_envoy_crashes_total").await, 1.0);
    // (Counted once the supervisor saw the new epoch LIVE, which may be just after the first answer.)
    until("the restart counted", Duration::from_secs(5), async || {
        proxy.metric("aether_proxy_envoy_restarts_total").await == 1.0
    })
    .await;
    // It is a fresh epoch 0 that hot-restarts like the first one.
    proxy.signal(Signal::SIGHUP);
    proxy.wait_epoch_live(1, LIVE_TIMEOUT).await;
}

/// A surge rollout on the host network: the successor shares the Envoy, the state dir and the supervisor's admin
/// address with its predecessor. It takes the Envoy over by hot restart; the predecessor frees the admin address
/// once its epoch has retired and then stays (an exited container would be restarted and take the Envoy back)
/// until SIGTERM, which it answers at once without touching the successor's Envoy. Readiness goes by each one's own
/// ready file, never by the shared port.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_surge_successor_takes_over_and_the_predecessor_steps_aside_until_sigterm() {
    let (mut mesh, frontend, _backend, _apps) = mesh_with_pods().await;
    let h1 = load(&frontend, Protocol::Http1, 4, 1);
    let h2 = load(&frontend, Protocol::Http2, 2, 4);
    h1.wait_ok(100, Duration::from_secs(10)).await;
    h2.wait_ok(100, Duration::from_secs(10)).await;

    let first_options = proxy(&mesh).options.clone();
    assert!(
        first_options.ready_file.exists(),
        "a LIVE supervisor has its ready file"
    );
    let successor_options = first_options.successor();
    assert_eq!(
        successor_options.admin, first_options.admin,
        "one admin address, as on the host network"
    );
    let mut second = ProxySupervisor::spawn(&successor_options);
    second.wait_epoch_live(1, LIVE_TIMEOUT).await;
    assert!(
        successor_options.ready_file.exists(),
        "the successor is ready once it owns a LIVE Envoy"
    );
    assert!(
        !first_options.ready_file.exists(),
        "a superseded supervisor is not ready"
    );
    h1.wait_ok(50, Duration::from_secs(10)).await;
    h2.wait_ok(50, Duration::from_secs(10)).await;

    // The predecessor stepped aside: its epoch retired, the admin address is the successor's, and it keeps running.
    let first = proxy_mut(&mut mesh);
    until("the predecessor idles", Duration::from_secs(20), async || {
        first.child.logs().contains("idle until SIGTERM")
    })
    .await;
    assert!(first.child.logs().contains("retired by"), "{}", first.child.logs());
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        first.child.try_wait().is_none(),
        "the predecessor must not exit before SIGTERM; logs:\n{}",
        first.child.logs()
    );
    assert_eq!(
        second.metric("aether_proxy_takeovers_total").await,
        1.0,
        "the successor serves the admin address"
    );
    let state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(first_options.state_dir.join("proxy-state.json")).unwrap()).unwrap();
    assert_eq!(state["owner_pid"], second.pid());
    assert_eq!(state["epoch"], 1);

    // SIGTERM (the DaemonSet deleting the old pod): it exits at once and the successor's Envoy serves on.
    first.signal(Signal::SIGTERM);
    let status = first
        .child
        .wait_timeout(Duration::from_secs(5))
        .unwrap_or_else(|| panic!("the predecessor did not exit on SIGTERM; logs:\n{}", first.child.logs()));
    assert!(status.success(), "predecessor: {status}; logs:\n{}", first.child.logs());
    mesh.proxy = Some(second);
    let second = proxy_mut(&mut mesh);
    assert_eq!(second.envoy_pids().len(), 1);
    assert_eq!(second.envoy_epoch().await.unwrap(), ("LIVE".to_owned(), 1));
    h1.wait_ok(50, Duration::from_secs(10)).await;
    h2.wait_ok(50, Duration::from_secs(10)).await;

    // It continues the epochs.
    second.signal(Signal::SIGHUP);
    second.wait_epoch_live(2, LIVE_TIMEOUT).await;
    h1.wait_ok(50, Duration::from_secs(10)).await;
    h2.wait_ok(50, Duration::from_secs(10)).await;
    let (h1, h2) = (h1.stop().await, h2.stop().await);
    print_report("HTTP/1.1", &h1);
    print_report("HTTP/2", &h2);
    h1.assert_clean(200);
    h2.assert_clean(200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_envoy_then_exits() {
    let (mut mesh, _frontend, _backend, _apps) = mesh_with_pods().await;
    let proxy = proxy_mut(&mut mesh);
    assert_eq!(proxy.envoy_pids().len(), 1);
    let state_file = proxy.options.state_dir.join("proxy-state.json");
    assert!(state_file.exists());
    proxy.signal(Signal::SIGTERM);
    // Draining: Envoy's listeners enter their drain (the supervisor is no longer ready meanwhile).
    until("Envoy draining", Duration::from_secs(5), async || {
        proxy.server_info().await.is_ok_and(|info| info["state"] == "DRAINING")
    })
    .await;
    let status = proxy.child.wait_timeout(Duration::from_secs(20)).unwrap_or_else(|| {
        panic!(
            "the supervisor did not exit after SIGTERM; logs:\n{}",
            proxy.child.logs()
        )
    });
    assert!(status.success(), "{status}; logs:\n{}", proxy.child.logs());
    assert!(proxy.envoy_pids().is_empty(), "Envoy outlived its supervisor");
    assert!(!state_file.exists(), "a drained Envoy must not be taken over");
    assert!(proxy.server_info().await.is_err(), "Envoy's admin still answers");
}

#[test]
fn the_envoy_under_test_is_the_pinned_version() {
    let pinned = std::fs::read_to_string(aether_tests::envoy::workspace_root().join("proxy/ENVOY_VERSION")).unwrap();
    let pinned = pinned.trim();
    assert!(
        pinned.split('.').count() == 3 && pinned.split('.').all(|p| p.parse::<u32>().is_ok()),
        "proxy/ENVOY_VERSION is not x.y.z: {pinned:?}"
    );
    let out = std::process::Command::new(aether_tests::envoy_bin())
        .arg("--version")
        .output()
        .unwrap();
    let version = String::from_utf8_lossy(&out.stdout);
    assert!(
        version.contains(&format!("/{pinned}/")),
        "the Envoy under test is not proxy/ENVOY_VERSION {pinned}: {version}"
    );
    let dockerfile = std::fs::read_to_string(aether_tests::envoy::workspace_root().join("proxy/Dockerfile")).unwrap();
    assert!(
        dockerfile.contains(&format!("ARG ENVOY_VERSION={pinned}")),
        "proxy/Dockerfile pins another version"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_keeps_serving_while_the_agent_restarts() {
    let (mut mesh, frontend, _backend, _apps) = mesh_with_pods().await;
    let h1 = load(&frontend, Protocol::Http1, 2, 1);
    h1.wait_ok(50, Duration::from_secs(10)).await;
    let envoys = proxy(&mesh).envoy_pids();
    // The agent goes away (Envoy loses its ADS stream and keeps its last config) and comes back.
    drop(mesh.agent.take());
    h1.wait_ok(200, Duration::from_secs(10)).await;
    mesh.start_agent().await;
    h1.wait_ok(200, Duration::from_secs(10)).await;
    let report = h1.stop().await;
    print_report("HTTP/1.1 across an agent restart", &report);
    report.assert_clean(400);
    let proxy = proxy(&mesh);
    assert_eq!(proxy.envoy_pids(), envoys, "Envoy was restarted");
    assert_eq!(proxy.metric("aether_proxy_envoy_crashes_total").await, 0.0);
    assert_eq!(proxy.envoy_epoch().await.unwrap(), ("LIVE".to_owned(), 0));
}

/// Names of the listeners Envoy serves (its active ones, not those draining after removal).
async fn active_listeners(proxy: &ProxySupervisor) -> Vec<String> {
    let dump: serde_json::Value = serde_json::from_str(&proxy.envoy_get("/config_dump").await).unwrap();
    let mut names = Vec::new();
    for config in dump["configs"].as_array().into_iter().flatten() {
        for listener in config["dynamic_listeners"].as_array().into_iter().flatten() {
            if listener.get("active_state").is_some() {
                names.push(listener["name"].as_str().unwrap_or_default().to_owned());
            }
        }
    }
    names
}

/// What the agent believes Envoy holds must be what the live Envoy holds, whichever process restarted: once one
/// Envoy is connected, `/debug/xds` shows every served resource ACKed by it, every pod passes CHECK, a pod whose upstreams
/// are all unchanged is added (its wait is answered by the live Envoy, not the 10 s deadline), and RemovePod
/// returns once that Envoy has really dropped the pod's listeners.
async fn assert_acks_follow_the_live_envoy(mesh: &Mesh, pods: &[(&TestPod, &str)]) {
    // (Envoy reconnects to a restarted agent after its own backoff.)
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let xds: serde_json::Value = serde_json::from_str(&mesh.agent_get("/debug/xds").await).unwrap();
        let mut served = 0;
        let mut unacked = Vec::new();
        for (type_url, resources) in xds["types"].as_object().unwrap() {
            for (name, r) in resources.as_object().unwrap() {
                served += 1;
                if r["acked"] != r["served"] {
                    unacked.push(format!("{type_url} {name}"));
                }
            }
        }
        if unacked.is_empty() && xds["streams"] == 1 {
            eprintln!("all {served} served resources ACKed by the live Envoy");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{} of {served} resources not ACKed, {} streams: {unacked:#?}",
            unacked.len(),
            xds["streams"]
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for (pod, name) in pods {
        let checked = mesh.check_pod(pod, name).await;
        assert!(
            matches!(&checked, Ok(r) if r.outcome == Outcome::Success as i32),
            "CheckPod {name}: {checked:?}"
        );
    }
    let extra = mesh.node.add_pod("frontend-2");
    mesh.describe_pod(&extra, "frontend-2", "frontend", "backend", &[("http", 8080)]);
    let started = Instant::now();
    mesh.add_pod_ok(&extra, "frontend-2").await;
    eprintln!("AddPod with unchanged upstreams: {:?}", started.elapsed());
    assert!(
        active_listeners(proxy(mesh))
            .await
            .iter()
            .any(|l| l.ends_with("demo/frontend-2")),
        "the added pod's listeners are not in Envoy"
    );
    let started = Instant::now();
    let removed = mesh.remove_pod(&extra, "frontend-2").await.expect("RemovePod");
    let took = started.elapsed();
    assert_eq!(removed.outcome, Outcome::Success as i32, "{removed:?}");
    eprintln!("RemovePod: {took:?}");
    let left: Vec<String> = active_listeners(proxy(mesh))
        .await
        .into_iter()
        .filter(|l| l.ends_with("demo/frontend-2"))
        .collect();
    assert!(left.is_empty(), "RemovePod returned while Envoy still serves {left:?}");
    // Its wait was answered by Envoy's ACK, not by running out (the agent's bound is 5 s).
    assert!(
        took < Duration::from_secs(4),
        "RemovePod waited out its bound: {took:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acks_follow_the_new_envoy_after_a_hot_restart() {
    let (mut mesh, frontend, backend, _apps) = mesh_with_pods().await;
    let proxy = proxy_mut(&mut mesh);
    proxy.signal(Signal::SIGHUP);
    proxy.wait_epoch_live(1, LIVE_TIMEOUT).await;
    // The old epoch's ADS stream ends only now, after the new one has ACKed everything.
    wait_one_envoy(proxy).await;
    assert_acks_follow_the_live_envoy(&mesh, &[(&frontend, "frontend"), (&backend, "backend")]).await;
    assert_eq!(served(&frontend).await.json()["pod"], "backend");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acks_follow_the_envoy_the_supervisor_restarts_after_kill_9() {
    let (mesh, frontend, backend, _apps) = mesh_with_pods().await;
    let envoys = proxy(&mesh).envoy_pids();
    assert_eq!(envoys.len(), 1, "{envoys:?}");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(envoys[0] as i32), Signal::SIGKILL).unwrap();
    until("a new Envoy LIVE", Duration::from_secs(10), async || {
        let now = proxy(&mesh).envoy_pids();
        now.len() == 1 && now != envoys && proxy(&mesh).envoy_epoch().await.is_ok_and(|(state, _)| state == "LIVE")
    })
    .await;
    assert_acks_follow_the_live_envoy(&mesh, &[(&frontend, "frontend"), (&backend, "backend")]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acks_follow_the_running_envoy_after_an_agent_restart() {
    let (mut mesh, frontend, backend, _apps) = mesh_with_pods().await;
    drop(mesh.agent.take());
    mesh.start_agent().await;
    assert_acks_follow_the_live_envoy(&mesh, &[(&frontend, "frontend"), (&backend, "backend")]).await;
}
