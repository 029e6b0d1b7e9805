//! A real Envoy (the one `make setup` installs) run from a bootstrap written by the test.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use tempfile::TempDir;

use crate::process::ChildGuard;

/// Overrides where the Envoy binary is (`make test` sets it).
pub const ENVOY_BIN_ENV: &str = "AETHER_ENVOY_BIN";
/// How long [`Envoy::start`] waits for admin `/ready` to answer 200.
pub const READY_TIMEOUT: Duration = Duration::from_secs(30);
const ADMIN_TIMEOUT: Duration = Duration::from_secs(10);

static BASE_ID_SEQ: AtomicU32 = AtomicU32::new(0);
/// Live [`Envoy`] guards per base id (hot-restart epochs share one), so the last one removes the shared memory.
static BASE_ID_USERS: Mutex<Option<HashMap<u32, usize>>> = Mutex::new(None);

/// The Envoy binary: `$AETHER_ENVOY_BIN`, else `<workspace>/.venv/lib/python3*/site-packages/envoy/_bin/envoy`.
/// Panics with "Envoy not found: run `make setup`" if neither exists.
pub fn envoy_bin() -> PathBuf {
    if let Some(path) = std::env::var_os(ENVOY_BIN_ENV).filter(|p| !p.is_empty()) {
        let path = PathBuf::from(path);
        assert!(
            path.is_file(),
            "Envoy not found: run `make setup` ({ENVOY_BIN_ENV}={} does not exist)",
            path.display()
        );
        return path;
    }
    let lib = workspace_root().join(".venv/lib");
    let mut candidates: Vec<PathBuf> = std::fs::read_dir(&lib)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
        .map(|e| e.path().join("site-packages/envoy/_bin/envoy"))
        .filter(|p| p.is_file())
        .collect();
    candidates.sort();
    candidates.into_iter().next().unwrap_or_else(|| {
        panic!(
            "Envoy not found: run `make setup` (no {ENVOY_BIN_ENV} and no {}/python3*/site-packages/envoy/_bin/envoy)",
            lib.display()
        )
    })
}

/// The workspace root (the parent of this crate's directory).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("crate dir has a parent")
        .to_path_buf()
}

/// A `--base-id` no other test process (or test in this process) uses at the same time: pid × 64 + a per-process
/// counter. Envoy multiplies the base id by 10 internally, so it stays below 2^32 / 10.
pub fn unique_base_id() -> u32 {
    std::process::id() * 64 + BASE_ID_SEQ.fetch_add(1, Ordering::Relaxed) % 64
}

/// The bootstrap's `admin` section for an admin server on `127.0.0.1:port`:
/// `"admin": admin_address_json(port)`.
pub fn admin_address_json(port: u16) -> serde_json::Value {
    serde_json::json!({
        "address": { "socket_address": { "address": "127.0.0.1", "port_value": port } }
    })
}

/// Where Envoy keeps its hot-restart shared memory for `base_id` (Envoy scales the base id by 10); Envoy leaves it
/// behind when it exits.
pub fn shared_memory_path(base_id: u32) -> PathBuf {
    PathBuf::from(format!("/dev/shm/envoy_shared_memory_{}", u64::from(base_id) * 10))
}

/// A running Envoy; dropping it kills it (and prints its logs if the test is failing) and, if no other guard of
/// this process uses its base id, removes its hot-restart shared memory.
pub struct Envoy {
    child: ChildGuard,
    base_id: u32,
    admin: SocketAddr,
    bootstrap_path: PathBuf,
    _dir: TempDir,
}

impl Envoy {
    /// Runs `envoy -c <bootstrap> --base-id <base_id> --concurrency 1 --log-level info` and waits until admin
    /// `/ready` answers 200. The admin address is read from the bootstrap's `admin.address.socket_address` (put one
    /// there with [`admin_address_json`] and a [`crate::free_port`]). Panics with Envoy's logs if it exits or is not
    /// ready within [`READY_TIMEOUT`].
    pub fn start(bootstrap: &serde_json::Value, base_id: u32) -> Envoy {
        Envoy::start_with_args(bootstrap, base_id, &[])
    }

    /// [`Envoy::start`] with extra command-line arguments (e.g. `--restart-epoch 1`, `--drain-time-s 1`, or
    /// `--concurrency N` instead of the one worker).
    pub fn start_with_args(bootstrap: &serde_json::Value, base_id: u32, extra_args: &[&str]) -> Envoy {
        let admin = admin_addr_of(bootstrap);
        let dir = tempfile::Builder::new()
            .prefix("aether-envoy-")
            .tempdir()
            .expect("temp dir");
        let bootstrap_path = dir.path().join("bootstrap.json");
        std::fs::write(
            &bootstrap_path,
            serde_json::to_vec_pretty(bootstrap).expect("bootstrap JSON"),
        )
        .unwrap_or_else(|e| panic!("write {}: {e}", bootstrap_path.display()));
        let mut cmd = Command::new(envoy_bin());
        cmd.arg("-c")
            .arg(&bootstrap_path)
            .args(["--base-id", &base_id.to_string()])
            .args(["--log-level", "info"]);
        // One worker unless the caller names its own count (Envoy refuses a flag given twice).
        if !extra_args.contains(&"--concurrency") {
            cmd.args(["--concurrency", "1"]);
        }
        cmd.args(extra_args);
        *BASE_ID_USERS
            .lock()
            .get_or_insert_with(HashMap::new)
            .entry(base_id)
            .or_default() += 1;
        // From here on the guard owns the process and its share of the base id.
        let mut envoy = Envoy {
            child: ChildGuard::spawn("envoy", cmd),
            base_id,
            admin,
            bootstrap_path,
            _dir: dir,
        };
        envoy.wait_ready(READY_TIMEOUT);
        envoy
    }

    fn wait_ready(&mut self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait() {
                panic!(
                    "Envoy exited before it was ready ({status}); logs:\n{}",
                    self.child.logs()
                );
            }
            let last = match admin_request(self.admin, "GET", "/ready") {
                Ok((200, _)) => return,
                Ok((status, body)) => format!("{status} {}", body.trim()),
                Err(e) => e,
            };
            assert!(
                Instant::now() < deadline,
                "Envoy not ready within {timeout:?} (admin {}: {last}); logs:\n{}",
                self.admin,
                self.child.logs()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The `--base-id` it runs with.
    pub fn base_id(&self) -> u32 {
        self.base_id
    }

    /// The admin server's address.
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin
    }

    /// Where the bootstrap was written.
    pub fn bootstrap_path(&self) -> &Path {
        &self.bootstrap_path
    }

    /// GET an admin path (`/config_dump`, `/clusters`, `/stats?format=json`, …) and return the body; panics unless
    /// the answer is 200.
    pub fn admin_get(&self, path: &str) -> String {
        self.admin_expect_ok("GET", path)
    }

    /// POST an admin path (`/healthcheck/fail`, `/drain_listeners`, …) and return the body; panics unless 200.
    pub fn admin_post(&self, path: &str) -> String {
        self.admin_expect_ok("POST", path)
    }

    /// An admin request returning (status, body); Err if the admin server cannot be reached.
    pub fn admin_request(&self, method: &str, path: &str) -> Result<(u16, String), String> {
        admin_request(self.admin, method, path)
    }

    fn admin_expect_ok(&self, method: &str, path: &str) -> String {
        match admin_request(self.admin, method, path) {
            Ok((200, body)) => body,
            Ok((status, body)) => panic!("Envoy admin {method} {path}: {status}: {body}"),
            Err(e) => panic!("Envoy admin {method} {path}: {e}; logs:\n{}", self.child.logs()),
        }
    }

    /// `/config_dump` parsed.
    pub fn config_dump(&self) -> serde_json::Value {
        let body = self.admin_get("/config_dump");
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("/config_dump is not JSON ({e}): {body}"))
    }

    /// Envoy's process (pid, logs, signals).
    pub fn child(&self) -> &ChildGuard {
        &self.child
    }

    /// Envoy's process, mutably (wait, kill).
    pub fn child_mut(&mut self) -> &mut ChildGuard {
        &mut self.child
    }

    /// Everything Envoy has logged so far.
    pub fn logs(&self) -> String {
        self.child.logs()
    }

    /// SIGTERM and wait for Envoy to exit; returns its status.
    pub fn terminate(&mut self) -> ExitStatus {
        self.child.terminate()
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        self.child.kill();
        let mut users = BASE_ID_USERS.lock();
        let users = users.get_or_insert_with(HashMap::new);
        let last = match users.get_mut(&self.base_id) {
            Some(n) if *n > 1 => {
                *n -= 1;
                false
            }
            _ => {
                users.remove(&self.base_id);
                true
            }
        };
        if last {
            let _ = std::fs::remove_file(shared_memory_path(self.base_id));
        }
    }
}

fn admin_addr_of(bootstrap: &serde_json::Value) -> SocketAddr {
    let sa = &bootstrap["admin"]["address"]["socket_address"];
    let ip = sa["address"].as_str().and_then(|a| a.parse::<IpAddr>().ok());
    let port = sa["port_value"].as_u64().and_then(|p| u16::try_from(p).ok());
    match (ip, port) {
        (Some(ip), Some(port)) if port != 0 => SocketAddr::new(ip, port),
        _ => panic!(
            "the bootstrap needs admin.address.socket_address with an IP address and a fixed port \
             (use admin_address_json(free_port())), got {sa}"
        ),
    }
}

/// One request to Envoy's admin server; returns (status, body). HTTP/1.1 with `Connection: close` (Envoy answers
/// HTTP/1.0 with 426 unless configured otherwise), so the body ends at EOF and may be chunked.
fn admin_request(admin: SocketAddr, method: &str, path: &str) -> Result<(u16, String), String> {
    let mut stream = TcpStream::connect_timeout(&admin, ADMIN_TIMEOUT).map_err(|e| format!("connect {admin}: {e}"))?;
    stream
        .set_read_timeout(Some(ADMIN_TIMEOUT))
        .map_err(|e| e.to_string())?;
    stream
        .set_write_timeout(Some(ADMIN_TIMEOUT))
        .map_err(|e| e.to_string())?;
    let request =
        format!("{method} {path} HTTP/1.1\r\nHost: {admin}\r\nConnection: close\r\nContent-Length: 0\r\n\r\n");
    stream
        .write_all(request.as_bytes())
        .map_err(|e| format!("write to {admin}: {e}"))?;
    let mut response = Vec::new();
    stream
        .read_to_end(&mut response)
        .map_err(|e| format!("read from {admin}: {e}"))?;
    let split = find(&response, b"\r\n\r\n").ok_or_else(|| {
        format!(
            "{method} {path}: malformed response: {:?}",
            String::from_utf8_lossy(&response)
        )
    })?;
    let head = String::from_utf8_lossy(&response[..split]).to_ascii_lowercase();
    let body = &response[split + 4..];
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("{method} {path}: bad status line: {head:?}"))?;
    let chunked = head
        .lines()
        .any(|l| l.starts_with("transfer-encoding:") && l.contains("chunked"));
    let body = if chunked {
        dechunk(body).ok_or_else(|| format!("{method} {path}: bad chunked body"))?
    } else {
        body.to_vec()
    };
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Decodes a complete `Transfer-Encoding: chunked` body (trailers ignored).
fn dechunk(mut input: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let line_end = find(input, b"\r\n")?;
        let size_field = std::str::from_utf8(&input[..line_end]).ok()?;
        let size = usize::from_str_radix(size_field.split(';').next()?.trim(), 16).ok()?;
        input = &input[line_end + 2..];
        if size == 0 {
            return Some(out);
        }
        out.extend_from_slice(input.get(..size)?);
        input = input.get(size + 2..)?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunked_bodies_are_decoded() {
        assert_eq!(
            dechunk(b"5\r\nLIVE\n\r\n3;x=y\r\nabc\r\n0\r\n\r\n").unwrap(),
            b"LIVE\nabc"
        );
        assert_eq!(dechunk(b"0\r\n\r\n").unwrap(), b"");
        assert_eq!(dechunk(b"5\r\nLI"), None);
    }
}
