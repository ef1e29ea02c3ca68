//! The decode steps' part of the page.

use std::fmt::Write as _;

use tracegate_diff::html::{esc, val};

use super::layers::{decision_lines, layers, tensor_table};
use super::View;
use crate::bisect::decode::DecodeReport;

/// `--generate N`: one box per decode step (compared, the first diverging, not compared), the
/// diverging step's tensors and decisions, the cached-path self-check, and the layers isolated
/// at that step as the prefill's (docs/bisect.md, "Decode").
pub(super) fn decode(d: &DecodeReport, h: &mut String) {
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
    decision_lines(
        "decode-decision",
        "/decode/step_decisions",
        &d.step_decisions,
        h,
    );
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
