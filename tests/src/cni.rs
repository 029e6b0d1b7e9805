//! Running CNI plugins the way a container runtime does (libcni): a conflist, each plugin found on `CNI_PATH` and
//! executed with the CNI environment and its config on stdin, ADD in order passing each result on as the next
//! plugin's `prevResult`, DEL in reverse order with the cached result, CHECK in order with the cached result, GC and
//! STATUS per plugin. Plus bare network namespaces (what a runtime creates before ADD) and a guard that removes netns
//! pins a test leaves behind.

use std::io::Write;
use std::net::{SocketAddr, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use nix::sched::{CloneFlags, setns};
use serde_json::{Value, json};

/// Debian's containernetworking-plugins.
pub const DEBIAN_CNI_DIR: &str = "/usr/lib/cni";
const NETNS_PREFIX: &str = "aen-";
static SEQ: AtomicU32 = AtomicU32::new(0);

/// One plugin execution: exit status, stdout (the CNI answer), stderr.
#[derive(Clone, Debug)]
pub struct PluginRun {
    pub plugin: String,
    pub command: String,
    pub success: bool,
    pub stdout: String,
    pub stderr: String,
}

impl PluginRun {
    /// stdout as JSON (panics with the output when it is not).
    pub fn json(&self) -> Value {
        serde_json::from_str(self.stdout.trim())
            .unwrap_or_else(|e| panic!("{} {}: stdout is not JSON ({e}): {:?}", self.plugin, self.command, self))
    }

    /// The CNI error code of a failed run.
    pub fn code(&self) -> u64 {
        assert!(!self.success, "{} {} succeeded: {self:?}", self.plugin, self.command);
        self.json()["code"]
            .as_u64()
            .unwrap_or_else(|| panic!("no error code: {self:?}"))
    }

    pub fn msg(&self) -> String {
        self.json()["msg"].as_str().unwrap_or_default().to_owned()
    }
}

/// The per-sandbox CNI variables.
#[derive(Clone, Debug)]
pub struct Sandbox {
    pub container_id: String,
    pub netns: PathBuf,
    pub ifname: String,
    /// `K8S_POD_NAMESPACE`, `K8S_POD_NAME`, `K8S_POD_UID` (CNI_ARGS); None: no CNI_ARGS.
    pub pod: Option<(String, String, String)>,
}

impl Sandbox {
    pub fn new(container_id: &str, netns: &Path, namespace: &str, name: &str) -> Sandbox {
        Sandbox {
            container_id: container_id.to_owned(),
            netns: netns.to_owned(),
            ifname: "eth0".into(),
            pod: Some((namespace.to_owned(), name.to_owned(), format!("uid-{container_id}"))),
        }
    }

    pub fn env(&self) -> Vec<(String, String)> {
        let mut env = vec![
            ("CNI_CONTAINERID".to_owned(), self.container_id.clone()),
            ("CNI_NETNS".to_owned(), self.netns.display().to_string()),
            ("CNI_IFNAME".to_owned(), self.ifname.clone()),
        ];
        if let Some((ns, name, uid)) = &self.pod {
            env.push((
                "CNI_ARGS".to_owned(),
                format!("IgnoreUnknown=1;K8S_POD_NAMESPACE={ns};K8S_POD_NAME={name};K8S_POD_INFRA_CONTAINER_ID={};K8S_POD_UID={uid}", self.container_id),
            ));
        }
        env
    }
}

/// Executes `binary` with `CNI_COMMAND=command`, `env` and `stdin`, as a runtime does (environment cleared but for
/// PATH and the CNI variables).
pub fn exec_plugin(binary: &Path, command: &str, env: &[(String, String)], stdin: &[u8]) -> PluginRun {
    let mut cmd = Command::new(binary);
    cmd.env_clear()
        .env(
            "PATH",
            std::env::var("PATH").unwrap_or_else(|_| "/usr/sbin:/usr/bin:/sbin:/bin".into()),
        )
        .env("CNI_COMMAND", command)
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", binary.display()));
    child
        .stdin
        .take()
        .expect("piped")
        .write_all(stdin)
        .expect("writing stdin");
    let out = child.wait_with_output().expect("plugin output");
    PluginRun {
        plugin: binary.display().to_string(),
        command: command.to_owned(),
        success: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// A network configuration list and the directories plugins are looked up in.
#[derive(Clone, Debug)]
pub struct ConfList {
    pub list: Value,
    pub cni_path: Vec<PathBuf>,
}

impl ConfList {
    pub fn new(list: Value, cni_path: Vec<PathBuf>) -> ConfList {
        assert!(list["plugins"].is_array(), "a conflist needs plugins: {list}");
        ConfList { list, cni_path }
    }

    fn cni_path_var(&self) -> String {
        self.cni_path
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(":")
    }

    /// The plugin binary for `type`, from CNI_PATH in order.
    pub fn find(&self, plugin_type: &str) -> PathBuf {
        self.cni_path
            .iter()
            .map(|d| d.join(plugin_type))
            .find(|p| p.is_file())
            .unwrap_or_else(|| panic!("plugin {plugin_type:?} is not in CNI_PATH {}", self.cni_path_var()))
    }

    pub fn plugins(&self) -> Vec<Value> {
        self.list["plugins"].as_array().cloned().unwrap_or_default()
    }

    /// A plugin's stdin: its entry plus the list's cniVersion and name, and extra keys.
    fn stdin_for(&self, plugin: &Value, extra: &[(&str, Value)]) -> Vec<u8> {
        let mut conf = plugin.clone();
        conf["cniVersion"] = self.list["cniVersion"].clone();
        conf["name"] = self.list["name"].clone();
        for (k, v) in extra {
            conf[*k] = v.clone();
        }
        serde_json::to_vec(&conf).expect("JSON")
    }

    /// Runs one plugin of the list (its entry from [`ConfList::plugins`]).
    pub fn run(&self, plugin: &Value, command: &str, sandbox: Option<&Sandbox>, extra: &[(&str, Value)]) -> PluginRun {
        let plugin_type = plugin["type"].as_str().expect("plugin type");
        let mut env = sandbox.map(Sandbox::env).unwrap_or_default();
        env.push(("CNI_PATH".to_owned(), self.cni_path_var()));
        exec_plugin(&self.find(plugin_type), command, &env, &self.stdin_for(plugin, extra))
    }

    /// ADD through the chain. Ok: every plugin's result in order (the last is the runtime's). Err: the failing run.
    pub fn add(&self, sandbox: &Sandbox) -> Result<Vec<Value>, PluginRun> {
        let mut results: Vec<Value> = Vec::new();
        for plugin in self.plugins() {
            let extra: Vec<(&str, Value)> = results.last().map(|r| ("prevResult", r.clone())).into_iter().collect();
            let run = self.run(&plugin, "ADD", Some(sandbox), &extra);
            if !run.success {
                return Err(run);
            }
            results.push(run.json());
        }
        Ok(results)
    }

    /// CHECK through the chain with the cached result.
    pub fn check(&self, sandbox: &Sandbox, cached: &Value) -> Result<(), PluginRun> {
        for plugin in self.plugins() {
            let run = self.run(&plugin, "CHECK", Some(sandbox), &[("prevResult", cached.clone())]);
            if !run.success {
                return Err(run);
            }
        }
        Ok(())
    }

    /// DEL through the chain in reverse, with the cached result when there is one.
    pub fn del(&self, sandbox: &Sandbox, cached: Option<&Value>) -> Result<(), PluginRun> {
        for plugin in self.plugins().iter().rev() {
            let extra: Vec<(&str, Value)> = cached.map(|r| ("prevResult", r.clone())).into_iter().collect();
            let run = self.run(plugin, "DEL", Some(sandbox), &extra);
            if !run.success {
                return Err(run);
            }
        }
        Ok(())
    }

    /// GC with the attachments that are still valid.
    pub fn gc(&self, valid: &[&Sandbox]) -> Result<(), PluginRun> {
        let attachments: Vec<Value> = valid
            .iter()
            .map(|s| json!({"containerID": s.container_id, "ifname": s.ifname}))
            .collect();
        for plugin in self.plugins() {
            let run = self.run(
                &plugin,
                "GC",
                None,
                &[("cni.dev/valid-attachments", Value::Array(attachments.clone()))],
            );
            if !run.success {
                return Err(run);
            }
        }
        Ok(())
    }

    pub fn status(&self) -> Result<(), PluginRun> {
        for plugin in self.plugins() {
            let run = self.run(&plugin, "STATUS", None, &[]);
            if !run.success {
                return Err(run);
            }
        }
        Ok(())
    }
}

/// A bare network namespace (`ip netns add aen-…`), what a runtime creates before ADD. Deleted on drop.
#[derive(Debug)]
pub struct BareNetns {
    name: String,
}

impl BareNetns {
    pub fn new() -> BareNetns {
        crate::require_root();
        for _ in 0..64 {
            let seq = SEQ.fetch_add(1, Ordering::Relaxed);
            let name = format!("{NETNS_PREFIX}{:06x}{seq:04x}", std::process::id());
            let out = Command::new("ip")
                .args(["netns", "add", &name])
                .output()
                .expect("ip netns add");
            if out.status.success() {
                let ns = BareNetns { name };
                // What the runtime's separate `loopback` network does before the pod network's ADD.
                let lo = Command::new("ip")
                    .args(["-n", &ns.name, "link", "set", "lo", "up"])
                    .output()
                    .expect("ip");
                assert!(
                    lo.status.success(),
                    "lo up in {}: {}",
                    ns.name,
                    String::from_utf8_lossy(&lo.stderr)
                );
                return ns;
            }
            let err = String::from_utf8_lossy(&out.stderr).into_owned();
            assert!(err.contains("File exists"), "ip netns add {name}: {err}");
        }
        panic!("no free netns name");
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn path(&self) -> PathBuf {
        Path::new(crate::netns::NETNS_DIR).join(&self.name)
    }

    /// Runs `f` on a thread inside the namespace.
    pub fn run<F: FnOnce() -> R + Send, R: Send>(&self, f: F) -> R {
        run_in(&self.path(), f)
    }

    /// Runs a command inside the namespace; its output whatever the status.
    pub fn exec(&self, cmd: &[&str]) -> std::process::Output {
        Command::new("ip")
            .args(["netns", "exec", &self.name])
            .args(cmd)
            .output()
            .expect("ip netns exec")
    }
}

impl Default for BareNetns {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for BareNetns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.name]).output();
    }
}

/// Runs `f` on a fresh thread that entered the netns at `path`.
pub fn run_in<F: FnOnce() -> R + Send, R: Send>(path: &Path, f: F) -> R {
    let file = std::fs::File::open(path).unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    std::thread::scope(|s| {
        let t = s.spawn(move || {
            setns(&file, CloneFlags::CLONE_NEWNET).expect("setns");
            f()
        });
        match t.join() {
            Ok(r) => r,
            Err(p) => std::panic::resume_unwind(p),
        }
    })
}

/// Unmounts and deletes every pin under a directory when dropped (a failing test's leftovers keep netns alive).
pub struct PinSweeper(pub PathBuf);

impl Drop for PinSweeper {
    fn drop(&mut self) {
        let Ok(entries) = std::fs::read_dir(&self.0) else {
            return;
        };
        for entry in entries.flatten() {
            let _ = nix::mount::umount2(&entry.path(), nix::mount::MntFlags::MNT_DETACH);
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// Is `pin` a bind mount of the netns at `netns` (same nsfs inode)?
pub fn is_pin_of(pin: &Path, netns: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(pin), std::fs::metadata(netns)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// `nft list table inet aether` inside the netns: Some(listing) or None when there is no such table.
pub fn aether_table(netns: &Path) -> Option<String> {
    let out = Command::new("nsenter")
        .arg(format!("--net={}", netns.display()))
        .args(["nft", "list", "table", "inet", "aether"])
        .output()
        .expect("nsenter nft");
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A plain HTTP/1.1 GET (Connection: close) from inside the netns; returns the whole response.
pub fn http_get_in(netns: &Path, addr: SocketAddr, path: &str, host: &str) -> Result<String, String> {
    use std::io::Read;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
    run_in(netns, move || {
        let mut stream =
            std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(3)).map_err(|e| e.to_string())?;
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .map_err(|e| e.to_string())?;
        stream.write_all(request.as_bytes()).map_err(|e| e.to_string())?;
        let mut out = String::new();
        stream.read_to_string(&mut out).map_err(|e| e.to_string())?;
        Ok(out)
    })
}

/// A UDP datagram from inside the netns to `to`; returns the reply and who it came from.
pub fn udp_exchange_in(netns: &Path, to: SocketAddr, payload: &[u8]) -> Result<(Vec<u8>, SocketAddr), String> {
    let payload = payload.to_vec();
    run_in(netns, move || {
        let socket = UdpSocket::bind("0.0.0.0:0").map_err(|e| e.to_string())?;
        socket
            .set_read_timeout(Some(Duration::from_secs(3)))
            .map_err(|e| e.to_string())?;
        socket.send_to(&payload, to).map_err(|e| e.to_string())?;
        let mut buf = [0u8; 1500];
        let (n, from) = socket.recv_from(&mut buf).map_err(|e| e.to_string())?;
        Ok((buf[..n].to_vec(), from))
    })
}

/// A TCP exchange from inside the netns: connect, write, read until EOF.
pub fn tcp_exchange_in(netns: &Path, to: SocketAddr, payload: &[u8]) -> Result<Vec<u8>, String> {
    use std::io::Read;
    let payload = payload.to_vec();
    run_in(netns, move || {
        let mut stream =
            std::net::TcpStream::connect_timeout(&to, Duration::from_secs(3)).map_err(|e| e.to_string())?;
        stream
            .set_read_timeout(Some(Duration::from_secs(3)))
            .map_err(|e| e.to_string())?;
        stream.write_all(&payload).map_err(|e| e.to_string())?;
        stream.shutdown(std::net::Shutdown::Write).map_err(|e| e.to_string())?;
        let mut out = Vec::new();
        stream.read_to_end(&mut out).map_err(|e| e.to_string())?;
        Ok(out)
    })
}

/// A stand-in for mesh-dns: UDP and TCP on the same address; answers every datagram / connection with
/// `"dns-stand-in:" + what it got`. Counts what it served. Stops when dropped.
pub struct DnsStandIn {
    pub addr: SocketAddr,
    pub served: std::sync::Arc<AtomicU32>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl DnsStandIn {
    pub fn start(ip: std::net::IpAddr) -> DnsStandIn {
        use std::io::Read;
        use std::sync::Arc;
        use std::sync::atomic::AtomicBool;
        let port = crate::free_port();
        let addr = SocketAddr::new(ip, port);
        let udp = UdpSocket::bind(addr).unwrap_or_else(|e| panic!("bind udp {addr}: {e}"));
        udp.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
        let tcp = std::net::TcpListener::bind(addr).unwrap_or_else(|e| panic!("bind tcp {addr}: {e}"));
        tcp.set_nonblocking(true).unwrap();
        let served = Arc::new(AtomicU32::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (s1, st1) = (served.clone(), stop.clone());
        let t1 = std::thread::spawn(move || {
            let mut buf = [0u8; 1500];
            while !st1.load(Ordering::Relaxed) {
                if let Ok((n, from)) = udp.recv_from(&mut buf) {
                    let mut reply = b"dns-stand-in:".to_vec();
                    reply.extend_from_slice(&buf[..n]);
                    let _ = udp.send_to(&reply, from);
                    s1.fetch_add(1, Ordering::SeqCst);
                }
            }
        });
        let (s2, st2) = (served.clone(), stop.clone());
        let t2 = std::thread::spawn(move || {
            while !st2.load(Ordering::Relaxed) {
                match tcp.accept() {
                    Ok((mut stream, _)) => {
                        let _ = stream.set_nonblocking(false);
                        let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
                        let mut got = Vec::new();
                        let _ = stream.read_to_end(&mut got);
                        let mut reply = b"dns-stand-in:".to_vec();
                        reply.extend_from_slice(&got);
                        let _ = stream.write_all(&reply);
                        s2.fetch_add(1, Ordering::SeqCst);
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(20)),
                }
            }
        });
        DnsStandIn {
            addr,
            served,
            stop,
            threads: vec![t1, t2],
        }
    }
}

impl Drop for DnsStandIn {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Main plugin for tests: Debian's `bridge` on an existing bridge (a [`crate::TestNode`]'s) with `host-local` handing
/// out `.100`–`.250` of its /24 (the harness uses the low addresses), and a default route via the node's gateway.
pub fn bridge_plugin(bridge: &str, subnet: std::net::Ipv4Addr, gateway: std::net::Ipv4Addr, ipam_dir: &Path) -> Value {
    let o = subnet.octets();
    json!({
        "type": "bridge",
        "bridge": bridge,
        "isGateway": false,
        "ipMasq": false,
        "ipam": {
            "type": "host-local",
            "ranges": [[{
                "subnet": format!("{subnet}/24"),
                "rangeStart": format!("{}.{}.{}.100", o[0], o[1], o[2]),
                "rangeEnd": format!("{}.{}.{}.250", o[0], o[1], o[2]),
                "gateway": gateway.to_string()
            }]],
            "routes": [{"dst": "0.0.0.0/0", "gw": gateway.to_string()}],
            "dataDir": ipam_dir
        }
    })
}
