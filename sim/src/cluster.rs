//! The real control plane of a run: one etcd and two registrar replicas on it, each
//! in its own process group, killed when dropped; what they cost, read from /proc and
//! etcd's /metrics.

use std::net::{SocketAddr, TcpListener};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::pki::Pki;

/// How long a process may take to become ready.
const START_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("spawning {what} ({bin}): {source}")]
    Spawn {
        what: &'static str,
        bin: PathBuf,
        source: std::io::Error,
    },
    #[error("{what} was not ready within {START_TIMEOUT:?}; its log: {log}")]
    NotReady { what: &'static str, log: PathBuf },
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

fn free_addr() -> std::io::Result<SocketAddr> {
    TcpListener::bind("127.0.0.1:0")?.local_addr()
}

/// A child in its own process group, killed (group and all) on drop.
struct Process(Child);

impl Process {
    fn spawn(what: &'static str, mut command: Command, log: &Path) -> Result<Process, StartError> {
        let bin = PathBuf::from(command.get_program());
        let child = command
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(log)?)
            .spawn()
            .map_err(|source| StartError::Spawn { what, bin, source })?;
        Ok(Process(child))
    }

    fn kill(&mut self) {
        let _ = killpg(Pid::from_raw(self.0.id() as i32), Signal::SIGKILL);
        let _ = self.0.wait();
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A minimal HTTP/1.0 GET: (status, body).
pub async fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    let request = format!("GET {path} HTTP/1.0\r\nHost: sim\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let status = response.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Ok((status, body))
}

async fn wait_ready(what: &'static str, addr: SocketAddr, path: &str, log: &Path) -> Result<(), StartError> {
    let deadline = Instant::now() + START_TIMEOUT;
    while !matches!(http_get(addr, path).await, Ok((200, _))) {
        if Instant::now() > deadline {
            return Err(StartError::NotReady {
                what,
                log: log.to_owned(),
            });
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

/// A single-member etcd on loopback with a temp data dir.
pub struct Etcd {
    _process: Process,
    pub client: SocketAddr,
}

impl Etcd {
    pub async fn start(bin: &Path, dir: &Path) -> Result<Etcd, StartError> {
        let (client, peer) = (free_addr()?, free_addr()?);
        let log = dir.join("etcd.log");
        let mut command = Command::new(bin);
        command
            .arg("--name=sim")
            .arg(format!("--data-dir={}", dir.join("etcd").display()))
            .arg(format!("--listen-client-urls=http://{client}"))
            .arg(format!("--advertise-client-urls=http://{client}"))
            .arg(format!("--listen-peer-urls=http://{peer}"))
            .arg(format!("--initial-advertise-peer-urls=http://{peer}"))
            .arg(format!("--initial-cluster=sim=http://{peer}"))
            // Like a production member: the backend may grow past the 2 GiB default.
            .arg("--quota-backend-bytes=8589934592");
        let process = Process::spawn("etcd", command, &log)?;
        wait_ready("etcd", client, "/health", &log).await?;
        Ok(Etcd {
            _process: process,
            client,
        })
    }

    /// Every gRPC message etcd has received so far (unary requests and stream
    /// messages: txns, lease grants and keep-alives, watch creations).
    pub async fn requests(&self) -> f64 {
        let body = http_get(self.client, "/metrics")
            .await
            .map(|(_, b)| b)
            .unwrap_or_default();
        body.lines()
            .filter(|l| l.starts_with("grpc_server_msg_received_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }
}

/// What a process has cost so far.
#[derive(Clone, Copy, Debug, Default)]
pub struct Usage {
    pub cpu_seconds: f64,
    pub rss_mib: f64,
}

impl Usage {
    /// Reads /proc/<pid>: utime + stime (in clock ticks, 100 Hz) and VmRSS.
    pub fn of(pid: u32) -> Usage {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        // Fields after the command name (which may hold spaces) start at state (3).
        let fields: Vec<&str> = stat
            .rsplit_once(')')
            .map(|(_, r)| r.split_whitespace().collect())
            .unwrap_or_default();
        let ticks = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        let rss_kib = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
            .unwrap_or(0.0);
        Usage {
            // utime and stime are fields 14 and 15, i.e. 11 and 12 after the state.
            cpu_seconds: (ticks(11) + ticks(12)) / 100.0,
            rss_mib: rss_kib / 1024.0,
        }
    }
}

/// One registrar replica serving mTLS on etcd.
pub struct Replica {
    process: Option<Process>,
    pid: u32,
    /// `http://127.0.0.1:<port>`: the agents' connector does the TLS.
    pub url: String,
    pub admin: SocketAddr,
}

impl Replica {
    pub async fn start(bin: &Path, pki: &Pki, etcd: &Etcd, dir: &Path, name: &str) -> Result<Replica, StartError> {
        let (grpc, admin) = (free_addr()?, free_addr()?);
        let data = dir.join(name);
        std::fs::create_dir_all(&data)?;
        let mut command = Command::new(bin);
        command
            .args(["--listen", &grpc.to_string(), "--admin", &admin.to_string()])
            .arg("--data-dir")
            .arg(&data)
            .args(["--store=etcd", &format!("--etcd-endpoints=http://{}", etcd.client)])
            .arg("--etcd-prefix=/aether-sim")
            // Simulated agents register once and never refresh (see the README).
            .arg("--endpoint-ttl=1h")
            .args(pki.registrar_args())
            .env("RUST_LOG", "warn");
        let log = dir.join(format!("{name}.log"));
        let process = Process::spawn("registrar", command, &log)?;
        wait_ready("registrar", admin, "/ready", &log).await?;
        Ok(Replica {
            pid: process.0.id(),
            process: Some(process),
            url: format!("http://{grpc}"),
            admin,
        })
    }

    pub fn usage(&self) -> Usage {
        Usage::of(self.pid)
    }

    /// SIGKILL: the replica dies without a goodbye, as on a node failure.
    pub fn kill(&mut self) {
        if let Some(mut process) = self.process.take() {
            process.kill();
        }
    }
}
