//! `aether`: one node's mesh from its agent's admin API (loopback; in a cluster, run it in
//! the agent pod with `kubectl exec`, or through the `kubectl-aether` plugin).
//!
//! Exit codes, for scripts:
//!
//! | code | meaning |
//! |---|---|
//! | 0 | all good: every hop ok, every check PASS, the node healthy |
//! | 1 | something fails: a hop of `explain`, a FAIL of `check`, a component `status` finds down |
//! | 2 | usage: a bad flag or argument |
//! | 3 | the agent could not be asked: not reachable, or an answer that makes no sense |
//! | 4 | works, with warnings (e.g. reachable on demand only, a WARN check) |

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};

pub mod checks;
pub mod client;
pub mod commands;
pub mod table;

/// The agent's admin address unless told otherwise (`aether-agent run --admin`).
pub const DEFAULT_AGENT: &str = "127.0.0.1:18092";

#[derive(Parser, Debug)]
#[command(
    name = "aether",
    version,
    about = "Status, checks, proxy config and explain for this node's mesh"
)]
pub struct Cli {
    /// The agent's admin address (loopback).
    #[arg(long, global = true, env = "AETHER_AGENT_ADMIN", default_value = DEFAULT_AGENT)]
    pub agent: SocketAddr,
    /// Output: human tables, or the agent's JSON for scripts.
    #[arg(short, long, global = true, value_enum, default_value = "table")]
    pub output: Output,
    /// The namespace of a pod given without one.
    #[arg(short, long, global = true, default_value = "default")]
    pub namespace: String,
    /// The node's CNI config directory, whose conflist must chain aether-cni (status, check).
    #[arg(long, global = true, env = "AETHER_CNI_CONF_DIR", default_value = "/etc/cni/net.d")]
    pub cni_conf_dir: PathBuf,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Output {
    Table,
    Json,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// The node: agent, Envoy, xDS, registrar stream, mesh-dns records, the CNI chain, pods.
    Status,
    /// Pre-flight and post-install checks, each PASS/WARN/FAIL with a fix.
    Check,
    /// What this node's Envoy holds for a pod.
    ProxyConfig {
        /// `<namespace>/<pod>` or `<pod>` (with -n).
        pod: String,
        #[arg(value_enum, default_value = "listeners")]
        section: Section,
    },
    /// Why a pod can or cannot reach a service: the hops in order, the first failing one, its fix.
    Explain {
        /// `<namespace>/<pod>` or `<pod>` (with -n).
        pod: String,
        /// A service (`backend`, `backend.ns`, `ns/backend`, its mesh name, with `:port`), a URL or a VIP.
        /// A URL's path and query are judged against the routes attached to the service.
        target: String,
        /// The request's method, for the route hop (default GET).
        #[arg(short = 'X', long = "request", value_name = "METHOD")]
        method: Option<String>,
        /// A request header `name:value`, for the route hop (repeatable).
        #[arg(short = 'H', long = "header", value_name = "NAME:VALUE", value_parser = header)]
        headers: Vec<String>,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Section {
    Listeners,
    Routes,
    Clusters,
    Endpoints,
    Secrets,
}

/// What a command printed and how it ended.
#[derive(Debug)]
pub struct Outcome {
    pub code: Code,
    pub output: String,
    pub error: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Code {
    Ok = 0,
    Warn = 4,
    Fail = 1,
    Unreachable = 3,
}

impl Code {
    /// The worse of two: fail over warn over ok.
    pub fn worst(self, other: Code) -> Code {
        let rank = |c: Code| match c {
            Code::Ok => 0,
            Code::Warn => 1,
            Code::Fail => 2,
            Code::Unreachable => 3,
        };
        if rank(other) > rank(self) { other } else { self }
    }
}

pub fn run(cli: &Cli) -> Outcome {
    let agent = client::Agent { addr: cli.agent };
    let result = match &cli.command {
        Command::Status => commands::status(&agent, &cli.cni_conf_dir, cli.output),
        Command::Check => commands::check(&agent, &cli.cni_conf_dir, cli.output),
        Command::ProxyConfig { pod, section } => {
            commands::proxy_config(&agent, &pod_id(pod, &cli.namespace), *section, cli.output)
        }
        Command::Explain {
            pod,
            target,
            method,
            headers,
        } => {
            let request = commands::Call {
                method: method.as_deref(),
                headers,
            };
            commands::explain(&agent, &pod_id(pod, &cli.namespace), target, &request, cli.output)
        }
    };
    match result {
        Ok((code, output)) => Outcome {
            code,
            output,
            error: None,
        },
        Err(error) => Outcome {
            code: Code::Unreachable,
            output: String::new(),
            error: Some(error.to_string()),
        },
    }
}

/// A `-H` value: `name:value` with a non-empty name.
fn header(text: &str) -> Result<String, String> {
    match text.split_once(':') {
        Some((name, _)) if !name.trim().is_empty() => Ok(text.to_owned()),
        _ => Err(format!("{text:?} is not name:value")),
    }
}

/// `<ns>/<pod>`, completing a bare name with `namespace`.
pub fn pod_id(pod: &str, namespace: &str) -> String {
    match pod.contains('/') {
        true => pod.to_owned(),
        false => format!("{namespace}/{pod}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn explain_takes_a_method_and_headers_like_curl() {
        let cli = Cli::try_parse_from([
            "aether",
            "explain",
            "frontend",
            "http://backend.demo:8080/api",
            "-X",
            "POST",
            "-H",
            "x-env: canary",
            "-H",
            "x-user:1",
        ])
        .unwrap();
        let Command::Explain { method, headers, .. } = cli.command else {
            panic!("{cli:?}")
        };
        assert_eq!(method.as_deref(), Some("POST"));
        assert_eq!(headers, ["x-env: canary", "x-user:1"]);
        let bad = Cli::try_parse_from(["aether", "explain", "frontend", "backend", "-H", "no-colon"]);
        assert!(bad.unwrap_err().to_string().contains("is not name:value"));
    }
}
