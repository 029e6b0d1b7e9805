//! The simulated cluster: services ranked by popularity (Zipf-like), one workload per
//! service with 10–20 upstreams drawn by that popularity, pods placed on nodes, and
//! what each node's agent depends on. Everything follows from the seed.

use std::collections::BTreeSet;
use std::net::Ipv4Addr;
use std::ops::RangeInclusive;

use aether_proto::registry::v1::{Endpoint, Health, Locality, PodInfo, Port, Protocol};

/// The knobs of a generated cluster.
#[derive(Clone, Debug)]
pub struct Shape {
    pub seed: u64,
    pub nodes: usize,
    pub services: usize,
    pub pods_per_node: RangeInclusive<usize>,
    pub upstreams: RangeInclusive<usize>,
    /// Zipf exponent of how often a service is someone's upstream.
    pub upstream_skew: f64,
    /// Zipf exponent of how many replicas a service runs.
    pub replica_skew: f64,
}

/// SplitMix64: small, seedable and good enough to draw a workload.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }

    pub fn within(&mut self, range: &RangeInclusive<usize>) -> usize {
        range.start() + self.below(range.end() - range.start() + 1)
    }
}

/// Ranks 0..n drawn with weight 1 / (rank + 1)^skew.
#[derive(Clone, Debug)]
pub struct Zipf {
    cumulative: Vec<f64>,
}

impl Zipf {
    pub fn new(n: usize, skew: f64) -> Self {
        let mut total = 0.0;
        let cumulative = (0..n)
            .map(|rank| {
                total += 1.0 / ((rank + 1) as f64).powf(skew);
                total
            })
            .collect();
        Self { cumulative }
    }

    pub fn sample(&self, rng: &mut Rng) -> usize {
        let target = rng.unit() * self.cumulative.last().copied().unwrap_or(0.0);
        self.cumulative
            .partition_point(|&c| c <= target)
            .min(self.cumulative.len() - 1)
    }
}

#[derive(Clone, Debug)]
pub struct Pod {
    pub service: u32,
    pub node: u32,
    pub address: Ipv4Addr,
    pub ready: bool,
    pub alive: bool,
}

/// A generated cluster; churn changes its pods.
#[derive(Clone, Debug)]
pub struct Model {
    pub shape: Shape,
    /// The upstreams of service `s`'s workload, at `s`.
    pub upstreams: Vec<Vec<u32>>,
    /// Every pod ever created (removed ones stay, `alive: false`), by id.
    pub pods: Vec<Pod>,
    /// The pods placed on node `n`, at `n`.
    pub by_node: Vec<Vec<u32>>,
}

impl Model {
    pub fn generate(shape: Shape) -> Model {
        let mut rng = Rng::new(shape.seed);
        let popularity = Zipf::new(shape.services, shape.upstream_skew);
        let upstreams = (0..shape.services)
            .map(|s| draw_upstreams(&mut rng, &popularity, s, &shape))
            .collect();
        let replicas = Zipf::new(shape.services, shape.replica_skew);
        let mut model = Model {
            upstreams,
            pods: Vec::new(),
            by_node: vec![Vec::new(); shape.nodes],
            shape,
        };
        for node in 0..model.shape.nodes {
            for _ in 0..rng.within(&model.shape.pods_per_node) {
                model.add_pod(node as u32, replicas.sample(&mut rng) as u32);
            }
        }
        model
    }

    /// Places a new (ready) pod of `service` on `node`, with the next free address.
    pub fn add_pod(&mut self, node: u32, service: u32) -> u32 {
        let id = self.pods.len() as u32;
        self.pods.push(Pod {
            service,
            node,
            address: pod_address(id),
            ready: true,
            alive: true,
        });
        self.by_node[node as usize].push(id);
        id
    }

    /// The services node `n`'s agent watches: its pods' own services and their
    /// workloads' upstreams (proposals/000, demand scoping).
    pub fn dependencies(&self, node: usize) -> BTreeSet<u32> {
        let mut deps = BTreeSet::new();
        for &pod in &self.by_node[node] {
            let service = self.pods[pod as usize].service;
            deps.insert(service);
            deps.extend(&self.upstreams[service as usize]);
        }
        deps
    }

    /// How many nodes depend on each service, by service.
    pub fn dependents(&self) -> Vec<u32> {
        let mut counts = vec![0u32; self.shape.services];
        for node in 0..self.shape.nodes {
            for s in self.dependencies(node) {
                counts[s as usize] += 1;
            }
        }
        counts
    }

    pub fn alive_pods(&self) -> usize {
        self.pods.iter().filter(|p| p.alive).count()
    }

    /// The endpoint pod `id`'s agent registers.
    pub fn endpoint(&self, id: u32) -> Endpoint {
        let pod = &self.pods[id as usize];
        let key = service_key(pod.service);
        let (namespace, name) = key.split_once('/').expect("a service key");
        Endpoint {
            service: key.clone(),
            address: pod.address.to_string(),
            ports: vec![Port {
                name: "http".into(),
                port: 8080,
                protocol: Protocol::Http as i32,
            }],
            locality: Some(Locality {
                region: "eu-west-1".into(),
                zone: format!("eu-west-1{}", ["a", "b", "c"][pod.node as usize % 3]),
                subzone: String::new(),
            }),
            weight: 1,
            health: if pod.ready { Health::Healthy } else { Health::Unhealthy } as i32,
            metadata: Default::default(),
            pod: Some(PodInfo {
                namespace: namespace.into(),
                name: format!("{name}-{id}"),
                uid: format!("00000000-0000-0000-0000-{id:012}"),
                service_account: name.into(),
            }),
            node: node_name(pod.node),
        }
    }
}

fn draw_upstreams(rng: &mut Rng, popularity: &Zipf, service: usize, shape: &Shape) -> Vec<u32> {
    let wanted = rng.within(&shape.upstreams).min(shape.services.saturating_sub(1));
    let mut chosen = BTreeSet::new();
    while chosen.len() < wanted {
        let upstream = popularity.sample(rng);
        if upstream != service {
            chosen.insert(upstream as u32);
        }
    }
    chosen.into_iter().collect()
}

/// `ns<k>/svc-<s>`: services spread over 32 namespaces.
pub fn service_key(service: u32) -> String {
    format!("ns{}/svc-{service}", service % 32)
}

pub fn node_name(node: u32) -> String {
    format!("node-{node}")
}

/// Pod `id`'s address: 10.0.0.1 onwards.
pub fn pod_address(id: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 0, 0, 1)) + id)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(nodes: usize, services: usize) -> Shape {
        Shape {
            seed: 7,
            nodes,
            services,
            pods_per_node: 10..=30,
            upstreams: 10..=20,
            upstream_skew: 1.0,
            replica_skew: 0.5,
        }
    }

    #[test]
    fn a_node_depends_on_its_pods_services_and_their_upstreams_only() {
        let model = Model::generate(shape(50, 100));
        let node = 3;
        let mut expected = BTreeSet::new();
        for pod in model.pods.iter().filter(|p| p.node == node as u32) {
            expected.insert(pod.service);
            expected.extend(model.upstreams[pod.service as usize].iter().copied());
        }
        assert_eq!(model.dependencies(node), expected);
        let counts = model.dependents();
        for s in &expected {
            assert!(counts[*s as usize] >= 1, "node {node} depends on {s}");
        }
    }

    #[test]
    fn placement_and_upstreams_respect_the_shape() {
        let model = Model::generate(shape(200, 300));
        for (node, pods) in model.by_node.iter().enumerate() {
            assert!((10..=30).contains(&pods.len()), "node {node}: {} pods", pods.len());
            assert!(pods.iter().all(|&p| model.pods[p as usize].node == node as u32));
        }
        for (s, ups) in model.upstreams.iter().enumerate() {
            assert!((10..=20).contains(&ups.len()), "service {s}: {} upstreams", ups.len());
            assert!(!ups.contains(&(s as u32)), "service {s} is its own upstream");
        }
        let addresses: BTreeSet<_> = model.pods.iter().map(|p| p.address).collect();
        assert_eq!(addresses.len(), model.pods.len(), "pod addresses are unique");
    }

    #[test]
    fn popularity_is_skewed_towards_low_ranks() {
        let model = Model::generate(shape(500, 300));
        let counts = model.dependents();
        let top: u32 = counts[..10].iter().sum();
        let tail: u32 = counts[290..].iter().sum();
        assert!(top > 3 * tail, "top 10 {top} vs last 10 {tail}");
        let replicas = |s: u32| model.pods.iter().filter(|p| p.service == s).count();
        assert!(replicas(0) > replicas(299), "the top service runs more replicas");
    }

    #[test]
    fn the_same_seed_makes_the_same_cluster() {
        let (a, b) = (Model::generate(shape(40, 60)), Model::generate(shape(40, 60)));
        assert_eq!(a.upstreams, b.upstreams);
        assert_eq!(a.by_node, b.by_node);
        let c = Model::generate(Shape {
            seed: 8,
            ..shape(40, 60)
        });
        assert_ne!(a.by_node, c.by_node);
    }

    #[test]
    fn an_endpoint_names_its_pod_node_and_readiness() {
        let mut model = Model::generate(shape(5, 20));
        let id = model.add_pod(4, 7);
        model.pods[id as usize].ready = false;
        let e = model.endpoint(id);
        assert_eq!(e.service, "ns7/svc-7");
        assert_eq!(e.node, "node-4");
        assert_eq!(e.address, pod_address(id).to_string());
        assert_eq!(e.health, Health::Unhealthy as i32);
    }
}
