//! Whether a predecessor supervisor's Envoy can be taken over. A successor cannot see the predecessor's processes:
//! only the state file and what Envoy's admin answers.

use std::path::Path;
use std::time::Duration;

use super::admin::{AdminError, ServerInfo};
use super::supervisor::SupervisorError;

/// How long after its parent-shutdown time an old epoch may still take to exit.
const PARENT_EXIT_MARGIN: Duration = Duration::from_secs(1);

/// What one answer of the predecessor's Envoy admin means.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// LIVE at the recorded epoch, its own parent retired: hot-restart from it.
    TakeOver,
    /// Nothing answers (and nothing did): start a fresh epoch 0.
    StartFresh,
    /// An Envoy answers but cannot be taken over yet; `last` says why.
    Wait(String),
}

/// Judges `answer` from the Envoy the state file records at `epoch`; `answered`: whether it answered before (then
/// silence is a restart in progress, not an absent Envoy).
pub fn judge(
    answer: &Result<ServerInfo, AdminError>,
    epoch: u32,
    answered: bool,
    parent_shutdown_time: Duration,
) -> Verdict {
    match answer {
        Ok(info)
            if info.is_live()
                && info.restart_epoch == epoch
                && info.restart_epoch > 0
                && info.uptime_current_epoch <= parent_shutdown_time + PARENT_EXIT_MARGIN =>
        {
            // Its parent may still be draining; Envoy would kill that one at once (see Machine::request).
            Verdict::Wait("waiting for the predecessor's previous epoch to retire".to_owned())
        }
        Ok(info) if info.is_live() && info.restart_epoch == epoch => Verdict::TakeOver,
        Ok(info) => Verdict::Wait(format!("state {} at epoch {}", info.state, info.restart_epoch)),
        Err(_) if !answered => Verdict::StartFresh,
        Err(error) => Verdict::Wait(error.to_string()),
    }
}

/// A hot restart needs the predecessor's hot-restart socket: `ours` (None: Envoy's abstract default).
pub fn check_socket(info: &ServerInfo, ours: Option<&Path>) -> Result<(), SupervisorError> {
    let ours = ours
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_else(|| "@envoy_domain_socket".into());
    if info.socket_path != ours {
        return Err(SupervisorError::SocketMismatch {
            theirs: info.socket_path.clone(),
            ours,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const PARENT_SHUTDOWN: Duration = Duration::from_secs(15);

    fn info(state: &str, epoch: u32, uptime_s: u64) -> Result<ServerInfo, AdminError> {
        Ok(ServerInfo {
            state: state.into(),
            restart_epoch: epoch,
            base_id: 7,
            use_dynamic_base_id: false,
            hot_restart_version: "11.104".into(),
            socket_path: "/s/hot-restart".into(),
            uptime_current_epoch: Duration::from_secs(uptime_s),
        })
    }

    fn silent() -> Result<ServerInfo, AdminError> {
        Err(AdminError::Request {
            addr: "127.0.0.1:15000".parse().unwrap(),
            path: "/server_info".into(),
            reason: "connect: refused".into(),
        })
    }

    #[test]
    fn a_predecessor_is_taken_over_only_live_at_its_recorded_epoch_with_its_parent_retired() {
        let waits = |why: &str| Verdict::Wait(why.into());
        let retiring = waits("waiting for the predecessor's previous epoch to retire");
        // (case, the epoch the state file records, the admin's answer, verdict)
        let cases = [
            ("live epoch 0", 0, info("LIVE", 0, 1), Verdict::TakeOver),
            ("live, parent retired", 3, info("LIVE", 3, 17), Verdict::TakeOver),
            ("live, parent may still drain", 3, info("LIVE", 3, 16), retiring),
            (
                "initializing",
                3,
                info("INITIALIZING", 3, 1),
                waits("state INITIALIZING at epoch 3"),
            ),
            ("another epoch", 3, info("LIVE", 4, 60), waits("state LIVE at epoch 4")),
            ("nobody answers", 3, silent(), Verdict::StartFresh),
        ];
        for (case, recorded, answer, verdict) in cases {
            assert_eq!(judge(&answer, recorded, false, PARENT_SHUTDOWN), verdict, "{case}");
        }
        // Silence after an answer is an Envoy between epochs, not a missing one.
        let Verdict::Wait(why) = judge(&silent(), 3, true, PARENT_SHUTDOWN) else {
            panic!("silence after an answer must wait");
        };
        assert!(why.contains("refused"), "{why}");
    }

    #[test]
    fn the_predecessor_must_use_our_hot_restart_socket() {
        let Ok(info) = info("LIVE", 1, 60) else { unreachable!() };
        assert!(check_socket(&info, Some(Path::new("/s/hot-restart"))).is_ok());
        let error = check_socket(&info, None).unwrap_err().to_string();
        assert!(
            error.contains("@envoy_domain_socket") && error.contains("/s/hot-restart"),
            "{error}"
        );
    }
}
