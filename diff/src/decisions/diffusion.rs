//! The decisions of a block-diffusion trace (docs/diff.md, "Diffusion decisions" and "Sampling
//! divergence"): where the sampler's decisions are taken in the capture order, their token
//! positions, the first draw that differs between producers of different `rng`, and the
//! tolerance of the sampler's margins (probabilities, nats, whole steps).

use serde_json::Value;
use tracegate_trace::{DecisionInfo, Trace};

use super::source::range_divergence;
use crate::passes::{self, Key, Sampler};
use crate::{numeric, FindingKind, Options, Pair, Report, SamplingDivergence, MARGIN_SLACK};
use std::collections::HashSet;

/// The reference's tensors by run order, to find where a sampler decision is taken: the last
/// tensor (largest capture index) whose run-order key is at most the decision's.
pub(super) struct RunIndex {
    /// (key, capture index) sorted by key, with the running maximum of the index.
    by_key: Vec<(Key, usize)>,
}

impl RunIndex {
    pub(super) fn new(r: &Trace) -> Self {
        let mut by_key: Vec<(Key, usize)> = r
            .tensors()
            .iter()
            .enumerate()
            .map(|(i, t)| (passes::key(&t.name), i))
            .collect();
        by_key.sort_unstable();
        let mut max = 0;
        for e in by_key.iter_mut() {
            max = max.max(e.1);
            e.1 = max;
        }
        RunIndex { by_key }
    }

    /// Where a sampler decision is taken: after every tensor of its step (or, for init_canvas,
    /// before its block's first step; for commit, after its block's last step). None when no
    /// tensor comes before it.
    pub(super) fn taken_at(&self, name: &str) -> Option<usize> {
        let k = passes::key(name);
        let n = self.by_key.partition_point(|e| e.0 <= k);
        n.checked_sub(1).map(|i| self.by_key[i].1)
    }
}

/// A sampler decision's rows are canvas rows: their positions are those of its step's (for
/// init_canvas, its block's first step's; for commit, its block's) canvas tensors. `stop`'s
/// rows are not positions.
pub(super) fn row_position(name: &str, row: u64, rows: u64, r: &Trace) -> Option<Option<i64>> {
    let p = passes::place(name)?;
    let sampler = p.sampler?;
    if sampler == Sampler::Stop {
        return Some(None);
    }
    let step = p.step.unwrap_or(0);
    let candidates = [
        tracegate_trace::names::denoise(p.block, step, "logits.tempered"),
        tracegate_trace::names::denoise(p.block, step, "canvas"),
        tracegate_trace::names::denoise(p.block, step, "entropy"),
    ];
    let positions = candidates.iter().find_map(|n| {
        r.tensor_info(n)
            .and_then(|i| i.attributes.positions.as_ref())
            .filter(|p| p.len() as u64 == rows)
    });
    Some(positions.map(|p| p[row as usize]))
}

fn rng(t: &Trace) -> Option<&str> {
    t.provenance().get("rng").and_then(Value::as_str)
}

fn forced(t: &Trace) -> bool {
    t.provenance()
        .get("forced_decisions")
        .is_some_and(|v| !v.is_null())
}

/// The sampling divergence of two traces, if there is one: under a policy, both traces record
/// `rng` and the values differ, neither side was forced (`forced_decisions` in its provenance),
/// and a draw (`init_canvas`, `sampled`, `renoise`) the filter selects differs; the first such
/// draw in the reference's recorded order. With the same `rng`, an absent one, or a forced
/// side, a differing draw stays an ordinary flip (a defect).
pub(super) fn sampling_divergence(
    r: &Trace,
    c: &Trace,
    opts: &Options,
) -> Option<SamplingDivergence> {
    opts.policy.as_ref()?;
    let (rr, cr) = (rng(r)?, rng(c)?);
    if rr == cr || forced(r) || forced(c) {
        return None;
    }
    for rd in r.decisions().iter().filter(|i| opts.selects(&i.name)) {
        let Some(p) = passes::place(&rd.name) else {
            continue;
        };
        if !p.sampler.is_some_and(Sampler::is_draw) {
            continue;
        }
        let Some(cd) = c.decision_info(&rd.name).filter(|cd| cd.shape == rd.shape) else {
            continue;
        };
        let rows = differing_rows(r, c, rd, cd);
        if !rows.is_empty() {
            return Some(SamplingDivergence {
                decision: rd.name.clone(),
                block: p.block as u64,
                step: p.step.map(|s| s as u64),
                rows,
                reference_rng: rr.to_string(),
                candidate_rng: cr.to_string(),
                tensors_not_judged: 0,
                decisions_not_judged: 0,
                decision_rows_not_judged: 0,
            });
        }
    }
    None
}

fn differing_rows(r: &Trace, c: &Trace, rd: &DecisionInfo, cd: &DecisionInfo) -> Vec<u64> {
    let (rv, cv) = (r.decision_values(rd), c.decision_values(cd));
    let width = rd.count().checked_div(rd.rows()).unwrap_or(0) as usize;
    if width == 0 {
        return Vec::new();
    }
    rv.chunks(width)
        .zip(cv.chunks(width))
        .enumerate()
        .filter(|(_, (a, b))| a != b)
        .map(|(i, _)| i as u64)
        .collect()
}

/// The last step of block `block` in a trace: the largest s with a `denoise.BBBB.SSSS.argmax`.
pub(super) fn last_step(t: &Trace, block: usize) -> Option<usize> {
    t.decisions()
        .iter()
        .filter_map(|d| passes::place(&d.name))
        .filter(|p| p.block == block && p.sampler == Some(Sampler::Argmax))
        .filter_map(|p| p.step)
        .max()
}

/// One step of the stored dtype of `name` at magnitude `x`, on the coarser side.
fn step_at(r: &Trace, c: &Trace, name: &str, x: f64) -> f64 {
    let bits = |t: &Trace| match t.tensor_info(name).map(|i| i.dtype) {
        Some(tracegate_trace::DType::F64) => 53,
        Some(tracegate_trace::DType::F16) => 11,
        Some(tracegate_trace::DType::BF16) => 8,
        _ => 24,
    };
    let p = bits(r).min(bits(c));
    let x = x.abs();
    if !x.is_finite() || x == 0.0 {
        return 0.0;
    }
    2f64.powi(x.log2().floor() as i32 - (p - 1))
}

/// The reference's values of a float tensor, in f64.
fn values_f64(t: &Trace, name: &str) -> Option<Vec<f64>> {
    let info = t.tensor_info(name)?;
    Pair::new(info.dtype, info.dtype)?;
    let data = t.data(info);
    Some(
        (0..info.element_count())
            .map(|i| numeric::element_value(info.dtype, data, i))
            .collect(),
    )
}

/// Under a policy, the largest |reference − candidate| accepted for the margins `a`, `b` of
/// equal row `row` of a sampler decision (docs/diff.md, "Diffusion decisions", margins), from
/// what its step's tensors measure; None for a decision that is not the sampler's (the general
/// tolerance applies). `source_selected`: a tensor the filter left out excuses nothing.
pub(super) fn margin_tolerance(
    r: &Trace,
    c: &Trace,
    name: &str,
    row: u64,
    (a, b): (f32, f32),
    stable: Option<i64>,
    selected: &dyn Fn(&str) -> bool,
) -> Option<f64> {
    let p = passes::place(name)?;
    let sampler = p.sampler?;
    let (a, b) = (a as f64, b as f64);
    let slack = MARGIN_SLACK * 1f64.max(a.abs()).max(b.abs());
    let divergence = |tensor: &str, rows: Option<(u64, u64)>| {
        Some(tensor)
            .filter(|t| selected(t))
            .and_then(|t| range_divergence(r, c, t, rows))
            .filter(|d| d.is_finite())
    };
    match sampler {
        Sampler::Argmax | Sampler::InitCanvas | Sampler::Renoise => None,
        Sampler::Commit => {
            // The commit's margins are its last step's argmax margins: the general rule on
            // that step's tempered logits, when both sides ended the block at that step.
            let s = last_step(r, p.block).filter(|&s| Some(s) == last_step(c, p.block))?;
            let src = tracegate_trace::names::denoise(p.block, s, "logits.tempered");
            let rows = r.tensor_info(&src)?.shape.first().copied()?;
            let d = divergence(&src, Some((row, rows))).unwrap_or(0.0);
            Some(2.0 * d + slack)
        }
        Sampler::Sampled => {
            // p = softmax(ℓ)[t]: log p = ℓ_t − LSE(ℓ), and both terms move by at most the
            // row's divergence d, so |p' − p| ≤ max(p, p')·(1 − e^{−2d}).
            let step = p.step?;
            let src = tracegate_trace::names::denoise(p.block, step, "logits.tempered");
            let rows = r.tensor_info(&src)?.shape.first().copied()?;
            let d = divergence(&src, Some((row, rows))).unwrap_or(0.0);
            Some(a.abs().max(b.abs()) * -(-2.0 * d).exp_m1() + slack)
        }
        Sampler::Accept | Sampler::Stop => {
            let step = p.step?;
            let src = tracegate_trace::names::denoise(p.block, step, "entropy");
            let h = values_f64(r, &src).filter(|_| selected(&src))?;
            let top = h.iter().fold(0f64, |m, x| m.max(x.abs()));
            // Each entropy as each producer used it: the stored values' divergence, plus one
            // step of the stored dtype each (a producer may compare before it rounds to store).
            let d = divergence(&src, None).unwrap_or(0.0) + 2.0 * step_at(r, c, &src, top);
            let n = h.len() as f64;
            let total: f64 = h.iter().map(|x| x.abs()).sum::<f64>() + n * d;
            // A sum of n f32 terms, in any order (torch's cumsum accumulates in f64, the
            // engine in order): at most n roundings of one f32 step at the total.
            let rounding =
                (n + 2.0) * 2f64.powi(total.max(f64::MIN_POSITIVE).log2().floor() as i32 - 23);
            if sampler == Sampler::Stop {
                // Row 0 (and row 2 when not stable) counts whole steps: exact. Row 1 (and row
                // 2 when stable) is the mean entropy's distance to its threshold: it moves by at
                // most d, plus the mean's rounding.
                let nats = row == 1 || (row == 2 && stable == Some(1));
                return Some(if nats {
                    d + rounding / n.max(1.0) + slack
                } else {
                    slack
                });
            }
            // accept: x = the sum of the entropies ranked before this row. Each of the n − 1
            // terms moves by at most d; a row whose entropy is within 2d of this row's may
            // change sides in the ranking (honestly: torch's sort is not stable), taking its
            // whole entropy in or out of the sum.
            let own = *h.get(row as usize)?;
            let crossing: f64 = h
                .iter()
                .enumerate()
                .filter(|&(k, x)| k as u64 != row && (x - own).abs() <= 2.0 * d)
                .map(|(_, x)| x.abs() + d)
                .sum();
            Some((n - 1.0).max(0.0) * d + crossing + rounding + slack)
        }
    }
}

/// A pass of a diffusion run: a step (block, Some(step)), a commit pass (block, None, true),
/// or a block as a whole (block, None, false), which any of its names makes present.
type Pass = (usize, Option<usize>, bool);

fn pass_of(name: &str) -> Option<Pass> {
    let p = passes::place(name)?;
    Some((p.block, p.step, p.encode))
}

/// Every pass a trace ran: each name's own, and its block as a whole.
fn passes_run(t: &Trace) -> HashSet<Pass> {
    let names = t
        .tensors()
        .iter()
        .map(|i| i.name.as_str())
        .chain(t.decisions().iter().map(|d| d.name.as_str()));
    let mut out = HashSet::new();
    for n in names {
        if let Some((b, s, e)) = pass_of(n) {
            out.insert((b, s, e));
            out.insert((b, None, false));
        }
    }
    out
}

/// After a sampling divergence the canvases differ, and so may where each side's stop rule
/// ends a block and whether another block runs (DG13.5, DG14): a missing or extra tensor or
/// decision after the draw whose whole step, commit pass or block the other side did not run
/// is not a structure difference. Its finding becomes `after_sampling_divergence` (counted,
/// not failing). A name missing from a pass both sides ran stays a structure finding. Returns
/// how many findings changed.
pub(crate) fn one_sided_after_sampling(r: &Trace, c: &Trace, rep: &mut Report) -> usize {
    let Some(draw) = rep
        .decisions
        .sampling_divergence
        .as_ref()
        .map(|s| s.decision.clone())
    else {
        return 0;
    };
    let (ran_r, ran_c) = (passes_run(r), passes_run(c));
    let mut changed = 0;
    for f in rep.findings.iter_mut() {
        let other = match f.kind {
            FindingKind::MissingTensor | FindingKind::MissingDecision => &ran_c,
            FindingKind::ExtraTensor | FindingKind::ExtraDecision => &ran_r,
            _ => continue,
        };
        let Some(name) = f.tensor().map(str::to_string) else {
            continue;
        };
        let Some(pass) = pass_of(&name).filter(|_| passes::after_draw(&draw, &name)) else {
            continue;
        };
        if !other.contains(&pass) {
            let side = if std::ptr::eq(other, &ran_c) {
                "reference"
            } else {
                "candidate"
            };
            f.kind = FindingKind::AfterSamplingDivergence;
            f.detail = format!(
                "in the {side} only: its {} ran on one side only, after the sampling divergence at {draw} (another canvas, another stop): not judged",
                match pass {
                    (b, Some(s), _) => format!("block {b} step {s}"),
                    (b, None, true) => format!("block {b} commit pass"),
                    (b, None, false) => format!("block {b}"),
                }
            );
            changed += 1;
        }
    }
    changed
}

/// What fails a verdict among the findings and flips once the one-sided names above are
/// settled: every structure, margin and commit finding, and a flip that is not excused.
pub(crate) fn still_different(rep: &Report) -> bool {
    rep.findings.iter().any(|f| {
        matches!(
            f.kind,
            FindingKind::MissingTensor
                | FindingKind::ExtraTensor
                | FindingKind::DtypeMismatch
                | FindingKind::ShapeMismatch
                | FindingKind::OrderMismatch
                | FindingKind::AttributeDiffers
                | FindingKind::MissingDecision
                | FindingKind::ExtraDecision
                | FindingKind::DecisionShapeMismatch
                | FindingKind::DecisionOrderMismatch
                | FindingKind::MarginDiffers
                | FindingKind::MarginPresenceMismatch
                | FindingKind::MarginContradictsScores
                | FindingKind::CommitNotArgmax
        )
    }) || rep
        .decisions
        .results
        .iter()
        .any(|d| d.flips.iter().any(|f| !f.excused()))
}
