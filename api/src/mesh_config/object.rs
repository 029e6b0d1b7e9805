//! `mesh.aether.io/v1alpha1` MeshConfig, typed: what the Kubernetes API serves and what a
//! config directory holds (proposals/016).
//!
//! Decoding is lenient, as for policies and filters: numbers decode as `i64` and enums
//! keep unknown values, so a bad value is refused by the projector with its field named;
//! a field this version does not know lands in `unsupported` and is refused by name.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Serialize};

use crate::authorization::Unsupported;
use crate::gateway::string_enum;

/// The API group of [`MeshConfig`].
pub const GROUP: &str = "mesh.aether.io";
/// The one version served.
pub const VERSION: &str = "v1alpha1";
pub const KIND: &str = "MeshConfig";
/// The one name a MeshConfig may have: a namespace has one.
pub const NAME: &str = "default";

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct MeshConfig {
    #[serde(default)]
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: MeshConfigSpec,
}

/// Every part is optional: what is left out inherits (the namespace's from the mesh's,
/// the mesh's from the agents' flags and built-in defaults).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MeshConfigSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mtls: Option<Mtls>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub authorization: Option<Authorization>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resilience: Option<Resilience>,
    /// Mesh-wide only: a domain the mesh answers to next to the install-time one, and the
    /// one new pods search.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mesh_domain: Option<String>,
    #[serde(flatten, skip_serializing_if = "BTreeMap::is_empty")]
    pub unsupported: Unsupported,
}

string_enum! {
    /// `spec.mtls.mode`.
    MtlsMode {
        Strict = "STRICT",
        Permissive = "PERMISSIVE",
    }
}

/// `spec.mtls`: the inbound mTLS mode of the namespace's pods.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Mtls {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<MtlsMode>,
    #[serde(flatten, skip_serializing_if = "BTreeMap::is_empty")]
    pub unsupported: Unsupported,
}

string_enum! {
    /// `spec.authorization.defaultAction`.
    DefaultAction {
        Allow = "ALLOW",
        Deny = "DENY",
    }
}

/// `spec.authorization`: what a pod no ALLOW policy selects admits.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Authorization {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_action: Option<DefaultAction>,
    #[serde(flatten, skip_serializing_if = "BTreeMap::is_empty")]
    pub unsupported: Unsupported,
}

/// `spec.resilience`: defaults for calls to the namespace's services.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Resilience {
    /// A Gateway API duration ("1s", "250ms").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub connect_timeout: Option<String>,
    /// A Gateway API duration; "0s" is no timeout.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_timeout: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retries: Option<Retries>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outlier_detection: Option<OutlierDetection>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub circuit_breaker: Option<CircuitBreaker>,
    #[serde(flatten, skip_serializing_if = "BTreeMap::is_empty")]
    pub unsupported: Unsupported,
}

/// `spec.resilience.retries`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Retries {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempts: Option<i64>,
    #[serde(flatten, skip_serializing_if = "BTreeMap::is_empty")]
    pub unsupported: Unsupported,
}

/// `spec.resilience.outlierDetection`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OutlierDetection {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub consecutive_gateway_errors: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_ejection_percent: Option<i64>,
    #[serde(flatten, skip_serializing_if = "BTreeMap::is_empty")]
    pub unsupported: Unsupported,
}

/// `spec.resilience.circuitBreaker`: limits per service and node.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CircuitBreaker {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_connections: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_pending_requests: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_requests: Option<i64>,
    #[serde(flatten, skip_serializing_if = "BTreeMap::is_empty")]
    pub unsupported: Unsupported,
}

crate::resource::namespaced_resource!(MeshConfig, GROUP, VERSION, KIND, "meshconfigs");
