//! The statuses the objects should have, from the one projector
//! (`aether_api::edge::project`), compared with those they have: only the differences
//! become writes. Pure.
//!
//! - A GatewayClass naming [`CONTROLLER_NAME`]: `status.conditions` (Accepted).
//! - A Gateway of such a class: `status.conditions` (Accepted, Programmed),
//!   `status.listeners[]` and `status.addresses` (from the Gateway's own Service).
//! - A route: this controller's `status.parents[]` entries, one per parentRef naming such
//!   a Gateway; entries of ours for parents it no longer names (or that are no longer
//!   the edge's) go; other controllers' entries are never touched.
//!
//! A condition whose status did not change keeps its `lastTransitionTime`.

use std::collections::{BTreeMap, BTreeSet};

use aether_api::edge::{CONTROLLER_NAME, EdgeInputs, ListenerStatus, project};
use aether_api::gateway::{
    GROUP, Gateway, GatewayAddress, GatewayClass, GatewaySpec, GatewayStatus, RouteParentStatus,
};
use aether_api::route::RouteObject;
use aether_api::status::merge_parent_status;
use k8s_openapi::api::core::v1::{Secret, Service};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use serde_json::{Value, json};

use super::objects::Objects;
use super::secrets::SecretKey;

/// The label on the Service of a Gateway's edge, naming the Gateway.
pub const GATEWAY_NAME_LABEL: &str = "gateway.networking.k8s.io/gateway-name";
/// The label on the Service of a Gateway's edge created in the edges' own namespace (the
/// chart's), naming the Gateway's namespace.
pub const GATEWAY_NAMESPACE_LABEL: &str = "aether.io/gateway-namespace";

/// The object a write is for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    Class(String),
    Gateway {
        namespace: String,
        name: String,
    },
    Route {
        kind: RouteKind,
        namespace: String,
        name: String,
    },
}

/// The route kinds, as their APIs name them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RouteKind {
    Http,
    Grpc,
    Tcp,
    Tls,
}

impl Target {
    /// `<Kind> <namespace>/<name>`, for logs and for remembering writes.
    pub fn key(&self) -> String {
        match self {
            Target::Class(name) => format!("GatewayClass {name}"),
            Target::Gateway { namespace, name } => format!("Gateway {namespace}/{name}"),
            Target::Route { kind, namespace, name } => format!("{kind:?}Route {namespace}/{name}"),
        }
    }
}

/// One status to write: the object, the resourceVersion it was computed from (the
/// write's precondition), and the `status` fields to merge.
#[derive(Clone, Debug, PartialEq)]
pub struct Write {
    pub target: Target,
    pub resource_version: String,
    pub status: Value,
}

fn ours(class: &GatewayClass) -> bool {
    class.spec.controller_name == CONTROLLER_NAME
}

/// Every status that differs from what its object holds, at `now`. `held`: Gateways
/// whose Secrets are unknown (their own status is not written; their routes' entries
/// do not depend on Secrets and are). `edges_namespace`: where the edges' Services may
/// also be ([`addresses`]).
pub fn writes(
    objects: &Objects,
    secrets: &BTreeMap<SecretKey, Secret>,
    held: &BTreeSet<String>,
    edges_namespace: &str,
    now: &Time,
) -> Vec<Write> {
    let mut writes = class_writes(objects, now);
    let entries = gateway_writes(objects, secrets, held, edges_namespace, now, &mut writes);
    writes.extend(route_writes(objects, entries));
    writes
}

/// Our GatewayClasses whose conditions changed.
fn class_writes(objects: &Objects, now: &Time) -> Vec<Write> {
    let mut writes = Vec::new();
    let no_labels = BTreeMap::new();
    let no_secrets = BTreeMap::new();
    for class in objects.classes.values().filter(|c| ours(c)) {
        // The projector judges a class through a Gateway naming it: one with no listeners
        // asks nothing else of it.
        let probe = Gateway {
            spec: GatewaySpec {
                gateway_class_name: class.metadata.name.clone().unwrap_or_default(),
                ..GatewaySpec::default()
            },
            ..Gateway::default()
        };
        let inputs = EdgeInputs {
            class: Some(class),
            gateway: &probe,
            routes: &[],
            grants: &[],
            namespace_labels: &no_labels,
            secrets: &no_secrets,
            service_exists: &|_| false,
        };
        let Some(mut conditions) = project(&inputs, now).status.class else {
            continue;
        };
        let current = class.status.as_ref().map_or(&[][..], |s| &s.conditions[..]);
        keep_times(&mut conditions, current);
        if conditions != current {
            writes.push(Write {
                target: Target::Class(class.metadata.name.clone().unwrap_or_default()),
                resource_version: class.metadata.resource_version.clone().unwrap_or_default(),
                status: json!({"conditions": conditions}),
            });
        }
    }
    writes
}

/// The writes of our Gateways whose status changed (none for a `held` one), added to
/// `writes`; returns each route's parent entries the projections computed, by route key.
fn gateway_writes(
    objects: &Objects,
    secrets: &BTreeMap<SecretKey, Secret>,
    held: &BTreeSet<String>,
    edges_namespace: &str,
    now: &Time,
    writes: &mut Vec<Write>,
) -> BTreeMap<String, Vec<RouteParentStatus>> {
    let routes: Vec<RouteObject> = (objects.routes.values())
        .filter(|r| r.parent_refs().iter().any(|p| p.group == GROUP && p.kind == "Gateway"))
        .cloned()
        .collect();
    let grants: Vec<_> = objects.grants.values().cloned().collect();
    let service_exists = |service: &str| objects.services.contains_key(service);
    let mut entries: BTreeMap<String, Vec<RouteParentStatus>> = BTreeMap::new();
    for (gateway_key, gateway) in &objects.gateways {
        let class = objects.classes.get(&gateway.spec.gateway_class_name);
        if !class.is_some_and(ours) {
            continue;
        }
        let inputs = EdgeInputs {
            class,
            gateway,
            routes: &routes,
            grants: &grants,
            namespace_labels: &objects.namespace_labels,
            secrets,
            service_exists: &service_exists,
        };
        let edge = project(&inputs, now);
        for (route, entry) in edge.status.routes {
            entries.entry(route).or_default().push(entry);
        }
        if held.contains(gateway_key) {
            continue;
        }
        let current = gateway.status.clone().unwrap_or_default();
        let status = gateway_status(
            &current,
            edge.status.gateway,
            edge.status.listeners,
            addresses(gateway, objects, edges_namespace),
        );
        if status != current {
            writes.push(Write {
                target: Target::Gateway {
                    namespace: gateway.metadata.namespace.clone().unwrap_or_default(),
                    name: gateway.metadata.name.clone().unwrap_or_default(),
                },
                resource_version: gateway.metadata.resource_version.clone().unwrap_or_default(),
                status: json!({
                    "conditions": status.conditions,
                    "listeners": status.listeners,
                    "addresses": status.addresses,
                }),
            });
        }
    }
    entries
}

/// The routes whose parent entries of ours differ from `entries` (ours stale or new).
fn route_writes(objects: &Objects, mut entries: BTreeMap<String, Vec<RouteParentStatus>>) -> Vec<Write> {
    let mut writes = Vec::new();
    for (route_key, route) in &objects.routes {
        let current = parents(route);
        let wanted = entries.remove(route_key).unwrap_or_default();
        let desired = route_parents(current, wanted);
        if desired != current {
            let (kind, namespace, name) = (route_kind(route), route.namespace(), route.name());
            writes.push(Write {
                target: Target::Route {
                    kind,
                    namespace: namespace.to_owned(),
                    name: name.to_owned(),
                },
                resource_version: route.metadata().resource_version.clone().unwrap_or_default(),
                status: json!({"parents": desired}),
            });
        }
    }
    writes
}

/// The Gateway's status: the projector's conditions and listeners (times kept where a
/// status did not change) and `addresses`.
fn gateway_status(
    current: &GatewayStatus,
    mut conditions: Vec<Condition>,
    mut listeners: Vec<ListenerStatus>,
    addresses: Vec<GatewayAddress>,
) -> GatewayStatus {
    keep_times(&mut conditions, &current.conditions);
    for listener in &mut listeners {
        if let Some(previous) = current.listeners.iter().find(|l| l.name == listener.name) {
            keep_times(&mut listener.conditions, &previous.conditions);
        }
    }
    GatewayStatus {
        addresses,
        conditions,
        listeners,
    }
}

/// Keeps the `lastTransitionTime` of each condition whose status is what `previous` says.
pub fn keep_times(conditions: &mut [Condition], previous: &[Condition]) {
    for condition in conditions {
        let same = previous
            .iter()
            .find(|p| p.type_ == condition.type_ && p.status == condition.status);
        if let Some(previous) = same {
            condition.last_transition_time = previous.last_transition_time.clone();
        }
    }
}

/// `current` with this controller's entries replaced by `wanted` (times kept where a
/// condition's status did not change); everyone else's entries as they are.
pub fn route_parents(current: &[RouteParentStatus], wanted: Vec<RouteParentStatus>) -> Vec<RouteParentStatus> {
    let is_ours = |p: &RouteParentStatus| p.controller_name == CONTROLLER_NAME;
    let mut parents: Vec<RouteParentStatus> = (current.iter())
        .filter(|p| !is_ours(p) || wanted.iter().any(|w| w.parent_ref == p.parent_ref))
        .cloned()
        .collect();
    for mut entry in wanted {
        let previous = (current.iter()).find(|p| is_ours(p) && p.parent_ref == entry.parent_ref);
        if let Some(previous) = previous {
            keep_times(&mut entry.conditions, &previous.conditions);
        }
        merge_parent_status(&mut parents, entry);
    }
    parents
}

fn parents(route: &RouteObject) -> &[RouteParentStatus] {
    let status = match route {
        RouteObject::Http(r) => r.status.as_ref(),
        RouteObject::Grpc(r) => r.status.as_ref(),
        RouteObject::Tcp(r) => r.status.as_ref(),
        RouteObject::Tls(r) => r.status.as_ref(),
    };
    status.map_or(&[], |s| &s.parents)
}

fn route_kind(route: &RouteObject) -> RouteKind {
    match route {
        RouteObject::Http(_) => RouteKind::Http,
        RouteObject::Grpc(_) => RouteKind::Grpc,
        RouteObject::Tcp(_) => RouteKind::Tcp,
        RouteObject::Tls(_) => RouteKind::Tls,
    }
}

/// The addresses of the Gateway's own Service: its load balancer's IPs and hostnames,
/// else its clusterIP; none without a Service. Its Service is labelled
/// [`GATEWAY_NAME_LABEL`] with the Gateway's name and is either in the Gateway's
/// namespace or in `edges_namespace` (the controller's, where the chart creates the
/// edges) labelled [`GATEWAY_NAMESPACE_LABEL`] with the Gateway's namespace: no other
/// namespace can claim a Gateway's addresses. The first by namespace and name if several.
pub fn addresses(gateway: &Gateway, objects: &Objects, edges_namespace: &str) -> Vec<GatewayAddress> {
    let namespace = gateway.metadata.namespace.as_deref().unwrap_or_default();
    let name = gateway.metadata.name.as_deref().unwrap_or_default();
    let serves = |service: &&Service| {
        let labels = service.metadata.labels.as_ref();
        let label = |key: &str| labels.and_then(|labels| labels.get(key)).map(String::as_str);
        let at = service.metadata.namespace.as_deref().unwrap_or_default();
        label(GATEWAY_NAME_LABEL) == Some(name)
            && match label(GATEWAY_NAMESPACE_LABEL) {
                None => at == namespace,
                Some(label) => label == namespace && (at == namespace || at == edges_namespace),
            }
    };
    let Some(service) = objects.services.values().find(serves) else {
        return Vec::new();
    };
    let address = |type_: &str, value: &str| GatewayAddress {
        type_: Some(type_.to_owned()),
        value: value.to_owned(),
    };
    let ingress = (service.status.as_ref())
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|lb| lb.ingress.as_ref());
    let mut addresses: Vec<GatewayAddress> = Vec::new();
    for entry in ingress.into_iter().flatten() {
        let found = match (entry.ip.as_deref(), entry.hostname.as_deref()) {
            (Some(ip), _) if !ip.is_empty() => address("IPAddress", ip),
            (_, Some(hostname)) if !hostname.is_empty() => address("Hostname", hostname),
            _ => continue,
        };
        if !addresses.contains(&found) {
            addresses.push(found);
        }
    }
    if addresses.is_empty() {
        let cluster_ip = service.spec.as_ref().and_then(|s| s.cluster_ip.as_deref());
        if let Some(ip) = cluster_ip.filter(|ip| !ip.is_empty() && *ip != "None") {
            addresses.push(address("IPAddress", ip));
        }
    }
    addresses
}

#[cfg(test)]
mod tests {
    use k8s_openapi::jiff::Timestamp;

    use super::*;
    use crate::gateway_status::objects::Watched;

    fn at(second: i64) -> Time {
        Time(Timestamp::from_second(second).unwrap())
    }

    fn condition(type_: &str, status: &str, second: i64) -> Condition {
        Condition {
            type_: type_.to_owned(),
            status: status.to_owned(),
            reason: type_.to_owned(),
            message: String::new(),
            observed_generation: Some(1),
            last_transition_time: at(second),
        }
    }

    fn entry(controller: &str, gateway: &str, accepted: &str, second: i64) -> RouteParentStatus {
        RouteParentStatus {
            parent_ref: serde_json::from_value(json!({"name": gateway})).unwrap(),
            controller_name: controller.to_owned(),
            conditions: vec![condition("Accepted", accepted, second)],
        }
    }

    #[test]
    fn a_condition_keeps_its_time_until_its_status_changes() {
        let previous = [condition("Accepted", "True", 10), condition("Programmed", "False", 10)];
        let mut now = vec![condition("Accepted", "True", 50), condition("Programmed", "True", 50)];
        keep_times(&mut now, &previous);
        assert_eq!(now[0].last_transition_time, at(10));
        assert_eq!(now[1].last_transition_time, at(50));
    }

    #[test]
    fn our_route_entries_are_merged_beside_theirs_and_stale_ones_go() {
        let theirs = entry("aether.io/mesh", "web", "True", 1);
        let current = vec![
            theirs.clone(),
            entry(CONTROLLER_NAME, "web", "True", 5),
            entry(CONTROLLER_NAME, "gone", "True", 5),
        ];
        let merged = route_parents(&current, vec![entry(CONTROLLER_NAME, "web", "True", 9)]);
        assert_eq!(
            merged,
            current[..2],
            "the stale entry goes; the time of an unchanged status stays"
        );
        let flipped = route_parents(&current, vec![entry(CONTROLLER_NAME, "web", "False", 9)]);
        assert_eq!(flipped[0], theirs);
        assert_eq!(flipped[1].conditions[0].last_transition_time, at(9));
        let alone = std::slice::from_ref(&theirs);
        assert_eq!(route_parents(alone, Vec::new()), alone);
    }

    #[test]
    fn addresses_come_from_the_gateways_own_service() {
        let gateway: Gateway =
            serde_json::from_value(json!({"metadata": {"name": "web", "namespace": "edge"}})).unwrap();
        let service = |name: &str, namespace: &str, gateway: &str, status: Value| -> Service {
            serde_json::from_value(json!({
                "metadata": {"name": name, "namespace": namespace, "labels": {GATEWAY_NAME_LABEL: gateway}},
                "spec": {"clusterIP": "10.96.0.7"},
                "status": status,
            }))
            .unwrap()
        };
        let mut objects = Objects::default();
        let values = |objects: &Objects| -> Vec<(Option<String>, String)> {
            let found = addresses(&gateway, objects, "aether-system");
            found.into_iter().map(|a| (a.type_, a.value)).collect()
        };
        assert_eq!(values(&objects), [], "no Service: none");
        service("web", "other", "web", json!({})).store(&mut objects);
        service("api", "edge", "api", json!({})).store(&mut objects);
        let mut claim = service("web-claim", "other", "web", json!({}));
        let labels = claim.metadata.labels.as_mut().unwrap();
        labels.insert(GATEWAY_NAMESPACE_LABEL.into(), "edge".into());
        claim.clone().store(&mut objects);
        assert_eq!(
            values(&objects),
            [],
            "not its Service; another namespace cannot claim it"
        );

        // The chart's layout: the edge's Service in the edges' namespace, naming the Gateway's.
        claim.metadata.namespace = Some("aether-system".into());
        claim.spec.as_mut().unwrap().cluster_ip = Some("10.96.0.99".into());
        claim.store(&mut objects);
        assert_eq!(values(&objects), [(Some("IPAddress".into()), "10.96.0.99".into())]);
        objects.services.clear();
        service("web-edge", "edge", "web", json!({})).store(&mut objects);
        assert_eq!(values(&objects), [(Some("IPAddress".into()), "10.96.0.7".into())]);
        let balanced = json!({"loadBalancer": {"ingress": [{"ip": "203.0.113.9"}, {"hostname": "lb.example.com"}]}});
        service("web-edge", "edge", "web", balanced).store(&mut objects);
        assert_eq!(
            values(&objects),
            [
                (Some("IPAddress".into()), "203.0.113.9".into()),
                (Some("Hostname".into()), "lb.example.com".into())
            ]
        );
    }
}
