//! North-south: an edge gateway (`aether-agent edge` and its own Envoy under `aether-agent proxy`) serves a
//! Gateway with an HTTPS listener (a demo certificate from a Secret) and an HTTPRoute to frontend; a request from the
//! host, outside the mesh, reaches frontend over mTLS with the gateway's own SPIFFE ID.

use super::*;

/// The name the demo's HTTPS listener serves.
pub(crate) const EDGE_HOST: &str = "shop.example.com";
/// The gateway's service account: its identity in the mesh.
const EDGE_SERVICE_ACCOUNT: &str = "edge-gateway";

/// The Gateway API objects, as a user would `kubectl apply` them (here: files in the edge's `--config-dir`).
fn edge_objects(port: u16, certificate: &aether_tests::identity::Leaf) -> String {
    let quoted = |text: &str| serde_json::to_string(text).expect("a string");
    format!(
        r#"apiVersion: gateway.networking.k8s.io/v1
kind: GatewayClass
metadata: {{name: aether}}
spec: {{controllerName: aether.io/edge}}
---
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {{name: edge, namespace: {NAMESPACE}}}
spec:
  gatewayClassName: aether
  listeners:
  - name: https
    port: {port}
    protocol: HTTPS
    hostname: {EDGE_HOST}
    tls: {{mode: Terminate, certificateRefs: [{{name: shop-cert}}]}}
---
apiVersion: v1
kind: Secret
metadata: {{name: shop-cert, namespace: {NAMESPACE}}}
type: kubernetes.io/tls
stringData:
  tls.crt: {}
  tls.key: {}
---
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {{name: shop, namespace: {NAMESPACE}}}
spec:
  parentRefs: [{{name: edge}}]
  hostnames: [{EDGE_HOST}]
  rules: [{{backendRefs: [{{name: frontend, port: {APP_PORT}}}]}}]
"#,
        quoted(&certificate.cert_pem),
        quoted(&certificate.key_pem),
    )
}

impl Demo {
    pub(crate) async fn edge(&mut self) -> Result<Vec<String>, DemoError> {
        let ca = TestCa::new("aether demo edge CA");
        let certificate = ca.issue_server_names(&[EDGE_HOST], Duration::from_secs(3600));
        let port = self.ports.edge_https;
        let config = self.path("edge/config");
        std::fs::create_dir_all(&config).map_err(|e| fail(format!("creating {}: {e}", config.display())))?;
        canary::write_atomically(&config.join("gateway.yaml"), &edge_objects(port, &certificate))?;
        self.start_edge(&config).await?;

        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let deadline = Instant::now() + CONVERGE_TIMEOUT;
        let (reply, presented) = loop {
            let answer =
                aether_tests::http::https_request(addr, EDGE_HOST, &ca.cert_pem, "GET", "/shop", EDGE_HOST, &[], "")
                    .await;
            match answer {
                Ok((reply, presented)) if reply.status == 200 => break (reply, presented),
                other if Instant::now() > deadline => {
                    let edge_log = self.edge.as_ref().map(ChildGuard::logs).unwrap_or_default();
                    return Err(fail(format!(
                        "https://{EDGE_HOST}:{port}/shop through the edge never answered 200 (last: {other:?})\n\
                         edge log (tail):\n{}",
                        tail(&edge_log, 15)
                    )));
                }
                _ => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        };
        let body: Value = serde_json::from_str(&reply.body).map_err(|e| fail(format!("not the app's JSON: {e}")))?;
        let served_by = body["pod"].as_str().unwrap_or_default().to_owned();
        if served_by != "frontend" {
            return Err(fail(format!("the answer did not come from frontend: {body}")));
        }
        let xfcc = body["headers"]["x-forwarded-client-cert"].as_str().unwrap_or_default();
        let expected = format!("spiffe://{TRUST_DOMAIN}/ns/{NAMESPACE}/sa/{EDGE_SERVICE_ACCOUNT}");
        if peer_uris(xfcc) != [expected.clone()] {
            return Err(fail(format!(
                "frontend did not see the gateway's SPIFFE ID {expected}; x-forwarded-client-cert: {xfcc:?}"
            )));
        }
        if presented.first() != Some(&certificate.cert_der) {
            return Err(fail("the edge did not present the Secret's certificate"));
        }
        self.facts.edge = format!("https://{EDGE_HOST} -> edge (TLS) -> mTLS as {expected} -> frontend");
        Ok(vec![
            format!("Gateway {NAMESPACE}/edge: HTTPS listener for {EDGE_HOST} with the Secret shop-cert (a demo CA)"),
            format!("HTTPRoute {NAMESPACE}/shop: {EDGE_HOST} -> frontend:{APP_PORT}"),
            format!("curl https://{EDGE_HOST}:{port}/shop from the host: 200 from {served_by}"),
            format!("the certificate served is the Secret's; frontend saw the gateway as {expected}"),
        ])
    }

    /// `aether-agent edge` on the config dir and its own `aether-agent proxy`, LIVE.
    async fn start_edge(&mut self, config: &Path) -> Result<(), DemoError> {
        let xds = self.path("run/edge-xds.sock");
        let mut cmd = Command::new(self.bins.join("aether-agent"));
        cmd.arg("edge")
            .args(["--gateway", &format!("{NAMESPACE}/edge")])
            .arg("--config-dir")
            .arg(config)
            .args(["--registrar", &self.registrar_url()])
            .args(self.control_plane().edge_args(NAMESPACE, EDGE_SERVICE_ACCOUNT))
            .args(["--pod-name", "demo-edge", "--namespace", NAMESPACE])
            .args(["--service-account", EDGE_SERVICE_ACCOUNT])
            .arg("--xds-socket")
            .arg(&xds)
            .args(["--admin", &format!("127.0.0.1:{}", self.ports.edge_admin)])
            .args(["--bind-address", "127.0.0.1", "--mesh-domain", MESH_DOMAIN])
            .args(["--identity", "builtin", "--trust-domain", TRUST_DOMAIN])
            .arg("--ca-cert")
            .arg(self.path("ca/ca.crt"))
            .arg("--ca-key")
            .arg(self.path("ca/ca.key"))
            .env("RUST_LOG", "info");
        let child = self.edge.insert(spawn("edge", cmd));
        wait_ready(self.ports.edge_admin, child).await?;

        let (envoy_admin, admin) = (self.ports.edge_envoy_admin, self.ports.edge_proxy_admin);
        let cmd = self.proxy_command("demo-edge", "edge/proxy", "run/edge-xds.sock", envoy_admin, admin);
        let child = self.edge_proxy.insert(spawn("edge-proxy", cmd));
        wait_ready(self.ports.edge_proxy_admin, child).await
    }
}
