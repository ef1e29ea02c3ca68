//! ggml tensor types and their dequantization to f32 (docs/numerics.md §21.2), bit-exact with
//! ggml's Python reference `gguf.quants.dequantize`: the same operations in the same order, each
//! product and sum rounded to f32 (Rust never contracts `a * b + c` into a fused multiply-add).

use crate::{err, Result};

/// A ggml tensor type: its id in the file, with the block layout of every type ggml defines, so
/// that the data of a tensor of any known type is checked even when it cannot be dequantized.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GgmlType(u32);

/// (id, name, elements per block, bytes per block), as gguf-py's `GGML_QUANT_SIZES` (QK_K = 256).
const TYPES: [(u32, &str, u64, u64); 34] = [
    (0, "F32", 1, 4),
    (1, "F16", 1, 2),
    (2, "Q4_0", 32, 18),
    (3, "Q4_1", 32, 20),
    (6, "Q5_0", 32, 22),
    (7, "Q5_1", 32, 24),
    (8, "Q8_0", 32, 34),
    (9, "Q8_1", 32, 40),
    (10, "Q2_K", 256, 84),
    (11, "Q3_K", 256, 110),
    (12, "Q4_K", 256, 144),
    (13, "Q5_K", 256, 176),
    (14, "Q6_K", 256, 210),
    (15, "Q8_K", 256, 292),
    (16, "IQ2_XXS", 256, 66),
    (17, "IQ2_XS", 256, 74),
    (18, "IQ3_XXS", 256, 98),
    (19, "IQ1_S", 256, 50),
    (20, "IQ4_NL", 32, 18),
    (21, "IQ3_S", 256, 110),
    (22, "IQ2_S", 256, 82),
    (23, "IQ4_XS", 256, 136),
    (24, "I8", 1, 1),
    (25, "I16", 1, 2),
    (26, "I32", 1, 4),
    (27, "I64", 1, 8),
    (28, "F64", 1, 8),
    (29, "IQ1_M", 256, 56),
    (30, "BF16", 1, 2),
    (34, "TQ1_0", 256, 54),
    (35, "TQ2_0", 256, 66),
    (39, "MXFP4", 32, 17),
    (40, "NVFP4", 64, 36),
    (41, "Q1_0", 128, 18),
];

impl GgmlType {
    pub const F32: GgmlType = GgmlType(0);
    pub const F16: GgmlType = GgmlType(1);
    pub const Q4_0: GgmlType = GgmlType(2);
    pub const Q4_1: GgmlType = GgmlType(3);
    pub const Q5_0: GgmlType = GgmlType(6);
    pub const Q5_1: GgmlType = GgmlType(7);
    pub const Q8_0: GgmlType = GgmlType(8);
    pub const Q4_K: GgmlType = GgmlType(12);
    pub const Q5_K: GgmlType = GgmlType(13);
    pub const Q6_K: GgmlType = GgmlType(14);
    pub const BF16: GgmlType = GgmlType(30);

    /// The types `dequantize_row` computes.
    pub const SUPPORTED: [GgmlType; 11] = [
        Self::F32,
        Self::F16,
        Self::BF16,
        Self::Q8_0,
        Self::Q4_0,
        Self::Q4_1,
        Self::Q5_0,
        Self::Q5_1,
        Self::Q4_K,
        Self::Q5_K,
        Self::Q6_K,
    ];

    pub fn from_id(id: u32) -> Option<GgmlType> {
        TYPES.iter().any(|t| t.0 == id).then_some(GgmlType(id))
    }
    fn row(self) -> &'static (u32, &'static str, u64, u64) {
        TYPES
            .iter()
            .find(|t| t.0 == self.0)
            .expect("constructed from the table")
    }
    pub fn id(self) -> u32 {
        self.0
    }
    pub fn name(self) -> &'static str {
        self.row().1
    }
    /// Elements per block.
    pub fn block_size(self) -> u64 {
        self.row().2
    }
    /// Bytes per block.
    pub fn type_size(self) -> u64 {
        self.row().3
    }
    pub fn is_supported(self) -> bool {
        Self::SUPPORTED.contains(&self)
    }
    /// `F32, F16, ...`: the supported list, for messages.
    pub fn supported_list() -> String {
        Self::SUPPORTED.map(|t| t.name()).join(", ")
    }
}

/// IEEE binary16 bits to the f32 of the same value, exactly; a NaN keeps its sign and payload
/// (shifted into the top of the f32 mantissa, quiet bit untouched), as numpy's
/// `float16.astype(float32)` does.
#[inline]
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h as u32) & 0x8000) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    let bits = match exp {
        // Zero or subnormal: man · 2^-24, exact in f32 (a normal number there).
        0 => (man as f32 * f32::from_bits(0x3380_0000)).to_bits(),
        0x1f => 0x7f80_0000 | (man << 13),
        _ => ((exp + 127 - 15) << 23) | (man << 13),
    };
    f32::from_bits(sign | bits)
}

#[inline]
fn f16_at(b: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
}

/// Dequantize whole blocks: `src` holds `out.len() / block_size` blocks of type `t`. The caller
/// has checked the lengths (a row of a parsed tensor); `t` must be supported.
pub fn dequantize_row(t: GgmlType, src: &[u8], out: &mut [f32]) -> Result<()> {
    let (block, size) = (t.block_size() as usize, t.type_size() as usize);
    if !out.len().is_multiple_of(block) || src.len() != out.len() / block * size {
        return Err(err!(Internal:
            "dequantize {}: {} bytes for {} values",
            t.name(),
            src.len(),
            out.len()
        ));
    }
    let blocks = src.chunks_exact(size).zip(out.chunks_exact_mut(block));
    match t {
        GgmlType::F32 => {
            blocks.for_each(|(b, o)| o[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        }
        GgmlType::F16 => blocks.for_each(|(b, o)| o[0] = f16_at(b, 0)),
        GgmlType::BF16 => blocks.for_each(|(b, o)| {
            o[0] = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16)
        }),
        GgmlType::Q8_0 => blocks.for_each(|(b, o)| q8_0(b, o)),
        GgmlType::Q4_0 => blocks.for_each(|(b, o)| q4_0(b, o)),
        GgmlType::Q4_1 => blocks.for_each(|(b, o)| q4_1(b, o)),
        GgmlType::Q5_0 => blocks.for_each(|(b, o)| q5_0(b, o)),
        GgmlType::Q5_1 => blocks.for_each(|(b, o)| q5_1(b, o)),
        GgmlType::Q4_K => blocks.for_each(|(b, o)| q4_k(b, o)),
        GgmlType::Q5_K => blocks.for_each(|(b, o)| q5_k(b, o)),
        GgmlType::Q6_K => blocks.for_each(|(b, o)| q6_k(b, o)),
        _ => {
            return Err(err!(Checkpoint:
                "ggml type {} (id {}) not supported ({})",
                t.name(),
                t.id(),
                GgmlType::supported_list()
            ))
        }
    }
    Ok(())
}

/// Q8_0, 34 bytes: `d` f16 at 0, 32 × i8 at 2. `y[i] = f32(q[i]) ⊗ d`.
fn q8_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (i, y) in y.iter_mut().enumerate() {
        *y = b[2 + i] as i8 as f32 * d;
    }
}

/// Q4_0, 18 bytes: `d` f16 at 0, 16 bytes of nibbles at 2; value j < 16 is byte j's low nibble,
/// value j + 16 its high nibble, each minus 8. `y = d ⊗ f32(q − 8)`.
fn q4_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for j in 0..16 {
        let q = b[2 + j];
        y[j] = d * ((q & 0x0f) as i32 - 8) as f32;
        y[j + 16] = d * ((q >> 4) as i32 - 8) as f32;
    }
}

/// Q4_1, 20 bytes: `d` f16 at 0, `m` f16 at 2, nibbles at 4 as Q4_0 (unsigned, no offset).
/// `y = (d ⊗ f32(q)) ⊕ m`.
fn q4_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    for j in 0..16 {
        let q = b[4 + j];
        y[j] = d * (q & 0x0f) as f32 + m;
        y[j + 16] = d * (q >> 4) as f32 + m;
    }
}

/// The 5-bit quants of a Q5_0/Q5_1 block: `qh` the u32 (little-endian) of high bits, `qs` the
/// 16 bytes of nibbles. Value j < 16 is byte j's low nibble, value j + 16 its high nibble; bit i
/// of `qh` is value i's fifth bit.
#[inline]
fn q5_quants(qh: &[u8], qs: &[u8]) -> [u8; 32] {
    let qh = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    let mut q = [0u8; 32];
    for j in 0..16 {
        let (lo, hi) = (qs[j] & 0x0f, qs[j] >> 4);
        q[j] = lo | ((((qh >> j) & 1) as u8) << 4);
        q[j + 16] = hi | ((((qh >> (j + 16)) & 1) as u8) << 4);
    }
    q
}

/// Q5_0, 22 bytes: `d` f16 at 0, `qh` u32 at 2, 16 bytes of nibbles at 6 (`q5_quants`).
/// `y = d ⊗ f32(q − 16)` (exact: an f16 times an integer of 5 bits).
fn q5_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (y, q) in y.iter_mut().zip(q5_quants(&b[2..6], &b[6..22])) {
        *y = d * (q as i32 - 16) as f32;
    }
}

/// Q5_1, 24 bytes: `d` f16 at 0, `m` f16 at 2, `qh` u32 at 4, nibbles at 8 (unsigned, no
/// offset). `y = (d ⊗ f32(q)) ⊕ m`.
fn q5_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    for (y, q) in y.iter_mut().zip(q5_quants(&b[4..8], &b[8..24])) {
        *y = d * q as f32 + m;
    }
}

/// Q4_K's 6-bit scales and mins of its 8 sub-blocks, from the 12 packed bytes `s`.
pub fn q4_k_scale_min(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let (mut sc, mut mn) = ([0u8; 8], [0u8; 8]);
    for j in 0..4 {
        sc[j] = s[j] & 0x3f;
        mn[j] = s[j + 4] & 0x3f;
        sc[j + 4] = (s[j + 8] & 0x0f) | ((s[j] >> 6) << 4);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
    (sc, mn)
}

/// Q4_K, 144 bytes, 256 values in 8 sub-blocks of 32: `d` f16 at 0, `dmin` f16 at 2, 12 bytes of
/// packed scales/mins at 4, 128 bytes of nibbles at 16. Sub-block j reads bytes `32·(j/2) ..` of
/// the nibbles, low nibbles for even j, high for odd.
/// `y[32j + l] = ((d ⊗ f32(sc[j])) ⊗ f32(q)) ⊖ (dmin ⊗ f32(mn[j]))`.
fn q4_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (sc, mn) = q4_k_scale_min(&b[4..16]);
    let qs = &b[16..144];
    for j in 0..8 {
        let (dj, mj) = (d * sc[j] as f32, dmin * mn[j] as f32);
        let (bytes, shift) = (&qs[32 * (j / 2)..32 * (j / 2) + 32], 4 * (j % 2));
        for l in 0..32 {
            y[32 * j + l] = dj * ((bytes[l] >> shift) & 0x0f) as f32 - mj;
        }
    }
}

/// Q5_K, 176 bytes, 256 values in 8 sub-blocks of 32: `d` f16 at 0, `dmin` f16 at 2, 12 bytes
/// of packed scales/mins at 4 (as Q4_K), 32 bytes of high bits `qh` at 16, 128 bytes of nibbles
/// at 48 (as Q4_K's). Value `32j + l` takes bit j of `qh[l]` as its fifth bit.
/// `y[32j + l] = ((d ⊗ f32(sc[j])) ⊗ f32(q)) ⊖ (dmin ⊗ f32(mn[j]))`.
fn q5_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (sc, mn) = q4_k_scale_min(&b[4..16]);
    let (qh, qs) = (&b[16..48], &b[48..176]);
    for j in 0..8 {
        let (dj, mj) = (d * sc[j] as f32, dmin * mn[j] as f32);
        let (bytes, shift) = (&qs[32 * (j / 2)..32 * (j / 2) + 32], 4 * (j % 2));
        for l in 0..32 {
            let q = ((bytes[l] >> shift) & 0x0f) | (((qh[l] >> j) & 1) << 4);
            y[32 * j + l] = dj * q as f32 - mj;
        }
    }
}

/// Q6_K, 210 bytes, 256 values in 16 groups of 16: `ql` (128 bytes) at 0, `qh` (64) at 128,
/// 16 × i8 scales at 192, `d` f16 at 208. Value i (h = i / 128, r = i mod 128): low 4 bits
/// `(ql[64h + r mod 64] >> 4·(r / 64)) & 15`, high 2 bits `(qh[32h + r mod 32] >> 2·(r / 32)) & 3`,
/// `q = low | high << 4`, minus 32. `y[i] = (d ⊗ f32(sc[i / 16])) ⊗ f32(q − 32)`.
fn q6_k(b: &[u8], y: &mut [f32]) {
    let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = f16_at(b, 208);
    for (i, y) in y.iter_mut().enumerate() {
        let (h, r) = (i / 128, i % 128);
        let low = (ql[64 * h + r % 64] >> (4 * (r / 64))) & 0x0f;
        let high = (qh[32 * h + r % 32] >> (2 * (r / 32))) & 0x03;
        let q = (low | (high << 4)) as i32 - 32;
        *y = (d * sc[i / 16] as i8 as f32) * q as f32;
    }
}
