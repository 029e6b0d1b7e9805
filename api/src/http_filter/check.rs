//! The rules on single values, shared by the projector (on objects, YAML field paths) and
//! [`super::validate`] (on projected protos, proto field paths), so both refuse exactly the
//! same things. Each returns why a value is refused, in words that follow the field.

use std::net::IpAddr;
use std::ops::RangeInclusive;

use aether_common::quote::quote;
use aether_proto::registry::v1::AuthorizationRule;

/// The bounds of one filter: what Envoy accepts, narrowed to what a mesh needs, so one
/// object cannot bloat every node's Envoy.
pub mod limits {
    use std::ops::RangeInclusive;

    pub const TARGET_REFS: usize = 16;
    pub const ORDER: RangeInclusive<i64> = -1000..=1000;
    pub const TIMEOUT_MS: RangeInclusive<u32> = 1..=10_000;
    /// Envoy refuses a token bucket refilled more often than every 50 ms.
    pub const FILL_INTERVAL_MS: RangeInclusive<u32> = 50..=3_600_000;
    /// Body bytes buffered for a check: Envoy holds them per request.
    pub const MAX_REQUEST_BYTES: u32 = 1 << 20;
    pub const ALLOWED_HEADERS: usize = 64;
    pub const HEADER_RULES: usize = 32;
    pub const HOST_LEN: usize = 253;
    pub const HEADER_LEN: usize = 256;
    /// A metadata key or namespace.
    pub const METADATA_LEN: usize = 256;
    pub const PATH_PREFIX_LEN: usize = 1024;
}

/// The 4xx and 5xx codes of Envoy's `type.v3.StatusCode`: any other is a NACK (418
/// included), and a filter's refusal is never a success or a redirect.
const ERROR_STATUSES: [u32; 37] = [
    400, 401, 402, 403, 404, 405, 406, 407, 408, 409, 410, 411, 412, 413, 414, 415, 416, 417, 421, 422, 423, 424, 426,
    428, 429, 431, 500, 501, 502, 503, 504, 505, 506, 507, 508, 510, 511,
];

/// `spec.order`: within [`limits::ORDER`].
pub fn order(value: i64) -> Result<i32, String> {
    if limits::ORDER.contains(&value) {
        // Within ±1000: fits.
        return Ok(value as i32);
    }
    Err(format!("{value} is outside -1000 to 1000"))
}

/// A service address: a lower-case DNS name or an IP address, projected canonical
/// (`FD00::1` is `fd00::1`), so the agent's cluster name for it is one per address.
pub fn host(value: &str) -> Result<String, String> {
    if let Ok(address) = value.parse::<IpAddr>() {
        return Ok(address.to_string());
    }
    if crate::route::check::hostname(value).is_ok() {
        return Ok(value.to_owned());
    }
    Err(format!(
        "{} is not a lower-case DNS name (e.g. authz.shop.svc.cluster.local) or an IP address",
        quote(value)
    ))
}

/// A host as projected: valid and canonical.
pub fn canonical_host(value: &str) -> Result<(), String> {
    match host(value) {
        Ok(canonical) if canonical == value => Ok(()),
        Ok(canonical) => Err(format!("{} is not canonical ({canonical})", quote(value))),
        Err(e) => Err(e),
    }
}

/// A status a filter answers with: 4xx or 5xx, one Envoy knows.
pub fn status(value: i64) -> Result<u32, String> {
    match u32::try_from(value) {
        Ok(code) if ERROR_STATUSES.contains(&code) => Ok(code),
        _ => Err(format!(
            "{value} is not a 4xx or 5xx status Envoy answers with (e.g. 403, 429, 503)"
        )),
    }
}

/// A status as projected: 0 (the default) or [`status`].
pub fn status_or_default(value: u32) -> Result<(), String> {
    if value == 0 {
        Ok(())
    } else {
        status(i64::from(value)).map(drop)
    }
}

/// A request header name: a lower-case RFC 7230 token (HTTP/2 sends them lower-case, and
/// Envoy's matchers compare them so).
pub fn header(value: &str) -> Result<(), String> {
    let token = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit() || b"!#$%&'*+-.^_`|~".contains(&b);
    if !value.is_empty() && value.len() <= limits::HEADER_LEN && value.bytes().all(token) {
        return Ok(());
    }
    let hint = if value.bytes().any(|b| b.is_ascii_uppercase()) {
        " (write it lower-case)"
    } else {
        ""
    };
    Err(format!("{} is not a lower-case header name{hint}", quote(value)))
}

/// A dynamic metadata namespace or key: letters, digits, `.`, `_` and `-`.
pub fn metadata_name(value: &str) -> Result<(), String> {
    let allowed = |b: u8| b.is_ascii_alphanumeric() || b"._-".contains(&b);
    if !value.is_empty() && value.len() <= limits::METADATA_LEN && value.bytes().all(allowed) {
        return Ok(());
    }
    Err(format!(
        "{} is not a metadata name (1 to 256 letters, digits, '.', '_' or '-')",
        quote(value)
    ))
}

/// An HTTP check's path prefix: an absolute path without a trailing `/` (the checked
/// request's path, which starts with one, is appended to it).
pub fn path_prefix(value: &str) -> Result<(), String> {
    crate::route::check::path(value)?;
    if value.ends_with('/') {
        return Err(format!(
            "{} ends with '/': the request's path is appended as is, '/' included",
            quote(value)
        ));
    }
    Ok(())
}

/// A Gateway API duration (`200ms`, `1s`, `1m30s`) within `bounds`, in milliseconds.
pub fn duration_ms(text: &str, bounds: RangeInclusive<u32>) -> Result<u32, String> {
    let millis = crate::duration::parse_millis(text).map_err(|e| e.to_string())?;
    match u32::try_from(millis) {
        Ok(ms) if bounds.contains(&ms) => Ok(ms),
        _ => Err(format!("{} is outside {}", quote(text), range_text(&bounds))),
    }
}

/// A projected duration: within `bounds`.
pub fn millis(value: u32, bounds: RangeInclusive<u32>) -> Result<(), String> {
    if bounds.contains(&value) {
        return Ok(());
    }
    Err(format!("{value} ms is outside {}", range_text(&bounds)))
}

fn range_text(bounds: &RangeInclusive<u32>) -> String {
    let text = |ms: u32| match ms {
        _ if ms.is_multiple_of(3_600_000) => format!("{}h", ms / 3_600_000),
        _ if ms.is_multiple_of(1000) => format!("{}s", ms / 1000),
        _ => format!("{ms}ms"),
    };
    format!("{} to {}", text(*bounds.start()), text(*bounds.end()))
}

/// A token count: 1 to `u32::MAX` (Envoy's bucket refuses 0).
pub fn tokens(value: i64) -> Result<u32, String> {
    match u32::try_from(value) {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!("{value} is not a token count (1 to 4294967295)")),
    }
}

/// Body bytes sent with a check: 0 to [`limits::MAX_REQUEST_BYTES`].
pub fn max_request_bytes(value: i64) -> Result<u32, String> {
    match u32::try_from(value) {
        Ok(n) if n <= limits::MAX_REQUEST_BYTES => Ok(n),
        _ => Err(format!("{value} is outside 0 to 1048576 (1 MiB)")),
    }
}

/// Why an rbac filter's rule may not name ports.
pub const PORTS_IN_RULES: &str = "names ports, which an HTTPFilter cannot match (it does not know the app port a \
     request is for, and on the callers' side there is none): ports are an AuthorizationPolicy's";

pub const IDENTITY_OFF_INBOUND: &str = "names callers by identity, which only an Inbound filter can judge (on the \
     callers' side the request comes from the local app, which presents no certificate)";

/// The first source of `rules` that names callers by identity: its rule, its index in
/// `from`, and the field (proto name; `yaml` gives the YAML one).
pub fn identity_in_rules(rules: &[AuthorizationRule]) -> Option<(usize, usize, &'static str)> {
    rules.iter().enumerate().find_map(|(i, rule)| {
        rule.from.iter().enumerate().find_map(|(j, s)| {
            let fields = [
                ("principals", s.principals.is_empty()),
                ("not_principals", s.not_principals.is_empty()),
                ("service_accounts", s.service_accounts.is_empty()),
                ("not_service_accounts", s.not_service_accounts.is_empty()),
                ("namespaces", s.namespaces.is_empty()),
                ("not_namespaces", s.not_namespaces.is_empty()),
            ];
            let named = fields.into_iter().find(|(_, empty)| !empty);
            named.map(|(field, _)| (i, j, field))
        })
    })
}

/// A proto field name of a source in the YAML's camelCase.
pub fn yaml_name(field: &str) -> String {
    let mut out = String::new();
    let mut upper = false;
    for c in field.chars() {
        match (c, upper) {
            ('_', _) => upper = true,
            (c, true) => {
                out.push(c.to_ascii_uppercase());
                upper = false;
            }
            (c, false) => out.push(c),
        }
    }
    out
}

/// The first operation of `rules` that names ports: its rule, its index in `to`, and
/// whether it is `not_ports`.
pub fn ports_in_rules(rules: &[AuthorizationRule]) -> Option<(usize, usize, bool)> {
    rules.iter().enumerate().find_map(|(i, rule)| {
        (rule.to.iter().enumerate()).find_map(|(j, to)| match (to.ports.is_empty(), to.not_ports.is_empty()) {
            (true, true) => None,
            (ports_empty, _) => Some((i, j, ports_empty)),
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_are_dns_names_or_canonical_addresses() {
        assert_eq!(
            host("authz.shop.svc.cluster.local").as_deref(),
            Ok("authz.shop.svc.cluster.local")
        );
        assert_eq!(host("FD00::1").as_deref(), Ok("fd00::1"));
        assert_eq!(host("10.0.0.1").as_deref(), Ok("10.0.0.1"));
        for bad in ["Authz.shop", "authz:9000", "", "a..b", "[fd00::1]", "http://authz"] {
            assert!(host(bad).is_err(), "{bad}");
        }
        assert!(canonical_host("FD00::1").unwrap_err().contains("fd00::1"));
        assert_eq!(canonical_host("fd00::1"), Ok(()));
    }

    #[test]
    fn statuses_are_the_error_codes_envoy_knows() {
        assert_eq!(status(403), Ok(403));
        assert_eq!(status(511), Ok(511));
        for bad in [0, 200, 302, 418, 430, 509, 600, -403] {
            assert!(status(bad).is_err(), "{bad}");
        }
        assert_eq!(status_or_default(0), Ok(()));
        assert!(status_or_default(418).is_err());
    }

    #[test]
    fn durations_are_bounded_and_say_their_bounds() {
        assert_eq!(duration_ms("200ms", limits::TIMEOUT_MS), Ok(200));
        assert_eq!(duration_ms("1m30s", limits::FILL_INTERVAL_MS), Ok(90_000));
        assert_eq!(
            duration_ms("11s", limits::TIMEOUT_MS),
            Err("\"11s\" is outside 1ms to 10s".to_owned())
        );
        assert!(
            duration_ms("10ms", limits::FILL_INTERVAL_MS)
                .unwrap_err()
                .contains("50ms to 1h")
        );
        assert!(
            duration_ms("1.5s", limits::TIMEOUT_MS)
                .unwrap_err()
                .contains("Gateway API duration")
        );
        assert!(duration_ms("99999h", limits::FILL_INTERVAL_MS).is_err());
        assert!(millis(0, limits::TIMEOUT_MS).is_err() && millis(10_000, limits::TIMEOUT_MS).is_ok());
    }

    #[test]
    fn headers_metadata_prefixes_and_counts() {
        assert_eq!(header("x-tenant"), Ok(()));
        assert!(header("X-Tenant").unwrap_err().contains("lower-case"));
        assert!(header(":path").is_err() && header("").is_err() && header("a b").is_err());
        assert_eq!(metadata_name("aether.tenant"), Ok(()));
        assert!(metadata_name("a/b").is_err() && metadata_name("").is_err());
        assert_eq!(path_prefix("/check"), Ok(()));
        assert!(path_prefix("/check/").unwrap_err().contains("ends with '/'"));
        assert!(path_prefix("check").is_err());
        assert_eq!((tokens(1), tokens(4_294_967_295)), (Ok(1), Ok(u32::MAX)));
        assert!(tokens(0).is_err() && tokens(1 << 32).is_err());
        assert_eq!(max_request_bytes(1 << 20), Ok(1 << 20));
        assert!(max_request_bytes((1 << 20) + 1).is_err() && max_request_bytes(-1).is_err());
        assert_eq!((order(-1000), order(1000)), (Ok(-1000), Ok(1000)));
        assert!(order(1001).is_err());
    }
}
