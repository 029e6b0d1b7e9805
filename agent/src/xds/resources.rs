//! The generators: local pods + the node's slice of the catalog → Envoy resources.
//! One function per resource type; every output is sorted so equal inputs give equal
//! bytes (and so equal versions, and no push).
//!
//! Names: a service port's cluster is named by its authority, `<svc>.<ns>.<domain>:<port>`
//! (so on-demand CDS can ask for what a request's authority names); the bare
//! `<svc>.<ns>.<domain>` cluster serves the service's default port, when asked for. Per pod:
//! `outbound|<ns>/<pod>` (explicit and captured traffic) and `inbound|<ns>/<pod>` listeners and
//! `local|<ns>/<pod>|<port>` delivery clusters; with mTLS its `originate|<ns>/<pod>`
//! cluster and secret, and per node the `originate|h2` and `originate|tcp` internal
//! listeners (see `origination`).
//!
//! Cost: per pod a constant number of resources; per dependency service its clusters,
//! assignments and (VHDS) virtual hosts. Adding a pod adds its own resources, its new
//! dependencies' and changes its own service's endpoints, never a shared cluster or
//! table.

pub mod app_protocols;
pub mod authorization;
mod clusters;
pub mod edge;
pub mod external;
pub mod http_filters;
mod listeners;
mod origination;
mod routes;
mod tcp_routes;
pub mod transport;
mod util;

use std::collections::{BTreeMap, BTreeSet};

use std::collections::HashMap;
use std::sync::Arc;

use aether_api::mesh_config::ResilienceSettings;
use aether_api::service_ports::ServicePorts;
use aether_proto::registry::v1::{
    AuthorizationPolicy, DefaultAuthorization, Locality, Protocol, Route, RouteKind, Service,
};
use aether_proto::view::{CatalogView, Endpoints};
use envoy_types::pb::google::protobuf::Any;

use super::cache::{Resource, Snapshot};
use crate::identity::Identities;
use crate::mesh_settings::MeshSettings;
use crate::pod::LocalPod;
use transport::Mtls;

pub use clusters::server_sans;
pub use routes::{Attached, regex_budget, with_virtual_hosts_inline};
pub use util::{CAPTURE_PORT, INBOUND_PORT, OUTBOUND_PORT, PORT_HEADER};

/// Everything the generators read.
pub struct Inputs<'a> {
    pub pods: &'a [LocalPod],
    /// The catalog, already filtered to the node's dependency set.
    pub catalog: &'a CatalogView,
    pub mesh_domain: &'a str,
    pub locality: &'a Locality,
    /// Cluster names Envoy asked for on demand, with their service key.
    pub on_demand: &'a BTreeMap<String, String>,
    /// Services of the catalog that only local pods' own are ([`crate::node::Demand`]):
    /// their virtual hosts are served, their clusters only once Envoy asks.
    pub own_only: &'a BTreeSet<String>,
}

/// A service in the node's dependency set, as the generators see it.
pub struct MeshService<'a> {
    pub key: &'a str,
    pub service: &'a Service,
    pub fqdn: String,
    pub vip: &'a str,
    /// Its Kubernetes Service's ClusterIPs (empty without one): captured and routed like the VIP.
    pub cluster_ips: &'a [String],
    /// Its Kubernetes Service's ports, each with the endpoint port it reaches (a named
    /// targetPort resolved by the endpoints' port names; one no endpoint names is left
    /// out). `None` while the Service's ports are unknown.
    pub kubernetes_ports: Option<BTreeMap<u32, u32>>,
    /// The ports its endpoints serve, with their protocol.
    pub ports: BTreeMap<u32, Protocol>,
    pub endpoints: Option<&'a Endpoints>,
    /// Also serve the default port's cluster under the bare name: only when it was
    /// asked for on demand (a request whose authority had no port); declared
    /// dependencies reach the default port through the route table instead.
    pub bare: bool,
}

impl MeshService<'_> {
    /// The port a request without one in its authority goes to: 80 if served, else the
    /// lowest HTTP port, else the lowest port.
    pub fn default_port(&self) -> Option<u32> {
        if self.ports.contains_key(&80) {
            return Some(80);
        }
        self.ports
            .iter()
            .find(|(_, p)| is_http(**p))
            .or_else(|| self.ports.iter().next())
            .map(|(port, _)| *port)
    }

    pub fn cluster(&self, port: u32) -> String {
        format!("{}:{port}", self.fqdn)
    }

    /// The ports on which a call to its ClusterIPs or Kubernetes names reaches the
    /// endpoint port `port`: the Service ports targeting it, or `port` itself while the
    /// Service's ports are unknown.
    pub fn kubernetes_ports_to(&self, port: u32) -> Vec<u32> {
        match &self.kubernetes_ports {
            None => vec![port],
            Some(ports) => ports
                .iter()
                .filter(|(_, target)| **target == port)
                .map(|(service_port, _)| *service_port)
                .collect(),
        }
    }

    /// The endpoint port a Gateway API port reaches (a parentRef's or backendRef's, which
    /// name Service ports): the one the Service port targets; a port the Service does not
    /// map (or any, while its ports are unknown) is taken as an endpoint port itself.
    pub fn endpoint_port(&self, service_port: u32) -> u32 {
        aether_api::service_ports::endpoint_port(self.kubernetes_ports.as_ref(), service_port)
    }

    /// The endpoint port a Kubernetes name without a port reaches: the target of the
    /// Service's port 80 (what an HTTP client means), else the mesh's default port.
    pub fn kubernetes_default_port(&self) -> Option<u32> {
        let via_80 = self.kubernetes_ports.as_ref().and_then(|ports| ports.get(&80));
        via_80
            .copied()
            .filter(|t| self.ports.contains_key(t))
            .or_else(|| self.default_port())
    }

    /// Its names besides the mesh's, answered on the ports its Kubernetes Service maps:
    /// an external service's hosts; else the names its Kubernetes Service has in cluster
    /// DNS, if it has ClusterIPs: `<svc>.<ns>.svc.<cluster domain>` and `<svc>.<ns>.svc`.
    pub fn kubernetes_names(&self, cluster_domain: &str) -> Vec<String> {
        if let Some(external) = &self.service.external {
            return external.hosts.clone();
        }
        if self.cluster_ips.is_empty() {
            return Vec::new();
        }
        let (ns, name) = self.key.split_once('/').unwrap_or(("", self.key));
        vec![format!("{name}.{ns}.svc.{cluster_domain}"), format!("{name}.{ns}.svc")]
    }
}

/// Whether a route shapes connections (TCP and TLS routes, on TCP ports) rather than
/// HTTP requests.
pub fn routes_connections(route: &Route) -> bool {
    matches!(route.kind(), RouteKind::Tcp | RouteKind::Tls)
}

pub use aether_api::service_ports::is_http;

pub fn fqdn(key: &str, mesh_domain: &str) -> String {
    let (ns, name) = key.split_once('/').unwrap_or(("", key));
    format!("{name}.{ns}.{mesh_domain}")
}

/// The inverse of [`fqdn`] for an authority (`<svc>.<ns>.<domain>[:port]`): the
/// service key and port, if it names a mesh service.
pub fn parse_authority(authority: &str, mesh_domain: &str) -> Option<(String, Option<u32>)> {
    let (host, port) = match authority.rsplit_once(':') {
        Some((host, port)) => (host, Some(port.parse().ok()?)),
        None => (authority, None),
    };
    let rest = host.strip_suffix(mesh_domain)?.strip_suffix('.')?;
    let (name, ns) = rest.split_once('.')?;
    if ns.contains('.') || crate::upstreams::check(ns).is_err() || crate::upstreams::check(name).is_err() {
        return None;
    }
    Some((format!("{ns}/{name}"), port))
}

pub fn services<'a>(catalog: &'a CatalogView, mesh_domain: &str) -> Vec<MeshService<'a>> {
    (catalog.services.iter())
        .map(|(key, service)| mesh_service(catalog, key, service, mesh_domain))
        .collect()
}

/// The catalog's service `key` as the generators see it.
fn mesh_service<'a>(
    catalog: &'a CatalogView,
    key: &'a str,
    service: &'a Service,
    mesh_domain: &str,
) -> MeshService<'a> {
    let endpoints = catalog.endpoints.get(key).into_iter().flat_map(|e| e.values());
    let ServicePorts {
        endpoint: ports,
        targets: kubernetes_ports,
    } = ServicePorts::of(service, endpoints);
    MeshService {
        key,
        service,
        fqdn: fqdn(key, mesh_domain),
        vip: &service.vip,
        cluster_ips: service.kubernetes.as_ref().map_or(&[], |k| k.cluster_ips.as_slice()),
        kubernetes_ports,
        ports,
        endpoints: catalog.endpoints.get(key),
        bare: false,
    }
}

/// Named resource bodies, as a generator makes them.
pub type Named = Vec<(String, Any)>;

/// Resources by type URL, each with its version.
pub type Generated = BTreeMap<String, Vec<Arc<Resource>>>;

/// The generators with their memory: a service's clusters and assignments are rebuilt
/// only when the service or its endpoints changed (the catalog view shares unchanged
/// endpoint sets), a pod's listeners only when the pod or its declared services'
/// addresses changed, the route table only when some service's name, VIP or ports did.
#[derive(Default)]
pub struct Generator {
    services: HashMap<String, ServiceMemo>,
    pods: HashMap<String, PodMemo>,
    /// The catalog's routes last seen, and the valid ones among them.
    checked: Checked,
    routes: Option<(RoutesInput, ServedTables)>,
    /// Each service's virtual hosts per table, for the next route build.
    route_memo: routes::Memo,
    /// The catalog's authorization policies, validated.
    policies: authorization::Checked,
    /// The catalog's HTTP filters, validated.
    http_filters: http_filters::Checked,
    /// The catalog's MeshConfigs, validated: resilience and authorization defaults.
    mesh: MeshSettings,
    /// Policies refused for some local pod (HTTP fields on a TCP port), as last generated.
    refused_for_pods: Vec<authorization::Refused>,
    /// mTLS between pods; `None`: plaintext (`--identity none`, not for production).
    mtls: Option<Mtls>,
    /// The pods' SVIDs and trust bundles (with mTLS).
    identities: Arc<Identities>,
    cluster_domain: ClusterDomain,
    /// This node's name (endpoints on it are "same node" for trafficDistribution).
    node_name: String,
    /// Where pods' Unix sockets are reached (`crate::uds`).
    uds_link_dir: UdsLinkDir,
    /// How external services' hosts are resolved (`--external-dns`).
    external_dns: external::ExternalDns,
}

/// `--uds-link-dir`.
struct UdsLinkDir(std::path::PathBuf);

impl Default for UdsLinkDir {
    fn default() -> Self {
        UdsLinkDir("/run/aether/uds".into())
    }
}

impl std::ops::Deref for UdsLinkDir {
    type Target = std::path::Path;
    fn deref(&self) -> &std::path::Path {
        &self.0
    }
}

/// Kubernetes' cluster DNS domain (`--cluster-domain`).
struct ClusterDomain(String);

/// What Kubernetes uses unless the cluster was set up otherwise.
pub const DEFAULT_CLUSTER_DOMAIN: &str = "cluster.local";

impl Default for ClusterDomain {
    fn default() -> Self {
        ClusterDomain(DEFAULT_CLUSTER_DOMAIN.to_owned())
    }
}

struct ServiceMemo {
    service: Service,
    resilience: ResilienceSettings,
    bare: bool,
    endpoints: Option<Endpoints>,
    clusters: Vec<Arc<Resource>>,
    assignments: Vec<Arc<Resource>>,
}

struct PodMemo {
    pod: LocalPod,
    /// The authorization policies its inbound listener enforces.
    policies: Vec<Arc<AuthorizationPolicy>>,
    /// The HTTP filters of its listeners.
    filters: PodFilters,
    declared: Vec<RouteKey>,
    /// The TCP routes' splits of its declared services' TCP ports.
    splits: tcp_routes::Splits,
    /// What its chains to external stream ports log of each connection.
    egress_logged: authorization::egress::StreamDecisions,
    /// The outbound route table its listener names.
    table: String,
    listeners: Vec<Arc<Resource>>,
    /// Its inbound route table (with its authorization rules), if it serves HTTP.
    inbound_routes: Vec<Arc<Resource>>,
    clusters: Vec<Arc<Resource>>,
}

/// The catalog's routes, checked once per version of each.
#[derive(Default)]
struct Checked {
    seen: Vec<Arc<Route>>,
    valid: Vec<Arc<Route>>,
    invalid: usize,
}

impl Checked {
    /// Re-checks the routes when any changed; an invalid one (or one with a regex over
    /// the RE2 budget, see `routes::regex_budget`) is logged and skipped, so one bad
    /// route never makes Envoy refuse a table.
    fn refresh(&mut self, routes: &BTreeMap<String, Arc<Route>>) {
        let current: Vec<Arc<Route>> = routes.values().cloned().collect();
        if same_routes(&current, &self.seen) {
            return;
        }
        self.valid.clear();
        self.invalid = 0;
        for route in &current {
            match check_route(route) {
                Ok(()) => self.valid.push(route.clone()),
                Err(error) => {
                    self.invalid += 1;
                    let key = aether_proto::view::route_key(route);
                    tracing::warn!(route = %aether_common::quote::quote(&key), %error, "invalid route skipped");
                }
            }
        }
        self.seen = current;
    }
}

/// Whether the agent serves a route: valid, and every regex within Envoy's RE2 budget
/// (`aether explain` names the ones it skips).
pub fn check_route(route: &Route) -> Result<(), String> {
    aether_api::route::validate(route)
        .map_err(|e| e.to_string())
        .and_then(|()| routes::regex_budget::check(route).map_err(|e| e.to_string()))
}

/// Equal by identity: the catalog view shares an unchanged policy.
fn same_policies(a: &[Arc<AuthorizationPolicy>], b: &[Arc<AuthorizationPolicy>]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(a, b)| Arc::ptr_eq(a, b))
}

/// Equal by identity: the catalog view shares an unchanged route.
fn same_routes(a: &[Arc<Route>], b: &[Arc<Route>]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(a, b)| Arc::ptr_eq(a, b))
}

/// The outbound route tables and their virtual hosts, as resources.
#[derive(Clone)]
struct ServedTables {
    tables: Vec<Arc<Resource>>,
    virtual_hosts: Vec<Arc<Resource>>,
}

/// What the route tables are built from.
struct RoutesInput {
    services: Vec<RouteKey>,
    /// Timeouts and retries come from the services' namespaces' settings.
    mesh: MeshSettings,
    routes: Vec<Arc<Route>>,
    consumers: BTreeSet<String>,
    /// Callers-side HTTP filters, enabled per service and route.
    callers: http_filters::Callers,
}

impl RoutesInput {
    fn same(&self, other: &RoutesInput) -> bool {
        self.services == other.services && self.same_but_services(other)
    }

    /// The same but for which services there are: each service's virtual hosts are as
    /// they were built, if it is.
    fn same_but_services(&self, other: &RoutesInput) -> bool {
        self.mesh == other.mesh
            && same_routes(&self.routes, &other.routes)
            && self.consumers == other.consumers
            && self.callers == other.callers
    }
}

/// What a service contributes to routes and capture chains.
#[derive(Clone, PartialEq)]
struct RouteKey {
    key: String,
    vip: String,
    cluster_ips: Vec<String>,
    kubernetes_ports: Option<BTreeMap<u32, u32>>,
    ports: BTreeMap<u32, Protocol>,
}

impl RouteKey {
    fn of(service: &MeshService) -> Self {
        Self {
            key: service.key.to_owned(),
            vip: service.vip.to_owned(),
            cluster_ips: service.cluster_ips.to_vec(),
            kubernetes_ports: service.kubernetes_ports.clone(),
            ports: service.ports.clone(),
        }
    }
}

/// Endpoint assignments versioned with their cluster: when a cluster changes (e.g. its
/// service's identities or ports), Envoy warms the new cluster until it gets endpoints
/// again, so its assignment is re-sent with it.
fn with_cluster_versions(items: Vec<(String, Any)>, clusters: &[Arc<Resource>]) -> Vec<Arc<Resource>> {
    items
        .into_iter()
        .map(|(name, body)| {
            let cluster = clusters
                .iter()
                .find(|c| c.name == name)
                .map_or("", |c| c.version.as_str());
            Resource::depending_on(name, body, cluster)
        })
        .collect()
}

fn resources(items: Vec<(String, Any)>) -> Vec<Arc<Resource>> {
    items
        .into_iter()
        .map(|(name, body)| Resource::new(name, body))
        .collect()
}

impl Generator {
    /// A generator for mTLS between pods in `trust_domain`.
    pub fn with_mtls(trust_domain: &str) -> Self {
        Self {
            mtls: Some(Mtls {
                trust_domain: trust_domain.to_owned(),
            }),
            ..Default::default()
        }
    }

    /// Kubernetes' cluster DNS domain, for the names of services with a Kubernetes
    /// Service (default [`DEFAULT_CLUSTER_DOMAIN`]).
    pub fn set_cluster_domain(&mut self, cluster_domain: &str) {
        self.cluster_domain = ClusterDomain(cluster_domain.to_owned());
    }

    /// Where pods' Unix sockets are reached (`--uds-link-dir`, see `crate::uds`).
    pub fn set_uds_link_dir(&mut self, dir: &std::path::Path) {
        self.uds_link_dir = UdsLinkDir(dir.to_owned());
    }

    /// The DNS servers Envoy resolves external services' hosts with (`--external-dns`;
    /// none: the system's).
    pub fn set_external_dns(&mut self, dns: external::ExternalDns) {
        self.external_dns = dns;
    }

    /// This node's name, as its agent registers endpoints under it.
    pub fn set_node_name(&mut self, node_name: &str) {
        self.node_name = node_name.to_owned();
    }

    /// mTLS between pods in `trust_domain` from now on.
    pub fn enable_mtls(&mut self, trust_domain: &str) {
        self.mtls = Some(Mtls {
            trust_domain: trust_domain.to_owned(),
        });
    }

    /// The identities the next [`Generator::generate`] serves (SDS). With mTLS, a pod
    /// without an SVID gets no listeners: it cannot join the mesh without an identity
    /// (its CNI ADD waits, then fails, and kubelet retries).
    pub fn set_identities(&mut self, identities: Arc<Identities>) {
        self.identities = identities;
    }

    /// All resources for the node, by type URL.
    pub fn generate(&mut self, inputs: &Inputs) -> Generated {
        let mtls = self.mtls.clone();
        let mtls = mtls.as_ref();
        let mut services = services(inputs.catalog, inputs.mesh_domain);
        for service in &mut services {
            service.bare = inputs.on_demand.contains_key(&service.fqdn);
        }
        self.checked.refresh(&inputs.catalog.routes);
        self.policies.refresh(&inputs.catalog.policies);
        self.http_filters
            .refresh(&inputs.catalog.http_filters, &self.identities.trust_domain);
        self.mesh = MeshSettings::new(&inputs.catalog.mesh_configs);
        // TCP and TLS routes shape the pods' TCP chains; the others, the HTTP route tables.
        let (tcp_routes, http_routes): (Vec<Arc<Route>>, Vec<Arc<Route>>) =
            (self.checked.valid.iter().cloned()).partition(|r| routes_connections(r));
        let attached = routes::Attached::new(http_routes.iter().map(|r| &**r));
        let tcp_attached = routes::Attached::new(tcp_routes.iter().map(|r| &**r));
        // A table of its own only for a namespace whose callers live here.
        let consumers: BTreeSet<String> = attached
            .consumer_namespaces()
            .into_iter()
            .filter(|ns| inputs.pods.iter().any(|p| p.info.namespace == *ns))
            .map(str::to_owned)
            .collect();
        let mut out = Collected::default();
        let node_name = self.node_name.clone();
        let here = clusters::Here {
            locality: inputs.locality,
            node: &node_name,
        };
        let dependencies: BTreeSet<&str> = services.iter().map(|s| s.key).collect();
        let mut callers = self.http_filters.callers(&dependencies);
        let egress = self.policies.egress();
        // Authorization of calls to external services, first among the callers' filters.
        let egress_filters = authorization::egress::http_filters(authorization::egress::audit_slots(&egress));
        callers.filters.splice(0..0, egress_filters);
        for service in services.iter().filter(|s| s.service.external.is_some()) {
            for (port, _) in service.ports.iter().filter(|(_, p)| is_http(**p)) {
                let enabled = authorization::egress::http_port(service, *port, &egress, &self.identities.trust_domain);
                if !enabled.is_empty() {
                    let ports = callers.by_service_port.entry(service.key.to_owned()).or_default();
                    ports.insert(*port, enabled);
                }
            }
        }
        self.add_services(&services, inputs.own_only, here, mtls, &mut out);
        let pod_inputs = PodInputs {
            services: &services,
            consumers: &consumers,
            callers: &callers,
            tcp_routes: &tcp_attached,
            egress: &egress,
        };
        self.add_pods(inputs.pods, &pod_inputs, mtls, &mut out);
        add_empty_on_demand(inputs, mtls, &self.mesh, &mut out);
        out.clusters
            .extend(resources(self.http_filters.ext_authz_clusters(inputs.pods, &callers)));
        let input = RoutesInput {
            services: services.iter().map(RouteKey::of).collect(),
            mesh: self.mesh.clone(),
            routes: http_routes.clone(),
            consumers,
            callers,
        };
        let ServedTables {
            tables: mut routes,
            virtual_hosts,
        } = self.routes(inputs.mesh_domain, &services, &attached, input);

        let Collected {
            mut clusters,
            mut assignments,
            mut listeners,
            inbound_routes,
        } = out;
        routes.extend(inbound_routes);
        if mtls.is_some() {
            // The per-node originate listeners the pods' mTLS clusters go through.
            listeners.extend(resources(origination::listeners()));
        }
        for resources in [&mut clusters, &mut assignments, &mut listeners, &mut routes] {
            resources.sort_by(|a, b| a.name.cmp(&b.name));
        }
        let mut generated = BTreeMap::from([
            (super::CLUSTER.to_owned(), clusters),
            (super::ENDPOINT.to_owned(), assignments),
            (super::LISTENER.to_owned(), listeners),
            (super::ROUTE.to_owned(), routes),
            (super::VIRTUAL_HOST.to_owned(), virtual_hosts),
        ]);
        if mtls.is_some() {
            generated.insert(super::SECRET.to_owned(), self.secrets(inputs.pods));
        }
        generated
    }

    /// Each called service's clusters and assignments, rebuilt only when it changed.
    fn add_services(
        &mut self,
        services: &[MeshService],
        own_only: &BTreeSet<String>,
        here: clusters::Here,
        mtls: Option<&Mtls>,
        out: &mut Collected,
    ) {
        let mut fresh = HashMap::new();
        for service in services.iter().filter(|s| !own_only.contains(s.key)) {
            let resilience = self.mesh.of(&service.service.namespace).resilience;
            let memo = match self.services.remove(service.key) {
                Some(memo) if memo.is_current(service, &resilience) => memo,
                _ => ServiceMemo::build(service, here, mtls, resilience, &self.external_dns),
            };
            out.clusters.extend(memo.clusters.iter().cloned());
            out.assignments.extend(memo.assignments.iter().cloned());
            fresh.insert(service.key.to_owned(), memo);
        }
        self.services = fresh;
    }

    /// Each pod's listeners and clusters, rebuilt only when the pod or the addresses of
    /// its declared services changed. With mTLS, a pod without an SVID yet gets none.
    fn add_pods(&mut self, pods: &[LocalPod], inputs: &PodInputs, mtls: Option<&Mtls>, out: &mut Collected) {
        let PodInputs {
            services,
            consumers,
            callers,
            tcp_routes,
            egress,
        } = inputs;
        let by_key: HashMap<&str, &MeshService> = services.iter().map(|s| (s.key, s)).collect();
        let mut fresh = HashMap::new();
        let mut refused = Vec::new();
        for pod in pods {
            if mtls.is_some() && !self.identities.svids.contains_key(&pod.id()) {
                tracing::debug!(pod = %pod.id(), "no SVID yet: the pod's listeners wait for it");
                continue;
            }
            let declared: Vec<&MeshService> = pod
                .info
                .upstreams()
                .services
                .iter()
                .filter_map(|key| by_key.get(key.as_str()).copied())
                .collect();
            let declared_keys: Vec<RouteKey> = declared.iter().map(|s| RouteKey::of(s)).collect();
            let mut splits = tcp_routes::splits(&pod.info.namespace, &declared, tcp_routes, &by_key);
            let trust_domain = &self.identities.trust_domain;
            let mut egress_logged = authorization::egress::StreamDecisions::new();
            authorization::egress::judge_streams(pod, &declared, egress, trust_domain, &mut splits, &mut egress_logged);
            let table = routes::table_name(&pod.info.namespace, consumers);
            let last = self.pods.get(&pod.id()).map_or(&[][..], |m| &m.policies[..]);
            let default_deny = self.mesh.of(&pod.info.namespace).default_authorization == DefaultAuthorization::Deny;
            let (policies, refused_here) = self.policies.for_pod(pod, last, default_deny);
            refused.extend(refused_here);
            let (inbound, inbound_enabled) = self.http_filters.inbound(pod);
            let filters = PodFilters {
                inbound,
                inbound_enabled,
                callers: callers.filters.clone(),
                trust_domain: self.identities.trust_domain.clone(),
            };
            let memo = match self.pods.remove(&pod.id()) {
                Some(memo)
                    if memo.pod == *pod
                        && memo.declared == declared_keys
                        && memo.splits == splits
                        && memo.egress_logged == egress_logged
                        && memo.table == table
                        && same_policies(&memo.policies, &policies)
                        && memo.filters == filters =>
                {
                    memo
                }
                _ => PodMemo::build(
                    pod,
                    &self.uds_link_dir,
                    Declared {
                        services: &declared,
                        keys: declared_keys,
                        splits,
                        egress_logged,
                    },
                    table,
                    mtls,
                    policies,
                    filters,
                ),
            };
            out.listeners.extend(memo.listeners.iter().cloned());
            out.inbound_routes.extend(memo.inbound_routes.iter().cloned());
            out.clusters.extend(memo.clusters.iter().cloned());
            fresh.insert(pod.id(), memo);
        }
        self.pods = fresh;
        for error in refused.iter().filter(|r| !self.refused_for_pods.contains(r)) {
            tracing::warn!(%error, "authorization policy refused for the pod; its last good version stays enforced");
        }
        self.refused_for_pods = refused;
    }

    /// The route tables, rebuilt only when some service's name, VIP or ports changed, a
    /// route did, or the namespaces with tables of their own.
    fn routes(
        &mut self,
        mesh_domain: &str,
        services: &[MeshService],
        attached: &routes::Attached,
        input: RoutesInput,
    ) -> ServedTables {
        let routes = match self.routes.take() {
            Some((last, routes)) if last.same(&input) => routes,
            last => {
                if !last.is_some_and(|(last, _)| last.same_but_services(&input)) {
                    self.route_memo = routes::Memo::default();
                }
                let names = routes::Names {
                    mesh_domain,
                    cluster_domain: &self.cluster_domain.0,
                };
                let tables = routes::route_configs(
                    &names,
                    services,
                    attached,
                    &input.consumers,
                    &input.callers,
                    &input.mesh,
                    &mut self.route_memo,
                );
                ServedTables {
                    tables: resources(tables.tables),
                    virtual_hosts: tables.virtual_hosts,
                }
            }
        };
        self.routes = Some((input, routes.clone()));
        routes
    }

    /// HTTP filters in the catalog that fail `aether_api::http_filter::validate`, skipped.
    pub fn invalid_http_filters(&self) -> usize {
        self.http_filters.invalid()
    }

    /// MeshConfigs in the catalog that fail `aether_api::mesh_config::validate`, skipped.
    pub fn invalid_mesh_configs(&self) -> usize {
        self.mesh.invalid()
    }

    /// Routes in the catalog that fail `aether_api::route::validate`, skipped.
    pub fn invalid_routes(&self) -> usize {
        self.checked.invalid
    }

    /// Authorization policies not enforced as they are: invalid ones, and ones refused
    /// for a local pod (each names the field at fault; the last good version stays).
    pub fn refused_policies(&self) -> impl Iterator<Item = &authorization::Refused> {
        self.policies.invalid().iter().chain(&self.refused_for_pods)
    }

    /// The SVIDs and bundles of the pods still local: a deleted pod's secret is withdrawn with it.
    fn secrets(&self, pods: &[LocalPod]) -> Vec<Arc<Resource>> {
        let local: BTreeSet<String> = pods.iter().map(LocalPod::id).collect();
        let mut identities = (*self.identities).clone();
        identities.svids.retain(|id, _| local.contains(id));
        resources(transport::secrets(&identities))
    }
}

/// A pod's HTTP filters (proposals/014): its inbound ones, and the node's callers-side
/// ones (disabled) for its outbound HCMs; and the trust domain its authorization rules
/// name service accounts and namespaces in.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PodFilters {
    pub trust_domain: String,
    /// Disabled in the inbound HCM; `inbound_enabled` enables them in the inbound table.
    pub inbound: Vec<envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::HttpFilter>,
    pub inbound_enabled: Vec<http_filters::Enabled>,
    pub callers: Vec<envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::HttpFilter>,
}

/// The resources of one generation, before they are sorted by name.
#[derive(Default)]
struct Collected {
    clusters: Vec<Arc<Resource>>,
    assignments: Vec<Arc<Resource>>,
    listeners: Vec<Arc<Resource>>,
    inbound_routes: Vec<Arc<Resource>>,
}

impl ServiceMemo {
    /// Built from this very service: same definition, same bare-name wish, and the same
    /// endpoint set (the catalog view shares an unchanged one, so pointer equality says it).
    fn is_current(&self, service: &MeshService, resilience: &ResilienceSettings) -> bool {
        let same_endpoints = match (&self.endpoints, service.endpoints) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            (None, None) => true,
            _ => false,
        };
        self.service == *service.service
            && self.bare == service.bare
            && same_endpoints
            && self.resilience == *resilience
    }

    fn build(
        service: &MeshService,
        here: clusters::Here,
        mtls: Option<&Mtls>,
        resilience: ResilienceSettings,
        dns: &external::ExternalDns,
    ) -> Self {
        let (c, a) = clusters::service_resources(service, here, mtls, &resilience, dns);
        let clusters = resources(c);
        let assignments = with_cluster_versions(a, &clusters);
        ServiceMemo {
            service: service.service.clone(),
            resilience,
            bare: service.bare,
            endpoints: service.endpoints.cloned(),
            clusters,
            assignments,
        }
    }
}

/// What the generators read for every pod.
struct PodInputs<'a> {
    services: &'a [MeshService<'a>],
    consumers: &'a BTreeSet<String>,
    callers: &'a http_filters::Callers,
    /// Valid TCP routes by parent.
    tcp_routes: &'a routes::Attached<'a>,
    /// The policies guarding calls to external services.
    egress: &'a [Arc<AuthorizationPolicy>],
}

/// The services a pod declared, as its listeners use them.
struct Declared<'a> {
    services: &'a [&'a MeshService<'a>],
    keys: Vec<RouteKey>,
    splits: tcp_routes::Splits,
    /// What its chains to external stream ports log of each connection.
    egress_logged: authorization::egress::StreamDecisions,
}

impl PodMemo {
    fn build(
        pod: &LocalPod,
        uds_link_dir: &std::path::Path,
        declared: Declared,
        table: String,
        mtls: Option<&Mtls>,
        policies: Vec<Arc<AuthorizationPolicy>>,
        filters: PodFilters,
    ) -> Self {
        let authz = authorization::filters(pod, &policies, &filters.trust_domain);
        let clusters = clusters::pod_clusters(pod, uds_link_dir)
            .into_iter()
            .chain(mtls.map(|m| origination::pod_cluster(m, &pod.id())))
            .collect();
        let listeners = listeners::pod_listeners(pod, &declared, &table, mtls, &authz, &filters);
        let inbound_routes = listeners::pod_inbound_routes(pod, &authz, &filters.inbound_enabled);
        PodMemo {
            pod: pod.clone(),
            policies,
            filters,
            declared: declared.keys,
            splits: declared.splits,
            egress_logged: declared.egress_logged,
            listeners: resources(listeners),
            inbound_routes: resources(inbound_routes.into_iter().collect()),
            table,
            clusters: resources(clusters),
        }
    }
}

/// Asked for on demand, known, but with nothing serving that port: the cluster is served
/// empty, so callers get a retryable 503 instead of a 404.
fn add_empty_on_demand(inputs: &Inputs, mtls: Option<&Mtls>, mesh: &MeshSettings, out: &mut Collected) {
    let served: BTreeSet<String> = out.clusters.iter().map(|r| r.name.clone()).collect();
    for (name, service) in inputs.on_demand {
        if served.contains(name) || !inputs.catalog.services.contains_key(service) {
            continue;
        }
        let namespace = service.split_once('/').map_or("", |(ns, _)| ns);
        let resilience = mesh.of(namespace).resilience;
        let cluster = Resource::new(name.clone(), clusters::empty_cluster(name, service, mtls, &resilience));
        out.assignments.push(Resource::depending_on(
            name.clone(),
            clusters::empty_assignment(name),
            &cluster.version,
        ));
        out.clusters.push(cluster);
    }
}

/// All resources for the node, computed from scratch.
pub fn generate(inputs: &Inputs) -> Generated {
    Generator::default().generate(inputs)
}

/// The names of the clusters a dependency service is served as (none while no
/// endpoint serves it).
pub fn cluster_names(catalog: &CatalogView, key: &str, mesh_domain: &str) -> Vec<String> {
    // Only this service: a pod declaring N upstreams asks N times.
    let Some((key, service)) = catalog.services.get_key_value(key) else {
        return Vec::new();
    };
    let service = mesh_service(catalog, key, service, mesh_domain);
    (clusters::service_clusters(&service).into_iter())
        .map(|(name, _, _)| name)
        .collect()
}

/// The virtual hosts routing `pod`'s calls to `clusters`, as `snapshot` serves them: in
/// its namespace's own table when there is one (consumer routes), else the shared one.
pub fn pod_virtual_host_names(snapshot: &Snapshot, pod: &LocalPod, clusters: &[String]) -> Vec<String> {
    let own = routes::consumer_table(&pod.info.namespace);
    let has_own = snapshot.version_of(super::ROUTE, &own).is_some();
    let table = if has_own { own.as_str() } else { routes::OUTBOUND_ROUTES };
    (clusters.iter())
        .map(|cluster| format!("{table}/{cluster}"))
        .filter(|name| snapshot.version_of(super::VIRTUAL_HOST, name).is_some())
        .collect()
}

/// With mTLS, what must be live before a pod's connections leave with its identity: its
/// secret and its originate cluster.
pub fn pod_identity_names(pod: &LocalPod) -> Vec<(&'static str, String)> {
    vec![
        (super::SECRET, crate::identity::svid_secret(&pod.id())),
        (super::CLUSTER, origination::pod_cluster_name(&pod.id())),
    ]
}

/// The names of a pod's listeners (what AddPod waits for Envoy to ACK).
pub fn pod_listener_names(pod: &LocalPod) -> BTreeSet<String> {
    let mut names = BTreeSet::from([listeners::outbound_name(pod)]);
    if !pod.info.mesh_ports().is_empty() {
        names.insert(listeners::inbound_name(pod));
    }
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_service_ports_app_protocol_names_a_stream_ports_protocol_only() {
        use aether_proto::registry::v1::{Endpoint, KubernetesService, Port, ServicePort};
        let mut catalog = CatalogView::default();
        let port = |port: u32, protocol: Protocol| Port {
            name: String::new(),
            port,
            protocol: protocol as i32,
        };
        let endpoint = Endpoint {
            service: "shop/cache".into(),
            address: "10.1.0.1".into(),
            ports: vec![
                port(6379, Protocol::Tcp),
                port(8080, Protocol::Http),
                port(9000, Protocol::Tcp),
            ],
            ..Default::default()
        };
        let service_port = |port: u32, app_protocol: &str| ServicePort {
            port,
            target_port: port,
            app_protocol: app_protocol.into(),
            ..Default::default()
        };
        let service = Service {
            namespace: "shop".into(),
            name: "cache".into(),
            vip: "240.240.0.1".into(),
            kubernetes: Some(KubernetesService {
                ports: vec![
                    service_port(6379, "redis"),
                    service_port(8080, "thrift"),
                    service_port(9000, "kubernetes.io/h2c"),
                ],
                ..Default::default()
            }),
            external: None,
        };
        catalog.services.insert("shop/cache".into(), service);
        let endpoints = [("10.1.0.1".to_owned(), endpoint)].into_iter().collect();
        catalog.endpoints.insert("shop/cache".into(), Arc::new(endpoints));
        let services = services(&catalog, "mesh");
        assert_eq!(
            services[0].ports,
            BTreeMap::from([
                (6379, Protocol::Redis),
                // Never HTTP into a stream, nor a stream out of HTTP: the pod's names decide.
                (8080, Protocol::Http),
                (9000, Protocol::Tcp),
            ])
        );
    }

    /// A local pod's own service no local pod calls: its virtual hosts route (a call finds
    /// its cluster on demand) but Envoy holds no cluster or assignment of it.
    #[test]
    fn an_own_service_no_one_here_calls_gets_virtual_hosts_and_no_cluster() {
        use super::routes::tests::{DOMAIN, catalog, pod};
        let catalog = catalog(Vec::new());
        let pods = [pod("gamma", "caller")];
        let generated = |own_only: &BTreeSet<String>, on_demand: &BTreeMap<String, String>| {
            generate(&Inputs {
                pods: &pods,
                catalog: &catalog,
                mesh_domain: DOMAIN,
                locality: &Locality::default(),
                on_demand,
                own_only,
            })
        };
        let names = |generated: &Generated, type_url: &str| -> Vec<String> {
            generated[type_url].iter().map(|r| r.name.clone()).collect()
        };
        let own = format!("echo-v1.gamma.{DOMAIN}:80");
        let own_only = BTreeSet::from(["gamma/echo-v1".to_owned()]);
        let served = generated(&own_only, &BTreeMap::new());
        assert!(!names(&served, super::super::CLUSTER).contains(&own));
        assert!(!names(&served, super::super::ENDPOINT).contains(&own));
        assert!(names(&served, super::super::CLUSTER).contains(&format!("echo.gamma.{DOMAIN}:80")));
        assert!(
            names(&served, super::super::VIRTUAL_HOST)
                .iter()
                .any(|vh| vh.ends_with(&own)),
            "{:?}",
            names(&served, super::super::VIRTUAL_HOST)
        );
        // Once no longer own-only (a call looked it up), its clusters are served.
        let asked = BTreeMap::from([(own.clone(), "gamma/echo-v1".to_owned())]);
        let served = generated(&BTreeSet::new(), &asked);
        assert!(names(&served, super::super::CLUSTER).contains(&own));
        assert!(names(&served, super::super::ENDPOINT).contains(&own));
    }

    #[test]
    fn authorities_map_back_to_services() {
        let d = "aether.internal";
        assert_eq!(
            parse_authority("cart.shop.aether.internal", d),
            Some(("shop/cart".into(), None))
        );
        assert_eq!(
            parse_authority("cart.shop.aether.internal:8080", d),
            Some(("shop/cart".into(), Some(8080)))
        );
        assert_eq!(parse_authority("cart.shop.example.com", d), None);
        assert_eq!(parse_authority("a.b.c.aether.internal", d), None);
        assert_eq!(parse_authority("cart.shop.aether.internal:x", d), None);
        assert_eq!(fqdn("shop/cart", d), "cart.shop.aether.internal");
    }
}
