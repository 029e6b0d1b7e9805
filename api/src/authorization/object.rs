//! `security.aether.io/v1alpha1` AuthorizationPolicy, typed: what the Kubernetes API serves
//! and what a policy directory holds.
//!
//! Shaped like Istio's AuthorizationPolicy (selector, action, rules of from/to), with
//! Service `targetRefs`, integer ports and no `when` conditions. Decoding is lenient, as
//! for routes (one undecodable object would break the registrar's whole watch): an unknown
//! action decodes as `Other` and a field this version does not know lands in `unsupported`;
//! the projector refuses both, naming the field, so nothing a user wrote is silently dropped
//! (a copied Istio `when:` must never widen a DENY into nothing).

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::gateway::string_enum;

/// The API group of [`AuthorizationPolicy`].
pub const GROUP: &str = "security.aether.io";
/// The one version served.
pub const VERSION: &str = "v1alpha1";
pub const KIND: &str = "AuthorizationPolicy";

/// Fields of a mapping this version does not know, kept so the projector can name them.
pub type Unsupported = BTreeMap<String, Value>;

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct AuthorizationPolicy {
    #[serde(default)]
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: AuthorizationPolicySpec,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AuthorizationPolicySpec {
    /// The pods of the policy's namespace it applies to; unset (or empty) with no
    /// `targetRefs`: all of them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<WorkloadSelector>,
    /// The Services (of the policy's namespace) whose pods it applies to.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub target_refs: Vec<TargetRef>,
    #[serde(default)]
    pub action: Action,
    /// Evaluate and report, never enforce.
    #[serde(default)]
    pub dry_run: bool,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rules: Vec<Rule>,
    #[serde(flatten, skip_serializing_if = "BTreeMap::is_empty")]
    pub unsupported: Unsupported,
}

string_enum! {
    /// `spec.action`; ALLOW when unset.
    #[derive(Default)]
    Action {
        #[default]
        Allow = "ALLOW",
        Deny = "DENY",
        Audit = "AUDIT",
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WorkloadSelector {
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub match_labels: BTreeMap<String, String>,
    #[serde(flatten, skip_serializing_if = "BTreeMap::is_empty")]
    pub unsupported: Unsupported,
}

/// `spec.targetRefs[]`: a Service of the policy's namespace.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TargetRef {
    /// Empty: the core group.
    #[serde(default)]
    pub group: String,
    pub kind: String,
    pub name: String,
    #[serde(flatten, skip_serializing_if = "BTreeMap::is_empty")]
    pub unsupported: Unsupported,
}

/// `spec.rules[]`: matches when some `from` and some `to` match; empty lists match all.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Rule {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub from: Vec<RuleFrom>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub to: Vec<RuleTo>,
    #[serde(flatten, skip_serializing_if = "BTreeMap::is_empty")]
    pub unsupported: Unsupported,
}

/// `rules[].from[]`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RuleFrom {
    #[serde(default)]
    pub source: Source,
    #[serde(flatten, skip_serializing_if = "BTreeMap::is_empty")]
    pub unsupported: Unsupported,
}

/// `rules[].to[]`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RuleTo {
    #[serde(default)]
    pub operation: Operation,
    #[serde(flatten, skip_serializing_if = "BTreeMap::is_empty")]
    pub unsupported: Unsupported,
}

/// `from[].source`: every field set must hold; `not*` holds when none of its values match.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Source {
    /// SPIFFE IDs: exact, `prefix*`, `*suffix` or `*`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub principals: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub not_principals: Vec<String>,
    /// `<namespace>/<service account>`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub service_accounts: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub not_service_accounts: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub namespaces: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub not_namespaces: Vec<String>,
    /// CIDRs or single addresses.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ip_blocks: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub not_ip_blocks: Vec<String>,
    #[serde(flatten, skip_serializing_if = "BTreeMap::is_empty")]
    pub unsupported: Unsupported,
}

/// `to[].operation`: ports are L4; methods, paths and hosts need an HTTP port.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Operation {
    /// The pod's own ports (the app's, as its containers declare them).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<i64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub not_ports: Vec<i64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub methods: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub not_methods: Vec<String>,
    /// `/exact`, `/prefix*`, `*suffix` or `*`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub paths: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub not_paths: Vec<String>,
    /// `host`, `*.suffix`, `prefix.*` or `*`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hosts: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub not_hosts: Vec<String>,
    #[serde(flatten, skip_serializing_if = "BTreeMap::is_empty")]
    pub unsupported: Unsupported,
}

crate::resource::namespaced_resource!(AuthorizationPolicy, GROUP, VERSION, KIND, "authorizationpolicies");
