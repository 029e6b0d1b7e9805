//! MeshConfig objects from YAML, as a config directory holds them: many documents per
//! file, other kinds skipped, each document's error on its own (see [`crate::yaml`]).

use super::object::{GROUP, KIND, MeshConfig, VERSION};
use crate::yaml::{ParseError, of_kind, read_documents};

/// Parses every document of `text`: a MeshConfig, or why not, for each MeshConfig of
/// [`GROUP`]; nothing for other documents.
pub fn parse_documents(text: &str) -> Vec<Result<MeshConfig, ParseError>> {
    read_documents(text, |value| of_kind(value, (GROUP, VERSION, KIND)))
}
