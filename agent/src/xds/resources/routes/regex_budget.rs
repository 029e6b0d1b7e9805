//! Envoy compiles every route regex with RE2 and refuses the whole route table when
//! one compiles to a program larger than its `re2.max_program_size.error_level` runtime
//! value. Envoy's default, 100, refuses ordinary regexes (`/[a-z]{1,50}` is 104), so
//! both bootstraps raise it to [`ENVOY_ERROR_LEVEL`] and warn above [`MAX_PROGRAM_SIZE`];
//! the agent skips a route with a regex whose estimated program exceeds
//! [`MAX_PROGRAM_SIZE`], so a table Envoy would refuse is never sent.
//!
//! The estimate walks the regex's syntax tree the way RE2 lays out its program: one
//! instruction per literal byte, about two per class range, a counted repetition
//! spelled out copy by copy, plus RE2's fixed prologue. It is at or above RE2's own
//! figure for the regexes measured (see the tests), and the error level leaves twice
//! the budget for what it misjudges (large Unicode classes, which RE2 compiles to UTF-8
//! sequences).

use aether_proto::registry::v1::{MatchType, Route, RouteKind, ValueMatch};
use regex_syntax::hir::{Class, Hir, HirKind};

use super::matching::PathSpec;

/// The largest estimated RE2 program a route regex may have (the bootstraps' warn level).
pub const MAX_PROGRAM_SIZE: usize = 500;
/// The bootstraps' `re2.max_program_size.error_level`: twice the budget.
pub const ENVOY_ERROR_LEVEL: usize = 2 * MAX_PROGRAM_SIZE;
/// The instructions every RE2 program has (measured: `a` is 5).
const PROLOGUE: usize = 4;

#[derive(Debug, thiserror::Error)]
pub enum RegexBudgetError {
    #[error("{field}: {} compiles to an RE2 program of about {size} instructions, over the mesh's limit of {MAX_PROGRAM_SIZE}", aether_common::quote::quote(.pattern))]
    TooLarge {
        field: String,
        pattern: String,
        size: usize,
    },
}

/// Every regex of `route` within the budget; the first that is not is named by its field.
pub fn check(route: &Route) -> Result<(), RegexBudgetError> {
    for (r, rule) in route.rules.iter().enumerate() {
        for (m, matched) in rule.matches.iter().enumerate() {
            let at = format!("rules[{r}].matches[{m}]");
            let field = if route.kind() == RouteKind::Grpc {
                "method"
            } else {
                "path.value"
            };
            if let PathSpec::Regex(pattern) = PathSpec::of(route.kind(), Some(matched)) {
                within(&format!("{at}.{field}"), &pattern)?;
            }
            for (kind, values) in [("headers", &matched.headers), ("query_params", &matched.query_params)] {
                for (i, value) in values.iter().enumerate() {
                    value_within(&format!("{at}.{kind}[{i}].value"), value)?;
                }
            }
        }
    }
    Ok(())
}

fn value_within(field: &str, value: &ValueMatch) -> Result<(), RegexBudgetError> {
    if value.r#type() == MatchType::Regex {
        within(field, &value.value)?;
    }
    Ok(())
}

fn within(field: &str, pattern: &str) -> Result<(), RegexBudgetError> {
    match estimate(pattern) {
        Some(size) if size <= MAX_PROGRAM_SIZE => Ok(()),
        // What does not parse here was refused by validation already; count it as over.
        size => Err(RegexBudgetError::TooLarge {
            field: field.to_owned(),
            pattern: pattern.to_owned(),
            size: size.unwrap_or(usize::MAX),
        }),
    }
}

/// RE2's program size for `pattern`, estimated (saturating). RE2's `\w`, `\d`, `\s` are
/// ASCII, as in the non-Unicode syntax; a regex that needs Unicode syntax (`\p{L}`) is
/// estimated with it, which counts its classes generously.
pub fn estimate(pattern: &str) -> Option<usize> {
    let ascii = regex_syntax::ParserBuilder::new()
        .unicode(false)
        .utf8(false)
        .build()
        .parse(pattern);
    let hir = match ascii {
        Ok(hir) => hir,
        Err(_) => regex_syntax::ParserBuilder::new().build().parse(pattern).ok()?,
    };
    Some(PROLOGUE.saturating_add(size(&hir)))
}

fn size(hir: &Hir) -> usize {
    match hir.kind() {
        HirKind::Empty => 0,
        HirKind::Literal(literal) => literal.0.len(),
        HirKind::Class(Class::Bytes(class)) => class_size(class.ranges().len()),
        // A Unicode range becomes UTF-8 byte sequences of up to four bytes.
        HirKind::Class(Class::Unicode(class)) => class_size(class.ranges().len()).saturating_mul(4),
        HirKind::Look(_) => 1,
        HirKind::Capture(capture) => size(&capture.sub).saturating_add(2),
        HirKind::Concat(parts) => parts.iter().map(size).fold(0, usize::saturating_add),
        HirKind::Alternation(parts) => parts
            .iter()
            .map(size)
            .fold(parts.len().saturating_sub(1), usize::saturating_add),
        HirKind::Repetition(repetition) => {
            let sub = size(&repetition.sub);
            let min = repetition.min as usize;
            // Each copy past the minimum is optional: the copy and a split.
            let optional = match repetition.max {
                Some(max) => (max as usize).saturating_sub(min),
                None => 1,
            };
            sub.saturating_mul(min)
                .saturating_add(sub.saturating_add(1).saturating_mul(optional))
        }
    }
}

/// A class of `ranges` byte ranges: one instruction each and the splits between them.
fn class_size(ranges: usize) -> usize {
    (2 * ranges).saturating_sub(1).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RE2 program sizes Envoy 1.40 reported for these regexes (an error level of 1
    /// makes it print them).
    const MEASURED: [(&str, usize); 10] = [
        ("/[a-z]{1,50}", 104),
        ("/v[0-9]+/.*", 11),
        (".*", 6),
        ("[^/]+", 7),
        ("/[^/]+/S.*", 12),
        ("\\w+", 8),
        ("\\d{3}", 7),
        ("a", 5),
        ("(a|b|c)", 7),
        (
            "/api/v[0-9]+/users/[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
            87,
        ),
    ];

    #[test]
    fn the_estimate_is_at_or_above_re2_and_within_reach_of_it() {
        for (pattern, re2) in MEASURED {
            let estimate = estimate(pattern).unwrap();
            assert!(estimate >= re2, "{pattern}: estimated {estimate} < RE2's {re2}");
            assert!(estimate <= 2 * re2 + 8, "{pattern}: estimated {estimate}, RE2 {re2}");
        }
    }

    #[test]
    fn a_regex_over_the_budget_skips_its_route_naming_the_field() {
        use aether_proto::registry::v1::{PathMatch, RouteMatch, RouteRule};
        let route = |path: &str, header: &str| Route {
            kind: RouteKind::Http as i32,
            rules: vec![RouteRule {
                matches: vec![RouteMatch {
                    path: Some(PathMatch {
                        r#type: MatchType::Regex as i32,
                        value: path.into(),
                    }),
                    headers: vec![ValueMatch {
                        name: "x-user".into(),
                        r#type: MatchType::Regex as i32,
                        value: header.into(),
                    }],
                    ..Default::default()
                }],
                ..Default::default()
            }],
            ..Default::default()
        };
        // Envoy's default limit refuses this one; the mesh's budget does not.
        check(&route("/[a-z]{1,50}", "[a-z]+")).unwrap();
        let error = check(&route("/x", "[a-z]{1,300}")).unwrap_err().to_string();
        assert!(
            error.starts_with("rules[0].matches[0].headers[0].value: \"[a-z]{1,300}\""),
            "{error}"
        );
        assert!(check(&route("(/[a-z]{1,100}){1,10}", "x")).is_err());
        // Unicode classes are counted generously, never under.
        assert!(estimate("\\p{L}+").unwrap() > estimate("[a-z]+").unwrap());
    }

    #[test]
    fn the_shipped_bootstrap_sets_envoys_levels_to_the_budget() {
        let bootstrap = include_str!("../../../../../proxy/bootstrap.yaml");
        assert!(bootstrap.contains(&format!("re2.max_program_size.error_level: {ENVOY_ERROR_LEVEL}\n")));
        assert!(bootstrap.contains(&format!("re2.max_program_size.warn_level: {MAX_PROGRAM_SIZE}\n")));
    }
}
