//! `edge::certificate`: what a listener's Secret must hold before Envoy sees it. Keys
//! and certificates are generated here (rcgen); none is committed.

mod edge_support;

use aether_api::edge::certificate;
use edge_support::{secret, tls_pair, tls_secret};

fn pair_for(alg: &'static rcgen::SignatureAlgorithm, hosts: &[&str]) -> (String, String) {
    let key = rcgen::KeyPair::generate_for(alg).unwrap();
    let names: Vec<String> = hosts.iter().map(|h| (*h).to_owned()).collect();
    let cert = rcgen::CertificateParams::new(names).unwrap().self_signed(&key).unwrap();
    (cert.pem(), key.serialize_pem())
}

#[test]
fn a_tls_secret_gives_its_chain_key_names_and_expiry() {
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params =
        rcgen::CertificateParams::new(vec!["Shop.Example.org".to_owned(), "*.shop.example.org".to_owned()]).unwrap();
    params.not_after = rcgen::date_time_ymd(2030, 1, 1);
    let cert = params.self_signed(&key).unwrap();
    let (chain, key) = (cert.pem(), key.serialize_pem());
    let s = secret(
        "edge",
        "shop",
        Some("kubernetes.io/tls"),
        &[("tls.crt", chain.as_bytes()), ("tls.key", key.as_bytes())],
    );
    let checked = certificate(&s).unwrap();
    assert_eq!(checked.dns_names, ["shop.example.org", "*.shop.example.org"]);
    assert_eq!(checked.not_after_unix, 1_893_456_000);
    assert_eq!(
        (checked.chain_pem.as_str(), checked.key_pem.as_str()),
        (chain.as_str(), key.as_str())
    );
}

#[test]
fn every_key_type_the_edge_serves_is_checked_against_its_certificate() {
    for alg in [
        &rcgen::PKCS_ECDSA_P256_SHA256,
        &rcgen::PKCS_ECDSA_P384_SHA384,
        &rcgen::PKCS_ED25519,
    ] {
        let (cert, key) = pair_for(alg, &["a.example.org"]);
        let (other_cert, _) = pair_for(alg, &["a.example.org"]);
        let good = secret(
            "edge",
            "s",
            None,
            &[("tls.crt", cert.as_bytes()), ("tls.key", key.as_bytes())],
        );
        assert!(certificate(&good).is_ok(), "{alg:?}");
        let swapped = secret(
            "edge",
            "s",
            None,
            &[("tls.crt", other_cert.as_bytes()), ("tls.key", key.as_bytes())],
        );
        let error = certificate(&swapped).unwrap_err();
        assert!(error.starts_with("data[tls.key]: does not match"), "{alg:?}: {error}");
    }
}

#[test]
fn a_chain_keeps_the_leaf_first_and_reads_the_leafs_names() {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca = rcgen::CertifiedIssuer::self_signed(ca_params, ca_key).unwrap();
    let leaf_key = rcgen::KeyPair::generate().unwrap();
    let leaf = rcgen::CertificateParams::new(vec!["leaf.example.org".to_owned()])
        .unwrap()
        .signed_by(&leaf_key, &ca)
        .unwrap();
    let chain = format!("{}{}", leaf.pem(), ca.pem());
    let key = leaf_key.serialize_pem();
    let s = secret(
        "edge",
        "s",
        Some("Opaque"),
        &[("tls.crt", chain.as_bytes()), ("tls.key", key.as_bytes())],
    );
    assert_eq!(certificate(&s).unwrap().dns_names, ["leaf.example.org"]);
    // The CA first: its key is not the one given.
    let reversed = format!("{}{}", ca.pem(), leaf.pem());
    let s = secret(
        "edge",
        "s",
        None,
        &[("tls.crt", reversed.as_bytes()), ("tls.key", key.as_bytes())],
    );
    assert!(certificate(&s).unwrap_err().contains("does not match"));
}

#[test]
fn what_is_not_a_usable_certificate_is_refused_naming_the_field() {
    let (cert, key) = tls_pair(&["a.example.org"]);
    let (c, k) = (cert.as_bytes(), key.as_bytes());
    type Data<'a> = Vec<(&'a str, &'a [u8])>;
    let cases: Vec<(Option<&str>, Data, &str)> = vec![
        (
            Some("kubernetes.io/basic-auth"),
            vec![("tls.crt", c), ("tls.key", k)],
            "type: \"kubernetes.io/basic-auth\"",
        ),
        (None, vec![("tls.key", k)], "data[tls.crt]: is missing"),
        (None, vec![("tls.crt", c)], "data[tls.key]: is missing"),
        (
            None,
            vec![("tls.crt", b""), ("tls.key", k)],
            "data[tls.crt]: is missing or empty",
        ),
        (
            None,
            vec![("tls.crt", b"Hello world\n"), ("tls.key", k)],
            "data[tls.crt]: holds no PEM CERTIFICATE",
        ),
        (
            None,
            vec![("tls.crt", k), ("tls.key", k)],
            "data[tls.crt]: holds no PEM CERTIFICATE",
        ),
        (
            None,
            vec![("tls.crt", c), ("tls.key", c)],
            "data[tls.key]: holds no PEM private key",
        ),
        (
            None,
            vec![("tls.crt", &[0xff, 0xfe]), ("tls.key", k)],
            "data[tls.crt]: is not PEM",
        ),
        (
            None,
            vec![
                (
                    "tls.crt",
                    b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
                ),
                ("tls.key", k),
            ],
            "data[tls.crt]: certificate 0 is not X.509",
        ),
        (
            None,
            vec![
                (
                    "tls.crt",
                    b"-----BEGIN CERTIFICATE-----\n!!!!\n-----END CERTIFICATE-----\n",
                ),
                ("tls.key", k),
            ],
            "data[tls.crt]: is not PEM",
        ),
    ];
    for (type_, data, expected) in cases {
        let s = secret("edge", "s", type_, &data);
        let error = certificate(&s).unwrap_err();
        assert!(error.starts_with(expected), "{expected} ← {error}");
    }
    let no_data = k8s_openapi::api::core::v1::Secret::default();
    assert!(
        certificate(&no_data)
            .unwrap_err()
            .starts_with("data[tls.crt]: is missing")
    );
}

#[test]
fn errors_quote_input_bounded() {
    let huge = "t".repeat(1 << 20);
    let s = secret("edge", "s", Some(&huge), &[]);
    let error = certificate(&s).unwrap_err();
    assert!(error.len() < 1024, "{} bytes", error.len());
    assert!(error.contains("(1048576 bytes)"), "{error}");
    let mut garbage = b"-----BEGIN CERTIFICATE-----\n".to_vec();
    garbage.extend(std::iter::repeat_n(b'!', 1 << 20));
    let s = secret("edge", "s", None, &[("tls.crt", &garbage), ("tls.key", b"x")]);
    assert!(certificate(&s).unwrap_err().len() < 1024);
}

#[test]
fn debug_never_prints_the_key() {
    let s = tls_secret("edge", "s", &["a.example.org"]);
    let checked = certificate(&s).unwrap();
    let printed = format!("{checked:?}");
    assert!(
        printed.contains("redacted") && printed.contains("a.example.org"),
        "{printed}"
    );
    assert!(
        !printed.contains("PRIVATE KEY") && !printed.contains(&checked.key_pem[40..80]),
        "{printed}"
    );
}

#[test]
fn the_debug_json_names_certificates_without_their_keys() {
    let w = edge_support::World::new()
        .secret(tls_secret("edge", "cert", &["a.example.org"]))
        .with(
            "kind: Gateway\nmetadata: {name: g, namespace: edge}\nspec:\n  gatewayClassName: aether\n  listeners:\n  \
             - {name: https, port: 443, protocol: HTTPS, tls: {certificateRefs: [{name: cert}]}}\n",
        );
    let edge = w.project("edge/g");
    let json = aether_api::edge::status_json(&edge);
    let certificate = &json["ports"][0]["listeners"][0]["certificates"][0];
    assert_eq!(
        (certificate["secret"].as_str(), certificate["dnsNames"][0].as_str()),
        (Some("edge/cert"), Some("a.example.org"))
    );
    assert_eq!(json["conditions"][0]["type"], "Accepted");
    assert!(!json.to_string().contains("PRIVATE KEY"));
}
