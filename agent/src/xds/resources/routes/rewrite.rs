//! Gateway API path modifiers (URL rewrites and redirects) as Envoy path rewrites.
//!
//! `replace_prefix_match` replaces the matched prefix segment by segment: with prefix
//! `/foo`, `/foo/bar` becomes `<new>/bar`, and an empty or `/` replacement leaves
//! `/bar` (never an empty path). Envoy's `prefix_rewrite` swaps the matched characters
//! only, so the cases it cannot express (a replacement that would leave `//` or nothing)
//! are a regex rewrite.

use aether_proto::registry::v1::{PathModifier, path_modifier};
use envoy_types::pb::envoy::r#type::matcher::v3::RegexMatchAndSubstitute;

use super::matching::{PathSpec, escape, regex_matcher};

/// How Envoy rewrites the path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PathRewrite {
    /// The whole path (a redirect's `path_redirect`).
    Full(String),
    /// The matched prefix (Envoy's `prefix_rewrite`).
    Prefix(String),
    Regex {
        pattern: String,
        substitution: String,
    },
}

impl PathRewrite {
    /// What `modifier` does to a request `path` matched; `None`: nothing to rewrite
    /// (a prefix replacement on a regex match, which validation refuses).
    pub fn of(modifier: &PathModifier, path: &PathSpec) -> Option<PathRewrite> {
        match modifier.modifier.as_ref()? {
            path_modifier::Modifier::ReplaceFullPath(full) => Some(PathRewrite::Full(full.clone())),
            path_modifier::Modifier::ReplacePrefixMatch(new) => replace_prefix(path, new.trim_end_matches('/')),
        }
    }

    /// The rewrite for a forwarded request: a full path is a regex over the whole path
    /// (the query string stays, as Envoy rewrites the path part only).
    pub fn for_forwarding(self) -> PathRewrite {
        match self {
            PathRewrite::Full(full) => PathRewrite::Regex {
                pattern: "^.*$".into(),
                substitution: substitution(&full),
            },
            other => other,
        }
    }

    pub fn regex(pattern: &str, substitution: &str) -> RegexMatchAndSubstitute {
        RegexMatchAndSubstitute {
            pattern: Some(regex_matcher(pattern)),
            substitution: substitution.to_owned(),
        }
    }
}

/// `new` is the replacement without its trailing slashes.
fn replace_prefix(path: &PathSpec, new: &str) -> Option<PathRewrite> {
    let matched = match path {
        PathSpec::Prefix(prefix) | PathSpec::Exact(prefix) => prefix.trim_end_matches('/'),
        PathSpec::Regex(_) => return None,
    };
    Some(match (matched, new) {
        // Prefix "/" matched one character: keep the separator after the new prefix.
        ("", "") => return None,
        ("", new) => PathRewrite::Prefix(format!("{new}/")),
        // What follows the prefix is empty or starts with "/": swap the prefix.
        (_, "") => PathRewrite::Regex {
            pattern: format!("^{}/*", escape(matched)),
            substitution: "/".into(),
        },
        (_, new) => PathRewrite::Prefix(new.to_owned()),
    })
}

/// A literal RE2 substitution (a backslash starts a group reference there).
fn substitution(text: &str) -> String {
    text.replace('\\', "\\\\")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prefix(new: &str, matched: &str) -> Option<PathRewrite> {
        let modifier = PathModifier {
            modifier: Some(path_modifier::Modifier::ReplacePrefixMatch(new.into())),
        };
        PathRewrite::of(&modifier, &PathSpec::Prefix(matched.into()))
    }

    /// Applies a rewrite the way Envoy does, for the shapes [`replace_prefix`] makes.
    fn apply(rewrite: &PathRewrite, matched: &str, request: &str) -> String {
        match rewrite {
            PathRewrite::Full(full) => full.clone(),
            PathRewrite::Prefix(new) => format!("{new}{}", &request[matched.len().max(1)..]),
            PathRewrite::Regex { substitution, .. } => {
                let rest = request[matched.len()..].trim_start_matches('/');
                format!("{substitution}{rest}")
            }
        }
    }

    #[test]
    fn replace_prefix_match_follows_the_gateway_api_table() {
        // (request, matched prefix as written, replacement, result), Gateway API's cases.
        let cases = [
            ("/foo/bar", "/foo", "/xyz", "/xyz/bar"),
            ("/foo/bar", "/foo", "/xyz/", "/xyz/bar"),
            ("/foo/bar", "/foo/", "/xyz", "/xyz/bar"),
            ("/foo/bar", "/foo/", "/xyz/", "/xyz/bar"),
            ("/foo", "/foo", "/xyz", "/xyz"),
            ("/foo/", "/foo", "/xyz", "/xyz/"),
            ("/foo/bar", "/foo", "", "/bar"),
            ("/foo/", "/foo", "", "/"),
            ("/foo", "/foo", "", "/"),
            ("/foo/", "/foo", "/", "/"),
            ("/foo", "/foo", "/", "/"),
            ("/foo", "/", "/xyz", "/xyz/foo"),
        ];
        for (request, written, new, expected) in cases {
            let PathSpec::Prefix(matched) = PathSpec::of(
                aether_proto::registry::v1::RouteKind::Http,
                Some(&aether_proto::registry::v1::RouteMatch {
                    path: Some(aether_proto::registry::v1::PathMatch {
                        r#type: aether_proto::registry::v1::MatchType::PathPrefix as i32,
                        value: written.into(),
                    }),
                    ..Default::default()
                }),
            ) else {
                unreachable!()
            };
            let rewrite = prefix(new, &matched).unwrap();
            let got = apply(&rewrite, matched.trim_end_matches('/'), request);
            assert_eq!(got, expected, "{request} with {written} → {new:?}: {rewrite:?}");
        }
        assert_eq!(prefix("/", "/"), None, "prefix / replaced by / changes nothing");
    }

    #[test]
    fn an_empty_replacement_is_a_regex_that_keeps_one_slash() {
        assert_eq!(
            prefix("", "/a.b"),
            Some(PathRewrite::Regex {
                pattern: "^/a\\.b/*".into(),
                substitution: "/".into()
            })
        );
    }

    #[test]
    fn a_full_path_is_a_regex_when_forwarding_and_literal_in_a_redirect() {
        let modifier = PathModifier {
            modifier: Some(path_modifier::Modifier::ReplaceFullPath("/new\\path".into())),
        };
        let rewrite = PathRewrite::of(&modifier, &PathSpec::Regex("/x.*".into())).unwrap();
        assert_eq!(rewrite, PathRewrite::Full("/new\\path".into()));
        assert_eq!(
            rewrite.for_forwarding(),
            PathRewrite::Regex {
                pattern: "^.*$".into(),
                substitution: "/new\\\\path".into()
            }
        );
        let prefix_on_regex = PathModifier {
            modifier: Some(path_modifier::Modifier::ReplacePrefixMatch("/x".into())),
        };
        assert_eq!(PathRewrite::of(&prefix_on_regex, &PathSpec::Regex("/x.*".into())), None);
    }
}
