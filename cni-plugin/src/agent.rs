//! The agent's `aether.cni.v1.CniPlugin` over its Unix socket: a deadline per attempt
//! and bounded retries while it is Unavailable (down, restarting, or not ready for
//! the pod yet).

use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Duration;

use aether_proto::cni::v1::cni_plugin_client::CniPluginClient;
use tonic::transport::{Channel, Endpoint};

/// First pause between attempts; doubles each time.
const FIRST_BACKOFF: Duration = Duration::from_millis(200);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("the aether agent at {socket} is unavailable ({attempts} attempts): {last}")]
    Unavailable {
        socket: String,
        attempts: u32,
        last: String,
    },
    #[error("the aether agent did not answer {rpc} within {timeout:?}")]
    Timeout { rpc: &'static str, timeout: Duration },
    #[error("the aether agent refused {rpc} ({code:?}): {message}")]
    Refused {
        rpc: &'static str,
        code: tonic::Code,
        message: String,
    },
}

/// Why the agent's socket could not be reached: an attempt's Unavailable message.
#[derive(Debug, thiserror::Error)]
enum ConnectError {
    #[error("socket path: {0}")]
    Path(tonic::transport::Error),
    /// The whole cause chain: tonic's own message rarely says why (no such file, refused).
    #[error("{}", causes(.0))]
    Connect(tonic::transport::Error),
}

/// `error: its source: …`, each cause once (a source's text may already be in its parent's).
fn causes(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(s) = source {
        let part = s.to_string();
        if !text.contains(&part) {
            text = format!("{text}: {part}");
        }
        source = s.source();
    }
    text
}

#[derive(Clone, Debug)]
pub struct Agent {
    pub socket: PathBuf,
    /// Deadline of one attempt (connect + call).
    pub timeout: Duration,
    pub attempts: u32,
}

impl Agent {
    pub fn new(socket: &Path, timeout: Duration, attempts: u32) -> Self {
        Agent {
            socket: socket.to_owned(),
            timeout,
            attempts: attempts.max(1),
        }
    }

    async fn connect(&self) -> Result<CniPluginClient<Channel>, ConnectError> {
        let endpoint = Endpoint::from_shared(format!("unix:{}", self.socket.display()))
            .map_err(ConnectError::Path)?
            .connect_timeout(CONNECT_TIMEOUT.min(self.timeout))
            .timeout(self.timeout);
        let channel = endpoint.connect().await.map_err(ConnectError::Connect)?;
        Ok(CniPluginClient::new(channel))
    }

    /// Calls `rpc` with retries on Unavailable (including a socket nobody listens on).
    pub async fn call<T, F, Fut>(&self, rpc: &'static str, mut f: F) -> Result<T, AgentError>
    where
        F: FnMut(CniPluginClient<Channel>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let mut backoff = FIRST_BACKOFF;
        let mut last = String::new();
        for attempt in 1..=self.attempts {
            if attempt > 1 {
                tokio::time::sleep(backoff).await;
                backoff *= 2;
            }
            let outcome = tokio::time::timeout(self.timeout, async {
                let client = self
                    .connect()
                    .await
                    .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
                f(client).await
            })
            .await;
            match outcome {
                Err(_) => {
                    return Err(AgentError::Timeout {
                        rpc,
                        timeout: self.timeout,
                    });
                }
                Ok(Ok(reply)) => return Ok(reply.into_inner()),
                Ok(Err(status)) if status.code() == tonic::Code::Unavailable => {
                    tracing::warn!(rpc, attempt, message = status.message(), "agent unavailable");
                    last = status.message().to_owned();
                }
                Ok(Err(status)) => {
                    return Err(AgentError::Refused {
                        rpc,
                        code: status.code(),
                        message: status.message().to_owned(),
                    });
                }
            }
        }
        Err(AgentError::Unavailable {
            socket: self.socket.display().to_string(),
            attempts: self.attempts,
            last,
        })
    }
}
