//! Interop with the Python binding: written in Python and read here, and the reverse.
//! Needs the project's .venv with the `tracegate` module (scripts/setup.sh builds it).
use crate::common;

use std::path::PathBuf;
use std::process::Command;

use common::*;
use tracegate_trace::Trace;

fn python() -> PathBuf {
    let py = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python");
    assert!(
        py.exists(),
        "{} missing: run scripts/setup.sh (the interop test needs the tracegate module)",
        py.display()
    );
    py
}

fn run_python(code: &str) -> String {
    let out = Command::new(python()).args(["-c", code]).output().unwrap();
    assert!(
        out.status.success(),
        "python failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

#[test]
fn written_in_rust_read_in_python() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("r.trace");
    let digest = write_sample(&p, sample_provenance());
    let code = format!(
        "import tracegate; t = tracegate.Trace({:?}); t.verify(); \
         print(t.digest, t['embed.out'][1,1], t.decisions['logits.argmax'].tolist(), t.attributes('ids')['positions'])",
        p.to_str().unwrap()
    );
    assert_eq!(
        run_python(&code),
        format!("{} 0.5 [5, 7, 5] [0, 1, 2]", digest.hex())
    );
}

#[test]
fn written_in_python_read_in_rust() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("py.trace");
    let code = format!(
        "import numpy as np, tracegate\n\
         with tracegate.TraceWriter({:?}, {{'producer': 'python'}}) as w:\n\
         \x20   w.tensor('h', np.arange(6, dtype=np.float32).reshape(2, 3), path='prefill', mask='causal', positions=[0, 1])\n\
         \x20   w.decision('logits.argmax', [2, 0], margins=[0.5, 0.25])\n\
         print(w.digest)",
        p.to_str().unwrap()
    );
    let py_digest = run_python(&code);
    let t = Trace::open(&p).unwrap();
    t.verify().unwrap();
    assert_eq!(t.digest().hex(), py_digest);
    assert_eq!(t.f32_slice("h").unwrap(), &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
    assert_eq!(
        t.tensor_info("h").unwrap().attributes.positions,
        Some(vec![0, 1])
    );
    let d = t.decision_info("logits.argmax").unwrap();
    assert_eq!(t.decision_values(d), vec![2, 0]);
    assert_eq!(t.provenance()["producer"], "python");
}
