use super::*;

use tokio::time::advance;

const GRACE: Duration = Duration::from_secs(30);

fn rules(fixed_base_id: bool) -> Rules {
    Rules {
        me: "me".into(),
        fixed_base_id,
        successor_grace: GRACE,
    }
}

fn binary(inode: u64) -> Fingerprint {
    Fingerprint {
        len: 1,
        mtime_ns: 0,
        inode,
    }
}

/// Template `template`, binary 1.
fn inputs(template: u64) -> Inputs {
    Inputs {
        template,
        binary: binary(1),
    }
}

fn live(epoch: u32) -> Event {
    Event::Live {
        epoch,
        pid: 100 + epoch,
        spawned: Instant::now(),
        inputs: inputs(1),
    }
}

/// A machine whose epoch 0 runs from `inputs(1)`.
fn running(fixed_base_id: bool) -> Machine {
    let mut machine = Machine::new(rules(fixed_base_id));
    assert_eq!(on(&mut machine, live(0)), []);
    machine
}

fn on(machine: &mut Machine, event: Event) -> Vec<Action> {
    machine.on(Instant::now(), event)
}

fn tick(watch: bool, inputs: Option<Inputs>) -> Event {
    Event::Tick {
        watch,
        inputs,
        record: None,
    }
}

/// A tick that finds the state file claimed by "next" at epoch 1.
fn tick_claimed() -> Event {
    Event::Tick {
        watch: false,
        inputs: None,
        record: claim("next", 1),
    }
}

fn claim(owner: &str, epoch: u32) -> Option<Record> {
    Some(Record {
        owner: owner.into(),
        epoch,
    })
}

fn exited() -> Event {
    Event::Exited {
        status: "signal: 9 (SIGKILL)".into(),
        record: None,
    }
}

fn crashed(epoch: u32, restart_in: Duration) -> Action {
    Action::Crashed {
        epoch,
        status: "signal: 9 (SIGKILL)".into(),
        restart_in,
    }
}

/// Hot-restarts `from` → `from + 1` for SIGHUP; the old epoch is then retiring. Needs a paused clock (`since`).
fn hot_restart(machine: &mut Machine, from: u32) {
    let since = Instant::now();
    let why = Trigger::Sighup;
    assert_eq!(on(machine, Event::Hangup), [Action::Probe { epoch: from, why }]);
    let epoch = from + 1;
    assert_eq!(
        on(machine, Event::Probed { live: true }),
        [Action::HotRestart { epoch, why, since }]
    );
    assert_eq!(on(machine, live(epoch)), []);
}

#[tokio::test(start_paused = true)]
async fn crash_restarts_back_off_doubling_up_to_ten_seconds() {
    let mut machine = running(false);
    let waits = [100, 200, 400, 800, 1600, 3200, 6400, 10_000, 10_000].map(Duration::from_millis);
    for (n, wait) in waits.into_iter().enumerate() {
        assert_eq!(on(&mut machine, exited()), [crashed(0, wait)], "crash {n}");
        assert_eq!(machine.restart_at(), Some(Instant::now() + wait));
        // Nothing restarts in between: no ticks' work, no hot restart without a running Envoy.
        assert_eq!(on(&mut machine, tick(true, Some(inputs(2)))), []);
        assert_eq!(on(&mut machine, Event::Hangup), []);
        advance(wait).await;
        let reuse = Some(inputs(1));
        assert_eq!(on(&mut machine, Event::RestartDue), [Action::StartFresh { reuse }]);
        assert_eq!(machine.restart_at(), None);
        advance(Duration::from_secs(1)).await;
        assert_eq!(on(&mut machine, live(0)), []);
    }
}

#[tokio::test(start_paused = true)]
async fn an_epoch_that_lived_a_minute_resets_the_crash_backoff() {
    for (lived, wait) in [
        (STABLE_AFTER - Duration::from_millis(1), Duration::from_millis(800)),
        (STABLE_AFTER, FIRST_BACKOFF),
    ] {
        let mut machine = running(false);
        for wait in [100, 200, 400].map(Duration::from_millis) {
            assert_eq!(on(&mut machine, exited()), [crashed(0, wait)]);
            on(&mut machine, Event::RestartDue);
            on(&mut machine, live(0));
        }
        advance(lived).await;
        assert_eq!(on(&mut machine, exited()), [crashed(0, wait)], "lived {lived:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn a_failed_crash_restart_retries_with_growing_backoff() {
    let mut machine = running(false);
    assert_eq!(on(&mut machine, exited()), [crashed(0, FIRST_BACKOFF)]);
    for wait in [200, 400, 800].map(Duration::from_millis) {
        advance(machine.restart_at().unwrap() - Instant::now()).await;
        assert!(matches!(
            on(&mut machine, Event::RestartDue)[..],
            [Action::StartFresh { .. }]
        ));
        assert_eq!(machine.backoff(), wait);
        assert_eq!(on(&mut machine, Event::StartFailed), []);
        assert_eq!(machine.restart_at(), Some(Instant::now() + wait));
    }
}

#[tokio::test(start_paused = true)]
async fn with_a_fixed_base_id_a_crash_restart_stops_the_retiring_epochs_first() {
    for (fixed, stop_first) in [(true, true), (false, false)] {
        let mut machine = running(fixed);
        hot_restart(&mut machine, 0);
        assert_eq!(on(&mut machine, exited()), [crashed(1, FIRST_BACKOFF)]);
        let start = Action::StartFresh { reuse: Some(inputs(1)) };
        let expected = if stop_first {
            vec![Action::StopRetiring, start]
        } else {
            vec![start]
        };
        assert_eq!(on(&mut machine, Event::RestartDue), expected, "fixed {fixed}");
    }
    // Nothing retiring, nothing to stop.
    let mut machine = running(true);
    on(&mut machine, exited());
    assert_eq!(on(&mut machine, Event::RestartDue).len(), 1);
}

#[test]
fn input_changes_trigger_a_hot_restart_named_by_what_changed() {
    let template = |t| Some(inputs(t));
    let new_binary = |b| {
        Some(Inputs {
            template: 1,
            binary: binary(b),
        })
    };
    let both = Some(Inputs {
        template: 2,
        binary: binary(2),
    });
    let probe = |why| vec![Action::Heartbeat, Action::Probe { epoch: 0, why }];
    let cases = [
        ("unchanged", true, template(1), vec![Action::Heartbeat]),
        ("unreadable", true, None, vec![Action::Heartbeat]),
        ("not a watch tick", false, template(2), vec![]),
        ("template", true, template(2), probe(Trigger::BootstrapChanged)),
        ("binary", true, new_binary(2), probe(Trigger::BinaryChanged)),
        ("both", true, both, probe(Trigger::BinaryChanged)),
    ];
    for (case, watch, inputs, expected) in cases {
        let mut machine = running(false);
        assert_eq!(on(&mut machine, tick(watch, inputs)), expected, "{case}");
    }
}

#[tokio::test(start_paused = true)]
async fn a_hot_restart_bumps_the_epoch_and_the_next_one_waits_for_the_old_epoch_to_retire() {
    let mut machine = running(false);
    hot_restart(&mut machine, 0);
    // Epoch 0 is retiring (Envoy's parent shutdown): a trigger waits, keeping when it was first asked for.
    let first = Instant::now();
    assert_eq!(on(&mut machine, Event::Hangup), []);
    advance(Duration::from_millis(300)).await;
    assert_eq!(on(&mut machine, tick(true, Some(inputs(2)))), [Action::Heartbeat]);
    assert_eq!(on(&mut machine, tick(false, None)), []);
    assert_eq!(on(&mut machine, Event::Retired { epoch: 0 }), []);
    let why = Trigger::BootstrapChanged;
    assert_eq!(on(&mut machine, tick(false, None)), [Action::Probe { epoch: 1, why }]);
    assert_eq!(
        on(&mut machine, Event::Probed { live: true }),
        [Action::HotRestart {
            epoch: 2,
            why,
            since: first
        }]
    );
}

#[tokio::test(start_paused = true)]
async fn a_trigger_during_a_hot_restart_follows_it() {
    let mut machine = running(false);
    assert!(matches!(on(&mut machine, Event::Hangup)[..], [Action::Probe { .. }]));
    advance(Duration::from_millis(10)).await;
    let second = Instant::now();
    assert_eq!(on(&mut machine, Event::Hangup), []);
    assert!(matches!(
        on(&mut machine, Event::Probed { live: true })[..],
        [Action::HotRestart { epoch: 1, .. }]
    ));
    assert_eq!(on(&mut machine, live(1)), []);
    assert_eq!(on(&mut machine, tick(false, None)), [], "epoch 0 still retires");
    on(&mut machine, Event::Retired { epoch: 0 });
    let why = Trigger::Sighup;
    assert_eq!(on(&mut machine, tick(false, None)), [Action::Probe { epoch: 1, why }]);
    let restart = on(&mut machine, Event::Probed { live: true });
    assert_eq!(
        restart,
        [Action::HotRestart {
            epoch: 2,
            why,
            since: second
        }]
    );
}

#[tokio::test(start_paused = true)]
async fn a_trigger_waits_while_the_running_epoch_is_not_live() {
    let mut machine = running(false);
    let first = Instant::now();
    let why = Trigger::Sighup;
    assert_eq!(on(&mut machine, Event::Hangup), [Action::Probe { epoch: 0, why }]);
    assert_eq!(on(&mut machine, Event::Probed { live: false }), []);
    advance(Duration::from_millis(500)).await;
    assert_eq!(on(&mut machine, tick(false, None)), [Action::Probe { epoch: 0, why }]);
    assert_eq!(
        on(&mut machine, Event::Probed { live: true }),
        [Action::HotRestart {
            epoch: 1,
            why,
            since: first
        }]
    );
}

#[test]
fn refused_inputs_are_retried_only_once_they_change_again_or_on_sighup() {
    let mut machine = running(false);
    let bootstrap = |epoch| {
        vec![
            Action::Heartbeat,
            Action::Probe {
                epoch,
                why: Trigger::BootstrapChanged,
            },
        ]
    };
    let refuse = |machine: &mut Machine, template| {
        assert_eq!(on(machine, Event::Probed { live: true }).len(), 1);
        let inputs = Some(inputs(template));
        assert_eq!(on(machine, Event::Refused { inputs }), []);
    };
    assert_eq!(on(&mut machine, tick(true, Some(inputs(2)))), bootstrap(0));
    refuse(&mut machine, 2);
    assert_eq!(on(&mut machine, tick(true, Some(inputs(2)))), [Action::Heartbeat]);
    assert_eq!(on(&mut machine, tick(true, Some(inputs(3)))), bootstrap(0));
    refuse(&mut machine, 3);
    // SIGHUP forgets the refusal; a failed start does not refuse anything.
    let probe = Action::Probe {
        epoch: 0,
        why: Trigger::Sighup,
    };
    assert_eq!(on(&mut machine, Event::Hangup), [probe]);
    on(&mut machine, Event::Probed { live: true });
    assert_eq!(on(&mut machine, Event::RestartFailed), []);
    assert_eq!(on(&mut machine, tick(true, Some(inputs(3)))), bootstrap(0));
    on(&mut machine, Event::Probed { live: true });
    assert_eq!(on(&mut machine, live(1)), []);
    on(&mut machine, Event::Retired { epoch: 0 });
    assert_eq!(on(&mut machine, tick(true, Some(inputs(1)))), [Action::Heartbeat]);
}

#[test]
fn a_later_epoch_claimed_by_another_owner_supersedes_us() {
    let cases = [
        ("another owner, later epoch", claim("next", 1), true),
        ("another owner, same epoch", claim("next", 0), false),
        ("ourselves, later epoch", claim("me", 1), false),
        ("no state file", None, false),
    ];
    for (case, record, superseded) in cases {
        let mut machine = running(false);
        let actions = on(
            &mut machine,
            Event::Tick {
                watch: true,
                inputs: Some(inputs(1)),
                record,
            },
        );
        let expected = if superseded {
            vec![Action::Superseded {
                by: "next".into(),
                epoch: 1,
            }]
        } else {
            vec![Action::Heartbeat]
        };
        assert_eq!(actions, expected, "{case}");
    }
}

#[test]
fn a_superseded_supervisor_restarts_nothing_and_hands_off_when_its_epoch_exits() {
    let mut machine = running(false);
    assert_eq!(on(&mut machine, tick_claimed()).len(), 1);
    assert_eq!(on(&mut machine, Event::Hangup), []);
    assert_eq!(on(&mut machine, tick(true, Some(inputs(2)))), []);
    assert_eq!(on(&mut machine, exited()), [Action::HandOff]);

    // A claim seen only once our epoch exited hands off too, instead of counting a crash.
    let mut machine = running(false);
    let record = claim("next", 1);
    let actions = on(
        &mut machine,
        Event::Exited {
            status: "0".into(),
            record,
        },
    );
    assert_eq!(
        actions,
        [
            Action::Superseded {
                by: "next".into(),
                epoch: 1
            },
            Action::HandOff
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn a_successor_that_vanished_without_taking_over_is_looked_for_after_the_grace() {
    let mut machine = running(false);
    assert_eq!(on(&mut machine, tick_claimed()).len(), 1);
    advance(GRACE - Duration::from_millis(1)).await;
    assert_eq!(on(&mut machine, tick_claimed()), []);
    advance(Duration::from_millis(1)).await;
    let check = Action::CheckSuccessor {
        successor: "next".into(),
        epoch: 0,
    };
    assert_eq!(on(&mut machine, tick_claimed()), [check]);
    for (successor_alive, ours_live, reclaim) in [(true, true, false), (false, false, false), (false, true, true)] {
        let answer = Event::SuccessorChecked {
            successor_alive,
            ours_live,
        };
        let expected = if reclaim { vec![Action::Reclaim] } else { vec![] };
        assert_eq!(
            on(&mut machine, answer),
            expected,
            "alive {successor_alive} live {ours_live}"
        );
    }
    // Ours again: restarts run.
    let why = Trigger::Sighup;
    assert_eq!(on(&mut machine, Event::Hangup), [Action::Probe { epoch: 0, why }]);
}

#[test]
fn sigterm_drains_our_epoch_unless_a_successor_owns_it() {
    let superseded = Action::Superseded {
        by: "next".into(),
        epoch: 1,
    };
    let cases = [
        ("ours", None, vec![Action::Drain { epoch: Some(0) }]),
        ("claimed", claim("next", 1), vec![superseded, Action::AwaitRetirement]),
    ];
    for (case, record, expected) in cases {
        let mut machine = running(false);
        assert_eq!(on(&mut machine, Event::Shutdown { record }), expected, "{case}");
    }
    let mut machine = running(false);
    on(&mut machine, tick_claimed());
    let record = None;
    let actions = on(&mut machine, Event::Shutdown { record });
    assert_eq!(actions, [Action::AwaitRetirement], "superseded before");
    let mut machine = running(false);
    on(&mut machine, exited());
    let record = None;
    let actions = on(&mut machine, Event::Shutdown { record });
    assert_eq!(actions, [Action::Drain { epoch: None }], "while a crash restart waits");
}
