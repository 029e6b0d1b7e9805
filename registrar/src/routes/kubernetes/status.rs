//! Route status on Kubernetes: for each route object with Service parents, this
//! registrar's `status.parents[]` entries (controller `aether.io/mesh`, one per Service
//! parentRef) say whether the object is Accepted and its references resolved, at the
//! generation they were computed for. A refused object says why (its condition False,
//! with the reason and the field); an accepted one whose backend Service is not in the
//! catalog says ResolvedRefs=False/BackendNotFound, re-checked as services come and go.
//!
//! Written through the status subresource, only when what the object holds differs, so
//! replicas and restarts agree without writing; other controllers' entries are kept.
//! A write carries the resourceVersion it was computed from: a concurrent change gets
//! 409 and is recomputed from the newer object. Failures are logged and retried.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use aether_api::gateway::{GrpcRoute, HttpRoute, ParentReference, RouteParentStatus, TcpRoute, TlsRoute};
use aether_api::route::is_service_parent;
use aether_api::service_ports::ServicePorts;
use aether_api::status::{CONTROLLER_NAME, merge_parent_status};
use aether_api::{RouteObject, mismatched_ports, parent_status, unresolved_backends};
use aether_common::quote::quote;
use aether_proto::registry::v1::Protocol;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use tokio_util::sync::CancellationToken;

use super::{ClusterRoutes, RouteSet, Watched};
use crate::catalog::{Catalog, State};

/// How often statuses are recomputed without a route change (backends come and go).
pub const RECHECK: Duration = Duration::from_secs(2);
/// The field manager of the registrar's status writes.
const FIELD_MANAGER: &str = "aether-registrar";

/// Keeps the status of the cluster's route objects current until `shutdown`.
pub async fn run(mut routes: ClusterRoutes, catalog: Catalog, client: Client, shutdown: CancellationToken) {
    let mut writer = Writer {
        client,
        written: HashMap::new(),
        failing: HashMap::new(),
    };
    let mut current: Option<Arc<RouteSet>> = None;
    loop {
        if let Some(set) = &current {
            writer.reconcile(set, &catalog).await;
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            next = routes.next() => match next {
                Some(set) => current = Some(set),
                None => return,
            },
            () = tokio::time::sleep(RECHECK) => {}
        }
    }
}

/// What the catalog says of the services a route names.
pub trait Services {
    /// Whether the catalog holds `service`.
    fn known(&self, service: &str) -> bool;
    /// What `service`'s (Gateway API) port carries, if its endpoints serve it.
    fn protocol_at(&self, service: &str, port: u32) -> Option<Protocol>;
}

impl Services for State {
    fn known(&self, service: &str) -> bool {
        self.service(service).is_some()
    }

    fn protocol_at(&self, service: &str, port: u32) -> Option<Protocol> {
        let entry = self.service(service)?;
        ServicePorts::of(&entry.service, entry.endpoints.values().map(|e| &**e)).protocol_at(port)
    }
}

/// The `status.parents` `watched` should have, or `None` when it has them already:
/// this controller's entry for each Service parentRef (entries for parents it no longer
/// names go), everyone else's entries untouched. `services` says which backends the
/// catalog holds and what the parents' ports carry; `now` stamps the conditions whose
/// status changes.
pub fn desired_parents(watched: &Watched, services: &impl Services, now: &Time) -> Option<Vec<RouteParentStatus>> {
    let object = &watched.object;
    let current = current_parents(object);
    let refusal = match &watched.outcome {
        Err(rejected) => Some(rejected.clone()),
        Ok(Some(route)) => mismatched_ports(route, |s, p| services.protocol_at(s, p))
            .and_then(|()| unresolved_backends(route, |s| services.known(s)))
            .err(),
        Ok(None) => None,
    };
    let generation = object.metadata().generation.unwrap_or(0);
    let service_parents: Vec<&ParentReference> = object.parent_refs().iter().filter(|p| is_service_parent(p)).collect();
    let ours = |p: &RouteParentStatus| p.controller_name == CONTROLLER_NAME;
    let mut parents: Vec<RouteParentStatus> = current
        .iter()
        .filter(|p| !ours(p) || service_parents.contains(&&p.parent_ref))
        .cloned()
        .collect();
    for parent in service_parents {
        let previous = current.iter().find(|p| ours(p) && p.parent_ref == *parent);
        let entry = parent_status(parent, refusal.as_ref(), generation, previous, now);
        merge_parent_status(&mut parents, entry);
    }
    (parents != current).then_some(parents)
}

fn current_parents(object: &RouteObject) -> &[RouteParentStatus] {
    let status = match object {
        RouteObject::Http(route) => route.status.as_ref(),
        RouteObject::Grpc(route) => route.status.as_ref(),
        RouteObject::Tcp(route) => route.status.as_ref(),
        RouteObject::Tls(route) => route.status.as_ref(),
    };
    status.map_or(&[], |s| &s.parents)
}

/// Patches the status subresource of a route of kind `K`.
async fn patch_status<K>(
    client: Client,
    namespace: &str,
    name: &str,
    params: &PatchParams,
    patch: &Patch<&serde_json::Value>,
) -> Result<(), kube::Error>
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    let api = Api::<K>::namespaced(client, namespace);
    api.patch_status(name, params, patch).await.map(drop)
}

struct Writer {
    client: Client,
    /// The resourceVersion each object had when its status was last written: until the
    /// watch brings the newer version, there is nothing to recompute.
    written: HashMap<String, String>,
    /// The last failure per object, logged once until it changes or clears.
    failing: HashMap<String, String>,
}

impl Writer {
    async fn reconcile(&mut self, set: &RouteSet, catalog: &Catalog) {
        let now = Time(Timestamp::now());
        let wanted: Vec<(&String, &Watched, Vec<RouteParentStatus>)> = {
            let state = catalog.read();
            set.objects
                .iter()
                .filter(|(key, w)| self.written.get(*key) != w.object.metadata().resource_version.as_ref())
                .filter_map(|(key, w)| Some((key, w, desired_parents(w, &*state, &now)?)))
                .collect()
        };
        self.written.retain(|key, _| set.objects.contains_key(key));
        self.failing.retain(|key, _| set.objects.contains_key(key));
        for (key, watched, parents) in wanted {
            self.write(key, &watched.object, &parents).await;
        }
    }

    async fn write(&mut self, key: &str, object: &RouteObject, parents: &[RouteParentStatus]) {
        let resource_version = object.metadata().resource_version.clone().unwrap_or_default();
        let patch = serde_json::json!({
            "metadata": {"resourceVersion": resource_version},
            "status": {"parents": parents},
        });
        let patch = Patch::Merge(&patch);
        let params = PatchParams {
            field_manager: Some(FIELD_MANAGER.to_owned()),
            ..PatchParams::default()
        };
        let (client, namespace, name) = (self.client.clone(), object.namespace(), object.name());
        let written = match object {
            RouteObject::Http(_) => patch_status::<HttpRoute>(client, namespace, name, &params, &patch).await,
            RouteObject::Grpc(_) => patch_status::<GrpcRoute>(client, namespace, name, &params, &patch).await,
            RouteObject::Tcp(_) => patch_status::<TcpRoute>(client, namespace, name, &params, &patch).await,
            RouteObject::Tls(_) => patch_status::<TlsRoute>(client, namespace, name, &params, &patch).await,
        };
        match written {
            Ok(()) => {
                tracing::debug!(route = %quote(key), "route status written");
                self.failing.remove(key);
                self.written.insert(key.to_owned(), resource_version);
            }
            // Changed (or gone) since it was read: the watch brings the newer version.
            Err(kube::Error::Api(status)) if matches!(status.code, 404 | 409) => {
                tracing::debug!(route = %quote(key), code = status.code, "route changed before its status was written");
            }
            Err(error) => {
                let text = error.to_string();
                if self.failing.get(key) != Some(&text) {
                    tracing::warn!(route = %quote(key), %error,
                        "writing the route's status failed (is the registrar allowed to patch its /status?); retrying");
                    self.failing.insert(key.to_owned(), text);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use aether_api::project;

    use super::*;

    fn watched(json: serde_json::Value) -> Watched {
        let object = RouteObject::Http(serde_json::from_value(json).unwrap());
        let outcome = project(&object);
        Watched { object, outcome }
    }

    fn route(path: &str, backend: &str, status: serde_json::Value) -> serde_json::Value {
        serde_json::json!({
            "metadata": {"name": "canary", "namespace": "shop", "generation": 3, "resourceVersion": "9"},
            "spec": {"parentRefs": [{"group": "", "kind": "Service", "name": "cart"},
                                    {"name": "edge"}],
                     "rules": [{"matches": [{"path": {"type": "RegularExpression", "value": path}}],
                                "backendRefs": [{"name": backend, "port": 8080}]}]},
            "status": status,
        })
    }

    /// A catalog that holds every backend (or none), whose ports all carry HTTP.
    struct Known(bool);

    impl Services for Known {
        fn known(&self, _: &str) -> bool {
            self.0
        }
        fn protocol_at(&self, _: &str, _: u32) -> Option<Protocol> {
            Some(Protocol::Http)
        }
    }

    fn conditions(parents: &[RouteParentStatus]) -> Vec<(&str, &str, &str)> {
        let ours = parents.iter().find(|p| p.controller_name == CONTROLLER_NAME).unwrap();
        ours.conditions
            .iter()
            .map(|c| (c.type_.as_str(), c.status.as_str(), c.reason.as_str()))
            .collect()
    }

    #[test]
    fn statuses_follow_the_projection_and_the_catalog_and_are_written_once() {
        let now = Time(Timestamp::from_second(100).unwrap());
        let theirs = serde_json::json!({"parents": [{"parentRef": {"name": "edge"}, "controllerName": "edge.io/gw",
            "conditions": []}]});
        let fresh = watched(route("^/a$", "cart-v2", theirs.clone()));
        let parents = desired_parents(&fresh, &Known(true), &now).unwrap();
        assert_eq!(
            parents.len(),
            2,
            "one entry for the Service parent; the Gateway's entry kept"
        );
        assert_eq!(parents[0].controller_name, "edge.io/gw");
        assert_eq!(
            conditions(&parents),
            [
                ("Accepted", "True", "Accepted"),
                ("ResolvedRefs", "True", "ResolvedRefs")
            ]
        );
        assert_eq!(parents[1].conditions[0].observed_generation, Some(3));

        // Written: nothing more to write.
        let status = serde_json::json!({"parents": parents});
        assert_eq!(
            desired_parents(&watched(route("^/a$", "cart-v2", status.clone())), &Known(true), &now),
            None
        );

        // The backend leaves the catalog.
        let unresolved =
            desired_parents(&watched(route("^/a$", "cart-v2", status.clone())), &Known(false), &now).unwrap();
        assert_eq!(conditions(&unresolved)[1], ("ResolvedRefs", "False", "BackendNotFound"));

        // An invalid edit: Accepted=False naming the field.
        let refused = desired_parents(&watched(route("^/a[$", "cart-v2", status)), &Known(true), &now).unwrap();
        assert_eq!(conditions(&refused)[0], ("Accepted", "False", "UnsupportedValue"));
        let ours = refused.iter().find(|p| p.controller_name == CONTROLLER_NAME).unwrap();
        assert!(
            ours.conditions[0]
                .message
                .starts_with("spec.rules[0].matches[0].path.value"),
            "{}",
            ours.conditions[0].message
        );
    }

    #[test]
    fn a_tcp_route_on_a_port_that_carries_http_is_not_accepted() {
        let now = Time(Timestamp::from_second(100).unwrap());
        let tcp = |port: Option<u32>| {
            let object = RouteObject::Tcp(
                serde_json::from_value(serde_json::json!({
                    "metadata": {"name": "split", "namespace": "shop", "generation": 1},
                    "spec": {"parentRefs": [{"group": "", "kind": "Service", "name": "cart", "port": port}],
                             "rules": [{"backendRefs": [{"name": "cart-v2", "port": 8080}]}]},
                }))
                .unwrap(),
            );
            let outcome = project(&object);
            Watched { object, outcome }
        };
        let refused = desired_parents(&tcp(Some(8080)), &Known(true), &now).unwrap();
        assert_eq!(conditions(&refused)[0], ("Accepted", "False", "UnsupportedValue"));
        let ours = refused.iter().find(|p| p.controller_name == CONTROLLER_NAME).unwrap();
        let message = &ours.conditions[0].message;
        assert!(
            message.contains("port 8080 of service \"shop/cart\" carries HTTP"),
            "{message}"
        );
        // Every port (none named): it shapes the TCP ones, whatever else the service serves.
        let every = tcp(None);
        let accepted = desired_parents(&every, &Known(true), &now).unwrap();
        assert_eq!(conditions(&accepted)[0], ("Accepted", "True", "Accepted"));
    }
}
