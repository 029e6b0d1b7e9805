//! The naming rules more than one binary checks: DNS-1123 labels (Kubernetes namespaces
//! and service names), mesh domains and CNI container ids.
//!
//! Only the rule lives here. Each caller words its own error (a gRPC field, a CNI
//! variable, an annotation entry) from the typed reason these functions return, so its
//! messages stay what its users and tests expect.

/// The longest DNS-1123 label.
pub const MAX_LABEL_LEN: usize = 63;
/// The longest container id accepted (the CNI spec sets no limit; runtimes use 64).
pub const MAX_CONTAINER_ID_LEN: usize = 256;

/// Why a string is not a DNS-1123 label. The wording is the registrar's, e.g.
/// `namespace is 64 characters long (at most 63)` once prefixed with the field.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LabelError {
    #[error("is empty")]
    Empty,
    /// The label's length in bytes.
    #[error("is {0} characters long (at most 63)")]
    TooLong(usize),
    /// A character other than `a-z`, `0-9` and `-`, or `-` first or last.
    #[error("must be a DNS-1123 label (lowercase letters, digits and '-', starting and ending with a letter or digit)")]
    NotALabel,
}

/// Checks that `label` is a DNS-1123 label (RFC 1123), what Kubernetes requires of
/// namespaces and service names: 1 to 63 lowercase ASCII letters, digits and `-`,
/// starting and ending with a letter or digit.
pub fn dns_label(label: &str) -> Result<(), LabelError> {
    let b = label.as_bytes();
    if b.is_empty() {
        return Err(LabelError::Empty);
    }
    if b.len() > MAX_LABEL_LEN {
        return Err(LabelError::TooLong(b.len()));
    }
    let allowed = |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-';
    if !b.iter().all(allowed) || b[0] == b'-' || b[b.len() - 1] == b'-' {
        return Err(LabelError::NotALabel);
    }
    Ok(())
}

/// Whether `label` is a DNS-1123 label (see [`dns_label`]).
pub fn valid_label(label: &str) -> bool {
    dns_label(label).is_ok()
}

/// The longest mesh domain: `<service>.<namespace>.` (two labels of 63 and their dots)
/// under it stays within a DNS name's 253 characters.
pub const MAX_MESH_DOMAIN_LEN: usize = 125;

/// Why a string is not a mesh domain.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MeshDomainError {
    #[error("is {0} characters long (at most 125, so that <service>.<namespace>. fits under it)")]
    TooLong(usize),
    /// One label: a top-level domain would make every name under it the mesh's.
    #[error("has one label: a mesh domain has at least two (under a top-level domain, every name would be the mesh's)")]
    OneLabel,
    /// The label at this index (from the left) is not a DNS-1123 label.
    #[error("label {0} {1}")]
    Label(usize, LabelError),
}

/// Checks a mesh domain (`aether.internal`): at least two DNS-1123 labels, lowercase, no
/// trailing dot, at most [`MAX_MESH_DOMAIN_LEN`] characters.
pub fn mesh_domain(domain: &str) -> Result<(), MeshDomainError> {
    if domain.len() > MAX_MESH_DOMAIN_LEN {
        return Err(MeshDomainError::TooLong(domain.len()));
    }
    let labels = domain.split('.');
    labels
        .clone()
        .enumerate()
        .try_for_each(|(i, label)| dns_label(label).map_err(|e| MeshDomainError::Label(i, e)))?;
    match labels.count() {
        1 => Err(MeshDomainError::OneLabel),
        _ => Ok(()),
    }
}

/// Why a string is not a container id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ContainerIdError {
    #[error("is empty")]
    Empty,
    /// Longer than [`MAX_CONTAINER_ID_LEN`], or a character other than those allowed.
    #[error("is not a container id (letters, digits, '-', '_', '.')")]
    Invalid,
}

/// Checks a CNI container id: the spec allows ASCII letters, digits, `-`, `_` and `.`;
/// at most [`MAX_CONTAINER_ID_LEN`] bytes (it becomes a file name under the pin and
/// state directories).
pub fn container_id(id: &str) -> Result<(), ContainerIdError> {
    if id.is_empty() {
        return Err(ContainerIdError::Empty);
    }
    if id.len() > MAX_CONTAINER_ID_LEN || !id.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b)) {
        return Err(ContainerIdError::Invalid);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn labels() {
        for ok in ["a", "shop", "a-b", "0", "9lives", &"a".repeat(63)] {
            assert_eq!(dns_label(ok), Ok(()), "{ok:?}");
        }
        assert_eq!(dns_label(""), Err(LabelError::Empty));
        assert_eq!(dns_label(&"a".repeat(64)), Err(LabelError::TooLong(64)));
        for bad in ["-a", "a-", "-", "A", "a_b", "a.b", "a/b", "é", "a b"] {
            assert_eq!(dns_label(bad), Err(LabelError::NotALabel), "{bad:?}");
        }
        assert_eq!(
            dns_label(&"a".repeat(64)).unwrap_err().to_string(),
            "is 64 characters long (at most 63)"
        );
    }

    #[test]
    fn mesh_domains() {
        for ok in [
            "aether.internal",
            "corp.example",
            "a.b.c",
            &format!("{}.{}", "a".repeat(63), "b".repeat(61)),
        ] {
            assert_eq!(mesh_domain(ok), Ok(()), "{ok:?}");
        }
        assert_eq!(mesh_domain("internal"), Err(MeshDomainError::OneLabel));
        assert_eq!(mesh_domain(&"a.".repeat(63)), Err(MeshDomainError::TooLong(126)));
        assert_eq!(
            mesh_domain("aether.internal."),
            Err(MeshDomainError::Label(2, LabelError::Empty))
        );
        assert_eq!(
            mesh_domain("Corp.example"),
            Err(MeshDomainError::Label(0, LabelError::NotALabel))
        );
        assert_eq!(mesh_domain(""), Err(MeshDomainError::Label(0, LabelError::Empty)));
        assert_eq!(mesh_domain("a..b").unwrap_err().to_string(), "label 1 is empty");
    }

    #[test]
    fn container_ids() {
        for ok in ["a", "abc-123_x.y", &"f".repeat(256)] {
            assert_eq!(container_id(ok), Ok(()), "{ok:?}");
        }
        assert_eq!(container_id(""), Err(ContainerIdError::Empty));
        for bad in ["a b", "a/b", "..:", "é", &"f".repeat(257)] {
            assert_eq!(container_id(bad), Err(ContainerIdError::Invalid), "{bad:?}");
        }
    }

    proptest! {
        #[test]
        fn a_label_is_exactly_the_dns_1123_pattern(s in "[a-z0-9-]{0,70}|\\PC{0,8}") {
            let expected = !s.is_empty()
                && s.len() <= 63
                && s.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
                && !s.starts_with('-')
                && !s.ends_with('-');
            prop_assert_eq!(valid_label(&s), expected);
        }
    }
}
