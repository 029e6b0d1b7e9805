//! AuthorizationPolicy objects from YAML, as a policy directory holds them: many documents
//! per file, other kinds skipped, each document's error on its own (see [`crate::yaml`]).

use super::object::{AuthorizationPolicy, GROUP, KIND, VERSION};
use crate::yaml::{ParseError, of_kind, read_documents};

/// Parses every document of `text`: a policy, or why not, for each AuthorizationPolicy of
/// [`GROUP`]; nothing for other documents (Istio's `security.istio.io` policies included:
/// their semantics differ, so they are not read as ours).
pub fn parse_documents(text: &str) -> Vec<Result<AuthorizationPolicy, ParseError>> {
    read_documents(text, |value| of_kind(value, (GROUP, VERSION, KIND)))
}
