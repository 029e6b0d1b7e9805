//! A fixture file, typed: the case, its request rows and their expectations, and the check of one answer against
//! one expectation (pure, so it is unit-tested without a mesh).

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use serde::Deserialize;

use super::Observed;

/// One fixture file.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Case {
    /// The file's stem; not in the file.
    #[serde(skip)]
    pub name: String,
    /// What the case shows, in one sentence.
    pub about: String,
    /// The gateway-api conformance test it restates, if any.
    #[serde(default)]
    pub restates: Option<String>,
    /// Gateway API feature names (and ours: RequestTimeout, Retry, …) the case exercises.
    pub features: Vec<String>,
    /// Gateway API YAML (one or more documents) written into the registrar's routes directory; empty for a case
    /// about the mesh without routes.
    #[serde(default)]
    pub routes: String,
    /// Edge cases only: the Gateway's `spec.listeners` (YAML) for this case, instead of the standard ones
    /// ([`crate::edge::STANDARD_LISTENERS`]).
    #[serde(default)]
    pub gateway: Option<String>,
    pub requests: Vec<Row>,
    /// Weighted splits checked once every row holds.
    #[serde(default)]
    pub splits: Vec<Split>,
}

/// One request and what must come of it.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Row {
    /// The client pod: `client` (namespace demo) or `consumer` (namespace consumer).
    #[serde(default = "client")]
    pub from: String,
    /// The service called, in namespace demo (by its VIP, with its mesh name as the authority, unless `via` says).
    #[serde(default = "echo")]
    pub to: String,
    #[serde(default = "http_port")]
    pub port: u16,
    /// The address the connection goes to.
    #[serde(default)]
    pub via: Via,
    #[serde(default = "get")]
    pub method: String,
    /// Path with query.
    #[serde(default = "root")]
    pub path: String,
    /// Request headers; `{nonce}` in a value becomes a token unique to each request sent.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// The authority sent instead of the default one (the connection still goes to the same address).
    #[serde(default)]
    pub authority: Option<String>,
    /// A unary gRPC call instead of an HTTP request (`path` is then ignored).
    #[serde(default)]
    pub grpc: Option<GrpcCall>,
    /// Passes in a row that make the row settled (default [`super::CONSECUTIVE_PASSES`]).
    #[serde(default)]
    pub passes: Option<usize>,
    pub expect: Expect,
}

/// How a client reaches the service it calls.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum Via {
    /// Its mesh VIP, with its mesh name (`<svc>.demo.aether.internal`) as the authority.
    #[default]
    Vip,
    /// Its Kubernetes Service's ClusterIP (captured by the pod's ClusterIP set), with its Kubernetes name
    /// (`<svc>.demo.svc.cluster.local`) as the authority; only in a suite with Kubernetes Services.
    ClusterIp,
    /// The edge gateway's listener on `port`, in plain HTTP from outside the mesh (the root netns); `authority`
    /// is required. `from` and `to` are not used.
    Edge,
    /// The edge gateway's listener on `port` over TLS, with the authority's host as SNI, trusting the edge's
    /// test CA.
    EdgeTls,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GrpcCall {
    /// Fully qualified gRPC service, e.g. `aether.test.Echo`.
    pub service: String,
    pub method: String,
}

impl GrpcCall {
    pub fn path(&self) -> String {
        format!("/{}/{}", self.service, self.method)
    }
}

/// What a row's answer must show; unset fields are not checked.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Expect {
    /// HTTP status (a gRPC call: the HTTP status, and `grpc-status: 0` when 200).
    #[serde(default = "ok")]
    pub status: u16,
    /// A gRPC call's `grpc-status`; unset: `0` whenever `status` is 200.
    #[serde(default)]
    pub grpc_status: Option<String>,
    /// The service whose pod answered: one name, or a list of which any will do (weighted rules).
    #[serde(default, deserialize_with = "one_or_many")]
    pub backend: Vec<String>,
    /// Path with query as the backend saw it.
    #[serde(default)]
    pub path: Option<String>,
    /// Host (authority) as the backend saw it.
    #[serde(default)]
    pub host: Option<String>,
    /// Headers the backend saw (names case-insensitive; repeated ones joined with ",").
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// Headers the backend must not see.
    #[serde(default)]
    pub absent: Vec<String>,
    #[serde(default)]
    pub response_headers: BTreeMap<String, String>,
    #[serde(default)]
    pub response_absent: Vec<String>,
    /// The redirect's Location, part by part.
    #[serde(default)]
    pub redirect: Option<Redirect>,
    /// Bounds on how long the answer took, in milliseconds.
    #[serde(default)]
    pub elapsed_ms: Option<[u64; 2]>,
    /// An `edge-tls` row: a DNS name the certificate the edge served must carry.
    #[serde(default)]
    pub certificate: Option<String>,
    /// Services that must also have received the request (a mirror's copy), besides the one that answered.
    #[serde(default)]
    pub mirrored_to: Vec<String>,
}

/// The parts of a Location header that are checked; unset ones are not.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Redirect {
    pub scheme: Option<String>,
    pub host: Option<String>,
    /// 0: the Location names no port.
    pub port: Option<u16>,
    pub path: Option<String>,
}

/// Many requests to one service and the share each backend service must answer.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Split {
    #[serde(default = "client")]
    pub from: String,
    #[serde(default = "echo")]
    pub to: String,
    #[serde(default = "http_port")]
    pub port: u16,
    #[serde(default = "root")]
    pub path: String,
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    #[serde(default)]
    pub grpc: Option<GrpcCall>,
    /// How the requests travel (see [`Row::via`]).
    #[serde(default)]
    pub via: Via,
    /// The authority sent (required for edge splits).
    #[serde(default)]
    pub authority: Option<String>,
    #[serde(default = "five_hundred")]
    pub requests: usize,
    /// Backend service → expected share (0..=1); every answer must come from one of them.
    pub shares: BTreeMap<String, f64>,
    /// Allowed distance from each share.
    #[serde(default = "five_percent")]
    pub tolerance: f64,
}

fn client() -> String {
    "client".into()
}
fn echo() -> String {
    "echo".into()
}
fn http_port() -> u16 {
    80
}
fn get() -> String {
    "GET".into()
}
fn root() -> String {
    "/".into()
}
fn ok() -> u16 {
    200
}
fn five_hundred() -> usize {
    500
}
fn five_percent() -> f64 {
    0.05
}

/// Every `*.yaml` case in `dir`, sorted by name.
pub fn load_cases(dir: &Path) -> Result<Vec<Case>, String> {
    let entries = std::fs::read_dir(dir).map_err(|e| format!("reading {}: {e}", dir.display()))?;
    let mut paths: Vec<_> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    paths.sort();
    paths.iter().map(|p| load_case(p)).collect()
}

fn load_case(path: &Path) -> Result<Case, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
    let mut case: Case = serde_saphyr::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    case.name = path.file_stem().unwrap_or_default().to_string_lossy().into_owned();
    if case.requests.is_empty() {
        return Err(format!("{}: no requests", path.display()));
    }
    Ok(case)
}

impl Row {
    /// How a failure names the row: its number and the request.
    pub fn describe(&self, index: usize) -> String {
        let what = match &self.grpc {
            Some(call) => format!("gRPC {}", call.path()),
            None => format!("{} {}", self.method, self.path),
        };
        let headers = if self.headers.is_empty() {
            String::new()
        } else {
            format!(" {:?}", self.headers)
        };
        let via = match self.via {
            Via::Vip => "",
            Via::ClusterIp => " by ClusterIP",
            Via::Edge | Via::EdgeTls => {
                let scheme = if self.via == Via::Edge { "http" } else { "https" };
                let authority = self.authority.as_deref().unwrap_or("?");
                return format!(
                    "row {index} (edge {scheme}://{authority} on port {}: {what}{headers})",
                    self.port
                );
            }
        };
        format!(
            "row {index} ({} → {}:{}{via} {what}{headers})",
            self.from, self.to, self.port
        )
    }
}

impl Expect {
    /// Every way `got` differs from this expectation (empty: it holds).
    pub fn check(&self, got: &Observed) -> Vec<String> {
        let mut errors = Vec::new();
        if got.status != self.status {
            errors.push(format!("status: want {}, got {}", self.status, got.status));
        }
        let want_grpc = match (&self.grpc_status, self.status) {
            (Some(want), _) => Some(want.as_str()),
            (None, 200) if got.grpc_status.is_some() => Some("0"),
            (None, _) => None,
        };
        if let Some(want) = want_grpc
            && got.grpc_status.as_deref() != Some(want)
        {
            errors.push(format!("grpc-status: want {want}, got {:?}", got.grpc_status));
        }
        let seen = |field: &str| got.backend_field(field);
        let service = seen("service").unwrap_or_default();
        if !self.backend.is_empty() && !self.backend.contains(&service) {
            errors.push(format!("backend service: want {:?}, got {service:?}", self.backend));
        }
        for (field, want) in [("path", &self.path), ("host", &self.host)] {
            if let Some(want) = want
                && seen(field).as_deref() != Some(want.as_str())
            {
                errors.push(format!("backend {field}: want {want:?}, got {:?}", seen(field)));
            }
        }
        let backend_headers = got.backend_headers();
        super::compare_headers(
            "backend header",
            &self.headers,
            &self.absent,
            &backend_headers,
            &mut errors,
        );
        let response = &got.headers;
        super::compare_headers(
            "response header",
            &self.response_headers,
            &self.response_absent,
            response,
            &mut errors,
        );
        if let Some(redirect) = &self.redirect {
            redirect.check(got.headers.get("location"), &mut errors);
        }
        if let Some([min, max]) = self.elapsed_ms
            && !(Duration::from_millis(min)..=Duration::from_millis(max)).contains(&got.elapsed)
        {
            errors.push(format!("took {:?}, want {min}..={max} ms", got.elapsed));
        }
        for service in &self.mirrored_to {
            if !got.traced.contains(service) {
                errors.push(format!(
                    "no copy reached {service:?} (the request was seen by {:?})",
                    got.traced
                ));
            }
        }
        if let Some(name) = &self.certificate
            && !got.certificate_names.contains(name)
        {
            errors.push(format!(
                "served certificate: want one naming {name:?}, got names {:?}",
                got.certificate_names
            ));
        }
        errors
    }
}

impl Redirect {
    fn check(&self, location: Option<&String>, errors: &mut Vec<String>) {
        let Some(location) = location else {
            errors.push("no Location header".into());
            return;
        };
        let Ok(uri) = location.parse::<hyper::Uri>() else {
            errors.push(format!("Location {location:?} is not a URI"));
            return;
        };
        let mut differs = |part: &str, want: Option<String>, got: Option<String>| {
            if want.is_some() && want != got {
                errors.push(format!("Location {location:?}: {part} want {want:?}, got {got:?}"));
            }
        };
        differs("scheme", self.scheme.clone(), uri.scheme_str().map(str::to_owned));
        differs("host", self.host.clone(), uri.host().map(str::to_owned));
        let port = uri.port_u16().unwrap_or(0);
        differs("port", self.port.map(|p| p.to_string()), Some(port.to_string()));
        differs("path", self.path.clone(), Some(uri.path().to_owned()));
    }
}

/// A YAML field that is one string or a list of them.
fn one_or_many<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(String),
        Many(Vec<String>),
    }
    Ok(match OneOrMany::deserialize(d)? {
        OneOrMany::One(one) => vec![one],
        OneOrMany::Many(many) => many,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(status: u16, echo: serde_json::Value, headers: &[(&str, &str)]) -> Observed {
        Observed {
            status,
            body: Some(echo),
            headers: headers.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            ..Observed::default()
        }
    }

    fn expect(yaml: &str) -> Expect {
        serde_saphyr::from_str(yaml).unwrap()
    }

    #[test]
    fn backends_headers_and_paths_are_checked_only_when_asked() {
        let got = answer(
            200,
            serde_json::json!({"service": "echo-v2", "path": "/one?x=1", "headers": {"x-a": "1,2"}}),
            &[("x-route", "on")],
        );
        assert!(
            expect("{backend: [echo-v1, echo-v2], path: /one?x=1}")
                .check(&got)
                .is_empty()
        );
        assert!(
            expect("{headers: {X-A: '1,2'}, response_headers: {X-Route: 'on'}}")
                .check(&got)
                .is_empty()
        );
        let errors = expect("{backend: echo-v1, absent: [x-a], response_absent: [x-route]}").check(&got);
        assert_eq!(errors.len(), 3, "{errors:?}");
        assert_eq!(expect("{status: 404}").check(&got), ["status: want 404, got 200"]);
    }

    #[test]
    fn a_redirect_is_checked_part_by_part_and_port_0_means_none() {
        let got = answer(
            302,
            serde_json::Value::Null,
            &[("location", "https://elsewhere.example/new")],
        );
        assert!(
            expect("{status: 302, redirect: {scheme: https, host: elsewhere.example, port: 0, path: /new}}")
                .check(&got)
                .is_empty()
        );
        let errors = expect("{status: 302, redirect: {port: 8443}}").check(&got);
        assert_eq!(errors.len(), 1, "{errors:?}");
        let no_location = answer(302, serde_json::Value::Null, &[]);
        assert_eq!(
            expect("{status: 302, redirect: {}}").check(&no_location),
            ["no Location header"]
        );
    }

    #[test]
    fn a_grpc_answer_must_carry_status_0_unless_told_otherwise() {
        let mut got = answer(200, serde_json::json!({"service": "echo"}), &[]);
        got.grpc_status = Some("12".into());
        assert_eq!(expect("{}").check(&got), ["grpc-status: want 0, got Some(\"12\")"]);
        assert!(expect("{grpc_status: '12'}").check(&got).is_empty());
    }

    #[test]
    fn mirrored_copies_and_served_certificates_must_be_seen() {
        let mut got = answer(200, serde_json::json!({"service": "echo-v1"}), &[]);
        got.traced = vec!["echo-v1".into()];
        assert_eq!(
            expect("{mirrored_to: [echo-v2]}").check(&got),
            ["no copy reached \"echo-v2\" (the request was seen by [\"echo-v1\"])"]
        );
        got.traced.push("echo-v2".into());
        assert!(expect("{mirrored_to: [echo-v2]}").check(&got).is_empty());
        got.certificate_names = vec!["*.example.com".into()];
        assert!(expect("{certificate: '*.example.com'}").check(&got).is_empty());
        assert_eq!(expect("{certificate: '*.example.org'}").check(&got).len(), 1);
    }
}
