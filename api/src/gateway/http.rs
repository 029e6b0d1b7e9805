//! `HTTPRoute` (v1, standard channel, plus the experimental fields the mesh implements:
//! retry, and the fields it refuses: sessionPersistence).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Serialize};

use super::{
    BackendRef, HeaderFilter, LocalObjectReference, ParentReference, RequestMirrorFilter, RouteStatus, string_enum,
};

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct HttpRoute {
    #[serde(default)]
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: HttpRouteSpec,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<RouteStatus>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HttpRouteSpec {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub parent_refs: Vec<ParentReference>,
    /// Host header matches; not used for Service parents (the parent already names the host).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hostnames: Vec<String>,
    /// Empty means the API's default: one rule matching every request, with no backend.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rules: Vec<HttpRouteRule>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HttpRouteRule {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Any one selects the rule. Empty means the API's default: path prefix "/".
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub matches: Vec<HttpRouteMatch>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub filters: Vec<HttpRouteFilter>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub backend_refs: Vec<HttpBackendRef>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeouts: Option<HttpRouteTimeouts>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry: Option<HttpRouteRetry>,
    /// Not supported by the mesh: a route that sets it is refused. Kept untyped, as only
    /// its presence matters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_persistence: Option<serde_json::Value>,
}

/// Every field set must match (AND).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HttpRouteMatch {
    /// Unset: path prefix "/".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<HttpPathMatch>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub headers: Vec<HttpHeaderMatch>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub query_params: Vec<HttpQueryParamMatch>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method: Option<String>,
}

string_enum!(
    /// How a path is compared.
    #[derive(Default)]
    PathMatchType {
        Exact = "Exact",
        #[default]
        PathPrefix = "PathPrefix",
        RegularExpression = "RegularExpression",
    }
);

string_enum!(
    /// How a header, query parameter or gRPC method is compared.
    #[derive(Default)]
    MatchValueType {
        #[default]
        Exact = "Exact",
        RegularExpression = "RegularExpression",
    }
);

fn root_path() -> String {
    "/".to_owned()
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HttpPathMatch {
    #[serde(default, rename = "type")]
    pub type_: PathMatchType,
    #[serde(default = "root_path")]
    pub value: String,
}

impl Default for HttpPathMatch {
    fn default() -> Self {
        Self {
            type_: PathMatchType::PathPrefix,
            value: root_path(),
        }
    }
}

/// A header match (name compared case-insensitively); the first of equal names counts.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HttpHeaderMatch {
    #[serde(default, rename = "type")]
    pub type_: MatchValueType,
    pub name: String,
    pub value: String,
}

/// A query parameter match (name compared exactly); the first of equal names counts.
pub type HttpQueryParamMatch = HttpHeaderMatch;

string_enum!(
    /// The filters of an HTTPRoute rule or backend.
    HttpFilterType {
        RequestHeaderModifier = "RequestHeaderModifier",
        ResponseHeaderModifier = "ResponseHeaderModifier",
        RequestMirror = "RequestMirror",
        RequestRedirect = "RequestRedirect",
        UrlRewrite = "URLRewrite",
        ExtensionRef = "ExtensionRef",
        Cors = "CORS",
    }
);

/// One filter: `type` names which of the other fields is set.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HttpRouteFilter {
    #[serde(rename = "type")]
    pub type_: HttpFilterType,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_header_modifier: Option<HeaderFilter>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_header_modifier: Option<HeaderFilter>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_mirror: Option<RequestMirrorFilter>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_redirect: Option<RequestRedirectFilter>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url_rewrite: Option<UrlRewriteFilter>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub extension_ref: Option<LocalObjectReference>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RequestRedirectFilter {
    /// "http" or "https"; unset keeps the request's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheme: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<HttpPathModifier>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<i32>,
    /// Unset: 302.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status_code: Option<i32>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct UrlRewriteFilter {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<HttpPathModifier>,
}

string_enum!(
    /// How a redirect or rewrite changes the path.
    PathModifierType {
        ReplaceFullPath = "ReplaceFullPath",
        ReplacePrefixMatch = "ReplacePrefixMatch",
    }
);

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HttpPathModifier {
    #[serde(rename = "type")]
    pub type_: PathModifierType,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replace_full_path: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replace_prefix_match: Option<String>,
}

pub type HttpBackendRef = BackendRef<HttpRouteFilter>;

/// GEP-2257 durations ("10s", "1m30s"); "0s" disables the timeout.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HttpRouteTimeouts {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend_request: Option<String>,
}

/// GEP-1731.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct HttpRouteRetry {
    /// Status codes retried, 400..=599.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub codes: Vec<i32>,
    /// Retries after the first attempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempts: Option<i32>,
    /// A GEP-2257 duration: the least wait before a retry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backoff: Option<String>,
}
