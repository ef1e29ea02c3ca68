//! The fast kernels of the two pairs that dominate traces: f32 against f32 (portable, or
//! [`super::avx512`]) and f32 against bf16 (portable, or [`super::avx2`]). Each gives the
//! careful path's statistics ([`super::scan`]), the float sums to the bit across kernels;
//! blocks with a NaN or an infinity are left to the careful path.

use super::median::{UlpCounts, Window};
use super::ordering::{BF16K, F32K};
use super::pair_stats::Stats;
use super::scan::{finish_chunk, scan_chunk, scan_chunk_mixed, scan_chunks, CHUNK};
#[cfg(target_arch = "x86_64")]
use super::{avx2, avx512};

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

pub(super) const LANES: usize = 16;

/// Per-lane float accumulators of the fast kernels. The f32 kernels use 16 (LANES): lane `i`
/// takes the elements at `i` mod 16, whatever the vector width, so every f32 kernel gives the
/// same sums to the bit. The f32/bf16 kernel uses 4, one AVX2 vector each: sixteen would not
/// fit the sixteen AVX2 registers.
pub(super) struct LaneSums<const N: usize> {
    pub(super) rr: [f64; N],
    pub(super) cc: [f64; N],
    pub(super) rc: [f64; N],
    pub(super) dd: [f64; N],
    pub(super) max_abs: [f64; N],
    // The largest d/|x| is kept as a fraction (num/den) and divided once at the end: a
    // comparison by cross-multiplication costs far less than a division per element.
    pub(super) rel_num: [f64; N],
    pub(super) rel_den: [f64; N],
}

impl<const N: usize> LaneSums<N> {
    pub(super) fn new() -> LaneSums<N> {
        let z = [0f64; N];
        LaneSums {
            rr: z,
            cc: z,
            rc: z,
            dd: z,
            max_abs: z,
            rel_num: z,
            rel_den: [1f64; N],
        }
    }

    /// Adds one finite pair (reference `x`, candidate `y`) to lane `i`.
    #[inline(always)]
    pub(super) fn add(&mut self, i: usize, x: f64, y: f64) {
        self.rr[i] += x * x;
        self.cc[i] += y * y;
        self.rc[i] += x * y;
        let d = (x - y).abs();
        self.dd[i] += d * d;
        self.max_abs[i] = self.max_abs[i].max(d);
        // x = 0 with d > 0 takes den = 0: the relative difference is +inf, as defined.
        let bigger = d * self.rel_den[i] > self.rel_num[i] * x.abs();
        self.rel_num[i] = if bigger { d } else { self.rel_num[i] };
        self.rel_den[i] = if bigger { x.abs() } else { self.rel_den[i] };
    }

    /// Adds the lanes into `s` in lane order.
    pub(super) fn fold_into(&self, s: &mut Stats) {
        for i in 0..N {
            s.rr += self.rr[i];
            s.cc += self.cc[i];
            s.rc += self.rc[i];
            s.dd += self.dd[i];
            s.max_abs = s.max_abs.max(self.max_abs[i]);
            if self.rel_num[i] > 0.0 {
                s.max_rel = s.max_rel.max(self.rel_num[i] / self.rel_den[i]);
            }
        }
    }
}

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

/// A finite f32 (bits) rounded to bf16, to nearest with ties to even: adding 0x7fff plus
/// the bit that becomes the last (bit 16) carries exactly when the dropped half is above
/// half, or at half with that bit odd; a carry into the exponent is the right result, up to
/// infinity. [`narrow`] is the general rule; a test checks that both agree.
#[inline(always)]
pub(super) fn f32_to_bf16(bits: u32) -> u32 {
    (bits + 0x7fff + ((bits >> 16) & 1)) >> 16
}

/// Float lanes of the f32/bf16 kernel (see [`LaneSums`]).
pub(super) const MIXED_LANES: usize = 4;

/// 16-bit float bits (in a u32) as an ordered integer.
#[inline(always)]
pub(super) fn ord16(bits: u32) -> i32 {
    let m = (bits & 0x7fff) as i32;
    let s = -(((bits >> 15) & 1) as i32);
    (m ^ s).wrapping_sub(s)
}

/// f32 bits as an ordered integer (any non-NaN value: |result| ≤ 0x7f800000, so two of them
/// are at most 0xff000000 apart and the distance fits a u32).
#[inline(always)]
pub(super) fn ord32(bits: u32) -> i32 {
    let m = (bits & 0x7fff_ffff) as i32;
    let s = (bits as i32) >> 31;
    (m ^ s).wrapping_sub(s)
}
