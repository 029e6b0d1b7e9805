//! Following one Kubernetes kind, the one way the project does it (the registrar's
//! Gateway API sources, the controller's status writer, the edge's objects): kube's
//! watcher turned into [`Change`]s, with the failures handled alike everywhere:
//!
//! - a kind whose CRD is not installed (404) is reported [`Change::Absent`] (no objects)
//!   and looked for again every `absent_retry`;
//! - access refused (403) is reported [`Change::Forbidden`], then retried with backoff;
//! - any other failure retries with doubling backoff;
//! - a watch answered 410 re-lists (kube would re-watch from the expired version);
//! - each failure is logged once until it changes, and the recovery once.

use std::future::Future;
use std::pin::pin;
use std::time::Duration;

use futures::StreamExt;
use kube::Api;
use kube::runtime::watcher::{self, Event};
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;

use crate::quote::clip;

/// What a watch reports, in order.
#[derive(Debug, PartialEq)]
pub enum Change<K> {
    /// A (re)list starts: the objects until [`Change::Listed`] replace the set.
    Relist,
    Applied(K),
    Listed,
    Deleted(K),
    /// The kind's CRD is not installed: no objects.
    Absent,
    /// This follower may not read the kind (403): what it had is kept.
    Forbidden,
}

/// How one watch is followed.
#[derive(Clone, Debug)]
pub struct Follow {
    /// What the logs call what is watched, e.g. `the HTTPFilter CRD (networking.aether.io)`.
    pub what: String,
    /// How long a missing CRD is waited for before looking again.
    pub absent_retry: Duration,
    /// The first and the longest pause after other failures.
    pub backoff: (Duration, Duration),
    /// Log a decoding failure without its message (it may quote the object: a Secret's data).
    pub quiet_decoding: bool,
}

/// Why a watch failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    Absent,
    Forbidden,
    Other,
}

/// How an error is classified.
pub fn failure(error: &watcher::Error) -> Failure {
    match error {
        watcher::Error::InitialListFailed(kube::Error::Api(s))
        | watcher::Error::WatchStartFailed(kube::Error::Api(s))
        | watcher::Error::WatchFailed(kube::Error::Api(s)) => match s.code {
            404 => Failure::Absent,
            403 => Failure::Forbidden,
            _ => Failure::Other,
        },
        watcher::Error::WatchError(s) if s.code == 403 => Failure::Forbidden,
        _ => Failure::Other,
    }
}

/// Follows `api` with `config` until `send` says the receiver is gone, handing each
/// [`Change`] to `send` (which returns `false` to stop).
pub async fn follow<K, S, F>(api: Api<K>, config: watcher::Config, follow: Follow, mut send: S)
where
    K: kube::Resource + Clone + DeserializeOwned + std::fmt::Debug + Send + 'static,
    S: FnMut(Change<K>) -> F,
    F: Future<Output = bool>,
{
    let mut failing: Option<String> = None;
    let mut pause = Duration::ZERO;
    loop {
        let mut stream = pin!(watcher::watcher(api.clone(), config.clone()));
        while let Some(next) = stream.next().await {
            let change = match next {
                Ok(event) => {
                    if failing.take().is_some() {
                        tracing::info!("watching {} again", follow.what);
                    }
                    pause = Duration::ZERO;
                    match event {
                        Event::Init => Change::Relist,
                        Event::InitApply(object) | Event::Apply(object) => Change::Applied(object),
                        Event::InitDone => Change::Listed,
                        Event::Delete(object) => Change::Deleted(object),
                    }
                }
                Err(error) => {
                    let failed = failure(&error);
                    let text = describe(&follow, &error);
                    if failing.as_ref() != Some(&text) {
                        log(&follow, failed, &text);
                    }
                    failing = Some(text);
                    pause = match failed {
                        Failure::Absent => follow.absent_retry,
                        _ => (pause * 2).clamp(follow.backoff.0, follow.backoff.1),
                    };
                    let reported = match failed {
                        Failure::Absent => Some(Change::Absent),
                        Failure::Forbidden => Some(Change::Forbidden),
                        Failure::Other => None,
                    };
                    if let Some(change) = reported
                        && !send(change).await
                    {
                        return;
                    }
                    tokio::time::sleep(pause).await;
                    if must_restart(&error) {
                        break;
                    }
                    continue;
                }
            };
            if !send(change).await {
                return;
            }
        }
    }
}

/// [`follow`] into a channel, each change mapped by `map`.
pub async fn follow_into<K, T>(
    api: Api<K>,
    config: watcher::Config,
    settings: Follow,
    tx: mpsc::Sender<T>,
    map: impl Fn(Change<K>) -> T,
) where
    K: kube::Resource + Clone + DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    follow(api, config, settings, |change| {
        let sent = tx.send(map(change));
        async move { sent.await.is_ok() }
    })
    .await;
}

fn log(follow: &Follow, failed: Failure, text: &str) {
    let what = &follow.what;
    match failed {
        Failure::Absent => tracing::warn!(
            "{what} is not installed (404): taken as none; looking again every {}s",
            follow.absent_retry.as_secs_f32()
        ),
        Failure::Forbidden => tracing::warn!(error = %text,
            "reading {what} is forbidden (403: RBAC); retrying with backoff"),
        Failure::Other => tracing::warn!(error = %text,
            "watching {what} failed; retrying with backoff (the last objects stay)"),
    }
}

/// An HTTP 410 answering the watch request itself: kube would keep re-watching from the
/// same expired resourceVersion, so a new watcher re-lists.
fn must_restart(error: &watcher::Error) -> bool {
    matches!(error, watcher::Error::WatchStartFailed(kube::Error::Api(status)) if status.code == 410)
}

/// An error as logged, bounded; a decoding error without its message when asked.
fn describe(follow: &Follow, error: &watcher::Error) -> String {
    let decoding = matches!(
        error,
        watcher::Error::InitialListFailed(kube::Error::SerdeError(_))
            | watcher::Error::WatchStartFailed(kube::Error::SerdeError(_))
            | watcher::Error::WatchFailed(kube::Error::SerdeError(_))
    );
    match decoding && follow.quiet_decoding {
        true => "an object did not decode (its content is not logged)".to_owned(),
        false => clip(&error.to_string()).to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api_error(code: u16) -> kube::Error {
        kube::Error::Api(kube::core::Status::failure("refused", "Reason").with_code(code).boxed())
    }

    fn settings(quiet_decoding: bool) -> Follow {
        Follow {
            what: "a watch".into(),
            absent_retry: Duration::from_secs(30),
            backoff: (Duration::from_millis(500), Duration::from_secs(30)),
            quiet_decoding,
        }
    }

    #[test]
    fn a_missing_crd_a_refusal_and_the_rest_are_told_apart() {
        assert_eq!(
            failure(&watcher::Error::InitialListFailed(api_error(404))),
            Failure::Absent
        );
        assert_eq!(
            failure(&watcher::Error::WatchStartFailed(api_error(404))),
            Failure::Absent
        );
        assert_eq!(
            failure(&watcher::Error::WatchFailed(api_error(403))),
            Failure::Forbidden
        );
        assert_eq!(
            failure(&watcher::Error::InitialListFailed(api_error(500))),
            Failure::Other
        );
        assert!(must_restart(&watcher::Error::WatchStartFailed(api_error(410))));
        assert!(!must_restart(&watcher::Error::InitialListFailed(api_error(410))));
    }

    #[test]
    fn a_decoding_error_is_logged_without_the_object_when_asked() {
        let decoding = || {
            let error = serde_json::from_str::<u32>(r#""SECRET-MATERIAL""#).unwrap_err();
            watcher::Error::InitialListFailed(kube::Error::SerdeError(error))
        };
        assert!(!describe(&settings(true), &decoding()).contains("SECRET-MATERIAL"));
        assert!(describe(&settings(false), &decoding()).contains("SECRET-MATERIAL"));
        assert!(describe(&settings(false), &decoding()).len() < 1024);
    }
}
