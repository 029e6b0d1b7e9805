//! The echo backend of the GAMMA suite ([`crate::gamma`]): an HTTP/1.1 + h2c server, run inside a pod's netns,
//! that answers every request with a JSON description of itself (pod, namespace, service) and of the request as it
//! arrived (method, path with query, host, headers). A gRPC call (`content-type: application/grpc…`) gets the same
//! JSON as its one response message, with `grpc-status: 0` in the trailers: enough for Envoy's gRPC routing and for
//! the suite's checks, with no generated code.
//!
//! Request headers steer it, so resilience cases need no other backend:
//! - `x-echo-delay-ms: N` answers after N ms (timeouts);
//! - `x-echo-status: N` answers with status N (a backend that always fails);
//! - `x-echo-fail-pod: <pod>` makes that pod answer 500 (or `x-echo-fail-status`), the others normally (outlier
//!   ejection);
//! - `x-echo-fail-first: <key>:<n>` answers 503 (or `x-echo-fail-status`) to the first n requests carrying `<key>`,
//!   then normally (retries).
//!   The counters are shared by every echo server of one [`EchoLedger`], so a retry that lands on another
//!   replica still counts.

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper::{HeaderMap, Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use parking_lot::Mutex;
use tokio::net::{TcpListener, TcpSocket};
use tokio::task::{JoinHandle, JoinSet};

use crate::http::CLIENT_TIMEOUT;
use crate::netns::TestPod;

pub const DELAY_HEADER: &str = "x-echo-delay-ms";
pub const STATUS_HEADER: &str = "x-echo-status";
pub const FAIL_FIRST_HEADER: &str = "x-echo-fail-first";
pub const FAIL_STATUS_HEADER: &str = "x-echo-fail-status";
pub const FAIL_POD_HEADER: &str = "x-echo-fail-pod";

/// Who an echo server answers as.
#[derive(Clone, Debug)]
pub struct EchoIdentity {
    pub pod: String,
    pub namespace: String,
    pub service: String,
}

/// A request carrying this header is recorded with the service that answered it (see [`EchoLedger::served`]):
/// how a test sees the copies a mirror sends, whose answers nobody gets.
pub const TRACE_HEADER: &str = "x-echo-trace";

/// What the echo servers given one clone share: the `x-echo-fail-first` counters, keyed by the header's key, and
/// the services that answered each `x-echo-trace`.
#[derive(Clone, Default)]
pub struct EchoLedger {
    failures: Arc<Mutex<HashMap<String, u32>>>,
    traces: Arc<Mutex<HashMap<String, Vec<String>>>>,
}

impl EchoLedger {
    /// The services whose echo answered requests traced `trace`, in arrival order.
    pub fn served(&self, trace: &str) -> Vec<String> {
        self.traces.lock().get(trace).cloned().unwrap_or_default()
    }

    fn record(&self, trace: String, service: &str) {
        self.traces.lock().entry(trace).or_default().push(service.to_owned());
    }

    /// True when this request must fail: `<key>:<n>` seen fewer than n times before (counted).
    fn should_fail(&self, spec: &str) -> bool {
        let Some((key, n)) = spec.rsplit_once(':') else {
            return false;
        };
        let Ok(n) = n.trim().parse::<u32>() else {
            return false;
        };
        let mut counts = self.failures.lock();
        let seen = counts.entry(key.to_owned()).or_default();
        *seen += 1;
        *seen <= n
    }
}

/// A running echo server; dropping it stops the accept loop and every open connection.
pub struct EchoServer {
    addr: SocketAddr,
    task: JoinHandle<()>,
}

impl EchoServer {
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for EchoServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

type EchoBody = BoxBody<Bytes, Infallible>;

/// Serves the echo backend on `addr` inside `pod`. Must be called from within a tokio runtime.
pub fn serve_echo(pod: &TestPod, addr: SocketAddr, who: EchoIdentity, failures: EchoLedger) -> EchoServer {
    let listener = pod
        .run(move || std::net::TcpListener::bind(addr))
        .unwrap_or_else(|e| panic!("echo in pod {}: bind {addr}: {e}", pod.name()));
    listener.set_nonblocking(true).expect("set_nonblocking");
    let listener = TcpListener::from_std(listener).expect("tokio TcpListener::from_std");
    let addr = listener.local_addr().expect("local_addr");
    let who = Arc::new(who);
    let task = tokio::spawn(accept_loop(listener, who, failures));
    EchoServer { addr, task }
}

async fn accept_loop(listener: TcpListener, who: Arc<EchoIdentity>, failures: EchoLedger) {
    // Dropping the accept task drops the set, which aborts every connection.
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                let (who, failures) = (Arc::clone(&who), failures.clone());
                connections.spawn(async move {
                    let service = service_fn(move |req| answer(Arc::clone(&who), failures.clone(), req));
                    let _ = auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

async fn answer(
    who: Arc<EchoIdentity>,
    failures: EchoLedger,
    req: Request<Incoming>,
) -> Result<Response<EchoBody>, Infallible> {
    let header = |name: &str| req.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
    let number = |name: &str| header(name).and_then(|v| v.parse::<u64>().ok());
    if let Some(ms) = number(DELAY_HEADER) {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    if let Some(trace) = header(TRACE_HEADER) {
        failures.record(trace, &who.service);
    }
    let fail_status = number(FAIL_STATUS_HEADER).and_then(|n| u16::try_from(n).ok());
    let status = if header(FAIL_POD_HEADER).is_some_and(|pod| pod == who.pod) {
        fail_status.unwrap_or(500)
    } else if header(FAIL_FIRST_HEADER).is_some_and(|spec| failures.should_fail(&spec)) {
        fail_status.unwrap_or(503)
    } else {
        number(STATUS_HEADER).and_then(|n| u16::try_from(n).ok()).unwrap_or(200)
    };
    let grpc = header("content-type").is_some_and(|c| c.starts_with("application/grpc"));
    let description = describe(&who, &req, grpc);
    // Read the request to its end: an early answer could reset a stream Envoy still writes to.
    let _ = req.into_body().collect().await;
    if grpc && status == 200 {
        return Ok(grpc_answer(description));
    }
    let body = Full::new(Bytes::from(description.to_string())).boxed();
    let resp = Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(body)
        .expect("echo response");
    Ok(resp)
}

/// The JSON every answer carries. Repeated headers are joined with "," in arrival order.
fn describe(who: &EchoIdentity, req: &Request<Incoming>, grpc: bool) -> serde_json::Value {
    let mut headers = serde_json::Map::new();
    for (name, value) in req.headers() {
        let value = String::from_utf8_lossy(value.as_bytes()).into_owned();
        match headers.get_mut(name.as_str()) {
            Some(serde_json::Value::String(v)) => {
                v.push(',');
                v.push_str(&value);
            }
            _ => {
                headers.insert(name.as_str().to_owned(), value.into());
            }
        }
    }
    let host = req
        .headers()
        .get(hyper::header::HOST)
        .map(|h| String::from_utf8_lossy(h.as_bytes()).into_owned())
        .or_else(|| req.uri().authority().map(|a| a.to_string()));
    serde_json::json!({
        "pod": who.pod,
        "namespace": who.namespace,
        "service": who.service,
        "protocol": if grpc { "grpc" } else { "http" },
        "method": req.method().as_str(),
        "path": req.uri().path_and_query().map_or("/", |p| p.as_str()),
        "host": host,
        "headers": headers,
    })
}

/// A unary gRPC answer: one length-prefixed message (the JSON), then `grpc-status: 0`.
fn grpc_answer(description: serde_json::Value) -> Response<EchoBody> {
    let mut trailers = HeaderMap::new();
    trailers.insert("grpc-status", "0".parse().expect("header value"));
    let frames = [
        Ok::<_, Infallible>(Frame::data(grpc_frame(description.to_string().as_bytes()))),
        Ok(Frame::trailers(trailers)),
    ];
    let body = StreamBody::new(tokio_stream::iter(frames)).boxed();
    Response::builder()
        .status(200)
        .header("content-type", "application/grpc")
        .body(body)
        .expect("grpc response")
}

/// gRPC's message framing: no compression flag, a big-endian length, the bytes.
pub fn grpc_frame(message: &[u8]) -> Bytes {
    let mut frame = BytesMut::with_capacity(5 + message.len());
    frame.put_u8(0);
    frame.put_u32(u32::try_from(message.len()).expect("message under 4 GiB"));
    frame.put_slice(message);
    frame.freeze()
}

/// The first message of a gRPC body, if it holds a whole one.
pub fn grpc_message(body: &[u8]) -> Option<&[u8]> {
    let len = u32::from_be_bytes(body.get(1..5)?.try_into().ok()?) as usize;
    body.get(5..5 + len)
}

/// A gRPC call's answer as the client saw it.
#[derive(Clone, Debug)]
pub struct GrpcReply {
    pub status: u16,
    /// Lower-case names, repeated ones joined with ", ".
    pub headers: BTreeMap<String, String>,
    /// The first response message (empty when there is none).
    pub message: Vec<u8>,
    /// From the trailers, or the headers of a trailers-only answer.
    pub grpc_status: Option<String>,
}

/// A unary gRPC call with an empty request message, over h2c from inside `pod` to `addr`, with `authority` and
/// the method's `path` (`/<service>/<method>`). Err on connect/protocol failure or after [`CLIENT_TIMEOUT`].
pub async fn grpc_call(
    pod: Option<&TestPod>,
    addr: SocketAddr,
    authority: &str,
    path: &str,
    headers: &[(String, String)],
) -> Result<GrpcReply, String> {
    let socket = match pod {
        Some(pod) => pod
            .run(TcpSocket::new_v4)
            .map_err(|e| format!("socket in pod {}: {e}", pod.name()))?,
        None => TcpSocket::new_v4().map_err(|e| format!("socket: {e}"))?,
    };
    let mut req = Request::builder()
        .method("POST")
        .uri(format!("http://{authority}{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    for (name, value) in headers {
        req = req.header(name, value);
    }
    let req = req
        .body(Full::new(grpc_frame(b"")))
        .map_err(|e| format!("request: {e}"))?;
    let exchange = async move {
        let stream = socket.connect(addr).await.map_err(|e| format!("connect: {e}"))?;
        let (mut sender, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .map_err(|e| format!("handshake: {e}"))?;
        let driver = tokio::spawn(conn);
        let result = async {
            let resp = sender.send_request(req).await.map_err(|e| format!("send: {e}"))?;
            let status = resp.status().as_u16();
            let headers = joined(resp.headers());
            let body = resp.into_body().collect().await.map_err(|e| format!("body: {e}"))?;
            let trailers = body.trailers().map(joined).unwrap_or_default();
            let grpc_status = trailers.get("grpc-status").or(headers.get("grpc-status")).cloned();
            let bytes = body.to_bytes();
            let message = grpc_message(&bytes).unwrap_or_default().to_vec();
            Ok(GrpcReply {
                status,
                headers,
                message,
                grpc_status,
            })
        }
        .await;
        driver.abort();
        result
    };
    match tokio::time::timeout(CLIENT_TIMEOUT, exchange).await {
        Ok(result) => result.map_err(|e: String| format!("gRPC {path} to {addr} ({authority}): {e}")),
        Err(_) => Err(format!(
            "gRPC {path} to {addr} ({authority}): timed out after {CLIENT_TIMEOUT:?}"
        )),
    }
}

fn joined(headers: &HeaderMap) -> BTreeMap<String, String> {
    let mut out = BTreeMap::<String, String>::new();
    for (name, value) in headers {
        let value = String::from_utf8_lossy(value.as_bytes()).into_owned();
        out.entry(name.as_str().to_owned())
            .and_modify(|v| {
                v.push_str(", ");
                v.push_str(&value)
            })
            .or_insert(value);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fail_first_counts_each_key_apart() {
        let counters = EchoLedger::default();
        let fails: Vec<bool> = ["a:2", "a:2", "b:1", "a:2", "b:1"]
            .iter()
            .map(|spec| counters.should_fail(spec))
            .collect();
        assert_eq!(fails, [true, true, true, false, false]);
        assert!(!counters.should_fail("no count"));
        assert!(!counters.should_fail("k:x"));
    }

    #[test]
    fn grpc_frames_round_trip() {
        let frame = grpc_frame(b"{\"pod\":\"p\"}");
        assert_eq!(&frame[..5], &[0, 0, 0, 0, 11]);
        assert_eq!(grpc_message(&frame), Some(&b"{\"pod\":\"p\"}"[..]));
        assert_eq!(grpc_message(&frame[..7]), None);
    }
}
