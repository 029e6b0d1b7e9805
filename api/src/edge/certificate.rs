//! A listener's certificate: a `kubernetes.io/tls` Secret, checked before Envoy sees it
//! (PEM that parses, a leaf whose public key is the private key's), so a bad Secret is a
//! listener condition and never a rejected Envoy update.

use std::fmt;

use aether_common::quote::{clip, quote};
use k8s_openapi::api::core::v1::Secret;
use rustls::crypto::aws_lc_rs;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::sign::CertifiedKey;
use x509_parser::extensions::GeneralName;

/// The Secret type the API's core support names.
pub const TLS_SECRET_TYPE: &str = "kubernetes.io/tls";
/// The key of the PEM certificate chain, leaf first.
pub const CERT_KEY: &str = "tls.crt";
/// The key of the PEM private key (PKCS#8, SEC1 or PKCS#1).
pub const KEY_KEY: &str = "tls.key";
/// The longest chain taken (a leaf and its intermediates).
const MAX_CHAIN: usize = 16;

/// A TLS certificate from a `kubernetes.io/tls` Secret, checked.
#[derive(Clone, PartialEq, Eq)]
pub struct Certificate {
    /// The chain as the Secret holds it, PEM, leaf first.
    pub chain_pem: String,
    /// The private key, PEM. Never printed (see the Debug impl).
    pub key_pem: String,
    /// DNS SANs of the leaf, lower-case.
    pub dns_names: Vec<String>,
    /// The leaf's notAfter, seconds since the epoch.
    pub not_after_unix: i64,
}

impl fmt::Debug for Certificate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Certificate")
            .field("chain_pem", &format_args!("({} bytes)", self.chain_pem.len()))
            .field("key_pem", &format_args!("(redacted)"))
            .field("dns_names", &self.dns_names)
            .field("not_after_unix", &self.not_after_unix)
            .finish()
    }
}

/// Checks a Secret: type `kubernetes.io/tls` (or `Opaque` holding the same two keys),
/// `data` holding `tls.crt` and `tls.key`, both PEM, at least one certificate (each one
/// X.509), a private key whose public key is the leaf's. The error names the field and
/// quotes input bounded.
pub fn certificate(secret: &Secret) -> Result<Certificate, String> {
    match secret.type_.as_deref() {
        None | Some(TLS_SECRET_TYPE) | Some("Opaque") => {}
        Some(other) => {
            return Err(format!("type: {} is not {TLS_SECRET_TYPE}", quote(other)));
        }
    }
    let data = |key: &str| -> Result<String, String> {
        let bytes = (secret.data.as_ref())
            .and_then(|data| data.get(key))
            .map(|b| b.0.as_slice())
            .unwrap_or_default();
        if bytes.is_empty() {
            return Err(format!("data[{key}]: is missing or empty"));
        }
        String::from_utf8(bytes.to_vec()).map_err(|_| format!("data[{key}]: is not PEM (not UTF-8 text)"))
    };
    let chain_pem = data(CERT_KEY)?;
    let key_pem = data(KEY_KEY)?;
    let chain = CertificateDer::pem_slice_iter(chain_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("data[{CERT_KEY}]: is not PEM: {}", clip(&e.to_string())))?;
    if chain.is_empty() {
        return Err(format!("data[{CERT_KEY}]: holds no PEM CERTIFICATE block"));
    }
    if chain.len() > MAX_CHAIN {
        return Err(format!(
            "data[{CERT_KEY}]: holds {} certificates (at most {MAX_CHAIN})",
            chain.len()
        ));
    }
    let mut parsed = Vec::with_capacity(chain.len());
    for (i, der) in chain.iter().enumerate() {
        match x509_parser::parse_x509_certificate(der) {
            Ok((_, cert)) => parsed.push(cert),
            Err(e) => {
                return Err(format!(
                    "data[{CERT_KEY}]: certificate {i} is not X.509: {}",
                    clip(&e.to_string())
                ));
            }
        }
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
        .map_err(|e| format!("data[{KEY_KEY}]: holds no PEM private key: {}", clip(&e.to_string())))?;
    let provider = aws_lc_rs::default_provider();
    let signing_key = (provider.key_provider.load_private_key(key))
        .map_err(|e| format!("data[{KEY_KEY}]: is not a usable private key: {}", clip(&e.to_string())))?;
    CertifiedKey::new(chain.clone(), signing_key)
        .keys_match()
        .map_err(|e| {
            format!(
                "data[{KEY_KEY}]: does not match the certificate's public key ({})",
                clip(&e.to_string())
            )
        })?;
    let leaf = &parsed[0];
    let mut dns_names: Vec<String> = Vec::new();
    match leaf.subject_alternative_name() {
        Ok(Some(san)) => {
            for name in &san.value.general_names {
                if let GeneralName::DNSName(name) = name {
                    let lower = name.to_ascii_lowercase();
                    if !dns_names.contains(&lower) {
                        dns_names.push(lower);
                    }
                }
            }
        }
        Ok(None) => {}
        Err(e) => {
            return Err(format!(
                "data[{CERT_KEY}]: the leaf's subjectAltName is malformed: {}",
                clip(&e.to_string())
            ));
        }
    }
    Ok(Certificate {
        not_after_unix: leaf.validity().not_after.timestamp(),
        chain_pem,
        key_pem,
        dns_names,
    })
}
