#![allow(dead_code)]
use serde_json::json;
use tracegate_trace::{Attributes, DType, Digest, TraceWriter};

pub fn attrs() -> Attributes {
    Attributes::default()
        .with_path("prefill")
        .with_mask("causal")
        .with_positions(vec![0, 1, 2])
}

/// A small trace with tensors of several dtypes and two decisions.
pub fn write_sample(path: &std::path::Path, provenance: serde_json::Value) -> Digest {
    let mut w = TraceWriter::create(path, provenance).unwrap();
    let a: Vec<f32> = (0..12).map(|i| i as f32 * 0.5 - 2.0).collect();
    w.tensor_f32("embed.out", &[3, 4], &a, &attrs()).unwrap();
    w.tensor(
        "ids",
        DType::I32,
        &[3],
        &[1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0],
        &attrs(),
    )
    .unwrap();
    w.tensor("flags", DType::Bool, &[2], &[0, 1], &Attributes::default())
        .unwrap();
    w.decision("logits.argmax", &[3], &[5, 7, 5], Some(&[0.25, 1.5, 0.125]))
        .unwrap();
    w.decision("layer.00.router.topk", &[3, 2], &[1, 4, 0, 2, 4, 1], None)
        .unwrap();
    w.finish().unwrap()
}

pub fn sample_provenance() -> serde_json::Value {
    json!({"producer": "test", "threads": 1})
}

/// Splits a finished trace into (bytes before the index, the index as JSON).
pub fn split_index(file: &[u8]) -> (Vec<u8>, serde_json::Value) {
    let n = file.len();
    let offset = u64::from_le_bytes(file[n - 40..n - 32].try_into().unwrap()) as usize;
    (
        file[..offset].to_vec(),
        serde_json::from_slice(&file[offset..n - 40]).unwrap(),
    )
}

/// Reassembles a trace around `index` with a footer whose xxh3-128 matches it, so the footer
/// check passes and what follows it must catch the edit.
pub fn with_index(data: &[u8], index: &serde_json::Value) -> Vec<u8> {
    let index = serde_json::to_vec(index).unwrap();
    let mut f = data.to_vec();
    f.extend_from_slice(&index);
    f.extend_from_slice(&(data.len() as u64).to_le_bytes());
    f.extend_from_slice(&(index.len() as u64).to_le_bytes());
    f.extend_from_slice(&xxhash_rust::xxh3::xxh3_128(&index).to_be_bytes());
    f.extend_from_slice(b"TGTREND\0");
    f
}

/// `file` with its index edited by `edit` and the footer re-digested.
pub fn edit_index(file: &[u8], edit: impl FnOnce(&mut serde_json::Value)) -> Vec<u8> {
    let (data, mut index) = split_index(file);
    edit(&mut index);
    with_index(&data, &index)
}

/// Whether two traces hold the same content: every tensor's name, dtype, shape, attributes and
/// bytes, every decision's name, shape, values and margin bits, in order, and the recorded digest.
pub fn same_content(a: &tracegate_trace::Trace, b: &tracegate_trace::Trace) -> bool {
    let tensors = a.tensors().len() == b.tensors().len()
        && a.tensors().iter().zip(b.tensors()).all(|(x, y)| {
            (&x.name, x.dtype, &x.shape, &x.attributes, x.digest)
                == (&y.name, y.dtype, &y.shape, &y.attributes, y.digest)
                && a.data(x) == b.data(y)
        });
    let bits = |m: Option<Vec<f32>>| m.map(|v| v.iter().map(|f| f.to_bits()).collect::<Vec<u32>>());
    let decisions = a.decisions().len() == b.decisions().len()
        && a.decisions().iter().zip(b.decisions()).all(|(x, y)| {
            (&x.name, &x.shape) == (&y.name, &y.shape)
                && a.decision_values(x) == b.decision_values(y)
                && bits(a.decision_margins(x)) == bits(b.decision_margins(y))
        });
    a.digest() == b.digest() && tensors && decisions
}
