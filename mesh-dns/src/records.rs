//! The record file: the agent writes it, mesh-dns reads it.
//!
//! JSON, one object:
//! ```json
//! {"version": 1, "generation": 7, "written_at_unix_ms": 1764500000000,
//!  "records": {"default/web": {"v4": "240.240.0.7"}, "shop/cart": {"v4": "240.240.0.9", "v6": "fd00::9"}}}
//! ```
//! `hosts` (absent when empty) maps names outside the mesh domain to addresses: the hosts
//! of external services (proposals/017), answered A/AAAA instead of being forwarded.
//! `aliases` (absent when empty, so readers older than it keep reading the file) lists
//! other domains every name is answered under too: the mesh-wide MeshConfig's mesh domain
//! (proposals/016). `generation` grows whenever the records or aliases change; `written_at_unix_ms` is refreshed
//! on every write, including the periodic re-stamp of unchanged records, so a reader
//! can tell a stale file (writer gone) from a quiet mesh. Keys are `<ns>/<svc>`, both
//! DNS labels (lowercase letters, digits, `-`, at most 63 characters).
//! The parser is strict: any bad field rejects the whole file and names the field.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use aether_common::quote::{clip, quote};
use serde::{Deserialize, Serialize};

/// The only format version this code reads and writes.
pub const VERSION: u32 = 1;
/// The record file's directory under the agent's state dir.
pub const DIR: &str = "mesh-dns";
/// The record file's name in [`DIR`].
pub const FILE: &str = "records";
/// Largest record file a reader accepts (10,000 services take about 600 KiB).
pub const MAX_FILE_BYTES: u64 = 64 * 1024 * 1024;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RecordsError {
    #[error("not a record file: {}", clip(.0))]
    Json(String),
    #[error("version: {0} is not supported (this reader knows version {VERSION})")]
    Version(u32),
    #[error("records[{}]: {reason}", quote(.key))]
    Key { key: String, reason: String },
    #[error("records[{}].{family}: {} is not an IP{family} address", quote(.key), quote(.value))]
    Address {
        key: String,
        family: &'static str,
        value: String,
    },
    #[error("records[{}]: has neither v4 nor v6", quote(.key))]
    NoAddress { key: String },
    #[error("file is {0} bytes (at most {MAX_FILE_BYTES})")]
    TooLarge(u64),
    #[error("aliases[{index}]: {} {reason}", quote(.value))]
    Alias {
        index: usize,
        value: String,
        reason: aether_common::names::MeshDomainError,
    },
    #[error("aliases: {0} domains (at most {MAX_ALIASES})")]
    TooManyAliases(usize),
    #[error("hosts[{}]: {reason}", quote(.host))]
    Host { host: String, reason: String },
}

/// The most alias domains a file may list (a mesh has one domain and, while it moves, one
/// more).
pub const MAX_ALIASES: usize = 4;

/// A service's addresses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Addresses {
    pub v4: Option<Ipv4Addr>,
    pub v6: Option<Ipv6Addr>,
}

/// A parsed, validated record file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordFile {
    pub generation: u64,
    pub written_at: SystemTime,
    /// `(namespace, service)` → addresses.
    pub records: BTreeMap<(String, String), Addresses>,
    /// Other domains the same names are answered under (mesh domains, lowercase).
    pub aliases: Vec<String>,
    /// Names outside the mesh domain answered with these addresses (external services'
    /// hosts, lowercase, without a trailing dot).
    pub hosts: BTreeMap<String, Addresses>,
}

impl Default for RecordFile {
    fn default() -> Self {
        Self {
            generation: 0,
            written_at: UNIX_EPOCH,
            records: BTreeMap::new(),
            aliases: Vec::new(),
            hosts: BTreeMap::new(),
        }
    }
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Wire {
    version: u32,
    generation: u64,
    written_at_unix_ms: u64,
    records: BTreeMap<String, WireAddresses>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    aliases: Vec<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    hosts: BTreeMap<String, WireAddresses>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct WireAddresses {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    v4: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    v6: Option<String>,
}

impl WireAddresses {
    fn of(addresses: &Addresses) -> Self {
        WireAddresses {
            v4: addresses.v4.map(|v| v.to_string()),
            v6: addresses.v6.map(|v| v.to_string()),
        }
    }

    /// The addresses of the entry `key` (as errors name it): at least one, each of its family.
    fn parse(self, key: String) -> Result<Addresses, RecordsError> {
        let v4 = match self.v4 {
            Some(v) => Some(v.parse::<Ipv4Addr>().map_err(|_| RecordsError::Address {
                key: key.clone(),
                family: "v4",
                value: v,
            })?),
            None => None,
        };
        let v6 = match self.v6 {
            Some(v) => Some(v.parse::<Ipv6Addr>().map_err(|_| RecordsError::Address {
                key: key.clone(),
                family: "v6",
                value: v,
            })?),
            None => None,
        };
        if v4.is_none() && v6.is_none() {
            return Err(RecordsError::NoAddress { key });
        }
        Ok(Addresses { v4, v6 })
    }
}

/// A host name the file may map: lowercase DNS labels joined by dots, at least two, at
/// most 253 characters (what `aether_api::external_service` admits).
pub fn check_host(host: &str) -> Result<(), RecordsError> {
    let bad = |reason: &str| RecordsError::Host {
        host: host.to_owned(),
        reason: reason.to_owned(),
    };
    if host.len() > 253 {
        return Err(bad("is longer than 253 characters"));
    }
    if !host.contains('.') || !host.split('.').all(valid_label) {
        return Err(bad("is not a lowercase DNS name of two labels or more"));
    }
    Ok(())
}

/// Whether `label` is a DNS label as Kubernetes names namespaces and services (RFC 1123):
/// [`aether_common::names::valid_label`], the rule the agent and registrar check too.
pub use aether_common::names::valid_label;

fn split_key(key: &str) -> Result<(String, String), RecordsError> {
    let bad = |reason: &str| RecordsError::Key {
        key: key.to_owned(),
        reason: reason.to_owned(),
    };
    let (ns, svc) = key.split_once('/').ok_or_else(|| bad("is not <namespace>/<service>"))?;
    if !valid_label(ns) {
        return Err(bad("namespace is not a DNS label (a-z, 0-9, '-', 1-63 characters)"));
    }
    if !valid_label(svc) {
        return Err(bad("service is not a DNS label (a-z, 0-9, '-', 1-63 characters)"));
    }
    Ok((ns.to_owned(), svc.to_owned()))
}

impl RecordFile {
    pub fn parse(bytes: &[u8]) -> Result<Self, RecordsError> {
        if bytes.len() as u64 > MAX_FILE_BYTES {
            return Err(RecordsError::TooLarge(bytes.len() as u64));
        }
        // The version is checked first so a future format gets a clear error, not a
        // complaint about an unknown field.
        #[derive(Deserialize)]
        struct VersionOnly {
            version: u32,
        }
        let version: VersionOnly = serde_json::from_slice(bytes).map_err(|e| RecordsError::Json(e.to_string()))?;
        if version.version != VERSION {
            return Err(RecordsError::Version(version.version));
        }
        let wire: Wire = serde_json::from_slice(bytes).map_err(|e| RecordsError::Json(e.to_string()))?;
        let mut records = BTreeMap::new();
        for (key, addresses) in wire.records {
            let name = split_key(&key)?;
            records.insert(name, addresses.parse(key)?);
        }
        let mut hosts = BTreeMap::new();
        for (host, addresses) in wire.hosts {
            check_host(&host)?;
            let addresses = addresses.parse(format!("hosts/{host}"))?;
            hosts.insert(host, addresses);
        }
        if wire.aliases.len() > MAX_ALIASES {
            return Err(RecordsError::TooManyAliases(wire.aliases.len()));
        }
        for (index, alias) in wire.aliases.iter().enumerate() {
            aether_common::names::mesh_domain(alias).map_err(|reason| RecordsError::Alias {
                index,
                value: alias.clone(),
                reason,
            })?;
        }
        Ok(Self {
            generation: wire.generation,
            written_at: UNIX_EPOCH + Duration::from_millis(wire.written_at_unix_ms),
            records,
            aliases: wire.aliases,
            hosts,
        })
    }

    /// The file's bytes. Keys and addresses are validated by the writer's caller;
    /// [`RecordFile::parse`] of the result gives `self` back for valid content.
    pub fn to_json(&self) -> Vec<u8> {
        let written_at_unix_ms = self
            .written_at
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        let wire = Wire {
            version: VERSION,
            generation: self.generation,
            written_at_unix_ms,
            records: self
                .records
                .iter()
                .map(|((ns, svc), a)| (format!("{ns}/{svc}"), WireAddresses::of(a)))
                .collect(),
            aliases: self.aliases.clone(),
            hosts: (self.hosts.iter())
                .map(|(host, a)| (host.clone(), WireAddresses::of(a)))
                .collect(),
        };
        let mut out = serde_json::to_vec(&wire).expect("the record file serialises");
        out.push(b'\n');
        out
    }

    /// How old the file's stamp is at `now` (zero if it is from the future).
    pub fn age(&self, now: SystemTime) -> Duration {
        now.duration_since(self.written_at).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> RecordFile {
        let mut records = BTreeMap::new();
        records.insert(
            ("default".into(), "web".into()),
            Addresses {
                v4: Some(Ipv4Addr::new(240, 240, 0, 7)),
                v6: None,
            },
        );
        records.insert(
            ("shop".into(), "cart".into()),
            Addresses {
                v4: Some(Ipv4Addr::new(240, 240, 0, 9)),
                v6: Some("fd00::9".parse().unwrap()),
            },
        );
        RecordFile {
            generation: 7,
            written_at: UNIX_EPOCH + Duration::from_millis(1_764_500_000_123),
            records,
            aliases: vec!["corp.internal".into()],
            hosts: BTreeMap::from([(
                "api.payments.example".to_owned(),
                Addresses {
                    v4: Some(Ipv4Addr::new(240, 240, 0, 11)),
                    v6: None,
                },
            )]),
        }
    }

    #[test]
    fn bad_hosts_are_refused_naming_them() {
        for (host, reason) in [
            ("localhost", "two labels"),
            ("API.example", "lowercase"),
            ("a..example", "lowercase DNS name"),
        ] {
            let json = format!(
                r#"{{"version":1,"generation":1,"written_at_unix_ms":1,"records":{{}},"hosts":{{"{host}":{{"v4":"240.240.0.1"}}}}}}"#
            );
            let error = RecordFile::parse(json.as_bytes()).unwrap_err().to_string();
            assert!(
                error.starts_with(&format!("hosts[\"{host}\"]")) && error.contains(reason),
                "{error}"
            );
        }
        let json =
            r#"{"version":1,"generation":1,"written_at_unix_ms":1,"records":{},"hosts":{"a.example":{"v4":"x"}}}"#;
        let error = RecordFile::parse(json.as_bytes()).unwrap_err().to_string();
        assert!(
            error.contains("hosts/a.example") && error.contains("not an IPv4"),
            "{error}"
        );
    }

    #[test]
    fn round_trips() {
        let file = sample();
        assert_eq!(RecordFile::parse(&file.to_json()).unwrap(), file);
    }

    #[test]
    fn no_aliases_writes_no_field_for_readers_older_than_it() {
        let file = RecordFile {
            aliases: Vec::new(),
            ..sample()
        };
        let json = String::from_utf8(file.to_json()).unwrap();
        assert!(!json.contains("aliases"), "{json}");
        assert_eq!(RecordFile::parse(json.as_bytes()).unwrap(), file);
    }

    #[test]
    fn errors_name_the_field() {
        let cases: &[(&str, &str)] = &[
            (
                r#"{"version":2,"generation":1,"written_at_unix_ms":1,"records":{}}"#,
                "version: 2",
            ),
            (
                r#"{"version":1,"generation":1,"written_at_unix_ms":1,"records":{"a":{"v4":"1.2.3.4"}}}"#,
                r#"records["a"]: is not"#,
            ),
            (
                r#"{"version":1,"generation":1,"written_at_unix_ms":1,"records":{"A/b":{"v4":"1.2.3.4"}}}"#,
                "namespace is not a DNS label",
            ),
            (
                r#"{"version":1,"generation":1,"written_at_unix_ms":1,"records":{"a/b":{"v4":"::1"}}}"#,
                r#"records["a/b"].v4: "::1""#,
            ),
            (
                r#"{"version":1,"generation":1,"written_at_unix_ms":1,"records":{"a/b":{"v6":"1.2.3.4"}}}"#,
                r#"records["a/b"].v6"#,
            ),
            (
                r#"{"version":1,"generation":1,"written_at_unix_ms":1,"records":{"a/b":{}}}"#,
                "neither v4 nor v6",
            ),
            (r#"{"version":1,"generation":1,"records":{}}"#, "written_at_unix_ms"),
            (
                r#"{"version":1,"generation":1,"written_at_unix_ms":1,"records":{},"aliases":["corp"]}"#,
                r#"aliases[0]: "corp" has one label"#,
            ),
            (
                r#"{"version":1,"generation":1,"written_at_unix_ms":1,"records":{},"aliases":["a.b","c.d","e.f","g.h","i.j"]}"#,
                "aliases: 5 domains (at most 4)",
            ),
            (
                r#"{"version":1,"generation":1,"written_at_unix_ms":1,"records":{},"aliases":[7]}"#,
                "not a record file",
            ),
            (r#"{"version":1"#, "not a record file"),
        ];
        for (input, want) in cases {
            let error = RecordFile::parse(input.as_bytes()).unwrap_err().to_string();
            assert!(error.contains(want), "{input}: {error:?} does not mention {want:?}");
        }
    }

    #[test]
    fn huge_keys_and_values_are_quoted_by_their_start_and_size() {
        let huge = "a".repeat(1 << 20);
        let start = &huge[..64];
        let file = |records: serde_json::Value| {
            let json = serde_json::json!({"version": 1, "generation": 1, "written_at_unix_ms": 1, "records": records});
            RecordFile::parse(json.to_string().as_bytes()).unwrap_err().to_string()
        };
        let mut records = serde_json::Map::new();
        records.insert(huge.clone(), serde_json::json!({"v4": "1.2.3.4"}));
        assert_eq!(
            file(records.into()),
            format!("records[{start:?}… (1048576 bytes)]: is not <namespace>/<service>")
        );
        assert_eq!(
            file(serde_json::json!({"a/b": {"v4": huge}})),
            format!("records[\"a/b\"].v4: {start:?}… (1048576 bytes) is not an IPv4 address")
        );
        // serde's message names an unknown field whole: clipped.
        let mut records = serde_json::Map::new();
        records.insert("a/b".into(), serde_json::json!({ huge.clone(): 1 }));
        let error = file(records.into());
        assert!(error.starts_with("not a record file: unknown field `aaaa"), "{error}");
        assert!(error.len() < 1024, "{} bytes: {error}", error.len());
    }

    fn label() -> impl Strategy<Value = String> {
        "[a-z0-9]([a-z0-9-]{0,20}[a-z0-9])?"
    }

    fn addresses() -> impl Strategy<Value = Addresses> {
        (any::<Option<[u8; 4]>>(), any::<Option<[u8; 16]>>())
            .prop_filter("one address at least", |(a, b)| a.is_some() || b.is_some())
            .prop_map(|(v4, v6)| Addresses {
                v4: v4.map(Ipv4Addr::from),
                v6: v6.map(Ipv6Addr::from),
            })
    }

    proptest! {
        #[test]
        fn any_valid_file_round_trips(
            generation in any::<u64>(),
            ms in 0u64..4_000_000_000_000,
            records in proptest::collection::btree_map((label(), label()), addresses(), 0..20),
            hosts in proptest::collection::btree_map(
                proptest::collection::vec(label(), 2..4).prop_map(|l| l.join(".")), addresses(), 0..4),
        ) {
            let aliases = if generation % 2 == 0 { vec!["corp.internal".to_owned()] } else { Vec::new() };
            let written_at = UNIX_EPOCH + Duration::from_millis(ms);
            let file = RecordFile { generation, written_at, records, aliases, hosts };
            prop_assert_eq!(RecordFile::parse(&file.to_json()).unwrap(), file);
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = RecordFile::parse(&bytes);
        }

        #[test]
        fn mutated_files_parse_or_fail_cleanly(index in any::<prop::sample::Index>(), byte in any::<u8>()) {
            let mut bytes = sample().to_json();
            let i = index.index(bytes.len());
            bytes[i] = byte;
            if let Ok(file) = RecordFile::parse(&bytes) {
                // Whatever parsed is valid: it writes back to something that parses the same.
                prop_assert_eq!(RecordFile::parse(&file.to_json()).unwrap(), file);
            }
        }

        #[test]
        fn bad_keys_are_rejected(key in "[^/]{0,10}(/[^/]{0,10})?") {
            let valid = key.split_once('/').is_some_and(|(a, b)| valid_label(a) && valid_label(b));
            let json = serde_json::json!({"version":1,"generation":1,"written_at_unix_ms":1,
                "records":{key.clone():{"v4":"1.2.3.4"}}});
            let parsed = RecordFile::parse(json.to_string().as_bytes());
            prop_assert_eq!(parsed.is_ok(), valid, "{:?}: {:?}", key, parsed);
        }
    }
}
