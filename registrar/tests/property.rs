//! Property: under any interleaving of registrations, unregistrations, route set
//! changes, filter changes and reconnects, every consistent point of every watcher's view equals the catalog
//! at that version, filtered by the filter the view says it reflects; and at the end
//! every view equals the registrar's catalog.
//!
//! The test keeps its own model of the catalog, one copy per version (ops run one at
//! a time, so each changing op is one version), which also checks that the registrar
//! advances the version exactly when the catalog changes.

mod support;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use aether_proto::registrar::v1::registrar_client::RegistrarClient;
use aether_proto::registrar::v1::{
    RegisterEndpointRequest, RegisterEndpointResponse, UnregisterEndpointRequest, WatchRequest, watch_response,
};
use aether_proto::registry::v1::{Endpoint, Health, Route, RouteKind, RouteParent};
use aether_proto::view::{CatalogView, route_key};
use aether_registrar::catalog::Catalog;
use clap::Parser;
use proptest::prelude::*;
use support::{Watcher, catalog, endpoint};
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

const SERVICES: [&str; 4] = ["a/x", "a/y", "b/x", "c/z"];
const ADDRESSES: [&str; 4] = ["10.9.0.1", "10.9.0.2", "10.9.0.3", "fd00::9"];
const WATCHERS: usize = 3;

/// None is the wildcard; Some(set) names services by index into SERVICES.
type Spec = Option<BTreeSet<usize>>;

#[derive(Clone, Debug)]
enum Op {
    Register {
        service: usize,
        address: usize,
        port: u32,
        draining: bool,
    },
    Unregister {
        service: usize,
        address: usize,
    },
    Filter {
        watcher: usize,
        spec: Spec,
    },
    Reconnect {
        watcher: usize,
    },
    Read {
        watcher: usize,
    },
    /// A route source's whole set: route `r<i>` (namespace `a`) with these parents.
    Routes(Vec<(usize, BTreeSet<usize>)>),
    /// New endpoints registered concurrently while `watcher` changes its filter, so
    /// writes are group-committed and batches race the filter change.
    Burst {
        services: Vec<usize>,
        watcher: usize,
        spec: Spec,
    },
}

fn spec() -> impl Strategy<Value = Spec> {
    prop_oneof![
        1 => Just(None),
        4 => proptest::collection::btree_set(0..SERVICES.len(), 0..=SERVICES.len()).prop_map(Some),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (0..SERVICES.len(), 0..ADDRESSES.len(), 80..82u32, any::<bool>())
            .prop_map(|(service, address, port, draining)| Op::Register { service, address, port, draining }),
        3 => (0..SERVICES.len(), 0..ADDRESSES.len()).prop_map(|(service, address)| Op::Unregister { service, address }),
        2 => (0..WATCHERS, spec()).prop_map(|(watcher, spec)| Op::Filter { watcher, spec }),
        1 => (0..WATCHERS).prop_map(|watcher| Op::Reconnect { watcher }),
        3 => (0..WATCHERS).prop_map(|watcher| Op::Read { watcher }),
        2 => (proptest::collection::vec(0..SERVICES.len(), 1..24), 0..WATCHERS, spec())
            .prop_map(|(services, watcher, spec)| Op::Burst { services, watcher, spec }),
        2 => proptest::collection::vec(
            (0..3usize, proptest::collection::btree_set(0..SERVICES.len(), 1..=2)),
            0..3
        )
        .prop_map(Op::Routes),
    ]
}

/// Route `r<i>` of namespace `a` with `parents` (indexes into SERVICES).
fn route(i: usize, parents: &BTreeSet<usize>) -> Route {
    Route {
        kind: RouteKind::Http as i32,
        namespace: "a".into(),
        name: format!("r{i}"),
        parents: parents
            .iter()
            .map(|&p| RouteParent {
                service: SERVICES[p].into(),
                port: 0,
            })
            .collect(),
        ..Default::default()
    }
}

fn request(spec: &Spec, id: u64) -> WatchRequest {
    match spec {
        None => WatchRequest {
            wildcard: true,
            filter_id: id,
            ..Default::default()
        },
        Some(set) => WatchRequest {
            services: set.iter().map(|&i| SERVICES[i].to_string()).collect(),
            filter_id: id,
            ..Default::default()
        },
    }
}

fn filtered(catalog: &CatalogView, spec: &Spec) -> CatalogView {
    catalog.restricted(|key| spec.as_ref().is_none_or(|set| set.iter().any(|&i| SERVICES[i] == key)))
}

struct Client {
    watcher: Watcher,
    filters: HashMap<u64, Spec>,
    current: u64,
}

struct Case {
    client: RegistrarClient<Channel>,
    catalog: Catalog,
    /// The catalog at each version, as the test's own model says it must be.
    history: HashMap<u64, CatalogView>,
    model: CatalogView,
    seq: u64,
    clients: Vec<Client>,
    /// Bursts use fresh addresses, so their writes always change the catalog.
    next_address: u32,
}

impl Case {
    /// Checks a watcher's view against the model whenever the view is consistent.
    fn check(
        client: &Client,
        message: &aether_proto::registrar::v1::WatchResponse,
        history: &HashMap<u64, CatalogView>,
    ) {
        let consistent = matches!(
            message.event,
            Some(watch_response::Event::Delta(_) | watch_response::Event::SnapshotComplete(_))
        );
        if !consistent {
            return;
        }
        let view = &client.watcher.view;
        let seq = view.version.as_ref().expect("a consistent view has a version").seq;
        let spec = &client.filters[&view.filter_id];
        let expected = filtered(&history[&seq], spec);
        assert_eq!(
            view.catalog, expected,
            "view at version {seq} under filter {spec:?} is wrong"
        );
    }

    fn drain(&mut self, watcher: usize) {
        let client = &mut self.clients[watcher];
        while let Some(message) = client.watcher.try_next() {
            Self::check(client, &message, &self.history);
        }
    }

    fn record(&mut self, seq: u64, changed: bool) {
        let expected = if changed { self.seq + 1 } else { self.seq };
        assert_eq!(
            seq, expected,
            "the version must advance exactly when the catalog changes"
        );
        self.seq = seq;
        self.history.insert(seq, self.model.clone());
    }

    async fn apply(&mut self, op: Op) {
        match op {
            Op::Register {
                service,
                address,
                port,
                draining,
            } => self.register(service, address, port, draining).await,
            Op::Unregister { service, address } => self.unregister(service, address).await,
            Op::Routes(routes) => self.set_routes(routes).await,
            Op::Filter { watcher, spec } => self.change_filter(watcher, spec).await,
            Op::Reconnect { watcher } => self.reconnect(watcher).await,
            Op::Read { watcher } => self.drain(watcher),
            Op::Burst {
                services,
                watcher,
                spec,
            } => self.burst(services, watcher, spec).await,
        }
    }

    async fn register(&mut self, service: usize, address: usize, port: u32, draining: bool) {
        let mut e: Endpoint = endpoint(SERVICES[service], ADDRESSES[address], port);
        e.weight = 1;
        e.health = if draining { Health::Draining } else { Health::Healthy } as i32;
        let reply = self
            .client
            .register_endpoint(RegisterEndpointRequest {
                endpoint: Some(e.clone()),
            })
            .await
            .expect("register")
            .into_inner();
        let key = SERVICES[service].to_string();
        let endpoints = Arc::make_mut(self.model.endpoints.entry(key.clone()).or_default());
        let changed = endpoints.get(&e.address) != Some(&e);
        endpoints.insert(e.address.clone(), e);
        let new_service = !self.model.services.contains_key(&key);
        self.model.services.insert(key, reply.service.unwrap());
        self.record(reply.version.unwrap().seq, changed || new_service);
    }

    async fn unregister(&mut self, service: usize, address: usize) {
        let reply = self
            .client
            .unregister_endpoint(UnregisterEndpointRequest {
                service: SERVICES[service].into(),
                address: ADDRESSES[address].into(),
            })
            .await
            .expect("unregister")
            .into_inner();
        let had = self
            .model
            .endpoints
            .get_mut(SERVICES[service])
            .and_then(|e| Arc::make_mut(e).remove(ADDRESSES[address]))
            .is_some();
        assert_eq!(reply.existed, had);
        self.record(reply.version.unwrap().seq, had);
    }

    async fn set_routes(&mut self, routes: Vec<(usize, BTreeSet<usize>)>) {
        let desired: BTreeMap<String, Route> = routes
            .iter()
            .map(|(i, parents)| route(*i, parents))
            .map(|r| (route_key(&r), r))
            .collect();
        let version = self.catalog.set_records(desired.clone()).await.expect("set routes");
        let wanted: BTreeMap<String, Arc<Route>> = desired.into_iter().map(|(k, r)| (k, Arc::new(r))).collect();
        let changed = self.model.routes != wanted;
        self.model.routes = wanted;
        self.record(version.seq, changed);
    }

    async fn change_filter(&mut self, watcher: usize, spec: Spec) {
        let client = &mut self.clients[watcher];
        client.current += 1;
        client.filters.insert(client.current, spec.clone());
        client.watcher.send(request(&spec, client.current)).await;
    }

    async fn reconnect(&mut self, watcher: usize) {
        let client = &mut self.clients[watcher];
        let id = client.current;
        let first = WatchRequest {
            resume_from: client.watcher.view.resume_from(id),
            ..request(&client.filters[&id], id)
        };
        let mut fresh = Watcher::open(&mut self.client, first).await;
        fresh.view = std::mem::take(&mut client.watcher.view);
        client.watcher = fresh;
    }

    /// New endpoints of `services` registered concurrently with a filter change of `watcher`.
    async fn burst(&mut self, services: Vec<usize>, watcher: usize, spec: Spec) {
        let endpoints: Vec<Endpoint> = services
            .iter()
            .map(|&service| {
                self.next_address += 1;
                let n = self.next_address;
                let mut e = endpoint(SERVICES[service], &format!("10.8.{}.{}", n / 200, n % 200 + 1), 80);
                e.weight = 1;
                e.health = Health::Healthy as i32;
                e
            })
            .collect();
        let registers = endpoints.iter().map(|e| {
            let mut client = self.client.clone();
            let e = e.clone();
            async move {
                client
                    .register_endpoint(RegisterEndpointRequest { endpoint: Some(e) })
                    .await
                    .expect("register")
                    .into_inner()
            }
        });
        let client = &mut self.clients[watcher];
        client.current += 1;
        client.filters.insert(client.current, spec.clone());
        let filter_change = client.watcher.send(request(&spec, client.current));
        let (replies, ()) = futures::join!(futures::future::join_all(registers), filter_change);
        self.record_burst(&endpoints, &replies);
    }

    /// The state at each version is the base plus every write committed by then.
    fn record_burst(&mut self, endpoints: &[Endpoint], replies: &[RegisterEndpointResponse]) {
        let versions: Vec<u64> = replies.iter().map(|r| r.version.as_ref().unwrap().seq).collect();
        let last = *versions.iter().max().unwrap();
        assert!(versions.iter().all(|&v| v > self.seq));
        let base = self.model.clone();
        for seq in self.seq + 1..=last {
            let mut state = base.clone();
            for ((e, reply), &v) in endpoints.iter().zip(replies).zip(&versions) {
                if v <= seq {
                    state.services.insert(e.service.clone(), reply.service.clone().unwrap());
                    Arc::make_mut(state.endpoints.entry(e.service.clone()).or_default())
                        .insert(e.address.clone(), e.clone());
                }
            }
            self.history.insert(seq, state);
        }
        self.model = self.history[&last].clone();
        self.seq = last;
    }

    /// Brings every watcher to the latest version under its latest filter.
    async fn settle(&mut self) {
        let (mut actual, version) = catalog(&mut self.client, |_| true).await;
        // List does not carry routes; the catalog's own state does.
        let routes = self
            .catalog
            .read()
            .records::<Route>()
            .map(|r| (route_key(r), r.clone()))
            .collect();
        actual.routes = routes;
        assert_eq!(actual, self.model, "the registrar's catalog differs from the model");
        assert_eq!(version.seq, self.seq);
        for client in &mut self.clients {
            client.current += 1;
            let spec = client.filters[&(client.current - 1)].clone();
            client.filters.insert(client.current, spec.clone());
            client.watcher.send(request(&spec, client.current)).await;
            loop {
                let message = client.watcher.next().await;
                Self::check(client, &message, &self.history);
                let view = &client.watcher.view;
                if view.filter_id == client.current && view.version.as_ref().is_some_and(|v| v.seq >= self.seq) {
                    break;
                }
            }
            assert_eq!(client.watcher.view.catalog, filtered(&actual, &spec));
        }
    }
}

async fn run(filters: Vec<Spec>, ops: Vec<Op>) {
    let dir = tempfile::tempdir().unwrap();
    let config = aether_registrar::Config::parse_from([
        "aether-registrar",
        "--insecure",
        "--listen",
        "127.0.0.1:0",
        "--admin",
        "127.0.0.1:0",
        "--data-dir",
        dir.path().to_str().unwrap(),
    ]);
    let shutdown = CancellationToken::new();
    let running = aether_registrar::start(config, shutdown.clone()).await.expect("start");
    let mut client = RegistrarClient::connect(format!("http://{}", running.grpc_addr))
        .await
        .unwrap();
    let mut clients = Vec::new();
    for spec in filters {
        let watcher = Watcher::open(&mut client, request(&spec, 1)).await;
        clients.push(Client {
            watcher,
            filters: HashMap::from([(1, spec)]),
            current: 1,
        });
    }
    let mut case = Case {
        client,
        catalog: running.catalog.clone(),
        history: HashMap::from([(0, CatalogView::default())]),
        model: CatalogView::default(),
        seq: 0,
        clients,
        next_address: 0,
    };
    for op in ops {
        case.apply(op).await;
    }
    case.settle().await;
    drop(case);
    shutdown.cancel();
    running.wait().await.expect("a clean stop");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn every_watcher_view_equals_the_filtered_catalog(
        filters in proptest::collection::vec(spec(), WATCHERS),
        ops in proptest::collection::vec(op(), 1..60),
    ) {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(run(filters, ops));
    }
}
