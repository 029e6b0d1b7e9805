//! `aether explain <pod> <service|URL>`: why a pod can or cannot reach a service, as the
//! hops a call takes, in order. [`explain`] is pure: the facts the agent gathered
//! (`crate::debug::gather`) in, one verdict per hop out, each with a one-sentence why and
//! a fix. The first failing hop is the answer; later hops are not judged (`skip`).
//!
//! The route hop (see [`route`]) names the rule of the routes attached to the target's
//! port that takes the request, in the precedence order the agent compiles; the cluster
//! and endpoints hops stay about the service's own cluster (skipped when the rule
//! redirects), the route hop saying whether the catalog holds its backends. The
//! authorization hop (see [`authorization`]) names the policy and rule that deny the call:
//! from the decisions this node's destination pods logged for the caller, else from
//! `decide` over the policies the node holds for the target's namespace.

use std::net::IpAddr;
use std::time::{Duration, SystemTime};

use aether_api::route::request::Request;
use serde::Serialize;

pub use crate::access_log::Failure;

mod route;

pub use route::{Action, Backend, Matched, RouteFacts, RouteReport, Skipped};

/// How one hop fared.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Ok,
    /// Works, with a caveat worth knowing (e.g. reached on demand).
    Warn,
    Fail,
    /// Not judged: not applicable, or after the first failure.
    Skip,
}

/// One hop of the call.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Hop {
    pub hop: &'static str,
    pub status: Status,
    /// One sentence.
    pub why: String,
    /// How to fix it (empty when there is nothing to fix).
    pub fix: String,
}

/// Everything [`explain`] judges; gathered by the agent for one (pod, target).
#[derive(Clone, Debug, Default)]
pub struct Facts {
    /// The source pod as given on the command line (`<ns>/<name>`).
    pub pod_id: String,
    /// `None`: the agent does not know the pod.
    pub pod: Option<PodFacts>,
    /// The target as typed, and what it names.
    pub target_text: String,
    pub target: Option<Target>,
    pub registrar_connected: bool,
    pub dns: DnsFacts,
    pub capture: Capture,
    pub envoy: EnvoyFacts,
    pub identity: Option<IdentityFacts>,
    /// The request the route hop judges: a URL's path and query, with the CLI's method
    /// and headers; `None`: a service given without URL (a plain `GET /` is judged).
    pub request: Option<Request>,
    /// The routes on the target's port for the pod; `None`: not judged (the service is
    /// not loaded, has no endpoints, or does not serve the port).
    pub route: Option<RouteFacts>,
    /// What the node knows of authorization at the target; `None`: not gathered (no
    /// source pod or target).
    pub authorization: Option<AuthzFacts>,
    /// The pod's last failed calls to the target, newest first, as Envoy logged them.
    pub recent_failures: Vec<Failure>,
    pub now: Option<SystemTime>,
}

/// Authorization at the target for the call judged.
#[derive(Clone, Debug, Default)]
pub struct AuthzFacts {
    /// The newest denial of the pod's calls that the target's pods on this node logged.
    pub recent_denial: Option<crate::access_log::decisions::Decision>,
    /// What the node's policies for the target's namespace decide for the request
    /// (`aether_api::authorization::decide`); `None`: the node does not hold them (no
    /// local pod in that namespace).
    pub decided: Option<aether_api::authorization::Decision>,
    /// Policies selecting pods by label that may apply: not judged here.
    pub unjudged: Vec<String>,
    /// The target's namespace's MeshConfig (or the mesh's) sets `defaultAction: DENY`:
    /// `decided` counts the policy that stands for it.
    pub default_deny: bool,
}

#[derive(Clone, Debug, Default)]
pub struct PodFacts {
    pub terminating: bool,
    pub config_errors: Vec<String>,
    /// Its `config.aether.io/upstreams`, as service keys.
    pub upstreams: Vec<String>,
}

/// What the target names.
#[derive(Clone, Debug, Default)]
pub struct Target {
    /// `<ns>/<name>`.
    pub service: String,
    pub fqdn: String,
    /// The port asked for, if any.
    pub port: Option<u32>,
    /// Given as an IP (a VIP), so no name is looked up.
    pub by_ip: bool,
    /// The service's VIP, if the catalog or the record file knows it.
    pub vip: Option<IpAddr>,
    /// The service is in the node's catalog slice (declared or looked up on demand).
    pub loaded: bool,
    /// The ports its endpoints serve (empty: none, or not loaded).
    pub ports: Vec<u32>,
    /// Endpoints in the catalog (when loaded).
    pub endpoints: usize,
}

#[derive(Clone, Debug, Default)]
pub struct DnsFacts {
    /// The addresses mesh-dns's record file holds for the name; `None`: no record.
    pub record: Option<Vec<IpAddr>>,
    /// Reading the record file failed.
    pub file_error: Option<String>,
    /// What mesh-dns itself answered, when the node runs one (`--mesh-dns`): its address,
    /// and the A records or why there was no answer. Judged before the file: it is what
    /// the pod's resolver gets.
    pub answer: Option<(String, Result<Vec<IpAddr>, String>)>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Capture {
    #[default]
    Unknown,
    /// The netns holds the rules the agent applied; they captured this many connections
    /// since they were applied.
    Intact { captured: u64 },
    /// The table is missing or changed.
    Drifted,
    /// The pod was added without capture.
    NotCaptured,
    /// Checking failed (nft, netns).
    Error(String),
}

#[derive(Clone, Debug, Default)]
pub struct EnvoyFacts {
    /// An Envoy is connected to the agent's xDS socket.
    pub connected: bool,
    pub listener: Resource,
    /// The cluster the call would use (`None`: none, e.g. not loaded or no endpoints).
    pub cluster: Option<(String, Resource)>,
    /// Hosts Envoy holds for that cluster (`None`: Envoy's admin did not answer).
    pub hosts: Option<Vec<Host>>,
}

/// A resource the agent serves, as Envoy took it.
#[derive(Clone, Debug, Default)]
pub struct Resource {
    pub served: bool,
    pub acked: bool,
    /// Envoy's NACK error, if it rejected the served version.
    pub rejected: Option<String>,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct Host {
    pub address: String,
    pub healthy: bool,
    pub ejected: bool,
}

#[derive(Clone, Debug, Default)]
pub struct IdentityFacts {
    pub svid: Option<Svid>,
    /// The pod's SVID secret is ACKed by Envoy.
    pub secret_acked: bool,
    /// The identities the client pins for the destination (the cluster's SANs).
    pub expected_sans: Vec<String>,
    /// SPIFFE IDs of the destination's endpoints that are pods on this node (their SVIDs).
    pub local_destinations: Vec<(String, String)>,
    /// The destination's endpoints on other nodes, asked who they are (a TLS handshake as
    /// the source pod), a few of them.
    pub remote_destinations: Vec<RemoteDestination>,
}

/// A destination pod on another node, and the SPIFFE ID it presented (or why it did not).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteDestination {
    pub address: String,
    pub node: String,
    pub presented: Result<String, String>,
}

#[derive(Clone, Debug)]
pub struct Svid {
    pub spiffe_id: String,
    pub not_before: SystemTime,
    pub not_after: SystemTime,
}

/// The whole answer: every hop, and the verdict (the first failure, else the first warning).
#[derive(Clone, Debug, Serialize)]
pub struct Explanation {
    pub pod: String,
    pub target: String,
    pub service: Option<String>,
    pub verdict: Status,
    /// The hop the verdict is about (the first fail, else the first warn).
    pub first: Option<Hop>,
    pub hops: Vec<Hop>,
    /// The routes on the target's port and the rule the request takes, when routes apply.
    pub route: Option<RouteReport>,
    /// The pod's last failed calls to the target (status ≥ 400 or an Envoy response
    /// flag), newest first: what the hops cannot see, such as a timeout or a reset.
    pub recent_failures: Vec<Failure>,
}

type Judge = fn(&Facts) -> Hop;

/// The hops in the order a call takes them.
const HOPS: [Judge; 12] = [
    pod,
    target,
    control_plane,
    dns,
    capture,
    declared,
    listener,
    route::judge,
    cluster,
    endpoints,
    identity,
    authorization,
];

/// Judges every hop in order; after the first failure the rest are skipped.
pub fn explain(facts: &Facts) -> Explanation {
    let mut hops = Vec::new();
    let mut failed = false;
    for judge in HOPS {
        let hop = judge(facts);
        if failed {
            hops.push(Hop {
                status: Status::Skip,
                why: "not checked: an earlier hop failed".into(),
                fix: String::new(),
                ..hop
            });
            continue;
        }
        failed = hop.status == Status::Fail;
        hops.push(hop);
    }
    let first = [Status::Fail, Status::Warn]
        .iter()
        .find_map(|s| hops.iter().find(|h| h.status == *s))
        .cloned();
    Explanation {
        pod: facts.pod_id.clone(),
        target: facts.target_text.clone(),
        service: facts.target.as_ref().map(|t| t.service.clone()),
        verdict: first.as_ref().map_or(Status::Ok, |h| h.status),
        first,
        hops,
        route: route::report(facts),
        recent_failures: facts.recent_failures.clone(),
    }
}

fn hop(hop: &'static str, status: Status, why: impl Into<String>, fix: impl Into<String>) -> Hop {
    Hop {
        hop,
        status,
        why: why.into(),
        fix: fix.into(),
    }
}

fn ok(name: &'static str, why: impl Into<String>) -> Hop {
    hop(name, Status::Ok, why, "")
}

fn pod(f: &Facts) -> Hop {
    let Some(pod) = &f.pod else {
        return hop(
            "pod",
            Status::Fail,
            format!("{} is not a pod this node's agent manages", f.pod_id),
            "label it aether.io/managed=true, check it runs on this node and that its CNI ADD succeeded (aether status lists the node's pods)",
        );
    };
    if pod.terminating {
        return hop(
            "pod",
            Status::Warn,
            format!("{} is terminating: its connections drain", f.pod_id),
            "",
        );
    }
    if let Some(error) = pod.config_errors.first() {
        return hop(
            "pod",
            Status::Warn,
            format!(
                "{} is managed, but part of its mesh config is ignored: {error}",
                f.pod_id
            ),
            "fix the annotation named",
        );
    }
    ok("pod", format!("{} is managed by this node's agent", f.pod_id))
}

fn target(f: &Facts) -> Hop {
    let Some(t) = &f.target else {
        return hop(
            "service",
            Status::Fail,
            format!("{:?} does not name a mesh service", f.target_text),
            "give <service>, <service>.<namespace>, <namespace>/<service>, the mesh name or a URL with it",
        );
    };
    if t.vip.is_none() && !t.loaded {
        return hop(
            "service",
            Status::Fail,
            format!("{} is not in the mesh catalog", t.service),
            "check the name and namespace; a service exists once a managed pod serving it is registered",
        );
    }
    ok("service", format!("{} is in the mesh catalog", t.service))
}

fn control_plane(f: &Facts) -> Hop {
    if f.registrar_connected {
        return ok("registrar", "the agent's catalog watch on the registrar is up");
    }
    hop(
        "registrar",
        Status::Warn,
        "the agent's catalog watch on the registrar is down: this node's endpoints may be stale and new services cannot be looked up",
        "check the registrar (its /ready, the agent's log for the link error) and the network between them",
    )
}

fn dns(f: &Facts) -> Hop {
    let Some(t) = &f.target else { return skipped("dns") };
    if t.by_ip {
        return ok(
            "dns",
            format!(
                "addressed by IP {}: no lookup",
                t.vip.map(|v| v.to_string()).unwrap_or_default()
            ),
        );
    }
    if let Some((server, answer)) = &f.dns.answer {
        return dns_answer(t, server, answer);
    }
    let fix_file = "check the agent's DNS catalog watch (aether status) and mesh-dns's /debug/records; the agent rewrites the record file on every catalog change";
    if let Some(error) = &f.dns.file_error {
        return hop(
            "dns",
            Status::Fail,
            format!("mesh-dns's record file cannot be read: {error}"),
            fix_file,
        );
    }
    let Some(record) = &f.dns.record else {
        return hop(
            "dns",
            Status::Fail,
            format!("mesh-dns has no record for {}", t.fqdn),
            fix_file,
        );
    };
    match t.vip {
        Some(vip) if !record.contains(&vip) => hop(
            "dns",
            Status::Fail,
            format!("mesh-dns answers {} with {record:?}, but its VIP is {vip}", t.fqdn),
            fix_file,
        ),
        _ => ok("dns", format!("{} resolves to {}", t.fqdn, list(record))),
    }
}

/// mesh-dns asked directly: it answers the name with the service's VIP.
fn dns_answer(t: &Target, server: &str, answer: &Result<Vec<IpAddr>, String>) -> Hop {
    let fix = "check mesh-dns (aether check: mesh-dns answering), its /debug/records and the agent's DNS catalog watch";
    let ips = match answer {
        Err(e) => {
            return hop(
                "dns",
                Status::Fail,
                format!("mesh-dns at {server} did not answer: {e}"),
                fix,
            );
        }
        Ok(ips) if ips.is_empty() => {
            let why = format!("mesh-dns at {server} has no record for {}", t.fqdn);
            return hop("dns", Status::Fail, why, fix);
        }
        Ok(ips) => ips,
    };
    match t.vip {
        Some(vip) if !ips.contains(&vip) => hop(
            "dns",
            Status::Fail,
            format!(
                "mesh-dns at {server} answers {} with {}, but its VIP is {vip}",
                t.fqdn,
                list(ips)
            ),
            fix,
        ),
        _ => ok(
            "dns",
            format!("mesh-dns at {server} answers {} with {}", t.fqdn, list(ips)),
        ),
    }
}

fn capture(f: &Facts) -> Hop {
    let fix = "restart the agent (it re-applies every pod's rules at start-up) or recreate the pod; inspect with `nsenter --net=<netns> nft list table inet aether`";
    match &f.capture {
        Capture::Intact { captured: 0 } => hop(
            "capture",
            Status::Warn,
            "the pod's netns holds the capture rules, but they have captured no connection yet: if the pod has called the service, it dialed an address outside the mesh's VIPs and ClusterIPs",
            "call the service by its mesh name (or VIP or ClusterIP); check the address the app dials",
        ),
        Capture::Intact { captured } => ok(
            "capture",
            format!("the pod's netns holds the capture rules; they captured {captured} connection(s)"),
        ),
        Capture::Drifted => hop(
            "capture",
            Status::Fail,
            "the capture rules in the pod's netns are missing or changed: calls to the VIP leave the pod uncaptured",
            fix,
        ),
        Capture::NotCaptured => hop(
            "capture",
            Status::Fail,
            "the pod was added without traffic capture: its calls never reach Envoy",
            "re-create the pod without capture mode none in its CNI config",
        ),
        Capture::Error(e) => hop(
            "capture",
            Status::Fail,
            format!("checking the capture rules failed: {e}"),
            fix,
        ),
        Capture::Unknown => skipped("capture"),
    }
}

fn declared(f: &Facts) -> Hop {
    let (Some(t), Some(pod)) = (&f.target, &f.pod) else {
        return skipped("upstreams");
    };
    if pod.upstreams.contains(&t.service) {
        return ok(
            "upstreams",
            format!("{} is declared in the pod's config.aether.io/upstreams", t.service),
        );
    }
    let fix = format!("add {} to the pod's config.aether.io/upstreams annotation", t.service);
    if t.loaded {
        return hop(
            "upstreams",
            Status::Warn,
            format!(
                "{} is not declared; the node holds it already (another pod declares it, or a call looked it up)",
                t.service
            ),
            fix,
        );
    }
    if !f.registrar_connected {
        return hop(
            "upstreams",
            Status::Fail,
            format!(
                "{} is not declared and the registrar is unreachable: an on-demand lookup cannot be answered",
                t.service
            ),
            fix,
        );
    }
    hop(
        "upstreams",
        Status::Warn,
        format!(
            "{} is not declared: reachable on demand (the first call waits for the registrar lookup)",
            t.service
        ),
        fix,
    )
}

fn listener(f: &Facts) -> Hop {
    if !f.envoy.connected {
        return hop(
            "listener",
            Status::Fail,
            "no Envoy is connected to the agent's xDS socket",
            "check the proxy container (aether status: Envoy) and its log",
        );
    }
    // With mTLS the agent withholds a pod's listeners until it has an SVID: name that cause.
    if let Some(id) = f
        .identity
        .as_ref()
        .filter(|id| id.svid.is_none() && !f.envoy.listener.served)
    {
        let why = svid_problem(&f.pod_id, id, SystemTime::now()).unwrap_or_default();
        return hop(
            "listener",
            Status::Fail,
            format!("the agent withholds the pod's listeners: {why}"),
            "check the identity provider (aether check: CA/SVID) and the agent's log",
        );
    }
    resource("listener", "the pod's listeners", &f.envoy.listener)
}

fn resource(name: &'static str, what: &str, r: &Resource) -> Hop {
    if let Some(error) = &r.rejected {
        return hop(
            name,
            Status::Fail,
            format!("Envoy rejected {what}: {error}"),
            "report it: the agent generated config Envoy refuses (aether status counts NACKs)",
        );
    }
    if !r.served {
        return hop(
            name,
            Status::Fail,
            format!("the agent does not serve {what}"),
            "check the agent's log and /debug/xds",
        );
    }
    if !r.acked {
        return hop(
            name,
            Status::Fail,
            format!("Envoy has not taken {what} yet"),
            "wait a moment and retry; if it persists check the xDS stream in aether status",
        );
    }
    ok(name, format!("Envoy holds {what}"))
}

/// The rule the request takes redirects: no upstream is called.
fn redirected(name: &'static str, f: &Facts) -> Option<Hop> {
    let report = route::report(f)?;
    matches!(report.matched?.action, Action::Redirect { .. }).then(|| {
        hop(
            name,
            Status::Skip,
            "the request is redirected (route hop): no upstream is called",
            "",
        )
    })
}

fn cluster(f: &Facts) -> Hop {
    let Some(t) = &f.target else { return skipped("cluster") };
    if let Some(hop) = redirected("cluster", f) {
        return hop;
    }
    if !t.loaded {
        return hop(
            "cluster",
            Status::Skip,
            "not loaded yet: Envoy asks for it on the first call (on-demand CDS)",
            "",
        );
    }
    if t.endpoints == 0 {
        return hop(
            "cluster",
            Status::Skip,
            "no cluster while the service has no endpoints",
            "",
        );
    }
    if let Some(port) = t.port
        && !t.ports.contains(&port)
    {
        return hop(
            "cluster",
            Status::Fail,
            format!("{} serves port(s) {}, not {port}", t.service, list(&t.ports)),
            "call one of the ports its pods declare",
        );
    }
    match &f.envoy.cluster {
        Some((name, r)) => resource("cluster", &format!("cluster {name}"), r),
        None => hop(
            "cluster",
            Status::Fail,
            format!("the agent serves no cluster for {}", t.service),
            "check the agent's /debug/xds",
        ),
    }
}

fn endpoints(f: &Facts) -> Hop {
    let Some(t) = &f.target else {
        return skipped("endpoints");
    };
    if let Some(hop) = redirected("endpoints", f) {
        return hop;
    }
    if !t.loaded {
        return hop(
            "endpoints",
            Status::Skip,
            "not loaded yet: fetched with the cluster on the first call",
            "",
        );
    }
    if t.endpoints == 0 {
        return hop(
            "endpoints",
            Status::Fail,
            format!("{} has no endpoints: no ready pod serves it", t.service),
            "start or fix its pods (ready, managed, registered); the registrar's ListEndpoints shows what is registered",
        );
    }
    let Some(hosts) = &f.envoy.hosts else {
        return hop(
            "endpoints",
            Status::Warn,
            format!(
                "{} endpoint(s) in the catalog; Envoy's admin did not answer for their health",
                t.endpoints
            ),
            "check Envoy (aether status)",
        );
    };
    let healthy = hosts.iter().filter(|h| h.healthy && !h.ejected).count();
    let ejected = hosts.iter().filter(|h| h.ejected).count();
    if healthy == 0 {
        return hop(
            "endpoints",
            Status::Fail,
            format!(
                "none of {}'s {} host(s) in Envoy is healthy ({ejected} ejected)",
                t.service,
                hosts.len()
            ),
            "check the destination pods; outlier ejection ends by itself once they answer",
        );
    }
    if ejected > 0 {
        return hop(
            "endpoints",
            Status::Warn,
            format!("{healthy} healthy, {ejected} ejected of {} host(s)", hosts.len()),
            "check the ejected pods",
        );
    }
    ok("endpoints", format!("{healthy} healthy host(s) in Envoy"))
}

fn identity(f: &Facts) -> Hop {
    let Some(id) = &f.identity else {
        return hop(
            "identity",
            Status::Skip,
            "mTLS is off on this node (--identity none): calls are plaintext",
            "",
        );
    };
    let now = f.now.unwrap_or_else(SystemTime::now);
    if let Some(why) = svid_problem(&f.pod_id, id, now) {
        let fix = match why.contains("clock skew") {
            true => "check the node's clock against the CA's",
            false => "check the identity provider (aether check: CA/SVID) and the agent's log",
        };
        return hop("identity", Status::Fail, why, fix);
    }
    if let Some((pod, spiffe_id)) = id
        .local_destinations
        .iter()
        .find(|(_, s)| !id.expected_sans.contains(s))
    {
        return hop(
            "identity",
            Status::Fail,
            format!(
                "SAN mismatch: destination pod {pod} presents {spiffe_id}, but callers pin {}",
                list(&id.expected_sans)
            ),
            "run the destination under a service account its registration names, or fix the endpoint's registration",
        );
    }
    if let Some(hop) = remote_destinations(id) {
        return hop;
    }
    let svid = id.svid.as_ref().expect("checked by svid_problem");
    ok(
        "identity",
        format!(
            "SVID {} valid for {}; destination pinned to {}",
            svid.spiffe_id,
            ago(svid.not_after, now),
            list(&id.expected_sans)
        ),
    )
}

/// The destination pods on other nodes: one presenting an identity the callers do not
/// pin fails the hop; one that could not be asked is a warning.
fn remote_destinations(id: &IdentityFacts) -> Option<Hop> {
    let remote = &id.remote_destinations;
    if let Some((r, presented)) = remote.iter().find_map(|r| {
        let presented = r.presented.as_ref().ok()?;
        (!id.expected_sans.contains(presented)).then_some((r, presented))
    }) {
        return Some(hop(
            "identity",
            Status::Fail,
            format!(
                "SAN mismatch: destination pod {} on node {} presents {presented}, but callers pin {}",
                r.address,
                r.node,
                list(&id.expected_sans)
            ),
            "run the destination under a service account its registration names, or fix the endpoint's registration",
        ));
    }
    let (r, error) = remote.iter().find_map(|r| r.presented.as_ref().err().map(|e| (r, e)))?;
    Some(hop(
        "identity",
        Status::Warn,
        format!(
            "destination pod {} on node {} could not be asked who it is: {error}",
            r.address, r.node
        ),
        "check that pod and its node's agent (aether status there)",
    ))
}

/// Why the source pod's SVID cannot be used now, if it cannot.
fn svid_problem(pod: &str, id: &IdentityFacts, now: SystemTime) -> Option<String> {
    let Some(svid) = &id.svid else {
        return Some(format!("{pod} has no SVID: its calls cannot leave with mTLS"));
    };
    if svid.not_after <= now {
        let ago = ago(now, svid.not_after);
        return Some(format!("{pod}'s SVID {} expired {ago} ago", svid.spiffe_id));
    }
    if svid.not_before > now {
        let wait = ago(svid.not_before, now);
        return Some(format!("{pod}'s SVID is not valid for another {wait} (clock skew?)"));
    }
    (!id.secret_acked).then(|| format!("Envoy does not hold {pod}'s SVID yet"))
}

fn authorization(f: &Facts) -> Hop {
    use aether_api::authorization::{Cause, Verdict};
    let Some(a) = &f.authorization else {
        return skipped("authorization");
    };
    let fix =
        "change the policy (or the caller's identity); `aether_agent_authorization_decisions_total` counts its denials";
    // Said alike whether a logged denial or the node's own judgement names it.
    let default_deny = "the target's namespace denies by default (MeshConfig defaultAction DENY)";
    if let Some(d) = &a.recent_denial {
        let mut why = format!(
            "{} denied {} {} from {}: {}",
            d.pod,
            d.method,
            d.path,
            d.source,
            d.decided_by()
        );
        if a.default_deny && d.policy.is_empty() {
            why.push_str(&format!("; {default_deny}"));
        }
        return hop("authorization", Status::Fail, &why, fix);
    }
    let name = |p: &aether_api::authorization::PolicyRule| format!("policy {} rule {}", p.policy, p.rule);
    let unjudged = match a.unjudged.is_empty() {
        true => String::new(),
        false => format!("; not judged here (label selectors): {}", list(&a.unjudged)),
    };
    let forbidden = f.recent_failures.iter().any(|r| r.status == 403);
    match &a.decided {
        Some(d) if d.verdict == Verdict::Deny => {
            let why = match &d.cause {
                Cause::Denied(p) => format!("denied by {}", name(p)),
                _ if a.default_deny => format!("no ALLOW policy allows the call, and {default_deny}"),
                _ => "no ALLOW policy selecting the target matches the call".to_owned(),
            };
            hop("authorization", Status::Fail, format!("{why}{unjudged}"), fix)
        }
        _ if forbidden => hop(
            "authorization",
            Status::Warn,
            "the destination answered 403 recently: its authorization may deny the call",
            "the destination node's agent logs the policy and rule (`authorization:` lines)",
        ),
        Some(d) => {
            let why = match &d.cause {
                Cause::Allowed(p) => format!("allowed by {}", name(p)),
                _ => "no ALLOW policy selects the target".to_owned(),
            };
            let status = if unjudged.is_empty() { Status::Ok } else { Status::Warn };
            hop("authorization", status, format!("{why}{unjudged}"), "")
        }
        None => hop(
            "authorization",
            Status::Skip,
            "not judged: this node holds no policies of the target's namespace",
            "",
        ),
    }
}

fn skipped(name: &'static str) -> Hop {
    hop(name, Status::Skip, "not checked", "")
}

fn list<T: std::fmt::Display>(items: &[T]) -> String {
    items.iter().map(T::to_string).collect::<Vec<_>>().join(", ")
}

/// `later - earlier`, rounded to seconds, human-readable.
fn ago(later: SystemTime, earlier: SystemTime) -> String {
    let d = later.duration_since(earlier).unwrap_or_default();
    let s = Duration::from_secs(d.as_secs()).as_secs();
    match s {
        0..120 => format!("{s}s"),
        120..7200 => format!("{}m", s / 60),
        _ => format!("{}h", s / 3600),
    }
}

#[cfg(test)]
mod tests;
