//! Bringing the node up: prerequisites, the node, the control plane, the proxy, mesh-dns and the pods.

use super::*;

impl Demo {
    /// Steps 1–8: the node, its control plane, its proxy and DNS, and its pods.
    pub(crate) async fn bring_up(&mut self) -> Result<(), DemoError> {
        self.progress
            .begin("checking prerequisites and sweeping leftovers of earlier runs");
        let r = self.prerequisites();
        self.progress.end(r)?;

        self.progress
            .begin("creating the node network (a Linux bridge, as a cluster's primary CNI would)");
        let r = self.create_node();
        self.progress.end(r)?;

        self.progress.begin(format!(
            "starting aether-registrar (embedded store) on 127.0.0.1:{}",
            self.ports.registrar_grpc
        ));
        let r = self.start_registrar().await;
        self.progress.end(r)?;

        self.progress.begin(format!(
            "registering {} services of other teams in the catalog",
            self.options.extra_services
        ));
        let r = self.register_other_services().await;
        self.progress.end(r)?;

        self.progress.begin(format!(
            "starting aether-agent run (built-in CA, trust domain {TRUST_DOMAIN}, static pod source)"
        ));
        let r = self.start_agent().await;
        self.progress.end(r)?;

        self.progress
            .begin("starting aether-agent proxy (Envoy from the shipped proxy/bootstrap.yaml)");
        let r = self.start_proxy().await;
        self.progress.end(r)?;

        self.progress
            .begin(format!("starting aether-mesh-dns on {}", self.mesh_dns_addr()));
        let r = self.start_mesh_dns().await;
        self.progress.end(r)?;

        self.progress.begin(format!(
            "creating {} pods through CNI (bridge + host-local, aether-cni chained)",
            PODS.len()
        ));
        let r = self.create_pods().await;
        self.progress.end(r)?;

        Ok(())
    }

    pub(crate) fn prerequisites(&mut self) -> Result<Vec<String>, DemoError> {
        aether_tests::require_root();
        let swept = sweep_leftovers();
        let mut lines = vec![match swept.len() {
            0 => "no leftovers of earlier runs".to_owned(),
            _ => format!("removed leftovers of killed runs: {}", swept.join(", ")),
        }];
        installed_tools()?;
        self.built_binaries()?;
        self.envoy_bin = aether_tests::envoy_bin();
        lines.push(format!("Envoy {}", self.envoy_bin.display()));
        Ok(lines)
    }

    /// Our binaries and the shipped Envoy bootstrap.
    fn built_binaries(&self) -> Result<(), DemoError> {
        for (bin, component) in [
            ("aether-registrar", "the registrar (registrar/)"),
            ("aether-agent", "the agent (agent/)"),
            ("aether-cni", "the CNI plugin (cni-plugin/)"),
            ("aether-mesh-dns", "mesh-dns (mesh-dns/)"),
        ] {
            let path = self.bins.join(bin);
            if !path.is_file() {
                return Err(DemoError::Missing {
                    component,
                    detail: format!("{} is not built: run `cargo build --workspace --bins`", path.display()),
                });
            }
        }
        let template = aether_tests::supervisor::shipped_template();
        if !template.is_file() {
            return Err(DemoError::Missing {
                component: "the shipped Envoy bootstrap (proxy/bootstrap.yaml)",
                detail: format!("{} does not exist", template.display()),
            });
        }
        Ok(())
    }

    pub(crate) fn create_node(&mut self) -> Result<Vec<String>, DemoError> {
        let node = TestNode::new();
        let (subnet, len) = node.subnet();
        let line = format!(
            "bridge {} with gateway {} on {subnet}/{len}; pods get .100-.250 from host-local",
            node.bridge_name(),
            node.gateway()
        );
        let ours = json!({
            "type": "aether-cni",
            "agentSocket": self.path("run/cni.sock"),
            "stateDir": self.path("cni"),
            "logFile": self.path("cni.log"),
            "logLevel": "info",
        });
        self.conflist = Some(ConfList::new(
            json!({"cniVersion": "1.0.0", "name": "aether-demo", "plugins": [
                bridge_plugin(node.bridge_name(), subnet, node.gateway(), &self.path("ipam")),
                ours,
            ]}),
            vec![PathBuf::from(DEBIAN_CNI_DIR), self.bins.clone()],
        ));
        self.node = Some(node);
        for dir in ["run", "pods", "cni", "ca", "agent", "proxy", "config"] {
            std::fs::create_dir_all(self.path(dir)).map_err(|e| fail(format!("creating {dir}: {e}")))?;
        }
        Ok(vec![line])
    }

    pub(crate) async fn start_registrar(&mut self) -> Result<Vec<String>, DemoError> {
        let control_plane = self.control_plane.insert(ControlPlane::new(&self.work));
        let mut cmd = Command::new(self.bins.join("aether-registrar"));
        cmd.args(["--listen", &format!("127.0.0.1:{}", self.ports.registrar_grpc)])
            .args(control_plane.registrar_args())
            .envs(control_plane.registrar_env())
            .args(["--admin", &format!("127.0.0.1:{}", self.ports.registrar_admin)])
            .args(["--store", "embedded"])
            .arg("--data-dir")
            .arg(self.path("registrar"))
            // The other teams' endpoints below are registered once; keep them for the whole run.
            .args(["--endpoint-ttl", "1h"])
            // Routes and policies as YAML files, as a cluster without Kubernetes (or this demo) gives them.
            .arg("--config-dir")
            .arg(self.path("config"));
        let child = spawn("registrar", cmd);
        let child = self.registrar.insert(child);
        wait_ready(self.ports.registrar_admin, child).await?;
        Ok(vec![
            format!("catalog on a redb file under {}", self.path("registrar").display()),
            format!(
                "routes (HTTPRoute) and policies (AuthorizationPolicy) as YAML files from {}",
                self.path("config").display()
            ),
            "gRPC over mTLS only: agents get node certificates by showing a ServiceAccount token (reviewed by a \
             stand-in Kubernetes API), and each may write only its own node's endpoints"
                .into(),
        ])
    }

    pub(crate) fn registrar_url(&self) -> String {
        format!("https://127.0.0.1:{}", self.ports.registrar_grpc)
    }

    pub(crate) fn control_plane(&self) -> &ControlPlane {
        self.control_plane.as_ref().expect("the registrar was started")
    }

    /// A client with the demo's reader identity (List and Watch).
    pub(crate) async fn registrar_client(&self) -> Result<RegistrarClient<tonic::transport::Channel>, DemoError> {
        let leaf = self.control_plane().node_ca.issue(READER_ID, Duration::from_secs(3600));
        self.control_plane()
            .client_with(&self.registrar_url(), Some(&leaf))
            .await
            .map_err(|e| fail(format!("connecting to the registrar: {e}")))
    }

    /// A client acting as the agent of `node`, for the stand-in endpoints of other nodes.
    pub(crate) async fn registrar_client_as(
        &self,
        node: &str,
    ) -> Result<RegistrarClient<tonic::transport::Channel>, DemoError> {
        let leaf = self
            .control_plane()
            .node_ca
            .issue(&node_id(node), Duration::from_secs(3600));
        self.control_plane()
            .client_with(&self.registrar_url(), Some(&leaf))
            .await
            .map_err(|e| fail(format!("connecting to the registrar as the agent of {node}: {e}")))
    }

    pub(crate) async fn register_other_services(&mut self) -> Result<Vec<String>, DemoError> {
        let mut client = self.registrar_client().await?;
        // The two replicas of each service run on two other nodes, whose agents register them.
        let mut agents = [
            self.registrar_client_as("node-2").await?,
            self.registrar_client_as("node-3").await?,
        ];
        let mut names = Vec::new();
        for i in 0..self.options.extra_services {
            let team = TEAMS[i % TEAMS.len()];
            let name = format!(
                "{}-{}",
                SERVICES[(i / TEAMS.len()) % SERVICES.len()],
                i / (TEAMS.len() * SERVICES.len()) + 1
            );
            let service = format!("{team}/{name}");
            for replica in 0..2u8 {
                let endpoint = Endpoint {
                    service: service.clone(),
                    address: format!("10.250.{}.{}", i / 100, (i % 100) * 2 + usize::from(replica) + 2),
                    ports: vec![Port {
                        name: "http".into(),
                        port: 8080,
                        protocol: PortProtocol::Http as i32,
                    }],
                    locality: Some(Locality {
                        region: "r1".into(),
                        zone: format!("z{}", replica + 1),
                        subzone: String::new(),
                    }),
                    weight: 1,
                    health: Health::Healthy as i32,
                    pod: Some(PodInfo {
                        namespace: team.into(),
                        name: format!("{name}-{replica}"),
                        uid: format!("uid-{team}-{name}-{replica}"),
                        service_account: name.clone(),
                    }),
                    node: format!("node-{}", replica + 2),
                    ..Default::default()
                };
                agents[usize::from(replica)]
                    .register_endpoint(RegisterEndpointRequest {
                        endpoint: Some(endpoint),
                    })
                    .await
                    .map_err(|s| fail(format!("registering {service}: {}", s.message())))?;
            }
            names.push(service);
        }
        let listed = client
            .list_services(ListServicesRequest {})
            .await
            .map_err(|s| fail(format!("listing services: {}", s.message())))?
            .into_inner()
            .services;
        if listed.len() < self.options.extra_services {
            return Err(fail(format!(
                "the catalog lists {} services, expected {}",
                listed.len(),
                names.len()
            )));
        }
        let shown: Vec<&str> = names.iter().take(4).map(String::as_str).collect();
        Ok(vec![format!(
            "{} services with 2 endpoints each on other nodes ({}, ...), each with its own VIP",
            listed.len(),
            shown.join(", ")
        )])
    }

    pub(crate) async fn start_agent(&mut self) -> Result<Vec<String>, DemoError> {
        let ca = TestCa::new("aether demo CA");
        let (cert, key) = ca.write(&self.path("ca"));
        let mut cmd = Command::new(self.bins.join("aether-agent"));
        cmd.arg("run")
            .args(["--node-name", NODE_NAME])
            .args(["--registrar", &self.registrar_url()])
            .args(self.control_plane().agent_args(NODE_NAME))
            .arg("--state-dir")
            .arg(self.path("agent"))
            .arg("--cni-socket")
            .arg(self.path("run/cni.sock"))
            .arg("--xds-socket")
            .arg(self.path("run/xds.sock"))
            .args(["--admin", &format!("127.0.0.1:{}", self.ports.agent_admin)])
            .args(["--pod-source", "static"])
            .arg("--pod-dir")
            .arg(self.path("pods"))
            .arg("--netns-pin-dir")
            .arg(self.path("cni/netns"))
            .args(["--mesh-domain", MESH_DOMAIN])
            .args(["--mesh-dns", &self.mesh_dns_addr().to_string()])
            .args(["--region", "r1", "--zone", "z1"])
            .args(["--identity", "builtin", "--trust-domain", TRUST_DOMAIN])
            .arg("--ca-cert")
            .arg(&cert)
            .arg("--ca-key")
            .arg(&key)
            .args(["--envoy-admin", &format!("127.0.0.1:{}", self.ports.envoy_admin)])
            .env("RUST_LOG", "info");
        let child = spawn("agent", cmd);
        let child = self.agent.insert(child);
        wait_ready(self.ports.agent_admin, child).await?;
        Ok(vec![
            format!("a fresh CA made with rcgen for this run: {}", cert.display()),
            format!(
                "pods are read from {}; DNS from pods goes to {}",
                self.path("pods").display(),
                self.mesh_dns_addr()
            ),
        ])
    }

    pub(crate) async fn start_proxy(&mut self) -> Result<Vec<String>, DemoError> {
        let (envoy_admin, admin) = (self.ports.envoy_admin, self.ports.proxy_admin);
        let cmd = self.proxy_command(NODE_NAME, "proxy/state", "run/xds.sock", envoy_admin, admin);
        let child = spawn("proxy", cmd);
        self.proxy = Some(child);
        self.wait_envoy_live(0).await?;
        let info = self.envoy_server_info().await.map_err(fail)?;
        self.envoy_base_id = info["command_line_options"]["base_id"]
            .as_str()
            .and_then(|s| s.parse().ok())
            .or_else(|| info["command_line_options"]["base_id"].as_u64().map(|b| b as u32));
        Ok(vec![format!(
            "Envoy {} LIVE at epoch 0 (pid {}, base id {}), fed over ADS on {}",
            info["version"].as_str().unwrap_or("?").split('/').nth(1).unwrap_or("?"),
            self.envoy_pids().first().copied().unwrap_or(0),
            self.envoy_base_id.map(|b| b.to_string()).unwrap_or_else(|| "?".into()),
            self.path("run/xds.sock").display()
        )])
    }

    /// `aether-agent proxy` for `node`: Envoy from the shipped bootstrap, fed on `xds` (under the work dir), its
    /// state in `state`, admin ports as given.
    pub(crate) fn proxy_command(&self, node: &str, state: &str, xds: &str, envoy_admin: u16, admin: u16) -> Command {
        let mut cmd = Command::new(self.bins.join("aether-agent"));
        cmd.arg("proxy")
            .args(["--node-name", node])
            .arg("--envoy-bin")
            .arg(&self.envoy_bin)
            .arg("--bootstrap-template")
            .arg(aether_tests::supervisor::shipped_template())
            .arg("--state-dir")
            .arg(self.path(state))
            .arg("--xds-socket")
            .arg(self.path(xds))
            .args(["--envoy-admin", &format!("127.0.0.1:{envoy_admin}")])
            .args(["--admin", &format!("127.0.0.1:{admin}")])
            .args([
                "--drain-time",
                "1s",
                "--parent-shutdown-time",
                "2s",
                "--concurrency",
                "1",
            ])
            .env("RUST_LOG", "info");
        cmd
    }

    pub(crate) async fn start_mesh_dns(&mut self) -> Result<Vec<String>, DemoError> {
        let mut cmd = Command::new(self.bins.join("aether-mesh-dns"));
        cmd.args(["--listen", &self.mesh_dns_addr().to_string()])
            .arg("--records")
            .arg(self.path("agent/mesh-dns/records"))
            .args(["--mesh-domain", MESH_DOMAIN])
            .args(["--admin", &format!("127.0.0.1:{}", self.ports.dns_admin)])
            .args(["--workers", "1"])
            .env("RUST_LOG", "info");
        let child = spawn("mesh-dns", cmd);
        let child = self.mesh_dns.insert(child);
        wait_ready(self.ports.dns_admin, child).await?;
        Ok(vec![format!(
            "serving the agent's record file {} (services with their VIPs)",
            self.path("agent/mesh-dns/records").display()
        )])
    }

    pub(crate) async fn create_pods(&mut self) -> Result<Vec<String>, DemoError> {
        let pid = std::process::id();
        let mut lines = Vec::new();
        for (name, sa, upstreams, managed) in PODS {
            let netns = BareNetns::new();
            write_pod_resolv_conf(netns.name())?;
            let sandbox = Sandbox::new(&format!("{WORK_PREFIX}{pid}-{name}"), &netns.path(), NAMESPACE, name);
            self.pods.push(Pod {
                name: name.into(),
                service_account: sa.into(),
                upstreams: upstreams.into(),
                managed,
                netns: Some(netns),
                sandbox,
                result: None,
                ip: None,
            });
            let index = self.pods.len() - 1;
            self.write_manifest(index)?;
            let conflist = self.conflist.clone().expect("node created");
            let sandbox = self.pods[index].sandbox.clone();
            let results = conflist.add(&sandbox).map_err(|run| {
                fail(format!(
                    "CNI ADD of pod {name} failed in {}: {} {}\ncni log (tail):\n{}\nagent log (tail):\n{}\n\
                     supervisor and Envoy log (tail):\n{}",
                    run.plugin,
                    run.stdout.trim(),
                    run.stderr.trim(),
                    tail(&std::fs::read_to_string(self.path("cni.log")).unwrap_or_default(), 15),
                    tail(&self.agent.as_ref().map(ChildGuard::logs).unwrap_or_default(), 15),
                    tail(&self.proxy.as_ref().map(ChildGuard::logs).unwrap_or_default(), 15),
                ))
            })?;
            let result = results.last().cloned().unwrap_or_default();
            if results.len() != 2 || results[1] != results[0] {
                return Err(fail(format!(
                    "aether-cni did not pass bridge's result through unchanged: {results:?}"
                )));
            }
            let ip: Ipv4Addr = result["ips"][0]["address"]
                .as_str()
                .and_then(|a| a.split('/').next())
                .and_then(|a| a.parse().ok())
                .ok_or_else(|| fail(format!("no IPv4 address in the result of pod {name}: {result}")))?;
            let pod = &mut self.pods[index];
            pod.result = Some(result);
            pod.ip = Some(ip);
            let captured = aether_table(&pod.netns_path()).is_some();
            if captured != managed {
                return Err(fail(format!(
                    "pod {name}: capture rules {} but the pod is {}managed",
                    if captured { "present" } else { "absent" },
                    if managed { "" } else { "not " }
                )));
            }
            // The app container starts once the network is up.
            let app = serve_echo(&pod.netns_path(), name)?;
            self.apps.push(app);
            let what = match (managed, upstreams) {
                (false, _) => "unmanaged (no aether.io/managed label): plugin ran, agent ignored it".to_owned(),
                (true, "") => format!("service {NAMESPACE}/{sa}, captured"),
                (true, u) => format!("service {NAMESPACE}/{sa}, upstreams: {u}, captured"),
            };
            lines.push(format!(
                "{name:<10} {ip:<15} netns {:<16} {what}",
                self.pods[index].sandbox.netns.display()
            ));
        }
        Ok(lines)
    }

    pub(crate) fn write_manifest(&self, index: usize) -> Result<(), DemoError> {
        let pod = &self.pods[index];
        let (_, _, uid) = pod.sandbox.pod.clone().expect("sandbox with pod args");
        let mut labels = serde_json::Map::new();
        labels.insert("app".into(), json!(pod.service_account));
        if pod.managed {
            labels.insert("aether.io/managed".into(), json!("true"));
        }
        let manifest = json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {
                "name": pod.name, "namespace": NAMESPACE, "uid": uid, "labels": labels,
                "annotations": {"config.aether.io/upstreams": pod.upstreams}
            },
            "spec": {
                "nodeName": NODE_NAME,
                "serviceAccountName": pod.service_account,
                "containers": [{"name": "app", "ports": [{"name": "http", "containerPort": APP_PORT}]}]
            }
        });
        let path = self.path(&format!("pods/{}.json", pod.name));
        std::fs::write(&path, serde_json::to_vec_pretty(&manifest).expect("JSON"))
            .map_err(|e| fail(format!("writing {}: {e}", path.display())))
    }

    pub(crate) fn pod(&self, name: &str) -> &Pod {
        self.pods.iter().find(|p| p.name == name).expect("pod exists")
    }

    pub(crate) async fn backend_vip(&self) -> Result<Ipv4Addr, DemoError> {
        let service = self
            .registrar_client()
            .await?
            .list_endpoints(ListEndpointsRequest {
                service: format!("{NAMESPACE}/backend"),
            })
            .await
            .map_err(|s| {
                fail(format!(
                    "the registrar does not know {NAMESPACE}/backend: {}",
                    s.message()
                ))
            })?
            .into_inner()
            .service
            .ok_or_else(|| fail("the registrar returned no service for demo/backend"))?;
        service
            .vip
            .parse()
            .map_err(|_| fail(format!("demo/backend has no IPv4 VIP: {:?}", service.vip)))
    }
}

/// The pods: name, service account (also the `app` label, hence the service), upstreams, managed. Servers before
/// their clients, as a rollout usually goes; `batch` calls backend too, but is not the caller a policy admits.
const PODS: [(&str, &str, &str, bool); 6] = [
    ("backend-1", "backend", "", true),
    ("backend-2", "backend", "", true),
    ("backend-v2", "backend-v2", "", true),
    ("frontend", "frontend", "backend", true),
    ("batch", "batch", "backend", true),
    ("legacy", "legacy", "", false),
];

/// What `make setup` installs from Debian: the primary CNI plugins and the tools the steps use.
fn installed_tools() -> Result<(), DemoError> {
    for plugin in ["bridge", "host-local"] {
        let path = Path::new(DEBIAN_CNI_DIR).join(plugin);
        if !path.is_file() {
            return Err(DemoError::Missing {
                component: "Debian containernetworking-plugins",
                detail: format!("{} does not exist: run `make setup`", path.display()),
            });
        }
    }
    for (tool, flag, component) in [
        ("nft", "--version", "nftables"),
        ("dig", "-v", "bind9-dnsutils (dig)"),
        ("curl", "--version", "curl"),
    ] {
        if Command::new(tool).arg(flag).output().is_err() {
            return Err(DemoError::Missing {
                component,
                detail: format!("`{tool}` is not installed: run `make setup`"),
            });
        }
    }
    Ok(())
}
