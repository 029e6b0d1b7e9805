//! Authorization of calls to external services (proposals/017): policies whose target is
//! an ExternalService are judged on the callers' side, with the calling pod's identity,
//! which its own outbound listener records ([`crate::xds::resources::transport::SOURCE_IDENTITY`]):
//! nothing of the outside takes part, and no certificate is presented to us.
//!
//! - HTTP ports: RBAC filters in every pod's outbound HCM, as a pod's inbound ones
//!   ([`EGRESS`]: one per AUDIT slot, then DENY, then ALLOW), pass everything until a
//!   virtual host of an external service enables them with that service port's rules,
//!   dry-run policies in the shadow rules of their action's filter. The rules read the
//!   caller from the filter state, so they are the same for every pod: one config per
//!   external service port, nothing per pod. Denials, AUDIT matches and dry-run denials
//!   are shipped to the agent's decision log by the HCM's logger ([`logged_keys`]).
//! - TCP and TLS ports: each pod's chain for the port is its own, so the verdict is
//!   settled when compiling ([`aether_api::authorization::decide_egress`]); a denied
//!   pod's chain closes the connection, as a TCP route to no backend does, and the chain
//!   logs each connection with what was decided for it (the denial, AUDIT matches, a
//!   dry-run denial: [`judge_streams`]).

use std::sync::Arc;

use std::collections::BTreeMap;

use aether_api::authorization::{AuthzRequest, Cause, Verdict, Workload, decide_egress, guards_external};
use aether_proto::registry::v1::{AuthorizationAction, AuthorizationPolicy};
use envoy_types::pb::envoy::extensions::filters::http::rbac::v3::Rbac as HttpRbac;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{HttpFilter, http_filter};

use super::mirror::{self, HttpRbacConfig};
use super::{Layer, NO_MATCH, index, stages, typed};
use crate::access_log::decisions::Verdict as DecisionVerdict;
use crate::pod::LocalPod;
use crate::xds::resources::http_filters::Enabled;
use crate::xds::resources::transport::SOURCE_IDENTITY;
use crate::xds::resources::{MeshService, is_http, tcp_routes};

/// The outbound HCM's filters judging calls to external services.
pub const EGRESS: Layer = Layer {
    deny: "aether.egress.deny",
    allow: "aether.egress.allow",
    audit: "aether.egress.audit.",
    prefix: "egress.",
};

/// The filters, disabled in every pod's outbound HCM (the route table enables them):
/// `audit_slots` AUDIT filters, then DENY and ALLOW.
pub fn http_filters(audit_slots: usize) -> Vec<HttpFilter> {
    let audits = (0..audit_slots).map(|slot| format!("{}{slot}", EGRESS.audit));
    audits
        .chain([EGRESS.deny.to_owned(), EGRESS.allow.to_owned()])
        .map(|name| HttpFilter {
            name,
            config_type: Some(http_filter::ConfigType::TypedConfig(typed::<HttpRbac>(
                &HttpRbacConfig::default(),
            ))),
            disabled: true,
            ..Default::default()
        })
        .collect()
}

/// How many AUDIT filters the outbound HCMs carry: the most AUDIT policies guarding one
/// external service, rounded up to a power of two (so most edits change only the
/// route table); none without any.
pub fn audit_slots(policies: &[Arc<AuthorizationPolicy>]) -> usize {
    let audits = policies.iter().filter(|p| p.action() == AuthorizationAction::Audit);
    let mut per_service = std::collections::BTreeMap::<&str, usize>::new();
    for policy in audits {
        let targets = policy.target.iter().flat_map(|t| &t.external_services);
        for service in targets {
            *per_service.entry(service.as_str()).or_default() += 1;
        }
    }
    per_service.values().max().map_or(0, |n| n.next_power_of_two())
}

/// The RBAC results the outbound HCM's decision logger ships when `denied`: the enforced
/// denials, the dry-run denials and the AUDIT matches of `audit_slots` slots.
pub fn logged_keys(audit_slots: usize) -> Vec<String> {
    let prefix = EGRESS.prefix;
    let mut keys: Vec<String> = ["deny.", "allow."]
        .iter()
        .flat_map(|name| {
            [
                format!("{prefix}{name}enforced_engine_result"),
                format!("{prefix}dry_run.{name}shadow_engine_result"),
            ]
        })
        .collect();
    keys.extend((0..audit_slots).map(|slot| format!("{prefix}audit.{slot}.shadow_engine_result")));
    keys
}

/// The policies among `policies` guarding `service` (enforced, dry-run and AUDIT).
fn guarding(policies: &[Arc<AuthorizationPolicy>], service: &str) -> Vec<Arc<AuthorizationPolicy>> {
    (policies.iter())
        .filter(|p| guards_external(p, service))
        .cloned()
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
    let Ok(port16) = u16::try_from(port) else {
        return Vec::new();
    };
    let guarding = guarding(policies, service.key);
    let stages = stages(&EGRESS, &guarding, false, |action, of| {
        index::matcher(
            action,
            &mirror::named_rules(of),
            &[port16],
            trust_domain,
            index::CallerInput::FilterState(SOURCE_IDENTITY),
        )
    });
    stages
        .into_iter()
        .filter(|stage| stage.rules.is_some() || stage.shadow.is_some())
        .map(|stage| (stage.filter.clone(), stage.per_route()))
        .collect()
}

/// What a pod's chain for an external service's stream port logs of each connection,
/// by the port's cluster: (verdict, policy id `<ns>/<name>#<rule>` or [`NO_MATCH`]).
pub type StreamDecisions = BTreeMap<String, Vec<(DecisionVerdict, String)>>;

/// Judges `pod`'s calls to the TCP and TLS ports of the `declared` external services: a
/// port the enforced policies deny is closed (its chain takes [`tcp_routes::NO_BACKEND`]);
/// the denial, the AUDIT matches and a dry-run denial are what each of its connections
/// logs (`logged`).
pub fn judge_streams(
    pod: &LocalPod,
    declared: &[&MeshService],
    policies: &[Arc<AuthorizationPolicy>],
    trust_domain: &str,
    splits: &mut tcp_routes::Splits,
    logged: &mut StreamDecisions,
) {
    let Some(peer_ip) = pod.ips.first().copied() else {
        return;
    };
    let principal = aether_api::authorization::service_account_id(
        &format!("{}/{}", pod.info.namespace, pod.info.service_account),
        trust_domain,
    );
    for service in declared.iter().filter(|s| s.service.external.is_some()) {
        let guarding: Vec<&AuthorizationPolicy> = (policies.iter())
            .filter(|p| guards_external(p, service.key))
            .map(|p| &**p)
            .collect();
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
            let decision = decide_egress(&guarding, service.key, &request);
            let mut log = Vec::new();
            if decision.verdict == Verdict::Deny {
                let closed = tcp_routes::PortRoutes {
                    by_server_name: Vec::new(),
                    otherwise: Some(vec![(tcp_routes::NO_BACKEND.to_owned(), 1)]),
                };
                splits.insert(service.cluster(*port), closed);
                log.push((DecisionVerdict::Deny, policy_id(&decision.cause)));
            }
            let audited = decision.audited.iter().map(|r| format!("{}#{}", r.policy, r.rule));
            log.extend(audited.map(|id| (DecisionVerdict::Audit, id)));
            if let (Verdict::Allow, Some((Verdict::Deny, cause))) = (decision.verdict, &decision.dry_run) {
                log.push((DecisionVerdict::DryRunDeny, policy_id(cause)));
            }
            if !log.is_empty() {
                logged.insert(service.cluster(*port), log);
            }
        }
    }
}

/// The policy id a verdict's cause names, as Envoy's RBAC would.
fn policy_id(cause: &Cause) -> String {
    match cause {
        Cause::Denied(rule) | Cause::Allowed(rule) => format!("{}#{}", rule.policy, rule.rule),
        Cause::NoAllowPolicy | Cause::NoAllowMatched => NO_MATCH.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use aether_proto::registry::v1::AuthorizationTarget;

    use super::*;

    fn policy(name: &str, action: AuthorizationAction, services: &[&str]) -> Arc<AuthorizationPolicy> {
        Arc::new(AuthorizationPolicy {
            name: name.into(),
            namespace: "shop".into(),
            action: action as i32,
            target: Some(AuthorizationTarget {
                external_services: services.iter().map(|s| (*s).to_owned()).collect(),
                ..Default::default()
            }),
            ..Default::default()
        })
    }

    #[test]
    fn audit_slots_are_the_most_audits_on_one_service_rounded_up_and_logged() {
        assert_eq!(audit_slots(&[]), 0);
        let deny = policy("no", AuthorizationAction::Deny, &["shop/pay"]);
        assert_eq!(audit_slots(std::slice::from_ref(&deny)), 0, "no AUDIT, no slot");
        let policies = [
            deny,
            policy("a", AuthorizationAction::Audit, &["shop/pay", "shop/mail"]),
            policy("b", AuthorizationAction::Audit, &["shop/pay"]),
            policy("c", AuthorizationAction::Audit, &["shop/pay"]),
        ];
        assert_eq!(audit_slots(&policies), 4, "three on shop/pay, rounded up");
        let filters: Vec<String> = http_filters(2).into_iter().map(|f| f.name).collect();
        assert_eq!(
            filters,
            [
                "aether.egress.audit.0",
                "aether.egress.audit.1",
                "aether.egress.deny",
                "aether.egress.allow"
            ]
        );
        let keys = logged_keys(1);
        assert!(
            keys.contains(&"egress.audit.0.shadow_engine_result".to_owned()),
            "{keys:?}"
        );
        assert!(
            keys.contains(&"egress.dry_run.allow.shadow_engine_result".to_owned()),
            "{keys:?}"
        );
        assert_eq!(keys.len(), 5);
    }
}
