//! Authorization: strict inbound mTLS (the agent's default) refuses a plaintext caller from outside the mesh, and an
//! AuthorizationPolicy on backend admitting only frontend's identity turns another caller in the mesh away with a
//! 403 that the agent logs and counts; removing the policy lets that caller in again.

use super::*;
use crate::canary::write_atomically;

/// The policy's file in the registrar's `--config-dir`.
const POLICY_FILE: &str = "config/backend-frontend-only.yaml";
/// The mesh caller the policy does not admit.
const OTHER_CALLER: &str = "batch";
/// How long the agent may take to log a denial (Envoy ships its access log every 100 ms).
const LOG_TIMEOUT: Duration = Duration::from_secs(5);

/// The policy, as a user would `kubectl apply` it (here: a file in the registrar's `--config-dir`).
fn frontend_only() -> String {
    format!(
        r#"apiVersion: security.aether.io/v1alpha1
kind: AuthorizationPolicy
metadata:
  name: backend-frontend-only
  namespace: {NAMESPACE}
spec:
  targetRefs:
  - {{kind: Service, name: backend}}
  action: ALLOW
  rules:
  - from:
    - source: {{serviceAccounts: [{NAMESPACE}/frontend]}}
"#
    )
}

impl Demo {
    pub(crate) async fn authorization(&mut self) -> Result<Vec<String>, DemoError> {
        let mut lines = self.plaintext_refused().await?;
        lines.extend(self.policy_enforced().await?);
        lines.extend(self.denial_logged().await?);
        lines.extend(self.decisions_counted().await?);
        lines.extend(self.policy_removed().await?);
        self.facts.authorization = format!(
            "legacy's plaintext refused (strict mTLS); ALLOW for {NAMESPACE}/frontend: {OTHER_CALLER} 403, frontend 200"
        );
        Ok(lines)
    }

    /// The unmanaged pod calls a backend replica's app port directly, as anything outside the mesh could.
    async fn plaintext_refused(&self) -> Result<Vec<String>, DemoError> {
        let backend = self.pod("backend-1");
        let ip = backend.ip.expect("backend-1 has an IP");
        let before = self.refused_plaintext("backend-1").await?;
        let target = SocketAddr::from((ip, APP_PORT));
        let error = match get_in(
            &self.pod("legacy").netns_path(),
            target,
            &target.to_string(),
            "/plaintext",
        )
        .await
        {
            Ok(reply) => {
                return Err(fail(format!(
                    "legacy reached backend-1's app port in plaintext ({}): strict inbound mTLS is not enforced",
                    reply.status
                )));
            }
            Err(e) => e,
        };
        let after = self.refused_plaintext("backend-1").await?;
        if after <= before {
            return Err(fail(format!(
                "legacy's plaintext call failed ({error}) but backend-1's refused_plaintext counter stayed at {after}"
            )));
        }
        Ok(vec![
            format!("legacy -> {target} (backend-1's app port, plaintext, outside the mesh): {error}"),
            "strict inbound mTLS (the agent's default): backend-1's netns admits TCP to its ports only from Envoy's \
             mTLS listener, Envoy's delivery and the node (probes), and resets the rest"
                .into(),
            format!(
                "agent /debug/status: {NAMESPACE}/backend-1 inbound_mtls strict, refused_plaintext {before} -> {after}"
            ),
        ])
    }

    /// The connections `pod`'s strict chain refused, as the agent reports them.
    async fn refused_plaintext(&self, pod: &str) -> Result<u64, DemoError> {
        let url = format!("http://127.0.0.1:{}/debug/status", self.ports.agent_admin);
        let reply = http_get(&url, None)
            .await
            .map_err(|e| fail(format!("agent {url}: {e}")))?;
        let status: Value =
            serde_json::from_str(&reply.body).map_err(|e| fail(format!("agent {url} is not JSON: {e}")))?;
        let id = format!("{NAMESPACE}/{pod}");
        let row = status["pods"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|row| row["pod"] == id.as_str())
            .ok_or_else(|| fail(format!("the agent's /debug/status lists no pod {id}")))?;
        row["refused_plaintext"].as_u64().ok_or_else(|| {
            fail(format!(
                "{id} has no strict inbound chain (inbound_mtls {}, refused_plaintext {})",
                row["inbound_mtls"], row["refused_plaintext"]
            ))
        })
    }

    /// The ALLOW policy written: the other caller gets 403 once it is enforced, frontend still gets 200.
    async fn policy_enforced(&self) -> Result<Vec<String>, DemoError> {
        let file = self.path(POLICY_FILE);
        write_atomically(&file, &frontend_only())?;
        let started = Instant::now();
        let denied = self.until_status(OTHER_CALLER, 403, "/report").await?;
        let enforced = started.elapsed();
        let allowed = self
            .call_from("frontend", "/page")
            .await
            .map_err(|e| fail(format!("frontend -> backend under the policy: {e}")))?;
        if allowed.status != 200 {
            return Err(fail(format!(
                "frontend, the one caller the policy admits, got {}: {}",
                allowed.status, allowed.body
            )));
        }
        Ok(vec![
            format!(
                "AuthorizationPolicy {NAMESPACE}/backend-frontend-only (ALLOW from serviceAccounts {NAMESPACE}/frontend) \
                 written to {}: enforced in {} ms",
                file.display(),
                enforced.as_millis()
            ),
            format!("{OTHER_CALLER} -> backend: {} ({})", denied.status, denied.body.trim()),
            format!(
                "frontend -> backend: {} from {}",
                allowed.status,
                allowed.json()?["pod"].as_str().unwrap_or("?")
            ),
        ])
    }

    /// The agent's log line for the denial, from its log file.
    async fn denial_logged(&self) -> Result<Vec<String>, DemoError> {
        let agent = self.agent.as_ref().ok_or_else(|| fail("the agent is not running"))?;
        let source = format!("source=spiffe://{TRUST_DOMAIN}/ns/{NAMESPACE}/sa/{OTHER_CALLER}");
        let deadline = Instant::now() + LOG_TIMEOUT;
        let line = loop {
            let logs = agent.logs();
            let found = logs
                .lines()
                .find(|l| l.contains("authorization:") && l.contains("verdict=\"deny\"") && l.contains(&source));
            if let Some(line) = found {
                break line.trim().to_owned();
            }
            if Instant::now() > deadline {
                let decisions: Vec<&str> = logs.lines().filter(|l| l.contains("authorization:")).collect();
                return Err(fail(format!(
                    "no denial of {OTHER_CALLER} in the agent's log {} within {LOG_TIMEOUT:?}; decisions logged:\n{}",
                    agent.log_path().display(),
                    decisions.join("\n")
                )));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        Ok(vec![
            format!("agent log ({}):", agent.log_path().display()),
            format!("  {line}"),
        ])
    }

    /// The agent's per-policy decision counter.
    async fn decisions_counted(&self) -> Result<Vec<String>, DemoError> {
        let url = format!("http://127.0.0.1:{}/metrics", self.ports.agent_admin);
        let metrics = http_get(&url, None)
            .await
            .map_err(|e| fail(format!("agent {url}: {e}")))?
            .body;
        let counted: Vec<String> = metrics
            .lines()
            .filter(|l| l.starts_with("aether_agent_authorization_decisions_total{"))
            .map(|l| format!("  {l}"))
            .collect();
        if !counted.iter().any(|l| l.contains("decision=\"deny\"")) {
            return Err(fail(format!("the agent's /metrics counts no denial: {counted:?}")));
        }
        let mut lines = vec![format!("agent {url}:")];
        lines.extend(counted);
        Ok(lines)
    }

    /// The policy removed: the other caller is allowed again.
    async fn policy_removed(&self) -> Result<Vec<String>, DemoError> {
        let file = self.path(POLICY_FILE);
        std::fs::remove_file(&file).map_err(|e| fail(format!("removing {}: {e}", file.display())))?;
        let started = Instant::now();
        let allowed = self.until_status(OTHER_CALLER, 200, "/report").await?;
        Ok(vec![format!(
            "policy removed: {OTHER_CALLER} -> backend: 200 from {} again ({} ms)",
            allowed.json()?["pod"].as_str().unwrap_or("?"),
            started.elapsed().as_millis()
        )])
    }

    /// Calls backend by its VIP from `caller` until it answers `status` (a policy change applies asynchronously).
    async fn until_status(&self, caller: &str, status: u16, path: &str) -> Result<Reply, DemoError> {
        let deadline = Instant::now() + CONVERGE_TIMEOUT;
        loop {
            let last = self.call_from(caller, path).await;
            match last {
                Ok(reply) if reply.status == status => return Ok(reply),
                _ if Instant::now() > deadline => {
                    return Err(fail(format!(
                        "{caller} -> backend never answered {status} within {CONVERGE_TIMEOUT:?} (last: {last:?})"
                    )));
                }
                _ => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }

    /// One GET from `caller`'s netns to backend's VIP, named by its mesh host.
    async fn call_from(&self, caller: &str, path: &str) -> Result<Reply, String> {
        let target = self.backend_target().map_err(|e| e.to_string())?;
        let host = format!("{}:{APP_PORT}", Self::fqdn("backend"));
        get_in(&self.pod(caller).netns_path(), target, &host, path).await
    }
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use aether_api::authorization::{
        AuthzRequest, Cause, HttpRequest, ProjectOptions, Verdict, Workload, decide, parse_documents, project,
    };

    use super::*;

    /// What the projector's oracle decides for a GET from `principal` to a pod of `service`.
    fn verdict_for(service: &str, principal: &str) -> (Verdict, Cause) {
        let object = parse_documents(&frontend_only())
            .pop()
            .expect("one document")
            .expect("the demo's policy parses");
        let policy = project(&object, &ProjectOptions::default()).expect("the demo's policy projects");
        let request = AuthzRequest {
            workload: Workload {
                namespace: NAMESPACE.into(),
                labels: [("app".to_owned(), service.to_owned())].into(),
                services: vec![format!("{NAMESPACE}/{service}")],
            },
            principal: Some(principal.into()),
            trust_domain: TRUST_DOMAIN.into(),
            peer_ip: IpAddr::from([10, 0, 0, 7]),
            port: APP_PORT.into(),
            http: Some(HttpRequest {
                method: "GET".into(),
                path: "/report".into(),
                host: format!("{}:{APP_PORT}", Demo::fqdn(service)),
            }),
        };
        let decision = decide(&[&policy], &request);
        (decision.verdict, decision.cause)
    }

    fn spiffe(account: &str) -> String {
        format!("spiffe://{TRUST_DOMAIN}/ns/{NAMESPACE}/sa/{account}")
    }

    #[test]
    fn the_policy_admits_frontend_and_turns_the_other_caller_away_from_backend_only() {
        let (verdict, cause) = verdict_for("backend", &spiffe("frontend"));
        assert_eq!(verdict, Verdict::Allow);
        assert!(matches!(cause, Cause::Allowed(rule) if rule.policy == "demo/backend-frontend-only"));
        // The step's log line says "no ALLOW policy selecting the pod matched" for this one.
        assert_eq!(
            verdict_for("backend", &spiffe(OTHER_CALLER)),
            (Verdict::Deny, Cause::NoAllowMatched)
        );
        // The canary is another Service: the policy does not select it.
        assert_eq!(
            verdict_for("backend-v2", &spiffe(OTHER_CALLER)),
            (Verdict::Allow, Cause::NoAllowPolicy)
        );
    }
}
