//! Where a tensor's difference is worst: the element a policy violation is shown at.
//!
//! The *worst element* of a differing tensor is, among the elements whose bits differ:
//! first any pair that differs by NaN or infinity (it has no finite |difference|; the first
//! such in index order), else the pair with the largest |reference − candidate| (computed in
//! f64, as `max_abs` is, so the worst element attains the tensor's `max_abs`), the first in
//! index order on ties. A tensor whose only differences are signed zeros has its first one.

use rayon::prelude::*;
use tracegate_trace::DType;

use crate::numeric::{Num, BF16K, F16K, F32K, F64K, I16K, I32K, I64K, I8K, U8K};

/// Elements per parallel work unit (as the scan's chunks: ties are settled by index, so the
/// answer does not depend on how the work is split).
const CHUNK: usize = 1 << 16;

/// The flat index of the worst element of two equal-length payloads; None when no bits differ.
pub(crate) fn locate(dtype: DType, r: &[u8], c: &[u8]) -> Option<u64> {
    match dtype {
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
    let by_size = if a.nonfinite { Equal } else { a.abs.partial_cmp(&b.abs).unwrap_or(Equal) };
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
            for (i, (e, f)) in a.chunks_exact(K::SIZE).zip(b.chunks_exact(K::SIZE)).enumerate() {
                let (x, y) = (K::bits(e), K::bits(f));
                if x == y {
                    continue;
                }
                let (xv, yv) = (K::to_f64(x), K::to_f64(y));
                let nonfinite = !(xv.is_finite() && yv.is_finite());
                let here = Candidate { index: base + i as u64, nonfinite, abs: if nonfinite { 0.0 } else { (xv - yv).abs() } };
                best = Some(best.map_or(here, |b| worse(b, here)));
            }
            best
        })
        .reduce_with(worse)
        .map(|w| w.index)
}

/// [`locate`] over element ranges `[start, end)` of the two payloads (the rows a near-tie left
/// in the judgement): the same order, so the answer is the worst element among those rows.
pub(crate) fn locate_in(dtype: DType, r: &[u8], c: &[u8], ranges: &[(u64, u64)]) -> Option<u64> {
    let size = dtype.size();
    ranges
        .iter()
        .filter_map(|&(start, end)| {
            let span = start as usize * size..end as usize * size;
            let index = start + locate(dtype, &r[span.clone()], &c[span])?;
            let (x, y) = (crate::numeric::element_value(dtype, r, index), crate::numeric::element_value(dtype, c, index));
            let nonfinite = !(x.is_finite() && y.is_finite());
            Some(Candidate { index, nonfinite, abs: if nonfinite { 0.0 } else { (x - y).abs() } })
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
        assert_eq!(locate(DType::F32, &r, &c), Some(2));
        assert_eq!(locate(DType::F32, &r, &r), None, "no differing bits, no worst element");
    }

    #[test]
    fn nan_or_infinity_outranks_any_finite_difference() {
        let r = f32s(&[0.0, 1.0, 1.0, 1.0]);
        let c = f32s(&[-0.0, 1e30, f32::INFINITY, f32::NAN]);
        assert_eq!(locate(DType::F32, &r, &c), Some(2));
        // Only a signed zero differs: it is the worst (and first) differing element.
        let c = f32s(&[-0.0, 1.0, 1.0, 1.0]);
        assert_eq!(locate(DType::F32, &r, &c), Some(0));
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
        assert_eq!(locate(DType::I32, &bytes(&r), &bytes(&c)), Some(CHUNK as u64 + 3));
        // Left out of the judgement, the worst row no longer counts; the later 9 is the worst.
        let (rb, cb) = (bytes(&r), bytes(&c));
        assert_eq!(locate_in(DType::I32, &rb, &cb, &[(0, CHUNK as u64), (2 * CHUNK as u64, n as u64)]), Some(2 * CHUNK as u64 + 1));
        assert_eq!(locate_in(DType::I32, &rb, &cb, &[(6, CHUNK as u64)]), None);
    }
}
