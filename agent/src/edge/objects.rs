//! The Gateway API objects the edge builds from, and the directory source that reads
//! them from YAML files (`--config-dir`): GatewayClasses, Gateways, routes,
//! ReferenceGrants, Namespaces (their labels, for `allowedRoutes` selectors) and the
//! TLS Secrets listeners reference, side by side, many documents per file.
//!
//! A document that does not parse is logged with its file, document and field, and left
//! out; the others still count. The directory is read again when inotify says it
//! changed, and every [`POLL`] regardless.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use aether_api::gateway::{Gateway, GatewayClass, ReferenceGrant};
use aether_api::route::RouteObject;
use aether_api::yaml::{Document, documents, route_objects};
use aether_common::quote::{clip, quote};
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use serde_json::Value;
use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;

/// How often the directory is read without an inotify event.
pub const POLL: Duration = Duration::from_secs(2);

/// Every object the edge's projection reads.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Objects {
    /// By name.
    pub classes: BTreeMap<String, GatewayClass>,
    /// By `<namespace>/<name>`.
    pub gateways: BTreeMap<String, Gateway>,
    pub routes: Vec<RouteObject>,
    pub grants: Vec<ReferenceGrant>,
    /// Namespace name → its labels.
    pub namespace_labels: BTreeMap<String, BTreeMap<String, String>>,
    /// By (namespace, name).
    pub secrets: BTreeMap<(String, String), Secret>,
}

/// Why one document was left out: `<file> document <n>: <field>: <message>`.
pub type Problem = String;

impl Objects {
    /// Adds the objects of one file's documents; returns what was left out.
    pub fn add_documents(&mut self, file: &str, documents: &[Document]) -> Vec<Problem> {
        let mut problems = Vec::new();
        for parsed in route_objects(documents) {
            match parsed {
                Ok(route) => self.routes.push(route),
                Err(e) => problems.push(format!("{file} {e}")),
            }
        }
        for (i, document) in documents.iter().enumerate() {
            let Ok(value) = document else { continue };
            if let Err(message) = self.add(value) {
                problems.push(format!("{file} document {}: {message}", i + 1));
            }
        }
        problems
    }

    /// One document of a kind the edge reads (routes aside); other kinds are skipped.
    fn add(&mut self, value: &Value) -> Result<(), String> {
        let kind = value.get("kind").and_then(Value::as_str).unwrap_or_default();
        let api_version = value.get("apiVersion").and_then(Value::as_str).unwrap_or_default();
        let gateway_api = api_version.starts_with(&format!("{}/", aether_api::gateway::GROUP));
        match (kind, gateway_api, api_version) {
            ("GatewayClass", true, _) => {
                let class: GatewayClass = typed(value)?;
                self.classes
                    .insert(class.metadata.name.clone().unwrap_or_default(), class);
            }
            ("Gateway", true, _) => {
                let gateway: Gateway = typed(value)?;
                let key = format!(
                    "{}/{}",
                    namespace_of(&gateway.metadata),
                    gateway.metadata.name.clone().unwrap_or_default()
                );
                self.gateways.insert(key, gateway);
            }
            ("ReferenceGrant", true, _) => self.grants.push(typed(value)?),
            ("Namespace", _, "v1") => {
                let namespace: Namespace = typed(value)?;
                let name = namespace.metadata.name.unwrap_or_default();
                self.namespace_labels
                    .insert(name, namespace.metadata.labels.unwrap_or_default());
            }
            ("Secret", _, "v1") => {
                let mut secret: Secret = typed(value)?;
                // stringData is write-only in the API: the server folds it into data.
                if let Some(strings) = secret.string_data.take() {
                    let data = secret.data.get_or_insert_with(BTreeMap::new);
                    data.extend(strings.into_iter().map(|(k, v)| (k, ByteString(v.into_bytes()))));
                }
                let key = (
                    namespace_of(&secret.metadata).to_owned(),
                    secret.metadata.name.clone().unwrap_or_default(),
                );
                self.secrets.insert(key, secret);
            }
            _ => {}
        }
        Ok(())
    }
}

fn namespace_of(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> &str {
    meta.namespace
        .as_deref()
        .unwrap_or(aether_api::route::DEFAULT_NAMESPACE)
}

/// A document as `T`, or why not, naming the field (never quoting a Secret's data).
fn typed<T: serde::de::DeserializeOwned>(value: &Value) -> Result<T, String> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let field = e.path().to_string();
        let inner = e.into_inner().to_string();
        let message = if field.starts_with("data") || field.starts_with("stringData") {
            "not a valid value".to_owned()
        } else {
            clip(&inner).to_string()
        };
        format!("{field}: {message}")
    })
}

/// Reads every `*.yaml`/`*.yml` file of `dir` (sorted, so later files win a name
/// clash), logging each left-out document.
pub fn read_dir(dir: &Path) -> Objects {
    let mut objects = Objects::default();
    let mut paths: Vec<PathBuf> = match std::fs::read_dir(dir) {
        Ok(entries) => entries.filter_map(|e| e.ok().map(|e| e.path())).collect(),
        Err(error) => {
            tracing::warn!(dir = %dir.display(), %error, "cannot read the edge's config directory");
            return objects;
        }
    };
    paths.retain(|p| p.extension().is_some_and(|x| x == "yaml" || x == "yml"));
    paths.sort();
    for path in paths {
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(error) => {
                tracing::warn!(file = %path.display(), %error, "cannot read a config file");
                continue;
            }
        };
        let file = path
            .file_name()
            .map(|f| f.to_string_lossy().into_owned())
            .unwrap_or_default();
        for problem in objects.add_documents(&file, &documents(&text)) {
            tracing::warn!(problem = %quote(&problem), "config document left out");
        }
    }
    objects
}

/// Publishes the directory's objects to `objects` whenever they change, until shutdown.
pub async fn follow_dir(dir: PathBuf, objects: watch::Sender<Arc<Objects>>, shutdown: CancellationToken) {
    let wake = Arc::new(Notify::new());
    let _watcher = watch_dir(&dir, wake.clone());
    loop {
        let read = tokio::task::spawn_blocking({
            let dir = dir.clone();
            move || read_dir(&dir)
        })
        .await
        .unwrap_or_default();
        objects.send_if_modified(|current| {
            let changed = **current != read;
            if changed {
                *current = Arc::new(read);
            }
            changed
        });
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = wake.notified() => {
                // A burst of events (an editor's save, a ConfigMap's symlink swap) settles first.
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            _ = tokio::time::sleep(POLL) => {}
        }
    }
}

/// An inotify watch on `dir` that wakes the reader; `None` (the poll alone) if it cannot be set up.
fn watch_dir(dir: &Path, wake: Arc<Notify>) -> Option<notify::RecommendedWatcher> {
    use notify::{RecursiveMode, Watcher};
    let mut watcher = notify::recommended_watcher(move |_: notify::Result<notify::Event>| wake.notify_one()).ok()?;
    watcher.watch(dir, RecursiveMode::NonRecursive).ok()?;
    Some(watcher)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_every_kind_side_by_side_and_skips_others() {
        let text = r#"
apiVersion: gateway.networking.k8s.io/v1
kind: GatewayClass
metadata: {name: aether}
spec: {controllerName: aether.io/edge}
---
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {name: edge, namespace: edge}
spec:
  gatewayClassName: aether
  listeners: [{name: http, port: 80, protocol: HTTP}]
---
apiVersion: v1
kind: Namespace
metadata: {name: other, labels: {edge-access: allowed}}
---
apiVersion: v1
kind: Secret
metadata: {name: cert, namespace: edge}
type: kubernetes.io/tls
stringData: {tls.crt: "chain", tls.key: "key"}
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: skipped}
"#;
        let mut objects = Objects::default();
        let problems = objects.add_documents("a.yaml", &documents(text));
        assert!(problems.is_empty(), "{problems:?}");
        assert!(objects.classes.contains_key("aether"));
        assert!(objects.gateways.contains_key("edge/edge"));
        assert_eq!(objects.namespace_labels["other"]["edge-access"], "allowed");
        let secret = &objects.secrets[&("edge".to_owned(), "cert".to_owned())];
        assert_eq!(secret.data.as_ref().unwrap()["tls.key"].0, b"key");
    }

    #[test]
    fn a_bad_document_is_named_and_never_quotes_secret_data() {
        let text = r#"
apiVersion: v1
kind: Secret
metadata: {name: cert, namespace: edge}
data: {tls.key: "not base64 SECRET-MATERIAL"}
---
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {name: edge, namespace: edge}
spec: {gatewayClassName: aether, listeners: [{name: http, port: "eighty", protocol: HTTP}]}
"#;
        let mut objects = Objects::default();
        let problems = objects.add_documents("b.yaml", &documents(text));
        assert_eq!(problems.len(), 2, "{problems:?}");
        assert!(problems[0].starts_with("b.yaml document 1: data"), "{}", problems[0]);
        assert!(!problems[0].contains("SECRET-MATERIAL"), "{}", problems[0]);
        assert!(problems[1].contains("spec.listeners[0].port"), "{}", problems[1]);
        assert!(objects.secrets.is_empty() && objects.gateways.is_empty());
    }
}
