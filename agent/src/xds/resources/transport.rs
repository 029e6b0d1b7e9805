//! The transport between pods: mTLS with each pod's own SVID, or plaintext when the
//! agent runs with `--identity none` (NOT FOR PRODUCTION: benchmarks and debugging).
//!
//! - Inbound (`:18008`): the pod's SVID (`svid|<ns>/<pod>` over SDS), a client
//!   certificate required and verified against the trust bundles (`spiffe://<td>` over
//!   SDS: SPIFFE validator, one CA set per trust domain, federated ones included).
//! - Outbound: service clusters are shared by every local pod, so TLS is not theirs:
//!   each pod has one originate cluster presenting its SVID, and a connection reaches
//!   the one of the pod it came from (see `origination`). A connection without a source
//!   pod reaches none and is closed: no node identity, ever. The expected server SANs
//!   are pinned per destination service.

use envoy_types::pb::envoy::config::core::v3::{
    DataSource, TransportSocket, TypedExtensionConfig, data_source, transport_socket,
};
use envoy_types::pb::envoy::config::listener::v3::{Filter, filter};
use envoy_types::pb::envoy::extensions::filters::common::set_filter_state::v3::{FilterStateValue, filter_state_value};
use envoy_types::pb::envoy::extensions::filters::network::set_filter_state::v3::Config as SetFilterState;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    CertificateValidationContext, CommonTlsContext, DownstreamTlsContext, SdsSecretConfig, Secret,
    SpiffeCertValidatorConfig, SubjectAltNameMatcher, TlsCertificate, TlsParameters, UpstreamTlsContext,
    common_tls_context, secret, spiffe_cert_validator_config, subject_alt_name_matcher, tls_parameters,
};
use envoy_types::pb::envoy::r#type::matcher::v3::{StringMatcher, string_matcher};
use envoy_types::pb::google::protobuf::{Any, BoolValue};

use super::util::{ads, any, format_string};
use crate::identity::{Identities, bundle_secret, svid_secret};

/// The filter state key carrying the source pod's id (`<ns>/<pod>`) through the
/// origination hop, which picks the pod's originate cluster by it.
pub const SOURCE_FILTER_STATE: &str = "aether.source_pod";
/// The filter state key carrying the source pod's SPIFFE ID on its own connections, for
/// the authorization of its calls to external services (`authorization::egress`).
pub const SOURCE_IDENTITY: &str = "aether.source_identity";
/// ALPN of HTTP between pods (the inbound listener picks its HTTP chain by it).
pub const ALPN_H2: &str = "h2";

/// mTLS settings of the node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mtls {
    pub trust_domain: String,
}

impl Mtls {
    /// The SPIFFE ID a service account of `namespace` has in this trust domain.
    pub fn spiffe_id(&self, namespace: &str, service_account: &str) -> String {
        format!("spiffe://{}/ns/{namespace}/sa/{service_account}", self.trust_domain)
    }
}

fn tls_socket(config: Any) -> TransportSocket {
    TransportSocket {
        name: "envoy.transport_sockets.tls".into(),
        config_type: Some(transport_socket::ConfigType::TypedConfig(config)),
    }
}

fn sds(name: &str) -> SdsSecretConfig {
    SdsSecretConfig {
        name: name.to_owned(),
        sds_config: ads(),
    }
}

fn tls13() -> Option<TlsParameters> {
    Some(TlsParameters {
        tls_minimum_protocol_version: tls_parameters::TlsProtocol::TlSv13 as i32,
        tls_maximum_protocol_version: tls_parameters::TlsProtocol::TlSv13 as i32,
        ..Default::default()
    })
}

fn upstream_context(mtls: &Mtls, secret: &str) -> UpstreamTlsContext {
    // Any identity of our trust domain; the destination service's own SANs are checked
    // as well, from filter state set per connection (see `origination`).
    let in_trust_domain = CertificateValidationContext {
        match_typed_subject_alt_names: vec![SubjectAltNameMatcher {
            san_type: subject_alt_name_matcher::SanType::Uri as i32,
            matcher: Some(StringMatcher {
                match_pattern: Some(string_matcher::MatchPattern::Prefix(format!(
                    "spiffe://{}/",
                    mtls.trust_domain
                ))),
                ..Default::default()
            }),
            ..Default::default()
        }],
        ..Default::default()
    };
    UpstreamTlsContext {
        common_tls_context: Some(CommonTlsContext {
            tls_params: tls13(),
            // ALPN comes per connection from the origination hop (h2 for HTTP).
            tls_certificate_sds_secret_configs: vec![sds(secret)],
            validation_context_type: Some(common_tls_context::ValidationContextType::CombinedValidationContext(
                common_tls_context::CombinedCertificateValidationContext {
                    default_validation_context: Some(in_trust_domain),
                    validation_context_sds_secret_config: Some(sds(&bundle_secret(&mtls.trust_domain))),
                    ..Default::default()
                },
            )),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The upstream TLS socket of a pod's originate cluster: that pod's SVID, and nothing
/// any other pod's connection can reach.
pub fn pod_upstream(mtls: &Mtls, pod_id: &str) -> TransportSocket {
    tls_socket(any(&upstream_context(mtls, &svid_secret(pod_id))))
}

/// The transport socket of a pod's inbound listener chains: the pod's SVID, a client
/// certificate from a trusted domain required.
pub fn downstream(mtls: Option<&Mtls>, pod_id: &str, http: bool) -> Option<TransportSocket> {
    let mtls = mtls?;
    let context = DownstreamTlsContext {
        require_client_certificate: Some(BoolValue { value: true }),
        common_tls_context: Some(CommonTlsContext {
            tls_params: tls13(),
            alpn_protocols: if http { vec![ALPN_H2.into()] } else { Vec::new() },
            tls_certificate_sds_secret_configs: vec![sds(&svid_secret(pod_id))],
            validation_context_type: Some(
                common_tls_context::ValidationContextType::ValidationContextSdsSecretConfig(sds(&bundle_secret(
                    &mtls.trust_domain,
                ))),
            ),
            ..Default::default()
        }),
        ..Default::default()
    };
    Some(tls_socket(any(&context)))
}

/// The network filter that marks a pod's outgoing connections with the pod (first in
/// every chain of its outbound and capture listeners). The value is hashable, so it is
/// part of every upstream connection pool's key on the way (two pods never share an
/// upstream connection), and shared transitively, so it crosses the internal hop, which
/// picks the pod's originate cluster by it.
/// Also the pod's SPIFFE ID, read by the authorization of its calls to external services
/// (not shared: nothing upstream needs it).
pub fn source_filter(mtls: Option<&Mtls>, pod: &crate::pod::LocalPod) -> Option<Filter> {
    let mtls = mtls?;
    let value = |key: &str, factory: &str, text: String, shared| FilterStateValue {
        factory_key: factory.into(),
        shared_with_upstream: shared as i32,
        key: Some(filter_state_value::Key::ObjectKey(key.to_owned())),
        value: Some(filter_state_value::Value::FormatString(format_string(
            text.replace('%', "%%"),
        ))),
        ..Default::default()
    };
    let identity = mtls.spiffe_id(&pod.info.namespace, &pod.info.service_account);
    let config = SetFilterState {
        on_new_connection: vec![
            value(
                SOURCE_FILTER_STATE,
                "envoy.hashable_string",
                pod.id(),
                filter_state_value::SharedWithUpstream::Transitive,
            ),
            value(
                SOURCE_IDENTITY,
                "envoy.string",
                identity,
                filter_state_value::SharedWithUpstream::None,
            ),
        ],
        ..Default::default()
    };
    Some(Filter {
        name: "envoy.filters.network.set_filter_state".into(),
        config_type: Some(filter::ConfigType::TypedConfig(any(&config))),
    })
}

/// The upstream TLS socket of an edge gateway's cluster: the gateway's own SVID (an
/// edge Envoy has one identity, so the socket is the cluster's own and needs no
/// origination hop), the destination service's SPIFFE IDs pinned, ALPN h2 for HTTP, and
/// for a TCP stream the server name that names the app port at the peer.
pub fn edge_upstream(
    mtls: &Mtls,
    svid: &str,
    sans: &[String],
    http: bool,
    stream_port: Option<u32>,
) -> TransportSocket {
    let pinned = CertificateValidationContext {
        match_typed_subject_alt_names: (sans.iter())
            .map(|san| SubjectAltNameMatcher {
                san_type: subject_alt_name_matcher::SanType::Uri as i32,
                matcher: Some(StringMatcher {
                    match_pattern: Some(string_matcher::MatchPattern::Exact(san.clone())),
                    ..Default::default()
                }),
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    };
    let context = UpstreamTlsContext {
        sni: stream_port
            .map(super::origination::port_server_name)
            .unwrap_or_default(),
        common_tls_context: Some(CommonTlsContext {
            tls_params: tls13(),
            alpn_protocols: if http { vec![ALPN_H2.into()] } else { Vec::new() },
            tls_certificate_sds_secret_configs: vec![sds(svid)],
            validation_context_type: Some(common_tls_context::ValidationContextType::CombinedValidationContext(
                common_tls_context::CombinedCertificateValidationContext {
                    default_validation_context: Some(pinned),
                    validation_context_sds_secret_config: Some(sds(&bundle_secret(&mtls.trust_domain))),
                    ..Default::default()
                },
            )),
            ..Default::default()
        }),
        ..Default::default()
    };
    tls_socket(any(&context))
}

/// The TLS a client outside the mesh gets at an HTTPS listener of the edge: the
/// listener's certificates (SDS secrets `secrets`, Envoy picks one by SNI), TLS 1.2 or
/// newer, HTTP/2 or HTTP/1.1. No client certificate.
pub fn edge_terminate(secrets: &[String]) -> TransportSocket {
    let context = DownstreamTlsContext {
        common_tls_context: Some(CommonTlsContext {
            tls_params: Some(TlsParameters {
                tls_minimum_protocol_version: tls_parameters::TlsProtocol::TlSv12 as i32,
                ..Default::default()
            }),
            alpn_protocols: vec![ALPN_H2.into(), "http/1.1".into()],
            tls_certificate_sds_secret_configs: secrets.iter().map(|name| sds(name)).collect(),
            ..Default::default()
        }),
        ..Default::default()
    };
    tls_socket(any(&context))
}

/// An SDS secret holding a certificate chain and its key (PEM).
pub fn certificate_secret(name: &str, chain_pem: &str, key_pem: &str) -> Any {
    any(&Secret {
        name: name.to_owned(),
        r#type: Some(secret::Type::TlsCertificate(TlsCertificate {
            certificate_chain: Some(inline(chain_pem.to_owned())),
            private_key: Some(inline(key_pem.to_owned())),
            ..Default::default()
        })),
    })
}

fn inline(text: String) -> DataSource {
    DataSource {
        specifier: Some(data_source::Specifier::InlineString(text)),
        ..Default::default()
    }
}

/// SDS: one secret per local pod holding an SVID, and the validation context with
/// every trust domain's CA certificates.
pub fn secrets(identities: &Identities) -> Vec<(String, Any)> {
    let mut out = Vec::with_capacity(identities.svids.len() + 1);
    for (pod_id, svid) in &identities.svids {
        let name = svid_secret(pod_id);
        let body = certificate_secret(&name, &svid.cert_chain_pem, svid.key.pem());
        out.push((name, body));
    }
    if !identities.bundles.is_empty() {
        let name = bundle_secret(&identities.trust_domain);
        let validator = SpiffeCertValidatorConfig {
            trust_domains: identities
                .bundles
                .iter()
                .map(|(td, pem)| spiffe_cert_validator_config::TrustDomain {
                    name: td.clone(),
                    trust_bundle: Some(inline(pem.clone())),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        };
        let body = Secret {
            name: name.clone(),
            r#type: Some(secret::Type::ValidationContext(CertificateValidationContext {
                custom_validator_config: Some(TypedExtensionConfig {
                    name: "envoy.tls.cert_validator.spiffe".into(),
                    typed_config: Some(any(&validator)),
                }),
                ..Default::default()
            })),
        };
        out.push((name, any(&body)));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}
