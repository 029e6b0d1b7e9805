//! Asking mesh-dns, as a pod's resolver would: one A query over UDP. `check` counts any
//! well-formed reply as answering (NXDOMAIN included: the server is up); `explain` reads
//! the addresses of the answer.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
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
    let (status, detail) = match ask(addr, &fqdn).await {
        Ok(reply) => (Level::Pass, format!("{addr} answered (rcode {})", reply[3] & 0x0f)),
        Err(e) => (Level::Fail, e),
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

/// The IPv4 addresses mesh-dns at `addr` answers for `fqdn` (empty: no such name).
pub async fn resolve(addr: SocketAddr, fqdn: &str) -> Result<Vec<IpAddr>, String> {
    let reply = ask(addr, fqdn).await?;
    addresses(&reply).ok_or_else(|| format!("{addr} sent a malformed answer"))
}

/// The whole reply (at least a header, with our id).
async fn ask(addr: SocketAddr, fqdn: &str) -> Result<Vec<u8>, String> {
    let exchange = async {
        let bind = if addr.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" };
        let socket = tokio::net::UdpSocket::bind(bind).await?;
        socket.send_to(&query(fqdn), addr).await?;
        let mut buf = [0u8; 512];
        loop {
            let (n, _) = socket.recv_from(&mut buf).await?;
            if n >= 12 && u16::from_be_bytes([buf[0], buf[1]]) == QUERY_ID {
                return Ok::<_, std::io::Error>(buf[..n].to_vec());
            }
        }
    };
    match tokio::time::timeout(TIMEOUT, exchange).await {
        Ok(Ok(reply)) => Ok(reply),
        Ok(Err(e)) => Err(format!("{addr}: {e}")),
        Err(_) => Err(format!("{addr} did not answer within {TIMEOUT:?}")),
    }
}

/// The A records of an answer; `None` if it does not parse.
fn addresses(reply: &[u8]) -> Option<Vec<IpAddr>> {
    let count = |at: usize| Some(u16::from_be_bytes([*reply.get(at)?, *reply.get(at + 1)?]));
    let (questions, answers) = (count(4)?, count(6)?);
    let mut at = 12;
    for _ in 0..questions {
        at = skip_name(reply, at)? + 4;
    }
    let mut out = Vec::new();
    for _ in 0..answers {
        at = skip_name(reply, at)?;
        let (kind, length) = (count(at)?, usize::from(count(at + 8)?));
        let data = reply.get(at + 10..at + 10 + length)?;
        if let (1, Ok(v4)) = (kind, <[u8; 4]>::try_from(data)) {
            out.push(IpAddr::V4(Ipv4Addr::from(v4)));
        }
        at += 10 + length;
    }
    Some(out)
}

/// The offset after the name at `at` (labels, ending in a zero or a compression pointer).
fn skip_name(reply: &[u8], mut at: usize) -> Option<usize> {
    loop {
        let length = *reply.get(at)?;
        match length {
            0 => return Some(at + 1),
            l if l & 0xc0 == 0xc0 => return Some(at + 2),
            l => at += usize::from(l) + 1,
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

    #[test]
    fn answers_give_their_a_records() {
        let mut reply = super::query("a.bc");
        reply[2] |= 0x80;
        reply[7] = 2; // two answers: a CNAME-like record, then an A with a compressed name
        reply.extend_from_slice(&[0xc0, 12, 0, 5, 0, 1, 0, 0, 0, 60, 0, 2, 0xc0, 12]);
        reply.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1, 0, 0, 0, 60, 0, 4, 240, 240, 0, 7]);
        assert_eq!(super::addresses(&reply), Some(vec!["240.240.0.7".parse().unwrap()]));
        assert_eq!(super::addresses(&reply[..reply.len() - 2]), None);
    }
}
