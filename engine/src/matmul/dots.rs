//! The attention scores' column dots (`dots_transposed`): every column exactly `ops::dot`,
//! the same generic loops compiled for each kernel family.

use super::Kernel;

/// `out[c] = dot(x, column c of kt)` for `c < out.len()`, where `kt[j*stride + c]` holds `w_c[j]`
/// and `out.len()` is a multiple of 16 no larger than `stride`. Each column is exactly `dot`
/// (from +0.0, j ascending, separate multiply and add); columns are independent, so 16-wide
/// vectors of them advance side by side (64 at a time to hide the add latency).
pub fn dots_transposed(x: &[f32], kt: &[f32], stride: usize, out: &mut [f32]) {
    dots_transposed_with(Kernel::detect(), x, kt, stride, out)
}

pub(super) fn dots_transposed_with(
    kernel: Kernel,
    x: &[f32],
    kt: &[f32],
    stride: usize,
    out: &mut [f32],
) {
    assert!(out.len().is_multiple_of(16) && out.len() <= stride && kt.len() >= x.len() * stride);
    assert!(
        kernel.supported(),
        "{kernel:?} kernels need CPU features this CPU lacks"
    );
    match kernel {
        // SAFETY: the CPU supports avx512f (asserted above).
        Kernel::Avx512 => unsafe { dots_transposed_avx512(x, kt, stride, out) },
        // SAFETY: the CPU supports avx2 (asserted above).
        Kernel::Avx2 => unsafe { dots_transposed_avx2(x, kt, stride, out) },
        Kernel::Portable => dots_transposed_generic(x, kt, stride, out),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dots_transposed_avx512(x: &[f32], kt: &[f32], stride: usize, out: &mut [f32]) {
    dots_transposed_generic(x, kt, stride, out)
}
#[cfg(not(target_arch = "x86_64"))]
unsafe fn dots_transposed_avx512(x: &[f32], kt: &[f32], stride: usize, out: &mut [f32]) {
    dots_transposed_generic(x, kt, stride, out)
}
/// The same loops compiled for 256-bit vectors (avx2 alone: the compiler may not fuse, and does
/// not, since Rust never contracts `a * b + c`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dots_transposed_avx2(x: &[f32], kt: &[f32], stride: usize, out: &mut [f32]) {
    dots_transposed_generic(x, kt, stride, out)
}
#[cfg(not(target_arch = "x86_64"))]
unsafe fn dots_transposed_avx2(x: &[f32], kt: &[f32], stride: usize, out: &mut [f32]) {
    dots_transposed_generic(x, kt, stride, out)
}

#[inline(always)]
fn dots_transposed_generic(x: &[f32], kt: &[f32], stride: usize, out: &mut [f32]) {
    let mut c0 = 0;
    while c0 + 64 <= out.len() {
        dots_block::<64>(x, kt, stride, c0, &mut out[c0..c0 + 64]);
        c0 += 64;
    }
    while c0 < out.len() {
        dots_block::<16>(x, kt, stride, c0, &mut out[c0..c0 + 16]);
        c0 += 16;
    }
}

#[inline(always)]
fn dots_block<const N: usize>(x: &[f32], kt: &[f32], stride: usize, c0: usize, out: &mut [f32]) {
    let mut acc = [0.0f32; N];
    for (j, &xj) in x.iter().enumerate() {
        let col: &[f32; N] = kt[j * stride + c0..j * stride + c0 + N]
            .try_into()
            .expect("N lanes");
        for i in 0..N {
            acc[i] += xj * col[i];
        }
    }
    out.copy_from_slice(&acc);
}
