//! Authorization of calls to external services (proposals/017): policies whose target is
//! an ExternalService are judged on the callers' side, with the calling pod's identity,
//! which its own outbound listener records ([`crate::xds::resources::transport::SOURCE_IDENTITY`]):
//! nothing of the outside takes part, and no certificate is presented to us.
//!
//! - HTTP ports: two RBAC filters in every pod's outbound HCM, [`DENY_FILTER`] and
//!   [`ALLOW_FILTER`], pass everything until a virtual host of an external service
//!   enables them with that service port's rules (the DENY policies' rules, then the
//!   ALLOW ones': with an ALLOW policy, what none of its rules allows is denied, 403).
//!   The rules read the caller from the filter state, so they are the same for every
//!   pod: one config per external service port, nothing per pod.
//! - TCP and TLS ports: each pod's chain for the port is its own, so the verdict is
//!   settled when compiling ([`aether_api::authorization::decide_egress`]); a denied pod's
//!   chain closes the connection, as a TCP route to no backend does.

use std::sync::Arc;

use aether_api::authorization::{AuthzRequest, Verdict, Workload, decide_egress, guards_external};
use aether_proto::registry::v1::{AuthorizationAction, AuthorizationPolicy};
use envoy_types::pb::envoy::extensions::filters::http::rbac::v3::{Rbac as HttpRbac, RbacPerRoute as HttpRbacPerRoute};
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{HttpFilter, http_filter};

use super::mirror::{self, HttpRbacConfig, HttpRbacPerRouteConfig};
use super::{index, typed};
use crate::pod::LocalPod;
use crate::xds::resources::http_filters::Enabled;
use crate::xds::resources::transport::SOURCE_IDENTITY;
use crate::xds::resources::{MeshService, is_http, tcp_routes};

/// The outbound HCM's filter of the DENY policies guarding external services.
pub const DENY_FILTER: &str = "aether.egress.deny";
/// The outbound HCM's filter of the ALLOW policies guarding external services.
pub const ALLOW_FILTER: &str = "aether.egress.allow";

/// The two filters, disabled in every pod's outbound HCM (the route table enables them).
pub fn http_filters() -> Vec<HttpFilter> {
    [DENY_FILTER, ALLOW_FILTER]
        .map(|name| HttpFilter {
            name: name.to_owned(),
            config_type: Some(http_filter::ConfigType::TypedConfig(typed::<HttpRbac>(
                &HttpRbacConfig::default(),
            ))),
            disabled: true,
            ..Default::default()
        })
        .to_vec()
}

/// The enforced policies among `policies` guarding `service`.
fn guarding<'a>(policies: &'a [Arc<AuthorizationPolicy>], service: &str) -> Vec<&'a AuthorizationPolicy> {
    (policies.iter())
        .filter(|p| guards_external(p, service) && !p.dry_run)
        .map(|p| &**p)
        .collect()
}

/// The filters an external service's HTTP `port` enables, with its rules; nothing when no
/// policy guards it (or `service` is not external).
pub fn http_port(
    service: &MeshService,
    port: u32,
    policies: &[Arc<AuthorizationPolicy>],
    trust_domain: &str,
) -> Vec<Enabled> {
    if service.service.external.is_none() {
        return Vec::new();
    }
    let guarding = guarding(policies, service.key);
    let of =
        |action| -> Vec<&AuthorizationPolicy> { guarding.iter().copied().filter(|p| p.action() == action).collect() };
    let Ok(port16) = u16::try_from(port) else {
        return Vec::new();
    };
    let prefix = format!("egress.{}.{port}.", service.key.replace('/', "."));
    [
        (DENY_FILTER, mirror::DENY, of(AuthorizationAction::Deny)),
        (ALLOW_FILTER, mirror::ALLOW, of(AuthorizationAction::Allow)),
    ]
    .into_iter()
    .filter(|(_, _, policies)| !policies.is_empty())
    .map(|(filter, action, policies)| {
        let rules = HttpRbacConfig {
            matcher: Some(index::matcher(
                action,
                &mirror::named_rules(&policies),
                &[port16],
                trust_domain,
                index::CallerInput::FilterState(SOURCE_IDENTITY),
            )),
            rules_stat_prefix: prefix.clone(),
            track_per_rule_stats: true,
            ..Default::default()
        };
        let per_route = HttpRbacPerRouteConfig { rbac: Some(rules) };
        (filter.to_owned(), typed::<HttpRbacPerRoute>(&per_route))
    })
    .collect()
}

/// Closes the TCP and TLS ports of `declared` external services that the policies guarding
/// them deny to `pod` (its chain for such a port takes [`tcp_routes::NO_BACKEND`]).
pub fn deny_streams(
    pod: &LocalPod,
    declared: &[&MeshService],
    policies: &[Arc<AuthorizationPolicy>],
    trust_domain: &str,
    splits: &mut tcp_routes::Splits,
) {
    let Some(peer_ip) = pod.ips.first().copied() else {
        return;
    };
    let principal = aether_api::authorization::service_account_id(
        &format!("{}/{}", pod.info.namespace, pod.info.service_account),
        trust_domain,
    );
    for service in declared.iter().filter(|s| s.service.external.is_some()) {
        let guarding = guarding(policies, service.key);
        if guarding.is_empty() {
            continue;
        }
        for (port, _) in service.ports.iter().filter(|(_, p)| !is_http(**p)) {
            let request = AuthzRequest {
                workload: Workload::default(),
                principal: Some(principal.clone()),
                trust_domain: trust_domain.to_owned(),
                peer_ip,
                port: *port,
                http: None,
            };
            if decide_egress(&guarding, service.key, &request).0 == Verdict::Deny {
                let closed = tcp_routes::PortRoutes {
                    by_server_name: Vec::new(),
                    otherwise: Some(vec![(tcp_routes::NO_BACKEND.to_owned(), 1)]),
                };
                splits.insert(service.cluster(*port), closed);
            }
        }
    }
}
