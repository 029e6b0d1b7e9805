//! What a route rule does with a request it matched: forward it to weighted backends
//! (with rewrites, mirrors, a timeout and retries), redirect it, or answer 500 when it
//! has nowhere to go (Gateway API).
//!
//! A backend is named by its cluster, `<svc>.<ns>.<domain>:<port>`, whether or not the
//! node knows the service yet: an unknown cluster is fetched on demand like any mesh
//! authority, and when the catalog has no such service the router answers that share
//! with `cluster_not_found_response_code` 500, as Gateway API requires for a backend
//! that does not resolve.

use std::collections::HashMap;

use aether_proto::registry::v1::{
    HeaderModifier, Redirect, RouteBackend, RouteFilter, RouteRetry, RouteRule, UrlRewrite, route_filter,
};
use envoy_types::pb::envoy::config::core::v3::{
    HeaderValue, HeaderValueOption, RuntimeFractionalPercent, header_value_option,
};
use envoy_types::pb::envoy::config::route::v3::{
    RedirectAction, RetryPolicy, RouteAction, WeightedCluster, redirect_action, retry_policy, route, route_action,
    weighted_cluster,
};
use envoy_types::pb::envoy::r#type::v3::{FractionalPercent, fractional_percent};

use super::matching::PathSpec;
use super::rewrite::PathRewrite;
use super::{direct_action, mesh_retries, retries};
use crate::xds::resources::util::{millis, u32v};
use crate::xds::resources::{MeshService, fqdn};

/// Where a service port's rules send traffic.
pub struct Target<'a> {
    pub mesh_domain: &'a str,
    /// The parent's port: a backend or mirror without one calls this port.
    pub port: u32,
    /// The virtual host's domains (what a request's authority may be).
    pub domains: &'a [String],
    /// The node's dependency services by key: a backend's port is a Service port, and
    /// its cluster is named by the endpoint port that one targets.
    pub services: &'a HashMap<&'a str, &'a MeshService<'a>>,
    /// Route key → the callers-side HTTP filters enabled on its rules (proposals/014).
    pub route_filters: &'a std::collections::BTreeMap<&'a str, &'a [crate::xds::resources::http_filters::Enabled]>,
    /// The parent service's namespace's defaults, for rules that set no timeout or retries.
    pub resilience: &'a aether_api::mesh_config::ResilienceSettings,
}

impl Target<'_> {
    /// A backend's cluster: on the endpoint port its Service port targets (the port
    /// itself while the backend or its Service's ports are unknown here), or the parent's
    /// port when it names none.
    pub fn cluster(&self, backend: &RouteBackend) -> String {
        let port = match (backend.port, self.services.get(backend.service.as_str())) {
            (0, _) => self.port,
            (port, Some(service)) => service.endpoint_port(port),
            (port, None) => port,
        };
        format!("{}:{port}", fqdn(&backend.service, self.mesh_domain))
    }
}

/// Headers a modifier sets and adds, and the names it removes, in Envoy's terms.
#[derive(Default, Debug, PartialEq)]
pub struct HeaderEdits {
    pub add: Vec<HeaderValueOption>,
    pub remove: Vec<String>,
}

impl HeaderEdits {
    pub fn extend(&mut self, modifier: &HeaderModifier) {
        use header_value_option::HeaderAppendAction::{AppendIfExistsOrAdd, OverwriteIfExistsOrAdd};
        let set = modifier.set.iter().map(|h| (h, OverwriteIfExistsOrAdd));
        let add = modifier.add.iter().map(|h| (h, AppendIfExistsOrAdd));
        self.add
            .extend(set.chain(add).map(|(header, action)| HeaderValueOption {
                header: Some(HeaderValue {
                    key: header.name.clone(),
                    value: header.value.clone(),
                    ..Default::default()
                }),
                append_action: action as i32,
                ..Default::default()
            }));
        self.remove.extend(modifier.remove.iter().cloned());
    }
}

/// The rule's request and response header modifiers, in filter order.
pub fn header_edits(filters: &[RouteFilter]) -> (HeaderEdits, HeaderEdits) {
    let mut request = HeaderEdits::default();
    let mut response = HeaderEdits::default();
    for filter in filters.iter().filter_map(|f| f.filter.as_ref()) {
        match filter {
            route_filter::Filter::RequestHeaderModifier(m) => request.extend(m),
            route_filter::Filter::ResponseHeaderModifier(m) => response.extend(m),
            _ => {}
        }
    }
    (request, response)
}

/// The action of `rule` for requests `path` matched.
pub fn action(rule: &RouteRule, path: &PathSpec, target: &Target) -> route::Action {
    let filters = || rule.filters.iter().filter_map(|f| f.filter.as_ref());
    if let Some(redirect) = filters().find_map(|f| match f {
        route_filter::Filter::RequestRedirect(r) => Some(r),
        _ => None,
    }) {
        return route::Action::Redirect(redirect_action(redirect, path));
    }
    let Some(cluster_specifier) = clusters(&rule.backends, target) else {
        return direct_action(500, "this route rule has no backend\n");
    };
    let mut action = RouteAction {
        cluster_specifier: Some(cluster_specifier),
        cluster_not_found_response_code: route_action::ClusterNotFoundResponseCode::InternalServerError as i32,
        ..Default::default()
    };
    timeouts(&mut action, rule, target.resilience);
    for filter in filters() {
        match filter {
            route_filter::Filter::UrlRewrite(rewrite) => url_rewrite(&mut action, rewrite, path),
            route_filter::Filter::RequestMirror(mirror) => {
                let Some(backend) = &mirror.backend else { continue };
                action.request_mirror_policies.push(route_action::RequestMirrorPolicy {
                    cluster: target.cluster(backend),
                    runtime_fraction: (mirror.percent < 100).then(|| RuntimeFractionalPercent {
                        default_value: Some(FractionalPercent {
                            numerator: mirror.percent,
                            denominator: fractional_percent::DenominatorType::Hundred as i32,
                        }),
                        ..Default::default()
                    }),
                    ..Default::default()
                });
            }
            _ => {}
        }
    }
    route::Action::Route(action)
}

/// One backend: its cluster; several, or one with its own filters: weighted clusters.
/// Zero-weight backends get nothing; with none left, `None` (the rule answers 500).
fn clusters(backends: &[RouteBackend], target: &Target) -> Option<route_action::ClusterSpecifier> {
    let live: Vec<&RouteBackend> = backends.iter().filter(|b| b.weight > 0).collect();
    if let [only] = live.as_slice()
        && only.filters.is_empty()
    {
        return Some(route_action::ClusterSpecifier::Cluster(target.cluster(only)));
    }
    if live.is_empty() {
        return None;
    }
    let clusters = live
        .iter()
        .map(|backend| {
            let (request, response) = header_edits(&backend.filters);
            weighted_cluster::ClusterWeight {
                name: target.cluster(backend),
                weight: u32v(backend.weight),
                request_headers_to_add: request.add,
                request_headers_to_remove: request.remove,
                response_headers_to_add: response.add,
                response_headers_to_remove: response.remove,
                ..Default::default()
            }
        })
        .collect();
    Some(route_action::ClusterSpecifier::WeightedClusters(WeightedCluster {
        clusters,
        ..Default::default()
    }))
}

/// GEP-1742: `request` bounds the whole exchange, `backend_request` each attempt (and
/// the whole when `request` is unset); neither: the MeshConfig's request timeout.
/// Retries: the rule's (GEP-1731), else the mesh's.
fn timeouts(action: &mut RouteAction, rule: &RouteRule, resilience: &aether_api::mesh_config::ResilienceSettings) {
    let request = (rule.request_timeout_ms > 0).then_some(rule.request_timeout_ms);
    let backend = (rule.backend_request_timeout_ms > 0).then_some(rule.backend_request_timeout_ms);
    let default = u64::from(resilience.request_timeout_ms);
    action.timeout = millis(request.or(backend).unwrap_or(default));
    let mut policy = match &rule.retry {
        None => mesh_retries(resilience.retry_attempts),
        Some(retry) => rule_retries(retry),
    };
    if let Some(per_try) = backend {
        // Without retries a per-try timeout still needs a policy to live in.
        let policy = policy.get_or_insert_with(|| RetryPolicy {
            num_retries: u32v(0),
            ..Default::default()
        });
        policy.per_try_timeout = millis(per_try);
    }
    action.retry_policy = policy;
}

fn rule_retries(retry: &RouteRetry) -> Option<RetryPolicy> {
    if retry.attempts == 0 {
        return None;
    }
    let mut retry_on = "connect-failure,refused-stream,reset".to_owned();
    if !retry.codes.is_empty() {
        retry_on.insert_str(0, "retriable-status-codes,");
    }
    let base = retries();
    Some(RetryPolicy {
        retry_on,
        retriable_status_codes: retry.codes.clone(),
        num_retries: u32v(retry.attempts),
        retry_back_off: (retry.backoff_ms > 0).then(|| retry_policy::RetryBackOff {
            base_interval: millis(retry.backoff_ms),
            max_interval: millis(retry.backoff_ms.saturating_mul(10)),
        }),
        ..base
    })
}

fn url_rewrite(action: &mut RouteAction, rewrite: &UrlRewrite, path: &PathSpec) {
    if !rewrite.hostname.is_empty() {
        action.host_rewrite_specifier = Some(route_action::HostRewriteSpecifier::HostRewriteLiteral(
            rewrite.hostname.clone(),
        ));
    }
    match rewrite
        .path
        .as_ref()
        .and_then(|p| PathRewrite::of(p, path))
        .map(PathRewrite::for_forwarding)
    {
        Some(PathRewrite::Prefix(prefix)) => action.prefix_rewrite = prefix,
        Some(PathRewrite::Regex { pattern, substitution }) => {
            action.regex_rewrite = Some(PathRewrite::regex(&pattern, &substitution));
        }
        Some(PathRewrite::Full(_)) | None => {}
    }
}

/// The port of a redirect's Location (Gateway API): the filter's, else a new scheme's
/// well-known one, else the request's; the final scheme's default port is left out.
#[derive(Debug, PartialEq, Eq)]
pub enum LocationPort {
    Request,
    Port(u32),
    /// The scheme's default: no port in the Location.
    Omitted,
}

impl LocationPort {
    pub fn of(redirect: &Redirect) -> Self {
        // Mesh callers speak plain HTTP to their node proxy.
        let https = redirect.scheme == "https";
        let port = match redirect.port {
            0 if redirect.scheme.is_empty() => return LocationPort::Request,
            0 if https => 443,
            0 => 80,
            port => port,
        };
        if port == if https { 443 } else { 80 } {
            LocationPort::Omitted
        } else {
            LocationPort::Port(port)
        }
    }
}

/// The redirect of `rule` when its Location must drop the request's port and name no
/// host: Envoy keeps the request's authority then, port included, so the rule becomes
/// one route per authority with a port, each redirecting to that host without it.
pub fn port_dropping_redirect(rule: &RouteRule) -> Option<&Redirect> {
    rule.filters.iter().find_map(|f| match &f.filter {
        Some(route_filter::Filter::RequestRedirect(r))
            if r.hostname.is_empty() && LocationPort::of(r) == LocationPort::Omitted =>
        {
            Some(r)
        }
        _ => None,
    })
}

fn redirect_action(redirect: &Redirect, path: &PathSpec) -> RedirectAction {
    use redirect_action::RedirectResponseCode as Code;
    let response_code = match redirect.status_code {
        301 => Code::MovedPermanently,
        303 => Code::SeeOther,
        307 => Code::TemporaryRedirect,
        308 => Code::PermanentRedirect,
        _ => Code::Found,
    };
    let path_rewrite_specifier = redirect
        .path
        .as_ref()
        .and_then(|p| PathRewrite::of(p, path))
        .map(|rewrite| match rewrite {
            PathRewrite::Full(full) => redirect_action::PathRewriteSpecifier::PathRedirect(full),
            PathRewrite::Prefix(prefix) => redirect_action::PathRewriteSpecifier::PrefixRewrite(prefix),
            PathRewrite::Regex { pattern, substitution } => {
                redirect_action::PathRewriteSpecifier::RegexRewrite(PathRewrite::regex(&pattern, &substitution))
            }
        });
    RedirectAction {
        host_redirect: redirect.hostname.clone(),
        port_redirect: match LocationPort::of(redirect) {
            LocationPort::Port(port) => port,
            LocationPort::Request | LocationPort::Omitted => 0,
        },
        response_code: response_code as i32,
        scheme_rewrite_specifier: (!redirect.scheme.is_empty())
            .then(|| redirect_action::SchemeRewriteSpecifier::SchemeRedirect(redirect.scheme.clone())),
        path_rewrite_specifier,
        ..Default::default()
    }
}
