//! The `trace-diff --html` page: the verdict and the text report's opening line (where the runs
//! first part), both sides, the first bit difference and the first violation, the curves by capture point, decisions, the per-tensor table, findings.

use std::fmt::Write as _;
use std::path::Path;

use tracegate_trace::names::Name;

use super::chart::{BoundBar, LogChart, Mark, Point, Series};
use super::decisions::decisions;
use super::{esc, fmt_real, int, json_text, num_td, page, real, val, write_file};
use crate::{Report, TensorRow};

/// The x group of a capture point: its decode step ("d0001"), else its layer ("L07").
fn group_of(name: &str) -> Option<String> {
    let n = Name::parse(name);
    match (n.decode_step, n.layer) {
        (Some(step), _) => Some(format!("d{step:04}")),
        (None, Some(layer)) => Some(format!("L{layer:02}")),
        (None, None) => None,
    }
}

/// Where the layer (or, past the prompt, the decode step) changes along the rows: the x groups.
fn groups(rows: &[TensorRow]) -> Vec<(usize, String)> {
    let mut out: Vec<(usize, String)> = Vec::new();
    for (i, r) in rows.iter().enumerate() {
        let key = group_of(&r.tensor);
        if let Some(k) = key {
            if out.last().is_none_or(|(_, last)| *last != k) {
                out.push((i, k));
            }
        }
    }
    out
}

/// At most this many per-tensor rows are drawn and listed (the page says how many there were).
pub const MAX_ROWS: usize = 20_000;

fn bound_of(rep: &Report, row: &TensorRow, key: &str) -> Option<(usize, f64)> {
    let r = row.rule.as_ref()?;
    let rule = rep.policy.as_ref()?.bounds.get(r.index)?;
    let v = match key {
        "max_rel_l2" => rule.max_rel_l2?,
        "max_ulp" => rule.max_ulp? as f64,
        _ => return None,
    };
    Some((r.index, v))
}

fn curve(
    rep: &Report,
    rows: &[TensorRow],
    id: &str,
    field: &str,
    bound: &str,
    y_label: &str,
    legend: &str,
) -> String {
    let value = |r: &TensorRow| -> (Option<f64>, String) {
        match field {
            "rel_l2" => (r.rel_l2.map(|v| v.0), json_text(&r.rel_l2)),
            _ => (r.max_ulp.map(|v| v as f64), json_text(&r.max_ulp)),
        }
    };
    let points = rows
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let (y, json) = value(r);
            Point {
                x: i,
                y,
                pointer: format!("/per_tensor/{i}/{field}"),
                title: format!("#{i} {}: {} {}", r.tensor, field, fmt_real(y)),
                json,
            }
        })
        .collect();
    let mut bounds = Vec::new();
    for (i, r) in rows.iter().enumerate() {
        if let Some((k, v)) = bound_of(rep, r, bound) {
            let json = match bound {
                "max_ulp" => json_text(&(v as u64)),
                _ => json_text(&v),
            };
            bounds.push(BoundBar {
                x: i,
                y: v,
                pointer: format!("/policy/bounds/{k}/{bound}"),
                json,
            });
        }
    }
    let mut marks = Vec::new();
    let at = |name: &str| rows.iter().position(|r| r.tensor == name);
    if let Some(d) = &rep.first_divergence {
        if let Some(x) = at(&d.tensor) {
            marks.push(Mark {
                x,
                id: format!("{id}-first-bit-difference"),
                class: "mark-fbd".into(),
                label: "first bit difference".into(),
                names: d.tensor.clone(),
            });
        }
    }
    if let Some(v) = rep.first_violation() {
        if let Some(x) = at(&v.tensor) {
            marks.push(Mark {
                x,
                id: format!("{id}-first-violation"),
                class: "mark-fv".into(),
                label: "first violation".into(),
                names: v.tensor.clone(),
            });
        }
    }
    // The caption promises only the bars drawn (chart.rs draws a positive, finite limit): a
    // policy whose rules set no such bound (no `max_ulp`, or `max_ulp: 0`, which a log scale
    // cannot place) draws none, and says why.
    let drawn = bounds
        .iter()
        .filter(|b| b.y > 0.0 && b.y.is_finite())
        .count();
    let zero = bounds.iter().filter(|b| b.y == 0.0).count();
    let zero_note = match zero {
        0 => String::new(),
        z => format!(" · {z} tensor(s) bounded by {bound} 0 (bit-exact): no bar on a log scale"),
    };
    let legend = match (rep.policy.is_some(), drawn) {
        (false, _) => format!("{legend} · hollow: 0 (identical) · no policy: no bounds"),
        (true, 0) => format!("{legend} · hollow: 0 (identical) · no bars: no rule of the policy sets a positive {bound}{zero_note}"),
        (true, n) if n == rows.len() => format!("{legend} · orange bars: the policy's {bound} for the tensor's rule · hollow: 0 (identical)"),
        (true, n) => format!("{legend} · orange bars: the policy's {bound} for the tensor's rule, on the {n} of {} tensors it bounds above 0{zero_note} · hollow: 0 (identical)", rows.len()),
    };
    LogChart {
        id: id.into(),
        y_label: y_label.into(),
        n: rows.len(),
        groups: groups(rows),
        series: vec![Series {
            key: field.into(),
            legend,
            points,
        }],
        bounds,
        marks,
    }
    .render()
}

fn first_boxes(rep: &Report, h: &mut String) {
    let _ = write!(h, "<div class=\"box\" id=\"first-bit-difference\" data-tensor=\"{}\"><b>First bit difference</b>: ", esc(rep.first_divergence.as_ref().map_or("", |d| d.tensor.as_str())));
    match &rep.first_divergence {
        None => h.push_str("none"),
        Some(d) => {
            let p = "/first_bit_difference";
            let _ = write!(
                h,
                "<code>{}</code> at {} (flat {}): reference {} vs candidate {}, {} ULP; {} of {} elements differ, max ULP {}, relative L2 {}",
                esc(&d.tensor),
                esc(&format!("{:?}", d.coords)),
                val("span", "num", &format!("{p}/flat_index"), &d.flat_index, &d.flat_index.to_string()),
                val("code", "num", &format!("{p}/reference_value"), &d.reference_value, &d.reference_value),
                val("code", "num", &format!("{p}/candidate_value"), &d.candidate_value, &d.candidate_value),
                val("span", "num", &format!("{p}/ulp"), &d.ulp, &int(d.ulp)),
                val("span", "num", &format!("{p}/differing_elements"), &d.differing_elements, &crate::thousands(d.differing_elements)),
                val("span", "num", &format!("{p}/total_elements"), &d.total_elements, &crate::thousands(d.total_elements)),
                val("span", "num", &format!("{p}/max_ulp"), &d.max_ulp, &int(d.max_ulp)),
                val("span", "num", &format!("{p}/rel_l2"), &d.rel_l2, &real(d.rel_l2)),
            );
        }
    }
    h.push_str("</div>");
    let fv = rep.first_violation();
    let _ = write!(
        h,
        "<div class=\"box\" id=\"first-violation\" data-tensor=\"{}\"><b>First violation</b>: ",
        esc(fv.as_ref().map_or("", |v| v.tensor.as_str()))
    );
    match (&fv, &rep.policy) {
        (_, None) => h.push_str("no policy (every difference counts)"),
        (None, Some(_)) => h.push_str("none: every tensor is within the policy"),
        (Some(v), Some(_)) => {
            let p = "/first_violation";
            let _ = write!(h, "<code>{}</code>", esc(&v.tensor));
            if let Some(r) = &v.rule {
                let _ = write!(
                    h,
                    " (rule #{} <code>{}</code>)",
                    val(
                        "span",
                        "num",
                        &format!("{p}/rule/index"),
                        &r.index,
                        &r.index.to_string()
                    ),
                    esc(&r.pattern)
                );
            }
            h.push_str("<ul>");
            for (i, b) in v.violations.iter().enumerate() {
                let q = format!("{p}/violations/{i}");
                let (value_shown, limit_shown) = match (&b.value, &b.limit) {
                    (Some(crate::Amount::Real(v)), crate::Amount::Real(l)) => {
                        super::fmt_against(v.0, l.0)
                    }
                    (v, l) => (v.as_ref().map_or("undefined".into(), amount), amount(l)),
                };
                let _ = write!(
                    h,
                    "<li class=\"violation\" data-bound=\"{}\">{}: value {} {} limit {}</li>",
                    esc(b.bound),
                    // A per-row bound names its row.
                    esc(&b.position.map_or(b.bound.to_string(), |x| {
                        format!("{} (the row at position {x})", b.bound)
                    })),
                    val("span", "num", &format!("{q}/value"), &b.value, &value_shown),
                    if b.bound == "min_cosine" {
                        "&lt;"
                    } else {
                        "&gt;"
                    },
                    val("span", "num", &format!("{q}/limit"), &b.limit, &limit_shown),
                );
            }
            h.push_str("</ul>");
            if let Some(e) = &v.worst_element {
                let _ = write!(
                    h,
                    "worst element at {}: reference {} vs candidate {}",
                    esc(&format!("{:?}", e.coords)),
                    val(
                        "code",
                        "num",
                        &format!("{p}/worst_element/reference_value"),
                        &e.reference_value,
                        &e.reference_value
                    ),
                    val(
                        "code",
                        "num",
                        &format!("{p}/worst_element/candidate_value"),
                        &e.candidate_value,
                        &e.candidate_value
                    ),
                );
            }
        }
    }
    h.push_str("</div>");
}

fn amount(a: &crate::Amount) -> String {
    match a {
        crate::Amount::Count(n) => crate::thousands(*n),
        crate::Amount::Real(r) => real(Some(*r)),
    }
}

fn tensor_table(rep: &Report, rows: &[TensorRow], h: &mut String) {
    let fv = rep.first_violation().map(|v| v.tensor);
    h.push_str("<table id=\"per-tensor\"><tr><th>#</th><th>tensor</th><th>dtype</th><th>method</th><th>status</th><th>differing</th><th>of</th><th>max ULP</th><th>median ULP</th><th>rel L2</th><th>max abs</th><th>max rel</th><th>cosine</th><th>rule</th><th>violations</th></tr>");
    for (i, r) in rows.iter().enumerate() {
        let p = |f: &str| format!("/per_tensor/{i}/{f}");
        let first = fv.as_deref() == Some(r.tensor.as_str());
        let dtype = if r.candidate_dtype.name() == r.dtype {
            r.dtype.to_string()
        } else {
            format!("{} vs {}", r.dtype, r.candidate_dtype.name())
        };
        let broken: Vec<String> = r.violations.iter().map(|v| v.bound.to_string()).collect();
        let _ = write!(
            h,
            "<tr id=\"t-{i}\" class=\"{}{}\" data-tensor=\"{}\"><td class=\"num\">{i}</td><td class=\"mono\">{}</td><td>{}</td><td>{}</td><td>{}</td>{}{}{}{}{}{}{}{}<td class=\"mono\">{}</td><td>{}</td></tr>",
            r.status,
            if first { " first-violation" } else { "" },
            esc(&r.tensor),
            esc(&r.tensor),
            esc(&dtype),
            r.method,
            r.status,
            num_td(&p("differing_elements"), &r.differing_elements, &int(r.differing_elements)),
            num_td(&p("total_elements"), &r.total_elements, &crate::thousands(r.total_elements)),
            num_td(&p("max_ulp"), &r.max_ulp, &int(r.max_ulp)),
            num_td(&p("median_ulp"), &r.median_ulp, &int(r.median_ulp)),
            num_td(&p("rel_l2"), &r.rel_l2, &real(r.rel_l2)),
            num_td(&p("max_abs"), &r.max_abs, &real(r.max_abs)),
            num_td(&p("max_rel"), &r.max_rel, &real(r.max_rel)),
            num_td(&p("cosine"), &r.cosine, &real(r.cosine)),
            r.rule.as_ref().map_or(String::new(), |r| esc(&r.pattern)),
            esc(&broken.join(", ")),
        );
    }
    h.push_str("</table>");
}

/// The `trace-diff --html` page of `rep`.
pub fn render_html(rep: &Report) -> String {
    let mut h = String::new();
    let verdict = json_text(&rep.verdict);
    let verdict = verdict.trim_matches('"');
    let _ = write!(h, "<h1>trace-diff: <span id=\"verdict\" class=\"v-{verdict}\" data-json=\"/verdict\" data-v=\"&quot;{verdict}&quot;\">{}</span></h1>", verdict.to_uppercase().replace('_', " "));
    // The line the text report opens with — the verdict and where the runs first part — at the
    // top of the page too, before the sides, the charts and the per-tensor table.
    let human = crate::render_human(rep);
    let _ = write!(
        h,
        "<p id=\"headline\">{}</p>",
        esc(human.lines().next().unwrap_or_default())
    );
    h.push_str("<table id=\"sides\"><tr><th></th><th>path</th><th>producer</th><th>digest</th><th>verified</th></tr>");
    for (k, s) in [("reference", &rep.reference), ("candidate", &rep.candidate)] {
        let _ = write!(
            h,
            "<tr><th>{k}</th><td class=\"mono\">{}</td><td>{}</td><td class=\"mono\">{}</td><td>{}</td></tr>",
            esc(s.path.as_deref().unwrap_or("-")),
            esc(s.producer.as_deref().unwrap_or("-")),
            esc(s.digest.as_deref().unwrap_or("-")),
            s.verified
        );
    }
    h.push_str("</table>");
    let t = &rep.tensors;
    let _ = write!(
        h,
        "<p>Policy: <b>{}</b>{}. Scan: {}. Tensors: reference {}, candidate {}, common {}; missing {}, extra {}.{}</p>",
        esc(rep.policy.as_ref().map_or("none (by bits)", |p| p.name.as_str())),
        rep.policy.as_ref().map_or(String::new(), |p| format!(" ({} rules)", val("span", "num", "/policy/rules", &p.rules, &p.rules.to_string()))),
        rep.scan,
        val("span", "num", "/tensors/reference_count", &t.reference_count, &t.reference_count.to_string()),
        val("span", "num", "/tensors/candidate_count", &t.candidate_count, &t.candidate_count.to_string()),
        rep.per_tensor.len(),
        t.missing.len(),
        t.extra.len(),
        rep.filter.as_ref().map_or(String::new(), |f| format!(" Filter: {} tensor(s) and {} decision(s) left out.", f.tensors_left_out, f.decisions_left_out)),
    );
    h.push_str("<h2>Divergence by capture point</h2>");
    first_boxes(rep, &mut h);
    let rows = &rep.per_tensor[..rep.per_tensor.len().min(MAX_ROWS)];
    if rows.is_empty() {
        h.push_str("<p>No tensor was compared.</p>");
    } else {
        if rows.len() < rep.per_tensor.len() {
            let _ = write!(h, "<p class=\"note\">first {} of {} tensors drawn and listed (all are in the JSON report)</p>", rows.len(), rep.per_tensor.len());
        }
        h.push_str(&curve(
            rep,
            rows,
            "chart-rel-l2",
            "rel_l2",
            "max_rel_l2",
            "relative L2 (log)",
            "relative L2 per capture point, in capture order",
        ));
        h.push_str(&curve(
            rep,
            rows,
            "chart-max-ulp",
            "max_ulp",
            "max_ulp",
            "max ULP (log)",
            "max ULP per capture point, in capture order",
        ));
    }
    h.push_str("<h2>Decisions</h2>");
    decisions(rep, &mut h);
    h.push_str("<h2>Per tensor</h2>");
    tensor_table(rep, rows, &mut h);
    h.push_str("<h2>Findings</h2><ul id=\"findings\">");
    for f in &rep.findings {
        let _ = write!(
            h,
            "<li><b>{}</b>{}: {}</li>",
            f.kind,
            f.tensor()
                .map_or(String::new(), |t| format!(" <code>{}</code>", esc(t))),
            esc(&f.detail)
        );
    }
    if rep.findings.is_empty() {
        h.push_str("<li>none</li>");
    }
    h.push_str("</ul>");
    page(&format!("trace-diff {verdict}"), &h)
}

/// Writes [`render_html`]'s page to `path`.
pub fn write_html(rep: &Report, path: &Path) -> std::io::Result<()> {
    write_file(path, &render_html(rep))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_groups_follow_the_names() {
        assert_eq!(group_of("layer.07.attn_out").as_deref(), Some("L07"));
        assert_eq!(group_of("layer.100.attn_out").as_deref(), Some("L100"));
        assert_eq!(
            group_of("decode.0001.layer.03.mlp_out").as_deref(),
            Some("d0001")
        );
        assert_eq!(group_of("logits"), None);
    }
}
