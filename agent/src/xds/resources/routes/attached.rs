//! Which routes shape which service port, for which callers.
//!
//! A route in its parent's namespace is a producer route: every caller sees it. A
//! route in another namespace is a consumer route: only callers in the route's
//! namespace see it, and for them it replaces the producer routes of that parent port.
//! Callers without consumer routes share one table; each namespace with consumer
//! routes (and local pods) gets its own.

use std::collections::{BTreeMap, BTreeSet};

use aether_proto::registry::v1::Route;

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
    /// sees on `service`'s `port`, each once.
    pub fn on(&self, service: &str, port: u32, caller: Option<&str>) -> Vec<&'a Route> {
        let producer = namespace(service);
        let on_port = || {
            self.by_parent
                .get(service)
                .into_iter()
                .flatten()
                .filter(move |(_, p)| *p == 0 || *p == port)
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
    use aether_proto::registry::v1::RouteParent;

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

    #[test]
    fn consumer_routes_replace_producer_routes_for_their_namespace_only() {
        let producer = route("shop", "canary", &[("shop/cart", 0)]);
        let consumer = route("web", "pin-v1", &[("shop/cart", 8080)]);
        let routes = [producer, consumer];
        let attached = Attached::new(&routes);
        assert_eq!(attached.consumer_namespaces(), BTreeSet::from(["web"]));
        assert_eq!(names(attached.on("shop/cart", 8080, None)), ["canary"]);
        assert_eq!(names(attached.on("shop/cart", 8080, Some("web"))), ["pin-v1"]);
        // The consumer route names port 8080 only: on 9090 web sees the producer's.
        assert_eq!(names(attached.on("shop/cart", 9090, Some("web"))), ["canary"]);
        // The producer's own namespace and others see the producer route.
        assert_eq!(names(attached.on("shop/cart", 8080, Some("shop"))), ["canary"]);
        assert_eq!(names(attached.on("shop/cart", 8080, Some("other"))), ["canary"]);
        assert!(attached.on("shop/other", 8080, None).is_empty());
    }

    #[test]
    fn a_route_naming_a_service_twice_applies_once() {
        let both = route("shop", "both", &[("shop/cart", 0), ("shop/cart", 8080)]);
        let routes = [both];
        let attached = Attached::new(&routes);
        assert_eq!(names(attached.on("shop/cart", 8080, None)), ["both"]);
        assert_eq!(names(attached.on("shop/cart", 9090, None)), ["both"]);
        assert!(attached.consumer_namespaces().is_empty());
    }
}
