//! A strict parser of Prometheus text exposition: OpenMetrics 1.0 (what prometheus-client writes) and the classic
//! 0.0.4 format (what Envoy's `/stats/prometheus` writes).
//!
//! The OTLP exporter turns a registry into OTLP by encoding it and parsing it back here, so the OTLP metrics are
//! the `/metrics` instruments by construction; tests use it to check that every binary's `/metrics` is valid.

use std::collections::BTreeSet;

/// Which dialect to accept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// OpenMetrics 1.0: counters' samples end in `_total`, the text ends with `# EOF`.
    OpenMetrics,
    /// Prometheus text 0.0.4: no `# EOF`, counters' samples carry the family name.
    Prometheus,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
    Summary,
    Info,
    StateSet,
    GaugeHistogram,
    Unknown,
}

impl Kind {
    fn parse(s: &str) -> Option<Kind> {
        Some(match s {
            "counter" => Kind::Counter,
            "gauge" => Kind::Gauge,
            "histogram" => Kind::Histogram,
            "summary" => Kind::Summary,
            "info" => Kind::Info,
            "stateset" => Kind::StateSet,
            "gaugehistogram" => Kind::GaugeHistogram,
            "unknown" | "untyped" => Kind::Unknown,
            _ => return None,
        })
    }

    /// Sample-name suffixes a family of this kind may use.
    fn suffixes(self, format: Format) -> &'static [&'static str] {
        match (self, format) {
            (Kind::Counter, Format::OpenMetrics) => &["_total", "_created"],
            (Kind::Counter, Format::Prometheus) => &["", "_total"],
            (Kind::Histogram, _) => &["_bucket", "_sum", "_count", "_created"],
            (Kind::GaugeHistogram, _) => &["_bucket", "_gsum", "_gcount"],
            (Kind::Summary, _) => &["", "_sum", "_count", "_created"],
            (Kind::Info, _) => &["_info"],
            _ => &[""],
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

impl Sample {
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Family {
    pub name: String,
    pub kind: Kind,
    pub help: String,
    pub unit: String,
    pub samples: Vec<Sample>,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ExpositionError {
    #[error("line {line}: {message}")]
    Line { line: usize, message: String },
    #[error("the exposition does not end with `# EOF`")]
    MissingEof,
    #[error("family {family}: {message}")]
    Family { family: String, message: String },
}

fn line_error(line: usize, message: impl Into<String>) -> ExpositionError {
    ExpositionError::Line {
        line,
        message: message.into(),
    }
}

/// Parses and validates `text`; returns its families in order.
pub fn parse(text: &str, format: Format) -> Result<Vec<Family>, ExpositionError> {
    let mut families: Vec<Family> = Vec::new();
    let mut seen = BTreeSet::new();
    let mut eof = false;
    for (index, line) in text.lines().enumerate() {
        let n = index + 1;
        if eof {
            return Err(line_error(n, "content after `# EOF`"));
        }
        if line.is_empty() {
            if format == Format::OpenMetrics {
                return Err(line_error(n, "empty line"));
            }
            continue;
        }
        if let Some(comment) = line.strip_prefix('#') {
            let comment = comment.strip_prefix(' ').unwrap_or(comment);
            if comment == "EOF" {
                eof = true;
                continue;
            }
            let mut parts = comment.splitn(3, ' ');
            let keyword = parts.next().unwrap_or_default();
            if !matches!(keyword, "TYPE" | "HELP" | "UNIT") {
                if format == Format::OpenMetrics {
                    return Err(line_error(n, format!("unknown descriptor {keyword:?}")));
                }
                continue;
            }
            let name = parts.next().unwrap_or_default();
            let rest = parts.next().unwrap_or_default();
            if !valid_metric_name(name) {
                return Err(line_error(n, format!("invalid metric name {name:?}")));
            }
            // A descriptor for a new name starts a new family.
            if families.last().is_none_or(|f| f.name != name) {
                if !seen.insert(name.to_owned()) {
                    return Err(line_error(n, format!("family {name} appears twice")));
                }
                families.push(Family {
                    name: name.to_owned(),
                    kind: Kind::Unknown,
                    help: String::new(),
                    unit: String::new(),
                    samples: Vec::new(),
                });
            }
            let family = families.last_mut().expect("pushed above");
            if !family.samples.is_empty() {
                return Err(line_error(n, format!("descriptor for {name} after its samples")));
            }
            match keyword {
                "TYPE" => {
                    family.kind = Kind::parse(rest).ok_or_else(|| line_error(n, format!("unknown type {rest:?}")))?;
                }
                "HELP" => family.help = unescape_help(rest),
                _ => {
                    if !rest.is_empty() && !name.ends_with(&format!("_{rest}")) {
                        return Err(line_error(n, format!("unit {rest} is not a suffix of {name}")));
                    }
                    family.unit = rest.to_owned();
                }
            }
            continue;
        }
        let sample = parse_sample(line).map_err(|m| line_error(n, m))?;
        let fits = |f: &Family| {
            f.kind
                .suffixes(format)
                .iter()
                .any(|suffix| sample.name.strip_suffix(suffix) == Some(f.name.as_str()))
        };
        match families.last_mut() {
            Some(family) if fits(family) => family.samples.push(sample),
            _ if format == Format::Prometheus => {
                // 0.0.4 allows samples without descriptors: an untyped family of their own.
                if !seen.insert(sample.name.clone()) {
                    return Err(line_error(n, format!("samples of {} are not contiguous", sample.name)));
                }
                families.push(Family {
                    name: sample.name.clone(),
                    kind: Kind::Unknown,
                    help: String::new(),
                    unit: String::new(),
                    samples: vec![sample],
                });
            }
            _ => return Err(line_error(n, format!("sample {} outside its family", sample.name))),
        }
    }
    if format == Format::OpenMetrics && !eof {
        return Err(ExpositionError::MissingEof);
    }
    for family in &families {
        check_family(family)?;
    }
    Ok(families)
}

fn family_error(family: &Family, message: impl Into<String>) -> ExpositionError {
    ExpositionError::Family {
        family: family.name.clone(),
        message: message.into(),
    }
}

/// Histograms: per label set, `le` ascending ending with +Inf, cumulative counts non-decreasing, +Inf == _count.
fn check_family(family: &Family) -> Result<(), ExpositionError> {
    let mut keys = BTreeSet::new();
    for sample in &family.samples {
        let mut labels = sample.labels.clone();
        labels.sort();
        if !keys.insert((sample.name.clone(), labels)) {
            return Err(family_error(family, format!("duplicate sample {}", sample.name)));
        }
        if family.kind == Kind::Counter && sample.value < 0.0 {
            return Err(family_error(family, "negative counter"));
        }
    }
    if family.kind != Kind::Histogram {
        return Ok(());
    }
    for series in histogram_series(family) {
        let Some(last) = series.buckets.last() else {
            return Err(family_error(family, "histogram without buckets"));
        };
        if last.0 != f64::INFINITY {
            return Err(family_error(family, "histogram without a +Inf bucket"));
        }
        for pair in series.buckets.windows(2) {
            if pair[1].0 <= pair[0].0 || pair[1].1 < pair[0].1 {
                return Err(family_error(family, "buckets not ascending or counts not cumulative"));
            }
        }
        if series.count.is_some_and(|count| count != last.1) {
            return Err(family_error(family, "+Inf bucket differs from _count"));
        }
    }
    Ok(())
}

/// One histogram's label set with its buckets (upper bound, cumulative count), sum and count.
#[derive(Clone, Debug, PartialEq)]
pub struct HistogramSeries {
    pub labels: Vec<(String, String)>,
    pub buckets: Vec<(f64, f64)>,
    pub sum: Option<f64>,
    pub count: Option<f64>,
}

/// Groups a histogram family's samples by label set (without `le`), in order of appearance.
pub fn histogram_series(family: &Family) -> Vec<HistogramSeries> {
    let mut out: Vec<HistogramSeries> = Vec::new();
    // Label set → its index in `out` (a series' samples need not be adjacent).
    let mut index_of: std::collections::HashMap<Vec<(String, String)>, usize> = std::collections::HashMap::new();
    for sample in &family.samples {
        let labels: Vec<(String, String)> = sample.labels.iter().filter(|(k, _)| k != "le").cloned().collect();
        let index = match index_of.get(&labels) {
            Some(i) => *i,
            None => {
                index_of.insert(labels.clone(), out.len());
                out.push(HistogramSeries {
                    labels,
                    buckets: Vec::new(),
                    sum: None,
                    count: None,
                });
                out.len() - 1
            }
        };
        let series = &mut out[index];
        let suffix = &sample.name[family.name.len()..];
        match suffix {
            "_bucket" => {
                let le = sample.label("le").and_then(parse_value).unwrap_or(f64::NAN);
                series.buckets.push((le, sample.value));
            }
            "_sum" => series.sum = Some(sample.value),
            "_count" => series.count = Some(sample.value),
            _ => {}
        }
    }
    out
}

fn valid_metric_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

fn valid_label_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

fn parse_value(s: &str) -> Option<f64> {
    match s {
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        "NaN" => Some(f64::NAN),
        _ if s.is_empty() || s.starts_with('+') => None,
        _ => s.parse().ok(),
    }
}

fn unescape_help(s: &str) -> String {
    s.replace("\\n", "\n").replace("\\\\", "\\")
}

/// `name{label="value",...} value [timestamp]`.
fn parse_sample(line: &str) -> Result<Sample, String> {
    let name_end = line.find(['{', ' ']).ok_or("a sample needs a value")?;
    let name = &line[..name_end];
    if !valid_metric_name(name) {
        return Err(format!("invalid metric name {name:?}"));
    }
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(body) = rest.strip_prefix('{') {
        let mut chars = body.char_indices().peekable();
        let end = loop {
            match chars.peek() {
                Some((i, '}')) => break *i,
                None => return Err("unterminated label set".into()),
                _ => {}
            }
            let start = chars.peek().map(|(i, _)| *i).unwrap_or(0);
            let eq = body[start..].find('=').ok_or("label without `=`")? + start;
            let key = &body[start..eq];
            if !valid_label_name(key) {
                return Err(format!("invalid label name {key:?}"));
            }
            if labels.iter().any(|(k, _): &(String, String)| k == key) {
                return Err(format!("label {key} repeated"));
            }
            while chars.peek().is_some_and(|(i, _)| *i <= eq) {
                chars.next();
            }
            if chars.next().map(|(_, c)| c) != Some('"') {
                return Err(format!("label {key}: value not quoted"));
            }
            let mut value = String::new();
            loop {
                match chars.next() {
                    Some((_, '"')) => break,
                    Some((_, '\\')) => match chars.next() {
                        Some((_, 'n')) => value.push('\n'),
                        Some((_, '\\')) => value.push('\\'),
                        Some((_, '"')) => value.push('"'),
                        other => return Err(format!("label {key}: bad escape {other:?}")),
                    },
                    Some((_, '\n')) | None => return Err(format!("label {key}: unterminated value")),
                    Some((_, c)) => value.push(c),
                }
            }
            labels.push((key.to_owned(), value));
            match chars.peek() {
                Some((_, ',')) => {
                    chars.next();
                }
                Some((_, '}')) => {}
                _ => return Err("expected `,` or `}` after a label".into()),
            }
        };
        rest = &body[end + 1..];
    }
    let rest = rest.strip_prefix(' ').ok_or("expected a space before the value")?;
    let mut fields = rest.split(' ');
    let value_text = fields.next().unwrap_or_default();
    let value = parse_value(value_text).ok_or_else(|| format!("invalid value {value_text:?}"))?;
    if let Some(timestamp) = fields.next()
        && timestamp.parse::<f64>().is_err()
    {
        return Err(format!("invalid timestamp {timestamp:?}"));
    }
    if fields.next().is_some() {
        return Err("trailing fields after the timestamp".into());
    }
    Ok(Sample {
        name: name.to_owned(),
        labels,
        value,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::family::Family as PFamily;
    use prometheus_client::metrics::histogram::Histogram;
    use prometheus_client::registry::Registry;
    use proptest::prelude::*;

    #[test]
    fn prometheus_client_output_parses() {
        let mut registry = Registry::with_prefix("aether_test");
        let family = PFamily::<Vec<(String, String)>, Counter>::default();
        family
            .get_or_create(&vec![("type".into(), "a \"b\"\\\n".into())])
            .inc_by(3);
        registry.register("pushes", "Pushes, by type", family);
        let histogram = Histogram::new([0.1, 1.0]);
        histogram.observe(0.5);
        histogram.observe(5.0);
        registry.register_with_unit(
            "push_duration",
            "Push latency",
            prometheus_client::registry::Unit::Seconds,
            histogram,
        );
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        let families = parse(&text, Format::OpenMetrics).unwrap();
        assert_eq!(families.len(), 2);
        assert_eq!(families[0].name, "aether_test_pushes");
        assert_eq!(families[0].kind, Kind::Counter);
        assert_eq!(families[0].samples[0].label("type"), Some("a \"b\"\\\n"));
        assert_eq!(families[0].samples[0].value, 3.0);
        assert_eq!(families[1].name, "aether_test_push_duration_seconds");
        assert_eq!(families[1].unit, "seconds");
        let series = histogram_series(&families[1]);
        assert_eq!(series[0].buckets, vec![(0.1, 0.0), (1.0, 1.0), (f64::INFINITY, 2.0)]);
        assert_eq!(series[0].sum, Some(5.5));
        assert_eq!(series[0].count, Some(2.0));
    }

    #[test]
    fn envoy_style_text_parses() {
        let text = "# TYPE envoy_cluster_upstream_rq counter\n\
                    envoy_cluster_upstream_rq{envoy_response_code=\"200\",envoy_cluster_name=\"demo/b|80\"} 3\n\
                    # TYPE envoy_t histogram\n\
                    envoy_t_bucket{le=\"0.5\"} 0\nenvoy_t_bucket{le=\"+Inf\"} 2\nenvoy_t_sum{} 7\nenvoy_t_count{} 2\n";
        let families = parse(text, Format::Prometheus).unwrap();
        assert_eq!(families[0].samples[0].value, 3.0);
        assert_eq!(histogram_series(&families[1])[0].count, Some(2.0));
        // OpenMetrics is stricter: no EOF, and counters need _total.
        assert!(parse(text, Format::OpenMetrics).is_err());
    }

    #[test]
    fn invalid_texts_are_refused_with_the_line() {
        for (text, what) in [
            ("# TYPE a counter\na_total 1\n", "EOF"),
            ("# TYPE a counter\nb_total 1\n# EOF\n", "outside its family"),
            ("# TYPE a gauge\na{x=\"1\"} 1\na{x=\"1\"} 2\n# EOF\n", "duplicate"),
            ("# TYPE a gauge\na{x=1} 1\n# EOF\n", "quoted"),
            ("# TYPE a gauge\na{1x=\"1\"} 1\n# EOF\n", "invalid label name"),
            ("# TYPE a gauge\na one\n# EOF\n", "invalid value"),
            ("# TYPE a wibble\n# EOF\n", "unknown type"),
            (
                "# TYPE a histogram\na_bucket{le=\"1\"} 2\na_bucket{le=\"+Inf\"} 1\n# EOF\n",
                "cumulative",
            ),
            ("# TYPE a histogram\na_bucket{le=\"1\"} 2\n# EOF\n", "+Inf"),
            ("# TYPE a gauge\na 1\n# EOF\na 2\n", "after"),
            ("# TYPE a counter\n# TYPE b counter\n# TYPE a counter\n# EOF\n", "twice"),
        ] {
            let error = parse(text, Format::OpenMetrics).unwrap_err().to_string();
            assert!(error.contains(what), "{text:?}: {error}");
        }
    }

    proptest! {
        #[test]
        fn never_panics(text in ".{0,200}") {
            let _ = parse(&text, Format::OpenMetrics);
            let _ = parse(&text, Format::Prometheus);
        }

        #[test]
        fn label_values_round_trip(value in "\\PC{0,20}", n in 0u64..1_000_000) {
            let mut registry = Registry::default();
            let family = PFamily::<Vec<(String, String)>, Counter>::default();
            family.get_or_create(&vec![("v".into(), value.clone())]).inc_by(n);
            registry.register("c", "help", family);
            let mut text = String::new();
            prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
            let families = parse(&text, Format::OpenMetrics).unwrap();
            prop_assert_eq!(families[0].samples[0].label("v"), Some(value.as_str()));
            prop_assert_eq!(families[0].samples[0].value, n as f64);
        }
    }
}
