//! The checks against the oracle: agrees (engine ≈ oracle under the policy, decisions exact)
//! and generation_oracle (greedy tokens equal), with the summary of how close they came.

use tracegate_diff::{label_text, Label, Options, Policy, RowStatus, Verdict};
use tracegate_trace::Trace;

use super::findings::{
    diff_findings, incomparable, judge, not_comparable, policy_kind, tokens_finding,
};
use super::report::{finding, CheckResult, Finding, OracleSummary, Status};
use super::traces::{decode_tokens, Traces};
use crate::milestone::check::{Check, FindingKind};
use crate::milestone::milestones::{Expectation, MilestoneModel};
use crate::prompts::Prompt;

/// agrees and generation_oracle, in that order, and the summary when the oracle's trace was read.
pub(super) fn check_oracle(
    m: &MilestoneModel,
    p: &Prompt,
    traces: &Traces,
    policy: &Policy,
    expect: std::result::Result<&Expectation, &str>,
) -> (Vec<CheckResult>, Option<OracleSummary>) {
    match (&traces.engine, &traces.oracle) {
        (Ok(e), Ok(r)) => {
            let recorded = expect.ok().map(|e| e.oracle_decisions_differing);
            let (agrees, summary) =
                compare_agrees(Check::Agrees, m, p, e, r, policy, None, recorded);
            let (a, b) = (decode_tokens(e), decode_tokens(r));
            let found: Vec<Finding> = tokens_finding("engine", "oracle", &a, &b)
                .into_iter()
                .collect();
            let generation = if a.is_empty() {
                CheckResult::not_checked(
                    Check::GenerationOracle,
                    "no tokens generated (--generate 0)",
                )
            } else if let refused @ [_, ..] = &incomparable("engine", &[("oracle", e, r)])[..] {
                not_comparable(Check::GenerationOracle, refused.to_vec())
            } else {
                let detail = if crate::prompts::samples(&m.family) {
                    format!(
                        "{} committed tokens equal to the oracle's, which was forced by the engine's canvases, draws and stops ({} decision rows it would have taken otherwise)",
                        a.len(),
                        overridden(r)
                    )
                } else {
                    format!(
                        "{} greedy tokens equal to the oracle's (its own KV cache)",
                        a.len()
                    )
                };
                judge(
                    m,
                    &p.id,
                    CheckResult::new(Check::GenerationOracle, Status::Pass, detail),
                    found,
                )
            };
            (vec![agrees, generation], Some(summary))
        }
        (Err(why), _) | (Ok(_), Err(why)) => {
            // An engine that failed, or an oracle that ran and failed, fails both; an oracle
            // that could not run leaves them NOT CHECKED.
            let status = match (&traces.engine, &traces.oracle) {
                (Ok(_), Err(crate::Error::Unavailable(_))) => Status::NotChecked,
                _ => Status::Fail,
            };
            let both = [Check::Agrees, Check::GenerationOracle]
                .map(|check| CheckResult::new(check, status, why.to_string()));
            (both.into(), None)
        }
    }
}

/// The decision rows a forced trace's producer would have taken otherwise (provenance
/// `forced_decisions.rows_overridden`, docs/producers.md), as a word.
fn overridden(t: &Trace) -> String {
    t.provenance()
        .pointer("/forced_decisions/rows_overridden")
        .and_then(serde_json::Value::as_u64)
        .map_or_else(|| "not recorded".to_string(), |n| n.to_string())
}

/// `eng` (the reference: the engine, a port's golden trace or its uncached run) against `ora`
/// (the oracle, or the port's candidate) under `policy`, as `check` (`agrees`; a port's
/// `generation`); `recorded`: the decisions recorded as differing, so a different number is a
/// finding even when each is declared.
#[allow(clippy::too_many_arguments)]
pub(super) fn compare_agrees(
    check: Check,
    m: &MilestoneModel,
    p: &Prompt,
    eng: &Trace,
    ora: &Trace,
    policy: &Policy,
    noise: Option<&std::sync::Arc<Trace>>,
    recorded: Option<usize>,
) -> (CheckResult, OracleSummary) {
    let rep = tracegate_diff::compare(
        eng,
        ora,
        &Options {
            policy: Some(policy.clone()),
            noise: noise.map(|n| tracegate_diff::NoiseReference(n.clone())),
            ..Options::default()
        },
    );
    let mut found = diff_findings(&rep);
    // A value finding (a signed zero, NaN, infinity) on a tensor the differ judged agreeing is
    // what kind of difference the row is, not a failure: the one classification bisect uses
    // (bisect/judge.rs), so a pair trace-diff calls within policy agrees here too.
    found.retain(|f| {
        f.kind.differ().map(crate::bisect::judge::finding_class)
            != Some(crate::bisect::judge::FindingClass::Values)
            || !rep
                .per_tensor
                .iter()
                .any(|r| r.tensor == f.about.name && r.status.agrees())
    });
    for row in &rep.per_tensor {
        if let Some(kind) = policy_kind(row.status) {
            // Already reported as a diff finding when the differ emits one; keep one entry per tensor.
            if !found.iter().any(|f| f.about.name == row.tensor) {
                let detail = row.violation().map_or_else(
                    || "no rule in the policy matches this tensor".to_string(),
                    |v| v.to_string(),
                );
                found.push(finding(kind, row.tensor.clone(), 1, detail));
            }
        }
    }
    // The differ's labels: a near-tie and the rows after it are reported, not failed; each
    // decision with a consequence or defect is a finding counting those rows.
    let mut near_ties = Vec::new();
    for r in rep
        .decisions
        .results
        .iter()
        .filter(|r| r.differing_rows > 0)
    {
        near_ties.extend(
            r.flips
                .iter()
                .filter(|f| f.label == Label::NearTie)
                .map(|f| format!("{}[{}]", r.name, f.row)),
        );
        let failing = r.flips.iter().filter(|f| !f.excused()).count() as u64;
        if failing > 0 {
            let labels: Vec<String> = r
                .flips
                .iter()
                .map(|f| {
                    format!(
                        "row {} {:?}→{:?} {}",
                        f.row,
                        f.reference,
                        f.candidate,
                        label_text(f)
                    )
                })
                .collect();
            found.push(finding(
                FindingKind::DecisionDiffers,
                r.name.clone(),
                failing,
                labels.join("; "),
            ));
        }
    }
    let rows_after_near_tie = rep
        .decisions
        .near_ties
        .as_ref()
        .map_or(0, |n| n.rows_after());
    // Smallest margin among the engine's decisions; worst numeric divergences.
    let mut smallest: Option<(f64, String)> = None;
    // A sampler's margins are probabilities, nats to a bound or whole steps, not distances to
    // a flip (docs/capture-points.md, "Diffusion Gemma").
    let sampler = |name: &str| {
        tracegate_trace::names::point(name)
            .is_some_and(|p| p.block == tracegate_trace::names::Block::Sampler)
    };
    for d in eng.decisions().iter().filter(|d| !sampler(&d.name)) {
        if let Some(ms) = eng.decision_margins(d) {
            for (row, m) in ms.iter().enumerate() {
                let m = *m as f64;
                if smallest.as_ref().is_none_or(|(s, _)| m < *s) {
                    smallest = Some((m, format!("{}[{row}]", d.name)));
                }
            }
        }
    }
    // The tensors judged: one after a near-tie ran on another sequence.
    let judged: Vec<&tracegate_diff::TensorRow> = rep
        .per_tensor
        .iter()
        .filter(|r| {
            !matches!(
                r.status,
                RowStatus::AfterNearTie | RowStatus::AfterSamplingDivergence
            )
        })
        .collect();
    let worst = |f: fn(&tracegate_diff::TensorRow) -> Option<f64>| {
        judged
            .iter()
            .filter_map(|r| f(r).map(|v| (v, r.tensor.clone())))
            .fold(None, |acc: Option<(f64, String)>, x| match acc {
                Some(a) if a.0 >= x.0 => Some(a),
                _ => Some(x),
            })
    };
    let max_rel = worst(|r| r.max_rel.map(|x| x.0));
    let rel_l2 = worst(|r| r.rel_l2.map(|x| x.0));
    let summary = OracleSummary {
        smallest_margin: smallest.as_ref().map(|s| s.0),
        smallest_margin_at: smallest.map(|s| s.1),
        worst_max_rel: max_rel.as_ref().map(|x| x.0),
        worst_max_rel_tensor: max_rel.map(|x| x.1),
        worst_rel_l2: rel_l2.as_ref().map(|x| x.0),
        worst_rel_l2_tensor: rel_l2.map(|x| x.1),
        near_ties,
        rows_after_near_tie,
        first_violation: rep.first_violation(),
    };
    let mut detail = format!(
        "{} under policy {}: {} tensors judged, {}/{} decisions differ; smallest margin {} at {}; worst rel L2 {} ({})",
        match rep.verdict {
            Verdict::Identical => "IDENTICAL",
            Verdict::WithinPolicy => "WITHIN POLICY",
            Verdict::Incomparable => "INCOMPARABLE",
            Verdict::NotChecked => "NOT CHECKED past a near-tie",
            _ => "DIFFERENT",
        },
        policy.name,
        judged.len(),
        rep.decisions.differing,
        rep.decisions.compared,
        summary.smallest_margin.map(|v| format!("{v:.3e}")).unwrap_or("n/a".into()),
        summary.smallest_margin_at.clone().unwrap_or_default(),
        summary.worst_rel_l2.map(|v| format!("{v:.2e}")).unwrap_or("n/a".into()),
        summary.worst_rel_l2_tensor.clone().unwrap_or_default(),
    );
    if !summary.near_ties.is_empty() {
        detail.push_str(&format!(
            "; {} near-tie(s) excused ({}), {} row(s) after them not judged",
            summary.near_ties.len(),
            summary.near_ties.join(", "),
            summary.rows_after_near_tie
        ));
    }
    // The policy failure is named by its first violation: the first bit difference may be
    // rounding noise within the policy.
    if let Some(v) = &summary.first_violation {
        let outside = rep
            .per_tensor
            .iter()
            .filter(|r| r.status == RowStatus::OutsidePolicy)
            .count();
        let first = v
            .violations
            .first()
            .map(|b| b.to_string())
            .unwrap_or_default();
        detail.push_str(&format!(
            "; {outside} tensor(s) outside the policy, first {}: {first}",
            v.tensor
        ));
    }
    if !matches!(
        rep.verdict,
        Verdict::Identical | Verdict::WithinPolicy | Verdict::NotChecked
    ) && found.is_empty()
    {
        found.push(finding(
            FindingKind::Different,
            "",
            1,
            format!("verdict {:?}", rep.verdict),
        ));
    }
    // Declared oracle divergences are recorded by count: a different number of differing
    // decisions is a change even when each one is declared.
    if let Some(recorded) = recorded {
        let have = found
            .iter()
            .filter(|f| f.kind == FindingKind::DecisionDiffers)
            .count();
        if have != recorded {
            found.push(finding(
                FindingKind::CountChanged,
                "oracle_decisions_differing",
                have as u64,
                format!("oracle_decisions_differing: recorded {recorded}, now {have}"),
            ));
        }
    }
    // Nothing judged failed, but what followed an excused near-tie was not judged: never a
    // pass (docs/diff.md, "Near-ties under a policy"); a finding still fails it.
    let status = if rep.verdict == Verdict::NotChecked {
        detail.push_str(
            "; what follows the near-tie is compared only with the reference's decisions forced",
        );
        Status::NotChecked
    } else {
        Status::Pass
    };
    let mut result = judge(m, &p.id, CheckResult::new(check, status, detail), found);
    if result.status == Status::NotChecked && !result.findings.is_empty() {
        result.status = Status::Fail;
    }
    (result, summary)
}

#[cfg(test)]
mod tests {
    //! `agrees` classifies a finding as trace-diff and bisect do (bisect::judge::finding_class):
    //! a candidate (the oracle's trace here, written as an adversary would, with TraceWriter)
    //! that differs from the engine in one element of embed.out.
    use super::*;
    use serde_json::json;
    use tracegate_trace::{Attributes, DType, TraceWriter};

    fn write(path: &std::path::Path, producer: serde_json::Value, first: f32) -> Trace {
        let mut w = TraceWriter::create(path, producer).unwrap();
        let attrs = Attributes::default()
            .with_path("prefill")
            .with_mask("causal")
            .with_positions(vec![0, 1]);
        let embed: Vec<u8> = [first, 0.5, -0.25, 1.0]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        w.tensor("embed.out", DType::F32, &[2, 2], &embed, &attrs)
            .unwrap();
        let logits: Vec<u8> = [2.0f32, 0.0, -1.0, -1.0, 0.0, 3.0]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        w.tensor("logits", DType::F32, &[2, 3], &logits, &attrs)
            .unwrap();
        w.decision("logits.argmax", &[2], &[0, 2], Some(&[2.0, 3.0]))
            .unwrap();
        w.finish().unwrap();
        Trace::open(path).unwrap()
    }

    fn agrees(oracle_first: f32) -> CheckResult {
        let dir = tempfile::tempdir().unwrap();
        let tokens = json!([1, 2]);
        let engine = json!({"producer": "engine", "versions": {"tracegate": "0.1.0"}, "dtype": "f32",
            "device": "cpu", "weights_digest": "w-1", "prompt_tokens": tokens});
        let oracle = json!({"producer": "oracle", "dtype": "float32", "device": "cpu",
            "versions": {"torch": "2.5.1", "transformers": "4.47.0", "numpy": "2.1.3"},
            "attn_implementation": "eager", "weights_digest": "w-1", "prompt_tokens": tokens});
        let e = write(&dir.path().join("e.trace"), engine, 0.0);
        let o = write(&dir.path().join("o.trace"), oracle, oracle_first);
        let m: MilestoneModel =
            serde_json::from_value(json!({"model": "m", "family": "qwen3"})).unwrap();
        let p = Prompt {
            id: "p".into(),
            tokens: vec![1, 2],
            text: None,
        };
        let policy = Policy::load(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../fixtures/policy/oracle-default.json"),
        )
        .unwrap();
        compare_agrees(Check::Agrees, &m, &p, &e, &o, &policy, None, None).0
    }

    #[test]
    fn a_signed_zero_within_the_policy_agrees_and_a_nan_or_infinity_fails() {
        // The control first: the same bits agree.
        assert_eq!(agrees(0.0).status, Status::Pass);
        // -0 against +0 is 0 ULP: trace-diff calls the row within policy, and so does agrees
        // (a signed_zero finding on an agreeing row says what kind of difference it is).
        let signed = agrees(-0.0);
        assert_eq!(signed.status, Status::Pass, "{:?}", signed.findings);
        for (what, v) in [("NaN", f32::NAN), ("+inf", f32::INFINITY)] {
            let r = agrees(v);
            assert_eq!(r.status, Status::Fail, "{what}: {}", r.detail);
            assert!(
                r.findings.iter().any(|f| f.about.name == "embed.out"),
                "{what}: {:?}",
                r.findings
            );
        }
    }
}
