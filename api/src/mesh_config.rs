//! THE MeshConfig projector: a `mesh.aether.io/v1alpha1` MeshConfig, validated and
//! projected once into `aether.registry.v1.MeshConfig` (proposals/016), and
//! [`effective`], how a namespace's settings come out of its own MeshConfig, the mesh's
//! and the agent's flags. The registrar's sources, the agent and the admission webhook
//! call these functions, so they agree on what a MeshConfig is and what it means.
//!
//! One MeshConfig per namespace, named `default`: the one in the mesh root namespace
//! holds the mesh-wide defaults, one elsewhere overrides them for its namespace, field by
//! field. What an object leaves unset projects as unset (the proto's UNSPECIFIED or an
//! absent optional) and inherits; the projector never fills a default in.

use aether_common::quote::quote;
use aether_proto::registry::v1::{
    AuthorizationAction, AuthorizationPolicy, AuthorizationTarget, DefaultAuthorization, InboundMtlsMode,
    MeshConfig as Projected, Resilience as ProjectedResilience,
};

use crate::authorization::{ProjectOptions, Unsupported};
use crate::pod::InboundMtls;

mod object;
mod yaml;

pub use object::*;
pub use yaml::{from_documents, parse_documents};

pub use crate::refusal::Refusal;
use crate::refusal::at;

/// The range of each resilience value, shared by [`project`] and [`validate`].
pub mod limits {
    use std::ops::RangeInclusive;

    pub const CONNECT_TIMEOUT_MS: RangeInclusive<u64> = 1..=60_000;
    /// 0 is no timeout; at most a day.
    pub const REQUEST_TIMEOUT_MS: RangeInclusive<u64> = 0..=86_400_000;
    pub const RETRY_ATTEMPTS: RangeInclusive<i64> = 0..=10;
    pub const CONSECUTIVE_GATEWAY_ERRORS: RangeInclusive<i64> = 0..=1_000;
    pub const MAX_EJECTION_PERCENT: RangeInclusive<i64> = 0..=100;
    pub const CIRCUIT_BREAKER: RangeInclusive<i64> = 1..=1_000_000;
}

/// Validates a MeshConfig object and projects it; a refusal names the first field at
/// fault. Never half-projected: one bad value refuses all of it.
pub fn project(object: &MeshConfig, options: &ProjectOptions) -> Result<Projected, Refusal> {
    let meta = &object.metadata;
    let namespace = meta.namespace.as_deref().unwrap_or(crate::route::DEFAULT_NAMESPACE);
    let name = meta.name.as_deref().unwrap_or_default();
    at("metadata.namespace", crate::route::check::label(namespace))?;
    check_name("metadata.name", name)?;
    let spec = &object.spec;
    unsupported("spec", &spec.unsupported)?;
    let inbound_mtls = match spec.mtls.as_ref() {
        None => InboundMtlsMode::Unspecified,
        Some(mtls) => {
            unsupported("spec.mtls", &mtls.unsupported)?;
            match &mtls.mode {
                None => InboundMtlsMode::Unspecified,
                Some(MtlsMode::Strict) => InboundMtlsMode::Strict,
                Some(MtlsMode::Permissive) => InboundMtlsMode::Permissive,
                Some(MtlsMode::Other(other)) => {
                    let message = format!("{} is not STRICT or PERMISSIVE", quote(other));
                    return Err(Refusal::new("spec.mtls.mode", message));
                }
            }
        }
    };
    let default_authorization = match spec.authorization.as_ref() {
        None => DefaultAuthorization::Unspecified,
        Some(authorization) => {
            unsupported("spec.authorization", &authorization.unsupported)?;
            match &authorization.default_action {
                None => DefaultAuthorization::Unspecified,
                Some(DefaultAction::Allow) => DefaultAuthorization::Allow,
                Some(DefaultAction::Deny) => DefaultAuthorization::Deny,
                Some(DefaultAction::Other(other)) => {
                    let message = format!("{} is not ALLOW or DENY", quote(other));
                    return Err(Refusal::new("spec.authorization.defaultAction", message));
                }
            }
        }
    };
    let resilience = spec.resilience.as_ref().map(resilience).transpose()?;
    let mesh_wide = namespace == options.root_namespace;
    let mesh_domain = spec.mesh_domain.clone().unwrap_or_default();
    if !mesh_domain.is_empty() && !mesh_wide {
        let message = format!(
            "is mesh-wide: set it in the MeshConfig of the mesh root namespace {}",
            quote(&options.root_namespace)
        );
        return Err(Refusal::new("spec.meshDomain", message));
    }
    if spec.mesh_domain.is_some() {
        at("spec.meshDomain", check_mesh_domain(&mesh_domain))?;
    }
    Ok(Projected {
        namespace: namespace.to_owned(),
        name: name.to_owned(),
        generation: meta.generation.unwrap_or(0),
        mesh_wide,
        inbound_mtls: inbound_mtls.into(),
        default_authorization: default_authorization.into(),
        resilience,
        mesh_domain,
    })
}

fn resilience(spec: &Resilience) -> Result<ProjectedResilience, Refusal> {
    let field = "spec.resilience";
    unsupported(field, &spec.unsupported)?;
    let duration = |name: &str, value: &Option<String>, range| -> Result<Option<u32>, Refusal> {
        let Some(text) = value else { return Ok(None) };
        let field = format!("{field}.{name}");
        let millis = at(&field, crate::duration::parse_millis(text).map_err(|e| e.to_string()))?;
        in_range(&field, millis, range).map(Some)
    };
    let mut projected = ProjectedResilience {
        connect_timeout_ms: duration("connectTimeout", &spec.connect_timeout, limits::CONNECT_TIMEOUT_MS)?,
        request_timeout_ms: duration("requestTimeout", &spec.request_timeout, limits::REQUEST_TIMEOUT_MS)?,
        ..Default::default()
    };
    if let Some(retries) = &spec.retries {
        let field = format!("{field}.retries");
        unsupported(&field, &retries.unsupported)?;
        projected.retry_attempts = number(&format!("{field}.attempts"), retries.attempts, limits::RETRY_ATTEMPTS)?;
    }
    if let Some(outlier) = &spec.outlier_detection {
        let field = format!("{field}.outlierDetection");
        unsupported(&field, &outlier.unsupported)?;
        let errors = format!("{field}.consecutiveGatewayErrors");
        projected.consecutive_gateway_errors = number(
            &errors,
            outlier.consecutive_gateway_errors,
            limits::CONSECUTIVE_GATEWAY_ERRORS,
        )?;
        let percent = format!("{field}.maxEjectionPercent");
        projected.max_ejection_percent = number(&percent, outlier.max_ejection_percent, limits::MAX_EJECTION_PERCENT)?;
    }
    if let Some(breaker) = &spec.circuit_breaker {
        let field = format!("{field}.circuitBreaker");
        unsupported(&field, &breaker.unsupported)?;
        let limit = |name: &str, value| number(&format!("{field}.{name}"), value, limits::CIRCUIT_BREAKER);
        projected.max_connections = limit("maxConnections", breaker.max_connections)?;
        projected.max_pending_requests = limit("maxPendingRequests", breaker.max_pending_requests)?;
        projected.max_requests = limit("maxRequests", breaker.max_requests)?;
    }
    Ok(projected)
}

/// Checks a projected MeshConfig (from a store or a stream) with the projector's rules;
/// the field named is the proto's.
pub fn validate(config: &Projected) -> Result<(), Refusal> {
    at("namespace", crate::route::check::label(&config.namespace))?;
    check_name("name", &config.name)?;
    if InboundMtlsMode::try_from(config.inbound_mtls).is_err() {
        return Err(Refusal::new(
            "inbound_mtls",
            format!("{} is not a mode", config.inbound_mtls),
        ));
    }
    if DefaultAuthorization::try_from(config.default_authorization).is_err() {
        let message = format!("{} is not an action", config.default_authorization);
        return Err(Refusal::new("default_authorization", message));
    }
    if !config.mesh_domain.is_empty() {
        if !config.mesh_wide {
            return Err(Refusal::new(
                "mesh_domain",
                "is set on a MeshConfig that is not mesh-wide",
            ));
        }
        at("mesh_domain", check_mesh_domain(&config.mesh_domain))?;
    }
    let Some(r) = &config.resilience else { return Ok(()) };
    let check = |field: &str, value: Option<u32>, range: std::ops::RangeInclusive<i64>| match value {
        Some(v) if !range.contains(&i64::from(v)) => Err(Refusal::new(
            format!("resilience.{field}"),
            format!("{v} is out of range ({} to {})", range.start(), range.end()),
        )),
        _ => Ok(()),
    };
    let wide = |range: std::ops::RangeInclusive<u64>| (*range.start() as i64)..=(*range.end() as i64);
    check(
        "connect_timeout_ms",
        r.connect_timeout_ms,
        wide(limits::CONNECT_TIMEOUT_MS),
    )?;
    check(
        "request_timeout_ms",
        r.request_timeout_ms,
        wide(limits::REQUEST_TIMEOUT_MS),
    )?;
    check("retry_attempts", r.retry_attempts, limits::RETRY_ATTEMPTS)?;
    check(
        "consecutive_gateway_errors",
        r.consecutive_gateway_errors,
        limits::CONSECUTIVE_GATEWAY_ERRORS,
    )?;
    check(
        "max_ejection_percent",
        r.max_ejection_percent,
        limits::MAX_EJECTION_PERCENT,
    )?;
    check("max_connections", r.max_connections, limits::CIRCUIT_BREAKER)?;
    check("max_pending_requests", r.max_pending_requests, limits::CIRCUIT_BREAKER)?;
    check("max_requests", r.max_requests, limits::CIRCUIT_BREAKER)
}

/// A namespace's settings, every one decided.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    /// For pods without their own `security.aether.io/inbound-mtls` annotation; `None`:
    /// no MeshConfig sets one, the node's flag decides.
    pub inbound_mtls: Option<InboundMtls>,
    /// [`DefaultAuthorization::Allow`] or [`DefaultAuthorization::Deny`].
    pub default_authorization: DefaultAuthorization,
    pub resilience: ResilienceSettings,
    /// The mesh-wide MeshConfig's domain, served next to the install-time one; `None`: it
    /// sets none.
    pub mesh_domain: Option<String>,
}

/// Resilience defaults for calls to one namespace's services, every one decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResilienceSettings {
    pub connect_timeout_ms: u32,
    /// 0: no timeout.
    pub request_timeout_ms: u32,
    pub retry_attempts: u32,
    /// 0: gateway errors never eject.
    pub consecutive_gateway_errors: u32,
    pub max_ejection_percent: u32,
    pub max_connections: u32,
    pub max_pending_requests: u32,
    pub max_requests: u32,
}

/// The built-in defaults (the mesh's before MeshConfig existed; see the agent's
/// `clusters` and `routes` for why each is what it is).
impl Default for ResilienceSettings {
    fn default() -> Self {
        Self {
            connect_timeout_ms: 1_000,
            request_timeout_ms: 15_000,
            retry_attempts: 2,
            consecutive_gateway_errors: 3,
            max_ejection_percent: 50,
            max_connections: 16_384,
            max_pending_requests: 16_384,
            max_requests: 65_536,
        }
    }
}

/// The settings of `namespace`: each field from the namespace's own MeshConfig, else the
/// mesh-wide one, else the built-in default (the inbound mTLS mode: the node's flag, see
/// [`Settings::inbound_mtls`]). `configs` are what the caller holds (valid ones; others
/// are skipped by the caller); the mesh-wide one is the first marked so.
pub fn effective<'a>(configs: impl IntoIterator<Item = &'a Projected>, namespace: &str) -> Settings {
    let (mut mesh, mut own) = (None, None);
    for config in configs {
        if config.mesh_wide {
            mesh = mesh.or(Some(config));
        }
        if config.namespace == namespace && config.name == NAME {
            own = Some(config);
        }
    }
    let layers: Vec<&Projected> = [own, mesh].into_iter().flatten().collect();
    let first = |f: &dyn Fn(&Projected) -> Option<u32>| layers.iter().find_map(|c| f(c));
    let inbound_mtls = layers.iter().find_map(|c| match c.inbound_mtls() {
        InboundMtlsMode::Strict => Some(InboundMtls::Strict),
        InboundMtlsMode::Permissive => Some(InboundMtls::Permissive),
        InboundMtlsMode::Unspecified => None,
    });
    let default_authorization = (layers.iter())
        .map(|c| c.default_authorization())
        .find(|action| *action != DefaultAuthorization::Unspecified);
    let built_in = ResilienceSettings::default();
    let value = |f: fn(&ProjectedResilience) -> Option<u32>, default: u32| {
        first(&|c| c.resilience.as_ref().and_then(f)).unwrap_or(default)
    };
    Settings {
        inbound_mtls,
        default_authorization: default_authorization.unwrap_or(DefaultAuthorization::Allow),
        mesh_domain: mesh.map(|c| c.mesh_domain.clone()).filter(|d| !d.is_empty()),
        resilience: ResilienceSettings {
            connect_timeout_ms: value(|r| r.connect_timeout_ms, built_in.connect_timeout_ms),
            request_timeout_ms: value(|r| r.request_timeout_ms, built_in.request_timeout_ms),
            retry_attempts: value(|r| r.retry_attempts, built_in.retry_attempts),
            consecutive_gateway_errors: value(|r| r.consecutive_gateway_errors, built_in.consecutive_gateway_errors),
            max_ejection_percent: value(|r| r.max_ejection_percent, built_in.max_ejection_percent),
            max_connections: value(|r| r.max_connections, built_in.max_connections),
            max_pending_requests: value(|r| r.max_pending_requests, built_in.max_pending_requests),
            max_requests: value(|r| r.max_requests, built_in.max_requests),
        },
    }
}

/// The name of the policy [`default_deny`] stands in with: not a Kubernetes name, so no
/// user's policy has it, and logs and `aether explain` say where it comes from.
pub const DEFAULT_DENY_POLICY: &str = "MeshConfig:defaultAction=DENY";

/// `defaultAction: DENY` for the pods of `namespace`, as the policy engine reads it: an
/// ALLOW policy without rules selecting every pod of the namespace. It allows nothing
/// itself, so a request is allowed only when another ALLOW policy allows it (proposals/013's
/// step 3: an enforced ALLOW policy selects the pod). Enforcement, the agent's RBAC
/// filters and `decide`, needs nothing else.
pub fn default_deny(namespace: &str) -> AuthorizationPolicy {
    AuthorizationPolicy {
        namespace: namespace.to_owned(),
        name: DEFAULT_DENY_POLICY.to_owned(),
        generation: 0,
        target: Some(AuthorizationTarget::default()),
        action: AuthorizationAction::Allow.into(),
        dry_run: false,
        rules: Vec::new(),
    }
}

/// One per namespace: the name is always [`NAME`].
fn check_name(field: &str, name: &str) -> Result<(), Refusal> {
    if name == NAME {
        return Ok(());
    }
    let message = format!(
        "{} is not {NAME:?}: a namespace has one MeshConfig, named {NAME:?}",
        quote(name)
    );
    Err(Refusal::new(field, message))
}

/// A field this version does not know: refused, never ignored.
fn unsupported(field: &str, extra: &Unsupported) -> Result<(), Refusal> {
    let Some(key) = extra.keys().next() else { return Ok(()) };
    let message = "is not a field of mesh.aether.io/v1alpha1 MeshConfig";
    Err(Refusal::new(format!("{field}.{key}"), message))
}

/// A mesh domain (`aether_common::names::mesh_domain`), the rule mesh-dns reads aliases with.
fn check_mesh_domain(domain: &str) -> Result<(), String> {
    aether_common::names::mesh_domain(domain).map_err(|e| format!("{} {e}", quote(domain)))
}

fn in_range(field: &str, value: u64, range: std::ops::RangeInclusive<u64>) -> Result<u32, Refusal> {
    if !range.contains(&value) {
        let message = format!("{value} ms is out of range ({} to {} ms)", range.start(), range.end());
        return Err(Refusal::new(field, message));
    }
    Ok(value as u32)
}

fn number(field: &str, value: Option<i64>, range: std::ops::RangeInclusive<i64>) -> Result<Option<u32>, Refusal> {
    match value {
        None => Ok(None),
        Some(v) if range.contains(&v) => Ok(Some(v as u32)),
        Some(v) => Err(Refusal::new(
            field,
            format!("{v} is out of range ({} to {})", range.start(), range.end()),
        )),
    }
}
