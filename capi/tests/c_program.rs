//! The C ABI from a C program: tests/c/write_trace.c, compiled with the system's `cc` against
//! include/tracegate.h and libtracegate_capi, writes a trace and tries the misuses a port makes.
//! Its trace must be byte for byte what the Rust writer writes for the same calls.

use std::path::{Path, PathBuf};
use std::process::Command;

use tracegate_trace::{Attributes, DType, Trace, TraceWriter};

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");

/// target/<profile>/deps/, this test's own folder: `cargo test` builds the crate's cdylib there
/// (`cargo build` also copies it up to target/<profile>/, where a port links it).
fn library_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().to_path_buf()
}

fn compile(dir: &Path) -> PathBuf {
    let lib = library_dir();
    assert!(
        lib.join("libtracegate_capi.so").exists(),
        "no libtracegate_capi.so in {}",
        lib.display()
    );
    let exe = dir.join("write_trace");
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = Command::new("cc")
        .args(["-std=c99", "-Wall", "-Wextra", "-Werror", "-o"])
        .arg(&exe)
        .arg(manifest.join("tests/c/write_trace.c"))
        .arg("-I")
        .arg(manifest.join("include"))
        .arg("-L")
        .arg(&lib)
        .arg("-ltracegate_capi")
        .output()
        .expect("cc (a C compiler) is needed to test the C ABI");
    assert!(
        out.status.success(),
        "cc failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    exe
}

/// What write_trace.c writes, through the Rust writer; `logit0` is its first bf16 logit's bits.
fn rust_twin(path: &Path, weights: &str, logit0: u16) -> String {
    let provenance = serde_json::json!({
        "producer": "c-port", "weights_digest": weights, "prompt_tokens": [3, 17, 5]
    });
    let mut w = TraceWriter::create(path, provenance).unwrap();
    let hidden: Vec<f32> = (0..12).map(|i| 0.25 * i as f32 - 1.0).collect();
    let mut attrs = Attributes::default()
        .with_path("prefill")
        .with_mask("causal")
        .with_positions(vec![0, 1, 2]);
    attrs.extra.insert("note".into(), "from C".into());
    w.tensor_f32("layer.00.hidden_out", &[3, 4], &hidden, &attrs)
        .unwrap();
    let logits: Vec<u8> = [logit0, 0xbf80, 0x4000, 0x0000, 0x7f80]
        .iter()
        .flat_map(|b| b.to_le_bytes())
        .collect();
    let lattrs = Attributes::default()
        .with_path("decode")
        .with_mask("causal")
        .with_positions(vec![3])
        .with_step(2);
    w.tensor("decode.0002.logits", DType::BF16, &[1, 5], &logits, &lattrs)
        .unwrap();
    let shard = tracegate_trace::Shard::new(1, 2, tracegate_trace::ShardKind::Partial);
    let sattrs = Attributes::default()
        .with_path("prefill")
        .with_mask("causal")
        .with_positions(vec![0, 1, 2])
        .with_shard(&shard);
    w.tensor_f32("layer.00.attn_out", &[3, 4], &hidden, &sattrs)
        .unwrap();
    w.decision("decode.0002.argmax", &[1], &[2], Some(&[1.0]))
        .unwrap();
    w.decision("layer.00.router.topk", &[2, 2], &[1, 6, 0, 3], None)
        .unwrap();
    w.finish().unwrap().hex()
}

#[test]
fn a_c_program_writes_the_rust_writers_bytes_and_each_misuse_is_a_code_and_a_line() {
    let dir = tempfile::tempdir().unwrap();
    let exe = compile(dir.path());
    let trace = dir.path().join("c.trace");
    let model = Path::new(ROOT).join("fixtures/tiny-qwen3");
    let out = Command::new(&exe)
        .arg(&trace)
        .arg(&model)
        .env("LD_LIBRARY_PATH", library_dir())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<&str> = stdout.lines().collect();
    let weights = tracegate_trace::weights_digest(&model).unwrap();
    assert_eq!(lines.first(), Some(&weights.as_str()), "{stdout}");

    // The same calls through the Rust writer: the same digest and the same bytes.
    let twin = dir.path().join("rust.trace");
    let digest = rust_twin(&twin, &weights, 0x3f80);
    assert_eq!(lines.last(), Some(&digest.as_str()), "{stdout}");
    assert_eq!(
        std::fs::read(&trace).unwrap(),
        std::fs::read(&twin).unwrap()
    );
    // Negative control: one logit's bits otherwise, and the digest tells them apart.
    let other = rust_twin(&dir.path().join("other.trace"), &weights, 0x3f81);
    assert_ne!(other, digest);
    let t = Trace::open(&trace).unwrap();
    assert_eq!((t.tensors().len(), t.decisions().len()), (3, 2));
    assert_eq!(
        t.tensor_info("layer.00.attn_out")
            .unwrap()
            .attributes
            .extra
            .get("shard")
            .map(String::as_str),
        Some("rank=1/2;partial")
    );

    // Each misuse: its code, and a line that names what was wrong.
    let refusals: Vec<&str> = lines
        .iter()
        .filter(|l| l.starts_with("refused"))
        .copied()
        .collect();
    let expected: [(&str, &[&str]); 14] = [
        (
            "refused 1:",
            &["layer.00.attn_out", "2 positions for 3 rows"],
        ),
        ("refused 1:", &["layer.00.mlp_out", "44 bytes", "48"]),
        (
            "refused 1:",
            &["duplicate tensor name", "layer.00.hidden_out"],
        ),
        ("refused 4:", &["layer.00.q", "dtype 0"]),
        ("refused 4:", &["name is NULL"]),
        (
            "refused 4:",
            &["layer.00.k", "shape is NULL but its count is 2"],
        ),
        (
            "refused 1:",
            &["layer.00.v", "rank=01/2;partial", "leading zeros"],
        ),
        (
            "refused 1:",
            &[
                "layer.00.hidden_in",
                "rank=1/2;partial",
                "only as replicated",
            ],
        ),
        ("refused 1:", &["decode.0003.argmax", "margin"]),
        ("refused 4:", &["the writer is NULL"]),
        ("refused 2:", &["/nonexistent/model"]),
        ("refused 4:", &["holds 8 bytes, 33 are needed"]),
        ("refused open:", &["/nonexistent/dir"]),
        ("refused open:", &["provenance must be a JSON object"]),
    ];
    assert_eq!(refusals.len(), expected.len(), "{stdout}");
    for (line, (start, words)) in refusals.iter().zip(expected) {
        assert!(line.starts_with(start), "{line:?} is not {start:?}");
        for word in words {
            assert!(line.contains(word), "{line:?} does not name {word:?}");
        }
    }
    // The abandoned writer and every temporary are gone: only the two traces and the program.
    let mut left: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(
        left,
        ["c.trace", "other.trace", "rust.trace", "write_trace"]
    );
}

#[test]
fn a_close_with_a_small_digest_buffer_writes_no_trace() {
    use std::ffi::CString;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.trace");
    let c_path = CString::new(path.to_str().unwrap()).unwrap();
    let provenance = CString::new("{}").unwrap();
    // SAFETY: the header's contract, as a C caller keeps it.
    unsafe {
        let w = tracegate_capi::tg_open(c_path.as_ptr(), provenance.as_ptr());
        assert!(!w.is_null());
        let mut small = [0 as std::ffi::c_char; 16];
        let code = tracegate_capi::tg_close(w, small.as_mut_ptr(), small.len());
        assert_eq!(code, tracegate_capi::TG_ERR_ARGUMENT);
        let message = std::ffi::CStr::from_ptr(tracegate_capi::tg_last_error());
        assert!(
            message
                .to_str()
                .unwrap()
                .contains("holds 16 bytes, 65 are needed"),
            "{message:?}"
        );
    }
    assert!(!path.exists());
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

#[test]
fn the_c_program_compiled_as_cpp_links_and_runs() {
    // C++, CUDA and Metal host code include the header from C++: without its extern "C" block
    // the calls would link against mangled names and fail here.
    let dir = tempfile::tempdir().unwrap();
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let exe = dir.path().join("write_trace_cpp");
    let out = Command::new("c++")
        .args([
            "-std=c++11",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-x",
            "c++",
            "-o",
        ])
        .arg(&exe)
        .arg(manifest.join("tests/c/write_trace.c"))
        .arg("-I")
        .arg(manifest.join("include"))
        .args(["-x", "none", "-L"])
        .arg(library_dir())
        .arg("-ltracegate_capi")
        .output()
        .expect("c++ (a C++ compiler) is needed to test the C ABI's header");
    assert!(
        out.status.success(),
        "c++ failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let run = Command::new(&exe)
        .arg(dir.path().join("cpp.trace"))
        .arg(Path::new(ROOT).join("fixtures/tiny-qwen3"))
        .env("LD_LIBRARY_PATH", library_dir())
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(Trace::open(dir.path().join("cpp.trace")).is_ok());
}

#[test]
fn the_weights_digest_refuses_a_fifo_without_blocking() {
    use std::ffi::CString;
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("pipe.gguf");
    let made = Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(made.success());
    let (tx, rx) = std::sync::mpsc::channel();
    let model = CString::new(fifo.to_str().unwrap()).unwrap();
    std::thread::spawn(move || {
        let mut out = [0 as std::ffi::c_char; 33];
        // SAFETY: a NUL-terminated string and a 33-byte buffer.
        let code = unsafe {
            tracegate_capi::tg_weights_digest(model.as_ptr(), out.as_mut_ptr(), out.len())
        };
        // SAFETY: the thread's last error, read on that thread.
        let message = unsafe { std::ffi::CStr::from_ptr(tracegate_capi::tg_last_error()) };
        let _ = tx.send((code, message.to_string_lossy().into_owned()));
    });
    let (code, message) = rx
        .recv_timeout(std::time::Duration::from_secs(10))
        .expect("tg_weights_digest blocked on a FIFO");
    assert_ne!(code, tracegate_capi::TG_OK);
    assert!(
        message.contains("pipe.gguf: a FIFO, not a regular file"),
        "{message}"
    );
}
