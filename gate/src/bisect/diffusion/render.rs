//! The block-diffusion part of `gate bisect`'s text output.

use super::DiffusionReport;
use crate::bisect::decode::DecodeStatus;
use crate::bisect::prefill::{self as b, Forcing};

/// The block-diffusion part of the human output.
pub fn render(d: &DiffusionReport) -> String {
    let mut o = String::new();
    if d.status != DecodeStatus::Compared {
        o.push_str(&format!(
            "\n  block diffusion (--generate {}, seed {}): not compared: {}\n",
            d.generate,
            d.seed,
            d.reason.as_deref().unwrap_or("")
        ));
        return o;
    }
    let first = match (&d.place, &d.first_diverging) {
        (Some(place), Some(name)) => format!("; first diverging at {place}: {name}"),
        _ => "; no pass diverges".into(),
    };
    o.push_str(&format!(
        "\n  block diffusion (--generate {}, seed {}): {} of {} passes after the prompt compared{first}\n",
        d.generate, d.seed, d.passes_compared, d.passes
    ));
    if let Some(f) = &d.forced {
        match f.status {
            Forcing::Forced => {
                // Its own decisions it would have taken otherwise; the draws are the other
                // generator's by construction.
                let own: Vec<String> = f
                    .overridden
                    .as_ref()
                    .and_then(|v| v.as_object())
                    .into_iter()
                    .flatten()
                    .filter(|(name, _)| {
                        !tracegate_diff::passes::place(name)
                            .and_then(|p| p.sampler)
                            .is_some_and(tracegate_diff::passes::Sampler::is_draw)
                    })
                    .map(|(name, n)| format!("{name}: {n}"))
                    .collect();
                const SHOWN: usize = 6;
                let more = if own.len() > SHOWN { ", …" } else { "" };
                o.push_str(&format!(
                    "    the candidate's draws differ from the reference's (another generator): traced again taking the reference's draws and decisions ({}); its own decisions it would have taken otherwise, draws aside: {}\n",
                    f.candidate_trace.as_deref().unwrap_or(""),
                    if own.is_empty() {
                        "none".to_string()
                    } else {
                        format!("{}{more}", own[..own.len().min(SHOWN)].join(", "))
                    }
                ));
            }
            Forcing::NotForced => o.push_str(&format!(
                "    decisions NOT forced: {}\n",
                f.reason.as_deref().unwrap_or("")
            )),
        }
    }
    if let Some(why) = &d.reason {
        o.push_str(&format!("    NOT CHECKED: {why}\n"));
    }
    const SHOWN: usize = 6;
    if d.pass_tensors.len() > SHOWN {
        o.push_str(&format!(
            "    ({} of the pass's tensors differ; the first {SHOWN}:)\n",
            d.pass_tensors.len()
        ));
    }
    for t in d.pass_tensors.iter().take(SHOWN) {
        o.push_str(&format!(
            "    {:<44} {:<14} {:>9}/{:<9} max {} ULP, rel L2 {}\n",
            t.tensor,
            t.status,
            b::thousands(t.differing_elements.unwrap_or(0)),
            b::thousands(t.total_elements),
            b::ulps(t.max_ulp),
            b::sci(t.rel_l2)
        ));
    }
    for x in &d.pass_decisions {
        o.push_str(&format!(
            "    decision {} differs in {}/{} rows\n",
            x.name,
            x.judged_rows(),
            x.rows
        ));
    }
    if !d.layers.is_empty() {
        o.push_str(&format!(
            "  isolated at {} (the candidate's layer verb on the reference's {}layer.LL.hidden_in):\n",
            d.place.as_deref().unwrap_or(""),
            d.first_diverging_pass.as_deref().unwrap_or("")
        ));
        o.push_str(&format!(
            "    {:<5} {:<11} {:<9} {:>12} {:>11} {:>12} {:>11}\n",
            "layer", "status", "pass", "isol max ULP", "isol rel L2", "pass max ULP", "pass rel L2"
        ));
        for r in &d.layers {
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
    }
    if let Some(st) = &d.stage {
        o.push_str(&format!(
            "  first wrong stage in layer {:02} at {}: {} — {}\n",
            st.layer,
            d.place.as_deref().unwrap_or(""),
            st.block.words(),
            st.detail
        ));
    }
    if let Some(i) = &d.inconsistent {
        o.push_str(&format!(
            "  self-consistency: INCONSISTENT at layer {:02}: the candidate's layer verb on its own whole run: {} ({})\n",
            i.layer, i.detail, i.trace
        ));
    } else if let Some(why) = &d.self_check_not_checked {
        o.push_str(&format!("  self-consistency NOT CHECKED: {why}\n"));
    } else if let Some(l) = d.first_wrong_layer {
        o.push_str(&format!(
            "  self-consistency: the candidate's layer verb agrees with its own whole run at layer {l:02}\n"
        ));
    }
    if let Some(why) = &d.isolation_not_checked {
        o.push_str(&format!("  isolation NOT CHECKED: {why}\n"));
    }
    o
}
