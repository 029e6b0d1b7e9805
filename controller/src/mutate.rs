//! The mutating pod webhook: a new pod in a mesh namespace joins the mesh.
//!
//! Which namespaces: the webhook configuration's `namespaceSelector`
//! (`aether.io/mesh: enabled`), so kube-apiserver sends only their pods here and this
//! code never looks a namespace up. For each new pod (CREATE), as a JSON Patch:
//! - the label `aether.io/managed: "true"` — unless the pod opts out with the annotation
//!   `config.aether.io/mesh: disabled`, or already carries the label (whatever its value:
//!   the owner decided);
//! - DNS: the search domains `<ns>.<meshDomain>` and `<meshDomain>` appended, so `backend`
//!   and `backend.<ns>` resolve to mesh names too (after the cluster's own suffixes); the
//!   mesh domain is the mesh-wide MeshConfig's when it sets one (`crate::mesh_domain`), and
//!   the new one for new pods when it changes; and
//!   `ndots: 3` unless the pod sets ndots itself, so a full mesh name (`svc.ns.domain`,
//!   three dots) is asked as written before any search suffix. Not for host-network pods
//!   (the mesh does not capture them) nor for `dnsPolicy: None` (the pod owns its DNS).
//!
//! Applying the patch and asking again yields no patch: the mutation is idempotent.

use std::sync::Arc;

use serde_json::{Value, json};
use tokio::sync::watch;

use crate::admission::{Operation, Request, Verdict};

/// The label that puts a pod in the mesh.
pub const MANAGED_LABEL: &str = aether_common::pod_meta::MANAGED_LABEL;
/// A pod's opt-out: `config.aether.io/mesh: disabled`.
pub const OPT_OUT_ANNOTATION: &str = "config.aether.io/mesh";
/// The ndots a mesh pod gets unless it sets its own.
pub const NDOTS: &str = "3";

#[derive(Clone, Debug)]
pub struct Mutator {
    /// The mesh domain new pods search, as it is now.
    mesh_domain: watch::Receiver<Arc<str>>,
}

impl Mutator {
    pub fn new(mesh_domain: watch::Receiver<Arc<str>>) -> Self {
        Self { mesh_domain }
    }

    /// Always `mesh_domain`.
    pub fn fixed(mesh_domain: &str) -> Self {
        Self::new(watch::channel(mesh_domain.into()).1)
    }

    pub fn decide(&self, request: &Request) -> Verdict {
        let is_pod = request.kind.group.is_empty() && request.kind.kind == "Pod";
        let (true, Operation::Create, Some(pod)) = (is_pod, request.operation, &request.object) else {
            return Verdict::Allow;
        };
        let namespace = request
            .namespace
            .as_deref()
            .or_else(|| pod["metadata"]["namespace"].as_str())
            .unwrap_or("default");
        match self.patch(pod, namespace) {
            ops if ops.is_empty() => Verdict::Allow,
            ops => Verdict::Patch(ops),
        }
    }

    /// The JSON Patch that brings `pod` into the mesh (empty: nothing to do).
    pub fn patch(&self, pod: &Value, namespace: &str) -> Vec<Value> {
        let metadata = &pod["metadata"];
        if metadata["annotations"][OPT_OUT_ANNOTATION].as_str() == Some("disabled") {
            return Vec::new();
        }
        let mut ops = Vec::new();
        match metadata["labels"].as_object() {
            Some(labels) if labels.contains_key(MANAGED_LABEL) => {}
            Some(_) => ops.push(add(
                &format!("/metadata/labels/{}", escape(MANAGED_LABEL)),
                json!("true"),
            )),
            None => ops.push(add("/metadata/labels", json!({ MANAGED_LABEL: "true" }))),
        }
        let spec = &pod["spec"];
        if spec["hostNetwork"] != json!(true) && spec["dnsPolicy"] != json!("None") {
            let domain = self.mesh_domain.borrow().clone();
            let searches = [format!("{namespace}.{domain}"), domain.to_string()];
            ops.extend(dns(&spec["dnsConfig"], &searches));
        }
        ops
    }
}

/// What `spec.dnsConfig` lacks: the mesh's search domains and an ndots.
fn dns(config: &Value, searches: &[String]) -> Vec<Value> {
    let ndots = json!({ "name": "ndots", "value": NDOTS });
    let Some(config) = config.as_object() else {
        return vec![add(
            "/spec/dnsConfig",
            json!({ "searches": searches, "options": [ndots] }),
        )];
    };
    let mut ops = Vec::new();
    match config.get("searches").and_then(Value::as_array) {
        None => ops.push(add("/spec/dnsConfig/searches", json!(searches))),
        Some(present) => ops.extend(
            searches
                .iter()
                .filter(|s| !present.contains(&json!(s)))
                .map(|s| add("/spec/dnsConfig/searches/-", json!(s))),
        ),
    }
    match config.get("options").and_then(Value::as_array) {
        None => ops.push(add("/spec/dnsConfig/options", json!([ndots]))),
        Some(options) if options.iter().any(|o| o["name"] == "ndots") => {}
        Some(_) => ops.push(add("/spec/dnsConfig/options/-", ndots)),
    }
    ops
}

fn add(path: &str, value: Value) -> Value {
    json!({ "op": "add", "path": path, "value": value })
}

/// A JSON Pointer token (RFC 6901): `~` and `/` escaped.
fn escape(token: &str) -> String {
    token.replace('~', "~0").replace('/', "~1")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mutator() -> Mutator {
        Mutator::fixed("aether.internal")
    }

    /// Applies `add` operations (all the webhook emits), as kube-apiserver would.
    fn apply(doc: &mut Value, ops: &[Value]) {
        for op in ops {
            assert_eq!(op["op"], "add", "{op}");
            let path = op["path"].as_str().unwrap();
            let (parent, last) = path.rsplit_once('/').unwrap();
            let parent = doc
                .pointer_mut(parent)
                .unwrap_or_else(|| panic!("no parent for {path}"));
            let last = last.replace("~1", "/").replace("~0", "~");
            match parent {
                Value::Array(items) if last == "-" => items.push(op["value"].clone()),
                Value::Object(fields) => {
                    assert!(!fields.contains_key(&last), "add over an existing {path}");
                    fields.insert(last, op["value"].clone());
                }
                other => panic!("cannot add {path} into {other}"),
            }
        }
    }

    fn mutated(pod: &Value) -> Value {
        let ops = mutator().patch(pod, "shop");
        let mut out = pod.clone();
        apply(&mut out, &ops);
        assert_eq!(mutator().patch(&out, "shop"), Vec::<Value>::new(), "idempotent: {out}");
        out
    }

    #[test]
    fn a_bare_pod_is_labelled_and_gets_the_mesh_search_domains_and_ndots() {
        let out = mutated(&json!({"metadata": {"name": "web"}, "spec": {"containers": []}}));
        assert_eq!(out["metadata"]["labels"], json!({"aether.io/managed": "true"}));
        assert_eq!(
            out["spec"]["dnsConfig"],
            json!({"searches": ["shop.aether.internal", "aether.internal"], "options": [{"name": "ndots", "value": "3"}]})
        );
    }

    #[test]
    fn what_the_pod_already_has_is_kept_and_only_what_lacks_is_added() {
        let pod = json!({
            "metadata": {"labels": {"app": "web"}},
            "spec": {"dnsConfig": {"searches": ["aether.internal"], "options": [{"name": "ndots", "value": "2"}]}}
        });
        let out = mutated(&pod);
        assert_eq!(
            out["metadata"]["labels"],
            json!({"app": "web", "aether.io/managed": "true"})
        );
        assert_eq!(
            out["spec"]["dnsConfig"],
            json!({"searches": ["aether.internal", "shop.aether.internal"], "options": [{"name": "ndots", "value": "2"}]})
        );
        let out = mutated(&json!({"metadata": {}, "spec": {"dnsConfig": {"nameservers": ["1.1.1.1"]}}}));
        assert_eq!(
            out["spec"]["dnsConfig"]["searches"],
            json!(["shop.aether.internal", "aether.internal"])
        );
        let out = mutated(&json!({"metadata": {}, "spec": {"dnsConfig": {"options": [{"name": "edns0"}]}}}));
        assert_eq!(
            out["spec"]["dnsConfig"]["options"],
            json!([{"name": "edns0"}, {"name": "ndots", "value": "3"}])
        );
    }

    #[test]
    fn a_new_mesh_domain_is_what_the_next_pod_searches() {
        let (domain, follows) = watch::channel(Arc::<str>::from("aether.internal"));
        let mutator = Mutator::new(follows);
        let pod = json!({"metadata": {"labels": {"aether.io/managed": "true"}}, "spec": {}});
        let searches = |mutator: &Mutator| mutator.patch(&pod, "shop")[0]["value"]["searches"].clone();
        assert_eq!(searches(&mutator), json!(["shop.aether.internal", "aether.internal"]));
        domain.send_replace("corp.internal".into());
        assert_eq!(searches(&mutator), json!(["shop.corp.internal", "corp.internal"]));
    }

    #[test]
    fn opting_out_an_owner_set_label_host_network_and_dns_policy_none_are_respected() {
        let opted_out = json!({"metadata": {"annotations": {"config.aether.io/mesh": "disabled"}}, "spec": {}});
        assert_eq!(mutator().patch(&opted_out, "shop"), Vec::<Value>::new());
        let owned = json!({"metadata": {"labels": {"aether.io/managed": "false"}}, "spec": {"dnsPolicy": "None"}});
        assert_eq!(mutator().patch(&owned, "shop"), Vec::<Value>::new());
        let host = json!({"metadata": {"labels": {}}, "spec": {"hostNetwork": true}});
        let out = mutated(&host);
        assert_eq!(out["metadata"]["labels"], json!({"aether.io/managed": "true"}));
        assert!(out["spec"].get("dnsConfig").is_none(), "{out}");
    }
}
