//! Gateway API route objects (`gateway.networking.k8s.io/v1`, and TCPRoute and TLSRoute
//! from `v1alpha2`) and the edge's GatewayClass, Gateway and ReferenceGrant, typed: what the Kubernetes
//! API serves and what a route directory holds, field for field.
//!
//! Decoding is lenient where the API lets values grow (enums, unknown fields), because one
//! object the registrar cannot decode would break its whole watch: an enum value this
//! version does not know decodes as `Other(value)` and the projector refuses the route with
//! `UnsupportedValue`, as the API asks. Defaults are the API's (`+kubebuilder:default`), so
//! an object read from a file means what the API server would have stored.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use serde::{Deserialize, Serialize};

mod gateways;
mod grpc;
mod http;
mod tcp;

pub use gateways::*;
pub use grpc::*;
pub use http::*;
pub use tcp::*;

/// The API group of every route type here.
pub const GROUP: &str = "gateway.networking.k8s.io";
/// The version of the standard channel's routes (HTTPRoute, GRPCRoute).
pub const VERSION: &str = "v1";
/// The version of the experimental channel's TCPRoute and TLSRoute.
pub const EXPERIMENTAL_VERSION: &str = "v1alpha2";

/// An enum of the API carried as a string: the known values, and `Other` for any value
/// a newer API version may add (decoding must not fail on it).
macro_rules! string_enum {
    ($(#[$meta:meta])* $name:ident { $($(#[$vmeta:meta])* $variant:ident = $text:literal),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(Clone, Debug, PartialEq, Eq, Hash)]
        pub enum $name {
            $($(#[$vmeta])* $variant,)+
            /// A value this version does not know.
            Other(String),
        }

        impl $name {
            pub fn as_str(&self) -> &str {
                match self {
                    $(Self::$variant => $text,)+
                    Self::Other(other) => other,
                }
            }
        }

        impl From<String> for $name {
            fn from(text: String) -> Self {
                match text.as_str() {
                    $($text => Self::$variant,)+
                    _ => Self::Other(text),
                }
            }
        }

        impl Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.serialize_str(self.as_str())
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                String::deserialize(deserializer).map(Self::from)
            }
        }
    };
}
pub(crate) use string_enum;

crate::resource::namespaced_resource!(HttpRoute, GROUP, VERSION, "HTTPRoute", "httproutes");
crate::resource::namespaced_resource!(GrpcRoute, GROUP, VERSION, "GRPCRoute", "grpcroutes");
crate::resource::namespaced_resource!(TcpRoute, GROUP, EXPERIMENTAL_VERSION, "TCPRoute", "tcproutes");
crate::resource::namespaced_resource!(TlsRoute, GROUP, EXPERIMENTAL_VERSION, "TLSRoute", "tlsroutes");

fn gateway_group() -> String {
    GROUP.to_owned()
}
fn gateway_kind() -> String {
    "Gateway".to_owned()
}
fn service_kind() -> String {
    "Service".to_owned()
}
fn default_weight() -> i32 {
    1
}
fn default_denominator() -> i32 {
    100
}

/// `spec.parentRefs[]`: what a route attaches to. In the mesh, a Service (`group: ""`,
/// `kind: Service`); the API's defaults name a Gateway.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ParentReference {
    #[serde(default = "gateway_group")]
    pub group: String,
    #[serde(default = "gateway_kind")]
    pub kind: String,
    /// The route's namespace when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    pub name: String,
    /// A Service: the name of one of its ports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub section_name: Option<String>,
    /// A Service: one of its ports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<i32>,
}

/// `backendRef` of a mirror filter, and the reference part of a weighted backend.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BackendObjectReference {
    /// Empty: the core group.
    #[serde(default)]
    pub group: String,
    #[serde(default = "service_kind")]
    pub kind: String,
    pub name: String,
    /// The route's namespace when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// Required for a Service (the service port, not the target port).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<i32>,
}

/// `backendRefs[]`: a reference, its weight, and filters applied when it is chosen
/// (`F` is the route type's filter).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BackendRef<F> {
    /// Empty: the core group.
    #[serde(default)]
    pub group: String,
    #[serde(default = "service_kind")]
    pub kind: String,
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<i32>,
    /// Share of requests: weight / sum of the rule's weights. 0 receives nothing.
    #[serde(default = "default_weight")]
    pub weight: i32,
    #[serde(default = "Vec::new", skip_serializing_if = "Vec::is_empty")]
    pub filters: Vec<F>,
}

impl<F> BackendRef<F> {
    /// The reference part, as a mirror filter holds it.
    pub fn object(&self) -> BackendObjectReference {
        BackendObjectReference {
            group: self.group.clone(),
            kind: self.kind.clone(),
            name: self.name.clone(),
            namespace: self.namespace.clone(),
            port: self.port,
        }
    }
}

/// A `(group, kind, name)` reference to an implementation's own filter.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LocalObjectReference {
    pub group: String,
    pub kind: String,
    pub name: String,
}

/// `requestHeaderModifier` / `responseHeaderModifier`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct HeaderFilter {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub set: Vec<HttpHeader>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub add: Vec<HttpHeader>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub remove: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HttpHeader {
    pub name: String,
    pub value: String,
}

/// `requestMirror`: a copy of each selected request goes to `backendRef`; its answer is dropped.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RequestMirrorFilter {
    pub backend_ref: BackendObjectReference,
    /// 0..=100; at most one of `percent` and `fraction`; neither means 100 %.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub percent: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fraction: Option<Fraction>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Fraction {
    pub numerator: i32,
    #[serde(default = "default_denominator")]
    pub denominator: i32,
}

/// `status` of a route: one entry per parent a controller handles.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RouteStatus {
    #[serde(default)]
    pub parents: Vec<RouteParentStatus>,
}

/// `status.parents[]`: the conditions one controller reports for one parent.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RouteParentStatus {
    pub parent_ref: ParentReference,
    pub controller_name: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}
