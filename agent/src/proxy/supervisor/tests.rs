//! The supervisor against a fake host ([`FakeHost`]) on a paused clock: what it does, and when.

use std::os::unix::process::ExitStatusExt;
use std::path::Path;

use aether_common::readiness::Readiness;
use aether_common::telemetry::{LogFormat, TelemetryConfig};
use nix::sys::signal::Signal;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::UnboundedReceiverStream;

use super::*;
use crate::proxy::config::AdsApi;
use crate::proxy::fake::{DYNAMIC_BASE_ID, FakeHost, PREDECESSOR_BASE_ID, Spawned, VERSION};
use crate::proxy::machine::STABLE_AFTER;

const DRAIN: Duration = Duration::from_secs(1);
const PARENT_SHUTDOWN: Duration = Duration::from_secs(2);
const LIVE_TIMEOUT: Duration = Duration::from_secs(5);
const WATCH: Duration = Duration::from_millis(200);

fn ms(ms: u64) -> Duration {
    Duration::from_millis(ms)
}

fn config(dir: &Path) -> ProxyConfig {
    let template = dir.join("bootstrap.yaml");
    if !template.exists() {
        let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("../proxy/bootstrap.yaml");
        std::fs::copy(shipped, &template).unwrap();
    }
    ProxyConfig {
        node_name: "node-a".into(),
        node_cluster: "aether".into(),
        envoy_bin: "/fake/envoy".into(),
        bootstrap_template: template,
        state_dir: dir.join("state"),
        xds_socket: "/run/aether/xds.sock".into(),
        ads: AdsApi::Delta,
        envoy_admin: "127.0.0.1:15000".parse().unwrap(),
        drain_time: DRAIN,
        parent_shutdown_time: PARENT_SHUTDOWN,
        base_id: BaseIdMode::Dynamic,
        base_id_value: 0,
        hot_restart_socket: None,
        concurrency: 1,
        max_heap_bytes: 1 << 30,
        max_downstream_connections: 50_000,
        live_timeout: LIVE_TIMEOUT,
        watch_interval: WATCH,
        envoy_log_level: "info".into(),
        admin: "127.0.0.1:18093".parse().unwrap(),
        ready_file: None,
        telemetry: TelemetryConfig::default(),
        log_format: LogFormat::Text,
    }
}

/// One supervisor, started and supervising, and what it can be asked.
struct Node {
    fake: FakeHost,
    cfg: ProxyConfig,
    metrics: ProxyMetrics,
    readiness: Readiness,
    status: Arc<Mutex<Status>>,
    hangup: mpsc::UnboundedSender<()>,
    shutdown: CancellationToken,
    supervisor: JoinHandle<Ended>,
    _dir: tempfile::TempDir,
}

impl Node {
    async fn start(fake: FakeHost) -> Node {
        Self::start_in(tempfile::tempdir().unwrap(), fake).await
    }

    async fn start_in(dir: tempfile::TempDir, fake: FakeHost) -> Node {
        let cfg = config(dir.path());
        let (metrics, readiness, status) = (ProxyMetrics::default(), Readiness::new(), Arc::default());
        let mut supervisor = Supervisor::with_host(
            cfg.clone(),
            fake.clone(),
            metrics.clone(),
            readiness.gate("envoy"),
            Arc::clone(&status),
        )
        .unwrap();
        supervisor.start().await.unwrap();
        let (hangup, hangups) = mpsc::unbounded_channel();
        let shutdown = CancellationToken::new();
        let supervisor = tokio::spawn(supervisor.supervise(shutdown.clone(), UnboundedReceiverStream::new(hangups)));
        Node {
            fake,
            cfg,
            metrics,
            readiness,
            status,
            hangup,
            shutdown,
            supervisor,
            _dir: dir,
        }
    }

    fn newest(&self) -> Spawned {
        self.fake.spawned().pop().expect("an Envoy")
    }

    /// The `n`th Envoy started (from 1), once it is.
    async fn spawned(&self, n: usize) -> Spawned {
        until(&format!("Envoy #{n} started"), || {
            self.fake.spawned().get(n - 1).cloned()
        })
        .await
    }

    fn state(&self) -> Option<ProxyState> {
        StateDir::open(&self.cfg.state_dir).unwrap().read().unwrap()
    }
}

fn counted(family: &Family<[(&'static str, &'static str); 1], Counter>, label: (&'static str, &'static str)) -> u64 {
    family.get_or_create(&[label]).get()
}

/// Polls `f` every 10 ms (of paused time) until it answers, for at most 10 minutes.
async fn until<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        if let Some(value) = f() {
            return value;
        }
        assert!(Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(ms(10)).await;
    }
}

fn has_args(spawned: &Spawned, args: &[&str]) -> bool {
    spawned.args.windows(args.len()).any(|w| w == args)
}

#[tokio::test(start_paused = true)]
async fn a_first_start_runs_epoch_0_with_a_dynamic_base_id_and_records_it() {
    let node = Node::start(FakeHost::default()).await;
    let zero = node.newest();
    assert!(
        has_args(&zero, &["--restart-epoch", "0", "--use-dynamic-base-id"]),
        "{:?}",
        zero.args
    );
    assert_eq!(node.readiness.get(), Ok(()));
    let state = node.state().unwrap();
    assert_eq!(
        (state.epoch, state.phase, state.base_id),
        (0, Phase::Live, DYNAMIC_BASE_ID)
    );
    assert_eq!(state.owner, node.status.lock().owner);
    assert_eq!(node.status.lock().envoy_pid, Some(zero.pid));
    assert_eq!(node.fake.validations(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_crashed_envoy_starts_again_after_a_backoff_doubling_up_to_ten_seconds() {
    let node = Node::start(FakeHost::default()).await;
    let waits = [100, 200, 400, 800, 1600, 3200, 6400, 10_000, 10_000].map(ms);
    for (n, wait) in waits.into_iter().enumerate() {
        let crashed = node.newest();
        node.fake.crash(crashed.pid);
        let at = Instant::now();
        until("not ready", || node.readiness.get().is_err().then_some(())).await;
        let restarted = node.spawned(n + 2).await;
        assert_eq!((restarted.epoch, restarted.at - at), (0, wait), "crash {n}");
        until("ready again", || node.readiness.get().ok()).await;
    }
    assert_eq!(
        node.fake.validations(),
        1,
        "unchanged inputs reuse the crashed epoch's bootstrap"
    );
    assert_eq!((node.metrics.crashes.get(), node.metrics.restarts.get()), (9, 9));
    // Each fresh epoch 0 got a new dynamic base id; the old ones' shared memory is gone.
    let removed: Vec<u32> = (0..9).map(|n| DYNAMIC_BASE_ID + n).collect();
    assert_eq!(node.fake.shared_memory_removed(), removed);
}

#[tokio::test(start_paused = true)]
async fn the_crash_backoff_resets_once_an_epoch_lived_a_minute() {
    let node = Node::start(FakeHost::default()).await;
    for (n, lived, wait) in [(2, ms(0), ms(100)), (3, ms(0), ms(200)), (4, STABLE_AFTER, ms(100))] {
        tokio::time::sleep(lived).await;
        node.fake.crash(node.newest().pid);
        let at = Instant::now();
        assert_eq!(node.spawned(n).await.at - at, wait, "after living {lived:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn sighup_starts_the_next_epoch_and_envoy_retires_the_parent_after_its_parent_shutdown() {
    let node = Node::start(FakeHost::default()).await;
    let zero = node.newest();
    node.hangup.send(()).unwrap();
    let one = node.spawned(2).await;
    let base_id = DYNAMIC_BASE_ID.to_string();
    assert!(
        has_args(&one, &["--restart-epoch", "1", "--base-id", &base_id]),
        "{:?}",
        one.args
    );
    until("epoch 1 LIVE", || (node.status.lock().epoch == Some(1)).then_some(())).await;
    assert_eq!(node.status.lock().retiring_pids, [zero.pid]);
    assert_eq!(counted(&node.metrics.hot_restarts, ("trigger", "sighup")), 1);
    let state = node.state().unwrap();
    assert_eq!((state.epoch, state.phase, state.envoy_pid), (1, Phase::Live, one.pid));
    // Envoy's parent shutdown retires epoch 0; the supervisor only reaps it and never signals a parent.
    until("epoch 0 reaped", || {
        node.status.lock().retiring_pids.is_empty().then_some(())
    })
    .await;
    let exited = node.fake.spawned()[0].exited_at.unwrap();
    assert_eq!(exited - one.at, PARENT_SHUTDOWN);
    assert!(node.fake.signals().is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_trigger_while_the_previous_epoch_retires_waits_for_it() {
    let node = Node::start(FakeHost::default()).await;
    node.hangup.send(()).unwrap();
    node.hangup.send(()).unwrap();
    let one = node.spawned(2).await;
    let two = node.spawned(3).await;
    let zero = node.fake.spawned()[0].clone();
    assert_eq!(two.epoch, 2);
    assert!(
        two.at >= zero.exited_at.unwrap(),
        "epoch 2 started before epoch 0 retired"
    );
    assert!(two.at - one.at <= PARENT_SHUTDOWN + WATCH, "{:?}", two.at - one.at);
    until("epoch 2 LIVE", || (node.status.lock().epoch == Some(2)).then_some(())).await;
    assert_eq!(counted(&node.metrics.hot_restarts, ("trigger", "sighup")), 2);
}

#[tokio::test(start_paused = true)]
async fn a_bootstrap_envoy_refuses_is_not_retried_until_sighup() {
    let node = Node::start(FakeHost::default()).await;
    node.fake.set_invalid(true);
    let template = &node.cfg.bootstrap_template;
    let text = std::fs::read_to_string(template).unwrap();
    std::fs::write(template, format!("{text}\n# changed\n")).unwrap();
    let refused = || counted(&node.metrics.validation_failures, ("reason", "invalid_bootstrap"));
    until("refused", || (refused() == 1).then_some(())).await;
    let error = node.status.lock().last_error.clone().unwrap_or_default();
    assert!(error.contains("fake Envoy refuses it"), "{error}");
    tokio::time::sleep(WATCH * 10).await;
    assert_eq!(
        (refused(), node.fake.validations()),
        (1, 2),
        "refused inputs are not retried"
    );
    node.fake.set_invalid(false);
    node.hangup.send(()).unwrap();
    assert_eq!(node.spawned(2).await.epoch, 1);
    assert_eq!(node.readiness.get(), Ok(()), "the running Envoy never noticed");
}

#[tokio::test(start_paused = true)]
async fn a_binary_with_another_hot_restart_version_is_refused() {
    let node = Node::start(FakeHost::default()).await;
    node.fake.replace_binary("99.1");
    let refused = || counted(&node.metrics.validation_failures, ("reason", "incompatible_binary"));
    until("refused", || (refused() == 1).then_some(())).await;
    tokio::time::sleep(WATCH * 10).await;
    assert_eq!((refused(), node.fake.spawned().len()), (1, 1));
    let error = node.status.lock().last_error.clone().unwrap_or_default();
    assert!(error.contains("99.1") && error.contains(VERSION), "{error}");
}

#[tokio::test(start_paused = true)]
async fn a_new_epoch_not_live_in_time_is_stopped_and_the_old_one_serves_on() {
    let node = Node::start(FakeHost::default()).await;
    let zero = node.newest();
    node.fake.never_live();
    node.hangup.send(()).unwrap();
    let one = node.spawned(2).await;
    let failed = || counted(&node.metrics.hot_restart_failures, ("reason", "not_live"));
    until("given up", || (failed() == 1).then_some(())).await;
    let signals = node.fake.signals();
    assert_eq!(signals.len(), 1);
    let (pid, signal, at) = signals[0];
    assert_eq!((pid, signal), (one.pid, Signal::SIGTERM));
    assert!(
        at - one.at >= LIVE_TIMEOUT && at - one.at < LIVE_TIMEOUT + ms(100),
        "{:?}",
        at - one.at
    );
    let state = node.state().unwrap();
    assert_eq!(
        (state.epoch, state.envoy_pid),
        (0, zero.pid),
        "the state file names the serving epoch again"
    );
    assert_eq!(node.status.lock().epoch, Some(0));
    assert!(node.fake.spawned()[0].exited_at.is_none());
}

#[tokio::test(start_paused = true)]
async fn sigterm_drains_for_the_drain_time_then_stops_envoy_killing_it_if_it_must() {
    let fake = FakeHost::default();
    fake.ignore_sigterm();
    let mut node = Node::start(fake).await;
    let zero = node.newest();
    let at = Instant::now();
    node.shutdown.cancel();
    assert_eq!((&mut node.supervisor).await.unwrap(), Ended::Stopped);
    let posts: Vec<_> = node
        .fake
        .admin_posts()
        .into_iter()
        .map(|(path, when)| (path, when - at))
        .collect();
    assert_eq!(
        posts,
        [("/healthcheck/fail", ms(0)), ("/drain_listeners?graceful", ms(0))]
    );
    let signals: Vec<_> = node
        .fake
        .signals()
        .into_iter()
        .map(|(pid, s, when)| (pid, s, when - at))
        .collect();
    let kill_at = DRAIN + STOP_TIMEOUT;
    assert_eq!(
        signals,
        [(zero.pid, Signal::SIGTERM, DRAIN), (zero.pid, Signal::SIGKILL, kill_at)]
    );
    assert_eq!(node.state(), None, "the state file is removed");
    assert_eq!(node.fake.shared_memory_removed(), [DYNAMIC_BASE_ID]);
    assert!(node.readiness.get().is_err());
}

/// A predecessor's state file naming its Envoy at `epoch`.
fn predecessor(cfg: &ProxyConfig, epoch: u32, phase: Phase, envoy_pid: u32) -> ProxyState {
    ProxyState {
        owner: "1-1".into(),
        owner_pid: 1,
        epoch,
        phase,
        base_id: PREDECESSOR_BASE_ID,
        envoy_pid,
        envoy_admin: cfg.envoy_admin,
        hot_restart_version: VERSION.into(),
        hot_restart_socket: cfg.hot_restart_socket_path(),
        heartbeat_unix_ms: now_unix_ms(),
    }
}

/// A state dir where a predecessor's Envoy at epoch 2, up for `up_for` (None: gone), is recorded in `phase`.
fn with_predecessor(fake: &FakeHost, up_for: Option<Duration>, phase: Phase) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path());
    let pid = up_for.map_or(99, |up_for| fake.adopt(2, up_for, cfg.hot_restart_socket_path()));
    let states = StateDir::open(&cfg.state_dir).unwrap();
    states
        .update(|_| (Some(Some(predecessor(&cfg, 2, phase, pid))), ()))
        .unwrap();
    dir
}

#[tokio::test(start_paused = true)]
async fn a_restarted_supervisor_takes_over_the_live_envoy_it_finds_in_the_state_dir() {
    let fake = FakeHost::default();
    let dir = with_predecessor(&fake, Some(Duration::from_secs(60)), Phase::Live);
    let node = Node::start_in(dir, fake).await;
    let three = node.newest();
    let base_id = PREDECESSOR_BASE_ID.to_string();
    assert!(
        has_args(&three, &["--restart-epoch", "3", "--base-id", &base_id]),
        "{:?}",
        three.args
    );
    assert_eq!(node.metrics.takeovers.get(), 1);
    let state = node.state().unwrap();
    let owner = node.status.lock().owner.clone();
    assert_eq!(
        (state.owner, state.epoch, state.base_id),
        (owner, 3, PREDECESSOR_BASE_ID)
    );
    let predecessors = until("the predecessor's epoch retired", || node.fake.spawned()[0].exited_at).await;
    assert_eq!(predecessors - three.at, PARENT_SHUTDOWN);
}

#[tokio::test(start_paused = true)]
async fn a_young_predecessor_epoch_is_taken_over_only_once_its_own_parent_retired() {
    let fake = FakeHost::default();
    let dir = with_predecessor(&fake, Some(Duration::ZERO), Phase::Live);
    let started = Instant::now();
    let node = Node::start_in(dir, fake).await;
    let three = node.newest();
    assert_eq!(three.epoch, 3);
    let waited = three.at - started;
    assert!(
        waited > PARENT_SHUTDOWN + Duration::from_secs(1),
        "took over after {waited:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_predecessor_that_is_gone_or_draining_means_a_fresh_epoch_0() {
    for (case, up_for, phase) in [
        ("gone", None, Phase::Live),
        ("draining", Some(Duration::from_secs(60)), Phase::Draining),
    ] {
        let fake = FakeHost::default();
        let dir = with_predecessor(&fake, up_for, phase);
        let node = Node::start_in(dir, fake).await;
        let zero = node.newest();
        assert!(
            has_args(&zero, &["--restart-epoch", "0", "--use-dynamic-base-id"]),
            "{case}: {:?}",
            zero.args
        );
        assert_eq!(node.metrics.takeovers.get(), 0, "{case}");
    }
}

#[tokio::test(start_paused = true)]
async fn a_superseded_supervisor_steps_aside_and_ends_when_its_epoch_is_retired() {
    let mut node = Node::start(FakeHost::default()).await;
    let zero = node.newest();
    let claim = ProxyState {
        owner: "successor".into(),
        ..predecessor(&node.cfg, 1, Phase::Starting, 1)
    };
    StateDir::open(&node.cfg.state_dir)
        .unwrap()
        .update(|_| (Some(Some(claim.clone())), ()))
        .unwrap();
    let reason = until("not ready", || node.readiness.get().err()).await.to_string();
    assert!(reason.contains("superseded by successor"), "{reason}");
    tokio::time::sleep(WATCH * 5).await;
    assert_eq!(node.state(), Some(claim), "no heartbeat over the successor's claim");
    node.fake.exit(zero.pid, std::process::ExitStatus::from_raw(0));
    assert_eq!((&mut node.supervisor).await.unwrap(), Ended::HandedOff);
    assert_eq!(node.metrics.crashes.get(), 0);
}
