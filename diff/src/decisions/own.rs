//! One side's own scores for one row of its own decision, for questions about that side alone
//! (`gate bisect` judging a forced candidate's overrides, docs/bisect.md): the margin its scores
//! give a choice, whether they pick it, which indexes they tie. The same rules the comparison
//! applies (scores.rs), read from the same source row.

use tracegate_trace::names::Name;
use tracegate_trace::Trace;

use super::rows::honest_noise;
use super::scores::{self, crossed_gap, Scores};
use super::source::{holds_scores, range_divergence, source_row, source_tensor};
use crate::Policy;

/// Row `row` of the source tensor of decision `name` in `t`, when that source holds the
/// decision's own scores (docs/diff.md, "The near-tie rule": `logits` for an argmax,
/// `router.logits` for a router, …).
pub struct OwnScores<'a> {
    scores: Scores<'a>,
    router: bool,
    source: String,
}

/// `t`'s own scores for row `row` of its decision `name`; None when it holds no such decision,
/// no source tensor holding the decision's scores, or a source row narrower than a choice.
pub fn own_scores<'a>(t: &'a Trace, name: &str, row: u64) -> Option<OwnScores<'a>> {
    let info = t.decision_info(name)?;
    let rows = info.rows();
    let width = info.count().checked_div(rows)?;
    let source = source_tensor(name, t, t).filter(|s| holds_scores(name, s))?;
    let range = source_row(name, &source, row, rows, t);
    let scores = Scores::of(t, &source, range).filter(|s| s.len() > width)?;
    Some(OwnScores {
        scores,
        router: Name::parse(name).point == "router.topk",
        source,
    })
}

impl OwnScores<'_> {
    /// The source tensor's name.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Whether a recorded margin for `chosen` agrees with the one these scores give it, as the
    /// comparison's `margin_contradicts_scores` check has it; Err: the margin they give. None
    /// without an unchosen index.
    pub fn margin_agrees(&self, chosen: &[i64], recorded: f32) -> Option<Result<(), f64>> {
        scores::margin_agrees(&self.scores, chosen, self.router, recorded as f64)
    }

    /// Whether these scores rank `chosen` (rank order) as chosen, up to what they cannot resolve
    /// (the comparison's check that a side's scores pick its choice); Err says where not.
    pub fn picks(&self, chosen: &[i64]) -> Result<(), String> {
        scores::picks(&self.scores, chosen, self.router)
    }

    /// Whether these scores tie indexes `x` and `y` (either order is theirs).
    pub fn tied(&self, x: i64, y: i64) -> bool {
        scores::tied(&self.scores, x, y, self.router)
    }

    /// The choice of `width` indexes these scores make, in rank order: highest first, among
    /// equals the lowest index first (`lowest_first`, the tie rule) or the highest (the other
    /// way an exact tie can be broken); a NaN ranks last.
    pub fn choice(&self, width: usize, lowest_first: bool) -> Vec<i64> {
        let score = |x: i64| {
            self.scores
                .at(x)
                .filter(|z| !z.is_nan())
                .unwrap_or(f64::NEG_INFINITY)
        };
        let mut v: Vec<i64> = (0..self.scores.len() as i64).collect();
        v.sort_by(|&x, &y| {
            let by_index = if lowest_first { x.cmp(&y) } else { y.cmp(&x) };
            score(y).total_cmp(&score(x)).then(by_index)
        });
        v.truncate(width);
        v
    }

    /// `chosen` in the order these scores rank it: highest first, the lowest index first among
    /// equals (the tie rule); an index outside the row last.
    pub fn order(&self, chosen: &[i64]) -> Vec<i64> {
        let score = |x: i64| self.scores.at(x).unwrap_or(f64::NEG_INFINITY);
        let mut v = chosen.to_vec();
        v.sort_by(|&x, &y| score(y).total_cmp(&score(x)).then(x.cmp(&y)));
        v
    }
}

/// A forced candidate's own choice `own` for row `row` of decision `name`, where it would have
/// decided otherwise than the reference `r` (whose choice its forced trace `c` took), measured
/// by the near-tie rule (docs/diff.md, "The near-tie rule"; `gate bisect` judges overrides by
/// it, docs/bisect.md): the gap the reference's own scores put between its choice and `own`,
/// beside the bound `F·h` of honest noise.
#[derive(Clone, Debug, PartialEq)]
pub struct OverrideGap {
    /// The largest `z_x − z_y` in the reference's scores over the pairs `own` inverts.
    pub gap: f64,
    /// max |reference − candidate| over the source row: read only to refuse a NaN or infinity.
    pub source_divergence: f64,
    /// The row's honest noise `h`: the noise reference's, else the policy's `near_tie.noise_abs`.
    pub honest_noise: f64,
    /// `noise_reference` or `policy`.
    pub honest_noise_from: &'static str,
    /// `F·h`, F the policy's `near_tie.margin_factor`.
    pub noise_bound: f64,
    /// The source tensor the scores were read from.
    pub source: String,
}

impl OverrideGap {
    /// Whether honest noise explains the override: gap ≤ F·h (an honest candidate's scores are
    /// within `h` of the reference's, so every pair it inverts is at most `2h` apart in them).
    pub fn within(&self) -> bool {
        self.gap <= self.noise_bound
    }
}

/// The near-tie rule's measures of a forced candidate's override (see [`OverrideGap`]), under
/// `policy`, `noise` the noise reference (tracegate's honest run of `r`). All the rule's checks
/// hold, or Err says which does not: a policy (by bits there are no near-ties); both traces
/// hold the decision's scores; the reference's scores pick its choice and the candidate's pick
/// `own` (up to what the stored scores cannot resolve); no NaN or infinity differs in the row;
/// an honest noise for the source. The bound is never the candidate's own difference: every
/// choice its own scores make is within twice that, whatever it is.
pub fn override_gap(
    r: &Trace,
    c: &Trace,
    name: &str,
    row: u64,
    own: &[i64],
    policy: Option<&Policy>,
    noise: Option<&Trace>,
) -> Result<OverrideGap, String> {
    let policy = policy.ok_or("judged by bits, which has no near-ties")?;
    let info = r
        .decision_info(name)
        .ok_or_else(|| format!("the reference holds no {name}"))?;
    let rows = info.rows();
    let width = info.count().checked_div(rows).unwrap_or(0) as usize;
    let values = r.decision_values(info);
    let a = values
        .chunks(width.max(1))
        .nth(row as usize)
        .ok_or_else(|| format!("the reference's {name} has no row {row}"))?;
    let source = source_tensor(name, r, c)
        .filter(|s| holds_scores(name, s))
        .ok_or_else(|| format!("the reference and the forced trace do not both hold the scores of {name} (router.logits: --capture internals)"))?;
    let range = source_row(name, &source, row, rows, r);
    let (zr, zc) = match (Scores::of(r, &source, range), Scores::of(c, &source, range)) {
        (Some(zr), Some(zc)) => (zr, zc),
        _ => return Err(format!("{source} is not a float tensor on both sides")),
    };
    let router = Name::parse(name).point == "router.topk";
    scores::picks(&zr, a, router).map_err(|e| {
        format!("the reference's own {source} row do not pick its choice {a:?}: they {e}")
    })?;
    scores::picks(&zc, own, router)
        .map_err(|e| format!("its own {source} row do not pick {own:?}: they {e}"))?;
    let d = range_divergence(r, c, &source, Some(range))
        .filter(|d| d.is_finite())
        .ok_or_else(|| format!("a NaN or infinity differs in {source} row {row}"))?;
    let gap = crossed_gap(&zr, a, own)
        .ok_or_else(|| {
            format!("{own:?} inverts no pair of the reference's choice {a:?}, or is not a choice of distinct indexes of {source}")
        })?;
    let (h, from) = honest_noise(r, noise, Some(policy), &source, range).ok_or_else(|| {
        format!("no honest noise bounds {source}: no noise reference measures it and the policy's near_tie.noise_abs has no pattern for it")
    })?;
    Ok(OverrideGap {
        gap,
        source_divergence: d,
        honest_noise: h,
        honest_noise_from: from.word(),
        noise_bound: policy.near_tie_factor() * h,
        source,
    })
}
