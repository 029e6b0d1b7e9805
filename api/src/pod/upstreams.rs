//! `config.aether.io/upstreams`: the services a pod calls, e.g. `"cart, payments/api"`.
//!
//! Entries are comma-separated and trimmed; empty entries are dropped; a bare name
//! means the pod's own namespace; duplicates collapse. A malformed entry is reported
//! and skipped: the rest of the annotation still counts. At most
//! [`MAX_REPORTED_ERRORS`] malformed entries are reported one by one (each quoted
//! briefly); one more line counts the rest, so a huge annotation cannot flood the log.

use std::collections::BTreeSet;

use aether_common::names::{self, LabelError};
use aether_common::quote::quote;

/// The annotation that declares a pod's upstreams.
pub const ANNOTATION: &str = "config.aether.io/upstreams";
/// Malformed entries reported one by one; the rest are counted in one more error.
pub const MAX_REPORTED_ERRORS: usize = 16;

/// Parsed upstreams: service keys `<ns>/<name>`, and the entries that were refused.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Upstreams {
    pub services: BTreeSet<String>,
    pub errors: Vec<String>,
}

pub fn parse(pod_namespace: &str, value: &str) -> Upstreams {
    let mut parsed = Upstreams::default();
    let mut unreported = 0;
    for (i, entry) in value.split(',').map(str::trim).enumerate() {
        if entry.is_empty() {
            continue;
        }
        let key = match entry.split_once('/') {
            Some((ns, name)) => (ns, name),
            None => (pod_namespace, entry),
        };
        match check(key.0).and_then(|()| check(key.1)) {
            Ok(()) => {
                parsed.services.insert(format!("{}/{}", key.0, key.1));
            }
            Err(_) if parsed.errors.len() >= MAX_REPORTED_ERRORS => unreported += 1,
            Err(reason) => parsed
                .errors
                .push(format!("{ANNOTATION}[{i}]: {}: {reason}", quote(entry))),
        }
    }
    if unreported > 0 {
        parsed
            .errors
            .push(format!("{ANNOTATION}: {unreported} more malformed entries"));
    }
    parsed
}

/// Why a namespace or service name was refused (the entry or field is named by the caller).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BadName {
    #[error("empty namespace or name")]
    Empty,
    /// The name, quoted (bounded).
    #[error("{0} is longer than 63 characters")]
    TooLong(String),
    /// The name, quoted (bounded).
    #[error("{0} is not a DNS-1123 label (lowercase letters, digits and '-')")]
    NotALabel(String),
}

/// A DNS-1123 label: what namespaces and service names must be
/// ([`aether_common::names::dns_label`], the rule the registrar and mesh-dns check too).
pub fn check(label: &str) -> Result<(), BadName> {
    names::dns_label(label).map_err(|e| match e {
        LabelError::Empty => BadName::Empty,
        LabelError::TooLong(_) => BadName::TooLong(quote(label).to_string()),
        LabelError::NotALabel => BadName::NotALabel(quote(label).to_string()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bare_names_take_the_pod_namespace_and_duplicates_collapse() {
        let parsed = parse("shop", " cart, payments/api ,, cart ,shop/cart");
        assert_eq!(
            parsed.services.into_iter().collect::<Vec<_>>(),
            ["payments/api", "shop/cart"]
        );
        assert!(parsed.errors.is_empty());
    }

    #[test]
    fn a_bad_entry_is_reported_and_the_rest_kept() {
        let parsed = parse("shop", "cart, Bad_Name, a/b/c, /x, ok");
        assert_eq!(
            parsed.services.into_iter().collect::<Vec<_>>(),
            ["shop/cart", "shop/ok"]
        );
        assert_eq!(
            parsed.errors,
            [
                "config.aether.io/upstreams[1]: \"Bad_Name\": \"Bad_Name\" is not a DNS-1123 label (lowercase letters, digits and '-')",
                "config.aether.io/upstreams[2]: \"a/b/c\": \"b/c\" is not a DNS-1123 label (lowercase letters, digits and '-')",
                "config.aether.io/upstreams[3]: \"/x\": empty namespace or name",
            ]
        );
    }

    #[test]
    fn a_huge_annotation_gives_a_bounded_report() {
        let value = format!("ok, {}, {}", "Bad_".repeat(1 << 18), "x_,".repeat(100_000));
        let parsed = parse("shop", &value);
        assert_eq!(parsed.services.into_iter().collect::<Vec<_>>(), ["shop/ok"]);
        assert_eq!(parsed.errors.len(), MAX_REPORTED_ERRORS + 1);
        assert_eq!(
            parsed.errors[0],
            format!(
                "config.aether.io/upstreams[1]: {:?}… (1048576 bytes): {:?}… (1048576 bytes) is longer than 63 characters",
                &value[4..68],
                &value[4..68]
            )
        );
        assert_eq!(
            parsed.errors[MAX_REPORTED_ERRORS],
            format!(
                "config.aether.io/upstreams: {} more malformed entries",
                100_000 + 1 - MAX_REPORTED_ERRORS
            )
        );
        assert!(parsed.errors.iter().all(|e| e.len() < 1024));
    }

    proptest::proptest! {
        #[test]
        fn every_entry_is_either_a_valid_key_or_an_error(value in ".{0,200}") {
            let parsed = parse("ns", &value);
            for key in &parsed.services {
                let (ns, name) = key.split_once('/').unwrap();
                proptest::prop_assert!(check(ns).is_ok() && check(name).is_ok());
            }
            let entries = value.split(',').filter(|e| !e.trim().is_empty()).count();
            proptest::prop_assert!(parsed.services.len() + parsed.errors.len() <= entries);
        }
    }
}
