//! Leader election on a `coordination.k8s.io/v1` Lease, as client-go's leaderelection does
//! it: the holder renews `renewTime` every third of the lease duration; another replica
//! takes the Lease over once `renewTime + leaseDurationSeconds` has passed; every write
//! carries the Lease's resourceVersion, so of two replicas racing for it one gets 409 and
//! stays a follower. A leader that cannot renew within the lease duration steps down
//! before anyone else may take over. Only the leader writes; every replica serves webhooks.

use std::time::{Duration, SystemTime};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use kube::api::PostParams;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// What to do about the Lease, seen at `now`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// None exists: create it, holding it.
    Create,
    /// We hold it: renew.
    Renew,
    /// Another holder let it expire: take it over.
    TakeOver,
    /// Another holder's lease is current.
    Follow,
}

/// The decision, from the Lease's spec (`None`: no Lease).
pub fn step(lease: Option<&LeaseSpec>, me: &str, now: SystemTime) -> Step {
    let Some(spec) = lease else { return Step::Create };
    if spec.holder_identity.as_deref() == Some(me) {
        return Step::Renew;
    }
    let renewed = spec.renew_time.as_ref().map(|t| system_time(&t.0));
    let duration = Duration::from_secs(spec.lease_duration_seconds.unwrap_or_default().max(0) as u64);
    match renewed {
        Some(renewed) if renewed + duration > now && spec.holder_identity.is_some() => Step::Follow,
        _ => Step::TakeOver,
    }
}

fn system_time(t: &Timestamp) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_micros(t.as_microsecond().max(0) as u64)
}

fn micro_time(t: SystemTime) -> MicroTime {
    let micros = t.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default().as_micros() as i64;
    MicroTime(Timestamp::from_microsecond(micros).unwrap_or(Timestamp::UNIX_EPOCH))
}

pub struct Election {
    pub leases: Api<Lease>,
    pub name: String,
    /// This replica (its pod name).
    pub identity: String,
    pub duration: Duration,
}

impl Election {
    /// Campaigns until `shutdown`, keeping `leading` true exactly while this replica holds
    /// a current Lease.
    pub async fn run(self, leading: watch::Sender<bool>, shutdown: CancellationToken) {
        let mut last_renewal: Option<tokio::time::Instant> = None;
        loop {
            let held = match self.attempt().await {
                Ok(held) => {
                    last_renewal = held.then(tokio::time::Instant::now);
                    held
                }
                Err(error) => {
                    tracing::warn!(%error, lease = %self.name, "leader election: the Lease cannot be read or written");
                    // Still ours for two thirds of the lease after the last renewal: stepping down well
                    // before another replica may take it over (client-go's renew deadline).
                    last_renewal.is_some_and(|at| at.elapsed() < self.duration * 2 / 3)
                }
            };
            let was = *leading.borrow();
            if held != was {
                tracing::info!(identity = %self.identity, leading = held, "leader election");
                leading.send_replace(held);
            }
            tokio::select! {
                _ = shutdown.cancelled() => {
                    leading.send_replace(false);
                    return;
                }
                _ = tokio::time::sleep(self.duration / 3) => {}
            }
        }
    }

    /// One look at the Lease: whether this replica holds it now.
    async fn attempt(&self) -> Result<bool, kube::Error> {
        let now = SystemTime::now();
        let current = self.leases.get_opt(&self.name).await?;
        let spec = current.as_ref().and_then(|l| l.spec.as_ref());
        let step = step(spec, &self.identity, now);
        let transitions = spec.and_then(|s| s.lease_transitions).unwrap_or_default();
        let acquired = spec
            .and_then(|s| s.acquire_time.clone())
            .filter(|_| step == Step::Renew);
        let mine = |acquired: Option<MicroTime>, transitions: i32| LeaseSpec {
            holder_identity: Some(self.identity.clone()),
            lease_duration_seconds: Some(self.duration.as_secs() as i32),
            acquire_time: acquired.or_else(|| Some(micro_time(now))),
            renew_time: Some(micro_time(now)),
            lease_transitions: Some(transitions),
            ..LeaseSpec::default()
        };
        let written = match step {
            Step::Follow => return Ok(false),
            Step::Create => {
                let lease = Lease {
                    metadata: ObjectMeta {
                        name: Some(self.name.clone()),
                        ..ObjectMeta::default()
                    },
                    spec: Some(mine(None, 0)),
                };
                self.leases.create(&PostParams::default(), &lease).await
            }
            Step::Renew | Step::TakeOver => {
                let mut lease = current.expect("a Lease to renew or take over");
                let transitions = transitions + i32::from(step == Step::TakeOver);
                lease.spec = Some(mine(acquired, transitions));
                // The resourceVersion read is the precondition: a racing writer wins, we follow.
                self.leases.replace(&self.name, &PostParams::default(), &lease).await
            }
        };
        match written {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(status)) if status.code == 409 => Ok(false),
            Err(error) => Err(error),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(holder: &str, renewed_ago: Duration, duration: i32, now: SystemTime) -> LeaseSpec {
        LeaseSpec {
            holder_identity: Some(holder.into()),
            renew_time: Some(micro_time(now - renewed_ago)),
            lease_duration_seconds: Some(duration),
            ..LeaseSpec::default()
        }
    }

    #[test]
    fn create_renew_follow_or_take_over() {
        let now = SystemTime::now();
        let s = Duration::from_secs;
        assert_eq!(step(None, "a", now), Step::Create);
        assert_eq!(step(Some(&lease("a", s(100), 15, now)), "a", now), Step::Renew);
        assert_eq!(step(Some(&lease("b", s(3), 15, now)), "a", now), Step::Follow);
        assert_eq!(step(Some(&lease("b", s(16), 15, now)), "a", now), Step::TakeOver);
        let released = LeaseSpec::default();
        assert_eq!(step(Some(&released), "a", now), Step::TakeOver, "no holder");
    }
}
