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

/// Peak resident memory of `cmd`'s process (KiB), from the rusage the kernel keeps for it and
/// hands over when it is reaped (`wait4`): a count, not a timing. The command must succeed.
#[cfg(target_os = "linux")]
// Reaped by `wait4`, which `Child::wait` cannot replace: it alone hands over the rusage.
#[allow(clippy::zombie_processes)]
fn peak_rss_kib(cmd: &mut std::process::Command) -> u64 {
    let child = cmd
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id() as libc::pid_t;
    let mut status = 0;
    // SAFETY: plain out-parameters; `pid` is this process's own child, not yet reaped.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let got = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    assert_eq!(got, pid, "wait4");
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "{cmd:?}: status {status}"
    );
    usage.ru_maxrss as u64
}

/// Diffusion Gemma's trace streams like the causal families' (issue 54 item 1): a prompt twice
/// as long grows the `--capture internals` trace by ~15 MB (the prompt pass's `attn_probs`,
/// [heads, T, T]) and the engine's peak memory by much less. The recorder it replaced kept every
/// tensor and wrote at the end: its peak grew by 1.3× the trace's growth on these two runs.
#[cfg(target_os = "linux")]
#[test]
fn a_diffusion_trace_streams_so_peak_memory_does_not_grow_with_it() {
    let tmp = tempfile::tempdir().unwrap();
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tiny-diffusion-gemma");
    let run = |t: usize| -> (u64, u64) {
        let out = tmp.path().join(format!("t{t}.trace"));
        let tokens: Vec<String> = (0..t).map(|i| (i * 37 % 500).to_string()).collect();
        let rss = peak_rss_kib(
            std::process::Command::new(env!("CARGO_BIN_EXE_engine"))
                .args(["trace", "--capture", "internals", "--generate", "1"])
                .args(["--threads", "1", "--model"])
                .arg(&model)
                .arg("--tokens")
                .arg(tokens.join(","))
                .arg("--out")
                .arg(&out),
        );
        (rss * 1024, std::fs::metadata(&out).unwrap().len())
    };
    let ((rss0, size0), (rss1, size1)) = (run(252), run(504));
    let grown = size1 - size0;
    assert!(grown > 12 << 20, "the trace grew by {grown} bytes only");
    // The rule: peak memory grows by under 3/4 of what the trace grows by.
    let holds = |d_rss: u64| d_rss * 4 >= grown * 3;
    let d_rss = rss1.saturating_sub(rss0);
    assert!(
        !holds(d_rss),
        "peak RSS grew by {d_rss} bytes for {grown} more trace bytes ({rss0} → {rss1})"
    );
    // Negative control: a process that holds as many bytes as the trace is caught by the rule.
    let holding = |n: u64| {
        peak_rss_kib(std::process::Command::new("sh").arg("-c").arg(format!(
            "x=$(head -c {n} /dev/zero | tr '\\000' a); test ${{#x}} -eq {n}"
        ))) * 1024
    };
    let d_held = holding(size1).saturating_sub(holding(size0));
    assert!(
        holds(d_held),
        "a process holding {grown} more bytes grew by {d_held} only"
    );
}
