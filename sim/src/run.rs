//! One simulated cluster of N agents, start to end: etcd and two registrar
//! replicas, the agents connecting, registering and syncing, churn, and the death of
//! a replica; what each phase cost.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use aether_proto::registrar::v1::{ListEndpointsRequest, ListServicesRequest};
use aether_proto::view::CatalogView;
use futures::StreamExt;
use tokio::sync::mpsc;

use crate::churn::{self, Churn, Driven};
use crate::cluster::{Etcd, Replica, StartError, Usage};
use crate::fleet::{AgentError, Fleet, Progress};
use crate::ledger::Outcome;
use crate::model::{Model, Shape, service_key};
use crate::pki::Pki;

/// How long the run waits for every agent to sync, recover or see a change.
const PHASE_TIMEOUT: Duration = Duration::from_secs(600);

#[derive(Clone, Debug)]
pub struct Config {
    pub shape: Shape,
    pub churn: Churn,
    pub registrar_bin: PathBuf,
    pub etcd_bin: PathBuf,
    /// Keep every agent's view and check it against the registrar's catalog.
    pub check_views: bool,
    /// A moved agent says what its view holds, so the survivor sends only what differs
    /// (off: every moved agent gets a snapshot, as before holdings existed).
    pub holdings: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Start(#[from] StartError),
    #[error(transparent)]
    Agent(#[from] AgentError),
    #[error("{what}: {done} of {expected} agents after {PHASE_TIMEOUT:?}")]
    Timeout {
        what: &'static str,
        done: usize,
        expected: usize,
    },
    #[error("listing the catalog: {0}")]
    List(#[from] tonic::Status),
}

/// What one run measured.
#[derive(Debug, Default)]
pub struct Figures {
    pub agents: usize,
    pub services: usize,
    pub pods: usize,
    /// Mean services per agent's filter.
    pub filter_services: f64,
    pub connect: Duration,
    pub connect_retries: usize,
    pub load: Duration,
    pub initial_sync: Duration,
    /// Until half the agents had their snapshot.
    pub initial_sync_p50: Duration,
    /// Mean size of an agent's initial snapshot (its full state) on the wire.
    pub full_state_bytes: f64,
    pub driven: Driven,
    pub outcome: Outcome,
    /// Registrar CPU seconds per second of churn, both replicas.
    pub churn_cpu: f64,
    pub etcd_requests_per_s_load: f64,
    pub etcd_requests_per_s_churn: f64,
    /// Both replicas' RSS: before agents, with agents connected, after sync.
    pub rss: [[f64; 2]; 3],
    pub rss_after_load: [f64; 2],
    /// Both replicas' RSS once churn is over (tens of seconds after the sync).
    pub rss_after_churn: [f64; 2],
    /// CPU seconds of the initial sync: both registrars, and this simulator (the agents).
    pub sync_cpu: (f64, f64),
    pub storm: Storm,
    /// Streams that broke before the replica was killed (e.g. HTTP/2 keepalive
    /// timeouts while snapshots queue behind each other), and the snapshots and
    /// resumes that followed.
    pub broken_before_kill: usize,
    /// Why streams broke, before and after the kill.
    pub breaks: std::collections::BTreeMap<String, usize>,
    /// Agents whose view differed from the catalog at the end (with `check_views`).
    pub mismatched_views: Option<Vec<String>>,
}

/// The reconnect storm after a replica died.
#[derive(Debug, Default)]
pub struct Storm {
    pub moved: usize,
    pub resumed: usize,
    pub resynced: usize,
    /// What a moved agent received to be current again, mean bytes on the wire: the
    /// reconciling Delta, or the snapshot.
    pub moved_bytes: f64,
    /// What a moved agent sent to say what it holds (`held`), mean bytes.
    pub held_bytes: f64,
    /// Until every moved agent was current again.
    pub recovered: Duration,
    /// Until half of them were.
    pub recovered_p50: Duration,
    /// The surviving replica's RSS with every agent on it, and its CPU seconds in the storm.
    pub survivor_rss: f64,
    pub survivor_cpu: f64,
    /// The simulator's (the agents') CPU seconds in the storm.
    pub agents_cpu: f64,
}

/// The cluster of a run.
struct Cluster {
    _dir: tempfile::TempDir,
    etcd: Etcd,
    replicas: [Replica; 2],
}

impl Cluster {
    async fn start(config: &Config, pki: &Pki) -> Result<Cluster, StartError> {
        let dir = tempfile::tempdir()?;
        let etcd = Etcd::start(&config.etcd_bin, dir.path()).await?;
        let a = Replica::start(&config.registrar_bin, pki, &etcd, dir.path(), "replica-a").await?;
        let b = Replica::start(&config.registrar_bin, pki, &etcd, dir.path(), "replica-b").await?;
        Ok(Cluster {
            _dir: dir,
            etcd,
            replicas: [a, b],
        })
    }

    fn usage(&self) -> [Usage; 2] {
        [self.replicas[0].usage(), self.replicas[1].usage()]
    }
}

fn rss(usage: [Usage; 2]) -> [f64; 2] {
    [usage[0].rss_mib, usage[1].rss_mib]
}

/// This process's CPU seconds: the simulated agents' share of the machine.
fn own_cpu() -> f64 {
    Usage::of(std::process::id()).cpu_seconds
}

fn cpu(usage: [Usage; 2]) -> f64 {
    usage[0].cpu_seconds + usage[1].cpu_seconds
}

/// Runs one simulated cluster of `config.shape.nodes` agents.
pub async fn run(config: &Config) -> Result<Figures, RunError> {
    let mut model = Model::generate(config.shape.clone());
    let deps: Vec<BTreeSet<u32>> = (0..config.shape.nodes).map(|n| model.dependencies(n)).collect();
    let dependents = model.dependents();
    let pki = Pki::new().map_err(StartError::from)?;
    let cluster = Cluster::start(config, &pki).await?;
    let mut figures = Figures {
        agents: config.shape.nodes,
        services: config.shape.services,
        pods: model.alive_pods(),
        filter_services: deps.iter().map(BTreeSet::len).sum::<usize>() as f64 / deps.len().max(1) as f64,
        ..Default::default()
    };
    let tls = (0..config.shape.nodes)
        .map(|n| pki.agent_tls(&format!("node-{n}")))
        .collect();
    let urls = [cluster.replicas[0].url.clone(), cluster.replicas[1].url.clone()];
    let (fleet, mut progress) = Fleet::new(urls, tls, config.check_views, config.holdings);
    let fleet = Arc::new(fleet);
    figures.rss[0] = rss(cluster.usage());

    connect_and_load(&fleet, &model, &cluster, &mut figures).await?;
    let watchers = sync(&fleet, &deps, &mut progress, &cluster, &mut figures).await?;

    let (before, etcd_before) = (cluster.usage(), cluster.etcd.requests().await);
    figures.driven = churn::drive(&fleet, &mut model, &dependents, &config.churn, config.shape.seed).await;
    let settle = Instant::now();
    while fleet.ledger.pending() > 0 && settle.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let seconds = figures.driven.took.as_secs_f64();
    figures.churn_cpu = (cpu(cluster.usage()) - cpu(before)) / seconds;
    figures.etcd_requests_per_s_churn = (cluster.etcd.requests().await - etcd_before) / seconds;
    figures.outcome = fleet.ledger.take();
    figures.rss_after_churn = rss(cluster.usage());

    while let Ok(event) = progress.try_recv() {
        if let Progress::Broken { .. } = event {
            figures.broken_before_kill += 1;
        }
    }
    let mut cluster = cluster;
    figures.storm = storm(&fleet, &mut cluster, &mut progress).await?;
    if config.check_views {
        figures.mismatched_views = Some(check_views(&fleet, &deps).await?);
    }
    for watcher in watchers {
        watcher.abort();
    }
    figures.breaks = std::mem::take(&mut *fleet.breaks.lock());
    Ok(figures)
}

/// Every agent connects, then registers its pods (all at once, as after a cluster start).
async fn connect_and_load(
    fleet: &Arc<Fleet>,
    model: &Model,
    cluster: &Cluster,
    figures: &mut Figures,
) -> Result<(), RunError> {
    let nodes = figures.agents as u32;
    let started = Instant::now();
    let retries = futures::stream::iter(0..nodes)
        .map(|n| fleet.connect(n))
        .buffer_unordered(nodes as usize)
        .collect::<Vec<_>>()
        .await;
    for r in retries {
        figures.connect_retries += r?;
    }
    figures.connect = started.elapsed();
    figures.rss[1] = rss(cluster.usage());

    let etcd_before = cluster.etcd.requests().await;
    let started = Instant::now();
    let loads = futures::stream::iter(0..nodes)
        .map(|n| {
            let pods = model.by_node[n as usize].iter().map(|&p| model.endpoint(p)).collect();
            fleet.register(n, pods)
        })
        .buffer_unordered(nodes as usize)
        .collect::<Vec<_>>()
        .await;
    for load in loads {
        load?;
    }
    figures.load = started.elapsed();
    figures.etcd_requests_per_s_load = (cluster.etcd.requests().await - etcd_before) / figures.load.as_secs_f64();
    figures.rss_after_load = rss(cluster.usage());
    Ok(())
}

/// Every agent opens its Watch; returns when all have their snapshot.
async fn sync(
    fleet: &Arc<Fleet>,
    deps: &[BTreeSet<u32>],
    progress: &mut mpsc::UnboundedReceiver<Progress>,
    cluster: &Cluster,
    figures: &mut Figures,
) -> Result<Vec<tokio::task::JoinHandle<Result<(), AgentError>>>, RunError> {
    let (started, cpu_before, own_before) = (Instant::now(), cpu(cluster.usage()), own_cpu());
    let watchers = deps
        .iter()
        .enumerate()
        .map(|(n, d)| {
            let services = d.iter().map(|&s| service_key(s)).collect();
            tokio::spawn(fleet.clone().follow(n as u32, services))
        })
        .collect();
    let (mut synced, mut bytes) = (Vec::with_capacity(deps.len()), 0usize);
    while synced.len() < deps.len() {
        match tokio::time::timeout(PHASE_TIMEOUT, progress.recv()).await {
            Ok(Some(Progress::Synced { bytes: b, at, .. })) => {
                synced.push(at.saturating_duration_since(started));
                bytes += b;
            }
            Ok(Some(Progress::Resumed { .. })) => {}
            Ok(Some(Progress::Broken { .. })) => figures.broken_before_kill += 1,
            _ => {
                return Err(RunError::Timeout {
                    what: "initial sync",
                    done: synced.len(),
                    expected: deps.len(),
                });
            }
        }
    }
    figures.initial_sync = started.elapsed();
    synced.sort();
    figures.initial_sync_p50 = crate::stats::percentile(&synced, 0.5);
    figures.sync_cpu = (cpu(cluster.usage()) - cpu_before, own_cpu() - own_before);
    figures.full_state_bytes = bytes as f64 / deps.len().max(1) as f64;
    tokio::time::sleep(Duration::from_secs(2)).await;
    figures.rss[2] = rss(cluster.usage());
    Ok(watchers)
}

/// Kills replica B; every agent on it moves to A. Returns when all are current again.
async fn storm(
    fleet: &Arc<Fleet>,
    cluster: &mut Cluster,
    progress: &mut mpsc::UnboundedReceiver<Progress>,
) -> Result<Storm, RunError> {
    let moved = (0..fleet.links.len()).filter(|n| n % 2 == 1).count();
    let (survivor_before, own_before) = (cluster.replicas[0].usage(), own_cpu());
    fleet.mark_dead(1);
    let killed = Instant::now();
    cluster.replicas[1].kill();
    let mut storm = Storm {
        moved,
        ..Default::default()
    };
    let mut times = Vec::with_capacity(moved);
    let (mut moved_bytes, mut held_bytes) = (0, 0);
    while storm.resumed + storm.resynced < moved {
        let at = match tokio::time::timeout(PHASE_TIMEOUT, progress.recv()).await {
            // Only the agents of the killed replica count (node n is on replica n % 2).
            Ok(Some(Progress::Synced { node, .. } | Progress::Resumed { node, .. } | Progress::Broken { node }))
                if node % 2 == 0 =>
            {
                continue;
            }
            Ok(Some(Progress::Broken { .. })) => continue,
            Ok(Some(Progress::Synced { at, bytes, .. })) => {
                storm.resynced += 1;
                moved_bytes += bytes;
                at
            }
            Ok(Some(Progress::Resumed { at, bytes, held, .. })) => {
                storm.resumed += 1;
                moved_bytes += bytes;
                held_bytes += held;
                at
            }
            _ => {
                return Err(RunError::Timeout {
                    what: "recovery after a replica died",
                    done: storm.resumed + storm.resynced,
                    expected: moved,
                });
            }
        };
        times.push(at.saturating_duration_since(killed));
    }
    times.sort();
    storm.moved_bytes = moved_bytes as f64 / moved.max(1) as f64;
    storm.held_bytes = held_bytes as f64 / moved.max(1) as f64;
    storm.recovered = times.last().copied().unwrap_or_default();
    storm.recovered_p50 = crate::stats::percentile(&times, 0.5);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let survivor = cluster.replicas[0].usage();
    storm.survivor_rss = survivor.rss_mib;
    storm.survivor_cpu = survivor.cpu_seconds - survivor_before.cpu_seconds;
    storm.agents_cpu = own_cpu() - own_before;
    Ok(storm)
}

/// The registrar's catalog (from the surviving replica, as agent 0 may List).
async fn listed(fleet: &Fleet) -> Result<CatalogView, RunError> {
    let mut client = fleet.links[0].client();
    let services = client
        .list_services(ListServicesRequest {})
        .await?
        .into_inner()
        .services;
    let mut catalog = CatalogView::default();
    for service in services {
        let key = format!("{}/{}", service.namespace, service.name);
        let request = ListEndpointsRequest { service: key.clone() };
        let endpoints = client.list_endpoints(request).await?.into_inner().endpoints;
        let endpoints = endpoints.into_iter().map(|e| (e.address.clone(), e)).collect();
        catalog.endpoints.insert(key.clone(), Arc::new(endpoints));
        catalog.services.insert(key, service);
    }
    Ok(catalog)
}

/// The agents whose view is not exactly the catalog restricted to their filter
/// (re-checked for up to 10 s, so changes still on the wire can land).
async fn check_views(fleet: &Fleet, deps: &[BTreeSet<u32>]) -> Result<Vec<String>, RunError> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let catalog = listed(fleet).await?;
        let mut mismatched = Vec::new();
        for (node, deps) in deps.iter().enumerate() {
            let keys: BTreeSet<String> = deps.iter().map(|&s| service_key(s)).collect();
            let mut expected = catalog.clone();
            expected.services.retain(|k, _| keys.contains(k));
            expected.endpoints.retain(|k, _| keys.contains(k));
            let view = fleet.links[node].view.lock();
            let actual = view.as_ref().map(|v| &v.catalog);
            if actual != Some(&expected) {
                mismatched.push(format!("node-{node}"));
            }
        }
        if mismatched.is_empty() || Instant::now() > deadline {
            return Ok(mismatched);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
