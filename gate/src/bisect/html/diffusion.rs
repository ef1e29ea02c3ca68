//! The block-diffusion part of the page.

use std::fmt::Write as _;

use tracegate_diff::html::{esc, val};
use tracegate_diff::thousands;

use super::layers::{decision_lines, layers, tensor_table};
use super::View;
use crate::bisect::diffusion::DiffusionReport;

/// `--generate N` on a diffusion model: the passes compared, forcing past another generator's
/// draws, the first diverging pass with its tensors and decisions, and the layers isolated there
/// as the prefill's (docs/bisect.md, "Block diffusion").
pub(super) fn diffusion(d: &DiffusionReport, h: &mut String) {
    let _ = write!(
        h,
        "<h2 id=\"diffusion\" data-status=\"{}\">Block diffusion: {} of {} passes after the prompt compared (seed {})</h2>",
        esc(d.status.as_str()),
        val("span", "num", "/diffusion/passes_compared", &d.passes_compared, &d.passes_compared.to_string()),
        val("span", "num", "/diffusion/passes", &d.passes, &d.passes.to_string()),
        val("span", "num", "/diffusion/seed", &d.seed, &d.seed.to_string()),
    );
    if let Some(why) = &d.reason {
        let _ = write!(
            h,
            "<p id=\"diffusion-reason\">NOT CHECKED: {}</p>",
            val("span", "text", "/diffusion/reason", why, why)
        );
    }
    if let Some(f) = &d.forced {
        let _ = write!(
            h,
            "<div class=\"box\" id=\"diffusion-forced\">another generator: the candidate traced taking the reference's draws and decisions: {}{}; rows it would have decided otherwise: {}</div>",
            val("b", "text", "/diffusion/forced/status", &f.status, f.status.as_str()),
            f.reason.as_ref().map_or(String::new(), |why| format!(
                " — {}",
                val("span", "text", "/diffusion/forced/reason", why, why)
            )),
            val(
                "span",
                "num",
                "/diffusion/forced/rows_overridden",
                &f.rows_overridden,
                &f.rows_overridden.map_or("-".into(), thousands)
            ),
        );
        super::forced::overrides(f, "/diffusion/forced", "diffusion-", h);
    }
    if let (Some(place), Some(name)) = (&d.place, &d.first_diverging) {
        let how = d.first_diverging_how.map_or("-", |h| h.as_str());
        let _ = write!(
            h,
            "<div class=\"box\" id=\"diffusion-first-diverging\" data-tensor=\"{}\">first diverging at {}: {} ({})</div>",
            esc(name),
            val("b", "text", "/diffusion/place", place, place),
            val("code", "text", "/diffusion/first_diverging", name, name),
            val("span", "text", "/diffusion/first_diverging_how", &d.first_diverging_how, how),
        );
    }
    if !d.pass_tensors.is_empty() {
        tensor_table(
            "diffusion-pass-tensors",
            "/diffusion/pass_tensors",
            &d.pass_tensors,
            h,
        );
    }
    decision_lines(
        "diffusion-decision",
        "/diffusion/pass_decisions",
        &d.pass_decisions,
        h,
    );
    if !d.layers.is_empty() || d.isolation_not_checked.is_some() {
        let _ = write!(
            h,
            "<h2>Layers isolated at {}: the candidate's <code>layer</code> verb on the reference's pass</h2>",
            esc(d.place.as_deref().unwrap_or(""))
        );
        if let Some(why) = &d.isolation_not_checked {
            let _ = write!(
                h,
                "<p id=\"diffusion-isolation-not-checked\">NOT CHECKED: {}</p>",
                val("span", "text", "/diffusion/isolation_not_checked", why, why)
            );
        }
        layers(&View::diffusion(d), h);
    }
}
