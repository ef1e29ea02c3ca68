//! The GGUF reader: hand-built blocks per type (values worked out here, by hand), the parser's
//! refusals, llama's un-permutation against its formula, the config, the engine's store over a
//! GGUF file against the same weights as safetensors, and everything bit for bit against ggml's
//! and transformers' Python (`reference.py`).

use std::path::{Path, PathBuf};

use serde_json::json;

use super::*;

// ---------------------------------------------------------------------------------------------
// A GGUF writer for the tests: the format spelled out byte by byte, sharing nothing with `parse`.

const T_F32: u32 = 0;
const T_F16: u32 = 1;
const T_Q4_0: u32 = 2;
const T_Q4_1: u32 = 3;
const T_Q5_0: u32 = 6;
const T_Q5_1: u32 = 7;
const T_Q2_K: u32 = 10;
const T_Q5_K: u32 = 13;
const T_Q8_0: u32 = 8;
const T_Q4_K: u32 = 12;
const T_Q6_K: u32 = 14;
const T_BF16: u32 = 30;

fn enc_str(s: &str) -> Vec<u8> {
    let mut v = (s.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(s.as_bytes());
    v
}

struct Writer {
    version: u32,
    kv_count: Option<u64>,
    kvs: Vec<u8>,
    n_kv: u64,
    tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
    alignment: usize,
    /// Replaces the offset of the tensor at this index.
    bad_offset: Option<(usize, u64)>,
}

impl Writer {
    fn new(arch: &str) -> Writer {
        let mut w = Writer {
            version: 3,
            kv_count: None,
            kvs: vec![],
            n_kv: 0,
            tensors: vec![],
            alignment: 32,
            bad_offset: None,
        };
        w.kv_str("general.architecture", arch);
        w
    }
    /// A key with its type id and already encoded value.
    fn kv(&mut self, key: &str, t: u32, value: &[u8]) -> &mut Self {
        self.kvs.extend(enc_str(key));
        self.kvs.extend(t.to_le_bytes());
        self.kvs.extend_from_slice(value);
        self.n_kv += 1;
        self
    }
    fn kv_str(&mut self, key: &str, s: &str) -> &mut Self {
        self.kv(key, 8, &enc_str(s))
    }
    fn kv_u32(&mut self, key: &str, v: u32) -> &mut Self {
        self.kv(key, 4, &v.to_le_bytes())
    }
    fn kv_f32(&mut self, key: &str, v: f32) -> &mut Self {
        self.kv(key, 6, &v.to_le_bytes())
    }
    fn tensor(&mut self, name: &str, dims: &[u64], t: u32, data: Vec<u8>) -> &mut Self {
        self.tensors.push((name.into(), dims.to_vec(), t, data));
        self
    }
    fn bytes(&self) -> Vec<u8> {
        let pad = |n: usize| n.div_ceil(self.alignment) * self.alignment;
        let mut f = b"GGUF".to_vec();
        f.extend(self.version.to_le_bytes());
        f.extend((self.tensors.len() as u64).to_le_bytes());
        f.extend(self.kv_count.unwrap_or(self.n_kv).to_le_bytes());
        f.extend_from_slice(&self.kvs);
        let mut offset = 0usize;
        for (i, (name, dims, t, data)) in self.tensors.iter().enumerate() {
            f.extend(enc_str(name));
            f.extend((dims.len() as u32).to_le_bytes());
            for d in dims {
                f.extend(d.to_le_bytes());
            }
            f.extend(t.to_le_bytes());
            let written = match self.bad_offset {
                Some((at, o)) if at == i => o,
                _ => offset as u64,
            };
            f.extend(written.to_le_bytes());
            offset += pad(data.len());
        }
        f.resize(pad(f.len()), 0);
        for (_, _, _, data) in &self.tensors {
            f.extend_from_slice(data);
            f.resize(pad(f.len()), 0);
        }
        f
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Deterministic varied values (an LCG), roughly in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 23) as f32) - 1.0
        })
        .collect()
}

fn dequantize_block(t: u32, block: &[u8], n: usize) -> Vec<f32> {
    let mut out = vec![0.0; n];
    dequantize_row(GgmlType::from_id(t).unwrap(), block, &mut out).unwrap();
    out
}

// ---------------------------------------------------------------------------------------------
// Hand-built blocks.

#[test]
fn f32_f16_bf16_widen_exactly() {
    let f16s: [(u16, u32); 9] = [
        (0x3c00, 0x3f80_0000), // 1.0
        (0xc000, 0xc000_0000), // -2.0
        (0x3555, 0x3eaa_a000), // 0.333251953125 (mantissa 0x155 << 13)
        (0x0001, 0x3380_0000), // smallest subnormal 2^-24
        (0x83ff, 0xb87f_c000), // -(1023 · 2^-24)
        (0x8000, 0x8000_0000), // -0.0
        (0x7c00, 0x7f80_0000), // +inf
        (0x7c01, 0x7f80_2000), // signalling NaN: payload kept, not quietened
        (0xfe00, 0xffc0_0000), // negative quiet NaN
    ];
    for (h, want) in f16s {
        assert_eq!(f16_to_f32(h).to_bits(), want, "f16 {h:#06x}");
        let got = dequantize_block(T_F16, &h.to_le_bytes(), 1);
        assert_eq!(got[0].to_bits(), want, "F16 tensor {h:#06x}");
    }
    let got = dequantize_block(T_BF16, &[0x80, 0x3f, 0x01, 0xff], 2);
    assert_eq!(got[0].to_bits(), 0x3f80_0000);
    assert_eq!(got[1].to_bits(), 0xff01_0000);
    let got = dequantize_block(T_F32, &0x7fa0_0001u32.to_le_bytes(), 1);
    assert_eq!(got[0].to_bits(), 0x7fa0_0001);
}

#[test]
fn q8_0_block() {
    // d = 0.5 (f16 0x3800); q[i] = i8 of byte i.
    let mut b = vec![0x00, 0x38];
    let q: Vec<i8> = (0..32)
        .map(|i| [-128, -1, 0, 1, 127, 3, -7, 64][i % 8])
        .collect();
    b.extend(q.iter().map(|&x| x as u8));
    let y = dequantize_block(T_Q8_0, &b, 32);
    assert_eq!(y[..8], [-64.0, -0.5, 0.0, 0.5, 63.5, 1.5, -3.5, 32.0]);
    assert_eq!(y[8..16], y[..8]);
}

#[test]
fn q4_0_block() {
    // d = 0.5; byte j holds low nibble j and high nibble 15 − j: value j is 0.5·(j − 8),
    // value 16 + j is 0.5·(7 − j).
    let mut b = vec![0x00, 0x38];
    b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    let y = dequantize_block(T_Q4_0, &b, 32);
    assert_eq!(y[0], -4.0);
    assert_eq!(y[8], 0.0);
    assert_eq!(y[15], 3.5);
    assert_eq!(y[16], 3.5);
    assert_eq!(y[31], -4.0);
    for j in 0..16 {
        assert_eq!(y[j], 0.5 * (j as f32 - 8.0), "value {j}");
        assert_eq!(y[16 + j], 0.5 * (7.0 - j as f32), "value {}", 16 + j);
    }
}

#[test]
fn q4_1_block() {
    // d = 1024 (f16 0x6400), m = 2^-11 (f16 0x1000); nibbles as in q4_0_block. The sum is
    // rounded once to f32: 1024 + 2^-11 is exact (ulp 2^-13 there), 15360 + 2^-11 is a tie
    // (ulp 2^-10) and rounds to the even 15360.
    let mut b = vec![0x00, 0x64, 0x00, 0x10];
    b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    let y = dequantize_block(T_Q4_1, &b, 32);
    assert_eq!(y[0], 0.00048828125); // 0·1024 + 2^-11
    assert_eq!(y[1], 1024.0 + 0.00048828125); // 1024 + 2^-11, exact
    assert_eq!(y[15], 15360.0);
    assert_eq!(y[16], 15360.0);
    assert_eq!(y[30], 1024.0 + 0.00048828125);
}

#[test]
fn q4_k_block() {
    // Sub-block scales sc = [1, 2, 3, 4, 5, 6, 7, 63], mins mn = [0, 1, 2, 3, 60, 61, 62, 63],
    // packed by hand: bytes 0..4 = sc[0..4] | (sc[4..8] >> 4) << 6, bytes 4..8 =
    // mn[0..4] | (mn[4..8] >> 4) << 6, bytes 8..12 = (sc[4..8] & 15) | (mn[4..8] & 15) << 4.
    let scales = [
        0x01, 0x02, 0x03, 0xc4, 0xc0, 0xc1, 0xc2, 0xc3, 0xc5, 0xd6, 0xe7, 0xff,
    ];
    assert_eq!(
        q4_k_scale_min(&scales),
        ([1, 2, 3, 4, 5, 6, 7, 63], [0, 1, 2, 3, 60, 61, 62, 63])
    );
    // d = 1, dmin = 0.5; nibble byte k holds low k mod 16, high 15 − k mod 16.
    let mut b = vec![0x00, 0x3c, 0x00, 0x38];
    b.extend_from_slice(&scales);
    b.extend((0..128u32).map(|k| ((k % 16) | ((15 - k % 16) << 4)) as u8));
    let y = dequantize_block(T_Q4_K, &b, 256);
    assert_eq!(y[3], 3.0); // sub-block 0, q 3: 1·3 − 0
    assert_eq!(y[32 + 3], 23.5); // sub-block 1 (high nibbles), q 12: 2·12 − 0.5
    assert_eq!(y[7 * 32], 913.5); // sub-block 7, q 15: 63·15 − 31.5
    assert_eq!(y[4 * 32 + 17], -25.0); // sub-block 4, q 1: 5·1 − 30
    let (sc, mn) = ([1, 2, 3, 4, 5, 6, 7, 63], [0, 1, 2, 3, 60, 61, 62, 63]);
    for i in 0..256 {
        let (j, l) = (i / 32, i % 32);
        let q = if j % 2 == 0 { l % 16 } else { 15 - l % 16 };
        let want = (sc[j] * q) as f64 - 0.5 * mn[j] as f64; // exact in both
        assert_eq!(y[i] as f64, want, "value {i}");
    }
    // Rounding: d = 1 + 2^-10 (0x3c01), dmin = 2^-24 (subnormal 0x0001), sc[7] = 63, mn[7] = 63:
    // (63·(1 + 2^-10))·15 = 968625/1024 exactly; minus 63·2^-24 rounds back to it (ulp 2^-14).
    b[..4].copy_from_slice(&[0x01, 0x3c, 0x01, 0x00]);
    let y = dequantize_block(T_Q4_K, &b, 256);
    assert_eq!(y[7 * 32], 968625.0 / 1024.0);
}

#[test]
fn q6_k_block() {
    // ql byte k: low nibble k mod 16, high 15 − k mod 16; every qh byte 0b11_10_01_00 (its four
    // 2-bit fields are 0, 1, 2, 3); scales i − 8 for group i; d = 0.5.
    let mut b: Vec<u8> = (0..128u32)
        .map(|k| ((k % 16) | ((15 - k % 16) << 4)) as u8)
        .collect();
    b.extend([0xe4u8; 64]);
    b.extend((0..16).map(|i| (i as i8 - 8) as u8));
    b.extend([0x00, 0x38]);
    let y = dequantize_block(T_Q6_K, &b, 256);
    assert_eq!(y[0], 128.0); // low 0, high 0: q −32; scale −8: (0.5·−8)·−32
    assert_eq!(y[127], -8.0); // low 15 − 15, high 3: q 16; scale −1
    assert_eq!(y[200], 14.0); // second half, r 72: low 15 − 8, high 2: q 7; scale 4
    for i in 0..256 {
        let r = i % 128;
        let low = if r < 64 { r % 16 } else { 15 - r % 16 };
        let q = (low | (r / 32) << 4) as f32 - 32.0;
        let want = (0.5 * ((i / 16) as f32 - 8.0)) * q; // exact
        assert_eq!(y[i], want, "value {i}");
    }
}

/// 32 five-bit quants as Q5_0/Q5_1 store them: the u32 of fifth bits (bit i: quant i's), then 16
/// bytes whose low nibbles are quants 0..16 and high nibbles 16..32.
fn q5_bits(q: &[u8; 32]) -> Vec<u8> {
    let qh: u32 = (0..32).map(|i| (((q[i] >> 4) & 1) as u32) << i).sum();
    let mut b = qh.to_le_bytes().to_vec();
    b.extend((0..16).map(|j| (q[j] & 15) | ((q[j + 16] & 15) << 4)));
    b
}

fn f16_bytes(x: f32) -> [u8; 2] {
    half::f16::from_f32(x).to_bits().to_le_bytes()
}

#[test]
fn q5_0_block() {
    // q[i] = (7i + 3) mod 32: every fifth bit and nibble used. d = 0.5: y = 0.5·(q − 16).
    let q: [u8; 32] = std::array::from_fn(|i| ((7 * i + 3) % 32) as u8);
    let block = |d: f32| [f16_bytes(d).to_vec(), q5_bits(&q)].concat();
    let y = dequantize_block(T_Q5_0, &block(0.5), 32);
    assert_eq!(y[0], -6.5); // q 3
    assert_eq!(y[2], 0.5); // q 17
    assert_eq!(y[19], -4.0); // q (7·19 + 3) mod 32 = 8, its fifth bit clear
    for i in 0..32 {
        assert_eq!(y[i], 0.5 * (q[i] as f32 - 16.0), "value {i}");
    }
    // d = −0.0: the product's sign, +0.0 for q < 16, −0.0 for q ≥ 16 (q − 16 = 0 too).
    let y = dequantize_block(T_Q5_0, &block(-0.0), 32);
    for i in 0..32 {
        assert_eq!(
            y[i].to_bits(),
            if q[i] >= 16 { 0x8000_0000 } else { 0 },
            "value {i}"
        );
    }
    // d = 65504 (f16's largest), and its negative: exact products, −16·65504 the extreme.
    for d in [65504.0f32, -65504.0] {
        let y = dequantize_block(T_Q5_0, &block(d), 32);
        for i in 0..32 {
            assert_eq!(y[i], d * (q[i] as f32 - 16.0), "value {i}");
        }
    }
}

#[test]
fn q5_1_block() {
    // d = 1024, m = 2^-11, one rounding: 1024·q + 2^-11 is exact below 8192 (ulp 2^-11 there);
    // from 8192 (ulp 2^-10) it is a tie, or less than half an ulp, and rounds to the even 1024·q.
    let q: [u8; 32] = std::array::from_fn(|i| ((7 * i + 3) % 32) as u8);
    let mut b = [f16_bytes(1024.0), f16_bytes(0.00048828125)].concat();
    b.extend(q5_bits(&q));
    let y = dequantize_block(T_Q5_1, &b, 32);
    for i in 0..32 {
        let exact = 1024.0 * q[i] as f64 + 0.00048828125;
        let want = if q[i] < 8 {
            exact
        } else {
            1024.0 * q[i] as f64
        };
        assert_eq!(y[i] as f64, want, "value {i}");
    }
    // m = −0.0 and d·q = +0.0 (q = 0, d = 1): +0.0 ⊕ −0.0 = +0.0; d = m = −0.0: −0.0.
    for (d, m, bits) in [(1.0, -0.0, 0u32), (-0.0, -0.0, 0x8000_0000)] {
        let mut b = [f16_bytes(d), f16_bytes(m)].concat();
        b.extend(q5_bits(&[0; 32]));
        let y = dequantize_block(T_Q5_1, &b, 32);
        assert!(y.iter().all(|v| v.to_bits() == bits), "d {d} m {m}: {y:?}");
    }
}

#[test]
fn q5_k_block() {
    // Scales sc = 1..=8, mins mn = 0..8 (all below 16: bytes 0..8 direct, bytes 8..12 the
    // nibbles of sub-blocks 4..8); d = 1, dmin = 0.25; qh byte l = l (bit j of l: value l of
    // sub-block j's fifth bit); nibble byte k: low k mod 16, high 15 − k mod 16.
    let (sc, mn): ([u32; 8], [u32; 8]) = ([1, 2, 3, 4, 5, 6, 7, 8], [0, 1, 2, 3, 4, 5, 6, 7]);
    let mut b = [f16_bytes(1.0), f16_bytes(0.25)].concat();
    b.extend((0..4).map(|j| sc[j] as u8));
    b.extend((0..4).map(|j| mn[j] as u8));
    b.extend((4..8).map(|j| (sc[j] | (mn[j] << 4)) as u8));
    b.extend(0..32u8);
    b.extend((0..128u32).map(|k| ((k % 16) | ((15 - k % 16) << 4)) as u8));
    assert_eq!(b.len(), 176);
    let y = dequantize_block(T_Q5_K, &b, 256);
    assert_eq!(y[31], 31.0); // sub-block 0, l 31: low 15, bit 0 of 31 set: q 31; 1·31 − 0
    assert_eq!(y[32 + 16], 29.75); // sub-block 1, l 16: low 15, bit 1 of 16 clear: 2·15 − 0.25
    assert_eq!(y[7 * 32 + 31], -1.75); // sub-block 7, l 31: low 0, bit 7 of 31 clear: 8·0 − 1.75
    for i in 0..256 {
        let (j, l) = (i / 32, i % 32);
        let low = if j % 2 == 0 { l % 16 } else { 15 - l % 16 } as u32;
        let q = low | ((l as u32 >> j) & 1) << 4;
        let want = (sc[j] * q) as f64 - 0.25 * mn[j] as f64; // exact in both
        assert_eq!(y[i] as f64, want, "value {i}");
    }
    // d = −0.0, dmin = 65504: (−0·sc)·q − 65504·mn; d = 65504, dmin = −0.0: 65504·sc·q + 0.
    b[..4].copy_from_slice(&[f16_bytes(-0.0), f16_bytes(65504.0)].concat());
    let y = dequantize_block(T_Q5_K, &b, 256);
    assert_eq!(y[0].to_bits(), (-0.0f32).to_bits()); // −0 ⊖ (65504·0) = −0 − 0 = −0
    assert_eq!(y[32], -65504.0); // sub-block 1: −0 ⊖ 65504·1
    b[..4].copy_from_slice(&[f16_bytes(65504.0), f16_bytes(-0.0)].concat());
    let y = dequantize_block(T_Q5_K, &b, 256);
    assert_eq!(y[7 * 32 + 16], 65504.0 * 8.0 * 15.0); // sub-block 7, l 16: low 15, bit 7 of 16 clear
    assert_eq!(y[0].to_bits(), 0); // 0 ⊖ (−0·0) = 0 − (−0) = +0
}

// ---------------------------------------------------------------------------------------------
// The parser's refusals, each naming what it is about.

fn parse_err(bytes: &[u8]) -> String {
    parse(bytes, "m.gguf").expect_err("refused").to_string()
}

fn one_tensor() -> Writer {
    let mut w = Writer::new("qwen3");
    w.tensor("a", &[4, 2], T_F32, f32_bytes(&values(8, 1)));
    w
}

#[test]
fn parses_what_it_was_given() {
    let mut w = Writer::new("llama");
    w.kv_u32("general.alignment", 64)
        .kv("k.u8", 0, &[7])
        .kv("k.i8", 1, &[0xff])
        .kv("k.i16", 3, &(-2i16).to_le_bytes())
        .kv("k.bool", 7, &[1])
        .kv("k.u64", 10, &u64::MAX.to_le_bytes())
        .kv("k.i64", 11, &(-3i64).to_le_bytes())
        .kv("k.f64", 12, &0.1f64.to_le_bytes())
        .kv_f32("k.f32", 1e-6);
    // A nested array: [[1, 2], ["x"]] (each inner array has its own item type).
    let mut nested = 9u32.to_le_bytes().to_vec();
    nested.extend(2u64.to_le_bytes());
    nested.extend(4u32.to_le_bytes());
    nested.extend(2u64.to_le_bytes());
    nested.extend(1u32.to_le_bytes());
    nested.extend(2u32.to_le_bytes());
    nested.extend(8u32.to_le_bytes());
    nested.extend(1u64.to_le_bytes());
    nested.extend(enc_str("x"));
    w.kv("k.nested", 9, &nested);
    w.alignment = 64;
    w.tensor("a", &[64, 3], T_Q8_0, vec![0; 6 * 34]);
    w.tensor("b", &[5], T_F16, vec![0; 10]);
    let bytes = w.bytes();
    let h = parse(&bytes, "m.gguf").unwrap();
    assert_eq!((h.version, h.alignment), (3, 64));
    assert_eq!(h.get("k.u8"), Some(&Value::U8(7)));
    assert_eq!(h.get("k.i8"), Some(&Value::I8(-1)));
    assert_eq!(h.get("k.i16"), Some(&Value::I16(-2)));
    assert_eq!(h.get("k.bool"), Some(&Value::Bool(true)));
    assert_eq!(h.get("k.u64"), Some(&Value::U64(u64::MAX)));
    assert_eq!(h.get("k.i64"), Some(&Value::I64(-3)));
    assert_eq!(h.get("k.f64"), Some(&Value::F64(0.1)));
    assert_eq!(h.get("k.f32"), Some(&Value::F32(1e-6)));
    assert_eq!(
        h.get("k.nested"),
        Some(&Value::Array(Array::Array(vec![
            Array::U32(vec![1, 2]),
            Array::Str(vec!["x".into()]),
        ])))
    );
    assert_eq!(h.data_start % 64, 0);
    let (a, b) = (&h.tensors[0], &h.tensors[1]);
    assert_eq!(
        (a.shape(), a.start, a.end),
        (vec![3, 64], h.data_start, h.data_start + 204)
    );
    // b starts at a's end padded to 64: 204 → 256.
    assert_eq!(
        (b.shape(), b.start, b.end),
        (vec![5], h.data_start + 256, h.data_start + 266)
    );
}

#[test]
fn refuses_a_wrong_magic_version_or_byte_order() {
    let mut bytes = one_tensor().bytes();
    bytes[..4].copy_from_slice(b"GGML");
    let e = parse_err(&bytes);
    assert!(
        e.contains("m.gguf: not a GGUF file (it starts with b\"GGML\""),
        "{e}"
    );
    for (v, says) in [
        (1u32, "GGUF version 1 not supported"),
        (4, "GGUF version 4 not supported"),
        (0x0300_0000, "big-endian GGUF"),
    ] {
        let mut w = one_tensor();
        w.version = v;
        let e = parse_err(&w.bytes());
        assert!(e.contains(says), "{e}");
    }
    let e = parse_err(b"GG");
    assert!(
        e.contains("m.gguf: truncated: the magic needs 4 bytes at offset 0"),
        "{e}"
    );
}

#[test]
fn refuses_a_truncated_file_naming_what_was_cut() {
    let mut w = Writer::new("qwen3");
    w.kv_str("general.name", "a fairly long model name");
    let bytes = w.bytes();
    // Cut inside general.name's value.
    let at = bytes.windows(7).position(|s| s == b"a fairl").unwrap() + 3;
    let e = parse_err(&bytes[..at]);
    assert!(
        e.contains("truncated: metadata general.name needs 24 bytes"),
        "{e}"
    );
}

#[test]
fn refuses_tensor_data_past_the_end() {
    let bytes = one_tensor().bytes();
    let e = parse_err(&bytes[..bytes.len() - 2]);
    assert!(
        e.contains("tensor a: 32 bytes at offset 0") && e.contains("run past the end of the file"),
        "{e}"
    );
    // Trailing bytes beyond the data section belong to no tensor.
    let mut bytes = one_tensor().bytes();
    bytes.extend([0u8; 40]);
    let e = parse_err(&bytes);
    assert!(e.contains("40 bytes after the data section"), "{e}");
}

#[test]
fn refuses_unknown_types_and_bad_layouts() {
    let mut w = one_tensor();
    w.tensor("b", &[4], 5, vec![0; 16]); // id 5: a removed type (Q4_2)
    let e = parse_err(&w.bytes());
    assert!(e.contains("tensor b: unknown ggml type id 5"), "{e}");

    let mut w = Writer::new("qwen3");
    w.kv("k.x", 13, &[0; 8]);
    let e = parse_err(&w.bytes());
    assert!(e.contains("metadata k.x: unknown value type 13"), "{e}");

    let mut w = Writer::new("qwen3");
    w.kv("k.b", 7, &[2]);
    let e = parse_err(&w.bytes());
    assert!(e.contains("metadata k.b: BOOL byte 2"), "{e}");

    let mut w = Writer::new("qwen3");
    w.tensor("q", &[48, 2], T_Q8_0, vec![0; 102]);
    let e = parse_err(&w.bytes());
    assert!(
        e.contains("tensor q: ne0 = 48 is not a multiple of Q8_0's block of 32"),
        "{e}"
    );

    let mut w = one_tensor();
    w.tensor("b", &[4], T_F32, vec![0; 16]);
    w.bad_offset = Some((1, 0));
    let e = parse_err(&w.bytes());
    assert!(e.contains("tensor b: offset 0, expected 32"), "{e}");

    let mut w = one_tensor();
    w.tensor("a", &[4], T_F32, vec![0; 16]);
    let e = parse_err(&w.bytes());
    assert!(e.contains("tensor a appears twice"), "{e}");

    let mut w = one_tensor();
    w.kv_str("general.architecture", "llama");
    let e = parse_err(&w.bytes());
    assert!(
        e.contains("metadata key general.architecture appears twice"),
        "{e}"
    );

    let mut w = one_tensor();
    w.kv_u32("general.alignment", 48);
    let e = parse_err(&w.bytes());
    assert!(
        e.contains("general.alignment = UINT32 U32(48) must be a UINT32 power of two"),
        "{e}"
    );

    let mut w = one_tensor();
    w.tensor("five", &[1, 1, 1, 1, 1], T_F32, vec![0; 4]);
    let e = parse_err(&w.bytes());
    assert!(e.contains("tensor five: 5 dimensions (at most 4)"), "{e}");

    let mut w = one_tensor();
    w.tensor("huge", &[1 << 32, 1 << 32], T_F32, vec![]);
    let e = parse_err(&w.bytes());
    assert!(
        e.contains("tensor huge: dims [4294967296, 4294967296] overflow"),
        "{e}"
    );
}

#[test]
fn refuses_absurd_counts_before_reserving_anything() {
    let mut w = one_tensor();
    w.kv_count = Some(1 << 60);
    let e = parse_err(&w.bytes());
    assert!(
        e.contains("1152921504606846976 metadata entries and 1 tensors cannot fit"),
        "{e}"
    );
    // An array claiming 2^62 strings; a string claiming 2^63 bytes.
    let mut arr = 8u32.to_le_bytes().to_vec();
    arr.extend((1u64 << 62).to_le_bytes());
    let mut w = Writer::new("qwen3");
    w.kv("tokenizer.ggml.tokens", 9, &arr);
    let e = parse_err(&w.bytes());
    assert!(
        e.contains("metadata tokenizer.ggml.tokens: array of 4611686018427387904 items of type 8 cannot fit"),
        "{e}"
    );
    let mut w = Writer::new("qwen3");
    w.kv("general.name", 8, &(1u64 << 63).to_le_bytes());
    let e = parse_err(&w.bytes());
    assert!(
        e.contains("metadata general.name needs 9223372036854775808 bytes"),
        "{e}"
    );
    // Arrays nested past the bound.
    let mut deep = Vec::new();
    for _ in 0..20 {
        deep.extend(9u32.to_le_bytes());
        deep.extend(1u64.to_le_bytes());
    }
    deep.extend(0u32.to_le_bytes());
    deep.extend(0u64.to_le_bytes());
    let mut w = Writer::new("qwen3");
    w.kv("k.deep", 9, &deep);
    let e = parse_err(&w.bytes());
    assert!(
        e.contains("metadata k.deep: arrays nested deeper than 8"),
        "{e}"
    );
}

/// An ARRAY value `depth` arrays deep in all (the innermost holds one UINT8).
fn nested(depth: usize) -> Vec<u8> {
    let mut v = [0u32.to_le_bytes().as_slice(), &1u64.to_le_bytes(), &[7]].concat();
    for _ in 1..depth {
        v = [9u32.to_le_bytes().as_slice(), &1u64.to_le_bytes(), &v].concat();
    }
    v
}

#[test]
fn arrays_nest_8_deep_and_no_deeper() {
    // §21.1: 8 levels parse (the contract now reads the same bound: issue 51, where it took 16).
    let mut w = one_tensor();
    w.kv("k.deep", 9, &nested(8));
    let bytes = w.bytes();
    let h = parse(&bytes, "m.gguf").unwrap();
    let mut a = match h.get("k.deep") {
        Some(Value::Array(a)) => a.clone(),
        v => panic!("{v:?}"),
    };
    for _ in 1..8 {
        a = match a {
            Array::Array(mut v) if v.len() == 1 => v.remove(0),
            other => panic!("{other:?}"),
        };
    }
    assert_eq!(a, Array::U8(vec![7]));
    let mut w = one_tensor();
    w.kv("k.deep", 9, &nested(9));
    let e = parse_err(&w.bytes());
    assert!(
        e.contains("metadata k.deep: arrays nested deeper than 8"),
        "{e}"
    );
}

#[test]
fn names_with_control_bytes_are_quoted_escaped() {
    // Issue 51: a key holding "\n" forged a second refusal line; ESC sequences reached the
    // terminal. The refusal is one line of printable characters, the name escaped.
    for (key, shown) in [
        ("t.x\nengine: error: forged", "t.x\\nengine: error: forged"),
        ("t.\u{1b}[2J\u{202e}", "t.\\u{1b}[2J\\u{202e}"),
    ] {
        let mut w = one_tensor();
        w.kv_u32(key, 1).kv_u32(key, 1);
        let e = parse_err(&w.bytes());
        assert!(
            e.contains(&format!("metadata key {shown} appears twice")),
            "{e}"
        );
        assert!(!e.chars().any(|c| c.is_control()), "{e:?}");
    }
    let mut w = Writer::new("qwen3");
    let name = "a\u{1b}[31m";
    w.tensor(name, &[4], T_F32, f32_bytes(&values(4, 1)));
    w.tensor(name, &[4], T_F32, f32_bytes(&values(4, 2)));
    let e = parse_err(&w.bytes());
    assert!(e.contains("tensor a\\u{1b}[31m appears twice"), "{e}");
    // The header keeps the file's own names; an ordinary name is quoted as itself.
    let mut w = Writer::new("qwen3");
    w.tensor(name, &[4], T_F32, f32_bytes(&values(4, 1)));
    let bytes = w.bytes();
    assert_eq!(parse(&bytes, "m.gguf").unwrap().tensors[0].name, name);
    assert_eq!(
        super::parse::shown("blk.0.attn_q.weight"),
        "blk.0.attn_q.weight"
    );
}

// ---------------------------------------------------------------------------------------------
// load: names, types, un-permutation, config.

fn write_file(dir: &Path, name: &str, w: &Writer) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, w.bytes()).unwrap();
    p
}

fn load_err(w: &Writer) -> String {
    let tmp = tempfile::tempdir().unwrap();
    let p = write_file(tmp.path(), "m.gguf", w);
    load(&p).err().expect("refused").to_string()
}

#[test]
fn refuses_unsupported_types_unknown_names_and_architectures() {
    let mut w = Writer::new("qwen3");
    w.tensor("blk.0.ffn_up.weight", &[256, 1], T_Q2_K, vec![0; 84]);
    let e = load_err(&w);
    assert!(
        e.contains("tensor blk.0.ffn_up.weight: type Q2_K (id 10) not supported (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K)"),
        "{e}"
    );
    for name in [
        "rope_freqs.weight",
        "blk.01.ffn_up.weight",
        "blk.0.ffn_norm.bias",
    ] {
        let mut w = Writer::new("qwen3");
        w.tensor(name, &[4], T_F32, vec![0; 16]);
        let e = load_err(&w);
        assert!(
            e.contains(&format!("tensor {name}: not a tensor of a qwen3 model")),
            "{e}"
        );
    }
    // q/k norms are Qwen3's; transformers' Llama has none.
    let mut w = Writer::new("llama");
    w.tensor("blk.0.attn_q_norm.weight", &[4], T_F32, vec![0; 16]);
    let e = load_err(&w);
    assert!(
        e.contains("tensor blk.0.attn_q_norm.weight: not a tensor of a llama model"),
        "{e}"
    );
    let e = load_err(&Writer::new("gemma2"));
    assert!(
        e.contains("general.architecture = \"gemma2\" not supported (llama, qwen3, gemma3)"),
        "{e}"
    );
    let mut w = Writer::new("qwen3");
    w.kv("split.count", 2, &3u16.to_le_bytes());
    let e = load_err(&w);
    assert!(
        e.contains("split GGUF (split.count = 3) not supported"),
        "{e}"
    );
}

#[test]
fn names_map_to_hugging_face() {
    let pairs = [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("output_norm.weight", "model.norm.weight"),
        ("output.weight", "lm_head.weight"),
        (
            "blk.0.attn_norm.weight",
            "model.layers.0.input_layernorm.weight",
        ),
        (
            "blk.3.attn_q.weight",
            "model.layers.3.self_attn.q_proj.weight",
        ),
        ("blk.3.attn_q.bias", "model.layers.3.self_attn.q_proj.bias"),
        (
            "blk.3.attn_k.weight",
            "model.layers.3.self_attn.k_proj.weight",
        ),
        ("blk.3.attn_v.bias", "model.layers.3.self_attn.v_proj.bias"),
        (
            "blk.12.attn_output.weight",
            "model.layers.12.self_attn.o_proj.weight",
        ),
        (
            "blk.1.attn_q_norm.weight",
            "model.layers.1.self_attn.q_norm.weight",
        ),
        (
            "blk.1.attn_k_norm.weight",
            "model.layers.1.self_attn.k_norm.weight",
        ),
        (
            "blk.1.ffn_norm.weight",
            "model.layers.1.post_attention_layernorm.weight",
        ),
        (
            "blk.1.ffn_gate.weight",
            "model.layers.1.mlp.gate_proj.weight",
        ),
        ("blk.1.ffn_up.weight", "model.layers.1.mlp.up_proj.weight"),
        (
            "blk.1.ffn_down.weight",
            "model.layers.1.mlp.down_proj.weight",
        ),
    ];
    for (g, h) in pairs {
        assert_eq!(hf_name(Arch::Qwen3, g).as_deref(), Some(h), "{g}");
    }
    for g in [
        "blk.x.ffn_up.weight",
        "blk.0.ffn_up",
        "blk.0.ffn_up.scale",
        "blk..attn_q.weight",
    ] {
        assert_eq!(hf_name(Arch::Qwen3, g), None, "{g}");
    }
}

#[test]
fn unpermutation_follows_the_formula() {
    // 8 rows, 2 heads: dim = 8 / 2 / 2 = 2. Within a head llama.cpp stored [i, j] at 2i + j;
    // transformers reads [j, i]: HF rows (j0 i0, j0 i1, j1 i0, j1 i1) = stored (0, 2, 1, 3).
    let want = [0, 2, 1, 3, 4, 6, 5, 7];
    let got: Vec<usize> = (0..8).map(|r| unpermuted_row(r, 8, 2)).collect();
    assert_eq!(got, want);
    // 12 rows, 1 head: dim 6: HF row j·6 + i from stored 2i + j.
    let want = [0, 2, 4, 6, 8, 10, 1, 3, 5, 7, 9, 11];
    let got: Vec<usize> = (0..12).map(|r| unpermuted_row(r, 12, 1)).collect();
    assert_eq!(got, want);

    // Through load: llama attn_q (4 heads) and attn_k (2 kv heads) of 8 rows × 32 columns, f32,
    // bias of attn_k too; qwen3 leaves them as stored.
    let q = values(8 * 32, 2);
    let k = values(8 * 32, 3);
    let kb = values(8, 4);
    for (arch, heads) in [("llama", Some((4, 2))), ("qwen3", None)] {
        let mut w = Writer::new(arch);
        w.kv_u32(&format!("{arch}.attention.head_count"), 4)
            .kv_u32(&format!("{arch}.attention.head_count_kv"), 2)
            .tensor("blk.0.attn_q.weight", &[32, 8], T_F32, f32_bytes(&q))
            .tensor("blk.0.attn_k.weight", &[32, 8], T_F32, f32_bytes(&k))
            .tensor("blk.0.attn_k.bias", &[8], T_F32, f32_bytes(&kb));
        let tmp = tempfile::tempdir().unwrap();
        let m = load(&write_file(tmp.path(), "m.gguf", &w)).unwrap();
        let (qh, kh) = heads.map_or((None, None), |(a, b)| (Some(a), Some(b)));
        for (t, stored, cols, h) in [(0, &q, 32, qh), (1, &k, 32, kh), (2, &kb, 1, kh)] {
            let got = m.to_f32(&m.tensors[t]).unwrap();
            assert_eq!(
                m.tensors[t].permuted_heads, h,
                "{arch} {}",
                m.tensors[t].name
            );
            for r in 0..8 {
                // rows / heads / 2 stored pairs per head.
                let src = h.map_or(r, |h| {
                    let dim = 8 / h / 2;
                    let (head, j, i) = (r / (2 * dim), r % (2 * dim) / dim, r % dim);
                    head * 2 * dim + 2 * i + j
                });
                assert_eq!(
                    got[r * cols..(r + 1) * cols],
                    stored[src * cols..(src + 1) * cols]
                );
            }
        }
    }
    // Rows that do not split into the heads' pairs; a missing kv head count.
    let mut w = Writer::new("llama");
    w.kv_u32("llama.attention.head_count", 3)
        .kv_u32("llama.attention.head_count_kv", 3)
        .tensor("blk.0.attn_q.weight", &[32, 8], T_F32, f32_bytes(&q));
    let e = load_err(&w);
    assert!(
        e.contains("tensor blk.0.attn_q.weight: shape [8, 32] does not split into 3 heads"),
        "{e}"
    );
    let mut w = Writer::new("llama");
    w.kv(
        "llama.attention.head_count",
        10,
        &(1u64 << 63).to_le_bytes(),
    )
    .kv_u32("llama.attention.head_count_kv", 1)
    .tensor("blk.0.attn_q.weight", &[32, 8], T_F32, f32_bytes(&q));
    let e = load_err(&w);
    assert!(
        e.contains("does not split into 9223372036854775808 heads"),
        "{e}"
    );
    let mut w = Writer::new("llama");
    w.kv_u32("llama.attention.head_count", 4).tensor(
        "blk.0.attn_k.weight",
        &[32, 8],
        T_F32,
        f32_bytes(&k),
    );
    let e = load_err(&w);
    assert!(
        e.contains("llama.attention.head_count_kv is missing"),
        "{e}"
    );
}

#[test]
fn config_is_transformers_gguf_config() {
    let mut w = Writer::new("qwen3");
    w.kv_str("general.name", "Tiny")
        .kv_u32("qwen3.block_count", 2)
        .kv_u32("qwen3.context_length", 40960)
        .kv_u32("qwen3.embedding_length", 32)
        .kv_u32("qwen3.feed_forward_length", 64)
        .kv_u32("qwen3.rope.dimension_count", 128) // not read for qwen3
        .kv_f32("qwen3.rope.freq_base", 1e6)
        .kv_u32("qwen3.attention.head_count", 2)
        .kv_u32("qwen3.attention.head_count_kv", 1)
        .kv_f32("qwen3.attention.layer_norm_rms_epsilon", 1e-6)
        .kv_str("qwen3.unknown", "ignored");
    let mut toks = 8u32.to_le_bytes().to_vec();
    toks.extend(3u64.to_le_bytes());
    for t in ["a", "b", "c"] {
        toks.extend(enc_str(t));
    }
    w.kv("tokenizer.ggml.tokens", 9, &toks);
    let tmp = tempfile::tempdir().unwrap();
    let m = load(&write_file(tmp.path(), "m.gguf", &w)).unwrap();
    let want = json!({
        "tie_word_embeddings": true,
        "model_type": "qwen3",
        "_model_name_or_path": "Tiny",
        "num_hidden_layers": 2,
        "max_position_embeddings": 40960,
        "hidden_size": 32,
        "intermediate_size": 64,
        "rope_theta": 1000000.0,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "rms_norm_eps": 9.999999974752427e-7, // the f32 nearest 1e-6, widened
        "vocab_size": 3,
        // Not read by transformers for qwen3; the file states it (§21.5).
        "head_dim": 128,
        "architectures": ["Qwen3ForCausalLM"],
    });
    assert_eq!(m.config, want);
    let keys: Vec<&String> = m.config.as_object().unwrap().keys().collect();
    let want_keys: Vec<&String> = want.as_object().unwrap().keys().collect();
    assert_eq!(keys, want_keys, "transformers' order");

    // An output head unties; llama reads rope.dimension_count as head_dim; "mistral".
    let mut w = Writer::new("llama");
    w.kv_str("general.name", "mistral")
        .kv_u32("llama.rope.dimension_count", 64)
        .kv_u32("llama.vocab_size", 10)
        .tensor("output.weight", &[4], T_F32, vec![0; 16]);
    let m = load(&write_file(tmp.path(), "l.gguf", &w)).unwrap();
    assert_eq!(
        m.config,
        json!({
            "tie_word_embeddings": false,
            "model_type": "mistral",
            "_model_name_or_path": "mistral",
            "head_dim": 64,
            "vocab_size": 10,
            "architectures": ["MistralForCausalLM"],
        })
    );

    // A qwen3 head size transformers would not read (it keeps 128) is the file's.
    let mut w = Writer::new("qwen3");
    w.kv_u32("qwen3.attention.key_length", 64);
    let m = load(&write_file(tmp.path(), "k.gguf", &w)).unwrap();
    assert_eq!(m.config["head_dim"], json!(64));
    // What no producer honours is refused.
    let mut w = Writer::new("llama");
    w.kv_str("llama.rope.scaling.type", "linear");
    let e = load_err(&w);
    assert!(
        e.contains("llama.rope.scaling.type = Str(\"linear\")"),
        "{e}"
    );
    let mut w = Writer::new("llama");
    let mut per_layer = 4u32.to_le_bytes().to_vec();
    per_layer.extend(2u64.to_le_bytes());
    per_layer.extend([8u8, 0, 0, 0, 8, 0, 0, 0]);
    w.kv("llama.attention.head_count", 9, &per_layer);
    let e = load_err(&w);
    assert!(
        e.contains("metadata llama.attention.head_count is an array"),
        "{e}"
    );
}

#[test]
fn gemma3_names_norms_and_config() {
    // The four norms of a Gemma 3 layer; llama.cpp's ffn_norm is the pre-feed-forward norm here.
    for (g, h) in [
        (
            "blk.2.attn_norm.weight",
            "model.layers.2.input_layernorm.weight",
        ),
        (
            "blk.2.post_attention_norm.weight",
            "model.layers.2.post_attention_layernorm.weight",
        ),
        (
            "blk.2.ffn_norm.weight",
            "model.layers.2.pre_feedforward_layernorm.weight",
        ),
        (
            "blk.2.post_ffw_norm.weight",
            "model.layers.2.post_feedforward_layernorm.weight",
        ),
        (
            "blk.2.attn_q_norm.weight",
            "model.layers.2.self_attn.q_norm.weight",
        ),
        (
            "blk.2.attn_k_norm.weight",
            "model.layers.2.self_attn.k_norm.weight",
        ),
    ] {
        assert_eq!(hf_name(Arch::Gemma3, g).as_deref(), Some(h), "{g}");
    }
    assert_eq!(hf_name(Arch::Qwen3, "blk.2.post_ffw_norm.weight"), None);
    // Stored w + 1, read as stored ⊖ 1 in f32: 1e-9 + 1 is stored as 1e-9 here (the file's
    // value), and 1e-9 ⊖ 1 rounds to −1; 3 ⊖ 1 = 2 exactly. Not the embedding, not a matrix.
    let mut w = Writer::new("gemma3");
    w.kv_u32("gemma3.block_count", 13)
        .kv_u32("gemma3.attention.key_length", 32)
        .kv_u32("gemma3.attention.sliding_window", 512)
        .kv_f32("gemma3.rope.freq_base", 1e6)
        .tensor(
            "blk.0.post_ffw_norm.weight",
            &[2],
            T_F32,
            f32_bytes(&[1e-9, 3.0]),
        )
        .tensor("token_embd.weight", &[2], T_F32, f32_bytes(&[1e-9, 3.0]));
    let tmp = tempfile::tempdir().unwrap();
    let m = load(&write_file(tmp.path(), "g.gguf", &w)).unwrap();
    assert_eq!(m.to_f32(&m.tensors[0]).unwrap(), [-1.0, 2.0]);
    assert_eq!(m.to_f32(&m.tensors[1]).unwrap(), [1e-9, 3.0]);
    let store = m.into_store().unwrap();
    let norm = store
        .take("model.layers.0.post_feedforward_layernorm.weight", &[2])
        .unwrap();
    assert_eq!(norm.to_vec(), [-1.0, 2.0]);
    let m = load(&write_file(tmp.path(), "g.gguf", &w)).unwrap();
    let kinds: Vec<&str> = (0..13)
        .map(|i| {
            if i == 5 || i == 11 {
                "full_attention"
            } else {
                "sliding_attention"
            }
        })
        .collect();
    assert_eq!(
        m.config,
        json!({
            "tie_word_embeddings": true,
            "model_type": "gemma3_text",
            "num_hidden_layers": 13,
            "head_dim": 32,
            "sliding_window": 512,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            },
            "layer_types": kinds,
            "query_pre_attn_scalar": 256,
            "hidden_activation": "gelu_pytorch_tanh",
            "final_logit_softcapping": null,
            "attn_logit_softcapping": null,
            "architectures": ["Gemma3ForCausalLM"],
        })
    );
    // Rope scaling (Gemma 3 4B and larger: linear ×8 on the global layers) is refused, as for
    // every architecture: transformers' GGUF loader would drop it.
    w.kv_str("gemma3.rope.scaling.type", "linear");
    let e = load_err(&w);
    assert!(
        e.contains("gemma3.rope.scaling.type = Str(\"linear\")"),
        "{e}"
    );
}

#[test]
fn model_file_finds_the_one_gguf() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    assert_eq!(model_file(d).unwrap(), None);
    std::fs::write(d.join("a.gguf"), b"").unwrap();
    assert_eq!(model_file(d).unwrap(), Some(d.join("a.gguf")));
    assert_eq!(
        model_file(&d.join("a.gguf")).unwrap(),
        Some(d.join("a.gguf"))
    );
    std::fs::write(d.join("b.gguf"), b"").unwrap();
    let e = model_file(d).err().unwrap().to_string();
    assert!(
        e.contains("2 .gguf files (a.gguf, b.gguf): expected exactly one"),
        "{e}"
    );
    // Safetensors beside a .gguf: which are the weights would be a guess.
    std::fs::remove_file(d.join("b.gguf")).unwrap();
    std::fs::write(d.join("model.safetensors"), b"").unwrap();
    let e = model_file(d).err().unwrap().to_string();
    assert!(e.contains("holds both *.safetensors and .gguf"), "{e}");
    // Safetensors alone: a safetensors checkpoint, as before.
    std::fs::remove_file(d.join("a.gguf")).unwrap();
    assert_eq!(model_file(d).unwrap(), None);
}

// ---------------------------------------------------------------------------------------------
// The engine over a GGUF file: the same trace as the same weights in safetensors.

/// A tiny Qwen3 (head_dim 128, transformers' default for a GGUF qwen3) with tensors of every
/// supported type.
fn tiny_qwen3() -> Writer {
    let (h, ff, v, hd) = (32u64, 64u64, 40u64, 128u64);
    let raw = |n: usize, seed: u64| -> Vec<u8> {
        // Blocks with small finite scales: varied bytes, then every f16 scale set to ≈ 0.01.
        values(n, seed)
            .iter()
            .map(|x| (x.to_bits() >> 7) as u8)
            .collect()
    };
    let with_scales = |mut b: Vec<u8>, size: usize, at: &[usize]| {
        for blk in b.chunks_exact_mut(size) {
            for &o in at {
                blk[o..o + 2].copy_from_slice(&0x2120u16.to_le_bytes());
            }
        }
        b
    };
    let bf16 = |n: usize, seed: u64| -> Vec<u8> {
        values(n, seed)
            .iter()
            .flat_map(|x| ((x.to_bits() >> 16) as u16).to_le_bytes())
            .collect()
    };
    let f16 = |n: usize, seed: u64| -> Vec<u8> {
        values(n, seed)
            .iter()
            .flat_map(|x| half::f16::from_f32(*x).to_bits().to_le_bytes())
            .collect()
    };
    let f32s = |n: usize, seed: u64| f32_bytes(&values(n, seed));
    let mut w = Writer::new("qwen3");
    w.kv_u32("qwen3.block_count", 2)
        .kv_u32("qwen3.context_length", 128)
        .kv_u32("qwen3.embedding_length", h as u32)
        .kv_u32("qwen3.feed_forward_length", ff as u32)
        .kv_u32("qwen3.attention.head_count", 2)
        .kv_u32("qwen3.attention.head_count_kv", 1)
        .kv_f32("qwen3.rope.freq_base", 1e6)
        .kv_f32("qwen3.attention.layer_norm_rms_epsilon", 1e-6)
        .kv_u32("qwen3.vocab_size", v as u32);
    let n = |a: u64, b: u64| (a * b) as usize;
    w.tensor(
        "token_embd.weight",
        &[h, v],
        T_Q8_0,
        with_scales(raw(n(h, v) / 32 * 34, 1), 34, &[0]),
    );
    for l in 0..2u64 {
        let s = 100 * (l + 1);
        let name = |p: &str| format!("blk.{l}.{p}.weight");
        w.tensor(&name("attn_norm"), &[h], T_F32, f32s(h as usize, s))
            .tensor(
                &name("attn_q"),
                &[h, 2 * hd],
                T_Q4_0,
                with_scales(raw(n(h, 2 * hd) / 32 * 18, s + 1), 18, &[0]),
            )
            .tensor(
                &name("attn_q_norm"),
                &[hd],
                T_BF16,
                bf16(hd as usize, s + 2),
            )
            .tensor(
                &name("attn_k"),
                &[h, hd],
                T_Q4_1,
                with_scales(raw(n(h, hd) / 32 * 20, s + 3), 20, &[0, 2]),
            )
            .tensor(&name("attn_k_norm"), &[hd], T_F16, f16(hd as usize, s + 4))
            .tensor(&name("attn_v"), &[h, hd], T_BF16, bf16(n(h, hd), s + 5))
            .tensor(
                &name("attn_output"),
                &[2 * hd, h],
                T_Q4_K,
                with_scales(raw(n(2 * hd, h) / 256 * 144, s + 6), 144, &[0, 2]),
            )
            .tensor(&name("ffn_norm"), &[h], T_F32, f32s(h as usize, s + 7))
            .tensor(&name("ffn_gate"), &[h, ff], T_F16, f16(n(h, ff), s + 8))
            .tensor(&name("ffn_up"), &[h, ff], T_F32, f32s(n(h, ff), s + 9))
            .tensor(
                &name("ffn_down"),
                &[ff, h],
                T_Q8_0,
                with_scales(raw(n(ff, h) / 32 * 34, s + 10), 34, &[0]),
            );
    }
    w.tensor("output_norm.weight", &[h], T_F32, f32s(h as usize, 7));
    w
}

/// A safetensors checkpoint in `dir`: `config`, and every tensor as f32.
fn write_safetensors(
    dir: &Path,
    config: &serde_json::Value,
    tensors: &[(String, Vec<usize>, Vec<f32>)],
) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let (mut header, mut data) = (serde_json::Map::new(), Vec::new());
    for (name, shape, v) in tensors {
        let b = data.len();
        data.extend(f32_bytes(v));
        header.insert(
            name.clone(),
            json!({"dtype": "F32", "shape": shape, "data_offsets": [b, data.len()]}),
        );
    }
    let h = serde_json::Value::Object(header).to_string();
    let mut file = (h.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(h.as_bytes());
    file.extend_from_slice(&data);
    std::fs::write(dir.join("model.safetensors"), file).unwrap();
}

#[test]
fn the_engine_runs_a_gguf_as_its_weights_in_safetensors() {
    let tmp = tempfile::tempdir().unwrap();
    let gguf_dir = tmp.path().join("gguf");
    std::fs::create_dir(&gguf_dir).unwrap();
    let file = write_file(&gguf_dir, "tiny.gguf", &tiny_qwen3());
    let m = load(&file).unwrap();
    let tensors: Vec<(String, Vec<usize>, Vec<f32>)> = m
        .tensors
        .iter()
        .map(|t| (t.name.clone(), t.shape.clone(), m.to_f32(t).unwrap()))
        .collect();

    // The store hands out each tensor as `read` gives it: f32/bf16 ones from the file as stored.
    let store = crate::open_store(&file).unwrap();
    for (name, shape, want) in &tensors {
        let mat = store.take(name, shape).unwrap();
        let stored = m
            .info(m.tensors.iter().find(|t| &t.name == name).unwrap())
            .ggml_type;
        let want_dtype = match stored {
            GgmlType::BF16 => crate::weights::WDType::BF16,
            _ => crate::weights::WDType::F32,
        };
        assert_eq!(mat.dtype, want_dtype, "{name}");
        let got = mat.to_vec();
        assert!(
            got.iter()
                .zip(want)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{name}"
        );
    }

    let st_dir = tmp.path().join("st");
    write_safetensors(&st_dir, &m.config, &tensors);
    let trace = |model: &Path, out: &str| {
        let o = crate::TraceOptions {
            model_dir: model.to_path_buf(),
            tokens: vec![3, 17, 5, 0, 39],
            out: tmp.path().join(out),
            internals: true,
            generate: 2,
            cache: true,
            threads: 1,
            command_line: vec![],
            force_decisions: None,
            prompt_text: None,
            shards: None,
        };
        crate::run_trace(&o).unwrap();
        tracegate_trace::Trace::open(&o.out).unwrap()
    };
    let want = trace(&st_dir, "st.trace");
    for model in [&file, &gguf_dir] {
        let got = trace(model, "gguf.trace");
        assert_eq!(got.tensors().len(), want.tensors().len());
        for t in want.tensors() {
            let g = got.tensor_info(&t.name).unwrap();
            // Same dtype, shape and payload (its xxh3-128).
            assert_eq!(
                (g.dtype, &g.shape, g.digest),
                (t.dtype, &t.shape, t.digest),
                "{}",
                t.name
            );
        }
        for d in want.decisions() {
            let g = got.decision_info(&d.name).unwrap();
            assert_eq!(
                got.decision_values(g),
                want.decision_values(d),
                "{}",
                d.name
            );
        }
        let digest = crate::weights_digest(model).unwrap();
        assert_eq!(digest, tracegate_trace::weights_digest(&file).unwrap());
        assert_eq!(got.provenance()["weights_digest"], json!(digest));
    }
}

// ---------------------------------------------------------------------------------------------
// Against ggml's and transformers' Python.

/// TRACEGATE_PYTHON, else the checkout's `.venv`.
fn python() -> Option<PathBuf> {
    let p = std::env::var_os("TRACEGATE_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python"));
    p.exists().then_some(p)
}

#[test]
fn bit_for_bit_with_gguf_quants_and_transformers() {
    let Some(py) = python() else {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI: no Python for the GGUF reference (TRACEGATE_PYTHON or .venv)"
        );
        println!("NOT CHECKED: no Python with gguf and transformers (TRACEGATE_PYTHON or .venv/bin/python)");
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/gguf/reference.py");
    let out = std::process::Command::new(&py)
        .arg(&script)
        .arg(tmp.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}: {}",
        script.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let expected: serde_json::Value =
        serde_json::from_slice(&std::fs::read(tmp.path().join("expected.json")).unwrap()).unwrap();
    let blob = std::fs::read(tmp.path().join("expected.bin")).unwrap();
    let bits = |e: &serde_json::Value| -> Vec<u32> {
        let (o, n) = (
            e["offset"].as_u64().unwrap() as usize,
            e["count"].as_u64().unwrap() as usize,
        );
        blob[o..o + 4 * n]
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    let first_difference = |got: &[f32], want: &[u32]| {
        assert_eq!(got.len(), want.len());
        got.iter()
            .zip(want)
            .position(|(g, w)| g.to_bits() != *w)
            .map(|i| (i, got[i].to_bits(), want[i]))
    };

    let all: Vec<f32> = (0..=u16::MAX).map(f16_to_f32).collect();
    assert_eq!(
        first_difference(&all, &bits(&expected["f16_all"])),
        None,
        "f16 widening"
    );

    let mut types_seen = std::collections::BTreeSet::new();
    for f in expected["files"].as_array().unwrap() {
        let path = tmp.path().join(f["path"].as_str().unwrap());
        let m = load(&path).unwrap();
        // Each GGUF tensor dequantized whole, in stored order, as gguf.quants.dequantize.
        for (d, info) in f["dequantized"]
            .as_array()
            .unwrap()
            .iter()
            .zip(&m.header.tensors)
        {
            assert_eq!(d["name"], json!(info.name));
            assert_eq!(d["type"], json!(info.ggml_type.name()), "{}", info.name);
            types_seen.insert(info.ggml_type.name());
            let mut got = vec![0.0; info.shape().iter().product()];
            dequantize_row(info.ggml_type, &m.map[info.start..info.end], &mut got).unwrap();
            assert_eq!(
                first_difference(&got, &bits(d)),
                None,
                "{}: {}",
                f["path"],
                info.name
            );
        }
        // The Hugging Face checkpoint transformers makes of it: names, shapes, values.
        let hf = f["hf"].as_array().unwrap();
        assert_eq!(hf.len(), m.tensors.len(), "{}", f["path"]);
        for want in hf {
            let name = want["name"].as_str().unwrap();
            let t = m
                .tensors
                .iter()
                .find(|t| t.name == name)
                .unwrap_or_else(|| panic!("{name}"));
            assert_eq!(json!(t.shape), want["shape"], "{name}");
            let got = m.to_f32(t).unwrap();
            assert_eq!(
                first_difference(&got, &bits(want)),
                None,
                "{}: {name}",
                f["path"]
            );
        }
        let mut config = m.config.clone();
        // The head size the file states, which transformers does not read for qwen3: equal to
        // its Qwen3Config default there, so the two models are the same (§21.5).
        if m.arch == Arch::Qwen3 {
            assert_eq!(
                config.as_object_mut().unwrap().shift_remove("head_dim"),
                Some(json!(128))
            );
        }
        assert_eq!(
            config
                .as_object_mut()
                .unwrap()
                .shift_remove("architectures"),
            Some(json!([match m.arch {
                Arch::Llama => "LlamaForCausalLM",
                Arch::Qwen3 => "Qwen3ForCausalLM",
                Arch::Gemma3 => "Gemma3ForCausalLM",
            }]))
        );
        if m.arch == Arch::Gemma3 {
            // transformers' dict as it is, but rope_theta, which its config class moves into
            // rope_parameters; what the class derives (the layer pattern, both thetas, its
            // defaults) as the class has it (§21.5).
            let theirs = f["config"].as_object().unwrap();
            let resolved = &f["resolved"];
            for (k, v) in config.as_object().unwrap() {
                let want = theirs.get(k).unwrap_or(&resolved[k]);
                assert_eq!(v, want, "gemma3 config field {k}");
            }
            for k in theirs.keys() {
                assert!(
                    config.get(k).is_some() || k == "rope_theta",
                    "gemma3 config lacks {k}"
                );
            }
            let full = &config["rope_parameters"]["full_attention"]["rope_theta"];
            assert_eq!(full, &theirs["rope_theta"]);
            continue;
        }
        assert_eq!(config, f["config"], "{}", f["path"]);
    }
    let supported: std::collections::BTreeSet<&str> =
        GgmlType::SUPPORTED.iter().map(|t| t.name()).collect();
    assert_eq!(
        types_seen, supported,
        "every supported type against the reference"
    );
}

#[test]
fn attention_biases_the_file_holds_are_the_models() {
    // transformers' GGUF config never sets attention_bias, so its model would drop these; the
    // file holds them, so the config says attention_bias and the model needs all four (§21.5).
    let mut w = tiny_qwen3();
    w.tensor(
        "blk.0.attn_q.bias",
        &[256],
        T_F32,
        f32_bytes(&values(256, 9)),
    );
    let tmp = tempfile::tempdir().unwrap();
    let file = write_file(tmp.path(), "m.gguf", &w);
    let (cfg, raw) = crate::load_config(&file).unwrap();
    assert_eq!(raw["attention_bias"], json!(true));
    let store = crate::open_store(&file).unwrap();
    let e = crate::model::Model::load(cfg, &store)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("missing tensor model.layers.0.self_attn.k_proj.bias"),
        "{e}"
    );
}

#[test]
fn head_sizes_the_file_states_must_agree() {
    let mut w = tiny_qwen3();
    w.kv_u32("qwen3.attention.key_length", 128)
        .kv_u32("qwen3.attention.value_length", 64);
    let tmp = tempfile::tempdir().unwrap();
    let e = load(&write_file(tmp.path(), "m.gguf", &w))
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("head sizes disagree") && e.contains("qwen3.attention.value_length = "),
        "{e}"
    );
}
