//! The whole run's outcome and the checks: outliers, self-consistency, calibration and the
//! rounding level.

use std::fmt::Write as _;

use tracegate_diff::html::{esc, fmt_real, val};
use tracegate_diff::thousands;

use super::ulp_text;
use crate::bisect::BisectReport;

pub(super) fn whole_run(r: &BisectReport, h: &mut String) {
    let w = &r.whole_run;
    let _ = write!(
        h,
        "<div class=\"box\" id=\"whole-run\">Whole run: {}",
        val(
            "b",
            "text",
            "/whole_run/verdict",
            &w.verdict,
            w.verdict.as_str()
        )
    );
    if let Some(f) = &w.first_diverging {
        let _ = write!(
            h,
            "; first diverging {}",
            val("code", "text", "/whole_run/first_diverging", f, f)
        );
    }
    if let Some(v) = &w.first_violation {
        let _ = write!(
            h,
            "; first outside the policy {}",
            val(
                "code",
                "text",
                "/whole_run/first_violation/tensor",
                &v.tensor,
                &v.tensor
            )
        );
    }
    if let Some(d) = &w.first_bit_difference {
        let _ = write!(
            h,
            "; first bit difference <code>{}{:?}</code>: {} vs {} ({} ULP)",
            esc(&d.tensor),
            d.coords,
            val(
                "code",
                "text",
                "/whole_run/first_bit_difference/reference_value",
                &d.reference_value,
                &d.reference_value
            ),
            val(
                "code",
                "text",
                "/whole_run/first_bit_difference/candidate_value",
                &d.candidate_value,
                &d.candidate_value
            ),
            val(
                "span",
                "num",
                "/whole_run/first_bit_difference/ulp",
                &d.ulp,
                &ulp_text(d.ulp)
            ),
        );
    }
    h.push_str(".<ul>");
    for (i, d) in w.differing_decisions.iter().enumerate() {
        let p = |f: &str| format!("/whole_run/differing_decisions/{i}/{f}");
        let _ = write!(
            h,
            "<li>decision <code>{}</code> differs in {} of {} rows ({} excused)</li>",
            esc(&d.name),
            val(
                "span",
                "num",
                &p("differing_rows"),
                &d.differing_rows,
                &thousands(d.differing_rows)
            ),
            val("span", "num", &p("rows"), &d.rows, &thousands(d.rows)),
            val(
                "span",
                "num",
                &p("excused_rows"),
                &d.excused_rows,
                &thousands(d.excused_rows)
            ),
        );
    }
    for (i, f) in w.findings.iter().enumerate() {
        let _ = write!(
            h,
            "<li>finding: {}</li>",
            val("span", "text", &format!("/whole_run/findings/{i}"), f, f)
        );
    }
    h.push_str("</ul></div>");
}

pub(super) fn checks(r: &BisectReport, h: &mut String) {
    let o = &r.outliers;
    let _ = write!(
        h,
        "<div class=\"box\" id=\"outliers\"><b>Outliers</b> ({}, factor {}): ",
        esc(o.measure),
        val(
            "span",
            "num",
            "/outliers/factor",
            &o.factor,
            &fmt_real(Some(o.factor))
        )
    );
    match &o.not_checked {
        Some(why) => {
            let _ = write!(
                h,
                "NOT CHECKED: {}",
                val("span", "text", "/outliers/not_checked", why, why)
            );
        }
        None => {
            let _ = write!(
                h,
                "{} matching isolated layers; suspicious: {}",
                val(
                    "span",
                    "num",
                    "/outliers/isolated_layers",
                    &o.isolated_layers,
                    &o.isolated_layers.to_string()
                ),
                if o.suspicious.is_empty() {
                    "none".to_string()
                } else {
                    esc(&o
                        .suspicious
                        .iter()
                        .map(|l| format!("{l:02}"))
                        .collect::<Vec<_>>()
                        .join(", "))
                }
            );
        }
    }
    h.push_str("</div>");
    let sc = &r.self_consistency;
    let _ = write!(
        h,
        "<div class=\"box\" id=\"self-consistency\"><b>Self-consistency</b> (scope {}): ",
        sc.scope
    );
    match &sc.inconsistent {
        Some(i) => {
            let _ = write!(
                h,
                "INCONSISTENT at layer {}: {}",
                val(
                    "span",
                    "num",
                    "/self_consistency/inconsistent/layer",
                    &i.layer,
                    &format!("{:02}", i.layer)
                ),
                val(
                    "span",
                    "text",
                    "/self_consistency/inconsistent/detail",
                    &i.detail,
                    &i.detail
                )
            );
        }
        None if sc.checked_layers.is_empty() => h.push_str("not run"),
        None => {
            let which = if sc.checked_layers.len() == 1 {
                "layer"
            } else {
                "layers"
            };
            let _ = write!(
                h,
                "the candidate's layer verb agrees with its own whole run in {which} {}",
                esc(&sc
                    .checked_layers
                    .iter()
                    .map(|l| format!("{l:02}"))
                    .collect::<Vec<_>>()
                    .join(", "))
            );
        }
    }
    for (i, why) in sc.not_checked.iter().enumerate() {
        let _ = write!(
            h,
            "<br>NOT CHECKED: {}",
            val(
                "span",
                "text",
                &format!("/self_consistency/not_checked/{i}"),
                why,
                why
            )
        );
    }
    h.push_str("</div>");
    if let Some(c) = &r.calibration {
        let _ = write!(
            h,
            "<div class=\"box\" id=\"calibration\"><b>Calibration</b> from layer {}{}: {} (input rel L2 {})",
            val("span", "num", "/calibration/from_layer", &c.from_layer, &format!("{:02}", c.from_layer)),
            if c.automatic { " (automatic)" } else { "" },
            val("span", "text", "/calibration/perturbation", &c.perturbation, &c.perturbation),
            val("span", "num", "/calibration/input_rel_l2", &c.input_rel_l2, &fmt_real(c.input_rel_l2)),
        );
        if let Some(why) = &c.not_checked {
            let _ = write!(
                h,
                "<br>NOT CHECKED: {}",
                val("span", "text", "/calibration/not_checked", why, why)
            );
        }
        h.push_str("</div>");
    }
    if let Some(rl) = &r.rounding_level {
        let _ = write!(
            h,
            "<div class=\"box\" id=\"rounding-level\"><b>Rounding level</b>: layer {} isolated rel L2 {} is {}× the 1-ULP response {} (rounding level at or below {}×): {}</div>",
            val("span", "num", "/rounding_level/layer", &rl.layer, &format!("{:02}", rl.layer)),
            val("span", "num", "/rounding_level/isolated_rel_l2", &rl.isolated_rel_l2, &fmt_real(Some(rl.isolated_rel_l2))),
            val("span", "num", "/rounding_level/ratio", &rl.ratio, &fmt_real(Some(rl.ratio))),
            val("span", "num", "/rounding_level/one_ulp_rel_l2", &rl.one_ulp_rel_l2, &fmt_real(Some(rl.one_ulp_rel_l2))),
            val("span", "num", "/rounding_level/factor", &rl.factor, &fmt_real(Some(rl.factor))),
            if rl.at_rounding_level { "at rounding level" } else { "above rounding level" },
        );
    }
}
