//! ClusterIP capture with real nftables in a pod's netns: TCP to a mesh service's
//! ClusterIP reaches the capture listener (with the ClusterIP as its original
//! destination), TCP to any other ClusterIP leaves the pod untouched, and the set follows
//! the mesh's ClusterIPs without the ruleset counting as drifted.

use std::collections::BTreeSet;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener};
use std::path::Path;
use std::time::Duration;

use aether_agent::capture::{self, CaptureConfig, Verdict};
use aether_tests::netns::{TestNode, require_root};

const MESH_CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const OTHER_CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 99);

/// A connect from inside the netns, answered within 300 ms? If so, the original
/// destination the listener saw for it.
fn captured(netns: &Path, listener: &TcpListener, to: Ipv4Addr) -> Option<SocketAddrV4> {
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, SockaddrIn, connect, getpeername, socket};
    use std::os::fd::AsRawFd;
    let target = SocketAddrV4::new(to, 80);
    let established = aether_tests::cni::run_in(netns, move || {
        let fd = socket(AddressFamily::Inet, SockType::Stream, SockFlag::SOCK_NONBLOCK, None).unwrap();
        let _ = connect(fd.as_raw_fd(), &SockaddrIn::from(target));
        std::thread::sleep(Duration::from_millis(300));
        getpeername::<SockaddrIn>(fd.as_raw_fd()).is_ok().then_some(fd)
    });
    established?;
    let (accepted, _) = listener.accept().expect("the capture listener accepts the connection");
    let original = nix::sys::socket::getsockopt(&accepted, nix::sys::socket::sockopt::OriginalDst).unwrap();
    Some(SocketAddrV4::new(
        Ipv4Addr::from(u32::from_be(original.sin_addr.s_addr)),
        u16::from_be(original.sin_port),
    ))
}

/// The agent's default capture, its desired state kept under `state`.
fn default_config(state: &Path) -> CaptureConfig {
    CaptureConfig::new(
        state,
        capture::DEFAULT_VIP_CIDR.parse().unwrap(),
        None,
        capture::DEFAULT_PROXY_MARK,
    )
}

fn ips(ips: &[Ipv4Addr]) -> BTreeSet<Ipv4Addr> {
    ips.iter().copied().collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_mesh_cluster_ips_are_captured_and_the_set_follows_the_mesh() {
    require_root();
    let node = TestNode::new();
    let pod = node.add_pod("client");
    let netns = pod.netns_path();
    let state = tempfile::tempdir().unwrap();
    let config = default_config(state.path());
    config.cluster_ips.set(ips(&[MESH_CLUSTER_IP]));
    // The capture listener, in the pod's netns.
    let listener = aether_tests::cni::run_in(&netns, || {
        TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 18001))).expect("bind the capture port")
    });
    let options = capture::pod_capture(&config, None).unwrap().unwrap();
    capture::apply(&config, "ctr-client", &netns, &options).await.unwrap();

    let mesh = SocketAddrV4::new(MESH_CLUSTER_IP, 80);
    assert_eq!(captured(&netns, &listener, MESH_CLUSTER_IP), Some(mesh));
    assert_eq!(
        captured(&netns, &listener, OTHER_CLUSTER_IP),
        None,
        "a non-mesh ClusterIP is not captured"
    );

    // The mesh's ClusterIPs change: the pod's set is replaced, the rules stay as recorded.
    config.cluster_ips.set(ips(&[OTHER_CLUSTER_IP]));
    capture::cluster_ips::replace(&config, &netns, &config.cluster_ips.get())
        .await
        .unwrap();
    let other = SocketAddrV4::new(OTHER_CLUSTER_IP, 80);
    assert_eq!(captured(&netns, &listener, OTHER_CLUSTER_IP), Some(other));
    assert_eq!(captured(&netns, &listener, MESH_CLUSTER_IP), None);
    // Its counter: the two connections captured (one per set), none of the uncaptured.
    let verdict = capture::check(&config, "ctr-client", &netns).await.unwrap();
    assert!(matches!(verdict, Verdict::Intact(c) if c.captured == 2), "{verdict:?}");

    // A repaired table gets the current set back.
    assert!(pod.exec(&["nft", "delete", "table", "inet", "aether"]).status.success());
    assert!(capture::repair(&config, "ctr-client", &netns).await.unwrap());
    assert_eq!(captured(&netns, &listener, OTHER_CLUSTER_IP), Some(other));
    capture::remove(&config, "ctr-client", &netns).await.unwrap();
}

/// A retried ADD finds the table it applied before (the agent died before answering): the
/// new-table transaction is refused whole, and the replacing one leaves exactly one table
/// with one copy of each rule, now the retry's rules.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_add_replaces_the_table_it_finds() {
    require_root();
    let node = TestNode::new();
    let pod = node.add_pod("retried");
    let netns = pod.netns_path();
    let state = tempfile::tempdir().unwrap();
    let config = default_config(state.path());
    let listing = || String::from_utf8(pod.exec(&["nft", "list", "ruleset"]).stdout).unwrap();
    let permissive = capture::PodCapture {
        inbound_mtls: capture::InboundMtls::Permissive,
        ..capture::pod_capture(&config, None).unwrap().unwrap()
    };
    capture::apply(&config, "ctr-retried", &netns, &permissive)
        .await
        .unwrap();
    let first = listing();
    assert_eq!(first.matches("table inet aether").count(), 1, "{first}");
    assert!(
        !first.contains("chain inbound"),
        "permissive has no inbound chain: {first}"
    );
    assert!(first.contains("redirect to :"), "{first}");

    let strict = capture::PodCapture {
        inbound_mtls: capture::InboundMtls::Strict,
        ..permissive.clone()
    };
    capture::apply(&config, "ctr-retried", &netns, &strict).await.unwrap();
    let retried = listing();
    assert_eq!(retried.matches("table inet aether").count(), 1, "{retried}");
    assert_eq!(retried.matches("chain output").count(), 1, "{retried}");
    assert_eq!(retried.matches("chain inbound").count(), 1, "{retried}");
    assert_eq!(
        retried.matches("redirect to :").count(),
        first.matches("redirect to :").count(),
        "the output rules are not doubled:\n{first}\n---\n{retried}"
    );
    let verdict = capture::check(&config, "ctr-retried", &netns).await.unwrap();
    assert!(matches!(verdict, Verdict::Intact(_)), "{verdict:?}");
    capture::remove(&config, "ctr-retried", &netns).await.unwrap();
    assert!(!listing().contains("table inet aether"));
}
