use super::*;

#[test]
fn f32_fast_kernel_agrees_with_the_careful_path() {
    // Mixed: equal runs, small and huge ULPs, signed zeros, NaNs, infinities, zeros, a tail.
    let n = 3 * CHUNK + 37;
    let mut r = Vec::new();
    let mut c = Vec::new();
    for i in 0..n {
        let x = (((i * 2654435761usize) >> 5) % 20001) as f32 / 100.0 - 100.0;
        let mut a = x.to_bits();
        let mut b = match i % 7 {
            0 | 1 => a,
            2 => a.wrapping_add((i % 500) as u32),
            3 => (-x).to_bits(),
            4 => (x * 1.5).to_bits(),
            5 => a ^ 1,
            _ => a,
        };
        match i % 1009 {
            0 => (a, b) = (0, 0x8000_0000),
            1 => b = 0x7fc0_0000,
            2 => (a, b) = (0x7fc0_0000, 0x7fc0_0001),
            3 => b = f32::INFINITY.to_bits(),
            4 => (a, b) = (0, 1),
            _ => {}
        }
        r.extend_from_slice(&a.to_le_bytes());
        c.extend_from_slice(&b.to_le_bytes());
    }
    let counts = |u: &UlpCounts| {
        (
            u.below,
            (0..BUCKETS).map(|k| u.bucket(k)).collect::<Vec<_>>(),
        )
    };
    for window in [
        Window::place(F32, &r, &c),
        Window::SMALL,
        Window {
            lo: 100,
            shift: 3,
            buckets: 77,
        },
        Window {
            lo: 1 << 20,
            shift: 9,
            buckets: BUCKETS as u32,
        },
    ] {
        let (fast, fast_ulps) = scan_f32(&r, &c, Some(window));
        let (careful, careful_ulps) = scan_k::<F32K>(&r, &c, Some(window));
        assert_eq!(
            (
                fast.total,
                fast.differing,
                fast.first,
                fast.max_ulp,
                fast.signed_zero,
                fast.nan_mismatch,
                fast.nan_payload,
                fast.infinity
            ),
            (
                careful.total,
                careful.differing,
                careful.first,
                careful.max_ulp,
                careful.signed_zero,
                careful.nan_mismatch,
                careful.nan_payload,
                careful.infinity
            )
        );
        assert_eq!(
            (fast.max_abs, fast.max_rel),
            (careful.max_abs, careful.max_rel)
        );
        for (x, y) in [
            (fast.rr, careful.rr),
            (fast.cc, careful.cc),
            (fast.rc, careful.rc),
            (fast.dd, careful.dd),
        ] {
            assert!((x - y).abs() <= 1e-12 * y.abs(), "{x} vs {y}");
        }
        let (fast_ulps, careful_ulps) = (fast_ulps.unwrap(), careful_ulps.unwrap());
        assert_eq!(counts(&fast_ulps), counts(&careful_ulps), "{window:?}");
        assert_eq!(
            median_ulp(F32, &r, &c, &fast, &fast_ulps),
            sorted_median(F32, &r, &c)
        );
    }
    // The AVX-512 kernel and the portable one: the same statistics to the bit, chunk by chunk.
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512f")
        && std::is_x86_feature_detected!("avx512dq")
        && std::is_x86_feature_detected!("popcnt")
    {
        let window = Window::place(F32, &r, &c);
        for (k, (a, b)) in r.chunks(4 * CHUNK).zip(c.chunks(4 * CHUNK)).enumerate() {
            let (mut u, mut v) = (UlpCounts::new(window), UlpCounts::new(window));
            // SAFETY: the CPU has the features (checked above).
            let x = unsafe { avx512::scan_chunk_f32::<true>(a, b, 0, Some(&mut u)) };
            let y = scan_chunk_f32(a, b, 0, Some(&mut v));
            let bits = |s: &Stats| [s.rr, s.cc, s.rc, s.dd, s.max_abs, s.max_rel].map(f64::to_bits);
            assert_eq!(bits(&x), bits(&y), "chunk {k}");
            assert_eq!(
                (x.differing, x.first, x.max_ulp, x.signed_zero, x.infinity),
                (y.differing, y.first, y.max_ulp, y.signed_zero, y.infinity)
            );
            assert_eq!(counts(&u), counts(&v), "chunk {k}");
        }
    } else {
        not_checked(
            "this CPU lacks avx512f/avx512dq/popcnt, so the AVX-512 kernel cannot run here",
        );
    }
    #[cfg(not(target_arch = "x86_64"))]
    not_checked("not an x86_64 build, so there is no AVX-512 kernel");
}

#[test]
fn the_bf16_kernel_rounding_is_the_general_rule() {
    // Every 997th finite f32 bit pattern, and the ties around each bf16 step boundary.
    let mut checked = 0;
    let mut check = |a: u32| {
        if a & 0x7f80_0000 != 0x7f80_0000 {
            assert_eq!(
                f32_to_bf16(a) as u64,
                round_to::<F32K>(BF16K::FORMAT, a as u64),
                "{a:#010x}"
            );
            checked += 1;
        }
    };
    for a in (0..=u32::MAX).step_by(997) {
        check(a);
    }
    for hi in (0..=0xffffu32).step_by(61) {
        for lo in [0x7fff, 0x8000, 0x8001] {
            check(hi << 16 | lo);
        }
    }
    assert!(checked > 4_000_000);
}

#[test]
fn f32_bf16_kernel_agrees_with_the_careful_path() {
    let n = 3 * CHUNK + 37;
    let (w, h) = f32_bf16_pairs(n);
    let counts = |u: &UlpCounts| {
        (
            u.below,
            (0..BUCKETS).map(|k| u.bucket(k)).collect::<Vec<_>>(),
        )
    };
    for (pair, r, c) in [
        (
            Pair {
                reference: DType::F32,
                candidate: DType::BF16,
            },
            &w,
            &h,
        ),
        (
            Pair {
                reference: DType::BF16,
                candidate: DType::F32,
            },
            &h,
            &w,
        ),
    ] {
        for window in [
            Window::place(pair, r, c),
            Window::SMALL,
            Window {
                lo: 100,
                shift: 3,
                buckets: 77,
            },
        ] {
            let (fast, fast_ulps) = scan_window(pair, r, c, Some(window));
            let (careful, careful_ulps) = if pair.reference == DType::F32 {
                scan_chunks(r, c, (4, 2), Some(window), scan_chunk_mixed::<F32K, BF16K>)
            } else {
                scan_chunks(r, c, (2, 4), Some(window), scan_chunk_mixed::<BF16K, F32K>)
            };
            let ints = |s: &Stats| {
                (
                    s.total,
                    s.differing,
                    s.first,
                    s.max_ulp,
                    s.signed_zero,
                    s.nan_mismatch,
                    s.nan_payload,
                    s.infinity,
                )
            };
            assert_eq!(ints(&fast), ints(&careful), "{pair:?}");
            assert!(
                fast.differing > 0
                    && fast.signed_zero > 0
                    && fast.nan_payload > 0
                    && fast.infinity > 0
            );
            assert_eq!(
                (fast.max_abs, fast.max_rel),
                (careful.max_abs, careful.max_rel)
            );
            for (x, y) in [
                (fast.rr, careful.rr),
                (fast.cc, careful.cc),
                (fast.rc, careful.rc),
                (fast.dd, careful.dd),
            ] {
                assert!((x - y).abs() <= 1e-12 * y.abs(), "{x} vs {y}");
            }
            assert_eq!(
                counts(&fast_ulps.unwrap()),
                counts(&careful_ulps.unwrap()),
                "{pair:?} {window:?}"
            );
        }
    }
    // The AVX2 kernel and the portable one: the same statistics to the bit, chunk by chunk,
    // counting or not (without counting, a chunk holding a NaN is scanned again).
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2")
        && std::is_x86_feature_detected!("fma")
        && std::is_x86_feature_detected!("popcnt")
    {
        let window = Window::place(
            Pair {
                reference: DType::F32,
                candidate: DType::BF16,
            },
            &w,
            &h,
        );
        // One chunk with no NaN or infinity at all, beside the mixed ones.
        let (wc, hc) = (
            0x3f80_0001u32.to_le_bytes().repeat(CHUNK),
            0x3f80u16.to_le_bytes().repeat(CHUNK),
        );
        let chunks: Vec<(&[u8], &[u8])> = w
            .chunks(4 * CHUNK)
            .zip(h.chunks(2 * CHUNK))
            .chain([(&wc[..], &hc[..])])
            .collect();
        let bits = |s: &Stats| {
            (
                [s.rr, s.cc, s.rc, s.dd, s.max_abs, s.max_rel].map(f64::to_bits),
                (
                    s.total,
                    s.differing,
                    s.first,
                    s.max_ulp,
                    s.signed_zero,
                    s.nan_mismatch,
                    s.nan_payload,
                    s.infinity,
                ),
            )
        };
        for (k, (a, b)) in chunks.into_iter().enumerate() {
            let (mut u, mut v) = (UlpCounts::new(window), UlpCounts::new(window));
            // SAFETY: the CPU has the features (checked above).
            let (x, x_uncounted, x_rev) = unsafe {
                (
                    avx2::scan_chunk_f32_bf16::<true, true>(a, b, 0, Some(&mut u)),
                    avx2::scan_chunk_f32_bf16::<true, false>(a, b, 7, None),
                    avx2::scan_chunk_f32_bf16::<false, false>(b, a, 7, None),
                )
            };
            let y = scan_chunk_f32_bf16::<true>(a, b, 0, Some(&mut v));
            assert_eq!(bits(&x), bits(&y), "chunk {k}");
            assert_eq!(counts(&u), counts(&v), "chunk {k}");
            assert_eq!(
                bits(&x_uncounted),
                bits(&scan_chunk_f32_bf16::<true>(a, b, 7, None)),
                "chunk {k}, not counting"
            );
            assert_eq!(
                bits(&x_rev),
                bits(&scan_chunk_f32_bf16::<false>(b, a, 7, None)),
                "chunk {k}, bf16 reference"
            );
        }
    } else {
        use std::io::Write;
        let _ = writeln!(std::io::stderr(), "NOT CHECKED: AVX2 f32/bf16 kernel ≡ portable kernel (diff/src/numeric/avx2.rs): this CPU lacks avx2/fma/popcnt");
    }
}
