//! The run's control-plane PKI (proposals/010): the registrar's serving certificate,
//! and a node CA issuing each simulated agent its node identity
//! `spiffe://<td>/aether/node/<node>`, so the registrar applies its own-node rule.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use aether_common::tls::{self, CertSlot, ServerIdentity};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};
use rustls::{ClientConfig, RootCertStore};
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

/// The DNS name the registrar's certificate carries and agents verify.
pub const REGISTRAR_NAME: &str = "aether-registrar.aether-system.svc";
pub const TRUST_DOMAIN: &str = "aether.sim";

pub struct Pki {
    dir: tempfile::TempDir,
    registrar_roots: Arc<RootCertStore>,
    node_ca: Issuer<'static, KeyPair>,
}

impl Pki {
    /// A fresh registrar CA and node CA; the registrar's files in a temp dir.
    pub fn new() -> std::io::Result<Pki> {
        let dir = tempfile::tempdir()?;
        let (registrar_ca, registrar_ca_der, _) = authority("aether sim registrar CA");
        let dns = SanType::DnsName(REGISTRAR_NAME.try_into().expect("a DNS name"));
        let (server, server_key) = leaf(&registrar_ca, dns);
        let (node_ca, _, node_ca_pem) = authority("aether sim node CA");
        std::fs::write(dir.path().join("registrar.crt"), server.pem())?;
        std::fs::write(dir.path().join("registrar.key"), server_key.serialize_pem())?;
        std::fs::write(dir.path().join("node-ca.crt"), node_ca_pem)?;
        Ok(Pki {
            registrar_roots: tls::roots("registrar CA", vec![registrar_ca_der]).expect("a CA certificate"),
            node_ca,
            dir,
        })
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The registrar's TLS flags: its certificate, the node CA it trusts, the trust domain.
    pub fn registrar_args(&self) -> Vec<String> {
        let path = |name: &str| self.path(name).display().to_string();
        vec![
            "--tls-cert".into(),
            path("registrar.crt"),
            "--tls-key".into(),
            path("registrar.key"),
            "--node-ca-cert".into(),
            path("node-ca.crt"),
            "--trust-domain".into(),
            TRUST_DOMAIN.into(),
        ]
    }

    /// The TLS client of the agent of `node`: a fresh node certificate and key.
    pub fn agent_tls(&self, node: &str) -> Arc<ClientConfig> {
        let id = format!("spiffe://{TRUST_DOMAIN}/aether/node/{node}");
        let (cert, key) = leaf(&self.node_ca, SanType::URI(id.try_into().expect("a SPIFFE ID")));
        let identity = tls::certified_key(
            vec![cert.der().clone()],
            PrivateKeyDer::Pkcs8(key.serialize_der().into()),
        )
        .expect("a node identity");
        tls::client_config(
            self.registrar_roots.clone(),
            ServerIdentity::Dns(REGISTRAR_NAME.into()),
            CertSlot::new(identity),
        )
        .expect("an agent's TLS client")
    }
}

/// A self-signed CA: its issuer, certificate (DER) and certificate (PEM).
fn authority(name: &str) -> (Issuer<'static, KeyPair>, CertificateDer<'static>, String) {
    let key = KeyPair::generate().expect("a CA key");
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, name);
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::DigitalSignature];
    params.not_before = (SystemTime::now() - Duration::from_secs(3600)).into();
    params.not_after = (SystemTime::now() + Duration::from_secs(86400)).into();
    let cert = params.self_signed(&key).expect("a CA certificate");
    let (der, pem) = (cert.der().clone(), cert.pem());
    (Issuer::new(params, key), der, pem)
}

/// A day-long leaf for client and server auth naming `san`.
fn leaf(issuer: &Issuer<'static, KeyPair>, san: SanType) -> (rcgen::Certificate, KeyPair) {
    let key = KeyPair::generate().expect("a leaf key");
    let mut params = CertificateParams::default();
    params.subject_alt_names = vec![san];
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
    params.use_authority_key_identifier_extension = true;
    params.not_before = (SystemTime::now() - Duration::from_secs(60)).into();
    params.not_after = (SystemTime::now() + Duration::from_secs(86400)).into();
    let cert = params.signed_by(&key, issuer).expect("a leaf certificate");
    (cert, key)
}
