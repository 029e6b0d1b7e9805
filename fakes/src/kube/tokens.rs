//! ServiceAccount tokens and their TokenReview, as the API server answers it: a token is
//! authenticated only for the audiences it was issued for, and a pod-bound token names
//! its node in `user.extra`.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use serde_json::{Value, json};

/// What the API server knows of a token it issued.
#[derive(Clone, Debug)]
pub struct TokenInfo {
    /// `system:serviceaccount:<namespace>:<name>`.
    pub username: String,
    /// The node of the pod the token is bound to, if any.
    pub node: Option<String>,
    pub audiences: Vec<String>,
}

#[derive(Default)]
pub(super) struct Tokens {
    issued: Mutex<BTreeMap<String, TokenInfo>>,
    reviewed: Mutex<Vec<String>>,
    minted: AtomicU64,
}

impl Tokens {
    pub fn mint(&self, info: TokenInfo) -> String {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        let token = format!("token-{nanos:x}-{}", self.minted.fetch_add(1, Ordering::Relaxed));
        self.issued.lock().insert(token.clone(), info);
        token
    }

    pub fn revoke(&self, token: &str) {
        self.issued.lock().remove(token);
    }

    pub fn reviewed(&self) -> Vec<String> {
        self.reviewed.lock().clone()
    }

    /// The TokenReview `review` (its `spec`) answered with its `status`.
    pub fn review(&self, review: &Value) -> Value {
        let token = review["spec"]["token"].as_str().unwrap_or_default().to_owned();
        let wanted: Vec<String> = review["spec"]["audiences"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|a| a.as_str().map(str::to_owned))
            .collect();
        self.reviewed.lock().push(token.clone());
        let info = self.issued.lock().get(&token).cloned();
        let status = match info {
            None => json!({"authenticated": false, "error": "invalid bearer token, token lookup failed"}),
            Some(info) => authenticated(info, &wanted),
        };
        json!({"kind": "TokenReview", "apiVersion": "authentication.k8s.io/v1",
               "metadata": {"creationTimestamp": null}, "spec": review["spec"], "status": status})
    }
}

/// The status of a review of a known token for the `wanted` audiences (none: the token's own).
fn authenticated(info: TokenInfo, wanted: &[String]) -> Value {
    let granted: Vec<&String> = if wanted.is_empty() {
        info.audiences.iter().collect()
    } else {
        wanted.iter().filter(|a| info.audiences.contains(a)).collect()
    };
    if granted.is_empty() {
        return json!({"authenticated": false, "error": "token audiences are invalid for the target audiences"});
    }
    let mut user = json!({"username": info.username, "uid": "uid-of-the-service-account",
                          "groups": ["system:serviceaccounts"]});
    if let Some(node) = info.node {
        user["extra"] = json!({"authentication.kubernetes.io/node-name": [node],
                               "authentication.kubernetes.io/pod-name": ["aether-agent-x"]});
    }
    json!({"authenticated": true, "user": user, "audiences": granted})
}
