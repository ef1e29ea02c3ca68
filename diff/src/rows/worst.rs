//! Where a tensor's difference is worst: the element a policy violation is shown at.
//!
//! The *worst element* of a differing tensor is, among the elements whose bits differ:
//! first any pair that differs by NaN or infinity (it has no finite |difference|; the first
//! such in index order), else the pair with the largest |reference − candidate| (computed in
//! f64, as `max_abs` is, so the worst element attains the tensor's `max_abs`), the first in
//! index order on ties. A tensor whose only differences are signed zeros has its first one.

use rayon::prelude::*;
use tracegate_trace::DType;

use crate::numeric::{
    element_value, Num, Pair, BF16K, F16K, F32K, F64K, I16K, I32K, I64K, I8K, U8K,
};

/// Elements per parallel work unit (as the scan's chunks: ties are settled by index, so the
/// answer does not depend on how the work is split).
const CHUNK: usize = 1 << 16;

/// The flat index of the worst element of two payloads of one shape; None when no element
/// differs. A mixed-precision pair compares real values (no two bit patterns are the same
/// number there), each read in its own dtype.
pub(crate) fn locate(pair: Pair, r: &[u8], c: &[u8]) -> Option<u64> {
    if pair.is_mixed() {
        return locate_mixed(pair, r, c);
    }
    match pair.reference {
        DType::F64 => locate_k::<F64K>(r, c),
        DType::F32 => locate_k::<F32K>(r, c),
        DType::F16 => locate_k::<F16K>(r, c),
        DType::BF16 => locate_k::<BF16K>(r, c),
        DType::I64 => locate_k::<I64K>(r, c),
        DType::I32 => locate_k::<I32K>(r, c),
        DType::I16 => locate_k::<I16K>(r, c),
        DType::I8 => locate_k::<I8K>(r, c),
        DType::U8 | DType::Bool => locate_k::<U8K>(r, c),
    }
}

fn locate_mixed(pair: Pair, r: &[u8], c: &[u8]) -> Option<u64> {
    let n = (r.len() / pair.reference.size()) as u64;
    let starts: Vec<u64> = (0..n).step_by(CHUNK).collect();
    starts
        .par_iter()
        .filter_map(|&base| {
            let mut best: Option<Candidate> = None;
            for index in base..(base + CHUNK as u64).min(n) {
                let (x, y) = (
                    element_value(pair.reference, r, index),
                    element_value(pair.candidate, c, index),
                );
                let nan_pair = x.is_nan() && y.is_nan();
                if x == y && x.is_sign_negative() == y.is_sign_negative() || nan_pair {
                    continue;
                }
                let nonfinite = !(x.is_finite() && y.is_finite());
                let here = Candidate {
                    index,
                    nonfinite,
                    abs: if nonfinite { 0.0 } else { (x - y).abs() },
                };
                best = Some(best.map_or(here, |b| worse(b, here)));
            }
            best
        })
        .reduce_with(worse)
        .map(|w| w.index)
}

/// How bad one differing pair is, and where: compared by (non-finite, |difference|), then the
/// lower index wins.
#[derive(Clone, Copy)]
struct Candidate {
    index: u64,
    nonfinite: bool,
    abs: f64,
}

/// The worse of two candidates; commutative and associative, so any reduction order agrees.
fn worse(a: Candidate, b: Candidate) -> Candidate {
    use std::cmp::Ordering::*;
    // |difference| of finite pairs is never NaN (it may be inf when an f64 subtraction overflows).
    let by_size = if a.nonfinite {
        Equal
    } else {
        a.abs.partial_cmp(&b.abs).unwrap_or(Equal)
    };
    match a.nonfinite.cmp(&b.nonfinite).then(by_size) {
        Greater => a,
        Less => b,
        Equal if a.index <= b.index => a,
        Equal => b,
    }
}

fn locate_k<K: Num>(r: &[u8], c: &[u8]) -> Option<u64> {
    debug_assert_eq!(r.len(), c.len());
    let bytes = CHUNK * K::SIZE;
    r.par_chunks(bytes)
        .zip(c.par_chunks(bytes))
        .enumerate()
        .filter_map(|(k, (a, b))| {
            let base = (k * CHUNK) as u64;
            let mut best: Option<Candidate> = None;
            for (i, (e, f)) in a
                .chunks_exact(K::SIZE)
                .zip(b.chunks_exact(K::SIZE))
                .enumerate()
            {
                let (x, y) = (K::bits(e), K::bits(f));
                if x == y {
                    continue;
                }
                let (xv, yv) = (K::to_f64(x), K::to_f64(y));
                let nonfinite = !(xv.is_finite() && yv.is_finite());
                let here = Candidate {
                    index: base + i as u64,
                    nonfinite,
                    abs: if nonfinite { 0.0 } else { (xv - yv).abs() },
                };
                best = Some(best.map_or(here, |b| worse(b, here)));
            }
            best
        })
        .reduce_with(worse)
        .map(|w| w.index)
}

/// [`locate`] over element ranges `[start, end)` of the two payloads (the rows a near-tie left
/// in the judgement): the same order, so the answer is the worst element among those rows.
pub(crate) fn locate_in(pair: Pair, r: &[u8], c: &[u8], ranges: &[(u64, u64)]) -> Option<u64> {
    let (rs, cs) = (pair.reference.size(), pair.candidate.size());
    ranges
        .iter()
        .filter_map(|&(start, end)| {
            let (a, b) = (
                &r[start as usize * rs..end as usize * rs],
                &c[start as usize * cs..end as usize * cs],
            );
            let index = start + locate(pair, a, b)?;
            let (x, y) = (
                element_value(pair.reference, r, index),
                element_value(pair.candidate, c, index),
            );
            let nonfinite = !(x.is_finite() && y.is_finite());
            Some(Candidate {
                index,
                nonfinite,
                abs: if nonfinite { 0.0 } else { (x - y).abs() },
            })
        })
        .reduce(worse)
        .map(|w| w.index)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32s(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn largest_difference_wins_first_on_ties() {
        let r = f32s(&[1.0, 2.0, 3.0, 4.0, 5.0]);
        // |diff|: 0.5 at 1, 2 at 2, 0 at 0 and 4, 2 at 3 (a tie with 2: the lower index wins).
        let c = f32s(&[1.0, 2.5, 5.0, 2.0, 5.0]);
        assert_eq!(locate(Pair::same(DType::F32), &r, &c), Some(2));
        assert_eq!(
            locate(Pair::same(DType::F32), &r, &r),
            None,
            "no differing bits, no worst element"
        );
    }

    #[test]
    fn nan_or_infinity_outranks_any_finite_difference() {
        let r = f32s(&[0.0, 1.0, 1.0, 1.0]);
        let c = f32s(&[-0.0, 1e30, f32::INFINITY, f32::NAN]);
        assert_eq!(locate(Pair::same(DType::F32), &r, &c), Some(2));
        // Only a signed zero differs: it is the worst (and first) differing element.
        let c = f32s(&[-0.0, 1.0, 1.0, 1.0]);
        assert_eq!(locate(Pair::same(DType::F32), &r, &c), Some(0));
    }

    #[test]
    fn across_dtypes_the_largest_real_difference_wins() {
        // bf16 candidate against f32: 1.0 vs 1.0 equal; 2.001 vs 2.0 differs by 0.001; 3.0 vs
        // 3.0078125 (one bf16 step above 3) by 0.0078125, the worst.
        let r = f32s(&[1.0, 2.001, 3.0]);
        let c: Vec<u8> = [0x3f80u16, 0x4000, 0x4041]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let pair = Pair::new(DType::F32, DType::BF16).unwrap();
        assert_eq!(locate(pair, &r, &c), Some(2));
        assert_eq!(locate_in(pair, &r, &c, &[(0, 2)]), Some(1));
        assert_eq!(
            locate_in(pair, &r, &c, &[(0, 1)]),
            None,
            "equal values: nothing differs"
        );
    }

    #[test]
    fn chunk_boundaries_do_not_change_the_answer() {
        // Equal worst differences in two chunks: the earlier one, whichever chunk finishes first.
        let n = 3 * CHUNK + 7;
        let r = vec![0i32; n];
        let mut c = r.clone();
        c[CHUNK + 3] = 9;
        c[2 * CHUNK + 1] = -9;
        c[5] = 4;
        let bytes = |v: &[i32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        assert_eq!(
            locate(Pair::same(DType::I32), &bytes(&r), &bytes(&c)),
            Some(CHUNK as u64 + 3)
        );
        // Left out of the judgement, the worst row no longer counts; the later 9 is the worst.
        let (rb, cb) = (bytes(&r), bytes(&c));
        assert_eq!(
            locate_in(
                Pair::same(DType::I32),
                &rb,
                &cb,
                &[(0, CHUNK as u64), (2 * CHUNK as u64, n as u64)]
            ),
            Some(2 * CHUNK as u64 + 1)
        );
        assert_eq!(
            locate_in(Pair::same(DType::I32), &rb, &cb, &[(6, CHUNK as u64)]),
            None
        );
    }
}
