//! aether-cni: the thin chained CNI plugin. It parses its config and the CNI
//! environment, pins the pod's netns, hands the pod to the node agent (which programs
//! the capture) and passes the main plugin's result through. `aether-cni install` /
//! `uninstall` put it into (and take it out of) the node's CNI configuration.

pub mod agent;
pub mod config;
pub mod env;
pub mod error;
pub mod install;
pub mod netns;
pub mod owner;
pub mod plugin;
pub mod result;
