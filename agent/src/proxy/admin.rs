//! A small client for Envoy's admin API: which epoch answers and whether it is LIVE, and draining.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::Request;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

const TIMEOUT: Duration = Duration::from_secs(3);

#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error("Envoy admin {addr}{path}: {reason}")]
    Request {
        addr: SocketAddr,
        path: String,
        reason: String,
    },
    #[error("Envoy admin {addr}{path}: HTTP {status}: {body}")]
    Status {
        addr: SocketAddr,
        path: String,
        status: u16,
        body: String,
    },
    #[error("Envoy admin {addr}/server_info: unexpected answer: {source}")]
    ServerInfo { addr: SocketAddr, source: ServerInfoError },
}

/// Why a `/server_info` answer is not one the supervisor can use.
#[derive(Debug, thiserror::Error)]
pub enum ServerInfoError {
    #[error("not JSON: {0}")]
    NotJson(#[source] serde_json::Error),
    /// `field` is missing or not of the `expected` kind.
    #[error("no {field} ({expected})")]
    Field {
        field: &'static str,
        expected: &'static str,
    },
}

/// What `/server_info` says about the Envoy that currently owns the admin address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerInfo {
    /// `LIVE`, `DRAINING`, `PRE_INITIALIZING` or `INITIALIZING`.
    pub state: String,
    pub restart_epoch: u32,
    /// As started (0 with a dynamic base id: the real one is in the base-id file).
    pub base_id: u32,
    pub use_dynamic_base_id: bool,
    pub hot_restart_version: String,
    /// The hot-restart socket path it runs with (Envoy's default is the abstract `@envoy_domain_socket`).
    pub socket_path: String,
    /// How long this epoch has run: its parent (if any) lives at most the parent-shutdown time of it.
    pub uptime_current_epoch: Duration,
}

impl ServerInfo {
    pub fn is_live(&self) -> bool {
        self.state == "LIVE"
    }
}

#[derive(Clone, Copy, Debug)]
pub struct EnvoyAdmin {
    addr: SocketAddr,
}

impl EnvoyAdmin {
    pub fn new(addr: SocketAddr) -> Self {
        Self { addr }
    }

    pub async fn server_info(&self) -> Result<ServerInfo, AdminError> {
        let body = self.request("GET", "/server_info").await?;
        parse_server_info(&body).map_err(|source| AdminError::ServerInfo {
            addr: self.addr,
            source,
        })
    }

    /// Envoy answers health checks (and `/server_info`) as DRAINING from now on.
    pub async fn fail_health_checks(&self) -> Result<(), AdminError> {
        self.request("POST", "/healthcheck/fail").await.map(drop)
    }

    /// Starts a graceful drain of every listener (they close after Envoy's drain time).
    pub async fn drain_listeners_gracefully(&self) -> Result<(), AdminError> {
        self.request("POST", "/drain_listeners?graceful").await.map(drop)
    }

    /// A read-only page (`/clusters?format=json`, `/config_dump`, …), for the agent's debug API.
    pub async fn get(&self, path: &str) -> Result<String, AdminError> {
        self.request("GET", path).await
    }

    async fn request(&self, method: &str, path: &str) -> Result<String, AdminError> {
        let err = |reason: String| AdminError::Request {
            addr: self.addr,
            path: path.to_owned(),
            reason,
        };
        let exchange = async {
            let stream = TcpStream::connect(self.addr)
                .await
                .map_err(|e| format!("connect: {e}"))?;
            let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
                .await
                .map_err(|e| format!("handshake: {e}"))?;
            let driver = tokio::spawn(conn);
            let req = Request::builder()
                .method(method)
                .uri(path)
                .header(hyper::header::HOST, self.addr.to_string())
                .body(Empty::<Bytes>::new())
                .map_err(|e| e.to_string())?;
            let result = async {
                let resp = sender.send_request(req).await.map_err(|e| format!("send: {e}"))?;
                let status = resp.status().as_u16();
                let body = resp.into_body().collect().await.map_err(|e| format!("body: {e}"))?;
                Ok::<_, String>((status, String::from_utf8_lossy(&body.to_bytes()).into_owned()))
            }
            .await;
            driver.abort();
            result
        };
        let (status, body) = tokio::time::timeout(TIMEOUT, exchange)
            .await
            .map_err(|_| err(format!("no answer within {TIMEOUT:?}")))?
            .map_err(err)?;
        if status != 200 {
            return Err(AdminError::Status {
                addr: self.addr,
                path: path.to_owned(),
                status,
                body: body.chars().take(512).collect(),
            });
        }
        Ok(body)
    }
}

/// Parses the fields of `/server_info` the supervisor needs.
pub fn parse_server_info(body: &str) -> Result<ServerInfo, ServerInfoError> {
    let json: serde_json::Value = serde_json::from_str(body).map_err(ServerInfoError::NotJson)?;
    let options = &json["command_line_options"];
    let missing = |field, expected| ServerInfoError::Field { field, expected };
    let text = |v: &serde_json::Value, field| v.as_str().map(str::to_owned).ok_or(missing(field, "a string"));
    // Envoy renders uint64 options as strings and uint32 ones as numbers; accept both.
    let number = |v: &serde_json::Value, field| {
        v.as_u64()
            .or_else(|| v.as_str().and_then(|s| s.parse().ok()))
            .and_then(|n| u32::try_from(n).ok())
            .ok_or(missing(field, "a number"))
    };
    Ok(ServerInfo {
        state: text(&json["state"], "state")?,
        restart_epoch: number(&options["restart_epoch"], "command_line_options.restart_epoch")?,
        base_id: number(&options["base_id"], "command_line_options.base_id")?,
        use_dynamic_base_id: options["use_dynamic_base_id"].as_bool().unwrap_or(false),
        hot_restart_version: text(&json["hot_restart_version"], "hot_restart_version")?,
        socket_path: options["socket_path"].as_str().unwrap_or_default().to_owned(),
        uptime_current_epoch: json["uptime_current_epoch"]
            .as_str()
            .and_then(|s| s.strip_suffix('s'))
            .and_then(|s| s.parse::<f64>().ok())
            .filter(|s| s.is_finite() && *s >= 0.0)
            .map(Duration::from_secs_f64)
            .ok_or(missing("uptime_current_epoch", "seconds like \"12s\""))?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_info_of_envoy_1_40() {
        let body = r#"{"version":"x/1.40.0/Clean/RELEASE/BoringSSL","state":"LIVE","hot_restart_version":"11.104",
            "uptime_current_epoch":"12.5s",
            "command_line_options":{"base_id":"254340702","restart_epoch":3,"use_dynamic_base_id":false,
            "socket_path":"/var/lib/aether/proxy/hot-restart"}}"#;
        assert_eq!(
            parse_server_info(body).unwrap(),
            ServerInfo {
                state: "LIVE".into(),
                restart_epoch: 3,
                base_id: 254340702,
                use_dynamic_base_id: false,
                hot_restart_version: "11.104".into(),
                socket_path: "/var/lib/aether/proxy/hot-restart".into(),
                uptime_current_epoch: Duration::from_millis(12_500),
            }
        );
    }

    #[test]
    fn a_server_info_error_names_the_field() {
        let field = |body: &str| match parse_server_info(body) {
            Err(ServerInfoError::Field { field, .. }) => field,
            other => panic!("{other:?}"),
        };
        assert_eq!(field("{}"), "state");
        assert_eq!(
            field(r#"{"state":"LIVE","command_line_options":{"restart_epoch":"x"}}"#),
            "command_line_options.restart_epoch"
        );
        assert_eq!(
            field(
                r#"{"state":"LIVE","hot_restart_version":"1","uptime_current_epoch":"-1s","command_line_options":{"restart_epoch":1,"base_id":"2"}}"#
            ),
            "uptime_current_epoch"
        );
        let error = parse_server_info("nope").unwrap_err();
        assert!(matches!(error, ServerInfoError::NotJson(_)), "{error}");
        assert!(error.to_string().starts_with("not JSON"), "{error}");
    }
}
