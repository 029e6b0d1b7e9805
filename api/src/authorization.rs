//! THE authorization projector: a `security.aether.io/v1alpha1` AuthorizationPolicy,
//! validated and projected once into `aether.registry.v1.AuthorizationPolicy`. The
//! registrar's sources, the agent (re-validating what it received) and the admission
//! webhooks call these functions, so they agree on what a policy means; [`decide`] is
//! what a policy set means for one request, the oracle of the enforcer's tests and of
//! `aether explain` (proposals/013).
//!
//! One check cannot happen here: L7 fields (methods, paths, hosts) need an HTTP port, and
//! only the catalog knows a port's protocol. The enforcer calls [`l7_on_non_http`] with it.

use std::collections::BTreeMap;

use aether_common::quote::quote;

use aether_proto::registry::v1::{
    AuthorizationAction, AuthorizationOperation, AuthorizationPattern, AuthorizationPolicy as Projected,
    AuthorizationRule, AuthorizationSource, AuthorizationTarget,
};

pub mod check;
mod decide;
mod object;
mod validate;
mod yaml;

use check::limits;
pub use decide::{
    AuthzRequest, Cause, Decision, HttpRequest, PolicyRule, Verdict, Workload, decide, decide_egress, guards_external,
    namespace_prefix, selects, service_account_id,
};
pub use object::*;
pub(crate) use validate::rules as validate_rules;
pub use validate::{l7_on_non_http, validate};
pub use yaml::{from_documents, parse_documents};

/// The namespace whose policies apply to every namespace, unless configured otherwise.
pub const DEFAULT_ROOT_NAMESPACE: &str = "aether-system";

pub use crate::refusal::Refusal;
pub(crate) use crate::refusal::{Field, at};

/// What the projector needs to know about the mesh.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProjectOptions {
    /// Policies in this namespace apply mesh-wide.
    pub root_namespace: String,
}

impl Default for ProjectOptions {
    fn default() -> Self {
        Self {
            root_namespace: DEFAULT_ROOT_NAMESPACE.to_owned(),
        }
    }
}

/// Validates a policy object and projects it; a refusal names the first field at fault.
/// A policy is never half-projected: one bad value refuses all of it.
pub fn project(object: &AuthorizationPolicy, options: &ProjectOptions) -> Result<Projected, Refusal> {
    let meta = &object.metadata;
    let namespace = meta.namespace.as_deref().unwrap_or(crate::route::DEFAULT_NAMESPACE);
    let name = meta.name.as_deref().unwrap_or_default();
    at("metadata.namespace", crate::route::check::label(namespace))?;
    at("metadata.name", crate::route::check::subdomain(name))?;
    let spec = &object.spec;
    unsupported("spec", &spec.unsupported)?;
    let action = match &spec.action {
        Action::Allow => AuthorizationAction::Allow,
        Action::Deny => AuthorizationAction::Deny,
        Action::Audit => AuthorizationAction::Audit,
        Action::Other(other) => return Err(unknown_action(other)),
    };
    if spec.dry_run && action == AuthorizationAction::Audit {
        let message = "an AUDIT policy never changes a verdict, so it has no dry run";
        return Err(Refusal::new("spec.dryRun", message));
    }
    let target = target(spec, namespace, options)?;
    bounded("spec.rules", spec.rules.len(), limits::RULES)?;
    let rules_field = Field::root("spec.rules");
    let rules = spec.rules.iter().enumerate();
    let rules = rules.map(|(i, r)| rule(r, &rules_field.index(i)));
    Ok(Projected {
        namespace: namespace.to_owned(),
        name: name.to_owned(),
        generation: meta.generation.unwrap_or(0),
        target: Some(target),
        action: action.into(),
        dry_run: spec.dry_run,
        rules: rules.collect::<Result<_, _>>()?,
    })
}

fn unknown_action(other: &str) -> Refusal {
    let hint = if other == "CUSTOM" {
        " (external authorization is an HTTPFilter ext_authz)"
    } else {
        ""
    };
    let message = format!("{} is not ALLOW, DENY or AUDIT{hint}", quote(other));
    Refusal::new("spec.action", message)
}

/// A field this version does not know: refused, never ignored (ignoring a condition would
/// change what the policy matches).
fn unsupported(field: impl std::fmt::Display, extra: &Unsupported) -> Result<(), Refusal> {
    match extra.keys().next() {
        None => Ok(()),
        Some(key) => Err(Refusal::new(
            format!("{field}.{key}"),
            "is not a field of security.aether.io/v1alpha1 AuthorizationPolicy",
        )),
    }
}

fn bounded(field: impl std::fmt::Display, len: usize, max: usize) -> Result<(), Refusal> {
    if len > max {
        return Err(Refusal::new(field.to_string(), format!("holds {len} (at most {max})")));
    }
    Ok(())
}

fn target(
    spec: &AuthorizationPolicySpec,
    namespace: &str,
    options: &ProjectOptions,
) -> Result<AuthorizationTarget, Refusal> {
    let mesh_wide = namespace == options.root_namespace;
    let labels = spec.selector.as_ref().map(|s| &s.match_labels);
    if let Some(selector) = &spec.selector {
        unsupported("spec.selector", &selector.unsupported)?;
    }
    let labels = labels.cloned().unwrap_or_default();
    if !labels.is_empty() && !spec.target_refs.is_empty() {
        let message = "is set with spec.selector: a policy targets either pods by label or Services";
        return Err(Refusal::new("spec.targetRefs", message));
    }
    if mesh_wide && !spec.target_refs.is_empty() {
        let message = format!(
            "a policy in the mesh root namespace {} applies mesh-wide; put a policy on Services in their namespace",
            quote(namespace)
        );
        return Err(Refusal::new("spec.targetRefs", message));
    }
    bounded("spec.selector.matchLabels", labels.len(), limits::LABELS)?;
    for (key, value) in &labels {
        at(
            format!("spec.selector.matchLabels[{}]", quote(key)),
            check::label(key, value),
        )?;
    }
    bounded("spec.targetRefs", spec.target_refs.len(), limits::TARGET_REFS)?;
    let (mut services, mut external_services) = (Vec::new(), Vec::new());
    for (i, target) in spec.target_refs.iter().enumerate() {
        let field = format!("spec.targetRefs[{i}]");
        let (key, external) = target_ref(target, namespace, &field)?;
        let (list, other) = match external {
            false => (&mut services, &external_services),
            true => (&mut external_services, &services),
        };
        if !other.is_empty() {
            let message = "mixes Services and ExternalServices: a policy guards either pods of the mesh or calls to destinations outside it";
            return Err(Refusal::new(format!("{field}.kind"), message));
        }
        if !list.contains(&key) {
            list.push(key);
        }
    }
    Ok(AuthorizationTarget {
        mesh_wide,
        match_labels: labels.into_iter().collect(),
        services,
        external_services,
    })
}

/// A Service or an ExternalService of the policy's namespace, as a service key, and
/// whether it is external.
fn target_ref(target: &TargetRef, namespace: &str, field: &str) -> Result<(String, bool), Refusal> {
    unsupported(field, &target.unsupported)?;
    let core = (target.group.is_empty() || target.group == "core") && target.kind == "Service";
    let external = target.group == crate::external_service::GROUP && target.kind == crate::external_service::KIND;
    if !core && !external {
        let message = format!(
            "{}/{} is neither a core Service nor a networking.aether.io ExternalService (the kinds a policy targets)",
            quote(&target.group),
            quote(&target.kind)
        );
        return Err(Refusal::new(format!("{field}.kind"), message));
    }
    at(format!("{field}.name"), crate::route::check::label(&target.name))?;
    Ok((format!("{namespace}/{}", target.name), external))
}

/// One rule, projected; `field` is where it is (HTTPFilter's `spec.rbac.rules[i]` too).
pub(crate) fn rule(rule: &Rule, field: &Field) -> Result<AuthorizationRule, Refusal> {
    unsupported(field, &rule.unsupported)?;
    let (from_field, to_field) = (field.name("from"), field.name("to"));
    bounded(from_field, rule.from.len(), limits::FROM_PER_RULE)?;
    bounded(to_field, rule.to.len(), limits::TO_PER_RULE)?;
    let from = rule.from.iter().enumerate().map(|(i, from)| {
        let at_i = from_field.index(i);
        unsupported(at_i, &from.unsupported)?;
        source(&from.source, &at_i.name("source"))
    });
    let to = rule.to.iter().enumerate().map(|(i, to)| {
        let at_i = to_field.index(i);
        unsupported(at_i, &to.unsupported)?;
        operation(&to.operation, &at_i.name("operation"))
    });
    Ok(AuthorizationRule {
        from: from.collect::<Result<_, _>>()?,
        to: to.collect::<Result<_, _>>()?,
    })
}

/// Each value of a list checked and projected, the field naming the value's index.
fn each<T, U>(field: Field, list: &[T], one: impl Fn(&T) -> Result<U, String>) -> Result<Vec<U>, Refusal> {
    bounded(field, list.len(), limits::VALUES)?;
    let values = list.iter().enumerate();
    values.map(|(i, v)| at(field.index(i), one(v))).collect()
}

fn patterns(
    field: Field,
    list: &[String],
    normalise: fn(&str) -> String,
    check: fn(&AuthorizationPattern) -> Result<(), String>,
) -> Result<Vec<AuthorizationPattern>, Refusal> {
    each(field, list, |text| {
        let pattern = check::pattern(&normalise(text))?;
        check(&pattern).map(|()| pattern)
    })
}

fn source(source: &Source, field: &Field) -> Result<AuthorizationSource, Refusal> {
    unsupported(field, &source.unsupported)?;
    let as_is = |s: &str| s.to_owned();
    let exact = |name: &str, list: &[String], check: fn(&str) -> Result<(), String>| {
        each(field.name(name), list, |v| check(v).map(|()| v.clone()))
    };
    let ip_blocks = |name: &str, list: &[String]| each(field.name(name), list, |v| check::ip_block(v));
    let principals = |name: &str, list: &[String]| patterns(field.name(name), list, as_is, check::principal);
    Ok(AuthorizationSource {
        principals: principals("principals", &source.principals)?,
        not_principals: principals("notPrincipals", &source.not_principals)?,
        service_accounts: exact("serviceAccounts", &source.service_accounts, check::service_account)?,
        not_service_accounts: exact(
            "notServiceAccounts",
            &source.not_service_accounts,
            check::service_account,
        )?,
        namespaces: exact("namespaces", &source.namespaces, check::namespace)?,
        not_namespaces: exact("notNamespaces", &source.not_namespaces, check::namespace)?,
        ip_blocks: ip_blocks("ipBlocks", &source.ip_blocks)?,
        not_ip_blocks: ip_blocks("notIpBlocks", &source.not_ip_blocks)?,
    })
}

fn operation(operation: &Operation, field: &Field) -> Result<AuthorizationOperation, Refusal> {
    unsupported(field, &operation.unsupported)?;
    let as_is = |s: &str| s.to_owned();
    let lower = |s: &str| s.to_ascii_lowercase();
    let ports = |name: &str, list: &[i64]| each(field.name(name), list, |p| check::port(*p));
    let methods = |name: &str, list: &[String]| each(field.name(name), list, |m| check::method(m).map(|()| m.clone()));
    let paths = |name: &str, list: &[String]| patterns(field.name(name), list, as_is, check::path);
    let hosts = |name: &str, list: &[String]| patterns(field.name(name), list, lower, check::host);
    Ok(AuthorizationOperation {
        ports: ports("ports", &operation.ports)?,
        not_ports: ports("notPorts", &operation.not_ports)?,
        methods: methods("methods", &operation.methods)?,
        not_methods: methods("notMethods", &operation.not_methods)?,
        paths: paths("paths", &operation.paths)?,
        not_paths: paths("notPaths", &operation.not_paths)?,
        hosts: hosts("hosts", &operation.hosts)?,
        not_hosts: hosts("notHosts", &operation.not_hosts)?,
    })
}

/// `<namespace>/<name>`, the key of a projected policy.
pub fn key(policy: &Projected) -> String {
    format!("{}/{}", policy.namespace, policy.name)
}

/// The labels a [`Projected`] target selects by, ordered (the proto's map is a HashMap).
pub fn match_labels(target: &AuthorizationTarget) -> BTreeMap<&str, &str> {
    let labels = target.match_labels.iter();
    labels.map(|(k, v)| (k.as_str(), v.as_str())).collect()
}
