//! `GRPCRoute` (v1).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Serialize};

use super::{
    BackendRef, HeaderFilter, HttpHeaderMatch, LocalObjectReference, MatchValueType, ParentReference,
    RequestMirrorFilter, RouteStatus, string_enum,
};

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GrpcRoute {
    #[serde(default)]
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: GrpcRouteSpec,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<RouteStatus>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GrpcRouteSpec {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub parent_refs: Vec<ParentReference>,
    /// Not used for Service parents.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hostnames: Vec<String>,
    /// Empty: one rule matching every call, with no backend.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rules: Vec<GrpcRouteRule>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GrpcRouteRule {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Any one selects the rule; empty matches every call.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub matches: Vec<GrpcRouteMatch>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub filters: Vec<GrpcRouteFilter>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub backend_refs: Vec<GrpcBackendRef>,
    /// Refused when set (see [`super::HttpRouteRule::session_persistence`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_persistence: Option<serde_json::Value>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GrpcRouteMatch {
    /// Unset: every method.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method: Option<GrpcMethodMatch>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub headers: Vec<GrpcHeaderMatch>,
}

/// At least one of `service` and `method`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GrpcMethodMatch {
    #[serde(default, rename = "type")]
    pub type_: MatchValueType,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method: Option<String>,
}

pub type GrpcHeaderMatch = HttpHeaderMatch;

string_enum!(
    /// The filters of a GRPCRoute rule or backend.
    GrpcFilterType {
        RequestHeaderModifier = "RequestHeaderModifier",
        ResponseHeaderModifier = "ResponseHeaderModifier",
        RequestMirror = "RequestMirror",
        ExtensionRef = "ExtensionRef",
    }
);

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GrpcRouteFilter {
    #[serde(rename = "type")]
    pub type_: GrpcFilterType,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_header_modifier: Option<HeaderFilter>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_header_modifier: Option<HeaderFilter>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_mirror: Option<RequestMirrorFilter>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub extension_ref: Option<LocalObjectReference>,
}

pub type GrpcBackendRef = BackendRef<GrpcRouteFilter>;
