//! Sockets and serving loops: several UDP sockets and one TCP listener on the same
//! address, all with SO_REUSEPORT so a second instance can bind it during a roll.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use socket2::{Domain, Protocol, Socket, Type};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::forward::{Forwarder, Transport};
use crate::handler::{self, Handler, Outcome, QueryResult};
use crate::metrics::Metrics;
use crate::ratelimit::SharedRateLimited;

/// Receive buffer for one UDP query (the largest UDP payload).
const UDP_BUFFER: usize = 65_535;
/// Most TCP client connections served at once.
const MAX_TCP_CONNECTIONS: usize = 1024;

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("binding {proto} {addr}: {source}")]
    Bind {
        proto: &'static str,
        addr: SocketAddr,
        source: std::io::Error,
    },
}

fn reuseport_socket(addr: SocketAddr, kind: Type, protocol: Protocol) -> std::io::Result<Socket> {
    let socket = Socket::new(Domain::for_address(addr), kind, Some(protocol))?;
    socket.set_reuse_port(true)?;
    socket.set_reuse_address(true)?;
    if addr.is_ipv6() {
        socket.set_only_v6(false)?;
    }
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    Ok(socket)
}

/// Binds `count` UDP sockets and one TCP listener on `addr` (port 0 picks one port for all).
pub fn bind(addr: SocketAddr, count: usize) -> Result<(Vec<std::net::UdpSocket>, std::net::TcpListener), ServerError> {
    let mut addr = addr;
    let mut udp = Vec::with_capacity(count);
    for _ in 0..count.max(1) {
        let socket = reuseport_socket(addr, Type::DGRAM, Protocol::UDP).map_err(|source| ServerError::Bind {
            proto: "UDP",
            addr,
            source,
        })?;
        // A deep receive queue rides out bursts while a worker is busy.
        let _ = socket.set_recv_buffer_size(4 << 20);
        let socket: std::net::UdpSocket = socket.into();
        addr = socket.local_addr().map_err(|source| ServerError::Bind {
            proto: "UDP",
            addr,
            source,
        })?;
        udp.push(socket);
    }
    let tcp = reuseport_socket(addr, Type::STREAM, Protocol::TCP)
        .and_then(|s| {
            s.listen(1024)?;
            Ok(s)
        })
        .map_err(|source| ServerError::Bind {
            proto: "TCP",
            addr,
            source,
        })?;
    Ok((udp, tcp.into()))
}

pub struct Server {
    pub handler: Handler,
    pub forwarder: Forwarder,
    pub metrics: Metrics,
    pub inflight: Semaphore,
    pub tcp_idle_timeout: Duration,
    pub upstream_errors_log: SharedRateLimited,
    pub malformed_log: SharedRateLimited,
}

impl Server {
    fn count(&self, result: QueryResult, transport: Transport, peer: SocketAddr) {
        self.metrics.query(result, transport);
        if result == QueryResult::Malformed
            && let Some(suppressed) = self.malformed_log.allow()
        {
            tracing::warn!(%peer, transport = transport.as_str(), suppressed, "malformed DNS packet");
        }
    }

    /// Forwards a query and returns the answer for the client (SERVFAIL if all upstreams fail).
    async fn forward(&self, packet: &[u8], forward: handler::Forward, transport: Transport) -> (Vec<u8>, QueryResult) {
        match self.forwarder.forward(packet, &forward, transport).await {
            Ok(answer) => (answer, QueryResult::Forwarded),
            Err(error) => {
                if let Some(suppressed) = self.upstream_errors_log.allow() {
                    tracing::warn!(%error, suppressed, "forwarding failed; answering SERVFAIL");
                }
                (handler::servfail(&forward.query), QueryResult::UpstreamFailed)
            }
        }
    }
}

/// Serves one UDP socket until `shutdown`. Local answers are sent inline; forwards
/// run as tasks so a slow upstream never holds up mesh names.
pub async fn serve_udp(server: Arc<Server>, socket: Arc<UdpSocket>, tasks: TaskTracker, shutdown: CancellationToken) {
    let mut buf = vec![0u8; UDP_BUFFER];
    loop {
        let (n, peer) = tokio::select! {
            _ = shutdown.cancelled() => return,
            r = socket.recv_from(&mut buf) => match r {
                Ok(r) => r,
                Err(error) => {
                    // ICMP errors from earlier sends surface here; they are not fatal.
                    tracing::debug!(%error, "UDP receive");
                    continue;
                }
            },
        };
        let packet = &buf[..n];
        match server.handler.handle(packet) {
            Outcome::Reply(answer, result) => {
                server.count(result, Transport::Udp, peer);
                let _ = socket.send_to(&answer, peer).await;
            }
            Outcome::Drop => server.count(QueryResult::Malformed, Transport::Udp, peer),
            Outcome::Forward(forward) => {
                let Ok(permit) = server.inflight.try_acquire() else {
                    server.count(QueryResult::Overloaded, Transport::Udp, peer);
                    let _ = socket.send_to(&handler::servfail(&forward.query), peer).await;
                    continue;
                };
                permit.forget();
                let server = server.clone();
                let socket = socket.clone();
                let packet = packet.to_vec();
                tasks.spawn(async move {
                    let (answer, result) = server.forward(&packet, forward, Transport::Udp).await;
                    server.inflight.add_permits(1);
                    server.count(result, Transport::Udp, peer);
                    let _ = socket.send_to(&answer, peer).await;
                });
            }
        }
    }
}

pub async fn serve_tcp(server: Arc<Server>, listener: TcpListener, tasks: TaskTracker, shutdown: CancellationToken) {
    let connections = Arc::new(Semaphore::new(MAX_TCP_CONNECTIONS));
    loop {
        let (stream, peer) = tokio::select! {
            _ = shutdown.cancelled() => return,
            r = listener.accept() => match r {
                Ok(r) => r,
                Err(error) => {
                    tracing::warn!(%error, "TCP accept");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
        };
        let Ok(permit) = connections.clone().try_acquire_owned() else {
            // Over the limit: closing is the only answer TCP DNS has.
            continue;
        };
        let server = server.clone();
        let shutdown = shutdown.clone();
        tasks.spawn(async move {
            let _permit = permit;
            tokio::select! {
                _ = shutdown.cancelled() => {}
                _ = serve_connection(&server, stream, peer) => {}
            }
        });
    }
}

/// Answers the queries of one TCP connection in order until it closes or idles out.
async fn serve_connection(server: &Server, mut stream: TcpStream, peer: SocketAddr) {
    let _ = stream.set_nodelay(true);
    loop {
        let len = match tokio::time::timeout(server.tcp_idle_timeout, stream.read_u16()).await {
            Ok(Ok(len)) => len as usize,
            _ => return,
        };
        let mut packet = vec![0u8; len];
        match tokio::time::timeout(server.tcp_idle_timeout, stream.read_exact(&mut packet)).await {
            Ok(Ok(_)) => {}
            _ => return,
        }
        let (answer, result) = match server.handler.handle(&packet) {
            Outcome::Reply(answer, result) => (answer, result),
            Outcome::Drop => {
                server.count(QueryResult::Malformed, Transport::Tcp, peer);
                return;
            }
            Outcome::Forward(forward) => server.forward(&packet, forward, Transport::Tcp).await,
        };
        server.count(result, Transport::Tcp, peer);
        let mut out = Vec::with_capacity(answer.len() + 2);
        out.extend_from_slice(&(answer.len() as u16).to_be_bytes());
        out.extend_from_slice(&answer);
        if stream.write_all(&out).await.is_err() {
            return;
        }
    }
}
