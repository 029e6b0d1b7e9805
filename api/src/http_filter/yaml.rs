//! HTTPFilter objects from YAML, as a config directory holds them: many documents per
//! file, other kinds skipped, each document's error on its own (see [`crate::yaml`]).

use super::object::{GROUP, HttpFilter, KIND, VERSION};
use crate::yaml::{Document, ParseError, documents, of_kind, pick};

/// Every document of `documents`: a filter, or why not, for each HTTPFilter of
/// [`GROUP`]; nothing for other documents (Envoy Gateway's `gateway.envoyproxy.io`
/// filters included: their shape differs, so they are not read as ours).
pub fn from_documents(documents: &[Document]) -> Vec<Result<HttpFilter, ParseError>> {
    pick(documents, |value| of_kind(value, (GROUP, VERSION, KIND)))
}

/// [`from_documents`] of `text`'s documents.
pub fn parse_documents(text: &str) -> Vec<Result<HttpFilter, ParseError>> {
    from_documents(&documents(text))
}
