//! The DynamoDB store (`--store dynamodb`): the catalog in one table that any
//! DynamoDB-API endpoint serves (`--dynamodb-endpoint-url`), shared by active/active
//! registrar replicas. See proposals/004 for the reasoning.
//!
//! # Single-table layout (`PK`, `SK` strings; `D` = protobuf bytes; `REV` = revision)
//! | item | PK | SK | attributes |
//! |---|---|---|---|
//! | service | `svc#<ns>/<name>` | `svc` | `D` (Service), `REV`, `VIP` |
//! | endpoint | `svc#<ns>/<name>` | `ep#<address>` | `D` (Endpoint), `REV`, `NODE` |
//! | configuration record | `<tag>#<key>` | `<tag>` | `D` (its protobuf), `REV` |
//! | VIP index | `vip#<ip>` | `vip` | `SVC` (owner key) |
//! | revision counter | `meta` | `revision` | `REV` |
//! | schema | `meta` | `schema` | `V` |
//! | node liveness | `nodes` | `node#<name>` | `AT` (wall-clock ms) |
//!
//! Access patterns: a service and its endpoints share a partition, so deleting a
//! service is one Query; VIP uniqueness is a conditional put on its `vip#` item; the
//! whole catalog is a consistent paginated Scan; node liveness is one Query on `nodes`.
//! A configuration record is its own partition, tagged by its kind (`route#http/ns/name`,
//! `policy#ns/name`): it names services but belongs to none of them.
//!
//! # Revisions
//! `commit` reserves a revision from the counter (`ADD REV 1`), then writes every item
//! of the batch with `REV = r` in `TransactWriteItems`, each endpoint and configuration record write
//! conditioned on `REV < r` so a write that reserved earlier but landed later never
//! overwrites a newer one (it is retried with a fresh revision). Service creation is
//! conditioned on `attribute_not_exists(PK)` for the service and its VIP; endpoint puts
//! on their service existing. A service update is conditioned on the service existing
//! with the same `VIP` and an older revision. Configuration records have no condition
//! beyond the revision's.
//!
//! # Sync
//! DynamoDB has no watch, so the feed is a periodic full scan (`--dynamodb-sync-interval`)
//! delivered as [`FeedEvent::Resync`]. A sync whose counter did not move since the last
//! one is skipped (one GetItem), except every [`FULL_SYNC_EVERY`] ticks, which catches
//! a commit that reserved its revision before the previous scan but landed after it.
//!
//! Errors: throttling, 5xx, timeouts and connection failures are retried with
//! exponential backoff ([`classify`]); the SDK's own retries are off so this is the
//! one retry policy. After the retries a call fails with `Unavailable`.

use parking_lot::Mutex;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use aether_common::quote::quote;
use aether_proto::registry::v1::{Endpoint, Service};
use async_trait::async_trait;
use aws_sdk_dynamodb::Client;
use aws_sdk_dynamodb::config::http::HttpResponse;
use aws_sdk_dynamodb::config::retry::RetryConfig;
use aws_sdk_dynamodb::config::timeout::TimeoutConfig;
use aws_sdk_dynamodb::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use aws_sdk_dynamodb::operation::get_item::GetItemError;
use aws_sdk_dynamodb::operation::transact_write_items::TransactWriteItemsError;
use aws_sdk_dynamodb::primitives::Blob;
use aws_sdk_dynamodb::types::{
    AttributeDefinition, AttributeValue, BillingMode, ConditionCheck, Delete, KeySchemaElement, KeyType, Put,
    PutRequest, ReturnValue, ScalarAttributeType, TableStatus, TransactWriteItem, WriteRequest,
};
use backon::{BackoffBuilder, ExponentialBuilder, Retryable};
use prost::Message;

use super::UnreadableRecord;
use super::{
    Conflict, Contents, Feed, FeedEvent, Revision, Store, StoreError, StoreOp, StoreSettings, Stored, vip_change,
};
use crate::model::ServiceKey;
use crate::records::{ConfigKind, ConfigRecord};

/// The default table name.
pub const DEFAULT_TABLE: &str = "aether-registrar";
/// A sync is a full scan at least this often (in sync ticks) even when the revision
/// counter did not move.
pub const FULL_SYNC_EVERY: u32 = 10;
/// DynamoDB's limit on actions in one `TransactWriteItems`.
pub const MAX_TRANSACTION_ITEMS: usize = 100;
/// DynamoDB's limit on requests in one `BatchWriteItem`.
const MAX_BATCH_WRITE: usize = 25;
/// How often a commit retries after losing a revision race to another replica.
const MAX_REVISION_RACES: usize = 8;
const SCHEMA_VERSION: &str = "1";

const PK: &str = "PK";
const SK: &str = "SK";
const DATA: &str = "D";
const REV: &str = "REV";

/// Everything the DynamoDB store needs, from `--dynamodb-*` flags.
#[derive(Clone, Debug)]
pub struct DynamoConfig {
    pub table: String,
    /// Any DynamoDB-API endpoint (e.g. a local one for development); `None` = AWS.
    pub endpoint_url: Option<String>,
    /// Region; `None` = the AWS default chain (AWS_REGION, profile).
    pub region: Option<String>,
    pub sync_interval: Duration,
    /// Create the table (on-demand billing) when it does not exist.
    pub create_table: bool,
    /// Items per Scan/Query page (`None` = DynamoDB's 1 MB pages); small in tests.
    pub page_size: Option<i32>,
    /// Timeout of one request attempt.
    pub request_timeout: Duration,
    /// Credentials given in code (embedding, tests); `None` = the AWS default chain
    /// (environment, profile, web identity, instance role). There is no flag for them.
    pub static_credentials: Option<aws_sdk_dynamodb::config::Credentials>,
    pub settings: StoreSettings,
}

/// What the retry policy makes of a failed call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Retry {
    /// Throttling, server errors, timeouts, connection failures: try again later.
    Transient,
    /// The request itself is refused (validation, access, a failed condition).
    Permanent,
}

/// The HTTP status of a raw response, when there is one.
pub trait HttpStatus {
    fn http_status(&self) -> u16;
}

impl HttpStatus for HttpResponse {
    fn http_status(&self) -> u16 {
        self.status().as_u16()
    }
}

/// Error codes DynamoDB answers that succeed when retried later.
const TRANSIENT_CODES: &[&str] = &[
    "ProvisionedThroughputExceededException",
    "ThrottlingException",
    "Throttling",
    "RequestLimitExceeded",
    "InternalServerError",
    "ServiceUnavailable",
    "TransactionConflictException",
    "TransactionInProgressException",
    "RequestTimeout",
    "RequestTimeoutException",
    "LimitExceededException",
];

/// Classifies a failed SDK call for the retry policy.
pub fn classify<E: ProvideErrorMetadata, R: HttpStatus>(error: &SdkError<E, R>) -> Retry {
    match error {
        SdkError::TimeoutError(_) | SdkError::ResponseError(_) => Retry::Transient,
        SdkError::DispatchFailure(failure) => {
            if failure.is_user() {
                Retry::Permanent
            } else {
                Retry::Transient
            }
        }
        SdkError::ServiceError(context) => classify_code(context.err().code(), Some(context.raw().http_status())),
        _ => Retry::Permanent,
    }
}

/// Classifies a DynamoDB error code and HTTP status.
pub fn classify_code(code: Option<&str>, status: Option<u16>) -> Retry {
    if code.is_some_and(|c| TRANSIENT_CODES.contains(&c)) {
        return Retry::Transient;
    }
    match status {
        Some(429) => Retry::Transient,
        Some(s) if s >= 500 => Retry::Transient,
        _ => Retry::Permanent,
    }
}

/// A transaction was cancelled only for reasons that pass when retried.
fn cancellation_is_transient(reasons: &[Option<&str>]) -> bool {
    !reasons.is_empty()
        && reasons.iter().all(|code| {
            matches!(
                code,
                None | Some("None" | "ThrottlingError" | "TransactionConflict" | "ProvisionedThroughputExceeded")
            )
        })
        && reasons.iter().any(|code| {
            matches!(
                code,
                Some("ThrottlingError" | "TransactionConflict" | "ProvisionedThroughputExceeded")
            )
        })
}

fn retry_policy() -> ExponentialBuilder {
    ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(50))
        .with_max_delay(Duration::from_secs(2))
        .with_max_times(6)
        .with_jitter()
}

fn describe<E: std::error::Error + 'static>(error: &SdkError<E, HttpResponse>) -> String {
    DisplayErrorContext(error).to_string()
}

fn table_missing<E: ProvideErrorMetadata>(error: &SdkError<E, HttpResponse>) -> bool {
    error.code() == Some("ResourceNotFoundException")
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or_default()
}

fn s(value: impl Into<String>) -> AttributeValue {
    AttributeValue::S(value.into())
}

fn n(value: impl ToString) -> AttributeValue {
    AttributeValue::N(value.to_string())
}

fn key(pk: impl Into<String>, sk: impl Into<String>) -> HashMap<String, AttributeValue> {
    HashMap::from([(PK.to_owned(), s(pk)), (SK.to_owned(), s(sk))])
}

fn service_pk(key: &str) -> String {
    format!("svc#{key}")
}

fn endpoint_sk(address: &str) -> String {
    format!("ep#{address}")
}

fn config_pk(kind: ConfigKind, key: &str) -> String {
    format!("{}#{key}", kind.tag())
}

fn vip_pk(vip: &str) -> String {
    format!("vip#{vip}")
}

fn node_sk(node: &str) -> String {
    format!("node#{node}")
}

const META_PK: &str = "meta";
const COUNTER_SK: &str = "revision";
const SCHEMA_SK: &str = "schema";
const NODES_PK: &str = "nodes";

fn text<'a>(item: &'a HashMap<String, AttributeValue>, name: &str) -> Option<&'a str> {
    item.get(name).and_then(|v| v.as_s().ok()).map(String::as_str)
}

fn number(item: &HashMap<String, AttributeValue>, name: &str) -> Option<i64> {
    item.get(name).and_then(|v| v.as_n().ok()).and_then(|v| v.parse().ok())
}

/// The kind and key of a configuration record's item (`<tag>#<key>`, sort key `<tag>`).
fn config_item<'a>(pk: &'a str, sk: &str) -> Option<(ConfigKind, &'a str)> {
    let kind = ConfigKind::ALL.into_iter().find(|kind| kind.tag() == sk)?;
    Some((kind, pk.strip_prefix(sk)?.strip_prefix('#')?))
}

/// Adds a scanned item to `contents` when it is a catalog record (a service, endpoint
/// or configuration record); one that cannot be read is returned, for
/// `Contents::unreadable`.
fn read_item(item: &HashMap<String, AttributeValue>, contents: &mut Contents) -> Result<(), UnreadableRecord> {
    let (Some(pk), Some(sk)) = (text(item, PK), text(item, SK)) else {
        return Ok(());
    };
    let (service_key, config) = (pk.strip_prefix("svc#"), config_item(pk, sk));
    if service_key.is_none() && config.is_none() {
        return Ok(());
    }
    let unreadable = |reason: String| UnreadableRecord {
        key: format!("{pk}/{sk}"),
        reason,
    };
    let revision = number(item, REV).unwrap_or(0).max(0) as Revision;
    let bytes = match item.get(DATA).and_then(|v| v.as_b().ok()) {
        Some(blob) => blob.as_ref(),
        None => return Err(unreadable(format!("no binary {DATA} attribute"))),
    };
    if let Some((kind, key)) = config {
        let value = kind.decode(bytes).map_err(unreadable)?;
        // A record under another record's key could never be deleted by its own key.
        if value.key() != key {
            return Err(unreadable(format!("holds {} {}", kind.tag(), quote(&value.key()))));
        }
        contents.configs.push(Stored { value, revision });
    } else if let Some(key) = service_key.filter(|_| sk == "svc") {
        let value = Service::decode(bytes).map_err(|e| unreadable(format!("not a Service protobuf: {e}")))?;
        let held = format!("{}/{}", value.namespace, value.name);
        if held != key {
            return Err(unreadable(format!("holds service {}", quote(&held))));
        }
        contents.services.push(Stored { value, revision });
    } else if service_key.is_some() && sk.starts_with("ep#") {
        let value = Endpoint::decode(bytes).map_err(|e| unreadable(format!("not an Endpoint protobuf: {e}")))?;
        contents.endpoints.push(Stored { value, revision });
    }
    Ok(())
}

/// The store; cheap to share (the feed holds a clone of its insides).
pub struct DynamoStore {
    inner: Arc<Inner>,
}

struct Inner {
    client: Client,
    config: DynamoConfig,
    /// The highest revision this replica has seen, so a reset counter (a DynamoDB-API
    /// endpoint that lost its data) never hands out a revision twice.
    max_seen: AtomicU64,
    /// Revisions reserved by commits still in flight: a snapshot never claims them.
    in_flight: Mutex<Vec<Revision>>,
    /// Held while reserving a revision (until it is in `in_flight`) and while a
    /// snapshot reads the counter and `in_flight`, so a snapshot either sees a
    /// reservation in `in_flight` or reads the counter before it.
    reserving: tokio::sync::Mutex<()>,
}

impl DynamoStore {
    /// Connects, checks (or creates) the table, and checks its schema version.
    pub async fn connect(config: DynamoConfig) -> Result<Self, StoreError> {
        if config.table.is_empty() {
            return Err(StoreError::Config("--dynamodb-table: must not be empty".into()));
        }
        if config.sync_interval.is_zero() {
            return Err(StoreError::Config(
                "--dynamodb-sync-interval: must be above zero".into(),
            ));
        }
        let mut loader = aws_config::defaults(aws_config::BehaviorVersion::latest());
        if let Some(region) = &config.region {
            loader = loader.region(aws_config::Region::new(region.clone()));
        }
        let shared = loader.load().await;
        if shared.region().is_none() {
            return Err(StoreError::Config(
                "--dynamodb-region: not set, and no region in AWS_REGION or the AWS profile".into(),
            ));
        }
        let mut builder = aws_sdk_dynamodb::config::Builder::from(&shared)
            // One retry policy, ours (see `classify`).
            .retry_config(RetryConfig::disabled())
            .timeout_config(
                TimeoutConfig::builder()
                    .connect_timeout(Duration::from_secs(2))
                    .operation_attempt_timeout(config.request_timeout)
                    .build(),
            );
        if let Some(credentials) = &config.static_credentials {
            builder = builder.credentials_provider(credentials.clone());
        }
        if let Some(url) = &config.endpoint_url {
            builder = builder.endpoint_url(url.clone());
        }
        let client = Client::from_conf(builder.build());
        let store = Self {
            inner: Arc::new(Inner {
                client,
                config,
                max_seen: AtomicU64::new(0),
                in_flight: Mutex::new(Vec::new()),
                reserving: tokio::sync::Mutex::new(()),
            }),
        };
        store.inner.ensure_table().await?;
        Ok(store)
    }
}

impl Inner {
    fn table(&self) -> &str {
        &self.config.table
    }

    fn unavailable(&self, what: &str, detail: impl std::fmt::Display) -> StoreError {
        StoreError::Unavailable(format!("DynamoDB table {:?}: {what}: {detail}", self.table()))
    }

    /// Creates the table if it is missing (and allowed), waits until it is active, and
    /// checks or writes the schema version.
    async fn ensure_table(&self) -> Result<(), StoreError> {
        let described = (|| self.client.describe_table().table_name(self.table()).send())
            .retry(retry_policy())
            .when(|e| classify(e) == Retry::Transient)
            .await;
        match described {
            Ok(_) => {}
            Err(e) if table_missing(&e) => {
                if !self.config.create_table {
                    return Err(StoreError::Config(format!(
                        "DynamoDB table {:?} does not exist (create it, or pass --dynamodb-create-table=true)",
                        self.table()
                    )));
                }
                self.create_table().await?;
            }
            Err(e) => return Err(self.unavailable("describing the table", describe(&e))),
        }
        self.wait_active().await?;
        self.check_schema().await
    }

    async fn create_table(&self) -> Result<(), StoreError> {
        let attribute = |name: &str| {
            AttributeDefinition::builder()
                .attribute_name(name)
                .attribute_type(ScalarAttributeType::S)
                .build()
                .expect("all fields set")
        };
        let key_element = |name: &str, kind: KeyType| {
            KeySchemaElement::builder()
                .attribute_name(name)
                .key_type(kind)
                .build()
                .expect("all fields set")
        };
        let created = (|| {
            self.client
                .create_table()
                .table_name(self.table())
                .billing_mode(BillingMode::PayPerRequest)
                .attribute_definitions(attribute(PK))
                .attribute_definitions(attribute(SK))
                .key_schema(key_element(PK, KeyType::Hash))
                .key_schema(key_element(SK, KeyType::Range))
                .send()
        })
        .retry(retry_policy())
        .when(|e| classify(e) == Retry::Transient)
        .await;
        match created {
            Ok(_) => {
                tracing::info!(table = self.table(), "created the DynamoDB table");
                Ok(())
            }
            // Another replica created it first.
            Err(e) if e.code() == Some("ResourceInUseException") => Ok(()),
            Err(e) => Err(self.unavailable("creating the table", describe(&e))),
        }
    }

    async fn wait_active(&self) -> Result<(), StoreError> {
        for _ in 0..120 {
            let out = (|| self.client.describe_table().table_name(self.table()).send())
                .retry(retry_policy())
                .when(|e| classify(e) == Retry::Transient)
                .await
                .map_err(|e| self.unavailable("describing the table", describe(&e)))?;
            if out.table().and_then(|t| t.table_status()) == Some(&TableStatus::Active) {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        Err(self.unavailable("waiting for the table", "not ACTIVE after 60 s"))
    }

    async fn check_schema(&self) -> Result<(), StoreError> {
        let written = (|| {
            self.client
                .put_item()
                .table_name(self.table())
                .set_item(Some(key(META_PK, SCHEMA_SK)))
                .item("V", s(SCHEMA_VERSION))
                .condition_expression("attribute_not_exists(PK)")
                .send()
        })
        .retry(retry_policy())
        .when(|e| classify(e) == Retry::Transient)
        .await;
        match written {
            Ok(_) => return Ok(()),
            Err(e) if e.code() == Some("ConditionalCheckFailedException") => {}
            Err(e) => return Err(self.unavailable("writing the schema version", describe(&e))),
        }
        let item = self
            .fetch(META_PK, SCHEMA_SK)
            .await
            .map_err(|e| self.unavailable("reading the schema version", describe(&e)))?
            .unwrap_or_default();
        match text(&item, "V") {
            Some(SCHEMA_VERSION) => Ok(()),
            other => Err(StoreError::Corrupt(format!(
                "DynamoDB table {:?} has schema version {}; this registrar reads version {SCHEMA_VERSION}",
                self.table(),
                other.map_or_else(|| "(none)".to_owned(), |v| quote(v).to_string())
            ))),
        }
    }

    /// A strongly consistent GetItem; recreates a vanished table when allowed.
    async fn get(&self, pk: &str, sk: &str) -> Result<Option<HashMap<String, AttributeValue>>, StoreError> {
        match self.fetch(pk, sk).await {
            Ok(item) => Ok(item),
            Err(e) if table_missing(&e) => {
                self.recreate_if_allowed().await?;
                Ok(None)
            }
            Err(e) => Err(self.unavailable(&format!("reading {pk}/{sk}"), describe(&e))),
        }
    }

    async fn fetch(
        &self,
        pk: &str,
        sk: &str,
    ) -> Result<Option<HashMap<String, AttributeValue>>, SdkError<GetItemError, HttpResponse>> {
        (|| {
            self.client
                .get_item()
                .table_name(self.table())
                .set_key(Some(key(pk, sk)))
                .consistent_read(true)
                .send()
        })
        .retry(retry_policy())
        .when(|e| classify(e) == Retry::Transient)
        .await
        .map(|out| out.item)
    }

    /// The table vanished (a DynamoDB-API endpoint that lost its data, or an operator):
    /// recreate it when allowed, so queued writes have somewhere to go.
    async fn recreate_if_allowed(&self) -> Result<(), StoreError> {
        if !self.config.create_table {
            return Err(self.unavailable("reading", "the table does not exist"));
        }
        tracing::warn!(table = self.table(), "the DynamoDB table is gone; recreating it");
        self.ensure_table().await
    }

    async fn counter(&self) -> Result<Revision, StoreError> {
        let item = self.get(META_PK, COUNTER_SK).await?;
        Ok(item.and_then(|i| number(&i, REV)).unwrap_or(0).max(0) as Revision)
    }

    /// Reserves the next revision, never one at or below what this replica has seen.
    async fn reserve(&self) -> Result<Revision, StoreError> {
        for _ in 0..3 {
            let out = (|| {
                self.client
                    .update_item()
                    .table_name(self.table())
                    .set_key(Some(key(META_PK, COUNTER_SK)))
                    .update_expression("ADD REV :one")
                    .expression_attribute_values(":one", n(1))
                    .return_values(ReturnValue::UpdatedNew)
                    .send()
            })
            .retry(retry_policy())
            .when(|e| classify(e) == Retry::Transient)
            .await;
            let out = match out {
                Ok(out) => out,
                Err(e) if table_missing(&e) => {
                    self.recreate_if_allowed().await?;
                    continue;
                }
                Err(e) => return Err(self.unavailable("reserving a revision", describe(&e))),
            };
            let reserved = out
                .attributes()
                .and_then(|a| number(a, REV))
                .ok_or_else(|| self.unavailable("reserving a revision", "no REV in the answer"))?
                as Revision;
            let floor = self.max_seen.load(Ordering::SeqCst);
            if reserved > floor {
                self.max_seen.fetch_max(reserved, Ordering::SeqCst);
                return Ok(reserved);
            }
            // The counter went backwards (the table was recreated): lift it past what
            // this replica has seen, then reserve again.
            tracing::warn!(
                table = self.table(),
                counter = reserved,
                seen = floor,
                "the revision counter is behind revisions already seen; raising it"
            );
            let lifted = self
                .client
                .update_item()
                .table_name(self.table())
                .set_key(Some(key(META_PK, COUNTER_SK)))
                .update_expression("SET REV = :floor")
                .condition_expression("attribute_not_exists(REV) OR REV < :floor")
                .expression_attribute_values(":floor", n(floor))
                .send()
                .await;
            if let Err(e) = lifted
                && e.code() != Some("ConditionalCheckFailedException")
            {
                return Err(self.unavailable("raising the revision counter", describe(&e)));
            }
        }
        Err(self.unavailable("reserving a revision", "the counter kept moving backwards"))
    }

    /// Every item of a Scan (strongly consistent, paginated).
    async fn scan_all(&self) -> Result<Vec<HashMap<String, AttributeValue>>, StoreError> {
        let mut items = Vec::new();
        let mut start: Option<HashMap<String, AttributeValue>> = None;
        loop {
            let page = (|| {
                self.client
                    .scan()
                    .table_name(self.table())
                    .consistent_read(true)
                    .set_limit(self.config.page_size)
                    .set_exclusive_start_key(start.clone())
                    .send()
            })
            .retry(retry_policy())
            .when(|e| classify(e) == Retry::Transient)
            .await;
            let page = match page {
                Ok(page) => page,
                Err(e) if table_missing(&e) => {
                    self.recreate_if_allowed().await?;
                    return Ok(Vec::new());
                }
                Err(e) => return Err(self.unavailable("scanning", describe(&e))),
            };
            items.extend(page.items.unwrap_or_default());
            match page.last_evaluated_key {
                Some(next) if !next.is_empty() => start = Some(next),
                _ => return Ok(items),
            }
        }
    }

    /// Every item of one partition (strongly consistent, paginated).
    async fn query_partition(
        &self,
        pk: &str,
        sk_prefix: &str,
    ) -> Result<Vec<HashMap<String, AttributeValue>>, StoreError> {
        let mut items = Vec::new();
        let mut start: Option<HashMap<String, AttributeValue>> = None;
        loop {
            let page = (|| {
                self.client
                    .query()
                    .table_name(self.table())
                    .consistent_read(true)
                    .key_condition_expression("PK = :pk AND begins_with(SK, :prefix)")
                    .expression_attribute_values(":pk", s(pk))
                    .expression_attribute_values(":prefix", s(sk_prefix))
                    .set_limit(self.config.page_size)
                    .set_exclusive_start_key(start.clone())
                    .send()
            })
            .retry(retry_policy())
            .when(|e| classify(e) == Retry::Transient)
            .await
            .map_err(|e| self.unavailable(&format!("querying {pk}"), describe(&e)))?;
            items.extend(page.items.unwrap_or_default());
            match page.last_evaluated_key {
                Some(next) if !next.is_empty() => start = Some(next),
                _ => return Ok(items),
            }
        }
    }

    async fn load(&self) -> Result<Contents, StoreError> {
        // Read the counter before scanning, and never claim a revision a commit of
        // this replica is still writing: R is then complete for every commit that
        // returned a revision ≤ R.
        let (counter, oldest_in_flight) = {
            let _gate = self.reserving.lock().await;
            let counter = self.counter().await?;
            let oldest = self.in_flight.lock().iter().min().copied();
            (counter, oldest)
        };
        let items = self.scan_all().await?;
        let mut contents = Contents {
            revision: match oldest_in_flight {
                Some(r) => counter.min(r.saturating_sub(1)),
                None => counter,
            },
            ..Default::default()
        };
        for item in items {
            if let Err(unreadable) = read_item(&item, &mut contents) {
                contents.unreadable.push(unreadable);
            }
        }
        self.max_seen.fetch_max(counter, Ordering::SeqCst);
        Ok(contents)
    }

    /// Commits `ops`; returns their revision and the nodes whose liveness they refresh.
    async fn commit(&self, ops: Vec<StoreOp>) -> Result<(Revision, Vec<String>), StoreError> {
        let batch = Batch::from_ops(ops);
        if batch.is_empty() {
            return Ok((self.max_seen.load(Ordering::SeqCst), Vec::new()));
        }
        // Endpoints of deleted services, found once (their keys do not depend on the revision).
        let mut doomed = Vec::new();
        for (service, _) in &batch.deleted_services {
            for item in self.query_partition(&service_pk(service), "ep#").await? {
                if let Some(sk) = text(&item, SK)
                    && let Some(address) = sk.strip_prefix("ep#")
                    && !batch.endpoints.contains_key(&(service.clone(), address.to_owned()))
                {
                    doomed.push((service.clone(), sk.to_owned()));
                }
            }
        }
        let mut skip_vip_deletes = BTreeSet::new();
        for _ in 0..MAX_REVISION_RACES {
            let revision = {
                let _gate = self.reserving.lock().await;
                let revision = self.reserve().await?;
                self.in_flight.lock().push(revision);
                revision
            };
            let result = self.write(&batch, &doomed, &skip_vip_deletes, revision).await;
            self.in_flight.lock().retain(|r| *r != revision);
            match result {
                Ok(()) => return Ok((revision, batch.live_nodes.iter().cloned().collect())),
                Err(WriteError::Store(e)) => return Err(e),
                Err(WriteError::RevisionRace) => {
                    tracing::debug!(revision, "another replica wrote a newer revision first; retrying");
                }
                Err(WriteError::VipReassigned(vip)) => {
                    skip_vip_deletes.insert(vip);
                }
            }
        }
        Err(self.unavailable("committing", "lost the revision race too often"))
    }

    /// Writes the batch at `revision` in transactions of at most 100 actions, the
    /// condition-carrying ones first.
    async fn write(
        &self,
        batch: &Batch,
        doomed: &[(String, String)],
        skip_vip_deletes: &BTreeSet<String>,
        revision: Revision,
    ) -> Result<(), WriteError> {
        let actions = self.actions(batch, doomed, skip_vip_deletes, revision)?;
        let chunks: Vec<_> = actions.chunks(MAX_TRANSACTION_ITEMS).collect();
        if chunks.len() > 1 {
            tracing::debug!(
                actions = actions.len(),
                transactions = chunks.len(),
                "batch larger than one DynamoDB transaction; conditions are all in the first"
            );
        }
        for (i, chunk) in chunks.into_iter().enumerate() {
            self.transact(chunk, i > 0).await?;
        }
        Ok(())
    }

    /// The batch's writes at `revision`, the condition-carrying ones first: new
    /// services and their VIPs, services that must exist, endpoints, routes, deleted
    /// services and VIPs, then the `doomed` items and forgotten nodes.
    fn actions(
        &self,
        batch: &Batch,
        doomed: &[(String, String)],
        skip_vip_deletes: &BTreeSet<String>,
        revision: Revision,
    ) -> Result<Vec<(Action, TransactWriteItem)>, WriteError> {
        let mut actions: Vec<(Action, TransactWriteItem)> = Vec::new();
        let rev = n(revision);
        for service in &batch.created {
            actions.extend(self.create_service(service, &rev)?);
        }
        for service in batch.updated.values() {
            actions.push(self.update_service(service, &rev)?);
        }
        for service in &batch.must_exist {
            let check = ConditionCheck::builder()
                .table_name(self.table())
                .set_key(Some(key(service_pk(service), "svc")))
                .condition_expression("attribute_exists(PK)")
                .build()
                .map_err(build_failed)?;
            actions.push((
                Action::ServiceExists(service.clone()),
                TransactWriteItem::builder().condition_check(check).build(),
            ));
        }
        for ((service, address), endpoint) in &batch.endpoints {
            let attributes = endpoint.as_deref().map(|e| {
                HashMap::from([
                    (DATA.to_owned(), AttributeValue::B(Blob::new(e.encode_to_vec()))),
                    ("NODE".to_owned(), s(&e.node)),
                ])
            });
            let item = self.write_revisioned(key(service_pk(service), endpoint_sk(address)), attributes, &rev)?;
            actions.push((Action::Revisioned, item));
        }
        // Configuration records: their protobuf, or `None` to delete them.
        for ((kind, record_key), record) in &batch.configs {
            let data = record.as_ref().map(ConfigRecord::encode);
            let attributes = data.map(|d| HashMap::from([(DATA.to_owned(), AttributeValue::B(Blob::new(d)))]));
            let item = self.write_revisioned(key(config_pk(*kind, record_key), kind.tag()), attributes, &rev)?;
            actions.push((Action::Revisioned, item));
        }
        for (service, vip) in &batch.deleted_services {
            actions.push((Action::Plain, self.delete_item(service_pk(service), "svc")?));
            if !skip_vip_deletes.contains(vip) {
                actions.push((Action::DeleteVip(vip.clone()), self.delete_vip(service, vip)?));
            }
        }
        for (service, sk) in doomed {
            actions.push((Action::Plain, self.delete_item(service_pk(service), sk.clone())?));
        }
        for node in &batch.forgotten_nodes {
            actions.push((Action::Plain, self.delete_item(NODES_PK, node_sk(node))?));
        }
        Ok(actions)
    }

    /// Puts a new service and its VIP, each only if it does not exist yet.
    fn create_service(
        &self,
        service: &Service,
        rev: &AttributeValue,
    ) -> Result<[(Action, TransactWriteItem); 2], WriteError> {
        let service_key = format!("{}/{}", service.namespace, service.name);
        let put_service = Put::builder()
            .table_name(self.table())
            .set_item(Some(key(service_pk(&service_key), "svc")))
            .item(DATA, AttributeValue::B(Blob::new(service.encode_to_vec())))
            .item(REV, rev.clone())
            .item("VIP", s(&service.vip))
            .condition_expression("attribute_not_exists(PK)")
            .build()
            .map_err(build_failed)?;
        let put_vip = Put::builder()
            .table_name(self.table())
            .set_item(Some(key(vip_pk(&service.vip), "vip")))
            .item("SVC", s(&service_key))
            .item(REV, rev.clone())
            .condition_expression("attribute_not_exists(PK)")
            .build()
            .map_err(build_failed)?;
        Ok([
            (
                Action::CreateService(service_key),
                TransactWriteItem::builder().put(put_service).build(),
            ),
            (
                Action::CreateVip(service.vip.clone()),
                TransactWriteItem::builder().put(put_vip).build(),
            ),
        ])
    }

    /// Replaces an existing service's item, only if it holds the same VIP at an older
    /// revision.
    fn update_service(
        &self,
        service: &Service,
        rev: &AttributeValue,
    ) -> Result<(Action, TransactWriteItem), WriteError> {
        let service_key = format!("{}/{}", service.namespace, service.name);
        let put = Put::builder()
            .table_name(self.table())
            .set_item(Some(key(service_pk(&service_key), "svc")))
            .item(DATA, AttributeValue::B(Blob::new(service.encode_to_vec())))
            .item(REV, rev.clone())
            .item("VIP", s(&service.vip))
            .condition_expression("attribute_exists(PK) AND VIP = :vip AND REV < :rev")
            .expression_attribute_values(":vip", s(&service.vip))
            .expression_attribute_values(":rev", rev.clone())
            .build()
            .map_err(build_failed)?;
        let action = Action::UpdateService(service_key, service.vip.clone());
        Ok((action, TransactWriteItem::builder().put(put).build()))
    }

    /// Puts the item at `key` with `attributes` (`Some`) or deletes it (`None`), only
    /// over an older revision: endpoints and routes, the records written again and again.
    fn write_revisioned(
        &self,
        key: HashMap<String, AttributeValue>,
        attributes: Option<HashMap<String, AttributeValue>>,
        rev: &AttributeValue,
    ) -> Result<TransactWriteItem, WriteError> {
        let newer = "attribute_not_exists(REV) OR REV < :rev";
        let item = match attributes {
            Some(attributes) => {
                let mut item = key;
                item.extend(attributes);
                item.insert(REV.to_owned(), rev.clone());
                let put = Put::builder()
                    .table_name(self.table())
                    .set_item(Some(item))
                    .condition_expression(newer)
                    .expression_attribute_values(":rev", rev.clone())
                    .build()
                    .map_err(build_failed)?;
                TransactWriteItem::builder().put(put).build()
            }
            None => {
                let delete = Delete::builder()
                    .table_name(self.table())
                    .set_key(Some(key))
                    .condition_expression(newer)
                    .expression_attribute_values(":rev", rev.clone())
                    .build()
                    .map_err(build_failed)?;
                TransactWriteItem::builder().delete(delete).build()
            }
        };
        Ok(item)
    }

    /// Deletes a deleted service's VIP, only while the VIP is still this service's:
    /// another replica may have handed it to a new service after an earlier delete.
    fn delete_vip(&self, service: &str, vip: &str) -> Result<TransactWriteItem, WriteError> {
        let delete = Delete::builder()
            .table_name(self.table())
            .set_key(Some(key(vip_pk(vip), "vip")))
            .condition_expression("attribute_not_exists(PK) OR SVC = :svc")
            .expression_attribute_values(":svc", s(service))
            .build()
            .map_err(build_failed)?;
        Ok(TransactWriteItem::builder().delete(delete).build())
    }

    /// Deletes an item unconditionally.
    fn delete_item(&self, pk: impl Into<String>, sk: impl Into<String>) -> Result<TransactWriteItem, WriteError> {
        let delete = Delete::builder()
            .table_name(self.table())
            .set_key(Some(key(pk, sk)))
            .build()
            .map_err(build_failed)?;
        Ok(TransactWriteItem::builder().delete(delete).build())
    }

    /// One transaction, retried while throttled or conflicting with another
    /// transaction. Its idempotency token makes a retry of a transaction that did
    /// land (its answer lost) succeed instead of failing its own conditions.
    async fn transact(&self, chunk: &[(Action, TransactWriteItem)], later: bool) -> Result<(), WriteError> {
        let token = uuid::Uuid::new_v4().to_string();
        let items: Vec<TransactWriteItem> = chunk.iter().map(|(_, item)| item.clone()).collect();
        let sent = (|| {
            self.client
                .transact_write_items()
                .set_transact_items(Some(items.clone()))
                .client_request_token(token.clone())
                .send()
        })
        .retry(retry_policy())
        .when(|e| match e.as_service_error() {
            Some(TransactWriteItemsError::TransactionCanceledException(c)) => {
                cancellation_is_transient(&c.cancellation_reasons().iter().map(|r| r.code()).collect::<Vec<_>>())
            }
            _ => classify(e) == Retry::Transient,
        })
        .await;
        let error = match sent {
            Ok(_) => return Ok(()),
            Err(error) => error,
        };
        let partial = if later {
            " (earlier transactions of this batch were applied; their writes are idempotent)"
        } else {
            ""
        };
        if table_missing(&error) {
            self.recreate_if_allowed().await.map_err(WriteError::Store)?;
            return Err(WriteError::Store(
                self.unavailable("committing", format!("the table was missing{partial}")),
            ));
        }
        let Some(TransactWriteItemsError::TransactionCanceledException(cancelled)) = error.as_service_error() else {
            return Err(WriteError::Store(
                self.unavailable("committing", format!("{}{partial}", describe(&error))),
            ));
        };
        let failed: Vec<&Action> = (cancelled.cancellation_reasons().iter())
            .zip(chunk)
            .filter(|(reason, _)| reason.code() == Some("ConditionalCheckFailed"))
            .map(|(_, (action, _))| action)
            .collect();
        Err(self.cancelled(&failed, partial).await.unwrap_or_else(|| {
            WriteError::Store(self.unavailable(
                "committing",
                format!("transaction cancelled: {}{partial}", describe(&error)),
            ))
        }))
    }

    /// Why a transaction was cancelled, from the actions whose conditions failed: a
    /// conflict (who won), a reassigned VIP, a lost revision race, or `None` if the
    /// actions tell nothing.
    async fn cancelled(&self, failed: &[&Action], partial: &str) -> Option<WriteError> {
        let mut conflict = Conflict::default();
        let mut race = false;
        let mut reassigned = None;
        for action in failed {
            let found = match action {
                Action::CreateService(service) => self.service_taken(service, &mut conflict).await,
                Action::CreateVip(vip) => self.vip_taken(vip, &mut conflict).await,
                Action::ServiceExists(service) => service_missing(service, &mut conflict),
                Action::UpdateService(service, vip) => match self.stored_service(service).await {
                    Ok(None) => service_missing(service, &mut conflict),
                    Ok(Some(stored)) if stored.vip != *vip => {
                        Err(WriteError::Store(vip_change(service, &stored.vip, vip)))
                    }
                    // There at an equal or newer revision: another replica wrote it since.
                    Ok(Some(_)) => {
                        race = true;
                        Ok(())
                    }
                    Err(error) => Err(WriteError::Store(error)),
                },
                Action::Revisioned => {
                    race = true;
                    Ok(())
                }
                Action::DeleteVip(vip) => {
                    reassigned = Some(vip.clone());
                    Ok(())
                }
                Action::Plain => Ok(()),
            };
            if let Err(error) = found {
                return Some(error);
            }
        }
        if !conflict.existing.is_empty() || !conflict.missing.is_empty() || !conflict.detail.is_empty() {
            conflict.existing.dedup();
            conflict.detail = conflict.detail.trim_end_matches("; ").to_owned();
            conflict.detail.push_str(partial);
            return Some(WriteError::Store(StoreError::Conflict(conflict)));
        }
        if let Some(vip) = reassigned {
            return Some(WriteError::VipReassigned(vip));
        }
        race.then_some(WriteError::RevisionRace)
    }

    /// Adds the service that already exists under `service` to `conflict`.
    async fn service_taken(&self, service: &str, conflict: &mut Conflict) -> Result<(), WriteError> {
        if let Some(existing) = self.stored_service(service).await.map_err(WriteError::Store)? {
            conflict.existing.push(existing);
        }
        conflict.detail.push_str(&format!("service {service} already exists; "));
        Ok(())
    }

    /// Adds the service that already holds `vip` to `conflict`.
    async fn vip_taken(&self, vip: &str, conflict: &mut Conflict) -> Result<(), WriteError> {
        let owner = self.get(&vip_pk(vip), "vip").await.map_err(WriteError::Store)?;
        let owner = owner
            .as_ref()
            .and_then(|o| text(o, "SVC"))
            .unwrap_or_default()
            .to_owned();
        if let Some(existing) = self.stored_service(&owner).await.map_err(WriteError::Store)? {
            conflict.existing.push(existing);
        }
        conflict
            .detail
            .push_str(&format!("VIP {vip} already belongs to {owner}; "));
        Ok(())
    }

    async fn stored_service(&self, service_key: &str) -> Result<Option<Service>, StoreError> {
        if service_key.is_empty() {
            return Ok(None);
        }
        let Some(item) = self.get(&service_pk(service_key), "svc").await? else {
            return Ok(None);
        };
        let bytes = item
            .get(DATA)
            .and_then(|v| v.as_b().ok())
            .ok_or_else(|| StoreError::Corrupt(format!("service {service_key}: no binary {DATA} attribute")))?;
        Service::decode(bytes.as_ref())
            .map(Some)
            .map_err(|e| StoreError::Corrupt(format!("service {service_key}: not a Service protobuf: {e}")))
    }

    /// Stamps `nodes` alive now (wall clock, see proposals/004).
    async fn refresh_nodes(&self, nodes: Vec<String>) -> Result<(), StoreError> {
        let at = n(now_ms());
        let mut requests: Vec<WriteRequest> = nodes
            .iter()
            .filter(|node| !node.is_empty())
            .map(|node| {
                let put = PutRequest::builder()
                    .set_item(Some(key(NODES_PK, node_sk(node))))
                    .item("AT", at.clone())
                    .build()
                    .expect("item set");
                WriteRequest::builder().put_request(put).build()
            })
            .collect();
        let mut backoff = retry_policy().build();
        while !requests.is_empty() {
            let rest = requests.split_off(requests.len().min(MAX_BATCH_WRITE));
            let batch = std::mem::replace(&mut requests, rest);
            let out = (|| {
                self.client
                    .batch_write_item()
                    .request_items(self.table(), batch.clone())
                    .send()
            })
            .retry(retry_policy())
            .when(|e| classify(e) == Retry::Transient)
            .await
            .map_err(|e| self.unavailable("refreshing node liveness", describe(&e)))?;
            // Unprocessed items (throttling) go round again after a pause.
            if let Some(unprocessed) = out.unprocessed_items.and_then(|mut u| u.remove(self.table()))
                && !unprocessed.is_empty()
            {
                let delay = backoff
                    .next()
                    .ok_or_else(|| self.unavailable("refreshing node liveness", "still throttled after retries"))?;
                tokio::time::sleep(delay).await;
                requests.extend(unprocessed);
            }
        }
        Ok(())
    }

    async fn expired_nodes(&self) -> Result<Vec<String>, StoreError> {
        let cutoff = now_ms() - self.config.settings.endpoint_ttl.as_millis() as i64;
        let items = self.query_partition(NODES_PK, "node#").await?;
        Ok(items
            .iter()
            .filter(|item| number(item, "AT").is_some_and(|at| at < cutoff))
            .filter_map(|item| text(item, SK)?.strip_prefix("node#").map(str::to_owned))
            .collect())
    }
}

/// Which condition an action in a transaction carries, to explain a cancellation.
#[derive(Clone, Debug)]
enum Action {
    CreateService(String),
    CreateVip(String),
    ServiceExists(String),
    /// A service update (key, VIP): the service must exist with that VIP, at an older
    /// revision.
    UpdateService(String, String),
    /// An endpoint or configuration record write, conditioned on the item's older revision.
    Revisioned,
    DeleteVip(String),
    Plain,
}

enum WriteError {
    Store(StoreError),
    /// An endpoint or configuration record already carries a revision ≥ ours: reserve a new one and retry.
    RevisionRace,
    /// The VIP of a deleted service already belongs to another service: keep it.
    VipReassigned(String),
}

fn build_failed(e: aws_sdk_dynamodb::error::BuildError) -> WriteError {
    WriteError::Store(StoreError::Corrupt(e.to_string()))
}

/// Adds a service a batch needed but the store lacks to `conflict`.
fn service_missing(service: &str, conflict: &mut Conflict) -> Result<(), WriteError> {
    let missing =
        ServiceKey::parse("service", service).map_err(|e| WriteError::Store(StoreError::Corrupt(e.to_string())))?;
    conflict.missing.push(missing);
    conflict
        .detail
        .push_str(&format!("service {service} is not in the store; "));
    Ok(())
}

/// A batch of ops folded per item: DynamoDB refuses two actions on one item in a
/// transaction, and the last op on an item is the one that counts.
#[derive(Default)]
struct Batch {
    created: Vec<Service>,
    /// Updates of services the batch does not create, by key.
    updated: BTreeMap<String, Service>,
    deleted_services: Vec<(String, String)>,
    /// (service, address) → the endpoint, or `None` to delete it.
    endpoints: BTreeMap<(String, String), Option<Arc<Endpoint>>>,
    /// (kind, key) → the configuration record, or `None` to delete it.
    configs: BTreeMap<(ConfigKind, String), Option<ConfigRecord>>,
    /// Services written into but not created by this batch: they must exist.
    must_exist: BTreeSet<String>,
    live_nodes: BTreeSet<String>,
    forgotten_nodes: BTreeSet<String>,
}

impl Batch {
    fn from_ops(ops: Vec<StoreOp>) -> Self {
        let mut batch = Batch::default();
        for op in ops {
            match op {
                StoreOp::CreateService(service) => batch.created.push(service),
                StoreOp::UpdateService(service) => batch.update(service),
                StoreOp::DeleteService { key, vip } => {
                    let key = key.to_string();
                    batch.updated.remove(&key);
                    batch.endpoints.retain(|(service, _), _| *service != key);
                    batch.created.retain(|s| format!("{}/{}", s.namespace, s.name) != key);
                    batch.deleted_services.push((key, vip));
                }
                StoreOp::PutEndpoint(endpoint) => {
                    batch.live_nodes.insert(endpoint.node.clone());
                    batch
                        .endpoints
                        .insert((endpoint.service.clone(), endpoint.address.clone()), Some(endpoint));
                }
                StoreOp::DeleteEndpoint { service, address } => {
                    batch.endpoints.insert((service.to_string(), address), None);
                }
                StoreOp::ForgetNode(node) => {
                    batch.live_nodes.remove(&node);
                    batch.forgotten_nodes.insert(node);
                }
                StoreOp::PutConfig(record) => {
                    batch.configs.insert((record.kind(), record.key()), Some(record));
                }
                StoreOp::DeleteConfig(kind, key) => {
                    batch.configs.insert((kind, key), None);
                }
            }
        }
        let created: BTreeSet<String> = batch
            .created
            .iter()
            .map(|s| format!("{}/{}", s.namespace, s.name))
            .collect();
        let deleted: BTreeSet<&String> = batch.deleted_services.iter().map(|(k, _)| k).collect();
        batch.must_exist = batch
            .endpoints
            .iter()
            .filter(|(_, e)| e.is_some())
            .map(|((service, _), _)| service.clone())
            .filter(|service| !created.contains(service) && !deleted.contains(service))
            // An update's own condition checks that its service exists.
            .filter(|service| !batch.updated.contains_key(service))
            .collect();
        batch
    }

    /// Folds an update into the batch: into the creation of the same service if the
    /// batch creates it (one action per item), else as an update.
    fn update(&mut self, service: Service) {
        let key = format!("{}/{}", service.namespace, service.name);
        match (self.created.iter_mut()).find(|c| format!("{}/{}", c.namespace, c.name) == key && c.vip == service.vip) {
            Some(created) => *created = service,
            None => {
                self.updated.insert(key, service);
            }
        }
    }

    fn is_empty(&self) -> bool {
        self.created.is_empty()
            && self.updated.is_empty()
            && self.deleted_services.is_empty()
            && self.endpoints.is_empty()
            && self.configs.is_empty()
            && self.forgotten_nodes.is_empty()
    }
}

#[async_trait]
impl Store for DynamoStore {
    fn kind(&self) -> &'static str {
        "dynamodb"
    }

    async fn load(&self) -> Result<Contents, StoreError> {
        self.inner.load().await
    }

    async fn commit(&self, ops: Vec<StoreOp>) -> Result<Revision, StoreError> {
        let (revision, live) = self.inner.commit(ops).await?;
        if !live.is_empty() {
            // Liveness is a timestamp beside the data, not part of the commit: stamp it
            // without holding up the caller.
            let inner = self.inner.clone();
            tokio::spawn(async move {
                if let Err(error) = inner.refresh_nodes(live).await {
                    tracing::warn!(%error, "refreshing node liveness after a commit failed");
                }
            });
        }
        Ok(revision)
    }

    fn feed(&self, after: Revision) -> Feed {
        let state = SyncState {
            inner: self.inner.clone(),
            last_counter: Some(after),
            since_full: 0,
            down: false,
        };
        // The sync runs in its own task: the consumer may leave the stream unpolled while
        // it commits, and a sync suspended mid-snapshot would hold the reservation gate.
        let (events, received) = tokio::sync::mpsc::channel(1);
        tokio::spawn(async move {
            let mut state = state;
            loop {
                let event = state.next().await;
                if events.send(event).await.is_err() {
                    return; // The feed was dropped.
                }
            }
        });
        Box::pin(tokio_stream::wrappers::ReceiverStream::new(received))
    }

    async fn refresh(&self, nodes: Vec<String>) -> Result<(), StoreError> {
        self.inner.refresh_nodes(nodes).await
    }

    async fn expired_nodes(&self) -> Result<Vec<String>, StoreError> {
        self.inner.expired_nodes().await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.inner.counter().await.map(|_| ())
    }

    /// Every op takes at most two transaction actions (a service and its VIP; or an
    /// endpoint and its service's condition check; a route is one), so batches this size fit one
    /// transaction; only a DeleteService of a service with many endpoints spills over.
    fn max_batch_ops(&self) -> usize {
        MAX_TRANSACTION_ITEMS / 2
    }
}

/// The periodic sync behind [`Store::feed`].
struct SyncState {
    inner: Arc<Inner>,
    last_counter: Option<Revision>,
    since_full: u32,
    down: bool,
}

impl SyncState {
    async fn next(&mut self) -> FeedEvent {
        let mut tick = tokio::time::interval(self.inner.config.sync_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            self.since_full += 1;
            let counter = match self.inner.counter().await {
                Ok(counter) => counter,
                Err(e) => return self.down(e),
            };
            if Some(counter) == self.last_counter && !self.down && self.since_full < FULL_SYNC_EVERY {
                continue;
            }
            match self.inner.load().await {
                Ok(contents) => {
                    if std::mem::take(&mut self.down) {
                        tracing::info!(table = self.inner.table(), "DynamoDB sync recovered");
                    }
                    // A snapshot held back by an in-flight commit is not a reason to skip the next.
                    self.last_counter = (contents.revision == counter).then_some(counter);
                    self.since_full = 0;
                    return FeedEvent::Resync(contents);
                }
                Err(e) => return self.down(e),
            }
        }
    }

    fn down(&mut self, error: StoreError) -> FeedEvent {
        if !std::mem::replace(&mut self.down, true) {
            tracing::warn!(table = self.inner.table(), %error, "DynamoDB sync failed; retrying every interval");
        }
        FeedEvent::Down(error.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use aws_sdk_dynamodb::error::{ConnectorError, ErrorMetadata};
    use aws_sdk_dynamodb::operation::put_item::PutItemError;

    struct Raw(u16);
    impl HttpStatus for Raw {
        fn http_status(&self) -> u16 {
            self.0
        }
    }

    fn service_error(code: &str, status: u16) -> SdkError<PutItemError, Raw> {
        SdkError::service_error(
            PutItemError::generic(ErrorMetadata::builder().code(code).build()),
            Raw(status),
        )
    }

    #[test]
    fn throttling_and_server_errors_are_retried() {
        for code in [
            "ProvisionedThroughputExceededException",
            "ThrottlingException",
            "RequestLimitExceeded",
            "InternalServerError",
            "TransactionConflictException",
        ] {
            assert_eq!(classify(&service_error(code, 400)), Retry::Transient, "{code}");
        }
        assert_eq!(classify(&service_error("Whatever", 503)), Retry::Transient);
        assert_eq!(classify(&service_error("Whatever", 429)), Retry::Transient);
        let timeout: SdkError<PutItemError, Raw> = SdkError::timeout_error("attempt timed out");
        assert_eq!(classify(&timeout), Retry::Transient);
        let refused: SdkError<PutItemError, Raw> =
            SdkError::dispatch_failure(ConnectorError::io("connection refused".into()));
        assert_eq!(classify(&refused), Retry::Transient);
    }

    #[test]
    fn refusals_are_not_retried() {
        for code in [
            "ConditionalCheckFailedException",
            "ValidationException",
            "AccessDeniedException",
            "ResourceNotFoundException",
            "TransactionCanceledException",
        ] {
            assert_eq!(classify(&service_error(code, 400)), Retry::Permanent, "{code}");
        }
        let user: SdkError<PutItemError, Raw> = SdkError::dispatch_failure(ConnectorError::user("bad URI".into()));
        assert_eq!(classify(&user), Retry::Permanent);
        assert_eq!(classify_code(None, None), Retry::Permanent);
    }

    #[test]
    fn cancelled_transactions_are_retried_only_for_throttling_or_conflicts() {
        assert!(cancellation_is_transient(&[Some("None"), Some("ThrottlingError")]));
        assert!(cancellation_is_transient(&[Some("TransactionConflict"), None]));
        assert!(!cancellation_is_transient(&[
            Some("ConditionalCheckFailed"),
            Some("ThrottlingError")
        ]));
        assert!(!cancellation_is_transient(&[Some("None"), Some("None")]));
        assert!(!cancellation_is_transient(&[]));
    }

    fn endpoint(service: &str, address: &str, node: &str) -> Arc<Endpoint> {
        Arc::new(Endpoint {
            service: service.into(),
            address: address.into(),
            node: node.into(),
            ..Default::default()
        })
    }

    #[test]
    fn a_batch_keeps_the_last_op_per_item_and_checks_services_it_does_not_create() {
        let key = |k: &str| ServiceKey::parse("service", k).unwrap();
        let batch = Batch::from_ops(vec![
            StoreOp::CreateService(Service {
                namespace: "ns".into(),
                name: "new".into(),
                vip: "240.240.0.9".into(),
                kubernetes: None,
                external: None,
            }),
            StoreOp::PutEndpoint(endpoint("ns/new", "10.0.0.1", "n1")),
            StoreOp::PutEndpoint(endpoint("ns/old", "10.0.0.2", "n1")),
            StoreOp::DeleteEndpoint {
                service: key("ns/old"),
                address: "10.0.0.2".into(),
            },
            StoreOp::PutEndpoint(endpoint("ns/other", "10.0.0.3", "n2")),
            StoreOp::ForgetNode("n3".into()),
        ]);
        assert_eq!(batch.endpoints.len(), 3);
        assert!(batch.endpoints[&("ns/old".into(), "10.0.0.2".into())].is_none());
        assert_eq!(batch.must_exist, BTreeSet::from(["ns/other".to_owned()]));
        assert_eq!(batch.live_nodes, BTreeSet::from(["n1".to_owned(), "n2".to_owned()]));
        assert_eq!(batch.forgotten_nodes, BTreeSet::from(["n3".to_owned()]));
    }

    #[test]
    fn a_batch_keeps_the_last_op_per_route_and_routes_alone_are_a_batch() {
        let route = |name: &str, generation: i64| {
            ConfigRecord::from(Arc::new(aether_proto::registry::v1::Route {
                kind: aether_proto::registry::v1::RouteKind::Http as i32,
                namespace: "ns".into(),
                name: name.into(),
                generation,
                ..Default::default()
            }))
        };
        let delete = |key: &str| StoreOp::DeleteConfig(ConfigKind::Route, key.into());
        let batch = Batch::from_ops(vec![
            StoreOp::PutConfig(route("canary", 1)),
            delete("http/ns/canary"),
            StoreOp::PutConfig(route("canary", 2)),
            StoreOp::PutConfig(route("stable", 1)),
            delete("http/ns/stable"),
        ]);
        assert!(!batch.is_empty());
        assert_eq!(batch.configs.len(), 2);
        let at = |key: &str| batch.configs[&(ConfigKind::Route, key.to_owned())].clone();
        assert_eq!(at("http/ns/canary"), Some(route("canary", 2)));
        assert!(at("http/ns/stable").is_none());
        assert!(batch.must_exist.is_empty(), "routes need no service to exist");
    }
}
