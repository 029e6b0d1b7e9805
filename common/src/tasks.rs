//! The long-lived tasks of a binary and what their end means (after ztunnel's drain):
//! a **critical** task runs for the life of the process, so ending before shutdown —
//! returning or panicking — is a failure: it is logged with its cause, the `tasks`
//! readiness gate closes naming it, and the process shuts down and exits non-zero. Shutdown waits for
//! every task, critical or not, up to a deadline.

use parking_lot::Mutex;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::readiness::{Gate, Readiness};

#[derive(Clone)]
pub struct Tasks {
    tracker: TaskTracker,
    shutdown: CancellationToken,
    /// Ready until a critical task ends early.
    readiness: Gate,
    /// The first critical task that ended early, and why.
    failure: Arc<Mutex<Option<TaskFailed>>>,
}

/// A critical task that ended before shutdown, and how.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{task} stopped: {cause}")]
pub struct TaskFailed {
    pub task: &'static str,
    pub cause: String,
}

impl Tasks {
    /// Tasks that stop at `shutdown`; a critical one ending early cancels it and makes
    /// closes the `tasks` gate of `readiness`.
    pub fn new(shutdown: CancellationToken, readiness: &Readiness) -> Self {
        let gate = readiness.gate("tasks");
        gate.set_ready();
        Self {
            tracker: TaskTracker::new(),
            shutdown,
            readiness: gate,
            failure: Arc::default(),
        }
    }

    /// Runs `task`, which must only end at shutdown (see the module docs).
    pub fn critical(&self, name: &'static str, task: impl Future<Output = ()> + Send + 'static) {
        let handle = tokio::spawn(task);
        let this = self.clone();
        self.tracker.spawn(async move {
            let cause = match handle.await {
                Ok(()) => "it returned".to_owned(),
                Err(error) if error.is_panic() => format!("it panicked: {}", panic_message(error.into_panic())),
                Err(error) => error.to_string(),
            };
            if this.shutdown.is_cancelled() {
                tracing::debug!(task = name, "stopped");
                return;
            }
            tracing::error!(task = name, %cause, "a critical task ended before shutdown; stopping the process");
            let failed = TaskFailed { task: name, cause };
            this.readiness.set_not_ready(failed.to_string());
            this.failure.lock().get_or_insert(failed);
            this.shutdown.cancel();
        });
    }

    /// Runs `task`, whose end is normal (a piece of work); shutdown still waits for it.
    pub fn spawn(&self, task: impl Future<Output = ()> + Send + 'static) {
        self.tracker.spawn(task);
    }

    /// After shutdown: waits for every task, at most `deadline` (those still running
    /// are left to the process exit, with a warning). `Err` names the critical task
    /// whose early end stopped the process.
    pub async fn drain(self, deadline: Duration) -> Result<(), TaskFailed> {
        self.tracker.close();
        if tokio::time::timeout(deadline, self.tracker.wait()).await.is_err() {
            tracing::warn!(
                left = self.tracker.len(),
                ?deadline,
                "tasks still running at the drain deadline"
            );
        }
        match self.failure.lock().take() {
            Some(failure) => Err(failure),
            None => Ok(()),
        }
    }
}

fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    match payload.downcast::<String>() {
        Ok(message) => *message,
        Err(payload) => payload
            .downcast_ref::<&str>()
            .map_or_else(|| "(no message)".to_owned(), |s| (*s).to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tasks() -> (Tasks, CancellationToken, Readiness) {
        let shutdown = CancellationToken::new();
        let readiness = Readiness::new();
        (Tasks::new(shutdown.clone(), &readiness), shutdown, readiness)
    }

    #[tokio::test]
    async fn a_critical_task_that_dies_stops_the_process_with_its_cause() {
        let (tasks, shutdown, readiness) = tasks();
        tasks.critical("watch", async {
            let fine = shutdown_never();
            fine.await;
        });
        tasks.critical("writer", async { panic!("disk full") });
        tokio::time::timeout(Duration::from_secs(5), shutdown.cancelled())
            .await
            .expect("the panic cancelled shutdown");
        let failed = TaskFailed {
            task: "writer",
            cause: "it panicked: disk full".into(),
        };
        let not_ready = readiness.get().unwrap_err().to_string();
        assert_eq!(not_ready, "tasks: writer stopped: it panicked: disk full");
        assert_eq!(tasks.drain(Duration::from_millis(100)).await, Err(failed));
    }

    #[tokio::test]
    async fn at_shutdown_tasks_end_normally_and_drain_waits_for_them() {
        let (tasks, shutdown, readiness) = tasks();
        let done = Arc::new(Mutex::new(Vec::new()));
        for name in ["server", "reaper"] {
            let (stop, done) = (shutdown.clone(), done.clone());
            tasks.critical(name, async move {
                stop.cancelled().await;
                tokio::time::sleep(Duration::from_millis(20)).await;
                done.lock().push(name);
            });
        }
        let one_off = done.clone();
        tasks.spawn(async move { one_off.lock().push("one-off") });
        shutdown.cancel();
        assert_eq!(tasks.drain(Duration::from_secs(5)).await, Ok(()));
        assert_eq!(done.lock().len(), 3, "drain returned before every task ended");
        assert_eq!(readiness.get(), Ok(()), "a normal stop is not a failure");
    }

    #[tokio::test(start_paused = true)]
    async fn drain_gives_up_at_its_deadline() {
        let (tasks, shutdown, _) = tasks();
        tasks.critical("stuck", shutdown_never());
        shutdown.cancel();
        let started = tokio::time::Instant::now();
        assert_eq!(tasks.drain(Duration::from_secs(3)).await, Ok(()));
        assert_eq!(started.elapsed(), Duration::from_secs(3));
    }

    async fn shutdown_never() {
        std::future::pending::<()>().await
    }
}
