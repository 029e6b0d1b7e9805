//! Running a netlink query inside another network namespace.
//!
//! `setns(2)` moves the calling thread into the namespace for good, so the query runs
//! on a thread of its own (never a pool thread that would later serve other work),
//! with its own single-threaded runtime and netlink connection; the thread ends with
//! the query. Both the agent (a pod's addresses) and the CNI plugin (the sandbox
//! interface's addresses) read their pods this way.

use std::future::Future;
use std::path::{Path, PathBuf};

/// Why a query in a netns failed. Each step's wording is what the agent and the plugin
/// reported before this was shared (`opening: …`, `setns: …`).
#[derive(Debug, thiserror::Error)]
pub enum NetlinkError {
    #[error("opening: {0}")]
    Open(std::io::Error),
    #[error("setns: {0}")]
    Setns(nix::Error),
    #[error("runtime: {0}")]
    Runtime(std::io::Error),
    #[error("netlink socket: {0}")]
    Socket(std::io::Error),
    /// The query's own error.
    #[error("{0}")]
    Query(Box<dyn std::error::Error + Send + Sync>),
    #[error("netlink thread panicked")]
    Panicked,
}

/// Runs `query` with a netlink handle inside the network namespace at `netns`, on a
/// thread of its own, and waits for it without blocking the caller's runtime.
pub async fn query<T, E, F, Fut>(netns: &Path, query: F) -> Result<T, NetlinkError>
where
    T: Send + 'static,
    F: FnOnce(rtnetlink::Handle) -> Fut + Send + 'static,
    Fut: Future<Output = Result<T, E>>,
    E: std::error::Error + Send + Sync + 'static,
{
    let path = netns.to_owned();
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let _ = tx.send(run_here(&path, query));
    });
    rx.await.map_err(|_| NetlinkError::Panicked)?
}

/// [`query`] for a caller outside any runtime: blocks until the query's thread ends.
pub fn query_blocking<T, E, F, Fut>(netns: &Path, query: F) -> Result<T, NetlinkError>
where
    T: Send + 'static,
    F: FnOnce(rtnetlink::Handle) -> Fut + Send + 'static,
    Fut: Future<Output = Result<T, E>>,
    E: std::error::Error + Send + Sync + 'static,
{
    let path: PathBuf = netns.to_owned();
    std::thread::spawn(move || run_here(&path, query))
        .join()
        .map_err(|_| NetlinkError::Panicked)?
}

/// Enters `netns` on the current thread and runs `query` there. Private: only the
/// threads spawned above, which end right after, may call it.
fn run_here<T, E, F, Fut>(netns: &Path, query: F) -> Result<T, NetlinkError>
where
    F: FnOnce(rtnetlink::Handle) -> Fut,
    Fut: Future<Output = Result<T, E>>,
    E: std::error::Error + Send + Sync + 'static,
{
    let file = std::fs::File::open(netns).map_err(NetlinkError::Open)?;
    nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET).map_err(NetlinkError::Setns)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .map_err(NetlinkError::Runtime)?;
    rt.block_on(async {
        let (conn, handle, _) = rtnetlink::new_connection().map_err(NetlinkError::Socket)?;
        tokio::spawn(conn);
        query(handle).await.map_err(|e| NetlinkError::Query(Box::new(e)))
    })
}
