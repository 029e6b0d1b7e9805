//! The `status.parents[]` entries the registrar writes on a route: pure, so the registrar
//! only decides when to write them.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

use crate::gateway::{ParentReference, RouteParentStatus};
use crate::route::{ConditionType, Rejected, reason};

/// The mesh's controller name in `status.parents[].controllerName`.
pub const CONTROLLER_NAME: &str = "aether.io/mesh";

/// The status of one parent after projecting the route at `generation`: `refusal` None
/// means accepted with every reference resolved. A refusal sets its condition False and
/// the other True (as Gateway API implementations report: an unsupported filter leaves
/// references resolved; a missing backend leaves the route accepted).
/// `lastTransitionTime` moves only when a condition's status changes (`previous` holds the
/// times); `now` is the time of this change.
pub fn parent_status(
    parent_ref: &ParentReference,
    refusal: Option<&Rejected>,
    generation: i64,
    previous: Option<&RouteParentStatus>,
    now: &Time,
) -> RouteParentStatus {
    let condition = |type_: ConditionType, true_reason: &str| {
        let (status, reason, message) = match refusal {
            Some(r) if r.condition == type_ => ("False", r.reason, r.to_string()),
            _ => ("True", true_reason, String::new()),
        };
        let since = previous
            .and_then(|p| p.conditions.iter().find(|c| c.type_ == type_.as_str()))
            .filter(|c| c.status == status)
            .map_or_else(|| now.clone(), |c| c.last_transition_time.clone());
        Condition {
            type_: type_.as_str().to_owned(),
            status: status.to_owned(),
            reason: reason.to_owned(),
            message,
            observed_generation: Some(generation),
            last_transition_time: since,
        }
    };
    RouteParentStatus {
        parent_ref: parent_ref.clone(),
        controller_name: CONTROLLER_NAME.to_owned(),
        conditions: vec![
            condition(ConditionType::Accepted, reason::ACCEPTED),
            condition(ConditionType::ResolvedRefs, reason::RESOLVED_REFS),
        ],
    }
}

/// Puts `entry` into `parents`, replacing this controller's entry for the same parentRef
/// and leaving other controllers' entries alone (Gateway API: never touch theirs).
pub fn merge_parent_status(parents: &mut Vec<RouteParentStatus>, entry: RouteParentStatus) {
    let ours = |p: &RouteParentStatus| p.controller_name == entry.controller_name && p.parent_ref == entry.parent_ref;
    match parents.iter_mut().find(|p| ours(p)) {
        Some(existing) => *existing = entry,
        None => parents.push(entry),
    }
}
