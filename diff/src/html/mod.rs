//! The HTML report: one self-contained page (inline CSS and hand-written SVG; no script, no
//! font, no URL) a person opens in a browser. `trace-diff --html` writes [`render_html`]'s
//! page; the gate's pages (`gate/src/milestone/render.rs`) are built from the primitives here.
//!
//! Every number the page shows comes from the report the JSON is serialised from, and says
//! where: an element with `data-json` (a JSON pointer into the `--json` report of the same run)
//! and `data-v` (that value, serialised by the same serializer). The browser test reads the DOM
//! and compares each with the JSON. Axis tick labels are the only other numbers.
//!
//! One concept a file: here, the primitives every page is built from (escaping, a value tied to
//! the JSON, the page and its style, the atomic write); `chart` (the log-scale chart);
//! `report_page` (the `trace-diff --html` page) with `decisions` (its decisions section).

mod chart;
mod decisions;
mod report_page;

use std::path::Path;

use serde::Serialize;

pub use chart::{BoundBar, LogChart, Mark, Point, Series};
pub use decisions::MAX_FLIPS;
pub use report_page::{render_html, write_html, MAX_ROWS};

use crate::Real;

/// `&`, `<`, `>`, `"`, `'` escaped: safe in text and in a quoted attribute. Control and
/// invisible format characters (bidirectional overrides and isolates, zero-width characters,
/// …; the terminal's and the JSON's rule) are shown as `\u{202e}`: raw, a name from a trace
/// could reorder what the browser shows. The one escaping function of every HTML page.
pub fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            c if crate::render::needs_escape(c) => {
                out.push_str(&format!("\\u{{{:x}}}", c as u32));
            }
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// The JSON text of `v`, as the report serialises it (a `Real` that is not finite is a string).
/// Characters [`esc`] would show as `\u{…}` are JSON escapes here (the same value once parsed):
/// such characters occur only inside JSON strings, so `data-v` stays the JSON's value.
pub fn json_text<T: Serialize + ?Sized>(v: &T) -> String {
    let text = serde_json::to_string(v).unwrap_or_else(|e| format!("\"unserialisable: {e}\""));
    crate::render::escape_with(&text, crate::render::json_escape).into_owned()
}

/// `<TAG class=.. data-json=POINTER data-v=JSON>SHOWN</TAG>`: a value of the report, shown
/// as `shown`, tied to where the JSON holds it.
pub fn val<T: Serialize + ?Sized>(
    tag: &str,
    class: &str,
    pointer: &str,
    v: &T,
    shown: &str,
) -> String {
    format!(
        "<{tag} class=\"{class}\" data-json=\"{}\" data-v=\"{}\">{}</{tag}>",
        esc(pointer),
        esc(&json_text(v)),
        esc(shown),
        tag = tag
    )
}

/// A number of the report in a table cell (`td.num`).
pub fn num_td<T: Serialize + ?Sized>(pointer: &str, v: &T, shown: &str) -> String {
    val("td", "num", pointer, v, shown)
}

/// A real for people: 3 significant digits, `0`, `inf`, `nan`; `-` for not measured.
pub fn fmt_real(v: Option<f64>) -> String {
    match v {
        None => "-".into(),
        Some(v) if v.is_nan() => "nan".into(),
        Some(v) if v.is_infinite() => {
            if v > 0.0 {
                "inf".into()
            } else {
                "-inf".into()
            }
        }
        Some(0.0) => "0".into(),
        // A short exact form (0.9999, 0.0001, 151) as it is: rounding it could make a limit
        // read like the value it bounds.
        Some(v) if format!("{v}").len() <= 7 => format!("{v}"),
        Some(v) if (1e-2..1e5).contains(&v.abs()) => {
            let digits = (2 - v.abs().log10().floor() as i32).max(0) as usize;
            format!("{v:.digits$}")
        }
        Some(v) => format!("{v:.2e}"),
    }
}

/// A measured value and the limit it broke (or kept), each with as many significant digits as it
/// takes for the two as shown to stand in the order the numbers do: 0.99987 against 0.9999
/// reads `0.99987 < 0.9999`, never `1.000 < 0.9999`. At 3 digits when that is enough.
pub fn fmt_against(value: f64, limit: f64) -> (String, String) {
    let order = value.partial_cmp(&limit);
    let holds = |v: &str, l: &str| match (v.parse::<f64>(), l.parse::<f64>()) {
        (Ok(v), Ok(l)) => v.partial_cmp(&l) == order,
        _ => true, // nan, inf: shown as words, nothing to round
    };
    let (v, l) = (fmt_real(Some(value)), fmt_real(Some(limit)));
    if holds(&v, &l) {
        return (v, l);
    }
    // A limit shown exactly (0.9999) stays as written; only a rounded one gains digits.
    let exact = l.parse::<f64>() == Ok(limit);
    for digits in 4..=17 {
        let v = significant(value, digits);
        let l = if exact {
            l.clone()
        } else {
            significant(limit, digits)
        };
        if holds(&v, &l) {
            return (v, l);
        }
    }
    (format!("{value}"), format!("{limit}"))
}

/// `v` rounded to `digits` significant digits, fixed-point in [1e-2, 1e5), else exponent form.
fn significant(v: f64, digits: usize) -> String {
    if v == 0.0 || !v.is_finite() {
        return fmt_real(Some(v));
    }
    if (1e-2..1e5).contains(&v.abs()) {
        let decimals = (digits as i32 - 1 - v.abs().log10().floor() as i32).max(0) as usize;
        format!("{v:.decimals$}")
    } else {
        format!("{v:.prec$e}", prec = digits - 1)
    }
}

fn real(v: Option<Real>) -> String {
    fmt_real(v.map(|r| r.0))
}

fn int(v: Option<u64>) -> String {
    v.map_or("-".into(), crate::thousands)
}

/// The page around `body`: inline style only.
pub fn page(title: &str, body: &str) -> String {
    format!(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'; img-src data:\">\
<title>{}</title><style>{STYLE}</style></head>\n<body>\n{body}\n</body></html>\n",
        esc(title)
    )
}

const STYLE: &str = "\
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#1d2430;max-width:1400px}\
h1{font-size:1.5em;margin:.2em 0}h2{font-size:1.15em;margin:1.4em 0 .4em;border-bottom:1px solid #ccd}\
table{border-collapse:collapse;margin:.4em 0;display:block;overflow-x:auto;max-width:100%}td,th{border:1px solid #d4d8e0;padding:2px 6px;text-align:left;vertical-align:top}\
th{background:#eef1f6}td.num{text-align:right;font-variant-numeric:tabular-nums}\
.mono,code{font-family:ui-monospace,monospace;font-size:12.5px}\
.v-identical,.v-within_policy,.s-PASS{color:#1a7f37}.v-different,.v-incomparable,.v-unreadable,.s-FAIL{color:#c62828}\
.s-NOT{color:#9a6700}td.s-FAIL{background:#fde7e7}td.s-PASS{background:#e8f5ec}td.s-NOT{background:#fff4d6}\
tr.outside_policy td,tr.no_rule td,tr.rerouted td{background:#fde7e7}tr.after_near_tie td,tr.after_sampling_divergence td{background:#fff4d6}tr.different td,tr.differs_by_digest td{background:#fff0e0}\
tr.first-violation td{outline:2px solid #c62828}.box{border:1px solid #ccd;border-radius:4px;padding:.5em .8em;margin:.5em 0;background:#fafbfd}\
.l-defect{color:#c62828;font-weight:600}.l-near-tie,.l-after-near-tie{color:#9a6700}.l-consequence{color:#555}\
svg{background:#fff;border:1px solid #d4d8e0;margin:.3em 0}svg text{font:11px system-ui,sans-serif;fill:#333}\
.grid{stroke:#e3e6ec}.axis{stroke:#888}.pt{stroke:none}.s-rel_l2 .pt{fill:#1f5fbf}.s-max_ulp .pt{fill:#7b3fbf}\
.pt.zero{fill:none;stroke:#9aa;stroke-width:1}.pt.off{fill:#c62828}.bound{stroke:#e07b00;stroke-width:2}\
.mark-fbd{stroke:#1f5fbf;stroke-dasharray:4 3;stroke-width:1.5}.mark-fv{stroke:#c62828;stroke-width:2}\
.lane{stroke:#eee}.m-defect{fill:#c62828}.m-near-tie{fill:#e0a000}.m-after-near-tie{fill:#c9b26b}.m-consequence{fill:#888}\
.nb{stroke:#333;stroke-width:1.5}.note{color:#555}a{color:#1f5fbf}";

/// Writes the page whole or not at all (tracegate_trace::output::write_whole): a crash or a
/// full disk never leaves half a page or a temporary.
pub fn write_file(path: &Path, text: &str) -> std::io::Result<()> {
    tracegate_trace::output::write_whole(&[(path, text.as_bytes())]).map_err(|e| e.error)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_and_its_limit_are_shown_in_the_order_they_stand() {
        let read =
            |(v, l): (String, String)| (v.parse::<f64>().unwrap(), l.parse::<f64>().unwrap());
        // The reported case: a broken cosine bound read `1.000 < 0.9999`.
        assert_eq!(fmt_real(Some(0.999_872_34)), "1.000");
        assert_eq!(
            fmt_against(0.999_872_34, 0.9999),
            ("0.99987".into(), "0.9999".into())
        );
        for (value, limit) in [
            (0.999_872_34, 0.9999), // below a cosine bound, by a little
            (0.999_900_1, 0.9999),  // above it, by less
            (1.000_04e-3, 1e-3),    // over a relative L2 bound
            (0.999_96e-3, 1e-3),    // under it
            (-2.000_001, -2.0),     // negative
            (123_456.7, 123_456.8), // exponent form
            (1.0 + 1e-15, 1.0),     // past 3 digits, within f64
        ] {
            let (v, l) = read(fmt_against(value, limit));
            assert_eq!(
                v.partial_cmp(&l),
                value.partial_cmp(&limit),
                "{value} vs {limit}: {v} vs {l}"
            );
        }
        // Enough at 3 digits: left as it was; equal stays equal; words for the non-finite.
        assert_eq!(fmt_against(0.5, 0.9999), ("0.5".into(), "0.9999".into()));
        assert_eq!(fmt_against(0.25, 0.25), ("0.25".into(), "0.25".into()));
        assert_eq!(fmt_against(f64::NAN, 0.9999).0, "nan");
        assert_eq!(fmt_against(f64::INFINITY, 1e-3).0, "inf");
    }

    #[test]
    fn text_from_traces_is_escaped() {
        let v = val(
            "td",
            "num",
            "/per_tensor/0/tensor",
            "<script>alert(1)</script>",
            "a\"b<c>",
        );
        assert!(!v.contains("<script>") && !v.contains("a\"b"), "{v}");
        assert!(
            v.contains("&lt;script&gt;") && v.contains("a&quot;b&lt;c&gt;"),
            "{v}"
        );
    }

    /// Every character that must not reach a page raw, one of each kind.
    const HOSTILE: [char; 9] = [
        '\u{202e}',
        '\u{202a}',
        '\u{2066}',
        '\u{2069}',
        '\u{200e}',
        '\u{200f}',
        '\u{200b}',
        '\u{feff}',
        '\u{e0041}',
    ];

    fn raw_hostile(page: &str) -> Vec<char> {
        page.chars().filter(|c| HOSTILE.contains(c)).collect()
    }

    #[test]
    fn format_characters_are_shown_escaped_and_data_v_keeps_the_value() {
        let name = "layer.00.\u{202e}tuo_nttA\u{202c}";
        let v = val("td", "num", "/per_tensor/0/tensor", name, name);
        assert!(raw_hostile(&v).is_empty(), "{v:?}");
        assert!(v.contains(">layer.00.\\u{202e}tuo_nttA\\u{202c}<"), "{v}");
        // data-v is the JSON's value: the JSON escape, parsed back to the same string.
        assert!(
            v.contains("data-v=\"&quot;layer.00.\\u202etuo_nttA\\u202c&quot;\""),
            "{v}"
        );
        assert_eq!(json_text("\u{e0041}"), "\"\\udb40\\udc41\"");
        let back: String = serde_json::from_str(&json_text(name)).unwrap();
        assert_eq!(back, name);
    }

    #[test]
    fn a_candidate_trace_with_bidi_names_gives_a_page_without_them_raw() {
        use tracegate_trace::{Attributes, DType, Trace, TraceWriter};
        // As an adversary writes it: each hostile character in a tensor name and a decision
        // name, one tensor in both traces with other values, one extra in the candidate.
        let dir = tempfile::tempdir().unwrap();
        let write = |file: &str, extra: bool, value: f32| {
            let path = dir.path().join(file);
            let mut w = TraceWriter::create(&path, serde_json::json!({"producer": "x"})).unwrap();
            for (i, c) in HOSTILE.iter().enumerate() {
                let bytes = [value + i as f32, 1.0].map(f32::to_le_bytes).concat();
                let name = format!("layer.{i:02}.{c}tuo_nttA");
                w.tensor(&name, DType::F32, &[2], &bytes, &Attributes::default())
                    .unwrap();
            }
            if extra {
                let bytes = 1f32.to_le_bytes();
                w.tensor(
                    "\u{2067}extra\u{2069}",
                    DType::F32,
                    &[1],
                    &bytes,
                    &Attributes::default(),
                )
                .unwrap();
            }
            w.decision("logits.\u{202e}xamgra", &[1], &[i64::from(extra)], None)
                .unwrap();
            w.finish().unwrap();
            Trace::open(&path).unwrap()
        };
        let (r, c) = (write("r.trace", false, 0.0), write("c.trace", true, 0.5));
        let rep = crate::compare(&r, &c, &crate::Options::default());
        let page = render_html(&rep);
        assert!(page.contains("tuo_nttA"), "the names are on the page");
        assert!(page.contains("\\u{202e}tuo_nttA"), "shown escaped");
        assert_eq!(raw_hostile(&page), [], "raw format characters on the page");
    }

    #[test]
    fn reals_are_shown_to_three_significant_digits() {
        let cases = [
            (Some(0.0001234567), "1.23e-4"),
            (Some(1.0), "1"),
            (Some(12.345), "12.345"),
            (Some(12.3456789), "12.3"),
            (Some(0.9999), "0.9999"),
            (Some(0.123456), "0.123"),
            (Some(f64::INFINITY), "inf"),
            (None, "-"),
            (Some(0.0), "0"),
        ];
        for (v, want) in cases {
            assert_eq!(fmt_real(v), want, "{v:?}");
        }
    }
}
