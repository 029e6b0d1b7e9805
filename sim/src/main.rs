//! `aether-sim`: runs the registrar tier at each N given and prints the figures, how
//! they grow, and the projection to 10,000 nodes. See proposals/011-scale.md.

use std::path::PathBuf;
use std::time::Duration;

use aether_sim::churn::Churn;
use aether_sim::model::Shape;
use aether_sim::run::{Config, run};
use aether_sim::{raise_fd_limit, registrar_bin, report};
use clap::Parser;

#[derive(Debug, Parser)]
#[command(about = "Simulate N agents against two registrar replicas on etcd and project to 10,000 nodes")]
struct Flags {
    /// Agent counts to run, one fresh cluster each.
    #[arg(long, value_delimiter = ',', default_value = "1000,2000,5000,10000")]
    agents: Vec<usize>,
    #[arg(long, default_value_t = 22)]
    seed: u64,
    /// Services per node (3,000 services at 10,000 nodes).
    #[arg(long, default_value_t = 0.3)]
    services_per_node: f64,
    #[arg(long, default_value_t = 10)]
    min_pods_per_node: usize,
    #[arg(long, default_value_t = 30)]
    max_pods_per_node: usize,
    #[arg(long, default_value_t = 10)]
    min_upstreams: usize,
    #[arg(long, default_value_t = 20)]
    max_upstreams: usize,
    /// Zipf exponent of how often a service is an upstream.
    #[arg(long, default_value_t = 1.0)]
    upstream_skew: f64,
    /// Zipf exponent of how many replicas a service runs.
    #[arg(long, default_value_t = 0.5)]
    replica_skew: f64,
    /// Pod events per second during churn.
    #[arg(long, default_value_t = 20.0)]
    rate: f64,
    /// Seconds of churn.
    #[arg(long, default_value_t = 60)]
    churn_seconds: u64,
    /// The registrar binary (default: next to this one).
    #[arg(long)]
    registrar_bin: Option<PathBuf>,
    #[arg(long, env = "AETHER_ETCD_BIN", default_value = "/usr/bin/etcd")]
    etcd_bin: PathBuf,
    /// Moved agents do not say what their view holds, so each gets a snapshot (agents
    /// from before holdings; for comparison).
    #[arg(long)]
    without_holdings: bool,
}

impl Flags {
    fn config(&self, agents: usize) -> Config {
        Config {
            shape: Shape {
                seed: self.seed,
                nodes: agents,
                services: ((agents as f64 * self.services_per_node).round() as usize).max(30),
                pods_per_node: self.min_pods_per_node..=self.max_pods_per_node,
                upstreams: self.min_upstreams..=self.max_upstreams,
                upstream_skew: self.upstream_skew,
                replica_skew: self.replica_skew,
            },
            churn: Churn {
                rate: self.rate,
                duration: Duration::from_secs(self.churn_seconds),
            },
            registrar_bin: self.registrar_bin.clone().unwrap_or_else(registrar_bin),
            etcd_bin: self.etcd_bin.clone(),
            check_views: false,
            holdings: !self.without_holdings,
        }
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let flags = Flags::parse();
    let fds = raise_fd_limit()?;
    println!("aether-sim {flags:?}");
    println!(
        "open files: {fds}; registrar: {}",
        flags.config(1).registrar_bin.display()
    );
    let mut runs = Vec::new();
    for &agents in &flags.agents {
        let config = flags.config(agents);
        println!("\n== N = {agents}: {:?}", config.shape);
        // A run that does not finish (e.g. its sync outlasts the phase limit) is a
        // finding too: say so and go on with the next N.
        let figures = match run(&config).await {
            Ok(figures) => figures,
            Err(e) => {
                println!("N = {agents} did not finish: {e}");
                continue;
            }
        };
        println!("{}", report::table(std::slice::from_ref(&figures)));
        for (why, count) in &figures.breaks {
            println!("  {count} streams ended with: {why}");
        }
        runs.push(figures);
    }
    println!("\n{}", report::table(&runs));
    println!("{}", report::projection(&runs));
    Ok(())
}
