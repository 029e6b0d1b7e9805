//! What a set of policies decides for one request: the reference semantics (proposals/013)
//! that the enforcer's Envoy config must reproduce, used as the oracle of its tests and by
//! `aether explain`. Pure, and independent of the order policies are given in (ties are
//! broken by `<namespace>/<name>`, then rule index).
//!
//! 1. Only policies that select the destination workload count ([`selects`]).
//! 2. A matching enforced DENY policy denies.
//! 3. Else, with no enforced ALLOW policy selecting the workload, the request is allowed.
//! 4. Else it is allowed only if some enforced ALLOW policy matches.
//!
//! AUDIT policies and dry-run policies never change the verdict: AUDIT matches are listed,
//! and when a dry-run policy selects the workload the verdict it would give, enforced, is
//! reported beside the real one.

use std::collections::BTreeMap;
use std::net::IpAddr;

use aether_proto::registry::v1::{
    AuthorizationAction, AuthorizationOperation, AuthorizationPattern, AuthorizationPolicy, AuthorizationRule,
    AuthorizationSource, PatternKind,
};
use ipnet::IpNet;

/// The destination pod, as the catalog knows it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Workload {
    pub namespace: String,
    pub labels: BTreeMap<String, String>,
    /// Service keys `<namespace>/<name>` the pod is an endpoint of.
    pub services: Vec<String>,
}

/// One connection (TCP) or request (HTTP) arriving at a workload's inbound listener.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AuthzRequest {
    pub workload: Workload,
    /// The caller's verified SPIFFE ID; `None` for plaintext.
    pub principal: Option<String>,
    /// The mesh's trust domain: service accounts and namespaces are of it.
    pub trust_domain: String,
    /// The address the connection comes from.
    pub peer_ip: IpAddr,
    /// The workload's port the caller asked for.
    pub port: u32,
    /// `None` on a TCP port.
    pub http: Option<HttpRequest>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HttpRequest {
    pub method: String,
    /// As sent, query included (it is not matched).
    pub path: String,
    /// `:authority`, port included or not.
    pub host: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Verdict {
    Allow,
    Deny,
}

/// A rule of a policy: what a decision names.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct PolicyRule {
    /// `<namespace>/<name>`.
    pub policy: String,
    /// Index in the policy's `rules`.
    pub rule: usize,
}

/// Why the verdict is what it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Cause {
    /// This DENY rule matched.
    Denied(PolicyRule),
    /// This ALLOW rule matched.
    Allowed(PolicyRule),
    /// No ALLOW policy selects the workload (and no DENY matched).
    NoAllowPolicy,
    /// ALLOW policies select the workload and none matched.
    NoAllowMatched,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    pub verdict: Verdict,
    pub cause: Cause,
    /// The AUDIT rules that matched, first rule of each policy.
    pub audited: Vec<PolicyRule>,
    /// When a dry-run policy selects the workload: the verdict and cause with dry-run
    /// policies enforced too.
    pub dry_run: Option<(Verdict, Cause)>,
}

/// Whether `policy` applies to `workload` (as a destination: a policy guarding calls to
/// external services selects no workload, see [`guards_external`]).
pub fn selects(policy: &AuthorizationPolicy, workload: &Workload) -> bool {
    let Some(target) = &policy.target else {
        return false;
    };
    if !target.external_services.is_empty() {
        return false;
    }
    let in_scope = target.mesh_wide || policy.namespace == workload.namespace;
    let labels = (target.match_labels.iter()).all(|(k, v)| workload.labels.get(k) == Some(v));
    let services = target.services.is_empty() || target.services.iter().any(|s| workload.services.contains(s));
    in_scope && labels && services
}

/// Whether `policy` guards calls to the external service `key`.
pub fn guards_external(policy: &AuthorizationPolicy, key: &str) -> bool {
    (policy.target.as_ref()).is_some_and(|t| t.external_services.iter().any(|s| s == key))
}

/// What the policies guarding the external service `external` decide for a call to it
/// (the callers' side, proposals/017): `request.principal` is the calling pod's SPIFFE ID,
/// `peer_ip` its address, `port` the external service's port; the workload is not read.
/// Steps 2 to 4 as for a workload, with the AUDIT matches and the dry-run verdict as
/// [`decide`]'s. On a TCP port an operation naming HTTP fields cannot be judged and fails
/// closed: it matches (by its ports) in a DENY policy and never in an ALLOW one.
pub fn decide_egress(policies: &[&AuthorizationPolicy], external: &str, request: &AuthzRequest) -> Decision {
    let mut guarding: Vec<AuthorizationPolicy> = (policies.iter())
        .filter(|p| guards_external(p, external))
        .map(|p| match request.http {
            Some(_) => (*p).clone(),
            None => on_tcp(p),
        })
        .collect();
    guarding.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    judge(guarding.iter(), request)
}

/// `policy` as judged on a TCP port: a DENY operation's HTTP fields are dropped (it
/// denies every connection its ports name), an ALLOW (or AUDIT) operation with HTTP fields
/// is dropped (it matches none; a rule left without operations can match nothing).
fn on_tcp(policy: &AuthorizationPolicy) -> AuthorizationPolicy {
    let deny = policy.action() == AuthorizationAction::Deny;
    let l7 = |o: &AuthorizationOperation| {
        [&o.methods, &o.not_methods].iter().any(|l| !l.is_empty())
            || [&o.paths, &o.not_paths, &o.hosts, &o.not_hosts]
                .iter()
                .any(|l| !l.is_empty())
    };
    let mut policy = policy.clone();
    policy.rules.retain_mut(|rule| {
        if rule.to.is_empty() {
            return true;
        }
        if deny {
            for o in &mut rule.to {
                (o.methods, o.not_methods) = (Vec::new(), Vec::new());
                (o.paths, o.not_paths, o.hosts, o.not_hosts) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            }
            return true;
        }
        rule.to.retain(|o| !l7(o));
        !rule.to.is_empty()
    });
    policy
}

/// What `policies` decide for `request`.
pub fn decide(policies: &[&AuthorizationPolicy], request: &AuthzRequest) -> Decision {
    let mut selected: Vec<_> = (policies.iter().copied())
        .filter(|p| selects(p, &request.workload))
        .collect();
    selected.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    judge(selected.into_iter(), request)
}

/// The decision of `policies` (all applying, in key order): the enforced verdict, the
/// AUDIT matches, and the verdict with dry-run policies enforced too.
fn judge<'a>(policies: impl Iterator<Item = &'a AuthorizationPolicy> + Clone, request: &AuthzRequest) -> Decision {
    let enforced = policies.clone().filter(|p| !p.dry_run);
    let (verdict, cause) = verdict(enforced, request);
    let audited = (policies.clone())
        .filter(|p| p.action() == AuthorizationAction::Audit)
        .filter_map(|p| first_match(p, request))
        .collect();
    let dry_run = (policies.clone().any(|p| p.dry_run)).then(|| self::verdict(policies, request));
    Decision {
        verdict,
        cause,
        audited,
        dry_run,
    }
}

/// Steps 2 to 4 over `policies`, all selecting the workload, in key order.
fn verdict<'a>(
    policies: impl Iterator<Item = &'a AuthorizationPolicy> + Clone,
    request: &AuthzRequest,
) -> (Verdict, Cause) {
    let of = |action: AuthorizationAction| policies.clone().filter(move |p| p.action() == action);
    if let Some(rule) = of(AuthorizationAction::Deny).find_map(|p| first_match(p, request)) {
        return (Verdict::Deny, Cause::Denied(rule));
    }
    let mut allows = of(AuthorizationAction::Allow).peekable();
    if allows.peek().is_none() {
        return (Verdict::Allow, Cause::NoAllowPolicy);
    }
    match allows.find_map(|p| first_match(p, request)) {
        Some(rule) => (Verdict::Allow, Cause::Allowed(rule)),
        None => (Verdict::Deny, Cause::NoAllowMatched),
    }
}

/// The policy's first rule that matches; none for a policy without rules.
fn first_match(policy: &AuthorizationPolicy, request: &AuthzRequest) -> Option<PolicyRule> {
    let rule = policy.rules.iter().position(|r| rule_matches(r, request))?;
    Some(PolicyRule {
        policy: super::key(policy),
        rule,
    })
}

/// Some source and some operation match; an empty list matches everything.
fn rule_matches(rule: &AuthorizationRule, request: &AuthzRequest) -> bool {
    let from = rule.from.is_empty() || rule.from.iter().any(|s| source_matches(s, request));
    let to = rule.to.is_empty() || rule.to.iter().any(|o| operation_matches(o, request));
    from && to
}

/// Every field set holds: a list holds when a value matches, a `not_*` list when none does.
fn holds<T>(list: &[T], not_list: &[T], matches: impl Fn(&T) -> bool) -> bool {
    (list.is_empty() || list.iter().any(&matches)) && !not_list.iter().any(matches)
}

fn source_matches(s: &AuthorizationSource, request: &AuthzRequest) -> bool {
    let principal = request.principal.as_deref();
    let td = &request.trust_domain;
    holds(&s.principals, &s.not_principals, |p| {
        principal.is_some_and(|id| pattern_matches(p, id))
    }) && holds(&s.service_accounts, &s.not_service_accounts, |a| {
        principal == Some(service_account_id(a, td).as_str())
    }) && holds(&s.namespaces, &s.not_namespaces, |n| {
        principal.is_some_and(|id| id.starts_with(&namespace_prefix(n, td)))
    }) && holds(&s.ip_blocks, &s.not_ip_blocks, |b| {
        b.parse::<IpNet>().is_ok_and(|net| net.contains(&request.peer_ip))
    })
}

/// The SPIFFE ID of service account `<ns>/<sa>`: in the mesh's own trust domain, never
/// a federated one (a workload of another trust domain is not one of ours, whatever
/// its path says).
pub fn service_account_id(account: &str, trust_domain: &str) -> String {
    let (ns, sa) = account.split_once('/').unwrap_or_default();
    format!("spiffe://{trust_domain}/ns/{ns}/sa/{sa}")
}

/// What the SPIFFE ID of every workload of namespace `ns` starts with.
pub fn namespace_prefix(ns: &str, trust_domain: &str) -> String {
    format!("spiffe://{trust_domain}/ns/{ns}/sa/")
}

fn operation_matches(o: &AuthorizationOperation, request: &AuthzRequest) -> bool {
    let ports = holds(&o.ports, &o.not_ports, |p| *p == request.port);
    let Some(http) = &request.http else {
        // L7 fields cannot be evaluated on TCP; the enforcer refuses such a policy
        // (l7_on_non_http), so this only states what an unchecked one would mean.
        let l7 = [&o.methods, &o.not_methods].iter().any(|l| !l.is_empty())
            || [&o.paths, &o.not_paths, &o.hosts, &o.not_hosts]
                .iter()
                .any(|l| !l.is_empty());
        return ports && !l7;
    };
    let path = http.path.split(['?', '#']).next().unwrap_or_default();
    let host = host_without_port(&http.host).to_ascii_lowercase();
    ports
        && holds(&o.methods, &o.not_methods, |m| *m == http.method)
        && holds(&o.paths, &o.not_paths, |p| pattern_matches(p, path))
        && holds(&o.hosts, &o.not_hosts, |p| pattern_matches(p, &host))
}

fn host_without_port(host: &str) -> &str {
    if host.starts_with('[') {
        return host.split_inclusive(']').next().unwrap_or(host);
    }
    match host.rsplit_once(':') {
        Some((name, port)) if !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => host,
    }
}

/// Whether `value` (present) matches the pattern.
fn pattern_matches(pattern: &AuthorizationPattern, value: &str) -> bool {
    match pattern.kind() {
        PatternKind::Exact => value == pattern.value,
        PatternKind::Prefix => value.starts_with(&pattern.value),
        PatternKind::Suffix => value.ends_with(&pattern.value),
        PatternKind::Any => true,
        PatternKind::Unspecified => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identities_hosts_and_patterns() {
        assert_eq!(service_account_id("shop/cart", "td"), "spiffe://td/ns/shop/sa/cart");
        assert_eq!(namespace_prefix("shop", "td"), "spiffe://td/ns/shop/sa/");
        assert_eq!(host_without_port("a.b:8080"), "a.b");
        assert_eq!(host_without_port("[::1]:80"), "[::1]");
        assert_eq!(host_without_port("a.b"), "a.b");
        let prefix = super::super::check::pattern("/api/*").unwrap();
        assert!(pattern_matches(&prefix, "/api/x") && !pattern_matches(&prefix, "/apix"));
    }
}
