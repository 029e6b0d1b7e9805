//! The rules on single values, shared by the projector (on objects, YAML field paths) and
//! [`super::validate`] (on projected protos, proto field paths), so both refuse exactly
//! the same things. Each returns why a value is refused, in words that follow the field.

use std::net::IpAddr;

use aether_common::names::dns_label;
use aether_common::quote::quote;
use aether_proto::registry::v1::{AuthorizationPattern, PatternKind};
use ipnet::IpNet;

/// The bounds that keep one policy from bloating every node's Envoy: a policy compiles
/// to one RBAC policy per rule, each matcher an Envoy matcher.
pub mod limits {
    pub const RULES: usize = 64;
    pub const FROM_PER_RULE: usize = 16;
    pub const TO_PER_RULE: usize = 16;
    /// Values in one list (`principals`, `notPaths`, …).
    pub const VALUES: usize = 64;
    pub const TARGET_REFS: usize = 16;
    pub const LABELS: usize = 32;
    /// The SPIFFE specification's own bound on an ID.
    pub const PRINCIPAL_LEN: usize = 2048;
    pub const PATH_LEN: usize = 1024;
    /// A DNS name and a `:port`.
    pub const HOST_LEN: usize = 253 + 6;
    pub const METHOD_LEN: usize = 32;
    pub const LABEL_VALUE_LEN: usize = 63;
    pub const LABEL_KEY_LEN: usize = 253 + 1 + 63;
}

/// A pattern as written: `*` any, `x*` prefix, `*x` suffix, else exact. A `*` anywhere
/// else (or two) is refused: Envoy's string matchers have no glob.
pub fn pattern(text: &str) -> Result<AuthorizationPattern, String> {
    let (kind, value) = match text {
        "*" => (PatternKind::Any, ""),
        _ if text.len() > 1 && text.ends_with('*') => (PatternKind::Prefix, &text[..text.len() - 1]),
        _ if text.len() > 1 && text.starts_with('*') => (PatternKind::Suffix, &text[1..]),
        _ => (PatternKind::Exact, text),
    };
    if value.contains('*') {
        return Err(format!(
            "{} has a '*' inside: only one, as the first or the last character",
            quote(text)
        ));
    }
    if text.is_empty() {
        return Err("is empty".to_owned());
    }
    Ok(AuthorizationPattern {
        kind: kind.into(),
        value: value.to_owned(),
    })
}

/// A principal pattern: a SPIFFE ID (`spiffe://<trust domain>/<path>`), or a part of one.
pub fn principal(p: &AuthorizationPattern) -> Result<(), String> {
    let value = p.value.as_str();
    if value.len() > limits::PRINCIPAL_LEN {
        return Err(format!("{} is longer than 2048 bytes", quote(value)));
    }
    let ok = match p.kind() {
        PatternKind::Any => true,
        PatternKind::Exact => spiffe_id(value),
        // A prefix is an ID cut short, so its characters are an ID's.
        PatternKind::Prefix => value.starts_with("spiffe://") && spiffe_chars(&value["spiffe://".len()..]),
        PatternKind::Suffix => spiffe_chars(value),
        PatternKind::Unspecified => false,
    };
    if ok {
        return Ok(());
    }
    Err(format!(
        "{} is not a SPIFFE ID (spiffe://<trust domain>/<path>), a prefix of one ending in '*', \
         a suffix starting with '*', or '*'",
        quote(&p.to_text())
    ))
}

/// `spiffe://<trust domain>/<path>`: a lower-case trust domain, a path of non-empty
/// segments that are not `.` or `..`, no query or fragment.
fn spiffe_id(value: &str) -> bool {
    let Some(rest) = value.strip_prefix("spiffe://") else {
        return false;
    };
    let (domain, path) = rest.split_once('/').unwrap_or((rest, ""));
    let domain_ok = !domain.is_empty()
        && domain
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-._".contains(&b));
    let segment_ok = |s: &str| !s.is_empty() && s != "." && s != ".." && spiffe_chars(s);
    domain_ok && (path.is_empty() && !rest.ends_with('/') || path.split('/').all(segment_ok))
}

/// The characters of a SPIFFE ID's path, and `/`.
fn spiffe_chars(value: &str) -> bool {
    value
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"-._/:".contains(&b))
}

/// `<namespace>/<service account>`: a namespace label and a service account name.
pub fn service_account(value: &str) -> Result<(), String> {
    match value.split_once('/') {
        Some((namespace, account)) if dns_label(namespace).is_ok() && subdomain(account) => Ok(()),
        _ => Err(format!(
            "{} is not <namespace>/<service account> (use principals for patterns)",
            quote(value)
        )),
    }
}

fn subdomain(value: &str) -> bool {
    !value.is_empty() && value.len() <= 253 && value.split('.').all(|l| dns_label(l).is_ok())
}

/// A namespace: a DNS label, exact.
pub fn namespace(value: &str) -> Result<(), String> {
    dns_label(value).map_err(|e| format!("{} {e} (namespaces are exact names)", quote(value)))
}

/// A CIDR or an address, projected to the canonical CIDR (an address is a /32 or /128).
/// Host bits set are refused: `10.0.0.1/8` is more likely a typo than a wish for /8.
pub fn ip_block(value: &str) -> Result<String, String> {
    let net = match value.parse::<IpNet>() {
        Ok(net) => net,
        Err(_) => match value.parse::<IpAddr>() {
            Ok(address) => IpNet::from(address),
            Err(_) => {
                return Err(format!(
                    "{} is not a CIDR (e.g. 10.1.0.0/16) or an address",
                    quote(value)
                ));
            }
        },
    };
    if net.trunc() != net {
        return Err(format!(
            "{} has host bits set: did you mean {}?",
            quote(value),
            net.trunc()
        ));
    }
    Ok(net.to_string())
}

/// A canonical CIDR, as projected.
pub fn canonical_ip_block(value: &str) -> Result<(), String> {
    match ip_block(value) {
        Ok(canonical) if canonical == value => Ok(()),
        Ok(canonical) => Err(format!("{} is not canonical ({canonical})", quote(value))),
        Err(e) => Err(e),
    }
}

/// A port: 1..=65535.
pub fn port(value: i64) -> Result<u32, String> {
    match u16::try_from(value) {
        Ok(port) if port > 0 => Ok(u32::from(port)),
        _ => Err(format!("{value} is not a port (1 to 65535)")),
    }
}

/// An HTTP method: an upper-case token, matched exactly.
pub fn method(value: &str) -> Result<(), String> {
    let token = |b: u8| b.is_ascii_uppercase() || b == b'-' || b == b'_';
    if !value.is_empty() && value.len() <= limits::METHOD_LEN && value.bytes().all(token) {
        return Ok(());
    }
    let hint = if value.bytes().any(|b| b.is_ascii_lowercase()) {
        " (methods are upper-case, e.g. GET)"
    } else {
        ""
    };
    Err(format!("{} is not an HTTP method{hint}", quote(value)))
}

/// A path pattern: `/exact`, `/prefix*`, `*suffix` or `*`; no query, fragment, space or
/// control character (Envoy's url_path sees the path without its query).
pub fn path(p: &AuthorizationPattern) -> Result<(), String> {
    let value = p.value.as_str();
    let text = p.to_text();
    if value.len() > limits::PATH_LEN {
        return Err(format!("{} is longer than 1024 bytes", quote(&text)));
    }
    let absolute = matches!(p.kind(), PatternKind::Exact | PatternKind::Prefix);
    if absolute && !value.starts_with('/') {
        return Err(format!("{} must start with '/' (or be '*' or '*suffix')", quote(&text)));
    }
    let allowed = |b: u8| b.is_ascii_graphic() && !b"?#".contains(&b);
    if p.kind() == PatternKind::Unspecified || !value.bytes().all(allowed) {
        return Err(format!(
            "{} holds a query, a fragment, a space or a character a path cannot",
            quote(&text)
        ));
    }
    Ok(())
}

/// A host pattern: a lower-case DNS name (optionally `:port`), `*.suffix`, `prefix.*` or
/// `*`. Projected lower-case, since hosts compare without case.
pub fn host(p: &AuthorizationPattern) -> Result<(), String> {
    let value = p.value.as_str();
    let allowed = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-.:[]".contains(&b);
    let ok = p.kind() != PatternKind::Unspecified && value.len() <= limits::HOST_LEN && value.bytes().all(allowed);
    if ok {
        return Ok(());
    }
    Err(format!(
        "{} is not a lower-case host name, '*.suffix', 'prefix.*' or '*'",
        quote(&p.to_text())
    ))
}

/// A label key (`[prefix/]name`) and value, as Kubernetes allows them.
pub fn label(key: &str, value: &str) -> Result<(), String> {
    let (prefix, name) = key.rsplit_once('/').unwrap_or(("", key));
    let name_ok = |s: &str| {
        !s.is_empty()
            && s.len() <= limits::LABEL_VALUE_LEN
            && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
            && s.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
            && s.bytes().last().is_some_and(|b| b.is_ascii_alphanumeric())
    };
    if key.len() > limits::LABEL_KEY_LEN || !name_ok(name) || !(prefix.is_empty() || subdomain(prefix)) {
        return Err(format!("{} is not a label key", quote(key)));
    }
    if !(value.is_empty() || name_ok(value)) {
        return Err(format!("{} is not a label value", quote(value)));
    }
    Ok(())
}

/// How a pattern is written in a policy, for messages.
pub trait PatternText {
    fn to_text(&self) -> String;
}

impl PatternText for AuthorizationPattern {
    fn to_text(&self) -> String {
        match self.kind() {
            PatternKind::Any => "*".to_owned(),
            PatternKind::Prefix => format!("{}*", self.value),
            PatternKind::Suffix => format!("*{}", self.value),
            PatternKind::Exact | PatternKind::Unspecified => self.value.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pat(text: &str) -> AuthorizationPattern {
        pattern(text).unwrap()
    }

    #[test]
    fn patterns_have_one_star_at_an_end() {
        assert_eq!(pat("*").kind(), PatternKind::Any);
        assert_eq!(
            (pat("/a*").kind(), pat("/a*").value.as_str()),
            (PatternKind::Prefix, "/a")
        );
        assert_eq!(
            (pat("*.x").kind(), pat("*.x").value.as_str()),
            (PatternKind::Suffix, ".x")
        );
        assert_eq!(pat("/a").kind(), PatternKind::Exact);
        for bad in ["**", "/a*b", "*a*", "a**", ""] {
            assert!(pattern(bad).is_err(), "{bad}");
        }
        for text in ["*", "/a*", "*.x", "/a"] {
            assert_eq!(pat(text).to_text(), text);
        }
    }

    #[test]
    fn principals_are_spiffe_ids_or_parts_of_them() {
        for ok in [
            "spiffe://cluster.local/ns/a/sa/b",
            "spiffe://td",
            "spiffe://cluster.local/ns/a/*",
            "*/sa/b",
            "*",
        ] {
            assert_eq!(principal(&pat(ok)), Ok(()), "{ok}");
        }
        for bad in [
            "cluster.local/ns/a/sa/b",
            "spiffe://TD/x",
            "spiffe://td/a//b",
            "spiffe://td/a/../b",
            "spiffe://td/",
            "spiffe://td/a?b",
            "http://td/*",
            "*/sa/b c",
        ] {
            assert!(principal(&pat(bad)).is_err(), "{bad}");
        }
    }

    #[test]
    fn ip_blocks_are_canonical_cidrs() {
        assert_eq!(ip_block("10.1.0.0/16"), Ok("10.1.0.0/16".to_owned()));
        assert_eq!(ip_block("10.1.2.3"), Ok("10.1.2.3/32".to_owned()));
        assert_eq!(ip_block("fd00::/8"), Ok("fd00::/8".to_owned()));
        assert!(ip_block("10.0.0.1/8").unwrap_err().contains("did you mean 10.0.0.0/8"));
        assert!(ip_block("10.0.0.0/33").is_err() && ip_block("ten").is_err());
        assert!(canonical_ip_block("10.1.2.3").is_err());
    }

    #[test]
    fn methods_paths_hosts_ports_labels() {
        assert_eq!(method("GET"), Ok(()));
        assert!(method("get").unwrap_err().contains("upper-case"));
        assert!(method("G ET").is_err() && method("").is_err());
        for ok in ["/", "/a/b", "/a*", "*.json", "*"] {
            assert_eq!(path(&pat(ok)), Ok(()), "{ok}");
        }
        for bad in ["a", "a*", "/a?x=1", "/a#f", "/a b"] {
            assert!(path(&pat(bad)).is_err(), "{bad}");
        }
        assert_eq!(host(&pat("*.example.com")), Ok(()));
        assert_eq!(host(&pat("api.local:8080")), Ok(()));
        assert!(host(&pat("Api.local")).is_err() && host(&pat("a b")).is_err());
        assert_eq!(port(65535), Ok(65535));
        assert!(port(0).is_err() && port(65536).is_err());
        assert_eq!(label("app.kubernetes.io/name", "web"), Ok(()));
        assert_eq!(label("app", ""), Ok(()));
        assert!(label("-app", "x").is_err() && label("app", "a b").is_err());
        assert_eq!(service_account("shop/cart-sa"), Ok(()));
        assert!(service_account("shop").is_err() && service_account("shop/*").is_err());
    }
}
