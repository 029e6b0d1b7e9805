//! Test support: the real registrar binary on loopback, and a watcher that rebuilds
//! its view from the stream.
#![allow(dead_code)] // each test binary uses a different part

pub mod etcd;
pub mod replicas;
pub mod sources;
pub mod updates;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use aether_proto::registrar::v1::registrar_client::RegistrarClient;
use aether_proto::registrar::v1::{
    ListEndpointsRequest, ListServicesRequest, RegisterEndpointRequest, Version, WatchRequest, WatchResponse,
};
use aether_proto::registry::v1::{
    AuthorizationAction, AuthorizationPolicy, AuthorizationTarget, Endpoint, HttpFilter, Port, Protocol,
};
use aether_proto::view::{CatalogView, WatchView};
use aether_registrar::records::{ConfigKind, ConfigRecord};
use aether_registrar::store::Contents;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;
use tonic::transport::Channel;

pub const TIMEOUT: Duration = Duration::from_secs(20);

/// A port nobody listens on right now.
pub use aether_fakes::ports::free_port;

/// The registrar binary, killed when dropped.
pub struct Registrar {
    child: Option<Child>,
    pub grpc: SocketAddr,
    pub admin: SocketAddr,
    pub log: PathBuf,
}

impl Registrar {
    /// Starts the binary on `data_dir` with `extra` flags and waits until /ready says so.
    pub async fn start(data_dir: &Path, extra: &[&str]) -> Registrar {
        Self::start_with_env(data_dir, extra, &[]).await
    }

    /// As [`Registrar::start`], with extra environment variables for the process.
    pub async fn start_with_env(data_dir: &Path, extra: &[&str], env: &[(String, String)]) -> Registrar {
        Self::spawn(data_dir, extra, env, true).await
    }

    /// As [`Registrar::start_with_env`] but serving mTLS with the access rules on (no
    /// `--insecure`): `extra` names the certificates.
    pub async fn start_secure(data_dir: &Path, extra: &[&str], env: &[(String, String)]) -> Registrar {
        Self::spawn(data_dir, extra, env, false).await
    }

    async fn spawn(data_dir: &Path, extra: &[&str], env: &[(String, String)], insecure: bool) -> Registrar {
        let grpc: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let admin: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let log = data_dir.with_extension(format!("{}.log", grpc.port()));
        let child = Command::new(env!("CARGO_BIN_EXE_aether-registrar"))
            .arg("--listen")
            .arg(grpc.to_string())
            .arg("--admin")
            .arg(admin.to_string())
            .arg("--data-dir")
            .arg(data_dir)
            // Most tests are about the catalog and its stores; the access rules and mTLS
            // are tested end to end in tests/tests/control_plane.rs.
            .args(insecure.then_some("--insecure"))
            .args(extra)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("spawning aether-registrar");
        let mut registrar = Registrar {
            child: Some(child),
            grpc,
            admin,
            log,
        };
        let deadline = Instant::now() + TIMEOUT;
        loop {
            if let Ok((200, _)) = http_get(admin, "/ready").await {
                return registrar;
            }
            if let Some(status) = registrar.child.as_mut().unwrap().try_wait().unwrap() {
                panic!(
                    "aether-registrar exited with {status} before becoming ready:\n{}",
                    registrar.logs()
                );
            }
            assert!(
                Instant::now() < deadline,
                "aether-registrar not ready in time:\n{}",
                registrar.logs()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn pid(&self) -> Pid {
        Pid::from_raw(self.child.as_ref().expect("running").id() as i32)
    }

    /// SIGKILL: the replica dies without any goodbye (reaped on drop).
    pub fn kill(&self) {
        kill(self.pid(), Signal::SIGKILL).unwrap();
    }

    pub async fn client(&self) -> RegistrarClient<Channel> {
        RegistrarClient::connect(format!("http://{}", self.grpc))
            .await
            .expect("connecting to the registrar")
    }

    /// SIGTERM, then wait for the exit.
    pub async fn terminate(mut self) -> ExitStatus {
        let mut child = self.child.take().expect("running");
        kill(Pid::from_raw(child.id() as i32), Signal::SIGTERM).unwrap();
        tokio::task::spawn_blocking(move || child.wait().unwrap())
            .await
            .unwrap()
    }
}

impl Drop for Registrar {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A minimal HTTP/1.0 GET: (status, body).
pub async fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: test\r\n\r\n").as_bytes())
        .await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("bad HTTP response: {response:?}")))?;
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Ok((status, body))
}

pub fn endpoint(service: &str, address: &str, port: u32) -> Endpoint {
    Endpoint {
        service: service.into(),
        address: address.into(),
        ports: vec![Port {
            name: "http".into(),
            port,
            protocol: Protocol::Http as i32,
        }],
        node: "node-1".into(),
        ..Default::default()
    }
}

/// A valid projected policy `<namespace>/<name>` (an ALLOW without rules: deny-all),
/// mesh-wide when `mesh_wide`; `generation` tells its versions apart.
pub fn policy(namespace: &str, name: &str, generation: i64, mesh_wide: bool) -> AuthorizationPolicy {
    AuthorizationPolicy {
        namespace: namespace.into(),
        name: name.into(),
        generation,
        target: Some(AuthorizationTarget {
            mesh_wide,
            ..Default::default()
        }),
        action: AuthorizationAction::Allow as i32,
        ..Default::default()
    }
}

/// A valid projected HTTP filter: an inbound local rate limit on `services`.
pub fn http_filter(namespace: &str, name: &str, generation: i64, services: &[&str]) -> HttpFilter {
    use aether_proto::registry::v1::{HttpFilterAttachment, LocalRateLimit, http_filter::Filter};
    HttpFilter {
        namespace: namespace.into(),
        name: name.into(),
        generation,
        services: services.iter().map(|s| s.to_string()).collect(),
        attach: HttpFilterAttachment::Inbound as i32,
        filter: Some(Filter::LocalRateLimit(LocalRateLimit {
            max_tokens: 100,
            fill_interval_ms: 1000,
            ..Default::default()
        })),
        ..Default::default()
    }
}

/// A record's generation, whatever its kind.
pub fn generation(record: &ConfigRecord) -> i64 {
    match record {
        ConfigRecord::Route(route) => route.generation,
        ConfigRecord::Policy(policy) => policy.generation,
        ConfigRecord::HttpFilter(filter) => filter.generation,
        ConfigRecord::MeshConfig(config) => config.generation,
    }
}

/// Each stored configuration record of `kind` as `key generation @revision`, sorted.
pub fn records_of(contents: &Contents, kind: ConfigKind) -> Vec<String> {
    let mut records: Vec<String> = (contents.configs.iter())
        .filter(|r| r.value.kind() == kind)
        .map(|r| format!("{} {} @{}", r.value.key(), generation(&r.value), r.revision))
        .collect();
    records.sort();
    records
}

pub async fn register(client: &mut RegistrarClient<Channel>, endpoint: Endpoint) -> Version {
    client
        .register_endpoint(RegisterEndpointRequest {
            endpoint: Some(endpoint),
        })
        .await
        .expect("register")
        .into_inner()
        .version
        .expect("register returns a version")
}

pub fn filter(services: &[&str]) -> WatchRequest {
    WatchRequest {
        services: services.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

pub fn wildcard() -> WatchRequest {
    WatchRequest {
        wildcard: true,
        ..Default::default()
    }
}

/// The registrar's catalog as List reports it, restricted to `matches`.
pub async fn catalog(client: &mut RegistrarClient<Channel>, matches: impl Fn(&str) -> bool) -> (CatalogView, Version) {
    let listed = client.list_services(ListServicesRequest {}).await.unwrap().into_inner();
    let mut catalog = CatalogView::default();
    for service in listed.services {
        let key = format!("{}/{}", service.namespace, service.name);
        if !matches(&key) {
            continue;
        }
        let endpoints = client
            .list_endpoints(ListEndpointsRequest { service: key.clone() })
            .await
            .unwrap()
            .into_inner()
            .endpoints;
        catalog.endpoints.insert(
            key.clone(),
            std::sync::Arc::new(endpoints.into_iter().map(|e| (e.address.clone(), e)).collect()),
        );
        catalog.services.insert(key, service);
    }
    (catalog, listed.version.unwrap())
}

/// One Watch stream and the view rebuilt from it.
pub struct Watcher {
    requests: mpsc::Sender<WatchRequest>,
    stream: Streaming<WatchResponse>,
    pub view: WatchView,
    /// Every message received, in order.
    pub received: Vec<WatchResponse>,
    /// Fail on a delta that adds what the view has or removes what it lacks.
    strict: bool,
}

impl Watcher {
    pub async fn open(client: &mut RegistrarClient<Channel>, first: WatchRequest) -> Watcher {
        let (requests, rx) = mpsc::channel(16);
        requests.send(first).await.unwrap();
        let stream = client
            .watch(ReceiverStream::new(rx))
            .await
            .expect("opening a watch")
            .into_inner();
        Watcher {
            requests,
            stream,
            view: WatchView::default(),
            received: Vec::new(),
            strict: false,
        }
    }

    /// Panics on duplicate adds and ghost removals (see [`check_delta`]).
    pub fn strict(mut self) -> Self {
        self.strict = true;
        self
    }

    /// Continues from a view built on another stream (a reconnect).
    pub fn with_view(mut self, view: WatchView) -> Self {
        self.view = view;
        self
    }

    fn apply(&mut self, message: WatchResponse) {
        if self.strict {
            check_delta(&self.view, &message);
        }
        self.view.apply(message.clone()).expect("a valid watch message");
        self.received.push(message);
    }

    /// The next message, applied to the view.
    pub async fn next(&mut self) -> WatchResponse {
        let message = tokio::time::timeout(TIMEOUT, self.stream.message())
            .await
            .expect("timed out waiting for a watch message")
            .expect("watch stream failed")
            .expect("watch stream ended");
        self.apply(message.clone());
        message
    }

    /// The next message if one has already arrived, applied to the view.
    pub fn try_next(&mut self) -> Option<WatchResponse> {
        use futures::FutureExt;
        let message = self
            .stream
            .message()
            .now_or_never()?
            .expect("watch stream failed")
            .expect("watch stream ended");
        self.apply(message.clone());
        Some(message)
    }

    /// The status the stream ends with.
    pub async fn end(&mut self) -> tonic::Status {
        loop {
            match tokio::time::timeout(TIMEOUT, self.stream.message())
                .await
                .expect("timed out waiting for the stream to end")
            {
                Ok(Some(message)) => {
                    self.received.push(message);
                }
                Ok(None) => return tonic::Status::ok(""),
                Err(status) => return status,
            }
        }
    }

    /// Reads until the view is at least at `seq`.
    pub async fn until(&mut self, seq: u64) {
        while self.view.version.as_ref().is_none_or(|v| v.seq < seq) {
            self.next().await;
        }
    }

    pub async fn send(&self, request: WatchRequest) {
        self.requests.send(request).await.unwrap();
    }

    /// Reads a RECONCILED snapshot whole: what it removed from the client's view and
    /// the keys of what it sent (services with their endpoints, and records, as
    /// `<kind> <key>`). Panics on any other answer.
    pub async fn reconciled(&mut self) -> Reconciliation {
        use aether_proto::registrar::v1::{SnapshotReason, change, watch_response};
        use aether_proto::view::{http_filter_key, mesh_config_key, policy_key, route_key, service_key};
        let mut seen = Reconciliation::default();
        let before = self.view.catalog.clone();
        loop {
            let message = self.next().await;
            match message.event {
                Some(watch_response::Event::Snapshot(chunk)) => {
                    if seen.chunks == 0 {
                        assert!(chunk.reset && chunk.retain, "not a retained snapshot: {chunk:?}");
                        assert_eq!(chunk.reason, SnapshotReason::Reconciled as i32);
                    } else {
                        assert_eq!(
                            self.view.catalog, before,
                            "the view changed before the snapshot was whole"
                        );
                    }
                    seen.chunks += 1;
                    for removal in chunk.removals {
                        seen.removed.insert(match removal.change.unwrap() {
                            change::Change::ServiceRemoved(key) => key,
                            change::Change::RouteRemoved(key) => format!("route {key}"),
                            change::Change::PolicyRemoved(key) => format!("policy {key}"),
                            change::Change::HttpFilterRemoved(key) => format!("http_filter {key}"),
                            change::Change::MeshConfigRemoved(key) => format!("mesh_config {key}"),
                            other => panic!("a removal that adds: {other:?}"),
                        });
                    }
                    seen.sent.extend(chunk.services.iter().map(service_key));
                    seen.sent.extend(chunk.endpoints.iter().map(|e| e.service.clone()));
                    seen.sent
                        .extend(chunk.routes.iter().map(|r| format!("route {}", route_key(r))));
                    seen.sent
                        .extend(chunk.policies.iter().map(|p| format!("policy {}", policy_key(p))));
                    seen.sent.extend(
                        chunk
                            .http_filters
                            .iter()
                            .map(|f| format!("http_filter {}", http_filter_key(f))),
                    );
                    seen.sent.extend(
                        chunk
                            .mesh_configs
                            .iter()
                            .map(|c| format!("mesh_config {}", mesh_config_key(c))),
                    );
                }
                Some(watch_response::Event::SnapshotComplete(_)) if seen.chunks > 0 => return seen,
                other => panic!("expected a reconciled snapshot, got {other:?}"),
            }
        }
    }
}

/// What a RECONCILED snapshot did (see [`Watcher::reconciled`]).
#[derive(Debug, Default)]
pub struct Reconciliation {
    pub chunks: usize,
    pub removed: std::collections::BTreeSet<String>,
    pub sent: std::collections::BTreeSet<String>,
}

/// A delta must not add an endpoint (or record) the view already has, nor update or
/// remove one it lacks: either would mean a duplicate or a ghost somewhere.
pub fn check_delta(view: &WatchView, message: &WatchResponse) {
    use aether_proto::registrar::v1::{change, watch_response};
    use aether_proto::view::{http_filter_key, mesh_config_key, policy_key, route_key};
    let Some(watch_response::Event::Delta(delta)) = &message.event else {
        return;
    };
    let mut catalog = view.catalog.clone();
    for c in &delta.changes {
        match c.change.as_ref().expect("change has content") {
            change::Change::RoutePut(route) => check_put(&mut catalog.routes, route_key(route), route, "RoutePut"),
            change::Change::RouteRemoved(key) => check_removed(&mut catalog.routes, key, "RouteRemoved"),
            change::Change::PolicyPut(policy) => {
                check_put(&mut catalog.policies, policy_key(policy), policy, "PolicyPut")
            }
            change::Change::PolicyRemoved(key) => check_removed(&mut catalog.policies, key, "PolicyRemoved"),
            change::Change::HttpFilterPut(filter) => check_put(
                &mut catalog.http_filters,
                http_filter_key(filter),
                filter,
                "HttpFilterPut",
            ),
            change::Change::HttpFilterRemoved(key) => {
                check_removed(&mut catalog.http_filters, key, "HttpFilterRemoved")
            }
            change::Change::MeshConfigPut(config) => check_put(
                &mut catalog.mesh_configs,
                mesh_config_key(config),
                config,
                "MeshConfigPut",
            ),
            change::Change::MeshConfigRemoved(key) => {
                check_removed(&mut catalog.mesh_configs, key, "MeshConfigRemoved")
            }
            other => check_service_change(&mut catalog, other),
        }
    }
}

fn check_put<T: Clone + PartialEq + std::fmt::Debug>(
    records: &mut std::collections::BTreeMap<String, std::sync::Arc<T>>,
    key: String,
    record: &T,
    what: &str,
) {
    let old = records.insert(key.clone(), std::sync::Arc::new(record.clone()));
    assert_ne!(old.as_deref(), Some(record), "duplicate {what} {key}");
}

fn check_removed<T>(records: &mut std::collections::BTreeMap<String, std::sync::Arc<T>>, key: &str, what: &str) {
    assert!(records.remove(key).is_some(), "ghost {what} {key}");
}

/// [`check_delta`] for a change of a service or an endpoint.
fn check_service_change(catalog: &mut CatalogView, change: &aether_proto::registrar::v1::change::Change) {
    use aether_proto::registrar::v1::change;
    fn endpoints_of<'a>(
        catalog: &'a mut CatalogView,
        service: &str,
    ) -> &'a mut std::collections::BTreeMap<String, Endpoint> {
        let eps = catalog.endpoints.get_mut(service).expect("endpoint of a known service");
        std::sync::Arc::make_mut(eps)
    }
    match change {
        change::Change::ServiceAdded(s) => {
            let key = format!("{}/{}", s.namespace, s.name);
            assert_ne!(catalog.services.get(&key), Some(s), "duplicate ServiceAdded {key}");
            catalog.endpoints.entry(key.clone()).or_default();
            catalog.services.insert(key, s.clone());
        }
        change::Change::ServiceRemoved(key) => {
            assert!(catalog.services.remove(key).is_some(), "ghost ServiceRemoved {key}");
            catalog.endpoints.remove(key);
        }
        change::Change::EndpointAdded(e) => {
            let fresh = endpoints_of(catalog, &e.service)
                .insert(e.address.clone(), e.clone())
                .is_none();
            assert!(fresh, "duplicate EndpointAdded {}/{}", e.service, e.address);
        }
        change::Change::EndpointUpdated(e) => {
            let known = endpoints_of(catalog, &e.service)
                .insert(e.address.clone(), e.clone())
                .is_some();
            assert!(known, "EndpointUpdated of absent {}/{}", e.service, e.address);
        }
        change::Change::EndpointRemoved(r) => {
            let known = endpoints_of(catalog, &r.service).remove(&r.address).is_some();
            assert!(known, "ghost EndpointRemoved {}/{}", r.service, r.address);
        }
        other => panic!("not a service change: {other:?}"),
    }
}
