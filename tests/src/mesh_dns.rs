//! A running `aether-mesh-dns` (the real binary) answering from an agent's record file, and
//! `dig` (Debian's bind9-dnsutils) asking it.

use std::path::Path;
use std::process::Command;

use crate::{ChildGuard, binary, free_port};

pub struct MeshDns {
    /// The DNS port on 127.0.0.1 (UDP and TCP).
    pub port: u16,
    pub child: ChildGuard,
}

impl MeshDns {
    /// mesh-dns on a free port, reading `records`, with an upstream that answers nothing
    /// (names it does not hold fail).
    pub fn start(records: &Path) -> MeshDns {
        let port = free_port();
        let mut cmd = Command::new(binary("aether-mesh-dns"));
        cmd.args(["--listen", &format!("127.0.0.1:{port}")])
            .arg("--records")
            .arg(records)
            .args(["--admin", &format!("127.0.0.1:{}", free_port())])
            .args(["--upstream", "127.0.0.1:9"]);
        MeshDns {
            port,
            child: ChildGuard::spawn("mesh-dns", cmd),
        }
    }

    /// `dig name A +short`: the addresses answered, none when the query failed (e.g.
    /// refused: mesh-dns not bound yet; callers retry until their deadline).
    pub fn dig_a(&self, name: &str) -> Vec<String> {
        let out = Command::new("dig")
            .args([
                "@127.0.0.1",
                "-p",
                &self.port.to_string(),
                name,
                "A",
                "+short",
                "+tries=1",
                "+time=2",
            ])
            .output()
            .expect("dig is not installed (Debian bind9-dnsutils, from scripts/setup.sh)");
        if !out.status.success() {
            eprintln!(
                "dig {name}: {} {}",
                String::from_utf8_lossy(&out.stdout).trim(),
                String::from_utf8_lossy(&out.stderr).trim()
            );
            return Vec::new();
        }
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_owned)
            .collect()
    }
}
