//! The figures of each run, side by side, how each cost grows with N, and the
//! projection to the design target with its assumptions.

use std::time::Duration;

use crate::run::Figures;
use crate::stats::{PowerLaw, Spread};

/// The design target (issue 22, proposals/000).
pub const TARGET_NODES: f64 = 10_000.0;
pub const TARGET_PODS: f64 = 100_000.0;
pub const TARGET_SERVICES: f64 = 3_000.0;

fn ms(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1e3)
}

fn spread(s: Spread) -> String {
    format!("{} / {} / {}", ms(s.p50), ms(s.p99), ms(s.max))
}

/// One row of the table: a label and how to read its value off a run.
type Row = (&'static str, fn(&Figures) -> String);

/// The quantities fitted against N, with how they are read off a run.
pub struct Metric {
    pub name: &'static str,
    pub unit: &'static str,
    pub value: fn(&Figures) -> f64,
    /// The goal at the target, if the issue sets one, and whether lower is better.
    pub goal: Option<f64>,
}

pub fn every_affected(f: &Figures) -> Spread {
    Spread::of(&f.outcome.completed.iter().map(|c| c.every).collect::<Vec<_>>())
}

pub fn deliveries_per_change(f: &Figures) -> f64 {
    let completed = &f.outcome.completed;
    completed.iter().map(|c| c.deliveries as f64).sum::<f64>() / completed.len().max(1) as f64
}

pub fn bytes_per_change(f: &Figures) -> f64 {
    let completed = &f.outcome.completed;
    completed.iter().map(|c| c.bytes).sum::<f64>() / completed.len().max(1) as f64
}

pub fn bytes_per_delivery(f: &Figures) -> f64 {
    bytes_per_change(f) / deliveries_per_change(f).max(1.0)
}

/// Registrar memory per connected agent: what connecting and syncing the agents
/// added to both replicas' RSS, without what loading the catalog added.
pub fn kib_per_agent(f: &Figures) -> f64 {
    let sum = |r: [f64; 2]| r[0] + r[1];
    let added = (sum(f.rss[1]) - sum(f.rss[0])) + (sum(f.rss[2]) - sum(f.rss_after_load));
    added * 1024.0 / f.agents.max(1) as f64
}

fn rows() -> Vec<Row> {
    [setup_rows(), churn_rows(), storm_rows()].concat()
}

fn setup_rows() -> Vec<Row> {
    vec![
        ("services / pods", |f| format!("{} / {}", f.services, f.pods)),
        ("services per agent filter (mean)", |f| {
            format!("{:.0}", f.filter_services)
        }),
        ("connect all agents (mTLS) s", |f| {
            format!("{:.1} ({} retried)", f.connect.as_secs_f64(), f.connect_retries)
        }),
        ("register all pods s (/s)", |f| {
            let rate = f.pods as f64 / f.load.as_secs_f64();
            format!("{:.1} ({rate:.0})", f.load.as_secs_f64())
        }),
        ("initial sync s: half / all agents", |f| {
            format!(
                "{:.1} / {:.1}",
                f.initial_sync_p50.as_secs_f64(),
                f.initial_sync.as_secs_f64()
            )
        }),
        ("  CPU s: registrars / agents (this process)", |f| {
            format!("{:.1} / {:.1}", f.sync_cpu.0, f.sync_cpu.1)
        }),
        ("full state per agent KiB", |f| {
            format!("{:.0}", f.full_state_bytes / 1024.0)
        }),
    ]
}

fn churn_rows() -> Vec<Row> {
    vec![
        ("churn events (/s), rollout steps", |f| {
            let rate = f.driven.events as f64 / f.driven.took.as_secs_f64();
            format!("{} ({rate:.1}), {}", f.driven.events, f.driven.rollout_steps)
        }),
        ("change -> one agent ms p50/p99/max", |f| {
            spread(Spread::of(&f.outcome.deliveries))
        }),
        ("change -> every affected agent ms p50/p99/max", |f| {
            spread(every_affected(f))
        }),
        ("changes incomplete / RPCs failed", |f| {
            let failed = f.driven.failed.load(std::sync::atomic::Ordering::Relaxed);
            format!("{} / {failed}", f.outcome.incomplete)
        }),
        ("deliveries per change (% of agents)", |f| {
            let share = 100.0 * deliveries_per_change(f) / f.agents as f64;
            format!("{:.0} ({share:.0} %)", deliveries_per_change(f))
        }),
        ("bytes per change: total / per agent", |f| {
            format!("{:.0} / {:.0}", bytes_per_change(f), bytes_per_delivery(f))
        }),
        ("per-agent delta / full state", |f| {
            format!("1/{:.0}", f.full_state_bytes / bytes_per_delivery(f).max(1.0))
        }),
        ("registrar CPU s per s of churn (2 replicas)", |f| {
            format!("{:.3}", f.churn_cpu)
        }),
        ("etcd requests/s: load / churn", |f| {
            format!("{:.0} / {:.1}", f.etcd_requests_per_s_load, f.etcd_requests_per_s_churn)
        }),
    ]
}

fn storm_rows() -> Vec<Row> {
    vec![
        ("registrar RSS MiB A/B: empty, connected, synced", |f| {
            let [empty, connected, synced] = f.rss.map(|r| format!("{:.0}/{:.0}", r[0], r[1]));
            format!("{empty}, {connected}, {synced}")
        }),
        ("registrar KiB per connected agent", |f| {
            format!("{:.1}", kib_per_agent(f))
        }),
        ("registrar RSS MiB A/B after churn", |f| {
            format!("{:.0}/{:.0}", f.rss_after_churn[0], f.rss_after_churn[1])
        }),
        ("streams broken before the kill", |f| {
            format!("{}", f.broken_before_kill)
        }),
        ("replica killed: agents moved", |f| format!("{}", f.storm.moved)),
        ("  resumed / full snapshot", |f| {
            format!("{} / {}", f.storm.resumed, f.storm.resynced)
        }),
        ("  KiB per moved agent: held sent / received", |f| {
            let storm = &f.storm;
            format!("{:.1} / {:.1}", storm.held_bytes / 1024.0, storm.moved_bytes / 1024.0)
        }),
        ("  current again s: half / all", |f| {
            format!(
                "{:.2} / {:.2}",
                f.storm.recovered_p50.as_secs_f64(),
                f.storm.recovered.as_secs_f64()
            )
        }),
        ("  survivor RSS MiB; CPU s: survivor / agents", |f| {
            let storm = &f.storm;
            format!(
                "{:.0}; {:.1} / {:.1}",
                storm.survivor_rss, storm.survivor_cpu, storm.agents_cpu
            )
        }),
    ]
}

/// The figures of every run, one column per N.
pub fn table(runs: &[Figures]) -> String {
    let mut out = format!("| {:<48} |", "N agents");
    for f in runs {
        out += &format!(" {:>24} |", f.agents);
    }
    out += &format!("\n|{}|", "-".repeat(50));
    for _ in runs {
        out += &format!("{}|", "-".repeat(26));
    }
    for (label, value) in rows() {
        out += &format!("\n| {label:<48} |");
        for f in runs {
            out += &format!(" {:>24} |", value(f));
        }
    }
    out + "\n"
}

pub fn metrics() -> Vec<Metric> {
    let p99 = |f: &Figures| every_affected(f).p99.as_secs_f64();
    vec![
        Metric {
            name: "change -> every affected agent p99",
            unit: "s",
            value: p99,
            goal: Some(0.5),
        },
        Metric {
            name: "deliveries per change",
            unit: "agents",
            value: deliveries_per_change,
            goal: None,
        },
        Metric {
            name: "bytes per change (all agents)",
            unit: "B",
            value: bytes_per_change,
            goal: None,
        },
        Metric {
            name: "full state per agent",
            unit: "B",
            value: |f| f.full_state_bytes,
            goal: None,
        },
        Metric {
            name: "registrar memory per agent",
            unit: "KiB",
            value: kib_per_agent,
            goal: Some(50.0 * 1000.0 / 1024.0),
        },
        Metric {
            name: "registrar CPU per s of churn",
            unit: "CPU s",
            value: |f| f.churn_cpu,
            goal: None,
        },
        Metric {
            name: "initial sync, all agents",
            unit: "s",
            value: |f| f.initial_sync.as_secs_f64(),
            goal: None,
        },
        Metric {
            name: "replica death: all current again",
            unit: "s",
            value: |f| f.storm.recovered.as_secs_f64(),
            goal: Some(10.0),
        },
        Metric {
            name: "etcd requests/s during churn",
            unit: "/s",
            value: |f| f.etcd_requests_per_s_churn,
            goal: None,
        },
    ]
}

/// How each metric grows with N (`y = a·N^b`) and its value at 10,000 nodes.
pub fn projection(runs: &[Figures]) -> String {
    let mut out =
        String::from("growth with N (y = a·N^b, least squares on logs) and the projection to 10,000 nodes:\n");
    for metric in metrics() {
        let points: Vec<(f64, f64)> = runs.iter().map(|f| (f.agents as f64, (metric.value)(f))).collect();
        let Some(fit) = PowerLaw::fit(&points) else {
            out += &format!("  {:<40} (needs two runs)\n", metric.name);
            continue;
        };
        let at = fit.at(TARGET_NODES);
        let goal = match metric.goal {
            Some(goal) if at <= goal => format!("goal {goal:.3}: met"),
            Some(goal) => format!("goal {goal:.3}: MISSED"),
            None => String::new(),
        };
        out += &format!(
            "  {:<40} b = {:>5.2}  at 10k: {:>12.3} {:<7} {goal}\n",
            metric.name, fit.b, at, metric.unit
        );
    }
    out + &assumptions()
}

fn assumptions() -> String {
    format!(
        "assumptions: the model grows services with N (0.3 per node: {TARGET_SERVICES:.0} at {TARGET_NODES:.0} nodes) and places \
         10-30 pods per node (~200,000 at 10,000 nodes, twice the {TARGET_PODS:.0}-pod target, so pod-proportional costs \
         (full state, load, initial sync, catalog memory) are over-estimated about 2x and per-change costs, which follow the \
         filters, slightly); churn at the same rate at every N; the registrars, etcd and all agents share this machine's \
         2 cores, so latencies include the agents' own CPU; no agent re-registration refresh (endpoint TTL 1 h)\n"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::Completed;

    #[test]
    fn per_change_figures_average_over_completed_changes() {
        let mut f = Figures {
            agents: 10,
            ..Default::default()
        };
        f.outcome.completed = vec![
            Completed {
                every: Duration::from_millis(2),
                deliveries: 4,
                bytes: 400.0,
            },
            Completed {
                every: Duration::from_millis(4),
                deliveries: 2,
                bytes: 300.0,
            },
        ];
        assert_eq!(deliveries_per_change(&f), 3.0);
        assert_eq!(bytes_per_change(&f), 350.0);
        assert!((bytes_per_delivery(&f) - 350.0 / 3.0).abs() < 1e-9);
        assert_eq!(every_affected(&f).max, Duration::from_millis(4));
        assert!(table(&[f]).contains(" 3 (30 %) |"));
    }

    #[test]
    fn memory_per_agent_leaves_out_the_catalog() {
        let f = Figures {
            agents: 1024,
            rss: [[10.0, 10.0], [20.0, 20.0], [60.0, 40.0]],
            rss_after_load: [30.0, 30.0],
            ..Default::default()
        };
        // Connections: +20 MiB; watchers: +40 MiB; the catalog's +20 MiB is not counted.
        assert_eq!(kib_per_agent(&f), 60.0);
    }
}
