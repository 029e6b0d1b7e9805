//! The transport between pods: mTLS with each pod's own SVID, or plaintext when the
//! agent runs with `--identity none` (NOT FOR PRODUCTION: benchmarks and debugging).
//!
//! - Inbound (`:18008`): the pod's SVID (`svid|<ns>/<pod>` over SDS), a client
//!   certificate required and verified against the trust bundles (`spiffe://<td>` over
//!   SDS: SPIFFE validator, one CA set per trust domain, federated ones included).
//! - Outbound: mesh clusters are shared by every local pod, so the client certificate
//!   is chosen per connection: the pod's outbound and capture listeners put the pod's id
//!   in filter state (`set_filter_state`, shared with the upstream connection), and each
//!   mesh cluster carries one named TLS socket per local pod (presenting that pod's SVID)
//!   selected by a `transport_socket_matcher` on that filter state. A per-pod opaque SNI,
//!   also from filter state, keys the upstream connection pools, so two pods never share
//!   an upstream connection. A connection without a source pod gets the default socket,
//!   which presents no certificate and is refused: no node identity, ever. The expected
//!   server SANs are pinned.

use envoy_types::pb::envoy::config::cluster::v3::cluster::TransportSocketMatch;
use envoy_types::pb::envoy::config::core::v3::{
    DataSource, SubstitutionFormatString, TransportSocket, TypedExtensionConfig, data_source,
    substitution_format_string, transport_socket,
};
use envoy_types::pb::envoy::config::listener::v3::{Filter, filter};
use envoy_types::pb::envoy::extensions::filters::common::set_filter_state::v3::{FilterStateValue, filter_state_value};
use envoy_types::pb::envoy::extensions::filters::network::set_filter_state::v3::Config as SetFilterState;
use envoy_types::pb::envoy::extensions::matching::common_inputs::transport_socket::v3::{
    FilterStateInput, TransportSocketNameAction,
};
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    CertificateValidationContext, CommonTlsContext, DownstreamTlsContext, SdsSecretConfig, Secret,
    SpiffeCertValidatorConfig, SubjectAltNameMatcher, TlsCertificate, TlsParameters, UpstreamTlsContext,
    common_tls_context, secret, spiffe_cert_validator_config, subject_alt_name_matcher, tls_parameters,
};
use envoy_types::pb::envoy::r#type::matcher::v3::{StringMatcher, string_matcher};
use envoy_types::pb::google::protobuf::{Any, BoolValue};
use envoy_types::pb::xds::core::v3::TypedExtensionConfig as XdsTypedExtensionConfig;
use envoy_types::pb::xds::r#type::matcher::v3::{
    Matcher, StringMatcher as XdsStringMatcher, matcher, matcher::matcher_list, string_matcher as xds_string_matcher,
};

use super::util::{ads, any};
use crate::identity::{Identities, bundle_secret, svid_secret};

/// The filter state key carrying the source pod's id (`<ns>/<pod>`) to the clusters'
/// transport socket matcher.
pub const SOURCE_FILTER_STATE: &str = "aether.source_pod";
/// Envoy's upstream SNI override (part of the upstream connection pool key).
pub const SNI_FILTER_STATE: &str = "envoy.network.upstream_server_name";
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

/// What a mesh cluster needs for mTLS: the default socket (no client certificate: the
/// peer refuses it), one named socket per local pod presenting that pod's SVID, and the
/// matcher choosing among them by the connection's source pod.
#[derive(Default)]
pub struct UpstreamTls {
    pub socket: Option<TransportSocket>,
    pub matches: Vec<TransportSocketMatch>,
    pub matcher: Option<Matcher>,
}

fn upstream_context(mtls: &Mtls, server_sans: &[String], http: bool, secret: Option<&str>) -> UpstreamTlsContext {
    let pinned = CertificateValidationContext {
        match_typed_subject_alt_names: server_sans
            .iter()
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
    UpstreamTlsContext {
        common_tls_context: Some(CommonTlsContext {
            tls_params: tls13(),
            alpn_protocols: if http { vec![ALPN_H2.into()] } else { Vec::new() },
            tls_certificate_sds_secret_configs: secret.map(sds).into_iter().collect(),
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
    }
}

/// The transport of mesh clusters (toward a peer's inbound listener): the source pod's
/// SVID, chosen per connection by the source marker among `sources` (the local pods
/// holding an SVID), the peer verified against the trust bundles and pinned to
/// `server_sans` (exact URI SANs; callers never pass an empty list).
pub fn upstream(mtls: Option<&Mtls>, server_sans: &[String], http: bool, sources: &[String]) -> UpstreamTls {
    let Some(mtls) = mtls else {
        return UpstreamTls::default();
    };
    let mut matches = Vec::with_capacity(sources.len());
    let mut matchers = Vec::with_capacity(sources.len());
    for pod_id in sources {
        let secret = svid_secret(pod_id);
        matches.push(TransportSocketMatch {
            name: secret.clone(),
            transport_socket: Some(tls_socket(any(&upstream_context(
                mtls,
                server_sans,
                http,
                Some(&secret),
            )))),
            ..Default::default()
        });
        matchers.push(matcher_list::FieldMatcher {
            predicate: Some(matcher_list::Predicate {
                match_type: Some(matcher_list::predicate::MatchType::SinglePredicate(
                    matcher_list::predicate::SinglePredicate {
                        input: Some(XdsTypedExtensionConfig {
                            name: "envoy.matching.inputs.transport_socket_filter_state".into(),
                            typed_config: Some(any(&FilterStateInput {
                                key: SOURCE_FILTER_STATE.into(),
                            })),
                        }),
                        matcher: Some(matcher_list::predicate::single_predicate::Matcher::ValueMatch(
                            XdsStringMatcher {
                                match_pattern: Some(xds_string_matcher::MatchPattern::Exact(pod_id.clone())),
                                ..Default::default()
                            },
                        )),
                    },
                )),
            }),
            on_match: Some(matcher::OnMatch {
                on_match: Some(matcher::on_match::OnMatch::Action(XdsTypedExtensionConfig {
                    name: "envoy.matching.action.transport_socket.name".into(),
                    typed_config: Some(any(&TransportSocketNameAction { name: secret })),
                })),
                ..Default::default()
            }),
        });
    }
    UpstreamTls {
        // No source pod: no client certificate, so the peer refuses it (never a node identity).
        socket: Some(tls_socket(any(&upstream_context(mtls, server_sans, http, None)))),
        matches,
        matcher: if matchers.is_empty() {
            None
        } else {
            Some(Matcher {
                matcher_type: Some(matcher::MatcherType::MatcherList(matcher::MatcherList { matchers })),
                on_no_match: None,
            })
        },
    }
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
/// every chain of its outbound and capture listeners): the pod id for the clusters'
/// transport socket matcher, and a per-pod opaque SNI, which keys Envoy's upstream
/// connection pools so two pods never share an upstream connection.
pub fn source_filter(mtls: Option<&Mtls>, pod_id: &str) -> Option<Filter> {
    mtls?;
    let value = |key: &str, factory: &str, text: String| FilterStateValue {
        factory_key: factory.to_owned(),
        shared_with_upstream: filter_state_value::SharedWithUpstream::Once as i32,
        key: Some(filter_state_value::Key::ObjectKey(key.to_owned())),
        value: Some(filter_state_value::Value::FormatString(SubstitutionFormatString {
            format: Some(substitution_format_string::Format::TextFormatSource(inline(
                text.replace('%', "%%"),
            ))),
            ..Default::default()
        })),
        ..Default::default()
    };
    let config = SetFilterState {
        on_new_connection: vec![
            value(SOURCE_FILTER_STATE, "envoy.string", pod_id.to_owned()),
            value(SNI_FILTER_STATE, "", source_sni(pod_id)),
        ],
        ..Default::default()
    };
    Some(Filter {
        name: "envoy.filters.network.set_filter_state".into(),
        config_type: Some(filter::ConfigType::TypedConfig(any(&config))),
    })
}

/// The SNI a pod's upstream connections carry: opaque (a hash of the pod id), so the
/// ClientHello does not name the pod.
pub fn source_sni(pod_id: &str) -> String {
    format!("{:016x}.src.aether", aether_common::hash::fnv1a(pod_id.as_bytes()))
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
        let body = Secret {
            name: name.clone(),
            r#type: Some(secret::Type::TlsCertificate(TlsCertificate {
                certificate_chain: Some(inline(svid.cert_chain_pem.clone())),
                private_key: Some(inline(svid.key.pem().to_owned())),
                ..Default::default()
            })),
        };
        out.push((name, any(&body)));
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
