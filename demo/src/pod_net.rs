//! Inside the pods: their resolv.conf, their echo app, and HTTP calls made from their network namespace.

use super::*;

/// Where `ip netns exec <name>` finds per-netns files it bind-mounts over `/etc` (here: the pod's resolv.conf).
pub(crate) const ETC_NETNS: &str = "/etc/netns";

/// The resolv.conf kubelet gives a pod (`dnsPolicy: ClusterFirst`): the cluster DNS, the namespace's search path.
/// Commands run with `ip netns exec` in the pod see it as /etc/resolv.conf.
pub(crate) fn write_pod_resolv_conf(netns: &str) -> Result<(), DemoError> {
    let dir = Path::new(ETC_NETNS).join(netns);
    let conf = format!(
        "nameserver {CLUSTER_DNS}\nsearch {NAMESPACE}.svc.cluster.local svc.cluster.local cluster.local\noptions ndots:5\n"
    );
    std::fs::create_dir_all(&dir)
        .and_then(|()| std::fs::write(dir.join("resolv.conf"), conf))
        .map_err(|e| fail(format!("writing {}/resolv.conf: {e}", dir.display())))
}

pub(crate) fn remove_pod_resolv_conf(netns: &str) -> Result<(), String> {
    let dir = Path::new(ETC_NETNS).join(netns);
    match std::fs::remove_dir_all(&dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(format!("removing {}: {e}", dir.display())),
    }
}

// ---- pods' apps and client --------------------------------------------------------------------------------------

pub(crate) fn serve_echo(netns: &Path, name: &str) -> Result<App, DemoError> {
    let listener = run_in(netns, || std::net::TcpListener::bind((Ipv4Addr::UNSPECIFIED, APP_PORT)))
        .map_err(|e| fail(format!("pod {name}: bind :{APP_PORT}: {e}")))?;
    listener
        .set_nonblocking(true)
        .map_err(|e| fail(format!("pod {name}: {e}")))?;
    let listener = tokio::net::TcpListener::from_std(listener).map_err(|e| fail(format!("pod {name}: {e}")))?;
    let name: Arc<str> = Arc::from(name);
    let served = Arc::new(AtomicU64::new(0));
    let task = tokio::spawn(async move {
        let mut connections = JoinSet::new();
        loop {
            tokio::select! {
                accepted = listener.accept() => {
                    let Ok((stream, _)) = accepted else { continue };
                    let (name, served) = (name.clone(), served.clone());
                    connections.spawn(async move {
                        let service = service_fn(move |req| {
                            served.fetch_add(1, Ordering::Relaxed);
                            echo(name.clone(), req)
                        });
                        let _ = auto::Builder::new(TokioExecutor::new())
                            .serve_connection(TokioIo::new(stream), service)
                            .await;
                    });
                }
                Some(_) = connections.join_next(), if !connections.is_empty() => {}
            }
        }
    });
    Ok(App { task })
}

pub(crate) async fn echo(name: Arc<str>, req: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    let mut headers: BTreeMap<String, String> = BTreeMap::new();
    for (k, v) in req.headers() {
        let v = String::from_utf8_lossy(v.as_bytes()).into_owned();
        headers
            .entry(k.as_str().to_owned())
            .and_modify(|old| {
                old.push_str(", ");
                old.push_str(&v);
            })
            .or_insert(v);
    }
    let body = json!({
        "pod": &*name,
        "method": req.method().as_str(),
        "path": req.uri().path(),
        "headers": headers,
    });
    Ok(Response::builder()
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("response"))
}

#[derive(Debug)]
pub(crate) struct Reply {
    pub(crate) status: u16,
    pub(crate) body: String,
}

impl Reply {
    pub(crate) fn json(&self) -> Result<Value, DemoError> {
        serde_json::from_str(&self.body)
            .map_err(|e| fail(format!("the answer is not the app's JSON ({e}): {}", self.body)))
    }
}

/// An HTTP/1.1 GET whose socket lives in the netns at `netns` (the pod's app making a call).
pub(crate) async fn get_in(netns: &Path, addr: SocketAddr, host: &str, path: &str) -> Result<Reply, String> {
    get_in_with(netns, addr, host, path, &[]).await
}

/// As [`get_in`], with extra request headers.
pub(crate) async fn get_in_with(
    netns: &Path,
    addr: SocketAddr,
    host: &str,
    path: &str,
    headers: &[(&str, &str)],
) -> Result<Reply, String> {
    let stream = run_in(netns, move || {
        std::net::TcpStream::connect_timeout(&addr, REQUEST_TIMEOUT)
    })
    .map_err(|e| format!("connect {addr}: {e}"))?;
    stream.set_nonblocking(true).map_err(|e| e.to_string())?;
    let stream = tokio::net::TcpStream::from_std(stream).map_err(|e| e.to_string())?;
    let exchange = async {
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| format!("handshake: {e}"))?;
        let driver = tokio::spawn(conn);
        let mut req = Request::get(path).header(hyper::header::HOST, host);
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        let req = req.body(Empty::<Bytes>::new()).map_err(|e| e.to_string())?;
        let resp = sender.send_request(req).await.map_err(|e| format!("request: {e}"))?;
        let status = resp.status().as_u16();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("body: {e}"))?
            .to_bytes();
        driver.abort();
        Ok(Reply {
            status,
            body: String::from_utf8_lossy(&body).into_owned(),
        })
    };
    tokio::time::timeout(REQUEST_TIMEOUT, exchange)
        .await
        .map_err(|_| format!("no answer within {REQUEST_TIMEOUT:?}"))?
}

/// The `URI=` values of an x-forwarded-client-cert header.
pub(crate) fn peer_uris(xfcc: &str) -> Vec<String> {
    xfcc.split([';', ','])
        .filter_map(|kv| kv.trim().strip_prefix("URI="))
        .map(|v| v.trim_matches('"').to_owned())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xfcc_uris_are_extracted() {
        let xfcc =
            "By=spiffe://cluster.local/ns/demo/sa/backend;Hash=ab;URI=spiffe://cluster.local/ns/demo/sa/frontend";
        assert_eq!(peer_uris(xfcc), ["spiffe://cluster.local/ns/demo/sa/frontend"]);
        assert!(peer_uris("Hash=ab").is_empty());
    }
}
