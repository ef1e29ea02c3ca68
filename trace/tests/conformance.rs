//! The conformance vectors in fixtures/format/ were written by the independent Python spec
//! writer (binding/tests/spec_writer.py); the Rust writer must reproduce them byte for byte.

use std::path::PathBuf;

use serde_json::Value;
use tracegate_trace::{Attributes, DType, Trace, TraceWriter};

fn vectors_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/format")
}

fn attributes(v: &Value) -> Attributes {
    let mut a = Attributes::default();
    for (k, v) in v.as_object().unwrap() {
        match k.as_str() {
            "path" => a.path = Some(v.as_str().unwrap().into()),
            "mask" => a.mask = Some(v.as_str().unwrap().into()),
            "step" => a.step = Some(v.as_i64().unwrap()),
            "positions" => {
                a.positions = Some(
                    v.as_array()
                        .unwrap()
                        .iter()
                        .map(|x| x.as_i64().unwrap())
                        .collect(),
                )
            }
            _ => {
                a.extra.insert(k.clone(), v.as_str().unwrap().into());
            }
        }
    }
    a
}

fn u64s(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

#[test]
fn rust_writer_reproduces_every_vector_byte_for_byte() {
    let dir = vectors_dir();
    let doc: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("vectors.json")).unwrap()).unwrap();
    let vectors = doc["vectors"].as_array().unwrap();
    assert!(vectors.len() >= 3);
    let out = tempfile::tempdir().unwrap();
    for v in vectors {
        let file = v["file"].as_str().unwrap();
        let path = out.path().join(file);
        let mut w = TraceWriter::create(&path, v["provenance"].clone()).unwrap();
        for t in v["tensors"].as_array().unwrap() {
            let data = hex::decode(t["data_hex"].as_str().unwrap()).unwrap();
            let dtype = DType::parse(t["dtype"].as_str().unwrap()).unwrap();
            w.tensor(
                t["name"].as_str().unwrap(),
                dtype,
                &u64s(&t["shape"]),
                &data,
                &attributes(&t["attributes"]),
            )
            .unwrap();
        }
        for d in v["decisions"].as_array().unwrap() {
            let values: Vec<i64> = d["values"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_i64().unwrap())
                .collect();
            let margins: Option<Vec<f32>> = d["margins_hex"].as_array().map(|m| {
                m.iter()
                    .map(|h| {
                        f32::from_le_bytes(
                            hex::decode(h.as_str().unwrap())
                                .unwrap()
                                .try_into()
                                .unwrap(),
                        )
                    })
                    .collect()
            });
            w.decision(
                d["name"].as_str().unwrap(),
                &u64s(&d["shape"]),
                &values,
                margins.as_deref(),
            )
            .unwrap();
        }
        let digest = w.finish().unwrap();
        assert_eq!(
            digest.hex(),
            v["digest"].as_str().unwrap(),
            "{file}: content digest"
        );
        let ours = std::fs::read(&path).unwrap();
        let theirs = std::fs::read(dir.join(file)).unwrap();
        assert_eq!(ours, theirs, "{file}: bytes differ from the spec writer's");
        // And the committed vector reads and verifies.
        let t = Trace::open(dir.join(file)).unwrap();
        t.verify().unwrap();
        assert_eq!(t.digest().hex(), v["digest"].as_str().unwrap());
    }
}
