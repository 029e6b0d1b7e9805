//! Durations on the command line: `250ms`, `5s`, `10m`, `1h`.

use std::time::Duration;

use crate::quote::quote;

/// Parses `<digits><unit>` with unit `ms`, `s`, `m` or `h`.
pub fn parse(text: &str) -> Result<Duration, String> {
    let digits = text.bytes().take_while(u8::is_ascii_digit).count();
    let (number, unit) = text.split_at(digits);
    let value: u64 = number
        .parse()
        .map_err(|_| format!("{} is not a duration like 250ms, 5s, 10m or 1h", quote(text)))?;
    let seconds = match unit {
        "ms" => return Ok(Duration::from_millis(value)),
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        _ => return Err(format!("{} has no unit: use ms, s, m or h (e.g. 5s)", quote(text))),
    };
    value
        .checked_mul(seconds)
        .map(Duration::from_secs)
        .ok_or_else(|| format!("{} is too long", quote(text)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_each_unit_and_refuses_the_rest() {
        assert_eq!(parse("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse("5s"), Ok(Duration::from_secs(5)));
        assert_eq!(parse("10m"), Ok(Duration::from_secs(600)));
        assert_eq!(parse("1h"), Ok(Duration::from_secs(3600)));
        assert!(parse("5").unwrap_err().contains("no unit"));
        assert!(parse("s").unwrap_err().contains("not a duration"));
        assert!(parse("-1s").is_err());
        assert!(parse("5d").is_err());
        // Input is quoted bounded: its start and its size.
        let huge = parse(&"9".repeat(1 << 20)).unwrap_err();
        assert!(
            huge.ends_with("… (1048576 bytes) is not a duration like 250ms, 5s, 10m or 1h"),
            "{huge}"
        );
    }
}
