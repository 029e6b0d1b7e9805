//! The mesh a suite runs on, and running one case on it: requests from the client pods, polling until each row
//! settles, the weighted splits, and the return to default routing once the routes are gone.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use super::case::{Case, GrpcCall, Row, Split, Via};
use super::kubernetes::{CLUSTER_DOMAIN, Written, apply_routes, create_services};
use super::{CONSECUTIVE_PASSES, SETTLE_DEADLINE, nonce};
use crate::echo::{EchoIdentity, EchoLedger, EchoServer, grpc_call, serve_echo};
use crate::load::{LoadSpec, Protocol};
use crate::mesh::{MESH_DOMAIN, Mesh, NAMESPACE};
use crate::netns::TestPod;

/// The echo pods: (pod, service). `echo` has two replicas, as upstream's `echo` spans two deployments.
const BACKENDS: [(&str, &str); 4] = [
    ("echo-a", "echo"),
    ("echo-b", "echo"),
    ("echo-v1", "echo-v1"),
    ("echo-v2", "echo-v2"),
];
/// Every echo pod serves these ports (upstream's echo Services: `http` 80, `http-alt` 8080, `grpc` 7070).
const PORTS: [(&str, u16); 3] = [("http", 80), ("http-alt", 8080), ("grpc", 7070)];
/// The namespace of the `consumer` client (consumer routes live there).
pub const CONSUMER_NAMESPACE: &str = "consumer";
/// Requests a weighted split sends at once.
const SPLIT_CONCURRENCY: usize = 10;

/// One answer, as the client saw it. A request that got no answer has status 0 and `error` set.
#[derive(Clone, Debug, Default)]
pub struct Observed {
    pub status: u16,
    /// Response headers, lower-case names, repeated ones joined with ", ".
    pub headers: BTreeMap<String, String>,
    /// The echo's JSON, when the answer carried it.
    pub body: Option<serde_json::Value>,
    /// A gRPC call's `grpc-status`.
    pub grpc_status: Option<String>,
    pub elapsed: Duration,
    pub error: Option<String>,
    /// The first bytes of a body that is not the echo's JSON.
    pub raw: String,
    /// Over TLS: the DNS names of the certificate the server presented.
    pub certificate_names: Vec<String>,
    /// A traced request (a row expecting mirrored copies): every service whose echo received it.
    pub traced: Vec<String>,
}

impl Observed {
    /// A top-level string field of the echo's JSON (`service`, `pod`, `path`, `host`, …).
    pub fn backend_field(&self, field: &str) -> Option<String> {
        self.body.as_ref()?.get(field)?.as_str().map(str::to_owned)
    }

    /// The headers the backend saw.
    pub fn backend_headers(&self) -> BTreeMap<String, String> {
        let Some(headers) = self
            .body
            .as_ref()
            .and_then(|b| b.get("headers"))
            .and_then(|h| h.as_object())
        else {
            return BTreeMap::new();
        };
        headers
            .iter()
            .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
            .collect()
    }

    /// What routing decided: the status and the service that answered.
    fn outcome(&self) -> (u16, Option<String>) {
        (self.status, self.backend_field("service"))
    }

    /// The answer in one line, for failure messages.
    fn summary(&self) -> String {
        if let Some(error) = &self.error {
            return format!("no answer: {error}");
        }
        let mut s = format!("status {}", self.status);
        if let Some(body) = &self.body {
            s.push_str(&format!(", echo {body}"));
        } else if !self.raw.is_empty() {
            s.push_str(&format!(", body {:?}", self.raw));
        }
        if let Some(location) = self.headers.get("location") {
            s.push_str(&format!(", location {location:?}"));
        }
        s
    }
}

/// How a suite's mesh is set up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Setup {
    /// The registrar reads routes from a directory; the echo services have no Kubernetes Services.
    RoutesDir,
    /// The registrar reads the fake Kubernetes API server (`--from-kubernetes`): routes are applied there, and
    /// the echo services have Services with ClusterIPs (rows may call `via: cluster-ip`).
    Kubernetes,
    /// [`Setup::RoutesDir`] and an edge gateway reading the same directory ([`crate::edge`]): rows may call
    /// `via: edge` and `via: edge-tls`, from outside the mesh.
    Edge,
}

/// One node of the mesh with the echo services, two clients and a registrar reading routes from a directory or
/// the fake Kubernetes API server.
pub struct Suite {
    // Dropped first: the edge, the servers and pods before the mesh that serves them.
    /// The edge gateway and its world ([`Setup::Edge`]).
    edge: Option<(crate::edge::EdgeGateway, crate::edge::EdgeWorld)>,
    _servers: Vec<EchoServer>,
    /// What the echo servers saw (traced requests, fail-first counters).
    ledger: EchoLedger,
    clients: BTreeMap<&'static str, TestPod>,
    _backends: Vec<TestPod>,
    vips: BTreeMap<String, String>,
    /// The echo services' ClusterIPs ([`Setup::Kubernetes`]; empty otherwise).
    cluster_ips: BTreeMap<String, String>,
    mesh: Mesh,
    /// The routes directory ([`Setup::RoutesDir`], [`Setup::Edge`]).
    routes_dir: Option<tempfile::TempDir>,
}

impl Suite {
    /// Starts the mesh (routes from a directory) and its pods and waits until each client reaches each echo
    /// service.
    pub async fn start() -> Suite {
        Self::start_as(Setup::RoutesDir).await
    }

    /// [`Suite::start`] set up as `setup` says; with Kubernetes Services, also waits until each client reaches
    /// each echo service by its ClusterIP.
    pub async fn start_as(setup: Setup) -> Suite {
        let routes_dir = (setup != Setup::Kubernetes).then(|| tempfile::tempdir().expect("routes dir"));
        let routes_flag = routes_dir.as_ref().map(|d| d.path().display().to_string());
        let registrar_args = match &routes_flag {
            Some(dir) => vec!["--routes-dir", dir.as_str()],
            None => vec!["--from-kubernetes"],
        };
        let mesh = Mesh::start_with_registrar(&[], &registrar_args).await;
        let cluster_ips = match setup {
            Setup::Kubernetes => create_services(&mesh.control_plane.kube),
            Setup::RoutesDir | Setup::Edge => BTreeMap::new(),
        };
        let failures = EchoLedger::default();
        let (mut backends, mut servers) = (Vec::new(), Vec::new());
        for (pod_name, service) in BACKENDS {
            let pod = mesh.node.add_pod(pod_name);
            let who = EchoIdentity {
                pod: pod_name.into(),
                namespace: NAMESPACE.into(),
                service: service.into(),
            };
            for (_, port) in PORTS {
                let addr = SocketAddr::from(([0, 0, 0, 0], port));
                servers.push(serve_echo(&pod, addr, who.clone(), failures.clone()));
            }
            mesh.describe_pod(&pod, pod_name, service, "", &PORTS);
            mesh.add_pod_ok(&pod, pod_name).await;
            backends.push(pod);
        }
        let clients = start_clients(&mesh).await;
        let mut vips = BTreeMap::new();
        for (_, service) in BACKENDS {
            vips.insert(service.to_owned(), mesh.vip(service).await);
        }
        let edge = match (setup, &routes_dir) {
            (Setup::Edge, Some(dir)) => {
                let world = crate::edge::EdgeWorld::new();
                write_file(
                    dir.path(),
                    crate::edge::WORLD_FILE,
                    &world.yaml(crate::edge::STANDARD_LISTENERS),
                );
                Some((crate::edge::EdgeGateway::start(&mesh, dir.path()).await, world))
            }
            _ => None,
        };
        let suite = Suite {
            edge,
            ledger: failures,
            _servers: servers,
            clients,
            _backends: backends,
            vips,
            cluster_ips,
            mesh,
            routes_dir,
        };
        suite.wait_for_default_routing().await;
        suite.wait_for_edge().await;
        suite
    }

    /// With an edge: its HTTP listener answers (404: no route is attached yet).
    async fn wait_for_edge(&self) {
        if self.edge.is_none() {
            return;
        }
        let row = Row {
            via: Via::Edge,
            authority: Some("nothing.example.com".into()),
            expect: super::Expect {
                status: 404,
                ..Default::default()
            },
            ..default_row()
        };
        let settled = self.settle(&row, "the edge's HTTP listener").await;
        settled.unwrap_or_else(|e| panic!("{e}\n{}", self.registrar_logs()));
    }

    /// The edge gateway ([`Setup::Edge`]).
    pub fn edge(&self) -> &crate::edge::EdgeGateway {
        &self.edge.as_ref().expect("an edge suite").0
    }

    /// Whether a GET from the `client` pod to `service` (its VIP, port 80) is refused with 403 now.
    pub async fn refused_from_client(&self, service: &str) -> bool {
        let row = Row {
            to: service.into(),
            ..default_row()
        };
        self.send(&row).await.status == 403
    }

    /// The edge gateway, to hot-restart its Envoy ([`Setup::Edge`]).
    pub fn edge_mut(&mut self) -> &mut crate::edge::EdgeGateway {
        &mut self.edge.as_mut().expect("an edge suite").0
    }

    /// The edge's standard objects and the CA of its certificates ([`Setup::Edge`]).
    pub fn edge_world(&self) -> &crate::edge::EdgeWorld {
        &self.edge.as_ref().expect("an edge suite").1
    }

    /// The registrar's and the agent's logs, for failure messages.
    pub fn registrar_logs(&self) -> String {
        let tail = |logs: String| {
            let lines: Vec<&str> = logs.lines().collect();
            lines[lines.len().saturating_sub(40)..].join("\n")
        };
        let agent = self.mesh.agent.as_ref().map(|a| tail(a.logs())).unwrap_or_default();
        let edge = self.edge.as_ref().map(|(e, _)| e.logs()).unwrap_or_default();
        format!("{}\n\nagent:\n{agent}\n\n{edge}", tail(self.mesh.registrar.logs()))
    }

    /// The mesh the suite runs on.
    pub fn mesh(&self) -> &Mesh {
        &self.mesh
    }

    /// Every client reaches every echo service's own pods while no route is applied (by VIP, and by ClusterIP
    /// when the services have them).
    async fn wait_for_default_routing(&self) {
        let ways: &[Via] = if self.cluster_ips.is_empty() {
            &[Via::Vip]
        } else {
            &[Via::Vip, Via::ClusterIp]
        };
        for from in self.clients.keys() {
            for ((_, service), via) in BACKENDS.iter().flat_map(|b| ways.iter().map(move |v| (b, *v))) {
                let row = Row {
                    from: (*from).into(),
                    to: (*service).into(),
                    via,
                    ..default_row()
                };
                let mut expect = row.expect.clone();
                expect.backend = vec![(*service).into()];
                let settled = self.settle(&Row { expect, ..row }, "default routing").await;
                settled.unwrap_or_else(|e| panic!("{e}\n{}", self.registrar_logs()));
            }
        }
    }

    /// Runs one case (module docs of [`crate::gamma`]); Err names each failed row and its last answer.
    pub async fn run_case(&self, case: &Case) -> Result<(), String> {
        let mut before = Vec::new();
        for row in &case.requests {
            before.push(self.send(row).await);
        }
        let (held, changed): (Vec<usize>, Vec<usize>) =
            (0..case.requests.len()).partition(|&i| case.requests[i].expect.check(&before[i]).is_empty());
        if !case.routes.is_empty() && changed.is_empty() {
            return Err("every row already holds with no route applied: nothing shows the routes work".into());
        }
        let written = self.apply(case);
        let mut errors = Vec::new();
        for &i in changed.iter().chain(&held) {
            if let Err(e) = self.settle(&case.requests[i], &case.requests[i].describe(i)).await {
                errors.push(e);
                break;
            }
        }
        if errors.is_empty() {
            for split in &case.splits {
                if let Err(e) = self.split(split).await {
                    errors.push(e);
                }
            }
        }
        if let Some(written) = written {
            self.remove_routes(written);
            self.restore_gateway(case);
            errors.extend(self.revert(case, &changed, &before).await);
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors.join("\n  "))
        }
    }

    /// Writes the case's routes where the registrar reads them (and, on an edge, its listeners).
    fn apply(&self, case: &Case) -> Option<Written> {
        if let (Some(listeners), Some((edge, world))) = (&case.gateway, &self.edge) {
            write_file(&edge.config_dir, crate::edge::WORLD_FILE, &world.yaml(listeners));
        }
        (!case.routes.is_empty()).then(|| self.write_routes(&case.name, &case.routes))
    }

    /// Puts the standard listeners back after a case that replaced them.
    fn restore_gateway(&self, case: &Case) {
        if let (Some(_), Some((edge, world))) = (&case.gateway, &self.edge) {
            write_file(
                &edge.config_dir,
                crate::edge::WORLD_FILE,
                &world.yaml(crate::edge::STANDARD_LISTENERS),
            );
        }
    }

    /// Writes `yaml` where the registrar reads routes: into its routes directory as `<name>.yaml`, whole, by rename
    /// (never half a file), or each route object into the fake API server.
    pub fn write_routes(&self, name: &str, yaml: &str) -> Written {
        let Some(dir) = &self.routes_dir else {
            return apply_routes(&self.mesh.control_plane.kube, yaml);
        };
        Written::File(write_file(dir.path(), &format!("{name}.yaml"), yaml))
    }

    /// Removes what [`Suite::write_routes`] wrote.
    pub fn remove_routes(&self, written: Written) {
        written.remove(&self.mesh.control_plane.kube);
    }

    /// Waits until a plain GET from `client` to `echo` (port 80) is answered by `service`.
    pub async fn settle_to(&self, service: &str) -> Result<(), String> {
        let mut row = default_row();
        row.expect.backend = vec![service.into()];
        self.settle(&row, &format!("echo answered by {service}"))
            .await
            .map(|_| ())
    }

    /// Load from the `client` pod to the echo service's port 80 (its VIP, its mesh name as the authority).
    pub fn load_to_echo(&self, protocol: Protocol, connections: usize) -> LoadSpec {
        LoadSpec {
            target: SocketAddr::new(self.vips["echo"].parse().expect("a VIP"), 80),
            host: authority("echo", 80),
            path: "/load".into(),
            protocol,
            connections,
            streams: 4,
            netns: Some(self.clients["client"].netns_path()),
        }
    }

    /// After the routes are removed: every row they changed answers as it did before them.
    async fn revert(&self, case: &Case, changed: &[usize], before: &[Observed]) -> Vec<String> {
        let mut errors = Vec::new();
        for &i in changed {
            let row = &case.requests[i];
            let deadline = Instant::now() + SETTLE_DEADLINE;
            loop {
                let now = self.send(row).await;
                if now.outcome() == before[i].outcome() {
                    break;
                }
                if Instant::now() > deadline {
                    errors.push(format!(
                        "{}: routes removed, but after {SETTLE_DEADLINE:?} it still answers {} (before the routes: {})",
                        row.describe(i),
                        now.summary(),
                        before[i].summary()
                    ));
                    return errors;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        errors
    }

    /// Sends `row` until its expectation holds [`CONSECUTIVE_PASSES`] times in a row, or fails after
    /// [`SETTLE_DEADLINE`] with the last answer.
    async fn settle(&self, row: &Row, name: &str) -> Result<Observed, String> {
        let deadline = Instant::now() + SETTLE_DEADLINE;
        let mut passes = 0;
        loop {
            let got = self.send(row).await;
            let errors = row.expect.check(&got);
            if errors.is_empty() {
                passes += 1;
                if passes == row.passes.unwrap_or(CONSECUTIVE_PASSES) {
                    return Ok(got);
                }
                continue;
            }
            passes = 0;
            if Instant::now() > deadline {
                return Err(format!(
                    "{name}: did not settle within {SETTLE_DEADLINE:?}: {}; last answer: {}",
                    errors.join("; "),
                    got.summary()
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// One request as the row describes it; a row expecting mirrored copies is traced, and its copies awaited.
    async fn send(&self, row: &Row) -> Observed {
        if row.expect.mirrored_to.is_empty() {
            return self.send_once(row, None).await;
        }
        let trace = nonce();
        let mut got = self.send_once(row, Some(&trace)).await;
        if got.status != row.expect.status {
            // Not routed as the row expects (before the routes, or after them): no copy to wait for.
            got.traced = self.ledger.served(&trace);
            return got;
        }
        // A mirror's copy travels on its own: it may land after the answer.
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            got.traced = self.ledger.served(&trace);
            let arrived = (row.expect.mirrored_to.iter()).all(|s| got.traced.contains(s));
            if arrived || Instant::now() > deadline {
                return got;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn send_once(&self, row: &Row, trace: Option<&str>) -> Observed {
        let client = &self.clients[row.from.as_str()];
        let mut headers: Vec<(String, String)> = row
            .headers
            .iter()
            .map(|(k, v)| (k.clone(), v.replace("{nonce}", &nonce())))
            .collect();
        if let Some(trace) = trace {
            headers.push((crate::echo::TRACE_HEADER.to_owned(), trace.to_owned()));
        }
        let (addresses, what) = match row.via {
            Via::Vip => (&self.vips, "VIP"),
            Via::ClusterIp => (&self.cluster_ips, "ClusterIP"),
            Via::Edge | Via::EdgeTls => {
                let started = Instant::now();
                let mut got = self.send_to_edge(row, &headers).await;
                got.elapsed = started.elapsed();
                return got;
            }
        };
        let Some(address) = addresses.get(&row.to) else {
            return Observed {
                error: Some(format!("no {what} known for service {:?}", row.to)),
                ..Observed::default()
            };
        };
        let default_authority = || match row.via {
            Via::ClusterIp => kubernetes_authority(&row.to, row.port),
            _ => authority(&row.to, row.port),
        };
        let authority = row.authority.clone().unwrap_or_else(default_authority);
        let started = Instant::now();
        let mut got = match &row.grpc {
            Some(call) => self.grpc(client, address, row.port, &authority, call, &headers).await,
            None => http(client, address, row, &authority, &headers).await,
        };
        got.elapsed = started.elapsed();
        got
    }

    /// A row from outside the mesh to the edge gateway's listener on `row.port`.
    async fn send_to_edge(&self, row: &Row, headers: &[(String, String)]) -> Observed {
        let Some((edge, world)) = &self.edge else {
            return Observed {
                error: Some("an edge row in a suite without an edge gateway".into()),
                ..Observed::default()
            };
        };
        let Some(authority) = &row.authority else {
            return Observed {
                error: Some("an edge row needs an authority".into()),
                ..Observed::default()
            };
        };
        let addr = edge.addr(row.port);
        if let Some(call) = &row.grpc {
            return grpc_observed(grpc_call(None, addr, authority, &call.path(), headers).await);
        }
        let headers: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let (reply, names) = match row.via {
            Via::EdgeTls => {
                let host = authority.rsplit_once(':').map_or(authority.as_str(), |(h, _)| h);
                let ca = &world.ca.cert_pem;
                match crate::http::https_request(addr, host, ca, &row.method, &row.path, authority, &headers, "").await
                {
                    Ok((reply, certificates)) => (Ok(reply), leaf_dns_names(&certificates)),
                    Err(e) => (Err(e), Vec::new()),
                }
            }
            _ => {
                let url = format!("http://{addr}{}", row.path);
                (
                    crate::http_request(&row.method, &url, Some(authority), &headers, "").await,
                    Vec::new(),
                )
            }
        };
        match reply {
            Ok(reply) => Observed {
                status: reply.status,
                body: serde_json::from_str(&reply.body).ok(),
                raw: reply.body.chars().take(200).collect(),
                headers: reply.headers,
                certificate_names: names,
                ..Observed::default()
            },
            Err(e) => Observed {
                error: Some(e),
                ..Observed::default()
            },
        }
    }

    async fn grpc(
        &self,
        client: &TestPod,
        address: &str,
        port: u16,
        authority: &str,
        call: &GrpcCall,
        headers: &[(String, String)],
    ) -> Observed {
        let addr = SocketAddr::new(address.parse().expect("an IP address"), port);
        grpc_observed(grpc_call(Some(client), addr, authority, &call.path(), headers).await)
    }

    /// `split.requests` requests; each backend service's share must be within the tolerance. Three tries, as
    /// a fair split misses a ±5 % window at 500 requests about once in 60.
    async fn split(&self, split: &Split) -> Result<(), String> {
        let row = Row {
            from: split.from.clone(),
            to: split.to.clone(),
            port: split.port,
            path: split.path.clone(),
            headers: split.headers.clone(),
            grpc: split.grpc.clone(),
            via: split.via,
            authority: split.authority.clone(),
            ..default_row()
        };
        let mut last = String::new();
        for _ in 0..3 {
            let counts = self.count_backends(&row, split.requests).await;
            match split_errors(split, &counts) {
                None => return Ok(()),
                Some(e) => last = e,
            }
        }
        Err(format!("split {} → {}:{}: {last}", split.from, split.to, split.port))
    }

    /// Sends `total` copies of `row`, [`SPLIT_CONCURRENCY`] at a time; counts answers by backend service
    /// (failed ones as `status <n>`).
    async fn count_backends(&self, row: &Row, total: usize) -> BTreeMap<String, usize> {
        let mut counts = BTreeMap::new();
        let mut sent = 0;
        while sent < total {
            let batch = SPLIT_CONCURRENCY.min(total - sent);
            let answers = futures::future::join_all((0..batch).map(|_| self.send(row))).await;
            for got in answers {
                let key = match (got.status, got.backend_field("service")) {
                    (200, Some(service)) => service,
                    (status, _) => format!("status {status}"),
                };
                *counts.entry(key).or_default() += 1;
            }
            sent += batch;
        }
        counts
    }
}

/// A unary gRPC call's answer, as a row sees it.
fn grpc_observed(reply: Result<crate::echo::GrpcReply, String>) -> Observed {
    match reply {
        Ok(reply) => Observed {
            status: reply.status,
            headers: reply.headers,
            body: serde_json::from_slice(&reply.message).ok(),
            grpc_status: reply.grpc_status,
            ..Observed::default()
        },
        Err(e) => Observed {
            error: Some(e),
            ..Observed::default()
        },
    }
}

/// Writes `<dir>/<name>` whole, by rename (a reader never sees half a file); returns its path.
fn write_file(dir: &std::path::Path, name: &str, text: &str) -> std::path::PathBuf {
    let file = dir.join(name);
    let partial = dir.join(format!(".{name}.partial"));
    std::fs::write(&partial, text).expect("writing a config file");
    std::fs::rename(&partial, &file).expect("renaming a config file");
    file
}

/// The DNS names of a presented chain's leaf.
fn leaf_dns_names(certificates: &[Vec<u8>]) -> Vec<String> {
    let Some(leaf) = certificates.first() else {
        return Vec::new();
    };
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(leaf) else {
        return Vec::new();
    };
    let Ok(Some(names)) = cert.subject_alternative_name() else {
        return Vec::new();
    };
    (names.value.general_names.iter())
        .filter_map(|n| match n {
            x509_parser::extensions::GeneralName::DNSName(d) => Some(d.to_string()),
            _ => None,
        })
        .collect()
}

/// The row the suite uses for its own checks: GET / on port 80, expecting 200.
fn default_row() -> Row {
    Row {
        from: "client".into(),
        to: "echo".into(),
        port: 80,
        via: Via::Vip,
        method: "GET".into(),
        path: "/".into(),
        headers: BTreeMap::new(),
        authority: None,
        grpc: None,
        passes: None,
        expect: super::Expect {
            status: 200,
            ..Default::default()
        },
    }
}

/// The two clients: `client` in the echo services' namespace, `consumer` in another one; both declare the echo
/// services as upstreams.
async fn start_clients(mesh: &Mesh) -> BTreeMap<&'static str, TestPod> {
    let client = mesh.node.add_pod("client");
    mesh.describe_pod(&client, "client", "client", "echo, echo-v1, echo-v2", &[("http", 8080)]);
    mesh.add_pod_ok(&client, "client").await;
    let consumer = mesh.node.add_pod("consumer");
    let upstreams = format!("{NAMESPACE}/echo, {NAMESPACE}/echo-v1, {NAMESPACE}/echo-v2");
    mesh.describe_pod_in(
        CONSUMER_NAMESPACE,
        &consumer,
        "consumer",
        "client",
        &upstreams,
        &[("http", 8080)],
    );
    let added = mesh.add_pod_in(CONSUMER_NAMESPACE, &consumer, "consumer").await;
    let added = added.unwrap_or_else(|s| panic!("AddPod consumer: {s:?}"));
    assert_eq!(
        added.outcome,
        aether_proto::cni::v1::Outcome::Success as i32,
        "{added:?}"
    );
    BTreeMap::from([("client", client), ("consumer", consumer)])
}

/// A service's mesh name as a client's authority (the port only when not 80, as a browser would write it).
fn authority(service: &str, port: u16) -> String {
    with_port(format!("{service}.{NAMESPACE}.{MESH_DOMAIN}"), port)
}

/// A service's Kubernetes name as a client's authority.
fn kubernetes_authority(service: &str, port: u16) -> String {
    with_port(format!("{service}.{NAMESPACE}.svc.{CLUSTER_DOMAIN}"), port)
}

fn with_port(name: String, port: u16) -> String {
    if port == 80 { name } else { format!("{name}:{port}") }
}

async fn http(client: &TestPod, address: &str, row: &Row, authority: &str, headers: &[(String, String)]) -> Observed {
    let url = format!("http://{address}:{}{}", row.port, row.path);
    let headers: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    match client
        .http_request(&row.method, &url, Some(authority), &headers, "")
        .await
    {
        Ok(reply) => Observed {
            status: reply.status,
            body: serde_json::from_str(&reply.body).ok(),
            raw: reply.body.chars().take(200).collect(),
            headers: reply.headers,
            ..Observed::default()
        },
        Err(e) => Observed {
            error: Some(e),
            ..Observed::default()
        },
    }
}

/// Why `counts` misses the split, or None when every share is within the tolerance.
fn split_errors(split: &Split, counts: &BTreeMap<String, usize>) -> Option<String> {
    let total: usize = counts.values().sum();
    let mut errors = Vec::new();
    for (service, want) in &split.shares {
        let got = counts.get(service).copied().unwrap_or(0) as f64 / total.max(1) as f64;
        if (got - want).abs() > split.tolerance {
            errors.push(format!(
                "{service}: share {got:.3}, want {want:.3} ± {}",
                split.tolerance
            ));
        }
    }
    for (key, n) in counts {
        if !split.shares.contains_key(key) {
            errors.push(format!("{n} answers from {key}, which has no share"));
        }
    }
    (!errors.is_empty()).then(|| format!("{} (counts over {total}: {counts:?})", errors.join("; ")))
}
