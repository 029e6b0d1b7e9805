//! The catalog's configuration records: what users' objects are projected into (routes,
//! authorization policies, HTTP filters, MeshConfigs), as opposed to what agents register (services, endpoints).
//!
//! Every kind travels the same way, so one mechanism carries them all: stored by key in
//! each backend (a [`ConfigKind`] names its embedded table, etcd segment and DynamoDB
//! tag), validated again whenever read back from a store or a feed (a store can hold
//! anything), held in memory by kind and key ([`ConfigRecords`]), and streamed as
//! `Change`s to the watchers that want them. What differs per kind is only its key, its
//! projector's check and its place in the wire messages: the [`Record`] trait.

use std::collections::BTreeMap;
use std::sync::Arc;

use aether_proto::registrar::v1::{Held, Holdings, Snapshot, change};
use aether_proto::registry::v1::{AuthorizationPolicy, HttpFilter, MeshConfig, Route};
use aether_proto::view::{http_filter_key, mesh_config_key, policy_key, route_key};
use prost::Message;

/// A kind of configuration record.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ConfigKind {
    Route,
    Policy,
    HttpFilter,
    MeshConfig,
}

impl ConfigKind {
    pub const ALL: [ConfigKind; 4] = [
        ConfigKind::Route,
        ConfigKind::Policy,
        ConfigKind::HttpFilter,
        ConfigKind::MeshConfig,
    ];

    /// How logs and refusals name one: `route`, `authorization policy`, `HTTP filter`, `MeshConfig`.
    pub fn noun(self) -> &'static str {
        match self {
            ConfigKind::Route => "route",
            ConfigKind::Policy => "authorization policy",
            ConfigKind::HttpFilter => "HTTP filter",
            ConfigKind::MeshConfig => "MeshConfig",
        }
    }

    /// How stores and metrics name them all: the embedded table, the etcd key segment
    /// (`P/<plural>/<key>`), the gauges `aether_registrar_<plural>[_refused]`.
    pub fn plural(self) -> &'static str {
        match self {
            ConfigKind::Route => "routes",
            ConfigKind::Policy => "policies",
            ConfigKind::HttpFilter => "http_filters",
            ConfigKind::MeshConfig => "mesh_configs",
        }
    }

    /// The users' objects they are projected from, for help texts and messages.
    pub fn objects(self) -> &'static str {
        match self {
            ConfigKind::Route => "HTTPRoute, GRPCRoute, TCPRoute and TLSRoute",
            ConfigKind::Policy => "AuthorizationPolicy",
            ConfigKind::HttpFilter => "HTTPFilter",
            ConfigKind::MeshConfig => "MeshConfig",
        }
    }

    /// The DynamoDB item tag: partition `<tag>#<key>`, sort key `<tag>`.
    pub fn tag(self) -> &'static str {
        match self {
            ConfigKind::Route => "route",
            ConfigKind::Policy => "policy",
            ConfigKind::HttpFilter => "http_filter",
            ConfigKind::MeshConfig => "mesh_config",
        }
    }

    /// The position of this kind in [`ConfigKind::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// Decodes a stored record of this kind; why not, naming the message expected.
    pub fn decode(self, bytes: &[u8]) -> Result<ConfigRecord, String> {
        fn decode<T: Record>(bytes: &[u8]) -> Result<ConfigRecord, String> {
            let message = T::MESSAGE;
            T::decode(bytes)
                .map(|r| T::wrap(Arc::new(r)))
                .map_err(|e| format!("not {message} protobuf: {e}"))
        }
        match self {
            ConfigKind::Route => decode::<Route>(bytes),
            ConfigKind::Policy => decode::<AuthorizationPolicy>(bytes),
            ConfigKind::HttpFilter => decode::<HttpFilter>(bytes),
            ConfigKind::MeshConfig => decode::<MeshConfig>(bytes),
        }
    }

    /// What a watcher's holdings list of this kind.
    pub fn held(self, holdings: &Holdings) -> &[Held] {
        match self {
            ConfigKind::Route => &holdings.routes,
            ConfigKind::Policy => &holdings.policies,
            ConfigKind::HttpFilter => &holdings.http_filters,
            ConfigKind::MeshConfig => &holdings.mesh_configs,
        }
    }

    /// The change that takes the record `key` of this kind away from a watcher.
    pub fn removed(self, key: &str) -> change::Change {
        let key = key.to_owned();
        match self {
            ConfigKind::Route => change::Change::RouteRemoved(key),
            ConfigKind::Policy => change::Change::PolicyRemoved(key),
            ConfigKind::HttpFilter => change::Change::HttpFilterRemoved(key),
            ConfigKind::MeshConfig => change::Change::MeshConfigRemoved(key),
        }
    }
}

/// What each kind of record brings to the shared mechanism.
pub trait Record: Message + Default + Clone + PartialEq + Send + Sync + 'static {
    const KIND: ConfigKind;
    /// The protobuf message's name with its article, for refusals of undecodable records.
    const MESSAGE: &'static str;
    /// The key it is stored and streamed under.
    fn key(&self) -> String;
    /// Checks it with its projector's own rules; why it is unusable, naming the field.
    fn validate(&self) -> Result<(), String>;
    /// The change that hands it to a watcher.
    fn put(&self) -> change::Change;
    /// Where snapshots carry this kind.
    fn listed(snapshot: &mut Snapshot) -> &mut Vec<Self>;
    /// This kind's record, if `record` is one.
    fn of(record: &ConfigRecord) -> Option<&Arc<Self>>;
    /// It as a record of any kind.
    fn wrap(record: Arc<Self>) -> ConfigRecord;
}

/// A kind's [`Record`]: its [`ConfigKind`] and [`ConfigRecord`] variant, message name,
/// key function, projector check, put change and snapshot list.
macro_rules! record {
    ($type:ident, $variant:ident, $message:literal, $key:path, $validate:path, $put:ident, $listed:ident) => {
        impl Record for $type {
            const KIND: ConfigKind = ConfigKind::$variant;
            const MESSAGE: &'static str = $message;
            fn key(&self) -> String {
                $key(self)
            }
            fn validate(&self) -> Result<(), String> {
                $validate(self).map_err(|e| e.to_string())
            }
            fn put(&self) -> change::Change {
                change::Change::$put(self.clone())
            }
            fn listed(snapshot: &mut Snapshot) -> &mut Vec<Self> {
                &mut snapshot.$listed
            }
            fn of(record: &ConfigRecord) -> Option<&Arc<Self>> {
                match record {
                    ConfigRecord::$variant(record) => Some(record),
                    _ => None,
                }
            }
            fn wrap(record: Arc<Self>) -> ConfigRecord {
                ConfigRecord::$variant(record)
            }
        }
    };
}

record!(
    Route,
    Route,
    "a Route",
    route_key,
    aether_api::validate,
    RoutePut,
    routes
);
record!(
    AuthorizationPolicy,
    Policy,
    "an AuthorizationPolicy",
    policy_key,
    aether_api::authorization::validate,
    PolicyPut,
    policies
);
record!(
    HttpFilter,
    HttpFilter,
    "an HttpFilter",
    http_filter_key,
    aether_api::http_filter::validate,
    HttpFilterPut,
    http_filters
);
record!(
    MeshConfig,
    MeshConfig,
    "a MeshConfig",
    mesh_config_key,
    aether_api::mesh_config::validate,
    MeshConfigPut,
    mesh_configs
);

/// One record of any kind, shared (the catalog, its history and every watcher hold the
/// same one).
#[derive(Clone, Debug, PartialEq)]
pub enum ConfigRecord {
    Route(Arc<Route>),
    Policy(Arc<AuthorizationPolicy>),
    HttpFilter(Arc<HttpFilter>),
    MeshConfig(Arc<MeshConfig>),
}

/// Runs `$body` with `$r` bound to the record inside, whatever its kind.
macro_rules! each_kind {
    ($record:expr, $r:ident => $body:expr) => {
        match $record {
            ConfigRecord::Route($r) => $body,
            ConfigRecord::Policy($r) => $body,
            ConfigRecord::HttpFilter($r) => $body,
            ConfigRecord::MeshConfig($r) => $body,
        }
    };
}

impl<T: Record> From<Arc<T>> for ConfigRecord {
    fn from(record: Arc<T>) -> Self {
        T::wrap(record)
    }
}

impl ConfigRecord {
    pub fn kind(&self) -> ConfigKind {
        fn kind<T: Record>(_: &T) -> ConfigKind {
            T::KIND
        }
        each_kind!(self, r => kind(&**r))
    }

    pub fn key(&self) -> String {
        each_kind!(self, r => r.key())
    }

    /// Its digest, as a watcher holding it computes it (`aether_proto::digest`).
    pub fn digest(&self) -> u64 {
        each_kind!(self, r => aether_proto::digest::of(&**r))
    }

    pub fn encode(&self) -> Vec<u8> {
        each_kind!(self, r => r.encode_to_vec())
    }

    /// Checks a record read from a store or a feed with its projector's own rules.
    pub fn validate(&self) -> Result<(), String> {
        each_kind!(self, r => r.validate())
    }

    /// The change that hands it to a watcher.
    pub fn put(&self) -> change::Change {
        each_kind!(self, r => r.put())
    }

    /// Adds it to a snapshot chunk.
    pub fn add_to(&self, snapshot: &mut Snapshot) {
        fn add<T: Record>(record: &T, snapshot: &mut Snapshot) {
            T::listed(snapshot).push(record.clone());
        }
        each_kind!(self, r => add(&**r, snapshot))
    }
}

/// A record put (`Some`) or the removal of `key` of `kind`.
pub fn config_change(kind: ConfigKind, key: &str, record: Option<&ConfigRecord>) -> change::Change {
    match record {
        Some(record) => record.put(),
        None => kind.removed(key),
    }
}

/// Records by kind and key.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ConfigRecords {
    by_kind: [BTreeMap<String, ConfigRecord>; ConfigKind::ALL.len()],
}

impl ConfigRecords {
    /// The records of `kind`, by key.
    pub fn of(&self, kind: ConfigKind) -> &BTreeMap<String, ConfigRecord> {
        &self.by_kind[kind.index()]
    }

    /// Every record, kind by kind.
    pub fn all(&self) -> impl Iterator<Item = &ConfigRecord> {
        self.by_kind.iter().flat_map(BTreeMap::values)
    }

    /// The records of `T`'s kind, typed.
    pub fn typed<T: Record>(&self) -> impl Iterator<Item = &Arc<T>> {
        self.of(T::KIND).values().filter_map(T::of)
    }

    /// Makes the records of `kind` exactly `records`.
    pub fn replace(&mut self, kind: ConfigKind, records: BTreeMap<String, ConfigRecord>) {
        self.by_kind[kind.index()] = records;
    }

    /// Puts (`Some`) or deletes the record `key` of `kind`.
    pub fn set(&mut self, kind: ConfigKind, key: String, record: Option<ConfigRecord>) {
        let records = &mut self.by_kind[kind.index()];
        match record {
            Some(record) => records.insert(key, record),
            None => records.remove(&key),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use aether_proto::registry::v1::RouteKind;

    fn route() -> Route {
        Route {
            kind: RouteKind::Http as i32,
            namespace: "shop".into(),
            name: "split".into(),
            ..Default::default()
        }
    }

    #[test]
    fn every_kind_is_at_its_index_and_named_apart() {
        for (i, kind) in ConfigKind::ALL.into_iter().enumerate() {
            assert_eq!(kind.index(), i);
        }
        let names = |f: fn(ConfigKind) -> &'static str| ConfigKind::ALL.map(f);
        for names in [
            names(ConfigKind::plural),
            names(ConfigKind::tag),
            names(ConfigKind::noun),
        ] {
            let mut unique = names.to_vec();
            unique.sort();
            unique.dedup();
            assert_eq!(unique.len(), names.len(), "{names:?}");
        }
    }

    /// One record of each kind, in the order of [`ConfigKind::ALL`].
    fn one_of_each() -> [ConfigRecord; 4] {
        let policy = AuthorizationPolicy {
            namespace: "shop".into(),
            name: "deny".into(),
            ..Default::default()
        };
        let filter = HttpFilter {
            namespace: "shop".into(),
            name: "limit".into(),
            ..Default::default()
        };
        let config = MeshConfig {
            namespace: "shop".into(),
            name: "default".into(),
            ..Default::default()
        };
        [
            Arc::new(route()).into(),
            Arc::new(policy).into(),
            Arc::new(filter).into(),
            Arc::new(config).into(),
        ]
    }

    #[test]
    fn each_record_round_trips_through_its_kind_and_lands_in_its_own_places() {
        for (record, kind) in one_of_each().into_iter().zip(ConfigKind::ALL) {
            assert_eq!(record.kind(), kind);
            assert_eq!(kind.decode(&record.encode()), Ok(record.clone()));
            let mut snapshot = Snapshot::default();
            record.add_to(&mut snapshot);
            let placed = [
                snapshot.routes.len(),
                snapshot.policies.len(),
                snapshot.http_filters.len(),
                snapshot.mesh_configs.len(),
            ];
            assert_eq!(placed.iter().sum::<usize>(), 1, "{kind:?}");
            assert_eq!(placed[kind.index()], 1, "{kind:?}");
            let key = record.key();
            let changes = (record.put(), config_change(kind, &key, None));
            let paired = matches!(
                (kind, changes),
                (
                    ConfigKind::Route,
                    (change::Change::RoutePut(_), change::Change::RouteRemoved(_))
                ) | (
                    ConfigKind::Policy,
                    (change::Change::PolicyPut(_), change::Change::PolicyRemoved(_))
                ) | (
                    ConfigKind::HttpFilter,
                    (change::Change::HttpFilterPut(_), change::Change::HttpFilterRemoved(_))
                ) | (
                    ConfigKind::MeshConfig,
                    (change::Change::MeshConfigPut(_), change::Change::MeshConfigRemoved(_))
                )
            );
            assert!(paired, "{kind:?}: its put and removal are changes of its own kind");
        }
        assert_eq!(
            one_of_each().map(|r| r.key()),
            ["http/shop/split", "shop/deny", "shop/limit", "shop/default"]
        );
    }

    #[test]
    fn records_are_held_by_kind_and_key() {
        let mut records = ConfigRecords::default();
        for record in one_of_each() {
            records.set(record.kind(), record.key(), Some(record.clone()));
        }
        assert_eq!(records.typed::<Route>().count(), 1);
        assert_eq!(
            records
                .typed::<HttpFilter>()
                .map(|f| f.name.as_str())
                .collect::<Vec<_>>(),
            ["limit"]
        );
        assert_eq!(
            records.all().map(ConfigRecord::kind).collect::<Vec<_>>(),
            ConfigKind::ALL
        );
        records.set(ConfigKind::Route, "http/shop/split".into(), None);
        records.replace(ConfigKind::Policy, BTreeMap::new());
        assert_eq!(records.all().count(), 2, "the HTTP filter and the MeshConfig");
    }

    #[test]
    fn bytes_of_another_message_are_refused_naming_the_one_expected() {
        let error = ConfigKind::Policy.decode(b"\xff\xff").unwrap_err();
        assert!(error.starts_with("not an AuthorizationPolicy protobuf: "), "{error}");
    }
}
