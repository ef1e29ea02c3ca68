//! The verdict and summary line from the whole-run comparison, the isolations, the forced run
//! and the self-consistency check, and the words for suspicious layers.

use super::*;

/// The differ's report on two whole traces, refused when they cannot be compared. An MoE
/// expert that routing sent other tokens is compared by the differ itself (status `rerouted`).
pub(crate) fn compare_whole(
    reference: &Trace,
    candidate: &Trace,
    opts: &Options,
) -> Result<Report> {
    let whole = compare(reference, candidate, opts);
    if matches!(whole.verdict, Verdict::Incomparable | Verdict::Unreadable) {
        let why: Vec<String> = whole.findings.iter().map(describe).collect();
        return Err(gerr!(
            Incomparable: "the whole traces cannot be compared ({:?}): {}",
            whole.verdict,
            why.join("; ")
        ));
    }
    Ok(whole)
}

/// The forced candidate run, checked: it must have run, recorded that it was forced from this
/// reference, and taken every decision the reference took. Else why not, in a line.
pub(crate) fn forced_run(
    o: &BisectOptions,
    reference: &Trace,
    rec: &RunRecord,
    rel: &str,
    opts: &Options,
) -> Result<(Report, Trace)> {
    if !rec.ok {
        let why = rec.why();
        let said: Vec<&str> = why
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect();
        return Err(
            gerr!(Producer: "the candidate's trace verb failed with --force-decisions (a producer need not implement it): {}", said.join(" | ")),
        );
    }
    let t = open(&o.root, rel)?;
    let digest = reference.digest().hex();
    if t.provenance()["forced_decisions"]["trace_digest"].as_str() != Some(digest.as_str()) {
        return Err(
            gerr!(Producer: "the candidate's trace does not record decisions forced from the reference (provenance forced_decisions.trace_digest)"),
        );
    }
    let rep = compare_whole(reference, &t, opts)?;
    let still: Vec<String> = rep
        .decisions
        .results
        .iter()
        .filter(|d| d.differing_rows > 0)
        .map(|d| format!("{} ({} rows)", d.name, d.differing_rows))
        .collect();
    if !still.is_empty() {
        return Err(gerr!(
            Producer: "the candidate's forced trace still takes other decisions: {}",
            still.join(", ")
        ));
    }
    Ok((rep, t))
}

/// The verdict on the forced runs, with the decisions said. The numbers agreeing once forced is
/// `nothing_wrong` only when no unforced flip is one trace-diff labels a defect; otherwise
/// `decisions_differ` (exit 1): the candidate decides otherwise on numbers that agree.
pub(crate) fn with_forcing(f: &DecisionsForced, (verdict, summary): Said) -> Said {
    let summary = summary.trim_end_matches([';', ' ']);
    let rows = |n: u64| format!("{n} row{}", if n == 1 { "" } else { "s" });
    let list: Vec<String> = f
        .unforced
        .iter()
        .map(|d| {
            let labels: Vec<String> = d.labels.iter().map(|(l, n)| format!("{n} {l}")).collect();
            format!(
                "{} {}/{} ({})",
                d.name,
                d.differing_rows,
                rows(d.rows),
                labels.join(", ")
            )
        })
        .collect();
    let unforced = format!(
        "unforced, the runs take other decisions: {}",
        list.join("; ")
    );
    if f.status != Forcing::Forced {
        return (
            verdict,
            format!(
                "{summary}; {unforced}; decisions NOT forced: {}",
                f.reason.as_deref().unwrap_or("")
            ),
        );
    }
    // Where the candidate, given the reference's decisions upstream, would itself decide
    // otherwise: the flips, without their consequences.
    let own: Vec<String> = f
        .overridden
        .as_ref()
        .and_then(|o| o.as_object())
        .map(|o| {
            o.iter()
                .map(|(name, n)| format!("{name} ({})", rows(n.as_u64().unwrap_or(0))))
                .collect()
        })
        .unwrap_or_default();
    let own = if own.is_empty() {
        String::new()
    } else {
        format!(
            "; given the reference's decisions the candidate would decide otherwise in {}",
            own.join(", ")
        )
    };
    let said = if verdict == BisectVerdict::NothingWrong
        && f.unforced
            .iter()
            .any(|d| d.labels.contains_key(&Label::Defect))
    {
        (BisectVerdict::DecisionsDiffer, format!("the numbers agree once decisions are forced, but the candidate decides otherwise where they do not explain it{own}; {unforced}"))
    } else {
        (
            verdict,
            format!("with decisions forced from the reference: {summary}{own}; {unforced}"),
        )
    };
    with_own_overrides(f, said)
}

/// A forced run's own overrides, judged row by row (overrides.rs), said after the verdict: rows
/// its own numbers do not explain make a clean verdict `decisions_differ`; overrides that could
/// not be judged make it NOT CHECKED, never nothing wrong; exact ties are said, not failed.
pub(crate) fn with_own_overrides(f: &DecisionsForced, (verdict, mut summary): Said) -> Said {
    if f.status != Forcing::Forced {
        return (verdict, summary);
    }
    if !f.overrides_ties.is_empty() {
        let ties: Vec<String> = f
            .overrides_ties
            .iter()
            .map(|(name, n)| format!("{name}: {n}"))
            .collect();
        summary.push_str(&format!(
            "; rows it would have decided otherwise where the scores tie exactly (said, not failed): {}",
            ties.join(", ")
        ));
    }
    if !f.overrides_near_ties.is_empty() {
        let near: Vec<String> = f
            .overrides_near_ties
            .iter()
            .map(|(name, n)| format!("{name}: {n}"))
            .collect();
        summary.push_str(&format!(
            "; rows it would have decided otherwise by its own scores, within the honest-noise bound of the reference's choice in the reference's scores (near-ties, said, not failed): {}",
            near.join(", ")
        ));
    }
    let not_checked = f
        .overrides_not_checked
        .as_ref()
        .map(|why| format!("the candidate's own overrides NOT CHECKED: {why}"));
    if !f.overrides_unexplained.is_empty() {
        let words = format!(
            "the candidate's own decisions differ on the reference's numbers, not explained by its own numbers: {}",
            overrides::unexplained_words(&f.overrides_unexplained, 3)
        );
        let tail = not_checked.map(|w| format!("; {w}")).unwrap_or_default();
        return match verdict {
            BisectVerdict::NothingWrong => {
                let rest = summary.strip_prefix("nothing wrong: ").unwrap_or(&summary);
                (
                    BisectVerdict::DecisionsDiffer,
                    format!("{words}; {rest}{tail}"),
                )
            }
            _ => (verdict, format!("{summary}; {words}{tail}")),
        };
    }
    match (verdict, not_checked) {
        (BisectVerdict::NothingWrong, Some(w)) => {
            (BisectVerdict::NotChecked, format!("{w}; {summary}"))
        }
        (_, Some(w)) => (verdict, format!("{summary}; {w}")),
        (_, None) => (verdict, summary),
    }
}

/// The verdict and summary from the layers' statuses and where the whole runs diverge;
/// `failed`: the layer whose layer verb failed, and why.
pub(crate) fn verdict(
    layers: &[LayerRow],
    located: &super::whole::Located,
    first_wrong: Option<usize>,
    stage: &Option<Stage>,
    amplification: Option<f64>,
    failed: &Option<(usize, String)>,
) -> Said {
    let (first, n, whole, structure) = (
        &located.first,
        located.n,
        &located.whole_run,
        &located.structure,
    );
    let with = |status: LayerStatus| -> Vec<usize> {
        layers
            .iter()
            .filter(|r| r.status == status)
            .map(|r| r.layer)
            .collect()
    };
    let (matched, inherits, downstream, wrong) = (
        layers
            .iter()
            .filter(|r| r.isolation == Isolated::Match && r.whole_run == WholeRunState::Match)
            .map(|r| r.layer)
            .collect::<Vec<_>>(),
        with(LayerStatus::Inherits),
        with(LayerStatus::Downstream),
        with(LayerStatus::Wrong),
    );
    let also_structure = structure
        .as_ref()
        .map(|s| format!("; the whole runs also differ in structure: {s}"))
        .unwrap_or_default();
    let mut tail = Vec::new();
    if !matched.is_empty() {
        tail.push(say(&matched, "matches in isolation", "match in isolation"));
    }
    let inconsistent = with(LayerStatus::Inconsistent);
    if !inconsistent.is_empty() {
        tail.push(say(
            &inconsistent,
            "has a layer verb that disagrees with its own whole run",
            "have layer verbs that disagree with their own whole runs",
        ));
    }
    if let (Some(l), Some(s)) = (first_wrong, stage) {
        let also: Vec<usize> = wrong.iter().copied().filter(|&w| w != l).collect();
        if !also.is_empty() {
            tail.push(say(
                &also,
                "is also wrong in isolation",
                "are also wrong in isolation",
            ));
        }
        if !inherits.is_empty() {
            tail.push(say(&inherits, "inherits", "inherit"));
        }
        if !downstream.is_empty() {
            tail.push(
                say(&downstream, "differs downstream", "differ downstream")
                    + " (not isolated; --all-layers checks whether they inherit)",
            );
        }
        return (
            BisectVerdict::WrongLayer,
            format!(
                "layer {l:02} body is wrong: {} [{}]; {}{also_structure}",
                s.detail,
                s.block.words(),
                tail.join("; ")
            ),
        );
    }
    let whole_same = matches!(
        whole.verdict,
        Verdict::Identical | Verdict::WithinPolicy | Verdict::NotChecked
    ) && structure.is_none();
    if let Some((at, why)) = failed {
        let div = match (first, structure) {
            (Some((_, name, how)), _) => {
                format!("the whole runs first diverge at {name} ({})", how.words())
            }
            (None, Some(s)) => format!("the whole runs differ in structure: {s}"),
            (None, None) if whole_same => {
                format!(
                    "the whole runs are {}",
                    whole.verdict.as_str().replace('_', " ")
                )
            }
            (None, None) => format!("the whole runs differ ({})", whole.verdict),
        };
        return (
            BisectVerdict::NotChecked,
            format!("isolation NOT CHECKED from layer {at:02}: {why}; {div}"),
        );
    }
    // The first divergence is structural, or only the structure differs: no value to bisect.
    if first
        .as_ref()
        .is_some_and(|(_, _, how)| *how != How::Differs)
        || (first.is_none() && !whole_same)
    {
        let iso = if tail.is_empty() {
            String::new()
        } else {
            format!("; {}", tail.join("; "))
        };
        // No tensor and no structure differs: what differs is a finding the differ states of
        // the runs' records (a decision's margins that contradict its own scores, say), named
        // as such rather than as a difference of structure it is not.
        let said = match (structure, whole.findings.first()) {
            (Some(s), _) => format!("the whole runs differ in structure, not only in values: {s}"),
            (None, Some(f)) => format!(
                "no tensor differs and no layer is to blame; the whole runs differ in what they record: {f}"
            ),
            (None, None) => format!(
                "the whole runs differ in structure, not only in values: verdict {}",
                whole.verdict
            ),
        };
        return (BisectVerdict::StructureDiffers, format!("{said}{iso}"));
    }
    match first {
        // Nothing judged differs, but what followed an excused near-tie was not judged: the
        // forced run compares it; without one it is no pass (docs/diff.md).
        None if whole.verdict == Verdict::NotChecked => {
            let at: Vec<String> = whole
                .differing_decisions
                .iter()
                .filter(|d| d.excused_rows > 0)
                .map(|d| format!("{} ({} excused rows)", d.name, d.excused_rows))
                .collect();
            (
                BisectVerdict::NotChecked,
                format!(
                    "NOT CHECKED past a near-tie: nothing judged differs, but what followed the near-tie(s) in {} was not judged; the candidate re-run with the reference's decisions forced (its --force-decisions) compares it{also_structure}",
                    at.join(", ")
                ),
            )
        }
        None => {
            let how = if whole.verdict == Verdict::WithinPolicy { "within policy" } else { "identical" };
            // Say so when no layer verb ran: nothing needed isolating, but nothing was isolated.
            let iso = if matched.is_empty() { "; no layer isolated (nothing diverged; --all-layers runs every layer's verb)".to_string() } else { format!("; {}", tail.join("; ")) };
            (BisectVerdict::NothingWrong, format!("nothing wrong: the whole runs are {how}{iso}"))
        }
        Some((loc, name, _)) if *loc < 0 => (BisectVerdict::OutsideLayers, format!("{name} differs before layer 00{}: the embedding is wrong (the layer verb does not isolate it)", broken(whole, name))),
        Some((loc, name, _)) if *loc as usize >= n => (
            BisectVerdict::OutsideLayers,
            format!("no layer differs in the whole run; the divergence starts at {name}{}, after the last layer (the head, which the layer verb does not isolate)", broken(whole, name)),
        ),
        Some(_) => {
            let iso_ulp = layers.iter().filter(|r| r.isolation == Isolated::Match).filter_map(|r| r.isolated_max_ulp).max().unwrap_or(0);
            let iso_rel = layers.iter().filter_map(|r| r.isolated_rel_l2).fold(0.0f64, f64::max);
            let amp = amplification.map(|a| format!(", amplification ×{a:.2} per layer")).unwrap_or_default();
            (
                BisectVerdict::Accumulates,
                format!(
                    "no layer body is wrong in isolation; the divergence accumulates: per-layer isolated error <= {} ULP (rel L2 <= {}){amp}; {}{also_structure}",
                    thousands(iso_ulp),
                    sci(Some(iso_rel)),
                    tail.join("; ")
                ),
            )
        }
    }
}

/// No layer body is blamed: the first layer about to be is one whose layer verb disagrees with
/// the candidate's own whole run, so its isolation would judge the probe, not the engine; or a
/// layer whose input agrees and whose output does not though its layer verb matches the
/// reference (`unexplained`, layers::unexplained): the whole run alone computes it otherwise.
pub(crate) fn inconsistent_verdict(
    i: &Inconsistency,
    layers: &[LayerRow],
    whole: &WholeRun,
    unexplained: Option<&super::layers::Unexplained>,
) -> Said {
    let element = i
        .element
        .as_ref()
        .map(|e| {
            let which = match e.which {
                Which::FirstDiffering => "first differing element",
                Which::WorstOutsidePolicy => "worst element outside the policy",
            };
            format!(
                "; {which} {:?}: whole run {} vs layer verb {} ({} ULP)",
                e.coords,
                e.whole_run_value,
                e.layer_verb_value,
                ulps(e.ulp)
            )
        })
        .unwrap_or_default();
    let others: Vec<usize> = layers
        .iter()
        .filter(|r| r.status == LayerStatus::Inconsistent && r.layer != i.layer)
        .map(|r| r.layer)
        .collect();
    let also = if others.is_empty() {
        String::new()
    } else {
        format!("; {}", say(&others, "disagrees too", "disagree too"))
    };
    // Found through a layer that could inherit nothing: its whole-run input agrees, its output
    // does not, and the layer verb on the reference's input matches the reference.
    let found = unexplained
        .filter(|u| u.layer == i.layer)
        .map(|u| {
            format!(
                "; layer {l:02}'s input agrees with the reference in the whole runs (hidden_in rel L2 {}) and its output does not (hidden_out rel L2 {}), while the layer verb on the reference's input matches the reference: a defect of the candidate's whole run only (a weight or setting it loads for layer {l:02} that its layer verb does not)",
                sci(u.input_rel_l2),
                sci(u.output_rel_l2),
                l = u.layer
            )
        })
        .unwrap_or_default();
    (
        BisectVerdict::InconsistentProducer,
        format!(
            "the layer verb disagrees with the whole run at layer {:02} (the candidate's layer verb on its own whole run's input): {}{element}{found}{also}; no layer body is blamed (isolation runs the layer verb, which here is not what the whole run computes); the whole runs are {}",
            i.layer,
            i.detail,
            whole.verdict.as_str().replace('_', " ")
        ),
    )
}

/// "layer 01 suspicious: isolated error 3.10× its peers' median (rel L2 of …; flagged above 2×; not a failure)".
pub(crate) fn suspicious_words(layers: &[LayerRow], out: &Outliers) -> String {
    let each: Vec<String> = out
        .suspicious
        .iter()
        .map(|&l| {
            let r = &layers[l];
            let how = r
                .peer_ratio
                .map(|x| format!("{} its peers' median", ratio(Some(x))))
                .unwrap_or_else(|| "above zero, its peers' median (bit-exact)".into());
            format!("layer {l:02} suspicious: isolated error {how}")
        })
        .collect();
    format!(
        "{} (rel L2 of {}; flagged above {}×; not a failure)",
        each.join("; "),
        out.measure,
        out.factor
    )
}

/// " (relative L2 0.2 > 0.0001)" when `name` is the whole run's first violation: under a
/// policy, the bound that puts it outside.
pub(crate) fn broken(whole: &WholeRun, name: &str) -> String {
    let v = whole.first_violation.as_ref().filter(|v| v.tensor == name);
    v.and_then(|v| v.violations.first())
        .map(|b| format!(" ({b})"))
        .unwrap_or_default()
}

/// A hang says nothing about the layers: the bisection cannot be judged, so it is refused.
pub(crate) fn refuse_timeout(runs: &[RunRecord], o: &BisectOptions) -> Result<()> {
    match runs.iter().find(|r| r.timed_out) {
        Some(r) => Err(gerr!(
            Producer: "{} {} timed out after {} s (--timeout) and was killed: $ {}",
            r.producer,
            r.verb,
            o.timeout.as_secs(),
            r.invocation
        )),
        None => Ok(()),
    }
}

/// A differ finding that states a difference of structure, not of values: the one
/// classification ../judge.rs gives (a signed zero, NaN or infinity is a value difference,
/// judged by its tensor's row; dtype and shape mismatches, rerouted experts and margins are
/// rows too, `rows`).
pub(crate) fn is_structure(kind: FindingKind) -> bool {
    judge::finding_class(kind) == judge::FindingClass::Structure
}

/// "kind name: detail", the name left out when the finding has none.
pub(crate) fn describe(f: &tracegate_diff::Finding) -> String {
    match f.tensor() {
        Some(t) => format!("{} {t}: {}", f.kind, f.detail),
        None => format!("{}: {}", f.kind, f.detail),
    }
}

/// Structure findings by kind, each with its count and first names: "42 missing_tensor
/// (layer.00.q, layer.00.k, layer.00.v, …)".
pub(crate) fn summarise(findings: &[&tracegate_diff::Finding]) -> Option<String> {
    let mut kinds: Vec<(FindingKind, Vec<&tracegate_diff::Finding>)> = Vec::new();
    for f in findings {
        match kinds.iter_mut().find(|(k, _)| *k == f.kind) {
            Some((_, v)) => v.push(f),
            None => kinds.push((f.kind, vec![f])),
        }
    }
    let parts: Vec<String> = kinds
        .iter()
        .map(|(kind, fs)| {
            let names: Vec<&str> = fs.iter().filter_map(|f| f.tensor()).collect();
            let shown: Vec<&str> = names.iter().copied().take(3).collect();
            let more = if names.len() > shown.len() {
                ", …"
            } else {
                ""
            };
            match (fs.len(), shown.is_empty()) {
                (1, true) => format!("{kind}: {}", fs[0].detail),
                (1, false) => format!("{kind} {}", shown[0]),
                (count, true) => format!("{count} {kind}"),
                (count, false) => format!("{count} {kind} ({}{more})", shown.join(", ")),
            }
        })
        .collect();
    (!parts.is_empty()).then(|| parts.join("; "))
}

/// What the rounding response adds to the verdict line: the first layer far above what the
/// candidate's precision rounds, where the policy blamed none or a later one; else, with every
/// ratio measured, that none is. Nothing when it was not checked (the text output says why).
pub(crate) fn response_words(
    rr: &RoundingResponse,
    verdict: BisectVerdict,
    first_wrong: Option<usize>,
) -> Option<String> {
    let unit = format!("one {} ULP at its input", rr.precision);
    let unmeasured: Vec<usize> = rr
        .rows
        .iter()
        .filter(|r| {
            r.tensors
                .iter()
                .any(|t| t.undefined == Some(Undefined::NotMeasured))
        })
        .map(|r| r.layer)
        .collect();
    let unmeasured = if unmeasured.is_empty() {
        String::new()
    } else {
        format!(
            "; rounding response NOT CHECKED at {}: a block output was not measured",
            say(&unmeasured, "", "").trim_end()
        )
    };
    match (rr.first_far_above, rr.ratio) {
        (Some(l), None) => Some(format!(
            "by rounding response it starts at layer {l:02}: the reference's layer does not move with {unit} where the candidate's differs (no ratio bounds it){unmeasured}"
        )),
        (Some(l), Some(x)) => {
            let worst = rr
                .rows
                .iter()
                .find(|r| r.layer == l)
                .and_then(|r| r.tensors.iter().find(|t| t.ratio == Some(x)));
            let (what, a, b) = (
                worst.map_or("", |t| t.tensor.as_str()),
                sci(worst.and_then(|t| t.isolated_rel_l2)),
                sci(worst.and_then(|t| t.response_rel_l2)),
            );
            let size = format!(
                "layer {l:02}'s isolated error ({what} rel L2 {a}) is {} what {unit} produces ({b}), the first layer above {}×",
                ratio(Some(x)),
                rr.factor
            );
            Some(match (verdict, first_wrong) {
                (BisectVerdict::WrongLayer, Some(w)) if w == l => {
                    format!("rounding response: {size}")
                }
                (BisectVerdict::WrongLayer, Some(w)) => format!(
                    "by rounding response it starts earlier, at layer {l:02}: {size}, before layer {w:02} where the policy first trips"
                ),
                (BisectVerdict::NothingWrong, _) => format!(
                    "rounding response: {size} (the whole runs are within the policy: an observation, not a failure)"
                ),
                _ => format!("by rounding response it starts at layer {l:02}: {size}"),
            })
        }
        _ if rr.not_checked.is_some() || rr.rows.is_empty() => None,
        _ => {
            let top = rr
                .rows
                .iter()
                .filter_map(|r| r.ratio.map(|x| (r.layer, x)))
                .max_by(|a, b| a.1.total_cmp(&b.1));
            let largest = top
                .map(|(l, x)| format!(" (largest {} at layer {l:02})", ratio(Some(x))))
                .unwrap_or_default();
            Some(format!(
                "rounding response: every isolated layer within {}× what {unit} produces{largest}{unmeasured}",
                rr.factor
            ))
        }
    }
}
