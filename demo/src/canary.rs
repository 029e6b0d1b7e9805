//! Traffic policy: a Gateway API HTTPRoute on the backend Service (GAMMA) splits its traffic 90/10 with a canary
//! and pins requests carrying `x-version: v2` to the canary; removing the route restores plain load balancing.

use super::*;

/// The route, as a user would `kubectl apply` it (here: a file in the registrar's `--config-dir`).
fn canary_route() -> String {
    format!(
        r#"apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata:
  name: backend-canary
  namespace: {NAMESPACE}
spec:
  parentRefs:
  - {{group: "", kind: Service, name: backend, port: {APP_PORT}}}
  rules:
  - name: pinned-to-v2
    matches:
    - headers: [{{name: x-version, value: v2}}]
    backendRefs:
    - {{name: backend-v2, port: {APP_PORT}}}
  - name: canary
    backendRefs:
    - {{name: backend, port: {APP_PORT}, weight: 90}}
    - {{name: backend-v2, port: {APP_PORT}, weight: 10}}
"#
    )
}

/// Requests of the split; ±5 % around 10 % is what the conformance suite asks of 500.
const SPLIT_REQUESTS: usize = 500;

impl Demo {
    pub(crate) async fn canary(&mut self) -> Result<Vec<String>, DemoError> {
        let route = self.path("config/backend-canary.yaml");
        write_atomically(&route, &canary_route())?;
        let started = Instant::now();
        // Served once a pinned request lands on the canary.
        let pinned = self.pinned_to_v2().await?;
        let converged = started.elapsed();
        let counts = self.split().await?;
        let v2 = counts.get("backend-v2").copied().unwrap_or(0);
        let share = v2 as f64 / SPLIT_REQUESTS as f64;
        if !(0.05..=0.15).contains(&share) {
            return Err(fail(format!(
                "the 90/10 split sent {v2} of {SPLIT_REQUESTS} requests to backend-v2 ({:.1} %): {counts:?}",
                share * 100.0
            )));
        }
        std::fs::remove_file(&route).map_err(|e| fail(format!("removing {}: {e}", route.display())))?;
        let restored = self.split_without_canary().await?;
        let mut lines = vec![
            format!(
                "HTTPRoute {NAMESPACE}/backend-canary written to {}: served in {} ms",
                route.display(),
                converged.as_millis()
            ),
            format!("x-version: v2 -> {pinned} (rule pinned-to-v2)"),
        ];
        lines.extend(
            counts
                .iter()
                .map(|(pod, n)| format!("{pod}: {n} of {SPLIT_REQUESTS} requests")),
        );
        lines.push(format!("route removed: {restored}"));
        self.facts.canary = format!("{v2} of {SPLIT_REQUESTS} to backend-v2 ({:.1} %)", share * 100.0);
        Ok(lines)
    }

    /// Polls with `x-version: v2` until the canary answers; returns the pod that did.
    async fn pinned_to_v2(&self) -> Result<String, DemoError> {
        let deadline = Instant::now() + CONVERGE_TIMEOUT;
        loop {
            let pod = self.call_backend(&[("x-version", "v2")], "/pinned").await?;
            if pod == "backend-v2" {
                return Ok(pod);
            }
            if Instant::now() > deadline {
                return Err(fail(format!(
                    "a request with x-version: v2 still reached {pod} {} s after the route was written",
                    CONVERGE_TIMEOUT.as_secs()
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Sends [`SPLIT_REQUESTS`] plain requests; counts them per answering pod.
    async fn split(&self) -> Result<BTreeMap<String, u64>, DemoError> {
        let mut counts = BTreeMap::new();
        for i in 0..SPLIT_REQUESTS {
            let pod = self.call_backend(&[], &format!("/split/{i}")).await?;
            *counts.entry(pod).or_insert(0) += 1;
        }
        Ok(counts)
    }

    /// Once the route is gone, pinned requests reach the backend replicas again.
    async fn split_without_canary(&self) -> Result<String, DemoError> {
        let deadline = Instant::now() + CONVERGE_TIMEOUT;
        loop {
            let pod = self.call_backend(&[("x-version", "v2")], "/unpinned").await?;
            if pod.starts_with("backend-") && pod != "backend-v2" {
                return Ok(format!("x-version: v2 -> {pod} again"));
            }
            if Instant::now() > deadline {
                return Err(fail(format!(
                    "requests still reach {pod} {} s after the route was removed",
                    CONVERGE_TIMEOUT.as_secs()
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// One GET from the frontend to the backend by name; the pod that answered.
    async fn call_backend(&self, headers: &[(&str, &str)], path: &str) -> Result<String, DemoError> {
        let target = self.backend_target()?;
        let host = format!("{}:{APP_PORT}", Self::fqdn("backend"));
        let netns = self.pod("frontend").netns_path();
        let reply = get_in_with(&netns, target, &host, path, headers)
            .await
            .map_err(|e| fail(format!("GET {path} from frontend to {host}: {e}")))?;
        if reply.status != 200 {
            return Err(fail(format!("GET {path} answered {}: {}", reply.status, reply.body)));
        }
        Ok(reply.json()?["pod"].as_str().unwrap_or_default().to_owned())
    }
}

/// Writes `text` to `path` through a temporary file and a rename, as `kubectl apply` of a ConfigMap would swap it.
pub(crate) fn write_atomically(path: &Path, text: &str) -> Result<(), DemoError> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).map_err(|e| fail(format!("writing {}: {e}", tmp.display())))?;
    std::fs::rename(&tmp, path).map_err(|e| fail(format!("renaming {} into place: {e}", tmp.display())))
}
