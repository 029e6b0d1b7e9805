//! Is mesh-dns answering? One A query over UDP for a mesh name; any well-formed reply
//! with our id counts (NXDOMAIN included: the server is up).

use std::time::Duration;

use super::Inspector;
use super::check::{Check, Level};

const TIMEOUT: Duration = Duration::from_secs(1);
const QUERY_ID: u16 = 0xae71;

pub async fn answering(inspector: &Inspector) -> Check {
    let name = "mesh-dns answering";
    let Some(addr) = inspector.mesh_dns else {
        return Check {
            check: name,
            status: Level::Skip,
            detail: "no --mesh-dns on this node: pods' DNS is not captured".into(),
            fix: String::new(),
        };
    };
    let fqdn = format!("aether-check.{}", inspector.node.view().mesh_domain);
    let (status, detail) = match tokio::time::timeout(TIMEOUT, ask(addr, &fqdn)).await {
        Ok(Ok(rcode)) => (Level::Pass, format!("{addr} answered (rcode {rcode})")),
        Ok(Err(e)) => (Level::Fail, format!("{addr}: {e}")),
        Err(_) => (Level::Fail, format!("{addr} did not answer within {TIMEOUT:?}")),
    };
    let fix = match status {
        Level::Fail => "check the mesh-dns DaemonSet and its log".into(),
        _ => String::new(),
    };
    Check {
        check: name,
        status,
        detail,
        fix,
    }
}

/// The reply's rcode.
async fn ask(addr: std::net::SocketAddr, fqdn: &str) -> std::io::Result<u8> {
    let bind = if addr.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" };
    let socket = tokio::net::UdpSocket::bind(bind).await?;
    socket.send_to(&query(fqdn), addr).await?;
    let mut buf = [0u8; 512];
    loop {
        let (n, _) = socket.recv_from(&mut buf).await?;
        if n >= 12 && u16::from_be_bytes([buf[0], buf[1]]) == QUERY_ID {
            return Ok(buf[3] & 0x0f);
        }
    }
}

/// A recursive A/IN query for `fqdn`.
fn query(fqdn: &str) -> Vec<u8> {
    let mut q = Vec::with_capacity(fqdn.len() + 18);
    q.extend_from_slice(&QUERY_ID.to_be_bytes());
    q.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0]);
    for label in fqdn.split('.').filter(|l| !l.is_empty()) {
        q.push(label.len() as u8);
        q.extend_from_slice(label.as_bytes());
    }
    q.extend_from_slice(&[0, 0, 1, 0, 1]);
    q
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_query_is_header_name_type_class() {
        let q = super::query("a.bc");
        assert_eq!(q[..4], [0xae, 0x71, 0x01, 0x00]);
        assert_eq!(q[12..], [1, b'a', 2, b'b', b'c', 0, 0, 1, 0, 1]);
    }
}
