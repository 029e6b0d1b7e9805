//! One watch of the cluster's HTTPRoutes and GRPCRoutes in all namespaces, published as
//! the whole current set after each burst of events. Each object is projected once per
//! generation (a status-only change reuses its projection). A kind whose CRD is not
//! installed holds no routes; it is looked for again every [`ABSENT_RETRY`].

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Debug;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use aether_api::gateway::{GrpcRoute, HttpRoute, TcpRoute, TlsRoute};
use aether_api::{Rejected, RouteObject, project};
use aether_proto::registry::v1::{Route, RouteKind};
use futures::StreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client};
use serde::de::DeserializeOwned;
use tokio::sync::{mpsc, watch};

use crate::cluster::{Collect, Sets, publish};
use crate::sources::ObjectSet;

/// Events arriving within this window are published as one set.
pub const DEBOUNCE: Duration = Duration::from_millis(100);
/// How often a kind whose CRD is missing is looked for again.
pub const ABSENT_RETRY: Duration = Duration::from_secs(30);
/// The first and the longest pause after any other watch failure.
/// HTTPRoute, GRPCRoute, TCPRoute and TLSRoute: the set is known once each is listed or absent.
const ROUTE_KINDS: usize = 4;
const BACKOFF: (Duration, Duration) = (Duration::from_millis(500), Duration::from_secs(30));

/// What projecting an object gave: its route (`None`: no Service parent, so not the
/// mesh's), or why it is refused.
pub type Outcome = Result<Option<Route>, Rejected>;

/// An object as the cluster holds it, with its projection.
#[derive(Clone, Debug)]
pub struct Watched {
    pub object: RouteObject,
    pub outcome: Outcome,
}

/// Every route object of the cluster.
#[derive(Clone, Debug, Default)]
pub struct RouteSet {
    /// Moves when an object was added, removed or changed its spec; not when only a
    /// status changed (the registrar's own writes), so projections are not redone.
    pub spec_version: u64,
    /// By route key, `<kind>/<namespace>/<name>`.
    pub objects: BTreeMap<String, Watched>,
}

impl ObjectSet for RouteSet {
    type Object = RouteObject;
    fn spec_version(&self) -> u64 {
        self.spec_version
    }
    /// The objects with the origin refusals name them by (their key).
    fn origins(&self) -> impl Iterator<Item = (String, &RouteObject)> {
        self.objects.iter().map(|(key, w)| (key.clone(), &w.object))
    }
}

/// A handle on the route watch.
pub type ClusterRoutes = Sets<RouteSet>;

impl ClusterRoutes {
    /// Starts watching the route kinds through `client`.
    pub fn start(client: Client) -> ClusterRoutes {
        let (tx, sets) = watch::channel(None);
        tokio::spawn(collect(client, tx));
        Sets::new(sets)
    }
}

/// What one kind's watch reports.
enum Input {
    /// A (re)list starts: the objects until `Listed` replace the kind's.
    Relist(RouteKind),
    Applied(RouteObject),
    Listed(RouteKind),
    Deleted(RouteObject),
    /// The kind's CRD is not installed.
    Absent(RouteKind),
}

async fn collect(client: Client, tx: watch::Sender<Option<Arc<RouteSet>>>) {
    let (inputs_tx, inputs) = mpsc::channel(1024);
    let http = Api::<HttpRoute>::all(client.clone());
    let grpc = Api::<GrpcRoute>::all(client.clone());
    let tcp = Api::<TcpRoute>::all(client.clone());
    let tls = Api::<TlsRoute>::all(client);
    let tasks = [
        tokio::spawn(follow(http, RouteKind::Http, RouteObject::Http, inputs_tx.clone())),
        tokio::spawn(follow(grpc, RouteKind::Grpc, RouteObject::Grpc, inputs_tx.clone())),
        tokio::spawn(follow(tcp, RouteKind::Tcp, RouteObject::Tcp, inputs_tx.clone())),
        tokio::spawn(follow(tls, RouteKind::Tls, RouteObject::Tls, inputs_tx)),
    ];
    publish(Collected::default(), inputs, DEBOUNCE, tx).await;
    for task in tasks {
        task.abort();
    }
}

/// Forwards one kind's watch, pausing after failures (a missing CRD: [`ABSENT_RETRY`]).
async fn follow<K>(api: Api<K>, kind: RouteKind, wrap: fn(K) -> RouteObject, tx: mpsc::Sender<Input>)
where
    K: kube::Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + 'static,
{
    let name = K::kind(&()).into_owned();
    let mut stream = pin!(watcher::watcher(api, watcher::Config::default()));
    let mut trouble = Trouble::default();
    while let Some(next) = stream.next().await {
        let input = match next {
            Ok(event) => {
                trouble.recovered(&name);
                match event {
                    Event::Init => Input::Relist(kind),
                    Event::InitApply(object) | Event::Apply(object) => Input::Applied(wrap(object)),
                    Event::InitDone => Input::Listed(kind),
                    Event::Delete(object) => Input::Deleted(wrap(object)),
                }
            }
            Err(error) => {
                let absent = trouble.failed(&name, &error);
                if absent && tx.send(Input::Absent(kind)).await.is_err() {
                    return;
                }
                tokio::time::sleep(trouble.pause).await;
                continue;
            }
        };
        if tx.send(input).await.is_err() {
            return;
        }
    }
}

/// A watch's failure streak: logged when it starts and ends, paused between attempts.
#[derive(Default)]
struct Trouble {
    /// The last failure's text, while failing.
    failing: Option<String>,
    pause: Duration,
}

impl Trouble {
    /// Records a failure; true if the kind's CRD is not installed.
    fn failed(&mut self, kind: &str, error: &watcher::Error) -> bool {
        let absent = matches!(error,
            watcher::Error::InitialListFailed(kube::Error::Api(s))
            | watcher::Error::WatchStartFailed(kube::Error::Api(s)) if s.code == 404);
        let text = error.to_string();
        if self.failing.as_ref() != Some(&text) {
            if absent {
                tracing::warn!(%kind, "the Gateway API CRD of {kind} is not installed (404): serving no {kind}s; \
                    looking again every {}s", ABSENT_RETRY.as_secs());
            } else {
                tracing::warn!(%kind, %error, "watching {kind}s failed; retrying with backoff (serving the last set)");
            }
        }
        self.failing = Some(text);
        self.pause = match absent {
            true => ABSENT_RETRY,
            false => (self.pause * 2).clamp(BACKOFF.0, BACKOFF.1),
        };
        absent
    }

    fn recovered(&mut self, kind: &str) {
        if self.failing.take().is_some() {
            tracing::info!(%kind, "watching {kind}s again");
        }
        self.pause = Duration::ZERO;
    }
}

/// The objects seen so far, and which kinds are known (listed, or not installed).
#[derive(Default)]
struct Collected {
    set: RouteSet,
    relists: HashMap<RouteKind, BTreeMap<String, Watched>>,
    settled: HashSet<RouteKind>,
}

impl Collect for Collected {
    type Input = Input;
    type Set = RouteSet;

    fn known(&self) -> Option<&RouteSet> {
        (self.settled.len() == ROUTE_KINDS).then_some(&self.set)
    }

    fn apply(&mut self, input: Input) -> bool {
        match input {
            Input::Relist(kind) => {
                self.relists.insert(kind, BTreeMap::new());
                return false;
            }
            Input::Applied(object) => {
                let key = object.key();
                let (watched, new_spec) = self.watched(object);
                if let Some(relist) = self.relists.get_mut(&watched.object.kind()) {
                    relist.insert(key, watched);
                    return false;
                }
                self.set.objects.insert(key, watched);
                if !new_spec {
                    return true;
                }
            }
            Input::Listed(kind) => {
                let listed = self.relists.remove(&kind).unwrap_or_default();
                self.replace_kind(kind, listed);
            }
            Input::Deleted(object) => {
                self.set.objects.remove(&object.key());
            }
            Input::Absent(kind) => {
                self.relists.remove(&kind);
                self.replace_kind(kind, BTreeMap::new());
            }
        }
        self.set.spec_version += 1;
        true
    }
}

impl Collected {
    fn replace_kind(&mut self, kind: RouteKind, objects: BTreeMap<String, Watched>) {
        self.set.objects.retain(|_, w| w.object.kind() != kind);
        self.set.objects.extend(objects);
        self.settled.insert(kind);
    }

    /// The object with its projection: the one already made when its spec is the same
    /// (same uid and generation), else a new one (then `true`).
    fn watched(&self, object: RouteObject) -> (Watched, bool) {
        let known = self.set.objects.get(&object.key()).filter(|old| {
            let (old, new) = (old.object.metadata(), object.metadata());
            new.generation.is_some() && old.uid == new.uid && old.generation == new.generation
        });
        match known {
            Some(old) => {
                let outcome = old.outcome.clone();
                (Watched { object, outcome }, false)
            }
            None => {
                let outcome = project(&object);
                (Watched { object, outcome }, true)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn http(name: &str, generation: i64, parent: &str) -> RouteObject {
        RouteObject::Http(
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": name, "namespace": "shop", "uid": format!("u-{name}"), "generation": generation},
                "spec": {"parentRefs": [{"group": "", "kind": "Service", "name": parent}]}
            }))
            .unwrap(),
        )
    }

    #[test]
    fn a_relist_replaces_its_kind_and_status_only_changes_keep_the_spec_version() {
        let mut collected = Collected::default();
        collected.apply(Input::Relist(RouteKind::Http));
        assert!(!collected.apply(Input::Applied(http("a", 1, "cart"))));
        assert!(collected.apply(Input::Listed(RouteKind::Http)));
        assert!(collected.apply(Input::Absent(RouteKind::Grpc)));
        assert_eq!(collected.settled.len(), 2);
        let version = collected.set.spec_version;
        let route = collected.set.objects["http/shop/a"].outcome.clone().unwrap().unwrap();
        assert_eq!(route.parents[0].service, "shop/cart");

        // Same generation (a status write): the set changes, the projection is kept.
        assert!(collected.apply(Input::Applied(http("a", 1, "cart"))));
        assert_eq!(collected.set.spec_version, version);
        // A new generation is projected again.
        collected.apply(Input::Applied(http("a", 2, "pay")));
        assert!(collected.set.spec_version > version);
        let route = collected.set.objects["http/shop/a"].outcome.clone().unwrap().unwrap();
        assert_eq!(route.parents[0].service, "shop/pay");

        // A relist without the object removes it.
        collected.apply(Input::Relist(RouteKind::Http));
        collected.apply(Input::Listed(RouteKind::Http));
        assert!(collected.set.objects.is_empty());
    }
}
