//! Bounded quoting of input in error messages and log lines.
//!
//! An error that echoes what it was given helps the caller fix it, but the input can
//! be arbitrarily large: a gRPC status carrying a 1 MB field travels in trailers that a
//! standard client refuses (16 KiB metadata limit), so the caller never learns what
//! was wrong; a log line carrying it floods the log. Every error or log line that
//! quotes input goes through this module instead of `{:?}`:
//!
//! - [`quote`] for a value (a key, an address, a path, a name):
//!   `"shop/cart"`, or for a long one the start of it and its full size,
//!   `"aaaaaaaa…aaaa"… (1048576 bytes)`. Debug-escaped like `{:?}`, so control
//!   characters cannot forge log lines.
//! - [`clip`] for prose that may embed input, such as a library's error message
//!   (`invalid type: string "…", expected u64`): printed as is, with control characters
//!   escaped, and cut the same way after [`CLIP_CHARS`] characters.
//!
//! Both print at most [`MAX_QUOTED_BYTES`] / [`MAX_CLIPPED_BYTES`] bytes whatever the
//! input, and neither allocates.

use std::fmt;

/// How many characters of a value [`quote`] shows.
pub const QUOTE_CHARS: usize = 64;
/// How many characters of a message [`clip`] shows.
pub const CLIP_CHARS: usize = 128;

/// The longest `… (N bytes)` suffix: `…` is 3 bytes, N at most 20 digits.
const SUFFIX_BYTES: usize = 3 + " (".len() + 20 + " bytes)".len();
/// The longest text `{:?}` makes of one `char` (`\u{10ffff}`).
const MAX_DEBUG_CHAR_BYTES: usize = 10;
/// The longest text [`clip`] makes of one `char`: a control character escaped
/// (`\u{9f}`); any other character is at most 4 bytes of UTF-8.
const MAX_CLIP_CHAR_BYTES: usize = 6;

/// Upper bound of the text a [`Quoted`] prints, whatever the input.
pub const MAX_QUOTED_BYTES: usize = 2 + QUOTE_CHARS * MAX_DEBUG_CHAR_BYTES + SUFFIX_BYTES;
/// Upper bound of the text a [`Clipped`] prints, whatever the input.
pub const MAX_CLIPPED_BYTES: usize = CLIP_CHARS * MAX_CLIP_CHAR_BYTES + SUFFIX_BYTES;
// Both stay under 1 KiB, so a message quoting a value or two stays small.
const _: () = assert!(MAX_QUOTED_BYTES < 1024 && MAX_CLIPPED_BYTES < 1024);

/// Quotes `value` for an error or log line: `{:?}` of the value when it has at most
/// [`QUOTE_CHARS`] characters, else `{:?}` of its first [`QUOTE_CHARS`] characters
/// followed by `… (N bytes)`, N the value's full length.
///
/// ```
/// use aether_common::quote::quote;
/// assert_eq!(quote("shop/cart").to_string(), r#""shop/cart""#);
/// assert_eq!(
///     format!("{}", quote(&"x".repeat(100))),
///     format!("{:?}… (100 bytes)", "x".repeat(64))
/// );
/// ```
pub fn quote(value: &str) -> Quoted<'_> {
    Quoted(value)
}

/// Bounds `message`, prose that may embed input (a library's error, say): printed as
/// is with control characters escaped, cut after [`CLIP_CHARS`] characters and then
/// followed by `… (N bytes)`, N the message's full length.
///
/// ```
/// use aether_common::quote::clip;
/// assert_eq!(clip("expected value at line 1").to_string(), "expected value at line 1");
/// assert!(clip(&"y".repeat(1 << 20)).to_string().ends_with("y… (1048576 bytes)"));
/// ```
pub fn clip(message: &str) -> Clipped<'_> {
    Clipped(message)
}

/// A value quoted by [`quote`]; `Display` and `Debug` print the same text.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Quoted<'a>(&'a str);

/// A message bounded by [`clip`]; `Display` and `Debug` print the same text.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Clipped<'a>(&'a str);

/// `text` cut after `chars` characters (on a character boundary), and whether it was cut.
fn prefix(text: &str, chars: usize) -> (&str, bool) {
    match text.char_indices().nth(chars) {
        Some((end, _)) => (&text[..end], true),
        None => (text, false),
    }
}

fn suffix(f: &mut fmt::Formatter<'_>, full: &str) -> fmt::Result {
    write!(f, "… ({} bytes)", full.len())
}

impl fmt::Display for Quoted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (shown, cut) = prefix(self.0, QUOTE_CHARS);
        fmt::Debug::fmt(shown, f)?;
        if cut {
            suffix(f, self.0)?;
        }
        Ok(())
    }
}

impl fmt::Debug for Quoted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for Clipped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (shown, cut) = prefix(self.0, CLIP_CHARS);
        // Runs of ordinary characters are written as they are; control characters escaped.
        let mut rest = shown;
        while let Some(at) = rest.find(char::is_control) {
            f.write_str(&rest[..at])?;
            let c = rest[at..].chars().next().expect("found a character");
            write!(f, "{}", c.escape_debug())?;
            rest = &rest[at + c.len_utf8()..];
        }
        f.write_str(rest)?;
        if cut {
            suffix(f, self.0)?;
        }
        Ok(())
    }
}

impl fmt::Debug for Clipped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_short_value_is_quoted_as_debug_does() {
        for value in ["", "shop/cart", "a \"b\"\n\t\\", "ünï©ødé", &"z".repeat(QUOTE_CHARS)] {
            assert_eq!(quote(value).to_string(), format!("{value:?}"));
            assert_eq!(format!("{:?}", quote(value)), format!("{value:?}"));
        }
    }

    #[test]
    fn a_long_value_shows_its_start_and_its_size() {
        let value = format!("{}tail", "a".repeat(QUOTE_CHARS));
        assert_eq!(
            quote(&value).to_string(),
            format!("\"{}\"… ({} bytes)", "a".repeat(QUOTE_CHARS), QUOTE_CHARS + 4)
        );
        let big = "k".repeat(1 << 20);
        let quoted = quote(&big).to_string();
        assert!(quoted.ends_with("\"… (1048576 bytes)"), "{quoted}");
        assert!(quoted.len() < 100, "{quoted}");
    }

    #[test]
    fn the_cut_is_on_a_character_boundary() {
        // 2-, 3- and 4-byte characters: the cut counts characters, never splits one.
        for c in ['é', '€', '🦀'] {
            let value: String = std::iter::repeat_n(c, QUOTE_CHARS + 1).collect();
            let shown: String = std::iter::repeat_n(c, QUOTE_CHARS).collect();
            assert_eq!(quote(&value).to_string(), format!("{shown:?}… ({} bytes)", value.len()));
        }
    }

    #[test]
    fn control_characters_are_escaped() {
        assert_eq!(quote("a\nb\u{1b}[2J").to_string(), r#""a\nb\u{1b}[2J""#);
        assert_eq!(
            clip("line 1\nforged: line\r\0").to_string(),
            r"line 1\nforged: line\r\0"
        );
        assert_eq!(
            clip("expected `u64`, got \"é\"").to_string(),
            "expected `u64`, got \"é\""
        );
    }

    #[test]
    fn a_long_message_is_clipped_with_its_size() {
        let message = format!("invalid type: string \"{}\", expected u64", "v".repeat(1000));
        let clipped = clip(&message).to_string();
        assert!(clipped.starts_with("invalid type: string \"vvvv"), "{clipped}");
        assert!(clipped.ends_with(&format!("v… ({} bytes)", message.len())), "{clipped}");
        assert_eq!(
            clipped.chars().count(),
            CLIP_CHARS + format!("… ({} bytes)", message.len()).len() - 2
        );
    }

    #[test]
    fn the_bounds_hold_for_the_worst_characters() {
        // `{:?}` of U+10FFFF and clip of a C1 control take the most bytes per character.
        let worst: String = std::iter::repeat_n('\u{10ffff}', 1 << 16).collect();
        assert_eq!(
            quote(&worst).to_string().len(),
            2 + QUOTE_CHARS * 10 + "… (262144 bytes)".len()
        );
        let controls: String = std::iter::repeat_n('\u{9f}', 1 << 16).collect();
        assert_eq!(
            clip(&controls).to_string().len(),
            CLIP_CHARS * 6 + "… (131072 bytes)".len()
        );
    }

    proptest::proptest! {
        #[test]
        fn output_is_bounded_whatever_the_input(value in "(?s).{0,300}") {
            let quoted = quote(&value).to_string();
            proptest::prop_assert!(quoted.len() <= MAX_QUOTED_BYTES, "{} bytes: {quoted}", quoted.len());
            let clipped = clip(&value).to_string();
            proptest::prop_assert!(clipped.len() <= MAX_CLIPPED_BYTES, "{} bytes: {clipped}", clipped.len());
            // Short input is shown whole; long input ends with its full size.
            if value.chars().count() <= QUOTE_CHARS {
                proptest::prop_assert_eq!(&quoted, &format!("{value:?}"));
            } else {
                let size = format!("… ({} bytes)", value.len());
                proptest::prop_assert!(quoted.ends_with(&size));
            }
            // Control characters never reach the output unescaped.
            proptest::prop_assert!(!quoted.chars().any(char::is_control));
            proptest::prop_assert!(!clipped.chars().any(char::is_control));
        }

        #[test]
        fn the_shown_prefix_is_the_start_of_the_input(value in "\\PC{0,200}") {
            let clipped = clip(&value).to_string();
            let shown = clipped.split("… (").next().unwrap();
            proptest::prop_assert!(value.starts_with(shown));
        }
    }
}
