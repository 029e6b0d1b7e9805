//! The mesh domain new pods search (proposals/016): the mesh-wide MeshConfig's
//! `spec.meshDomain` when it sets one, else the install-time `--mesh-domain`.
//!
//! With `--follow-mesh-config` every replica (each serves the pod webhook) watches the one
//! MeshConfig that can set it, `default` in the mesh root namespace, and judges it with
//! `aether_api::mesh_config::project`, as the registrar does: a refused edit keeps the
//! last accepted domain (the registrar keeps serving its last accepted version too);
//! deleted, the install-time one is back.

use std::pin::pin;
use std::sync::Arc;

use aether_api::authorization::ProjectOptions;
use aether_api::mesh_config::{MeshConfig, NAME, project};
use aether_common::readiness::Gate;
use futures::StreamExt;
use kube::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

pub struct Follower {
    /// MeshConfigs of the mesh root namespace.
    pub api: Api<MeshConfig>,
    pub options: ProjectOptions,
    /// `--mesh-domain`: the domain when the MeshConfig sets none.
    pub install: Arc<str>,
    /// Ready once the MeshConfig was first read (or found absent).
    pub gate: Gate,
}

impl Follower {
    /// Keeps `domain` current until `shutdown`.
    pub async fn run(self, domain: watch::Sender<Arc<str>>, shutdown: CancellationToken) {
        let config = watcher::Config::default().fields(&format!("metadata.name={NAME}"));
        let mut events = pin!(watcher::watcher(self.api.clone(), config).default_backoff());
        // The object the current list has shown, judged: none at its end is the
        // install-time domain.
        let mut listed: Option<Option<Arc<str>>> = None;
        let mut failing = None::<String>;
        loop {
            let event = tokio::select! {
                _ = shutdown.cancelled() => return,
                event = events.next() => match event {
                    Some(event) => event,
                    None => return,
                },
            };
            let event = match event {
                Ok(event) => {
                    if failing.take().is_some() {
                        tracing::info!("watching the mesh-wide MeshConfig again");
                    }
                    event
                }
                Err(error) => {
                    let text = error.to_string();
                    if failing.as_ref() != Some(&text) {
                        tracing::warn!(error = %text, "watching the mesh-wide MeshConfig; new pods keep the domain known");
                        failing = Some(text);
                    }
                    continue;
                }
            };
            let next = match event {
                Event::Init => {
                    listed = None;
                    continue;
                }
                Event::InitApply(object) => {
                    listed = Some(self.judge(&object));
                    continue;
                }
                Event::InitDone => {
                    self.gate.set_ready();
                    match listed.take() {
                        Some(judged) => judged,
                        None => Some(self.install.clone()),
                    }
                }
                Event::Apply(object) => self.judge(&object),
                Event::Delete(_) => Some(self.install.clone()),
            };
            if let Some(next) = next {
                domain.send_if_modified(|current| {
                    let changed = *current != next;
                    if changed {
                        tracing::info!(mesh_domain = %next, previous = %current, "the mesh domain new pods search");
                        *current = next;
                    }
                    changed
                });
            }
        }
    }

    /// The domain `object` sets (the install-time one if none); `None` for a refused
    /// object, which changes nothing.
    fn judge(&self, object: &MeshConfig) -> Option<Arc<str>> {
        match project(object, &self.options) {
            Ok(projected) if projected.mesh_domain.is_empty() => Some(self.install.clone()),
            Ok(projected) => Some(projected.mesh_domain.into()),
            Err(refusal) => {
                tracing::warn!(%refusal, "the mesh-wide MeshConfig is refused; new pods keep the domain known");
                None
            }
        }
    }
}
