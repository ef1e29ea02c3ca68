//! The engine's trace is written as it is produced (issue 54 item 1): each tensor goes to the
//! writer's temporary file when it is recorded, and only a finished run puts a file at `--out`.

use crate::common;

use std::path::{Path, PathBuf};

use common::*;
use serde_json::json;
use tracegate_engine::capture::Capture;
use tracegate_engine::{run_trace, TraceOptions};
use tracegate_trace::{Trace, TraceWriter};

/// The writers' temporaries in `dir`, with their sizes.
fn temporaries(dir: &Path) -> Vec<(PathBuf, u64)> {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".tracegate-tmp"))
        .map(|e| (e.path(), e.metadata().unwrap().len()))
        .collect()
}

#[test]
fn a_streaming_capture_writes_each_tensor_when_it_is_recorded() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("s.trace");
    // 512 rows of 1024: 2 MiB, past the writer's 1 MiB buffer.
    let (rows, cols) = (512, 1024);
    let data: Vec<f32> = (0..rows * cols).map(|i| i as f32 * 0.5).collect();
    let pos: Vec<i64> = (0..rows as i64).collect();
    let payload = (rows * cols * 4) as u64;

    // Negative control: a capture that keeps its tensors leaves the file at its header.
    let w = TraceWriter::create(&out, json!({})).unwrap();
    let mut kept = Capture::new("prefill", false);
    kept.tensor("final_norm.out", &[rows, cols], &data, &pos);
    let [(_, len)] = temporaries(tmp.path())[..] else {
        panic!("one temporary")
    };
    assert!(len <= 64, "{len} bytes: a kept tensor is not in the file");
    drop(w);
    drop(kept);
    assert!(temporaries(tmp.path()).is_empty());

    let w = TraceWriter::create(&out, json!({})).unwrap();
    let mut cap = Capture::new("prefill", false).stream_to(w, None, Box::new(|_| "causal".into()));
    cap.tensor("final_norm.out", &[rows, cols], &data, &pos);
    let [(_, len)] = temporaries(tmp.path())[..] else {
        panic!("one temporary")
    };
    assert!(
        len >= 64 + payload,
        "{len} bytes: the tensor was not written when recorded"
    );
    assert!(
        cap.tensors.is_empty(),
        "a streaming capture keeps no tensor"
    );
    assert!(!out.exists(), "nothing at the final path before finish");
    cap.decision("logits.argmax", &[2], vec![4, 5], Some(vec![0.25, 0.5]));
    let digest = cap.finish(json!({"producer": "test"})).unwrap();
    assert!(temporaries(tmp.path()).is_empty());
    let t = Trace::open(&out).unwrap();
    t.verify().unwrap();
    assert_eq!(t.digest(), digest);
    assert_eq!(t.f32_vec("final_norm.out").unwrap(), data);
    assert_eq!(t.provenance()["producer"], "test");
    let d = t.decision_info("logits.argmax").unwrap();
    assert_eq!(t.decision_values(d), [4, 5]);
}

fn opts(model: &Path, out: PathBuf, force: Option<PathBuf>) -> TraceOptions {
    TraceOptions {
        model_dir: model.to_path_buf(),
        tokens: vec![3, 17, 5, 0, 42, 17, 9],
        out,
        internals: true,
        generate: 3,
        cache: true,
        threads: 1,
        command_line: vec![],
        force_decisions: force,
        prompt_text: None,
        shards: None,
    }
}

#[test]
fn a_run_refused_after_its_tensors_were_written_leaves_nothing() {
    // The forcing trace's weights are checked once the run is done, every tensor written: the
    // refusal must still leave no file at --out and no temporary beside it.
    let tmp = tempfile::tempdir().unwrap();
    let (moe, other) = (tmp.path().join("moe"), tmp.path().join("other"));
    make_model(&moe, &moe_config(), "BF16", 2);
    make_model(&other, &moe_config(), "BF16", 3);
    let forcing = tmp.path().join("forcing.trace");
    run_trace(&opts(&moe, forcing.clone(), None)).unwrap();
    let out = tmp.path().join("out.trace");
    let e = run_trace(&opts(&other, out.clone(), Some(forcing)))
        .unwrap_err()
        .to_string();
    assert!(e.contains("is not this run's"), "{e}");
    assert!(!out.exists());
    assert!(temporaries(tmp.path()).is_empty());
}

#[test]
fn a_killed_run_leaves_nothing_at_out() {
    // Killed once its temporary holds more than the writer's buffer (tensors on disk before the
    // run ends): --out never appears; what is left is the temporary a later writer removes.
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("dense");
    let mut cfg = dense_config();
    cfg["max_position_embeddings"] = json!(4096);
    make_model(&model, &cfg, "F32", 1);
    let out = tmp.path().join("k.trace");
    let tokens: Vec<String> = (0..2048).map(|i| (i % 7).to_string()).collect();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_engine"))
        .args([
            "trace",
            "--capture",
            "internals",
            "--threads",
            "1",
            "--model",
        ])
        .arg(&model)
        .arg("--tokens")
        .arg(tokens.join(","))
        .arg("--out")
        .arg(&out)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let streamed = loop {
        let big = temporaries(tmp.path()).iter().any(|(_, n)| *n > 2 << 20);
        if big || child.try_wait().unwrap().is_some() || std::time::Instant::now() > deadline {
            break big;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    };
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(
        streamed,
        "the temporary never held more than 2 MiB before the run ended"
    );
    assert!(!out.exists(), "a killed run left {}", out.display());
    // The next writer of the same path removes the dead writer's temporary.
    drop(TraceWriter::create(&out, json!({})).unwrap());
    assert!(temporaries(tmp.path()).is_empty());
}
