//! Decisions are compared exactly, as ordered sequences, under every mode and policy: all
//! floats can agree to 1e-6 and the model still picks another expert (trap 12). Each flipped
//! row is set beside the reference's margin and the numeric divergence of the tensor the
//! decision was taken from, so a near-tie reads differently from a defect. Margins are content
//! too: compared by bits, or under a policy within [`margin_tolerance`].

use tracegate_trace::{DecisionInfo, Trace};

use crate::{order_finding, range_divergence, DecisionDivergence, DecisionResult, Finding, Flip, MarginDifference, Options, Real, Report};

/// A flip whose reference margin exceeds this many times the source divergence is a defect.
pub const DEFECT_FACTOR: f64 = 10.0;

/// Under a policy, the slack a margin gets beyond what its source row explains, relative to
/// max(1, |margin|): covers rounding of the subtraction and of the softmax (≈1e-7), and router
/// margins whose traces hold no `router.logits` (the fallback source is not the scores).
pub const MARGIN_SLACK: f64 = 1e-5;

/// Under a policy, the largest |reference − candidate| margin difference accepted for a row:
/// `2·d + MARGIN_SLACK·max(1, |a|, |b|)`, `d` the source row's divergence (0 without a source).
/// Why 2·d: the top-1 and top-2 (k-th, (k+1)-th) values of a row are order statistics, each
/// moving by at most the row's max |difference|, and a softmax moves no probability by more.
pub fn margin_tolerance(a: f32, b: f32, divergence: Option<f64>) -> f64 {
    let scale = 1f64.max((a as f64).abs()).max((b as f64).abs());
    2.0 * divergence.unwrap_or(0.0) + MARGIN_SLACK * scale
}

/// The tensor a decision was taken from, if the traces hold it: `logits` for `logits.argmax`;
/// `decode.SSSS.logits`, else `logits`, for `decode.SSSS.argmax`; `layer.NN.router.logits`,
/// else `layer.NN.hidden_in`, for `layer.NN.router.topk`; `X` for any other `X.argmax`.
pub fn source_tensor(name: &str, r: &Trace, c: &Trace) -> Option<String> {
    let both = |n: &str| r.tensor_info(n).is_some() && c.tensor_info(n).is_some();
    let candidates: Vec<String> = if let Some(step) = name.strip_prefix("decode.").and_then(|s| s.strip_suffix(".argmax")) {
        vec![format!("decode.{step}.logits"), "logits".into()]
    } else if let Some(layer) = name.strip_suffix(".router.topk") {
        vec![format!("{layer}.router.logits"), format!("{layer}.hidden_in")]
    } else if let Some(base) = name.strip_suffix(".argmax") {
        vec![base.to_string()]
    } else {
        vec![]
    };
    candidates.into_iter().find(|n| both(n))
}

/// Labels one flip: "near-tie" when the reference margin is no larger than the observed
/// divergence, "defect" when it is more than DEFECT_FACTOR times larger (or the source is
/// bit-identical, so the rule itself differs), "unclear" otherwise or without the numbers.
pub fn label(margin: Option<f32>, divergence: Option<f64>) -> &'static str {
    match (margin, divergence) {
        (Some(m), Some(d)) if m.is_finite() && !d.is_nan() => {
            let m = m.abs() as f64;
            if d == 0.0 {
                "defect"
            } else if m <= d {
                "near-tie"
            } else if m > DEFECT_FACTOR * d {
                "defect"
            } else {
                "unclear"
            }
        }
        _ => "unclear",
    }
}

/// Compares every decision `opts` selects; true if any finding or difference. Under a policy,
/// margins are judged by [`margin_tolerance`] instead of by bits.
pub fn compare(r: &Trace, c: &Trace, opts: &Options, rep: &mut Report) -> bool {
    let policy = opts.policy.is_some();
    let before = rep.findings.len();
    let d = &mut rep.decisions;
    d.reference_count = r.decisions().iter().filter(|i| opts.selects(&i.name)).count();
    d.candidate_count = c.decisions().iter().filter(|i| opts.selects(&i.name)).count();
    for rd in r.decisions().iter().filter(|i| opts.selects(&i.name)) {
        let Some(cd) = c.decision_info(&rd.name) else {
            d.missing.push(rd.name.clone());
            rep.findings.push(Finding::new("missing_decision", Some(&rd.name), "in the reference, not in the candidate"));
            continue;
        };
        if rd.shape != cd.shape {
            rep.findings.push(Finding::new(
                "decision_shape_mismatch",
                Some(&rd.name),
                format!("reference {:?} vs candidate {:?}", rd.shape, cd.shape),
            ));
            d.results.push(DecisionResult {
                name: rd.name.clone(),
                shape: rd.shape.clone(),
                status: "shape_mismatch",
                rows: rd.rows(),
                differing_rows: 0,
                reordered_rows: 0,
                source: None,
                flips: Vec::new(),
                margins: "not_compared",
                margin_differing_rows: 0,
                margin_outside_rows: 0,
                first_margin_difference: None,
            });
            continue;
        }
        d.compared += 1;
        let result = compare_one(r, c, rd, cd, policy);
        match (result.margins, &result.first_margin_difference) {
            ("reference_only" | "candidate_only", _) => {
                let (has, lacks) = if result.margins == "reference_only" { ("reference", "candidate") } else { ("candidate", "reference") };
                rep.findings.push(Finding::new("margin_presence_mismatch", Some(&rd.name), format!("margins recorded in the {has}, none in the {lacks}")));
            }
            ("different", Some(m)) => {
                let bound = m.tolerance.map(|t| format!(" (outside the tolerance {:e})", t.0)).unwrap_or_default();
                let counted = if policy { result.margin_outside_rows } else { result.margin_differing_rows };
                rep.findings.push(Finding::new(
                    "margin_differs",
                    Some(&rd.name),
                    format!(
                        "margins differ in {counted} of {} rows whose values are equal; first at row {}: {:e} ({}) vs {:e} ({}){bound}",
                        result.rows, m.row, m.reference.0, m.reference_bits, m.candidate.0, m.candidate_bits
                    ),
                ));
            }
            _ => {}
        }
        if result.differing_rows > 0 {
            d.differing += 1;
            let f = &result.flips[0];
            rep.findings.push(Finding::new(
                "decision_differs",
                Some(&rd.name),
                format!(
                    "{} of {} rows differ{}; first at row {}: {:?} vs {:?}",
                    result.differing_rows,
                    result.rows,
                    if result.reordered_rows > 0 { format!(" ({} same values, different order)", result.reordered_rows) } else { String::new() },
                    f.row,
                    f.reference,
                    f.candidate
                ),
            ));
            if rep.first_decision_divergence.is_none() {
                rep.first_decision_divergence = Some(DecisionDivergence {
                    name: rd.name.clone(),
                    row: f.row,
                    reference: f.reference.clone(),
                    candidate: f.candidate.clone(),
                    same_values_different_order: f.same_values_different_order,
                    reference_margin: f.reference_margin,
                    candidate_margin: f.candidate_margin,
                });
            }
        }
        d.results.push(result);
    }
    for cd in c.decisions().iter().filter(|i| opts.selects(&i.name)) {
        if r.decision_info(&cd.name).is_none() {
            d.extra.push(cd.name.clone());
            rep.findings.push(Finding::new("extra_decision", Some(&cd.name), "in the candidate, not in the reference"));
        }
    }
    let rn = r.decisions().iter().map(|i| i.name.as_str()).filter(|n| opts.selects(n) && c.decision_info(n).is_some());
    let cn = c.decisions().iter().map(|i| i.name.as_str()).filter(|n| opts.selects(n) && r.decision_info(n).is_some());
    if let Some(f) = order_finding("decision_order_mismatch", rn, cn) {
        rep.findings.push(f);
    }
    rep.findings.len() > before
}

fn compare_one(r: &Trace, c: &Trace, rd: &DecisionInfo, cd: &DecisionInfo, policy: bool) -> DecisionResult {
    let (rv, cv) = (r.decision_values(rd), c.decision_values(cd));
    let (rm, cm) = (r.decision_margins(rd), c.decision_margins(cd));
    let rows = rd.rows();
    let width = rd.count().checked_div(rows).unwrap_or(0) as usize;
    let source = source_tensor(&rd.name, r, c);
    let mut out = DecisionResult {
        name: rd.name.clone(),
        shape: rd.shape.clone(),
        status: "identical",
        rows,
        differing_rows: 0,
        reordered_rows: 0,
        source: source.clone(),
        flips: Vec::new(),
        margins: match (&rm, &cm) {
            (None, None) => "absent",
            (Some(_), None) => "reference_only",
            (None, Some(_)) => "candidate_only",
            (Some(_), Some(_)) => "identical",
        },
        margin_differing_rows: 0,
        margin_outside_rows: 0,
        first_margin_difference: None,
    };
    if width == 0 {
        return out;
    }
    for (row, (a, b)) in rv.chunks(width).zip(cv.chunks(width)).enumerate() {
        if a == b {
            // Equal choices: the margins must be equal too (a flipped row shows both instead).
            if let (Some(rm), Some(cm)) = (&rm, &cm) {
                let (ma, mb) = (rm[row], cm[row]);
                if ma.to_bits() != mb.to_bits() {
                    out.margin_differing_rows += 1;
                    let tolerance = policy.then(|| {
                        let d = source.as_deref().and_then(|s| range_divergence(r, c, s, Some((row as u64, rows))));
                        margin_tolerance(ma, mb, d)
                    });
                    // NaN never lies within a tolerance; only equal bits match it.
                    let outside = tolerance.is_none_or(|t| !(((ma as f64) - (mb as f64)).abs() <= t));
                    out.margin_outside_rows += outside as u64;
                    // Keep the first row outside the tolerance, else the first that differs at all.
                    let keep = match &out.first_margin_difference {
                        None => true,
                        Some(m) => outside && !m.outside,
                    };
                    if keep {
                        out.first_margin_difference = Some(MarginDifference {
                            row: row as u64,
                            reference: Real(ma as f64),
                            candidate: Real(mb as f64),
                            reference_bits: format!("{:#010x}", ma.to_bits()),
                            candidate_bits: format!("{:#010x}", mb.to_bits()),
                            tolerance: tolerance.map(Real),
                            outside,
                        });
                    }
                }
            }
            continue;
        }
        let mut sa = a.to_vec();
        let mut sb = b.to_vec();
        sa.sort_unstable();
        sb.sort_unstable();
        let reordered = sa == sb;
        out.differing_rows += 1;
        out.reordered_rows += reordered as u64;
        let margin_of = |m: &Option<Vec<f32>>| m.as_ref().and_then(|m| m.get(row).copied());
        let (ref_margin, cand_margin) = (margin_of(&rm), margin_of(&cm));
        let divergence = source.as_deref().and_then(|s| range_divergence(r, c, s, Some((row as u64, rows))));
        out.flips.push(Flip {
            row: row as u64,
            reference: a.to_vec(),
            candidate: b.to_vec(),
            same_values_different_order: reordered,
            reference_margin: ref_margin.map(|m| Real(m as f64)),
            candidate_margin: cand_margin.map(|m| Real(m as f64)),
            source_divergence: divergence.map(Real),
            label: label(ref_margin, divergence),
        });
    }
    if out.differing_rows > 0 {
        out.status = "different";
    }
    if out.margin_outside_rows > 0 {
        out.margins = "different";
    } else if out.margin_differing_rows > 0 {
        out.margins = "within_tolerance";
    }
    out
}

#[cfg(test)]
mod tests {
    use super::label;

    #[test]
    fn labels() {
        assert_eq!(label(Some(1e-7), Some(1e-5)), "near-tie");
        assert_eq!(label(Some(1e-5), Some(1e-5)), "near-tie");
        assert_eq!(label(Some(5e-5), Some(1e-5)), "unclear");
        assert_eq!(label(Some(2.0), Some(1e-5)), "defect");
        assert_eq!(label(Some(0.0), Some(0.0)), "defect");
        assert_eq!(label(None, Some(1.0)), "unclear");
        assert_eq!(label(Some(1.0), None), "unclear");
    }
}
