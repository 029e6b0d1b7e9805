//! Why a user's object (or its projected record) is refused, as every projector of this
//! crate says it: the field at fault and the rule, the input quoted bounded.

/// Display: `field: message`. The field is the object's (`spec.rules[1].to[0].operation.paths[2]`)
/// from a projector's `project`, the proto's (`rules[1].to[0].paths[2]`) from its `validate`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct Refusal {
    pub field: String,
    pub message: String,
}

impl Refusal {
    pub(crate) fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            message: message.into(),
        }
    }
}

/// A value check's refusal on `field`.
pub(crate) fn at<T>(field: impl std::fmt::Display, result: Result<T, String>) -> Result<T, Refusal> {
    result.map_err(|message| Refusal::new(field.to_string(), message))
}
