//! A pod's mesh annotations, validated in one place: the agent (which applies them), the
//! controller's pod webhook (which refuses a pod whose annotations it would ignore) and
//! `aether explain` all read them through these functions, so apply-time and run-time
//! verdicts agree.
//!
//! - `config.aether.io/upstreams`: the services the pod calls ([`upstreams`]);
//! - `config.aether.io/service`: the service the pod serves (a DNS-1123 label);
//! - `security.aether.io/inbound-mtls`: `strict` or `permissive` ([`InboundMtls`]);
//! - `endpoint.aether.io/uds-socket`: the Unix socket inbound traffic is delivered to;
//! - `protocol.aether.io/l7`: which of the pod's stream ports the node parses ([`l7_protocols`]).

use std::collections::BTreeMap;

use aether_common::pod_meta::{AppProtocol, SERVICE_ANNOTATION};
use aether_common::quote::quote;

pub mod upstreams;

/// The annotation that sets a pod's inbound mTLS mode.
pub const INBOUND_MTLS_ANNOTATION: &str = "security.aether.io/inbound-mtls";

/// How a pod's app ports may be reached.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum InboundMtls {
    /// Only through the mesh (and from the node, for probes).
    #[default]
    Strict,
    /// Also in plaintext, from anywhere that routes to the pod (migration).
    Permissive,
}

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum InboundError {
    #[error("{INBOUND_MTLS_ANNOTATION}: {} is not strict or permissive", quote(.0))]
    Mode(String),
}

impl InboundMtls {
    pub fn as_str(self) -> &'static str {
        match self {
            InboundMtls::Strict => "strict",
            InboundMtls::Permissive => "permissive",
        }
    }

    /// An annotation's (or flag's) value; case does not matter (Istio spells the modes in
    /// capitals).
    pub fn parse(text: &str) -> Result<Self, InboundError> {
        match text.trim().to_ascii_lowercase().as_str() {
            "strict" => Ok(InboundMtls::Strict),
            "permissive" => Ok(InboundMtls::Permissive),
            _ => Err(InboundError::Mode(text.to_owned())),
        }
    }
}

impl std::fmt::Display for InboundMtls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Delivers the pod's inbound traffic to a Unix socket in one of its volumes instead of
/// its loopback ports: `<volume>/<file>`, an emptyDir volume of the pod and a socket file
/// directly in it.
pub const UDS_SOCKET_ANNOTATION: &str = "endpoint.aether.io/uds-socket";

/// The longest socket file name (the node's link to the volume keeps the whole path
/// within the 107 bytes a Unix socket address holds).
pub const UDS_FILE_MAX: usize = 48;

/// Where [`UDS_SOCKET_ANNOTATION`] says the app listens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UdsSocket {
    pub volume: String,
    pub file: String,
}

/// The Unix socket the pod's annotation names, if it has one; the error names the
/// annotation and quotes the value, bounded.
pub fn uds_socket(annotations: &BTreeMap<String, String>) -> Result<Option<UdsSocket>, String> {
    let Some(value) = annotations.get(UDS_SOCKET_ANNOTATION) else {
        return Ok(None);
    };
    let refuse = |why: &str| format!("{UDS_SOCKET_ANNOTATION}: {} {why}", quote(value));
    let (volume, file) = value
        .trim()
        .split_once('/')
        .ok_or_else(|| refuse("is not <volume>/<file>"))?;
    upstreams::check(volume).map_err(|_| refuse("names no volume (a DNS-1123 label)"))?;
    let file_ok = !file.is_empty()
        && file.len() <= UDS_FILE_MAX
        && file != "."
        && file != ".."
        && file.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if !file_ok {
        return Err(refuse(
            "names no socket file (1 to 48 of letters, digits, '.', '_', '-')",
        ));
    }
    Ok(Some(UdsSocket {
        volume: volume.to_owned(),
        file: file.to_owned(),
    }))
}

/// Which stream protocols of the pod's ports the node's proxy parses on the way in
/// (proposal 017): a comma-separated list of `thrift`, `redis` and `dubbo`, or `none`.
/// Absent, it is [`L7_DEFAULT`]: Thrift is parsed whole by Envoy, while its Redis proxy
/// speaks only a subset of commands (no SELECT, pub/sub or blocking commands) and its
/// Dubbo proxy only Hessian2 bodies (Dubbo 3.2 defaults to fastjson2), so those two are
/// opt-in.
pub const L7_ANNOTATION: &str = "protocol.aether.io/l7";

/// The protocols parsed when the pod does not say.
pub const L7_DEFAULT: &[AppProtocol] = &[AppProtocol::Thrift];

/// The protocols [`L7_ANNOTATION`] names (the default without it); the error names the
/// annotation and quotes the entry, bounded.
pub fn l7_protocols(annotations: &BTreeMap<String, String>) -> Result<Vec<AppProtocol>, String> {
    let Some(value) = annotations.get(L7_ANNOTATION) else {
        return Ok(L7_DEFAULT.to_vec());
    };
    let mut protocols = Vec::new();
    for entry in value.split(',').map(str::trim) {
        let protocol = match entry.to_ascii_lowercase().as_str() {
            "none" if value.trim().eq_ignore_ascii_case("none") => continue,
            "thrift" => AppProtocol::Thrift,
            "redis" => AppProtocol::Redis,
            "dubbo" => AppProtocol::Dubbo,
            _ => {
                return Err(format!(
                    "{L7_ANNOTATION}: {} is not thrift, redis, dubbo or none (a comma-separated list)",
                    quote(entry)
                ));
            }
        };
        if !protocols.contains(&protocol) {
            protocols.push(protocol);
        }
    }
    Ok(protocols)
}

/// The inbound mTLS mode the pod's annotation asks for, if it has one.
pub fn inbound_mtls(annotations: &BTreeMap<String, String>) -> Result<Option<InboundMtls>, InboundError> {
    annotations
        .get(INBOUND_MTLS_ANNOTATION)
        .map(|value| InboundMtls::parse(value))
        .transpose()
}

/// Problems with a pod's mesh annotations, each naming its annotation (and entry); empty
/// when every one is valid. The agent ignores what is named here (and says so); the pod
/// webhook refuses the pod.
pub fn config_errors(namespace: &str, annotations: &BTreeMap<String, String>) -> Vec<String> {
    let mut errors = annotations
        .get(upstreams::ANNOTATION)
        .map(|v| upstreams::parse(namespace, v).errors)
        .unwrap_or_default();
    if let Some(name) = annotations.get(SERVICE_ANNOTATION)
        && let Err(reason) = upstreams::check(name.trim())
    {
        errors.push(format!("{SERVICE_ANNOTATION}: {reason}"));
    }
    if let Err(error) = inbound_mtls(annotations) {
        errors.push(error.to_string());
    }
    if let Err(error) = uds_socket(annotations) {
        errors.push(error);
    }
    if let Err(error) = l7_protocols(annotations) {
        errors.push(error);
    }
    errors
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse_in_any_case_and_a_bad_one_names_the_annotation() {
        assert_eq!(InboundMtls::parse("strict"), Ok(InboundMtls::Strict));
        assert_eq!(InboundMtls::parse(" PERMISSIVE "), Ok(InboundMtls::Permissive));
        assert_eq!(
            InboundMtls::parse("off").unwrap_err().to_string(),
            "security.aether.io/inbound-mtls: \"off\" is not strict or permissive"
        );
        let long = "x".repeat(10_000);
        assert!(
            InboundMtls::parse(&long).unwrap_err().to_string().len() < 400,
            "quoted bounded"
        );
    }

    #[test]
    fn every_bad_annotation_is_named_and_good_ones_pass() {
        let annotations = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
        };
        let good = annotations(&[
            (upstreams::ANNOTATION, "cart, shop/pay"),
            (SERVICE_ANNOTATION, "web"),
            (INBOUND_MTLS_ANNOTATION, "Permissive"),
        ]);
        assert_eq!(config_errors("demo", &good), Vec::<String>::new());
        let bad = annotations(&[
            (upstreams::ANNOTATION, "cart, Bad_Name"),
            (SERVICE_ANNOTATION, "Web"),
            (INBOUND_MTLS_ANNOTATION, "mtls"),
        ]);
        assert_eq!(
            config_errors("demo", &bad),
            [
                "config.aether.io/upstreams[1]: \"Bad_Name\": \"Bad_Name\" is not a DNS-1123 label (lowercase letters, digits and '-')",
                "config.aether.io/service: \"Web\" is not a DNS-1123 label (lowercase letters, digits and '-')",
                "security.aether.io/inbound-mtls: \"mtls\" is not strict or permissive",
            ]
        );
    }

    #[test]
    fn l7_protocols_default_to_thrift_and_the_others_are_opt_in() {
        let of = |value: &str| l7_protocols(&BTreeMap::from([(L7_ANNOTATION.to_owned(), value.to_owned())]));
        assert_eq!(l7_protocols(&BTreeMap::new()), Ok(vec![AppProtocol::Thrift]));
        assert_eq!(
            of("redis, Thrift, redis"),
            Ok(vec![AppProtocol::Redis, AppProtocol::Thrift])
        );
        assert_eq!(of(" None "), Ok(vec![]));
        assert_eq!(of("redis"), Ok(vec![AppProtocol::Redis]));
        let error = of("redis, http").unwrap_err();
        assert_eq!(
            error,
            "protocol.aether.io/l7: \"http\" is not thrift, redis, dubbo or none (a comma-separated list)"
        );
        assert!(of("none, redis").is_err(), "none stands alone");
        assert_eq!(of("dubbo"), Ok(vec![AppProtocol::Dubbo]));
        assert!(of(&"x".repeat(10_000)).unwrap_err().len() < 400, "quoted bounded");
    }

    proptest::proptest! {
        #[test]
        fn l7_protocols_never_panic_and_bound_their_message(text in "(?s).{0,2000}") {
            let annotations = BTreeMap::from([(L7_ANNOTATION.to_owned(), text)]);
            match l7_protocols(&annotations) {
                Ok(protocols) => proptest::prop_assert!(protocols.len() <= 3),
                Err(e) => proptest::prop_assert!(e.starts_with(L7_ANNOTATION) && e.len() < 512, "{e}"),
            }
        }
    }

    #[test]
    fn a_uds_socket_is_a_volume_and_a_file_in_it() {
        let of = |value: &str| uds_socket(&BTreeMap::from([(UDS_SOCKET_ANNOTATION.to_owned(), value.to_owned())]));
        let socket = of("sockets/app.sock").unwrap().unwrap();
        assert_eq!((socket.volume.as_str(), socket.file.as_str()), ("sockets", "app.sock"));
        assert_eq!(uds_socket(&BTreeMap::new()), Ok(None));
        for bad in [
            "app.sock",
            "Sockets/app.sock",
            "sockets/",
            "sockets/..",
            "sockets/a/b",
            "/abs/x",
            "v/sp ace",
        ] {
            let error = of(bad).unwrap_err();
            assert!(error.starts_with(UDS_SOCKET_ANNOTATION), "{bad}: {error}");
        }
        assert!(of(&format!("v/{}", "x".repeat(49))).is_err());
        assert!(
            of(&format!("v/{}", "x".repeat(10_000))).unwrap_err().len() < 400,
            "quoted bounded"
        );
        let errors = config_errors(
            "shop",
            &BTreeMap::from([(UDS_SOCKET_ANNOTATION.to_owned(), "nope".to_owned())]),
        );
        assert_eq!(errors.len(), 1, "{errors:?}");
    }
}
