//! The CNI service against fakes of its effects: no root, no Envoy, no registrar.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use aether_proto::cni::v1::{CaptureMode, CaptureOptions};
use aether_proto::registry::v1::Locality;
use parking_lot::Mutex;
use tokio::sync::watch;
use tonic::Code;

use super::*;
use crate::capture::CaptureError;
use crate::catalog_watch::{Interest, WatchedCatalog};
use crate::node::{NodeMetrics, ServeError};
use crate::pod::{ContainerPort, PodInfo};
use crate::pod_store::PodStore;
use crate::xds::cache::{Cache, WaitError};

/// One fake for every effect: it keeps what is registered, captured and pinned, logs
/// each effect in order, and fails the effects it is told to.
#[derive(Default)]
struct Fake {
    log: Mutex<Vec<String>>,
    /// `register`, `envoy`, `capture`, `serving` or `drift`.
    failing: Mutex<BTreeSet<&'static str>>,
    /// `<service> <address>`.
    registered: Mutex<BTreeSet<String>>,
    /// Sandboxes with capture state.
    captured: Mutex<BTreeSet<String>>,
    /// Sandboxes with a netns pin (under `pin_dir`).
    pinned: Mutex<BTreeSet<String>>,
    pin_dir: PathBuf,
    /// What a netns holds, for a request without IPs.
    addresses: Mutex<Vec<IpAddr>>,
}

impl Fake {
    fn did(&self, effect: String) {
        self.log.lock().push(effect);
    }

    fn fails(&self, effect: &str) -> bool {
        self.failing.lock().contains(effect)
    }

    fn log(&self) -> Vec<String> {
        self.log.lock().clone()
    }

    fn state(&self) -> [Vec<String>; 3] {
        [&self.registered, &self.captured, &self.pinned].map(|set| set.lock().iter().cloned().collect())
    }
}

#[tonic::async_trait]
impl Registration for Fake {
    async fn register(&self, pod: &LocalPod) -> Result<(), Status> {
        self.did(format!("register {}", pod.id()));
        if self.fails("register") {
            return Err(Status::unavailable("registrar down"));
        }
        let mut registered = self.registered.lock();
        registered.extend(pod.ips.iter().map(|ip| format!("{} {ip}", pod.info.service())));
        Ok(())
    }

    async fn unregister(&self, service: &str, ips: &[IpAddr]) -> Result<(), Status> {
        self.did(format!("unregister {service}"));
        let mut registered = self.registered.lock();
        for ip in ips {
            registered.remove(&format!("{service} {ip}"));
        }
        Ok(())
    }
}

#[tonic::async_trait]
impl Capture for Fake {
    async fn addresses(&self, _netns: &Path) -> Result<Vec<IpAddr>, CaptureError> {
        Ok(self.addresses.lock().clone())
    }

    async fn apply(&self, container_id: &str, netns: &Path, _: &PodCapture) -> Result<(), CaptureError> {
        self.did(format!("capture {container_id}"));
        if self.fails("capture") {
            return Err(CaptureError::Nft {
                command: "nft -f -".into(),
                netns: netns.display().to_string(),
                stderr: "refused".into(),
            });
        }
        self.captured.lock().insert(container_id.into());
        Ok(())
    }

    async fn remove(&self, container_id: &str, _netns: &Path) -> Result<(), CaptureError> {
        self.did(format!("uncapture {container_id}"));
        self.captured.lock().remove(container_id);
        Ok(())
    }

    async fn check(&self, container_id: &str, _netns: &Path) -> Result<Verdict, CaptureError> {
        if self.fails("drift") {
            Ok(Verdict::Drifted)
        } else if self.captured.lock().contains(container_id) {
            Ok(Verdict::Intact(Default::default()))
        } else {
            Ok(Verdict::NotCaptured)
        }
    }

    fn orphans(&self, known: &[String]) -> Vec<String> {
        let captured = self.captured.lock();
        captured.iter().filter(|id| !known.contains(id)).cloned().collect()
    }

    fn pin(&self, container_id: &str) -> PathBuf {
        self.pin_dir.join(container_id)
    }

    fn pinned(&self) -> Vec<String> {
        self.pinned.lock().iter().cloned().collect()
    }

    fn unpin(&self, netns: &Path) -> std::io::Result<bool> {
        let name = netns.file_name().unwrap().to_string_lossy();
        self.did(format!("unpin {name}"));
        Ok(netns.parent() == Some(&self.pin_dir) && self.pinned.lock().remove(name.as_ref()))
    }
}

#[tonic::async_trait]
impl EnvoyWaits for Fake {
    async fn served(&self, pod: &LocalPod, _generation: u64) -> Result<(), ServeError> {
        self.did(format!("served {}", pod.id()));
        match self.fails("envoy") {
            true => Err(ServeError::NotRebuilt(pod.id())),
            false => Ok(()),
        }
    }

    async fn unserved(&self, pod: &LocalPod) -> Result<(), WaitError> {
        self.did(format!("unserved {}", pod.id()));
        Ok(())
    }

    async fn serving(&self, pod: &LocalPod) -> Result<(), WaitError> {
        match self.fails("serving") {
            true => Err(WaitError::NotAcked {
                missing: vec![format!("{}-outbound", pod.id())],
                connected: true,
            }),
            false => Ok(()),
        }
    }
}

/// A CNI service on a real node and pod directory, with [`Fake`] effects. Sandboxes are
/// files under `pin_dir`, as the plugin's pins are.
struct Harness {
    cni: CniService,
    node: Node,
    directory: PodDirectory,
    fake: Arc<Fake>,
    state: tempfile::TempDir,
    pins: tempfile::TempDir,
}

impl Harness {
    fn new() -> Self {
        let (state, pins) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let (_, catalog) = watch::channel(Arc::new(WatchedCatalog::default()));
        let (dependencies, _) = watch::channel(Interest::default());
        let pods = PodStore::open(state.path()).unwrap();
        let node = Node::new(
            "aether.internal",
            Locality::default(),
            pods,
            Cache::default(),
            catalog,
            dependencies,
            NodeMetrics::default(),
        );
        let fake = Arc::new(Fake {
            pin_dir: pins.path().to_owned(),
            ..Fake::default()
        });
        let effects = Effects {
            registration: fake.clone(),
            capture: fake.clone(),
            envoy: fake.clone(),
        };
        let settings = CniSettings {
            excluded_namespaces: BTreeSet::from(["kube-system".to_owned()]),
            pod_lookup_timeout: Duration::from_millis(20),
            capture: CaptureConfig::new(state.path(), "240.240.0.0/16".parse().unwrap(), None, 0x4145),
            uds: crate::uds::UdsLinks {
                link_dir: state.path().join("uds"),
                kubelet_root: state.path().join("kubelet"),
            },
        };
        let directory = PodDirectory::default();
        let cni = CniService::new(
            node.clone(),
            directory.clone(),
            settings,
            effects,
            CniMetrics::default(),
        );
        Harness {
            cni,
            node,
            directory,
            fake,
            state,
            pins,
        }
    }

    /// The pod source reports managed pods `names` of namespace `demo` (service account `web`).
    fn knows(&self, names: &[&str]) {
        let pod = |name: &str| PodInfo {
            namespace: "demo".into(),
            name: name.into(),
            service_account: "web".into(),
            labels: BTreeMap::from([(MANAGED_LABEL.to_owned(), "true".to_owned())]),
            ports: vec![ContainerPort::from_spec("p", 8080, Some("http"), None).unwrap()],
            ..PodInfo::default()
        };
        let pods: HashMap<String, PodInfo> = names.iter().map(|n| (format!("demo/{n}"), pod(n))).collect();
        self.directory.replace_all(pods);
    }

    /// ADD of pod `demo/<name>` in sandbox `c-<name>`, pinned, at 10.0.0.1.
    fn request(&self, name: &str) -> AddPodRequest {
        let netns = self.pins.path().join(format!("c-{name}"));
        std::fs::write(&netns, b"").unwrap();
        self.fake.pinned.lock().insert(format!("c-{name}"));
        AddPodRequest {
            container_id: format!("c-{name}"),
            netns_path: netns.display().to_string(),
            interface_name: "eth0".into(),
            pod: Some(PodRef {
                namespace: "demo".into(),
                name: name.into(),
                uid: String::new(),
            }),
            ips: vec!["10.0.0.1".into()],
            capture: None,
        }
    }

    async fn add(&self, request: AddPodRequest) -> Result<AddPodResponse, Status> {
        CniPlugin::add_pod(&self.cni, Request::new(request))
            .await
            .map(Response::into_inner)
    }

    async fn remove(&self, container_id: &str) -> Result<RemovePodResponse, Status> {
        let request = RemovePodRequest {
            container_id: container_id.into(),
            pod: None,
        };
        CniPlugin::remove_pod(&self.cni, Request::new(request))
            .await
            .map(Response::into_inner)
    }

    async fn check(&self, container_id: &str) -> Result<CheckPodResponse, Status> {
        let request = CheckPodRequest {
            container_id: container_id.into(),
            ..Default::default()
        };
        CniPlugin::check_pod(&self.cni, Request::new(request))
            .await
            .map(Response::into_inner)
    }

    /// The local pods, in memory and on disk.
    fn pods(&self) -> [Vec<String>; 2] {
        let on_disk = PodStore::open(self.state.path()).unwrap().all();
        [self.node.pods(), on_disk].map(|pods| pods.iter().map(LocalPod::id).collect())
    }

    fn calls(&self, method: &'static str, result: &'static str) -> u64 {
        let labels = [("method", method), ("result", result)];
        self.cni.metrics.calls.get_or_create(&labels).get()
    }
}

fn code_and_message(status: Status) -> (Code, String) {
    (status.code(), status.message().to_owned())
}

/// Nothing registered, captured or pinned.
const NOTHING: [Vec<String>; 3] = [Vec::new(), Vec::new(), Vec::new()];
/// No pods in memory or on disk.
const NO_PODS: [Vec<String>; 2] = [Vec::new(), Vec::new()];

#[tokio::test]
async fn an_add_joins_the_mesh_and_a_del_leaves_nothing() {
    let h = Harness::new();
    h.knows(&["p"]);
    let added = h.add(h.request("p")).await.unwrap();
    assert_eq!((added.outcome, added.message.as_str()), (Outcome::Success as i32, ""));
    assert_eq!(h.pods(), [["demo/p"], ["demo/p"]]);
    let [registered, captured, pinned] = h.fake.state();
    assert_eq!(
        (registered, captured, pinned),
        (
            vec!["demo/web 10.0.0.1".to_owned()],
            vec!["c-p".to_owned()],
            vec!["c-p".to_owned()]
        )
    );
    h.check("c-p").await.unwrap();
    assert_eq!(h.calls("AddPod", "ok"), 1);

    let removed = h.remove("c-p").await.unwrap();
    assert_eq!(
        (removed.outcome, removed.message.as_str()),
        (Outcome::Success as i32, "")
    );
    assert_eq!(h.pods(), NO_PODS);
    assert_eq!(h.fake.state(), NOTHING);
    // Envoy lets go of the pod before its capture and pin go.
    assert_eq!(
        h.fake.log()[3..],
        ["unregister demo/web", "unserved demo/p", "uncapture c-p", "unpin c-p"]
    );
}

#[tokio::test]
async fn a_failed_add_undoes_every_part_and_the_retry_starts_clean() {
    let cases = [
        (
            "register",
            Code::Unavailable,
            "registering demo/p with the registrar: registrar down",
        ),
        (
            "envoy",
            Code::DeadlineExceeded,
            "the node has not rebuilt its config with demo/p; retry",
        ),
        (
            "capture",
            Code::Internal,
            "programming the capture rules of demo/p: `nft -f -` in ",
        ),
    ];
    for (failing, code, message) in cases {
        let h = Harness::new();
        h.knows(&["p"]);
        h.fake.failing.lock().insert(failing);
        let (got_code, got_message) = code_and_message(h.add(h.request("p")).await.unwrap_err());
        assert_eq!(got_code, code, "{failing}: {got_message}");
        assert!(got_message.starts_with(message), "{failing}: {got_message}");
        assert_eq!(h.pods(), NO_PODS, "{failing}");
        let [registered, captured, _] = h.fake.state();
        assert!(registered.is_empty() && captured.is_empty(), "{failing}");
        let log = h.fake.log();
        assert!(
            log.contains(&"unregister demo/web".to_owned()) && log.contains(&"uncapture c-p".to_owned()),
            "{log:?}"
        );
        assert_eq!(h.calls("AddPod", "error"), 1);

        h.fake.failing.lock().clear();
        assert_eq!(h.add(h.request("p")).await.unwrap().outcome, Outcome::Success as i32);
    }
}

#[tokio::test]
async fn a_pod_that_cannot_be_saved_is_not_added() {
    let h = Harness::new();
    h.knows(&["p"]);
    let request = h.request("p");
    std::fs::remove_dir_all(h.state.path()).unwrap();
    let (code, message) = code_and_message(h.add(request).await.unwrap_err());
    assert_eq!(code, Code::Internal);
    assert!(message.starts_with("saving pod demo/p: writing "), "{message}");
    assert!(h.node.pods().is_empty());
    let [registered, captured, _] = h.fake.state();
    assert!(registered.is_empty() && captured.is_empty());
}

#[tokio::test]
async fn an_uncaptured_pod_has_no_capture_to_undo() {
    let h = Harness::new();
    h.knows(&["p"]);
    h.fake.failing.lock().insert("register");
    let request = AddPodRequest {
        capture: Some(CaptureOptions {
            mode: CaptureMode::None as i32,
            ..Default::default()
        }),
        ..h.request("p")
    };
    h.add(request).await.unwrap_err();
    assert_eq!(
        h.fake.log(),
        ["register demo/p", "served demo/p", "unregister demo/web"]
    );
}

#[tokio::test]
async fn a_repeated_add_is_one_pod() {
    let h = Harness::new();
    h.knows(&["p"]);
    for _ in 0..2 {
        assert_eq!(h.add(h.request("p")).await.unwrap().outcome, Outcome::Success as i32);
    }
    assert_eq!(h.pods(), [["demo/p"], ["demo/p"]]);
    let [registered, captured, _] = h.fake.state();
    assert_eq!((registered.len(), captured.len()), (1, 1));
}

#[tokio::test]
async fn excluded_and_unmanaged_pods_are_ignored_without_effects() {
    let h = Harness::new();
    h.knows(&[]);
    let excluded = AddPodRequest {
        pod: Some(PodRef {
            namespace: "kube-system".into(),
            name: "dns".into(),
            uid: String::new(),
        }),
        ..h.request("dns")
    };
    let reply = h.add(excluded).await.unwrap();
    assert_eq!(
        (reply.outcome, reply.message.as_str()),
        (
            Outcome::Ignored as i32,
            "namespace kube-system is excluded from the mesh"
        )
    );
    let mut unmanaged = PodInfo {
        namespace: "demo".into(),
        name: "p".into(),
        ..PodInfo::default()
    };
    unmanaged.labels.insert(MANAGED_LABEL.into(), "false".into());
    h.directory
        .replace_all(HashMap::from([("demo/p".to_owned(), unmanaged)]));
    let reply = h.add(h.request("p")).await.unwrap();
    assert_eq!(
        (reply.outcome, reply.message.as_str()),
        (
            Outcome::Ignored as i32,
            "pod demo/p is not managed (label aether.io/managed=true)"
        )
    );
    assert!(h.fake.log().is_empty() && h.node.pods().is_empty());
}

#[tokio::test]
async fn a_pod_unknown_or_of_another_uid_is_refused() {
    let h = Harness::new();
    let status = h.add(h.request("p")).await.unwrap_err();
    assert_eq!(
        code_and_message(status),
        (
            Code::Unavailable,
            "pod demo/p is not known to the pod source yet; retry".into()
        )
    );
    h.knows(&["p"]);
    let mut pods = HashMap::new();
    pods.insert(
        "demo/p".to_owned(),
        PodInfo {
            uid: "u-2".into(),
            ..h.directory.get("demo/p").unwrap()
        },
    );
    h.directory.replace_all(pods);
    let mut request = h.request("p");
    request.pod.as_mut().unwrap().uid = "u-1".into();
    let status = h.add(request).await.unwrap_err();
    assert_eq!(
        code_and_message(status),
        (
            Code::FailedPrecondition,
            "pod.uid: \"u-1\" does not match the pod source's u-2 for demo/p".into()
        )
    );
    assert!(h.fake.log().is_empty());
}

#[tokio::test]
async fn without_ips_the_netns_addresses_are_used() {
    let h = Harness::new();
    h.knows(&["p"]);
    let status = h
        .add(AddPodRequest {
            ips: vec![],
            ..h.request("p")
        })
        .await
        .unwrap_err();
    assert_eq!(
        code_and_message(status),
        (
            Code::InvalidArgument,
            "ips: none given and the netns has no address".into()
        )
    );
    *h.fake.addresses.lock() = vec!["10.0.0.9".parse().unwrap()];
    h.add(AddPodRequest {
        ips: vec![],
        ..h.request("p")
    })
    .await
    .unwrap();
    assert_eq!(h.node.pods()[0].ips, ["10.0.0.9".parse::<IpAddr>().unwrap()]);
}

#[tokio::test]
async fn bad_input_is_refused_naming_the_field() {
    let h = Harness::new();
    h.knows(&["p"]);
    type Spoil = fn(&mut AddPodRequest);
    let cases: [(Spoil, &str); 10] = [
        (|r| r.container_id = "".into(), "container_id: must be set"),
        (
            |r| r.container_id = "a b".into(),
            "container_id: \"a b\" is not a container id",
        ),
        (|r| r.netns_path = "".into(), "netns_path: must be set"),
        (
            |r| r.netns_path = "ns".into(),
            "netns_path: \"ns\" is not an absolute path",
        ),
        (
            |r| r.netns_path = "/no/ns".into(),
            "netns_path: \"/no/ns\" does not exist",
        ),
        (|r| r.pod = None, "pod: must be set"),
        (
            |r| r.pod.as_mut().unwrap().namespace = "Bad".into(),
            "pod.namespace: \"Bad\" is not a DNS-1123 label (lowercase letters, digits and '-')",
        ),
        (
            |r| r.pod.as_mut().unwrap().name.clear(),
            "pod.name: must be 1..=253 characters",
        ),
        (|r| r.ips.push("x".into()), "ips[1]: \"x\" is not an IP address"),
        (
            |r| r.capture.get_or_insert_default().mesh_dns = "x".into(),
            "capture.mesh_dns: \"x\" is not an ip:port address",
        ),
    ];
    for (spoil, message) in cases {
        let mut request = h.request("p");
        spoil(&mut request);
        let status = h.add(request).await.unwrap_err();
        assert_eq!(code_and_message(status), (Code::InvalidArgument, message.to_owned()));
    }
    assert_eq!(h.calls("AddPod", "invalid"), 10);
    assert!(h.fake.log().is_empty());
}

#[tokio::test]
async fn every_call_refuses_a_bad_container_id() {
    let h = Harness::new();
    let status = h.remove("a/b").await.unwrap_err();
    assert_eq!(
        code_and_message(status),
        (
            Code::InvalidArgument,
            "container_id: \"a/b\" is not a container id".into()
        )
    );
    let status = h.check("").await.unwrap_err();
    assert_eq!(
        code_and_message(status),
        (Code::InvalidArgument, "container_id: must be set".into())
    );
    let request = GarbageCollectRequest {
        valid_container_ids: vec!["c-1".into(), "a b".into()],
    };
    let status = CniPlugin::garbage_collect(&h.cni, Request::new(request))
        .await
        .unwrap_err();
    assert_eq!(
        status.message(),
        "valid_container_ids[1]: container_id: \"a b\" is not a container id"
    );
    assert_eq!(h.calls("RemovePod", "invalid") + h.calls("CheckPod", "invalid"), 2);
}

#[tokio::test]
async fn a_del_of_an_unknown_sandbox_succeeds_and_sweeps_what_a_failed_add_left() {
    let h = Harness::new();
    h.fake.captured.lock().insert("ghost".into());
    std::fs::write(h.pins.path().join("ghost"), b"").unwrap();
    h.fake.pinned.lock().insert("ghost".into());
    for _ in 0..2 {
        let removed = h.remove("ghost").await.unwrap();
        assert_eq!(
            (removed.outcome, removed.message.as_str()),
            (Outcome::Success as i32, "unknown sandbox; nothing to do")
        );
        assert_eq!(h.fake.state(), NOTHING);
    }
}

#[tokio::test]
async fn gc_removes_the_sandboxes_the_runtime_no_longer_has() {
    let h = Harness::new();
    h.knows(&["a", "b"]);
    for name in ["a", "b"] {
        h.add(h.request(name)).await.unwrap();
    }
    h.fake.pinned.lock().insert("ghost".into());
    let request = GarbageCollectRequest {
        valid_container_ids: vec!["c-a".into()],
    };
    let reply = CniPlugin::garbage_collect(&h.cni, Request::new(request)).await.unwrap();
    assert_eq!(reply.into_inner().removed, ["c-b", "ghost"]);
    assert_eq!(h.pods(), [["demo/a"], ["demo/a"]]);
    let [_, captured, pinned] = h.fake.state();
    assert_eq!((captured, pinned), (vec!["c-a".to_owned()], vec!["c-a".to_owned()]));
}

#[tokio::test]
async fn check_fails_when_envoy_or_the_capture_lost_the_pod() {
    let h = Harness::new();
    h.knows(&["p"]);
    h.add(h.request("p")).await.unwrap();
    h.check("c-p").await.unwrap();
    h.fake.failing.lock().insert("serving");
    let status = h.check("c-p").await.unwrap_err();
    assert_eq!(
        code_and_message(status),
        (
            Code::FailedPrecondition,
            "Envoy has not acknowledged demo/p-outbound".into()
        )
    );
    h.fake.failing.lock().insert("drift");
    h.fake.failing.lock().remove("serving");
    let (code, message) = code_and_message(h.check("c-p").await.unwrap_err());
    assert_eq!(code, Code::FailedPrecondition);
    assert!(
        message.starts_with("capture: the nftables table inet aether in "),
        "{message}"
    );
    let status = h.check("missing").await.unwrap_err();
    assert_eq!(
        code_and_message(status),
        (
            Code::NotFound,
            "container_id: sandbox missing is not in the mesh".into()
        )
    );
    std::fs::remove_file(h.pins.path().join("c-p")).unwrap();
    assert_eq!(h.check("c-p").await.unwrap_err().code(), Code::FailedPrecondition);
}
