#![allow(dead_code)]
use serde_json::json;
use tracegate_trace::{Attributes, DType, Digest, TraceWriter};

pub fn attrs() -> Attributes {
    Attributes::default().with_path("prefill").with_mask("causal").with_positions(vec![0, 1, 2])
}

/// A small trace with tensors of several dtypes and two decisions.
pub fn write_sample(path: &std::path::Path, provenance: serde_json::Value) -> Digest {
    let mut w = TraceWriter::create(path, provenance).unwrap();
    let a: Vec<f32> = (0..12).map(|i| i as f32 * 0.5 - 2.0).collect();
    w.tensor_f32("embed.out", &[3, 4], &a, &attrs()).unwrap();
    w.tensor("ids", DType::I32, &[3], &[1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0], &attrs()).unwrap();
    w.tensor("flags", DType::Bool, &[2], &[0, 1], &Attributes::default()).unwrap();
    w.decision("logits.argmax", &[3], &[5, 7, 5], Some(&[0.25, 1.5, 0.125])).unwrap();
    w.decision("layer.00.router.topk", &[3, 2], &[1, 4, 0, 2, 4, 1], None).unwrap();
    w.finish().unwrap()
}

pub fn sample_provenance() -> serde_json::Value {
    json!({"producer": "test", "threads": 1})
}
