//! The block-diffusion part of `gate bisect`'s text output.

use super::{own_overrides, DiffusionReport};
use crate::bisect::decode::render::{differing, isolated_table};
use crate::bisect::decode::DecodeStatus;
use crate::bisect::prefill::Forcing;

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
                let own: Vec<String> = own_overrides(f)
                    .into_iter()
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
                if let Some(why) = &f.overrides_not_checked {
                    o.push_str(&format!("    its own decisions NOT CHECKED: {why}\n"));
                }
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
    o.push_str(&differing(&d.pass_tensors, &d.pass_decisions, "pass", 44));
    if !d.layers.is_empty() {
        o.push_str(&format!(
            "  isolated at {} (the candidate's layer verb on the reference's {}layer.LL.hidden_in):\n",
            d.place.as_deref().unwrap_or(""),
            d.first_diverging_pass.as_deref().unwrap_or("")
        ));
        o.push_str(&isolated_table(&d.layers, "pass"));
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
