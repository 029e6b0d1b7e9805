//! Churn at a steady rate of pod events: readiness flips, pods removed and added,
//! and a rolling deployment of the most popular service (a new pod surges in, then
//! an old one goes). Every event goes through the agent of the pod's node, and the
//! ledger learns when it was sent and how many agents depend on its service.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use aether_proto::registrar::v1::{RegisterEndpointRequest, UnregisterEndpointRequest};

use crate::fleet::Fleet;
use crate::model::{Model, Rng};

/// The churn of a run.
#[derive(Clone, Debug)]
pub struct Churn {
    /// Pod events per second.
    pub rate: f64,
    pub duration: Duration,
}

/// One pod event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PodEvent {
    /// The pod's readiness flips (its endpoint is updated).
    Flip(u32),
    Remove(u32),
    /// A new pod of `service` on `node`.
    Add {
        node: u32,
        service: u32,
    },
}

/// What the driver did.
#[derive(Debug, Default)]
pub struct Driven {
    pub events: u64,
    pub rollout_steps: u64,
    pub failed: Arc<AtomicU64>,
    pub took: Duration,
}

/// Chooses events: while a rollout has old pods left, every other event is a step of
/// it; the rest are 50 % flips, 25 % removals, 25 % additions of random pods.
pub struct Chooser {
    rng: Rng,
    /// The rollout's old pods still to replace, and whether the next step is the surge.
    rollout: VecDeque<u32>,
    surge_next: bool,
    tick: u64,
}

impl Chooser {
    /// Starts with a rollout of service 0 (the most popular) under way.
    pub fn new(model: &Model, seed: u64) -> Chooser {
        let rollout = model.pods.iter().enumerate();
        let rollout = rollout
            .filter(|(_, p)| p.alive && p.service == 0)
            .map(|(id, _)| id as u32);
        Chooser {
            rng: Rng::new(seed ^ 0x5eed),
            rollout: rollout.collect(),
            surge_next: true,
            tick: 0,
        }
    }

    /// The next event, or `None` if the pod it picked is busy (skip this tick).
    pub fn next(&mut self, model: &Model, busy: impl Fn(u32) -> bool) -> Option<PodEvent> {
        self.tick += 1;
        if self.tick.is_multiple_of(2)
            && let Some(&old) = self.rollout.front()
        {
            let pod = &model.pods[old as usize];
            if std::mem::take(&mut self.surge_next) {
                return Some(PodEvent::Add {
                    node: pod.node,
                    service: pod.service,
                });
            }
            self.surge_next = true;
            self.rollout.pop_front();
            return Some(PodEvent::Remove(old));
        }
        let pod = self.rng.below(model.pods.len()) as u32;
        let picked = &model.pods[pod as usize];
        if !picked.alive || busy(pod) || self.rollout.contains(&pod) {
            return None;
        }
        match self.rng.below(4) {
            0 | 1 => Some(PodEvent::Flip(pod)),
            2 => Some(PodEvent::Remove(pod)),
            _ => Some(PodEvent::Add {
                node: picked.node,
                service: picked.service,
            }),
        }
    }

    pub fn rollout_left(&self) -> usize {
        self.rollout.len()
    }
}

/// Applies `event` to the model, records it in the ledger and sends it through the
/// node's agent (in the background, so a slow write does not slow the rate).
pub fn send(fleet: &Arc<Fleet>, model: &mut Model, dependents: &[u32], event: PodEvent, failed: &Arc<AtomicU64>) {
    let pod = match event {
        PodEvent::Flip(pod) => {
            let ready = &mut model.pods[pod as usize].ready;
            *ready = !*ready;
            pod
        }
        PodEvent::Remove(pod) => {
            model.pods[pod as usize].alive = false;
            pod
        }
        PodEvent::Add { node, service } => model.add_pod(node, service),
    };
    let endpoint = model.endpoint(pod);
    let affected = dependents[model.pods[pod as usize].service as usize];
    fleet.ledger.sent(endpoint.address.clone(), affected, Instant::now());
    let mut client = fleet.links[model.pods[pod as usize].node as usize].client();
    let failed = failed.clone();
    tokio::spawn(async move {
        let result = match event {
            PodEvent::Remove(_) => client
                .unregister_endpoint(UnregisterEndpointRequest {
                    service: endpoint.service,
                    address: endpoint.address,
                })
                .await
                .map(|_| ()),
            _ => client
                .register_endpoint(RegisterEndpointRequest {
                    endpoint: Some(endpoint),
                })
                .await
                .map(|_| ()),
        };
        if result.is_err() {
            failed.fetch_add(1, Ordering::Relaxed);
        }
    });
}

/// Drives `churn` against the fleet, then returns what it did.
pub async fn drive(fleet: &Arc<Fleet>, model: &mut Model, dependents: &[u32], churn: &Churn, seed: u64) -> Driven {
    let mut chooser = Chooser::new(model, seed);
    let rollout_size = chooser.rollout_left() as u64;
    let mut driven = Driven::default();
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / churn.rate.max(0.001)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let started = Instant::now();
    while started.elapsed() < churn.duration {
        tick.tick().await;
        let busy = |pod: u32| fleet.ledger.busy(&model.pods[pod as usize].address.to_string());
        let Some(event) = chooser.next(model, busy) else {
            continue;
        };
        send(fleet, model, dependents, event, &driven.failed);
        driven.events += 1;
    }
    driven.took = started.elapsed();
    driven.rollout_steps = rollout_size - chooser.rollout_left() as u64;
    driven
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Shape;

    fn model() -> Model {
        Model::generate(Shape {
            seed: 3,
            nodes: 20,
            services: 30,
            pods_per_node: 10..=30,
            upstreams: 10..=20,
            upstream_skew: 1.0,
            replica_skew: 0.5,
        })
    }

    #[test]
    fn every_other_event_steps_the_rollout_surge_first() {
        let model = model();
        let mut chooser = Chooser::new(&model, 1);
        let first_old = chooser.rollout.front().copied().unwrap();
        let steps: Vec<_> = (0..8).map(|_| chooser.next(&model, |_| false)).collect();
        let old = &model.pods[first_old as usize];
        assert_eq!(
            steps[1],
            Some(PodEvent::Add {
                node: old.node,
                service: 0
            })
        );
        assert_eq!(steps[3], Some(PodEvent::Remove(first_old)));
        for random in [steps[0], steps[2], steps[4], steps[6]].into_iter().flatten() {
            let pod = match random {
                PodEvent::Flip(p) | PodEvent::Remove(p) => p,
                PodEvent::Add { service, .. } => {
                    assert!(model.pods.iter().any(|p| p.service == service));
                    continue;
                }
            };
            assert_ne!(
                model.pods[pod as usize].service, 0,
                "rollout pods are left to the rollout"
            );
        }
    }

    #[test]
    fn a_busy_pod_is_skipped() {
        let model = model();
        let mut chooser = Chooser::new(&model, 2);
        let picked = (0..50).filter_map(|_| chooser.next(&model, |_| true)).count();
        // Only rollout steps get through when every random pick is busy.
        assert_eq!(picked, 25);
    }
}
