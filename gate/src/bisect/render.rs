//! Human output: the summary line first, then the per-layer table.

use super::*;

// ------------------------------------------------------------------------------------------
// Human output: the summary line first, then the per-layer table.

pub fn render(r: &BisectReport) -> String {
    let mut o = String::new();
    o.push_str(&r.judge.line());
    o.push('\n');
    o.push_str(&r.summary);
    o.push('\n');
    o.push_str(&format!(
        "  reference {}{} · candidate {} · model {} · {} tokens{} · capture {}\n",
        r.reference,
        r.reference_trace
            .as_ref()
            .map(|t| format!(
                " (stored; recorded by {}, digest {})",
                t.producer,
                &t.digest[..16]
            ))
            .unwrap_or_default(),
        r.candidate,
        r.model,
        r.tokens.len(),
        r.prompt
            .as_ref()
            .map(|p| format!(" (prompt {p})"))
            .unwrap_or_default(),
        r.capture
    ));
    if let Some(s) = &r.sharded {
        o.push_str(&format!("  sharded candidate: {}\n", s.run.line()));
        if let Some(a) = &s.at {
            o.push_str(&format!("  at rank: {}\n", a.words()));
        }
        o.push_str(&format!("  layer verb: {}\n", s.layer_verb));
    }
    if let Some(f) = &r.decisions_forced {
        match &f.candidate_trace {
            Some(t) => o.push_str(&format!(
                "  decisions forced: the candidate re-ran with the reference's decisions ({t}); the whole run and the isolation below are that run ({} rows it would have decided otherwise)\n",
                f.rows_overridden.unwrap_or(0)
            )),
            None => o.push_str(&format!("  decisions NOT forced: {}\n", f.reason.as_deref().unwrap_or(""))),
        }
        if let Some(why) = &f.overrides_not_checked {
            o.push_str(&format!("  its own overrides NOT CHECKED: {why}\n"));
        }
        for d in &f.unforced {
            let labels: Vec<String> = d.labels.iter().map(|(l, n)| format!("{n} {l}")).collect();
            o.push_str(&format!(
                "  unforced: decision {} differs in {}/{} rows ({})\n",
                d.name,
                d.differing_rows,
                d.rows,
                labels.join(", ")
            ));
        }
    }
    if r.diffusion.is_some() {
        o.push_str(
            "  the prompt's encoder pass (the passes after it: \"block diffusion\" below):\n",
        );
    }
    match (
        &r.whole_run.first_diverging,
        &r.whole_run.first_bit_difference,
    ) {
        (None, _) => o.push_str(&format!("  whole run: {}\n", r.whole_run.verdict)),
        (Some(name), d) => {
            o.push_str(&format!(
                "  whole run: {}; first diverging {name}",
                r.whole_run.verdict
            ));
            if let Some(how) = r
                .whole_run
                .first_diverging_how
                .filter(|h| *h != How::Differs)
            {
                o.push_str(&format!(" ({})", how.words()));
            }
            // Under a policy the failure is its first violation; the first bit difference
            // (possibly rounding noise within the policy) follows, named as such.
            if let Some(v) = &r.whole_run.first_violation {
                o.push_str(&format!("; first outside the policy {}: {v}", v.tensor));
            }
            if let Some(d) = d {
                let what = if r.whole_run.first_violation.is_some() {
                    "first bit difference"
                } else {
                    "first differing element"
                };
                o.push_str(&format!(
                    "; {what} {}{:?}: {} vs {} ({} ULP; {}/{} elements differ)",
                    d.tensor,
                    d.coords,
                    d.reference_value,
                    d.candidate_value,
                    ulps(d.ulp),
                    thousands(d.differing_elements),
                    thousands(d.total_elements)
                ));
            }
            o.push('\n');
        }
    }
    for d in &r.whole_run.differing_decisions {
        let excused = if d.excused_rows > 0 {
            format!(
                " ({} excused: near-ties and rows after them)",
                d.excused_rows
            )
        } else {
            String::new()
        };
        o.push_str(&format!(
            "  whole run: decision {} differs in {}/{} rows{excused}\n",
            d.name,
            d.rows.min(d.differing_rows),
            d.rows
        ));
    }
    for f in &r.whole_run.findings {
        o.push_str(&format!("  whole run finding: {f}\n"));
    }
    let cal = r.calibration.is_some();
    let peers = r.outliers.checked;
    o.push_str(&format!(
        "\n  {:<5} {:<12} {:<9} {:>12} {:>11} {:>12} {:>11}{}{}\n",
        "layer",
        "status",
        "whole run",
        "isol max ULP",
        "isol rel L2",
        "whole max ULP",
        "whole rel L2",
        if cal {
            format!(" {:>11} {:>11}", "1-ULP rel L2", "whole/1-ULP")
        } else {
            String::new()
        },
        if peers { "  vs peers" } else { "" }
    ));
    for row in &r.layers {
        let vs = match (peers, row.isolation) {
            (false, _) => String::new(),
            (true, Isolated::Match) if row.status != LayerStatus::Inconsistent => format!(
                "  {:>8}{}",
                ratio(row.peer_ratio),
                if row.suspicious { " suspicious" } else { "" }
            ),
            (true, _) => format!("  {:>8}", "-"),
        };
        o.push_str(&format!(
            "  {:<5} {:<12} {:<9} {:>12} {:>11} {:>12} {:>11}{}{vs}\n",
            format!("{:02}", row.layer),
            row.status,
            row.whole_run,
            if row.isolation == Isolated::NotRun {
                "-".into()
            } else {
                ulps(row.isolated_max_ulp)
            },
            sci(row.isolated_rel_l2),
            ulps(row.whole_max_ulp),
            sci(row.whole_rel_l2),
            if cal {
                format!(
                    " {:>11} {:>11}",
                    sci(row.calibration_rel_l2),
                    ratio(row.whole_vs_calibration)
                )
            } else {
                String::new()
            }
        ));
    }
    if let Some(s) = &r.stage {
        o.push_str(&format!(
            "\n  first wrong stage in layer {:02}: {} — {}\n",
            s.layer,
            s.block.words(),
            s.detail
        ));
        if !s.matching.is_empty() {
            o.push_str(&format!(
                "    before it, matching in isolation: {}\n",
                s.matching.join(", ")
            ));
        }
        let row = &r.layers[s.layer];
        for t in row.isolated.iter().filter(|t| t.status.is_bad()) {
            o.push_str(&format!(
                "    {:<28} {:<14} {:>9}/{:<9} max {} ULP, rel L2 {}\n",
                t.tensor,
                t.status,
                thousands(t.differing_elements.unwrap_or(0)),
                thousands(t.total_elements),
                ulps(t.max_ulp),
                sci(t.rel_l2)
            ));
            // Outside the policy: which bound, so honest rounding blamed by one bound (a
            // scale error on a trained model, say) is seen without rerunning trace-diff.
            for v in &t.violations {
                o.push_str(&format!("      broke {}: {v}\n", v.bound));
            }
        }
    }
    for row in r.layers.iter().filter(|r| r.reason.is_some()).take(1) {
        o.push_str(&format!(
            "\n  layer {:02} NOT CHECKED: {}\n",
            row.layer,
            row.reason.as_deref().unwrap_or("")
        ));
    }
    o.push('\n');
    o.push_str(&self_consistency_lines(&r.self_consistency, &r.layers));
    o.push_str(&outlier_line(&r.outliers, &r.layers));
    if let Some(rr) = &r.rounding_response {
        o.push_str(&response_lines(rr));
    }
    if let Some(c) = &r.calibration {
        o.push_str(&format!(
            "\n  calibration: {} (input rel L2 {})\n",
            c.perturbation,
            sci(c.input_rel_l2)
        ));
        if let Some(row) = r.layers.get(c.from_layer) {
            if let Some(x) = row.isolated_vs_calibration {
                o.push_str(&format!(
                    "    in isolation, the candidate's layer {:02} hidden_out difference (rel L2 {}) is {} what a 1-ULP perturbation of its input produces ({})\n",
                    row.layer,
                    sci(row.isolated_rel_l2),
                    ratio(Some(x)),
                    sci(row.calibration_rel_l2)
                ));
            }
        }
        if let Some(row) = r
            .layers
            .iter()
            .rfind(|row| row.whole_vs_calibration.is_some())
        {
            o.push_str(&format!(
                "    in the whole run, the candidate's difference at layer {:02} is {} what a 1-ULP perturbation at layer {:02} grows to\n",
                row.layer,
                ratio(row.whole_vs_calibration),
                c.from_layer
            ));
        }
        if let Some(why) = &c.not_checked {
            o.push_str(&format!("    calibration NOT CHECKED: {why}\n"));
        }
    }
    if let Some(d) = &r.decode {
        o.push_str(&super::decode::render(d));
    }
    if let Some(d) = &r.diffusion {
        o.push_str(&super::diffusion::render(d));
    }
    o.push_str(&format!("\n  traces in {}\n", r.work_dir));
    o
}

pub(crate) fn self_consistency_lines(sc: &SelfConsistency, layers: &[LayerRow]) -> String {
    let mut o = String::new();
    let consistent: Vec<usize> = layers
        .iter()
        .filter(|r| r.self_check == SelfCheck::Consistent)
        .map(|r| r.layer)
        .collect();
    match (&sc.inconsistent, consistent.is_empty(), sc.scope) {
        (Some(i), _, _) => {
            o.push_str(&format!("  self-consistency: INCONSISTENT at layer {:02}: the candidate's layer verb on its own input: {} ({})\n", i.layer, i.detail, i.trace));
            if let Some(e) = &i.element {
                o.push_str(&format!("    {} {:?}: whole run {} vs layer verb {} ({} ULP)\n", e.which.as_str().replace('_', " "), e.coords, e.whole_run_value, e.layer_verb_value, ulps(e.ulp)));
            }
        }
        (None, true, Scope::FirstWrongLayer) if sc.not_checked.is_empty() => {
            o.push_str("  self-consistency: not run (checked only for a layer about to be blamed, or one whose agreeing input cannot explain its differing output; --all-layers checks every isolated layer)\n")
        }
        _ => {}
    }
    if !consistent.is_empty() {
        let which = if consistent.len() == 1 {
            "layer"
        } else {
            "layers"
        };
        o.push_str(&format!("  self-consistency: the candidate's layer verb on its own input agrees with its own whole run in {which} {}\n", span(&consistent)));
    }
    for why in &sc.not_checked {
        o.push_str(&format!("  self-consistency NOT CHECKED: {why}\n"));
    }
    o
}

pub(crate) fn outlier_line(out: &Outliers, layers: &[LayerRow]) -> String {
    if let Some(why) = &out.not_checked {
        return format!("  outliers NOT CHECKED: {why}\n");
    }
    if !out.suspicious.is_empty() {
        return format!("  outliers: {}\n", suspicious_words(layers, out));
    }
    let largest = match (out.largest_layer, out.largest_ratio) {
        (Some(l), Some(x)) => format!(" (largest: layer {l:02}, {})", ratio(Some(x))),
        _ => String::new(),
    };
    format!("  outliers: no layer's isolated error ({}) is above {}× its peers' median, of {} matching isolated layers{largest}\n", out.measure, out.factor, out.isolated_layers)
}

/// The rounding response: each layer's isolated error over its 1-ULP response, or why not.
fn response_lines(rr: &RoundingResponse) -> String {
    if let Some(why) = &rr.not_checked {
        return format!("  rounding response NOT CHECKED: {why}\n");
    }
    let each: Vec<String> = rr
        .rows
        .iter()
        .map(|r| format!("{:02} {}", r.layer, ratio(r.ratio)))
        .collect();
    let first = match rr.first_far_above {
        Some(l) => format!("; first above {}×: layer {l:02}", rr.factor),
        None => format!("; none above {}×", rr.factor),
    };
    format!(
        "  rounding response (block outputs' isolated error / the reference's response to one {} ULP at the layer's input, that layer alone): {}{first}\n",
        rr.precision,
        each.join(", ")
    )
}
