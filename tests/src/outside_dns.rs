//! A DNS server standing for the world outside the mesh: it answers A queries for the
//! names it was given (NXDOMAIN for others) over UDP on a free loopback port, so the node's
//! Envoy resolves external services' hosts through it (the agent's `--external-dns`) and a
//! test decides where a name points. Counts the queries it answered, per name.

use std::collections::{BTreeMap, HashMap};
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;

use hickory_proto::op::{Message, MessageType, ResponseCode};
use hickory_proto::rr::rdata::A;
use hickory_proto::rr::{RData, Record, RecordType};
use parking_lot::Mutex;
use tokio::net::UdpSocket;
use tokio::task::JoinHandle;

/// The TTL of every answer: short, so a test that moves a name sees Envoy follow.
pub const TTL: u32 = 5;

pub struct OutsideDns {
    addr: SocketAddr,
    names: Arc<Mutex<HashMap<String, Ipv4Addr>>>,
    queries: Arc<Mutex<BTreeMap<String, u64>>>,
    task: JoinHandle<()>,
}

impl OutsideDns {
    /// Starts answering `names` (lowercase, without the trailing dot). Call from a tokio runtime.
    pub async fn start(names: &[(&str, Ipv4Addr)]) -> OutsideDns {
        let socket = UdpSocket::bind("127.0.0.1:0")
            .await
            .expect("binding the outside DNS server");
        let addr = socket.local_addr().unwrap();
        let names = Arc::new(Mutex::new(
            names
                .iter()
                .map(|(n, ip)| ((*n).to_owned(), *ip))
                .collect::<HashMap<_, _>>(),
        ));
        let queries = Arc::new(Mutex::new(BTreeMap::new()));
        let (table, counts) = (names.clone(), queries.clone());
        let task = tokio::spawn(async move {
            let mut buf = [0u8; 1500];
            loop {
                let Ok((n, peer)) = socket.recv_from(&mut buf).await else {
                    continue;
                };
                let Ok(query) = Message::from_vec(&buf[..n]) else {
                    continue;
                };
                let Some(question) = query.queries.first().cloned() else {
                    continue;
                };
                let name = question.name().to_ascii().trim_end_matches('.').to_ascii_lowercase();
                *counts.lock().entry(name.clone()).or_insert(0) += 1;
                let mut reply = Message::new(query.metadata.id, MessageType::Response, query.metadata.op_code);
                reply.metadata.recursion_desired = query.metadata.recursion_desired;
                reply.metadata.recursion_available = true;
                reply.queries = query.queries.clone();
                let address = table.lock().get(&name).copied();
                match address {
                    Some(ip) if question.query_type() == RecordType::A => {
                        reply
                            .answers
                            .push(Record::from_rdata(question.name().clone(), TTL, RData::A(A(ip))));
                    }
                    // Known, but no address of that family: NODATA.
                    Some(_) => {}
                    None => reply.metadata.response_code = ResponseCode::NXDomain,
                }
                if let Ok(bytes) = reply.to_vec() {
                    let _ = socket.send_to(&bytes, peer).await;
                }
            }
        });
        OutsideDns {
            addr,
            names,
            queries,
            task,
        }
    }

    /// Where to send queries (`--external-dns`).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Points `name` at `ip` from now on.
    pub fn set(&self, name: &str, ip: Ipv4Addr) {
        self.names.lock().insert(name.to_owned(), ip);
    }

    /// How many queries for `name` arrived.
    pub fn queries(&self, name: &str) -> u64 {
        self.queries.lock().get(name).copied().unwrap_or(0)
    }
}

impl Drop for OutsideDns {
    fn drop(&mut self) {
        self.task.abort();
    }
}
