//! The decisions section of the human report, and how a flip's label reads.

use std::fmt::Write;

use super::real;
use super::sink::Sink;
use crate::{DecisionStatus, Flip, Label, Margins, Real, Report};

/// How a flip's label reads: with the upstream tensor, the near-tie it follows, or the gap
/// against the noise bound (the gate prints flips the same way).
pub fn label_text(f: &Flip) -> String {
    let vs = |op: &str| match (f.gap, f.noise_bound) {
        (Some(g), Some(b)) => format!(" (gap {} {op} bound {})", real(Some(g)), real(Some(b))),
        _ => String::new(),
    };
    match f.label {
        Label::Consequence => format!("consequence of {}", f.upstream.as_deref().unwrap_or("?")),
        Label::AfterNearTie => format!("after a near-tie ({})", f.after.as_deref().unwrap_or("?")),
        Label::SamplingDivergence => {
            "sampling divergence (another rng, not forced): not a defect by itself".into()
        }
        Label::AfterSamplingDivergence => format!(
            "after the sampling divergence ({}): not judged",
            f.after.as_deref().unwrap_or("?")
        ),
        Label::NearTie => format!("near-tie{}", vs("≤")),
        Label::Defect => match &f.why {
            Some(why) => format!("{}: {why}", f.label),
            None => format!("{}{}", f.label, vs(">")),
        },
    }
}

pub(super) fn decisions(o: &mut Sink<'_>, rep: &Report) {
    let d = &rep.decisions;
    if d.results.is_empty() && d.missing.is_empty() && d.extra.is_empty() {
        return;
    }
    let _ = writeln!(
        o,
        "decisions  {} compared, {} differ",
        d.compared, d.differing
    );
    for r in &d.results {
        let state = match r.status {
            DecisionStatus::Identical => format!("identical ({} rows)", r.rows),
            DecisionStatus::ShapeMismatch => "shape mismatch".into(),
            DecisionStatus::Different => {
                let reord = if r.reordered_rows > 0 {
                    format!(", {} same values in a different order", r.reordered_rows)
                } else {
                    String::new()
                };
                format!("{} of {} rows differ{reord}", r.differing_rows, r.rows)
            }
        };
        let after = if r.rows_after_near_tie > 0 {
            format!("; {} after a near-tie, not judged", r.rows_after_near_tie)
        } else {
            String::new()
        };
        let state = state + &after;
        let _ = writeln!(o, "  {} {:?}  {state}", r.name, r.shape);
        if let Some(m) = &r.first_margin_difference {
            let n = if r.margins == Margins::WithinTolerance {
                r.margin_differing_rows
            } else {
                r.margin_outside_rows
            };
            let bound = m
                .tolerance
                .map(|t| format!(", tolerance {}", real(Some(t))))
                .unwrap_or_default();
            let _ = writeln!(
                o,
                "    margins {}: {n} row{} (first row {}: {} ({}) vs {} ({}){bound})",
                r.margins.as_str().replace('_', " "),
                if n == 1 { "" } else { "s" },
                m.row,
                real(Some(m.reference)),
                m.reference_bits,
                real(Some(m.candidate)),
                m.candidate_bits
            );
        } else if let Some(side) = match r.margins {
            Margins::ReferenceOnly => Some("reference"),
            Margins::CandidateOnly => Some("candidate"),
            _ => None,
        } {
            let _ = writeln!(o, "    margins in the {side} only");
        }
        for f in r.flips.iter().take(10) {
            let what = if f.same_values_different_order {
                "  same values, different order"
            } else {
                ""
            };
            let _ = writeln!(
                o,
                "    row {}: {:?} vs {:?}{what}; margin ref {} cand {}; {} divergence {} → {}",
                f.row,
                f.reference,
                f.candidate,
                real(f.reference_margin),
                real(f.candidate_margin),
                r.source.as_deref().unwrap_or("(no source tensor)"),
                real(f.source_divergence),
                label_text(f)
            );
        }
        if r.flips.len() > 10 {
            let _ = writeln!(
                o,
                "    … {} more differing rows (see --json)",
                r.flips.len() - 10
            );
        }
    }
    if let Some(n) = d.near_ties.as_ref().filter(|n| !n.excused.is_empty()) {
        let which: Vec<String> = n
            .excused
            .iter()
            .map(|e| format!("{} row {} (position {})", e.decision, e.row, e.position))
            .collect();
        let _ = writeln!(
            o,
            "near-ties  {} excused by the policy (gap ≤ {}·divergence): {}",
            n.excused.len(),
            real(Some(Real(n.margin_factor))),
            which.join(", ")
        );
        let mut after: Vec<String> = n
            .tensors
            .iter()
            .map(|t| {
                format!(
                    "{} {} row{}",
                    t.tensor,
                    t.rows,
                    if t.rows == 1 { "" } else { "s" }
                )
            })
            .collect();
        if n.decision_rows > 0 {
            after.push(format!(
                "{} decision row{}",
                n.decision_rows,
                if n.decision_rows == 1 { "" } else { "s" }
            ));
        }
        if !after.is_empty() {
            let _ = writeln!(o, "  after a near-tie, not judged: {}", after.join(", "));
        }
    }
}
