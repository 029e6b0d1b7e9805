//! `config.aether.io/upstreams`: the services a pod calls, e.g. `"cart, payments/api"`.
//!
//! Entries are comma-separated and trimmed; empty entries are dropped; a bare name
//! means the pod's own namespace; duplicates collapse. A malformed entry is reported
//! and skipped: the rest of the annotation still counts.

use std::collections::BTreeSet;

/// The annotation that declares a pod's upstreams.
pub const ANNOTATION: &str = "config.aether.io/upstreams";

/// Parsed upstreams: service keys `<ns>/<name>`, and the entries that were refused.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Upstreams {
    pub services: BTreeSet<String>,
    pub errors: Vec<String>,
}

pub fn parse(pod_namespace: &str, value: &str) -> Upstreams {
    let mut parsed = Upstreams::default();
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
            Err(reason) => parsed.errors.push(format!("{ANNOTATION}[{i}]: {entry:?}: {reason}")),
        }
    }
    parsed
}

/// A DNS-1123 label: what namespaces and service names must be.
pub fn check(label: &str) -> Result<(), String> {
    if label.is_empty() {
        return Err("empty namespace or name".into());
    }
    if label.len() > 63 {
        return Err(format!("{label:?} is longer than 63 characters"));
    }
    let ok = label
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !label.starts_with('-')
        && !label.ends_with('-');
    if !ok {
        return Err(format!(
            "{label:?} is not a DNS-1123 label (lowercase letters, digits and '-')"
        ));
    }
    Ok(())
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
