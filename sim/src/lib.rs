//! aether-sim: the registrar tier at cluster scale. N simulated agents, each with its
//! own mTLS HTTP/2 connection, node identity and filtered Watch stream, against two
//! registrar replicas on a real etcd; a seeded workload model, churn, and the death
//! of a replica; what every part costs (issue 22, proposals/011).

pub mod churn;
pub mod cluster;
pub mod fleet;
pub mod holdings;
pub mod ledger;
pub mod model;
pub mod pki;
pub mod report;
pub mod run;
pub mod stats;

use std::path::PathBuf;

/// The registrar binary: `AETHER_REGISTRAR_BIN`, or `aether-registrar` next to this
/// executable or its parent directory (test binaries live in `target/<profile>/deps`).
pub fn registrar_bin() -> PathBuf {
    if let Ok(bin) = std::env::var("AETHER_REGISTRAR_BIN") {
        return bin.into();
    }
    let exe = std::env::current_exe().unwrap_or_default();
    exe.ancestors()
        .skip(1)
        .take(2)
        .map(|dir| dir.join("aether-registrar"))
        .find(|bin| bin.exists())
        .unwrap_or_else(|| "aether-registrar".into())
}

/// Raises this process's open-file limit to its hard limit (children inherit it):
/// every agent holds a socket here and on a replica.
pub fn raise_fd_limit() -> nix::Result<u64> {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
    setrlimit(Resource::RLIMIT_NOFILE, hard, hard)?;
    Ok(hard)
}
