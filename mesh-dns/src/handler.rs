//! Turns one query packet into an answer, a forward, or nothing. Pure: no sockets, so
//! it is property-tested with arbitrary bytes.
//!
//! Name rule (see proposals/008): with mesh domain `D` and cluster domain `C`,
//! - `D` itself: NODATA (SOA for an SOA query);
//! - `<ns>.D`: NODATA if some service lives in `<ns>`, else NXDOMAIN;
//! - `<svc>.<ns>.D`: A / AAAA from the table, NODATA for other types or a missing family,
//!   NXDOMAIN if unknown;
//! - deeper names under `D`: NXDOMAIN;
//! - `X.D.S` where `X` is one or more labels and `S` is `C`, `svc.C`, `<one label>.svc.C`
//!   or a configured search domain: a search-path expansion, NXDOMAIN locally;
//! - an external service's host the record file lists: A / AAAA from the table (NODATA
//!   for a missing family), so a pod calling it reaches the mesh VIP; its other types are
//!   forwarded;
//! - everything else is forwarded.
//!
//! Mesh names get SERVFAIL until a record file was loaded once. Each alias domain the
//! record file lists is a `D` too (its own zone, the same records), unless it is the mesh
//! domain or the cluster domain, or either is under the other: such an alias would take
//! their names, and is left out (the debug page says so).

use std::sync::Arc;

use aether_common::quote::quote;
use hickory_proto::op::{Edns, Message, MessageType, OpCode, ResponseCode};
use hickory_proto::rr::rdata::{A, AAAA};
use hickory_proto::rr::{DNSClass, RData, Record, RecordType};

use crate::records::Addresses;
use crate::table::{CurrentTable, Table};
pub use crate::zone::DomainError;
use crate::zone::{Zone, labels};

/// TTL of mesh answers.
pub const ANSWER_TTL: u32 = 30;
/// TTL of the SOA in negative answers, which is also how long they are cached.
pub const NEGATIVE_TTL: u32 = 5;
/// The UDP payload size mesh-dns advertises in its own EDNS answers (the DNS flag day value).
pub const EDNS_PAYLOAD: u16 = 1232;
/// A DNS header's length.
pub const HEADER_LEN: usize = 12;

#[derive(Debug, thiserror::Error)]
pub enum HandlerError {
    #[error("--mesh-domain {}: {}", quote(.0), .1)]
    MeshDomain(String, DomainError),
    #[error("--cluster-domain {}: {}", quote(.0), .1)]
    ClusterDomain(String, DomainError),
    #[error("--search-domain {}: {}", quote(.0), .1)]
    SearchDomain(String, DomainError),
}

/// What a query turned into; `as_str` is the `result` label of the queries metric.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QueryResult {
    /// A mesh name with records of the asked type.
    Answer,
    /// A mesh name without records of the asked type.
    NoData,
    /// An unknown mesh name.
    NxDomain,
    /// A search-path expansion of a mesh name.
    SearchExpansion,
    /// A mesh name asked before any record file was loaded.
    NotLoaded,
    /// Answered by an upstream.
    Forwarded,
    /// Every upstream failed or timed out (SERVFAIL).
    UpstreamFailed,
    /// Too many forwarded queries in flight (SERVFAIL).
    Overloaded,
    /// Not a parseable DNS query (FORMERR, or dropped without a header).
    Malformed,
    /// An opcode other than QUERY (NOTIMP) or a class other than IN under the mesh domain (REFUSED).
    Refused,
}

impl QueryResult {
    pub const ALL: [QueryResult; 10] = [
        QueryResult::Answer,
        QueryResult::NoData,
        QueryResult::NxDomain,
        QueryResult::SearchExpansion,
        QueryResult::NotLoaded,
        QueryResult::Forwarded,
        QueryResult::UpstreamFailed,
        QueryResult::Overloaded,
        QueryResult::Malformed,
        QueryResult::Refused,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            QueryResult::Answer => "answer",
            QueryResult::NoData => "nodata",
            QueryResult::NxDomain => "nxdomain",
            QueryResult::SearchExpansion => "search_nxdomain",
            QueryResult::NotLoaded => "servfail_not_loaded",
            QueryResult::Forwarded => "forwarded",
            QueryResult::UpstreamFailed => "servfail_upstream",
            QueryResult::Overloaded => "servfail_overloaded",
            QueryResult::Malformed => "malformed",
            QueryResult::Refused => "refused",
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }
}

/// A query to send upstream.
#[derive(Debug)]
pub struct Forward {
    /// The client's query, parsed: to check the upstream's answer against it.
    pub query: Message,
    /// The largest UDP answer the client accepts.
    pub client_udp_limit: usize,
}

#[derive(Debug)]
pub enum Outcome {
    Reply(Vec<u8>, QueryResult),
    Forward(Forward),
    /// Not answerable at all (shorter than a header, or a response): dropped.
    Drop,
}

/// Where a name falls.
#[derive(Debug, PartialEq, Eq)]
enum Class<'a> {
    Apex,
    Namespace(&'a [u8]),
    Service { svc: &'a [u8], ns: &'a [u8] },
    TooDeep,
    SearchExpansion,
    Other,
}

pub struct Handler {
    store: Arc<CurrentTable>,
    /// The mesh domain mesh-dns was started with.
    zone: Zone,
    /// Cluster domain labels, lowercase.
    cluster_labels: Vec<Vec<u8>>,
    /// Other search domains' labels, lowercase.
    search_domains: Vec<Vec<Vec<u8>>>,
}

impl Handler {
    pub fn new(
        store: Arc<CurrentTable>,
        mesh_domain: &str,
        cluster_domain: &str,
        search_domains: &[String],
    ) -> Result<Self, HandlerError> {
        let zone =
            Zone::new("mesh domain", mesh_domain).map_err(|e| HandlerError::MeshDomain(mesh_domain.into(), e))?;
        let (_, cluster_labels) = labels("cluster domain", cluster_domain)
            .map_err(|e| HandlerError::ClusterDomain(cluster_domain.into(), e))?;
        let search_domains = search_domains
            .iter()
            .filter(|s| !s.trim().is_empty() && s.trim() != ".")
            .map(|s| {
                labels("search domain", s.trim())
                    .map(|(_, l)| l)
                    .map_err(|e| HandlerError::SearchDomain(s.clone(), e))
            })
            .collect::<Result<_, _>>()?;
        Ok(Self {
            store,
            zone,
            cluster_labels,
            search_domains,
        })
    }

    pub fn store(&self) -> &Arc<CurrentTable> {
        &self.store
    }

    /// Whether an alias of the record file is answered: not one that is, or is above or
    /// under, the mesh domain or the cluster domain.
    pub fn serves_alias(&self, alias: &Zone) -> bool {
        !alias.overlaps(&self.zone.labels) && !alias.overlaps(&self.cluster_labels)
    }

    /// The zones answered with `table`: the mesh domain, then the table's aliases served.
    fn zones<'z>(&'z self, table: Option<&'z Table>) -> impl Iterator<Item = &'z Zone> + Clone {
        let aliases = table.map_or(&[][..], |t| &t.aliases[..]);
        std::iter::once(&self.zone).chain(aliases.iter().filter(|a| self.serves_alias(a)))
    }

    fn classify<'a, 'z>(
        &'z self,
        name: &'a [&'a [u8]],
        zones: impl Iterator<Item = &'z Zone> + Clone,
    ) -> (Class<'a>, &'z Zone) {
        let eq = |a: &[u8], b: &[u8]| a.eq_ignore_ascii_case(b);
        let ends_with = |labels: &[&[u8]], suffix: &[Vec<u8>]| {
            labels.len() >= suffix.len()
                && labels[labels.len() - suffix.len()..]
                    .iter()
                    .zip(suffix)
                    .all(|(a, b)| eq(a, b))
        };
        for zone in zones.clone() {
            if !ends_with(name, &zone.labels) {
                continue;
            }
            let class = match name.len() - zone.labels.len() {
                0 => Class::Apex,
                1 => Class::Namespace(name[0]),
                2 => Class::Service {
                    svc: name[0],
                    ns: name[1],
                },
                _ => Class::TooDeep,
            };
            return (class, zone);
        }
        // X.D.S with X at least one label: find D strictly inside the name.
        for zone in zones {
            let d = zone.labels.len();
            for start in 1..name.len().saturating_sub(d) {
                let inner = &name[start..start + d];
                if inner.iter().zip(&zone.labels).all(|(a, b)| eq(a, b)) && self.is_search_suffix(&name[start + d..]) {
                    return (Class::SearchExpansion, zone);
                }
            }
        }
        (Class::Other, &self.zone)
    }

    fn is_search_suffix(&self, suffix: &[&[u8]]) -> bool {
        let c = &self.cluster_labels;
        let eq_all = |labels: &[&[u8]], want: &[Vec<u8>]| {
            labels.len() == want.len() && labels.iter().zip(want).all(|(a, b)| a.eq_ignore_ascii_case(b))
        };
        if eq_all(suffix, c) {
            return true;
        }
        // svc.C or <ns>.svc.C
        for skip in [0usize, 1] {
            if suffix.len() == skip + 1 + c.len()
                && suffix[skip].eq_ignore_ascii_case(b"svc")
                && eq_all(&suffix[skip + 1..], c)
            {
                return true;
            }
        }
        self.search_domains.iter().any(|s| eq_all(suffix, s))
    }

    /// Handles one packet.
    pub fn handle(&self, packet: &[u8]) -> Outcome {
        if packet.len() < HEADER_LEN || packet[2] & 0x80 != 0 {
            // No header to answer with, or a response (answering could start a loop).
            return Outcome::Drop;
        }
        self.store.with(|table| {
            if let Some(answer) = table.and_then(|t| self.fast_answer(packet, t)) {
                return Outcome::Reply(answer, QueryResult::Answer);
            }
            self.handle_parsed(packet, table)
        })
    }

    /// The general path: any query, through hickory's messages.
    fn handle_parsed(&self, packet: &[u8], table: Option<&Table>) -> Outcome {
        let request = match Message::from_vec(packet) {
            Ok(m) => m,
            Err(_) => return Outcome::Reply(header_only(packet, ResponseCode::FormErr), QueryResult::Malformed),
        };
        if request.metadata.op_code != OpCode::Query {
            return Outcome::Reply(header_only(packet, ResponseCode::NotImp), QueryResult::Refused);
        }
        if request.queries.len() != 1 {
            return Outcome::Reply(header_only(packet, ResponseCode::FormErr), QueryResult::Malformed);
        }
        let query = &request.queries[0];
        let name_labels: Vec<&[u8]> = query.name().iter().collect();
        let (class, zone) = self.classify(&name_labels, self.zones(table));
        if class == Class::Other {
            let host = table.and_then(|t| t.lookup_host(&name_labels));
            let address_query = matches!(query.query_type(), RecordType::A | RecordType::AAAA | RecordType::ANY);
            if let Some(addresses) = host.filter(|_| address_query && query.query_class() == DNSClass::IN) {
                return addresses_reply(&request, &addresses, None);
            }
            let client_udp_limit = request.edns.as_ref().map_or(512, |e| e.max_payload().max(512)) as usize;
            return Outcome::Forward(Forward {
                query: request,
                client_udp_limit,
            });
        }
        let reply = |code, result| reply(&request, code, Vec::new(), None, result);
        if class == Class::SearchExpansion {
            return reply(ResponseCode::NXDomain, QueryResult::SearchExpansion);
        }
        if !matches!(query.query_class(), DNSClass::IN | DNSClass::ANY) {
            return reply(ResponseCode::Refused, QueryResult::Refused);
        }
        match table {
            None => reply(ResponseCode::ServFail, QueryResult::NotLoaded),
            Some(table) => answer(&request, &class, zone, table),
        }
    }

    /// The hot path, measured (see proposals/008): a plain A or AAAA query for a mesh
    /// service that has that address is answered straight from the packet bytes, without
    /// building messages. Anything else (compression, several questions, other types,
    /// EDNS options beyond a bare OPT, misses) returns None and takes the general path,
    /// which gives the same answer (property-tested).
    fn fast_answer(&self, packet: &[u8], table: &Table) -> Option<Vec<u8>> {
        let additional = plain_query_header(packet)?;
        let name = QuestionName::read(packet)?;
        let at = name.end;
        let question_end = at + 4;
        let qtype = u16::from_be_bytes([*packet.get(at)?, *packet.get(at + 1)?]);
        let qclass = u16::from_be_bytes([*packet.get(at + 2)?, *packet.get(at + 3)?]);
        if qclass != 1 {
            return None;
        }
        let in_domain = |zone: &Zone| {
            name.count == 2 + zone.labels.len()
                && (zone.labels.iter().enumerate()).all(|(i, d)| name.label(packet, i + 2).eq_ignore_ascii_case(d))
        };
        if !self.zones(Some(table)).any(in_domain) {
            return None;
        }
        let edns = bare_opt(packet, question_end, additional)?;
        let addresses = table.lookup(name.label(packet, 0), name.label(packet, 1))?;
        fast_reply(&packet[..question_end], qtype, &addresses, edns)
    }

    /// The general path only, for tests that compare it with the fast one.
    #[cfg(test)]
    fn handle_general(&self, packet: &[u8]) -> Outcome {
        self.store.with(|table| self.handle_parsed(packet, table))
    }
}

/// The answer to a query for a name under `zone`, classified as `class`.
fn answer(request: &Message, class: &Class<'_>, zone: &Zone, table: &Table) -> Outcome {
    let query = &request.queries[0];
    let qtype = query.query_type();
    let soa = Some((zone, table.generation as u32));
    match *class {
        Class::Apex if qtype == RecordType::SOA => {
            let record = zone.soa(table.generation as u32);
            reply(request, ResponseCode::NoError, vec![record], None, QueryResult::Answer)
        }
        Class::Apex => reply(request, ResponseCode::NoError, Vec::new(), soa, QueryResult::NoData),
        Class::Namespace(ns) if table.has_namespace(ns) => {
            reply(request, ResponseCode::NoError, Vec::new(), soa, QueryResult::NoData)
        }
        Class::Service { svc, ns } => match table.lookup(svc, ns) {
            Some(addresses) => addresses_reply(request, &addresses, soa),
            None => reply(request, ResponseCode::NXDomain, Vec::new(), soa, QueryResult::NxDomain),
        },
        _ => reply(request, ResponseCode::NXDomain, Vec::new(), soa, QueryResult::NxDomain),
    }
}

/// The A / AAAA answer of `addresses` to `request` (NODATA, with `soa` if given, when
/// it has none of the family asked for).
fn addresses_reply(request: &Message, addresses: &Addresses, soa: Option<(&Zone, u32)>) -> Outcome {
    let query = &request.queries[0];
    let (qtype, name) = (query.query_type(), query.name().clone());
    let mut answers = Vec::with_capacity(2);
    if matches!(qtype, RecordType::A | RecordType::ANY)
        && let Some(v4) = addresses.v4
    {
        answers.push(Record::from_rdata(name.clone(), ANSWER_TTL, RData::A(A(v4))));
    }
    if matches!(qtype, RecordType::AAAA | RecordType::ANY)
        && let Some(v6) = addresses.v6
    {
        answers.push(Record::from_rdata(name, ANSWER_TTL, RData::AAAA(AAAA(v6))));
    }
    match answers.is_empty() {
        true => reply(request, ResponseCode::NoError, answers, soa, QueryResult::NoData),
        false => reply(request, ResponseCode::NoError, answers, None, QueryResult::Answer),
    }
}

/// A reply to `request`; a negative one carries the SOA of its zone with the table's
/// generation as its serial.
fn reply(
    request: &Message,
    code: ResponseCode,
    answers: Vec<Record>,
    soa: Option<(&Zone, u32)>,
    result: QueryResult,
) -> Outcome {
    let mut response = Message::new(request.metadata.id, MessageType::Response, OpCode::Query);
    response.metadata.authoritative = !matches!(
        result,
        QueryResult::NotLoaded | QueryResult::Refused | QueryResult::SearchExpansion
    );
    response.metadata.recursion_desired = request.metadata.recursion_desired;
    response.metadata.recursion_available = true;
    response.metadata.checking_disabled = request.metadata.checking_disabled;
    response.metadata.response_code = code;
    response.queries = request.queries.clone();
    response.answers = answers;
    if let Some((zone, serial)) = soa {
        response.authorities.push(zone.soa(serial));
    }
    if request.edns.is_some() {
        let mut edns = Edns::new();
        edns.set_max_payload(EDNS_PAYLOAD);
        response.edns = Some(edns);
    }
    match response.to_vec() {
        Ok(bytes) => Outcome::Reply(bytes, result),
        Err(_) => Outcome::Reply(header_only_for(&request.metadata, ResponseCode::ServFail), result),
    }
}

/// The fast path's header check: a standard query (opcode 0, no TC), one question, at
/// most one additional record. Returns the additional count.
fn plain_query_header(packet: &[u8]) -> Option<u8> {
    if packet[2] & 0x7a != 0 || packet[4..8] != [0, 1, 0, 0] || packet[8..10] != [0, 0] || packet[10] != 0 {
        return None;
    }
    let additional = packet[11];
    (additional <= 1).then_some(additional)
}

/// The labels of an uncompressed question name, as offsets on the stack (no allocation
/// on the hot path).
struct QuestionName {
    /// Each label's start and length in the packet.
    spans: [(usize, usize); 32],
    count: usize,
    /// Just past the name's terminating root label: where the question's type starts.
    end: usize,
}

impl QuestionName {
    /// The name after the header; None if it is compressed, malformed, longer than 255
    /// bytes or has more than 32 labels.
    fn read(packet: &[u8]) -> Option<Self> {
        let mut name = QuestionName {
            spans: [(0, 0); 32],
            count: 0,
            end: HEADER_LEN,
        };
        loop {
            let at = name.end;
            let len = *packet.get(at)? as usize;
            if len == 0 {
                name.end += 1;
                break;
            }
            if len > 63 || name.count == name.spans.len() || at + 1 + len > packet.len() {
                return None;
            }
            name.spans[name.count] = (at + 1, len);
            name.count += 1;
            name.end += 1 + len;
        }
        (name.end - HEADER_LEN <= 255).then_some(name)
    }

    fn label<'p>(&self, packet: &'p [u8], i: usize) -> &'p [u8] {
        let (start, len) = self.spans[i];
        &packet[start..start + len]
    }
}

/// What follows the question: nothing (`Some(false)`) or one bare OPT record — root
/// name, type 41, version 0, no options (`Some(true)`). Anything else: None.
fn bare_opt(packet: &[u8], question_end: usize, additional: u8) -> Option<bool> {
    match additional {
        0 if packet.len() == question_end => Some(false),
        1 if packet.len() == question_end + 11
            && packet[question_end] == 0
            && packet[question_end + 1..question_end + 3] == [0, 41]
            && packet[question_end + 6] == 0
            && packet[question_end + 9..question_end + 11] == [0, 0] =>
        {
            Some(true)
        }
        _ => None,
    }
}

/// The answer to `query` (its header and question) with the one address of the asked
/// type, and a bare OPT if the query had one; None if there is no such address.
fn fast_reply(query: &[u8], qtype: u16, addresses: &Addresses, edns: bool) -> Option<Vec<u8>> {
    let (v4, v6);
    let rdata: &[u8] = match (qtype, addresses.v4, addresses.v6) {
        (1, Some(a), _) => {
            v4 = a.octets();
            &v4
        }
        (28, _, Some(a)) => {
            v6 = a.octets();
            &v6
        }
        _ => return None,
    };
    let mut out = Vec::with_capacity(query.len() + 28 + 11);
    out.extend_from_slice(query);
    // QR, AA, RD copied; RA, CD copied; NOERROR.
    out[2] = 0x84 | (query[2] & 0x01);
    out[3] = 0x80 | (query[3] & 0x10);
    out[6..8].copy_from_slice(&[0, 1]);
    out[11] = u8::from(edns);
    // The answer: a pointer to the question's name, type, class IN, TTL, the address.
    out.extend_from_slice(&[0xc0, 0x0c]);
    out.extend_from_slice(&qtype.to_be_bytes());
    out.extend_from_slice(&[0, 1]);
    out.extend_from_slice(&ANSWER_TTL.to_be_bytes());
    out.extend_from_slice(&(rdata.len() as u16).to_be_bytes());
    out.extend_from_slice(rdata);
    if edns {
        out.push(0);
        out.extend_from_slice(&[0, 41]);
        out.extend_from_slice(&EDNS_PAYLOAD.to_be_bytes());
        out.extend_from_slice(&[0, 0, 0, 0, 0, 0]);
    }
    Some(out)
}

fn header_only_for(meta: &hickory_proto::op::Metadata, code: ResponseCode) -> Vec<u8> {
    let mut out = vec![0u8; HEADER_LEN];
    out[..2].copy_from_slice(&meta.id.to_be_bytes());
    out[2] = 0x80 | (u8::from(meta.op_code) << 3) | u8::from(meta.recursion_desired);
    out[3] = 0x80 | code.low();
    out
}

/// A header-only answer to a packet that may not parse: id, opcode and RD copied.
pub fn header_only(packet: &[u8], code: ResponseCode) -> Vec<u8> {
    let mut out = vec![0u8; HEADER_LEN];
    out[..2].copy_from_slice(&packet[..2]);
    // QR=1, opcode and RD from the query.
    out[2] = 0x80 | (packet[2] & 0x79);
    // RA=1 and the code.
    out[3] = 0x80 | code.low();
    out
}

/// A SERVFAIL answer to a query that parsed.
pub fn servfail(query: &Message) -> Vec<u8> {
    let mut response = Message::new(query.metadata.id, MessageType::Response, query.metadata.op_code);
    response.metadata.recursion_desired = query.metadata.recursion_desired;
    response.metadata.recursion_available = true;
    response.metadata.response_code = ResponseCode::ServFail;
    response.queries = query.queries.clone();
    if query.edns.is_some() {
        let mut edns = Edns::new();
        edns.set_max_payload(EDNS_PAYLOAD);
        response.edns = Some(edns);
    }
    response
        .to_vec()
        .unwrap_or_else(|_| header_only_for(&query.metadata, ResponseCode::ServFail))
}

/// The same answer cut to its header and question with TC set, for a UDP client that
/// cannot take all of it: the client retries over TCP.
pub fn truncated(query: &Message, answer: &[u8]) -> Vec<u8> {
    let mut response = Message::new(query.metadata.id, MessageType::Response, query.metadata.op_code);
    if answer.len() >= 4 {
        response.metadata.authoritative = answer[2] & 0x04 != 0;
        response.metadata.recursion_available = answer[3] & 0x80 != 0;
        response.metadata.response_code = ResponseCode::from_low(answer[3] & 0x0f);
    }
    response.metadata.recursion_desired = query.metadata.recursion_desired;
    response.metadata.truncation = true;
    response.queries = query.queries.clone();
    if query.edns.is_some() {
        let mut edns = Edns::new();
        edns.set_max_payload(EDNS_PAYLOAD);
        response.edns = Some(edns);
    }
    response
        .to_vec()
        .unwrap_or_else(|_| header_only_for(&query.metadata, ResponseCode::ServFail))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::RecordFile;
    use hickory_proto::op::Query;
    use hickory_proto::rr::Name;
    use proptest::prelude::*;
    use std::net::Ipv4Addr;

    fn handler(loaded: bool) -> Handler {
        let store = Arc::new(CurrentTable::default());
        if loaded {
            let mut file = RecordFile {
                generation: 4,
                ..RecordFile::default()
            };
            file.records.insert(
                ("shop".into(), "cart".into()),
                Addresses {
                    v4: Some(Ipv4Addr::new(240, 240, 0, 9)),
                    v6: Some("fd00::9".parse().unwrap()),
                },
            );
            file.records.insert(
                ("shop".into(), "v4only".into()),
                Addresses {
                    v4: Some(Ipv4Addr::new(240, 240, 0, 10)),
                    v6: None,
                },
            );
            // One alias answered; two that would take names of the mesh domain or of
            // the cluster's, left out.
            file.aliases = ["corp.internal", "aether.internal", "x.cluster.local"]
                .map(String::from)
                .to_vec();
            let external = Addresses {
                v4: Some(Ipv4Addr::new(240, 240, 0, 11)),
                v6: None,
            };
            file.hosts.insert("api.payments.example".into(), external);
            store.replace(Table::new(&file));
        }
        Handler::new(store, "aether.internal", "cluster.local", &["corp.example".to_owned()]).unwrap()
    }

    fn query(name: &str, qtype: RecordType, edns: bool) -> Vec<u8> {
        let mut m = Message::new(0x1234, MessageType::Query, OpCode::Query);
        m.metadata.recursion_desired = true;
        m.add_query(Query::query(Name::from_ascii(name).unwrap(), qtype));
        if edns {
            let mut e = Edns::new();
            e.set_max_payload(4096);
            m.edns = Some(e);
        }
        m.to_vec().unwrap()
    }

    fn reply(h: &Handler, packet: &[u8]) -> (Message, QueryResult) {
        match h.handle(packet) {
            Outcome::Reply(bytes, result) => (Message::from_vec(&bytes).unwrap(), result),
            other => panic!("expected a reply, got {other:?}"),
        }
    }

    /// What a query for a mesh name gets: its response code, answer count and metric result.
    type Expected = (ResponseCode, usize, QueryResult);

    #[test]
    fn answers_every_kind_of_mesh_name() {
        let answer = |n| (ResponseCode::NoError, n, QueryResult::Answer);
        let nodata = (ResponseCode::NoError, 0, QueryResult::NoData);
        let nxdomain = (ResponseCode::NXDomain, 0, QueryResult::NxDomain);
        let h = handler(true);
        for (name, qtype, expected) in [
            // Services: by family and type, in any case; unknown ones and names below them.
            ("cart.shop.aether.internal.", RecordType::A, answer(1)),
            ("CART.Shop.aether.INTERNAL.", RecordType::AAAA, answer(1)),
            ("v4only.shop.aether.internal.", RecordType::AAAA, nodata),
            ("cart.shop.aether.internal.", RecordType::MX, nodata),
            ("cart.shop.aether.internal.", RecordType::ANY, answer(2)),
            ("nope.shop.aether.internal.", RecordType::A, nxdomain),
            ("a.cart.shop.aether.internal.", RecordType::A, nxdomain),
            // A namespace with services, one without, and the apex.
            ("shop.aether.internal.", RecordType::A, nodata),
            ("other.aether.internal.", RecordType::A, nxdomain),
            ("aether.internal.", RecordType::SOA, answer(1)),
            ("aether.internal.", RecordType::A, nodata),
        ] {
            assert_authoritative_reply(&h, name, qtype, expected);
        }
    }

    /// The reply is `expected`, authoritative, for the asked name; answers carry the
    /// answer TTL and negative answers the SOA.
    fn assert_authoritative_reply(h: &Handler, name: &str, qtype: RecordType, expected: Expected) {
        let (m, result) = reply(h, &query(name, qtype, false));
        let (_, answers, _) = expected;
        assert_eq!(
            (m.metadata.response_code, m.answers.len(), result),
            expected,
            "{name} {qtype}"
        );
        assert_eq!(m.metadata.id, 0x1234);
        assert!(m.metadata.authoritative, "{name}");
        assert_eq!(m.queries[0].name(), &Name::from_ascii(name).unwrap());
        if answers > 0 && qtype != RecordType::SOA {
            assert!(m.answers.iter().all(|a| a.ttl == ANSWER_TTL));
        }
        if answers == 0 {
            assert_eq!(m.authorities.len(), 1, "negative answers carry the SOA: {name}");
        }
    }

    #[test]
    fn external_hosts_are_answered_with_their_vip_and_their_other_types_forwarded() {
        let h = handler(true);
        let (m, result) = reply(&h, &query("API.payments.example.", RecordType::A, true));
        assert_eq!(
            (m.metadata.response_code, result),
            (ResponseCode::NoError, QueryResult::Answer)
        );
        assert_eq!(m.answers.len(), 1);
        assert_eq!(m.answers[0].data, RData::A(A(Ipv4Addr::new(240, 240, 0, 11))));
        assert!(m.edns.is_some(), "EDNS asked, EDNS answered");
        // No IPv6 VIP: NODATA, never the outside's own AAAA (which would bypass the mesh).
        let (m, result) = reply(&h, &query("api.payments.example.", RecordType::AAAA, false));
        assert_eq!(
            (m.metadata.response_code, m.answers.len(), result),
            (ResponseCode::NoError, 0, QueryResult::NoData)
        );
        for (name, qtype) in [
            ("api.payments.example.", RecordType::MX),
            ("payments.example.", RecordType::A),
            ("www.api.payments.example.", RecordType::A),
        ] {
            assert!(
                matches!(h.handle(&query(name, qtype, false)), Outcome::Forward(_)),
                "{name} {qtype}"
            );
        }
    }

    #[test]
    fn an_alias_domain_is_answered_like_the_mesh_domain_in_its_own_zone() {
        let answer = |n| (ResponseCode::NoError, n, QueryResult::Answer);
        let nodata = (ResponseCode::NoError, 0, QueryResult::NoData);
        let nxdomain = (ResponseCode::NXDomain, 0, QueryResult::NxDomain);
        let h = handler(true);
        for (name, qtype, expected) in [
            ("cart.shop.corp.internal.", RecordType::A, answer(1)),
            ("Cart.Shop.CORP.internal.", RecordType::ANY, answer(2)),
            ("nope.shop.corp.internal.", RecordType::A, nxdomain),
            ("shop.corp.internal.", RecordType::A, nodata),
            ("corp.internal.", RecordType::SOA, answer(1)),
        ] {
            assert_authoritative_reply(&h, name, qtype, expected);
        }
        // Negative answers carry the alias's own SOA.
        let (m, _) = reply(&h, &query("nope.shop.corp.internal.", RecordType::A, false));
        assert_eq!(m.authorities[0].name, Name::from_ascii("corp.internal.").unwrap());
        let (m, _) = reply(&h, &query("nope.shop.aether.internal.", RecordType::A, false));
        assert_eq!(m.authorities[0].name, Name::from_ascii("aether.internal.").unwrap());
        // A search expansion of an alias name is one too.
        let (_, result) = reply(
            &h,
            &query("cart.shop.corp.internal.cluster.local.", RecordType::A, false),
        );
        assert_eq!(result, QueryResult::SearchExpansion);
        // The alias under the cluster domain is left out: its names go upstream.
        for name in ["cart.shop.x.cluster.local.", "corp.internal.example."] {
            assert!(
                matches!(h.handle(&query(name, RecordType::A, false)), Outcome::Forward(_)),
                "{name}"
            );
        }
        let table = h.store.load().unwrap();
        let served: Vec<String> = (table.aliases.iter())
            .filter(|a| h.serves_alias(a))
            .map(|a| a.name().to_string())
            .collect();
        assert_eq!(served, ["corp.internal."]);
    }

    #[test]
    fn servfail_before_any_table_leaves_alias_names_to_upstream() {
        // Before a record file, no alias is known: its names are not the mesh's yet.
        let h = handler(false);
        assert!(matches!(
            h.handle(&query("cart.shop.corp.internal.", RecordType::A, false)),
            Outcome::Forward(_)
        ));
    }

    #[test]
    fn the_fast_path_reads_only_plain_question_names() {
        let plain = query("cart.shop.aether.internal.", RecordType::A, false);
        let name = QuestionName::read(&plain).expect("a plain name");
        assert_eq!((name.count, name.end), (4, plain.len() - 4));
        assert_eq!(name.label(&plain, 1), b"shop");
        let mut header = plain[..HEADER_LEN].to_vec();
        let with_name = |name: &[u8]| [&header[..], name].concat();
        // A compression pointer, a label running past the end, a name over 255 bytes, 33 labels.
        assert!(QuestionName::read(&with_name(&[0xc0, 0x0c])).is_none());
        assert!(QuestionName::read(&with_name(&[5, b'c', b'a'])).is_none());
        let long: Vec<u8> = (0..5)
            .flat_map(|_| [&[60u8][..], &[b'x'; 60]].concat())
            .chain([0])
            .collect();
        assert!(QuestionName::read(&with_name(&long)).is_none());
        let deep: Vec<u8> = (0..33).flat_map(|_| [1, b'a']).chain([0]).collect();
        assert!(QuestionName::read(&with_name(&deep)).is_none());
        // Two questions: the general path's job.
        header[5] = 2;
        assert!(plain_query_header(&header).is_none());
    }

    #[test]
    fn search_path_expansions_are_nxdomain_and_the_rest_is_forwarded() {
        let h = handler(true);
        for name in [
            "cart.shop.aether.internal.shop.svc.cluster.local.",
            "cart.shop.aether.internal.svc.cluster.local.",
            "cart.shop.aether.internal.cluster.local.",
            "cart.shop.aether.internal.corp.example.",
            "x.aether.internal.Cluster.Local.",
        ] {
            let (m, result) = reply(&h, &query(name, RecordType::A, false));
            assert_eq!(
                (m.metadata.response_code, result),
                (ResponseCode::NXDomain, QueryResult::SearchExpansion),
                "{name}"
            );
        }
        for name in [
            "example.com.",
            "aether.internal.cluster.local.",
            "cart.shop.aether.internal.a.b.svc.cluster.local.",
            "cart.shop.aether.internal.example.com.",
            "kubernetes.default.svc.cluster.local.",
            "internal.",
        ] {
            assert!(
                matches!(h.handle(&query(name, RecordType::A, true)), Outcome::Forward(_)),
                "{name}"
            );
        }
        let Outcome::Forward(f) = h.handle(&query("example.com.", RecordType::A, true)) else {
            unreachable!()
        };
        assert_eq!(f.client_udp_limit, 4096);
        let Outcome::Forward(f) = h.handle(&query("example.com.", RecordType::A, false)) else {
            unreachable!()
        };
        assert_eq!(f.client_udp_limit, 512);
    }

    #[test]
    fn servfail_before_any_table_but_expansions_still_nxdomain() {
        let h = handler(false);
        let (m, result) = reply(&h, &query("cart.shop.aether.internal.", RecordType::A, false));
        assert_eq!(
            (m.metadata.response_code, result),
            (ResponseCode::ServFail, QueryResult::NotLoaded)
        );
        let (m, _) = reply(
            &h,
            &query("cart.shop.aether.internal.svc.cluster.local.", RecordType::A, false),
        );
        assert_eq!(m.metadata.response_code, ResponseCode::NXDomain);
    }

    #[test]
    fn edns_is_answered_with_edns() {
        let h = handler(true);
        let (m, _) = reply(&h, &query("cart.shop.aether.internal.", RecordType::A, true));
        assert_eq!(m.edns.map(|e| e.max_payload()), Some(EDNS_PAYLOAD));
        let (m, _) = reply(&h, &query("cart.shop.aether.internal.", RecordType::A, false));
        assert!(m.edns.is_none());
    }

    #[test]
    fn bad_packets_get_formerr_or_are_dropped() {
        let h = handler(true);
        assert!(matches!(h.handle(&[1, 2, 3]), Outcome::Drop));
        let mut response = query("cart.shop.aether.internal.", RecordType::A, false);
        response[2] |= 0x80;
        assert!(
            matches!(h.handle(&response), Outcome::Drop),
            "responses are never answered"
        );
        let mut garbage = query("cart.shop.aether.internal.", RecordType::A, false);
        garbage.truncate(20);
        match h.handle(&garbage) {
            Outcome::Reply(bytes, QueryResult::Malformed) => {
                assert_eq!(&bytes[..2], &[0x12, 0x34]);
                assert_eq!(bytes[3] & 0x0f, ResponseCode::FormErr.low());
            }
            other => panic!("{other:?}"),
        }
        let mut two = Message::new(7, MessageType::Query, OpCode::Query);
        two.add_query(Query::query(
            Name::from_ascii("a.b.aether.internal.").unwrap(),
            RecordType::A,
        ));
        two.add_query(Query::query(
            Name::from_ascii("c.d.aether.internal.").unwrap(),
            RecordType::A,
        ));
        let (m, result) = reply(&h, &two.to_vec().unwrap());
        assert_eq!(
            (m.metadata.response_code, result),
            (ResponseCode::FormErr, QueryResult::Malformed)
        );
        let mut notify = Message::new(7, MessageType::Query, OpCode::Notify);
        notify.add_query(Query::query(
            Name::from_ascii("a.b.aether.internal.").unwrap(),
            RecordType::A,
        ));
        let (m, _) = reply(&h, &notify.to_vec().unwrap());
        assert_eq!(m.metadata.response_code, ResponseCode::NotImp);
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

        #[test]
        fn the_fast_path_answers_exactly_as_the_general_path(
            svc in prop::sample::select(vec!["cart", "CART", "v4only", "nope", "Cart"]),
            ns in prop::sample::select(vec!["shop", "SHOP", "other"]),
            domain in prop::sample::select(vec!["aether.internal", "corp.internal", "Corp.Internal"]),
            qtype in prop::sample::select(vec![RecordType::A, RecordType::AAAA, RecordType::MX, RecordType::ANY]),
            edns in any::<bool>(),
            rd in any::<bool>(),
            cd in any::<bool>(),
            id in any::<u16>(),
        ) {
            let h = handler(true);
            let mut m = Message::new(id, MessageType::Query, OpCode::Query);
            m.metadata.recursion_desired = rd;
            m.metadata.checking_disabled = cd;
            m.add_query(Query::query(Name::from_ascii(format!("{svc}.{ns}.{domain}.")).unwrap(), qtype));
            if edns {
                let mut e = Edns::new();
                e.set_max_payload(4096);
                m.edns = Some(e);
            }
            let packet = m.to_vec().unwrap();
            let table = h.store.load().unwrap();
            let (Outcome::Reply(general, _), fast) = (h.handle_general(&packet), h.fast_answer(&packet, &table)) else {
                panic!("the general path answers every mesh name");
            };
            let Outcome::Reply(served, _) = h.handle(&packet) else { panic!("a reply") };
            if let Some(fast) = fast {
                prop_assert_eq!(Message::from_vec(&fast).unwrap(), Message::from_vec(&general).unwrap());
                prop_assert_eq!(&served, &fast);
            } else {
                prop_assert_eq!(&served, &general);
                prop_assert!(qtype != RecordType::A || svc.eq_ignore_ascii_case("nope") || ns == "other",
                    "a plain A hit took the slow path");
            }
        }

        #[test]
        fn arbitrary_packets_never_panic_and_replies_echo_the_id(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
            let h = handler(true);
            if let Outcome::Reply(answer, _) = h.handle(&bytes) {
                prop_assert!(answer.len() >= HEADER_LEN);
                prop_assert_eq!(&answer[..2], &bytes[..2]);
                prop_assert!(answer[2] & 0x80 != 0, "a reply is a response");
            }
        }

        #[test]
        fn mutated_queries_never_panic(
            name in prop::sample::select(vec!["cart.shop.aether.internal.", "x.aether.internal.cluster.local.", "example.com."]),
            edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
            cut in any::<prop::sample::Index>(),
        ) {
            let h = handler(true);
            let mut packet = query(name, RecordType::A, true);
            for (i, b) in edits {
                let i = i.index(packet.len());
                packet[i] = b;
            }
            let len = HEADER_LEN + cut.index(packet.len() - HEADER_LEN + 1);
            packet.truncate(len);
            match h.handle(&packet) {
                Outcome::Reply(answer, _) => prop_assert_eq!(&answer[..2], &packet[..2]),
                Outcome::Forward(f) => prop_assert_eq!(f.query.queries.len(), 1),
                Outcome::Drop => prop_assert!(packet[2] & 0x80 != 0),
            }
        }
    }
}
