//! Free TCP ports for the servers tests start, safe across the parallel test processes.
//!
//! Binding `127.0.0.1:0` and handing the number on races: until the test's server binds
//! it, the kernel may give the same number to another test's `:0` or to an outgoing
//! connection (both draw from the ephemeral range). Ports here come from below that range
//! (outgoing connections never take them) and each is claimed by a lock file created
//! exclusively, so no two tests get the same one. A claim older than [`STALE`] is free again:
//! by then its server is bound (and the bind check skips it) or gone.

use std::fs::OpenOptions;
use std::io::ErrorKind;
use std::net::TcpListener;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, SystemTime};

/// Below Linux's default ephemeral range (32768–60999).
const FIRST: u32 = 20_000;
const COUNT: u32 = 12_000;
const STALE: Duration = Duration::from_secs(600);

/// A TCP port on 127.0.0.1 nobody listens on and no other test process was given.
pub fn free_port() -> u16 {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let dir = claims_dir();
    // Processes start at different offsets, so they rarely contend for the same claims.
    let start = std::process::id().wrapping_mul(7919);
    for _ in 0..COUNT {
        let port = (FIRST + (start.wrapping_add(NEXT.fetch_add(1, Ordering::Relaxed)) % COUNT)) as u16;
        if claim(&dir.join(port.to_string())) && TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("free_port: no free port in {FIRST}..{}", FIRST + COUNT)
}

fn claims_dir() -> PathBuf {
    let dir = std::env::temp_dir().join("aether-test-ports");
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("free_port: {}: {e}", dir.display()));
    dir
}

/// Claims `path` for this process: created now, or left stale by an earlier claim.
fn claim(path: &PathBuf) -> bool {
    match OpenOptions::new().write(true).create_new(true).open(path) {
        Ok(_) => true,
        Err(e) if e.kind() == ErrorKind::AlreadyExists => {
            let age = std::fs::metadata(path)
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| SystemTime::now().duration_since(t).ok());
            // Re-stamp a stale claim; the newer mtime keeps others off it.
            age.is_some_and(|a| a > STALE) && std::fs::File::create(path).is_ok()
        }
        Err(e) => panic!("free_port: {}: {e}", path.display()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_distinct_bindable_and_below_the_ephemeral_range() {
        let ports: Vec<u16> = (0..50).map(|_| free_port()).collect();
        let mut unique = ports.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), ports.len(), "{ports:?}");
        for port in ports {
            assert!((FIRST..FIRST + COUNT).contains(&u32::from(port)));
            TcpListener::bind(("127.0.0.1", port)).expect("bindable");
        }
    }
}
