//! A small simulated cluster end to end: 200 agents on their own mTLS connections
//! against two registrar replicas on a real etcd, churn, then one replica killed.
//! Every agent's view must end exactly equal to the registrar's catalog restricted to
//! its filter. A consistency check, not a timing.

use std::time::Duration;

use aether_sim::churn::Churn;
use aether_sim::model::Shape;
use aether_sim::run::{Config, run};
use aether_sim::{raise_fd_limit, registrar_bin};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_agent_converges_to_the_catalog() {
    raise_fd_limit().expect("raising the open-file limit");
    let config = Config {
        shape: Shape {
            seed: 2026,
            nodes: 200,
            services: 60,
            pods_per_node: 10..=30,
            upstreams: 10..=20,
            upstream_skew: 1.0,
            replica_skew: 0.5,
        },
        churn: Churn {
            rate: 20.0,
            duration: Duration::from_secs(10),
        },
        registrar_bin: registrar_bin(),
        etcd_bin: std::env::var("AETHER_ETCD_BIN")
            .unwrap_or_else(|_| "/usr/bin/etcd".into())
            .into(),
        check_views: true,
        holdings: true,
    };
    let figures = run(&config).await.expect("the simulated cluster ran");
    println!("{}", aether_sim::report::table(std::slice::from_ref(&figures)));
    assert_eq!(
        figures.mismatched_views,
        Some(Vec::new()),
        "agents whose view is not the catalog"
    );
    assert!(
        figures.driven.events >= 150,
        "churn ran: {} events",
        figures.driven.events
    );
    assert_eq!(
        figures.outcome.incomplete, 0,
        "every change reached every affected agent"
    );
    assert_eq!(figures.storm.moved, 100);
    assert_eq!(
        (figures.storm.resumed, figures.storm.resynced),
        (100, 0),
        "every moved agent is reconciled from its holdings, none gets a snapshot"
    );
}
