//! Which objects a list or watch is about: its namespace and its label and field
//! selectors (equality terms, `=`, `==` and `!=`, as the project's clients send them).

use std::collections::HashMap;

use serde_json::Value;

/// A selector this fake does not speak: answered `400`, so the test sees why.
#[derive(Debug)]
pub(super) struct Unsupported(pub String);

#[derive(Clone, Debug, Default)]
pub(super) struct Selection {
    namespace: Option<String>,
    labels: Vec<Term>,
    fields: Vec<Term>,
}

#[derive(Clone, Debug)]
struct Term {
    key: String,
    value: String,
    equal: bool,
}

impl Selection {
    pub fn new(namespace: Option<String>, query: &HashMap<String, String>) -> Result<Selection, Unsupported> {
        let terms = |name: &str| {
            query
                .get(name)
                .map_or(Ok(Vec::new()), |selector| Term::parse_all(selector))
        };
        Ok(Selection {
            namespace,
            labels: terms("labelSelector")?,
            fields: terms("fieldSelector")?,
        })
    }

    pub fn selects(&self, object: &Value) -> bool {
        let metadata = &object["metadata"];
        self.namespace
            .as_deref()
            .is_none_or(|ns| metadata["namespace"].as_str() == Some(ns))
            && self.labels.iter().all(|t| t.holds(metadata["labels"][&t.key].as_str()))
            && self.fields.iter().all(|t| t.holds(field(object, &t.key)))
    }
}

impl Term {
    fn parse_all(selector: &str) -> Result<Vec<Term>, Unsupported> {
        selector.split(',').filter(|s| !s.is_empty()).map(Term::parse).collect()
    }

    fn parse(term: &str) -> Result<Term, Unsupported> {
        let (key, value, equal) = if let Some((k, v)) = term.split_once("!=") {
            (k, v, false)
        } else if let Some((k, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
            (k, v, true)
        } else {
            return Err(Unsupported(format!(
                "the fake API server does not speak selector term {term:?}"
            )));
        };
        Ok(Term {
            key: key.trim().to_owned(),
            value: value.trim().to_owned(),
            equal,
        })
    }

    /// A missing label or field differs from every value, as on a real server.
    fn holds(&self, actual: Option<&str>) -> bool {
        (actual == Some(self.value.as_str())) == self.equal
    }
}

/// A field by its dotted path (`metadata.name`, `spec.nodeName`).
fn field<'a>(object: &'a Value, path: &str) -> Option<&'a str> {
    path.split('.').try_fold(object, |value, key| value.get(key))?.as_str()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn selects_by_namespace_labels_and_fields() {
        let pod = json!({"metadata": {"name": "a", "namespace": "shop", "labels": {"app": "web"}},
                         "spec": {"nodeName": "n1"}});
        let query = |pairs: &[(&str, &str)]| -> HashMap<String, String> {
            pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
        };
        let selects = |namespace: Option<&str>, pairs: &[(&str, &str)]| {
            Selection::new(namespace.map(str::to_owned), &query(pairs))
                .unwrap()
                .selects(&pod)
        };
        assert!(selects(
            Some("shop"),
            &[("labelSelector", "app=web"), ("fieldSelector", "spec.nodeName=n1")]
        ));
        assert!(selects(None, &[("labelSelector", "app==web,tier!=db")]));
        assert!(!selects(Some("other"), &[]));
        assert!(!selects(None, &[("labelSelector", "app!=web")]));
        assert!(!selects(None, &[("fieldSelector", "metadata.name=b")]));
        assert!(Selection::new(None, &query(&[("labelSelector", "app in (web)")])).is_err());
    }
}
