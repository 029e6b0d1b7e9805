//! A strict parser of Prometheus text exposition: OpenMetrics 1.0 (what prometheus-client writes) and the classic
//! 0.0.4 format (what Envoy's `/stats/prometheus` writes).
//!
//! The OTLP exporter turns a registry into OTLP by encoding it and parsing it back here, so the OTLP metrics are
//! the `/metrics` instruments by construction; tests use it to check that every binary's `/metrics` is valid.

use std::collections::BTreeSet;
use std::iter::Peekable;
use std::str::CharIndices;

use crate::quote::{clip, quote};

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

impl Family {
    fn new(name: &str) -> Self {
        Family {
            name: name.to_owned(),
            kind: Kind::Unknown,
            help: String::new(),
            unit: String::new(),
            samples: Vec::new(),
        }
    }
}

/// Why a text is not valid exposition. Input is quoted bounded (`crate::quote`): an
/// exposition can be megabytes, and so can one of its lines.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ExpositionError {
    #[error("line {line}: {problem}")]
    Line { line: usize, problem: LineError },
    #[error("the exposition does not end with `# EOF`")]
    MissingEof,
    #[error("family {}: {problem}", clip(.family))]
    Family { family: String, problem: FamilyError },
}

/// What is wrong with one line.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum LineError {
    #[error("content after `# EOF`")]
    AfterEof,
    #[error("empty line")]
    Empty,
    #[error("unknown descriptor {}", quote(.0))]
    UnknownDescriptor(String),
    #[error("invalid metric name {}", quote(.0))]
    MetricName(String),
    #[error("family {} appears twice", clip(.0))]
    FamilyTwice(String),
    #[error("descriptor for {} after its samples", clip(.0))]
    DescriptorAfterSamples(String),
    #[error("unknown type {}", quote(.0))]
    UnknownType(String),
    #[error("unit {} is not a suffix of {}", clip(.unit), clip(.name))]
    UnitNotSuffix { unit: String, name: String },
    #[error("samples of {} are not contiguous", clip(.0))]
    NotContiguous(String),
    #[error("sample {} outside its family", clip(.0))]
    OutsideFamily(String),
    #[error(transparent)]
    Sample(#[from] SampleError),
}

/// What is wrong with a sample line, `name{label="value",...} value [timestamp]`.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SampleError {
    #[error("a sample needs a value")]
    NoValue,
    #[error("invalid metric name {}", quote(.0))]
    MetricName(String),
    #[error("unterminated label set")]
    UnterminatedLabels,
    #[error("label without `=`")]
    LabelWithoutEquals,
    #[error("invalid label name {}", quote(.0))]
    LabelName(String),
    #[error("label {} repeated", clip(.0))]
    LabelRepeated(String),
    #[error("label {}: value not quoted", clip(.0))]
    ValueNotQuoted(String),
    /// The character after a `\` in a label value (`None`: the line ended).
    #[error("label {}: bad escape {}", clip(.label), escape_text(*.after))]
    BadEscape { label: String, after: Option<char> },
    #[error("label {}: unterminated value", clip(.0))]
    UnterminatedValue(String),
    #[error("expected `,` or `}}` after a label")]
    ExpectedCommaOrBrace,
    #[error("expected a space before the value")]
    NoSpaceBeforeValue,
    #[error("invalid value {}", quote(.0))]
    Value(String),
    #[error("invalid timestamp {}", quote(.0))]
    Timestamp(String),
    #[error("trailing fields after the timestamp")]
    TrailingFields,
}

fn escape_text(after: Option<char>) -> String {
    match after {
        Some(c) => format!("\\{}", c.escape_debug()),
        None => "at the end of the line".to_owned(),
    }
}

/// What is wrong with a family as a whole.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum FamilyError {
    #[error("duplicate sample {}", clip(.0))]
    DuplicateSample(String),
    #[error("negative counter")]
    NegativeCounter,
    #[error("histogram without buckets")]
    NoBuckets,
    #[error("histogram without a +Inf bucket")]
    NoInfBucket,
    #[error("buckets not ascending or counts not cumulative")]
    NotCumulative,
    #[error("+Inf bucket differs from _count")]
    InfBucketNotCount,
}

/// Parses and validates `text`; returns its families in order.
pub fn parse(text: &str, format: Format) -> Result<Vec<Family>, ExpositionError> {
    let mut parser = Parser::new(format);
    for (index, line) in text.lines().enumerate() {
        parser.line(line).map_err(|problem| ExpositionError::Line {
            line: index + 1,
            problem,
        })?;
    }
    parser.finish()
}

/// The families read so far, line by line.
struct Parser {
    format: Format,
    families: Vec<Family>,
    /// Every family name met, to refuse one that comes back later.
    seen: BTreeSet<String>,
    eof: bool,
}

/// The descriptors a `#` line may carry.
#[derive(Clone, Copy)]
enum Descriptor {
    Type,
    Help,
    Unit,
}

impl Descriptor {
    fn parse(keyword: &str) -> Option<Descriptor> {
        match keyword {
            "TYPE" => Some(Descriptor::Type),
            "HELP" => Some(Descriptor::Help),
            "UNIT" => Some(Descriptor::Unit),
            _ => None,
        }
    }
}

impl Parser {
    fn new(format: Format) -> Self {
        Parser {
            format,
            families: Vec::new(),
            seen: BTreeSet::new(),
            eof: false,
        }
    }

    fn line(&mut self, line: &str) -> Result<(), LineError> {
        if self.eof {
            return Err(LineError::AfterEof);
        }
        if line.is_empty() {
            return match self.format {
                Format::OpenMetrics => Err(LineError::Empty),
                Format::Prometheus => Ok(()),
            };
        }
        match line.strip_prefix('#') {
            Some(comment) => self.comment(comment.strip_prefix(' ').unwrap_or(comment)),
            None => self.sample(parse_sample(line)?),
        }
    }

    /// `# EOF`, a descriptor, or (0.0.4 only) a free comment.
    fn comment(&mut self, comment: &str) -> Result<(), LineError> {
        if comment == "EOF" {
            self.eof = true;
            return Ok(());
        }
        let mut parts = comment.splitn(3, ' ');
        let keyword = parts.next().unwrap_or_default();
        let Some(descriptor) = Descriptor::parse(keyword) else {
            return match self.format {
                Format::OpenMetrics => Err(LineError::UnknownDescriptor(keyword.to_owned())),
                Format::Prometheus => Ok(()),
            };
        };
        let name = parts.next().unwrap_or_default();
        let rest = parts.next().unwrap_or_default();
        if !valid_metric_name(name) {
            return Err(LineError::MetricName(name.to_owned()));
        }
        let family = self.described(name)?;
        if !family.samples.is_empty() {
            return Err(LineError::DescriptorAfterSamples(name.to_owned()));
        }
        describe(family, descriptor, rest)
    }

    /// The family a descriptor of `name` is about: a descriptor for a new name starts a new family.
    fn described(&mut self, name: &str) -> Result<&mut Family, LineError> {
        if self.families.last().is_none_or(|f| f.name != name) {
            if !self.seen.insert(name.to_owned()) {
                return Err(LineError::FamilyTwice(name.to_owned()));
            }
            self.families.push(Family::new(name));
        }
        Ok(self.families.last_mut().expect("pushed above"))
    }

    /// A sample belongs to the family just described, or (0.0.4) starts an untyped one.
    fn sample(&mut self, sample: Sample) -> Result<(), LineError> {
        let format = self.format;
        let fits = |f: &Family| {
            f.kind
                .suffixes(format)
                .iter()
                .any(|suffix| sample.name.strip_suffix(suffix) == Some(f.name.as_str()))
        };
        match self.families.last_mut() {
            Some(family) if fits(family) => family.samples.push(sample),
            _ if format == Format::Prometheus => {
                // 0.0.4 allows samples without descriptors: an untyped family of their own.
                if !self.seen.insert(sample.name.clone()) {
                    return Err(LineError::NotContiguous(sample.name));
                }
                let mut family = Family::new(&sample.name);
                family.samples.push(sample);
                self.families.push(family);
            }
            _ => return Err(LineError::OutsideFamily(sample.name)),
        }
        Ok(())
    }

    fn finish(self) -> Result<Vec<Family>, ExpositionError> {
        if self.format == Format::OpenMetrics && !self.eof {
            return Err(ExpositionError::MissingEof);
        }
        for family in &self.families {
            check_family(family).map_err(|problem| ExpositionError::Family {
                family: family.name.clone(),
                problem,
            })?;
        }
        Ok(self.families)
    }
}

fn describe(family: &mut Family, descriptor: Descriptor, rest: &str) -> Result<(), LineError> {
    match descriptor {
        Descriptor::Type => family.kind = Kind::parse(rest).ok_or_else(|| LineError::UnknownType(rest.to_owned()))?,
        Descriptor::Help => family.help = unescape_help(rest),
        Descriptor::Unit => {
            if !rest.is_empty() && !family.name.ends_with(&format!("_{rest}")) {
                return Err(LineError::UnitNotSuffix {
                    unit: rest.to_owned(),
                    name: family.name.clone(),
                });
            }
            family.unit = rest.to_owned();
        }
    }
    Ok(())
}

/// No duplicate samples, no negative counter, and for histograms [`check_histogram`].
fn check_family(family: &Family) -> Result<(), FamilyError> {
    let mut keys = BTreeSet::new();
    for sample in &family.samples {
        let mut labels = sample.labels.clone();
        labels.sort();
        if !keys.insert((sample.name.clone(), labels)) {
            return Err(FamilyError::DuplicateSample(sample.name.clone()));
        }
        if family.kind == Kind::Counter && sample.value < 0.0 {
            return Err(FamilyError::NegativeCounter);
        }
    }
    if family.kind != Kind::Histogram {
        return Ok(());
    }
    histogram_series(family).iter().try_for_each(check_histogram)
}

/// Per label set: `le` ascending ending with +Inf, cumulative counts non-decreasing, +Inf == _count.
fn check_histogram(series: &HistogramSeries) -> Result<(), FamilyError> {
    let Some(last) = series.buckets.last() else {
        return Err(FamilyError::NoBuckets);
    };
    if last.0 != f64::INFINITY {
        return Err(FamilyError::NoInfBucket);
    }
    for pair in series.buckets.windows(2) {
        if pair[1].0 <= pair[0].0 || pair[1].1 < pair[0].1 {
            return Err(FamilyError::NotCumulative);
        }
    }
    if series.count.is_some_and(|count| count != last.1) {
        return Err(FamilyError::InfBucketNotCount);
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
fn parse_sample(line: &str) -> Result<Sample, SampleError> {
    let name_end = line.find(['{', ' ']).ok_or(SampleError::NoValue)?;
    let name = &line[..name_end];
    if !valid_metric_name(name) {
        return Err(SampleError::MetricName(name.to_owned()));
    }
    let (labels, rest) = match line[name_end..].strip_prefix('{') {
        Some(body) => parse_labels(body)?,
        None => (Vec::new(), &line[name_end..]),
    };
    let value = parse_value_and_timestamp(rest)?;
    Ok(Sample {
        name: name.to_owned(),
        labels,
        value,
    })
}

/// A sample's labels, in order.
type Labels = Vec<(String, String)>;

/// The labels of `body` (what follows the `{`) and the text after the closing `}`.
fn parse_labels(body: &str) -> Result<(Labels, &str), SampleError> {
    let mut labels = Labels::new();
    let mut chars = body.char_indices().peekable();
    let end = loop {
        let start = match chars.peek() {
            Some((i, '}')) => break *i,
            Some((i, _)) => *i,
            None => return Err(SampleError::UnterminatedLabels),
        };
        let eq = body[start..].find('=').ok_or(SampleError::LabelWithoutEquals)? + start;
        let key = &body[start..eq];
        if !valid_label_name(key) {
            return Err(SampleError::LabelName(key.to_owned()));
        }
        if labels.iter().any(|(k, _)| k == key) {
            return Err(SampleError::LabelRepeated(key.to_owned()));
        }
        while chars.peek().is_some_and(|(i, _)| *i <= eq) {
            chars.next();
        }
        if chars.next().map(|(_, c)| c) != Some('"') {
            return Err(SampleError::ValueNotQuoted(key.to_owned()));
        }
        labels.push((key.to_owned(), label_value(&mut chars, key)?));
        match chars.peek() {
            Some((_, ',')) => {
                chars.next();
            }
            Some((_, '}')) => {}
            _ => return Err(SampleError::ExpectedCommaOrBrace),
        }
    };
    Ok((labels, &body[end + 1..]))
}

/// A label value after its opening quote, unescaped, up to and including its closing quote.
fn label_value(chars: &mut Peekable<CharIndices<'_>>, key: &str) -> Result<String, SampleError> {
    let mut value = String::new();
    loop {
        match chars.next().map(|(_, c)| c) {
            Some('"') => return Ok(value),
            Some('\\') => match chars.next().map(|(_, c)| c) {
                Some('n') => value.push('\n'),
                Some('\\') => value.push('\\'),
                Some('"') => value.push('"'),
                after => {
                    return Err(SampleError::BadEscape {
                        label: key.to_owned(),
                        after,
                    });
                }
            },
            Some('\n') | None => return Err(SampleError::UnterminatedValue(key.to_owned())),
            Some(c) => value.push(c),
        }
    }
}

/// ` value [timestamp]`, what follows the name and labels.
fn parse_value_and_timestamp(rest: &str) -> Result<f64, SampleError> {
    let rest = rest.strip_prefix(' ').ok_or(SampleError::NoSpaceBeforeValue)?;
    let mut fields = rest.split(' ');
    let value_text = fields.next().unwrap_or_default();
    let value = parse_value(value_text).ok_or_else(|| SampleError::Value(value_text.to_owned()))?;
    if let Some(timestamp) = fields.next()
        && timestamp.parse::<f64>().is_err()
    {
        return Err(SampleError::Timestamp(timestamp.to_owned()));
    }
    if fields.next().is_some() {
        return Err(SampleError::TrailingFields);
    }
    Ok(value)
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

    #[test]
    fn errors_are_typed_and_quote_input_bounded() {
        let huge = "x".repeat(1 << 20);
        let error = parse(
            &format!("# TYPE a gauge\na{{k=\"1\"}} {huge}\n# EOF\n"),
            Format::OpenMetrics,
        )
        .unwrap_err();
        assert_eq!(
            error,
            ExpositionError::Line {
                line: 2,
                problem: LineError::Sample(SampleError::Value(huge.clone())),
            }
        );
        let text = error.to_string();
        assert!(text.starts_with("line 2: invalid value \"xxx"), "{text}");
        assert!(text.ends_with("… (1048576 bytes)"), "{text}");
        assert!(text.len() < 200, "{} bytes", text.len());
        let family = format!("a{huge}");
        let text = format!("# TYPE {family} counter\n# TYPE b gauge\n# TYPE {family} gauge\n");
        let error = parse(&text, Format::Prometheus).expect_err("refused").to_string();
        assert!(error.len() < 400, "{} bytes", error.len());
        assert!(error.ends_with("(1048577 bytes) appears twice"), "{error}");
    }

    #[test]
    fn a_bad_escape_names_the_label_and_the_escape() {
        let message = |line: &str| parse_sample(line).unwrap_err().to_string();
        assert_eq!(message(r#"a{k="\t"} 1"#), r"label k: bad escape \t");
        assert_eq!(message(r#"a{k="\"#), "label k: bad escape at the end of the line");
        assert_eq!(message(r#"a{k="v} 1"#), "label k: unterminated value");
        assert_eq!(message("a{k=\"v\"} 1 2 3"), "trailing fields after the timestamp");
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
