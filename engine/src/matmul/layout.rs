//! How a weight matrix's bytes are laid out for the matmul (its storage dtype, row-major or row
//! panels) and the decision to make panels: the matmul's own business, which `weights` (the
//! checkpoint) uses and never the other way round.

use rayon::prelude::*;

/// Storage dtypes the engine can widen exactly to f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WDType {
    F32,
    F16,
    BF16,
}

impl WDType {
    pub fn size(self) -> usize {
        match self {
            WDType::F32 => 4,
            WDType::F16 | WDType::BF16 => 2,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            WDType::F32 => "F32",
            WDType::F16 => "F16",
            WDType::BF16 => "BF16",
        }
    }
}

/// Rows per panel of a `Layout::Panels` matrix: one 512-bit vector of outputs.
pub const PANEL: usize = 16;

/// How a matrix's bytes are ordered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Row-major `[rows, cols]`, as in the file.
    Rows,
    /// bf16 only, `cols` even: panels of `PANEL` rows, the last padded with zero rows. Panel `p`
    /// holds, for each column pair `q` ascending, `PANEL` 32-bit words, word `j` the bf16 pair
    /// `(w[p*PANEL + j][2q], w[p*PANEL + j][2q + 1])`. A decode kernel streams a panel front to
    /// back and finds `PANEL` outputs' next two weights in one load, already transposed; the
    /// row-major kernels read `PANEL` rows at once (as many memory streams) and transpose in
    /// registers (docs/benchmarks.md, "Decode from row panels").
    Panels,
}

/// A 2-D weight matrix `[rows, cols]`: a view into the mapped file (`Layout::Rows`) or into a
/// store's panels (`Weight::pack`).
#[derive(Clone, Copy)]
pub struct Mat<'a> {
    pub dtype: WDType,
    pub rows: usize,
    pub cols: usize,
    pub layout: Layout,
    pub bytes: &'a [u8],
}

impl<'a> Mat<'a> {
    /// A row-major matrix over `bytes` (`rows * cols` elements of `dtype`).
    pub fn rows(dtype: WDType, rows: usize, cols: usize, bytes: &'a [u8]) -> Mat<'a> {
        debug_assert_eq!(bytes.len(), rows * cols * dtype.size());
        Mat {
            dtype,
            rows,
            cols,
            layout: Layout::Rows,
            bytes,
        }
    }

    /// Rows `r0 .. r0+n` as their own matrix (used to split fused expert tensors before they
    /// are packed: a row-major matrix only).
    pub fn row_block(&self, r0: usize, n: usize) -> Mat<'a> {
        assert_eq!(self.layout, Layout::Rows, "row_block of a packed matrix");
        let rb = self.cols * self.dtype.size();
        Mat::rows(
            self.dtype,
            n,
            self.cols,
            &self.bytes[r0 * rb..(r0 + n) * rb],
        )
    }

    /// Whether `panels` can repack this matrix (bf16 with an even number of columns).
    pub fn can_pack(&self) -> bool {
        self.layout == Layout::Rows && self.dtype == WDType::BF16 && self.cols.is_multiple_of(2)
    }

    /// Bytes of the panels of this matrix (whole panels).
    pub fn panels_len(&self) -> usize {
        self.rows.div_ceil(PANEL) * PANEL * self.cols * 2
    }

    /// Repack into `out` (`panels_len` bytes, zeroed: padding rows stay zero) as
    /// `Layout::Panels`, the panels on the pool, and view it. Pure data movement.
    pub fn pack_into<'b>(&self, out: &'b mut [u8]) -> Mat<'b> {
        assert!(self.can_pack() && out.len() == self.panels_len());
        let (k, rb) = (self.cols, self.cols * 2);
        out.par_chunks_mut(PANEL * rb)
            .enumerate()
            .for_each(|(p, dst)| {
                let real = PANEL.min(self.rows - p * PANEL);
                let src = &self.bytes[p * PANEL * rb..(p * PANEL + real) * rb];
                // Written front to back, one 64-byte group (a column pair of every row) at a time.
                for (q, group) in dst.chunks_exact_mut(PANEL * 4).take(k / 2).enumerate() {
                    for (j, word) in group.chunks_exact_mut(4).take(real).enumerate() {
                        word.copy_from_slice(&src[j * rb + q * 4..j * rb + q * 4 + 4]);
                    }
                }
            });
        Mat {
            dtype: self.dtype,
            rows: self.rows,
            cols: self.cols,
            layout: Layout::Panels,
            bytes: out,
        }
    }

    /// The `count` whole panels from output row `o0` (a panel boundary) of a `Layout::Panels`
    /// matrix, each `PANEL * cols * 2` bytes: what the SIMD kernels read through raw pointers.
    pub fn panels_from(&self, o0: usize, count: usize) -> &'a [u8] {
        assert!(self.layout == Layout::Panels && o0.is_multiple_of(PANEL));
        let pb = PANEL * self.cols * 2;
        &self.bytes[o0 / PANEL * pb..(o0 / PANEL + count) * pb]
    }

    /// Widen `out.len()` elements of row `r` starting at column `c0` (exact).
    #[inline]
    pub fn widen_row(&self, r: usize, c0: usize, out: &mut [f32]) {
        match self.layout {
            Layout::Rows => {
                let s = self.dtype.size();
                let off = (r * self.cols + c0) * s;
                let b = &self.bytes[off..off + out.len() * s];
                widen(self.dtype, b, out);
            }
            Layout::Panels => {
                let panel = &self.bytes[r / PANEL * PANEL * self.cols * 2..];
                for (i, o) in out.iter_mut().enumerate() {
                    let c = c0 + i;
                    let at = c / 2 * PANEL * 4 + r % PANEL * 4 + c % 2 * 2;
                    let h = u16::from_le_bytes([panel[at], panel[at + 1]]);
                    *o = f32::from_bits((h as u32) << 16);
                }
            }
        }
    }

    /// Whole matrix widened (only for small tensors: norms, biases).
    pub fn to_vec(&self) -> Vec<f32> {
        let mut v = vec![0.0; self.rows * self.cols];
        for (r, row) in v.chunks_exact_mut(self.cols.max(1)).enumerate() {
            self.widen_row(r, 0, row);
        }
        v
    }
}

/// Whether a matmul of `rows` rows of x by `w` should read `w`'s row panels: a decode-sized
/// call (`rows ≤ MATVEC_ROWS`), a matrix `Mat::pack_into` can repack, and a kernel family with
/// panel kernels (`panels_pay`). Same bits either way (tested); only the speed differs.
pub fn wants_panels(w: &Mat, rows: usize) -> bool {
    rows <= super::MATVEC_ROWS && w.can_pack() && super::panels_pay()
}

/// Exact widening of little-endian storage to f32.
#[inline]
pub fn widen(dtype: WDType, b: &[u8], out: &mut [f32]) {
    match dtype {
        WDType::F32 => {
            for (o, c) in out.iter_mut().zip(b.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        WDType::BF16 => {
            for (o, c) in out.iter_mut().zip(b.chunks_exact(2)) {
                *o = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
            }
        }
        WDType::F16 => {
            for (o, c) in out.iter_mut().zip(b.chunks_exact(2)) {
                *o = half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
    }
}
