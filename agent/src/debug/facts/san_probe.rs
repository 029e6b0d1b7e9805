//! The destination's SAN pin against destination pods on other nodes: the agent opens the
//! connection the source pod's call would (TLS to the endpoint's inbound listener,
//! `<pod IP>:18008`, presenting the source pod's own SVID, ALPN h2), verifies the
//! destination's chain against the node's trust bundles, and reads the SPIFFE ID it
//! presents. Nothing is sent after the handshake. Destination pods on this node are
//! judged from their SVIDs instead (`local_destinations`).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use aether_common::tls::{self, CertSlot, PeerIdentity, ServerIdentity};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::net::TcpStream;

use crate::explain::RemoteDestination;
use crate::identity::Svid;
use crate::xds::resources::INBOUND_PORT;

/// How long one probe may take (connect and handshake).
const PROBE_TIMEOUT: Duration = Duration::from_millis(800);
/// How many remote destination pods are probed, at once: enough to find a mismatched
/// one among a service's pods in one explain, bounded so explain stays fast.
pub const PROBED: usize = 4;

/// Probes `endpoints` (`(address, node)`, at most [`PROBED`]) as the pod holding `svid`.
pub async fn probe(
    svid: &Svid,
    bundles: &BTreeMap<String, String>,
    endpoints: &[(String, String)],
) -> Vec<RemoteDestination> {
    let config = match client_config(svid, bundles) {
        Ok(config) => config,
        Err(e) => {
            let presented = Err(format!("the probe has no TLS identity: {e}"));
            return endpoints
                .iter()
                .take(PROBED)
                .map(|(a, n)| remote(a, n, presented.clone()))
                .collect();
        }
    };
    let probes = endpoints.iter().take(PROBED).map(|(address, node)| {
        let config = config.clone();
        async move { remote(address, node, presented(config, address).await) }
    });
    futures::future::join_all(probes).await
}

fn remote(address: &str, node: &str, presented: Result<String, String>) -> RemoteDestination {
    RemoteDestination {
        address: address.to_owned(),
        node: node.to_owned(),
        presented,
    }
}

/// A client that presents the pod's SVID and trusts every bundle the node accepts peers from.
fn client_config(svid: &Svid, bundles: &BTreeMap<String, String>) -> Result<Arc<rustls::ClientConfig>, String> {
    let chain = CertificateDer::pem_slice_iter(svid.cert_chain_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("the SVID's chain: {e}"))?;
    let key = PrivateKeyDer::from_pem_slice(svid.key.pem().as_bytes()).map_err(|e| format!("the SVID's key: {e}"))?;
    let slot = CertSlot::new(tls::certified_key(chain, key).map_err(|e| e.to_string())?);
    let roots = bundles
        .values()
        .flat_map(|pem| CertificateDer::pem_slice_iter(pem.as_bytes()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("a trust bundle: {e}"))?;
    let roots = tls::roots("trust bundle", roots).map_err(|e| e.to_string())?;
    tls::client_config(roots, ServerIdentity::Trusted, slot).map_err(|e| e.to_string())
}

/// The SPIFFE ID the destination at `address` presents, or why none could be read.
async fn presented(config: Arc<rustls::ClientConfig>, address: &str) -> Result<String, String> {
    let ip: std::net::IpAddr = address
        .parse()
        .map_err(|_| format!("{address:?} is not an IP address"))?;
    let handshake = async {
        let tcp = TcpStream::connect((ip, INBOUND_PORT as u16))
            .await
            .map_err(|e| format!("connecting to {ip}:{INBOUND_PORT}: {e}"))?;
        let connector = tokio_rustls::TlsConnector::from(config);
        let tls = connector
            .connect(ServerName::IpAddress(ip.into()), tcp)
            .await
            .map_err(|e| format!("TLS handshake with {ip}:{INBOUND_PORT}: {e}"))?;
        let leaf = tls.get_ref().1.peer_certificates().and_then(|c| c.first()).cloned();
        leaf.ok_or_else(|| "the destination presented no certificate".to_owned())
    };
    let leaf = tokio::time::timeout(PROBE_TIMEOUT, handshake)
        .await
        .map_err(|_| format!("no TLS handshake with {ip}:{INBOUND_PORT} within {PROBE_TIMEOUT:?}"))??;
    let identity = PeerIdentity::from_leaf(&leaf).map_err(|e| e.to_string())?;
    identity
        .spiffe_id
        .clone()
        .ok_or_else(|| format!("the destination presents no SPIFFE ID ({})", identity.name()))
}
