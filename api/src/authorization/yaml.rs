//! AuthorizationPolicy objects from YAML, as a policy directory holds them: many documents
//! per file, other kinds skipped, each document's error on its own (see [`crate::yaml`]).

use super::object::{AuthorizationPolicy, GROUP, KIND, VERSION};
use crate::yaml::{Document, ParseError, documents, of_kind, pick};

/// Every document of `documents`: a policy, or why not, for each AuthorizationPolicy of
/// [`GROUP`]; nothing for other documents (Istio's `security.istio.io` policies included:
/// their semantics differ, so they are not read as ours).
pub fn from_documents(documents: &[Document]) -> Vec<Result<AuthorizationPolicy, ParseError>> {
    pick(documents, |value| of_kind(value, (GROUP, VERSION, KIND)))
}

/// [`from_documents`] of `text`'s documents.
pub fn parse_documents(text: &str) -> Vec<Result<AuthorizationPolicy, ParseError>> {
    from_documents(&documents(text))
}
