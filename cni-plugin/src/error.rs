//! CNI errors: a spec error code and a message naming what was wrong, printed as the
//! spec's error JSON on stdout.

use serde::Serialize;

/// Error codes of the CNI spec (1.1.0, "Error"); 0-99 are reserved, above is ours.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Code {
    IncompatibleVersion = 1,
    UnsupportedField = 2,
    UnknownContainer = 3,
    InvalidEnvironment = 4,
    IoFailure = 5,
    DecodeFailure = 6,
    InvalidConfig = 7,
    TryAgainLater = 11,
    PluginNotAvailable = 50,
    /// Anything else (a custom code, allowed by the spec above 99).
    Other = 999,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct CniError {
    pub code: Code,
    pub message: String,
}

impl CniError {
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        CniError {
            code,
            message: message.into(),
        }
    }

    /// The spec's error object, in the caller's CNI version.
    pub fn to_json(&self, cni_version: &str) -> String {
        #[derive(Serialize)]
        #[serde(rename_all = "camelCase")]
        struct Wire<'a> {
            cni_version: &'a str,
            code: u32,
            msg: &'a str,
        }
        serde_json::to_string(&Wire {
            cni_version,
            code: self.code as u32,
            msg: &self.message,
        })
        .expect("error JSON serialises")
    }
}

pub fn invalid_config(message: impl Into<String>) -> CniError {
    CniError::new(Code::InvalidConfig, message)
}

pub fn invalid_env(message: impl Into<String>) -> CniError {
    CniError::new(Code::InvalidEnvironment, message)
}
