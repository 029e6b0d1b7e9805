//! Child processes that never outlive their test.

use std::fs::File;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tempfile::TempDir;

/// How long [`ChildGuard::terminate`] waits for the process after SIGTERM.
pub const TERMINATE_TIMEOUT: Duration = Duration::from_secs(10);

/// A child process started in its own process group, with stdout and stderr captured to a log file in a temp dir.
///
/// Dropping the guard SIGKILLs the whole group and reaps the child. If the thread is panicking (a failing test),
/// the drop also prints the logs to stderr, so the test's output shows what the process said.
pub struct ChildGuard {
    name: String,
    child: Child,
    log_path: PathBuf,
    /// `None` once the child has been reaped.
    status: Option<ExitStatus>,
    _dir: TempDir,
}

impl ChildGuard {
    /// Spawns `cmd` (its stdout and stderr go to the log; stdin is null) in a new process group. `name` labels the
    /// logs and panics. Panics if it cannot be spawned.
    pub fn spawn(name: &str, mut cmd: Command) -> ChildGuard {
        let dir = tempfile::Builder::new()
            .prefix(&format!("aether-{name}-"))
            .tempdir()
            .unwrap_or_else(|e| panic!("{name}: temp dir: {e}"));
        let log_path = dir.path().join(format!("{name}.log"));
        let log = File::create(&log_path).unwrap_or_else(|e| panic!("{name}: create {}: {e}", log_path.display()));
        let log2 = log.try_clone().expect("clone log file");
        cmd.process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log2));
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("{name}: cannot spawn {cmd:?}: {e}"));
        ChildGuard {
            name: name.to_string(),
            child,
            log_path,
            status: None,
            _dir: dir,
        }
    }

    /// The label given at spawn.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The child's pid (also its process group id).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Where the child's stdout and stderr go (deleted with the guard).
    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// Everything the child has written to stdout and stderr so far.
    pub fn logs(&self) -> String {
        std::fs::read(&self.log_path)
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_else(|e| format!("<cannot read {}: {e}>", self.log_path.display()))
    }

    /// Sends `signal` to the whole process group.
    pub fn signal(&self, signal: Signal) {
        if self.status.is_none() {
            let _ = killpg(self.pgid(), signal);
        }
    }

    /// The exit status if the child has exited (reaping it), else `None`.
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            self.status = self
                .child
                .try_wait()
                .unwrap_or_else(|e| panic!("{}: wait: {e}", self.name));
        }
        self.status
    }

    /// Waits up to `timeout` for the child to exit.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.try_wait() {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGTERM to the group and wait up to [`TERMINATE_TIMEOUT`] for the child; see [`ChildGuard::terminate_within`].
    pub fn terminate(&mut self) -> ExitStatus {
        self.terminate_within(TERMINATE_TIMEOUT)
    }

    /// SIGTERM to the group, wait up to `timeout` for the child to exit and return its status; then SIGKILL whatever
    /// is left of the group. Panics (with the logs) if the child ignores SIGTERM for `timeout`.
    pub fn terminate_within(&mut self, timeout: Duration) -> ExitStatus {
        self.signal(Signal::SIGTERM);
        match self.wait_timeout(timeout) {
            Some(status) => {
                let _ = killpg(self.pgid(), Signal::SIGKILL);
                status
            }
            None => {
                self.kill();
                panic!(
                    "{} (pid {}) did not exit within {timeout:?} of SIGTERM; logs:\n{}",
                    self.name,
                    self.pid(),
                    self.logs()
                );
            }
        }
    }

    /// SIGKILL to the group; waits for the child and returns its status.
    pub fn kill(&mut self) -> ExitStatus {
        if let Some(status) = self.status {
            return status;
        }
        match killpg(self.pgid(), Signal::SIGKILL) {
            Ok(()) | Err(Errno::ESRCH) => {}
            Err(e) => panic!("{}: killpg: {e}", self.name),
        }
        let status = self.child.wait().unwrap_or_else(|e| panic!("{}: wait: {e}", self.name));
        self.status = Some(status);
        status
    }

    fn pgid(&self) -> Pid {
        Pid::from_raw(self.child.id() as i32)
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if self.status.is_none() {
            let _ = killpg(self.pgid(), Signal::SIGKILL);
            if let Ok(status) = self.child.wait() {
                self.status = Some(status);
            }
        }
        if std::thread::panicking() {
            let how = match self.status {
                Some(s) if s.signal() == Some(Signal::SIGKILL as i32) => "SIGKILL".to_string(),
                Some(s) => s.to_string(),
                None => "unknown".to_string(),
            };
            eprintln!(
                "----- {} (pid {}, {how}) logs -----\n{}\n----- end of {} logs -----",
                self.name,
                self.pid(),
                self.logs(),
                self.name
            );
        }
    }
}

/// A process as `/proc` shows it.
#[derive(Debug)]
pub struct Process {
    pub pid: u32,
    pub pgid: u32,
    pub zombie: bool,
    /// Its arguments joined by spaces.
    pub cmdline: String,
}

/// Every process on the host (those that exit while being read are skipped).
pub fn processes() -> Vec<Process> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // pid (comm) state ppid pgrp …; comm may hold spaces, so split after the last ')'.
        let Some(rest) = stat.rfind(')').map(|i| &stat[i + 2..]) else {
            continue;
        };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let cmdline = std::fs::read(entry.path().join("cmdline"))
            .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
            .unwrap_or_default();
        out.push(Process {
            pid,
            pgid: fields.get(2).and_then(|p| p.parse().ok()).unwrap_or(0),
            zombie: fields.first() == Some(&"Z"),
            cmdline,
        });
    }
    out
}

/// A free TCP port on 127.0.0.1 no other test process was given (see `aether_fakes::ports`).
pub use aether_fakes::ports::free_port;
