//! `gate bisect --html`: the bisection as one self-contained page, built from the diff's HTML
//! primitives (tracegate_diff::html): the whole-run and isolated error per layer on one log
//! chart with the 1-ULP calibration response, the wrong layer and its stage marked, suspicious
//! layers marked, the per-layer table, the judge line and the verdict. Every number is tied to
//! its place in the `--report` JSON of the same run (`data-json`, `data-v`).

use std::fmt::Write as _;

use tracegate_diff::html::{
    esc, fmt_real, json_text, num_td, page, val, LogChart, Mark, Point, Series,
};
use tracegate_diff::thousands;

use crate::bisect::{BisectReport, LayerRow, Stage, TensorCmp};
use crate::bisect_decode::DecodeReport;

/// A table of layers on the page: the prefill's (`/layers`, ids as they are) or those isolated
/// at the first diverging decode step (`/decode/layers`, ids prefixed `decode-`).
struct View<'a> {
    rows: &'a [LayerRow],
    /// JSON pointer of the rows and of the report part holding `first_wrong_layer` and `stage`.
    rows_at: &'a str,
    owner_at: &'a str,
    /// Prefix of every element id.
    id: &'a str,
    first_wrong: Option<usize>,
    stage: Option<&'a Stage>,
}

impl<'a> View<'a> {
    fn prefill(r: &'a BisectReport) -> View<'a> {
        View {
            rows: &r.layers,
            rows_at: "/layers",
            owner_at: "",
            id: "",
            first_wrong: r.first_wrong_layer,
            stage: r.stage.as_ref(),
        }
    }

    fn decode(d: &'a DecodeReport) -> View<'a> {
        View {
            rows: &d.layers,
            rows_at: "/decode/layers",
            owner_at: "/decode",
            id: "decode-",
            first_wrong: d.first_wrong_layer,
            stage: d.stage.as_ref(),
        }
    }
}

/// The series' colours (the diff's sheet has one colour per diff series); allowed by the page's
/// CSP (`style-src 'unsafe-inline'`).
const STYLE: &str = "<style>.s-whole .pt{fill:none;stroke:#1f5fbf;stroke-width:1.5;r:6px}.s-isolated .pt{fill:#c62828}\
.s-calibration .pt{fill:#e0a000;r:4px}.mark-suspicious{stroke:#e07b00;stroke-dasharray:2 3;stroke-width:2}\
tr.wrong-layer td{background:#fde7e7;font-weight:600}tr.suspicious td{background:#fff4d6}</style>";

fn ulp_text(v: Option<u64>) -> String {
    v.map_or("-".into(), thousands)
}

/// One series over the layers: `field` of each row, tied to `/layers/N/<field>`.
fn series(
    v: &View,
    key: &str,
    legend: &str,
    field: &str,
    get: impl Fn(&LayerRow) -> Option<f64>,
) -> Series {
    let points = v
        .rows
        .iter()
        .enumerate()
        .map(|(i, row)| {
            let y = get(row);
            Point {
                x: i,
                y,
                pointer: format!("{}/{i}/{field}", v.rows_at),
                json: json_text(&y),
                title: format!("layer {:02} {field}: {}", row.layer, fmt_real(y)),
            }
        })
        .collect();
    Series {
        key: key.into(),
        legend: legend.into(),
        points,
    }
}

fn chart(v: &View) -> String {
    let layers = v.rows;
    let mut all = vec![
        series(
            v,
            "whole",
            "blue ring: whole run, layer.NN.hidden_out rel L2 (reference vs candidate)",
            "whole_rel_l2",
            |l| l.whole_rel_l2,
        ),
        series(
            v,
            "isolated",
            "red: isolated, the candidate's layer verb on the reference's input",
            "isolated_rel_l2",
            |l| l.isolated_rel_l2,
        ),
    ];
    if layers.iter().any(|l| l.calibration_rel_l2.is_some()) {
        all.push(series(v, "calibration", "amber: calibration, what a 1-ULP perturbation of the calibration layer's input grows to", "calibration_rel_l2", |l| l.calibration_rel_l2));
    }
    let mut marks = Vec::new();
    if let Some(w) = v.first_wrong {
        let names = v.stage.map_or(format!("layer {w:02}"), |s| {
            format!("{} ({})", s.tensor, s.block.words())
        });
        marks.push(Mark {
            x: w,
            id: format!("{}chart-layers-wrong-layer", v.id),
            class: "mark-fv".into(),
            label: "wrong layer".into(),
            names,
        });
    }
    for l in layers.iter().filter(|l| l.suspicious) {
        marks.push(Mark {
            x: l.layer,
            id: format!("{}chart-layers-suspicious-{:02}", v.id, l.layer),
            class: "mark-suspicious".into(),
            label: "suspicious".into(),
            names: format!("layer {:02}", l.layer),
        });
    }
    let groups = layers
        .iter()
        .enumerate()
        .map(|(i, l)| (i, format!("L{:02}", l.layer)))
        .collect();
    let mut s = LogChart {
        id: format!("{}chart-layers", v.id),
        y_label: "relative L2 of layer.NN.hidden_out (log)".into(),
        n: layers.len(),
        groups,
        series: all,
        bounds: Vec::new(),
        marks,
    }
    .render();
    s.push_str("<div class=\"note\">on the 0 line: identical · missing: not measured (a layer not isolated has no red point)</div>");
    s
}

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

/// The differ's rows of some tensors as a table; `at` is their JSON pointer.
fn tensor_table(id: &str, at: &str, rows: &[TensorCmp], h: &mut String) {
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

fn whole_run(r: &BisectReport, h: &mut String) {
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

fn checks(r: &BisectReport, h: &mut String) {
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

/// A view's chart (when it has rows), its wrong layer and stage, and its table.
fn layers(v: &View, h: &mut String) {
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

/// `--generate N`: one box per decode step (compared, the first diverging, not compared), the
/// diverging step's tensors and decisions, the cached-path self-check, and the layers isolated
/// at that step as the prefill's (docs/bisect.md, "Decode").
fn decode(d: &DecodeReport, h: &mut String) {
    let _ = write!(
        h,
        "<h2 id=\"decode\" data-status=\"{}\">Decode steps: {} of {} compared</h2>",
        esc(d.status.as_str()),
        val(
            "span",
            "num",
            "/decode/steps_compared",
            &d.steps_compared,
            &d.steps_compared.to_string()
        ),
        val(
            "span",
            "num",
            "/decode/generate",
            &d.generate,
            &d.generate.to_string()
        ),
    );
    if let Some(why) = &d.reason {
        let _ = write!(
            h,
            "<p>not compared: {}</p>",
            val("span", "text", "/decode/reason", why, why)
        );
    }
    // The steps in order: 0..steps_compared compared, the last of them diverging when one did.
    let (w, gap) = (44usize, 6usize);
    let _ = write!(
        h,
        "<svg id=\"decode-steps\" data-n=\"{}\" width=\"{}\" height=\"48\" role=\"img\">",
        d.generate,
        d.generate.max(1) * (w + gap)
    );
    for s in 0..d.generate {
        let (class, fill, said) = if d.first_diverging_step == Some(s) {
            ("step diverging", "#c62828", "first diverging")
        } else if s < d.steps_compared {
            ("step compared", "#2e7d32", "compared, agrees")
        } else {
            ("step not-compared", "#bdbdbd", "not compared")
        };
        let x = s * (w + gap);
        let _ = write!(
            h,
            "<g id=\"decode-step-{s:04}\" class=\"{class}\" data-step=\"{s}\"><title>decode step {s}: {said}</title>\
<rect x=\"{x}\" y=\"4\" width=\"{w}\" height=\"24\" fill=\"{fill}\"></rect>\
<text x=\"{}\" y=\"44\" text-anchor=\"middle\" font-size=\"11\">{s}</text></g>",
            x + w / 2
        );
    }
    h.push_str("</svg><div class=\"note\">green: compared, agrees · red: the first diverging step · grey: not compared</div>");
    if let (Some(s), Some(name)) = (d.first_diverging_step, &d.first_diverging) {
        let how = d.first_diverging_how.map_or("-", |h| h.as_str());
        let _ = write!(
            h,
            "<div class=\"box\" id=\"decode-first-diverging\" data-step=\"{s}\" data-tensor=\"{}\">first diverging step {} (position {}) at {} ({})</div>",
            esc(name),
            val("b", "num", "/decode/first_diverging_step", &s, &s.to_string()),
            val("span", "num", "/decode/position", &d.position, &d.position.map_or("-".into(), |p| p.to_string())),
            val("code", "text", "/decode/first_diverging", name, name),
            val("span", "text", "/decode/first_diverging_how", &d.first_diverging_how, how),
        );
    }
    if !d.step_tensors.is_empty() {
        tensor_table(
            "decode-step-tensors",
            "/decode/step_tensors",
            &d.step_tensors,
            h,
        );
    }
    for (i, x) in d.step_decisions.iter().enumerate() {
        let p = |f: &str| format!("/decode/step_decisions/{i}/{f}");
        let _ = write!(
            h,
            "<p class=\"decode-decision\">decision {} differs in {} of {} rows</p>",
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
    if let Some(c) = &d.cache_check {
        let _ = write!(
            h,
            "<div class=\"box\" id=\"decode-cache-check\" data-status=\"{}\"><b>Cached decode against the full recompute</b> (the candidate's --cache on vs --cache off): {}",
            esc(c.status.as_str()),
            val("b", "text", "/decode/cache_check/status", &c.status, c.status.as_str()),
        );
        if let (Some(at), Some(t)) = (c.first_step, &c.first_tensor) {
            let _ = write!(
                h,
                "; first at step {}: {}",
                val(
                    "span",
                    "num",
                    "/decode/cache_check/first_step",
                    &at,
                    &at.to_string()
                ),
                val("code", "text", "/decode/cache_check/first_tensor", t, t),
            );
        }
        for (f, x) in [("detail", &c.detail), ("reason", &c.reason)] {
            if let Some(x) = x {
                let _ = write!(
                    h,
                    "<br>{f}: {}",
                    val("span", "text", &format!("/decode/cache_check/{f}"), x, x)
                );
            }
        }
        h.push_str("</div>");
    }
    if let Some(s) = d.first_diverging_step {
        let _ = write!(
            h,
            "<h2>Layers isolated at decode step {s}: the candidate's <code>layer --decode-from</code></h2>"
        );
        if let Some(why) = &d.isolation_not_checked {
            let _ = write!(
                h,
                "<p id=\"decode-isolation-not-checked\">NOT CHECKED: {}</p>",
                val("span", "text", "/decode/isolation_not_checked", why, why)
            );
        }
        layers(&View::decode(d), h);
    }
}

/// The `gate bisect --html` page of `r`.
pub fn render_html(r: &BisectReport) -> String {
    let mut h = String::from(STYLE);
    let _ = write!(
        h,
        "<h1>gate bisect: <span id=\"verdict\" class=\"{}\" data-json=\"/verdict\" data-v=\"{}\">{}</span> (exit {})</h1>",
        if r.exit_code == 0 { "s-PASS" } else { "s-FAIL" },
        esc(&json_text(&r.verdict)),
        esc(&r.verdict.as_str().to_uppercase().replace('_', " ")),
        val("span", "num", "/exit_code", &r.exit_code, &r.exit_code.to_string()),
    );
    let j = &r.judge;
    let _ = write!(
        h,
        "<p id=\"judge\">judged by {}{} ({})</p>",
        val("b", "text", "/judge/by", &j.by, j.by.as_str()),
        j.policy.as_ref().map_or(String::new(), |p| format!(
            " {}",
            val("code", "text", "/judge/policy", p, p)
        )),
        val("span", "text", "/judge/reason", &j.reason, &j.reason),
    );
    let _ = write!(
        h,
        "<p id=\"summary\">{}</p>",
        val("span", "text", "/summary", &r.summary, &r.summary)
    );
    let _ = write!(
        h,
        "<p>reference <code>{}</code> · candidate <code>{}</code> · model <code>{}</code> · {} tokens{} · capture {} · {} layers · traces in <code>{}</code></p>",
        esc(&r.reference),
        esc(&r.candidate),
        esc(&r.model),
        r.tokens.len(),
        r.prompt.as_ref().map_or(String::new(), |p| format!(" (prompt {})", esc(p))),
        r.capture,
        val("span", "num", "/layers_total", &r.layers_total, &r.layers_total.to_string()),
        esc(&r.work_dir),
    );
    if let Some(f) = &r.decisions_forced {
        let _ = write!(
            h,
            "<p id=\"decisions-forced\">decisions: {}{}</p>",
            val(
                "b",
                "text",
                "/decisions_forced/status",
                &f.status,
                f.status.as_str()
            ),
            f.reason.as_ref().map_or(String::new(), |why| format!(
                " — {}",
                val("span", "text", "/decisions_forced/reason", why, why)
            ))
        );
    }
    whole_run(r, &mut h);
    h.push_str("<h2>Error per layer: whole run, isolated, calibration</h2>");
    if r.layers.is_empty() {
        h.push_str("<p>No layer row (the bisection stopped before the layers).</p>");
    }
    layers(&View::prefill(r), &mut h);
    h.push_str("<h2>Checks</h2>");
    checks(r, &mut h);
    if let Some(d) = &r.decode {
        decode(d, &mut h);
    }
    page(&format!("gate bisect {}", r.verdict), &h)
}
