//! The decisions section of the `trace-diff --html` page: the results table, the margin
//! distribution of flipped rows, and each decision's flips.

use std::fmt::Write as _;

use super::chart::{decades, R, T, W};
use super::{esc, fmt_real, json_text, num_td, real, val};
use crate::Report;

/// At most this many flips per decision family are listed.
pub const MAX_FLIPS: usize = 500;

pub(super) fn decisions(rep: &Report, h: &mut String) {
    let d = &rep.decisions;
    let _ = write!(
        h,
        "<p>{} compared, {} differing (reference {}, candidate {}); missing: {}; extra: {}.</p>",
        val(
            "span",
            "num",
            "/decisions/compared",
            &d.compared,
            &d.compared.to_string()
        ),
        val(
            "span",
            "num",
            "/decisions/differing",
            &d.differing,
            &d.differing.to_string()
        ),
        val(
            "span",
            "num",
            "/decisions/reference_count",
            &d.reference_count,
            &d.reference_count.to_string()
        ),
        val(
            "span",
            "num",
            "/decisions/candidate_count",
            &d.candidate_count,
            &d.candidate_count.to_string()
        ),
        if d.missing.is_empty() {
            "none".into()
        } else {
            esc(&d.missing.join(", "))
        },
        if d.extra.is_empty() {
            "none".into()
        } else {
            esc(&d.extra.join(", "))
        },
    );
    if let Some(n) = &d.near_ties {
        let _ = write!(
            h,
            "<p>Near-ties excused under the policy (margin factor {}): {}; rows after them not judged: {} decision rows and {} tensor(s).</p>",
            val("span", "num", "/decisions/near_ties/margin_factor", &n.margin_factor, &fmt_real(Some(n.margin_factor))),
            if n.excused.is_empty() { "none".to_string() } else { esc(&n.excused.iter().map(|e| format!("{}[{}]", e.decision, e.row)).collect::<Vec<_>>().join(", ")) },
            val("span", "num", "/decisions/near_ties/decision_rows", &n.decision_rows, &n.decision_rows.to_string()),
            n.tensors.len(),
        );
    }
    if let Some(s) = &d.sampling_divergence {
        let step = s.step.map(|x| format!(" step {x}")).unwrap_or_default();
        let _ = write!(
            h,
            "<p id=\"sampling-divergence\" class=\"loud\"><b>Sampling divergence</b> at <span class=\"mono\">{}</span> rows {} (rng {} vs {}, the candidate not forced): {} tensors, {} decisions after the sampling divergence at block {}{step}: <b>not judged</b>; force the candidate with --force-decisions REF to compare them.</p>",
            esc(&s.decision),
            esc(&format!("{:?}", s.rows)),
            esc(&s.reference_rng),
            esc(&s.candidate_rng),
            val("span", "num", "/decisions/sampling_divergence/tensors_not_judged", &s.tensors_not_judged, &s.tensors_not_judged.to_string()),
            val("span", "num", "/decisions/sampling_divergence/decisions_not_judged", &s.decisions_not_judged, &s.decisions_not_judged.to_string()),
            s.block,
        );
    }
    if d.results.is_empty() {
        h.push_str("<p>No decision compared.</p>");
        return;
    }
    h.push_str("<table id=\"decisions\"><tr><th>decision</th><th>status</th><th>rows</th><th>differing rows</th><th>reordered</th><th>margins</th><th>margins differing</th><th>margins outside</th><th>rows after near-tie</th><th>source</th></tr>");
    for (i, r) in d.results.iter().enumerate() {
        let p = |f: &str| format!("/decisions/results/{i}/{f}");
        let _ = write!(
            h,
            "<tr class=\"{}\" data-decision=\"{}\"><td class=\"mono\"><a href=\"#flips-{i}\">{}</a></td><td>{}</td>{}{}{}<td>{}</td>{}{}{}<td class=\"mono\">{}</td></tr>",
            if r.differing_rows > 0 { "different" } else { "" },
            esc(&r.name),
            esc(&r.name),
            r.status,
            num_td(&p("rows"), &r.rows, &crate::thousands(r.rows)),
            num_td(&p("differing_rows"), &r.differing_rows, &crate::thousands(r.differing_rows)),
            num_td(&p("reordered_rows"), &r.reordered_rows, &crate::thousands(r.reordered_rows)),
            r.margins,
            num_td(&p("margin_differing_rows"), &r.margin_differing_rows, &crate::thousands(r.margin_differing_rows)),
            num_td(&p("margin_outside_rows"), &r.margin_outside_rows, &crate::thousands(r.margin_outside_rows)),
            num_td(&p("rows_after_near_tie"), &r.rows_after_near_tie, &crate::thousands(r.rows_after_near_tie)),
            esc(r.source.as_deref().unwrap_or("")),
        );
    }
    h.push_str("</table>");
    margin_chart(rep, h);
    for (i, r) in d
        .results
        .iter()
        .enumerate()
        .filter(|(_, r)| !r.flips.is_empty())
    {
        let _ = write!(h, "<h3 class=\"mono\">{}</h3><table id=\"flips-{i}\" class=\"flips\" data-decision=\"{}\"><tr><th>row</th><th>reference</th><th>candidate</th><th>reference margin</th><th>candidate margin</th><th>source divergence</th><th>gap</th><th>noise bound</th><th>label</th><th>upstream / after</th></tr>", esc(&r.name), esc(&r.name));
        for (j, f) in r.flips.iter().enumerate().take(MAX_FLIPS) {
            let p = |k: &str| format!("/decisions/results/{i}/flips/{j}/{k}");
            let _ = write!(
                h,
                "<tr class=\"flip\" data-label=\"{}\">{}<td class=\"mono\">{}</td><td class=\"mono\">{}</td>{}{}{}{}{}<td class=\"l-{}\">{}</td><td class=\"mono\">{}</td></tr>",
                f.label,
                num_td(&p("row"), &f.row, &f.row.to_string()),
                val("span", "num", &p("reference"), &f.reference, &json_text(&f.reference)),
                val("span", "num", &p("candidate"), &f.candidate, &json_text(&f.candidate)),
                num_td(&p("reference_margin"), &f.reference_margin, &real(f.reference_margin)),
                num_td(&p("candidate_margin"), &f.candidate_margin, &real(f.candidate_margin)),
                num_td(&p("source_divergence"), &f.source_divergence, &real(f.source_divergence)),
                num_td(&p("gap"), &f.gap, &real(f.gap)),
                num_td(&p("noise_bound"), &f.noise_bound, &real(f.noise_bound)),
                f.label,
                f.label,
                esc(f.upstream.as_deref().or(f.after.as_deref()).unwrap_or("")),
            );
        }
        h.push_str("</table>");
        if r.flips.len() > MAX_FLIPS {
            let _ = write!(h, "<p class=\"note\">first {MAX_FLIPS} of {} flips listed (all are in the JSON report)</p>", r.flips.len());
        }
    }
}

/// The flipped rows' reference margins, one lane per decision family, on a log axis, coloured
/// by label; a black tick is the row's noise bound (a near-tie has margin ≤ bound).
fn margin_chart(rep: &Report, h: &mut String) {
    let lanes: Vec<(usize, &crate::DecisionResult)> = rep
        .decisions
        .results
        .iter()
        .enumerate()
        .filter(|(_, r)| !r.flips.is_empty())
        .collect();
    if lanes.is_empty() {
        h.push_str("<p class=\"note\">No flipped row: no margin distribution.</p>");
        return;
    }
    let values = lanes
        .iter()
        .flat_map(|(_, r)| {
            r.flips
                .iter()
                .take(MAX_FLIPS)
                .flat_map(|f| [f.reference_margin, f.noise_bound])
        })
        .flatten()
        .map(|r| r.0);
    let (lo, hi) = decades(values);
    let lane_h = 26.0;
    let left = 220.0;
    let height = T + lanes.len() as f64 * lane_h + 38.0; // ticks at the axis + 14, the caption 20 px below them
    let pw = W - left - R;
    let x = |v: f64| left + (v.log10() - lo as f64) / (hi - lo) as f64 * pw;
    let _ = write!(h, "<h3>Margin distribution</h3><svg id=\"chart-margins\" class=\"chart\" viewBox=\"0 0 {W} {height}\" width=\"{W}\" height=\"{height}\" role=\"img\">");
    let axis_y = T + lanes.len() as f64 * lane_h;
    for d in lo..=hi {
        let xx = x(10f64.powi(d));
        let _ = write!(h, "<line class=\"grid\" x1=\"{xx:.1}\" x2=\"{xx:.1}\" y1=\"{T}\" y2=\"{axis_y}\"/><text class=\"tick\" x=\"{xx:.1}\" y=\"{}\" text-anchor=\"middle\">1e{d}</text>", axis_y + 14.0);
    }
    for (lane, (i, r)) in lanes.iter().enumerate() {
        let cy = T + (lane as f64 + 0.5) * lane_h;
        let _ = write!(h, "<line class=\"lane\" x1=\"{left}\" x2=\"{}\" y1=\"{cy}\" y2=\"{cy}\"/><text x=\"4\" y=\"{}\">{}</text>", W - R, cy + 4.0, esc(&r.name));
        for (j, f) in r.flips.iter().enumerate().take(MAX_FLIPS) {
            if let Some(b) = f.noise_bound.filter(|b| b.0 > 0.0 && b.0.is_finite()) {
                let xx = x(b.0);
                let _ = write!(h, "<line class=\"nb\" data-json=\"/decisions/results/{i}/flips/{j}/noise_bound\" data-v=\"{}\" x1=\"{xx:.1}\" x2=\"{xx:.1}\" y1=\"{}\" y2=\"{}\"/>", esc(&json_text(&b)), cy - 8.0, cy + 8.0);
            }
            if let Some(m) = f.reference_margin.filter(|m| m.0 > 0.0 && m.0.is_finite()) {
                let _ = write!(
                    h,
                    "<circle class=\"margin m-{}\" data-json=\"/decisions/results/{i}/flips/{j}/reference_margin\" data-v=\"{}\" cx=\"{:.1}\" cy=\"{cy}\" r=\"4\"><title>{}[{}]: margin {} ({})</title></circle>",
                    f.label,
                    esc(&json_text(&m)),
                    x(m.0),
                    esc(&r.name),
                    f.row,
                    real(Some(m)),
                    f.label
                );
            }
        }
    }
    let _ = write!(h, "<line class=\"axis\" x1=\"{left}\" x2=\"{}\" y1=\"{axis_y}\" y2=\"{axis_y}\"/><text x=\"{left}\" y=\"{}\">reference margin of each flipped row (log scale); tick: its noise bound</text></svg>", W - R, height - 4.0);
    h.push_str("<div class=\"note\">red: defect · amber: near-tie · pale: after a near-tie · grey: consequence of an earlier flip</div>");
}
