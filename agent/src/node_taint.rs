//! The node readiness taint, `aether.io/agent-not-ready:NoSchedule`. A node joins the
//! cluster with it (kubelet's `--register-with-taints`, or the node pool's taints), so no
//! pod is scheduled there before its agent can take it in; the agent removes it from its
//! own Node once it is ready: serving the CNI socket (it does before this runs), its catalog
//! synced with the registrar (the agent's readiness), and Envoy LIVE. Only the agent's own
//! taint is touched: the other taints are written back as they were, under the Node's
//! resourceVersion, so a concurrent writer makes the patch conflict and it is redone.
//! Putting the taint back when an agent is gone is the controller's (`aether-controller`).

use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Taint};
use kube::Api;
use kube::api::{Patch, PatchParams};
use serde_json::json;
use tokio_util::sync::CancellationToken;

/// The taint's key; its effect is NoSchedule.
pub const TAINT_KEY: &str = aether_common::pod_meta::READINESS_TAINT;
/// How often readiness and the Node are looked at until the taint is gone.
const POLL: Duration = Duration::from_secs(1);

/// The Node's taints without ours; `None` when it does not carry ours.
pub fn without_ours(node: &Node) -> Option<Vec<Taint>> {
    let taints = node.spec.as_ref()?.taints.as_ref()?;
    taints
        .iter()
        .any(|t| t.key == TAINT_KEY)
        .then(|| taints.iter().filter(|t| t.key != TAINT_KEY).cloned().collect())
}

/// Waits until `ready()` says the agent can take pods in, then removes the taint from
/// `node` (retrying until done or `shutdown`). Returns once the Node is free of it.
pub async fn remove_when_ready<F, R>(nodes: Api<Node>, node: String, ready: F, shutdown: CancellationToken)
where
    F: Fn() -> R,
    R: std::future::Future<Output = bool>,
{
    loop {
        if ready().await {
            match remove(&nodes, &node).await {
                Ok(removed) => {
                    if removed {
                        tracing::info!(%node, taint = TAINT_KEY, "the agent is ready: taint removed from its node");
                    }
                    return;
                }
                // No such Node, or no right to patch it: retrying will not help; say so once.
                Err(kube::Error::Api(status)) if [403, 404].contains(&status.code) => {
                    let error = status.message;
                    return tracing::error!(%node, %error, "cannot remove the readiness taint (the agent needs get and patch on its Node)");
                }
                Err(error) => tracing::warn!(%node, %error, "removing the readiness taint; retrying"),
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(POLL) => {}
        }
    }
}

/// One attempt: `true` when the taint was there and is gone now.
async fn remove(nodes: &Api<Node>, name: &str) -> Result<bool, kube::Error> {
    let node = nodes.get(name).await?;
    let Some(rest) = without_ours(&node) else {
        return Ok(false);
    };
    // A merge patch replaces the list: the resourceVersion makes a concurrent change conflict (409).
    let patch = json!({
        "metadata": {"resourceVersion": node.metadata.resource_version},
        "spec": {"taints": rest},
    });
    nodes
        .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use aether_fakes::kube::ApiServer;
    use serde_json::Value;

    use super::*;

    fn node(taints: Value) -> Node {
        serde_json::from_value(json!({"metadata": {"name": "node-a"}, "spec": {"taints": taints}})).unwrap()
    }

    fn ours() -> Value {
        json!({"key": TAINT_KEY, "effect": "NoSchedule"})
    }

    fn other() -> Value {
        json!({"key": "dedicated", "value": "gpu", "effect": "NoSchedule"})
    }

    #[test]
    fn only_our_taint_is_taken_out() {
        let rest = without_ours(&node(json!([other(), ours()]))).unwrap();
        assert_eq!(serde_json::to_value(rest).unwrap(), json!([other()]));
        assert_eq!(without_ours(&node(json!([other()]))), None);
        assert_eq!(without_ours(&node(Value::Null)), None);
    }

    #[tokio::test]
    async fn the_taint_goes_once_the_agent_is_ready_and_the_others_stay() {
        let api = ApiServer::start();
        api.apply::<Node>(serde_json::to_value(node(json!([other(), ours()]))).unwrap());
        let nodes: Api<Node> = Api::all(api.client());
        let (ready, readiness) = tokio::sync::watch::channel(false);
        let task = tokio::spawn(remove_when_ready(
            nodes.clone(),
            "node-a".into(),
            move || {
                let ready = *readiness.borrow();
                async move { ready }
            },
            CancellationToken::new(),
        ));
        let taints = |node: Node| serde_json::to_value(node.spec.unwrap().taints).unwrap();
        tokio::time::sleep(POLL + POLL / 2).await;
        assert_eq!(
            taints(nodes.get("node-a").await.unwrap()),
            json!([other(), ours()]),
            "not ready yet"
        );
        ready.send(true).unwrap();
        tokio::time::timeout(POLL * 3, task).await.unwrap().unwrap();
        assert_eq!(taints(nodes.get("node-a").await.unwrap()), json!([other()]));
    }

    #[tokio::test]
    async fn a_node_that_does_not_exist_ends_the_attempts_at_once() {
        let api = ApiServer::start();
        let nodes: Api<Node> = Api::all(api.client());
        let ready = || async { true };
        let gave_up = remove_when_ready(nodes, "nowhere".into(), ready, CancellationToken::new());
        tokio::time::timeout(POLL / 2, gave_up).await.expect("no retry loop");
    }
}
