//! The record table mesh-dns answers from, swapped whole on reload so a query sees
//! the old table or the new one, never a mix.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use arc_swap::ArcSwapOption;

use crate::records::{Addresses, RecordFile};
use crate::zone::Zone;

/// One loaded record file, indexed for lookups by query labels.
#[derive(Debug)]
pub struct Table {
    pub generation: u64,
    pub written_at: SystemTime,
    pub loaded_at: Instant,
    /// `<svc>.<ns>` (lowercase) → addresses.
    names: HashMap<Box<[u8]>, Addresses>,
    /// Namespaces with at least one service (empty non-terminals under the domain).
    namespaces: HashSet<Box<[u8]>>,
    /// The file's alias domains, answered like the mesh domain (see `Handler`).
    pub aliases: Vec<Zone>,
    /// External services' hosts (lowercase, no trailing dot) → addresses.
    hosts: HashMap<Box<[u8]>, Addresses>,
}

impl Table {
    pub fn new(file: &RecordFile) -> Self {
        let mut names = HashMap::with_capacity(file.records.len());
        let mut namespaces = HashSet::new();
        for ((ns, svc), addresses) in &file.records {
            names.insert(format!("{svc}.{ns}").into_bytes().into_boxed_slice(), *addresses);
            namespaces.insert(ns.as_bytes().into());
        }
        // `RecordFile::parse` admits only mesh domains (`aether_common::names::mesh_domain`),
        // which are all zones: none is left out here.
        let aliases = (file.aliases.iter())
            .filter_map(|a| Zone::new("alias", a).ok())
            .collect();
        let hosts = (file.hosts.iter())
            .map(|(host, addresses)| (host.as_bytes().into(), *addresses))
            .collect();
        Self {
            generation: file.generation,
            written_at: file.written_at,
            loaded_at: Instant::now(),
            names,
            namespaces,
            aliases,
            hosts,
        }
    }

    /// The addresses of an external service's host named by `labels`, compared
    /// case-insensitively.
    pub fn lookup_host(&self, labels: &[&[u8]]) -> Option<Addresses> {
        if self.hosts.is_empty() {
            return None;
        }
        let mut name = labels.join(&b'.');
        name.make_ascii_lowercase();
        self.hosts.get(name.as_slice()).copied()
    }

    /// The addresses of `<svc>.<ns>`; labels are compared case-insensitively.
    pub fn lookup(&self, svc: &[u8], ns: &[u8]) -> Option<Addresses> {
        // Names are at most 255 bytes: a stack buffer avoids an allocation per query.
        let mut key = [0u8; 256];
        let len = svc.len() + 1 + ns.len();
        if len > key.len() {
            return None;
        }
        key[..svc.len()].copy_from_slice(svc);
        key[svc.len()] = b'.';
        key[svc.len() + 1..len].copy_from_slice(ns);
        key[..len].make_ascii_lowercase();
        self.names.get(&key[..len]).copied()
    }

    pub fn has_namespace(&self, ns: &[u8]) -> bool {
        let lower = ns.to_ascii_lowercase();
        self.namespaces.contains(lower.as_slice())
    }

    pub fn len(&self) -> usize {
        self.names.len()
    }

    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }
}

/// The current table; empty until a record file was loaded once.
#[derive(Debug, Default)]
pub struct CurrentTable(ArcSwapOption<Table>);

impl CurrentTable {
    pub fn load(&self) -> Option<Arc<Table>> {
        self.0.load_full()
    }

    /// Runs `f` on the current table without touching its reference count.
    pub fn with<R>(&self, f: impl FnOnce(Option<&Table>) -> R) -> R {
        let guard = self.0.load();
        f(guard.as_deref())
    }

    pub fn replace(&self, table: Table) {
        self.0.store(Some(Arc::new(table)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    #[test]
    fn lookups_ignore_case_and_know_namespaces() {
        let mut file = RecordFile::default();
        file.records.insert(
            ("shop".into(), "cart".into()),
            Addresses {
                v4: Some(Ipv4Addr::new(240, 240, 0, 1)),
                v6: None,
            },
        );
        let table = Table::new(&file);
        assert_eq!(
            table.lookup(b"CaRt", b"SHOP").unwrap().v4,
            Some(Ipv4Addr::new(240, 240, 0, 1))
        );
        assert!(table.lookup(b"cart", b"other").is_none());
        assert!(table.has_namespace(b"Shop"));
        assert!(!table.has_namespace(b"cart"));
        assert!(table.lookup(&[b'a'; 200], &[b'b'; 200]).is_none());
    }
}
