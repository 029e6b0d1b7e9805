//! Test certificate authorities made with rcgen: the built-in CA's files for the agent,
//! SVIDs for the fake SPIRE agent, and client certificates for direct TLS probes.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};

/// The trust domain the tests' meshes use.
pub const TRUST_DOMAIN: &str = "aether.test";

/// A leaf certificate with its key.
#[derive(Clone)]
pub struct Leaf {
    pub spiffe_id: String,
    pub cert_der: Vec<u8>,
    pub cert_pem: String,
    pub key_der: Vec<u8>,
    pub key_pem: String,
    pub not_after: SystemTime,
}

impl Leaf {
    /// Writes `<stem>.crt` and `<stem>.key` into `dir` (for curl/openssl probes).
    pub fn write(&self, dir: &Path, stem: &str) -> (PathBuf, PathBuf) {
        let cert = dir.join(format!("{stem}.crt"));
        let key = dir.join(format!("{stem}.key"));
        std::fs::write(&cert, &self.cert_pem).unwrap();
        std::fs::write(&key, &self.key_pem).unwrap();
        (cert, key)
    }
}

pub struct TestCa {
    pub cert_pem: String,
    pub cert_der: Vec<u8>,
    key_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl TestCa {
    /// A fresh self-signed CA.
    pub fn new(name: &str) -> Self {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, name);
        params.distinguished_name = dn;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        params.not_before = (SystemTime::now() - Duration::from_secs(3600)).into();
        params.not_after = (SystemTime::now() + Duration::from_secs(86400)).into();
        let cert = params.self_signed(&key).unwrap();
        let key_pem = key.serialize_pem();
        Self {
            cert_pem: cert.pem(),
            cert_der: cert.der().to_vec(),
            key_pem,
            issuer: Issuer::new(params, key),
        }
    }

    /// Writes `ca.crt` and `ca.key` into `dir`: the built-in provider's `--ca-cert`/`--ca-key`.
    pub fn write(&self, dir: &Path) -> (PathBuf, PathBuf) {
        std::fs::create_dir_all(dir).unwrap();
        let cert = dir.join("ca.crt");
        let key = dir.join("ca.key");
        std::fs::write(&cert, &self.cert_pem).unwrap();
        std::fs::write(&key, &self.key_pem).unwrap();
        (cert, key)
    }

    /// A leaf naming `spiffe_id` (client and server auth), valid for `ttl`.
    pub fn issue(&self, spiffe_id: &str, ttl: Duration) -> Leaf {
        let now = SystemTime::now();
        self.issue_between(spiffe_id, now - Duration::from_secs(5), now + ttl)
    }

    /// A leaf naming `spiffe_id`, valid from `not_before` to `not_after` (an expired one
    /// when both are past).
    pub fn issue_between(&self, spiffe_id: &str, not_before: SystemTime, not_after: SystemTime) -> Leaf {
        let uri = SanType::URI(spiffe_id.to_owned().try_into().unwrap());
        let mut leaf = self.leaf(uri, not_before, not_after);
        leaf.spiffe_id = spiffe_id.to_owned();
        leaf
    }

    /// A server leaf naming the DNS name `dns`, valid for `ttl`.
    pub fn issue_server(&self, dns: &str, ttl: Duration) -> Leaf {
        let now = SystemTime::now();
        let name = SanType::DnsName(dns.to_owned().try_into().unwrap());
        self.leaf(name, now - Duration::from_secs(5), now + ttl)
    }

    /// A server leaf naming every DNS name of `names` (wildcards allowed), valid for `ttl`.
    pub fn issue_server_names(&self, names: &[&str], ttl: Duration) -> Leaf {
        let now = SystemTime::now();
        let sans = names
            .iter()
            .map(|n| SanType::DnsName((*n).to_owned().try_into().unwrap()))
            .collect();
        self.leaf_with(sans, now - Duration::from_secs(5), now + ttl)
    }

    fn leaf(&self, san: SanType, not_before: SystemTime, not_after: SystemTime) -> Leaf {
        self.leaf_with(vec![san], not_before, not_after)
    }

    fn leaf_with(&self, sans: Vec<SanType>, not_before: SystemTime, not_after: SystemTime) -> Leaf {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::default();
        params.subject_alt_names = sans;
        let mut dn = DistinguishedName::new();
        dn.push(DnType::OrganizationName, "aether-test");
        params.distinguished_name = dn;
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyAgreement];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        params.use_authority_key_identifier_extension = true;
        params.not_before = not_before.into();
        params.not_after = not_after.into();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        Leaf {
            spiffe_id: String::new(),
            cert_der: cert.der().to_vec(),
            cert_pem: cert.pem(),
            key_der: key.serialize_der(),
            key_pem: key.serialize_pem(),
            not_after,
        }
    }
}

/// `spiffe://aether.test/ns/<ns>/sa/<sa>`.
pub fn spiffe_id(ns: &str, sa: &str) -> String {
    format!("spiffe://{TRUST_DOMAIN}/ns/{ns}/sa/{sa}")
}
