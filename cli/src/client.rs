//! The agent's admin API over loopback HTTP/1.1: one GET per connection, JSON answers.
//! Deliberately tiny (std only): the CLI starts, asks and exits in milliseconds.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// How long one request to the agent may take (explain checks a netns and Envoy's admin).
const TIMEOUT: Duration = Duration::from_secs(10);
/// The largest answer read (a status of a node with many pods is well below).
const MAX_BODY: u64 = 64 * 1024 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error(
        "cannot reach the agent's admin API at {addr}: {source} (is the agent running? --agent / AETHER_AGENT_ADMIN)"
    )]
    Connect { addr: SocketAddr, source: std::io::Error },
    #[error("talking to the agent at {addr}{path}: {source}")]
    Io {
        addr: SocketAddr,
        path: String,
        source: std::io::Error,
    },
    #[error("the agent at {addr}{path} answered {status}: {body}")]
    Status {
        addr: SocketAddr,
        path: String,
        status: u16,
        body: String,
    },
    #[error("the agent at {addr}{path} answered something that is not HTTP/JSON: {reason}")]
    Malformed {
        addr: SocketAddr,
        path: String,
        reason: String,
    },
}

#[derive(Clone, Copy, Debug)]
pub struct Agent {
    pub addr: SocketAddr,
}

impl Agent {
    /// GET `path`: the status and body.
    pub fn get_raw(&self, path: &str) -> Result<(u16, String), ClientError> {
        let io = |source| ClientError::Io {
            addr: self.addr,
            path: path.to_owned(),
            source,
        };
        let mut stream = TcpStream::connect_timeout(&self.addr, TIMEOUT).map_err(|source| ClientError::Connect {
            addr: self.addr,
            source,
        })?;
        stream.set_read_timeout(Some(TIMEOUT)).map_err(io)?;
        let request = format!(
            "GET {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
            self.addr
        );
        stream.write_all(request.as_bytes()).map_err(io)?;
        let mut reply = Vec::new();
        stream.take(MAX_BODY).read_to_end(&mut reply).map_err(io)?;
        parse_reply(&reply).ok_or_else(|| ClientError::Malformed {
            addr: self.addr,
            path: path.to_owned(),
            reason: "no status line".into(),
        })
    }

    /// GET `path`, which must answer 200 with JSON.
    pub fn get(&self, path: &str) -> Result<serde_json::Value, ClientError> {
        let (status, body) = self.get_raw(path)?;
        if status != 200 {
            let message = serde_json::from_str::<serde_json::Value>(&body)
                .ok()
                .and_then(|v| v["error"].as_str().map(str::to_owned))
                .unwrap_or(body);
            return Err(ClientError::Status {
                addr: self.addr,
                path: path.to_owned(),
                status,
                body: message.trim().to_owned(),
            });
        }
        serde_json::from_str(&body).map_err(|e| ClientError::Malformed {
            addr: self.addr,
            path: path.to_owned(),
            reason: e.to_string(),
        })
    }
}

/// An HTTP/1.1 reply with a Content-Length body (what the agent's admin server sends).
fn parse_reply(reply: &[u8]) -> Option<(u16, String)> {
    let text = String::from_utf8_lossy(reply);
    let (head, body) = text.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((status, body.to_owned()))
}

/// Everything but RFC 3986's unreserved characters is encoded in a path segment.
const SEGMENT: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// Percent-encodes a path segment (a target URL carries `/`, `:` and `?`).
pub fn encode(segment: &str) -> String {
    percent_encoding::utf8_percent_encode(segment, SEGMENT).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_and_segments() {
        let reply = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 5\r\n\r\nnope\n";
        assert_eq!(parse_reply(reply), Some((503, "nope\n".into())));
        assert_eq!(parse_reply(b"garbage"), None);
        assert_eq!(encode("http://a.b:80/x?y"), "http%3A%2F%2Fa.b%3A80%2Fx%3Fy");
    }
}
