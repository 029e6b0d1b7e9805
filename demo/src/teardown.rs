//! Tearing the node down, in the reverse order of bringing it up; also run by `Drop`.

use super::*;

impl Demo {
    /// Stops the apps (their sockets keep pod netns alive), then everything else: see [`Demo::teardown`].
    pub async fn shutdown(&mut self) -> Result<Vec<String>, DemoError> {
        for app in self.apps.drain(..) {
            app.task.abort();
            let _ = app.task.await;
        }
        self.teardown()
    }

    /// Deletes the pods through CNI DEL (as the runtime does), stops mesh-dns, the supervisor (Envoy drains), the
    /// agent and the registrar, removes Envoy's shared memory, the pod netns, the bridge and the work dir; then
    /// checks that nothing of this run is left. Idempotent; `Drop` calls it too.
    pub fn teardown(&mut self) -> Result<Vec<String>, DemoError> {
        if self.torn_down {
            return Ok(Vec::new());
        }
        self.torn_down = true;
        for app in self.apps.drain(..) {
            app.task.abort();
        }
        let mut problems = Vec::new();
        if let Some(conflist) = self.conflist.clone() {
            for pod in self.pods.iter().rev() {
                let Some(result) = &pod.result else { continue };
                if let Err(run) = conflist.del(&pod.sandbox, Some(result)) {
                    problems.push(format!(
                        "CNI DEL of {}: {} {}",
                        pod.name,
                        run.stdout.trim(),
                        run.stderr.trim()
                    ));
                }
            }
        }
        for pod in &mut self.pods {
            if let Some(netns) = pod.netns.take()
                && let Err(e) = remove_pod_resolv_conf(netns.name())
            {
                problems.push(e);
            }
        }
        let base_id = self.envoy_base_id.or_else(|| read_base_id(&self.path("proxy/state")));
        let edge_base_id = read_base_id(&self.path("edge/proxy"));
        for (name, child) in [
            ("edge proxy", self.edge_proxy.take()),
            ("edge", self.edge.take()),
            ("mesh-dns", self.mesh_dns.take()),
            ("proxy", self.proxy.take()),
            ("agent", self.agent.take()),
            ("registrar", self.registrar.take()),
        ] {
            if let Some(mut child) = child {
                child.signal(Signal::SIGTERM);
                if child.wait_timeout(STOP_TIMEOUT).is_none() {
                    problems.push(format!("{name} ignored SIGTERM for {STOP_TIMEOUT:?}; killed"));
                }
                child.kill();
            }
        }
        for base_id in [base_id, edge_base_id].into_iter().flatten() {
            let _ = std::fs::remove_file(shm_path(base_id));
        }
        self.node = None;
        unmount_under(&self.work);
        if let Err(e) = std::fs::remove_dir_all(&self.work)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            problems.push(format!("removing {}: {e}", self.work.display()));
        }
        let left = leftovers(std::process::id(), &self.work, base_id);
        problems.extend(left);
        if problems.is_empty() {
            Ok(vec![
                "pods deleted through CNI DEL (capture rules, pins, endpoints, veths, addresses)".into(),
                "the edge gateway and its Envoy, mesh-dns, Envoy (drained), the supervisor, the agent and the registrar stopped"
                    .into(),
                format!(
                    "nothing left behind: no netns, bridge, mount, process or file of this run ({})",
                    self.work.display()
                ),
            ])
        } else {
            Err(fail(format!(
                "cleanup left things behind:\n  {}",
                problems.join("\n  ")
            )))
        }
    }

    /// The teardown as a numbered step.
    pub async fn teardown_step(&mut self) -> Result<(), DemoError> {
        self.progress.n = self.progress.n.max(STEPS - 1);
        self.progress.begin("tearing the node down");
        let r = self.shutdown().await;
        self.progress.end(r)
    }
}
