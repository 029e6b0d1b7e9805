//! The delta stream, step by step: each step (a snapshot published, a request from
//! Envoy) and what it must put out, as one line: the ACK-state records, then the
//! responses (`send <nonce> <type> +<name><version> -<removed>`), comma-separated.

use super::*;
use crate::xds::testing::{self, read, serving, version};
use crate::xds::{CLUSTER, LISTENER, ROUTE, VIRTUAL_HOST, short};
use envoy_types::pb::google::rpc;

type Step = testing::Step<DeltaStream>;

/// Runs `steps` through one new stream, checking what each puts out.
fn run(steps: Vec<(Step, &str)>) {
    testing::run(steps, response);
}

fn response(response: &DeltaDiscoveryResponse) -> String {
    let added = (response.resources.iter()).map(|r| format!(" +{}", read(r.resource.as_ref().unwrap())));
    let removed = response.removed_resources.iter().map(|name| format!(" -{name}"));
    let changes: String = added.chain(removed).collect();
    format!("send {} {}{changes}", response.nonce, short(&response.type_url))
}

/// The cache serves these clusters (`"a=1 b=2"`).
fn publish(serial: u64, clusters: &str) -> Step {
    Step::Publish(serving(serial, &[(CLUSTER, clusters)]))
}

/// [`publish`], with `looked_up` being looked up on demand.
fn publish_pending(serial: u64, clusters: &str, looked_up: &str) -> Step {
    let mut snapshot = serving(serial, &[(CLUSTER, clusters)]);
    snapshot.pending.insert((CLUSTER.into(), looked_up.into()));
    Step::Publish(snapshot)
}

fn strings(names: &[&str]) -> Vec<String> {
    names.iter().map(|n| n.to_string()).collect()
}

fn request(subscribe: &[&str], unsubscribe: &[&str], nonce: &str) -> DeltaDiscoveryRequest {
    DeltaDiscoveryRequest {
        type_url: CLUSTER.into(),
        resource_names_subscribe: strings(subscribe),
        resource_names_unsubscribe: strings(unsubscribe),
        response_nonce: nonce.into(),
        ..Default::default()
    }
}

fn subscribe(names: &[&str]) -> Step {
    Step::Request(Box::new(request(names, &[], "")))
}

fn unsubscribe(names: &[&str]) -> Step {
    Step::Request(Box::new(request(&[], names, "")))
}

fn ack(nonce: &str) -> Step {
    Step::Request(Box::new(request(&[], &[], nonce)))
}

fn nack(nonce: &str, error: &str) -> Step {
    let error_detail = Some(rpc::Status {
        message: error.into(),
        ..Default::default()
    });
    Step::Request(Box::new(DeltaDiscoveryRequest {
        error_detail,
        ..request(&[], &[], nonce)
    }))
}

/// The same request, for another type.
fn of_type(type_url: &str, step: Step) -> Step {
    match step {
        Step::Request(request) => Step::Request(Box::new(DeltaDiscoveryRequest {
            type_url: type_url.into(),
            ..*request
        })),
        publish => publish,
    }
}

#[test]
fn a_first_request_subscribes_by_name_and_gets_the_current_resources() {
    run(vec![
        (publish(1, "a=1 b=2"), ""),
        (subscribe(&["a"]), "send 1 Cluster +a1"),
        (subscribe(&["b"]), "send 2 Cluster +b2"),
        (publish(2, "a=2 b=2 c=3"), "send 3 Cluster +a2"),
    ]);
}

#[test]
fn a_wildcard_gets_everything_until_it_is_unsubscribed() {
    run(vec![
        (publish(1, "a=1 b=2"), ""),
        // A first request naming nothing is the legacy wildcard.
        (subscribe(&[]), "send 1 Cluster +a1 +b2"),
        (publish(2, "a=1 c=3"), "send 2 Cluster +c3 -b"),
        (unsubscribe(&["*"]), "forget Cluster *"),
        (publish(3, "a=2 c=3 d=4"), ""),
    ]);
    run(vec![
        (publish(1, "a=1 b=2"), ""),
        (subscribe(&["*", "b", "x"]), "send 1 Cluster +a1 +b2 -x"),
        // Gone, though subscribed by name too: reported once.
        (publish(2, "a=1"), "send 2 Cluster -b"),
        (publish(3, "a=2"), "send 3 Cluster +a2"),
    ]);
}

#[test]
fn an_ack_records_what_envoy_runs_once() {
    run(vec![
        (publish(1, "a=1 b=2"), ""),
        (subscribe(&["a", "b"]), "send 1 Cluster +a1 +b2"),
        (publish(2, "a=1"), "send 2 Cluster -b"),
        (ack("1"), "ack Cluster +a +b"),
        (ack("2"), "ack Cluster -b"),
        // Answered already, unknown, or no nonce at all: nothing to record.
        (ack("2"), ""),
        (ack("9"), ""),
        (ack(""), ""),
    ]);
}

#[test]
fn a_nack_records_the_error_and_nothing_is_resent_until_the_resource_changes() {
    run(vec![
        (publish(1, "a=1"), ""),
        (subscribe(&["a"]), "send 1 Cluster +a1"),
        (publish(2, "a=2"), "send 2 Cluster +a2"),
        (ack("1"), "ack Cluster +a"),
        (nack("2", "bad field"), "nack Cluster +a (bad field)"),
        (publish(3, "a=2 b=1"), ""),
        (publish(4, "a=3"), "send 3 Cluster +a3"),
        (ack("3"), "ack Cluster +a"),
    ]);
}

#[test]
fn an_unsubscribed_name_is_forgotten_and_not_pushed_again() {
    run(vec![
        (publish(1, "a=1 b=2"), ""),
        (subscribe(&["a", "b"]), "send 1 Cluster +a1 +b2"),
        (unsubscribe(&["b"]), "forget Cluster b"),
        (publish(2, "a=1 b=3"), ""),
        // Subscribing again sends it again: Envoy dropped it.
        (subscribe(&["b"]), "send 2 Cluster +b3"),
    ]);
}

#[test]
fn an_unchanged_resource_is_not_resent() {
    run(vec![
        (publish(1, "a=1 b=1"), ""),
        (subscribe(&[]), "send 1 Cluster +a1 +b1"),
        (publish(2, "a=1 b=1"), ""),
        (publish(3, "a=1 b=2"), "send 2 Cluster +b2"),
    ]);
}

#[test]
fn a_resource_removed_from_the_cache_is_reported_once_and_comes_back() {
    run(vec![
        (publish(1, "a=1 b=1"), ""),
        (subscribe(&["a"]), "send 1 Cluster +a1"),
        (publish(2, "b=1"), "send 2 Cluster -a"),
        (publish(3, "b=2"), ""),
        (publish(4, "a=1"), "send 3 Cluster +a1"),
    ]);
}

#[test]
fn a_name_looked_up_on_demand_waits_for_the_lookup() {
    // Found: Envoy's initial fetch is answered empty, then the cluster comes.
    run(vec![
        (publish_pending(1, "a=1", "x"), ""),
        (subscribe(&["x"]), "send 1 Cluster"),
        (publish(2, "a=1 x=1"), "send 2 Cluster +x1"),
    ]);
    // Not found: reported absent once the lookup ends, once.
    run(vec![
        (publish_pending(1, "a=1", "x"), ""),
        (subscribe(&["x"]), "send 1 Cluster"),
        (publish(2, "a=1"), "send 2 Cluster -x"),
        (publish(3, "a=2"), ""),
        (publish(4, "x=1"), "send 3 Cluster +x1"),
    ]);
}

#[test]
fn on_demand_names_are_those_subscribed_and_not_served() {
    let snapshot = serving(1, &[(CLUSTER, "a=1")]);
    let names = |r: &DeltaDiscoveryRequest| DeltaStream::on_demand(r, &snapshot).map(|(t, n)| (t.to_owned(), n));
    let missing = Some((CLUSTER.to_owned(), strings(&["x", "y"])));
    assert_eq!(names(&request(&["a", "x", "*", "y"], &[], "")), missing);
    assert_eq!(names(&request(&["a", "*"], &[], "")), None);
    assert_eq!(names(&request(&[], &["x"], "")), None);
    let listeners = DeltaDiscoveryRequest {
        type_url: LISTENER.into(),
        ..request(&["a"], &[], "")
    };
    assert_eq!(names(&listeners), Some((LISTENER.to_owned(), strings(&["a"]))));
}

#[test]
fn a_reconnecting_envoy_is_sent_only_what_it_does_not_run() {
    let initial = [("a", "1"), ("b", "1")].map(|(name, v)| (name.to_owned(), version(name, v)));
    let reconnect = DeltaDiscoveryRequest {
        initial_resource_versions: initial.into_iter().collect(),
        ..request(&[], &[], "")
    };
    run(vec![
        (publish(1, "a=1 b=2"), ""),
        (
            Step::Request(Box::new(reconnect)),
            "running Cluster +a +b, send 1 Cluster +b2",
        ),
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
    run(vec![
        (both(1, 1), ""),
        (of_type(LISTENER, subscribe(&[])), "send 1 Listener +l1"),
        (subscribe(&[]), "send 2 Cluster +c1"),
        (both(2, 2), "send 3 Cluster +c2, send 4 Listener +l2"),
        (of_type(LISTENER, ack("4")), "ack Listener +l"),
    ]);
}

#[test]
fn an_empty_type_answers_the_initial_fetch_once_and_responses_carry_the_serial() {
    run(vec![
        (subscribe(&[]), "send 1 Cluster"),
        (publish(5, ""), ""),
        (nack("1", "?"), "nack Cluster (?)"),
    ]);
    let mut stream = DeltaStream::default();
    let Step::Request(first) = subscribe(&["a"]) else {
        unreachable!()
    };
    stream.request(&first);
    let responses = stream.push(&serving(7, &[(CLUSTER, "a=1")]), Instant::now());
    assert_eq!(responses[0].system_version_info, "7");
    assert_eq!(responses[0].resources[0].version, version("a", "1"));
}

#[test]
fn a_tables_virtual_hosts_are_sent_once_envoy_holds_the_table_and_again_for_each_new_version() {
    let serve =
        |serial, tables: &str, vhosts: &str| Step::Publish(serving(serial, &[(ROUTE, tables), (VIRTUAL_HOST, vhosts)]));
    run(vec![
        (serve(1, "t=1", "t/a=1 t/b=2 u/a=3"), ""),
        // Envoy's VHDS subscription names nothing: nothing is sent before it holds a table.
        (of_type(VIRTUAL_HOST, subscribe(&[])), "send 1 VirtualHost"),
        (of_type(ROUTE, subscribe(&["t"])), "send 2 RouteConfiguration +t1"),
        (
            of_type(ROUTE, ack("2")),
            "ack RouteConfiguration +t, send 3 VirtualHost +t/a1 +t/b2",
        ),
        // A host added or changed goes alone; one gone is removed.
        (
            serve(2, "t=1", "t/a=1 t/b=5 t/c=6 u/a=3"),
            "send 4 VirtualHost +t/b5 +t/c6",
        ),
        (serve(3, "t=1", "t/a=1 t/c=6 u/a=3"), "send 5 VirtualHost -t/b"),
        // A new version of the table may restart Envoy's watch: its hosts go again.
        (serve(4, "t=2", "t/a=1 t/c=6 u/a=3"), "send 6 RouteConfiguration +t2"),
        (
            of_type(ROUTE, ack("6")),
            "ack RouteConfiguration +t, send 7 VirtualHost +t/a1 +t/c6",
        ),
    ]);
}
