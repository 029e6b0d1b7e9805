//! `make demo` end to end: the demo binary brings a node up, shows the mesh working and exits 0 having printed the
//! key facts; it leaves nothing of its run behind, also when interrupted (SIGINT) or killed (SIGKILL: the next run
//! sweeps what it left).

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use aether_demo::{WORK_BASE, WORK_PREFIX, leftovers};
use aether_tests::{binary, require_root};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// Well under nextest's 300 s kill: a demo run takes ~20 s.
const RUN_TIMEOUT: Duration = Duration::from_secs(180);

/// A running demo whose stdout lines arrive on a channel (and are kept), stderr collected at the end.
struct DemoRun {
    child: Child,
    lines: mpsc::Receiver<String>,
    stdout: Vec<String>,
}

impl DemoRun {
    fn spawn() -> DemoRun {
        require_root();
        let mut child = Command::new(binary("aether-demo"))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawning aether-demo");
        let stdout = child.stdout.take().expect("piped");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        DemoRun {
            child,
            lines,
            stdout: Vec::new(),
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn work(&self) -> PathBuf {
        Path::new(WORK_BASE).join(format!("{WORK_PREFIX}{}", self.pid()))
    }

    /// Waits for a stdout line starting with `prefix` and returns it.
    fn wait_line(&mut self, prefix: &str) -> String {
        let deadline = Instant::now() + RUN_TIMEOUT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.stdout.push(line.clone());
                    if line.starts_with(prefix) {
                        return line;
                    }
                }
                Err(_) => {
                    let _ = self.child.kill();
                    panic!(
                        "the demo never printed a line starting with {prefix:?}; stdout:\n{}",
                        self.stdout.join("\n")
                    );
                }
            }
        }
    }

    /// Waits for the exit; returns the status, the whole stdout and stderr.
    fn finish(mut self) -> (ExitStatus, String, String) {
        let deadline = Instant::now() + RUN_TIMEOUT;
        let status = loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                break status;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!(
                    "the demo did not finish within {RUN_TIMEOUT:?}; stdout so far:\n{}",
                    self.stdout.join("\n")
                );
            }
            while let Ok(line) = self.lines.try_recv() {
                self.stdout.push(line);
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        // The reader thread ends at EOF.
        while let Ok(line) = self.lines.recv_timeout(Duration::from_secs(5)) {
            self.stdout.push(line);
        }
        let mut stderr = String::new();
        if let Some(mut err) = self.child.stderr.take() {
            let _ = err.read_to_string(&mut stderr);
        }
        (status, self.stdout.join("\n"), stderr)
    }
}

/// The run's Envoy base id, from the proxy step's line.
fn base_id(stdout: &str) -> Option<u32> {
    let rest = stdout.split("base id ").nth(1)?;
    rest.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
}

fn assert_nothing_left(pid: u32, work: &Path, stdout: &str) {
    let left = leftovers(pid, work, base_id(stdout));
    assert!(
        left.is_empty(),
        "the demo (pid {pid}) left things behind: {left:#?}\nstdout:\n{stdout}"
    );
}

#[test]
fn the_demo_runs_green_shows_the_mesh_and_leaves_nothing_behind() {
    let run = DemoRun::spawn();
    let (pid, work) = (run.pid(), run.work());
    let (status, stdout, stderr) = run.finish();
    assert!(
        status.success(),
        "make demo failed ({status}):\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    // Every step reported ok, in order.
    for step in 1..=aether_demo::STEPS {
        let prefix = format!("[{step:>2}/{}] ", aether_demo::STEPS);
        let line = stdout
            .lines()
            .find(|l| l.starts_with(&prefix))
            .unwrap_or_else(|| panic!("no step {step}:\n{stdout}"));
        assert!(line.contains(" ... ok ("), "step {step} not ok: {line}");
    }
    // The key facts.
    assert!(
        stdout.contains("backend saw:    spiffe://cluster.local/ns/demo/sa/frontend"),
        "no SPIFFE ID:\n{stdout}"
    );
    assert!(
        stdout.contains("-> 240.240."),
        "the name did not resolve to a mesh VIP:\n{stdout}"
    );
    let spread = stdout
        .lines()
        .find(|l| l.contains("load spread:"))
        .expect("a load spread line");
    for replica in ["backend-1", "backend-2"] {
        let served: u64 = spread
            .split(&format!("{replica}="))
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no count for {replica}: {spread}"));
        assert!(served > 0, "{replica} served nothing: {spread}");
    }
    let restart = stdout
        .lines()
        .find(|l| l.contains("hot restart:"))
        .expect("a hot restart line");
    assert!(restart.ends_with(", 0 failed"), "{restart}");
    let ok: u64 = restart
        .split_whitespace()
        .find_map(|w| w.parse().ok())
        .expect("a request count");
    assert!(ok > 0, "{restart}");
    // Strict mTLS and the policy: the denial was logged by the agent, naming the caller.
    assert!(
        stdout.contains(
            "authorization:  legacy's plaintext refused (strict mTLS); ALLOW for demo/frontend: batch 403, frontend 200"
        ),
        "{stdout}"
    );
    let denial = stdout
        .lines()
        .find(|l| l.contains("authorization: no ALLOW policy selecting the pod matched"))
        .unwrap_or_else(|| panic!("no denial log line:\n{stdout}"));
    assert!(
        denial.contains("verdict=\"deny\"") && denial.contains("source=spiffe://cluster.local/ns/demo/sa/batch"),
        "{denial}"
    );
    // North-south: HTTPS from the host through the edge gateway, into the mesh as the gateway.
    assert!(
        stdout.contains(
            "edge gateway:   https://shop.example.com -> edge (TLS) -> mTLS as spiffe://cluster.local/ns/demo/sa/edge-gateway -> frontend"
        ),
        "{stdout}"
    );
    assert!(stdout.contains("cleanup:        nothing left behind"), "{stdout}");
    assert_nothing_left(pid, &work, &stdout);
}

#[test]
fn an_interrupted_or_killed_demo_leaves_nothing_behind_and_the_next_run_works() {
    // SIGINT in the middle (the hot restart step, with load running): cancel, clean up, exit non-zero. A step's
    // line ends when the step is done, so step 13's whole line means step 14, the hot restart, has begun.
    let mut run = DemoRun::spawn();
    let (pid, work) = (run.pid(), run.work());
    run.wait_line("[13/");
    kill(Pid::from_raw(pid as i32), Signal::SIGINT).expect("SIGINT");
    let (status, stdout, stderr) = run.finish();
    assert!(!status.success(), "an interrupted demo must not exit 0:\n{stdout}");
    assert!(
        stdout.contains("interrupted by SIGINT"),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(
        stderr.contains("make demo failed: interrupted by SIGINT"),
        "stderr:\n{stderr}"
    );
    let teardown = stdout
        .lines()
        .find(|l| l.contains("tearing the node down"))
        .expect("a teardown step");
    assert!(teardown.contains(" ... ok ("), "{teardown}\n{stdout}");
    assert_nothing_left(pid, &work, &stdout);

    // SIGKILL once the pods exist: the children die with it, the rest waits for the next run's sweep.
    let mut run = DemoRun::spawn();
    let (killed, killed_work) = (run.pid(), run.work());
    run.wait_line("[ 8/");
    kill(Pid::from_raw(killed as i32), Signal::SIGKILL).expect("SIGKILL");
    let (_, killed_stdout, _) = run.finish();
    let left = leftovers(killed, &killed_work, None);
    assert!(
        left.iter().any(|l| l.starts_with("netns")),
        "a killed run leaves its pod netns for the sweep: {left:?}"
    );

    // The next run sweeps them and works.
    let run = DemoRun::spawn();
    let (pid, work) = (run.pid(), run.work());
    let (status, stdout, stderr) = run.finish();
    assert!(
        status.success(),
        "the run after a killed one failed ({status}):\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert_nothing_left(killed, &killed_work, &killed_stdout);
    assert_nothing_left(pid, &work, &stdout);
}
