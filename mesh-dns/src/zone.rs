//! A domain mesh-dns answers for: the mesh domain it was started with, or an alias the
//! record file lists (a MeshConfig's mesh domain, proposals/016). Each is its own zone:
//! names under it are answered from the same records, and its negative answers carry
//! its own SOA.

use hickory_proto::rr::rdata::SOA;
use hickory_proto::rr::{Name, RData, Record};

use crate::handler::NEGATIVE_TTL;

/// Why a configured domain was refused; `what` names it (`mesh domain`, …).
#[derive(Debug, thiserror::Error)]
pub enum DomainError {
    #[error("{what}: {source}")]
    Name {
        what: &'static str,
        source: hickory_proto::ProtoError,
    },
    #[error("{what}: must not be the root")]
    Root { what: &'static str },
    /// `ns.` or `hostmaster.` under the domain (the SOA names) is not a name.
    #[error("{0}")]
    Soa(hickory_proto::ProtoError),
}

/// A domain's name and its labels, lowercase.
pub fn labels(what: &'static str, text: &str) -> Result<(Name, Vec<Vec<u8>>), DomainError> {
    let name = Name::from_ascii(text.trim_end_matches('.')).map_err(|source| DomainError::Name { what, source })?;
    let mut name = name.to_lowercase();
    name.set_fqdn(true);
    let labels: Vec<Vec<u8>> = name.iter().map(|l| l.to_vec()).collect();
    if labels.is_empty() {
        return Err(DomainError::Root { what });
    }
    Ok((name, labels))
}

#[derive(Clone, Debug)]
pub struct Zone {
    name: Name,
    /// The domain's labels, lowercase.
    pub labels: Vec<Vec<u8>>,
    soa_mname: Name,
    soa_rname: Name,
}

impl Zone {
    pub fn new(what: &'static str, domain: &str) -> Result<Self, DomainError> {
        let (name, labels) = labels(what, domain)?;
        let under = |label: &str| Name::from_ascii(label).and_then(|n| n.append_domain(&name));
        Ok(Self {
            soa_mname: under("ns").map_err(DomainError::Soa)?,
            soa_rname: under("hostmaster").map_err(DomainError::Soa)?,
            name,
            labels,
        })
    }

    /// The domain, e.g. `aether.internal.`.
    pub fn name(&self) -> &Name {
        &self.name
    }

    /// Whether one of the two domains is the other or under it: such an alias would take
    /// names of the mesh domain or of the cluster's own.
    pub fn overlaps(&self, other: &[Vec<u8>]) -> bool {
        let (short, long) = match self.labels.len() <= other.len() {
            true => (&self.labels[..], other),
            false => (other, &self.labels[..]),
        };
        long[long.len() - short.len()..] == *short
    }

    /// The zone's SOA with `serial`, as the authority of a negative answer.
    pub fn soa(&self, serial: u32) -> Record {
        let soa = SOA::new(
            self.soa_mname.clone(),
            self.soa_rname.clone(),
            serial,
            60,
            10,
            3600,
            NEGATIVE_TTL,
        );
        Record::from_rdata(self.name.clone(), NEGATIVE_TTL, RData::SOA(soa))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn zone(domain: &str) -> Zone {
        Zone::new("mesh domain", domain).unwrap()
    }

    #[test]
    fn overlapping_is_either_domain_under_the_other() {
        let mesh = zone("aether.internal");
        assert!(mesh.overlaps(&zone("aether.internal").labels));
        assert!(mesh.overlaps(&zone("internal").labels));
        assert!(mesh.overlaps(&zone("x.aether.internal").labels));
        assert!(!mesh.overlaps(&zone("corp.internal").labels));
        assert!(!mesh.overlaps(&zone("cluster.local").labels));
        assert!(
            zone("Corp.Internal").overlaps(&zone("corp.internal").labels),
            "lowercase"
        );
    }
}
