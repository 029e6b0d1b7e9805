//! Gateway API durations (GEP-2257): one to four components, each one to five decimal
//! digits and a unit `h`, `m`, `s` or `ms`, summed: "1h", "10s", "500ms", "1m30s".
//! No sign, no fraction, no days; units may repeat ("1h2h" is 3 h).

use std::time::Duration;

use aether_common::quote::quote;

/// Why a string is not a GEP-2257 duration. Display names the input, bounded.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{} is not a Gateway API duration ({reason}), e.g. \"10s\", \"500ms\" or \"1m30s\"", quote(.input))]
pub struct DurationError {
    pub input: String,
    pub reason: &'static str,
}

const MAX_COMPONENTS: usize = 4;
const MAX_DIGITS: usize = 5;

/// Parses a GEP-2257 duration.
pub fn parse(text: &str) -> Result<Duration, DurationError> {
    let fail = |reason| DurationError {
        input: text.to_owned(),
        reason,
    };
    if text.is_empty() {
        return Err(fail("empty"));
    }
    let mut rest = text;
    let mut total = Duration::ZERO;
    for _ in 0..MAX_COMPONENTS {
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return Err(fail("each component is digits then a unit"));
        }
        if digits > MAX_DIGITS {
            return Err(fail("at most 5 digits per component"));
        }
        let value: u64 = rest[..digits]
            .parse()
            .map_err(|_| fail("each component is digits then a unit"))?;
        rest = &rest[digits..];
        // "ms" before "m": the longest unit that fits.
        let (unit, millis) = [("ms", 1), ("h", 3_600_000), ("m", 60_000), ("s", 1_000)]
            .into_iter()
            .find(|(unit, _)| rest.starts_with(unit))
            .ok_or_else(|| fail("units are h, m, s and ms"))?;
        rest = &rest[unit.len()..];
        // At most 4 × 99999 h: no overflow.
        total += Duration::from_millis(value * millis);
        if rest.is_empty() {
            return Ok(total);
        }
    }
    Err(fail("at most 4 components"))
}

/// A duration in whole milliseconds, as the route protos carry it.
pub fn parse_millis(text: &str) -> Result<u64, DurationError> {
    // At most 4 × 99999 h: fits in u64 milliseconds.
    parse(text).map(|d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gep_test_vectors_parse() {
        let ms = |h: u64, m: u64, s: u64, ms: u64| Duration::from_millis(((h * 60 + m) * 60 + s) * 1000 + ms);
        for (text, expected) in [
            ("0h", ms(0, 0, 0, 0)),
            ("0s", ms(0, 0, 0, 0)),
            ("0h0m0s", ms(0, 0, 0, 0)),
            ("1h", ms(1, 0, 0, 0)),
            ("30m", ms(0, 30, 0, 0)),
            ("10s", ms(0, 0, 10, 0)),
            ("500ms", ms(0, 0, 0, 500)),
            ("2h30m", ms(2, 30, 0, 0)),
            ("150m", ms(2, 30, 0, 0)),
            ("7230s", ms(2, 0, 30, 0)),
            ("1h30m10s", ms(1, 30, 10, 0)),
            ("10s30m1h", ms(1, 30, 10, 0)),
            ("100ms200ms300ms", ms(0, 0, 0, 600)),
            ("1m30s", ms(0, 1, 30, 0)),
            ("00060m", ms(1, 0, 0, 0)),
            ("99999h99999h99999h99999h", ms(4 * 99999, 0, 0, 0)),
        ] {
            assert_eq!(parse(text), Ok(expected), "{text}");
        }
        assert_eq!(parse_millis("1s500ms"), Ok(1500));
    }

    #[test]
    fn the_gep_invalid_vectors_are_refused_with_a_reason() {
        for (text, reason) in [
            ("1", "units are h, m, s and ms"),
            ("1m1", "units are h, m, s and ms"),
            ("1d", "units are h, m, s and ms"),
            ("1h30m10s20ms50h", "at most 4 components"),
            ("999999h", "at most 5 digits per component"),
            ("1.5h", "units are h, m, s and ms"),
            ("-15m", "each component is digits then a unit"),
            ("", "empty"),
            ("h", "each component is digits then a unit"),
            ("1h ", "each component is digits then a unit"),
            ("1H", "units are h, m, s and ms"),
        ] {
            assert_eq!(parse(text).unwrap_err().reason, reason, "{text:?}");
        }
        assert_eq!(
            parse("1.5h").unwrap_err().to_string(),
            "\"1.5h\" is not a Gateway API duration (units are h, m, s and ms), e.g. \"10s\", \"500ms\" or \"1m30s\""
        );
    }

    proptest::proptest! {
        #[test]
        fn never_panics_and_bounds_its_message(text in "(?s).{0,100}") {
            if let Err(e) = parse(&text) {
                proptest::prop_assert!(e.to_string().len() < 1024);
            }
        }
    }
}
