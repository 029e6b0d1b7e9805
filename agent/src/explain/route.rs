//! The route hop: which rule of the routes attached to the target's port takes the
//! request, walked in the precedence order the agent compiles into Envoy
//! (`aether_api::route::order`), and what that rule does with it.

use std::collections::BTreeSet;

use aether_api::route::order::{MatchRef, first_match, ordered_matches};
use aether_api::route::request::Request;
use aether_proto::registry::v1::path_modifier::Modifier;
use aether_proto::registry::v1::{Redirect, Route, route_filter::Filter};
use aether_proto::view::route_key;
use serde::Serialize;

use super::{Facts, Hop, Status, Target, hop, list, ok};

/// What the agent serves on the target's port for the calling pod.
#[derive(Clone, Debug, Default)]
pub struct RouteFacts {
    /// The service port the routes were looked up on.
    pub port: u32,
    /// The port speaks HTTP (routes apply to HTTP ports only).
    pub http: bool,
    /// The valid routes attached to the port as the pod sees them: consumer routes of its
    /// namespace replace the producer's (`xds::resources::Attached::on`).
    pub routes: Vec<Route>,
    /// Routes naming the service that the agent skips as invalid: key and why.
    pub skipped: Vec<(String, String)>,
    /// The services the routes send to that the node's catalog holds.
    pub known_backends: BTreeSet<String>,
}

/// The route facts and the judgement, for `-o json`.
#[derive(Clone, Debug, Serialize)]
pub struct RouteReport {
    pub port: u32,
    /// Route keys, `<kind>/<ns>/<name>`.
    pub attached: Vec<String>,
    pub skipped: Vec<Skipped>,
    /// What was judged: the URL's request, or a plain `GET /` for a service.
    pub request: Request,
    /// The rule that takes the request; `None`: none does (404).
    pub matched: Option<Matched>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Skipped {
    pub route: String,
    pub error: String,
}

#[derive(Clone, Debug, Serialize)]
pub struct Matched {
    pub route: String,
    pub rule_index: usize,
    /// Empty when the rule has none.
    pub rule_name: String,
    /// The match within the rule; `None`: a rule without matches.
    pub match_index: Option<usize>,
    /// A route in the caller's namespace, not the service's.
    pub consumer: bool,
    pub action: Action,
}

#[derive(Clone, Debug, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Action {
    /// Weighted backends (zero weights left out).
    Backends {
        backends: Vec<Backend>,
    },
    Redirect {
        status: u32,
        to: String,
    },
    /// Nowhere to go: Envoy answers 500 (Gateway API).
    NoBackend,
}

#[derive(Clone, Debug, Serialize)]
pub struct Backend {
    pub service: String,
    pub port: u32,
    pub weight: u32,
    pub in_catalog: bool,
}

impl Backend {
    fn name(&self) -> String {
        format!("{}:{}", self.service, self.port)
    }
}

/// The report for `f`, when routes apply to its target's port.
pub fn report(f: &Facts) -> Option<RouteReport> {
    let r = f.route.as_ref().filter(|r| r.http)?;
    let routes: Vec<&Route> = r.routes.iter().collect();
    let request = f.request.clone().unwrap_or_else(|| Request::get("/"));
    let ordered = ordered_matches(&routes);
    let service_ns = f
        .target
        .as_ref()
        .and_then(|t| t.service.split_once('/'))
        .map(|(ns, _)| ns);
    let matched = first_match(&ordered, &request).map(|m| Matched {
        route: route_key(m.route),
        rule_index: m.rule_index,
        rule_name: m.rule().name.clone(),
        match_index: m.match_index,
        consumer: Some(m.route.namespace.as_str()) != service_ns,
        action: action(m, r),
    });
    Some(RouteReport {
        port: r.port,
        attached: routes.iter().map(|r| route_key(r)).collect(),
        skipped: r
            .skipped
            .iter()
            .map(|(route, error)| Skipped {
                route: route.clone(),
                error: error.clone(),
            })
            .collect(),
        request,
        matched,
    })
}

fn action(m: &MatchRef, r: &RouteFacts) -> Action {
    let rule = m.rule();
    let redirect = rule.filters.iter().find_map(|f| match &f.filter {
        Some(Filter::RequestRedirect(redirect)) => Some(redirect),
        _ => None,
    });
    if let Some(redirect) = redirect {
        return Action::Redirect {
            status: if redirect.status_code == 0 {
                302
            } else {
                redirect.status_code
            },
            to: redirect_target(redirect),
        };
    }
    let backends: Vec<Backend> = rule
        .backends
        .iter()
        .filter(|b| b.weight > 0)
        .map(|b| Backend {
            service: b.service.clone(),
            port: if b.port == 0 { r.port } else { b.port },
            weight: b.weight,
            in_catalog: r.known_backends.contains(&b.service),
        })
        .collect();
    match backends.is_empty() {
        true => Action::NoBackend,
        false => Action::Backends { backends },
    }
}

/// The parts of the location a redirect sets; the request keeps the rest.
fn redirect_target(redirect: &Redirect) -> String {
    let mut parts = Vec::new();
    for (what, value) in [("scheme", &redirect.scheme), ("hostname", &redirect.hostname)] {
        if !value.is_empty() {
            parts.push(format!("{what} {value}"));
        }
    }
    if redirect.port != 0 {
        parts.push(format!("port {}", redirect.port));
    }
    match redirect.path.as_ref().and_then(|p| p.modifier.as_ref()) {
        Some(Modifier::ReplaceFullPath(path)) => parts.push(format!("path {path}")),
        Some(Modifier::ReplacePrefixMatch(prefix)) => parts.push(format!("matched prefix → {prefix}")),
        None => {}
    }
    match parts.is_empty() {
        true => "the same location".into(),
        false => parts.join(", "),
    }
}

/// Judges the route hop (see [`report`]).
pub fn judge(f: &Facts) -> Hop {
    let Some(t) = &f.target else {
        return hop("route", Status::Skip, "not checked", "");
    };
    if let Some(r) = f.route.as_ref().filter(|r| !r.http && !r.routes.is_empty()) {
        return connection_routes(r);
    }
    let Some(report) = report(f) else {
        return hop("route", Status::Skip, not_judged(t, f.route.as_ref()), "");
    };
    if report.attached.is_empty() {
        if let Some(s) = report.skipped.first() {
            let why = format!(
                "route {} names {} but the agent skips it as invalid ({}): default routing",
                s.route, t.service, s.error
            );
            return hop(
                "route",
                Status::Warn,
                why,
                "fix the route; the registrar's log and its status name the field",
            );
        }
        return ok(
            "route",
            "no route attached: default routing (retries, outlier ejection)",
        );
    }
    let Some(m) = &report.matched else {
        return no_rule(f, &report);
    };
    let name = match m.rule_name.as_str() {
        "" => String::new(),
        name => format!(" ({name})"),
    };
    let mut taken = format!("route {} rule {}{name}", m.route, m.rule_index);
    if m.consumer {
        taken.push_str(", a consumer route of the pod's namespace,");
    }
    let lead = match f.request {
        None => format!(
            "{} attached; a plain {} takes {taken}",
            list(&report.attached),
            report.request
        ),
        Some(_) => format!("{} takes {taken}", report.request),
    };
    action_hop(lead, &m.action)
}

/// A TCP port with TCP or TLS routes: each connection takes one of their backends.
fn connection_routes(r: &RouteFacts) -> Hop {
    let keys: Vec<String> = r.routes.iter().map(route_key).collect();
    let by_name = r.routes.iter().any(|route| !route.hostnames.is_empty());
    let how = match by_name {
        true => "chosen by the TLS server name, then split by weight",
        false => "split by weight",
    };
    let why = format!(
        "port {} is a TCP stream; {} attached: connections {how}",
        r.port,
        list(&keys)
    );
    ok("route", why)
}

fn not_judged(t: &Target, r: Option<&RouteFacts>) -> String {
    match r {
        Some(r) => format!(
            "port {} is not HTTP and no TCP or TLS route shapes it: default routing",
            r.port
        ),
        None if !t.loaded => "not loaded yet: its routes come with it on the first call".into(),
        None if t.endpoints == 0 => "no endpoints: the service answers 503 before any route".into(),
        None => "not judged: the service does not serve the port asked for".into(),
    }
}

fn no_rule(f: &Facts, report: &RouteReport) -> Hop {
    let why = format!("404: no rule of {} matches {}", list(&report.attached), report.request);
    let fix = "add a rule or a PathPrefix / match (a rule without matches takes every request)";
    match f.request {
        Some(_) => hop("route", Status::Fail, why, fix),
        // A service without URL: `GET /` is only an example of a call.
        None => hop(
            "route",
            Status::Warn,
            format!("{why}; give a URL (and -X, -H) to judge the call you make"),
            fix,
        ),
    }
}

fn action_hop(lead: String, action: &Action) -> Hop {
    let backends = match action {
        Action::Redirect { status, to } => return ok("route", format!("{lead}: redirect {status} ({to})")),
        Action::NoBackend => {
            return hop(
                "route",
                Status::Fail,
                format!("{lead}, which has no backend: Envoy answers 500"),
                "give the rule a backendRef with a weight above 0, or a redirect",
            );
        }
        Action::Backends { backends } => backends,
    };
    let missing: Vec<String> = backends.iter().filter(|b| !b.in_catalog).map(Backend::name).collect();
    let total: u64 = backends.iter().map(|b| u64::from(b.weight)).sum();
    let shown: Vec<String> = backends
        .iter()
        .map(|b| match backends.len() {
            1 => b.name(),
            _ => format!("{} (weight {} of {total})", b.name(), b.weight),
        })
        .collect();
    let fix = "start the backend (a registered pod serving it) or fix the rule's backendRefs";
    if missing.len() == backends.len() {
        let why = format!(
            "{lead}, whose backend(s) {} are not in the mesh catalog: Envoy answers 500",
            list(&missing)
        );
        return hop("route", Status::Fail, why, fix);
    }
    if !missing.is_empty() {
        let why = format!(
            "{lead}: {}; {} not in the mesh catalog: that share answers 500",
            list(&shown),
            list(&missing)
        );
        return hop("route", Status::Warn, why, fix);
    }
    ok("route", format!("{lead}: {}", list(&shown)))
}
