//! `gate bisect --ranks N` (docs/bisect.md, "Sharded candidates"): the candidate's `trace` verb
//! is sharded over N ranks (`{rank}` in its `--out`), run, checked and merged by crate::ranks,
//! as `gate run port` does. The merged run is bisected like any whole run, and its first
//! divergence attributed to the rank whose shard holds it (`crate::ranks::attribute`). A merge
//! the rank traces do not survive (a rank that skipped the carry: a replicated tensor that
//! differs) is the bisection's finding, `rank_traces_refused` (exit 1), naming the rank, the
//! tensor, its layer and step. The `layer` verb is not sharded: isolation runs only when the
//! candidate answers it unsharded, and says so; otherwise it is NOT CHECKED, with that reason.

use serde::Serialize;
use tracegate_producers::RunRecord;
use tracegate_trace::names::Name;
use tracegate_trace::Trace;

use crate::bisect::options::BisectOptions;
use crate::bisect::prefill::layers::outliers;
use crate::bisect::prefill::whole::{choose_judge, Whole};
use crate::bisect::prefill::{BisectVerdict, Isolated, Scope, SelfConsistency, WholeRun};
use crate::ranks::ShardedRun;

/// The report's `sharded` (null without `--ranks`).
#[derive(Clone, Debug, Serialize)]
pub struct Sharded {
    /// The candidate's whole run: merged from its rank traces, or refused naming the rank.
    pub run: ShardedRun,
    /// Where the refusal or the first divergence is, and the rank that holds it.
    pub at: Option<RankAt>,
    /// How the layers were isolated: by the candidate's unsharded `layer` verb, or NOT CHECKED
    /// and why (`layer_verb_words`).
    pub layer_verb: String,
}

/// A tensor of the candidate's run named at its decode step, layer, capture point and rank.
#[derive(Clone, Debug, Serialize)]
pub struct RankAt {
    pub tensor: String,
    /// The decode step (`decode.SSSS.…`); null in the prefill.
    pub step: Option<usize>,
    pub layer: Option<usize>,
    /// The capture point (the stage): `attn_out`, `q`, `out` of an expert, `logits`, ….
    pub point: String,
    /// The rank at fault or whose shard holds the element; null when no one rank does (a
    /// partial sum, a replicated tensor wrong on every rank).
    pub rank: Option<u64>,
    pub detail: String,
}

impl RankAt {
    fn new(tensor: &str, rank: Option<u64>, detail: String) -> RankAt {
        let n = Name::parse(tensor);
        RankAt {
            tensor: tensor.to_string(),
            step: n.decode_step,
            layer: n.layer,
            point: n.point.to_string(),
            rank,
            detail,
        }
    }

    /// "decode step 1, layer 00, stage attn_out (decode.0001.layer.00.attn_out), rank 1: …".
    pub fn words(&self) -> String {
        let mut at = Vec::new();
        if let Some(s) = self.step {
            at.push(format!("decode step {s}"));
        }
        if let Some(l) = self.layer {
            at.push(format!("layer {l:02}"));
        }
        at.push(format!("stage {} ({})", self.point, self.tensor));
        if let Some(r) = self.rank {
            at.push(format!("rank {r}"));
        }
        format!("{}: {}", at.join(", "), self.detail)
    }
}

/// The first `tensor "NAME"` a merge's message names (`tensor "layer.00.q" is replicated but
/// rank 1 … differs`).
fn named_tensor(message: &str) -> Option<String> {
    let (_, rest) = message.split_once("tensor \"")?;
    let (name, _) = rest.split_once('"')?;
    Some(name.to_string())
}

/// Where a refused merge is: the tensor its message names (null when it names none, e.g. a
/// missing rank file) and the rank at fault.
pub(crate) fn refused_at(run: &ShardedRun) -> Option<RankAt> {
    let r = run.refused.as_ref()?;
    let tensor = named_tensor(&r.message)?;
    Some(RankAt::new(&tensor, r.rank, r.message.clone()))
}

/// The first divergence `tensor` of the merged run attributed to a rank: `coords` its worst or
/// first differing element when the comparison gave one, else the largest |difference| between
/// the reference's and the merged candidate's values.
pub(crate) fn attribute(
    o: &BisectOptions,
    run: &ShardedRun,
    (reference, candidate): (&Trace, &Trace),
    tensor: &str,
    coords: Option<Vec<u64>>,
) -> RankAt {
    let coords = coords.or_else(|| worst_coords(reference, candidate, tensor));
    let (rank, detail) = crate::ranks::attribute(&o.root, run, tensor, coords.as_deref());
    RankAt::new(tensor, rank, detail)
}

/// The element of `name` whose |reference − candidate| is largest (NaN-aware: a NaN on one
/// side only is the largest), as coordinates; None when either side has no f32 values for it.
fn worst_coords(reference: &Trace, candidate: &Trace, name: &str) -> Option<Vec<u64>> {
    let (r, c) = (reference.f32_vec(name).ok()?, candidate.f32_vec(name).ok()?);
    let shape = &candidate.tensor_info(name)?.shape;
    if r.len() != c.len() || r.is_empty() {
        return None;
    }
    let gap = |(a, b): (&f32, &f32)| match (a.is_nan(), b.is_nan()) {
        (false, false) => f64::from(*a) - f64::from(*b),
        (true, true) => 0.0,
        _ => f64::INFINITY,
    };
    let (mut at, mut worst) = (0usize, -1.0f64);
    for (i, d) in r.iter().zip(&c).map(gap).enumerate() {
        if d.abs() > worst {
            (at, worst) = (i, d.abs());
        }
    }
    let mut coords = vec![0u64; shape.len()];
    let mut rest = at as u64;
    for (k, dim) in shape.iter().enumerate().rev() {
        let dim = (*dim).max(1);
        coords[k] = rest % dim;
        rest /= dim;
    }
    Some(coords)
}

/// A sharded candidate's layer trace must be unsharded: the gate gives the `layer` verb one
/// `--out` and merges nothing (docs/bisect.md, "Sharded candidates").
pub(crate) fn unsharded_layer_trace(o: &BisectOptions, cand: &Trace) -> crate::Result<()> {
    let Some(world) = o.ranks else {
        return Ok(());
    };
    let key = tracegate_trace::shard::KEY;
    match cand
        .tensors()
        .iter()
        .find_map(|t| Some((&t.name, t.attributes.extra.get(key)?)))
    {
        None => Ok(()),
        Some((name, shard)) => Err(crate::gerr!(
            Producer: "a sharded candidate (--ranks {world}): its layer verb wrote a sharded trace ({name} says {key}={shard}); the layer verb is not sharded (the gate gives it one --out and merges nothing), so no layer is isolated"
        )),
    }
}

/// Why a sharded candidate's failed `layer` verb leaves isolation NOT CHECKED, before the run's
/// own words.
pub(crate) fn layer_verb_failed(o: &BisectOptions) -> String {
    match o.ranks {
        Some(w) => format!("a sharded candidate (--ranks {w}): the layer verb is not sharded (the gate runs it once, unsharded, on the whole layer) and the candidate's did not answer so: "),
        None => String::new(),
    }
}

/// The report's `layer_verb`: which layer verb isolated the layers, or why none did.
pub(crate) fn layer_verb_words(r: &super::BisectReport) -> String {
    let rows = r
        .layers
        .iter()
        .chain(r.decode.iter().flat_map(|d| &d.layers));
    let isolated = rows
        .clone()
        .any(|l| matches!(l.isolation, Isolated::Match | Isolated::Wrong));
    let why = rows
        .filter_map(|l| l.reason.as_deref())
        .find(|w| !w.starts_with("not attempted"));
    match (isolated, why) {
        (true, _) => "unsharded: the candidate answered the layer verb unsharded (one process, the whole layer), so the layers were isolated by it".into(),
        (false, Some(w)) => format!("NOT CHECKED: {w}"),
        (false, None) => "not run: no layer was isolated".into(),
    }
}

/// The report's `sharded` for a merged run: the first divergence (the decode path's when the
/// prefill agrees, else the whole runs') attributed to a rank, and which layer verb isolated;
/// the summary ends with both.
pub(crate) fn merged(
    o: &BisectOptions,
    run: ShardedRun,
    whole: &Whole,
    r: &mut super::BisectReport,
) -> Sharded {
    let w = &r.whole_run;
    let first = match r.decode.as_ref().and_then(|d| d.first_diverging.clone()) {
        Some(t) => Some((t, None)),
        None => w.first_diverging.clone().map(|t| {
            // The comparison's own element for it: the worst outside the policy, or the first
            // differing bit.
            let coords = w
                .first_violation
                .as_ref()
                .filter(|v| v.tensor == t)
                .and_then(|v| v.worst_element.as_ref().map(|e| e.coords.clone()))
                .or_else(|| {
                    w.first_bit_difference
                        .as_ref()
                        .filter(|d| d.tensor == t)
                        .map(|d| d.coords.clone())
                });
            (t, coords)
        }),
    };
    // A decision is identical on every rank (the merge checked): no shard holds it.
    let at = first
        .filter(|(t, _)| whole.candidate.tensor_info(t).is_some())
        .map(|(t, coords)| attribute(o, &run, (&whole.reference, &whole.candidate), &t, coords));
    let s = Sharded {
        run,
        at,
        layer_verb: layer_verb_words(r),
    };
    r.summary.push_str(&format!(
        "; sharded over {} ranks (merged): {}; layer verb {}",
        s.run.world,
        s.at.as_ref()
            .map_or("no tensor diverges, so no rank is named".to_string(), |a| {
                format!("first divergence at {}", a.words())
            }),
        s.layer_verb
    ));
    s
}

/// The bisection's report when the merge refused the candidate's rank traces: nothing is
/// compared (there is no merged run); the verdict `rank_traces_refused` names the rank, and the
/// tensor with its layer and step when the merge names one. A refused tensor of a decode step
/// is also the decode path's first diverging place (`decode`). `reference`: its whole trace.
pub(crate) fn refused_report(
    o: &BisectOptions,
    run: ShardedRun,
    reference: &Trace,
    runs: Vec<RunRecord>,
) -> crate::Result<super::BisectReport> {
    // The judge the bisection would have used, read from a rank trace (each one is the
    // candidate's, in its dtypes); nothing is judged by it.
    let stand_in = tracegate_trace::merge::rank_files(&o.root.join(&run.pattern))
        .into_iter()
        .find_map(|(_, f)| Trace::open(f).ok());
    let (judge, policy, _) = choose_judge(o, (reference, stand_in.as_ref().unwrap_or(reference)))?;
    let at = refused_at(&run);
    let why = run.refused.as_ref().map_or("", |r| r.message.as_str());
    let rank = run
        .refused
        .as_ref()
        .and_then(|r| r.rank)
        .map_or("no one rank".to_string(), |r| format!("rank {r}"));
    let summary = format!(
        "the candidate's rank traces were refused ({rank}; --ranks {}): {}; nothing compared, no layer isolated",
        run.world,
        match &at {
            Some(a) => a.words(),
            None => why.to_string(),
        }
    );
    let decode = (o.generate > 0 && !o.sampling).then(|| {
        let mut d = super::decode::DecodeReport::new(o.generate);
        d.status = super::decode::DecodeStatus::NotCompared;
        d.reason = Some(format!(
            "the candidate's rank traces were refused ({rank}): {why}"
        ));
        if let Some((a, s)) = at.as_ref().and_then(|a| Some((a, a.step?))) {
            d.first_diverging_step = Some(s);
            d.position = Some(o.tokens.len() as i64 + s as i64 - 1);
            d.first_diverging = Some(a.tensor.clone());
        }
        d
    });
    let verdict = BisectVerdict::RankTracesRefused;
    let mut outliers_rows = Vec::new();
    Ok(super::BisectReport {
        schema: super::SCHEMA,
        summary,
        verdict,
        exit_code: verdict.exit_code(),
        model: o.model.clone(),
        prompt: o.prompt.clone(),
        tokens: o.tokens.clone(),
        reference: o.reference.name(),
        reference_trace: super::reference_trace(o),
        candidate: o.candidate.name(),
        judge,
        capture: super::capture(o),
        layers_total: 0,
        decisions_forced: None,
        whole_run: WholeRun {
            verdict: tracegate_diff::Verdict::NotChecked,
            first_diverging: None,
            first_diverging_how: None,
            first_diverging_layer: None,
            first_violation: None,
            first_bit_difference: None,
            differing_decisions: vec![],
            findings: vec![],
        },
        timeout_s: o.timeout.as_secs(),
        first_wrong_layer: None,
        stage: None,
        layers: vec![],
        amplification_per_layer: None,
        calibration: None,
        decode,
        diffusion: None,
        rounding_level: None,
        rounding_response: None,
        self_consistency: SelfConsistency {
            scope: Scope::FirstWrongLayer,
            checked_layers: vec![],
            inconsistent: None,
            not_checked: vec![],
        },
        outliers: outliers(reference, &[], &mut outliers_rows),
        work_dir: o.work.clone(),
        runs,
        gate_invocation: o.gate_invocation.clone(),
        policy,
        sharded: Some(Sharded {
            run,
            at,
            layer_verb: "not run: the rank traces were refused".into(),
        }),
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_refused_tensor_is_the_first_the_merge_names() {
        let m = "the merge refused: tensor \"decode.0001.layer.00.attn_out\" is replicated but rank 1 (w/c.rank1.trace) differs from rank 0 at element 0 (bits 1 vs 2)";
        assert_eq!(
            super::named_tensor(m).as_deref(),
            Some("decode.0001.layer.00.attn_out")
        );
        assert_eq!(
            super::named_tensor("rank 2 of world size 4 is missing"),
            None
        );
        let at = super::RankAt::new("decode.0001.layer.00.attn_out", Some(1), "x".into());
        assert_eq!(
            (at.step, at.layer, at.point.as_str()),
            (Some(1), Some(0), "attn_out")
        );
        assert_eq!(
            at.words(),
            "decode step 1, layer 00, stage attn_out (decode.0001.layer.00.attn_out), rank 1: x"
        );
    }
}
