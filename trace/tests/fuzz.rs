//! Bounded fuzz of the reader (docs/fuzzing.md): the conformance vectors and a written trace,
//! mutated by bit flips, truncation at every offset, and index edits with a re-digested footer
//! (so the footer check passes and the deeper checks must catch the edit). Each mutant must be
//! refused by `open` or `verify`, or read back with the original content; views of every tensor
//! before `verify` are refused or handed out, never a panic. Deterministic seeds;
//! TRACEGATE_FUZZ_ITERS raises the iteration count for a long run.
use crate::common;

use std::path::{Path, PathBuf};

use common::*;
use serde_json::{json, Value};
use tracegate_trace::{DType, Element, TensorInfo, Trace};

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        // splitmix64: a fixed sequence per seed.
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

fn iterations() -> usize {
    std::env::var("TRACEGATE_FUZZ_ITERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(300)
}

/// (label, bytes) of every input: the committed vectors and a trace written by the writer.
fn inputs(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let vectors = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/format");
    let mut out: Vec<(String, Vec<u8>)> = ["empty.trace", "dtypes.trace", "decisions.trace"]
        .iter()
        .map(|f| (f.to_string(), std::fs::read(vectors.join(f)).unwrap()))
        .collect();
    let sample = dir.join("sample.trace");
    write_sample(&sample, sample_provenance());
    out.push(("sample".into(), std::fs::read(&sample).unwrap()));
    out
}

/// Checks one mutant: no panic (a panic fails the test), and refused or equal in content.
struct Judge {
    path: PathBuf,
    refused: usize,
    equal: usize,
}

impl Judge {
    /// A judge whose mutants are written to `dir`/m.trace.
    fn new(dir: &Path) -> Judge {
        Judge {
            path: dir.join("m.trace"),
            refused: 0,
            equal: 0,
        }
    }

    /// Whether the mutant was accepted.
    fn check(&mut self, original: &Trace, mutant: &[u8], what: &dyn Fn() -> String) -> bool {
        // A new file each time: truncating one in place makes ext4 flush it (auto_da_alloc).
        let _ = std::fs::remove_file(&self.path);
        std::fs::write(&self.path, mutant).unwrap();
        match Trace::open(&self.path).and_then(|t| {
            view_all(&t);
            t.verify().map(|_| t)
        }) {
            Err(_) => {
                self.refused += 1;
                false
            }
            Ok(t) => {
                assert!(
                    same_content(&t, original),
                    "{}: a mutant verified with different content",
                    what()
                );
                self.equal += 1;
                true
            }
        }
    }
}

/// Views every tensor as its own dtype before `verify`: each view is refused or handed out,
/// never a panic (a bool view reads every byte).
fn view_all(t: &Trace) {
    use half::{bf16, f16};
    fn touch<T: Element>(t: &Trace, i: &TensorInfo) {
        let _ = t.slice_of::<T>(i);
        #[cfg(feature = "ndarray")]
        let _ = t.view_of::<T>(i);
    }
    for i in t.tensors() {
        match i.dtype {
            DType::F64 => touch::<f64>(t, i),
            DType::F32 => touch::<f32>(t, i),
            DType::F16 => touch::<f16>(t, i),
            DType::BF16 => touch::<bf16>(t, i),
            DType::I64 => touch::<i64>(t, i),
            DType::I32 => touch::<i32>(t, i),
            DType::I16 => touch::<i16>(t, i),
            DType::I8 => touch::<i8>(t, i),
            DType::U8 => touch::<u8>(t, i),
            DType::Bool => touch::<bool>(t, i),
        }
    }
}

fn open_original(dir: &Path, label: &str, bytes: &[u8]) -> Trace {
    let p = dir.join(format!("orig-{label}"));
    std::fs::write(&p, bytes).unwrap();
    let t = Trace::open(&p).unwrap();
    t.verify().unwrap();
    t
}

#[test]
fn bit_flips_are_refused_or_harmless() {
    let dir = tempfile::tempdir().unwrap();
    let mut judge = Judge::new(dir.path());
    for (k, (label, bytes)) in inputs(dir.path()).into_iter().enumerate() {
        let original = open_original(dir.path(), &label, &bytes);
        let mut rng = Rng(0x5eed_0000 + k as u64);
        for i in 0..iterations() {
            let mut m = bytes.clone();
            for _ in 0..1 + rng.below(4) {
                let at = rng.below(m.len());
                m[at] ^= 1 << rng.below(8);
            }
            let what = || format!("{label}: bit flips, iteration {i}");
            // Every byte is covered by a digest, a structure check or a must-be-zero rule, so
            // only flips that cancel out may be accepted.
            if judge.check(&original, &m, &what) {
                let at = m.iter().zip(&bytes).position(|(a, b)| a != b);
                assert!(
                    at.is_none(),
                    "{}: a file changed at byte {at:?} was accepted",
                    what()
                );
            }
        }
    }
    assert!(judge.refused > 0, "no mutant was refused");
}

#[test]
fn truncation_at_every_offset_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut judge = Judge::new(dir.path());
    // Every offset of each input: header, payloads, padding, index, footer.
    for (label, bytes) in inputs(dir.path()) {
        let original = open_original(dir.path(), &label, &bytes);
        for cut in 0..bytes.len() {
            judge.check(&original, &bytes[..cut], &|| {
                format!("{label}: truncated to {cut} bytes")
            });
        }
    }
    assert_eq!(judge.equal, 0, "a truncated trace was accepted");
}

/// Values that sit on the checks' edges.
const EDGES: [u64; 12] = [
    0,
    1,
    4,
    63,
    64,
    65,
    128,
    4096,
    1 << 32,
    1 << 62,
    u64::MAX - 63,
    u64::MAX,
];

/// One random edit of the index: a number, a name, a dtype, a digest's spelling, an entry
/// removed, duplicated or moved, an attribute added or emptied.
fn edit(index: &mut Value, rng: &mut Rng) {
    let kinds = ["tensors", "decisions"];
    let kind = kinds[rng.below(2)];
    let n = index[kind].as_array().map_or(0, Vec::len);
    if n == 0 {
        index["version"] = json!([1, rng.below(3)]);
        return;
    }
    let i = rng.below(n);
    let other = rng.below(n);
    let edge = EDGES[rng.below(EDGES.len())];
    let e = &mut index[kind][i];
    match rng.below(14) {
        0 => {
            e[if kind == "tensors" {
                "offset"
            } else {
                "values_offset"
            }] = json!(edge)
        }
        1 if kind == "tensors" => e["nbytes"] = json!(edge),
        1 => {
            e["margins_offset"] = if rng.below(2) == 0 {
                Value::Null
            } else {
                json!(edge)
            }
        }
        2 => {
            if let Some(shape) = e["shape"].as_array_mut() {
                if shape.is_empty() {
                    shape.push(json!(edge));
                } else {
                    let d = rng.below(shape.len());
                    shape[d] = json!(edge);
                }
            }
        }
        3 => e["shape"] = json!([]),
        4 if kind == "tensors" => {
            e["dtype"] = json!(
                ["f64", "f32", "f16", "bf16", "i64", "i32", "i16", "i8", "u8", "bool", "f128"]
                    [rng.below(11)]
            )
        }
        5 => {
            e["name"] = json!(
                [
                    String::new(),
                    "a\u{1}".into(),
                    "x".repeat(4097),
                    "logits".into()
                ][rng.below(4)]
            )
        }
        6 => {
            let name = index[kind][other]["name"].clone();
            index[kind][i]["name"] = name;
        }
        7 => {
            let x = e["xxh3"].as_str().unwrap_or("").to_uppercase();
            e["xxh3"] = json!(x);
        }
        8 => {
            let x = index[kind][other]["xxh3"].clone();
            index[kind][i]["xxh3"] = x;
        }
        9 => {
            index[kind].as_array_mut().unwrap().remove(i);
        }
        10 => {
            let copy = index[kind][i].clone();
            index[kind].as_array_mut().unwrap().push(copy);
        }
        11 => index[kind].as_array_mut().unwrap().swap(i, other),
        12 if kind == "tensors" => {
            let key = ["", "note", "path", "step", "positions"][rng.below(5)];
            e["attributes"][key] = json!(["x", "decode"][rng.below(2)]);
        }
        13 => index["digest"] = json!(index["digest"].as_str().unwrap_or("").to_uppercase()),
        _ => index["provenance"] = json!({"edited": true}),
    }
}

#[test]
fn index_edits_with_a_valid_footer_are_refused_or_harmless() {
    let dir = tempfile::tempdir().unwrap();
    let mut judge = Judge::new(dir.path());
    for (k, (label, bytes)) in inputs(dir.path()).into_iter().enumerate() {
        let original = open_original(dir.path(), &label, &bytes);
        let (data, index) = split_index(&bytes);
        let mut rng = Rng(0x1dec_0000 + k as u64);
        for i in 0..iterations() {
            let mut index = index.clone();
            for _ in 0..1 + rng.below(2) {
                edit(&mut index, &mut rng);
            }
            judge.check(&original, &with_index(&data, &index), &|| {
                format!("{label}: index edit, iteration {i}: {index}")
            });
        }
    }
    assert!(
        judge.refused > 0 && judge.equal > 0,
        "refused {} equal {}",
        judge.refused,
        judge.equal
    );
}
