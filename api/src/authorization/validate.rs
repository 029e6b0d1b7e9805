//! Re-checks a projected policy (from a store or a stream, which could carry anything):
//! what the agent compiles must never make Envoy NACK, and must mean what the projector
//! meant. Field paths are the proto's. Also the one check that needs the catalog:
//! [`l7_on_non_http`].

use aether_proto::registry::v1::{
    AuthorizationAction, AuthorizationOperation, AuthorizationPattern, AuthorizationPolicy, AuthorizationRule,
    AuthorizationSource, PatternKind,
};

use super::check::{self, PatternText, limits};
use super::{Refusal, at};

fn ensure(ok: bool, field: impl Into<String>, message: &str) -> Result<(), Refusal> {
    if ok { Ok(()) } else { Err(Refusal::new(field, message)) }
}

/// Checks the invariants every projection holds.
pub fn validate(policy: &AuthorizationPolicy) -> Result<(), Refusal> {
    at("namespace", crate::route::check::label(&policy.namespace))?;
    at("name", crate::route::check::subdomain(&policy.name))?;
    let action = policy.action();
    ensure(action != AuthorizationAction::Unspecified, "action", "is unspecified")?;
    ensure(
        !(policy.dry_run && action == AuthorizationAction::Audit),
        "dry_run",
        "is set on an AUDIT policy",
    )?;
    let Some(target) = &policy.target else {
        return Err(Refusal::new("target", "is unset"));
    };
    ensure(
        target.match_labels.is_empty() || target.services.is_empty(),
        "target",
        "selects by labels and by services",
    )?;
    ensure(
        !target.mesh_wide || target.services.is_empty(),
        "target.services",
        "is set on a mesh-wide policy",
    )?;
    ensure(
        target.match_labels.len() <= limits::LABELS,
        "target.match_labels",
        "holds more than 32",
    )?;
    for (key, value) in &target.match_labels {
        at("target.match_labels", check::label(key, value))?;
    }
    ensure(
        target.services.len() <= limits::TARGET_REFS,
        "target.services",
        "holds more than 16",
    )?;
    ensure(
        target.external_services.is_empty()
            || (target.services.is_empty() && target.match_labels.is_empty() && !target.mesh_wide),
        "target.external_services",
        "is set with pods or services selected",
    )?;
    ensure(
        target.external_services.len() <= limits::TARGET_REFS,
        "target.external_services",
        "holds more than 16",
    )?;
    for (list, name) in [
        (&target.services, "services"),
        (&target.external_services, "external_services"),
    ] {
        for (i, service) in list.iter().enumerate() {
            let field = format!("target.{name}[{i}]");
            at(&field, crate::route::check::service_key(service))?;
            let own = service.split_once('/').is_some_and(|(ns, _)| ns == policy.namespace);
            ensure(own, field, "is not in the policy's namespace")?;
        }
    }
    rules(&policy.rules, "rules")
}

/// A projected rule list at `field` (HTTPFilter's `rbac.rules` too).
pub(crate) fn rules(rules: &[AuthorizationRule], field: &str) -> Result<(), Refusal> {
    ensure(rules.len() <= limits::RULES, field, "holds more than 64")?;
    for (i, rule) in rules.iter().enumerate() {
        let field = format!("{field}[{i}]");
        ensure(
            rule.from.len() <= limits::FROM_PER_RULE,
            format!("{field}.from"),
            "holds more than 16",
        )?;
        ensure(
            rule.to.len() <= limits::TO_PER_RULE,
            format!("{field}.to"),
            "holds more than 16",
        )?;
        for (j, from) in rule.from.iter().enumerate() {
            source(from, &format!("{field}.from[{j}]"))?;
        }
        for (j, to) in rule.to.iter().enumerate() {
            operation(to, &format!("{field}.to[{j}]"))?;
        }
    }
    Ok(())
}

/// Each value of a list must pass `one`.
fn each<T>(field: &str, list: &[T], one: impl Fn(&T) -> Result<(), String>) -> Result<(), Refusal> {
    ensure(list.len() <= limits::VALUES, field, "holds more than 64")?;
    (list.iter().enumerate()).try_for_each(|(i, v)| at(format!("{field}[{i}]"), one(v)))
}

/// A pattern must read back as itself (a `*` inside the value would change its meaning)
/// and pass the field's check.
fn pattern(p: &AuthorizationPattern, check: fn(&AuthorizationPattern) -> Result<(), String>) -> Result<(), String> {
    let any_is_empty = p.kind() != PatternKind::Any || p.value.is_empty();
    let round_trip = check::pattern(&p.to_text()).is_ok_and(|q| q == *p);
    if !any_is_empty || !round_trip {
        return Err(format!("{:?} is not a pattern the projector writes", p.to_text()));
    }
    check(p)
}

fn source(s: &AuthorizationSource, field: &str) -> Result<(), Refusal> {
    let principal = |p: &AuthorizationPattern| pattern(p, check::principal);
    each(&format!("{field}.principals"), &s.principals, principal)?;
    each(&format!("{field}.not_principals"), &s.not_principals, principal)?;
    let account = |a: &String| check::service_account(a);
    each(&format!("{field}.service_accounts"), &s.service_accounts, account)?;
    each(
        &format!("{field}.not_service_accounts"),
        &s.not_service_accounts,
        account,
    )?;
    let namespace = |n: &String| check::namespace(n);
    each(&format!("{field}.namespaces"), &s.namespaces, namespace)?;
    each(&format!("{field}.not_namespaces"), &s.not_namespaces, namespace)?;
    let block = |b: &String| check::canonical_ip_block(b);
    each(&format!("{field}.ip_blocks"), &s.ip_blocks, block)?;
    each(&format!("{field}.not_ip_blocks"), &s.not_ip_blocks, block)
}

fn operation(o: &AuthorizationOperation, field: &str) -> Result<(), Refusal> {
    let port = |p: &u32| check::port(i64::from(*p)).map(drop);
    each(&format!("{field}.ports"), &o.ports, port)?;
    each(&format!("{field}.not_ports"), &o.not_ports, port)?;
    let method = |m: &String| check::method(m);
    each(&format!("{field}.methods"), &o.methods, method)?;
    each(&format!("{field}.not_methods"), &o.not_methods, method)?;
    let path = |p: &AuthorizationPattern| pattern(p, check::path);
    each(&format!("{field}.paths"), &o.paths, path)?;
    each(&format!("{field}.not_paths"), &o.not_paths, path)?;
    let host = |p: &AuthorizationPattern| pattern(p, check::host);
    each(&format!("{field}.hosts"), &o.hosts, host)?;
    each(&format!("{field}.not_hosts"), &o.not_hosts, host)
}

/// The first L7 field (methods, paths, hosts or their `not_*` forms) of `policy` that
/// applies to a port `is_http` says is not HTTP, as a refusal on that field. An operation
/// without `ports` applies to every port of the workload: `workload_ports`, the ports of
/// the selected pod as the catalog knows them.
///
/// The projector cannot run this check (a port's protocol is the catalog's), so the
/// enforcer runs it per selected workload and refuses the policy there, loudly, instead
/// of compiling a rule a TCP connection could never match (a silent deny for ALLOW, a
/// silent allow for DENY).
pub fn l7_on_non_http(
    policy: &AuthorizationPolicy,
    workload_ports: &[u32],
    is_http: impl Fn(u32) -> bool,
) -> Option<Refusal> {
    for (i, rule) in policy.rules.iter().enumerate() {
        for (j, to) in rule.to.iter().enumerate() {
            let Some(l7_field) = first_l7_field(to) else {
                continue;
            };
            let ports = if to.ports.is_empty() { workload_ports } else { &to.ports };
            let not_excluded = |port: &&u32| !to.not_ports.contains(port);
            if let Some(port) = ports.iter().filter(not_excluded).find(|p| !is_http(**p)) {
                let message = format!(
                    "port {port} is not an HTTP port, so HTTP fields cannot be checked on it \
                     (restrict the operation's ports to HTTP ones)"
                );
                return Some(Refusal::new(format!("rules[{i}].to[{j}].{l7_field}"), message));
            }
        }
    }
    None
}

fn first_l7_field(o: &AuthorizationOperation) -> Option<&'static str> {
    [
        ("methods", o.methods.is_empty()),
        ("not_methods", o.not_methods.is_empty()),
        ("paths", o.paths.is_empty()),
        ("not_paths", o.not_paths.is_empty()),
        ("hosts", o.hosts.is_empty()),
        ("not_hosts", o.not_hosts.is_empty()),
    ]
    .into_iter()
    .find_map(|(name, empty)| (!empty).then_some(name))
}
