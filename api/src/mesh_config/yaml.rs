//! MeshConfig objects from YAML, as a config directory holds them: many documents per
//! file, other kinds skipped, each document's error on its own (see [`crate::yaml`]).

use super::object::{GROUP, KIND, MeshConfig, VERSION};
use crate::yaml::{Document, ParseError, documents, of_kind, pick};

/// Every document of `documents`: a MeshConfig, or why not, for each MeshConfig of
/// [`GROUP`]; nothing for other documents.
pub fn from_documents(documents: &[Document]) -> Vec<Result<MeshConfig, ParseError>> {
    pick(documents, |value| of_kind(value, (GROUP, VERSION, KIND)))
}

/// [`from_documents`] of `text`'s documents.
pub fn parse_documents(text: &str) -> Vec<Result<MeshConfig, ParseError>> {
    from_documents(&documents(text))
}
