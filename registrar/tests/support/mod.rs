//! Test support: the real registrar binary on loopback, and a watcher that rebuilds
//! its view from the stream.
#![allow(dead_code)] // each test binary uses a different part

pub mod etcd;
pub mod replicas;
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
    AuthorizationAction, AuthorizationPolicy, AuthorizationTarget, Endpoint, Port, Protocol,
};
use aether_proto::view::{CatalogView, WatchView};
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
            // These tests are about the catalog and its stores; the access rules and mTLS
            // are tested end to end in tests/tests/control_plane.rs.
            .arg("--insecure")
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
}

/// A delta must not add an endpoint the view already has, nor update or remove one
/// it lacks: either would mean a duplicate or a ghost somewhere.
pub fn check_delta(view: &WatchView, message: &WatchResponse) {
    use aether_proto::registrar::v1::{change, watch_response};
    let Some(watch_response::Event::Delta(delta)) = &message.event else {
        return;
    };
    let mut catalog = view.catalog.clone();
    for c in &delta.changes {
        match c.change.as_ref().expect("change has content") {
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
                let eps = catalog
                    .endpoints
                    .get_mut(&e.service)
                    .expect("endpoint of a known service");
                let eps = std::sync::Arc::make_mut(eps);
                assert!(
                    eps.insert(e.address.clone(), e.clone()).is_none(),
                    "duplicate EndpointAdded {}/{}",
                    e.service,
                    e.address
                );
            }
            change::Change::EndpointUpdated(e) => {
                let eps = catalog
                    .endpoints
                    .get_mut(&e.service)
                    .expect("endpoint of a known service");
                let eps = std::sync::Arc::make_mut(eps);
                assert!(
                    eps.insert(e.address.clone(), e.clone()).is_some(),
                    "EndpointUpdated of absent {}/{}",
                    e.service,
                    e.address
                );
            }
            change::Change::EndpointRemoved(r) => {
                let eps = catalog
                    .endpoints
                    .get_mut(&r.service)
                    .expect("endpoint of a known service");
                let eps = std::sync::Arc::make_mut(eps);
                assert!(
                    eps.remove(&r.address).is_some(),
                    "ghost EndpointRemoved {}/{}",
                    r.service,
                    r.address
                );
            }
            change::Change::RoutePut(route) => {
                let key = aether_proto::view::route_key(route);
                let old = catalog.routes.insert(key.clone(), std::sync::Arc::new(route.clone()));
                assert_ne!(old.as_deref(), Some(route), "duplicate RoutePut {key}");
            }
            change::Change::RouteRemoved(key) => {
                assert!(catalog.routes.remove(key).is_some(), "ghost RouteRemoved {key}");
            }
            change::Change::PolicyPut(policy) => {
                let key = aether_proto::view::policy_key(policy);
                let old = catalog
                    .policies
                    .insert(key.clone(), std::sync::Arc::new(policy.clone()));
                assert_ne!(old.as_deref(), Some(policy), "duplicate PolicyPut {key}");
            }
            change::Change::PolicyRemoved(key) => {
                assert!(catalog.policies.remove(key).is_some(), "ghost PolicyRemoved {key}");
            }
            change::Change::HttpFilterPut(filter) => {
                let key = aether_proto::view::http_filter_key(filter);
                let old = catalog
                    .http_filters
                    .insert(key.clone(), std::sync::Arc::new(filter.clone()));
                assert_ne!(old.as_deref(), Some(filter), "duplicate HttpFilterPut {key}");
            }
            change::Change::HttpFilterRemoved(key) => {
                assert!(
                    catalog.http_filters.remove(key).is_some(),
                    "ghost HttpFilterRemoved {key}"
                );
            }
        }
    }
}
