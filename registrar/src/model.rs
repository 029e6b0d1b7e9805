//! The catalog's data model and the validation every request and every stored
//! record goes through. Errors name the offending field, so a caller can fix it.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;

use aether_common::names::dns_label;
use aether_common::quote::quote;
use aether_proto::registry::v1::{Endpoint, Health, Port, Protocol};

/// Limits that keep one endpoint from bloating every watcher's stream.
pub const MAX_PORTS: usize = 64;
pub const MAX_METADATA_ENTRIES: usize = 64;
pub const MAX_METADATA_BYTES: usize = 16 * 1024;
pub const MAX_METADATA_KEY_BYTES: usize = 253;
pub const MAX_LABEL_BYTES: usize = 253;
pub const MAX_WEIGHT: u32 = 65_535;
/// The longest valid service key: two DNS labels and the slash.
pub const MAX_SERVICE_KEY_BYTES: usize = 63 + 1 + 63;
/// Every [`InvalidField`] message fits in this, whatever the input: values are quoted
/// with [`quote`] (a short prefix and the size), so a status carrying one stays far
/// below gRPC clients' 16 KiB metadata limit.
pub const MAX_ERROR_BYTES: usize = 1024;

/// A validated service key, `<namespace>/<name>`, both parts DNS-1123 labels (they
/// become `<name>.<namespace>.<meshDomain>`). Shared, since every change and index
/// entry of a service carries it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServiceKey(Arc<str>);

impl ServiceKey {
    /// Parses `<namespace>/<name>`; `field` names the request field in the error.
    pub fn parse(field: &str, key: &str) -> Result<Self, InvalidField> {
        let invalid = |reason: String| InvalidField::new(field, format!("{}: {reason}", quote(key)));
        if key.is_empty() {
            return Err(InvalidField::new(field, "must be set to \"<namespace>/<name>\""));
        }
        let Some((namespace, name)) = key.split_once('/') else {
            return Err(invalid("expected \"<namespace>/<name>\"".into()));
        };
        dns_label(namespace).map_err(|r| invalid(format!("namespace {r}")))?;
        dns_label(name).map_err(|r| invalid(format!("name {r}")))?;
        Ok(Self(key.into()))
    }

    /// The key a configuration record's change is published under (see
    /// `catalog::KeyedChange`): the record's own key, which may not be a service key's
    /// shape. Never looked up as a service: watchers select records by what they hold.
    pub fn of_config(key: &str) -> Self {
        Self(key.into())
    }

    pub fn from_parts(field: &str, namespace: &str, name: &str) -> Result<Self, InvalidField> {
        Self::parse(field, &format!("{namespace}/{name}"))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn namespace(&self) -> &str {
        self.0.split_once('/').map_or("", |(ns, _)| ns)
    }

    pub fn name(&self) -> &str {
        self.0.split_once('/').map_or("", |(_, name)| name)
    }
}

impl fmt::Display for ServiceKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::borrow::Borrow<str> for ServiceKey {
    fn borrow(&self) -> &str {
        &self.0
    }
}

/// A request or record field that failed validation, e.g.
/// `endpoint.ports[1].port: 70000 is out of range (1..=65535)`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct InvalidField {
    pub field: String,
    pub reason: String,
}

impl InvalidField {
    pub fn new(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

impl From<InvalidField> for tonic::Status {
    fn from(e: InvalidField) -> Self {
        tonic::Status::invalid_argument(e.to_string())
    }
}

/// Parses a pod address; the canonical text form is what the catalog stores.
pub fn parse_address(field: &str, address: &str) -> Result<IpAddr, InvalidField> {
    if address.is_empty() {
        return Err(InvalidField::new(field, "must be set to the pod's IP address"));
    }
    let ip: IpAddr = address
        .parse()
        .map_err(|_| InvalidField::new(field, format!("{} is not an IP address", quote(address))))?;
    if ip.is_unspecified() || ip.is_loopback() || ip.is_multicast() {
        return Err(InvalidField::new(
            field,
            format!("{} is not a unicast pod address", quote(address)),
        ));
    }
    Ok(ip)
}

/// An endpoint that passed validation, in canonical form (address text normalised,
/// weight 0 → 1, health UNSPECIFIED → HEALTHY), with its parsed key parts.
#[derive(Clone, Debug, PartialEq)]
pub struct ValidEndpoint {
    pub service: ServiceKey,
    pub address: IpAddr,
    pub endpoint: Endpoint,
}

/// Validates an endpoint; `field` is the path of the endpoint in the request
/// (`endpoint` for RegisterEndpoint, a record key for stored data).
pub fn validate_endpoint(field: &str, endpoint: Option<Endpoint>) -> Result<ValidEndpoint, InvalidField> {
    let Some(mut ep) = endpoint else {
        return Err(InvalidField::new(field, "must be set"));
    };
    let service = ServiceKey::parse(&format!("{field}.service"), &ep.service)?;
    let address = parse_address(&format!("{field}.address"), &ep.address)?;
    ep.address = address.to_string();
    check_ports(field, &ep.ports)?;
    // A canonical port order keeps equal registrations byte-identical.
    ep.ports.sort_by_key(|p| p.port);
    ep.weight = check_weight(field, ep.weight)?;
    ep.health = check_health(field, ep.health)?;
    check_placement(field, &ep)?;
    check_metadata(field, &ep.metadata)?;
    Ok(ValidEndpoint {
        service,
        address,
        endpoint: ep,
    })
}

/// At least one and at most [`MAX_PORTS`] ports, each valid, no number or name twice.
fn check_ports(field: &str, ports: &[Port]) -> Result<(), InvalidField> {
    if ports.is_empty() {
        return Err(InvalidField::new(
            format!("{field}.ports"),
            "at least one port is required",
        ));
    }
    if ports.len() > MAX_PORTS {
        return Err(InvalidField::new(
            format!("{field}.ports"),
            format!("{} ports (at most {MAX_PORTS})", ports.len()),
        ));
    }
    let mut numbers = HashSet::new();
    let mut names = HashSet::new();
    for (i, port) in ports.iter().enumerate() {
        let at = format!("{field}.ports[{i}]");
        if port.port == 0 || port.port > 65_535 {
            return Err(InvalidField::new(
                format!("{at}.port"),
                format!("{} is out of range (1..=65535)", port.port),
            ));
        }
        if !numbers.insert(port.port) {
            return Err(InvalidField::new(
                format!("{at}.port"),
                format!("{} is listed twice", port.port),
            ));
        }
        check_protocol(&at, port.protocol)?;
        if !port.name.is_empty() {
            check_port_name(&at, &port.name)?;
            if !names.insert(port.name.as_str()) {
                return Err(InvalidField::new(
                    format!("{at}.name"),
                    format!("{} is listed twice", quote(&port.name)),
                ));
            }
        }
    }
    Ok(())
}

/// A known protocol, set; `at` is the port's path.
fn check_protocol(at: &str, protocol: i32) -> Result<(), InvalidField> {
    match Protocol::try_from(protocol) {
        Ok(Protocol::Unspecified) => Err(InvalidField::new(
            format!("{at}.protocol"),
            "must be set (TCP, HTTP, HTTP2 or GRPC)",
        )),
        Ok(_) => Ok(()),
        Err(_) => Err(InvalidField::new(
            format!("{at}.protocol"),
            format!("unknown protocol {protocol}"),
        )),
    }
}

/// A port name is a DNS label of at most 15 characters (as in Kubernetes).
fn check_port_name(at: &str, name: &str) -> Result<(), InvalidField> {
    dns_label(name).map_err(|r| InvalidField::new(format!("{at}.name"), format!("{} {r}", quote(name))))?;
    if name.len() > 15 {
        return Err(InvalidField::new(
            format!("{at}.name"),
            format!("{} is longer than 15 characters", quote(name)),
        ));
    }
    Ok(())
}

/// The weight in canonical form (0 means 1), if at most [`MAX_WEIGHT`].
fn check_weight(field: &str, weight: u32) -> Result<u32, InvalidField> {
    if weight > MAX_WEIGHT {
        return Err(InvalidField::new(
            format!("{field}.weight"),
            format!("{weight} is out of range (0..={MAX_WEIGHT}; 0 means 1)"),
        ));
    }
    Ok(weight.max(1))
}

/// The health in canonical form (UNSPECIFIED means HEALTHY), if known.
fn check_health(field: &str, health: i32) -> Result<i32, InvalidField> {
    match Health::try_from(health) {
        Ok(Health::Unspecified) => Ok(Health::Healthy as i32),
        Ok(_) => Ok(health),
        Err(_) => Err(InvalidField::new(
            format!("{field}.health"),
            format!("unknown health {health}"),
        )),
    }
}

/// Where the endpoint runs: its locality, pod and node are label values.
fn check_placement(field: &str, ep: &Endpoint) -> Result<(), InvalidField> {
    if let Some(locality) = &ep.locality {
        for (name, value) in [
            ("region", &locality.region),
            ("zone", &locality.zone),
            ("subzone", &locality.subzone),
        ] {
            check_label_value(&format!("{field}.locality.{name}"), value)?;
        }
    }
    if let Some(pod) = &ep.pod {
        for (name, value) in [
            ("namespace", &pod.namespace),
            ("name", &pod.name),
            ("uid", &pod.uid),
            ("service_account", &pod.service_account),
        ] {
            check_label_value(&format!("{field}.pod.{name}"), value)?;
        }
    }
    check_label_value(&format!("{field}.node"), &ep.node)
}

/// At most [`MAX_METADATA_ENTRIES`] entries and [`MAX_METADATA_BYTES`] in all, each
/// key 1..=[`MAX_METADATA_KEY_BYTES`] bytes.
fn check_metadata(field: &str, metadata: &BTreeMap<String, String>) -> Result<(), InvalidField> {
    if metadata.len() > MAX_METADATA_ENTRIES {
        return Err(InvalidField::new(
            format!("{field}.metadata"),
            format!("{} entries (at most {MAX_METADATA_ENTRIES})", metadata.len()),
        ));
    }
    let mut total = 0;
    for (key, value) in metadata {
        if key.is_empty() || key.len() > MAX_METADATA_KEY_BYTES {
            return Err(InvalidField::new(
                format!("{field}.metadata"),
                format!("key {} must be 1..={MAX_METADATA_KEY_BYTES} bytes", quote(key)),
            ));
        }
        total += key.len() + value.len();
    }
    if total > MAX_METADATA_BYTES {
        return Err(InvalidField::new(
            format!("{field}.metadata"),
            format!("{total} bytes (at most {MAX_METADATA_BYTES})"),
        ));
    }
    Ok(())
}

fn check_label_value(field: &str, value: &str) -> Result<(), InvalidField> {
    if value.len() > MAX_LABEL_BYTES {
        return Err(InvalidField::new(
            field,
            format!("{} bytes (at most {MAX_LABEL_BYTES})", value.len()),
        ));
    }
    if value.chars().any(char::is_control) {
        return Err(InvalidField::new(
            field,
            format!("{} contains control characters", quote(value)),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use aether_proto::registry::v1::Port;

    fn endpoint() -> Endpoint {
        Endpoint {
            service: "shop/cart".into(),
            address: "10.1.2.3".into(),
            ports: vec![Port {
                name: "http".into(),
                port: 8080,
                protocol: Protocol::Http as i32,
            }],
            ..Default::default()
        }
    }

    fn error(ep: Endpoint) -> String {
        validate_endpoint("endpoint", Some(ep)).unwrap_err().to_string()
    }

    #[test]
    fn canonicalises_a_valid_endpoint() {
        let mut ep = endpoint();
        ep.address = "2001:db8:0:0::1".into();
        let valid = validate_endpoint("endpoint", Some(ep)).unwrap();
        assert_eq!(valid.service.namespace(), "shop");
        assert_eq!(valid.service.name(), "cart");
        assert_eq!(valid.endpoint.address, "2001:db8::1");
        assert_eq!(valid.endpoint.weight, 1);
        assert_eq!(valid.endpoint.health, Health::Healthy as i32);
    }

    #[test]
    fn names_the_bad_field() {
        assert_eq!(
            validate_endpoint("endpoint", None).unwrap_err().to_string(),
            "endpoint: must be set"
        );
        let mut ep = endpoint();
        ep.service = "".into();
        assert_eq!(error(ep), "endpoint.service: must be set to \"<namespace>/<name>\"");
        let mut ep = endpoint();
        ep.service = "Shop/cart".into();
        assert!(error(ep).starts_with("endpoint.service: \"Shop/cart\": namespace must be a DNS-1123 label"));
        let mut ep = endpoint();
        ep.service = "cart".into();
        assert_eq!(error(ep), "endpoint.service: \"cart\": expected \"<namespace>/<name>\"");
        let mut ep = endpoint();
        ep.address = "10.0.0.256".into();
        assert_eq!(error(ep), "endpoint.address: \"10.0.0.256\" is not an IP address");
        let mut ep = endpoint();
        ep.ports[0].port = 0;
        assert_eq!(error(ep), "endpoint.ports[0].port: 0 is out of range (1..=65535)");
        let mut ep = endpoint();
        ep.ports[0].port = 65_536;
        assert_eq!(error(ep), "endpoint.ports[0].port: 65536 is out of range (1..=65535)");
        let mut ep = endpoint();
        ep.ports[0].protocol = 42;
        assert_eq!(error(ep), "endpoint.ports[0].protocol: unknown protocol 42");
        let mut ep = endpoint();
        ep.metadata.insert("k".into(), "v".repeat(MAX_METADATA_BYTES));
        assert_eq!(error(ep), "endpoint.metadata: 16385 bytes (at most 16384)");
        let mut ep = endpoint();
        ep.health = 9;
        assert_eq!(error(ep), "endpoint.health: unknown health 9");
    }

    /// Any string, from empty to 1 MiB: plain text, valid-looking keys and addresses,
    /// control characters, and long runs of one character (ASCII or not).
    fn any_text() -> impl proptest::strategy::Strategy<Value = String> {
        use proptest::prelude::*;
        prop_oneof![
            "(?s).{0,80}",
            "[a-z0-9-]{0,70}/[a-z0-9-]{0,70}",
            "[0-9a-f.:]{0,45}",
            (any::<char>(), 0..(1usize << 20)).prop_map(|(c, n)| std::iter::repeat_n(c, n).collect()),
            ("[a-z]{1,5}", 0..(1usize << 20)).prop_map(|(ns, n)| format!("{ns}/{}", "\u{1b}".repeat(n))),
        ]
    }

    fn any_endpoint() -> impl proptest::strategy::Strategy<Value = Endpoint> {
        use aether_proto::registry::v1::{Locality, PodInfo};
        use proptest::prelude::*;
        (
            (any_text(), any_text(), any_text(), any_text()),
            (any_text(), any_text(), any_text()),
            (0..70_000u32, -1..5i32, 0..100_000u32, -1..6i32),
            proptest::option::of((any_text(), any_text(), any_text(), any_text())),
        )
            .prop_map(
                |(
                    (service, address, port_name, node),
                    (meta_key, meta_value, zone),
                    (port, protocol, weight, health),
                    pod,
                )| {
                    Endpoint {
                        service,
                        address,
                        ports: vec![Port {
                            name: port_name,
                            port,
                            protocol,
                        }],
                        weight,
                        health,
                        node,
                        metadata: [(meta_key, meta_value)].into_iter().collect(),
                        locality: Some(Locality {
                            zone,
                            ..Default::default()
                        }),
                        pod: pod.map(|(namespace, name, uid, service_account)| PodInfo {
                            namespace,
                            name,
                            uid,
                            service_account,
                        }),
                    }
                },
            )
    }

    fn check_bounded(error: InvalidField) -> Result<(), proptest::test_runner::TestCaseError> {
        let status = tonic::Status::from(error);
        proptest::prop_assert_eq!(status.code(), tonic::Code::InvalidArgument);
        proptest::prop_assert!(
            status.message().len() <= MAX_ERROR_BYTES,
            "{} bytes: {}",
            status.message().len(),
            status.message()
        );
        Ok(())
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config::with_cases(200))]

        #[test]
        fn no_validation_error_exceeds_the_bound(
            key in any_text(),
            address in any_text(),
            endpoint in any_endpoint(),
        ) {
            if let Err(e) = ServiceKey::parse("service", &key) {
                check_bounded(e)?;
            }
            if let Err(e) = parse_address("address", &address) {
                check_bounded(e)?;
            }
            if let Err(e) = validate_endpoint("endpoint", Some(endpoint)) {
                check_bounded(e)?;
            }
        }
    }

    proptest::proptest! {
        #[test]
        fn service_key_parse_never_panics_and_round_trips(key in ".{0,80}") {
            if let Ok(parsed) = ServiceKey::parse("service", &key) {
                proptest::prop_assert_eq!(parsed.as_str(), key.as_str());
                proptest::prop_assert_eq!(format!("{}/{}", parsed.namespace(), parsed.name()), key);
            }
        }

        #[test]
        fn address_parse_never_panics(address in ".{0,50}") {
            let _ = parse_address("address", &address);
        }
    }
}
