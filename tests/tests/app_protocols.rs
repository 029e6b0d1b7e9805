//! Thrift, Redis and Dubbo parsed at the destination (proposal 017) through real Envoy,
//! pods in network namespaces, mTLS on: real servers and clients (thriftpy2, redis-server,
//! redis-cli; for Dubbo, our own Hessian2 client and server, `tests/fixtures/dubbo`) in the pods, the client calling the service's VIP (captured), per-message
//! and per-command counts at Envoy and at the agent's `/metrics`, and a malformed frame
//! closed and counted while the port keeps serving.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use aether_agent::request_metrics::stats_config_json;
use aether_tests::envoy::workspace_root;
use aether_tests::mesh::Mesh;
use aether_tests::{ChildGuard, Envoy, TestPod, free_port, unique_base_id};

const THRIFT_PORT: u16 = 9090;
const DUBBO_PORT: u16 = 20880;
const REDIS_PORT: u16 = 6379;

/// A mesh whose agent reads Envoy's admin and whose Envoy runs the shipped stats tags.
async fn tagged_mesh() -> Mesh {
    tagged_mesh_with_registrar(&[]).await
}

async fn tagged_mesh_with_registrar(registrar_args: &[&str]) -> Mesh {
    let envoy_admin = free_port();
    let admin = format!("127.0.0.1:{envoy_admin}");
    let mut mesh = Mesh::start_with_registrar(&["--envoy-admin", &admin], registrar_args).await;
    mesh.envoy = None;
    let mut bootstrap = mesh.envoy_bootstrap(envoy_admin);
    bootstrap["stats_config"] = stats_config_json();
    mesh.envoy = Some(Envoy::start(&bootstrap, unique_base_id()));
    mesh
}

fn python() -> PathBuf {
    let python = workspace_root().join(".venv/bin/python");
    assert!(python.is_file(), "{} missing: run `make setup`", python.display());
    python
}

fn dubbo_script() -> String {
    workspace_root()
        .join("tests/fixtures/dubbo/calc.py")
        .display()
        .to_string()
}

fn calc_script() -> String {
    workspace_root()
        .join("tests/fixtures/thrift/calc.py")
        .display()
        .to_string()
}

/// Runs `program` inside `pod` for as long as the guard lives.
fn spawn_in(pod: &TestPod, name: &str, program: &str, args: &[&str]) -> ChildGuard {
    let mut command = pod.command(program);
    command.args(args);
    ChildGuard::spawn(name, command)
}

/// A service's one pod running an app, and the pods calling it.
struct Served {
    /// Dropped before the pods: the app dies first.
    _app: ChildGuard,
    _server: TestPod,
    callers: Vec<TestPod>,
    /// The service's VIP.
    vip: String,
}

/// Runs `program args` in a pod of its own service `name` (listening on 127.0.0.1 at
/// `port`, named `port_name`, the pod annotated with `annotations`), then adds `callers`,
/// each a pod of its own service that declares `name`.
async fn serve(
    mesh: &Mesh,
    name: &str,
    (port_name, port): (&str, u16),
    annotations: &[(&str, &str)],
    (program, args): (&str, &[&str]),
    callers: &[&str],
) -> Served {
    let server = mesh.node.add_pod(name);
    let app = spawn_in(&server, &format!("{name}-app"), program, args);
    wait_listening(&server, SocketAddr::from(([127, 0, 0, 1], port)), &app);
    mesh.describe_pod_annotated(&server, name, name, &[(port_name, port)], annotations);
    mesh.add_pod_ok(&server, name).await;
    let mut pods = Vec::new();
    for caller in callers {
        let pod = mesh.node.add_pod(caller);
        mesh.describe_pod(&pod, caller, caller, name, &[]);
        mesh.add_pod_ok(&pod, caller).await;
        pods.push(pod);
    }
    Served {
        _app: app,
        _server: server,
        callers: pods,
        vip: mesh.vip(name).await,
    }
}

/// Waits until `addr` accepts connections inside `pod`.
fn wait_listening(pod: &TestPod, addr: SocketAddr, server: &ChildGuard) {
    let deadline = Instant::now() + Duration::from_secs(15);
    while pod
        .run(move || TcpStream::connect_timeout(&addr, Duration::from_millis(200)))
        .is_err()
    {
        assert!(Instant::now() < deadline, "{} never listened on {addr}", server.name());
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The value of the sample whose text starts with `prefix` (name and labels), if any.
fn sample(body: &str, prefix: &str) -> Option<f64> {
    body.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// Polls the agent's `/metrics` until the sample `prefix` reaches `at_least`.
async fn until_counted(mesh: &Mesh, prefix: &str, at_least: f64) -> String {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let body = mesh.agent_get("/metrics").await;
        if sample(&body, prefix).is_some_and(|n| n >= at_least) {
            return body;
        }
        assert!(Instant::now() < deadline, "{prefix} never reached {at_least}:\n{body}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Sends `bytes` from `client` to `target` and reads until the other side closes; returns
/// what came back. Panics if the connection stays open (nothing closed it).
fn send_raw(client: &TestPod, target: SocketAddr, bytes: &'static [u8]) -> Vec<u8> {
    client
        .run(move || {
            let mut stream = TcpStream::connect_timeout(&target, Duration::from_secs(5))?;
            stream.set_read_timeout(Some(Duration::from_secs(10)))?;
            stream.write_all(bytes)?;
            let mut answer = Vec::new();
            stream.read_to_end(&mut answer)?;
            Ok::<_, std::io::Error>(answer)
        })
        .unwrap_or_else(|e| panic!("the malformed frame's connection to {target} was not closed: {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thrift_is_parsed_at_the_destination_counted_and_guarded_against_malformed_frames() {
    let mesh = tagged_mesh().await;
    let port = THRIFT_PORT.to_string();
    let python = python().display().to_string();
    let app = [&calc_script(), "serve", &port, "compact", "framed"];
    let calc = serve(
        &mesh,
        "calc",
        ("thrift", THRIFT_PORT),
        &[],
        (&python, &app),
        &["client"],
    )
    .await;
    let (client, vip) = (&calc.callers[0], &calc.vip);

    // A real Thrift client through the mesh: replies, a string, a declared exception.
    let call = |rounds: &str| {
        let out = client.exec(&[
            &python,
            &calc_script(),
            "call",
            vip,
            &THRIFT_PORT.to_string(),
            "compact",
            "framed",
            rounds,
        ]);
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "thrift client: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
    };
    assert_eq!(call("3").lines().collect::<Vec<_>>(), ["add=5 echo=hi refuse=no"; 3]);

    // Envoy parsed every message on the serving side: 3 rounds of 3 calls, 6 successes
    // and 3 declared exceptions (Thrift's "error" replies).
    let destination = "destination_service=\"demo/calc\",destination_port=\"9090\"";
    let calls = format!("aether_proxy_thrift_requests_total{{{destination},message_type=\"call\"}}");
    let body = until_counted(&mesh, &calls, 9.0).await;
    assert_eq!(sample(&body, &calls), Some(9.0), "{body}");
    let successes = format!("aether_proxy_thrift_responses_total{{{destination},outcome=\"success\"}}");
    let errors = format!("aether_proxy_thrift_responses_total{{{destination},outcome=\"error\"}}");
    assert_eq!(sample(&body, &successes), Some(6.0), "{body}");
    assert_eq!(sample(&body, &errors), Some(3.0), "{body}");

    // A frame that is no Thrift message: Envoy closes that connection before the app.
    let target: SocketAddr = format!("{vip}:{THRIFT_PORT}").parse().unwrap();
    let answer = send_raw(client, target, b"\x00\x00\x00\x10GET / HTTP/1.1\r\n\r\n");
    assert!(answer.is_empty() || answer.len() < 256, "{answer:?}");
    let malformed = format!("aether_proxy_protocol_errors_total{{{destination},protocol=\"thrift\"}}");
    until_counted(&mesh, &malformed, 1.0).await;
    // The port keeps serving.
    assert_eq!(call("1").trim(), "add=5 echo=hi refuse=no");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dubbo_is_parsed_where_the_pod_opts_in_counted_and_guarded_against_malformed_frames() {
    let mesh = tagged_mesh().await;
    let port = DUBBO_PORT.to_string();
    let python = python().display().to_string();
    let app = [&dubbo_script(), "serve", &port];
    let opt_in = [("protocol.aether.io/l7", "dubbo")];
    let calc = serve(
        &mesh,
        "calc",
        ("dubbo", DUBBO_PORT),
        &opt_in,
        (&python, &app),
        &["client"],
    )
    .await;
    let (client, vip) = (&calc.callers[0], &calc.vip);

    // Our Dubbo client (Hessian2) through the mesh: values, a string, a missing method's exception.
    let call = |rounds: &str| {
        let out = client.exec(&[&python, &dubbo_script(), "call", vip, &port, rounds]);
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "dubbo client: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
    };
    assert_eq!(
        call("2").lines().collect::<Vec<_>>(),
        ["add=5 echo=hi missing=exception"; 2]
    );

    let destination = "destination_service=\"demo/calc\",destination_port=\"20880\"";
    let twoway = format!("aether_proxy_dubbo_requests_total{{{destination},message_type=\"twoway\"}}");
    let body = until_counted(&mesh, &twoway, 6.0).await;
    assert_eq!(sample(&body, &twoway), Some(6.0), "{body}");
    let exceptions = format!("aether_proxy_dubbo_responses_total{{{destination},outcome=\"exception\"}}");
    assert_eq!(sample(&body, &exceptions), Some(2.0), "{body}");

    // A Dubbo header whose Hessian2 body is not one: closed before the app, counted.
    let target: SocketAddr = format!("{vip}:{DUBBO_PORT}").parse().unwrap();
    send_raw(
        client,
        target,
        b"\xda\xbb\xc2\x00\x00\x00\x00\x00\x00\x00\x00\x01\x00\x00\x00\x05\xff\xff\xff\xff\xff",
    );
    let malformed = format!("aether_proxy_protocol_errors_total{{{destination},protocol=\"dubbo\"}}");
    until_counted(&mesh, &malformed, 1.0).await;
    assert_eq!(
        call("1").trim(),
        "add=5 echo=hi missing=exception",
        "the port keeps serving"
    );
}

/// Only the client's identity may call calc.
const CALC_CLIENT_ONLY: &str = "\
apiVersion: security.aether.io/v1alpha1
kind: AuthorizationPolicy
metadata: {name: calc-clients, namespace: demo}
spec:
  targetRefs: [{kind: Service, name: calc}]
  rules:
    - from: [{source: {serviceAccounts: [demo/client]}}]
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parsed_port_keeps_its_policies_and_their_decision_log() {
    let config = tempfile::tempdir().unwrap();
    let dir = config.path().display().to_string();
    let mesh = tagged_mesh_with_registrar(&["--config-dir", &dir]).await;
    let port = THRIFT_PORT.to_string();
    let python = python().display().to_string();
    let app = [&calc_script(), "serve", &port, "binary", "buffered"];
    let calc = serve(
        &mesh,
        "calc",
        ("thrift", THRIFT_PORT),
        &[],
        (&python, &app),
        &["client", "intruder"],
    )
    .await;
    let (callers, vip) = (&calc.callers, &calc.vip);
    let call = |pod: &TestPod| {
        pod.exec(&[&python, &calc_script(), "call", vip, &port, "binary", "buffered"])
            .status
            .success()
    };
    assert!(call(&callers[1]), "unframed binary Thrift is served before the policy");

    aether_tests::mesh::put_config(config.path(), "calc.yaml", Some(CALC_CLIENT_ONLY));
    let deadline = Instant::now() + Duration::from_secs(15);
    while call(&callers[1]) {
        assert!(Instant::now() < deadline, "the intruder's calls are never refused");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(call(&callers[0]), "the client's calls are served");
    // The L7 chain's decisions are logged by the listener, naming the port.
    let parts = [
        "authorization: no ALLOW policy selecting the pod matched",
        "source=spiffe://aether.test/ns/demo/sa/intruder",
        "pod=demo/calc",
        "port=9090",
    ];
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let logs = mesh.agent.as_ref().unwrap().logs();
        if logs.lines().any(|line| parts.iter().all(|p| line.contains(p))) {
            break;
        }
        let decisions: Vec<&str> = logs.lines().filter(|l| l.contains("authorization:")).collect();
        assert!(Instant::now() < deadline, "never logged {parts:?}: {decisions:#?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_commands_are_counted_where_the_pod_opts_in_and_bad_frames_closed() {
    let mesh = tagged_mesh().await;
    let port = REDIS_PORT.to_string();
    let app = ["--port", &port, "--bind", "127.0.0.1", "--save", ""];
    let opt_in = [("protocol.aether.io/l7", "redis")];
    let cache = serve(
        &mesh,
        "cache",
        ("redis", REDIS_PORT),
        &opt_in,
        ("redis-server", &app),
        &["client"],
    )
    .await;
    let (client, vip) = (&cache.callers[0], &cache.vip);

    let cli = |args: &[&str]| {
        let port = REDIS_PORT.to_string();
        let mut command = vec!["redis-cli", "-h", &vip, "-p", &port];
        command.extend_from_slice(args);
        client.exec_ok(&command).trim().to_owned()
    };
    assert_eq!(cli(&["SET", "greeting", "hello"]), "OK");
    assert_eq!(cli(&["GET", "greeting"]), "hello");
    assert_eq!(cli(&["GET", "greeting"]), "hello");
    assert_eq!(
        cli(&["INCR", "greeting"]),
        "ERR value is not an integer or out of range"
    );

    let destination = "destination_service=\"demo/cache\",destination_port=\"6379\"";
    let gets = format!("aether_proxy_redis_commands_total{{{destination},command=\"get\",outcome=\"success\"}}");
    let body = until_counted(&mesh, &gets, 2.0).await;
    assert_eq!(sample(&body, &gets), Some(2.0), "{body}");
    let set = format!("aether_proxy_redis_commands_total{{{destination},command=\"set\",outcome=\"success\"}}");
    assert_eq!(sample(&body, &set), Some(1.0), "{body}");
    // The app's error reply is an answer: Envoy's "error" is a command the app never answered.
    let incr = format!("aether_proxy_redis_commands_total{{{destination},command=\"incr\",outcome=\"success\"}}");
    assert_eq!(sample(&body, &incr), Some(1.0), "{body}");

    // RESP that cannot be parsed: Envoy closes that connection and counts it.
    let target: SocketAddr = format!("{vip}:{REDIS_PORT}").parse().unwrap();
    send_raw(client, target, b"*2\r\n$x\r\nGET\r\n");
    let malformed = format!("aether_proxy_protocol_errors_total{{{destination},protocol=\"redis\"}}");
    until_counted(&mesh, &malformed, 1.0).await;
    assert_eq!(cli(&["GET", "greeting"]), "hello", "the port keeps serving");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_port_stays_a_tcp_stream_without_the_opt_in() {
    let mesh = tagged_mesh().await;
    let port = REDIS_PORT.to_string();
    let app = ["--port", &port, "--bind", "127.0.0.1", "--save", ""];
    let cache = serve(
        &mesh,
        "plain-cache",
        ("redis", REDIS_PORT),
        &[],
        ("redis-server", &app),
        &["client"],
    )
    .await;
    let (client, vip) = (&cache.callers[0], &cache.vip);
    // SELECT is one of the commands Envoy's Redis proxy does not speak: carried as TCP,
    // the app answers it.
    let out = client.exec_ok(&["redis-cli", "-h", vip, "-p", &port, "SELECT", "1"]);
    assert_eq!(out.trim(), "OK");
    let stats = mesh.envoy().admin_get("/stats?filter=^redis\\.");
    assert!(!stats.contains("redis.l7."), "{stats}");
}
