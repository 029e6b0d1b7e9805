//! Showing the mesh at work: DNS, calls with identity, spread, demand scoping, a hot restart, unmanaged pods.

use super::*;

impl Demo {
    /// Steps 9–18: the mesh at work, each step checked.
    pub(crate) async fn show(&mut self) -> Result<(), DemoError> {
        self.progress
            .begin(format!("frontend resolves {} through DNS", Self::fqdn("backend")));
        let r = self.resolve_by_name().await;
        self.progress.end(r)?;

        self.progress
            .begin(format!("frontend calls http://{}:{APP_PORT}/", Self::fqdn("backend")));
        let r = self.call_by_name().await;
        self.progress.end(r)?;

        self.progress.begin(format!(
            "{} requests from frontend spread over the backend replicas",
            self.options.requests
        ));
        let r = self.spread().await;
        self.progress.end(r)?;

        self.progress
            .begin("an HTTPRoute splits backend 90/10 with a canary and pins x-version: v2 to it");
        let r = self.canary().await;
        self.progress.end(r)?;

        self.progress
            .begin("demand scoping keeps this node's Envoy config small");
        let r = self.demand_scoping().await;
        self.progress.end(r)?;

        self.progress
            .begin("hot restart of Envoy (SIGHUP to the supervisor) under traffic");
        let r = self.hot_restart().await;
        self.progress.end(r)?;

        self.progress.begin("the unmanaged pod is left alone");
        let r = self.unmanaged_left_alone().await;
        self.progress.end(r)?;

        self.progress
            .begin("authorization: strict mTLS refuses plaintext, a policy admits only frontend's identity");
        let r = self.authorization().await;
        self.progress.end(r)?;

        self.progress
            .begin("an edge gateway takes HTTPS from outside the mesh to frontend (Gateway, HTTPRoute, a Secret)");
        let r = self.edge().await;
        self.progress.end(r)?;

        self.progress.begin("where to look next");
        let r = self.where_to_look().await;
        self.progress.end(r)?;
        Ok(())
    }

    pub(crate) async fn resolve_by_name(&mut self) -> Result<Vec<String>, DemoError> {
        let vip = self.backend_vip().await?;
        self.facts.vip = vip.to_string();
        let name = Self::fqdn("backend");
        let netns = self.pod("frontend").netns.as_ref().expect("netns").name().to_owned();
        let queries_before = self.dns_queries().await;
        let deadline = Instant::now() + CONVERGE_TIMEOUT;
        let answer = loop {
            let out = Command::new("ip")
                .args(["netns", "exec", &netns, "dig", "+short", "+time=2", "+tries=1"])
                .arg(format!("@{CLUSTER_DNS}"))
                .args([name.as_str(), "A"])
                .output()
                .map_err(|e| fail(format!("running dig in the frontend's netns: {e}")))?;
            let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
            let answer: Option<Ipv4Addr> = stdout.lines().filter_map(|l| l.trim().parse().ok()).next_back();
            if answer == Some(vip) {
                break answer.expect("some");
            }
            if Instant::now() > deadline {
                return Err(fail(format!(
                    "dig @{CLUSTER_DNS} {name} in the frontend's netns answered {:?} (stderr {:?}), not the VIP {vip}\n\
                     mesh-dns log (tail):\n{}",
                    stdout.trim(),
                    String::from_utf8_lossy(&out.stderr).trim(),
                    tail(&self.mesh_dns.as_ref().map(ChildGuard::logs).unwrap_or_default(), 15)
                )));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        let queries_after = self.dns_queries().await;
        if queries_after <= queries_before {
            return Err(fail(format!(
                "the answer did not come from aether-mesh-dns (its query count stayed at {queries_after})"
            )));
        }
        Ok(vec![
            format!("dig @{CLUSTER_DNS} {name} (the pod's resolver) -> {answer}, the service's mesh VIP"),
            format!(
                "the :53 query was DNAT'ed by the capture rules to aether-mesh-dns at {} (its query count went {} -> {})",
                self.mesh_dns_addr(),
                queries_before,
                queries_after
            ),
        ])
    }

    pub(crate) async fn dns_queries(&self) -> f64 {
        match http_get(&format!("http://127.0.0.1:{}/metrics", self.ports.dns_admin), None).await {
            Ok(reply) => metric_sum(&reply.body, "aether_mesh_dns_queries_total"),
            Err(_) => 0.0,
        }
    }

    pub(crate) fn backend_target(&self) -> Result<SocketAddr, DemoError> {
        let vip: Ipv4Addr = self
            .facts
            .vip
            .parse()
            .map_err(|_| fail("no backend VIP resolved yet"))?;
        Ok(SocketAddr::from((vip, APP_PORT)))
    }

    /// `curl http://backend.demo.aether.internal:8080/hello` in the frontend's netns, resolving the name itself
    /// through the pod's resolv.conf (the cluster DNS address, captured to mesh-dns; the search-path expansions
    /// `ndots:5` tries first are answered NXDOMAIN by mesh-dns without leaving the node).
    pub(crate) async fn call_by_name(&mut self) -> Result<Vec<String>, DemoError> {
        let target = self.backend_target()?;
        let url = format!("http://{}:{APP_PORT}/hello", Self::fqdn("backend"));
        let netns = self.pod("frontend").netns.as_ref().expect("netns").name().to_owned();
        let deadline = Instant::now() + CONVERGE_TIMEOUT;
        let body = loop {
            let out = tokio::process::Command::new("ip")
                .args([
                    "netns",
                    "exec",
                    &netns,
                    "curl",
                    "-sS",
                    "--max-time",
                    "5",
                    "-w",
                    "\n%{http_code} %{remote_ip}",
                ])
                .arg(&url)
                .output()
                .await
                .map_err(|e| fail(format!("running curl in the frontend's netns: {e}")))?;
            let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
            let (body, status) = stdout.rsplit_once('\n').unwrap_or(("", stdout.as_str()));
            if status == format!("200 {}", target.ip()) {
                break serde_json::from_str::<Value>(body)
                    .map_err(|e| fail(format!("the answer to {url} is not the echo JSON ({e}): {body}")))?;
            }
            if Instant::now() > deadline {
                return Err(fail(format!(
                    "curl {url} from frontend did not get 200 from the VIP {} (got {status:?}, stderr {:?})\n\
                     agent log (tail):\n{}",
                    target.ip(),
                    String::from_utf8_lossy(&out.stderr).trim(),
                    tail(&self.agent.as_ref().map(ChildGuard::logs).unwrap_or_default(), 15)
                )));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        let served_by = body["pod"].as_str().unwrap_or_default().to_owned();
        if !served_by.starts_with("backend-") {
            return Err(fail(format!("the answer did not come from a backend replica: {body}")));
        }
        let xfcc = body["headers"]["x-forwarded-client-cert"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let uris = peer_uris(&xfcc);
        let expected = format!("spiffe://{TRUST_DOMAIN}/ns/{NAMESPACE}/sa/frontend");
        if uris != [expected.clone()] {
            return Err(fail(format!(
                "the backend did not see the frontend's SPIFFE ID {expected} (mTLS with the pod's own identity); \
                 x-forwarded-client-cert: {xfcc:?}"
            )));
        }
        self.facts.spiffe_id = expected.clone();
        Ok(vec![
            format!(
                "curl {url} in frontend's netns: the name resolved through the pod's resolv.conf (mesh-dns) to {}",
                target.ip()
            ),
            format!(
                "frontend -> {target} (VIP) -> captured to Envoy's :18001 in frontend's netns -> mTLS -> {served_by}:18008 -> 127.0.0.1:{APP_PORT}"
            ),
            format!("answered by {served_by} with 200"),
            format!("SPIFFE ID the backend saw (x-forwarded-client-cert): {expected}"),
        ])
    }

    pub(crate) async fn spread(&mut self) -> Result<Vec<String>, DemoError> {
        let target = self.backend_target()?;
        let host = format!("{}:{APP_PORT}", Self::fqdn("backend"));
        let netns = self.pod("frontend").netns_path();
        let mut counts: BTreeMap<String, u64> = BTreeMap::from([("backend-1".into(), 0), ("backend-2".into(), 0)]);
        for i in 0..self.options.requests {
            let reply = get_in(&netns, target, &host, &format!("/spread/{i}"))
                .await
                .map_err(|e| fail(format!("request {i} from frontend to {host}: {e}")))?;
            if reply.status != 200 {
                return Err(fail(format!("request {i} answered {}: {}", reply.status, reply.body)));
            }
            let pod = reply.json()?["pod"].as_str().unwrap_or_default().to_owned();
            *counts
                .get_mut(&pod)
                .ok_or_else(|| fail(format!("request {i} was answered by {pod:?}, not a backend replica")))? += 1;
        }
        if let Some((idle, _)) = counts.iter().find(|(_, n)| **n == 0) {
            return Err(fail(format!(
                "{idle} served none of {} requests: {counts:?}",
                self.options.requests
            )));
        }
        let lines = counts.iter().map(|(pod, n)| format!("{pod}: {n} requests")).collect();
        self.facts.per_replica = counts;
        Ok(lines)
    }

    pub(crate) async fn demand_scoping(&mut self) -> Result<Vec<String>, DemoError> {
        let catalog = self
            .registrar_client()
            .await?
            .list_services(ListServicesRequest {})
            .await
            .map_err(|s| fail(format!("listing services: {}", s.message())))?
            .into_inner()
            .services;
        let reply = http_get(
            &format!(
                "http://127.0.0.1:{}/config_dump?resource=dynamic_active_clusters",
                self.ports.envoy_admin
            ),
            None,
        )
        .await
        .map_err(|e| fail(format!("Envoy admin config_dump: {e}")))?;
        let dump: Value =
            serde_json::from_str(&reply.body).map_err(|e| fail(format!("config_dump is not JSON: {e}")))?;
        let mut clusters: Vec<String> = dump["configs"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|c| c["cluster"]["name"].as_str().map(str::to_owned))
            .collect();
        clusters.sort();
        if !clusters.iter().any(|c| c.contains("backend")) {
            return Err(fail(format!(
                "Envoy has no cluster for the frontend's upstream backend: {clusters:?}"
            )));
        }
        let foreign: Vec<&String> = clusters
            .iter()
            .filter(|c| {
                TEAMS
                    .iter()
                    .any(|t| c.contains(&format!(".{t}.")) || c.contains(&format!("{t}/")))
            })
            .collect();
        if !foreign.is_empty() {
            return Err(fail(format!(
                "Envoy got clusters of services no pod here needs: {foreign:?}"
            )));
        }
        if clusters.len() >= catalog.len() {
            return Err(fail(format!(
                "{} clusters for {} catalog services: nothing was scoped",
                clusters.len(),
                catalog.len()
            )));
        }
        self.facts.envoy_clusters = clusters.len();
        self.facts.catalog_services = catalog.len();
        Ok(vec![
            format!(
                "catalog: {} services; this node's Envoy: {} clusters",
                catalog.len(),
                clusters.len()
            ),
            format!("clusters: {}", clusters.join(", ")),
            "only what this node's pods call (their upstreams) and serve; the other teams' services stay out \
             (still reachable on demand over HTTP)"
                .into(),
        ])
    }

    pub(crate) async fn hot_restart(&mut self) -> Result<Vec<String>, DemoError> {
        let target = self.backend_target()?;
        let load = Load::start(LoadSpec {
            target,
            host: format!("{}:{APP_PORT}", Self::fqdn("backend")),
            path: "/load".into(),
            protocol: Protocol::Http1,
            connections: 4,
            streams: 1,
            netns: Some(self.pod("frontend").netns_path()),
        });
        let settle = self.options.restart_load / 2;
        tokio::time::sleep(settle).await;
        let before = load.report();
        if before.ok == 0 {
            let report = load.stop().await;
            return Err(fail(format!("no traffic flows before the restart: {report:?}")));
        }
        let old = self.envoy_pids();
        let supervisor = self
            .proxy
            .as_ref()
            .map(ChildGuard::pid)
            .ok_or_else(|| fail("no supervisor"))?;
        kill(Pid::from_raw(supervisor as i32), Signal::SIGHUP)
            .map_err(|e| fail(format!("SIGHUP to the supervisor: {e}")))?;
        let started = Instant::now();
        if let Err(e) = self.wait_envoy_live(1).await {
            let _ = load.stop().await;
            return Err(e);
        }
        let handoff = started.elapsed();
        // The old epoch drains and exits (parent shutdown) while traffic keeps flowing.
        let deadline = Instant::now() + CONVERGE_TIMEOUT;
        while self.envoy_pids().iter().any(|p| old.contains(p)) {
            if Instant::now() > deadline {
                let _ = load.stop().await;
                return Err(fail(format!(
                    "the old Envoy (pids {old:?}) did not exit after the hot restart"
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tokio::time::sleep(settle).await;
        let report = load.stop().await;
        self.facts.restart_ok = report.ok;
        self.facts.restart_failed = report.failed + report.connect_failures;
        if report.failed != 0 || report.connect_failures != 0 || report.ok <= before.ok {
            return Err(fail(format!("requests failed across the hot restart: {report:#?}")));
        }
        Ok(vec![
            format!(
                "epoch 0 (pid {}) -> epoch 1 (pid {}) LIVE {} ms after SIGHUP; the old epoch drained and exited",
                old.first().copied().unwrap_or(0),
                self.envoy_pids().first().copied().unwrap_or(0),
                handoff.as_millis()
            ),
            format!(
                "{} requests over 4 keep-alive connections from frontend, {} failed ({} reconnects, {} resent never-written)",
                report.ok,
                report.failed + report.connect_failures,
                report.connects.saturating_sub(4),
                report.retried_unsent
            ),
        ])
    }

    pub(crate) async fn unmanaged_left_alone(&mut self) -> Result<Vec<String>, DemoError> {
        let legacy = self.pod("legacy");
        let (netns, ip) = (legacy.netns_path(), legacy.ip.expect("legacy has an IP"));
        if let Some(table) = aether_table(&netns) {
            return Err(fail(format!("the unmanaged pod got capture rules:\n{table}")));
        }
        let pods = http_get(&format!("http://127.0.0.1:{}/debug/pods", self.ports.agent_admin), None)
            .await
            .map_err(|e| fail(format!("agent /debug/pods: {e}")))?
            .body;
        if pods.contains("demo/legacy") {
            return Err(fail(format!("the agent manages the unmanaged pod: {pods}")));
        }
        let registered = self
            .registrar_client()
            .await?
            .list_endpoints(ListEndpointsRequest {
                service: format!("{NAMESPACE}/legacy"),
            })
            .await
            .map(|r| r.into_inner().endpoints.len())
            .unwrap_or(0);
        if registered != 0 {
            return Err(fail("the unmanaged pod was registered in the catalog"));
        }
        // The frontend can still talk to it directly: plain TCP to its pod IP, never through Envoy.
        let reply = get_in(
            &self.pod("frontend").netns_path(),
            SocketAddr::from((ip, APP_PORT)),
            &format!("{ip}:{APP_PORT}"),
            "/direct",
        )
        .await
        .map_err(|e| fail(format!("frontend -> legacy at {ip}:{APP_PORT}: {e}")))?;
        let body = reply.json()?;
        if body["pod"] != "legacy" || body["headers"].get("x-forwarded-client-cert").is_some() {
            return Err(fail(format!(
                "the direct call to legacy did not reach it untouched: {body}"
            )));
        }
        Ok(vec![
            "no nftables table in its netns, not in the agent's pods, not in the catalog".into(),
            format!(
                "frontend -> {ip}:{APP_PORT} (pod IP, not a VIP) reaches legacy directly: no Envoy, no client certificate"
            ),
        ])
    }

    pub(crate) async fn where_to_look(&mut self) -> Result<Vec<String>, DemoError> {
        let p = self.ports;
        let urls = [
            ("agent", format!("http://127.0.0.1:{}/debug/pods", p.agent_admin)),
            (
                "agent",
                format!("http://127.0.0.1:{}/debug/dependencies", p.agent_admin),
            ),
            ("agent", format!("http://127.0.0.1:{}/debug/xds", p.agent_admin)),
            ("agent", format!("http://127.0.0.1:{}/metrics", p.agent_admin)),
            ("registrar", format!("http://127.0.0.1:{}/metrics", p.registrar_admin)),
            (
                "proxy supervisor",
                format!("http://127.0.0.1:{}/debug/proxy", p.proxy_admin),
            ),
            (
                "proxy supervisor",
                format!("http://127.0.0.1:{}/metrics", p.proxy_admin),
            ),
            ("Envoy admin", format!("http://127.0.0.1:{}/config_dump", p.envoy_admin)),
            (
                "Envoy admin",
                format!("http://127.0.0.1:{}/stats/prometheus", p.envoy_admin),
            ),
            ("mesh-dns", format!("http://127.0.0.1:{}/debug/records", p.dns_admin)),
            ("mesh-dns", format!("http://127.0.0.1:{}/metrics", p.dns_admin)),
        ];
        let mut lines = Vec::new();
        for (who, url) in urls {
            let reply = http_get(&url, None)
                .await
                .map_err(|e| fail(format!("{who} {url}: {e}")))?;
            if reply.status != 200 {
                return Err(fail(format!("{who} {url} answered {}", reply.status)));
            }
            lines.push(format!("{who:<17} {url}"));
        }
        lines.extend(self.explain_frontend_to_backend().await?);
        lines.push(format!(
            "pod manifests in {}, CNI log {}",
            self.path("pods").display(),
            self.path("cni.log").display()
        ));
        lines.push(
            "these addresses and files disappear when the demo ends; `target/debug/aether-demo --hold` \
                    keeps the node up until Ctrl-C"
                .into(),
        );
        Ok(lines)
    }

    /// `aether explain` for the demo's one call: every hop must be ok.
    async fn explain_frontend_to_backend(&self) -> Result<Vec<String>, DemoError> {
        let target = format!("{}:{APP_PORT}", Self::fqdn("backend"));
        let agent = format!("127.0.0.1:{}", self.ports.agent_admin);
        let pod = format!("{NAMESPACE}/frontend");
        let args = ["--agent", &agent, "explain", &pod, &target];
        let out = tokio::process::Command::new(bin_dir().join("aether"))
            .args(args)
            .output()
            .await
            .map_err(|e| fail(format!("running aether: {e}")))?;
        let text = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() {
            let stderr = String::from_utf8_lossy(&out.stderr);
            return Err(fail(format!("aether explain frontend -> backend: {text}{stderr}")));
        }
        let mut lines = vec![format!("$ aether {}", args.join(" "))];
        lines.extend(text.lines().map(str::to_owned));
        Ok(lines)
    }

    // ---- helpers -----------------------------------------------------------------------------------------------

    pub(crate) async fn envoy_server_info(&self) -> Result<Value, String> {
        let reply = http_get(
            &format!("http://127.0.0.1:{}/server_info", self.ports.envoy_admin),
            None,
        )
        .await?;
        if reply.status != 200 {
            return Err(format!("Envoy /server_info answered {}", reply.status));
        }
        serde_json::from_str(&reply.body).map_err(|e| format!("/server_info is not JSON: {e}"))
    }

    pub(crate) async fn wait_envoy_live(&mut self, epoch: u64) -> Result<(), DemoError> {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let last = self.envoy_server_info().await;
            if let Ok(info) = &last
                && info["state"] == "LIVE"
                && info["command_line_options"]["restart_epoch"].as_u64() == Some(epoch)
            {
                return Ok(());
            }
            let proxy = self
                .proxy
                .as_mut()
                .ok_or_else(|| fail("the supervisor is not running"))?;
            if let Some(status) = proxy.try_wait() {
                return Err(fail(format!(
                    "aether-agent proxy exited ({status}) before Envoy epoch {epoch} was LIVE; log (tail):\n{}",
                    tail(&proxy.logs(), 20)
                )));
            }
            if Instant::now() > deadline {
                return Err(fail(format!(
                    "Envoy not LIVE at epoch {epoch} within {READY_TIMEOUT:?} (last: {last:?}); supervisor log (tail):\n{}",
                    tail(&proxy.logs(), 20)
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Live Envoy processes of the supervisor's process group.
    pub(crate) fn envoy_pids(&self) -> Vec<u32> {
        let Some(proxy) = &self.proxy else { return Vec::new() };
        let pgid = proxy.pid();
        processes()
            .into_iter()
            .filter(|p| p.pgid == pgid && p.pid != pgid && !p.zombie)
            .map(|p| p.pid)
            .collect()
    }
}
