//! The feature table: for each feature, the cases that exercise it and how many passed; then each case with the
//! upstream test it restates.

use std::collections::BTreeMap;

use super::Case;

/// Markdown: `| feature | cases | pass |`, then `| case | restates | result |`.
pub fn feature_table(results: &[(&Case, Result<(), String>)]) -> String {
    let mut by_feature: BTreeMap<&str, Vec<(&str, bool)>> = BTreeMap::new();
    for (case, result) in results {
        for feature in &case.features {
            by_feature
                .entry(feature.as_str())
                .or_default()
                .push((case.name.as_str(), result.is_ok()));
        }
    }
    let mut out = String::from("| Feature | Cases | Pass |\n| --- | --- | --- |\n");
    for (feature, cases) in &by_feature {
        let names: Vec<&str> = cases.iter().map(|(name, _)| *name).collect();
        let passed = cases.iter().filter(|(_, ok)| *ok).count();
        let mark = if passed == cases.len() { "yes" } else { "NO" };
        out.push_str(&format!(
            "| {feature} | {} | {mark} ({passed}/{}) |\n",
            names.join(", "),
            cases.len()
        ));
    }
    out.push_str("\n| Case | Restates | Result |\n| --- | --- | --- |\n");
    for (case, result) in results {
        let restates = case.restates.as_deref().unwrap_or("(ours)");
        let result = if result.is_ok() { "pass" } else { "FAIL" };
        out.push_str(&format!("| {} | {restates} | {result} |\n", case.name));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn case(name: &str, features: &[&str]) -> Case {
        Case {
            name: name.into(),
            about: String::new(),
            restates: Some(format!("Upstream{name}")),
            features: features.iter().map(|f| f.to_string()).collect(),
            routes: String::new(),
            gateway: None,
            requests: Vec::new(),
            splits: Vec::new(),
        }
    }

    #[test]
    fn a_feature_passes_only_when_every_case_of_it_does() {
        let (a, b) = (case("a", &["Mesh", "HTTPRoute"]), case("b", &["Mesh"]));
        let table = feature_table(&[(&a, Ok(())), (&b, Err("row 0".into()))]);
        assert!(table.contains("| HTTPRoute | a | yes (1/1) |"), "{table}");
        assert!(table.contains("| Mesh | a, b | NO (1/2) |"), "{table}");
        assert!(table.contains("| b | Upstreamb | FAIL |"), "{table}");
    }
}
