//! Every kernel family against the `ops` definitions, bit for bit (and the helpers `ops`'s
//! tests share).

use super::*;
use crate::matmul::layout::WDType;
use crate::ops::{dot, matmul_ref, matmul_ref_by};

fn bytes_of(dtype: WDType, v: &[f32]) -> Vec<u8> {
    match dtype {
        WDType::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        WDType::BF16 => v
            .iter()
            .flat_map(|x| ((x.to_bits() >> 16) as u16).to_le_bytes())
            .collect(),
        WDType::F16 => v
            .iter()
            .flat_map(|x| half::f16::from_f32(*x).to_bits().to_le_bytes())
            .collect(),
    }
}

/// Deterministic pseudo-random values with a wide exponent range, signed zeros included.
pub(crate) fn vals(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|i| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let u = ((s >> 33) as f32) / (1u64 << 31) as f32 - 0.5;
            match i % 37 {
                0 => -0.0,
                1 => 0.0,
                _ => u * (1 << (s % 7)) as f32,
            }
        })
        .collect()
}

/// A SIMD family this CPU lacks cannot be compared here: say so instead of passing quietly.
/// Written to the stderr handle itself, which the test harness does not capture (eprintln!
/// of a passing test is swallowed).
pub(crate) fn note_unchecked_kernels(what: &str) {
    for k in [Kernel::Avx2, Kernel::Avx512] {
        if !k.supported() {
            use std::io::Write;
            let _ = writeln!(std::io::stderr(), "NOT CHECKED: {what}: the {k:?} kernels did not run (this CPU lacks their features); the others were compared");
        }
    }
}

/// The first index where the bits differ, if any (what every bit-equality check asserts).
pub(crate) fn first_mismatch(want: &[f32], got: &[f32]) -> Option<usize> {
    assert_eq!(want.len(), got.len());
    (0..want.len()).find(|&i| want[i].to_bits() != got[i].to_bits())
}

/// Shapes hitting every tail: N not a multiple of NR, K = 1 and not a multiple of KB or of
/// the 8/16-column widening steps, one row (cached decode), rows not a multiple of the
/// micro-kernel heights (MR, MRA) or of the panel height MRP, many rows (prefill); 1..=4 rows
/// (the matvec path) with whole and partial 8/16/32-output spans and k tails.
const SHAPES: &[(usize, usize, usize)] = &[
    (1, 1, 1),
    (1, 17, 5),
    (3, 33, 1),
    (9, 15, 257),
    (17, 40, 300),
    (8, 16, 256),
    (1, 5, 600),
    (1, 48, 16),
    (2, 32, 47),
    (1, 16, 1000),
    (3, 16, 560),
    (64, 33, 300),
    (33, 17, 257),
    (31, 48, 1),
    (6, 16, 9),
    (1, 64, 1024),
    (13, 32, 7),
    (1, 32, 13),
    (1, 16, 1003),
    (1, 48, 7),
    (4, 40, 531),
    (2, 96, 80),
    (3, 64, 33),
    (1, 40, 64),
    (4, 48, 100),
];

/// One case: (dtype, rows, n, k, x, weight bytes, bias).
type Case = (WDType, usize, usize, usize, Vec<f32>, Vec<u8>, Vec<f32>);

/// Every shape × dtype of `SHAPES`, with a bias vector each.
fn cases() -> Vec<Case> {
    let mut v = vec![];
    for dtype in [WDType::F32, WDType::BF16, WDType::F16] {
        for &(rows, n, k) in SHAPES {
            let x = vals(rows * k, 1 + rows as u64);
            let wb = bytes_of(dtype, &vals(n * k, 7 + n as u64));
            v.push((dtype, rows, n, k, x, wb, vals(n, 99)));
        }
    }
    v
}

fn mat(dtype: WDType, n: usize, k: usize, bytes: &[u8]) -> Mat<'_> {
    Mat::rows(dtype, n, k, bytes)
}

/// `w` repacked as panels into `buf` (bf16 with even K), else `None`.
fn panels<'b>(w: Mat, buf: &'b mut Vec<u8>) -> Option<Mat<'b>> {
    w.can_pack().then(|| {
        *buf = vec![0; w.panels_len()];
        w.pack_into(buf)
    })
}

#[test]
fn matmul_every_kernel_equals_definition_bits() {
    note_unchecked_kernels("matmul_every_kernel_equals_definition_bits");
    // Three threads, so tiles of one matmul run on different threads.
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(3)
        .build()
        .unwrap();
    let kernels = Kernel::all_supported();
    let mut packed_cases = 0;
    for (dtype, rows, n, k, x, wb, b) in cases() {
        let w = mat(dtype, n, k, &wb);
        let mut buf = vec![];
        let p = panels(w, &mut buf);
        packed_cases += usize::from(p.is_some());
        for bias in [None, Some(&b[..])] {
            let want = matmul_ref(&x, rows, w, bias);
            // The same weights as panels: the definition reading them element by element, and
            // every family's kernels.
            if let Some(p) = p {
                let got = matmul_ref(&x, rows, p, bias);
                assert_eq!(first_mismatch(&want, &got), None, "definition on panels");
            }
            for &kernel in &kernels {
                for (layout, w) in [("rows", Some(w)), ("panels", p)] {
                    let Some(w) = w else { continue };
                    let got = pool.install(|| matmul_with(kernel, &x, rows, w, bias));
                    assert_eq!(
                        first_mismatch(&want, &got),
                        None,
                        "{kernel:?} {layout} dtype {dtype:?} rows {rows} n {n} k {k} bias {}",
                        bias.is_some()
                    );
                }
            }
        }
    }
    // bf16 shapes of SHAPES with an even K.
    assert_eq!(packed_cases, 11, "cases on panels");
}

/// Negative control for the test above: the same cases through a planted reorder (split-K:
/// the two halves of k summed separately, then added) and a planted FMA are caught.
#[test]
fn bit_equality_check_catches_planted_reorder_and_fma() {
    let split_k = |x: &[f32], w: &[f32]| {
        let h = x.len() / 2;
        dot(&x[..h], &w[..h]) + dot(&x[h..], &w[h..])
    };
    let fma = |x: &[f32], w: &[f32]| x.iter().zip(w).fold(0.0f32, |a, (&p, &q)| p.mul_add(q, a));
    // Deterministic data, so the counts are fixed: every case with K ≥ 16 is caught (with a
    // few steps only, a reorder can round the same by chance; with K = 1 it cannot differ).
    let (mut missed_split, mut missed_fma, mut long) = (vec![], vec![], 0);
    for (dtype, rows, n, k, x, wb, _) in cases() {
        let w = mat(dtype, n, k, &wb);
        let want = matmul_ref(&x, rows, w, None);
        if k >= 16 {
            long += 1;
            if first_mismatch(&want, &matmul_ref_by(&x, rows, w, None, split_k)).is_none() {
                missed_split.push((dtype, rows, n, k));
            }
            if first_mismatch(&want, &matmul_ref_by(&x, rows, w, None, fma)).is_none() {
                missed_fma.push((dtype, rows, n, k));
            }
        }
    }
    assert!(long >= 30, "{long} cases with K ≥ 16");
    assert_eq!(missed_split, vec![], "split-K not caught");
    assert_eq!(missed_fma, vec![], "FMA not caught");
}

#[test]
fn transposed_widening_is_exact_for_every_16_bit_pattern() {
    note_unchecked_kernels("transposed_widening_is_exact_for_every_16_bit_pattern");
    // Every bf16 and f16 bit pattern (subnormals, infinities, NaN payloads) through each
    // family's transpose-widen equals the scalar widening.
    let bytes: Vec<u8> = (0..=u16::MAX).flat_map(|b| b.to_le_bytes()).collect();
    for kernel in Kernel::all_supported() {
        for dtype in [WDType::BF16, WDType::F16] {
            let w = mat(dtype, 16, 4096, &bytes);
            let mut wt = [0.0f32; KB * NR];
            let mut row = vec![0.0f32; 4096];
            for k0 in (0..4096).step_by(KB) {
                let mut buf = vec![];
                for (layout, w) in [("rows", Some(w)), ("panels", panels(w, &mut buf))] {
                    let Some(wl) = w else { continue };
                    widen_transposed(kernel, wl, 0, 16, k0, KB, &mut wt);
                    for j in 0..16 {
                        mat(dtype, 16, 4096, &bytes).widen_row(j, 0, &mut row);
                        for kk in 0..KB {
                            assert_eq!(
                                wt[kk * NR + j].to_bits(),
                                row[k0 + kk].to_bits(),
                                "{kernel:?} {layout} {dtype:?} row {j} col {}",
                                k0 + kk
                            );
                        }
                    }
                }
            }
        }
    }
}

/// Negative control in the matvec path itself: the same kernels with a planted fused step and
/// a planted split-K (`matvec.rs`) differ from the definition in the outputs each family's own
/// kernel computes (the first span of every row: the portable code only takes partial spans).
#[test]
fn matvec_check_catches_planted_fma_and_split_k_in_every_kernel() {
    use super::matvec::{matvec, span};
    use super::step::{PLANT_FMA, PLANT_SPLIT};
    note_unchecked_kernels("matvec_check_catches_planted_fma_and_split_k_in_every_kernel");
    let mut covered = std::collections::BTreeMap::new();
    let mut missed = vec![];
    for (dtype, rows, n, k, x, wb, _) in cases() {
        let rw = mat(dtype, n, k, &wb);
        let want = matmul_ref(&x, rows, rw, None);
        let mut buf = vec![];
        let layouts: Vec<Mat> = [Some(rw), panels(rw, &mut buf)]
            .into_iter()
            .flatten()
            .collect();
        for (kernel, &w) in Kernel::all_supported()
            .into_iter()
            .flat_map(|kn| layouts.iter().map(move |w| (kn, w)))
        {
            let span = span(kernel, w);
            // K ≥ 32 so the planted split has two halves; n ≥ span so the first span is whole.
            if rows > super::matvec::MV_ROWS || n < span || k < 32 {
                continue;
            }
            *covered
                .entry(format!("{kernel:?} {:?}", w.layout))
                .or_insert(0) += 1;
            let first_span = |y: &[f32]| -> Vec<f32> {
                (0..rows)
                    .flat_map(|r| y[r * n..r * n + span].to_vec())
                    .collect()
            };
            let planted = [
                ("fma", matvec::<PLANT_FMA>(kernel, &x, rows, w, None)),
                ("split-K", matvec::<PLANT_SPLIT>(kernel, &x, rows, w, None)),
            ];
            for (what, got) in planted {
                if first_mismatch(&first_span(&want), &first_span(&got)).is_none() {
                    missed.push((what, kernel, w.layout, dtype, rows, n, k));
                }
            }
        }
    }
    assert_eq!(missed, vec![], "planted faults not caught");
    // Shapes of SHAPES with rows ≤ 4, k ≥ 32 and n ≥ the span: row-major, three dtypes each;
    // panels, bf16 with an even K (spans 8, 16 and 32).
    let want: &[(&str, Kernel, usize)] = &[
        ("Avx2 Rows", Kernel::Avx2, 3 * 10),
        ("Avx512 Rows", Kernel::Avx512, 3 * 10),
        ("Portable Rows", Kernel::Portable, 3 * 10),
        ("Avx2 Panels", Kernel::Avx2, 6),
        ("Avx512 Panels", Kernel::Avx512, 4),
        ("Portable Panels", Kernel::Portable, 6),
    ];
    for &(case, kernel, count) in want {
        if kernel.supported() {
            assert_eq!(covered.get(case), Some(&count), "{case} cases covered");
        }
    }
}

/// The explainer (`trace-diff --explain`, tracegate-diff) names this path's own planted faults:
/// tiny-qwen3's logits computed by every supported matvec kernel with the planted fused step,
/// and with the planted split-K (which cuts K = 52 at 16, `split_at`: not at K/2), are each
/// reproduced by the order that describes them, and the exact kernel by §2's.
#[test]
fn the_explainer_names_the_kernels_planted_fma_and_split_k() {
    use super::matvec::matvec;
    use super::step::{EXACT, PLANT_FMA, PLANT_SPLIT};
    use tracegate_trace::{Trace, TraceWriter};
    note_unchecked_kernels("the_explainer_names_the_kernels_planted_fma_and_split_k");
    let model = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tiny-qwen3");
    let dir = tempfile::tempdir().unwrap();
    let reference = dir.path().join("reference.trace");
    let tokens = vec![3, 17, 5, 42, 8];
    crate::run_trace(&crate::TraceOptions {
        model_dir: model.clone(),
        tokens: tokens.clone(),
        out: reference.clone(),
        internals: false,
        generate: 0,
        cache: true,
        threads: 1,
        command_line: vec!["matmul tests".into()],
        force_decisions: None,
        prompt_text: None,
        shards: None,
    })
    .unwrap();
    let t = Trace::open(&reference).unwrap();
    let x = t.f32_vec("final_norm.out").unwrap();
    let hidden = x.len() / tokens.len();
    let store = crate::open_store(&model).unwrap();
    let w = store
        .take("model.embed_tokens.weight", &[499, hidden])
        .unwrap();
    assert_eq!(
        (hidden, super::step::split_at(hidden)),
        (52, 16),
        "the split this test is about"
    );
    let explained = |logits: Vec<f32>, what: &str| -> Vec<String> {
        let path = dir.path().join(format!("{what}.trace"));
        let mut out = TraceWriter::create(&path, t.provenance().clone()).unwrap();
        for info in t.tensors() {
            if info.name == "logits" {
                out.tensor_f32("logits", &info.shape, &logits, &info.attributes)
                    .unwrap();
            } else {
                out.tensor(
                    &info.name,
                    info.dtype,
                    &info.shape,
                    t.data(info),
                    &info.attributes,
                )
                .unwrap();
            }
        }
        for d in t.decisions() {
            let m = t.decision_margins(d);
            out.decision(&d.name, &d.shape, &t.decision_values(d), m.as_deref())
                .unwrap();
        }
        out.finish().unwrap();
        let e = tracegate_diff::explain::explain(
            &t,
            &Trace::open(&path).unwrap(),
            "logits",
            Some(&model),
        );
        match e.outcome {
            tracegate_diff::explain::Outcome::Checked(k) => k.candidate.reproduced_by,
            tracegate_diff::explain::Outcome::NotExplained(why) => panic!("{what}: {why}"),
        }
    };
    for kernel in Kernel::all_supported() {
        let by_rows =
            |f: &dyn Fn(&[f32]) -> Vec<f32>| -> Vec<f32> { x.chunks(hidden).flat_map(f).collect() };
        let exact = by_rows(&|r| matvec::<EXACT>(kernel, r, 1, w, None));
        assert!(
            first_mismatch(&t.f32_vec("logits").unwrap(), &exact).is_none(),
            "{kernel:?}: the exact kernel is the engine's logits"
        );
        let fma = explained(
            by_rows(&|r| matvec::<PLANT_FMA>(kernel, r, 1, w, None)),
            "fma",
        );
        assert!(
            fma.iter().any(|o| o == "sequential (§2) with FMA"),
            "{kernel:?} fma: {fma:?}"
        );
        let split = explained(
            by_rows(&|r| matvec::<PLANT_SPLIT>(kernel, r, 1, w, None)),
            "split",
        );
        assert!(
            split.iter().any(|o| o == "split-K 2 at a multiple of 16"),
            "{kernel:?} split: {split:?}"
        );
        assert!(
            !split.iter().any(|o| o == "split-K 2"),
            "K/2 = 26 is not where it cuts: {split:?}"
        );
    }
}
