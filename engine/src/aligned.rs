//! f32 buffers that start on a cache-line boundary, for the data the SIMD kernels load and
//! store a vector at a time. From such a start, a 64-byte vector at a multiple of 16 floats
//! touches one cache line; from malloc's 16-byte alignment, most of them straddle two.
//! (docs/benchmarks.md, "Cache-line-aligned scratch", measures what that cost.)

use std::ops::{Deref, DerefMut};

/// One cache line of f32.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([f32; 16]);

const LANES: usize = 16;

/// A growable `[f32]` whose first element is 64-byte aligned. Only the `len` first floats are
/// visible; the rest of the last line is zero.
#[derive(Clone, Default)]
pub struct Lines {
    lines: Vec<Line>,
    len: usize,
}

impl Lines {
    /// `len` zeros.
    pub fn zeros(len: usize) -> Lines {
        Lines {
            lines: vec![Line([0.0; LANES]); len.div_ceil(LANES)],
            len,
        }
    }

    /// Append `x` (as `Vec::extend_from_slice`).
    pub fn extend_from_slice(&mut self, x: &[f32]) {
        let (start, end) = (self.len, self.len + x.len());
        self.lines.resize(end.div_ceil(LANES), Line([0.0; LANES]));
        self.len = end;
        self[start..].copy_from_slice(x);
    }
}

impl Deref for Lines {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        // SAFETY: `lines` holds at least `len` initialised f32 (`Line` is `repr(C)` over
        // `[f32; 16]`, no padding), borrowed for the lifetime of `&self`.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast::<f32>(), self.len) }
    }
}

impl DerefMut for Lines {
    fn deref_mut(&mut self) -> &mut [f32] {
        // SAFETY: as in `deref`, borrowed mutably for the lifetime of `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast::<f32>(), self.len) }
    }
}

#[cfg(test)]
mod tests {
    use super::Lines;

    #[test]
    fn lines_are_aligned_and_grow_like_a_vec() {
        let mut l = Lines::default();
        let mut v: Vec<f32> = vec![];
        for n in [0usize, 1, 15, 16, 17, 100] {
            let x: Vec<f32> = (0..n).map(|i| (v.len() + i) as f32 + 0.5).collect();
            l.extend_from_slice(&x);
            v.extend_from_slice(&x);
            assert_eq!(&l[..], &v[..]);
            assert_eq!(l.as_ptr() as usize % 64, 0);
        }
        let z = Lines::zeros(33);
        assert_eq!((z.len(), z.as_ptr() as usize % 64), (33, 0));
        assert!(z.iter().all(|&x| x == 0.0));
    }
}
