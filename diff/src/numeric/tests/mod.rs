//! Tests of the scan, its fast kernels and the median, with the helpers they share (the
//! ordering's and the printing's tests sit beside them).

use tracegate_trace::DType;

use super::chunk::*;
use super::counts::*;
use super::kernels::*;
use super::lanes::*;
use super::median::*;
use super::ordering::*;
use super::scan::*;
use super::*;

mod kernels;
mod median;

const F32: Pair = Pair::same(DType::F32);

/// The lower median by sorting every distance: what `median_ulp` must match.
fn sorted_median(pair: Pair, r: &[u8], c: &[u8]) -> Option<u64> {
    let mut d: Vec<u64> = (0..(r.len() / pair.reference.size()) as u64)
        .filter_map(|i| pair_element(pair, r, c, i)?.1)
        .collect();
    d.sort_unstable();
    (!d.is_empty()).then(|| d[(d.len() - 1) / 2])
}

/// The median, the passes it took beyond the scan, and the scan's window.
fn median(pair: Pair, r: &[u8], c: &[u8]) -> (Option<u64>, u32, Window) {
    let (s, ulps) = scan(pair, r, c, true);
    let ulps = ulps.expect("counted");
    let (m, passes) = median_search(pair, r, c, &s, &ulps);
    (m, passes, ulps.window)
}

fn f32_pairs(n: usize, step: impl Fn(usize) -> u32) -> (Vec<u8>, Vec<u8>) {
    let (mut r, mut c) = (Vec::new(), Vec::new());
    for i in 0..n {
        let x = ((((i * 2654435761usize) >> 5) % 20001) as f32 / 100.0 - 100.0).to_bits();
        r.extend_from_slice(&x.to_le_bytes());
        c.extend_from_slice(&x.wrapping_add(step(i)).to_le_bytes());
    }
    (r, c)
}

/// CI machines may lack AVX-512: a loud line, not a silent pass and not a failure. Written
/// to the stderr handle, which the test harness does not capture (`eprintln!` it hides).
#[allow(dead_code)]
fn not_checked(why: &str) {
    use std::io::Write;
    let _ = writeln!(
        std::io::stderr(),
        "NOT CHECKED: AVX-512 kernel ≡ portable kernel (diff/src/numeric/avx512.rs): {why}"
    );
}

/// f32 and bf16 payloads with every kind of element pair, the bf16 side derived from the
/// f32 one by rounding, then perturbed.
fn f32_bf16_pairs(n: usize) -> (Vec<u8>, Vec<u8>) {
    let (mut w, mut h) = (Vec::new(), Vec::new());
    for i in 0..n {
        let x = (((i * 2654435761usize) >> 5) % 20001) as f32 / 100.0 - 100.0;
        let mut a = x.to_bits();
        let mut b = f32_to_bf16(a) as u16;
        match i % 7 {
            0 => a = (b as u32) << 16,
            1 => {}
            2 => b = b.wrapping_add((i % 300) as u16),
            3 => b ^= 0x8000,
            4 => b = b.wrapping_sub(1),
            _ => a ^= 1,
        }
        match i % 1009 {
            0 => (a, b) = (0, 0x8000),
            1 => b = 0x7fc0,
            2 => (a, b) = (0xffc0_0000, 0x7fc0),
            3 => b = 0x7f80,
            4 => (a, b) = (0x7f7f_ffff, 0x7f7f),
            5 => (a, b) = (0x7f80_0000, 0x7f80),
            6 => (a, b) = (1, 0),
            _ => {}
        }
        w.extend_from_slice(&a.to_le_bytes());
        h.extend_from_slice(&b.to_le_bytes());
    }
    (w, h)
}
