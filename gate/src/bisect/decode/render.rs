//! The decode part of `gate bisect`'s text output.

use super::{CacheStatus, DecodeReport, DecodeStatus};
use crate::bisect::prefill::{self as b, DecisionCmp, LayerRow, TensorCmp};

/// A step's or pass's differing tensors (the first few; names padded to `width`) and decisions.
pub(crate) fn differing(
    tensors: &[TensorCmp],
    decisions: &[DecisionCmp],
    what: &str,
    width: usize,
) -> String {
    let mut o = String::new();
    const SHOWN: usize = 6;
    if tensors.len() > SHOWN {
        o.push_str(&format!(
            "    ({} of the {what}'s tensors differ; the first {SHOWN}:)\n",
            tensors.len()
        ));
    }
    for t in tensors.iter().take(SHOWN) {
        o.push_str(&format!(
            "    {:<width$} {:<14} {:>9}/{:<9} max {} ULP, rel L2 {}\n",
            t.tensor,
            t.status,
            b::thousands(t.differing_elements.unwrap_or(0)),
            b::thousands(t.total_elements),
            b::ulps(t.max_ulp),
            b::sci(t.rel_l2)
        ));
    }
    for x in decisions {
        o.push_str(&format!(
            "    decision {} differs in {}/{} rows\n",
            x.name, x.differing_rows, x.rows
        ));
    }
    o
}

/// The layers isolated at a step or pass; `at` heads the whole runs' columns ("step", "pass").
pub(crate) fn isolated_table(rows: &[LayerRow], at: &str) -> String {
    let mut o = format!(
        "    {:<5} {:<11} {:<9} {:>12} {:>11} {:>12} {:>11}\n",
        "layer",
        "status",
        at,
        "isol max ULP",
        "isol rel L2",
        format!("{at} max ULP"),
        format!("{at} rel L2")
    );
    for r in rows {
        o.push_str(&format!(
            "    {:<5} {:<11} {:<9} {:>12} {:>11} {:>12} {:>11}\n",
            format!("{:02}", r.layer),
            r.status,
            r.whole_run,
            b::ulps(r.isolated_max_ulp),
            b::sci(r.isolated_rel_l2),
            b::ulps(r.whole_max_ulp),
            b::sci(r.whole_rel_l2)
        ));
    }
    o
}

/// The decode part of the human output.
pub fn render(d: &DecodeReport) -> String {
    let mut o = String::new();
    if d.status != DecodeStatus::Compared {
        o.push_str(&format!(
            "\n  decode ({} steps): not compared: {}\n",
            d.generate,
            d.reason.as_deref().unwrap_or("")
        ));
        return o;
    }
    let first = match (d.first_diverging_step, &d.first_diverging) {
        (Some(s), Some(name)) => format!(
            "; first diverging step {s} (position {}) at {name}",
            d.position.unwrap_or(0)
        ),
        _ => "; no step diverges".into(),
    };
    o.push_str(&format!(
        "\n  decode ({} steps, cached): {} steps compared{first}\n",
        d.generate, d.steps_compared
    ));
    // What was left out of the steps' comparison (their numbers, the steps after a near-tie).
    if let Some(why) = &d.reason {
        o.push_str(&format!("    NOT CHECKED: {why}\n"));
    }
    o.push_str(&differing(&d.step_tensors, &d.step_decisions, "step", 36));
    if let Some(c) = &d.cache_check {
        let what = match c.status {
            CacheStatus::Disagrees => format!(
                "DISAGREES from step {} at {} ({})",
                c.first_step.unwrap_or(0),
                c.first_tensor.as_deref().unwrap_or(""),
                c.detail.as_deref().unwrap_or("")
            ),
            CacheStatus::Agrees => "agrees through the diverging step".to_string(),
            CacheStatus::NotChecked => {
                format!("NOT CHECKED: {}", c.reason.as_deref().unwrap_or(""))
            }
        };
        o.push_str(&format!(
            "  cache self-check (the candidate's --cache on vs --cache off): {what}\n"
        ));
    }
    if !d.layers.is_empty() {
        o.push_str(&format!(
            "  isolated at step {} (layer --decode-from {}):\n",
            d.first_diverging_step.unwrap_or(0),
            d.position.unwrap_or(0)
        ));
        o.push_str(&isolated_table(&d.layers, "step"));
    }
    if let Some(st) = &d.stage {
        o.push_str(&format!(
            "  first wrong stage in layer {:02} at the decode step: {} — {}\n",
            st.layer,
            st.block.words(),
            st.detail
        ));
    }
    if let Some(why) = &d.isolation_not_checked {
        o.push_str(&format!("  decode isolation NOT CHECKED: {why}\n"));
    }
    o
}
