//! What reaches a terminal or a JSON reader: names, attributes and provenance come from
//! files, so the characters that could drive a terminal are escaped in both outputs.

use std::borrow::Cow;
use std::fmt::Write;

use serde::Serialize;

use crate::Report;

/// What could drive a terminal or hide in a name: one rule for every tracegate tool
/// ([`tracegate_trace::output::needs_escape`]).
pub(crate) use tracegate_trace::output::needs_escape;

/// `c` as a JSON string escape: `\u202e`, a surrogate pair beyond the BMP (`\udb40\udc01`).
pub(crate) fn json_escape(out: &mut String, c: char) {
    for unit in c.encode_utf16(&mut [0; 2]) {
        let _ = write!(out, "\\u{unit:04x}");
    }
}

/// `s` with every character [`needs_escape`] names written by `escape`.
pub(crate) fn escape_with(s: &str, escape: fn(&mut String, char)) -> Cow<'_, str> {
    if !s.chars().any(needs_escape) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 16);
    for c in s.chars() {
        if needs_escape(c) {
            escape(&mut out, c);
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// Text for a terminal: each character [`needs_escape`] names is written as `\u{1b}`.
pub fn terminal_safe(s: &str) -> Cow<'_, str> {
    escape_with(s, |o, c| {
        let _ = write!(o, "\\u{{{:x}}}", c as u32);
    })
}

/// serde_json's pretty layout, with every string fragment passed through [`needs_escape`]:
/// serde_json escapes U+0000..U+001F itself; DEL, the C1 controls and the format characters
/// become `\u007f`-style escapes here (surrogate pairs beyond the BMP), the same string once
/// parsed.
struct SafeJson<'a>(serde_json::ser::PrettyFormatter<'a>);

macro_rules! delegate {
    ($($name:ident($($arg:ident: $ty:ty),*)),* $(,)?) => {$(
        fn $name<W: ?Sized + std::io::Write>(&mut self, w: &mut W $(, $arg: $ty)*) -> std::io::Result<()> {
            self.0.$name(w $(, $arg)*)
        }
    )*};
}

impl serde_json::ser::Formatter for SafeJson<'_> {
    delegate!(
        begin_array(),
        end_array(),
        begin_array_value(first: bool),
        end_array_value(),
        begin_object(),
        end_object(),
        begin_object_key(first: bool),
        end_object_key(),
        begin_object_value(),
        end_object_value(),
    );
    fn write_string_fragment<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        fragment: &str,
    ) -> std::io::Result<()> {
        let safe = escape_with(fragment, json_escape);
        w.write_all(safe.as_bytes())
    }
}

/// Writes the JSON report streamed (no whole-report string), pretty, newline-terminated.
pub fn write_json(rep: &Report, out: &mut dyn std::io::Write) -> std::io::Result<()> {
    pretty_json(rep, out)
}

pub(super) fn pretty_json(
    value: &impl Serialize,
    out: &mut dyn std::io::Write,
) -> std::io::Result<()> {
    let mut ser = serde_json::Serializer::with_formatter(
        &mut *out,
        SafeJson(serde_json::ser::PrettyFormatter::new()),
    );
    value.serialize(&mut ser).map_err(std::io::Error::other)?;
    out.write_all(b"\n")?;
    out.flush()
}
