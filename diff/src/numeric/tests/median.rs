use super::*;

#[test]
fn median_matches_a_sort() {
    let n = 2 * CHUNK + 21;
    // (case, distances, passes beyond the scan): none when the window's 1-ULP buckets hold
    // the median, one to split a wider bucket, more from scratch when the window misses.
    type Distances = Box<dyn Fn(usize) -> u32>;
    let cases: Vec<(&str, Distances, u32)> = vec![
        ("1..97 ULP", Box::new(|i| 1 + (i % 97) as u32), 0),
        ("1 ULP everywhere", Box::new(|_| 1), 0),
        (
            "half equal",
            Box::new(|i| (i % 2) as u32 * (i % 300) as u32),
            0,
        ),
        ("4000..6000 ULP", Box::new(|i| 4000 + (i % 2001) as u32), 0),
        (
            "wide: up to 10^6 ULP",
            Box::new(|i| ((i * 7919) % 1_000_003) as u32),
            1,
        ),
        (
            "huge spread",
            Box::new(|i| ((i as u32).wrapping_mul(2654435761)) >> 6),
            1,
        ),
        (
            "sparse, small",
            Box::new(|i| {
                if i % 9973 == 0 {
                    1 + (i % 50) as u32
                } else {
                    0
                }
            }),
            0,
        ),
        (
            "sparse, large",
            Box::new(|i| if i % 9973 == 0 { 100_000 + i as u32 } else { 0 }),
            2,
        ),
    ];
    for (name, step, passes) in cases {
        let (r, c) = f32_pairs(n, step);
        let (m, p, window) = median(F32, &r, &c);
        assert_eq!(m, sorted_median(F32, &r, &c), "{name}");
        assert_eq!(p, passes, "{name}: window {window:?}");
    }
    // Distances 1..=1001 ULP × 1000 plus 7 (every pair sampled, window buckets wider than 1).
    let (r, c) = f32_pairs(1001, |i| (i as u32 + 1) * 1000 + 7);
    assert_eq!(median(F32, &r, &c).0, Some(501 * 1000 + 7));
}

#[test]
fn median_is_exact_when_the_sample_misleads() {
    // The sampled pairs differ by 1 ULP, every other by 5000: the window, placed from the
    // sample, misses the median, and passes over [0, 2^13) find it: 4096 buckets of 2 ULP,
    // then the 2 ULP that hold it.
    let n = 64 * SAMPLE;
    let sampled = |i: usize| (0..SAMPLE).any(|k| k * n / SAMPLE == i);
    let sampled: Vec<bool> = (0..n).map(sampled).collect();
    let (r, c) = f32_pairs(n, |i| if sampled[i] { 1 } else { 5000 });
    let (m, passes, window) = median(F32, &r, &c);
    assert_eq!((m, passes), (Some(5000), 2));
    assert!(
        5000 - window.lo > window.last(),
        "the window {window:?} was meant to miss the median"
    );
}

#[test]
fn median_in_every_dtype_and_with_specials() {
    // NaN pairs have no distance and are left out; signed zeros count as 0 ULP.
    let n = CHUNK + 5;
    let (mut r, mut c) = f32_pairs(n, |i| (i % 13) as u32);
    for i in (0..n).step_by(11) {
        r[4 * i..4 * i + 4].copy_from_slice(&0x7fc0_0000u32.to_le_bytes());
    }
    for i in (3..n).step_by(17) {
        r[4 * i..4 * i + 4].copy_from_slice(&0u32.to_le_bytes());
        c[4 * i..4 * i + 4].copy_from_slice(&0x8000_0000u32.to_le_bytes());
    }
    assert_eq!(median(F32, &r, &c).0, sorted_median(F32, &r, &c));
    for (dtype, size) in [
        (DType::F64, 8),
        (DType::F16, 2),
        (DType::BF16, 2),
        (DType::I32, 4),
        (DType::I8, 1),
    ] {
        let (mut r, mut c) = (Vec::new(), Vec::new());
        for i in 0..n as u64 {
            let x = (i.wrapping_mul(2654435761) >> 3) & 0x3fff;
            let y = x + (i % 29) * (i % 3);
            r.extend_from_slice(&x.to_le_bytes()[..size]);
            c.extend_from_slice(&y.to_le_bytes()[..size]);
        }
        assert_eq!(
            median(Pair::same(dtype), &r, &c).0,
            sorted_median(Pair::same(dtype), &r, &c),
            "{dtype:?}"
        );
    }
    // The widest distance there is: i64::MIN against i64::MAX, 2^64 − 1.
    let (r, c): (Vec<u8>, Vec<u8>) = (
        i64::MIN.to_le_bytes().repeat(3).into_iter().collect(),
        i64::MAX.to_le_bytes().repeat(3).into_iter().collect(),
    );
    assert_eq!(median(Pair::same(DType::I64), &r, &c).0, Some(u64::MAX));
}

#[test]
fn median_of_mixed_pairs_matches_a_sort() {
    let n = CHUNK + 5;
    let (w, h) = f32_bf16_pairs(n);
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
        let (m, _, _) = median(pair, r, c);
        assert!(m.is_some());
        assert_eq!(m, sorted_median(pair, r, c), "{pair:?}");
    }
    // The careful path's pairs: each side's values from one sequence, in its own width.
    for (rt, ct) in [
        (DType::F16, DType::F32),
        (DType::F64, DType::F32),
        (DType::BF16, DType::F16),
        (DType::F32, DType::F64),
    ] {
        let pair = Pair::new(rt, ct).unwrap();
        let enc = |d: DType, x: f64, out: &mut Vec<u8>| match d {
            DType::F64 => out.extend_from_slice(&x.to_le_bytes()),
            DType::F32 => out.extend_from_slice(&(x as f32).to_le_bytes()),
            DType::F16 => out.extend_from_slice(&half::f16::from_f32(x as f32).to_le_bytes()),
            _ => out.extend_from_slice(&half::bf16::from_f32(x as f32).to_le_bytes()),
        };
        let (mut r, mut c) = (Vec::new(), Vec::new());
        for i in 0..n {
            let x = (((i * 2654435761usize) >> 5) % 20001) as f64 / 100.0 - 100.0;
            enc(rt, x, &mut r);
            enc(ct, x * (1.0 + (i % 13) as f64 * 1e-3), &mut c);
        }
        let (m, _, _) = median(pair, &r, &c);
        assert!(m.is_some_and(|m| m > 0), "{pair:?}");
        assert_eq!(m, sorted_median(pair, &r, &c), "{pair:?}");
    }
}
