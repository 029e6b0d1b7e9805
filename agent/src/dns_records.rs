//! The record file mesh-dns answers from: every service's VIP, written atomically to
//! `<state dir>/mesh-dns/records` whenever the catalog's services or VIPs change, and
//! re-stamped every `--dns-records-restamp` so mesh-dns can tell a stale file (agent
//! gone) from a quiet mesh. The format is `aether_mesh_dns::records`.
//!
//! The node's main Watch stream carries only its dependency set, so the file is fed by
//! a second, services-only one ([`crate::catalog_watch::Interest::ServicesOnly`]):
//! every service's record, no endpoints, and the mesh-wide MeshConfig, whose mesh domain
//! (when it is not the node's `--mesh-domain`) the file lists as an alias: mesh-dns
//! answers the same names under it (proposals/016).

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use aether_mesh_dns::records::{self, Addresses, RecordFile};
use aether_proto::view::CatalogView;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::catalog_watch::WatchedCatalog;

/// Record files are read by mesh-dns, another process: world-readable, owner-writable.
const FILE_MODE: u32 = 0o644;
const DIR_MODE: u32 = 0o755;

#[derive(Debug, thiserror::Error)]
pub enum DnsRecordsError {
    #[error("creating {path}: {source}")]
    Dir { path: String, source: std::io::Error },
}

#[derive(Clone, Default)]
pub struct DnsRecordsMetrics {
    pub generation: Gauge,
    pub records: Gauge,
    pub writes: Counter,
    pub write_errors: Counter,
    /// Services whose VIP is not an IP address (left out of the file).
    pub bad_vips: Gauge,
    pub connected: Gauge,
}

impl DnsRecordsMetrics {
    /// Registers under the agent's `aether_agent` registry as `dns_records_*`.
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("dns_records");
        r.register(
            "generation",
            "Generation of the mesh-dns record file written",
            self.generation.clone(),
        );
        r.register("services", "Services in the mesh-dns record file", self.records.clone());
        r.register(
            "writes",
            "mesh-dns record file writes (changes and re-stamps)",
            self.writes.clone(),
        );
        r.register(
            "write_errors",
            "Failed mesh-dns record file writes",
            self.write_errors.clone(),
        );
        r.register(
            "bad_vips",
            "Services left out of the record file: VIP not an IP",
            self.bad_vips.clone(),
        );
        r.register(
            "watch_connected",
            "1 while the services-only registrar watch is up",
            self.connected.clone(),
        );
    }
}

/// The record file's path under the agent's state dir.
pub fn path(state_dir: &Path) -> PathBuf {
    state_dir.join(records::DIR).join(records::FILE)
}

/// What the file says of a catalog view's services.
#[derive(Debug, Default)]
pub struct Records {
    /// Every service's VIP by (namespace, name).
    pub services: BTreeMap<(String, String), Addresses>,
    /// External services' hosts, each with its service's VIP (the first service to list a
    /// host, by key, wins).
    pub hosts: BTreeMap<String, Addresses>,
    /// Services left out: a VIP that is not an IP, or a name that is not a DNS label.
    pub bad: usize,
}

/// Every service's addresses, and external services' hosts, from a catalog view.
pub fn records_of(catalog: &CatalogView) -> Records {
    let (mut out, mut hosts) = (BTreeMap::new(), BTreeMap::new());
    let mut bad = 0;
    for service in catalog.services.values() {
        let mut addresses = Addresses::default();
        match service.vip.parse::<IpAddr>() {
            Ok(IpAddr::V4(v4)) => addresses.v4 = Some(v4),
            Ok(IpAddr::V6(v6)) => addresses.v6 = Some(v6),
            Err(_) => {
                bad += 1;
                continue;
            }
        }
        // The registrar validates names as DNS labels; anything else cannot be a DNS name.
        if !records::valid_label(&service.namespace) || !records::valid_label(&service.name) {
            bad += 1;
            continue;
        }
        for host in service.external.iter().flat_map(|e| &e.hosts) {
            if records::check_host(host).is_ok() {
                hosts.entry(host.clone()).or_insert(addresses);
            }
        }
        out.insert((service.namespace.clone(), service.name.clone()), addresses);
    }
    Records {
        services: out,
        hosts,
        bad,
    }
}

/// The alias domains of the file: the mesh-wide MeshConfig's mesh domain, unless it is
/// `mesh_domain` (the node's own, always answered).
pub fn aliases_of(catalog: &CatalogView, mesh_domain: &str) -> Vec<String> {
    let settings = crate::mesh_settings::MeshSettings::new(&catalog.mesh_configs).mesh();
    settings.mesh_domain.into_iter().filter(|d| d != mesh_domain).collect()
}

/// What the file says.
pub struct Content {
    pub records: BTreeMap<(String, String), Addresses>,
    pub aliases: Vec<String>,
    pub hosts: BTreeMap<String, Addresses>,
}

pub struct DnsRecords {
    path: PathBuf,
    restamp: Duration,
    /// The node's mesh domain: mesh-dns's own, never an alias.
    mesh_domain: String,
    metrics: DnsRecordsMetrics,
    /// The file as last written, or as a previous run left it.
    current: Option<RecordFile>,
    /// Whether a catalog view arrived in this run (only then is anything written).
    have_view: bool,
    /// Whether `current` is on disk as this run meant it (false after a failed write).
    written: bool,
}

impl DnsRecords {
    pub fn new(
        state_dir: &Path,
        restamp: Duration,
        mesh_domain: &str,
        metrics: DnsRecordsMetrics,
    ) -> Result<Self, DnsRecordsError> {
        let path = path(state_dir);
        let dir = path.parent().expect("the record path has a directory");
        let dir_error = |source| DnsRecordsError::Dir {
            path: dir.display().to_string(),
            source,
        };
        std::fs::create_dir_all(dir).map_err(dir_error)?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(DIR_MODE)).map_err(dir_error)?;
        // Continue the generation of a file a previous run left, so it never goes back.
        let previous = std::fs::read(&path).ok().and_then(|b| RecordFile::parse(&b).ok());
        Ok(Self {
            path,
            restamp,
            mesh_domain: mesh_domain.to_owned(),
            metrics,
            current: previous,
            have_view: false,
            written: false,
        })
    }

    /// Writes the file for `content` if it changed (new generation), or re-stamps it if
    /// `restamp`. Nothing is written before the first catalog view: an old file is better
    /// than an empty one.
    async fn write(&mut self, content: Option<Content>, restamp: bool) {
        let now = SystemTime::now();
        let file = match (content, &self.current) {
            (Some(new), Some(current))
                if new.records == current.records && new.aliases == current.aliases && new.hosts == current.hosts =>
            {
                if self.have_view && self.written && !restamp {
                    return;
                }
                RecordFile {
                    written_at: now,
                    ..current.clone()
                }
            }
            (Some(new), current) => RecordFile {
                generation: current.as_ref().map_or(1, |c| c.generation + 1),
                written_at: now,
                records: new.records,
                aliases: new.aliases,
                hosts: new.hosts,
            },
            (None, Some(current)) if self.have_view => RecordFile {
                written_at: now,
                ..current.clone()
            },
            (None, _) => return,
        };
        self.have_view = true;
        let bytes = file.to_json();
        let path = self.path.clone();
        let result = tokio::task::spawn_blocking(move || aether_common::fs::write_atomic(&path, &bytes, FILE_MODE))
            .await
            .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())));
        match result {
            Ok(()) => {
                self.metrics.writes.inc();
                self.metrics.generation.set(file.generation as i64);
                self.metrics.records.set(file.records.len() as i64);
                if self.current.as_ref().is_none_or(|c| c.generation != file.generation) {
                    tracing::info!(path = %self.path.display(), generation = file.generation,
                        services = file.records.len(), aliases = ?file.aliases, "mesh-dns record file written");
                }
                self.current = Some(file);
                self.written = true;
            }
            Err(error) => {
                self.metrics.write_errors.inc();
                tracing::error!(path = %self.path.display(), %error, "writing the mesh-dns record file failed; retrying");
                // Keep the new content so the retry writes it with the same generation.
                self.current = Some(file);
                self.written = false;
            }
        }
    }

    /// The gauge the services-only watch feeding [`DnsRecords::run`] keeps at 1 while up.
    pub fn connected(&self) -> Gauge {
        self.metrics.connected.clone()
    }

    /// Keeps the file current with every service's record from `views` (a services-only
    /// [`crate::catalog_watch::follow`]) until `shutdown`, re-stamping it every
    /// `restamp`, also while the registrar is away: the agent is alive and the file is
    /// its best knowledge.
    pub async fn run(mut self, mut views: watch::Receiver<Arc<WatchedCatalog>>, shutdown: CancellationToken) {
        let mut restamp = tokio::time::interval(self.restamp);
        restamp.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        restamp.reset();
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = restamp.tick() => self.write(None, true).await,
                changed = views.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    let view = views.borrow_and_update().clone();
                    let Records { services, hosts, bad } = records_of(&view.catalog);
                    self.metrics.bad_vips.set(bad as i64);
                    let aliases = aliases_of(&view.catalog, &self.mesh_domain);
                    let content = Content {
                        records: services,
                        aliases,
                        hosts,
                    };
                    self.write(Some(content), false).await;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use aether_proto::registry::v1::{MeshConfig, Service};

    const DOMAIN: &str = "aether.internal";

    /// A writer into `dir`, re-stamping every minute, for the node domain [`DOMAIN`].
    fn new_writer(dir: &Path) -> DnsRecords {
        DnsRecords::new(dir, Duration::from_secs(60), DOMAIN, DnsRecordsMetrics::default()).unwrap()
    }

    /// The record file in `dir`, parsed.
    fn written(dir: &Path) -> RecordFile {
        RecordFile::parse(&std::fs::read(path(dir)).unwrap()).unwrap()
    }

    fn content(records: &BTreeMap<(String, String), Addresses>, aliases: &[&str]) -> Option<Content> {
        Some(Content {
            records: records.clone(),
            aliases: aliases.iter().map(|a| a.to_string()).collect(),
            hosts: BTreeMap::new(),
        })
    }

    fn service(ns: &str, name: &str, vip: &str) -> Service {
        Service {
            namespace: ns.into(),
            name: name.into(),
            vip: vip.into(),
            kubernetes: None,
            external: None,
        }
    }

    #[test]
    fn external_services_hosts_answer_with_their_vip() {
        let mut catalog = CatalogView::default();
        let external = |hosts: &[&str]| aether_proto::registry::v1::External {
            hosts: hosts.iter().map(|h| h.to_string()).collect(),
            ..Default::default()
        };
        for (name, vip, hosts) in [
            ("payments", "240.240.0.9", &["api.payments.example", "Not A Host"][..]),
            ("zz-later", "240.240.0.10", &["api.payments.example"][..]),
        ] {
            let mut s = service("shop", name, vip);
            s.external = Some(Box::new(external(hosts)));
            catalog.services.insert(format!("shop/{name}"), s);
        }
        let records = records_of(&catalog);
        assert_eq!(records.services.len(), 2, "both are services too");
        // A name that is not a host is left out; a host two declare goes to the first by key.
        assert_eq!(
            records.hosts.into_iter().collect::<Vec<_>>(),
            [(
                "api.payments.example".to_owned(),
                records.services[&("shop".into(), "payments".into())]
            )]
        );
    }

    #[test]
    fn every_service_with_an_ip_vip_is_a_record() {
        let mut catalog = CatalogView::default();
        for s in [
            service("a", "web", "240.240.0.1"),
            service("b", "api", "fd00::1"),
            service("b", "broken", "not-an-ip"),
            service("b", "Upper", "240.240.0.2"),
        ] {
            catalog.services.insert(format!("{}/{}", s.namespace, s.name), s);
        }
        let Records {
            services: records, bad, ..
        } = records_of(&catalog);
        assert_eq!(bad, 2);
        assert_eq!(records.len(), 2);
        assert_eq!(
            records[&("a".into(), "web".into())].v4,
            Some("240.240.0.1".parse().unwrap())
        );
        assert_eq!(
            records[&("b".into(), "api".into())].v6,
            Some("fd00::1".parse().unwrap())
        );
    }

    fn mesh_config(namespace: &str, mesh_wide: bool, domain: &str) -> (String, Arc<MeshConfig>) {
        let config = MeshConfig {
            namespace: namespace.into(),
            name: "default".into(),
            mesh_wide,
            mesh_domain: domain.into(),
            ..Default::default()
        };
        (format!("{namespace}/default"), Arc::new(config))
    }

    #[test]
    fn the_mesh_wide_mesh_domain_is_an_alias_unless_it_is_the_nodes_own() {
        let mut catalog = CatalogView::default();
        assert_eq!(aliases_of(&catalog, DOMAIN), Vec::<String>::new());
        catalog
            .mesh_configs
            .extend([mesh_config("aether-system", true, "corp.internal")]);
        assert_eq!(aliases_of(&catalog, DOMAIN), ["corp.internal"]);
        assert_eq!(aliases_of(&catalog, "corp.internal"), Vec::<String>::new(), "its own");
        // A record a store could hold but the projector never writes: skipped.
        catalog.mesh_configs.clear();
        catalog
            .mesh_configs
            .extend([mesh_config("shop", false, "shop.internal")]);
        assert_eq!(aliases_of(&catalog, DOMAIN), Vec::<String>::new());
    }

    #[tokio::test]
    async fn a_new_alias_is_a_new_generation() {
        let dir = tempfile::tempdir().unwrap();
        let mut writer = new_writer(dir.path());
        let records = BTreeMap::new();
        writer.write(content(&records, &[]), false).await;
        writer.write(content(&records, &["corp.internal"]), false).await;
        let file = written(dir.path());
        assert_eq!((file.generation, file.aliases), (2, vec!["corp.internal".to_owned()]));
        writer.write(content(&records, &[]), false).await;
        let file = written(dir.path());
        assert_eq!((file.generation, file.aliases), (3, Vec::new()));
    }

    #[tokio::test]
    async fn writes_on_change_keeps_generation_on_restamp_and_continues_it_after_restart() {
        let dir = tempfile::tempdir().unwrap();
        let mut writer = new_writer(dir.path());
        let file = path(dir.path());
        // Nothing before a first view.
        writer.write(None, true).await;
        assert!(!file.exists());
        let mut records = BTreeMap::new();
        records.insert(
            ("a".to_owned(), "web".to_owned()),
            Addresses {
                v4: Some("240.240.0.1".parse().unwrap()),
                v6: None,
            },
        );
        writer.write(content(&records, &[]), false).await;
        let first = written(dir.path());
        assert_eq!(first.generation, 1);
        assert_eq!(first.records, records);
        let mode = std::fs::metadata(&file).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o644);
        // Same records: no write; a re-stamp keeps the generation and moves the stamp.
        tokio::time::sleep(Duration::from_millis(5)).await;
        writer.write(content(&records, &[]), false).await;
        assert_eq!(writer.metrics.writes.get(), 1);
        writer.write(None, true).await;
        let stamped = written(dir.path());
        assert_eq!(stamped.generation, 1);
        assert!(stamped.written_at > first.written_at);
        // A restarted writer writes nothing before its first view, keeps the generation
        // for the same records and continues it for new ones.
        let mut again = new_writer(dir.path());
        again.write(None, true).await;
        assert_eq!(again.metrics.writes.get(), 0);
        again.write(content(&records, &[]), false).await;
        assert_eq!(again.metrics.writes.get(), 1);
        assert_eq!(written(dir.path()).generation, 1);
        records.insert(
            ("b".to_owned(), "api".to_owned()),
            Addresses {
                v4: None,
                v6: Some("fd00::2".parse().unwrap()),
            },
        );
        again.write(content(&records, &[]), false).await;
        let changed = written(dir.path());
        assert_eq!((changed.generation, changed.records), (2, records));
    }
}
