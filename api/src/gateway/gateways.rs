//! `GatewayClass` and `Gateway` (v1) and `ReferenceGrant` (v1beta1, served by every
//! Gateway API release): what the edge gateway is programmed from (see [`crate::edge`]).

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector, ObjectMeta};
use serde::{Deserialize, Serialize};

use super::{GROUP, VERSION, gateway_group, string_enum};

/// The version of ReferenceGrant every Gateway API release serves.
pub const REFERENCE_GRANT_VERSION: &str = "v1beta1";

crate::resource::namespaced_resource!(
    GatewayClass,
    GROUP,
    VERSION,
    "GatewayClass",
    "gatewayclasses",
    k8s_openapi::ClusterResourceScope
);
crate::resource::namespaced_resource!(Gateway, GROUP, VERSION, "Gateway", "gateways");
crate::resource::namespaced_resource!(
    ReferenceGrant,
    GROUP,
    REFERENCE_GRANT_VERSION,
    "ReferenceGrant",
    "referencegrants"
);

fn secret_kind() -> String {
    "Secret".to_owned()
}

/// `GatewayClass` (cluster-scoped): which controller programs the Gateways naming it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GatewayClass {
    #[serde(default)]
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: GatewayClassSpec,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<GatewayClassStatus>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GatewayClassSpec {
    /// A domain-prefixed path, e.g. `aether.io/edge`.
    #[serde(default)]
    pub controller_name: String,
    /// Controller-specific configuration; kept opaque (the edge takes none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters_ref: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GatewayClassStatus {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// `Gateway`: listeners bound on the addresses of one edge.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Gateway {
    #[serde(default)]
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: GatewaySpec,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<GatewayStatus>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GatewaySpec {
    #[serde(default)]
    pub gateway_class_name: String,
    /// The API requires 1 to 64, with unique names.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub listeners: Vec<Listener>,
    /// Requested addresses (the edge assigns its own and refuses requests).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub addresses: Vec<GatewayAddress>,
}

string_enum!(
    /// What a listener receives.
    ProtocolType {
        Http = "HTTP",
        Https = "HTTPS",
        Tls = "TLS",
        Tcp = "TCP",
        Udp = "UDP",
    }
);

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Listener {
    /// Unique in the Gateway; what a route's `sectionName` names.
    pub name: String,
    /// Exact or `*.` wildcard; unset matches every host. Ignored for TCP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    pub port: i32,
    pub protocol: ProtocolType,
    /// Required for HTTPS and TLS, invalid for HTTP and TCP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<ListenerTls>,
    /// Unset: routes of the protocol's kinds from the Gateway's namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allowed_routes: Option<AllowedRoutes>,
}

string_enum!(
    /// Whether the gateway terminates TLS or passes it through.
    #[derive(Default)]
    TlsMode {
        #[default]
        Terminate = "Terminate",
        Passthrough = "Passthrough",
    }
);

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ListenerTls {
    #[serde(default)]
    pub mode: TlsMode,
    /// Terminate: at least one; each a core Secret of type `kubernetes.io/tls`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub certificate_refs: Vec<SecretObjectReference>,
    /// Implementation-specific settings (the edge supports none).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub options: BTreeMap<String, String>,
}

/// A certificateRef: a Secret, in the Gateway's namespace unless `namespace` says
/// otherwise (then a ReferenceGrant must allow it).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SecretObjectReference {
    /// Empty: the core group.
    #[serde(default)]
    pub group: String,
    #[serde(default = "secret_kind")]
    pub kind: String,
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct AllowedRoutes {
    #[serde(default)]
    pub namespaces: RouteNamespaces,
    /// Empty: the kinds the listener's protocol carries.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub kinds: Vec<RouteGroupKind>,
}

string_enum!(
    /// Which namespaces' routes a listener takes.
    #[derive(Default)]
    FromNamespaces {
        All = "All",
        Selector = "Selector",
        #[default]
        Same = "Same",
        None = "None",
    }
);

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RouteNamespaces {
    #[serde(default)]
    pub from: FromNamespaces,
    /// Required when `from` is Selector; ignored otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<LabelSelector>,
}

/// A route kind (`allowedRoutes.kinds[]`, `status.listeners[].supportedKinds[]`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RouteGroupKind {
    #[serde(default = "gateway_group")]
    pub group: String,
    pub kind: String,
}

impl RouteGroupKind {
    /// A kind of the Gateway API group.
    pub fn gateway(kind: &str) -> Self {
        Self {
            group: GROUP.to_owned(),
            kind: kind.to_owned(),
        }
    }
}

/// `spec.addresses[]` and `status.addresses[]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GatewayAddress {
    /// `IPAddress` (the API's default), `Hostname` or an implementation's own.
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    pub type_: Option<String>,
    #[serde(default)]
    pub value: String,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GatewayStatus {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub addresses: Vec<GatewayAddress>,
    /// Accepted, Programmed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub listeners: Vec<ListenerStatus>,
}

/// `status.listeners[]`: one per listener of the spec, by name.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ListenerStatus {
    pub name: String,
    /// The route kinds this listener takes (an unsupported kind asked for is left out).
    #[serde(default)]
    pub supported_kinds: Vec<RouteGroupKind>,
    /// Routes attached and accepted.
    #[serde(default)]
    pub attached_routes: i32,
    /// Accepted, Programmed, ResolvedRefs, Conflicted.
    #[serde(default)]
    pub conditions: Vec<Condition>,
}

/// `ReferenceGrant`: lets objects of the `from` kinds in other namespaces refer to
/// objects of the `to` kinds in this grant's namespace.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ReferenceGrant {
    #[serde(default)]
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: ReferenceGrantSpec,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ReferenceGrantSpec {
    /// Any entry grants (OR).
    #[serde(default)]
    pub from: Vec<ReferenceGrantFrom>,
    /// Any entry grants (OR).
    #[serde(default)]
    pub to: Vec<ReferenceGrantTo>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReferenceGrantFrom {
    /// Empty: the core group.
    #[serde(default)]
    pub group: String,
    pub kind: String,
    pub namespace: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReferenceGrantTo {
    /// Empty: the core group.
    #[serde(default)]
    pub group: String,
    pub kind: String,
    /// Unset: every object of the kind in the grant's namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}
