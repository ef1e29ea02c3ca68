//! `gate bisect --html`: the bisection as one self-contained page, built from the diff's HTML
//! primitives (tracegate_diff::html): the whole-run and isolated error per layer on one log
//! chart with the 1-ULP calibration response, the wrong layer and its stage marked, suspicious
//! layers marked, the per-layer table, the judge line and the verdict. Every number is tied to
//! its place in the `--report` JSON of the same run (`data-json`, `data-v`).
//!
//! The parts: chart.rs the per-layer chart, layers.rs a layer table with its wrong layer and
//! stage, checks.rs the whole run and the checks (outliers, self-consistency, calibration,
//! rounding level), decode.rs the decode steps, diffusion.rs a block-diffusion run's passes,
//! forced.rs a forced candidate's own overrides;
//! this file the page and its view of a table.

use std::fmt::Write as _;

use tracegate_diff::html::{esc, json_text, page, val};
use tracegate_diff::thousands;

use crate::bisect::decode::DecodeReport;
use crate::bisect::diffusion::DiffusionReport;
use crate::bisect::prefill::{LayerRow, Stage};
use crate::bisect::BisectReport;

mod chart;
mod checks;
mod decode;
mod diffusion;
mod forced;
mod layers;

use checks::{checks, whole_run};
use decode::decode;
use diffusion::diffusion;
use layers::layers;

/// A table of layers on the page: the prefill's (`/layers`, ids as they are) or those isolated
/// at the first diverging decode step (`/decode/layers`, ids prefixed `decode-`) or block-diffusion
/// pass (`/diffusion/layers`, ids prefixed `diffusion-`).
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

    fn diffusion(d: &'a DiffusionReport) -> View<'a> {
        View {
            rows: &d.layers,
            rows_at: "/diffusion/layers",
            owner_at: "/diffusion",
            id: "diffusion-",
            first_wrong: d.first_wrong_layer,
            stage: d.stage.as_ref(),
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
        forced::overrides(f, "/decisions_forced", "", &mut h);
    }
    if r.diffusion.is_some() {
        h.push_str("<h2 id=\"prompt-pass\">The prompt's encoder pass</h2><p>Up to the checks below: the prompt's pass alone; the passes after it are under <a href=\"#diffusion\">Block diffusion</a>.</p>");
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
    if let Some(d) = &r.diffusion {
        diffusion(d, &mut h);
    }
    page(&format!("gate bisect {}", r.verdict), &h)
}
