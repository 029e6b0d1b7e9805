//! Helpers of the configuration source tests (routes, policies, HTTP filters): the
//! directory's files, the fake cluster's objects and their `Accepted` condition, and
//! waiting for a watcher's view or a metric.

use std::path::Path;
use std::time::{Duration, Instant};

use aether_fakes::kube::ApiServer;
use aether_proto::registrar::v1::{WatchResponse, watch_response};

use super::{Registrar, TIMEOUT, Watcher, http_get};

/// Writes `text` into `dir/name` then renames it in, as a ConfigMap update or an editor
/// would.
pub fn write(dir: &Path, name: &str, text: &str) {
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, dir.join(name)).unwrap();
}

/// Reads the stream until `done` holds for the view.
pub async fn until(watcher: &mut Watcher, what: &str, done: impl Fn(&Watcher) -> bool) {
    let deadline = Instant::now() + TIMEOUT;
    while !done(watcher) {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        if watcher.try_next().is_none() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Whether the registrar's /metrics has `line`.
pub async fn metric(registrar: &Registrar, line: &str) -> bool {
    let (_, body) = http_get(registrar.admin, "/metrics").await.unwrap();
    body.lines().any(|l| l == line)
}

/// How many snapshots the watcher has received.
pub fn snapshot_count(watcher: &Watcher) -> usize {
    let snapshot = |m: &&WatchResponse| matches!(m.event, Some(watch_response::Event::SnapshotComplete(_)));
    watcher.received.iter().filter(snapshot).count()
}

/// The registrar binary with KUBECONFIG pointing at the fake.
pub async fn registrar(cluster: &ApiServer, dir: &Path, flags: &[&str]) -> Registrar {
    let kubeconfig = cluster.write_kubeconfig(dir);
    let env = [("KUBECONFIG".to_owned(), kubeconfig.display().to_string())];
    Registrar::start_with_env(&dir.join("data"), flags, &env).await
}

/// An object's `Accepted` condition: `(status, reason, message, observedGeneration)`.
pub type Condition = (String, String, String, i64);

/// The `Accepted` condition of the `K` object `key` (`<namespace>/<name>`).
pub fn accepted<K: kube::Resource<DynamicType = ()>>(cluster: &ApiServer, key: &str) -> Option<Condition> {
    let (namespace, name) = key.split_once('/').expect("<namespace>/<name>");
    let object = cluster.get::<K>(namespace, name)?;
    let conditions = object["status"]["conditions"].as_array()?.clone();
    let condition = conditions.iter().find(|c| c["type"] == "Accepted")?;
    let text = |f: &str| condition[f].as_str().unwrap_or_default().to_owned();
    let generation = condition["observedGeneration"].as_i64().unwrap_or(0);
    Some((text("status"), text("reason"), text("message"), generation))
}

/// Waits until the `K` object `key` is `Accepted` with `status` at `generation`; its
/// message.
pub async fn until_accepted<K: kube::Resource<DynamicType = ()>>(
    cluster: &ApiServer,
    registrar: &Registrar,
    key: &str,
    (status, generation): (&str, i64),
) -> String {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let now = accepted::<K>(cluster, key);
        if let Some((s, _, message, g)) = &now
            && s == status
            && *g == generation
        {
            return message.clone();
        }
        assert!(
            Instant::now() < deadline,
            "status is {now:?}, not {status}:\n{}",
            registrar.logs()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
