//! `admission.k8s.io/v1` AdmissionReview, as kube-apiserver sends and reads it: the
//! request's fields the webhooks use, and the response, with its JSON Patch base64-encoded
//! (Go's encoding of `[]byte`; kube-core's response type writes an array of numbers,
//! kube-rs#1781, which kube-apiserver cannot read).
//!
//! [`review`] turns one request body into one response body: a body that is not an
//! AdmissionReview is answered with a review that denies it, naming the field (a short
//! quote and the size), never with an HTTP error kube-apiserver would have to interpret.

use aether_common::quote::quote;
use base64::Engine;
use serde::{Deserialize, Serialize};
use serde_json::Value;

pub const API_VERSION: &str = "admission.k8s.io/v1";
pub const KIND: &str = "AdmissionReview";

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Review {
    api_version: String,
    kind: String,
    request: Option<Request>,
}

/// The request's fields the webhooks read (the rest is ignored).
#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Request {
    pub uid: String,
    pub kind: GroupVersionKind,
    #[serde(default)]
    pub namespace: Option<String>,
    pub operation: Operation,
    /// The object as it would be stored (none for DELETE).
    #[serde(default)]
    pub object: Option<Value>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct GroupVersionKind {
    #[serde(default)]
    pub group: String,
    pub version: String,
    pub kind: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Operation {
    Create,
    Update,
    Delete,
    Connect,
}

/// What a webhook decided.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    Allow,
    /// Allowed with these JSON Patch (RFC 6902) operations.
    Patch(Vec<Value>),
    /// Refused: the message names the field and the rule.
    Deny(String),
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ResponseReview<'a> {
    api_version: &'static str,
    kind: &'static str,
    response: Response<'a>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Response<'a> {
    uid: &'a str,
    allowed: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    status: Option<Status>,
    #[serde(skip_serializing_if = "Option::is_none")]
    patch_type: Option<&'static str>,
    /// The JSON Patch, base64.
    #[serde(skip_serializing_if = "Option::is_none")]
    patch: Option<String>,
}

/// The `metav1.Status` of a refusal: kube-apiserver shows its message to the client.
#[derive(Serialize)]
struct Status {
    code: u16,
    message: String,
}

/// Why a body is not a request the webhooks can answer.
#[derive(Debug, thiserror::Error)]
pub enum BadReview {
    #[error("the body ({size} bytes) is not an AdmissionReview: {path}: {reason}")]
    Json { size: usize, path: String, reason: String },
    #[error("apiVersion {} kind {}: expected {API_VERSION} {KIND}", quote(.0), quote(.1))]
    Type(String, String),
    #[error("request: missing")]
    NoRequest,
}

/// Parses one AdmissionReview request body. Path tracking (an allocation per key) runs
/// only for a body that does not decode, to name the field at fault.
pub fn parse(body: &[u8]) -> Result<Request, BadReview> {
    let review: Review = match serde_json::from_slice(body) {
        Ok(review) => review,
        Err(_) => {
            let mut deserializer = serde_json::Deserializer::from_slice(body);
            serde_path_to_error::deserialize(&mut deserializer).map_err(|e| BadReview::Json {
                size: body.len(),
                path: e.path().to_string(),
                reason: bounded(&e.inner().to_string()),
            })?
        }
    };
    if review.api_version != API_VERSION || review.kind != KIND {
        return Err(BadReview::Type(review.api_version, review.kind));
    }
    review.request.ok_or(BadReview::NoRequest)
}

/// One review: the request body in, the response body out. `decide` judges a parsed
/// request; a body that does not parse is denied with the reason.
pub fn review(body: &[u8], decide: impl FnOnce(Request) -> Verdict) -> (Verdict, Vec<u8>) {
    match parse(body) {
        Ok(request) => {
            let uid = request.uid.clone();
            let verdict = decide(request);
            let response = respond(&uid, &verdict);
            (verdict, response)
        }
        Err(bad) => {
            let verdict = Verdict::Deny(bad.to_string());
            let response = respond("", &verdict);
            (verdict, response)
        }
    }
}

/// The response body for `uid`.
pub fn respond(uid: &str, verdict: &Verdict) -> Vec<u8> {
    let base64 = base64::engine::general_purpose::STANDARD;
    let response = match verdict {
        Verdict::Allow => Response {
            uid,
            allowed: true,
            status: None,
            patch_type: None,
            patch: None,
        },
        Verdict::Patch(ops) => Response {
            uid,
            allowed: true,
            status: None,
            patch_type: Some("JSONPatch"),
            patch: Some(base64.encode(serde_json::to_vec(ops).expect("JSON values serialize"))),
        },
        Verdict::Deny(message) => Response {
            uid,
            allowed: false,
            status: Some(Status {
                code: 403,
                message: message.clone(),
            }),
            patch_type: None,
            patch: None,
        },
    };
    let review = ResponseReview {
        api_version: API_VERSION,
        kind: KIND,
        response,
    };
    serde_json::to_vec(&review).expect("the response serializes")
}

/// A message quoting input, cut to a readable length with its size.
pub fn bounded(text: &str) -> String {
    const MAX: usize = 200;
    if text.len() <= MAX {
        return text.to_owned();
    }
    let cut = (0..=MAX).rev().find(|i| text.is_char_boundary(*i)).unwrap_or(0);
    format!("{}… ({} bytes)", &text[..cut], text.len())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    /// A Pod CREATE as kube-apiserver sends it (the API reference's AdmissionReview v1).
    fn pod_create() -> Value {
        json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
                "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
                "requestResource": {"group": "", "version": "v1", "resource": "pods"},
                "name": "web-0",
                "namespace": "demo",
                "operation": "CREATE",
                "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller", "groups": ["system:serviceaccounts"]},
                "object": {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web-0", "namespace": "demo"}},
                "oldObject": null,
                "dryRun": false,
                "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"}
            }
        })
    }

    fn answer(body: &[u8]) -> Value {
        serde_json::from_slice(body).unwrap()
    }

    #[test]
    fn the_response_echoes_the_uid_and_encodes_the_patch_in_base64() {
        let body = serde_json::to_vec(&pod_create()).unwrap();
        let op = json!({"op": "add", "path": "/metadata/labels", "value": {"a": "b"}});
        let (_, out) = review(&body, |r| {
            assert_eq!((r.kind.kind.as_str(), r.operation), ("Pod", Operation::Create));
            assert_eq!(r.namespace.as_deref(), Some("demo"));
            Verdict::Patch(vec![op.clone()])
        });
        let out = answer(&out);
        assert_eq!(out["apiVersion"], "admission.k8s.io/v1");
        assert_eq!(out["kind"], "AdmissionReview");
        assert_eq!(out["response"]["uid"], "705ab4f5-6393-11e8-b7cc-42010a800002");
        assert_eq!(out["response"]["allowed"], true);
        assert_eq!(out["response"]["patchType"], "JSONPatch");
        let patch = base64::engine::general_purpose::STANDARD
            .decode(out["response"]["patch"].as_str().expect("a base64 string"))
            .unwrap();
        assert_eq!(serde_json::from_slice::<Value>(&patch).unwrap(), json!([op]));
    }

    #[test]
    fn a_denial_carries_its_message_with_code_403() {
        let body = serde_json::to_vec(&pod_create()).unwrap();
        let (_, out) = review(&body, |_| Verdict::Deny("spec.x: bad".into()));
        let out = answer(&out);
        assert_eq!(out["response"]["allowed"], false);
        assert_eq!(
            out["response"]["status"],
            json!({"code": 403, "message": "spec.x: bad"})
        );
        assert!(out["response"].get("patch").is_none());
    }

    #[test]
    fn a_body_that_is_not_a_review_is_denied_naming_the_field_bounded() {
        let cases: [(Vec<u8>, &str); 4] = [
            (
                b"not json".to_vec(),
                "the body (8 bytes) is not an AdmissionReview: .: expected ident",
            ),
            (
                serde_json::to_vec(&json!({"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview"}))
                    .unwrap(),
                "apiVersion \"admission.k8s.io/v1beta1\" kind \"AdmissionReview\": expected",
            ),
            (
                serde_json::to_vec(&json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"})).unwrap(),
                "request: missing",
            ),
            (
                {
                    let mut review = pod_create();
                    review["request"]["operation"] = json!("EXPLODE");
                    serde_json::to_vec(&review).unwrap()
                },
                "is not an AdmissionReview: request.operation: unknown variant `EXPLODE`",
            ),
        ];
        for (body, words) in cases {
            let (verdict, out) = review(&body, |_| unreachable!("not a request"));
            let Verdict::Deny(message) = verdict else {
                panic!("{verdict:?}")
            };
            assert!(message.contains(words), "{message}");
            assert_eq!(answer(&out)["response"]["allowed"], false);
        }
        let huge = format!("{{\"apiVersion\": \"{}\"}}", "x".repeat(100_000));
        let (verdict, _) = review(huge.as_bytes(), |_| unreachable!());
        let Verdict::Deny(message) = verdict else { panic!() };
        assert!(message.len() < 600, "{} bytes", message.len());
    }
}
