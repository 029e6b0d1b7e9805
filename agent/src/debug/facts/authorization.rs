//! The authorization facts of one call: the denials the target's pods on this node
//! logged for the caller, and what the node's policies decide for the request.

use aether_api::authorization::{AuthzRequest, HttpRequest, Workload, decide, selects};
use aether_api::route::request::Request;

use super::Inspector;
use crate::explain::{AuthzFacts, Target};
use crate::node::NodeView;
use crate::pod::LocalPod;

/// `caller`: the pod's SPIFFE ID (`None` without mTLS: decisions then name its address).
pub fn facts(
    inspector: &Inspector,
    view: &NodeView,
    pod: &LocalPod,
    caller: Option<&str>,
    target: &Target,
    request: Option<&Request>,
) -> AuthzFacts {
    let source = caller.map(str::to_owned);
    let peer = pod.ips.first().map(|ip| ip.to_string());
    let from_caller = |d: &crate::access_log::decisions::Decision| {
        let source_matches =
            Some(&d.source) == source.as_ref() || peer.as_ref().is_some_and(|ip| d.source.starts_with(ip.as_str()));
        source_matches && d.verdict == crate::access_log::decisions::Verdict::Deny
    };
    let destinations = view.pods.iter().filter(|p| p.info.service() == target.service);
    // A mesh service's pods judged the call; an external service's caller did.
    let egress = inspector.decisions.of_egress(&pod.id(), &target.service);
    let recent_denial = destinations
        .flat_map(|p| inspector.decisions.of(&p.id()))
        .chain(egress)
        .filter(from_caller)
        .max_by_key(|d| d.at_ms);
    let (namespace, _) = target.service.split_once('/').unwrap_or_default();
    let held = view.pods.iter().any(|p| p.info.namespace == namespace);
    let workload = Workload {
        namespace: namespace.to_owned(),
        services: vec![target.service.clone()],
        ..Default::default()
    };
    let policies = view.watched.catalog.policies.values();
    let selecting: Vec<_> = policies
        .filter(|p| selects(p, &with_any_labels(&workload, p)))
        .collect();
    let (by_label, judged): (Vec<_>, Vec<_>) = selecting
        .into_iter()
        .partition(|p| p.target.as_ref().is_some_and(|t| !t.match_labels.is_empty()));
    let call = AuthzRequest {
        workload,
        principal: source,
        trust_domain: view
            .identities
            .as_ref()
            .map(|i| i.trust_domain.clone())
            .unwrap_or_default(),
        peer_ip: pod.ips.first().copied().unwrap_or([0, 0, 0, 0].into()),
        port: target.port.or(target.ports.first().copied()).unwrap_or(0),
        http: Some(HttpRequest {
            method: request.map_or("GET", |r| &r.method).to_owned(),
            path: request.map_or("/", |r| &r.path).to_owned(),
            host: target.fqdn.clone(),
        }),
    };
    // The namespace's MeshConfig may deny by default: the policy that stands for it.
    let settings = crate::mesh_settings::MeshSettings::new(&view.watched.catalog.mesh_configs).of(namespace);
    let default_deny = (settings.default_authorization == aether_proto::registry::v1::DefaultAuthorization::Deny)
        .then(|| aether_api::mesh_config::default_deny(namespace));
    let judged: Vec<_> = judged.iter().map(|p| &***p).chain(default_deny.as_ref()).collect();
    AuthzFacts {
        recent_denial,
        decided: held.then(|| decide(&judged, &call)),
        unjudged: by_label.iter().map(|p| aether_proto::view::policy_key(p)).collect(),
        default_deny: default_deny.is_some(),
    }
}

/// The workload with the labels `policy` selects by: whether the policy could apply to
/// some pod of the target (the node does not know the destination pods' labels).
fn with_any_labels(workload: &Workload, policy: &aether_proto::registry::v1::AuthorizationPolicy) -> Workload {
    let labels = policy
        .target
        .as_ref()
        .map(|t| t.match_labels.clone().into_iter().collect());
    Workload {
        labels: labels.unwrap_or_default(),
        ..workload.clone()
    }
}
