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

#[cfg(test)]
mod tests {
    use k8s_openapi::jiff::Timestamp;

    use super::*;
    use crate::route::ConditionType;

    fn parent() -> ParentReference {
        serde_json::from_str(r#"{"group": "", "kind": "Service", "name": "cart"}"#).unwrap()
    }

    fn at(second: i64) -> Time {
        Time(Timestamp::from_second(second).unwrap())
    }

    fn summary(status: &RouteParentStatus) -> Vec<(&str, &str, &str, Option<i64>)> {
        let c = &status.conditions;
        c.iter()
            .map(|c| {
                (
                    c.type_.as_str(),
                    c.status.as_str(),
                    c.reason.as_str(),
                    c.observed_generation,
                )
            })
            .collect()
    }

    #[test]
    fn accepted_refused_and_unresolved() {
        let ok = parent_status(&parent(), None, 2, None, &at(10));
        assert_eq!(ok.controller_name, "aether.io/mesh");
        let expected = vec![
            ("Accepted", "True", "Accepted", Some(2)),
            ("ResolvedRefs", "True", "ResolvedRefs", Some(2)),
        ];
        assert_eq!(summary(&ok), expected);
        let unsupported = Rejected::unsupported("spec.rules[0].filters[0].type", "no");
        let refused = parent_status(&parent(), Some(&unsupported), 3, Some(&ok), &at(20));
        let expected = vec![
            ("Accepted", "False", "UnsupportedValue", Some(3)),
            ("ResolvedRefs", "True", "ResolvedRefs", Some(3)),
        ];
        assert_eq!(summary(&refused), expected);
        assert_eq!(refused.conditions[0].message, "spec.rules[0].filters[0].type: no");
        // Only the condition whose status changed moves its transition time.
        assert_eq!(refused.conditions[0].last_transition_time, at(20));
        assert_eq!(refused.conditions[1].last_transition_time, at(10));
        let missing = Rejected {
            condition: ConditionType::ResolvedRefs,
            ..unsupported
        };
        let unresolved = parent_status(&parent(), Some(&missing), 3, None, &at(30));
        assert_eq!(summary(&unresolved)[1].1, "False");
    }

    #[test]
    fn merging_replaces_only_our_entry_for_that_parent() {
        let theirs = RouteParentStatus {
            controller_name: "other.io/x".into(),
            ..parent_status(&parent(), None, 1, None, &at(1))
        };
        let mut parents = vec![theirs.clone(), parent_status(&parent(), None, 1, None, &at(1))];
        merge_parent_status(&mut parents, parent_status(&parent(), None, 2, None, &at(2)));
        assert_eq!(parents.len(), 2);
        assert_eq!(
            (parents[0].clone(), parents[1].conditions[0].observed_generation),
            (theirs, Some(2))
        );
        let mut other_parent = parent();
        other_parent.name = "pricing".into();
        merge_parent_status(&mut parents, parent_status(&other_parent, None, 2, None, &at(2)));
        assert_eq!(parents.len(), 3);
    }
}
