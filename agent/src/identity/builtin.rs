//! The built-in CA: a CA certificate and key from files (a mounted Secret in a
//! cluster; `make demo` generates one) signing a short-lived SVID per local pod, with
//! a fresh key each time, re-issued at half-life. For clusters without SPIRE and for
//! local runs.

use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use aether_common::tls::pem_blocks;
use rcgen::{
    CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
    SanType,
};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::{Identities, IdentityConfig, IdentityError, IdentityMetrics, PrivateKey, Svid, spiffe_id};
use crate::pod::LocalPod;

/// Certificates are valid from a little before issue, for clocks a little behind ours.
const BACKDATE_MAX: Duration = Duration::from_secs(60);

pub struct Builtin {
    inner: Arc<Inner>,
}

struct Inner {
    trust_domain: String,
    ttl: Duration,
    issuer: Issuer<'static, KeyPair>,
    /// Intermediates between the signing CA and the trust anchor (PEM), sent with each leaf.
    chain_pem: String,
    state: Arc<watch::Sender<Arc<Identities>>>,
    /// Local pods and when each one's SVID is due for rotation.
    pods: Mutex<BTreeMap<String, Local>>,
    metrics: IdentityMetrics,
}

struct Local {
    spiffe_id: String,
    rotate_at: SystemTime,
}

impl Builtin {
    pub fn start(
        config: &IdentityConfig,
        state: Arc<watch::Sender<Arc<Identities>>>,
        metrics: IdentityMetrics,
        shutdown: CancellationToken,
    ) -> Result<Self, IdentityError> {
        let read = |flag, path: &std::path::Path| {
            std::fs::read_to_string(path).map_err(|source| IdentityError::Read {
                flag,
                path: path.display().to_string(),
                source,
            })
        };
        let cert_text = read("--ca-cert", &config.ca_cert)?;
        let key_text = read("--ca-key", &config.ca_key)?;
        let blocks: Vec<String> = pem_blocks(&cert_text)
            .into_iter()
            .filter(|b| b.starts_with("-----BEGIN CERTIFICATE-----"))
            .collect();
        let flag_err = |flag, reason: String| IdentityError::Flag { flag, reason };
        let signing = blocks
            .first()
            .ok_or_else(|| flag_err("--ca-cert", "no PEM CERTIFICATE block".into()))?;
        let key =
            KeyPair::from_pem(&key_text).map_err(|e| flag_err("--ca-key", format!("not a PEM private key: {e}")))?;
        let issuer = Issuer::from_ca_cert_pem(signing, key)
            .map_err(|e| flag_err("--ca-cert", format!("not a usable CA certificate: {e}")))?;
        check_ca(signing)?;
        if config.svid_ttl < Duration::from_secs(1) {
            return Err(flag_err("--svid-ttl", "must be at least 1s".into()));
        }
        // The last certificate of the file is the trust anchor; any between are intermediates.
        let anchor = blocks.last().expect("non-empty").clone();
        let chain_pem = if blocks.len() > 1 {
            blocks[..blocks.len() - 1].concat()
        } else {
            String::new()
        };
        state.send_modify(|ids| {
            let mut next = (**ids).clone();
            next.bundles.insert(config.trust_domain.clone(), anchor);
            *ids = Arc::new(next);
        });
        let inner = Arc::new(Inner {
            trust_domain: config.trust_domain.clone(),
            ttl: config.svid_ttl,
            issuer,
            chain_pem: chain_pem
                .strip_prefix(signing.as_str())
                .unwrap_or(&chain_pem)
                .to_owned(),
            state,
            pods: Mutex::default(),
            metrics,
        });
        tokio::spawn(rotate(inner.clone(), shutdown));
        tracing::info!(trust_domain = %config.trust_domain, ttl = ?config.svid_ttl, "built-in CA loaded");
        Ok(Self { inner })
    }

    pub fn sync(&self, pods: &[LocalPod]) {
        self.inner.sync(pods);
    }
}

fn check_ca(pem: &str) -> Result<(), IdentityError> {
    let fail = |reason: String| IdentityError::Flag {
        flag: "--ca-cert",
        reason,
    };
    let der = pem_blocks(pem)
        .first()
        .and_then(|b| decode_pem_body(b))
        .ok_or_else(|| fail("bad PEM".into()))?;
    let (_, cert) = x509_parser::parse_x509_certificate(&der).map_err(|e| fail(format!("{e}")))?;
    if !cert.is_ca() {
        return Err(fail(
            "the certificate is not a CA (basicConstraints CA:FALSE or absent)".into(),
        ));
    }
    if !cert.validity().is_valid() {
        return Err(fail("the CA certificate is expired or not yet valid".into()));
    }
    Ok(())
}

fn decode_pem_body(block: &str) -> Option<Vec<u8>> {
    let body: String = block.lines().filter(|l| !l.starts_with("-----")).collect();
    let mut out = Vec::with_capacity(body.len() * 3 / 4);
    let mut acc = 0u32;
    let mut bits = 0;
    for c in body.bytes() {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            b'=' => continue,
            _ => return None,
        };
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    Some(out)
}

impl Inner {
    fn issue(&self, spiffe_id: &str) -> Result<(Svid, SystemTime), IdentityError> {
        let fail = |reason: String| IdentityError::Issue {
            spiffe_id: spiffe_id.to_owned(),
            reason,
        };
        let key = KeyPair::generate().map_err(|e| fail(e.to_string()))?;
        let mut params = CertificateParams::default();
        let uri = spiffe_id
            .to_owned()
            .try_into()
            .map_err(|e: rcgen::Error| fail(e.to_string()))?;
        params.subject_alt_names = vec![SanType::URI(uri)];
        let mut dn = DistinguishedName::new();
        dn.push(DnType::OrganizationName, "aether");
        params.distinguished_name = dn;
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyAgreement];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        params.use_authority_key_identifier_extension = true;
        let now = SystemTime::now();
        let not_before = now - (self.ttl / 8).min(BACKDATE_MAX);
        let not_after = now + self.ttl;
        params.not_before = not_before.into();
        params.not_after = not_after.into();
        let cert = params.signed_by(&key, &self.issuer).map_err(|e| fail(e.to_string()))?;
        let serial = x509_parser::parse_x509_certificate(cert.der())
            .map(|(_, c)| c.raw_serial_as_string())
            .unwrap_or_default();
        let svid = Svid {
            spiffe_id: spiffe_id.to_owned(),
            cert_chain_pem: format!("{}{}", cert.pem(), self.chain_pem),
            key: PrivateKey::new(key.serialize_pem()),
            not_before,
            not_after,
            serial,
        };
        Ok((svid, now + self.ttl / 2))
    }

    fn sync(&self, pods: &[LocalPod]) {
        let mut local = self.pods.lock();
        let mut issued = BTreeMap::new();
        let mut gone = Vec::new();
        let wanted: BTreeMap<String, String> = pods
            .iter()
            .map(|p| (p.id(), spiffe_id(&self.trust_domain, &p.info)))
            .collect();
        for id in local.keys() {
            if !wanted.contains_key(id) {
                gone.push(id.clone());
            }
        }
        for id in &gone {
            local.remove(id);
        }
        for (id, spiffe) in &wanted {
            if local.get(id).is_some_and(|l| &l.spiffe_id == spiffe) {
                continue;
            }
            match self.issue(spiffe) {
                Ok((svid, rotate_at)) => {
                    local.insert(
                        id.clone(),
                        Local {
                            spiffe_id: spiffe.clone(),
                            rotate_at,
                        },
                    );
                    issued.insert(id.clone(), Arc::new(svid));
                }
                Err(error) => {
                    self.metrics.errors.inc();
                    tracing::error!(pod = %id, %error, "issuing an SVID failed");
                }
            }
        }
        self.publish(issued, &gone, local.len());
    }

    fn publish(&self, issued: BTreeMap<String, Arc<Svid>>, gone: &[String], count: usize) {
        if issued.is_empty() && gone.is_empty() {
            return;
        }
        for (id, svid) in &issued {
            tracing::info!(pod = %id, spiffe_id = %svid.spiffe_id, serial = %svid.serial, "SVID issued");
        }
        self.metrics.issued.inc_by(issued.len() as u64);
        self.metrics.withdrawn.inc_by(gone.len() as u64);
        self.metrics.svids.set(count as i64);
        self.state.send_modify(|ids| {
            let mut next = (**ids).clone();
            for id in gone {
                next.svids.remove(id);
            }
            next.svids.extend(issued);
            *ids = Arc::new(next);
        });
    }
}

/// Re-issues every SVID past its half-life.
async fn rotate(inner: Arc<Inner>, shutdown: CancellationToken) {
    let tick = (inner.ttl / 10).clamp(Duration::from_millis(50), Duration::from_secs(10));
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(tick) => {}
        }
        let now = SystemTime::now();
        let mut local = inner.pods.lock();
        let mut issued = BTreeMap::new();
        for (id, pod) in local.iter_mut().filter(|(_, l)| l.rotate_at <= now) {
            match inner.issue(&pod.spiffe_id) {
                Ok((svid, rotate_at)) => {
                    pod.rotate_at = rotate_at;
                    issued.insert(id.clone(), Arc::new(svid));
                }
                Err(error) => {
                    inner.metrics.errors.inc();
                    tracing::error!(pod = %id, %error, "rotating an SVID failed; retrying");
                }
            }
        }
        inner.publish(issued, &[], local.len());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        #[test]
        fn any_bytes_round_trip_through_pem(der in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..600)) {
            let pem = super::super::pem_encode("CERTIFICATE", &der);
            let blocks = pem_blocks(&pem);
            proptest::prop_assert_eq!(blocks.len(), 1);
            proptest::prop_assert_eq!(decode_pem_body(&blocks[0]).unwrap(), der);
        }

        #[test]
        fn pem_decoding_never_panics(text in ".{0,300}") {
            for block in pem_blocks(&text) {
                let _ = decode_pem_body(&block);
            }
        }
    }

    #[test]
    fn a_ca_file_that_is_not_a_ca_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let key = KeyPair::generate().unwrap();
        let leaf = CertificateParams::new(vec!["leaf.test".to_owned()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        std::fs::write(dir.path().join("ca.crt"), leaf.pem()).unwrap();
        std::fs::write(dir.path().join("ca.key"), key.serialize_pem()).unwrap();
        let err = check_ca(&leaf.pem()).unwrap_err().to_string();
        assert!(err.starts_with("--ca-cert: the certificate is not a CA"), "{err}");
    }

    #[test]
    fn pem_round_trips() {
        let der: Vec<u8> = (0..=255u8).collect();
        let pem = super::super::pem_encode("CERTIFICATE", &der);
        assert_eq!(decode_pem_body(&pem_blocks(&pem)[0]).unwrap(), der);
    }
}
