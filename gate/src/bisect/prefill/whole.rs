//! The whole-run phases of a bisection: both producers' whole traces, the judge, the candidate
//! forced to take the reference's decisions, and where the whole runs first diverge.

use super::*;
use crate::bisect::work::candidate_trace;

/// Both producers' whole traces and where they are, relative to the root.
pub(crate) struct Whole {
    pub reference: Trace,
    pub candidate: Trace,
    pub ref_rel: String,
    pub cand_rel: String,
    /// `--ranks N`: the candidate's rank traces, merged into `candidate`.
    pub sharded: Option<crate::ranks::ShardedRun>,
}

/// The whole runs, or (`--ranks N`) the candidate's rank traces refused by the merge: the
/// bisection's finding (../sharded.rs), with the reference's trace when it ran.
#[allow(clippy::large_enum_variant)] // one per bisection, moved once
pub(crate) enum Wholes {
    Both(Whole),
    RanksRefused(crate::ranks::ShardedRun, Trace),
}

/// The `trace` verb of a whole run of the prompt at `out`; `force`: the trace whose decisions
/// it takes.
pub(crate) fn trace_verb(o: &BisectOptions, out: &str, force: Option<String>) -> Verb {
    Verb::Trace {
        model: o.model.clone(),
        tokens: o.tokens.clone(),
        out: out.into(),
        internals: o.internals,
        generate: o.generate,
        cache: true,
        force,
        seed: o.sampling.then_some(o.sampler_seed),
        shards: None,
    }
}

/// The candidate's whole trace at `out` (sharded under `--ranks`: ../work.rs, ../sharded.rs).
pub(crate) fn candidate_run(
    o: &BisectOptions,
    out: &str,
    force: Option<String>,
) -> (RunRecord, Option<crate::ranks::ShardedRun>) {
    candidate_trace(o, &trace_verb(o, out, force))
}

fn failed(side: &str, rec: &RunRecord) -> crate::Error {
    gerr!(
        Producer: "{side} ({}) trace failed: {}\n    $ {}",
        rec.producer,
        rec.why(),
        rec.invocation
    )
}

/// Both whole runs at once (one is usually a subprocess), or the candidate's beside a stored
/// reference; a side that fails refuses the bisection, except a sharded candidate whose rank
/// traces the merge refused (`Wholes::RanksRefused`).
pub(crate) fn whole_runs(o: &BisectOptions, runs: &mut Vec<RunRecord>) -> Result<Wholes> {
    let ref_rel = format!("{}/reference.trace", o.work);
    let cand_rel = format!("{}/candidate.trace", o.work);
    let producer = match &o.reference {
        Reference::Run(p) => p,
        Reference::Stored(stored) => {
            // Verified before the candidate runs: an edited file costs no run.
            let reference = stored.adopt(o, &ref_rel)?;
            let (cr, sharded) = candidate_run(o, &cand_rel, None);
            runs.push(cr.clone());
            crate::progress::step("whole run of the candidate (the reference is stored)");
            if let Some(s) = sharded.as_ref().filter(|s| s.refused.is_some()) {
                return Ok(Wholes::RanksRefused(s.clone(), reference));
            }
            if !cr.ok {
                return Err(failed("candidate", &cr));
            }
            return Ok(Wholes::Both(Whole {
                reference,
                candidate: open(&o.root, &cand_rel)?,
                ref_rel,
                cand_rel,
                sharded,
            }));
        }
    };
    let (rr, (cr, sharded)) = std::thread::scope(|s| {
        let h = s.spawn(|| candidate_run(o, &cand_rel, None));
        (
            run_fresh(&o.root, producer, &trace_verb(o, &ref_rel, None), o.timeout),
            h.join().expect("candidate thread"),
        )
    });
    runs.extend([rr.clone(), cr.clone()]);
    crate::progress::step("whole runs of the reference and the candidate");
    if !rr.ok {
        return Err(failed("reference", &rr));
    }
    if let Some(s) = sharded.as_ref().filter(|s| s.refused.is_some()) {
        return Ok(Wholes::RanksRefused(s.clone(), open(&o.root, &ref_rel)?));
    }
    if !cr.ok {
        return Err(failed("candidate", &cr));
    }
    Ok(Wholes::Both(Whole {
        reference: open(&o.root, &ref_rel)?,
        candidate: open(&o.root, &cand_rel)?,
        ref_rel,
        cand_rel,
        sharded,
    }))
}

/// By bits for two ordered producers, else by the policy for the candidate's precision, unless
/// --exact or --policy says otherwise. An oracle's provenance is never ordered. Also whether
/// each side (reference, candidate) is ordered. `traces`: the reference's and the candidate's.
pub(crate) fn choose_judge(
    o: &BisectOptions,
    (reference, candidate): (&Trace, &Trace),
) -> Result<(Judge, Option<Policy>, (bool, bool))> {
    let ask = match (o.exact, &o.policy) {
        (true, Some(p)) => {
            return Err(gerr!(
                "--exact judges by bits and --policy {p} by a policy: give one"
            ))
        }
        (true, None) => Ask::Exact,
        (false, Some(p)) => Ask::Policy(p.clone()),
        (false, None) => Ask::Default,
    };
    let ordered = (
        match &o.reference {
            Reference::Run(p) => is_ordered(&o.root, p) && !is_oracle(reference),
            Reference::Stored(s) => s.ordered,
        },
        is_ordered(&o.root, &o.candidate) && !is_oracle(candidate),
    );
    let (judge, policy) = judge::choose(
        &ask,
        (&o.reference.described(), &o.candidate.name()),
        ordered,
        candidate,
        o.precision.as_deref(),
        &o.root,
    )?;
    Ok((judge, policy, ordered))
}

/// A decision differs no later than the first differing tensor (by layer), so it may be what
/// makes the numbers differ: compare them past the flips, on the candidate forced to take the
/// reference's decisions (docs/producers.md). A flip after the numbers already diverged is
/// their consequence and changes nothing upstream. A candidate that cannot be forced is said so.
/// The comparison to bisect from (the forced one when forcing worked) and what forcing did.
pub(crate) fn force_decisions(
    o: &BisectOptions,
    whole: &Whole,
    compared: Report,
    opts: &Options,
    runs: &mut Vec<RunRecord>,
) -> Result<(Report, Option<DecisionsForced>)> {
    let first_tensor = rows(&compared)
        .iter()
        .filter(|t| t.status.is_bad())
        .map(|t| location(&t.tensor))
        .min();
    let flipped = || {
        compared
            .decisions
            .results
            .iter()
            .filter(|d| d.differing_rows > 0)
    };
    let first_flip = flipped().map(|d| location(&d.name)).min();
    let flip_first = first_flip.is_some_and(|f| first_tensor.is_none_or(|t| f <= t));
    if !flip_first {
        return Ok((compared, None));
    }
    let forced_rel = format!("{}/candidate.forced.trace", o.work);
    let (f, got) = trace_forced(
        o,
        (&whole.reference, &whole.ref_rel),
        &compared,
        forced_rel,
        opts,
        runs,
    );
    crate::progress::step("candidate traced with the reference's decisions forced");
    refuse_timeout(runs, o)?;
    let report = match got {
        Some((rep, _)) => rep,
        None => compared,
    };
    Ok((report, Some(f)))
}

/// Where the whole runs first diverge: the locate phase's answer.
pub(crate) struct Located {
    /// Layers in the model (the reference's prefill `layer.LL.hidden_out`).
    pub n: usize,
    /// The whole runs' tensor rows.
    pub rows: Vec<TensorCmp>,
    /// Every diverging place: its location (`location`), name and how it diverges.
    pub diverging: Vec<(i64, String, How)>,
    /// The first of them in computation order.
    pub first: Option<(i64, String, How)>,
    /// The layer it is in, when it is in a layer.
    pub first_layer: Option<usize>,
    pub whole_run: WholeRun,
    /// The structure findings, summarised (`summarise`).
    pub structure: Option<String>,
}

/// The first diverging place, in computation order (tensors in reference order, then decisions
/// by location). `forced`: the candidate took the reference's decisions.
pub(crate) fn locate(reference: &Trace, whole: &Report, forced: bool) -> Located {
    let whole_rows = rows(whole);
    let whole_decisions = decisions(whole);
    let n = reference
        .tensors()
        .iter()
        .filter_map(|t| {
            let n = Name::parse(&t.name);
            (n.decode_step.is_none() && n.point == "hidden_out").then_some(n.layer?)
        })
        .map(|l| l + 1)
        .max()
        .unwrap_or(0);
    let mut diverging: Vec<(i64, String, How)> = whole_rows
        .iter()
        .filter(|t| t.status.is_bad())
        .map(|t| (location(&t.tensor), t.tensor.clone(), How::Differs))
        .collect();
    diverging.extend(
        whole_decisions
            .iter()
            .filter(|d| d.judged_rows() > 0)
            .map(|d| (location(&d.name), d.name.clone(), How::Differs)),
    );
    // What the differ states as a finding rather than as values (a tensor or decision on one
    // side only, another order): divergence too, so the headline never calls runs matching while
    // the body lists their differences.
    let structure: Vec<&tracegate_diff::Finding> = whole
        .findings
        .iter()
        .filter(|f| is_structure(f.kind))
        .collect();
    // A decision whose values agree but whose margins do not diverges in value, not structure.
    // Forced decisions agree by construction, and their margins say where the candidate would
    // have decided otherwise: that is `decisions_forced`, not a place to bisect numbers from.
    let margins = whole
        .findings
        .iter()
        .filter(|f| f.kind == FindingKind::MarginDiffers && !forced);
    for f in structure.iter().copied().chain(margins) {
        if let Some(t) = f
            .tensor()
            .filter(|t| !diverging.iter().any(|(_, name, _)| name == t))
        {
            diverging.push((location(t), t.to_string(), How::Finding(f.kind)));
        }
    }
    let first = diverging.iter().min_by_key(|(loc, _, _)| *loc).cloned();
    let first_layer = first
        .as_ref()
        .and_then(|(loc, _, _)| (0..n as i64).contains(loc).then_some(*loc as usize));
    let whole_run = WholeRun {
        verdict: whole.verdict,
        first_diverging: first.as_ref().map(|(_, n, _)| n.clone()),
        first_diverging_how: first.as_ref().map(|(_, _, how)| *how),
        first_diverging_layer: first_layer,
        first_violation: whole.first_violation(),
        first_bit_difference: whole.first_divergence.as_ref().map(|d| FirstBitDifference {
            tensor: d.tensor.clone(),
            coords: d.coords.clone(),
            reference_value: d.reference_value.clone(),
            candidate_value: d.candidate_value.clone(),
            ulp: d.ulp,
            differing_elements: d.differing_elements,
            total_elements: d.total_elements,
        }),
        differing_decisions: whole_decisions
            .iter()
            .filter(|d| d.differing_rows > 0)
            .cloned()
            .collect(),
        findings: whole
            .findings
            .iter()
            .filter(|f| {
                !matches!(
                    f.kind,
                    FindingKind::ValuesDiffer
                        | FindingKind::OutsidePolicy
                        | FindingKind::DecisionDiffers
                )
            })
            .map(describe)
            .collect(),
    };
    Located {
        n,
        rows: whole_rows,
        diverging,
        first,
        first_layer,
        whole_run,
        structure: summarise(&structure),
    }
}

/// The candidate traced again at `rel`, taking the decisions of `reference` (its trace and path),
/// and that trace compared by `opts`: what forcing did (`unforced`: the differing decisions of
/// the comparison before it, with their labels), and when it worked the forced comparison and
/// trace. Shared by the prefill's forcing and a block-diffusion run's (../diffusion/).
pub(crate) fn trace_forced(
    o: &BisectOptions,
    (reference, ref_rel): (&Trace, &str),
    unforced: &Report,
    rel: String,
    opts: &Options,
    runs: &mut Vec<RunRecord>,
) -> (DecisionsForced, Option<(Report, Trace)>) {
    let (rec, _) = candidate_run(o, &rel, Some(ref_rel.to_string()));
    runs.push(rec.clone());
    let mut f = DecisionsForced {
        status: Forcing::NotForced,
        reason: None,
        from: ref_rel.to_string(),
        from_digest: reference.digest().hex(),
        candidate_trace: None,
        unforced: unforced
            .decisions
            .results
            .iter()
            .filter(|d| d.differing_rows > 0)
            .map(|d| {
                let mut labels = std::collections::BTreeMap::new();
                for x in &d.flips {
                    *labels.entry(x.label).or_insert(0) += 1;
                }
                UnforcedDecision {
                    name: d.name.clone(),
                    rows: d.rows,
                    differing_rows: d.differing_rows,
                    labels,
                }
            })
            .collect(),
        rows_overridden: None,
        overridden: None,
        overridden_rows: None,
        overrides_not_checked: None,
        overrides_unexplained: vec![],
        overrides_ties: Default::default(),
        overrides_near_ties: Default::default(),
        overrides_rows: vec![],
    };
    match forced_run(o, reference, &rec, &rel, opts) {
        Ok((rep, t)) => {
            let prov = &t.provenance()["forced_decisions"];
            f.rows_overridden = prov["rows_overridden"].as_u64();
            f.overridden = Some(prov["overridden"].clone());
            f.overridden_rows = Some(prov["overridden_rows"].clone());
            // The argmax and router rows it overrode, each judged by its own margin (a reorder
            // by the near-tie rule against the reference's scores, under the comparison's policy
            // and noise reference); what the comparison leaves out (a prefill's filter) is not
            // judged here.
            match overrides::record(&t) {
                Ok(rows) => {
                    let against = overrides::Against { reference, opts };
                    let j = overrides::judge(&t, &rep, &rows, &against);
                    f.overrides_unexplained = j.unexplained;
                    f.overrides_ties = j.ties;
                    f.overrides_near_ties = j.near_ties;
                    f.overrides_rows = j.rows;
                    if !j.not_checked.is_empty() {
                        f.overrides_not_checked = Some(j.not_checked.join("; "));
                    }
                }
                Err(why) => f.overrides_not_checked = Some(why),
            }
            f.status = Forcing::Forced;
            f.candidate_trace = Some(rel);
            (f, Some((rep, t)))
        }
        Err(why) => {
            f.reason = Some(why.to_string());
            (f, None)
        }
    }
}
