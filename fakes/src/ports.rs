//! Free TCP ports for the servers tests start, safe across the parallel test processes.
//!
//! Binding `127.0.0.1:0` and handing the number on races: until the test's server binds
//! it, the kernel may give the same number to another test's `:0` or to an outgoing
//! connection (both draw from the ephemeral range). Ports here come from below that range
//! (outgoing connections never take them), and each is claimed for the life of the test
//! process by an abstract Unix socket named after it, so no two live test processes get the
//! same one, and nothing is left behind when they exit.

use std::net::TcpListener;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener};
use std::sync::atomic::{AtomicU32, Ordering};

use parking_lot::Mutex;

/// Below Linux's default ephemeral range (32768–60999).
const FIRST: u32 = 20_000;
const COUNT: u32 = 12_000;

/// The claims this process holds; dropped (released) when it exits.
static CLAIMS: Mutex<Vec<UnixListener>> = Mutex::new(Vec::new());

/// A TCP port on 127.0.0.1 nobody listens on and no other live test process was given.
pub fn free_port() -> u16 {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    // Processes start at different offsets, so they rarely contend for the same claims.
    let start = std::process::id().wrapping_mul(7919);
    for _ in 0..COUNT {
        let port = (FIRST + start.wrapping_add(NEXT.fetch_add(1, Ordering::Relaxed)) % COUNT) as u16;
        if claim(port) && TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("free_port: no free port in {FIRST}..{}", FIRST + COUNT)
}

/// Claims `port` for this process; false if another live process holds it.
fn claim(port: u16) -> bool {
    let name = format!("aether-test-port-{port}");
    let address = SocketAddr::from_abstract_name(name.as_bytes()).unwrap_or_else(|e| panic!("free_port: {name}: {e}"));
    match UnixListener::bind_addr(&address) {
        Ok(listener) => {
            CLAIMS.lock().push(listener);
            true
        }
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_distinct_bindable_below_the_ephemeral_range_and_claimed() {
        let ports: Vec<u16> = (0..50).map(|_| free_port()).collect();
        let mut unique = ports.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), ports.len(), "{ports:?}");
        for port in ports {
            assert!((FIRST..FIRST + COUNT).contains(&u32::from(port)));
            TcpListener::bind(("127.0.0.1", port)).expect("bindable");
            assert!(!claim(port), "{port} is claimed by this process");
        }
    }
}
