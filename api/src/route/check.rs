//! The rules on single values, shared by the projector (on objects) and [`super::validate`]
//! (on projected protos), so both refuse exactly the same things. Each returns why a value
//! is refused, in words that follow the field's name.

use aether_common::names::dns_label;
use aether_common::quote::{clip, quote};

/// The bounds that keep one object from bloating every node's Envoy. The list sizes are the
/// Gateway API's own (its CRD refuses more), so the YAML source agrees with Kubernetes.
pub mod limits {
    pub const PARENTS: usize = 32;
    pub const RULES: usize = 16;
    pub const MATCHES_PER_RULE: usize = 64;
    pub const MATCHES_PER_ROUTE: usize = 128;
    pub const VALUE_MATCHES: usize = 16;
    pub const FILTERS: usize = 16;
    pub const BACKENDS: usize = 16;
    pub const HEADER_EDITS: usize = 16;
    pub const RETRY_CODES: usize = 32;
    pub const RETRY_ATTEMPTS: u32 = 10;
    pub const WEIGHT: u32 = 1_000_000;
    pub const PATH_LEN: usize = 1024;
    pub const HEADER_NAME_LEN: usize = 256;
    pub const HEADER_VALUE_LEN: usize = 4096;
    pub const QUERY_VALUE_LEN: usize = 1024;
    pub const HOSTNAME_LEN: usize = 253;
    pub const HOSTNAMES: usize = 16;
}

pub const METHODS: [&str; 9] = [
    "GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH",
];
pub const REDIRECT_CODES: [u32; 5] = [301, 302, 303, 307, 308];

/// A Kubernetes object name or rule name: a DNS-1123 subdomain (labels joined by dots).
pub fn subdomain(value: &str) -> Result<(), String> {
    if value.len() > limits::HOSTNAME_LEN {
        return Err(format!("is {} characters long (at most 253)", value.len()));
    }
    match value.split('.').try_for_each(dns_label) {
        Ok(()) => Ok(()),
        Err(_) => Err(format!(
            "{} must be a DNS-1123 subdomain (lowercase letters, digits, '-' and '.')",
            quote(value)
        )),
    }
}

/// A namespace or service name: a DNS-1123 label.
pub fn label(value: &str) -> Result<(), String> {
    dns_label(value).map_err(|e| format!("{} {e}", quote(value)))
}

/// A service key `<namespace>/<name>`.
pub fn service_key(key: &str) -> Result<(), String> {
    match key.split_once('/') {
        Some((namespace, name)) if dns_label(namespace).is_ok() && dns_label(name).is_ok() => Ok(()),
        _ => Err(format!("{} is not a service key <namespace>/<name>", quote(key))),
    }
}

/// A port: 1..=65535 when set.
pub fn port(value: i32) -> Result<u32, String> {
    match u16::try_from(value) {
        Ok(port) if port > 0 => Ok(u32::from(port)),
        _ => Err(format!("{value} is not a port (1 to 65535)")),
    }
}

/// An HTTP header name (RFC 7230 token); the projection stores it lower-cased.
pub fn header_name(name: &str) -> Result<(), String> {
    let token = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
    if name.is_empty() || name.len() > limits::HEADER_NAME_LEN || !name.bytes().all(token) {
        return Err(format!(
            "{} is not an HTTP header name (RFC 7230 token, at most 256)",
            quote(name)
        ));
    }
    Ok(())
}

/// A header a filter may set, add or remove: Envoy refuses to touch `host` (and
/// pseudo-headers, which are not tokens): the rewrite filter's hostname does that.
pub fn modifiable_header(name: &str) -> Result<(), String> {
    header_name(name)?;
    if name.eq_ignore_ascii_case("host") {
        return Err("\"host\" cannot be modified by a header filter (use URLRewrite's hostname)".to_owned());
    }
    Ok(())
}

/// A header value: no control characters but tab (Envoy refuses CR, LF and NUL).
pub fn header_value(value: &str, max: usize) -> Result<(), String> {
    if value.is_empty() || value.len() > max {
        return Err(format!("{} must be 1 to {max} bytes", quote(value)));
    }
    if value.chars().any(|c| c.is_control() && c != '\t') {
        return Err(format!("{} holds control characters", quote(value)));
    }
    Ok(())
}

/// An Exact or PathPrefix path (the Gateway API's rules): absolute, no empty, `.` or `..`
/// segment, no encoded slash, no fragment, only URI path characters.
pub fn path(value: &str) -> Result<(), String> {
    let quoted = quote(value);
    if !value.starts_with('/') {
        return Err(format!("{quoted} must start with '/'"));
    }
    if value.len() > limits::PATH_LEN {
        return Err(format!("{quoted} is longer than 1024 bytes"));
    }
    let bad = ["//", "/./", "/../", "%2f", "%2F", "#"]
        .into_iter()
        .find(|bad| value.contains(bad));
    if let Some(bad) = bad {
        return Err(format!("{quoted} must not contain {bad:?}"));
    }
    if value.ends_with("/..") || value.ends_with("/.") {
        return Err(format!("{quoted} must not end with a '.' or '..' segment"));
    }
    let allowed = |b: u8| b.is_ascii_alphanumeric() || b"-/._~!$&'()*+,;=:@%".contains(&b);
    if !value.bytes().all(allowed) || !percent_escapes_are_whole(value) {
        return Err(format!(
            "{quoted} holds characters a URI path cannot (escape them as %XX)"
        ));
    }
    Ok(())
}

fn percent_escapes_are_whole(value: &str) -> bool {
    let b = value.as_bytes();
    b.iter()
        .enumerate()
        .filter(|(_, c)| **c == b'%')
        .all(|(i, _)| b.len() > i + 2 && b[i + 1].is_ascii_hexdigit() && b[i + 2].is_ascii_hexdigit())
}

/// A path written by a redirect or rewrite: empty is allowed for a prefix replacement
/// (Gateway API: "/foo/bar" with prefix "/foo" and "" becomes "/bar").
pub fn replacement_path(value: &str, empty_allowed: bool) -> Result<(), String> {
    if value.is_empty() && empty_allowed {
        return Ok(());
    }
    path(value)
}

/// A TLS server name a route takes: a hostname, or `*.` and a hostname (the API's
/// wildcard, one leading label); never an IP literal.
pub fn server_name(value: &str) -> Result<(), String> {
    let name = value.strip_prefix("*.").unwrap_or(value);
    let not_ip = name.parse::<std::net::IpAddr>().is_err();
    match subdomain(name) {
        Ok(()) if not_ip && name.contains('.') => Ok(()),
        _ => Err(format!(
            "{} is not a server name (a lowercase DNS name with a dot, or *. and one)",
            quote(value)
        )),
    }
}

/// A hostname a redirect or rewrite writes (PreciseHostname: no wildcard, no IP literal).
pub fn hostname(value: &str) -> Result<(), String> {
    subdomain(value).map_err(|_| format!("{} is not a hostname (lowercase DNS name)", quote(value)))
}

/// A regular expression in RE2 syntax, which Envoy's safe_regex uses. Compiled with the
/// `regex` crate, whose syntax is RE2's plus a few extensions RE2 lacks; those are refused
/// so Envoy never receives what it cannot compile.
pub fn regex(pattern: &str) -> Result<(), String> {
    if pattern.len() > limits::PATH_LEN {
        return Err(format!("{} is longer than 1024 bytes", quote(pattern)));
    }
    // Class set operations and the \< \> \b{…} boundaries are not RE2.
    if let Some(ext) = ["&&", "--", "~~", "\\<", "\\>", "\\b{", "\\B{"]
        .into_iter()
        .find(|e| pattern.contains(e))
    {
        return Err(format!(
            "{} uses {ext:?}, which RE2 (Envoy's regex engine) does not support",
            quote(pattern)
        ));
    }
    regex::RegexBuilder::new(pattern)
        .size_limit(1 << 20)
        .build()
        .map(drop)
        .map_err(|e| {
            format!(
                "{} is not a valid RE2 regular expression: {}",
                quote(pattern),
                clip(&e.to_string())
            )
        })
}

/// An exact gRPC service name: `pkg.Service`, dot-separated identifiers.
pub fn grpc_service(value: &str) -> Result<(), String> {
    let trimmed = value.strip_prefix('.').unwrap_or(value);
    if trimmed.split('.').all(identifier) {
        return Ok(());
    }
    Err(format!(
        "{} is not a gRPC service name (e.g. helloworld.Greeter)",
        quote(value)
    ))
}

/// An exact gRPC method name: an identifier.
pub fn grpc_method(value: &str) -> Result<(), String> {
    if identifier(value) {
        return Ok(());
    }
    Err(format!(
        "{} is not a gRPC method name (letters, digits, '_')",
        quote(value)
    ))
}

fn identifier(value: &str) -> bool {
    let mut bytes = value.bytes();
    bytes.next().is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
        && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_follow_the_gateway_api_rules() {
        for ok in ["/", "/foo", "/foo/bar.baz", "/a%20b", "/~user/@x:y"] {
            assert_eq!(path(ok), Ok(()), "{ok}");
        }
        for bad in [
            "foo", "//", "/a//b", "/a/./b", "/a/../b", "/a%2fb", "/a#b", "/a/..", "/a/.", "/a b", "/%zz", "/%",
        ] {
            assert!(path(bad).is_err(), "{bad}");
        }
        assert_eq!(replacement_path("", true), Ok(()));
        assert!(replacement_path("", false).is_err());
    }

    #[test]
    fn regexes_outside_re2_are_refused() {
        assert_eq!(regex("^/v[0-9]+/.*$"), Ok(()));
        assert!(regex("(").unwrap_err().contains("not a valid RE2 regular expression"));
        assert!(regex("[a-z&&[^x]]").unwrap_err().contains("RE2"));
        assert!(regex("\\<word\\>").unwrap_err().contains("RE2"));
    }

    #[test]
    fn names_and_keys() {
        assert_eq!(subdomain("a.b-c"), Ok(()));
        assert!(subdomain("A").is_err());
        assert_eq!(service_key("ns/svc"), Ok(()));
        for bad in ["ns", "ns/", "/svc", "ns/svc/x", "NS/svc"] {
            assert!(service_key(bad).is_err(), "{bad}");
        }
        assert_eq!(port(8080), Ok(8080));
        assert!(port(0).is_err() && port(65536).is_err() && port(-1).is_err());
        assert!(modifiable_header("Host").is_err());
        assert!(header_name("x:y").is_err());
        assert!(header_value("a\r\nb", 10).is_err());
        assert_eq!(grpc_service("helloworld.Greeter"), Ok(()));
        assert!(grpc_service("hello..x").is_err());
        assert!(grpc_method("1x").is_err());
    }
}
