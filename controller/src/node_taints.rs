//! The node readiness taint, the controller's half: while it leads, it puts
//! `aether.io/agent-not-ready:NoSchedule` back on a node whose agent pod has not been Ready
//! for longer than a grace period (the agent crashed, was evicted, or its rollout is stuck),
//! so no new pod lands where nothing can take it in; and it takes the taint off a node whose
//! agent is Ready again (the agent does so itself too; whichever comes first). Nodes are
//! looked at every few seconds; each write carries the Node's resourceVersion and changes
//! only this taint.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Api;
use kube::api::{ListParams, Patch, PatchParams};
use serde_json::{Value, json};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

pub use aether_common::pod_meta::READINESS_TAINT;

/// How often nodes and agents are looked at.
const PERIOD: Duration = Duration::from_secs(2);

/// A change to one node's taints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Change {
    Taint,
    Untaint,
}

/// What the reconciler remembers between looks: since when each node's agent is not Ready.
#[derive(Debug, Default)]
pub struct Absences(BTreeMap<String, Instant>);

impl Absences {
    /// The changes to make now: `nodes` with whether each carries the taint, `ready` the
    /// nodes whose agent pod is Ready.
    pub fn changes(
        &mut self,
        nodes: &BTreeMap<String, bool>,
        ready: &BTreeSet<String>,
        now: Instant,
        grace: Duration,
    ) -> Vec<(String, Change)> {
        self.0
            .retain(|node, _| nodes.contains_key(node) && !ready.contains(node));
        let mut changes = Vec::new();
        for (node, &tainted) in nodes {
            if ready.contains(node) {
                if tainted {
                    changes.push((node.clone(), Change::Untaint));
                }
                continue;
            }
            let since = *self.0.entry(node.clone()).or_insert(now);
            if !tainted && now.duration_since(since) >= grace {
                changes.push((node.clone(), Change::Taint));
            }
        }
        changes
    }
}

pub struct Reconciler {
    pub nodes: Api<Node>,
    /// The agents' pods (the release namespace).
    pub pods: Api<Pod>,
    /// Selects the agent pods, e.g. `app.kubernetes.io/component=agent`.
    pub agent_selector: String,
    pub grace: Duration,
}

impl Reconciler {
    /// Looks every [`PERIOD`] while `leading` is true, until `shutdown`.
    pub async fn run(self, mut leading: watch::Receiver<bool>, shutdown: CancellationToken) {
        let mut absences = Absences::default();
        loop {
            if *leading.borrow_and_update() {
                if let Err(error) = self.once(&mut absences).await {
                    tracing::warn!(%error, "node readiness taints: cannot list nodes or agents");
                }
            } else {
                // A new leader starts counting afresh: it has not watched the absences.
                absences = Absences::default();
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(PERIOD) => {}
                _ = leading.changed() => {}
            }
        }
    }

    async fn once(&self, absences: &mut Absences) -> Result<(), kube::Error> {
        let nodes = self.nodes.list(&ListParams::default()).await?;
        let tainted: BTreeMap<String, bool> = nodes
            .items
            .iter()
            .filter_map(|n| Some((n.metadata.name.clone()?, has_taint(n))))
            .collect();
        let agents = self
            .pods
            .list(&ListParams::default().labels(&self.agent_selector))
            .await?;
        let ready: BTreeSet<String> = agents
            .items
            .iter()
            .filter(|p| is_ready(p))
            .filter_map(|p| p.spec.as_ref()?.node_name.clone())
            .collect();
        for (node, change) in absences.changes(&tainted, &ready, Instant::now(), self.grace) {
            let current = nodes
                .items
                .iter()
                .find(|n| n.metadata.name.as_deref() == Some(node.as_str()));
            match self.write(current.expect("listed"), change).await {
                Ok(()) => tracing::info!(%node, ?change, taint = READINESS_TAINT, "node readiness taint"),
                Err(error) => tracing::warn!(%node, ?change, %error, "node readiness taint not written; next look"),
            }
        }
        Ok(())
    }

    async fn write(&self, node: &Node, change: Change) -> Result<(), kube::Error> {
        let name = node.metadata.name.as_deref().unwrap_or_default();
        let mut taints: Vec<Value> = node
            .spec
            .as_ref()
            .and_then(|s| s.taints.as_ref())
            .into_iter()
            .flatten()
            .filter(|t| t.key != READINESS_TAINT)
            .map(|t| serde_json::to_value(t).expect("a taint serializes"))
            .collect();
        if change == Change::Taint {
            taints.push(json!({"key": READINESS_TAINT, "effect": "NoSchedule"}));
        }
        let patch = json!({
            "metadata": {"resourceVersion": node.metadata.resource_version},
            "spec": {"taints": taints},
        });
        self.nodes
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map(drop)
    }
}

fn has_taint(node: &Node) -> bool {
    let taints = node.spec.as_ref().and_then(|s| s.taints.as_ref());
    taints.into_iter().flatten().any(|t| t.key == READINESS_TAINT)
}

/// The pod's Ready condition is True (and it is not being deleted).
fn is_ready(pod: &Pod) -> bool {
    let conditions = pod.status.as_ref().and_then(|s| s.conditions.as_ref());
    pod.metadata.deletion_timestamp.is_none()
        && conditions
            .into_iter()
            .flatten()
            .any(|c| c.type_ == "Ready" && c.status == "True")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_is_tainted_after_its_agent_is_gone_for_the_grace_and_untainted_when_it_returns() {
        let grace = Duration::from_secs(60);
        let t0 = Instant::now();
        let nodes = |a: bool, b: bool| BTreeMap::from([("a".to_owned(), a), ("b".to_owned(), b)]);
        let ready = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<BTreeSet<_>>();
        let mut absences = Absences::default();
        assert_eq!(absences.changes(&nodes(false, false), &ready(&["a"]), t0, grace), []);
        let later = t0 + Duration::from_secs(59);
        assert_eq!(absences.changes(&nodes(false, false), &ready(&["a"]), later, grace), []);
        let after = t0 + grace;
        let tainted = absences.changes(&nodes(false, false), &ready(&["a"]), after, grace);
        assert_eq!(tainted, [("b".to_owned(), Change::Taint)]);
        // Back: untainted at once, and a later absence counts from its own start.
        let back = absences.changes(&nodes(false, true), &ready(&["a", "b"]), after, grace);
        assert_eq!(back, [("b".to_owned(), Change::Untaint)]);
        let gone_again = after + Duration::from_secs(1);
        assert_eq!(
            absences.changes(&nodes(false, false), &ready(&["a"]), gone_again, grace),
            []
        );
        // A new node whose agent has not started yet carries the taint already: nothing to do.
        let with_new = BTreeMap::from([("c".to_owned(), true)]);
        assert_eq!(absences.changes(&with_new, &ready(&[]), gone_again + grace, grace), []);
    }
}
