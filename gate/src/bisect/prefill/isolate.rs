//! Layer isolation: the candidate's layer verb on a whole run's input to a layer, compared with
//! that run's outputs; the first wrong stage; the self-consistency check.

use super::*;

// ------------------------------------------------------------------------------------------
// Isolation

pub(crate) struct Isolation {
    pub tensors: Vec<TensorCmp>,
    pub decisions: Vec<DecisionCmp>,
    pub wrong: bool,
    pub report: Report,
    /// The candidate's layer trace.
    pub out: String,
}

/// Where one isolation reads and writes: the whole trace whose `layer.LL.hidden_in` is the
/// input and whose `layer.LL.*` the output is compared with (the reference's, or for the
/// self-consistency check the candidate's own), and the file names under the work dir.
pub(crate) struct Source<'a> {
    pub(crate) trace: &'a Trace,
    pub(crate) rel: &'a str,
    /// "the reference's" / "its own whole run's", for messages.
    pub(crate) whose: &'a str,
    /// The candidate's layer trace and the rewritten slice, `{stem}.LL.trace`.
    pub(crate) out_stem: &'a str,
    pub(crate) slice_stem: &'a str,
    /// Tracegate's noise run of the reference, when the source is the reference: a layer alone
    /// is then held to the noise ratio the whole runs' comparison holds it to, so isolation
    /// never calls a layer right that `agrees` found too far from the reference in that layer.
    pub(crate) noise: Option<&'a tracegate_diff::NoiseReference>,
}

/// The reference's whole-run `layer.LL.*` tensors (those the candidate's layer trace also has)
/// rewritten with path=layer, so the differ compares them with the candidate's layer verb
/// under its usual rules (positions and masks must still agree). `pass`: a block-diffusion
/// pass's prefix (`denoise.BBBB.SSSS.`, `encode.BBBB.`, "" for the prompt's pass): the
/// reference's `P.layer.LL.*` are written as `layer.LL.*` with their own path, as that family's
/// layer verb records them (`unprefixed`).
pub(crate) fn write_slice(
    reference: &Trace,
    cand: &Trace,
    layer: usize,
    out: &Path,
    pass: Option<&str>,
) -> Result<()> {
    let pfx = format!("{}{}", pass.unwrap_or(""), names::layer_prefix(layer));
    let short = |name: &str| name[pass.map_or(0, str::len)..].to_string();
    let mut prov = reference.provenance().clone();
    if let Some(o) = prov.as_object_mut() {
        o.insert(
            "bisect_slice".into(),
            json!({ "layer": layer, "pass": pass, "from": reference.path().display().to_string() }),
        );
    }
    let mut w =
        TraceWriter::create(out, prov).map_err(|e| gerr!(File: "{}: {e}", out.display()))?;
    let same_rows = |name: &str, a: &Attributes| {
        cand.tensor_info(name)
            .is_some_and(|c| !name.contains(".expert.") || c.attributes.positions == a.positions)
    };
    // A candidate forced from the reference marks its tensors forced=<the reference's digest>;
    // this slice stands for that reference, so it carries the same mark.
    let digest = reference.digest().hex();
    for info in reference
        .tensors()
        .iter()
        .filter(|t| t.name.starts_with(&pfx) && same_rows(&short(&t.name), &t.attributes))
    {
        let name = short(&info.name);
        let mut attrs = info.attributes.clone();
        if pass.is_none() {
            attrs.path = Some("layer".into());
        }
        if cand
            .tensor_info(&name)
            .is_some_and(|c| c.attributes.extra.get("forced") == Some(&digest))
        {
            attrs.extra.insert("forced".into(), digest.clone());
        }
        w.tensor(&name, info.dtype, &info.shape, reference.data(info), &attrs)
            .map_err(|e| gerr!(File: "{}: {e}", out.display()))?;
    }
    for d in reference
        .decisions()
        .iter()
        .filter(|d| d.name.starts_with(&pfx) && cand.decision_info(&short(&d.name)).is_some())
    {
        let margins = reference.decision_margins(d);
        w.decision(
            &short(&d.name),
            &d.shape,
            &reference.decision_values(d),
            margins.as_deref(),
        )
        .map_err(|e| gerr!(File: "{}: {e}", out.display()))?;
    }
    w.finish()
        .map_err(|e| gerr!(File: "{}: {e}", out.display()))?;
    Ok(())
}

/// A block-diffusion layer trace's names without their pass prefix `pass`, so the layer's
/// points read as the prefill's (`layer.LL.*`) for the comparison and the stage: the same
/// tensors, decisions, attributes and provenance, at `out`. A name without the prefix is not the
/// pass's and is left out (the comparison then finds the pass's own missing).
fn unprefixed(t: &Trace, pass: &str, out: &Path) -> Result<()> {
    let io = |e: tracegate_trace::Error| gerr!(File: "{}: {e}", out.display());
    let mut w = TraceWriter::create(out, t.provenance().clone()).map_err(io)?;
    for info in t.tensors() {
        if let Some(name) = info.name.strip_prefix(pass) {
            w.tensor(
                name,
                info.dtype,
                &info.shape,
                t.data(info),
                &info.attributes,
            )
            .map_err(io)?;
        }
    }
    for d in t.decisions() {
        if let Some(name) = d.name.strip_prefix(pass) {
            let margins = t.decision_margins(d);
            w.decision(name, &d.shape, &t.decision_values(d), margins.as_deref())
                .map_err(io)?;
        }
    }
    w.finish().map_err(io)?;
    Ok(())
}

/// The candidate's layer verb on `src`'s input to `layer`, compared with `src`'s own outputs.
/// `forced`: the layer verb takes `src`'s router choices too.
pub(crate) fn isolate(
    o: &BisectOptions,
    src: &Source,
    layer: usize,
    policy: &Option<Policy>,
    forced: bool,
    runs: &mut Vec<RunRecord>,
) -> Result<Isolation> {
    let out = format!("{}/{}.{layer:02}.trace", o.work, src.out_stem);
    let verb = Verb::Layer {
        model: o.model.clone(),
        layer,
        input: src.rel.into(),
        input_name: names::layer(layer, "hidden_in"),
        out,
        internals: o.internals,
        force: forced.then(|| src.rel.to_string()),
        decode_from: None,
    };
    let run = LayerRun {
        verb,
        layer,
        slice_rel: format!("{}/{}.{layer:02}.trace", o.work, src.slice_stem),
        whose: src.whose,
        pass: None,
        noise: src.noise.cloned(),
        cut: None,
    };
    // A block-diffusion model's layer verb keeps the whole run's path (its prompt pass: no prefix).
    let pass = o.sampling.then_some("");
    isolate_with(o, &run, policy, runs, |cand, out| {
        write_slice(src.trace, cand, layer, out, pass)
    })
}

/// One layer isolation's run: the candidate's layer `verb` for `layer`, and where the reference's
/// rows of that layer go (`slice_rel`); `whose` names their source in messages ("the
/// reference's"). `pass`: a block-diffusion pass's prefix, which the layer verb's names carry.
pub(crate) struct LayerRun<'a> {
    pub(crate) verb: Verb,
    pub(crate) layer: usize,
    pub(crate) slice_rel: String,
    pub(crate) whose: &'a str,
    pub(crate) pass: Option<String>,
    /// The noise reference that judges this isolation (`Source::noise`).
    pub(crate) noise: Option<tracegate_diff::NoiseReference>,
    /// Rewrites the candidate's layer trace before it is compared (a head-reduced capsule's
    /// slicing, capsule/units.rs `Cut`); None: compared as written.
    #[allow(clippy::type_complexity)]
    pub(crate) cut: Option<Box<dyn Fn(&Trace, &Path) -> Result<()> + 'a>>,
}

/// Runs the candidate's layer verb of `run` and compares its trace with the reference's rows of
/// that layer, which `slice` writes (given the candidate's trace) to `run.slice_rel`.
pub(crate) fn isolate_with(
    o: &BisectOptions,
    run: &LayerRun,
    policy: &Option<Policy>,
    runs: &mut Vec<RunRecord>,
    slice: impl FnOnce(&Trace, &Path) -> Result<()>,
) -> Result<Isolation> {
    let LayerRun {
        verb,
        layer,
        slice_rel,
        whose,
        pass,
        noise,
        cut,
    } = run;
    let (layer, slice_rel) = (*layer, slice_rel.as_str());
    let rec = run_fresh(&o.root, &o.candidate, verb, o.timeout);
    runs.push(rec.clone());
    if !rec.ok {
        return Err(gerr!(
            Producer: "{}the candidate's layer verb failed: {} ($ {})",
            crate::bisect::sharded::layer_verb_failed(o),
            rec.why()
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .collect::<Vec<_>>()
                .join(" | "),
            rec.invocation
        ));
    }
    let cand = match pass.as_deref().filter(|p| !p.is_empty()) {
        None => open(&o.root, verb.out())?,
        Some(p) => {
            let out = verb.out();
            let rel = format!(
                "{}.unprefixed.trace",
                out.strip_suffix(".trace").unwrap_or(out)
            );
            unprefixed(&open(&o.root, verb.out())?, p, &o.root.join(&rel))?;
            open(&o.root, &rel)?
        }
    };
    crate::bisect::sharded::unsharded_layer_trace(o, &cand)?;
    for need in ["attn_out", "mlp_out", "hidden_out"] {
        let name = names::layer(layer, need);
        if cand.tensor_info(&name).is_none() {
            return Err(gerr!(Producer: "the candidate's layer trace has no {name}"));
        }
    }
    let cand = match cut {
        None => cand,
        Some(f) => {
            let out = verb.out();
            let rel = format!("{}.heads.trace", out.strip_suffix(".trace").unwrap_or(out));
            f(&cand, &o.root.join(&rel))?;
            open(&o.root, &rel)?
        }
    };
    slice(&cand, &o.root.join(slice_rel))?;
    let slice = open(&o.root, slice_rel)?;
    // The noise run's rows of this layer, on the layer path as the reference's slice is.
    let noise = match noise.as_ref().filter(|_| policy.is_some()) {
        None => None,
        Some(n) => {
            let rel = format!("{}/noise.layer.{layer:02}.trace", o.work);
            write_slice(&n.0, &cand, layer, &o.root.join(&rel), None)?;
            // A layer that computes the noise run's rows bit for bit (a port that is an
            // ordered producer) is at a ratio of 1 by construction: the policy judges it.
            let rows = open(&o.root, &rel)?;
            (rows.digest() != cand.digest())
                .then(|| tracegate_diff::NoiseReference(std::sync::Arc::new(rows)))
        }
    };
    let rep = compare(
        &slice,
        &cand,
        &Options {
            all: true,
            policy: policy.clone(),
            allow_stack_mismatch: o.allow_stack_mismatch,
            noise,
            ..Options::default()
        },
    );
    if matches!(rep.verdict, Verdict::Incomparable | Verdict::Unreadable) {
        let why: Vec<String> = rep.findings.iter().map(describe).collect();
        return Err(gerr!(
            Incomparable: "the candidate's layer trace is not comparable with {}: {}",
            whose,
            why.join("; ")
        ));
    }
    let tensors = rows(&rep);
    let decisions = decisions(&rep);
    let wrong =
        tensors.iter().any(|t| t.status.is_bad()) || decisions.iter().any(|d| d.judged_rows() > 0);
    Ok(Isolation {
        tensors,
        decisions,
        wrong,
        report: rep,
        out: verb.out().to_string(),
    })
}

/// A layer's row before isolation: `differs` in the whole run, `h` its hidden_out there.
pub(crate) fn layer_row(layer: usize, differs: bool, h: Option<&TensorCmp>) -> LayerRow {
    LayerRow {
        whole_run: if differs {
            WholeRunState::Differs
        } else {
            WholeRunState::Match
        },
        whole_max_ulp: h.and_then(|t| t.max_ulp),
        whole_rel_l2: h.and_then(|t| t.rel_l2),
        ..LayerRow::new(layer)
    }
}

pub(crate) fn fill_isolated(row: &mut LayerRow, iso: Isolation) {
    let h = iso
        .tensors
        .iter()
        .find(|t| t.tensor == names::layer(row.layer, "hidden_out"));
    row.isolated_max_ulp = h.and_then(|t| t.max_ulp);
    row.isolated_rel_l2 = h.and_then(|t| t.rel_l2);
    row.isolation = if iso.wrong {
        Isolated::Wrong
    } else {
        Isolated::Match
    };
    row.isolated = iso.tensors;
    row.isolated_decisions = iso.decisions;
}

/// A layer's status from its isolation and its whole-run comparison.
pub(crate) fn layer_status(isolation: Isolated, whole_run: WholeRunState) -> LayerStatus {
    match (isolation, whole_run) {
        (Isolated::Wrong, _) => LayerStatus::Wrong,
        (Isolated::NotChecked, _) => LayerStatus::NotChecked,
        (Isolated::Match, WholeRunState::Differs) => LayerStatus::Inherits,
        (Isolated::NotRun, WholeRunState::Differs) => LayerStatus::Downstream,
        (Isolated::Match | Isolated::NotRun, WholeRunState::Match) => LayerStatus::Ok,
    }
}

/// Where the layer verb and the whole run disagree first (`stage` names the capture point) and
/// the element that shows it: by bits the first differing one, under a policy the worst.
pub(crate) fn inconsistency(layer: usize, iso: &Isolation, moe: bool) -> Inconsistency {
    let probe = LayerRow {
        isolated: iso.tensors.clone(),
        isolated_decisions: iso.decisions.clone(),
        ..LayerRow::new(layer)
    };
    let s = stage(layer, &probe, moe, "differs from the whole run");
    let rep = &iso.report;
    let first = rep
        .first_divergence
        .as_ref()
        .filter(|d| d.tensor == s.tensor && rep.policy.is_none())
        .map(|d| ElementDiff {
            which: Which::FirstDiffering,
            coords: d.coords.clone(),
            whole_run_value: d.reference_value.clone(),
            layer_verb_value: d.candidate_value.clone(),
            ulp: d.ulp,
        });
    let worst = || {
        rep.per_tensor
            .iter()
            .find(|r| r.tensor == s.tensor)
            .and_then(|r| r.worst_element.as_ref())
            .map(|e| ElementDiff {
                which: Which::WorstOutsidePolicy,
                coords: e.coords.clone(),
                whole_run_value: e.reference_value.clone(),
                layer_verb_value: e.candidate_value.clone(),
                ulp: e.ulp,
            })
    };
    Inconsistency {
        layer,
        element: first.or_else(worst),
        tensor: s.tensor,
        detail: s.detail,
        trace: iso.out.clone(),
    }
}

/// The first wrong capture point of a layer in isolation, in the registry's computation order
/// (`tracegate_trace::names::POINTS`: a layer holds the linear-attention points or the
/// softmax-attention ones, absent points are passed over); `differs`: how a wrong one is said
/// ("differs in isolation").
pub(crate) fn stage(layer: usize, row: &LayerRow, moe: bool, differs: &str) -> Stage {
    use names::{Block as Registered, Scope};
    let pfx = names::layer_prefix(layer);
    let short = |n: &str| n.strip_prefix(&pfx).unwrap_or(n).to_string();
    let has_router = row.isolated.iter().any(|t| {
        t.tensor.starts_with(&format!("{pfx}router."))
            || t.tensor.starts_with(&format!("{pfx}expert."))
    });
    let feed_forward = if !moe {
        Block::Mlp
    } else if has_router {
        Block::MoeCombine
    } else {
        Block::Moe
    };
    let mut order: Vec<(String, Block)> = Vec::new();
    for p in names::POINTS.iter().filter(|p| p.scope != Scope::Model) {
        let block = match p.block {
            Registered::Input => Block::Input,
            Registered::Attention => Block::Attention,
            Registered::Router => Block::MoeRouter,
            Registered::Experts => Block::MoeExpert,
            // A dense MLP beside the routed experts (diffusion Gemma) is an MLP all the same.
            Registered::FeedForward if p.name.starts_with("dense_mlp.") => Block::Mlp,
            Registered::FeedForward => feed_forward,
            Registered::Residual => Block::Residual,
            // Model-wide blocks hold no layer point.
            Registered::Embedding
            | Registered::Head
            | Registered::SelfConditioning
            | Registered::Sampler => Block::Other,
        };
        if p.scope == Scope::Expert {
            // One per expert that received rows, in expert order.
            let mut experts: Vec<String> = row
                .isolated
                .iter()
                .map(|t| t.tensor.clone())
                .filter(|n| names::point(n).is_some_and(|q| q == p) && n.starts_with(&pfx))
                .collect();
            experts.sort();
            order.extend(experts.into_iter().map(|n| (n, block)));
        } else {
            order.push((format!("{pfx}{}", p.name), block));
        }
    }

    let mut matching = Vec::new();
    for (name, block) in order {
        if let Some(d) = row.isolated_decisions.iter().find(|d| d.name == name) {
            if d.judged_rows() > 0 {
                let detail = format!(
                    "{} {differs} ({}/{} rows choose other experts)",
                    short(&name),
                    d.differing_rows,
                    d.rows
                );
                return Stage {
                    layer,
                    block,
                    tensor: name,
                    detail,
                    matching,
                };
            }
            matching.push(short(&name));
        } else if let Some(t) = row.isolated.iter().find(|t| t.tensor == name) {
            if t.status.is_bad() {
                let how = if t.status == CmpStatus::Row(RowStatus::Different) {
                    String::new()
                } else {
                    format!(", {}", t.status.as_str().replace('_', " "))
                };
                let detail = format!(
                    "{} {differs} ({}/{} elements, max {} ULP, rel L2 {}{how})",
                    short(&name),
                    thousands(t.differing_elements.unwrap_or(0)),
                    thousands(t.total_elements),
                    ulps(t.max_ulp),
                    sci(t.rel_l2)
                );
                return Stage {
                    layer,
                    block,
                    tensor: name,
                    detail,
                    matching,
                };
            }
            matching.push(short(&name));
        }
    }
    // Only something outside the ordered capture points differs (an extra tensor, a structure finding).
    let other = row
        .isolated
        .iter()
        .find(|t| t.status.is_bad())
        .map(|t| t.tensor.clone())
        .unwrap_or_default();
    Stage {
        layer,
        block: Block::Other,
        detail: format!("{} {differs}", short(&other)),
        tensor: other,
        matching,
    }
}

pub(crate) fn is_moe(t: &Trace, layer: usize) -> bool {
    t.decision_info(&names::layer(layer, "router.topk"))
        .is_some()
}

/// The self-consistency check (`SelfConsistency`), lazily: only the first layer wrong in
/// isolation, the one about to be blamed (a clean run costs nothing), and `unexplained`, a layer
/// whose input agrees and whose output does not though it matches in isolation
/// (layers::unexplained: one more layer-verb run); or under `--all-layers` every isolated layer
/// (one more layer-verb run each). Sets each checked row's `self_check`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn self_check(
    o: &BisectOptions,
    own: &Trace,
    own_rel: &str,
    layers: &mut [LayerRow],
    policy: &Option<Policy>,
    forced: bool,
    unexplained: Option<usize>,
    runs: &mut Vec<RunRecord>,
) -> SelfConsistency {
    let mut sc = SelfConsistency {
        scope: if o.all_layers {
            Scope::AllLayers
        } else {
            Scope::FirstWrongLayer
        },
        checked_layers: Vec::new(),
        inconsistent: None,
        not_checked: Vec::new(),
    };
    let todo: Vec<usize> = if o.all_layers {
        layers
            .iter()
            .filter(|r| matches!(r.isolation, Isolated::Match | Isolated::Wrong))
            .map(|r| r.layer)
            .collect()
    } else {
        let mut todo: Vec<usize> = layers
            .iter()
            .find(|r| r.isolation == Isolated::Wrong)
            .map(|r| r.layer)
            .into_iter()
            .chain(unexplained)
            .collect();
        todo.sort_unstable();
        todo.dedup();
        todo
    };
    let src = Source {
        trace: own,
        rel: own_rel,
        whose: "its own whole run's",
        out_stem: "candidate.self.layer",
        slice_stem: "candidate.slice.layer",
        noise: None,
    };
    crate::progress::plan(todo.len() as u64);
    for l in todo {
        match isolate(o, &src, l, policy, forced, runs) {
            Ok(iso) => {
                sc.checked_layers.push(l);
                layers[l].self_check = if iso.wrong {
                    SelfCheck::Inconsistent
                } else {
                    SelfCheck::Consistent
                };
                if iso.wrong && sc.inconsistent.is_none() {
                    sc.inconsistent = Some(inconsistency(l, &iso, is_moe(own, l)));
                }
            }
            Err(why) => {
                layers[l].self_check = SelfCheck::NotChecked;
                sc.not_checked.push(format!("layer {l:02}: {why}"));
            }
        }
        crate::progress::step(format_args!(
            "layer {l:02} against the candidate's own whole run: {}",
            layers[l].self_check
        ));
        if runs.last().is_some_and(|r| r.timed_out) {
            break; // refused right after
        }
    }
    sc
}
