//! `TCPRoute` and `TLSRoute` (v1alpha2, the experimental channel): connections split
//! over weighted backends, with no matching of their own (TCP) or by server name (TLS).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Serialize};

use super::{BackendRef, ParentReference, RouteStatus};

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TcpRoute {
    #[serde(default)]
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: TcpRouteSpec,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<RouteStatus>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TcpRouteSpec {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub parent_refs: Vec<ParentReference>,
    /// The API requires at least one.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rules: Vec<TcpRouteRule>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TcpRouteRule {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The API requires at least one.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub backend_refs: Vec<TcpBackendRef>,
}

/// TCPRoute backends have no filters in the API; one that carries some anyway decodes
/// (as raw values) and is refused by the projector.
pub type TcpBackendRef = BackendRef<serde_json::Value>;

/// `TLSRoute` (v1alpha2): connections chosen by the server name of their ClientHello.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TlsRoute {
    #[serde(default)]
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: TlsRouteSpec,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<RouteStatus>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TlsRouteSpec {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub parent_refs: Vec<ParentReference>,
    /// Server names (SNI), exact or with a leading `*.` wildcard; empty: any.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hostnames: Vec<String>,
    /// The API requires at least one; a rule has the shape of a TCPRoute rule.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rules: Vec<TcpRouteRule>,
}
