//! Human-readable output: one summary line first, then the details a person needs to act on.
//!
//! One concept a file: `escape` (what reaches a terminal or a JSON reader: escaping, and the
//! streamed JSON writer), `headline` (the summary line), `human` (the human report),
//! `decisions` (its decisions section and a flip's label), `sink` (the streamed writer both
//! write to), `show` (`--show`, text and JSON);
//! here, the number and filter wording they share.

mod decisions;
mod escape;
mod headline;
mod human;
mod show;
mod sink;

pub use decisions::label_text;
pub(crate) use escape::{escape_with, json_escape, needs_escape};
pub use escape::{terminal_safe, write_json};
pub use human::{render_human, write_human};
pub use show::{render_show, write_show, write_show_json};

use crate::{FilterSummary, Real};

/// Names wider than this overflow their column instead of widening it: a format width is at
/// most 65,535 (wider panics), and one long name must not pad every other row.
const MAX_COLUMN: usize = 80;

/// 18676984 → "18,676,984".
pub fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, ch) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(ch);
    }
    out
}

fn real(x: Option<Real>) -> String {
    match x {
        None => "-".into(),
        Some(Real(v)) if v.is_nan() => "nan".into(),
        Some(Real(v)) if v.is_infinite() => {
            if v > 0.0 {
                "inf".into()
            } else {
                "-inf".into()
            }
        }
        Some(Real(0.0)) => "0".into(),
        Some(Real(v)) if (1e-3..1e6).contains(&v.abs()) => format!("{v:.6}")
            .trim_end_matches('0')
            .trim_end_matches('.')
            .to_string(),
        Some(Real(v)) => format!("{v:.3e}"),
    }
}

/// Cosine near 1 is printed as its distance from 1, so 1 − 1e-15 never reads as exactly 1. A
/// cosine rounded past 1 (the dot product and the norms round apart) is written `1+d`, never
/// `1--d`.
fn cosine(x: Option<Real>) -> String {
    match x {
        Some(Real(1.0)) => "1".into(),
        Some(Real(v)) if v.is_finite() && v > 1.0 => format!("1+{:.2e}", v - 1.0),
        Some(Real(v)) if v.is_finite() && v > 0.999 => format!("1-{:.2e}", 1.0 - v),
        Some(Real(v)) if v.is_finite() => format!("{v:.6}"),
        other => real(other),
    }
}

fn coords(c: &[u64]) -> String {
    c.iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

fn opt_u(x: Option<u64>) -> String {
    x.map(thousands).unwrap_or_else(|| "-".into())
}

/// "--only 'x' left out 120 tensors and 7 decisions".
fn left_out(f: &FilterSummary) -> String {
    let plural = |n: usize, what: &str| {
        format!(
            "{} {what}{}",
            thousands(n as u64),
            if n == 1 { "" } else { "s" }
        )
    };
    format!(
        "{} left out {} and {}",
        f.filter,
        plural(f.tensors_left_out, "tensor"),
        plural(f.decisions_left_out, "decision")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cosine_is_written_as_its_distance_from_one_on_either_side() {
        // The reported case: 1 + 8.88e-16 (the dot product rounded above the norms' product)
        // was printed "1--8.88e-16".
        let above = 1.0 + 4.0 * f64::EPSILON;
        assert_eq!(cosine(Some(Real(above))), "1+8.88e-16");
        assert_eq!(cosine(Some(Real(1.0 - 2f64.powi(-40)))), "1-9.09e-13");
        assert_eq!(cosine(Some(Real(1.0))), "1");
        assert_eq!(cosine(Some(Real(0.5))), "0.500000");
        assert_eq!(cosine(None), "-");
        for v in [above, 1.0 + 1e-9, 0.9995, 1.0 - f64::EPSILON] {
            assert!(!cosine(Some(Real(v))).contains("--"), "{v}");
        }
    }
}
