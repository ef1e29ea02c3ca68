//! The HTML report: one self-contained page (inline CSS and hand-written SVG; no script, no
//! font, no URL) a person opens in a browser. `trace-diff --html` writes [`render_html`]'s
//! page; the gate's pages (`gate/src/report.rs`) are built from the primitives here.
//!
//! Every number the page shows comes from the report the JSON is serialised from, and says
//! where: an element with `data-json` (a JSON pointer into the `--json` report of the same run)
//! and `data-v` (that value, serialised by the same serializer). The browser test reads the DOM
//! and compares each with the JSON. Axis tick labels are the only other numbers.

use std::fmt::Write as _;
use std::path::Path;

use serde::Serialize;

use tracegate_trace::names::Name;

use crate::{Real, Report, TensorRow};

/// `&`, `<`, `>`, `"`, `'` escaped: safe in text and in a quoted attribute.
pub fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
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
pub fn json_text<T: Serialize + ?Sized>(v: &T) -> String {
    serde_json::to_string(v).unwrap_or_else(|e| format!("\"unserialisable: {e}\""))
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
table{border-collapse:collapse;margin:.4em 0}td,th{border:1px solid #d4d8e0;padding:2px 6px;text-align:left;vertical-align:top}\
th{background:#eef1f6}td.num{text-align:right;font-variant-numeric:tabular-nums}\
.mono,code{font-family:ui-monospace,monospace;font-size:12.5px}\
.v-identical,.v-within_policy,.s-PASS{color:#1a7f37}.v-different,.v-incomparable,.v-unreadable,.s-FAIL{color:#c62828}\
.s-NOT{color:#9a6700}td.s-FAIL{background:#fde7e7}td.s-PASS{background:#e8f5ec}td.s-NOT{background:#fff4d6}\
tr.outside_policy td,tr.no_rule td,tr.rerouted td{background:#fde7e7}tr.different td,tr.differs_by_digest td{background:#fff0e0}\
tr.first-violation td{outline:2px solid #c62828}.box{border:1px solid #ccd;border-radius:4px;padding:.5em .8em;margin:.5em 0;background:#fafbfd}\
.l-defect{color:#c62828;font-weight:600}.l-near-tie,.l-after-near-tie{color:#9a6700}.l-consequence{color:#555}\
svg{background:#fff;border:1px solid #d4d8e0;margin:.3em 0}svg text{font:11px system-ui,sans-serif;fill:#333}\
.grid{stroke:#e3e6ec}.axis{stroke:#888}.pt{stroke:none}.s-rel_l2 .pt{fill:#1f5fbf}.s-max_ulp .pt{fill:#7b3fbf}\
.pt.zero{fill:none;stroke:#9aa;stroke-width:1}.pt.off{fill:#c62828}.bound{stroke:#e07b00;stroke-width:2}\
.mark-fbd{stroke:#1f5fbf;stroke-dasharray:4 3;stroke-width:1.5}.mark-fv{stroke:#c62828;stroke-width:2}\
.lane{stroke:#eee}.m-defect{fill:#c62828}.m-near-tie{fill:#e0a000}.m-after-near-tie{fill:#c9b26b}.m-consequence{fill:#888}\
.nb{stroke:#333;stroke-width:1.5}.note{color:#555}a{color:#1f5fbf}";

/// Writes through a temporary file and a rename, so a crash never leaves half a page.
pub fn write_file(path: &Path, text: &str) -> std::io::Result<()> {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".tmp");
    let tmp = path.with_file_name(name);
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)
}

/// One point of a [`LogChart`] series: `y` None is not measured (not drawn), 0 is drawn on the
/// chart's zero line, a non-finite value at its top edge.
pub struct Point {
    pub x: usize,
    pub y: Option<f64>,
    /// The JSON pointer and text of the value (the DOM's `data-json`, `data-v`).
    pub pointer: String,
    pub json: String,
    pub title: String,
}

pub struct Series {
    /// A class name (`s-<key>` on the group) and the legend's words.
    pub key: String,
    pub legend: String,
    pub points: Vec<Point>,
}

/// A limit drawn as a short horizontal bar over one x.
pub struct BoundBar {
    pub x: usize,
    pub y: f64,
    pub pointer: String,
    pub json: String,
}

/// A vertical line over one x (first bit difference, first violation, wrong layer).
pub struct Mark {
    pub x: usize,
    pub id: String,
    pub class: String,
    pub label: String,
    /// `data-tensor` (or whatever the mark names).
    pub names: String,
}

/// A chart over `n` positions (capture order) with a log-scale y axis.
pub struct LogChart {
    pub id: String,
    pub y_label: String,
    pub n: usize,
    /// Group labels along x: (first x of the group, text), e.g. layer numbers.
    pub groups: Vec<(usize, String)>,
    pub series: Vec<Series>,
    pub bounds: Vec<BoundBar>,
    pub marks: Vec<Mark>,
}

const W: f64 = 1100.0;
const H: f64 = 250.0;
// Plot margins: left, right, top, bottom.
const L: f64 = 64.0;
const R: f64 = 16.0;
const T: f64 = 22.0;
const B: f64 = 40.0;

/// Whole decades covering every positive finite value (at least one decade).
fn decades(values: impl Iterator<Item = f64>) -> (i32, i32) {
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for v in values.filter(|v| v.is_finite() && *v > 0.0) {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    if !lo.is_finite() {
        return (-1, 0);
    }
    let (a, b) = (lo.log10().floor() as i32, hi.log10().ceil() as i32);
    (a, if b > a { b } else { a + 1 })
}

impl LogChart {
    pub fn render(&self) -> String {
        let mut s = String::new();
        let all = self
            .series
            .iter()
            .flat_map(|s| s.points.iter().filter_map(|p| p.y))
            .chain(self.bounds.iter().map(|b| b.y));
        let (lo, hi) = decades(all);
        let (pw, ph) = (W - L - R, H - T - B);
        let n = self.n.max(1) as f64;
        let x = |i: usize| L + (i as f64 + 0.5) * pw / n;
        let y = |v: f64| T + ph - (v.log10() - lo as f64) / (hi - lo) as f64 * ph;
        let zero_y = T + ph + 12.0;
        let _ = write!(s, "<svg id=\"{}\" class=\"chart\" viewBox=\"0 0 {W} {H}\" width=\"{W}\" height=\"{H}\" role=\"img\" data-n=\"{}\">", esc(&self.id), self.n);
        let _ = write!(s, "<text x=\"4\" y=\"14\">{}</text>", esc(&self.y_label));
        for d in lo..=hi {
            let yy = y(10f64.powi(d));
            let _ = write!(s, "<line class=\"grid\" x1=\"{L}\" x2=\"{}\" y1=\"{yy:.1}\" y2=\"{yy:.1}\"/><text class=\"tick\" x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">1e{d}</text>", W - R, L - 4.0, yy + 4.0);
        }
        let _ = write!(
            s,
            "<text class=\"tick\" x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">0</text>",
            L - 4.0,
            zero_y + 4.0
        );
        for (g, text) in &self.groups {
            let xx = L + *g as f64 * pw / n;
            let _ = write!(s, "<line class=\"grid\" x1=\"{xx:.1}\" x2=\"{xx:.1}\" y1=\"{T}\" y2=\"{}\"/><text x=\"{:.1}\" y=\"{}\">{}</text>", T + ph, xx + 2.0, H - 8.0, esc(text));
        }
        let _ = write!(s, "<line class=\"axis\" x1=\"{L}\" x2=\"{L}\" y1=\"{T}\" y2=\"{}\"/><line class=\"axis\" x1=\"{L}\" x2=\"{}\" y1=\"{}\" y2=\"{}\"/>", T + ph, W - R, T + ph, T + ph);
        let half = (pw / n / 2.0).clamp(1.5, 8.0);
        for b in &self.bounds {
            if b.y > 0.0 && b.y.is_finite() {
                let (xx, yy) = (x(b.x), y(b.y));
                let _ = write!(s, "<line class=\"bound\" data-x=\"{}\" data-json=\"{}\" data-v=\"{}\" x1=\"{:.1}\" x2=\"{:.1}\" y1=\"{yy:.1}\" y2=\"{yy:.1}\"/>", b.x, esc(&b.pointer), esc(&b.json), xx - half, xx + half);
            }
        }
        for m in &self.marks {
            let xx = x(m.x);
            let _ = write!(
                s,
                "<g id=\"{}\" class=\"mark\" data-x=\"{}\" data-names=\"{}\"><line class=\"{}\" x1=\"{xx:.1}\" x2=\"{xx:.1}\" y1=\"{T}\" y2=\"{}\"/><text x=\"{:.1}\" y=\"{}\">{}</text><title>{}</title></g>",
                esc(&m.id),
                m.x,
                esc(&m.names),
                esc(&m.class),
                T + ph,
                xx + 3.0,
                T + 10.0,
                esc(&m.label),
                esc(&format!("{}: {}", m.label, m.names))
            );
        }
        for se in &self.series {
            let _ = write!(s, "<g class=\"series s-{}\">", esc(&se.key));
            for p in &se.points {
                let Some(v) = p.y else { continue };
                let (cy, class) = if v == 0.0 {
                    (zero_y, "pt zero")
                } else if !v.is_finite() {
                    (T, "pt off")
                } else {
                    (y(v), "pt")
                };
                let _ = write!(
                    s,
                    "<circle class=\"{class}\" data-x=\"{}\" data-json=\"{}\" data-v=\"{}\" cx=\"{:.1}\" cy=\"{cy:.1}\" r=\"3\"><title>{}</title></circle>",
                    p.x,
                    esc(&p.pointer),
                    esc(&p.json),
                    x(p.x),
                    esc(&p.title)
                );
            }
            s.push_str("</g>");
        }
        s.push_str("</svg>");
        let legend: Vec<String> = self.series.iter().map(|se| esc(&se.legend)).collect();
        let _ = write!(s, "<div class=\"note\">{}</div>", legend.join(" · "));
        s
    }
}

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
/// At most this many flips per decision family are listed.
pub const MAX_FLIPS: usize = 500;

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
    let legend = if rep.policy.is_some() {
        format!("{legend} · orange bars: the policy's {bound} for the tensor's rule · hollow: 0 (identical)")
    } else {
        format!("{legend} · hollow: 0 (identical) · no policy: no bounds")
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
                let _ = write!(
                    h,
                    "<li class=\"violation\" data-bound=\"{}\">{}: value {} {} limit {}</li>",
                    esc(b.bound),
                    esc(b.bound),
                    val(
                        "span",
                        "num",
                        &format!("{q}/value"),
                        &b.value,
                        &b.value.map_or("undefined".into(), |a| amount(&a))
                    ),
                    if b.bound == "min_cosine" {
                        "&lt;"
                    } else {
                        "&gt;"
                    },
                    val(
                        "span",
                        "num",
                        &format!("{q}/limit"),
                        &b.limit,
                        &amount(&b.limit)
                    ),
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

fn decisions(rep: &Report, h: &mut String) {
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
    let height = T + lanes.len() as f64 * lane_h + 30.0;
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

/// The `trace-diff --html` page of `rep`.
pub fn render_html(rep: &Report) -> String {
    let mut h = String::new();
    let verdict = json_text(&rep.verdict);
    let verdict = verdict.trim_matches('"');
    let _ = write!(h, "<h1>trace-diff: <span id=\"verdict\" class=\"v-{verdict}\" data-json=\"/verdict\" data-v=\"&quot;{verdict}&quot;\">{}</span></h1>", verdict.to_uppercase().replace('_', " "));
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
