//! The Envoy bootstrap: `proxy/bootstrap.yaml` with `{{name}}` placeholders, rendered with typed values.
//!
//! Each value is written as a JSON scalar (a quoted, escaped string or a number), which YAML reads as the same
//! scalar, so a node name or a path can never break out of its field. A placeholder the renderer does not know, or
//! a required one the template lacks, is an error naming it; the supervisor then checks the result with
//! `envoy --mode validate` before any Envoy runs it.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;

/// Placeholders every template must use: the supervisor relies on where Envoy's admin and ADS are.
pub const REQUIRED: [&str; 4] = ["node_id", "admin_address", "admin_port", "xds_socket"];

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BootstrapError {
    #[error("bootstrap template line {line}: unknown placeholder {{{{{name}}}}} (known: {known})")]
    UnknownPlaceholder { name: String, line: usize, known: String },
    #[error("bootstrap template line {line}: a placeholder opened with {{{{ is never closed with }}}}")]
    Unterminated { line: usize },
    #[error("bootstrap template never uses the required placeholder {{{{{0}}}}}")]
    MissingPlaceholder(&'static str),
    #[error("bootstrap parameter {field}: {reason}")]
    BadParameter { field: &'static str, reason: String },
}

/// The values a template is rendered with.
#[derive(Clone, Debug)]
pub struct BootstrapParams {
    pub node_id: String,
    pub node_cluster: String,
    /// The agent's xDS Unix socket.
    pub xds_socket: PathBuf,
    /// `DELTA_GRPC` or `GRPC`.
    pub ads_api_type: String,
    /// Envoy's admin address; must be loopback.
    pub admin: SocketAddr,
    pub max_heap_bytes: u64,
    pub max_downstream_connections: u64,
    /// Envoy `stats_sinks` entries (JSON objects); empty for none.
    pub stats_sinks: Vec<serde_json::Value>,
}

impl BootstrapParams {
    fn values(&self) -> Result<BTreeMap<&'static str, String>, BootstrapError> {
        let bad = |field, reason: &str| BootstrapError::BadParameter {
            field,
            reason: reason.to_owned(),
        };
        if self.node_id.trim().is_empty() {
            return Err(bad(
                "node_id",
                "must not be empty (it is the xDS node id the agent serves)",
            ));
        }
        if self.node_cluster.trim().is_empty() {
            return Err(bad("node_cluster", "must not be empty"));
        }
        if !self.admin.ip().is_loopback() {
            return Err(BootstrapError::BadParameter {
                field: "admin",
                reason: format!(
                    "{} is not a loopback address: Envoy's admin must never be reachable from pods",
                    self.admin
                ),
            });
        }
        if self.admin.port() == 0 {
            return Err(bad(
                "admin",
                "needs a fixed port (the supervisor and every epoch use it)",
            ));
        }
        if !self.xds_socket.is_absolute() {
            return Err(BootstrapError::BadParameter {
                field: "xds_socket",
                reason: format!("{} is not an absolute path", self.xds_socket.display()),
            });
        }
        if !matches!(self.ads_api_type.as_str(), "DELTA_GRPC" | "GRPC") {
            return Err(BootstrapError::BadParameter {
                field: "ads_api_type",
                reason: format!("{:?} is neither DELTA_GRPC nor GRPC", self.ads_api_type),
            });
        }
        if self.max_heap_bytes == 0 {
            return Err(bad("max_heap_bytes", "must be above 0"));
        }
        if self.max_downstream_connections == 0 {
            return Err(bad("max_downstream_connections", "must be above 0"));
        }
        if let Some(bad) = self.stats_sinks.iter().position(|sink| !sink.is_object()) {
            return Err(BootstrapError::BadParameter {
                field: "stats_sinks",
                reason: format!("entry {bad} is not an object"),
            });
        }
        let string = |s: &str| serde_json::Value::from(s).to_string();
        Ok(BTreeMap::from([
            ("node_id", string(&self.node_id)),
            ("node_cluster", string(&self.node_cluster)),
            ("xds_socket", string(&self.xds_socket.to_string_lossy())),
            ("ads_api_type", string(&self.ads_api_type)),
            ("admin_address", string(&self.admin.ip().to_string())),
            ("admin_port", self.admin.port().to_string()),
            ("max_heap_bytes", self.max_heap_bytes.to_string()),
            (
                "max_downstream_connections",
                self.max_downstream_connections.to_string(),
            ),
            (
                "stats_sinks",
                serde_json::Value::from(self.stats_sinks.clone()).to_string(),
            ),
        ]))
    }
}

/// Renders `template` with `params`: the YAML Envoy is started with.
pub fn render(template: &str, params: &BootstrapParams) -> Result<String, BootstrapError> {
    let values = params.values()?;
    let mut out = String::with_capacity(template.len() + 256);
    let mut used = std::collections::BTreeSet::new();
    for (index, line) in template.split_inclusive('\n').enumerate() {
        // Comments may mention placeholders; they are copied as they are.
        if line.trim_start().starts_with('#') {
            out.push_str(line);
            continue;
        }
        let mut rest = line;
        while let Some(start) = rest.find("{{") {
            out.push_str(&rest[..start]);
            let after = &rest[start + 2..];
            let end = after
                .find("}}")
                .ok_or(BootstrapError::Unterminated { line: index + 1 })?;
            let name = after[..end].trim();
            let value = values.get(name).ok_or_else(|| BootstrapError::UnknownPlaceholder {
                name: name.to_owned(),
                line: index + 1,
                known: values.keys().copied().collect::<Vec<_>>().join(", "),
            })?;
            used.insert(name.to_owned());
            out.push_str(value);
            rest = &after[end + 2..];
        }
        out.push_str(rest);
    }
    if let Some(missing) = REQUIRED.iter().find(|name| !used.contains(**name)) {
        return Err(BootstrapError::MissingPlaceholder(missing));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    pub(crate) fn params() -> BootstrapParams {
        BootstrapParams {
            node_id: "node-1".into(),
            node_cluster: "aether".into(),
            xds_socket: "/run/aether/xds.sock".into(),
            ads_api_type: "DELTA_GRPC".into(),
            admin: "127.0.0.1:15000".parse().unwrap(),
            max_heap_bytes: 1 << 30,
            max_downstream_connections: 50_000,
            stats_sinks: Vec::new(),
        }
    }

    const MINIMAL: &str = "node: {id: {{node_id}}}\nadmin: {{admin_address}}:{{admin_port}}\n\
                           x: {{ xds_socket }}\n";

    #[test]
    fn values_are_json_scalars() {
        let mut p = params();
        p.node_id = "evil\"\n}: x".into();
        let out = render(MINIMAL, &p).unwrap();
        assert!(out.starts_with("node: {id: \"evil\\\"\\n}: x\"}\n"), "{out}");
        assert!(out.contains("admin: \"127.0.0.1\":15000"), "{out}");
        assert!(out.contains("x: \"/run/aether/xds.sock\""), "{out}");
    }

    #[test]
    fn comment_lines_are_copied() {
        let out = render(&format!("# {{{{whatever}}}}\n{MINIMAL}"), &params()).unwrap();
        assert!(out.starts_with("# {{whatever}}\n"));
    }

    #[test]
    fn unknown_unterminated_and_missing_placeholders_are_named() {
        let err = render(&format!("{MINIMAL}y: {{{{nodeid}}}}\n"), &params()).unwrap_err();
        assert!(
            matches!(&err, BootstrapError::UnknownPlaceholder { name, line: 4, .. } if name == "nodeid"),
            "{err:?}"
        );
        assert!(err.to_string().contains("{{nodeid}}"), "{err}");
        assert_eq!(
            render(&format!("{MINIMAL}y: {{{{node_id\n"), &params()),
            Err(BootstrapError::Unterminated { line: 4 })
        );
        assert_eq!(
            render("node: {{node_id}}\n", &params()),
            Err(BootstrapError::MissingPlaceholder("admin_address"))
        );
    }

    #[test]
    fn bad_parameters_are_refused_by_field() {
        let mut p = params();
        p.admin = "0.0.0.0:15000".parse().unwrap();
        let err = render(MINIMAL, &p).unwrap_err();
        assert!(
            matches!(err, BootstrapError::BadParameter { field: "admin", .. }),
            "{err:?}"
        );
        let mut p = params();
        p.node_id = " ".into();
        assert!(matches!(
            render(MINIMAL, &p),
            Err(BootstrapError::BadParameter { field: "node_id", .. })
        ));
        let mut p = params();
        p.xds_socket = "relative.sock".into();
        assert!(matches!(
            render(MINIMAL, &p),
            Err(BootstrapError::BadParameter {
                field: "xds_socket",
                ..
            })
        ));
    }

    proptest! {
        #[test]
        fn text_without_placeholders_passes_through(text in "[^{#]*") {
            let template = format!("{MINIMAL}{text}");
            let out = render(&template, &params()).unwrap();
            prop_assert!(out.ends_with(&text));
        }

        #[test]
        fn any_string_parameter_stays_one_json_string(node in any::<String>().prop_filter("non-empty", |s| !s.trim().is_empty())) {
            let mut p = params();
            p.node_id = node.clone();
            let out = render("{{node_id}}\n{{admin_address}}{{admin_port}}{{xds_socket}}", &p).unwrap();
            let first = out.lines().next().unwrap();
            let parsed: String = serde_json::from_str(first).unwrap();
            prop_assert_eq!(parsed, node);
        }

        #[test]
        fn rendering_never_panics(template in ".*") {
            let _ = render(&template, &params());
        }
    }
}

/// The shipped template, rendered and checked by the real Envoy (`make setup` installs it).
#[cfg(test)]
mod envoy_validates {
    use super::tests::params;
    use super::*;
    use crate::proxy::envoy::EnvoyBinary;

    fn shipped_template() -> String {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../proxy/bootstrap.yaml");
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    #[tokio::test]
    async fn the_shipped_template_renders_to_a_bootstrap_envoy_accepts() {
        let envoy = EnvoyBinary::new(crate::proxy::envoy::test_envoy_bin());
        let dir = tempfile::tempdir().unwrap();
        for ads in ["DELTA_GRPC", "GRPC"] {
            let mut p = params();
            p.ads_api_type = ads.into();
            if ads == "GRPC" {
                // With the OTLP stats sink the observability work renders.
                p.stats_sinks = vec![serde_json::json!({
                    "name": "envoy.stat_sinks.open_telemetry",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.stat_sinks.open_telemetry.v3.SinkConfig",
                        "grpc_service": {"google_grpc": {"target_uri": "127.0.0.1:4317", "stat_prefix": "otlp"}},
                        "emit_tags_as_attributes": true, "use_tag_extracted_name": true
                    }
                })];
            }
            let rendered = render(&shipped_template(), &p).unwrap();
            let path = dir.path().join(format!("bootstrap-{ads}.yaml"));
            std::fs::write(&path, &rendered).unwrap();
            envoy
                .validate(&path)
                .await
                .unwrap_or_else(|e| panic!("Envoy rejects the rendered template ({ads}): {e}\n{rendered}"));
        }
    }

    #[tokio::test]
    async fn envoy_rejects_a_poisoned_bootstrap_and_says_why() {
        let envoy = EnvoyBinary::new(crate::proxy::envoy::test_envoy_bin());
        let dir = tempfile::tempdir().unwrap();
        let poisoned = shipped_template().replace("connect_timeout: 1s", "connect_timeout: 1s\n      no_such_field: 1");
        let path = dir.path().join("bootstrap.yaml");
        std::fs::write(&path, render(&poisoned, &params()).unwrap()).unwrap();
        let err = envoy.validate(&path).await.unwrap_err().to_string();
        assert!(err.contains("no_such_field"), "{err}");
    }
}
