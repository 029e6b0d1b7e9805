//! Runtime helpers used by more than one Aether binary.

pub mod admin;
pub mod duration;
pub mod fs;
pub mod hash;
#[cfg(feature = "kube")]
pub mod kube_watch;
pub mod names;
#[cfg(feature = "netns")]
pub mod netns;
pub mod pod_endpoint;
pub mod pod_meta;
pub mod quote;
pub mod readiness;
pub mod shutdown;
pub mod tasks;
pub mod telemetry;
pub mod tls;
