//! The CNI environment: CNI_COMMAND, CNI_CONTAINERID, CNI_NETNS, CNI_IFNAME, CNI_ARGS,
//! CNI_PATH.

use std::collections::BTreeMap;

use aether_common::names::ContainerIdError;
use aether_common::quote::quote;

use crate::error::{CniError, invalid_env};

pub const CNI_COMMAND: &str = "CNI_COMMAND";
pub const CNI_CONTAINERID: &str = "CNI_CONTAINERID";
pub const CNI_NETNS: &str = "CNI_NETNS";
pub const CNI_IFNAME: &str = "CNI_IFNAME";
pub const CNI_ARGS: &str = "CNI_ARGS";
pub const CNI_PATH: &str = "CNI_PATH";
pub const K8S_POD_NAMESPACE: &str = "K8S_POD_NAMESPACE";
pub const K8S_POD_NAME: &str = "K8S_POD_NAME";
pub const K8S_POD_UID: &str = "K8S_POD_UID";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Command {
    Add,
    Del,
    Check,
    Gc,
    Status,
    Version,
}

impl Command {
    pub fn parse(value: Option<&str>) -> Result<Command, CniError> {
        match value {
            None | Some("") => Err(invalid_env(format!("{CNI_COMMAND}: missing"))),
            Some("ADD") => Ok(Command::Add),
            Some("DEL") => Ok(Command::Del),
            Some("CHECK") => Ok(Command::Check),
            Some("GC") => Ok(Command::Gc),
            Some("STATUS") => Ok(Command::Status),
            Some("VERSION") => Ok(Command::Version),
            Some(other) => Err(invalid_env(format!(
                "{CNI_COMMAND}: {} is not a CNI command (ADD, DEL, CHECK, GC, STATUS, VERSION)",
                quote(other)
            ))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Command::Add => "ADD",
            Command::Del => "DEL",
            Command::Check => "CHECK",
            Command::Gc => "GC",
            Command::Status => "STATUS",
            Command::Version => "VERSION",
        }
    }
}

/// The Kubernetes pod a sandbox belongs to (from CNI_ARGS).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodArgs {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

/// The per-sandbox variables of ADD, DEL and CHECK.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sandbox {
    pub container_id: String,
    /// Empty on DEL when the runtime no longer has a netns.
    pub netns: String,
    pub ifname: String,
    /// None when CNI_ARGS does not name a Kubernetes pod.
    pub pod: Option<PodArgs>,
}

/// Why a container id was refused, worded for the plugin's variables and config.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BadContainerId {
    #[error("missing")]
    Missing,
    /// The id, quoted (bounded).
    #[error("{0} is not a container id (letters, digits, '-', '_', '.')")]
    Invalid(String),
}

/// Container ids: the spec allows alphanumerics, underscore, hyphen and period
/// ([`aether_common::names::container_id`], the rule the agent checks too).
pub fn check_container_id(id: &str) -> Result<(), BadContainerId> {
    aether_common::names::container_id(id).map_err(|e| match e {
        ContainerIdError::Empty => BadContainerId::Missing,
        ContainerIdError::Invalid => BadContainerId::Invalid(quote(id).to_string()),
    })
}

/// `KEY=VALUE;KEY=VALUE` (CNI_ARGS).
pub fn parse_args(args: &str) -> Result<BTreeMap<String, String>, CniError> {
    let mut out = BTreeMap::new();
    for pair in args.split(';').filter(|p| !p.is_empty()) {
        let (k, v) = pair
            .split_once('=')
            .ok_or_else(|| invalid_env(format!("{CNI_ARGS}: {} is not KEY=VALUE", quote(pair))))?;
        if k.is_empty() {
            return Err(invalid_env(format!("{CNI_ARGS}: {} has an empty key", quote(pair))));
        }
        out.insert(k.to_owned(), v.to_owned());
    }
    Ok(out)
}

impl Sandbox {
    /// Reads the sandbox variables; `needs_netns` for ADD and CHECK.
    pub fn from_env(get: impl Fn(&str) -> Option<String>, needs_netns: bool) -> Result<Sandbox, CniError> {
        let container_id = get(CNI_CONTAINERID).unwrap_or_default();
        check_container_id(&container_id).map_err(|r| invalid_env(format!("{CNI_CONTAINERID}: {r}")))?;
        let netns = get(CNI_NETNS).unwrap_or_default();
        if needs_netns && netns.is_empty() {
            return Err(invalid_env(format!("{CNI_NETNS}: missing")));
        }
        if !netns.is_empty() && !netns.starts_with('/') {
            return Err(invalid_env(format!(
                "{CNI_NETNS}: {} is not an absolute path",
                quote(&netns)
            )));
        }
        let ifname = get(CNI_IFNAME).unwrap_or_default();
        if ifname.is_empty() {
            return Err(invalid_env(format!("{CNI_IFNAME}: missing")));
        }
        if ifname.len() > 15 || ifname.contains('/') || ifname.chars().any(char::is_whitespace) {
            return Err(invalid_env(format!(
                "{CNI_IFNAME}: {} is not an interface name",
                quote(&ifname)
            )));
        }
        let args = parse_args(&get(CNI_ARGS).unwrap_or_default())?;
        let pod = match (args.get(K8S_POD_NAMESPACE), args.get(K8S_POD_NAME)) {
            (Some(ns), Some(name)) if !ns.is_empty() && !name.is_empty() => Some(PodArgs {
                namespace: ns.clone(),
                name: name.clone(),
                uid: args.get(K8S_POD_UID).cloned().unwrap_or_default(),
            }),
            _ => None,
        };
        Ok(Sandbox {
            container_id,
            netns,
            ifname,
            pod,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: BTreeMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn sandbox_variables_are_checked_with_the_variable_named() {
        let ok = [
            (CNI_CONTAINERID, "abc"),
            (CNI_NETNS, "/var/run/netns/x"),
            (CNI_IFNAME, "eth0"),
            (
                CNI_ARGS,
                "IgnoreUnknown=1;K8S_POD_NAMESPACE=demo;K8S_POD_NAME=web;K8S_POD_UID=u1",
            ),
        ];
        let s = Sandbox::from_env(env(&ok), true).unwrap();
        assert_eq!(
            s.pod,
            Some(PodArgs {
                namespace: "demo".into(),
                name: "web".into(),
                uid: "u1".into()
            })
        );
        let err = |pairs: &[(&str, &str)]| Sandbox::from_env(env(pairs), true).unwrap_err();
        assert_eq!(err(&ok[1..]).message, "CNI_CONTAINERID: missing");
        assert_eq!(err(&[ok[0], ok[2]]).message, "CNI_NETNS: missing");
        assert_eq!(err(&[ok[0], ok[1]]).message, "CNI_IFNAME: missing");
        assert_eq!(
            err(&[ok[0], ok[1], ok[2], (CNI_ARGS, "oops")]).message,
            "CNI_ARGS: \"oops\" is not KEY=VALUE"
        );
        assert_eq!(
            err(&[(CNI_CONTAINERID, "a b"), ok[1], ok[2]]).code,
            crate::error::Code::InvalidEnvironment
        );
        // DEL may come without a netns.
        assert!(Sandbox::from_env(env(&[ok[0], ok[2]]), false).is_ok());
        assert_eq!(
            Command::parse(Some("NOPE")).unwrap_err().code,
            crate::error::Code::InvalidEnvironment
        );
    }

    #[test]
    fn huge_variables_are_quoted_by_their_start_and_size() {
        let huge = "a".repeat(1 << 20);
        let start = &huge[..64];
        let ok = [
            (CNI_CONTAINERID, "abc"),
            (CNI_NETNS, "/var/run/netns/x"),
            (CNI_IFNAME, "eth0"),
        ];
        let err = |variable: &str, value: &str| {
            let mut pairs = ok.to_vec();
            pairs.retain(|(k, _)| *k != variable);
            pairs.push((variable, value));
            Sandbox::from_env(env(&pairs), true).unwrap_err().message
        };
        assert_eq!(
            err(CNI_CONTAINERID, &huge),
            format!(
                "CNI_CONTAINERID: {start:?}… (1048576 bytes) is not a container id (letters, digits, '-', '_', '.')"
            )
        );
        assert_eq!(
            err(CNI_NETNS, &huge),
            format!("CNI_NETNS: {start:?}… (1048576 bytes) is not an absolute path")
        );
        assert_eq!(
            err(CNI_IFNAME, &huge),
            format!("CNI_IFNAME: {start:?}… (1048576 bytes) is not an interface name")
        );
        assert_eq!(
            err(CNI_ARGS, &huge),
            format!("CNI_ARGS: {start:?}… (1048576 bytes) is not KEY=VALUE")
        );
        assert_eq!(
            err(CNI_ARGS, &format!("={huge}")),
            format!(
                "CNI_ARGS: {:?}… (1048577 bytes) has an empty key",
                &format!("={huge}")[..64]
            )
        );
        assert_eq!(
            Command::parse(Some(&huge)).unwrap_err().message,
            format!(
                "CNI_COMMAND: {start:?}… (1048576 bytes) is not a CNI command (ADD, DEL, CHECK, GC, STATUS, VERSION)"
            )
        );
    }

    proptest::proptest! {
        #[test]
        fn cni_args_never_panic(s in "\\PC{0,64}") {
            let _ = parse_args(&s);
        }
    }
}
