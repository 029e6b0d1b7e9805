//! The cluster's core/v1 Services, watched in all namespaces and reduced to what a mesh
//! service of the same namespace and name carries in `Service.kubernetes`
//! ([`attributes`]): its `spec.clusterIPs` and `spec.ports` (ClusterIP matching) and
//! its `spec.trafficDistribution` (locality). Published as the whole current set after each
//! burst of events that changed it; status-only changes publish nothing.
//!
//! - With a writable store (`--from-kubernetes`), [`run`] hands each set to
//!   `Catalog::set_service_attributes`, through the store like every other change.
//!   Every replica may run it: identical sets write nothing.
//! - The Kubernetes store derives its services' attributes from the same watch.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use aether_proto::registry::v1::{KubernetesService, ServicePort, TrafficDistribution};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Service, ServiceSpec};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::Sets;
use crate::catalog::Catalog;
use crate::model::ServiceKey;

/// Events arriving within this window are published as one set.
pub const DEBOUNCE: Duration = Duration::from_millis(100);
/// Pause before storing the attributes again after the catalog could not.
const RETRY: Duration = Duration::from_secs(1);

/// Every Service of the cluster, by `<namespace>/<name>`.
pub type ServiceSet = BTreeMap<ServiceKey, KubernetesService>;

/// What the mesh carries of a Service: its cluster IPs (none when headless: `None`),
/// its ports with their targets, and its traffic distribution (`PreferClose` is the
/// older name of `PreferSameZone`; anything else is no preference).
pub fn attributes(spec: Option<&ServiceSpec>) -> KubernetesService {
    let Some(spec) = spec else {
        return KubernetesService::default();
    };
    let listed = spec.cluster_ips.clone().unwrap_or_default();
    let ips = match listed.is_empty() {
        true => spec.cluster_ip.iter().cloned().collect(),
        false => listed,
    };
    let traffic = match spec.traffic_distribution.as_deref() {
        Some("PreferSameNode") => TrafficDistribution::PreferSameNode,
        Some("PreferSameZone" | "PreferClose") => TrafficDistribution::PreferSameZone,
        _ => TrafficDistribution::Unspecified,
    };
    KubernetesService {
        // "None" (headless) and anything else that is not an address carries nothing.
        cluster_ips: ips.into_iter().filter(|ip| ip.parse::<IpAddr>().is_ok()).collect(),
        traffic_distribution: traffic as i32,
        ports: spec.ports.iter().flatten().filter_map(service_port).collect(),
    }
}

/// One of `spec.ports`: a numeric targetPort as the target, a named one kept by name, none
/// meaning the port itself (as Kubernetes defaults it). `None` for a port out of range.
fn service_port(port: &k8s_openapi::api::core::v1::ServicePort) -> Option<ServicePort> {
    let number = u32::try_from(port.port).ok().filter(|p| (1..=65535).contains(p))?;
    let (target_port, target_port_name) = match &port.target_port {
        None => (number, String::new()),
        Some(IntOrString::Int(target)) => (
            u32::try_from(*target).ok().filter(|p| (1..=65535).contains(p))?,
            String::new(),
        ),
        // A number written as a string is still a number (the API server accepts "8080").
        Some(IntOrString::String(name)) => match name.parse::<u32>() {
            Ok(target) if (1..=65535).contains(&target) => (target, String::new()),
            _ => (0, name.clone()),
        },
    };
    Some(ServicePort {
        name: port.name.clone().unwrap_or_default(),
        port: number,
        target_port,
        target_port_name,
        app_protocol: port.app_protocol.clone().unwrap_or_default(),
    })
}

/// A handle on the Service watch.
pub type ClusterServices = Sets<ServiceSet>;

impl ClusterServices {
    /// Starts watching the cluster's Services through `client`.
    pub fn start(client: Client) -> ClusterServices {
        let (tx, sets) = watch::channel(None);
        tokio::spawn(collect(Api::all(client), tx));
        Sets::new(sets)
    }
}

/// The set being collected, and the one a relist is building.
#[derive(Default)]
struct Collected {
    set: ServiceSet,
    relist: Option<ServiceSet>,
    listed: bool,
}

impl Collected {
    /// Applies one event; true if the set changed (or was listed for the first time).
    fn apply(&mut self, event: Event<Service>) -> bool {
        match event {
            Event::Init => self.relist = Some(ServiceSet::new()),
            Event::InitApply(service) => {
                if let Some((key, value)) = entry(&service) {
                    self.relist.get_or_insert_default().insert(key, value);
                }
            }
            Event::InitDone => {
                let listed = self.relist.take().unwrap_or_default();
                let first = !std::mem::replace(&mut self.listed, true);
                return first | (std::mem::replace(&mut self.set, listed) != self.set);
            }
            Event::Apply(service) => {
                if let Some((key, value)) = entry(&service) {
                    return self.set.insert(key, value.clone()) != Some(value);
                }
            }
            Event::Delete(service) => {
                if let Some((key, _)) = entry(&service) {
                    return self.set.remove(&key).is_some();
                }
            }
        }
        false
    }
}

/// A Service's key and attributes; `None` for a name no mesh service can have.
fn entry(service: &Service) -> Option<(ServiceKey, KubernetesService)> {
    let metadata = &service.metadata;
    let namespace = metadata.namespace.as_deref().unwrap_or("default");
    let key = ServiceKey::from_parts("metadata", namespace, metadata.name.as_deref()?).ok()?;
    Some((key, attributes(service.spec.as_ref())))
}

async fn collect(api: Api<Service>, tx: watch::Sender<Option<Arc<ServiceSet>>>) {
    let mut events = pin!(watcher::watcher(api, watcher::Config::default()).default_backoff());
    let mut collected = Collected::default();
    let mut failing = false;
    loop {
        let first = tokio::select! {
            event = events.next() => event,
            () = tx.closed() => None,
        };
        let Some(first) = first else { return };
        let deadline = tokio::time::Instant::now() + DEBOUNCE;
        let mut changed = false;
        let mut next = Some(first);
        while let Some(event) = next {
            match event {
                Ok(event) => {
                    if std::mem::take(&mut failing) {
                        tracing::info!("watching Services again");
                    }
                    changed |= collected.apply(event);
                }
                Err(error) if !std::mem::replace(&mut failing, true) => {
                    tracing::warn!(%error, "watching Services failed; retrying with backoff (serving the last set)");
                }
                Err(_) => {}
            }
            next = tokio::time::timeout_at(deadline, events.next()).await.ok().flatten();
        }
        if changed && collected.listed {
            tx.send_replace(Some(Arc::new(collected.set.clone())));
        }
    }
}

/// Keeps the catalog's service attributes equal to the cluster's Services until
/// `shutdown` (a writable store).
pub async fn run(mut services: ClusterServices, catalog: Catalog, shutdown: CancellationToken) {
    let mut current: Option<Arc<ServiceSet>> = None;
    let mut stored = true;
    loop {
        if let Some(set) = current.as_ref().filter(|_| !stored) {
            match catalog.set_service_attributes(ServiceSet::clone(set)).await {
                Ok(version) => {
                    tracing::debug!(services = set.len(), seq = version.seq, "Service attributes applied");
                    stored = true;
                }
                Err(status) => {
                    tracing::error!(error = %status.message(), "storing Service attributes failed; retrying")
                }
            }
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            next = services.next() => match next {
                Some(set) => (current, stored) = (Some(set), false),
                None => return,
            },
            () = tokio::time::sleep(RETRY), if !stored => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn service(name: &str, spec: serde_json::Value) -> Service {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": "shop"}, "spec": spec
        }))
        .unwrap()
    }

    fn of(spec: serde_json::Value) -> KubernetesService {
        attributes(service("x", spec).spec.as_ref())
    }

    #[test]
    fn attributes_carry_cluster_ips_and_traffic_distribution() {
        let dual = of(
            serde_json::json!({"clusterIP": "10.96.0.7", "clusterIPs": ["10.96.0.7", "fd00::7"],
            "trafficDistribution": "PreferSameNode"}),
        );
        assert_eq!(dual.cluster_ips, ["10.96.0.7", "fd00::7"]);
        assert_eq!(dual.traffic_distribution, TrafficDistribution::PreferSameNode as i32);
        let old = of(serde_json::json!({"clusterIP": "10.96.0.8", "trafficDistribution": "PreferClose"}));
        assert_eq!(old.cluster_ips, ["10.96.0.8"], "clusterIP without clusterIPs");
        assert_eq!(old.traffic_distribution, TrafficDistribution::PreferSameZone as i32);
        let zone = of(serde_json::json!({"clusterIPs": ["10.96.0.9"], "trafficDistribution": "PreferSameZone"}));
        assert_eq!(zone.traffic_distribution, TrafficDistribution::PreferSameZone as i32);
        let headless = of(serde_json::json!({"clusterIP": "None", "clusterIPs": ["None"],
            "trafficDistribution": "SomethingNew"}));
        assert_eq!(headless, KubernetesService::default());
        assert_eq!(attributes(None), KubernetesService::default());
    }

    #[test]
    fn ports_carry_their_targets() {
        let service = of(serde_json::json!({"clusterIPs": ["10.96.0.7"], "ports": [
            {"name": "http", "port": 80, "targetPort": 8080, "appProtocol": "http"},
            {"name": "grpc", "port": 7070, "targetPort": "grpc-port"},
            {"name": "metrics", "port": 9090},
            {"name": "quoted", "port": 81, "targetPort": "8081"},
            {"name": "bad", "port": 0, "targetPort": 1},
        ]}));
        let port = |name: &str, port, target_port, target_port_name: &str, app_protocol: &str| ServicePort {
            name: name.into(),
            port,
            target_port,
            target_port_name: target_port_name.into(),
            app_protocol: app_protocol.into(),
        };
        assert_eq!(
            service.ports,
            [
                port("http", 80, 8080, "", "http"),
                port("grpc", 7070, 0, "grpc-port", ""),
                port("metrics", 9090, 9090, "", ""),
                port("quoted", 81, 8081, "", ""),
            ]
        );
    }

    #[test]
    fn a_set_changes_only_with_attributes() {
        let mut collected = Collected::default();
        let a = service("a", serde_json::json!({"clusterIPs": ["10.96.0.1"]}));
        collected.apply(Event::Init);
        assert!(!collected.apply(Event::InitApply(a.clone())));
        assert!(collected.apply(Event::InitDone), "the first list is news");
        assert_eq!(collected.set.len(), 1);
        assert!(
            !collected.apply(Event::Apply(a.clone())),
            "same attributes (e.g. a status write)"
        );
        let mut moved = a.clone();
        moved.spec.as_mut().unwrap().traffic_distribution = Some("PreferSameNode".into());
        assert!(collected.apply(Event::Apply(moved)));
        collected.apply(Event::Init);
        assert!(collected.apply(Event::InitDone), "a relist without it removes it");
        assert!(collected.set.is_empty());
        assert!(!collected.apply(Event::Delete(a)));
    }
}
