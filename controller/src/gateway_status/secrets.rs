//! The Secrets the edge's HTTPS listeners name in `tls.certificateRefs`, read one by one:
//! the controller may only `get` Secrets (it neither lists nor watches them), so it reads
//! exactly the ones a Gateway of the edge's class names, when that Gateway changes and
//! every refresh period (a Secret fixed later is seen then). A reference to another
//! namespace is read only when a ReferenceGrant there lets the Gateway use it (the
//! projector would refuse it anyway, so nothing more is read than could count).
//!
//! Only a Secret's type and its `tls.crt` and `tls.key` are kept. Nothing of a Secret's
//! content is ever logged: a failed read names the Secret and the server's answer.

use std::collections::{BTreeMap, BTreeSet};

use aether_api::edge::{CERT_KEY, CONTROLLER_NAME, KEY_KEY};
use aether_api::gateway::{GROUP, ProtocolType, ReferenceGrant, TlsMode};
use aether_api::route::DEFAULT_NAMESPACE;
use aether_common::quote::quote;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::{Api, Client};

use super::objects::Objects;

/// `(namespace, name)` of a Secret.
pub type SecretKey = (String, String);

/// What one Gateway of the edge's class needs read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Wanted {
    /// The Gateway's uid and generation: its Secrets are read again when they move.
    pub spec: (Option<String>, Option<i64>),
    pub secrets: BTreeSet<SecretKey>,
}

/// The Secrets each Gateway of the edge's class names (by `<namespace>/<name>`).
pub fn wanted(objects: &Objects) -> BTreeMap<String, Wanted> {
    let grants: Vec<&ReferenceGrant> = objects.grants.values().collect();
    let ours =
        |name: &str| (objects.classes.get(name)).is_some_and(|class| class.spec.controller_name == CONTROLLER_NAME);
    (objects.gateways.iter())
        .filter(|(_, gateway)| ours(&gateway.spec.gateway_class_name))
        .map(|(key, gateway)| {
            let namespace = gateway.metadata.namespace.as_deref().unwrap_or(DEFAULT_NAMESPACE);
            let terminated = (gateway.spec.listeners.iter())
                .filter(|l| l.protocol == ProtocolType::Https)
                .filter_map(|l| l.tls.as_ref())
                .filter(|tls| tls.mode == TlsMode::Terminate);
            let secrets = terminated
                .flat_map(|tls| tls.certificate_refs.iter())
                .filter(|r| is_core(&r.group) && r.kind == "Secret")
                .map(|r| {
                    (
                        r.namespace.clone().unwrap_or_else(|| namespace.to_owned()),
                        r.name.clone(),
                    )
                })
                .filter(|(secret_namespace, name)| {
                    secret_namespace == namespace || granted(&grants, secret_namespace, namespace, name)
                })
                .collect();
            let spec = (gateway.metadata.uid.clone(), gateway.metadata.generation);
            (key.clone(), Wanted { spec, secrets })
        })
        .collect()
}

fn is_core(group: &str) -> bool {
    group.is_empty() || group == "core"
}

/// Whether a ReferenceGrant in `namespace` lets Gateways of `from` use the Secret `name`
/// (the rule the projector applies, restated only to decide what to read).
fn granted(grants: &[&ReferenceGrant], namespace: &str, from: &str, name: &str) -> bool {
    (grants.iter())
        .filter(|g| g.metadata.namespace.as_deref().unwrap_or(DEFAULT_NAMESPACE) == namespace)
        .any(|g| {
            let from = (g.spec.from.iter()).any(|f| f.group == GROUP && f.kind == "Gateway" && f.namespace == from);
            let to = (g.spec.to.iter())
                .any(|t| is_core(&t.group) && t.kind == "Secret" && t.name.as_deref().is_none_or(|n| n == name));
            from && to
        })
}

/// The Secrets read, and what is remembered between reads.
pub struct Secrets {
    client: Client,
    /// Read and found (type and the two keys only).
    found: BTreeMap<SecretKey, Secret>,
    /// Read and not found.
    missing: BTreeSet<SecretKey>,
    /// The spec of each Gateway when its Secrets were last read.
    read_for: BTreeMap<String, (Option<String>, Option<i64>)>,
    /// The last failure per Secret, said once until it changes or clears.
    failing: BTreeMap<SecretKey, String>,
}

impl Secrets {
    pub fn new(client: Client) -> Secrets {
        Secrets {
            client,
            found: BTreeMap::new(),
            missing: BTreeSet::new(),
            read_for: BTreeMap::new(),
            failing: BTreeMap::new(),
        }
    }

    /// The Secrets found, as the projector takes them.
    pub fn found(&self) -> &BTreeMap<SecretKey, Secret> {
        &self.found
    }

    fn known(&self, key: &SecretKey) -> bool {
        self.found.contains_key(key) || self.missing.contains(key)
    }

    /// Reads what `wanted` needs: every Secret when `refresh`, else those of Gateways
    /// whose spec moved and those never read. Forgets Secrets no Gateway names. Returns
    /// the Gateways one of whose Secrets is unknown (its read failed and none succeeded
    /// before): their status waits.
    pub async fn update(&mut self, wanted: &BTreeMap<String, Wanted>, refresh: bool) -> BTreeSet<String> {
        let mut reads: BTreeSet<&SecretKey> = BTreeSet::new();
        for (gateway, w) in wanted {
            let moved = self.read_for.get(gateway) != Some(&w.spec);
            reads.extend(w.secrets.iter().filter(|s| refresh || moved || !self.known(s)));
        }
        for key in reads {
            self.read(key).await;
        }
        let named: BTreeSet<&SecretKey> = wanted.values().flat_map(|w| &w.secrets).collect();
        self.found.retain(|key, _| named.contains(key));
        self.missing.retain(|key| named.contains(key));
        self.failing.retain(|key, _| named.contains(key));
        self.read_for = (wanted.iter())
            .map(|(gateway, w)| (gateway.clone(), w.spec.clone()))
            .collect();
        (wanted.iter())
            .filter(|(_, w)| w.secrets.iter().any(|s| !self.known(s)))
            .map(|(gateway, _)| gateway.clone())
            .collect()
    }

    async fn read(&mut self, key: &SecretKey) {
        let (namespace, name) = key;
        let api = Api::<Secret>::namespaced(self.client.clone(), namespace);
        match api.get_opt(name).await {
            Ok(secret) => {
                if self.failing.remove(key).is_some() {
                    tracing::info!(secret = %quote(&format!("{namespace}/{name}")), "Gateway API status: the Secret is read again");
                }
                match secret {
                    Some(secret) => {
                        self.missing.remove(key);
                        self.found.insert(key.clone(), kept(secret));
                    }
                    None => {
                        self.found.remove(key);
                        self.missing.insert(key.clone());
                    }
                }
            }
            Err(error) => {
                let text = describe(&error);
                if self.failing.get(key) != Some(&text) {
                    tracing::warn!(secret = %quote(&format!("{namespace}/{name}")), error = %text,
                        "Gateway API status: a certificateRef's Secret cannot be read (is the controller allowed to \
                         get Secrets?); its Gateway's status waits; retrying");
                    self.failing.insert(key.clone(), text);
                }
            }
        }
    }
}

/// What is kept of a Secret: its name, type, `tls.crt` and `tls.key`.
fn kept(secret: Secret) -> Secret {
    let data = secret.data.map(|data| {
        data.into_iter()
            .filter(|(k, _)| k == CERT_KEY || k == KEY_KEY)
            .collect()
    });
    Secret {
        metadata: ObjectMeta {
            name: secret.metadata.name,
            namespace: secret.metadata.namespace,
            ..ObjectMeta::default()
        },
        type_: secret.type_,
        data,
        ..Secret::default()
    }
}

/// A failed read, said without anything of the body (a decoding error could quote it).
fn describe(error: &kube::Error) -> String {
    match error {
        kube::Error::Api(status) => format!("{} {}: {}", status.code, status.reason, status.message),
        kube::Error::SerdeError(_) => "the answer could not be decoded".to_owned(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::gateway_status::objects::Watched;

    fn objects(grant_to: Option<&str>) -> Objects {
        let mut objects = Objects::default();
        let class: aether_api::gateway::GatewayClass =
            serde_json::from_value(json!({"metadata": {"name": "edge"}, "spec": {"controllerName": CONTROLLER_NAME}}))
                .unwrap();
        class.store(&mut objects);
        let https = |name: &str, refs: serde_json::Value| json!({"name": name, "port": 443, "protocol": "HTTPS", "tls": {"certificateRefs": refs}});
        let gateway: aether_api::gateway::Gateway = serde_json::from_value(json!({
            "metadata": {"name": "web", "namespace": "edge", "uid": "u1", "generation": 2},
            "spec": {"gatewayClassName": "edge", "listeners": [
                https("a", json!([{"name": "own"}, {"name": "theirs", "namespace": "certs"}])),
                https("b", json!([{"group": "example.io", "kind": "Vault", "name": "x"}])),
                {"name": "tls", "port": 8443, "protocol": "TLS", "tls": {"mode": "Passthrough",
                    "certificateRefs": [{"name": "never"}]}},
            ]},
        }))
        .unwrap();
        gateway.store(&mut objects);
        let other: aether_api::gateway::Gateway = serde_json::from_value(json!({
            "metadata": {"name": "other", "namespace": "edge"},
            "spec": {"gatewayClassName": "someone-else", "listeners": [https("a", json!([{"name": "not-ours"}]))]},
        }))
        .unwrap();
        other.store(&mut objects);
        if let Some(to) = grant_to {
            let grant: ReferenceGrant = serde_json::from_value(json!({
                "metadata": {"name": "g", "namespace": "certs"},
                "spec": {"from": [{"group": GROUP, "kind": "Gateway", "namespace": "edge"}],
                         "to": [{"group": "", "kind": "Secret", "name": to}]},
            }))
            .unwrap();
            grant.store(&mut objects);
        }
        objects
    }

    #[test]
    fn only_the_secrets_a_gateway_of_ours_may_use_are_read() {
        let names = |objects: &Objects| -> Vec<SecretKey> {
            let wanted = wanted(objects);
            assert_eq!(
                wanted.keys().collect::<Vec<_>>(),
                ["edge/web"],
                "not another class's Gateway"
            );
            assert_eq!(wanted["edge/web"].spec, (Some("u1".to_owned()), Some(2)));
            wanted["edge/web"].secrets.iter().cloned().collect()
        };
        let own = ("edge".to_owned(), "own".to_owned());
        let theirs = ("certs".to_owned(), "theirs".to_owned());
        let only_own = std::slice::from_ref(&own);
        assert_eq!(names(&objects(None)), only_own, "no grant: not read");
        assert_eq!(names(&objects(Some("other"))), only_own, "a grant of another Secret");
        assert_eq!(names(&objects(Some("theirs"))), [theirs, own]);
    }

    #[test]
    fn only_the_certificate_and_key_are_kept() {
        let secret: Secret = serde_json::from_value(json!({
            "metadata": {"name": "c", "namespace": "edge", "annotations": {"a": "b"}},
            "type": "kubernetes.io/tls",
            "data": {"tls.crt": "Yw==", "tls.key": "aw==", "ca.crt": "eA==", "password": "cA=="},
        }))
        .unwrap();
        let kept = kept(secret);
        let keys: Vec<&String> = kept.data.as_ref().unwrap().keys().collect();
        assert_eq!(keys, ["tls.crt", "tls.key"]);
        assert_eq!(kept.metadata.annotations, None);
        assert_eq!(kept.type_.as_deref(), Some("kubernetes.io/tls"));
    }
}
