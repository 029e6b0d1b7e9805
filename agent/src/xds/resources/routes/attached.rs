//! Which routes shape which service port, for which callers.
//!
//! A route in its parent's namespace is a producer route: every caller sees it. A
//! route in another namespace is a consumer route: only callers in the route's
//! namespace see it, and for them it replaces the producer routes of that parent port.
//! Callers without consumer routes share one table; each namespace with consumer
//! routes (and local pods) gets its own.

use std::collections::{BTreeMap, BTreeSet};

use aether_proto::registry::v1::Route;

use crate::xds::resources::MeshService;

/// Valid routes by parent service, each with the parent port it names (0: every port).
#[derive(Default)]
pub struct Attached<'a> {
    by_parent: BTreeMap<&'a str, Vec<(&'a Route, u32)>>,
}

impl<'a> Attached<'a> {
    pub fn new(routes: impl IntoIterator<Item = &'a Route>) -> Self {
        let mut by_parent: BTreeMap<&str, Vec<(&Route, u32)>> = BTreeMap::new();
        for route in routes {
            for parent in &route.parents {
                by_parent.entry(&parent.service).or_default().push((route, parent.port));
            }
        }
        Attached { by_parent }
    }

    pub fn is_empty(&self) -> bool {
        self.by_parent.is_empty()
    }

    /// Whether any route names `service` (a key) as a parent.
    pub fn has_routes(&self, service: &str) -> bool {
        self.by_parent.contains_key(service)
    }

    /// The namespaces some route is a consumer route in.
    pub fn consumer_namespaces(&self) -> BTreeSet<&'a str> {
        self.by_parent
            .iter()
            .flat_map(|(service, routes)| routes.iter().map(move |(route, _)| (*service, *route)))
            .filter(|(service, route)| namespace(service) != route.namespace)
            .map(|(_, route)| route.namespace.as_str())
            .collect()
    }

    /// The routes a caller in `caller` (`None`: a namespace without consumer routes)
    /// sees on `service`'s endpoint port `port`, each once. A parent port is a Service
    /// port (Gateway API): it attaches to the endpoint port it targets.
    pub fn on(&self, service: &MeshService, port: u32, caller: Option<&str>) -> Vec<&'a Route> {
        let producer = namespace(service.key);
        let on_port = || {
            self.by_parent
                .get(service.key)
                .into_iter()
                .flatten()
                .filter(move |(_, p)| *p == 0 || service.endpoint_port(*p) == port)
                .map(|(route, _)| *route)
        };
        let of = |ns: &str| -> Vec<&'a Route> {
            let mut routes: Vec<&Route> = on_port().filter(|r| r.namespace == ns).collect();
            routes.dedup_by(|a, b| std::ptr::eq(*a, *b));
            routes
        };
        match caller.filter(|c| *c != producer).map(of) {
            Some(consumer) if !consumer.is_empty() => consumer,
            _ => of(producer),
        }
    }
}

fn namespace(service: &str) -> &str {
    service.split_once('/').map_or("", |(ns, _)| ns)
}

#[cfg(test)]
mod tests {
    use super::*;
    use aether_proto::registry::v1::{RouteParent, Service};

    fn route(namespace: &str, name: &str, parents: &[(&str, u32)]) -> Route {
        Route {
            namespace: namespace.into(),
            name: name.into(),
            parents: parents
                .iter()
                .map(|(service, port)| RouteParent {
                    service: (*service).into(),
                    port: *port,
                })
                .collect(),
            ..Default::default()
        }
    }

    fn names(routes: Vec<&Route>) -> Vec<&str> {
        routes.iter().map(|r| r.name.as_str()).collect()
    }

    /// `key` as the generators see it, with its Kubernetes Service's ports (Service
    /// port → endpoint port), if known.
    fn service<'a>(key: &'a str, kubernetes_ports: Option<&[(u32, u32)]>) -> MeshService<'a> {
        static SERVICE: Service = Service {
            namespace: String::new(),
            name: String::new(),
            vip: String::new(),
            kubernetes: None,
            external: None,
        };
        MeshService {
            key,
            service: &SERVICE,
            fqdn: String::new(),
            vip: "",
            cluster_ips: &[],
            kubernetes_ports: kubernetes_ports.map(|ports| ports.iter().copied().collect()),
            ports: Default::default(),
            endpoints: None,
            bare: false,
        }
    }

    #[test]
    fn consumer_routes_replace_producer_routes_for_their_namespace_only() {
        let producer = route("shop", "canary", &[("shop/cart", 0)]);
        let consumer = route("web", "pin-v1", &[("shop/cart", 8080)]);
        let routes = [producer, consumer];
        let (attached, cart) = (Attached::new(&routes), service("shop/cart", None));
        assert_eq!(attached.consumer_namespaces(), BTreeSet::from(["web"]));
        assert_eq!(names(attached.on(&cart, 8080, None)), ["canary"]);
        assert_eq!(names(attached.on(&cart, 8080, Some("web"))), ["pin-v1"]);
        // The consumer route names port 8080 only: on 9090 web sees the producer's.
        assert_eq!(names(attached.on(&cart, 9090, Some("web"))), ["canary"]);
        // The producer's own namespace and others see the producer route.
        assert_eq!(names(attached.on(&cart, 8080, Some("shop"))), ["canary"]);
        assert_eq!(names(attached.on(&cart, 8080, Some("other"))), ["canary"]);
        assert!(attached.on(&service("shop/other", None), 8080, None).is_empty());
    }

    #[test]
    fn a_route_naming_a_service_twice_applies_once() {
        let both = route("shop", "both", &[("shop/cart", 0), ("shop/cart", 8080)]);
        let routes = [both];
        let (attached, cart) = (Attached::new(&routes), service("shop/cart", None));
        assert_eq!(names(attached.on(&cart, 8080, None)), ["both"]);
        assert_eq!(names(attached.on(&cart, 9090, None)), ["both"]);
        assert!(attached.consumer_namespaces().is_empty());
    }

    #[test]
    fn a_parent_port_is_the_service_port_and_attaches_to_the_endpoint_port_it_targets() {
        let web = route("shop", "web", &[("shop/cart", 8000)]);
        let direct = route("shop", "direct", &[("shop/cart", 9090)]);
        let routes = [web, direct];
        let attached = Attached::new(&routes);
        // Service port 8000 targets endpoint port 80, and 80 targets 8080.
        let cart = service("shop/cart", Some(&[(8000, 80), (80, 8080)]));
        assert_eq!(names(attached.on(&cart, 80, None)), ["web"]);
        assert!(attached.on(&cart, 8000, None).is_empty());
        // Port 9090 is no Service port: it names the endpoint port itself, as before.
        assert_eq!(names(attached.on(&cart, 9090, None)), ["direct"]);
        // While the Service's ports are unknown, a parent port is the endpoint port.
        let unknown = service("shop/cart", None);
        assert_eq!(names(attached.on(&unknown, 8000, None)), ["web"]);
        assert!(attached.on(&unknown, 80, None).is_empty());
    }
}
