//! The human summary of a gate run. The JSON report is the serialised `MilestoneReport`.

use crate::milestone::check::Check;
use crate::milestone::run::{CheckResult, GateVerdict, MilestoneReport, Status};

/// Whose runs a report judges: a port milestone's are its candidate's (docs/gate.md, "Gate your
/// own engine"), the self-checks' the engine's.
fn whose_runs(r: &MilestoneReport) -> &'static str {
    if r.prompts
        .iter()
        .any(|p| p.digests.contains_key("candidate"))
    {
        "candidate"
    } else {
        "engine"
    }
}

/// The summary table: one row per prompt, one column per check, then failures and reasons.
pub fn render(r: &MilestoneReport) -> String {
    let mut out = String::new();
    out.push_str(&format!("gate {} — {}\n", r.milestone, r.claim));
    out.push_str(&format!(
        "model {} ({}){}, prompts {} (sha256 {}), generate {}, threads {}, policy {}\n\n",
        r.model,
        r.family,
        r.shards
            .as_ref()
            .map(|s| format!(" sharded {s}"))
            .unwrap_or_default(),
        r.prompt_file,
        &r.prompt_sha256[..16.min(r.prompt_sha256.len())],
        r.generate,
        r.threads,
        r.policy
    ));
    // The localisation first: the one line a failing porter needs, before the table and the
    // findings (a failing agrees can list hundreds of tensors).
    let localised: Vec<String> = r
        .prompts
        .iter()
        .filter_map(|p| Some(format!("{}: {}\n", p.id, p.localisation_line()?)))
        .collect();
    if !localised.is_empty() {
        out.push_str(&localised.concat());
        out.push('\n');
    }
    let checks: Vec<String> = r
        .prompts
        .first()
        .map(|p| p.checks.iter().map(|c| c.check.to_string()).collect())
        .unwrap_or_default();
    let mut header = format!("{:<10} {:>6}", "prompt", "tokens");
    for c in &checks {
        header.push_str(&format!(" {:<17}", c));
    }
    let whose = whose_runs(r);
    header.push_str(&format!(" {whose} digest"));
    out.push_str(&header);
    out.push('\n');
    for p in &r.prompts {
        let mut line = format!("{:<10} {:>6}", p.id, p.tokens);
        for c in &p.checks {
            line.push_str(&format!(" {:<17}", c.status));
        }
        line.push_str(&format!(
            " {}",
            p.digests.get(whose).map(|d| &d[..16]).unwrap_or("-")
        ));
        out.push_str(&line);
        out.push('\n');
    }
    out.push('\n');
    for p in &r.prompts {
        for c in &p.checks {
            match c.status {
                Status::Pass if c.excused.is_empty() => {}
                _ => {
                    out.push_str(&format!(
                        "{}/{} {}: {}\n",
                        p.id,
                        c.check,
                        c.status.as_str(),
                        c.detail
                    ));
                    for f in &c.findings {
                        out.push_str(&format!(
                            "    finding {} {} (count {}): {}\n",
                            f.kind, f.about.name, f.about.count, f.detail
                        ));
                    }
                    for f in &c.excused {
                        out.push_str(&format!(
                            "    declared {} {} (count {}): {}\n",
                            f.kind, f.about.name, f.about.count, f.detail
                        ));
                    }
                }
            }
        }
        for run in p.runs.iter().filter(|run| !run.ok) {
            out.push_str(&format!(
                "{}: {} crashed after {:.2}s: {}\n    $ {}\n",
                p.id,
                run.producer,
                run.seconds,
                run.why().replace('\n', "\n    "),
                run.invocation
            ));
        }
        for note in &p.observations {
            out.push_str(&format!("{}: observed: {note}\n", p.id));
        }
        if let Some(o) = &p.oracle {
            out.push_str(&format!(
                "{}: {} agreement — smallest margin {} ({}), worst max rel {} ({}), worst rel L2 {} ({}), near-ties excused: {}\n",
                p.id,
                if whose == "candidate" { "golden" } else { "oracle" },
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
        out.push_str(&format!(
            "{} {}: {}\n",
            b.check,
            b.status.as_str(),
            b.detail
        ));
        for f in &b.findings {
            out.push_str(&format!(
                "    finding {} {}: {}\n",
                f.kind, f.about.name, f.detail
            ));
        }
    }
    if !r.baselines_not_selected.is_empty() {
        out.push_str(&format!(
            "not selected (--only): baselines {}\n",
            r.baselines_not_selected.join(", ")
        ));
    }
    let n = |s: Status| r.totals.get(&s).copied().unwrap_or(0);
    out.push_str(&format!(
        "\n{} — {} PASS, {} FAIL, {} NOT CHECKED\n",
        r.verdict,
        n(Status::Pass),
        n(Status::Fail),
        n(Status::NotChecked)
    ));
    out
}

/// `gate m0|m1|run --html`: the report as one self-contained page (the diff's HTML primitives).
/// The milestone table links each check that did not pass to its findings; every number is tied
/// to its place in the JSON report (`data-json`, `data-v`: see tracegate_diff::html).
pub fn render_html(r: &MilestoneReport) -> String {
    use std::fmt::Write as _;
    use tracegate_diff::html::{esc, fmt_real, num_td, page, val};
    let mut h = String::new();
    let status_class = |s: Status| s.as_str().split(' ').next().unwrap_or("").to_string();
    let _ = write!(
        h,
        "<h1>gate {}: <span id=\"verdict\" class=\"s-{}\" data-json=\"/verdict\" data-v=\"&quot;{}&quot;\">{}</span></h1><p>{}</p>",
        esc(&r.milestone),
        match r.verdict {
            GateVerdict::Incomplete => "NOT",
            GateVerdict::Pass | GateVerdict::Fail => r.verdict.as_str(),
        },
        r.verdict,
        r.verdict,
        esc(&r.claim)
    );
    // The localisation at the top of the page, before the table and the findings.
    if r.prompts.iter().any(|p| p.localised.is_some()) {
        h.push_str("<h2>Localised</h2>");
        for (pi, p) in r.prompts.iter().enumerate() {
            let Some(l) = &p.localised else { continue };
            let layer = &l["first_wrong_layer"];
            let _ = write!(
                h,
                "<div class=\"box\" id=\"localised-{pi}\"><b>{}/agrees</b> localised by {}: {}<br>first wrong layer {}, stage <code>{}</code>{}{}</div>",
                esc(&p.id),
                esc(&crate::milestone::run::PromptResult::localised_by(l)),
                val("span", "text", &format!("/prompts/{pi}/localised/summary"), &l["summary"], l["summary"].as_str().unwrap_or("-")),
                val("span", "num", &format!("/prompts/{pi}/localised/first_wrong_layer"), layer, &layer.as_u64().map_or("-".into(), |n| n.to_string())),
                esc(l["stage"]["tensor"].as_str().unwrap_or("-")),
                l["report"].as_str().map(|r| format!("; its report: <code>{}</code>", esc(r))).unwrap_or_default(),
                crate::milestone::run::PromptResult::capsule_words(l).map(|c| format!("<br><span id=\"capsule-{pi}\">{}</span>", esc(&c))).unwrap_or_default(),
            );
        }
    }
    // A sharded milestone's report is one split of the model (m2: tp=2, ep=2): said beside the
    // model and on every row of the table.
    let split = r
        .shards
        .as_deref()
        .map(|s| val("code", "text", "/shards", s, s));
    let _ = write!(
        h,
        "<p>model <code>{}</code> ({}){}, prompts <code>{}</code>, generate {}, threads {}, timeout {} s, policy <code>{}</code>.</p>",
        esc(&r.model),
        esc(&r.family),
        split
            .as_ref()
            .map(|s| format!(", sharded <span id=\"split\">{s}</span>"))
            .unwrap_or_default(),
        esc(&r.prompt_file),
        val("span", "num", "/generate", &r.generate, &r.generate.to_string()),
        val("span", "num", "/threads", &r.threads, &r.threads.to_string()),
        val("span", "num", "/timeout_s", &r.timeout_s, &r.timeout_s.to_string()),
        esc(&r.policy)
    );
    let totals: Vec<String> = r
        .totals
        .iter()
        .map(|(k, n)| {
            format!(
                "{} {}",
                val("span", "num", &format!("/totals/{k}"), n, &n.to_string()),
                k
            )
        })
        .collect();
    let _ = write!(h, "<p id=\"totals\">{}</p>", totals.join(", "));

    // The milestone table: one row per prompt, one column per check (the first prompt's order).
    let mut checks: Vec<&Check> = Vec::new();
    for p in &r.prompts {
        for c in &p.checks {
            if !checks.contains(&&c.check) {
                checks.push(&c.check);
            }
        }
    }
    h.push_str("<h2>Checks</h2><table id=\"milestone-table\"><tr><th>prompt</th>");
    if split.is_some() {
        h.push_str("<th>split</th>");
    }
    h.push_str("<th>tokens</th>");
    for c in &checks {
        let _ = write!(h, "<th>{}</th>", esc(&c.to_string()));
    }
    let whose = whose_runs(r);
    let _ = write!(h, "<th>{whose} digest</th></tr>");
    for (pi, p) in r.prompts.iter().enumerate() {
        let _ = write!(
            h,
            "<tr data-prompt=\"{}\"><th>{}</th>{}{}",
            esc(&p.id),
            esc(&p.id),
            split
                .as_ref()
                .map(|s| format!("<td class=\"split\">{s}</td>"))
                .unwrap_or_default(),
            num_td(
                &format!("/prompts/{pi}/tokens"),
                &p.tokens,
                &p.tokens.to_string()
            )
        );
        for name in &checks {
            let Some((ci, c)) = p.checks.iter().enumerate().find(|(_, c)| c.check == **name) else {
                h.push_str("<td>-</td>");
                continue;
            };
            let shown = if c.status == Status::Pass && c.excused.is_empty() {
                esc(c.status.as_str())
            } else {
                format!(
                    "<a href=\"#finding-{pi}-{ci}\">{}</a>",
                    esc(c.status.as_str())
                )
            };
            let _ = write!(
                h,
                "<td class=\"check s-{}\" data-check=\"{}\" data-json=\"/prompts/{pi}/checks/{ci}/status\" data-v=\"&quot;{}&quot;\">{shown}</td>",
                status_class(c.status),
                esc(&c.check.to_string()),
                esc(c.status.as_str())
            );
        }
        let _ = write!(
            h,
            "<td class=\"mono\">{}</td></tr>",
            esc(p
                .digests
                .get(whose)
                .map(|d| &d[..16.min(d.len())])
                .unwrap_or("-"))
        );
    }
    h.push_str("</table>");

    h.push_str("<h2>Findings</h2>");
    let mut any = false;
    let findings_block = |h: &mut String, id: &str, title: &str, base: &str, c: &CheckResult| {
        let _ = write!(h, "<div class=\"box finding\" id=\"{id}\" data-check=\"{}\"><b>{title}</b> <span class=\"s-{}\">{}</span>: {}<ul>", esc(&c.check.to_string()), status_class(c.status), esc(c.status.as_str()), val("span", "text", &format!("{base}/detail"), &c.detail, &c.detail));
        for (kind, list) in [("finding", &c.findings), ("excused", &c.excused)] {
            for (i, f) in list.iter().enumerate() {
                let ptr = format!(
                    "{base}/{}/{i}/count",
                    if kind == "finding" {
                        "findings"
                    } else {
                        "excused"
                    }
                );
                let _ = write!(h, "<li class=\"{kind}\" data-kind=\"{}\" data-name=\"{}\">{kind} <b>{}</b> <code>{}</code> (count {}): {}</li>", f.kind, esc(&f.about.name), f.kind, esc(&f.about.name), val("span", "num", &ptr, &f.about.count, &f.about.count.to_string()), val("span", "text", &ptr.replace("/count", "/detail"), &f.detail, &f.detail));
            }
        }
        h.push_str("</ul></div>");
    };
    for (pi, p) in r.prompts.iter().enumerate() {
        for (ci, c) in p
            .checks
            .iter()
            .enumerate()
            .filter(|(_, c)| c.status != Status::Pass || !c.excused.is_empty())
        {
            any = true;
            findings_block(
                &mut h,
                &format!("finding-{pi}-{ci}"),
                &format!("{}/{}", esc(&p.id), esc(&c.check.to_string())),
                &format!("/prompts/{pi}/checks/{ci}"),
                c,
            );
        }
        for (ri, run) in p.runs.iter().enumerate().filter(|(_, run)| !run.ok) {
            any = true;
            let _ = write!(
                h,
                "<div class=\"box\" id=\"run-{pi}-{ri}\"><b>{}</b>: {} crashed after {} s: <pre>{}</pre><code>$ {}</code></div>",
                esc(&p.id),
                esc(&run.producer),
                val("span", "num", &format!("/prompts/{pi}/runs/{ri}/seconds"), &run.seconds, &fmt_real(Some(run.seconds))),
                esc(&run.why()),
                esc(&run.invocation)
            );
        }
    }
    if !any {
        h.push_str("<p>Every check of every prompt passed.</p>");
    }

    // A sharded port: how each run's rank traces were merged (or why they were refused).
    if r.prompts.iter().any(|p| !p.sharded.is_empty()) {
        h.push_str("<h2>Rank traces merged</h2>");
        for (pi, p) in r.prompts.iter().enumerate() {
            for (role, line) in p.sharded.keys().zip(p.sharded_lines()) {
                let _ = write!(
                    h,
                    "<div class=\"box\" id=\"sharded-{pi}-{}\"><b>{}</b>: {}</div>",
                    esc(role),
                    esc(&p.id),
                    esc(&line)
                );
            }
        }
    }
    if whose == "candidate" {
        h.push_str("<h2>Agreement with the golden traces</h2>");
    } else {
        h.push_str("<h2>Oracle agreement</h2>");
    }
    for (pi, p) in r.prompts.iter().enumerate() {
        let Some(o) = &p.oracle else {
            let _ = write!(h, "<p>{}: no oracle summary (the oracle did not run or its trace was unreadable).</p>", esc(&p.id));
            continue;
        };
        let b = format!("/prompts/{pi}/oracle");
        let _ = write!(
            h,
            "<div class=\"box\" id=\"oracle-{pi}\"><b>{}</b>: smallest margin {} at <code>{}</code>; worst max rel {} (<code>{}</code>); worst relative L2 {} (<code>{}</code>); near-ties excused: {} ({} rows after them not judged).",
            esc(&p.id),
            val("span", "num", &format!("{b}/smallest_margin"), &o.smallest_margin, &fmt_real(o.smallest_margin)),
            esc(o.smallest_margin_at.as_deref().unwrap_or("-")),
            val("span", "num", &format!("{b}/worst_max_rel"), &o.worst_max_rel, &fmt_real(o.worst_max_rel)),
            esc(o.worst_max_rel_tensor.as_deref().unwrap_or("-")),
            val("span", "num", &format!("{b}/worst_rel_l2"), &o.worst_rel_l2, &fmt_real(o.worst_rel_l2)),
            esc(o.worst_rel_l2_tensor.as_deref().unwrap_or("-")),
            if o.near_ties.is_empty() { "none".to_string() } else { esc(&o.near_ties.join(", ")) },
            val("span", "num", &format!("{b}/rows_after_near_tie"), &o.rows_after_near_tie, &o.rows_after_near_tie.to_string()),
        );
        if let Some(v) = &o.first_violation {
            let _ = write!(h, "<div class=\"first-violation\" id=\"first-violation-{pi}\" data-tensor=\"{}\">first violation: <code>{}</code><ul>", esc(&v.tensor), esc(&v.tensor));
            for (i, x) in v.violations.iter().enumerate() {
                let q = format!("{b}/first_violation/violations/{i}");
                let show = |a: &tracegate_diff::Amount| match a {
                    tracegate_diff::Amount::Count(n) => n.to_string(),
                    tracegate_diff::Amount::Real(r) => fmt_real(Some(r.0)),
                };
                let _ = write!(
                    h,
                    "<li data-bound=\"{}\">{}: value {} vs limit {}</li>",
                    esc(x.bound),
                    esc(x.bound),
                    val(
                        "span",
                        "num",
                        &format!("{q}/value"),
                        &x.value,
                        &x.value.as_ref().map_or("undefined".into(), show)
                    ),
                    val(
                        "span",
                        "num",
                        &format!("{q}/limit"),
                        &x.limit,
                        &show(&x.limit)
                    )
                );
            }
            h.push_str("</ul></div>");
        }
        h.push_str("</div>");
    }

    h.push_str("<h2>Baselines</h2><table id=\"baselines\"><tr><th>baseline</th><th>status</th><th>observation</th><th>recorded</th><th>now</th><th>delta</th><th>detail</th></tr>");
    for (bi, c) in r.baselines.iter().enumerate() {
        let status = if c.status == Status::Pass {
            esc(c.status.as_str())
        } else {
            format!("<a href=\"#baseline-{bi}\">{}</a>", esc(c.status.as_str()))
        };
        let span = c.observed.len().max(1);
        let _ = write!(
            h,
            "<tr data-baseline=\"{}\"><td rowspan=\"{span}\" class=\"mono\">{}</td><td rowspan=\"{span}\" class=\"check s-{}\" data-json=\"/baselines/{bi}/status\" data-v=\"&quot;{}&quot;\">{status}</td>",
            esc(&c.check.to_string()),
            esc(&c.check.to_string()),
            status_class(c.status),
            esc(c.status.as_str())
        );
        if c.observed.is_empty() {
            let _ = write!(
                h,
                "<td colspan=\"4\">none recorded</td><td rowspan=\"{span}\">{}</td></tr>",
                val(
                    "span",
                    "text",
                    &format!("/baselines/{bi}/detail"),
                    &c.detail,
                    &c.detail
                )
            );
        }
        for (oi, o) in c.observed.iter().enumerate() {
            let p = |f: &str| format!("/baselines/{bi}/observed/{oi}/{f}");
            if oi > 0 {
                h.push_str("<tr>");
            }
            let _ = write!(
                h,
                "<td class=\"mono\">{}</td>{}{}{}",
                esc(&o.key),
                num_td(&p("baseline"), &o.baseline, &fmt_real(Some(o.baseline))),
                num_td(&p("now"), &o.now, &fmt_real(Some(o.now))),
                num_td(&p("delta"), &o.delta, &format!("{:+.1}%", o.delta * 100.0)),
            );
            if oi == 0 {
                let _ = write!(
                    h,
                    "<td rowspan=\"{span}\">{}</td>",
                    val(
                        "span",
                        "text",
                        &format!("/baselines/{bi}/detail"),
                        &c.detail,
                        &c.detail
                    )
                );
            }
            h.push_str("</tr>");
        }
    }
    h.push_str("</table>");
    for (bi, c) in r
        .baselines
        .iter()
        .enumerate()
        .filter(|(_, c)| c.status != Status::Pass)
    {
        findings_block(
            &mut h,
            &format!("baseline-{bi}"),
            &esc(&c.check.to_string()),
            &format!("/baselines/{bi}"),
            c,
        );
    }
    if !r.baselines_not_selected.is_empty() {
        let _ = write!(
            h,
            "<p class=\"note\">not selected (--only): baselines {}</p>",
            esc(&r.baselines_not_selected.join(", "))
        );
    }
    page(&format!("gate {} {}", r.milestone, r.verdict), &h)
}
