//! A reconnecting HTTP load generator that counts failures exactly (h2load does not reconnect after GOAWAY, and wrk
//! counts a server's graceful close as an error).
//!
//! Each connection sends requests back to back (HTTP/1.1 keep-alive, or several concurrent streams on one h2c
//! connection). When the server closes a connection gracefully (`Connection: close`, GOAWAY) the worker opens a new
//! one. A request is **failed** when it was sent and did not come back as a complete 200 within the timeout. A request
//! hyper hands back as never written to the wire (the connection closed first, or an HTTP/2 stream above GOAWAY's
//! last stream id), or one written but above the last stream id of the server's graceful GOAWAY, is sent again and
//! counted as **retried_unsent**: HTTP lets every client do that, no server processed it.

use parking_lot::Mutex;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::Request;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::{TcpSocket, TcpStream};
use tokio::task::JoinSet;

/// How long one request may take before it counts as failed.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How many failure descriptions a report keeps.
const MAX_ERRORS: usize = 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    /// HTTP/1.1 keep-alive: one request at a time per connection.
    Http1,
    /// h2c with prior knowledge: `streams` concurrent requests per connection.
    Http2,
}

#[derive(Clone, Debug)]
pub struct LoadSpec {
    pub target: SocketAddr,
    /// The Host header / `:authority`.
    pub host: String,
    pub path: String,
    pub protocol: Protocol,
    pub connections: usize,
    /// Concurrent streams per HTTP/2 connection (HTTP/1.1 always uses 1).
    pub streams: usize,
    /// Open the client sockets inside this network namespace (a pod's), else in the caller's.
    pub netns: Option<PathBuf>,
}

/// What the load saw so far.
#[derive(Clone, Debug, Default)]
pub struct LoadReport {
    pub ok: u64,
    pub failed: u64,
    pub retried_unsent: u64,
    pub connects: u64,
    pub connect_failures: u64,
    /// The first failures, described.
    pub errors: Vec<String>,
    pub elapsed: Duration,
}

impl LoadReport {
    /// Fails the test with the details unless nothing failed (requests, connects) and at least `min_ok` succeeded.
    pub fn assert_clean(&self, min_ok: u64) {
        assert!(
            self.failed == 0 && self.connect_failures == 0 && self.ok >= min_ok,
            "load was not clean (wanted 0 failed, 0 connect failures, ≥ {min_ok} ok): {self:#?}"
        );
    }
}

#[derive(Default)]
struct Counters {
    ok: AtomicU64,
    failed: AtomicU64,
    retried_unsent: AtomicU64,
    connects: AtomicU64,
    connect_failures: AtomicU64,
    errors: Mutex<Vec<String>>,
}

impl Counters {
    fn error(&self, counter: &AtomicU64, what: String) {
        counter.fetch_add(1, Ordering::SeqCst);
        let mut errors = self.errors.lock();
        if errors.len() < MAX_ERRORS {
            errors.push(what);
        }
    }
}

/// Running load; [`Load::stop`] ends it and returns the totals.
pub struct Load {
    stop: Arc<AtomicBool>,
    counters: Arc<Counters>,
    tasks: JoinSet<()>,
    started: Instant,
}

impl Load {
    /// Starts `spec.connections` workers on the current tokio runtime.
    pub fn start(spec: LoadSpec) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let counters = Arc::new(Counters::default());
        let spec = Arc::new(spec);
        let mut tasks = JoinSet::new();
        for _ in 0..spec.connections.max(1) {
            tasks.spawn(worker(spec.clone(), stop.clone(), counters.clone()));
        }
        Load {
            stop,
            counters,
            tasks,
            started: Instant::now(),
        }
    }

    /// The totals so far.
    pub fn report(&self) -> LoadReport {
        let c = &self.counters;
        LoadReport {
            ok: c.ok.load(Ordering::SeqCst),
            failed: c.failed.load(Ordering::SeqCst),
            retried_unsent: c.retried_unsent.load(Ordering::SeqCst),
            connects: c.connects.load(Ordering::SeqCst),
            connect_failures: c.connect_failures.load(Ordering::SeqCst),
            errors: c.errors.lock().clone(),
            elapsed: self.started.elapsed(),
        }
    }

    /// Waits until `n` more requests succeeded than when called (or panics after `timeout` with the report).
    pub async fn wait_ok(&self, n: u64, timeout: Duration) {
        let target = self.counters.ok.load(Ordering::SeqCst) + n;
        let deadline = Instant::now() + timeout;
        while self.counters.ok.load(Ordering::SeqCst) < target {
            assert!(
                Instant::now() < deadline,
                "load made no progress ({n} more ok wanted within {timeout:?}): {:#?}",
                self.report()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Lets in-flight requests finish (each ends within [`REQUEST_TIMEOUT`]) and returns the totals.
    pub async fn stop(mut self) -> LoadReport {
        self.stop.store(true, Ordering::SeqCst);
        while self.tasks.join_next().await.is_some() {}
        self.report()
    }
}

async fn worker(spec: Arc<LoadSpec>, stop: Arc<AtomicBool>, counters: Arc<Counters>) {
    while !stop.load(Ordering::SeqCst) {
        let stream = match connect(&spec).await {
            Ok(stream) => stream,
            Err(e) => {
                counters.error(&counters.connect_failures, format!("connect {}: {e}", spec.target));
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        counters.connects.fetch_add(1, Ordering::SeqCst);
        match spec.protocol {
            Protocol::Http1 => {
                let Ok((sender, conn)) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await else {
                    continue;
                };
                let driver = tokio::spawn(conn);
                send_until_closed(Sender::H1(sender), &spec, &stop, &counters).await;
                driver.abort();
            }
            Protocol::Http2 => {
                let handshake = hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream));
                let Ok((sender, conn)) = handshake.await else {
                    continue;
                };
                let driver = tokio::spawn(conn);
                let mut streams = JoinSet::new();
                for _ in 0..spec.streams.max(1) {
                    let (sender, spec, stop, counters) = (sender.clone(), spec.clone(), stop.clone(), counters.clone());
                    streams.spawn(async move { send_until_closed(Sender::H2(sender), &spec, &stop, &counters).await });
                }
                drop(sender);
                while streams.join_next().await.is_some() {}
                driver.abort();
            }
        }
    }
}

async fn connect(spec: &LoadSpec) -> std::io::Result<TcpStream> {
    let socket = match &spec.netns {
        None => TcpSocket::new_v4()?,
        Some(netns) => {
            let netns = netns.clone();
            // A fresh thread: setns changes only the calling thread, and pooled threads must not keep it.
            std::thread::spawn(move || {
                let file = std::fs::File::open(&netns)?;
                nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET).map_err(std::io::Error::from)?;
                TcpSocket::new_v4()
            })
            .join()
            .map_err(|_| std::io::Error::other("socket thread panicked"))??
        }
    };
    socket.set_nodelay(true)?;
    tokio::time::timeout(CONNECT_TIMEOUT, socket.connect(spec.target))
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out"))?
}

type H1 = hyper::client::conn::http1::SendRequest<Empty<Bytes>>;
type H2 = hyper::client::conn::http2::SendRequest<Empty<Bytes>>;

/// The request-sending half of either protocol.
enum Sender {
    H1(H1),
    H2(H2),
}

enum Unsent {
    /// Never written: safe to send again.
    Unsent,
    /// Written; the answer did not come.
    Failed(String),
}

fn classify<T>(mut e: hyper::client::conn::TrySendError<T>) -> Unsent {
    if e.take_message().is_some() {
        return Unsent::Unsent;
    }
    let error = e.into_error();
    // Written, but above the last stream id of the server's graceful GOAWAY: the server
    // says it did not process it, and HTTP/2 lets the client send it again (RFC 9113
    // §6.8). hyper hands such a request back only when it had not been written yet.
    let refused_by_goaway = std::error::Error::source(&error)
        .and_then(|s| s.downcast_ref::<h2::Error>())
        .is_some_and(|h2| h2.is_go_away() && h2.is_remote() && h2.reason() == Some(h2::Reason::NO_ERROR));
    if refused_by_goaway {
        Unsent::Unsent
    } else {
        Unsent::Failed(error_chain(&error))
    }
}

/// An error with its causes (hyper's own Display says only "http2 error").
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text += &format!(": {cause}");
        source = cause.source();
    }
    text
}

impl Sender {
    async fn ready(&mut self) -> bool {
        match self {
            Sender::H1(s) => s.ready().await.is_ok(),
            Sender::H2(s) => s.ready().await.is_ok(),
        }
    }

    async fn send(&mut self, req: Request<Empty<Bytes>>) -> Result<hyper::Response<hyper::body::Incoming>, Unsent> {
        match self {
            Sender::H1(s) => s.try_send_request(req).await.map_err(classify),
            Sender::H2(s) => s.try_send_request(req).await.map_err(classify),
        }
    }
}

async fn send_until_closed(mut sender: Sender, spec: &LoadSpec, stop: &AtomicBool, counters: &Counters) {
    while !stop.load(Ordering::SeqCst) {
        if !sender.ready().await {
            return; // closed by the server (gracefully or not): reconnect
        }
        let mut req = Request::builder().uri(&spec.path);
        req = match spec.protocol {
            Protocol::Http1 => req.header(hyper::header::HOST, &spec.host),
            Protocol::Http2 => req.uri(format!("http://{}{}", spec.host, spec.path)),
        };
        let req = req.body(Empty::<Bytes>::new()).expect("request");
        let exchange = async {
            let resp = sender.send(req).await?;
            let status = resp.status();
            let body = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| Unsent::Failed(format!("body: {e}")))?;
            if status != 200 {
                let body = String::from_utf8_lossy(&body.to_bytes())
                    .chars()
                    .take(200)
                    .collect::<String>();
                return Err(Unsent::Failed(format!("status {status}: {body}")));
            }
            Ok(())
        };
        match tokio::time::timeout(REQUEST_TIMEOUT, exchange).await {
            Ok(Ok(())) => {
                counters.ok.fetch_add(1, Ordering::SeqCst);
            }
            Ok(Err(Unsent::Unsent)) => {
                counters.retried_unsent.fetch_add(1, Ordering::SeqCst);
                return;
            }
            Ok(Err(Unsent::Failed(e))) => {
                counters.error(&counters.failed, format!("{:?} request: {e}", spec.protocol));
                return;
            }
            Err(_) => {
                counters.error(
                    &counters.failed,
                    format!("{:?} request: no answer within {REQUEST_TIMEOUT:?}", spec.protocol),
                );
                return;
            }
        }
    }
}
