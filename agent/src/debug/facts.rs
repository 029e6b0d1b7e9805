//! Gathering the facts `aether explain` judges ([`crate::explain::Facts`]) from the node's
//! view, the mesh-dns record file, the pod's netns and Envoy's admin.

use std::net::IpAddr;
use std::path::Path;

use aether_api::route::request::Request;
use aether_mesh_dns::records::RecordFile;
use aether_proto::registry::v1::Endpoint;

use super::Inspector;

mod authorization;
mod san_probe;
use crate::explain::{
    Capture, DnsFacts, EnvoyFacts, Facts, IdentityFacts, PodFacts, Resource, RouteFacts, Svid, Target,
};
use crate::mesh_settings::MeshSettings;
use crate::node::NodeView;
use crate::pod::LocalPod;
use crate::xds;
use crate::xds::resources::{self, transport::Mtls};

/// What a target names before it is looked up.
#[derive(Debug, PartialEq, Eq)]
pub enum Name {
    /// `<ns>/<name>` and the port, if given.
    Service(String, Option<u32>),
    Ip(IpAddr, Option<u32>),
}

/// Parses `backend`, `backend.demo`, `demo/backend`, `backend.demo.<mesh domain>` (any of
/// `domains`: the node's and the mesh-wide MeshConfig's), any of them with `:port`, a URL
/// with such a host, or a VIP. `pod_ns` completes a bare name.
pub fn parse_target(text: &str, pod_ns: &str, domains: &[&str]) -> Option<Name> {
    let text = text.trim();
    let rest = text.split_once("://").map_or(text, |(_, rest)| rest);
    // A URL's authority ends at its path; `<ns>/<name>` has no scheme and no dot.
    let slash_key = !text.contains("://") && !rest.contains('.') && rest.contains('/');
    let authority = if slash_key { rest } else { rest.split('/').next()? };
    let (host, port) = match authority.rsplit_once(':') {
        Some((host, port)) if !host.contains(':') => (host, Some(port.parse().ok()?)),
        _ => (authority, None),
    };
    if let Ok(ip) = host.trim_matches(['[', ']']).parse::<IpAddr>() {
        return Some(Name::Ip(ip, port));
    }
    let host = host.trim_end_matches('.');
    let in_domain = |domain: &&str| host.strip_suffix(*domain)?.strip_suffix('.');
    let host = domains.iter().find_map(in_domain).unwrap_or(host);
    let (ns, name) = match (host.split_once('/'), host.split_once('.')) {
        (Some((ns, name)), _) => (ns, name),
        (None, Some((name, ns))) => (ns, name),
        (None, None) => (pod_ns, host),
    };
    let valid = |l: &str| crate::upstreams::check(l).is_ok();
    (valid(ns) && valid(name)).then(|| Name::Service(format!("{ns}/{name}"), port))
}

/// The request the route hop judges: a URL's path and query with `method` (default GET)
/// and `headers`; `None` for a target without URL when neither is given.
pub fn request_of(text: &str, method: Option<&str>, headers: &[(String, String)]) -> Option<Request> {
    let path = text
        .trim()
        .split_once("://")
        .map(|(_, rest)| match rest.find(['/', '?', '#']) {
            Some(at) if rest[at..].starts_with('/') => rest[at..].to_owned(),
            Some(at) => format!("/{}", &rest[at..]),
            None => "/".to_owned(),
        });
    if path.is_none() && method.is_none() && headers.is_empty() {
        return None;
    }
    Some(Request {
        method: method.unwrap_or("GET").to_ascii_uppercase(),
        path: path.unwrap_or_else(|| "/".to_owned()),
        headers: headers.to_vec(),
    })
}

/// What one `explain` asks: the pod, the target as typed, and the request's method and
/// headers from the CLI.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Question {
    pub pod: String,
    pub target: String,
    pub method: Option<String>,
    pub headers: Vec<(String, String)>,
}

pub async fn gather(inspector: &Inspector, question: &Question) -> Facts {
    let (pod_id, text) = (question.pod.as_str(), question.target.as_str());
    let view = inspector.node.view();
    let local = view.pods.iter().find(|p| p.id() == pod_id);
    let records = read_records(&inspector.records);
    let pod_ns = pod_id.split_once('/').map_or("default", |(ns, _)| ns);
    let alias = MeshSettings::new(&view.watched.catalog.mesh_configs).mesh().mesh_domain;
    let domains: Vec<&str> = std::iter::once(&*view.mesh_domain).chain(alias.as_deref()).collect();
    let target = parse_target(text, pod_ns, &domains).and_then(|n| resolve(n, &view, records.as_ref().ok()));
    let capture = match local {
        Some(pod) => capture(inspector, pod).await,
        None => Capture::Unknown,
    };
    let mut envoy = EnvoyFacts {
        connected: view.streams.newest().is_some(),
        ..Default::default()
    };
    let (mut identity, mut route, mut authorization) = (None, None, None);
    let request = request_of(text, question.method.as_deref(), &question.headers);
    if let (Some(pod), Some(t)) = (local, &target) {
        envoy = envoy_facts(inspector, &view, pod, t).await;
        identity = identity_facts(&view, pod, t).await;
        route = route_facts(&view, pod, t);
        let caller = identity
            .as_ref()
            .and_then(|i| i.svid.as_ref())
            .map(|s| s.spiffe_id.as_str());
        authorization = Some(authorization::facts(inspector, &view, pod, caller, t, request.as_ref()));
    }
    let recent_failures = target
        .as_ref()
        .map(|t| inspector.failures.of(pod_id, &names_of(t)))
        .unwrap_or_default();
    Facts {
        pod_id: pod_id.to_owned(),
        pod: local.map(pod_facts),
        target_text: text.to_owned(),
        dns: DnsFacts {
            answer: dns_answer(inspector, target.as_ref()).await,
            ..dns_facts(&records, target.as_ref())
        },
        target,
        registrar_connected: inspector.registrar_connected.get() == 1,
        capture,
        envoy,
        identity,
        request,
        route,
        authorization,
        recent_failures,
        now: None,
    }
}

/// The names a call to `target` may carry in its authority or cluster.
fn names_of(target: &Target) -> Vec<String> {
    let (ns, name) = target.service.split_once('/').unwrap_or(("", &target.service));
    let mut names = vec![target.fqdn.clone(), format!("{name}.{ns}.svc")];
    names.extend(target.vip.map(|ip| ip.to_string()));
    names
}

fn pod_facts(pod: &LocalPod) -> PodFacts {
    PodFacts {
        terminating: pod.info.terminating,
        config_errors: pod.info.config_errors(),
        upstreams: pod.info.upstreams().services.into_iter().collect(),
    }
}

pub fn read_records(path: &Path) -> Result<RecordFile, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    RecordFile::parse(&bytes).map_err(|e| format!("{}: {e}", path.display()))
}

/// The service a name means, with what the node's catalog slice and the record file know of it.
fn resolve(name: Name, view: &NodeView, records: Option<&RecordFile>) -> Option<Target> {
    let catalog = &view.watched.catalog;
    let (service, port, by_ip) = match name {
        Name::Service(key, port) => (key, port, false),
        Name::Ip(ip, port) => {
            let in_catalog = catalog.services.iter().find(|(_, s)| s.vip.parse() == Ok(ip));
            let in_records = records.and_then(|r| {
                r.records
                    .iter()
                    .find(|(_, a)| a.v4.map(IpAddr::V4) == Some(ip) || a.v6.map(IpAddr::V6) == Some(ip))
            });
            let key = in_catalog
                .map(|(k, _)| k.clone())
                .or_else(|| in_records.map(|((ns, name), _)| format!("{ns}/{name}")))?;
            (key, port, true)
        }
    };
    let (ns, name) = service.split_once('/')?;
    let record_vip = records
        .and_then(|r| r.records.get(&(ns.to_owned(), name.to_owned())))
        .and_then(|a| a.v4.map(IpAddr::V4).or(a.v6.map(IpAddr::V6)));
    let services = resources::services(catalog, &view.mesh_domain);
    let loaded = services.iter().find(|s| s.key == service);
    Some(Target {
        fqdn: resources::fqdn(&service, &view.mesh_domain),
        vip: loaded.and_then(|s| s.vip.parse().ok()).or(record_vip),
        ports: loaded.map(|s| s.ports.keys().copied().collect()).unwrap_or_default(),
        endpoints: loaded.and_then(|s| s.endpoints).map_or(0, |e| e.len()),
        loaded: loaded.is_some(),
        service,
        port,
        by_ip,
    })
}

fn dns_facts(records: &Result<RecordFile, String>, target: Option<&Target>) -> DnsFacts {
    let file = match records {
        Ok(file) => file,
        Err(e) => {
            return DnsFacts {
                record: None,
                file_error: Some(e.clone()),
                answer: None,
            };
        }
    };
    let record = target.and_then(|t| {
        let (ns, name) = t.service.split_once('/')?;
        let a = file.records.get(&(ns.to_owned(), name.to_owned()))?;
        Some(a.v4.map(IpAddr::V4).into_iter().chain(a.v6.map(IpAddr::V6)).collect())
    });
    DnsFacts {
        record,
        file_error: None,
        answer: None,
    }
}

/// mesh-dns's own answer for the target's name, when the node runs one.
async fn dns_answer(inspector: &Inspector, target: Option<&Target>) -> Option<(String, Result<Vec<IpAddr>, String>)> {
    let (addr, target) = (inspector.mesh_dns?, target.filter(|t| !t.by_ip)?);
    Some((addr.to_string(), super::mesh_dns::resolve(addr, &target.fqdn).await))
}

async fn capture(inspector: &Inspector, pod: &LocalPod) -> Capture {
    match crate::capture::check(&inspector.capture, &pod.container_id, &pod.netns).await {
        Ok(crate::capture::Verdict::Intact(counters)) => Capture::Intact {
            captured: counters.captured,
        },
        Ok(crate::capture::Verdict::Drifted) => Capture::Drifted,
        Ok(crate::capture::Verdict::NotCaptured) => Capture::NotCaptured,
        Err(e) => Capture::Error(e.to_string()),
    }
}

/// How the newest Envoy took the named resources (all of them must be ACKed).
pub fn resource(view: &NodeView, type_url: &str, names: &[String]) -> Resource {
    let newest = view.streams.newest();
    let served = |name: &String| view.snapshot.version_of(type_url, name);
    let rejected = names.iter().find_map(|name| {
        let (version, error) = newest?.rejected.get(&(type_url.to_owned(), name.clone()))?;
        (Some(version.as_str()) == served(name)).then(|| error.clone())
    });
    Resource {
        served: !names.is_empty() && names.iter().all(|n| served(n).is_some()),
        acked: names.iter().all(|name| {
            let acked = newest.and_then(|s| s.acked.get(type_url)?.get(name));
            acked.is_some() && acked.map(String::as_str) == served(name)
        }),
        rejected,
    }
}

async fn envoy_facts(inspector: &Inspector, view: &NodeView, pod: &LocalPod, target: &Target) -> EnvoyFacts {
    let listeners: Vec<String> = resources::pod_listener_names(pod).into_iter().collect();
    let services = resources::services(&view.watched.catalog, &view.mesh_domain);
    let service = services.iter().find(|s| s.key == target.service);
    let cluster = service
        .and_then(|s| target.port.or(s.default_port()).map(|port| s.cluster(port)))
        .filter(|name| view.snapshot.version_of(xds::CLUSTER, name).is_some());
    let hosts = match &cluster {
        Some(name) => match inspector.envoy.get("/clusters?format=json").await {
            Ok(body) => Some(super::envoy::hosts(&body).remove(name).unwrap_or_default()),
            Err(_) => None,
        },
        None => None,
    };
    EnvoyFacts {
        connected: view.streams.newest().is_some(),
        listener: resource(view, xds::LISTENER, &listeners),
        cluster: cluster.map(|name| {
            let r = resource(view, xds::CLUSTER, std::slice::from_ref(&name));
            (name, r)
        }),
        hosts,
    }
}

/// The routes the agent serves on the target's port to `pod`: the valid ones attached to
/// it as the pod's namespace sees them (TCP and TLS routes on a TCP port, the others on an
/// HTTP port), and the invalid ones naming the service.
fn route_facts(view: &NodeView, pod: &LocalPod, target: &Target) -> Option<RouteFacts> {
    let catalog = &view.watched.catalog;
    let services = resources::services(catalog, &view.mesh_domain);
    let service = services.iter().find(|s| s.key == target.service)?;
    let port = target.port.or(service.default_port())?;
    let protocol = *service.ports.get(&port)?;
    let mut facts = RouteFacts {
        port,
        http: resources::is_http(protocol),
        ..Default::default()
    };
    let naming = catalog
        .routes
        .values()
        .filter(|r| r.parents.iter().any(|p| p.service == target.service))
        .filter(|r| resources::routes_connections(r) != facts.http);
    let mut valid = Vec::new();
    for route in naming {
        match resources::check_route(route) {
            Ok(()) => valid.push(route.as_ref()),
            Err(error) => facts.skipped.push((aether_proto::view::route_key(route), error)),
        }
    }
    let attached = resources::Attached::new(valid);
    let on_port = attached.on(service, port, Some(&pod.info.namespace));
    facts.routes = on_port.into_iter().cloned().collect();
    facts.known_backends = facts
        .routes
        .iter()
        .flat_map(aether_api::backend_services)
        .filter(|s| catalog.services.contains_key(*s))
        .map(str::to_owned)
        .collect();
    Some(facts)
}

async fn identity_facts(view: &NodeView, pod: &LocalPod, target: &Target) -> Option<IdentityFacts> {
    let identities = view.identities.as_ref()?;
    let svid = identities.svids.get(&pod.id()).map(|s| Svid {
        spiffe_id: s.spiffe_id.clone(),
        not_before: s.not_before,
        not_after: s.not_after,
    });
    let secret = crate::identity::svid_secret(&pod.id());
    let endpoints: Vec<&Endpoint> = view
        .watched
        .catalog
        .endpoints
        .get(&target.service)
        .map(|e| e.values().collect())
        .unwrap_or_default();
    let mtls = Mtls {
        trust_domain: identities.trust_domain.clone(),
    };
    let local_pod = |e: &&Endpoint| {
        view.pods
            .iter()
            .find(|p| p.ips.iter().any(|ip| ip.to_string() == e.address))
    };
    let local_destinations = endpoints
        .iter()
        .filter_map(local_pod)
        .filter_map(|p| Some((p.id(), identities.svids.get(&p.id())?.spiffe_id.clone())))
        .collect();
    let remote: Vec<(String, String)> = endpoints
        .iter()
        .filter(|e| local_pod(e).is_none())
        .map(|e| (e.address.clone(), e.node.clone()))
        .collect();
    let remote_destinations = match identities.svids.get(&pod.id()) {
        Some(svid) if !remote.is_empty() => san_probe::probe(svid, &identities.bundles, &remote).await,
        _ => Vec::new(),
    };
    Some(IdentityFacts {
        svid,
        secret_acked: resource(view, xds::SECRET, &[secret]).acked,
        expected_sans: resources::server_sans(&mtls, &target.service, &endpoints),
        local_destinations,
        remote_destinations,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_are_names_urls_keys_or_vips() {
        let d = &["aether.internal", "corp.internal"];
        let svc = |k: &str, p| Some(Name::Service(k.into(), p));
        let cases = [
            ("backend", svc("demo/backend", None)),
            ("backend:8080", svc("demo/backend", Some(8080))),
            ("backend.shop", svc("shop/backend", None)),
            ("shop/backend", svc("shop/backend", None)),
            ("shop/backend:81", svc("shop/backend", Some(81))),
            ("backend.shop.aether.internal", svc("shop/backend", None)),
            ("backend.shop.corp.internal.", svc("shop/backend", None)),
            (
                "http://backend.shop.aether.internal:8080/a/b?c",
                svc("shop/backend", Some(8080)),
            ),
            ("https://backend/x", svc("demo/backend", None)),
            (
                "240.240.0.7:80",
                Some(Name::Ip("240.240.0.7".parse().unwrap(), Some(80))),
            ),
            (
                "http://240.240.0.7/",
                Some(Name::Ip("240.240.0.7".parse().unwrap(), None)),
            ),
            ("Bad_Name", None),
            ("backend:http", None),
        ];
        for (text, want) in cases {
            assert_eq!(parse_target(text, "demo", d), want, "{text}");
        }
    }

    #[test]
    fn a_url_gives_the_request_and_a_bare_service_none() {
        let path = |text: &str| request_of(text, None, &[]).map(|r| r.path);
        assert_eq!(path("http://backend.demo:8080/a/b?c=1").as_deref(), Some("/a/b?c=1"));
        assert_eq!(path("http://backend.demo:8080?c=1").as_deref(), Some("/?c=1"));
        assert_eq!(path("http://backend.demo").as_deref(), Some("/"));
        assert_eq!(path("backend.demo:8080"), None);
        let headers = [("x-env".to_owned(), "canary".to_owned())];
        let request = request_of("backend", Some("post"), &headers).unwrap();
        assert_eq!(request.to_string(), "POST / [x-env: canary]");
    }
}
