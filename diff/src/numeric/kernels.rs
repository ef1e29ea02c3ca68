//! The portable fast kernels of the two pairs that dominate traces: f32 against f32 (its
//! intrinsics version: `avx512`) and f32 against bf16 (`avx2`); `scan` picks one per CPU. Each
//! gives the careful path's statistics (`chunk`), the float sums to the bit across kernels;
//! blocks with a NaN or an infinity are left to the careful path.

use super::chunk::{finish_chunk, scan_chunk, scan_chunk_mixed, CHUNK};
use super::counts::{UlpCounts, Window};
use super::lanes::{f32_to_bf16, ord16, ord32, LaneSums, LANES, MIXED_LANES};
use super::ordering::{BF16K, F32K};
use super::pair_stats::Stats;

/// The portable f32 kernel: 16 lanes per block with fixed per-lane accumulators and
/// branch-free ULPs.
#[inline(always)]
pub(super) fn scan_chunk_f32(
    r: &[u8],
    c: &[u8],
    base: u64,
    mut ulps: Option<&mut UlpCounts>,
) -> Stats {
    let mut s = Stats::new();
    let n = r.len() / 4;
    assert!(n <= CHUNK, "one chunk at a time");
    let mut lanes = LaneSums::<LANES>::new();
    let (mut max_ulp, mut differing, mut signed_zero) =
        ([0u32; LANES], [0u32; LANES], [0u32; LANES]);
    let mut nonfinite = [0u64; CHUNK / LANES / 64];
    let window = ulps.as_ref().map_or(Window::SMALL, |u| u.window);
    let (lo, last) = window.as_u32();
    let mut rb = r.chunks_exact(4 * LANES);
    let mut cb = c.chunks_exact(4 * LANES);
    for (blk, (ra, ca)) in (&mut rb).zip(&mut cb).enumerate() {
        let mut a = [0u32; LANES];
        let mut b = [0u32; LANES];
        for i in 0..LANES {
            a[i] = u32::from_le_bytes(ra[4 * i..4 * i + 4].try_into().unwrap());
            b[i] = u32::from_le_bytes(ca[4 * i..4 * i + 4].try_into().unwrap());
        }
        let mut nonfinite_block = false;
        for i in 0..LANES {
            nonfinite_block |=
                (a[i] & 0x7f80_0000 == 0x7f80_0000) | (b[i] & 0x7f80_0000 == 0x7f80_0000);
        }
        if nonfinite_block {
            nonfinite[blk / 64] |= 1 << (blk % 64);
            continue;
        }
        let mut dist = [0u32; LANES];
        let mut diff = [false; LANES];
        for i in 0..LANES {
            let (oa, ob) = (ord32(a[i]), ord32(b[i]));
            let u = if oa >= ob {
                oa.wrapping_sub(ob) as u32
            } else {
                ob.wrapping_sub(oa) as u32
            };
            (dist[i], diff[i]) = (u, a[i] != b[i]);
            max_ulp[i] = max_ulp[i].max(u);
            differing[i] += diff[i] as u32;
            signed_zero[i] += (diff[i] & (u == 0)) as u32;
            lanes.add(i, f32::from_bits(a[i]) as f64, f32::from_bits(b[i]) as f64);
        }
        if let Some(u) = ulps.as_deref_mut() {
            for i in 0..LANES {
                u.below += (diff[i] & (dist[i] < lo)) as u64;
                let offset = dist[i].wrapping_sub(lo);
                if diff[i] & (offset <= last) {
                    u.bump((offset >> window.shift) as usize, i);
                }
            }
        }
    }
    lanes.fold_into(&mut s);
    for i in 0..LANES {
        s.max_ulp = s.max_ulp.max(max_ulp[i] as u64);
        s.differing += differing[i] as u64;
        s.signed_zero += signed_zero[i] as u64;
    }
    let done = n - n % LANES;
    s.first = r[..4 * done]
        .chunks_exact(4)
        .zip(c[..4 * done].chunks_exact(4))
        .position(|(x, y)| x != y)
        .map(|i| base + i as u64);
    finish_chunk(
        s,
        &nonfinite,
        (r, c),
        (4, 4),
        base,
        ulps,
        scan_chunk::<F32K>,
    )
}

/// One chunk of f32 against bf16 (`REF_F32`: the reference is the f32 side). With no NaN or
/// infinity in a block, the bf16 value's f32 bits are its bits shifted up 16 (exact), so an
/// element differs when those differ from the f32's, and its distance is between the f32
/// rounded to bf16 ([`f32_to_bf16`]) and the bf16, as ordered 16-bit integers.
#[inline(always)]
pub(super) fn scan_chunk_f32_bf16<const REF_F32: bool>(
    r: &[u8],
    c: &[u8],
    base: u64,
    mut ulps: Option<&mut UlpCounts>,
) -> Stats {
    let (wide, short) = if REF_F32 { (r, c) } else { (c, r) };
    let n = short.len() / 2;
    assert!(
        n <= CHUNK && wide.len() == 4 * n,
        "one chunk of equal element counts at a time"
    );
    let mut lanes = LaneSums::<MIXED_LANES>::new();
    let (mut max_ulp, mut differing, mut signed_zero) = (
        [0u32; MIXED_LANES],
        [0u32; MIXED_LANES],
        [0u32; MIXED_LANES],
    );
    let mut nonfinite = [0u64; CHUNK / LANES / 64];
    let mut first = None;
    let window = ulps.as_ref().map_or(Window::SMALL, |u| u.window);
    let (lo, last) = window.as_u32();
    for (blk, (wa, sa)) in wide
        .chunks_exact(4 * LANES)
        .zip(short.chunks_exact(2 * LANES))
        .enumerate()
    {
        let mut a = [0u32; LANES];
        let mut h = [0u32; LANES];
        for i in 0..LANES {
            a[i] = u32::from_le_bytes(wa[4 * i..4 * i + 4].try_into().unwrap());
            h[i] = u16::from_le_bytes(sa[2 * i..2 * i + 2].try_into().unwrap()) as u32;
        }
        let mut nonfinite_block = false;
        for i in 0..LANES {
            nonfinite_block |= (a[i] & 0x7f80_0000 == 0x7f80_0000) | (h[i] & 0x7f80 == 0x7f80);
        }
        if nonfinite_block {
            nonfinite[blk / 64] |= 1 << (blk % 64);
            continue;
        }
        let mut dist = [0u32; LANES];
        let mut diff = [false; LANES];
        // Four at a time in index order, lane j of every accumulator taking element 4g + j,
        // as the AVX2 kernel adds them.
        for g in 0..LANES / MIXED_LANES {
            let (mut x, mut y) = ([0f64; MIXED_LANES], [0f64; MIXED_LANES]);
            for j in 0..MIXED_LANES {
                let i = MIXED_LANES * g + j;
                let w = h[i] << 16;
                let u = ord16(f32_to_bf16(a[i])).abs_diff(ord16(h[i]));
                (dist[i], diff[i]) = (u, a[i] != w);
                max_ulp[j] = max_ulp[j].max(u);
                differing[j] += diff[i] as u32;
                signed_zero[j] += (diff[i] & ((a[i] | w) & 0x7fff_ffff == 0)) as u32;
                let (fa, fh) = (f32::from_bits(a[i]) as f64, f32::from_bits(w) as f64);
                (x[j], y[j]) = if REF_F32 { (fa, fh) } else { (fh, fa) };
            }
            for j in 0..MIXED_LANES {
                lanes.add(j, x[j], y[j]);
            }
        }
        if first.is_none() {
            first = diff
                .iter()
                .position(|&d| d)
                .map(|i| base + (LANES * blk + i) as u64);
        }
        if let Some(u) = ulps.as_deref_mut() {
            for i in 0..LANES {
                u.below += (diff[i] & (dist[i] < lo)) as u64;
                let offset = dist[i].wrapping_sub(lo);
                if diff[i] & (offset <= last) {
                    u.bump((offset >> window.shift) as usize, i);
                }
            }
        }
    }
    let mut s = Stats::new();
    lanes.fold_into(&mut s);
    for j in 0..MIXED_LANES {
        s.max_ulp = s.max_ulp.max(max_ulp[j] as u64);
        s.differing += differing[j] as u64;
        s.signed_zero += signed_zero[j] as u64;
    }
    s.first = first;
    finish_f32_bf16_chunk::<REF_F32>(s, &nonfinite, r, c, base, ulps)
}

/// [`finish_chunk`] for f32 against bf16, in either order.
pub(super) fn finish_f32_bf16_chunk<const REF_F32: bool>(
    s: Stats,
    nonfinite: &[u64; CHUNK / LANES / 64],
    r: &[u8],
    c: &[u8],
    base: u64,
    ulps: Option<&mut UlpCounts>,
) -> Stats {
    if REF_F32 {
        finish_chunk(
            s,
            nonfinite,
            (r, c),
            (4, 2),
            base,
            ulps,
            scan_chunk_mixed::<F32K, BF16K>,
        )
    } else {
        finish_chunk(
            s,
            nonfinite,
            (r, c),
            (2, 4),
            base,
            ulps,
            scan_chunk_mixed::<BF16K, F32K>,
        )
    }
}
