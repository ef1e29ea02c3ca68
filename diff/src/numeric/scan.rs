//! The per-tensor scan: statistics of a tensor pair gathered chunk by chunk on the rayon pool,
//! by the careful element-by-element path (`chunk`) or, for f32 and f32/bf16, a fast kernel
//! (`kernels`, or `avx512` / `avx2` where the CPU has them).

use rayon::prelude::*;
use tracegate_trace::DType;

#[cfg(target_arch = "x86_64")]
use super::avx2;
#[cfg(target_arch = "x86_64")]
use super::avx512;
use super::chunk::{scan_chunk, scan_chunk_mixed, CHUNK};
use super::counts::{UlpCounts, Window};
use super::kernels::{scan_chunk_f32, scan_chunk_f32_bf16};
use super::ordering::{
    dispatch, with_float, Num, Pair, BF16K, F16K, F32K, F64K, I16K, I32K, I64K, I8K, U8K,
};
use super::pair_stats::Stats;

/// Runs `kernel` over [`CHUNK`]-element pieces of both payloads on the rayon pool, counting
/// distances in `window` when one is given. Statistics are merged in chunk order, so float
/// sums do not depend on the thread count; counts are integers and are summed per thread.
/// `sizes` are the reference's and the candidate's element sizes (they differ for mixed dtypes).
pub(super) fn scan_chunks(
    r: &[u8],
    c: &[u8],
    sizes: (usize, usize),
    window: Option<Window>,
    kernel: impl Fn(&[u8], &[u8], u64, Option<&mut UlpCounts>) -> Stats + Sync,
) -> (Stats, Option<UlpCounts>) {
    let (mut parts, ulps) = r
        .par_chunks(CHUNK * sizes.0)
        .zip(c.par_chunks(CHUNK * sizes.1))
        .enumerate()
        .fold(
            || (Vec::new(), window.map(UlpCounts::new)),
            |(mut parts, mut ulps), (i, (a, b))| {
                parts.push((i, kernel(a, b, (i * CHUNK) as u64, ulps.as_mut())));
                (parts, ulps)
            },
        )
        .reduce(
            || (Vec::new(), None),
            |(mut p, u), (q, v)| {
                p.extend(q);
                let merged = match (u, v) {
                    (Some(u), Some(v)) => Some(u.merge(v)),
                    (u, v) => u.or(v),
                };
                (p, merged)
            },
        );
    parts.sort_unstable_by_key(|p| p.0);
    (
        parts
            .into_iter()
            .map(|p| p.1)
            .fold(Stats::new(), Stats::merge),
        ulps,
    )
}

pub(super) fn scan_k<K: Num>(
    r: &[u8],
    c: &[u8],
    window: Option<Window>,
) -> (Stats, Option<UlpCounts>) {
    scan_chunks(r, c, (K::SIZE, K::SIZE), window, scan_chunk::<K>)
}

/// Scans two payloads of the same element count; with `count`, also counts the ULP distances
/// that [`median_ulp`] needs, in a window placed from a sample first.
pub(crate) fn scan(pair: Pair, r: &[u8], c: &[u8], count: bool) -> (Stats, Option<UlpCounts>) {
    scan_window(pair, r, c, count.then(|| Window::place(pair, r, c)))
}

pub(super) fn scan_window(
    pair: Pair,
    r: &[u8],
    c: &[u8],
    window: Option<Window>,
) -> (Stats, Option<UlpCounts>) {
    debug_assert_eq!(
        r.len() / pair.reference.size(),
        c.len() / pair.candidate.size()
    );
    match (pair.reference, pair.candidate) {
        (DType::F32, DType::F32) => scan_f32(r, c, window),
        (DType::F32, DType::BF16) => scan_f32_bf16::<true>(r, c, window),
        (DType::BF16, DType::F32) => scan_f32_bf16::<false>(r, c, window),
        (dtype, same) if dtype == same => dispatch!(dtype, scan_k, r, c, window),
        (rt, ct) => with_float!(rt, A => with_float!(ct, B => {
            scan_chunks(r, c, (A::SIZE, B::SIZE), window, scan_chunk_mixed::<A, B>)
        })),
    }
}

/// f32, the dtype of nearly every activation, gets fast kernels: AVX-512 intrinsics where the
/// CPU has them, else portable code the compiler vectorises. Blocks holding a NaN or an
/// infinity take the careful path.
pub(super) fn scan_f32(r: &[u8], c: &[u8], window: Option<Window>) -> (Stats, Option<UlpCounts>) {
    #[cfg(target_arch = "x86_64")]
    let avx512 = std::is_x86_feature_detected!("avx512f")
        && std::is_x86_feature_detected!("avx512dq")
        && std::is_x86_feature_detected!("popcnt");
    scan_chunks(r, c, (4, 4), window, |a, b, base, ulps| {
        if a == b {
            return scan_chunk::<F32K>(a, b, base, ulps);
        }
        #[cfg(target_arch = "x86_64")]
        if avx512 {
            // SAFETY: the CPU has every feature the kernel enables (checked above).
            return unsafe {
                match ulps {
                    Some(u) => avx512::scan_chunk_f32::<true>(a, b, base, Some(u)),
                    None => avx512::scan_chunk_f32::<false>(a, b, base, None),
                }
            };
        }
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2 (checked just above).
            return unsafe { scan_chunk_f32_avx2(a, b, base, ulps) };
        }
        scan_chunk_f32(a, b, base, ulps)
    })
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn scan_chunk_f32_avx2(
    r: &[u8],
    c: &[u8],
    base: u64,
    ulps: Option<&mut UlpCounts>,
) -> Stats {
    scan_chunk_f32(r, c, base, ulps)
}

/// f32 against bf16 (either side), the pair of a bf16 port: AVX2 intrinsics where the CPU
/// has them, else a portable kernel with the same arithmetic lane for lane (the same sums to
/// the bit; a test checks it). The compiler vectorised the portable one only in part, keeping
/// its accumulators in memory, hence the intrinsics. Blocks holding a NaN or an infinity take
/// the careful path, [`scan_chunk_mixed`].
pub(super) fn scan_f32_bf16<const REF_F32: bool>(
    r: &[u8],
    c: &[u8],
    window: Option<Window>,
) -> (Stats, Option<UlpCounts>) {
    let sizes = if REF_F32 { (4, 2) } else { (2, 4) };
    #[cfg(target_arch = "x86_64")]
    let avx2 = std::is_x86_feature_detected!("avx2")
        && std::is_x86_feature_detected!("fma")
        && std::is_x86_feature_detected!("popcnt");
    scan_chunks(r, c, sizes, window, |a, b, base, ulps| {
        #[cfg(target_arch = "x86_64")]
        if avx2 {
            // SAFETY: the CPU has every feature the kernel enables (checked above).
            return unsafe {
                match ulps {
                    Some(u) => avx2::scan_chunk_f32_bf16::<REF_F32, true>(a, b, base, Some(u)),
                    None => avx2::scan_chunk_f32_bf16::<REF_F32, false>(a, b, base, None),
                }
            };
        }
        scan_chunk_f32_bf16::<REF_F32>(a, b, base, ulps)
    })
}

/// Scans the elements `[start, end)` of the reference payload against those of `c_range` in the
/// candidate's (the same range, except for a rerouted expert's rows): the rows a near-tie leaves
/// in, a rerouted expert's rows, the noise reference's measure over either.
pub(crate) fn scan_range(
    pair: Pair,
    rd: &[u8],
    cd: &[u8],
    (start, end): (u64, u64),
    (c_start, c_end): (u64, u64),
) -> Stats {
    let (rs, cs) = (pair.reference.size(), pair.candidate.size());
    let (a, b) = (
        &rd[start as usize * rs..end as usize * rs],
        &cd[c_start as usize * cs..c_end as usize * cs],
    );
    scan(pair, a, b, false).0
}
