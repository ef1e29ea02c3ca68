//! A layer table (the prefill's or the decode step's) with its chart, wrong layer and stage.

use std::fmt::Write as _;

use tracegate_diff::html::{esc, fmt_real, num_td, val};
use tracegate_diff::thousands;

use super::chart::chart;
use super::{ulp_text, View};
use crate::bisect::prefill::{DecisionCmp, TensorCmp};

fn layer_table(v: &View, h: &mut String) {
    let _ = write!(h, "<table id=\"{}layers\"><tr>", v.id);
    h.push_str("<th>layer</th><th>status</th><th>whole run</th><th>isolation</th><th>isolated max ULP</th><th>isolated rel L2</th><th>whole max ULP</th><th>whole rel L2</th><th>1-ULP rel L2</th><th>whole / 1-ULP</th><th>isolated / 1-ULP</th><th>self check</th><th>vs peers</th><th>suspicious</th><th>reason</th></tr>");
    for (i, l) in v.rows.iter().enumerate() {
        let p = |f: &str| format!("{}/{i}/{f}", v.rows_at);
        let class = match (v.first_wrong == Some(l.layer), l.suspicious) {
            (true, _) => "wrong-layer",
            (false, true) => "suspicious",
            _ => "",
        };
        let _ = write!(
            h,
            "<tr id=\"{}layer-{:02}\" class=\"{class}\" data-layer=\"{}\">{}{}{}{}{}{}{}{}{}{}{}{}{}{}{}</tr>",
            v.id,
            l.layer,
            l.layer,
            num_td(&p("layer"), &l.layer, &format!("{:02}", l.layer)),
            val("td", "text", &p("status"), &l.status, l.status.as_str()),
            val("td", "text", &p("whole_run"), &l.whole_run, l.whole_run.as_str()),
            val("td", "text", &p("isolation"), &l.isolation, l.isolation.as_str()),
            num_td(&p("isolated_max_ulp"), &l.isolated_max_ulp, &ulp_text(l.isolated_max_ulp)),
            num_td(&p("isolated_rel_l2"), &l.isolated_rel_l2, &fmt_real(l.isolated_rel_l2)),
            num_td(&p("whole_max_ulp"), &l.whole_max_ulp, &ulp_text(l.whole_max_ulp)),
            num_td(&p("whole_rel_l2"), &l.whole_rel_l2, &fmt_real(l.whole_rel_l2)),
            num_td(&p("calibration_rel_l2"), &l.calibration_rel_l2, &fmt_real(l.calibration_rel_l2)),
            num_td(&p("whole_vs_calibration"), &l.whole_vs_calibration, &fmt_real(l.whole_vs_calibration)),
            num_td(&p("isolated_vs_calibration"), &l.isolated_vs_calibration, &fmt_real(l.isolated_vs_calibration)),
            val("td", "text", &p("self_check"), &l.self_check, l.self_check.as_str()),
            num_td(&p("peer_ratio"), &l.peer_ratio, &fmt_real(l.peer_ratio)),
            val("td", "flag", &p("suspicious"), &l.suspicious, if l.suspicious { "suspicious" } else { "" }),
            val("td", if l.reason.is_some() { "text" } else { "none" }, &p("reason"), &l.reason, l.reason.as_deref().unwrap_or("-")),
        );
    }
    h.push_str("</table>");
}

fn stage(v: &View, h: &mut String) {
    let Some(s) = v.stage else {
        h.push_str("<p>No stage named (no layer is wrong in isolation).</p>");
        return;
    };
    let at = |f: &str| format!("{}/stage/{f}", v.owner_at);
    let _ = write!(
        h,
        "<div class=\"box\" id=\"{}stage\" data-layer=\"{}\" data-tensor=\"{}\"><b>First wrong stage</b> in layer {}: {} ({}) at <code>{}</code>: {}",
        v.id,
        s.layer,
        esc(&s.tensor),
        val("span", "num", &at("layer"), &s.layer, &format!("{:02}", s.layer)),
        esc(s.block.words()),
        val("code", "text", &at("block"), &s.block, s.block.as_str()),
        esc(&s.tensor),
        val("span", "text", &at("detail"), &s.detail, &s.detail),
    );
    if !s.matching.is_empty() {
        let _ = write!(
            h,
            "<br>before it, matching in isolation: {}",
            esc(&s.matching.join(", "))
        );
    }
    h.push_str("</div>");
    // The wrong layer's isolated capture points (the candidate's layer verb vs the reference).
    let Some((li, row)) = v.rows.iter().enumerate().find(|(_, l)| l.layer == s.layer) else {
        return;
    };
    tensor_table(
        &format!("{}stage-tensors", v.id),
        &format!("{}/{li}/isolated", v.rows_at),
        &row.isolated,
        h,
    );
}

/// Differing decisions, one line each, of class `class`; `at` is their JSON pointer.
pub(super) fn decision_lines(class: &str, at: &str, rows: &[DecisionCmp], h: &mut String) {
    for (i, x) in rows.iter().enumerate() {
        let p = |f: &str| format!("{at}/{i}/{f}");
        let _ = write!(
            h,
            "<p class=\"{class}\">decision {} differs in {} of {} rows</p>",
            val("code", "text", &p("name"), &x.name, &x.name),
            val(
                "span",
                "num",
                &p("differing_rows"),
                &x.differing_rows,
                &thousands(x.differing_rows)
            ),
            val("span", "num", &p("rows"), &x.rows, &thousands(x.rows)),
        );
    }
}

/// The differ's rows of some tensors as a table; `at` is their JSON pointer.
pub(super) fn tensor_table(id: &str, at: &str, rows: &[TensorCmp], h: &mut String) {
    let _ = write!(h, "<table id=\"{id}\">");
    h.push_str("<tr><th>tensor</th><th>status</th><th>differing</th><th>of</th><th>max ULP</th><th>rel L2</th><th>cosine</th></tr>");
    for (j, t) in rows.iter().enumerate() {
        let p = |f: &str| format!("{at}/{j}/{f}");
        let _ = write!(
            h,
            "<tr class=\"{}\" data-tensor=\"{}\"><td class=\"mono\">{}</td>{}{}{}{}{}{}</tr>",
            t.status,
            esc(&t.tensor),
            esc(&t.tensor),
            val("td", "text", &p("status"), &t.status, t.status.as_str()),
            num_td(
                &p("differing_elements"),
                &t.differing_elements,
                &ulp_text(t.differing_elements)
            ),
            num_td(
                &p("total_elements"),
                &t.total_elements,
                &thousands(t.total_elements)
            ),
            num_td(&p("max_ulp"), &t.max_ulp, &ulp_text(t.max_ulp)),
            num_td(&p("rel_l2"), &t.rel_l2, &fmt_real(t.rel_l2)),
            num_td(&p("cosine"), &t.cosine, &fmt_real(t.cosine)),
        );
    }
    h.push_str("</table>");
}

/// A view's chart (when it has rows), its wrong layer and stage, and its table.
pub(super) fn layers(v: &View, h: &mut String) {
    if !v.rows.is_empty() {
        h.push_str(&chart(v));
    }
    h.push_str("<h3>Wrong layer and stage</h3>");
    match v.first_wrong {
        Some(w) => {
            let _ = write!(
                h,
                "<p id=\"{}wrong-layer\" data-layer=\"{w}\">first wrong layer: {}</p>",
                v.id,
                val(
                    "b",
                    "num",
                    &format!("{}/first_wrong_layer", v.owner_at),
                    &w,
                    &format!("{w:02}")
                )
            );
        }
        None => {
            let _ = write!(
                h,
                "<p id=\"{}wrong-layer\" data-layer=\"\">No layer is wrong in isolation.</p>",
                v.id
            );
        }
    }
    stage(v, h);
    h.push_str("<h3>Layers</h3>");
    layer_table(v, h);
}
