//! The demo's processes and what a run leaves behind: spawning, readiness, leftovers and the sweep of killed runs.

use super::*;

/// Spawns a product process in its own process group that dies with the demo (`PR_SET_PDEATHSIG`), logging to a
/// file under `$TMPDIR` (the work dir).
pub(crate) fn spawn(name: &str, mut cmd: Command) -> ChildGuard {
    #[allow(unsafe_code)]
    // SAFETY: the closure runs between fork and exec and only calls prctl(2), which is async-signal-safe.
    unsafe {
        cmd.pre_exec(|| nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).map_err(std::io::Error::from));
    }
    ChildGuard::spawn(name, cmd)
}

pub(crate) async fn wait_ready(admin_port: u16, child: &mut ChildGuard) -> Result<(), DemoError> {
    let deadline = Instant::now() + READY_TIMEOUT;
    let url = format!("http://127.0.0.1:{admin_port}/ready");
    loop {
        if let Ok(reply) = http_get(&url, None).await
            && reply.status == 200
        {
            return Ok(());
        }
        if let Some(status) = child.try_wait() {
            return Err(fail(format!(
                "{} exited ({status}) before it was ready; log (tail):\n{}",
                child.name(),
                tail(&child.logs(), 20)
            )));
        }
        if Instant::now() > deadline {
            return Err(fail(format!(
                "{} not ready at {url} within {READY_TIMEOUT:?}; log (tail):\n{}",
                child.name(),
                tail(&child.logs(), 20)
            )));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub(crate) fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

pub(crate) fn shm_path(base_id: u32) -> PathBuf {
    PathBuf::from(format!("/dev/shm/envoy_shared_memory_{}", u64::from(base_id) * 10))
}

/// The base id the supervisor recorded in its state dir.
pub(crate) fn read_base_id(state_dir: &Path) -> Option<u32> {
    let text = std::fs::read_to_string(state_dir.join("proxy-state.json")).ok()?;
    let state: Value = serde_json::from_str(&text).ok()?;
    state["base_id"].as_u64().map(|b| b as u32)
}

/// Mount points under `dir` (netns pins), deepest first.
pub(crate) fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    // With the trailing slash: `/tmp/aether-demo-12` must not match `/tmp/aether-demo-123/…`.
    let prefix = format!("{}/", dir.display());
    let mut mounts: Vec<PathBuf> = std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_whitespace().nth(4))
        .filter(|m| m.starts_with(&prefix))
        .map(PathBuf::from)
        .collect();
    mounts.sort_by_key(|m| std::cmp::Reverse(m.as_os_str().len()));
    mounts
}

pub(crate) fn unmount_under(dir: &Path) {
    for mount in mounts_under(dir) {
        let _ = nix::mount::umount2(&mount, nix::mount::MntFlags::MNT_DETACH);
    }
}

/// This run's netns names (`aen-<pid>…`).
pub(crate) fn run_netns(pid: u32) -> Vec<String> {
    let prefix = format!("{NETNS_PREFIX}{pid:06x}");
    std::fs::read_dir(aether_tests::netns::NETNS_DIR)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&prefix) && n.len() == prefix.len() + 4)
        .collect()
}

/// What a run of process `pid` working in `work` left behind, described (empty: nothing).
pub fn leftovers(pid: u32, work: &Path, base_id: Option<u32>) -> Vec<String> {
    let mut left = Vec::new();
    for ns in run_netns(pid) {
        left.push(format!("netns {ns}"));
    }
    let prefix = format!("{NETNS_PREFIX}{pid:06x}");
    for entry in std::fs::read_dir(ETC_NETNS).into_iter().flatten().flatten() {
        if entry.file_name().to_string_lossy().starts_with(&prefix) {
            left.push(format!("pod resolv.conf {}", entry.path().display()));
        }
    }
    let links = Command::new("ip")
        .args(["-o", "link", "show"])
        .output()
        .map(|o| o.stdout)
        .unwrap_or_default();
    let bridge = format!("aeb{pid:06x}");
    for line in String::from_utf8_lossy(&links).lines() {
        if let Some(name) = line.split_whitespace().nth(1)
            && name.starts_with(&bridge)
        {
            left.push(format!("link {}", name.trim_end_matches(':')));
        }
    }
    for mount in mounts_under(work) {
        left.push(format!("mount {}", mount.display()));
    }
    let work_str = format!("{}/", work.display());
    for p in processes() {
        if p.pid != std::process::id() && !p.zombie && p.cmdline.contains(&work_str) {
            left.push(format!(
                "process {} ({})",
                p.pid,
                p.cmdline.chars().take(80).collect::<String>()
            ));
        }
    }
    if work.exists() {
        left.push(format!("directory {}", work.display()));
    }
    if let Some(base_id) = base_id
        && shm_path(base_id).exists()
    {
        left.push(format!("Envoy shared memory {}", shm_path(base_id).display()));
    }
    left
}

/// Removes what runs killed without cleaning up left (their pid is gone): processes working in their dir, netns
/// pins and their netns, Envoy's shared memory, the dir. Returns what it removed. Bridges and veths of dead
/// processes are swept by [`TestNode::new`].
pub fn sweep_leftovers() -> Vec<String> {
    let mut swept = Vec::new();
    let tmp = Path::new(WORK_BASE);
    let alive = |pid: u32| Path::new(&format!("/proc/{pid}")).exists();
    for entry in std::fs::read_dir(tmp).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name.strip_prefix(WORK_PREFIX).and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if pid == std::process::id() || alive(pid) {
            continue;
        }
        let dir = entry.path();
        let dir_str = format!("{}/", dir.display());
        for p in processes() {
            // Each process on its own (not its group: a shell that merely names the dir must not lose its group).
            if p.cmdline.contains(&dir_str) && p.pid != std::process::id() {
                let _ = kill(Pid::from_raw(p.pid as i32), Signal::SIGKILL);
            }
        }
        if let Some(base_id) = read_base_id(&dir.join("proxy/state")) {
            let _ = std::fs::remove_file(shm_path(base_id));
        }
        unmount_under(&dir);
        let _ = std::fs::remove_dir_all(&dir);
        swept.push(dir_str);
    }
    // Pod netns of dead processes (`aen-<pid>…`).
    for entry in std::fs::read_dir(aether_tests::netns::NETNS_DIR)
        .into_iter()
        .flatten()
        .flatten()
    {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix(NETNS_PREFIX) else {
            continue;
        };
        let Some(pid) = rest.get(..6).and_then(|p| u32::from_str_radix(p, 16).ok()) else {
            continue;
        };
        if rest.len() == 10 && rest.chars().all(|c| c.is_ascii_hexdigit()) && !alive(pid) {
            let _ = Command::new("ip").args(["netns", "del", &name]).output();
            swept.push(format!("netns {name}"));
        }
    }
    // Their pods' resolv.conf (`/etc/netns/aen-<pid>…`).
    for entry in std::fs::read_dir(ETC_NETNS).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix(NETNS_PREFIX)
            .and_then(|rest| rest.get(..6))
            .and_then(|p| u32::from_str_radix(p, 16).ok())
        else {
            continue;
        };
        if !alive(pid) && std::fs::remove_dir_all(entry.path()).is_ok() {
            swept.push(format!("pod resolv.conf {}", entry.path().display()));
        }
    }
    swept
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_keeps_the_last_lines() {
        assert_eq!(tail("a\nb\nc", 2), "b\nc");
        assert_eq!(tail("a", 5), "a");
    }
}
