//! The state-of-the-world stream, step by step: each step (a snapshot published, a
//! request from Envoy) and what it must put out, as one line: the ACK-state records,
//! then the responses (`send <nonce> <type> <name><version>…`), comma-separated.

use std::collections::BTreeMap;

use super::*;
use crate::xds::cache::Resource;
use crate::xds::testing::{self, read, record, serving};
use crate::xds::{CLUSTER, LISTENER, ROUTE, VIRTUAL_HOST, short};
use envoy_types::pb::envoy::config::route::v3::{RouteConfiguration, Vhds, VirtualHost};
use envoy_types::pb::google::protobuf::Any;
use envoy_types::pb::google::rpc;
use prost::{Message, Name};

type Step = testing::Step<SotwStream>;

/// Runs `steps` through one new stream, checking what each puts out.
fn run(steps: Vec<(Step, &str)>) {
    testing::run(steps, response);
}

fn response(response: &DiscoveryResponse) -> String {
    let bodies: String = response
        .resources
        .iter()
        .map(|body| format!(" {}", read(body)))
        .collect();
    format!("send {} {}{bodies}", response.nonce, short(&response.type_url))
}

fn publish(serial: u64, clusters: &str) -> Step {
    Step::Publish(serving(serial, &[(CLUSTER, clusters)]))
}

fn request(names: &[&str], nonce: &str) -> DiscoveryRequest {
    DiscoveryRequest {
        type_url: CLUSTER.into(),
        resource_names: names.iter().map(|n| n.to_string()).collect(),
        response_nonce: nonce.into(),
        ..Default::default()
    }
}

/// Envoy asks for `names` (none: all), answering `nonce` (an ACK).
fn ask(names: &[&str], nonce: &str) -> Step {
    Step::Request(Box::new(request(names, nonce)))
}

fn nack(names: &[&str], nonce: &str, error: &str) -> Step {
    let error_detail = Some(rpc::Status {
        message: error.into(),
        ..Default::default()
    });
    Step::Request(Box::new(DiscoveryRequest {
        error_detail,
        ..request(names, nonce)
    }))
}

#[test]
fn a_first_request_gets_its_whole_selection() {
    run(vec![
        (publish(1, "a=1 b=2"), ""),
        (ask(&["a", "x"], ""), "send 1 Cluster a1"),
        // Asking for everything, answering the first response.
        (ask(&[], "1"), "ack all Cluster +a, send 2 Cluster a1 b2"),
        (publish(2, "a=1 b=2 c=3"), "send 3 Cluster a1 b2 c3"),
    ]);
}

#[test]
fn only_the_last_nonce_of_a_type_answers_and_only_once() {
    run(vec![
        (publish(1, "a=1"), ""),
        (ask(&[], ""), "send 1 Cluster a1"),
        (publish(2, "a=2"), "send 2 Cluster a2"),
        // Superseded by nonce 2: ignored.
        (ask(&[], "1"), ""),
        (ask(&[], "2"), "ack all Cluster +a"),
        (ask(&[], "2"), ""),
        (ask(&[], "7"), ""),
    ]);
}

#[test]
fn the_version_info_of_a_request_is_not_consulted() {
    let stale = DiscoveryRequest {
        version_info: "an older version".into(),
        ..request(&[], "1")
    };
    run(vec![
        (publish(1, "a=1"), ""),
        (ask(&[], ""), "send 1 Cluster a1"),
        (Step::Request(Box::new(stale)), "ack all Cluster +a"),
    ]);
}

#[test]
fn a_nack_records_the_error_and_nothing_is_resent_until_the_selection_changes() {
    run(vec![
        (publish(1, "a=1 b=1"), ""),
        (ask(&["a"], ""), "send 1 Cluster a1"),
        (nack(&["a"], "1", "bad field"), "nack Cluster +a (bad field)"),
        (publish(2, "a=1 b=2"), ""),
        (publish(3, "a=2 b=2"), "send 2 Cluster a2"),
        (ask(&["a"], "2"), "ack all Cluster +a"),
    ]);
}

#[test]
fn a_removed_resource_leaves_the_whole_set_and_the_same_selection_is_not_resent() {
    run(vec![
        (publish(1, "a=1 b=2"), ""),
        (ask(&[], ""), "send 1 Cluster a1 b2"),
        (publish(2, "a=1"), "send 2 Cluster a1"),
        (ask(&[], "2"), "ack all Cluster +a"),
        (publish(3, "a=1"), ""),
        // Asking for what is served, by name, selects the same set.
        (ask(&["a", "b"], ""), ""),
        (publish(4, ""), "send 3 Cluster"),
    ]);
}

#[test]
fn types_are_pushed_in_push_order_once_asked_for() {
    let both = |serial, version| {
        let (cluster, listener) = (format!("c={version}"), format!("l={version}"));
        Step::Publish(serving(
            serial,
            &[(CLUSTER, cluster.as_str()), (LISTENER, listener.as_str())],
        ))
    };
    let listeners = |nonce: &str| {
        Step::Request(Box::new(DiscoveryRequest {
            type_url: LISTENER.into(),
            ..request(&[], nonce)
        }))
    };
    run(vec![
        (both(1, 1), ""),
        (listeners(""), "send 1 Listener l1"),
        (ask(&[], ""), "send 2 Cluster c1"),
        (both(2, 2), "send 3 Cluster c2, send 4 Listener l2"),
        // A cluster nonce on a listener request answers nothing.
        (listeners("3"), ""),
        (listeners("4"), "ack all Listener +l"),
    ]);
}

/// A resource of `message`, named `name`.
fn resource<M: Message + Name>(name: &str, message: &M) -> Arc<Resource> {
    let body = Any {
        type_url: M::type_url(),
        value: message.encode_to_vec(),
    };
    Resource::new(name.into(), body)
}

/// Table `t` (with VHDS) and `inbound|p` (without), each with a catch-all; virtual hosts
/// `t/a`, `t/b` (answering to `b_domain`) and `t~web/c`.
fn tables_and_hosts(serial: u64, b_domain: &str) -> Snapshot {
    let vhost = |name: &str, domain: &str| {
        let vhost = VirtualHost {
            name: name.into(),
            domains: vec![domain.into()],
            ..Default::default()
        };
        resource(name, &vhost)
    };
    let table = |name: &str, vhds: bool| {
        let table = RouteConfiguration {
            name: name.into(),
            virtual_hosts: vec![VirtualHost {
                name: "catch-all".into(),
                domains: vec!["*".into()],
                ..Default::default()
            }],
            vhds: vhds.then(Vhds::default),
            ..Default::default()
        };
        resource(name, &table)
    };
    let by_name = |items: Vec<Arc<Resource>>| items.into_iter().map(|r| (r.name.clone(), r)).collect();
    Snapshot {
        serial,
        types: BTreeMap::from([
            (
                ROUTE.to_owned(),
                by_name(vec![table("t", true), table("inbound|p", false)]),
            ),
            (
                VIRTUAL_HOST.to_owned(),
                by_name(vec![vhost("t/a", "a"), vhost("t/b", b_domain), vhost("t~web/c", "c")]),
            ),
        ]),
        pending: Default::default(),
    }
}

/// Each table a response carries: its name, whether it names VHDS, its virtual hosts.
fn tables_served(response: &DiscoveryResponse) -> Vec<(String, bool, Vec<String>)> {
    (response.resources.iter())
        .map(|body| RouteConfiguration::decode(&*body.value).unwrap())
        .map(|t| {
            (
                t.name,
                t.vhds.is_some(),
                t.virtual_hosts.into_iter().map(|v| v.name).collect(),
            )
        })
        .collect()
}

/// VHDS is delta-only: an Envoy on SotW gets each outbound table with its virtual hosts
/// inline (and without `vhds`), a host changed re-sends its table, and the ACK of the
/// tables counts for the hosts in them.
#[test]
fn a_route_table_goes_with_its_virtual_hosts_inline_and_its_ack_covers_them() {
    let ask_routes = |nonce: &str| DiscoveryRequest {
        type_url: ROUTE.into(),
        response_nonce: nonce.into(),
        ..Default::default()
    };
    let now = std::time::Instant::now();
    let mut stream = SotwStream::default();
    assert!(stream.request(&ask_routes("")).is_empty());
    let first = stream.push(&tables_and_hosts(1, "b"), now);
    assert_eq!(
        tables_served(&first[0]),
        [
            ("inbound|p".to_owned(), false, vec!["catch-all".to_owned()]),
            (
                "t".to_owned(),
                false,
                ["catch-all", "t/a", "t/b"].map(str::to_owned).to_vec()
            ),
        ]
    );
    let acked: Vec<String> = stream.request(&ask_routes("1")).iter().map(record).collect();
    assert_eq!(
        acked,
        [
            "ack all RouteConfiguration +inbound|p +t",
            "ack all VirtualHost +t/a +t/b"
        ]
    );
    assert!(
        stream.push(&tables_and_hosts(1, "b"), now).is_empty(),
        "nothing changed"
    );
    let changed = stream.push(&tables_and_hosts(2, "b2"), now);
    assert_eq!(changed.len(), 1, "a host changed re-sends its table");
    let t = RouteConfiguration::decode(&*changed[0].resources[1].value).unwrap();
    assert_eq!(t.virtual_hosts[2].domains, ["b2"]);
}
