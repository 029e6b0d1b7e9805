//! The CNI commands. [`run`] takes the environment and stdin and returns what to print
//! on stdout and the exit status, so it is testable in-process.

use std::path::Path;

use aether_common::quote::quote;
use aether_proto::cni::v1::{
    AddPodRequest, AddPodResponse, CaptureMode as ProtoCaptureMode, CaptureOptions, CheckPodRequest,
    GarbageCollectRequest, Outcome, PodRef, ReadyRequest, RemovePodRequest,
};
use serde_json::json;

use crate::agent::{Agent, AgentError};
use crate::config::{
    self, ALL_VERSIONS, CaptureMode, GC_VERSIONS, MODERN_VERSIONS, NetConf, VALID_ATTACHMENTS, require_version,
};
use crate::env::{CNI_COMMAND, CNI_IFNAME, Command, PodArgs, Sandbox};
use crate::error::{CniError, Code, invalid_config};
use crate::netns;
use crate::result;

/// What the process prints and returns.
#[derive(Debug, PartialEq, Eq)]
pub struct Output {
    pub stdout: String,
    pub exit_code: i32,
}

/// How long STATUS waits for the agent.
const STATUS_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

pub async fn run(get: impl Fn(&str) -> Option<String>, stdin: &[u8]) -> Output {
    let version = config::peek_version(stdin)
        .filter(|v| ALL_VERSIONS.contains(&v.as_str()))
        .unwrap_or_else(|| "1.1.0".to_owned());
    let command = Command::parse(get(CNI_COMMAND).as_deref());
    let name = command.as_ref().ok().map(|c| c.name());
    let result = match command {
        Ok(command) => execute(command, &get, stdin).await,
        Err(e) => Err(e),
    };
    match result {
        Ok(stdout) => Output { stdout, exit_code: 0 },
        Err(error) => {
            tracing::error!(command = ?name, code = error.code as u32, %error, "CNI call failed");
            Output {
                stdout: error.to_json(&version),
                exit_code: 1,
            }
        }
    }
}

async fn execute(command: Command, get: &impl Fn(&str) -> Option<String>, stdin: &[u8]) -> Result<String, CniError> {
    if command == Command::Version {
        return Ok(version(stdin));
    }
    let conf = config::parse(stdin)?;
    match command {
        Command::Add => add(&conf, get).await,
        Command::Del => del(&conf, get).await,
        Command::Check => check(&conf, get).await,
        Command::Gc => gc(&conf).await,
        Command::Status => status(&conf).await,
        Command::Version => unreachable!("answered above"),
    }
}

fn version(stdin: &[u8]) -> String {
    let asked = config::peek_version(stdin)
        .filter(|v| ALL_VERSIONS.contains(&v.as_str()))
        .unwrap_or_else(|| "1.1.0".to_owned());
    json!({"cniVersion": asked, "supportedVersions": ALL_VERSIONS}).to_string()
}

fn agent(conf: &NetConf) -> Agent {
    Agent::new(&conf.agent_socket, conf.agent_timeout, conf.agent_attempts)
}

fn agent_error(error: AgentError) -> CniError {
    let code = match &error {
        AgentError::Unavailable { .. } | AgentError::Timeout { .. } => Code::TryAgainLater,
        AgentError::Refused {
            code: tonic::Code::DeadlineExceeded | tonic::Code::Unavailable,
            ..
        } => Code::TryAgainLater,
        AgentError::Refused { .. } => Code::Other,
    };
    CniError::new(code, error.to_string())
}

fn pod_ref(pod: &PodArgs) -> PodRef {
    PodRef {
        namespace: pod.namespace.clone(),
        name: pod.name.clone(),
        uid: pod.uid.clone(),
    }
}

/// The pod, when it is a Kubernetes pod in a namespace the mesh manages.
fn managed<'a>(conf: &NetConf, sandbox: &'a Sandbox) -> Option<&'a PodArgs> {
    let pod = sandbox.pod.as_ref()?;
    (!conf.excluded_namespaces.iter().any(|n| n == &pod.namespace)).then_some(pod)
}

fn missing_netns(netns: &str) -> CniError {
    CniError::new(
        Code::UnknownContainer,
        format!("CNI_NETNS: {} does not exist", quote(netns)),
    )
}

fn netns_error(error: netns::NetnsError) -> CniError {
    match error {
        netns::NetnsError::Missing(path) => missing_netns(&path),
        e @ (netns::NetnsError::Pin { .. } | netns::NetnsError::Unpin { .. }) => {
            CniError::new(Code::IoFailure, e.to_string())
        }
        e @ netns::NetnsError::Netlink { .. } => CniError::new(Code::Other, e.to_string()),
    }
}

fn prev_result(conf: &NetConf) -> Result<&serde_json::Value, CniError> {
    conf.prev_result.as_ref().ok_or_else(|| {
        invalid_config(
            "prevResult: missing (aether-cni is a chained plugin: list it after the main plugin in a conflist)",
        )
    })
}

async fn add(conf: &NetConf, get: &impl Fn(&str) -> Option<String>) -> Result<String, CniError> {
    require_version(&conf.cni_version, MODERN_VERSIONS, "ADD")?;
    let sandbox = Sandbox::from_env(get, true)?;
    let prev = prev_result(conf)?;
    let addresses = result::pod_addresses(prev, &sandbox.ifname)?;
    // A chained plugin passes the result through unchanged.
    let output = prev.to_string();
    let Some(pod) = managed(conf, &sandbox) else {
        tracing::info!(container = %sandbox.container_id, pod = ?sandbox.pod, "not a mesh pod: passing through");
        return Ok(output);
    };
    let netns = Path::new(&sandbox.netns);
    if !netns.exists() {
        return Err(missing_netns(&sandbox.netns));
    }
    let ips = if addresses.is_empty() {
        interface_ips(netns, &sandbox)?
    } else {
        addresses.iter().map(|c| c.ip.to_string()).collect()
    };
    let pin = netns::pin(netns, &conf.pin_dir(), &sandbox.container_id).map_err(netns_error)?;
    let request = AddPodRequest {
        container_id: sandbox.container_id.clone(),
        netns_path: pin.display().to_string(),
        interface_name: sandbox.ifname.clone(),
        pod: Some(pod_ref(pod)),
        ips,
        capture: Some(capture_options(conf)),
    };
    let reply = agent(conf)
        .call("AddPod", |mut client| {
            let request = request.clone();
            async move { client.add_pod(request).await }
        })
        .await;
    added(reply, &pin, &sandbox, pod).map(|()| output)
}

/// The pod's addresses read from its interface, for a main plugin whose result lists none.
fn interface_ips(netns: &Path, sandbox: &Sandbox) -> Result<Vec<String>, CniError> {
    let found = netns::interface_addresses(netns, &sandbox.ifname)
        .map_err(netns_error)?
        .ok_or_else(|| {
            CniError::new(
                Code::Other,
                format!("{CNI_IFNAME}: no interface {} in {}", sandbox.ifname, sandbox.netns),
            )
        })?;
    Ok(found.iter().map(|c| c.ip.to_string()).collect())
}

fn capture_options(conf: &NetConf) -> CaptureOptions {
    CaptureOptions {
        mode: match conf.capture_mode {
            CaptureMode::Vip => ProtoCaptureMode::Vip as i32,
            CaptureMode::None => ProtoCaptureMode::None as i32,
        },
        mesh_dns: conf.mesh_dns.map(|a| a.to_string()).unwrap_or_default(),
        excluded_ports: conf.excluded_ports.clone(),
        excluded_cidrs: conf.excluded_cidrs.clone(),
    }
}

/// What the agent's answer to AddPod means for ADD: success when the pod joined the mesh
/// or the agent ignored it; the netns pin stays only when it joined.
fn added(
    reply: Result<AddPodResponse, AgentError>,
    pin: &Path,
    sandbox: &Sandbox,
    pod: &PodArgs,
) -> Result<(), CniError> {
    let outcome = match reply {
        Ok(reply) if reply.outcome == Outcome::Success as i32 => {
            tracing::info!(container = %sandbox.container_id, pod = %format!("{}/{}", pod.namespace, pod.name), "pod added to the mesh");
            return Ok(());
        }
        Ok(reply) if reply.outcome == Outcome::Ignored as i32 => {
            tracing::info!(container = %sandbox.container_id, message = %reply.message, "agent ignored the pod");
            Ok(())
        }
        Ok(reply) => Err(CniError::new(
            Code::Other,
            format!(
                "the aether agent answered AddPod with outcome {}: {}",
                reply.outcome, reply.message
            ),
        )),
        Err(error) => Err(agent_error(error)),
    };
    if let Err(error) = netns::unpin(pin) {
        tracing::warn!(%error, "dropping the pin after a failed ADD");
    }
    outcome
}

async fn del(conf: &NetConf, get: &impl Fn(&str) -> Option<String>) -> Result<String, CniError> {
    require_version(&conf.cni_version, ALL_VERSIONS, "DEL")?;
    let sandbox = Sandbox::from_env(get, false)?;
    let pin = conf.pin_dir().join(&sandbox.container_id);
    if sandbox.pod.is_none() || managed(conf, &sandbox).is_some() {
        let request = RemovePodRequest {
            container_id: sandbox.container_id.clone(),
            pod: sandbox.pod.as_ref().map(pod_ref),
        };
        let reply = agent(conf)
            .call("RemovePod", |mut client| {
                let request = request.clone();
                async move { client.remove_pod(request).await }
            })
            .await;
        match reply {
            Ok(_) => {}
            // DEL must not wedge pod deletion while the agent is down: the agent forgets
            // pods whose pinned netns is gone when it starts.
            Err(error @ (AgentError::Unavailable { .. } | AgentError::Timeout { .. })) => {
                tracing::warn!(container = %sandbox.container_id, %error, "agent unavailable on DEL; unpinning locally");
            }
            Err(error) => return Err(agent_error(error)),
        }
    }
    netns::unpin(&pin).map_err(netns_error)?;
    Ok(String::new())
}

async fn check(conf: &NetConf, get: &impl Fn(&str) -> Option<String>) -> Result<String, CniError> {
    require_version(&conf.cni_version, MODERN_VERSIONS, "CHECK")?;
    let sandbox = Sandbox::from_env(get, true)?;
    let prev = prev_result(conf)?;
    let expected = result::pod_addresses(prev, &sandbox.ifname)?;
    let netns = Path::new(&sandbox.netns);
    if !netns.exists() {
        return Err(missing_netns(&sandbox.netns));
    }
    let found = netns::interface_addresses(netns, &sandbox.ifname)
        .map_err(netns_error)?
        .ok_or_else(|| {
            CniError::new(
                Code::Other,
                format!("CHECK: interface {} is gone from {}", sandbox.ifname, sandbox.netns),
            )
        })?;
    for want in &expected {
        if !found.contains(want) {
            let found: Vec<String> = found.iter().map(ToString::to_string).collect();
            return Err(CniError::new(
                Code::Other,
                format!(
                    "CHECK: address {want} from prevResult is not on {} in {} (found: {})",
                    sandbox.ifname,
                    sandbox.netns,
                    found.join(", ")
                ),
            ));
        }
    }
    let Some(pod) = managed(conf, &sandbox) else {
        return Ok(String::new());
    };
    let request = CheckPodRequest {
        container_id: sandbox.container_id.clone(),
        netns_path: conf.pin_dir().join(&sandbox.container_id).display().to_string(),
        pod: Some(pod_ref(pod)),
    };
    agent(conf)
        .call("CheckPod", |mut client| {
            let request = request.clone();
            async move { client.check_pod(request).await }
        })
        .await
        .map_err(agent_error)?;
    Ok(String::new())
}

async fn gc(conf: &NetConf) -> Result<String, CniError> {
    require_version(&conf.cni_version, GC_VERSIONS, "GC")?;
    let valid = conf
        .valid_attachments
        .as_ref()
        .ok_or_else(|| invalid_config(format!("{VALID_ATTACHMENTS}: missing")))?;
    let ids: Vec<String> = valid.iter().map(|a| a.container_id.clone()).collect();
    let request = GarbageCollectRequest {
        valid_container_ids: ids.clone(),
    };
    let reply = agent(conf)
        .call("GarbageCollect", |mut client| {
            let request = request.clone();
            async move { client.garbage_collect(request).await }
        })
        .await
        .map_err(agent_error)?;
    // Pins the agent never heard of (an ADD that died between pinning and AddPod).
    let mut unpinned = Vec::new();
    for id in netns::pins(&conf.pin_dir()) {
        if !ids.contains(&id) {
            netns::unpin(&conf.pin_dir().join(&id)).map_err(netns_error)?;
            unpinned.push(id);
        }
    }
    tracing::info!(removed = ?reply.removed, ?unpinned, "GC done");
    Ok(String::new())
}

async fn status(conf: &NetConf) -> Result<String, CniError> {
    require_version(&conf.cni_version, GC_VERSIONS, "STATUS")?;
    let agent = Agent::new(&conf.agent_socket, STATUS_TIMEOUT.min(conf.agent_timeout), 1);
    agent
        .call("Ready", |mut client| async move { client.ready(ReadyRequest {}).await })
        .await
        .map_err(|e| CniError::new(Code::PluginNotAvailable, format!("plugin not available: {e}")))?;
    Ok(String::new())
}
