//! A real etcd (Debian `etcd-server`, `/usr/bin/etcd`) on free loopback ports with a
//! temp data dir, in its own process group so it never outlives the test.

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;

use super::replicas::StoreFixture;
use super::{TIMEOUT, free_port};

/// Where tests find etcd; override with `AETHER_ETCD_BIN`.
pub const ETCD_BIN_ENV: &str = "AETHER_ETCD_BIN";
pub const DEFAULT_ETCD_BIN: &str = "/usr/bin/etcd";

pub fn etcd_bin() -> PathBuf {
    let bin = PathBuf::from(std::env::var(ETCD_BIN_ENV).unwrap_or_else(|_| DEFAULT_ETCD_BIN.into()));
    assert!(
        bin.exists(),
        "etcd not found at {} (install Debian etcd-server via scripts/setup.sh, or set {ETCD_BIN_ENV})",
        bin.display()
    );
    bin
}

pub struct Etcd {
    child: Option<Child>,
    pub client_port: u16,
    peer_port: u16,
    dir: tempfile::TempDir,
    /// Key prefix given to the registrars: unique per fixture.
    pub prefix: String,
}

impl Etcd {
    /// Starts etcd and waits until it answers.
    pub async fn start() -> Etcd {
        let mut etcd = Etcd {
            child: None,
            client_port: free_port(),
            peer_port: free_port(),
            dir: tempfile::Builder::new().prefix("aether-etcd-").tempdir().unwrap(),
            prefix: format!("/aether-test/{}", std::process::id()),
        };
        etcd.spawn().await;
        etcd
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("etcd.log")
    }

    pub fn logs(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    async fn spawn(&mut self) {
        assert!(self.child.is_none(), "etcd already running");
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .unwrap();
        let child = Command::new(etcd_bin())
            .arg("--name=test")
            .arg(format!("--data-dir={}", self.dir.path().join("data").display()))
            .arg(format!("--listen-client-urls={}", self.endpoint()))
            .arg(format!("--advertise-client-urls={}", self.endpoint()))
            .arg(format!("--listen-peer-urls={peer}"))
            .arg(format!("--initial-advertise-peer-urls={peer}"))
            .arg(format!("--initial-cluster=test={peer}"))
            .arg("--heartbeat-interval=50")
            .arg("--election-timeout=500")
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log.try_clone().unwrap()))
            .stderr(Stdio::from(log))
            .spawn()
            .expect("spawning etcd");
        self.child = Some(child);
        let deadline = Instant::now() + TIMEOUT;
        loop {
            if let Ok(mut client) = etcd_client::Client::connect([self.endpoint()], None).await
                && client.get("/health-probe", None).await.is_ok()
            {
                return;
            }
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("etcd exited with {status} before answering:\n{}", self.logs());
            }
            assert!(
                Instant::now() < deadline,
                "etcd did not answer in time:\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// SIGKILLs etcd's process group (data stays).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = killpg(Pid::from_raw(child.id() as i32), Signal::SIGKILL);
            let _ = child.wait();
        }
    }

    /// Starts etcd again on the same ports and data.
    pub async fn restart(&mut self) {
        self.kill();
        self.spawn().await;
    }

    pub async fn client(&self) -> etcd_client::Client {
        etcd_client::Client::connect([self.endpoint()], None)
            .await
            .expect("connecting to etcd")
    }

    /// Compacts etcd's history up to its current revision.
    pub async fn compact(&self) -> i64 {
        let mut client = self.client().await;
        let revision = client
            .get("/", None)
            .await
            .unwrap()
            .header()
            .map(|h| h.revision())
            .unwrap();
        client
            .compact(revision, Some(etcd_client::CompactionOptions::new().with_physical()))
            .await
            .expect("compacting etcd");
        revision
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("---- etcd log ----\n{}", self.logs());
        }
        self.kill();
    }
}

impl StoreFixture for Etcd {
    fn name(&self) -> &'static str {
        "etcd"
    }

    fn registrar_args(&self) -> Vec<String> {
        vec![
            "--store=etcd".into(),
            format!("--etcd-endpoints={}", self.endpoint()),
            format!("--etcd-prefix={}", self.prefix),
            "--etcd-timeout=1s".into(),
        ]
    }

    async fn stop(&mut self) {
        self.kill();
    }

    async fn resume(&mut self) {
        self.spawn().await;
    }
}
