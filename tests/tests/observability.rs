//! Observability end to end: request metrics between two pods from stock Envoy (stats tags from the bootstrap,
//! Envoy's own OTLP sink, re-exposed at the agent's /metrics), the agent's and registrar's OTLP push, valid
//! Prometheus exposition on every /metrics, and a collector that is down.

use std::net::SocketAddr;
use std::process::Command;
use std::time::{Duration, Instant};

use aether_agent::request_metrics::{stats_config_json, stats_sinks_json};
use aether_common::telemetry::exposition::{self, Family, Format};
use aether_tests::control_plane::ControlPlane;
use aether_tests::mesh::{Mesh, fqdn};
use aether_tests::otlp::OtlpReceiver;
use aether_tests::{ChildGuard, Envoy, TestPod, binary, free_port, http_get, unique_base_id};

/// Requests the frontend sends the backend.
const N: u64 = 7;

/// GET `url` from the test process; the body (panics unless 200).
async fn get(url: &str) -> String {
    let reply = http_get(url, None).await.unwrap_or_else(|e| panic!("GET {url}: {e}"));
    assert_eq!(reply.status, 200, "GET {url}: {}", reply.body);
    reply.body
}

/// Polls `url` until a line equals `line` (or panics with the last body).
async fn wait_for_line(url: &str, line: &str) -> String {
    poll_body(url, &format!("no line {line:?} at {url}"), |body| {
        body.lines().any(|l| l == line)
    })
    .await
}

/// The value of the sample whose text starts with `prefix` (name and labels), if any.
fn sample(body: &str, prefix: &str) -> Option<f64> {
    body.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

fn parse_openmetrics(what: &str, body: &str) -> Vec<Family> {
    exposition::parse(body, Format::OpenMetrics)
        .unwrap_or_else(|e| panic!("{what} /metrics is not valid OpenMetrics: {e}\n{body}"))
}

/// A mesh whose agent pushes to `otlp` every 500 ms and reads Envoy's admin, and whose Envoy runs the shipped
/// stats tags and (with `sink`) Envoy's OTLP stats sink to `otlp`.
async fn observed_mesh(otlp: &str, sink: bool, extra_agent_args: &[&str]) -> Mesh {
    let envoy_admin = free_port();
    let admin = format!("127.0.0.1:{envoy_admin}");
    let mut args = vec![
        "--envoy-admin",
        &admin,
        "--otel-enabled",
        "--otlp-endpoint",
        otlp,
        "--otlp-export-interval",
        "500ms",
        "--otlp-timeout",
        "1s",
    ];
    args.extend_from_slice(extra_agent_args);
    let mut mesh = Mesh::start_with(&args).await;
    // Envoy again, with the stats config of proxy/bootstrap.yaml and the sink.
    mesh.envoy = None;
    let mut bootstrap = mesh.envoy_bootstrap(envoy_admin);
    bootstrap["stats_config"] = stats_config_json();
    bootstrap["stats_flush_interval"] = "1s".into();
    if sink {
        bootstrap["stats_sinks"] = stats_sinks_json(Some(otlp));
    }
    mesh.envoy = Some(Envoy::start(&bootstrap, unique_base_id()));
    mesh
}

const REQUESTS_200: &str = "aether_proxy_requests_total{source_workload=\"demo/frontend\",destination_service=\"demo/backend\",destination_port=\"8080\",response_code=\"200\",response_code_class=\"2xx\"}";

const REQUESTS_503: &str = "aether_proxy_requests_total{source_workload=\"demo/frontend\",destination_service=\"demo/backend\",destination_port=\"8080\",response_code=\"503\",response_code_class=\"5xx\"}";

const DURATION_COUNT: &str = "aether_proxy_request_duration_seconds_count{source_workload=\"demo/frontend\",destination_service=\"demo/backend\",destination_port=\"8080\"}";

/// Envoy's own request counter as the bootstrap's stats_tags tag it.
const ENVOY_UPSTREAM_RQ_200: &str = "envoy_cluster_mesh_upstream_rq{envoy_response_code=\"200\",envoy_cluster_name=\"demo/backend|8080\",source_workload=\"demo/frontend\",destination_service=\"demo/backend\",destination_port=\"8080\"}";

/// The tags the bootstrap's stats_tags put on the mesh's request counter, with its response code.
const UPSTREAM_RQ_200: [(&str, &str); 4] = [
    ("source_workload", "demo/frontend"),
    ("destination_service", "demo/backend"),
    ("destination_port", "8080"),
    ("envoy.response_code", "200"),
];

/// The backend's address as the frontend names it.
fn backend_host() -> String {
    format!("{}:8080", fqdn("backend"))
}

/// The agent's /metrics URL.
fn agent_metrics(mesh: &Mesh) -> String {
    format!("http://{}/metrics", mesh.agent_admin)
}

/// `count` requests from `frontend` to the backend at `path(i)` through the node Envoy, each answered `status`.
async fn send_requests(frontend: &TestPod, count: u64, path: impl Fn(u64) -> String, status: u16) {
    let host = backend_host();
    for i in 0..count {
        let reply = frontend
            .http_get(&format!("http://127.0.0.1:18081{}", path(i)), Some(&host))
            .await
            .unwrap();
        assert_eq!(reply.status, status, "{reply:?}");
    }
}

/// Polls `url` until `done` holds for its body (or panics with `what` and the last body).
async fn poll_body(url: &str, what: &str, done: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let body = get(url).await;
        if done(&body) {
            return body;
        }
        assert!(Instant::now() < deadline, "{what}:\n{body}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_between_two_pods_are_envoy_stats_exported_over_otlp_and_at_the_agent() {
    let otlp = OtlpReceiver::start().await;
    let mesh = observed_mesh(
        &otlp.endpoint(),
        true,
        &["--trace-sample-rate", "1", "--envoy-access-log"],
    )
    .await;
    let (frontend, _backend, mut apps) = mesh.frontend_and_backend().await;
    let app = apps.pop().expect("the backend's app");
    send_requests(&frontend, N, |i| format!("/r/{i}"), 200).await;
    assert_eq!(app.requests(), N);

    assert_envoy_stats_are_tagged(&mesh);
    assert_agent_exposes_request_metrics(&mesh).await;
    assert_envoy_sink_exports_the_tagged_counter(&otlp).await;
    assert_agent_pushes_its_instruments_and_spans(&otlp).await;
    assert_access_log_has_a_record_per_request(&otlp).await;

    // A failing backend shows up in the 5xx class, beside the untouched 2xx count.
    drop(app);
    send_requests(&frontend, 3, |_| "/down".into(), 503).await;
    let body = poll_body(&agent_metrics(&mesh), "no 5xx requests at the agent", |body| {
        sample(body, REQUESTS_503).is_some_and(|n| n >= 3.0)
    })
    .await;
    assert_eq!(sample(&body, REQUESTS_200), Some(N as f64), "{body}");
}

/// Envoy's own stats, tagged by the bootstrap's stats_tags.
fn assert_envoy_stats_are_tagged(mesh: &Mesh) {
    let envoy = mesh.envoy().admin_get("/stats/prometheus?usedonly");
    let envoy_line = format!("{ENVOY_UPSTREAM_RQ_200} {N}");
    assert!(
        envoy.lines().any(|l| l == envoy_line),
        "{envoy_line} not in Envoy's stats:\n{envoy}"
    );
    exposition::parse(&envoy, Format::Prometheus).expect("Envoy's /stats/prometheus parses");
}

/// At the agent's /metrics, with our names, as valid OpenMetrics.
async fn assert_agent_exposes_request_metrics(mesh: &Mesh) {
    let url = agent_metrics(mesh);
    let body = wait_for_line(&url, &format!("{REQUESTS_200} {N}")).await;
    // Envoy's histograms move on its stats flush (1 s here).
    let body = if sample(&body, DURATION_COUNT) == Some(N as f64) {
        body
    } else {
        wait_for_line(&url, &format!("{DURATION_COUNT} {N}")).await
    };
    let families = parse_openmetrics("agent", &body);
    let latency = families
        .iter()
        .find(|f| f.name == "aether_proxy_request_duration_seconds")
        .expect("latency histogram");
    let series = exposition::histogram_series(latency);
    assert!(
        series[0].sum.unwrap() > 0.0 && series[0].sum.unwrap() < 10.0,
        "{series:?}"
    );
}

/// Envoy's OTLP stats sink: the same counter, the tags as attributes, the cumulative value N.
async fn assert_envoy_sink_exports_the_tagged_counter(otlp: &OtlpReceiver) {
    let point = otlp
        .wait_for(Duration::from_secs(20), "Envoy request counter with 7", |r| {
            r.latest("cluster.mesh.upstream_rq", &UPSTREAM_RQ_200)
                .filter(|p| p.value == N as f64)
        })
        .await;
    assert!(point.monotonic, "{point:?}");
    let time = otlp
        .wait_for(Duration::from_secs(20), "Envoy request latency histogram", |r| {
            r.latest("cluster.mesh.upstream_rq_time", &[("source_workload", "demo/frontend")])
                .filter(|p| p.value == N as f64)
        })
        .await;
    assert_eq!(time.attributes["destination_service"], "demo/backend");
}

/// The agent's push: the same instruments as /metrics, with the resource naming the process; and its spans.
async fn assert_agent_pushes_its_instruments_and_spans(otlp: &OtlpReceiver) {
    let agent_point = otlp
        .wait_for(Duration::from_secs(20), "agent request counter", |r| {
            r.latest(
                "aether_proxy_requests",
                &[("source_workload", "demo/frontend"), ("response_code_class", "2xx")],
            )
            .filter(|p| p.value == N as f64)
        })
        .await;
    assert_eq!(agent_point.resource["service.name"], "aether-agent");
    assert_eq!(agent_point.resource["k8s.node.name"], "test-node");
    assert!(agent_point.monotonic);
    let pods = otlp
        .wait_for(Duration::from_secs(10), "aether_agent_pods = 2", |r| {
            r.latest("aether_agent_pods", &[]).filter(|p| p.value == 2.0)
        })
        .await;
    assert_eq!(pods.resource["service.version"], env!("CARGO_PKG_VERSION"));
    let acks = otlp
        .wait_for(Duration::from_secs(10), "xDS listener ACKs", |r| {
            r.latest("aether_agent_xds_acks", &[("type", "Listener")])
                .filter(|p| p.value >= 1.0)
        })
        .await;
    assert!(acks.monotonic);
    otlp.wait_for(Duration::from_secs(10), "push latency histogram", |r| {
        r.latest("aether_agent_xds_push_duration_seconds", &[("type", "Cluster")])
            .filter(|p| p.value >= 1.0 && p.sum.is_some())
    })
    .await;
    // Traces: every rebuild is a span, sampled at rate 1.
    otlp.wait_for(Duration::from_secs(20), "an xds_rebuild span from the agent", |r| {
        r.spans()
            .into_iter()
            .find(|(service, name)| service == "aether-agent" && name == "xds_rebuild")
    })
    .await;
}

/// Envoy's OTLP access log (on with --envoy-access-log): one record per request, same dimensions.
async fn assert_access_log_has_a_record_per_request(otlp: &OtlpReceiver) {
    let logs = otlp
        .wait_for(Duration::from_secs(20), "7 access log records", |r| {
            let logs: Vec<_> = r
                .logs()
                .into_iter()
                .filter(|l| l.attributes.get("source_workload").map(String::as_str) == Some("demo/frontend"))
                .collect();
            (logs.len() as u64 == N).then_some(logs)
        })
        .await;
    for log in &logs {
        assert_eq!(log.attributes["response_code"], "200", "{log:?}");
        // Envoy's %UPSTREAM_CLUSTER% is the cluster's stats name.
        assert_eq!(log.attributes["destination_cluster"], "demo/backend|8080", "{log:?}");
        assert!(log.body.starts_with("GET ") && log.body.ends_with(" 200"), "{log:?}");
    }
}

/// The families each component's /metrics must have.
const EXPECTED_FAMILIES: [(&str, &[&str]); 2] = [
    (
        "agent",
        &[
            "aether_agent_xds_pushes",
            "aether_agent_xds_acks",
            "aether_agent_xds_push_duration_seconds",
            "aether_agent_dependencies",
            "aether_agent_clusters",
            "aether_agent_registrar_connected",
            "aether_agent_pods",
            "aether_agent_otlp_exports",
            "aether_proxy_requests",
            "aether_proxy_request_duration_seconds",
        ],
    ),
    (
        "registrar",
        &[
            "aether_registrar_watchers",
            "aether_registrar_changes",
            "aether_registrar_catalog_version",
            "aether_registrar_store_commit_duration_seconds",
        ],
    ),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metrics_endpoint_is_valid_exposition_with_consistent_names() {
    let otlp = OtlpReceiver::start().await;
    let mesh = observed_mesh(&otlp.endpoint(), false, &[]).await;
    let (frontend, _backend, _app) = mesh.frontend_and_backend().await;
    send_requests(&frontend, 1, |_| "/".into(), 200).await;
    wait_for_line(&agent_metrics(&mesh), &format!("{REQUESTS_200} 1")).await;
    // Envoy's histograms appear on its next stats flush.
    wait_for_line(&agent_metrics(&mesh), &format!("{DURATION_COUNT} 1")).await;

    for (component, expected) in EXPECTED_FAMILIES {
        let admin = match component {
            "agent" => mesh.agent_admin,
            _ => mesh.registrar_admin,
        };
        assert_metrics_are_consistent(component, admin, expected).await;
    }
    let envoy = mesh.envoy().admin_get("/stats/prometheus");
    exposition::parse(&envoy, Format::Prometheus).expect("Envoy's /stats/prometheus parses");

    assert_mesh_dns_metrics_are_consistent_and_pushed(&otlp).await;
}

/// `component`'s /metrics at `admin` is valid OpenMetrics, every family named aether_<component>_ (or
/// aether_proxy_) with a HELP, and has every `expected` family.
async fn assert_metrics_are_consistent(component: &str, admin: SocketAddr, expected: &[&str]) {
    let body = get(&format!("http://{admin}/metrics")).await;
    let families = parse_openmetrics(component, &body);
    for family in &families {
        assert!(
            family.name.starts_with(&format!("aether_{component}_")) || family.name.starts_with("aether_proxy_"),
            "{component}: {} is not aether_{component}_<what>[_<unit>]",
            family.name
        );
        assert!(!family.help.is_empty(), "{}: no HELP", family.name);
    }
    let names: Vec<&str> = families.iter().map(|f| f.name.as_str()).collect();
    for name in expected {
        assert!(names.contains(name), "{component}: no {name} in {names:?}");
    }
}

/// mesh-dns: its /metrics is valid with consistent names, and it pushes them too.
async fn assert_mesh_dns_metrics_are_consistent_and_pushed(otlp: &OtlpReceiver) {
    let dir = tempfile::tempdir().unwrap();
    let dns_admin: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let mut cmd = Command::new(binary("aether-mesh-dns"));
    cmd.args(["--listen", &format!("127.0.0.1:{}", free_port())])
        .args(["--admin", &dns_admin.to_string()])
        .arg("--records")
        .arg(dir.path().join("records"))
        .args(["--upstream", "127.0.0.1:9", "--workers", "1"])
        .args([
            "--otel-enabled",
            "--otlp-endpoint",
            &otlp.endpoint(),
            "--otlp-export-interval",
            "300ms",
        ]);
    let dns = ChildGuard::spawn("mesh-dns", cmd);
    let deadline = Instant::now() + Duration::from_secs(20);
    let body = loop {
        if let Ok(reply) = http_get(&format!("http://{dns_admin}/metrics"), None).await
            && reply.status == 200
        {
            break reply.body;
        }
        assert!(
            Instant::now() < deadline,
            "mesh-dns /metrics never answered:\n{}",
            dns.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let families = parse_openmetrics("mesh-dns", &body);
    assert!(!families.is_empty());
    for family in &families {
        assert!(family.name.starts_with("aether_mesh_dns_"), "{}", family.name);
    }
    let pushed = otlp
        .wait_for(Duration::from_secs(20), "mesh-dns's push", |r| {
            r.points("aether_mesh_dns_otlp_exports")
                .into_iter()
                .find(|p| p.resource.get("service.name").map(String::as_str) == Some("aether-mesh-dns"))
        })
        .await;
    assert!(pushed.value >= 1.0, "{pushed:?}");
}

/// Starts the registrar binary pushing to `otlp` every 200 ms; returns it with its admin address.
async fn registrar_pushing_to(otlp: &str, dir: &std::path::Path) -> (ChildGuard, SocketAddr, String, ControlPlane) {
    let control_plane = ControlPlane::new(dir);
    let running = control_plane
        .spawn_registrar(
            &dir.join("data"),
            &[
                "--otel-enabled",
                "--otlp-endpoint",
                otlp,
                "--otlp-export-interval",
                "200ms",
                "--otlp-timeout",
                "500ms",
            ],
        )
        .await;
    (running.child, running.admin, running.url, control_plane)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collector_that_is_down_blocks_nothing_and_is_counted_until_it_comes_back() {
    // Nothing listens on this port (yet).
    let port = free_port();
    let endpoint = format!("http://127.0.0.1:{port}");
    // Everything that exports is on: the agent's push, Envoy's stats sink and its access log.
    let mesh = observed_mesh(&endpoint, true, &["--envoy-access-log", "--trace-sample-rate", "1"]).await;
    let dir = tempfile::tempdir().unwrap();
    let (registrar, registrar_admin, registrar_url, control_plane) = registrar_pushing_to(&endpoint, dir.path()).await;

    // The data path works: pods are added and served, the registrar answers.
    let (frontend, _backend, _app) = mesh.frontend_and_backend().await;
    send_requests(&frontend, 3, |_| "/".into(), 200).await;
    assert_registrar_serves(&control_plane, &registrar_url).await;

    assert_export_failures_keep_being_counted(&mesh, registrar_admin).await;
    // The admin endpoints answer at once meanwhile (nothing waits on the collector).
    let started = Instant::now();
    get(&format!("http://{}/ready", mesh.agent_admin)).await;
    assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());

    let otlp = OtlpReceiver::start_on(format!("127.0.0.1:{port}").parse().unwrap()).await;
    assert_pushes_land_after_recovery(&otlp).await;
    drop(registrar);
}

/// The registrar answers a list (NotFound counts as an answer) while its collector is down.
async fn assert_registrar_serves(control_plane: &ControlPlane, registrar_url: &str) {
    let mut client = control_plane.reader(registrar_url).await;
    client
        .list_endpoints(aether_proto::registrar::v1::ListEndpointsRequest {
            service: "demo/none".into(),
        })
        .await
        .map(|_| ())
        .or_else(|s| {
            if s.code() == tonic::Code::NotFound {
                Ok(())
            } else {
                Err(s)
            }
        })
        .expect("the registrar serves while its collector is down");
}

/// The agent's and the registrar's failed pushes are counted, and keep being counted.
async fn assert_export_failures_keep_being_counted(mesh: &Mesh, registrar_admin: SocketAddr) {
    let failures = |body: &str, component: &str| {
        sample(
            body,
            &format!("aether_{component}_otlp_export_failures_total{{signal=\"metrics\"}}"),
        )
        .unwrap_or(0.0)
    };
    let mut last = (0.0, 0.0);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let agent = get(&agent_metrics(mesh)).await;
        let reg = get(&format!("http://{registrar_admin}/metrics")).await;
        let now = (failures(&agent, "agent"), failures(&reg, "registrar"));
        if now.0 >= 3.0 && now.1 >= 3.0 && now.0 > last.0 && now.1 > last.1 && last.0 > 0.0 {
            return;
        }
        last = now;
        assert!(
            Instant::now() < deadline,
            "failures not counted: agent {now:?}\n{agent}"
        );
        tokio::time::sleep(Duration::from_millis(700)).await;
    }
}

/// The collector is back: the next pushes land, from both, with the totals so far, and Envoy's sink reconnects.
async fn assert_pushes_land_after_recovery(otlp: &OtlpReceiver) {
    otlp.wait_for(Duration::from_secs(30), "the agent's pods gauge after recovery", |r| {
        r.latest("aether_agent_pods", &[]).filter(|p| p.value == 2.0)
    })
    .await;
    let failed = otlp
        .wait_for(
            Duration::from_secs(30),
            "the registrar's failure count after recovery",
            |r| {
                r.latest("aether_registrar_otlp_export_failures", &[("signal", "metrics")])
                    .filter(|p| p.value >= 3.0)
            },
        )
        .await;
    assert_eq!(failed.resource["service.name"], "aether-registrar");
    otlp.wait_for(Duration::from_secs(30), "Envoy's request counter after recovery", |r| {
        r.latest("cluster.mesh.upstream_rq", &[("source_workload", "demo/frontend")])
            .filter(|p| p.value == 3.0)
    })
    .await;
}

/// Requests after the hot restart.
const M: u64 = 4;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shipped_bootstrap_tags_request_metrics_exports_them_and_they_survive_a_hot_restart() {
    let otlp = OtlpReceiver::start().await;
    let (mut mesh, supervisor_admin) = mesh_with_supervised_envoy(&otlp).await;
    let (frontend, _backend, mut apps) = mesh.frontend_and_backend().await;
    let app = apps.pop().expect("the backend's app");
    send_requests(&frontend, N, |_| "/".into(), 200).await;
    otlp.wait_for(
        Duration::from_secs(30),
        "the request counter from the shipped bootstrap's sink",
        |r| {
            r.latest("cluster.mesh.upstream_rq", &UPSTREAM_RQ_200)
                .filter(|p| p.value == N as f64)
        },
    )
    .await;
    assert_supervisor_pushes_and_exposes_its_metrics(&otlp, supervisor_admin).await;

    // Hot restart (SIGHUP) onto a new epoch.
    let proxy = mesh.proxy.as_mut().unwrap();
    proxy.signal(nix::sys::signal::Signal::SIGHUP);
    proxy.wait_epoch_live(1, Duration::from_secs(60)).await;
    send_requests(&frontend, M, |_| "/".into(), 200).await;
    assert_eq!(app.requests(), N + M);
    assert_the_new_epoch_tags_its_counter(&mesh, &otlp).await;
}

/// A mesh whose Envoy is run by the supervisor from proxy/bootstrap.yaml, with Envoy's OTLP stats sink and the
/// supervisor's push to `otlp`; returns it with the supervisor's admin address.
async fn mesh_with_supervised_envoy(otlp: &OtlpReceiver) -> (Mesh, SocketAddr) {
    let envoy_admin = free_port();
    let admin = format!("127.0.0.1:{envoy_admin}");
    let mut mesh = Mesh::start_with(&["--envoy-admin", &admin]).await;
    mesh.envoy = None;
    let mut options = mesh.proxy_options();
    options.envoy_admin = admin.parse().unwrap();
    let endpoint = otlp.endpoint();
    options.extra_args.extend(
        [
            "--otel-enabled",
            "--otlp-endpoint",
            &endpoint,
            "--otlp-export-interval",
            "500ms",
        ]
        .map(String::from),
    );
    mesh.proxy = Some(aether_tests::supervisor::ProxySupervisor::start(&options, 0).await);
    (mesh, options.admin)
}

/// The supervisor pushes its own instruments, and its /metrics is valid.
async fn assert_supervisor_pushes_and_exposes_its_metrics(otlp: &OtlpReceiver, admin: SocketAddr) {
    let epoch = otlp
        .wait_for(Duration::from_secs(10), "aether_proxy_epoch", |r| {
            r.latest("aether_proxy_epoch", &[])
        })
        .await;
    assert_eq!(
        (epoch.value, epoch.resource["service.name"].as_str()),
        (0.0, "aether-proxy")
    );
    let supervisor_metrics = get(&format!("http://{admin}/metrics")).await;
    for family in parse_openmetrics("proxy", &supervisor_metrics) {
        assert!(family.name.starts_with("aether_proxy_"), "{}", family.name);
    }
}

/// The new epoch's stats carry the same tags (re-derived from the same names by its own bootstrap), at the agent
/// and in Envoy's OTLP export. Whether the parent's counts are merged in is the hot restart's business (the
/// supervisor's parent shutdown currently ends the parent before Envoy merges its stats), so both are accepted.
async fn assert_the_new_epoch_tags_its_counter(mesh: &Mesh, otlp: &OtlpReceiver) {
    let counted = |value: f64| value == M as f64 || value == (N + M) as f64;
    poll_body(
        &agent_metrics(mesh),
        "no tagged request counter after the hot restart",
        |body| sample(body, REQUESTS_200).is_some_and(counted),
    )
    .await;
    let after = otlp
        .wait_for(
            Duration::from_secs(30),
            "the tagged request counter after the hot restart",
            |r| {
                r.latest("cluster.mesh.upstream_rq", &UPSTREAM_RQ_200)
                    .filter(|p| counted(p.value) && p.value != N as f64)
            },
        )
        .await;
    assert!(after.monotonic, "{after:?}");
}
