//! Forwarding to the upstream resolvers: UDP with a TCP retry when the answer is
//! truncated, TCP for clients that came over TCP, a per-upstream timeout and failover.
//! The query goes out byte for byte (EDNS0 and all) under a fresh random id, which is
//! rewritten back to the client's id in the answer.

use std::hash::{BuildHasher, RandomState};
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use hickory_proto::op::{Message, MessageType};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpStream, UdpSocket};
use tokio::time::{Instant, timeout_at};

use aether_common::quote::quote;

use crate::handler::{self, Forward, HEADER_LEN};

/// The largest DNS message.
const MAX_MESSAGE: usize = 65_535;
/// The DNS port, for upstreams given without one.
const DNS_PORT: u16 = 53;

#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    #[error("no upstream resolvers configured")]
    NoUpstreams,
    #[error("upstream {}: {} is not an address (want ip or ip:port)", .0, quote(.1))]
    BadUpstream(usize, String),
    #[error("{upstream}: timed out")]
    Timeout { upstream: SocketAddr },
    #[error("{upstream}: {source}")]
    Io {
        upstream: SocketAddr,
        source: std::io::Error,
    },
    #[error("{upstream}: answer does not match the query")]
    Mismatch { upstream: SocketAddr },
    #[error("all {0} upstreams failed; last: {1}")]
    AllFailed(usize, Box<ForwardError>),
}

/// How the client asked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    Udp,
    Tcp,
}

impl Transport {
    pub fn as_str(self) -> &'static str {
        match self {
            Transport::Udp => "udp",
            Transport::Tcp => "tcp",
        }
    }
}

#[derive(Clone, Debug, Default)]
pub struct ForwardMetrics {
    /// Upstream attempts that failed, by reason (timeout, error, mismatch).
    pub upstream_errors: Family<Vec<(String, String)>, Counter>,
    /// UDP answers that came back truncated and were asked again over TCP.
    pub tcp_retries: Counter,
}

pub struct Forwarder {
    upstreams: Vec<SocketAddr>,
    timeout: Duration,
    /// The upstream tried first; moves on when it fails.
    preferred: AtomicUsize,
    metrics: ForwardMetrics,
}

/// Parses `ip` or `ip:port` (IPv6 with a port as `[ip]:port`).
pub fn parse_upstream(text: &str) -> Option<SocketAddr> {
    let text = text.trim();
    if let Ok(addr) = text.parse::<SocketAddr>() {
        return Some(addr);
    }
    text.parse::<std::net::IpAddr>()
        .ok()
        .map(|ip| SocketAddr::new(ip, DNS_PORT))
}

/// The `nameserver` and `search` entries of a resolv.conf.
pub fn parse_resolv_conf(text: &str) -> (Vec<SocketAddr>, Vec<String>) {
    let mut servers = Vec::new();
    let mut search = Vec::new();
    for line in text.lines() {
        let mut words = line.split_whitespace();
        match words.next() {
            Some("nameserver") => {
                // Link-local IPv6 with a zone ("fe80::1%eth0") cannot be parsed; skip it.
                if let Some(addr) = words.next().and_then(parse_upstream) {
                    servers.push(addr);
                }
            }
            Some("search") | Some("domain") => search = words.map(str::to_owned).collect(),
            _ => {}
        }
    }
    (servers, search)
}

fn random_id() -> u16 {
    // A per-call random SipHash key is enough to make ids unpredictable off-host.
    RandomState::new().hash_one(std::time::SystemTime::now()) as u16
}

impl Forwarder {
    pub fn new(upstreams: Vec<SocketAddr>, timeout: Duration, metrics: ForwardMetrics) -> Result<Self, ForwardError> {
        if upstreams.is_empty() {
            return Err(ForwardError::NoUpstreams);
        }
        Ok(Self {
            upstreams,
            timeout,
            preferred: AtomicUsize::new(0),
            metrics,
        })
    }

    pub fn upstreams(&self) -> &[SocketAddr] {
        &self.upstreams
    }

    /// Asks the upstreams, in turn starting from the preferred one, and returns the
    /// answer to send the client (with its id), cut to the client's UDP limit if needed.
    pub async fn forward(&self, raw: &[u8], forward: &Forward, transport: Transport) -> Result<Vec<u8>, ForwardError> {
        let first = self.preferred.load(Ordering::Relaxed) % self.upstreams.len();
        let mut last = None;
        for i in 0..self.upstreams.len() {
            let index = (first + i) % self.upstreams.len();
            let upstream = self.upstreams[index];
            let result = match transport {
                Transport::Udp => self.udp_then_tcp(upstream, raw, forward).await,
                Transport::Tcp => self.tcp(upstream, raw, forward).await,
            };
            match result {
                Ok(mut answer) => {
                    answer[..2].copy_from_slice(&forward.query.metadata.id.to_be_bytes());
                    if transport == Transport::Udp && answer.len() > forward.client_udp_limit {
                        return Ok(handler::truncated(&forward.query, &answer));
                    }
                    return Ok(answer);
                }
                Err(error) => {
                    let reason = match error {
                        ForwardError::Timeout { .. } => "timeout",
                        ForwardError::Mismatch { .. } => "mismatch",
                        _ => "error",
                    };
                    self.metrics
                        .upstream_errors
                        .get_or_create(&vec![
                            ("upstream".to_owned(), upstream.to_string()),
                            ("reason".to_owned(), reason.to_owned()),
                        ])
                        .inc();
                    // Later queries start at the next upstream.
                    let _ = self.preferred.compare_exchange(
                        index,
                        (index + 1) % self.upstreams.len(),
                        Ordering::Relaxed,
                        Ordering::Relaxed,
                    );
                    last = Some(error);
                }
            }
        }
        Err(ForwardError::AllFailed(
            self.upstreams.len(),
            Box::new(last.expect("at least one upstream")),
        ))
    }

    async fn udp_then_tcp(&self, upstream: SocketAddr, raw: &[u8], forward: &Forward) -> Result<Vec<u8>, ForwardError> {
        let answer = self.udp(upstream, raw, forward).await?;
        if answer[2] & 0x02 != 0 {
            self.metrics.tcp_retries.inc();
            return self.tcp(upstream, raw, forward).await;
        }
        Ok(answer)
    }

    async fn udp(&self, upstream: SocketAddr, raw: &[u8], forward: &Forward) -> Result<Vec<u8>, ForwardError> {
        let deadline = Instant::now() + self.timeout;
        let io = |source| ForwardError::Io { upstream, source };
        let local: SocketAddr = if upstream.is_ipv4() {
            (Ipv4Addr::UNSPECIFIED, 0).into()
        } else {
            (Ipv6Addr::UNSPECIFIED, 0).into()
        };
        // A fresh socket per query: a random source port as well as a random id.
        let socket = UdpSocket::bind(local).await.map_err(io)?;
        socket.connect(upstream).await.map_err(io)?;
        let id = random_id();
        let mut query = raw.to_vec();
        query[..2].copy_from_slice(&id.to_be_bytes());
        socket.send(&query).await.map_err(io)?;
        let mut buf = vec![0u8; MAX_MESSAGE];
        loop {
            let n = match timeout_at(deadline, socket.recv(&mut buf)).await {
                Err(_) => return Err(ForwardError::Timeout { upstream }),
                Ok(r) => r.map_err(io)?,
            };
            // Anything that is not the answer to this query is ignored (late or forged).
            if matches_query(&buf[..n], id, &forward.query) {
                buf.truncate(n);
                return Ok(buf);
            }
        }
    }

    async fn tcp(&self, upstream: SocketAddr, raw: &[u8], forward: &Forward) -> Result<Vec<u8>, ForwardError> {
        let deadline = Instant::now() + self.timeout;
        let io = |source| ForwardError::Io { upstream, source };
        let id = random_id();
        let exchange = async {
            let mut stream = TcpStream::connect(upstream).await.map_err(io)?;
            stream.set_nodelay(true).map_err(io)?;
            let mut out = Vec::with_capacity(raw.len() + 2);
            out.extend_from_slice(&(raw.len() as u16).to_be_bytes());
            out.extend_from_slice(raw);
            out[2..4].copy_from_slice(&id.to_be_bytes());
            stream.write_all(&out).await.map_err(io)?;
            let len = stream.read_u16().await.map_err(io)? as usize;
            let mut answer = vec![0u8; len];
            stream.read_exact(&mut answer).await.map_err(io)?;
            if !matches_query(&answer, id, &forward.query) {
                return Err(ForwardError::Mismatch { upstream });
            }
            Ok(answer)
        };
        match timeout_at(deadline, exchange).await {
            Err(_) => Err(ForwardError::Timeout { upstream }),
            Ok(r) => r,
        }
    }
}

/// Whether `answer` is a response with `id` to the same question as `query`.
fn matches_query(answer: &[u8], id: u16, query: &Message) -> bool {
    if answer.len() < HEADER_LEN || answer[..2] != id.to_be_bytes() {
        return false;
    }
    // A truncated answer may not even carry its question; trust the id and TC then.
    match Message::from_vec(answer) {
        Ok(m) => {
            m.metadata.message_type == MessageType::Response
                && (m.queries == query.queries || (m.metadata.truncation && m.queries.is_empty()))
        }
        Err(_) => answer[2] & 0x80 != 0 && answer[2] & 0x02 != 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolv_conf_gives_servers_and_search() {
        let (servers, search) = parse_resolv_conf(
            "# comment\nnameserver 10.0.0.10\nnameserver fe80::1%eth0\nnameserver ::1\nsearch a.svc.cluster.local svc.cluster.local\noptions ndots:5\n",
        );
        assert_eq!(
            servers,
            vec!["10.0.0.10:53".parse().unwrap(), "[::1]:53".parse().unwrap()]
        );
        assert_eq!(search, vec!["a.svc.cluster.local", "svc.cluster.local"]);
    }

    #[test]
    fn upstreams_take_a_port_or_default_to_53() {
        assert_eq!(
            parse_upstream("127.0.0.1:5353"),
            Some("127.0.0.1:5353".parse().unwrap())
        );
        assert_eq!(parse_upstream("[::1]:5353"), Some("[::1]:5353".parse().unwrap()));
        assert_eq!(parse_upstream("::1"), Some("[::1]:53".parse().unwrap()));
        assert_eq!(parse_upstream("dns.example"), None);
    }
}
