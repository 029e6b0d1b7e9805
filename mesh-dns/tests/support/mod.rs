//! Test support: the real mesh-dns binary, a real unbound as its upstream, dig, and a
//! small UDP query client. Processes are killed when their guard drops.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use aether_mesh_dns::records::{Addresses, RecordFile};
use tempfile::TempDir;

pub const MESH_DNS: &str = env!("CARGO_BIN_EXE_aether-mesh-dns");

/// A port free for both UDP and TCP on 127.0.0.1.
pub fn free_port() -> u16 {
    for _ in 0..100 {
        let tcp = TcpListener::bind("127.0.0.1:0").expect("bind a TCP port");
        let port = tcp.local_addr().unwrap().port();
        if UdpSocket::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no port free for both UDP and TCP");
}

/// A child process in its own process group with its output in a log file; killed on drop,
/// and its log printed if the test is failing.
pub struct Proc {
    pub name: String,
    child: Child,
    log: PathBuf,
    _dir: TempDir,
}

impl Proc {
    pub fn spawn(name: &str, mut cmd: Command) -> Proc {
        let dir = tempfile::Builder::new()
            .prefix(&format!("mesh-dns-test-{name}-"))
            .tempdir()
            .unwrap();
        let log = dir.path().join("log");
        let file = std::fs::File::create(&log).unwrap();
        cmd.process_group(0)
            .stdin(Stdio::null())
            .stdout(file.try_clone().unwrap())
            .stderr(file);
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("{name}: cannot start {cmd:?}: {e}"));
        Proc {
            name: name.into(),
            child,
            log,
            _dir: dir,
        }
    }

    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Panics (with the log) if the process has exited.
    pub fn assert_running(&mut self) {
        if let Some(status) = self.child.try_wait().unwrap() {
            panic!("{} exited with {status}:\n{}", self.name, self.logs());
        }
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() {
            eprintln!("----- {} log -----\n{}", self.name, self.logs());
        }
    }
}

/// Local data for unbound: `name` → records in zone-file syntax.
pub struct Unbound {
    pub proc: Proc,
    pub port: u16,
    _dir: TempDir,
}

impl Unbound {
    /// Starts unbound on 127.0.0.1:`port` with `extra` config lines under `server:`,
    /// answering only from local data (it never recurses).
    pub fn start(extra: &[String]) -> Unbound {
        Self::start_on(free_port(), extra)
    }

    pub fn start_on(port: u16, extra: &[String]) -> Unbound {
        let bin = which("unbound").unwrap_or_else(|| {
            panic!("unbound is not installed (scripts/setup.sh installs Debian's unbound); this test needs it")
        });
        let dir = tempfile::Builder::new().prefix("mesh-dns-unbound-").tempdir().unwrap();
        let mut conf = format!(
            "server:\n  interface: 127.0.0.1@{port}\n  port: {port}\n  do-daemonize: no\n  use-syslog: no\n  \
             logfile: \"\"\n  username: \"\"\n  chroot: \"\"\n  directory: \"{dir}\"\n  pidfile: \"{dir}/unbound.pid\"\n  \
             access-control: 127.0.0.0/8 allow\n  do-ip6: no\n  verbosity: 0\n  \
             module-config: \"iterator\"\n  auto-trust-anchor-file: \"\"\n",
            dir = dir.path().display()
        );
        for line in extra {
            conf.push_str("  ");
            conf.push_str(line);
            conf.push('\n');
        }
        conf.push_str("remote-control:\n  control-enable: no\n");
        let path = dir.path().join("unbound.conf");
        std::fs::write(&path, &conf).unwrap();
        let checkconf = Command::new("unbound-checkconf").arg(&path).output();
        if let Ok(out) = &checkconf
            && !out.status.success()
        {
            panic!(
                "unbound-checkconf rejected the test config:\n{}\n{}",
                String::from_utf8_lossy(&out.stdout),
                conf
            );
        }
        let mut cmd = Command::new(bin);
        cmd.arg("-d").arg("-c").arg(&path);
        let proc = Proc::spawn("unbound", cmd);
        let mut unbound = Unbound { proc, port, _dir: dir };
        unbound.wait_ready();
        unbound
    }

    fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            self.proc.assert_running();
            if query_udp(self.addr(), "version.bind.", 16, 3, Duration::from_millis(300)).is_some() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "unbound did not answer in time:\n{}",
                self.proc.logs()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from((Ipv4Addr::LOCALHOST, self.port))
    }
}

pub fn which(bin: &str) -> Option<PathBuf> {
    for dir in [
        "/usr/sbin",
        "/usr/bin",
        "/sbin",
        "/bin",
        "/usr/local/sbin",
        "/usr/local/bin",
    ] {
        let p = Path::new(dir).join(bin);
        if p.exists() {
            return Some(p);
        }
    }
    None
}

/// The real mesh-dns binary.
pub struct MeshDns {
    pub proc: Proc,
    pub port: u16,
    pub admin: SocketAddr,
}

impl MeshDns {
    /// Starts mesh-dns on 127.0.0.1:`port` reading `records`, with more `args`.
    pub fn start(port: u16, records: &Path, args: &[&str]) -> MeshDns {
        let admin = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()));
        let mut dns = Self::spawn(port, admin, records, args);
        dns.wait_for("/ready", |d| {
            http_get(d.admin, "/ready").is_some_and(|(code, _)| code == 200)
        });
        dns
    }

    /// Starts mesh-dns with the admin address given (it may be busy); returns at once.
    pub fn spawn(port: u16, admin: SocketAddr, records: &Path, args: &[&str]) -> MeshDns {
        let mut cmd = Command::new(MESH_DNS);
        cmd.arg("--listen")
            .arg(format!("127.0.0.1:{port}"))
            .arg("--records")
            .arg(records)
            .arg("--admin")
            .arg(admin.to_string())
            .args(args)
            .env("RUST_LOG", "info");
        let proc = Proc::spawn("mesh-dns", cmd);
        MeshDns { proc, port, admin }
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from((Ipv4Addr::LOCALHOST, self.port))
    }

    /// The value of one metric line (exact name with labels, e.g. `x_total{a="b"}`), 0 if absent.
    pub fn metric(&self, series: &str) -> f64 {
        let (_, body) = http_get(self.admin, "/metrics").expect("mesh-dns /metrics");
        body.lines()
            .find_map(|l| l.strip_prefix(series).and_then(|rest| rest.strip_prefix(' ')))
            .map_or(0.0, |v| v.trim().parse().unwrap())
    }

    pub fn queries(&self, result: &str, transport: &str) -> f64 {
        self.metric(&format!(
            "aether_mesh_dns_queries_total{{result=\"{result}\",transport=\"{transport}\"}}"
        ))
    }

    /// Waits until `f` holds (checking the process stays up).
    pub fn wait_for(&mut self, what: &str, mut f: impl FnMut(&MeshDns) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(15);
        while !f(self) {
            self.proc.assert_running();
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}:\n{}",
                self.proc.logs()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// A minimal HTTP/1.0 GET: (status, body).
pub fn http_get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: test\r\n\r\n").ok()?;
    let mut out = String::new();
    stream.read_to_string(&mut out).ok()?;
    let code = out.split_whitespace().nth(1)?.parse().ok()?;
    let body = out
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Some((code, body))
}

/// What dig printed, parsed.
#[derive(Debug)]
pub struct Dig {
    pub status: String,
    pub flags: Vec<String>,
    /// Answer records as (name, ttl, type, data).
    pub answers: Vec<(String, u32, String, String)>,
    pub authority: Vec<(String, u32, String, String)>,
    /// The OPT pseudo-section's "udp:" size, if any.
    pub edns_udp: Option<u16>,
    pub raw: String,
}

impl Dig {
    pub fn answer_data(&self, rtype: &str) -> Vec<String> {
        self.answers
            .iter()
            .filter(|a| a.2 == rtype)
            .map(|a| a.3.clone())
            .collect()
    }
}

/// Runs dig against `server` with extra options; panics if dig cannot run or gets no answer.
pub fn dig(server: SocketAddr, name: &str, rtype: &str, opts: &[&str]) -> Dig {
    let bin = which("dig").expect("dig is not installed (Debian bind9-dnsutils, from scripts/setup.sh)");
    let out = Command::new(bin)
        .arg(format!("@{}", server.ip()))
        .arg("-p")
        .arg(server.port().to_string())
        .arg(name)
        .arg(rtype)
        .args(["+tries=1", "+time=3", "+nocookie", "+nostats"])
        .args(opts)
        .output()
        .expect("run dig");
    let raw = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "dig {name} {rtype} {opts:?} failed ({}):\n{raw}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    parse_dig(raw)
}

fn parse_dig(raw: String) -> Dig {
    let mut status = String::new();
    let mut flags = Vec::new();
    let mut answers = Vec::new();
    let mut authority = Vec::new();
    let mut edns_udp = None;
    let mut section = "";
    for line in raw.lines() {
        if let Some(rest) = line.split_once("status: ") {
            status = rest.1.split(',').next().unwrap_or("").trim().to_owned();
        }
        if let Some(rest) = line.strip_prefix(";; flags: ") {
            let f = rest.split(';').next().unwrap_or("");
            flags = f.split_whitespace().map(str::to_owned).collect();
        }
        if let Some(rest) = line.split_once("; EDNS: version: 0, flags:") {
            edns_udp = rest.1.split("udp: ").nth(1).and_then(|u| u.trim().parse().ok());
        }
        if line.starts_with(";; ANSWER SECTION") {
            section = "answer";
            continue;
        }
        if line.starts_with(";; AUTHORITY SECTION") {
            section = "authority";
            continue;
        }
        if line.starts_with(";;") || line.trim().is_empty() {
            if line.trim().is_empty() {
                section = "";
            }
            continue;
        }
        let parts: Vec<&str> = line.split_whitespace().collect();
        if parts.len() >= 5 && !line.starts_with(';') {
            let rr = (
                parts[0].to_owned(),
                parts[1].parse().unwrap_or(0),
                parts[3].to_owned(),
                parts[4..].join(" "),
            );
            match section {
                "answer" => answers.push(rr),
                "authority" => authority.push(rr),
                _ => {}
            }
        }
    }
    Dig {
        status,
        flags,
        answers,
        authority,
        edns_udp,
        raw,
    }
}

/// One UDP query; the raw answer, or None on timeout.
pub fn query_udp(server: SocketAddr, name: &str, qtype: u16, qclass: u16, timeout: Duration) -> Option<Vec<u8>> {
    let socket = UdpSocket::bind("127.0.0.1:0").ok()?;
    socket.set_read_timeout(Some(timeout)).ok()?;
    let id: u16 = (SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos()
        & 0xffff) as u16;
    let packet = build_query(id, name, qtype, qclass);
    socket.send_to(&packet, server).ok()?;
    let mut buf = [0u8; 4096];
    loop {
        let (n, _) = socket.recv_from(&mut buf).ok()?;
        if n >= 2 && buf[..2] == id.to_be_bytes() {
            return Some(buf[..n].to_vec());
        }
    }
}

/// A query packet built by hand (RD set, no EDNS).
pub fn build_query(id: u16, name: &str, qtype: u16, qclass: u16) -> Vec<u8> {
    let mut p = Vec::with_capacity(64);
    p.extend_from_slice(&id.to_be_bytes());
    p.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0]);
    for label in name.trim_end_matches('.').split('.') {
        p.push(label.len() as u8);
        p.extend_from_slice(label.as_bytes());
    }
    p.push(0);
    p.extend_from_slice(&qtype.to_be_bytes());
    p.extend_from_slice(&qclass.to_be_bytes());
    p
}

/// A record directory and file the test writes the way the agent does.
pub struct Records {
    pub dir: TempDir,
    pub path: PathBuf,
}

impl Records {
    pub fn new() -> Records {
        let dir = tempfile::Builder::new().prefix("mesh-dns-records-").tempdir().unwrap();
        let path = dir.path().join("mesh-dns").join("records");
        Records { dir, path }
    }

    pub fn write(&self, generation: u64, written_at: SystemTime, records: &[(&str, &str, Addresses)]) {
        let mut file = RecordFile {
            generation,
            written_at,
            records: BTreeMap::new(),
            aliases: Vec::new(),
            hosts: BTreeMap::new(),
        };
        for (ns, svc, a) in records {
            file.records.insert(((*ns).to_owned(), (*svc).to_owned()), *a);
        }
        self.write_raw(&file.to_json());
    }

    pub fn write_raw(&self, bytes: &[u8]) {
        std::fs::create_dir_all(self.path.parent().unwrap()).unwrap();
        aether_common::fs::write_atomic(&self.path, bytes, 0o644).unwrap();
    }
}

pub fn v4(a: [u8; 4]) -> Addresses {
    Addresses {
        v4: Some(Ipv4Addr::from(a)),
        v6: None,
    }
}

pub fn dual(a: [u8; 4], b: &str) -> Addresses {
    Addresses {
        v4: Some(Ipv4Addr::from(a)),
        v6: Some(b.parse().unwrap()),
    }
}
