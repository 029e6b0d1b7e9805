//! The node's mesh ClusterIPs in every captured pod's `mesh_cluster_ips` set.
//!
//! The services-only Watch (the one the DNS record file follows) carries every mesh
//! service, so the set holds the ClusterIPs of all of them, not only the node's
//! dependencies: a call by ClusterIP to an undeclared mesh service is captured and
//! goes through on demand like a call to its VIP. IPv4 only, as the capture listener.
//!
//! Cost: one set element per (captured pod, mesh ClusterIP) — kernel memory in the
//! order of 100 bytes each (100 pods × 5,000 mesh services ≈ 500,000 elements ≈ 50 MB),
//! and a change rewrites every pod's set, one `nft` transaction per pod.

use std::collections::BTreeSet;
use std::net::Ipv4Addr;
use std::path::Path;
use std::sync::Arc;

use aether_proto::view::CatalogView;
use parking_lot::RwLock;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::{CLUSTER_IP_SET, CaptureConfig, CaptureError, TABLE, nft};
use crate::catalog_watch::WatchedCatalog;
use crate::node::Node;

/// The node's current set, shared by every clone of a [`CaptureConfig`].
#[derive(Clone, Debug, Default)]
pub struct ClusterIps(Arc<RwLock<Arc<BTreeSet<Ipv4Addr>>>>);

impl ClusterIps {
    pub fn get(&self) -> Arc<BTreeSet<Ipv4Addr>> {
        self.0.read().clone()
    }

    /// Replaces the set; false if it was already this one.
    pub fn set(&self, ips: BTreeSet<Ipv4Addr>) -> bool {
        let mut current = self.0.write();
        if **current == ips {
            return false;
        }
        *current = Arc::new(ips);
        true
    }
}

/// Every mesh service's IPv4 ClusterIPs (what its Kubernetes Service has).
pub fn of(catalog: &CatalogView) -> BTreeSet<Ipv4Addr> {
    catalog
        .services
        .values()
        .filter_map(|service| service.kubernetes.as_ref())
        .flat_map(|kubernetes| &kubernetes.cluster_ips)
        .filter_map(|ip| ip.parse::<Ipv4Addr>().ok())
        .collect()
}

/// The `nft` lines that add `ips` to the set (nothing for none: nft refuses `{ }`).
pub fn render_elements(ips: &BTreeSet<Ipv4Addr>) -> String {
    if ips.is_empty() {
        return String::new();
    }
    let list: Vec<String> = ips.iter().map(Ipv4Addr::to_string).collect();
    format!("add element {TABLE} {CLUSTER_IP_SET} {{ {} }}\n", list.join(", "))
}

/// The set in `netns` becomes exactly `ips`, in one transaction (no moment without them).
pub async fn replace(config: &CaptureConfig, netns: &Path, ips: &BTreeSet<Ipv4Addr>) -> Result<(), CaptureError> {
    let transaction = format!("flush set {TABLE} {CLUSTER_IP_SET}\n{}", render_elements(ips));
    nft(config, netns, &["-f", "-"], Some(&transaction)).await.map(drop)
}

/// Follows the services-only views until `shutdown`: whenever the mesh's ClusterIPs
/// change, every captured local pod's set is replaced.
pub async fn sync(
    config: CaptureConfig,
    node: Node,
    mut views: watch::Receiver<Arc<WatchedCatalog>>,
    shutdown: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            changed = views.changed() => if changed.is_err() { return },
        }
        let ips = of(&views.borrow_and_update().catalog);
        if !config.cluster_ips.set(ips) {
            continue;
        }
        let ips = config.cluster_ips.get();
        tracing::info!(
            cluster_ips = ips.len(),
            "mesh ClusterIPs changed; updating captured pods"
        );
        for pod in node.pods() {
            if !matches!(super::desired(&config, &pod.container_id), Ok(Some(_))) {
                continue;
            }
            if let Err(error) = replace(&config, &pod.netns, &ips).await {
                tracing::warn!(pod = %pod.id(), %error, "updating the pod's mesh ClusterIPs failed");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use aether_proto::registry::v1::{KubernetesService, Service};

    #[test]
    fn the_set_holds_every_mesh_services_ipv4_cluster_ips() {
        let mut catalog = CatalogView::default();
        let service = |name: &str, ips: Option<&[&str]>| Service {
            namespace: "shop".into(),
            name: name.into(),
            vip: "240.240.0.1".into(),
            kubernetes: ips.map(|ips| KubernetesService {
                cluster_ips: ips.iter().map(|ip| (*ip).into()).collect(),
                traffic_distribution: 0,
                ports: Vec::new(),
            }),
            external: None,
        };
        catalog
            .services
            .insert("shop/a".into(), service("a", Some(&["10.96.0.10", "fd00::10"])));
        catalog
            .services
            .insert("shop/b".into(), service("b", Some(&["10.96.0.2"])));
        // Headless (no ClusterIP) and no Kubernetes Service at all.
        catalog.services.insert("shop/c".into(), service("c", Some(&[])));
        catalog.services.insert("shop/d".into(), service("d", None));
        let ips = of(&catalog);
        let expected: BTreeSet<Ipv4Addr> = ["10.96.0.2", "10.96.0.10"]
            .iter()
            .map(|ip| ip.parse().unwrap())
            .collect();
        assert_eq!(ips, expected);
        assert_eq!(
            render_elements(&ips),
            "add element inet aether mesh_cluster_ips { 10.96.0.2, 10.96.0.10 }\n"
        );
        assert_eq!(render_elements(&BTreeSet::new()), "");
        let shared = ClusterIps::default();
        let clone = shared.clone();
        assert!(shared.set(ips.clone()));
        assert!(!clone.set(ips.clone()), "clones share one set");
        assert_eq!(*clone.get(), ips);
    }
}
