//! The network configuration on stdin: the CNI standard keys plus ours.
//!
//! ```json
//! {"cniVersion": "1.1.0", "name": "k8s-pod-network", "type": "aether-cni",
//!  "agentSocket": "/run/aether/cni.sock", "excludedNamespaces": ["kube-system"],
//!  "captureMode": "vip", "meshDns": "10.0.0.1:18054", "excludedPorts": [15000],
//!  "excludedCidrs": ["169.254.0.0/16"], "logFile": "/var/log/aether-cni.log",
//!  "stateDir": "/var/run/aether", "agentTimeoutMs": 20000, "agentAttempts": 3,
//!  "prevResult": {…}}
//! ```

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use aether_common::quote::{clip, quote};
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use crate::error::{CniError, Code, invalid_config};

pub const DEFAULT_AGENT_SOCKET: &str = "/run/aether/cni.sock";
pub const DEFAULT_LOG_FILE: &str = "/var/log/aether-cni.log";
/// Pins live in `<stateDir>/netns/<container id>`.
pub const DEFAULT_STATE_DIR: &str = "/var/run/aether";
pub const DEFAULT_EXCLUDED_NAMESPACES: &[&str] = &["kube-system"];
/// mesh-dns's port when `meshDns` names only an address.
pub const MESH_DNS_PORT: u16 = 18054;
const DEFAULT_AGENT_TIMEOUT: Duration = Duration::from_secs(20);
const DEFAULT_AGENT_ATTEMPTS: u32 = 3;
pub const VALID_ATTACHMENTS: &str = "cni.dev/valid-attachments";

/// Every CNI version a runtime may send us (VERSION, DEL).
pub const ALL_VERSIONS: &[&str] = &["0.1.0", "0.2.0", "0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];
/// The versions whose ADD/CHECK we implement.
pub const MODERN_VERSIONS: &[&str] = &["1.0.0", "1.1.0"];
/// GC and STATUS arrived in 1.1.0.
pub const GC_VERSIONS: &[&str] = &["1.1.0"];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CaptureMode {
    /// TCP to mesh VIPs and DNS are captured.
    Vip,
    /// Registered in the mesh, no nftables rules (explicit outbound listener only).
    None,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attachment {
    pub container_id: String,
    pub ifname: String,
}

#[derive(Clone, Debug)]
pub struct NetConf {
    pub cni_version: String,
    pub name: String,
    pub agent_socket: PathBuf,
    pub excluded_namespaces: Vec<String>,
    pub capture_mode: CaptureMode,
    pub mesh_dns: Option<SocketAddr>,
    pub excluded_ports: Vec<u32>,
    pub excluded_cidrs: Vec<String>,
    pub log_file: PathBuf,
    pub log_level: String,
    pub state_dir: PathBuf,
    pub agent_timeout: Duration,
    pub agent_attempts: u32,
    pub prev_result: Option<Value>,
    pub valid_attachments: Option<Vec<Attachment>>,
}

impl NetConf {
    pub fn pin_dir(&self) -> PathBuf {
        self.state_dir.join("netns")
    }
}

/// Reads `cniVersion` only (VERSION needs nothing else, and errors need it early).
pub fn peek_version(stdin: &[u8]) -> Option<String> {
    let v: Value = serde_json::from_slice(stdin).ok()?;
    v.get("cniVersion")?.as_str().map(str::to_owned)
}

fn field<T: DeserializeOwned>(obj: &Map<String, Value>, key: &str) -> Result<Option<T>, CniError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => serde_json::from_value(v.clone())
            .map(Some)
            .map_err(|e| invalid_config(format!("{key}: {}", clip(&e.to_string())))),
    }
}

/// The path at `key`, or `default`; either must be absolute.
fn absolute(obj: &Map<String, Value>, key: &str, default: &str) -> Result<PathBuf, CniError> {
    let value = field::<String>(obj, key)?.unwrap_or_else(|| default.to_owned());
    if !value.starts_with('/') {
        return Err(invalid_config(format!(
            "{key}: {} is not an absolute path",
            quote(&value)
        )));
    }
    Ok(PathBuf::from(value))
}

/// Parses stdin. Errors: 6 when it is not a JSON object, 7 for a bad value (field
/// named), 2 for a value we do not support. Fields are checked in the order written.
pub fn parse(stdin: &[u8]) -> Result<NetConf, CniError> {
    let obj = object(stdin)?;
    Ok(NetConf {
        cni_version: field(&obj, "cniVersion")?.ok_or_else(|| invalid_config("cniVersion: missing"))?,
        name: field(&obj, "name")?.unwrap_or_default(),
        agent_socket: absolute(&obj, "agentSocket", DEFAULT_AGENT_SOCKET)?,
        excluded_namespaces: field(&obj, "excludedNamespaces")?
            .unwrap_or_else(|| DEFAULT_EXCLUDED_NAMESPACES.iter().map(|s| s.to_string()).collect()),
        capture_mode: capture_mode(&obj)?,
        mesh_dns: mesh_dns(&obj)?,
        excluded_ports: excluded_ports(&obj)?,
        excluded_cidrs: excluded_cidrs(&obj)?,
        log_file: absolute(&obj, "logFile", DEFAULT_LOG_FILE)?,
        log_level: field(&obj, "logLevel")?.unwrap_or_else(|| "info".into()),
        state_dir: absolute(&obj, "stateDir", DEFAULT_STATE_DIR)?,
        agent_timeout: agent_timeout(&obj)?,
        agent_attempts: agent_attempts(&obj)?,
        prev_result: prev_result(&obj)?,
        valid_attachments: valid_attachments(&obj)?,
    })
}

/// Stdin as a JSON object (error 6 otherwise).
fn object(stdin: &[u8]) -> Result<Map<String, Value>, CniError> {
    let value: Value = serde_json::from_slice(stdin).map_err(|e| {
        CniError::new(
            Code::DecodeFailure,
            format!("network configuration on stdin is not JSON: {e}"),
        )
    })?;
    match value {
        Value::Object(obj) => Ok(obj),
        _ => Err(CniError::new(
            Code::DecodeFailure,
            "network configuration on stdin is not a JSON object",
        )),
    }
}

/// `captureMode`: `vip` (the default) or `none`; anything else is error 2.
fn capture_mode(obj: &Map<String, Value>) -> Result<CaptureMode, CniError> {
    match field::<String>(obj, "captureMode")?.as_deref() {
        None | Some("vip") => Ok(CaptureMode::Vip),
        Some("none") => Ok(CaptureMode::None),
        Some(other) => Err(CniError::new(
            Code::UnsupportedField,
            format!(
                "captureMode: {} is not supported (use \"vip\" or \"none\")",
                quote(other)
            ),
        )),
    }
}

/// `meshDns`: `ip` or `ip:port`; absent or empty, the agent's.
fn mesh_dns(obj: &Map<String, Value>) -> Result<Option<SocketAddr>, CniError> {
    match field::<String>(obj, "meshDns")? {
        Some(s) if !s.is_empty() => parse_mesh_dns(&s).map(Some),
        _ => Ok(None),
    }
}

fn parse_mesh_dns(text: &str) -> Result<SocketAddr, CniError> {
    if let Ok(addr) = text.parse::<SocketAddr>() {
        return Ok(addr);
    }
    if let Ok(ip) = text.parse::<IpAddr>() {
        return Ok(SocketAddr::new(ip, MESH_DNS_PORT));
    }
    Err(invalid_config(format!(
        "meshDns: {} is not an ip or ip:port address",
        quote(text)
    )))
}

fn excluded_ports(obj: &Map<String, Value>) -> Result<Vec<u32>, CniError> {
    let ports: Vec<u32> = field(obj, "excludedPorts")?.unwrap_or_default();
    if let Some((i, p)) = ports.iter().enumerate().find(|(_, p)| **p == 0 || **p > 65535) {
        return Err(invalid_config(format!(
            "excludedPorts[{i}]: {p} is not a port (1..=65535)"
        )));
    }
    Ok(ports)
}

/// `excludedCidrs`: CIDRs or bare addresses.
fn excluded_cidrs(obj: &Map<String, Value>) -> Result<Vec<String>, CniError> {
    let cidrs: Vec<String> = field(obj, "excludedCidrs")?.unwrap_or_default();
    let not_a_cidr = |c: &String| c.parse::<ipnet::IpNet>().is_err() && c.parse::<IpAddr>().is_err();
    if let Some((i, c)) = cidrs.iter().enumerate().find(|(_, c)| not_a_cidr(c)) {
        return Err(invalid_config(format!(
            "excludedCidrs[{i}]: {} is not a CIDR",
            quote(c)
        )));
    }
    Ok(cidrs)
}

fn agent_timeout(obj: &Map<String, Value>) -> Result<Duration, CniError> {
    match field::<u64>(obj, "agentTimeoutMs")? {
        Some(0) => Err(invalid_config("agentTimeoutMs: must be > 0")),
        Some(ms) => Ok(Duration::from_millis(ms)),
        None => Ok(DEFAULT_AGENT_TIMEOUT),
    }
}

fn agent_attempts(obj: &Map<String, Value>) -> Result<u32, CniError> {
    match field::<u32>(obj, "agentAttempts")? {
        Some(0) => Err(invalid_config("agentAttempts: must be > 0")),
        Some(n) => Ok(n),
        None => Ok(DEFAULT_AGENT_ATTEMPTS),
    }
}

/// `prevResult`, kept as JSON: a chained plugin passes it through.
fn prev_result(obj: &Map<String, Value>) -> Result<Option<Value>, CniError> {
    match obj.get("prevResult") {
        None | Some(Value::Null) => Ok(None),
        Some(v @ Value::Object(_)) => Ok(Some(v.clone())),
        Some(_) => Err(invalid_config("prevResult: is not a JSON object")),
    }
}

/// GC's `cni.dev/valid-attachments`: each entry's container id is checked.
fn valid_attachments(obj: &Map<String, Value>) -> Result<Option<Vec<Attachment>>, CniError> {
    let items = match obj.get(VALID_ATTACHMENTS) {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(items)) => items,
        Some(_) => return Err(invalid_config(format!("{VALID_ATTACHMENTS}: is not a list"))),
    };
    let text = |item: &Value, key: &str| item.get(key).and_then(Value::as_str).unwrap_or_default().to_owned();
    let mut out = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let container_id = text(item, "containerID");
        crate::env::check_container_id(&container_id)
            .map_err(|r| invalid_config(format!("{VALID_ATTACHMENTS}[{i}].containerID: {r}")))?;
        out.push(Attachment {
            container_id,
            ifname: text(item, "ifname"),
        });
    }
    Ok(Some(out))
}

/// Is `version` one of `supported`? Error 1 names the command and what we support.
pub fn require_version(version: &str, supported: &[&str], command: &str) -> Result<(), CniError> {
    if supported.contains(&version) {
        return Ok(());
    }
    Err(CniError::new(
        Code::IncompatibleVersion,
        format!(
            "cniVersion: {} is not supported for {command} (supported: {})",
            quote(version),
            supported.join(", ")
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_fields() {
        let c = parse(br#"{"cniVersion":"1.1.0","name":"n","type":"aether-cni","meshDns":"10.0.0.1"}"#).unwrap();
        assert_eq!(c.agent_socket, PathBuf::from(DEFAULT_AGENT_SOCKET));
        assert_eq!(c.mesh_dns, Some("10.0.0.1:18054".parse().unwrap()));
        assert_eq!(c.excluded_namespaces, vec!["kube-system".to_string()]);
        assert_eq!(c.capture_mode, CaptureMode::Vip);
        assert_eq!(c.pin_dir(), PathBuf::from("/var/run/aether/netns"));
    }

    #[test]
    fn bad_values_name_the_field_with_the_right_code() {
        let e = |s: &str| parse(s.as_bytes()).unwrap_err();
        assert_eq!(e("{nope").code, Code::DecodeFailure);
        assert_eq!(e("[1]").code, Code::DecodeFailure);
        assert_eq!(e("{}").message, "cniVersion: missing");
        let bad = e(r#"{"cniVersion":"1.1.0","agentSocket":7}"#);
        assert_eq!(bad.code, Code::InvalidConfig);
        assert!(bad.message.starts_with("agentSocket: invalid type"), "{}", bad.message);
        assert_eq!(
            e(r#"{"cniVersion":"1.1.0","agentSocket":"rel"}"#).message,
            "agentSocket: \"rel\" is not an absolute path"
        );
        let unsupported = e(r#"{"cniVersion":"1.1.0","captureMode":"all"}"#);
        assert_eq!(unsupported.code, Code::UnsupportedField);
        assert_eq!(
            e(r#"{"cniVersion":"1.1.0","meshDns":"x:y"}"#).message,
            "meshDns: \"x:y\" is not an ip or ip:port address"
        );
        assert_eq!(
            e(r#"{"cniVersion":"1.1.0","excludedPorts":[80,0]}"#).message,
            "excludedPorts[1]: 0 is not a port (1..=65535)"
        );
        assert_eq!(
            e(r#"{"cniVersion":"1.1.0","prevResult":[]}"#).message,
            "prevResult: is not a JSON object"
        );
        assert_eq!(
            require_version("0.4.0", MODERN_VERSIONS, "ADD").unwrap_err().code,
            Code::IncompatibleVersion
        );
    }

    #[test]
    fn the_first_bad_field_in_the_written_order_is_named() {
        let first = |conf: &str| parse(conf.as_bytes()).unwrap_err().message;
        let all_bad = r#"{"cniVersion":"1.1.0","agentSocket":"rel","captureMode":"all","excludedPorts":[0],
                          "agentAttempts":0,"prevResult":[],"cni.dev/valid-attachments":{}}"#;
        assert_eq!(first(all_bad), "agentSocket: \"rel\" is not an absolute path");
        assert_eq!(
            first(r#"{"cniVersion":"1.1.0","excludedCidrs":["x"],"excludedPorts":[70000]}"#),
            "excludedPorts[0]: 70000 is not a port (1..=65535)"
        );
        assert_eq!(
            first(r#"{"cniVersion":"1.1.0","agentAttempts":0,"prevResult":[]}"#),
            "agentAttempts: must be > 0"
        );
        assert_eq!(
            first(r#"{"cniVersion":"1.1.0","cni.dev/valid-attachments":{}}"#),
            "cni.dev/valid-attachments: is not a list"
        );
        let gc = parse(br#"{"cniVersion":"1.1.0","cni.dev/valid-attachments":[{"containerID":"c1","ifname":"eth0"}]}"#);
        assert_eq!(
            gc.unwrap().valid_attachments,
            Some(vec![Attachment {
                container_id: "c1".into(),
                ifname: "eth0".into()
            }])
        );
    }

    #[test]
    fn huge_values_are_quoted_by_their_start_and_size() {
        let huge = "a".repeat(1 << 20);
        let start = &huge[..64];
        let with = |key: &str, value: Value| {
            let mut conf = serde_json::json!({"cniVersion": "1.1.0"});
            conf[key] = value;
            parse(conf.to_string().as_bytes()).unwrap_err()
        };
        let cases = [
            (
                with("agentSocket", Value::from(huge.clone())),
                format!("agentSocket: {start:?}… (1048576 bytes) is not an absolute path"),
            ),
            (
                with("meshDns", Value::from(huge.clone())),
                format!("meshDns: {start:?}… (1048576 bytes) is not an ip or ip:port address"),
            ),
            (
                with("captureMode", Value::from(huge.clone())),
                format!("captureMode: {start:?}… (1048576 bytes) is not supported (use \"vip\" or \"none\")"),
            ),
            (
                with("excludedCidrs", serde_json::json!(["10.0.0.0/8", huge])),
                format!("excludedCidrs[1]: {start:?}… (1048576 bytes) is not a CIDR"),
            ),
            (
                with(VALID_ATTACHMENTS, serde_json::json!([{"containerID": huge}])),
                format!(
                    "{VALID_ATTACHMENTS}[0].containerID: {start:?}… (1048576 bytes) is not a container id \
                     (letters, digits, '-', '_', '.')"
                ),
            ),
        ];
        for (error, message) in cases {
            assert_eq!(error.message, message);
        }
        // A library's message that embeds the value is clipped, the field still named.
        let error = with("agentTimeoutMs", Value::from(huge.clone()));
        assert_eq!(error.code, Code::InvalidConfig);
        assert!(
            error.message.starts_with("agentTimeoutMs: invalid type: string \"aaaa"),
            "{}",
            error.message
        );
        assert!(error.message.len() < 1024, "{}", error.message);
        let error = require_version(&huge, MODERN_VERSIONS, "ADD").unwrap_err();
        assert!(
            error.message.starts_with(&format!(
                "cniVersion: {start:?}… (1048576 bytes) is not supported for ADD"
            )),
            "{}",
            error.message
        );
    }

    proptest::proptest! {
        #[test]
        fn no_error_json_exceeds_the_bound(
            key in "(cniVersion|agentSocket|meshDns|captureMode|excludedCidrs|excludedPorts|agentTimeoutMs|logFile|stateDir|name)",
            c in proptest::prelude::any::<char>(),
            len in 0..(1usize << 20),
            in_list in proptest::prelude::any::<bool>(),
        ) {
            let value: String = std::iter::repeat_n(c, len).collect();
            let mut conf = serde_json::json!({"cniVersion": "1.1.0"});
            conf[key.as_str()] = if in_list { serde_json::json!([value]) } else { Value::from(value) };
            if let Err(error) = parse(conf.to_string().as_bytes()) {
                let json = error.to_json("1.1.0");
                proptest::prop_assert!(json.len() < 2048, "{} bytes: {json}", json.len());
            }
        }

        #[test]
        fn any_stdin_is_an_answer_never_a_panic(s in "\\PC{0,128}") {
            let _ = parse(s.as_bytes());
        }

        #[test]
        fn any_json_object_is_an_answer_never_a_panic(
            keys in proptest::collection::vec("(cniVersion|agentSocket|meshDns|captureMode|excludedPorts|prevResult|cni.dev/valid-attachments|stateDir)", 0..6),
            vals in proptest::collection::vec(proptest::prop_oneof![
                proptest::strategy::Just(serde_json::json!("1.1.0")),
                proptest::strategy::Just(serde_json::json!(1)),
                proptest::strategy::Just(serde_json::json!([])),
                proptest::strategy::Just(serde_json::json!({})),
                proptest::strategy::Just(serde_json::json!(null)),
                proptest::strategy::Just(serde_json::json!("/abs")),
                proptest::strategy::Just(serde_json::json!([{"containerID": "a b"}])),
            ], 0..6),
        ) {
            let obj: Map<String, Value> = keys.into_iter().zip(vals).collect();
            let _ = parse(serde_json::to_vec(&Value::Object(obj)).unwrap().as_slice());
        }
    }
}
