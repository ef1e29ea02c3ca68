//! The human summary of a gate run. The JSON report is the serialised `MilestoneReport`.

use crate::run::{MilestoneReport, Status};

fn cell(status: Status) -> &'static str {
    status.label()
}

/// The summary table: one row per prompt, one column per check, then failures and reasons.
pub fn render(r: &MilestoneReport) -> String {
    let mut out = String::new();
    out.push_str(&format!("gate {} — {}\n", r.milestone, r.claim));
    out.push_str(&format!(
        "model {} ({}), prompts {} (sha256 {}), generate {}, threads {}, policy {}\n\n",
        r.model,
        r.family,
        r.prompt_file,
        &r.prompt_sha256[..16.min(r.prompt_sha256.len())],
        r.generate,
        r.threads,
        r.policy
    ));
    let checks: Vec<String> = r.prompts.first().map(|p| p.checks.iter().map(|c| c.check.clone()).collect()).unwrap_or_default();
    let mut header = format!("{:<10} {:>6}", "prompt", "tokens");
    for c in &checks {
        header.push_str(&format!(" {:<17}", c));
    }
    header.push_str(" engine digest");
    out.push_str(&header);
    out.push('\n');
    for p in &r.prompts {
        let mut line = format!("{:<10} {:>6}", p.id, p.tokens);
        for c in &p.checks {
            line.push_str(&format!(" {:<17}", cell(c.status)));
        }
        line.push_str(&format!(" {}", p.digests.get("engine").map(|d| &d[..16]).unwrap_or("-")));
        out.push_str(&line);
        out.push('\n');
    }
    out.push('\n');
    for p in &r.prompts {
        for c in &p.checks {
            match c.status {
                Status::Pass if c.excused.is_empty() => {}
                _ => {
                    out.push_str(&format!("{}/{} {}: {}\n", p.id, c.check, c.status.label(), c.detail));
                    for f in &c.findings {
                        out.push_str(&format!("    finding {} {} (count {}): {}\n", f.kind, f.name, f.count, f.detail));
                    }
                    for f in &c.excused {
                        out.push_str(&format!("    declared {} {} (count {}): {}\n", f.kind, f.name, f.count, f.detail));
                    }
                }
            }
        }
        for run in p.runs.iter().filter(|run| !run.ok) {
            out.push_str(&format!("{}: {} crashed after {:.2}s: {}\n    $ {}\n", p.id, run.producer, run.seconds, run.why().replace('\n', "\n    "), run.invocation));
        }
        if let Some(o) = &p.oracle {
            out.push_str(&format!(
                "{}: oracle agreement — smallest margin {} ({}), worst max rel {} ({}), worst rel L2 {} ({}), near-ties excused: {}\n",
                p.id,
                o.smallest_margin.map(|v| format!("{v:.3e}")).unwrap_or("n/a".into()),
                o.smallest_margin_at.clone().unwrap_or_default(),
                o.worst_max_rel.map(|v| format!("{v:.2e}")).unwrap_or("n/a".into()),
                o.worst_max_rel_tensor.clone().unwrap_or_default(),
                o.worst_rel_l2.map(|v| format!("{v:.2e}")).unwrap_or("n/a".into()),
                o.worst_rel_l2_tensor.clone().unwrap_or_default(),
                if o.near_ties.is_empty() { "none".into() } else { format!("{} ({} rows after them not judged)", o.near_ties.join(", "), o.rows_after_near_tie) }
            ));
        }
    }
    for b in &r.baselines {
        out.push_str(&format!("{} {}: {}\n", b.check, b.status.label(), b.detail));
        for f in &b.findings {
            out.push_str(&format!("    finding {} {}: {}\n", f.kind, f.name, f.detail));
        }
    }
    if !r.baselines_not_selected.is_empty() {
        out.push_str(&format!("not selected (--only): baselines {}\n", r.baselines_not_selected.join(", ")));
    }
    let n = |k: &str| r.totals.get(k).copied().unwrap_or(0);
    out.push_str(&format!(
        "\n{} — {} PASS, {} FAIL, {} NOT CHECKED\n",
        r.verdict,
        n("PASS"),
        n("FAIL"),
        n("NOT CHECKED")
    ));
    out
}
