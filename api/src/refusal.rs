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

/// Where a value sits in its object (`spec.rules[1].to[0].operation.paths[2]`), written
/// out only when a refusal names it: projecting a valid object formats no paths (a
/// policy's paths were a tenth of the admission webhook's CPU when formatted eagerly).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Field<'a> {
    parent: Option<&'a Field<'a>>,
    step: Step<'a>,
}

#[derive(Clone, Copy, Debug)]
enum Step<'a> {
    Name(&'a str),
    Index(usize),
}

impl<'a> Field<'a> {
    /// A path from the object's root, e.g. `spec.rules` (or where a caller's own path is).
    pub(crate) const fn root(path: &'a str) -> Self {
        Self {
            parent: None,
            step: Step::Name(path),
        }
    }

    /// `self.name`.
    pub(crate) fn name(&'a self, name: &'a str) -> Field<'a> {
        Field {
            parent: Some(self),
            step: Step::Name(name),
        }
    }

    /// `self[index]`.
    pub(crate) fn index(&'a self, index: usize) -> Field<'a> {
        Field {
            parent: Some(self),
            step: Step::Index(index),
        }
    }
}

impl std::fmt::Display for Field<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let Some(parent) = self.parent {
            parent.fmt(f)?;
        }
        match (self.step, self.parent.is_some()) {
            (Step::Name(name), true) => write!(f, ".{name}"),
            (Step::Name(name), false) => f.write_str(name),
            (Step::Index(index), _) => write!(f, "[{index}]"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Field;

    #[test]
    fn a_field_writes_its_path_from_the_root() {
        let rules = Field::root("spec.rules");
        let rule = rules.index(1);
        let to = rule.name("to");
        let first = to.index(0);
        assert_eq!(first.name("operation").to_string(), "spec.rules[1].to[0].operation");
        assert_eq!(Field::root("spec").to_string(), "spec");
    }
}
