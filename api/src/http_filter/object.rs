//! `networking.aether.io/v1alpha1` HTTPFilter, typed: what the Kubernetes API serves and
//! what a config directory holds (proposals/014).
//!
//! Decoding is lenient, as for policies: numbers decode as `i64` and enums keep unknown
//! values, so an out-of-range or misspelled value is refused by the projector with its
//! field named instead of breaking the registrar's whole watch; a field this version does
//! not know lands in `unsupported` and is refused by name, never dropped.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Serialize};

use crate::authorization::{self, Rule, TargetRef, Unsupported};
use crate::gateway::string_enum;

/// The API group of [`HttpFilter`].
pub const GROUP: &str = "networking.aether.io";
/// The one version served.
pub const VERSION: &str = "v1alpha1";
pub const KIND: &str = "HTTPFilter";

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct HttpFilter {
    #[serde(default)]
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: HttpFilterSpec,
}

/// Where a filter goes and which one it is: exactly one of `ext_authz`,
/// `local_rate_limit`, `header_to_metadata` and `rbac` is set.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HttpFilterSpec {
    /// Core Services of the filter's namespace whose traffic gets the filter.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub target_refs: Vec<TargetRef>,
    #[serde(default)]
    pub attach: Attach,
    /// `attach: Route` only: the route whose rules get the filter.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub route_ref: Option<RouteRef>,
    /// Ascending among the filters of one place; ties by `<namespace>/<name>`.
    #[serde(default)]
    pub order: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ext_authz: Option<ExtAuthz>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local_rate_limit: Option<LocalRateLimit>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header_to_metadata: Option<HeaderToMetadata>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rbac: Option<Rbac>,
    #[serde(flatten, skip_serializing_if = "BTreeMap::is_empty")]
    pub unsupported: Unsupported,
}

string_enum! {
    /// `spec.attach`; Inbound when unset.
    #[derive(Default)]
    Attach {
        #[default]
        Inbound = "Inbound",
        Callers = "Callers",
        Route = "Route",
    }
}

/// `spec.routeRef`: an HTTPRoute or GRPCRoute of the filter's namespace.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RouteRef {
    /// Empty: `gateway.networking.k8s.io`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub group: String,
    #[serde(default)]
    pub kind: String,
    #[serde(default)]
    pub name: String,
    #[serde(flatten, skip_serializing_if = "BTreeMap::is_empty")]
    pub unsupported: Unsupported,
}

/// `spec.extAuthz`: exactly one of `grpc` and `http`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ExtAuthz {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grpc: Option<GrpcService>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http: Option<HttpService>,
    /// A Gateway API duration, 1ms to 10s; unset: 200ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<String>,
    #[serde(default)]
    pub fail_open: bool,
    /// Unset: 403.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status_on_error: Option<i64>,
    /// 0 (the default) to 1 MiB.
    #[serde(default)]
    pub max_request_bytes: i64,
    #[serde(flatten, skip_serializing_if = "BTreeMap::is_empty")]
    pub unsupported: Unsupported,
}

/// `extAuthz.grpc`: an `envoy.service.auth.v3.Authorization` server.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GrpcService {
    #[serde(default)]
    pub host: String,
    #[serde(default)]
    pub port: i64,
    #[serde(flatten, skip_serializing_if = "BTreeMap::is_empty")]
    pub unsupported: Unsupported,
}

/// `extAuthz.http`: a plain HTTP server answering each check.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HttpService {
    #[serde(default)]
    pub host: String,
    #[serde(default)]
    pub port: i64,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub path_prefix: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allowed_headers: Vec<String>,
    #[serde(flatten, skip_serializing_if = "BTreeMap::is_empty")]
    pub unsupported: Unsupported,
}

/// `spec.localRateLimit`: a token bucket.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LocalRateLimit {
    #[serde(default)]
    pub max_tokens: i64,
    /// Unset: `max_tokens`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_fill: Option<i64>,
    /// A Gateway API duration, 50ms to 1h.
    #[serde(default)]
    pub fill_interval: String,
    /// Unset: 429.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<i64>,
    #[serde(flatten, skip_serializing_if = "BTreeMap::is_empty")]
    pub unsupported: Unsupported,
}

/// `spec.headerToMetadata`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct HeaderToMetadata {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rules: Vec<HeaderRule>,
    #[serde(flatten, skip_serializing_if = "BTreeMap::is_empty")]
    pub unsupported: Unsupported,
}

/// `headerToMetadata.rules[]`: one request header copied into dynamic metadata.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HeaderRule {
    #[serde(default)]
    pub header: String,
    #[serde(default)]
    pub key: String,
    /// Unset: `envoy.filters.http.header_to_metadata`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata_namespace: Option<String>,
    #[serde(default)]
    pub remove: bool,
    #[serde(flatten, skip_serializing_if = "BTreeMap::is_empty")]
    pub unsupported: Unsupported,
}

/// `spec.rbac`: AuthorizationPolicy's action (ALLOW or DENY) and rules.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Rbac {
    #[serde(default)]
    pub action: authorization::Action,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rules: Vec<Rule>,
    #[serde(flatten, skip_serializing_if = "BTreeMap::is_empty")]
    pub unsupported: Unsupported,
}

crate::resource::namespaced_resource!(HttpFilter, GROUP, VERSION, KIND, "httpfilters");
