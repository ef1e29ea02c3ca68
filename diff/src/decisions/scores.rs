//! A decision row's scores, read from its source tensor, and the three questions the labels and
//! margins ask of them (docs/diff.md, "Labels" and "The near-tie rule"): which gap a flip
//! crossed in the reference's scores, whether a side's scores pick that side's choice, and
//! what margin a side's scores give its choice.

use tracegate_trace::{DType, Trace};

use super::source::row_range;
use crate::numeric;

/// Under a policy, the slack a margin gets beyond what its source row explains, relative to
/// max(1, |margin|): covers rounding of the subtraction and of the softmax (≈1e-7), and router
/// margins whose traces hold no `router.logits` (the fallback source is not the scores).
pub const MARGIN_SLACK: f64 = 1e-5;

/// One row of one side's source tensor: `len` scores of `dtype` starting at element `start`.
pub(super) struct Scores<'a> {
    dtype: DType,
    data: &'a [u8],
    start: u64,
    len: u64,
}

impl<'a> Scores<'a> {
    /// Row `range` of tensor `source` in `t` (the whole tensor when its first axis does not
    /// have that many rows), if `t` holds a float tensor of that name.
    pub(super) fn of(t: &'a Trace, source: &str, range: (u64, u64)) -> Option<Scores<'a>> {
        let info = t.tensor_info(source)?;
        significand_bits(info.dtype)?;
        let (start, end) = row_range(info, Some(range));
        Some(Scores {
            dtype: info.dtype,
            data: t.data(info),
            start,
            len: end - start,
        })
    }

    pub(super) fn len(&self) -> u64 {
        self.len
    }

    fn get(&self, i: u64) -> f64 {
        numeric::element_value(self.dtype, self.data, self.start + i)
    }

    /// The score of choice `v`, if `v` indexes this row.
    pub(super) fn at(&self, v: i64) -> Option<f64> {
        u64::try_from(v)
            .ok()
            .filter(|&i| i < self.len)
            .map(|i| self.get(i))
    }

    /// How far two stored scores of magnitude up to `x` can be from the values a producer
    /// compared before storing them: one step of the stored dtype at that magnitude each.
    fn rounding(&self, x: f64) -> f64 {
        2.0 * ulp_at(self.dtype, x)
    }

    /// The strongest score outside `chosen` (the tie rule's first: the lowest index among
    /// equals), as (index, score); None when every index is chosen.
    fn strongest_unchosen(&self, chosen: &[i64]) -> Option<(u64, f64)> {
        let mut best: Option<(u64, f64)> = None;
        for i in 0..self.len {
            if chosen.contains(&(i as i64)) {
                continue;
            }
            let z = self.get(i);
            // NaN never wins; `>` keeps the lowest index among equals.
            if best.is_none_or(|(_, b)| z > b || b.is_nan()) {
                best = Some((i, z));
            }
        }
        best
    }
}

/// Significand bits (with the implicit one) of a float dtype; None for integers.
fn significand_bits(d: DType) -> Option<i32> {
    match d {
        DType::F64 => Some(53),
        DType::F32 => Some(24),
        DType::F16 => Some(11),
        DType::BF16 => Some(8),
        _ => None,
    }
}

/// One unit in the last place of `dtype` at magnitude `x`, as for a normal number: a subnormal
/// magnitude gets a smaller step than its real one, so the slack is stricter there, never looser.
fn ulp_at(dtype: DType, x: f64) -> f64 {
    let bits = significand_bits(dtype).unwrap_or(53);
    let x = x.abs();
    if !x.is_finite() || x == 0.0 {
        return 0.0;
    }
    2f64.powi(x.log2().floor() as i32 - (bits - 1))
}

/// A choice is a list of distinct in-range indexes, in rank order.
fn valid_choice(s: &Scores, v: &[i64]) -> bool {
    v.iter()
        .enumerate()
        .all(|(i, &x)| u64::try_from(x).is_ok_and(|u| u < s.len) && !v[..i].contains(&x))
}

/// The largest gap in the reference's scores `s` between two indexes whose order a flip from
/// `a` (the reference's choice, rank order) to `b` (the candidate's) inverted: `x` ranked above
/// `y` by the reference (chosen before it, or chosen where `y` is not) and below it by the
/// candidate. Each score moved by at most `d`, so the candidate preferring `y` needs
/// `z_x − z_y ≤ 2d` (docs/diff.md, "The near-tie rule"). None when either choice is not a list
/// of distinct indexes of the row.
pub(super) fn crossed_gap(s: &Scores, a: &[i64], b: &[i64]) -> Option<f64> {
    if !valid_choice(s, a) || !valid_choice(s, b) {
        return None;
    }
    let rank = |v: &[i64], x: i64| v.iter().position(|&y| y == x).unwrap_or(v.len());
    let mut gap: Option<f64> = None;
    for &x in a {
        for &y in b {
            if x != y && rank(a, x) < rank(a, y) && rank(b, y) < rank(b, x) {
                let g = s.at(x)? - s.at(y)?;
                gap = Some(gap.map_or(g, |m: f64| if g > m || g.is_nan() { g } else { m }));
            }
        }
    }
    gap
}

/// Whether the scores `s` pick `chosen` (rank order), up to the rounding of the stored scores
/// (and, for a router, of the probabilities it ranks: `router`): every chosen score at least
/// the next one's, the weakest at least the strongest unchosen. Err says where they do not.
pub(super) fn picks(s: &Scores, chosen: &[i64], router: bool) -> Result<(), String> {
    if !valid_choice(s, chosen) {
        return Err(format!(
            "{chosen:?} is not a choice of distinct indexes below {}",
            s.len
        ));
    }
    let beats = |hi: (i64, f64), lo: (i64, f64)| beats(s, hi.1, lo.1, router);
    let scored: Vec<(i64, f64)> = chosen
        .iter()
        .map(|&x| (x, s.at(x).unwrap_or(f64::NAN)))
        .collect();
    for w in scored.windows(2) {
        if !beats(w[0], w[1]) {
            return Err(format!(
                "ranks {} (score {}) above {} (score {})",
                w[0].0, w[0].1, w[1].0, w[1].1
            ));
        }
    }
    if let (Some(&weakest), Some((i, z))) = (
        scored.iter().min_by(|a, b| a.1.total_cmp(&b.1)),
        s.strongest_unchosen(chosen),
    ) {
        if !beats(weakest, (i as i64, z)) {
            return Err(format!(
                "chose {} (score {}) over {i} (score {z})",
                weakest.0, weakest.1
            ));
        }
    }
    Ok(())
}

/// Whether score `hi` ranks at least as high as `lo` up to what the stored scores cannot resolve:
/// the rounding of the stored dtype at their magnitude and, for a router, the probabilities that
/// round to one value (ranked by index, whatever their logits' order).
fn beats(s: &Scores, hi: f64, lo: f64, router: bool) -> bool {
    let extra = if router {
        2f64.powi(1 - significand_bits(s.dtype).unwrap_or(53))
    } else {
        0.0
    };
    hi >= lo - (s.rounding(hi.abs().max(lo.abs())) + extra)
}

/// Whether the scores `s` tie indexes `x` and `y`: each ranks at least as high as the other up to
/// what [`picks`] cannot resolve, so either order is the scores' own (an exact tie, broken by
/// the tie rule of whoever ranked them). False when either is not an index of the row.
pub(super) fn tied(s: &Scores, x: i64, y: i64, router: bool) -> bool {
    match (s.at(x), s.at(y)) {
        (Some(a), Some(b)) => a == b || (beats(s, a, b, router) && beats(s, b, a, router)),
        _ => false,
    }
}

/// Whether a recorded margin `got` for `chosen` agrees with the margin the scores `s` give it
/// (docs/diff.md, "A recorded margin is a claim"): within `MARGIN_SLACK·max(1, |got|, |want|)`
/// plus the rounding of the stored scores. Err(want) where it does not; None without an unchosen
/// index.
pub(super) fn margin_agrees(
    s: &Scores,
    chosen: &[i64],
    router: bool,
    got: f64,
) -> Option<Result<(), f64>> {
    let (want, rounding) = margin_of(s, chosen, router)?;
    let slack = MARGIN_SLACK * 1f64.max(got.abs()).max(want.abs()) + rounding;
    let agrees = got == want || (got.is_nan() && want.is_nan()) || (got - want).abs() <= slack;
    Some(if agrees { Ok(()) } else { Err(want) })
}

/// The margin the scores `s` give `chosen` (docs/producers.md, "Forced decisions", for a choice
/// that is not the model's own): the score of the weakest chosen index minus that of the
/// strongest unchosen one; for a router, the same gap in the softmax probabilities of the
/// scores (docs/numerics.md §10). Computed in f64; None without an unchosen index.
pub(super) fn margin_of(s: &Scores, chosen: &[i64], router: bool) -> Option<(f64, f64)> {
    let weakest = chosen
        .iter()
        .filter_map(|&x| s.at(x))
        .min_by(|a, b| a.total_cmp(b))?;
    let (_, strongest) = s.strongest_unchosen(chosen)?;
    let magnitude = weakest.abs().max(strongest.abs());
    if !router {
        return Some((weakest - strongest, s.rounding(magnitude)));
    }
    let (mut max, mut top) = (f64::NEG_INFINITY, 0.0f64);
    for i in 0..s.len {
        let z = s.get(i);
        max = max.max(z);
        top = top.max(z.abs());
    }
    let sum: f64 = (0..s.len).map(|i| (s.get(i) - max).exp()).sum();
    let p = |z: f64| (z - max).exp() / sum;
    // A probability moves by at most the largest shift of the row's logits.
    Some((p(weakest) - p(strongest), s.rounding(top)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    fn scores(data: &[u8]) -> Scores<'_> {
        Scores {
            dtype: DType::F32,
            data,
            start: 0,
            len: (data.len() / 4) as u64,
        }
    }

    #[test]
    fn the_gap_is_read_from_the_scores_not_the_margin() {
        let d = row(&[5.0, 4.99999, -3.0, 1.0]);
        let s = scores(&d);
        // argmax 0 → 2: the reference's scores put 2 eight below 0.
        assert_eq!(crossed_gap(&s, &[0], &[2]), Some(8.0));
        assert_eq!(crossed_gap(&s, &[0], &[1]), Some(5.0 - 4.99999f32 as f64));
        // top-2 [0, 1] → [1, 2]: 0 fell below 1 and 2, 1 rose; the largest inverted gap is 0 over 2.
        assert_eq!(crossed_gap(&s, &[0, 1], &[1, 2]), Some(8.0));
        // The best swapped for the worst.
        assert_eq!(crossed_gap(&s, &[0, 1], &[2, 1]), Some(8.0));
        // Not a choice: duplicates, out of range, negative.
        assert_eq!(crossed_gap(&s, &[0, 1], &[2, 2]), None);
        assert_eq!(crossed_gap(&s, &[0], &[4]), None);
        assert_eq!(crossed_gap(&s, &[0], &[-1]), None);
    }

    #[test]
    fn picks_follows_the_tie_rule_up_to_rounding() {
        let d = row(&[5.0, 4.99999, -3.0, 1.0]);
        let s = scores(&d);
        assert!(picks(&s, &[0], false).is_ok());
        assert!(picks(&s, &[1], false).is_err());
        assert!(picks(&s, &[2], false).is_err());
        assert!(picks(&s, &[0, 1], true).is_ok());
        assert!(picks(&s, &[1, 0], true).is_err(), "4.99999 ranked above 5");
        assert!(picks(&s, &[0, 3], true).is_err(), "1 chosen over 4.99999");
        // One f32 step apart: the stored scores may have been rounded after the choice.
        let near = row(&[1.0, f32::from_bits(1.0f32.to_bits() + 1), 0.0]);
        assert!(picks(&scores(&near), &[0], false).is_ok());
    }

    #[test]
    fn a_tie_is_equal_scores_up_to_what_picks_cannot_resolve() {
        let up = |x: f32, n: u32| f32::from_bits(x.to_bits() + n);
        let d = row(&[0.25, 0.25, 0.125, up(0.25, 1), up(0.25, 4)]);
        let s = scores(&d);
        assert!(tied(&s, 0, 1, false) && tied(&s, 1, 0, false));
        assert!(!tied(&s, 0, 2, false));
        // One f32 step apart: the stored scores may have been rounded after the choice.
        assert!(tied(&s, 0, 3, false));
        assert!(!tied(&s, 0, 4, false), "four steps apart");
        // A router's logits this close give probabilities that round to one value.
        assert!(tied(&s, 0, 4, true));
        assert!(!tied(&s, 0, 2, true));
        assert!(!tied(&s, 0, 5, false), "not an index of the row");
    }

    #[test]
    fn margins_from_the_scores() {
        let d = row(&[2.0, 0.5, -1.0]);
        let s = scores(&d);
        assert_eq!(margin_of(&s, &[0], false).unwrap().0, 1.5);
        // A choice that is not the scores' own: negative (forced decisions).
        assert_eq!(margin_of(&s, &[1], false).unwrap().0, -1.5);
        let e: Vec<f64> = [2.0f64, 0.5, -1.0].iter().map(|z| z.exp()).collect();
        let sum: f64 = e.iter().sum();
        let (m, _) = margin_of(&s, &[0, 1], true).unwrap();
        assert!((m - (e[1] - e[2]) / sum).abs() < 1e-15);
    }
}
