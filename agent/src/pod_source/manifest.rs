//! Kubernetes Pod manifests (JSON) → [`PodInfo`]. Only the fields the mesh uses are
//! read; everything else is ignored. Errors name the field.

use std::collections::BTreeMap;

use aether_common::quote::{clip, quote};
use serde::Deserialize;

use crate::pod::{ContainerPort, PodError, PodInfo};

#[derive(Deserialize)]
struct Pod {
    kind: Option<String>,
    metadata: Option<Metadata>,
    spec: Option<Spec>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Metadata {
    name: Option<String>,
    namespace: Option<String>,
    uid: Option<String>,
    #[serde(default)]
    labels: BTreeMap<String, String>,
    #[serde(default)]
    annotations: BTreeMap<String, String>,
    deletion_timestamp: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Spec {
    service_account_name: Option<String>,
    #[serde(default)]
    containers: Vec<Container>,
}

#[derive(Deserialize)]
struct Container {
    #[serde(default)]
    ports: Vec<Port>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Port {
    name: Option<String>,
    container_port: i64,
    protocol: Option<String>,
}

/// Parses one Pod manifest.
pub fn parse(json: &[u8]) -> Result<PodInfo, PodError> {
    let pod: Pod =
        serde_json::from_slice(json).map_err(|e| PodError::NotAManifest(clip(&e.to_string()).to_string()))?;
    if let Some(kind) = &pod.kind
        && kind != "Pod"
    {
        return Err(PodError::Kind(quote(kind).to_string()));
    }
    let metadata = pod.metadata.ok_or(PodError::Missing("metadata"))?;
    let name = metadata
        .name
        .filter(|n| !n.is_empty())
        .ok_or(PodError::Missing("metadata.name"))?;
    let namespace = metadata.namespace.unwrap_or_else(|| "default".into());
    crate::upstreams::check(&namespace).map_err(PodError::Namespace)?;
    let spec = pod.spec.ok_or(PodError::Missing("spec"))?;
    let mut ports = Vec::new();
    for (c, container) in spec.containers.iter().enumerate() {
        for (p, port) in container.ports.iter().enumerate() {
            ports.push(ContainerPort::from_spec(
                &format!("spec.containers[{c}].ports[{p}]"),
                port.container_port,
                port.name.as_deref(),
                port.protocol.as_deref(),
            )?);
        }
    }
    Ok(PodInfo {
        uid: metadata.uid.unwrap_or_default(),
        service_account: spec.service_account_name.unwrap_or_else(|| "default".into()),
        labels: metadata.labels,
        annotations: metadata.annotations,
        terminating: metadata.deletion_timestamp.is_some(),
        ports,
        namespace,
        name,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_fields_the_mesh_uses() {
        let pod = parse(
            br#"{"apiVersion":"v1","kind":"Pod",
                "metadata":{"name":"web-1","namespace":"shop","uid":"u-1",
                  "labels":{"aether.io/managed":"true"},
                  "annotations":{"config.aether.io/upstreams":"cart"}},
                "spec":{"serviceAccountName":"web","containers":[
                  {"name":"app","ports":[{"name":"http","containerPort":8080}]}]}}"#,
        )
        .unwrap();
        assert_eq!(pod.key(), "shop/web-1");
        assert_eq!(pod.service(), "shop/web");
        assert!(pod.is_managed());
        assert_eq!(pod.ports[0].port, 8080);
        assert!(!pod.terminating);
    }

    #[test]
    fn errors_name_the_field() {
        let error = |json: &[u8]| parse(json).unwrap_err().to_string();
        assert_eq!(error(br#"{"kind":"Service"}"#), "kind: \"Service\" is not Pod");
        assert_eq!(error(br#"{"metadata":{}}"#), "metadata.name: missing");
        assert_eq!(
            error(br#"{"metadata":{"name":"a"},"spec":{"containers":[{"ports":[{"containerPort":70000}]}]}}"#),
            "spec.containers[0].ports[0].containerPort: 70000 is out of range (1..=65535)"
        );
        assert!(error(b"{").starts_with("not a Pod manifest"));
        assert_eq!(
            error(br#"{"metadata":{"name":"a","namespace":"Shop"}}"#),
            "metadata.namespace: \"Shop\" is not a DNS-1123 label (lowercase letters, digits and '-')"
        );
    }

    proptest::proptest! {
        #[test]
        fn never_panics(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..256)) {
            let _ = parse(&bytes);
        }
    }
}
