//! How long one full xDS rebuild takes for the agent benchmark's node: 100 local pods,
//! each with 20 upstreams out of a 2,000-service / 20,000-endpoint catalog. Prints the
//! median and worst of several rebuilds, and the resource counts and bytes.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use aether_agent::pod::{ContainerPort, LocalPod, PodInfo};
use aether_agent::xds::resources::{Generated, Generator, Inputs, generate};
use aether_proto::registry::v1::{Endpoint, Locality, Port, Protocol, Service};
use aether_proto::view::CatalogView;

const SERVICES: usize = 2_000;
const PODS: usize = 100;
const UPSTREAMS: usize = 20;
/// Rebuilds timed, of each kind.
const ROUNDS: usize = 15;

fn main() {
    let catalog = full_catalog();
    let pods = local_pods();
    let deps = dependency_set(&pods);
    let scoped = scoped_to(&catalog, &deps);
    let locality = Locality {
        region: "r1".into(),
        zone: "z1".into(),
        subzone: String::new(),
    };
    let on_demand = BTreeMap::new();
    let own_only = own_only(&pods);
    let inputs = node_inputs(&pods, &scoped, &locality, &on_demand, &own_only);
    let (full, last) = time_full_rebuilds(&inputs);
    // Kept live until the RSS is read.
    let mut generator = Generator::default();
    let incremental = time_one_endpoint_changes(&mut generator, &inputs);
    let new_dependency = time_new_dependencies(&catalog, &pods);
    println!(
        "agent rebuild: {PODS} pods x {UPSTREAMS} upstreams, {} services in the dependency set",
        deps.len()
    );
    println!(
        "  one endpoint changed (memoized): median {:.2} ms, worst {:.2} ms (of {})",
        incremental[incremental.len() / 2].as_secs_f64() * 1e3,
        incremental[incremental.len() - 1].as_secs_f64() * 1e3,
        incremental.len()
    );
    println!(
        "  a pod with one new upstream (memoized): median {:.2} ms, worst {:.2} ms (of {})",
        new_dependency[new_dependency.len() / 2].as_secs_f64() * 1e3,
        new_dependency[new_dependency.len() - 1].as_secs_f64() * 1e3,
        new_dependency.len()
    );
    println!(
        "  full rebuild: median {:.1} ms, worst {:.1} ms (of {})",
        full[full.len() / 2].as_secs_f64() * 1e3,
        full[full.len() - 1].as_secs_f64() * 1e3,
        full.len()
    );
    print_rss();
    print_resources(&last);
    drop(generator);
}

/// The generator's inputs for a node of `pods` watching `catalog`.
fn node_inputs<'a>(
    pods: &'a [LocalPod],
    catalog: &'a CatalogView,
    locality: &'a Locality,
    on_demand: &'a BTreeMap<String, String>,
    own_only: &'a BTreeSet<String>,
) -> Inputs<'a> {
    Inputs {
        pods,
        catalog,
        mesh_domain: "aether.internal",
        locality,
        on_demand,
        own_only,
    }
}

/// 2,000 services of 10 endpoints each, over three zones.
fn full_catalog() -> CatalogView {
    let mut catalog = CatalogView::default();
    for s in 0..SERVICES {
        let key = format!("bench/svc-{s:04}");
        catalog.services.insert(
            key.clone(),
            Service {
                namespace: "bench".into(),
                name: format!("svc-{s:04}"),
                vip: format!("240.240.{}.{}", s / 250, s % 250 + 1),
                kubernetes: None,
                external: None,
            },
        );
        let endpoints: BTreeMap<String, Endpoint> = (0..10)
            .map(|e| {
                let address = format!("10.{}.{}.{}", s / 250, s % 250, e + 1);
                (address.clone(), catalog_endpoint(&key, address, e))
            })
            .collect();
        catalog.endpoints.insert(key, std::sync::Arc::new(endpoints));
    }
    catalog
}

/// Endpoint `e` of `service`, at `address`.
fn catalog_endpoint(service: &str, address: String, e: usize) -> Endpoint {
    Endpoint {
        service: service.into(),
        address,
        ports: vec![Port {
            name: "http".into(),
            port: 8080,
            protocol: Protocol::Http as i32,
        }],
        locality: Some(Locality {
            region: "r1".into(),
            zone: format!("z{}", e % 3),
            subzone: String::new(),
        }),
        weight: 1,
        health: 1,
        ..Default::default()
    }
}

/// 100 pods, each with 20 upstreams spread over the catalog.
fn local_pods() -> Vec<LocalPod> {
    (0..PODS)
        .map(|p| {
            let upstreams: Vec<String> = (0..UPSTREAMS)
                .map(|u| format!("svc-{:04}", (p * 37 + u * 101) % SERVICES))
                .collect();
            LocalPod {
                container_id: format!("c{p}"),
                listener_sockets: Default::default(),
                netns: format!("/run/aether/netns/pod-{p}").into(),
                ips: vec![format!("10.250.{}.{}", p / 250, p % 250 + 1).parse().unwrap()],
                info: PodInfo {
                    namespace: "bench".into(),
                    name: format!("pod-{p}"),
                    service_account: format!("svc-{:04}", p),
                    annotations: BTreeMap::from([("config.aether.io/upstreams".into(), upstreams.join(","))]),
                    ports: vec![ContainerPort {
                        name: "http".into(),
                        port: 8080,
                        protocol: "TCP".into(),
                    }],
                    ..Default::default()
                },
            }
        })
        .collect()
}

/// The services the node's pods are or depend on.
fn dependency_set(pods: &[LocalPod]) -> BTreeSet<String> {
    let mut deps = BTreeSet::new();
    for pod in pods {
        deps.insert(pod.info.service());
        deps.extend(pod.info.upstreams().services);
    }
    deps
}

/// The pods' own services no pod calls (the node serves them no cluster until asked).
fn own_only(pods: &[LocalPod]) -> BTreeSet<String> {
    let called: BTreeSet<String> = pods.iter().flat_map(|p| p.info.upstreams().services).collect();
    let own = pods.iter().map(|p| p.info.service());
    own.filter(|s| !called.contains(s)).collect()
}

/// The catalog slice the node watches: its dependency set.
fn scoped_to(catalog: &CatalogView, deps: &BTreeSet<String>) -> CatalogView {
    catalog.restricted(|k| deps.contains(k))
}

/// Full rebuilds, sorted, and the last one's output.
fn time_full_rebuilds(inputs: &Inputs) -> (Vec<Duration>, Generated) {
    let mut times: Vec<Duration> = Vec::new();
    let mut last = BTreeMap::new();
    for _ in 0..ROUNDS {
        let started = Instant::now();
        last = generate(inputs);
        times.push(started.elapsed());
    }
    times.sort();
    (times, last)
}

/// One endpoint changes per round: the memoizing generator rebuilds only that service. Sorted.
fn time_one_endpoint_changes(generator: &mut Generator, inputs: &Inputs) -> Vec<Duration> {
    generator.generate(inputs);
    let mut incremental: Vec<Duration> = Vec::new();
    let mut changing = inputs.catalog.clone();
    for i in 0..ROUNDS {
        let key = changing.endpoints.keys().nth(i * 7).unwrap().clone();
        let endpoints = std::sync::Arc::make_mut(changing.endpoints.get_mut(&key).unwrap());
        let mut endpoint = endpoints.values().next().unwrap().clone();
        endpoint.address = format!("10.99.0.{}", i + 1);
        endpoints.insert(endpoint.address.clone(), endpoint);
        let changed = Inputs {
            catalog: &changing,
            ..*inputs
        };
        let started = Instant::now();
        generator.generate(&changed);
        incremental.push(started.elapsed());
    }
    incremental.sort();
    incremental
}

/// One pod joins per round, depending on a service the node did not yet: the memoizing
/// generator builds that service and the pod's resources. Sorted.
fn time_new_dependencies(catalog: &CatalogView, pods: &[LocalPod]) -> Vec<Duration> {
    let locality = Locality::default();
    let on_demand = BTreeMap::new();
    let mut pods = pods.to_vec();
    let mut generator = Generator::default();
    let mut times = Vec::new();
    for round in 0..=ROUNDS {
        let deps = dependency_set(&pods);
        let scoped = scoped_to(catalog, &deps);
        let own_only = own_only(&pods);
        let inputs = node_inputs(&pods, &scoped, &locality, &on_demand, &own_only);
        let started = Instant::now();
        generator.generate(&inputs);
        // The first round builds the whole node.
        if round > 0 {
            times.push(started.elapsed());
        }
        let new = (0..SERVICES)
            .map(|s| format!("svc-{s:04}"))
            .find(|name| !deps.contains(&format!("bench/{name}")))
            .expect("a service outside the dependency set");
        let mut pod = pods[0].clone();
        pod.container_id = format!("joiner-{round}");
        pod.info.name = format!("joiner-{round}");
        pod.info.annotations.insert("config.aether.io/upstreams".into(), new);
        pods.push(pod);
    }
    times.sort();
    times
}

fn print_rss() {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
            / 1024.0
    };
    println!(
        "  process RSS with catalog, memo and last output live: {:.1} MiB (peak {:.1} MiB)",
        field("VmRSS:"),
        field("VmHWM:")
    );
}

fn print_resources(resources: &Generated) {
    for (type_url, resources) in resources {
        let bytes: usize = resources.iter().map(|r| r.body.value.len()).sum();
        println!(
            "  {:<20} {:>6} resources {:>10} bytes",
            type_url.rsplit('.').next().unwrap_or(type_url),
            resources.len(),
            bytes
        );
    }
}
