//! The example producer judged the way a user's engine is (docs/producers.md): by `gate bisect`
//! against the engine under the f32 policy (it is not bit-exact) and by `trace-diff`. Every check
//! has its negative control: a test-only planted defect (`--plant`) that must be caught.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{json, Value};
use tracegate_trace::{Attributes, Trace, TraceWriter};

const MODEL: &str = "fixtures/tiny-qwen3";
/// Its `hidden_size`.
const HIDDEN: usize = 52;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .unwrap()
}

fn example() -> &'static str {
    env!("CARGO_BIN_EXE_example-producer")
}

/// `gate`, `trace-diff` and `engine`, from the target directory this test's binary is in: built
/// by scripts/setup.sh (`cargo build --release --bins`) and by the workspace's `cargo test --release`.
fn tool(name: &str) -> PathBuf {
    let p = Path::new(example()).with_file_name(name);
    assert!(
        p.is_file(),
        "{} is not built: run scripts/setup.sh (or cargo build --release --bins)",
        p.display()
    );
    p
}

/// Runs from the project root (the producer protocol's working directory): exit code, stdout, stderr.
fn run(program: &Path, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(program)
        .current_dir(root())
        .args(args)
        .output()
        .unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (
        out.status.code().unwrap_or(-1),
        text(&out.stdout),
        text(&out.stderr),
    )
}

/// The "short" prompt of fixtures/prompts/frozen.json, as `--tokens` takes it.
fn short_prompt() -> String {
    let set: Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("fixtures/prompts/frozen.json")).unwrap(),
    )
    .unwrap();
    let p = set["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["id"] == "short")
        .unwrap();
    p["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// `example-producer trace` on the short prompt; extra arguments appended. Returns the path.
fn example_trace(dir: &Path, file: &str, extra: &[&str]) -> PathBuf {
    let out = dir.join(file);
    let tokens = short_prompt();
    let mut args = vec![
        "trace",
        "--model",
        MODEL,
        "--tokens",
        &tokens,
        "--out",
        out.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let (code, _, err) = run(Path::new(example()), &args);
    assert_eq!(code, 0, "example-producer trace {extra:?}: {err}");
    out
}

fn trace_diff_f32(reference: &Path, candidate: &Path) -> (i32, String) {
    let (code, out, err) = run(
        &tool("trace-diff"),
        &[
            reference.to_str().unwrap(),
            candidate.to_str().unwrap(),
            "--policy",
            "f32",
        ],
    );
    (code, format!("{out}{err}"))
}

/// `gate bisect` of the example (with `--plant` when given) against the engine, every layer
/// isolated, internals captured, judged by the f32 policy. Returns exit code, stdout and report.
fn bisect(plant: Option<&str>) -> (i32, String, Value) {
    let root = root();
    let work = tempfile::tempdir_in(root.join("target")).unwrap();
    let report = work.path().join("report.json");
    let plant = plant.map(|p| format!(" --plant {p}")).unwrap_or_default();
    let cmd = format!("'{}' {{verb}} {{args}}{plant}", example());
    let (code, out, err) = run(
        &tool("gate"),
        &[
            "--root",
            root.to_str().unwrap(),
            "bisect",
            "--model",
            MODEL,
            "--prompt",
            "short",
            "--reference",
            "engine",
            "--candidate",
            "cmd",
            "--candidate-cmd",
            &cmd,
            "--policy",
            "f32",
            "--all-layers",
            "--capture",
            "internals",
            "--work",
            work.path().to_str().unwrap(),
            "--report",
            report.to_str().unwrap(),
        ],
    );
    let report = std::fs::read_to_string(&report)
        .unwrap_or_else(|e| panic!("no report ({e}):\n{out}\n{err}"));
    (code, out, serde_json::from_str(&report).unwrap())
}

#[test]
fn clean_example_bisects_to_nothing_wrong_under_the_f32_policy() {
    let (code, out, r) = bisect(None);
    assert_eq!(
        (code, r["verdict"].as_str()),
        (0, Some("nothing_wrong")),
        "{out}"
    );
    let layers = r["layers"].as_array().unwrap();
    // Every layer was run alone through the example's layer verb, not skipped.
    assert_eq!(layers.len(), 5, "{out}");
    assert!(layers.iter().all(|l| l["status"] == "ok"), "{out}");
}

#[test]
fn planted_k_norm_defect_is_named_at_its_layer_and_stage() {
    let (code, out, r) = bisect(Some("k-norm:3"));
    assert_eq!(
        (code, r["verdict"].as_str()),
        (1, Some("wrong_layer")),
        "{out}"
    );
    assert_eq!(r["first_wrong_layer"], 3, "{out}");
    assert_eq!(r["stage"]["block"], "attention", "{out}");
    assert_eq!(r["stage"]["tensor"], "layer.03.k", "{out}");
    assert!(
        out.contains("layer 03 body is wrong: k differs in isolation"),
        "{out}"
    );
}

#[test]
fn example_against_the_engine_is_within_the_f32_policy_and_not_bit_exact() {
    let dir = tempfile::tempdir().unwrap();
    let engine = dir.path().join("engine.trace");
    let tokens = short_prompt();
    let (code, _, err) = run(
        &tool("engine"),
        &[
            "trace",
            "--model",
            MODEL,
            "--tokens",
            &tokens,
            "--out",
            engine.to_str().unwrap(),
            "--capture",
            "internals",
            "--threads",
            "1",
        ],
    );
    assert_eq!(code, 0, "{err}");
    // Same weights digest (else refused, exit 2), numbers within the policy but not identical.
    let (code, out) = trace_diff_f32(
        &engine,
        &example_trace(dir.path(), "clean.trace", &["--capture", "internals"]),
    );
    assert_eq!(code, 0, "{out}");
    assert!(out.starts_with("WITHIN POLICY"), "{out}");
    let planted = example_trace(
        dir.path(),
        "planted.trace",
        &["--capture", "internals", "--plant", "k-norm:3"],
    );
    let (code, out) = trace_diff_f32(&engine, &planted);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("first layer.03.k"), "{out}");
}

#[test]
fn cached_decode_agrees_with_the_recompute_and_a_misplaced_position_does_not() {
    let dir = tempfile::tempdir().unwrap();
    let gen = |file: &str, cache: &str, plant: &[&str]| {
        let mut extra = vec!["--capture", "default", "--generate", "3", "--cache", cache];
        extra.extend_from_slice(plant);
        example_trace(dir.path(), file, &extra)
    };
    let (code, out) = trace_diff_f32(&gen("off.trace", "off", &[]), &gen("on.trace", "on", &[]));
    assert_eq!(code, 0, "{out}");
    let plant = ["--plant", "decode-pos"];
    let (code, out) = trace_diff_f32(
        &gen("off-p.trace", "off", &plant),
        &gen("on-p.trace", "on", &plant),
    );
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("first decode.0001.logits"), "{out}");
}

/// Rows of `names` from `t`, concatenated in order.
fn rows(t: &Trace, names: &[String]) -> Vec<f32> {
    names.iter().flat_map(|n| t.f32_vec(n).unwrap()).collect()
}

fn write(path: &Path, provenance: Value, tensors: &[(String, Vec<f32>, Attributes)]) {
    let mut w = TraceWriter::create(path, provenance).unwrap();
    for (name, data, attrs) in tensors {
        w.tensor_f32(
            name,
            &[(data.len() / HIDDEN) as u64, HIDDEN as u64],
            data,
            attrs,
        )
        .unwrap();
    }
    w.finish().unwrap();
}

#[test]
fn decode_from_rows_agree_with_the_decode_steps_of_a_recompute() {
    // Layer 2 at decode steps 1 and 2 (positions 5 and 6) of an uncached run: its input rows at
    // positions 0..6 go to `layer --decode-from 5`, whose two rows run the cached decode path.
    let dir = tempfile::tempdir().unwrap();
    let full = example_trace(
        dir.path(),
        "full.trace",
        &[
            "--capture",
            "internals",
            "--generate",
            "3",
            "--cache",
            "off",
        ],
    );
    let t = Trace::open(&full).unwrap();
    let steps = |point: &str| {
        vec![
            format!("decode.0001.layer.02.{point}"),
            format!("decode.0002.layer.02.{point}"),
        ]
    };
    let mut input_rows = vec!["layer.02.hidden_in".to_string()];
    input_rows.extend(steps("hidden_in"));
    let input = dir.path().join("input.trace");
    let attrs = |pos: Vec<i64>| {
        Attributes::default()
            .with_path("prefill")
            .with_mask("causal")
            .with_positions(pos)
    };
    write(
        &input,
        json!({}),
        &[(
            "layer.02.hidden_in".into(),
            rows(&t, &input_rows),
            attrs((0..7).collect()),
        )],
    );
    let mut decode_attrs = Attributes::default()
        .with_path("layer")
        .with_mask("causal")
        .with_positions(vec![5, 6]);
    decode_attrs.extra.insert("decode_from".into(), "5".into());
    let expected = dir.path().join("expected.trace");
    let points = ["hidden_in", "attn_out", "mlp_out", "hidden_out"];
    let tensors: Vec<_> = points
        .iter()
        .map(|p| {
            (
                format!("layer.02.{p}"),
                rows(&t, &steps(p)),
                decode_attrs.clone(),
            )
        })
        .collect();
    write(
        &expected,
        json!({ "weights_digest": t.provenance()["weights_digest"] }),
        &tensors,
    );

    let layer = |input: &Path, from: &str, plant: &[&str]| {
        let out = dir
            .path()
            .join(format!("layer-{from}-{}.trace", plant.len()));
        let mut args = vec![
            "layer",
            "--model",
            MODEL,
            "--layer",
            "2",
            "--input",
            input.to_str().unwrap(),
            "--input-name",
            "layer.02.hidden_in",
        ];
        args.extend_from_slice(&[
            "--out",
            out.to_str().unwrap(),
            "--capture",
            "internals",
            "--decode-from",
            from,
        ]);
        args.extend_from_slice(plant);
        let (code, _, err) = run(Path::new(example()), &args);
        (code, err, out)
    };
    let (code, err, out) = layer(&input, "5", &[]);
    assert_eq!(code, 0, "{err}");
    let (code, diff) = trace_diff_f32(&expected, &out);
    assert_eq!(code, 0, "{diff}");
    let (code, err, planted) = layer(&input, "5", &["--plant", "decode-pos"]);
    assert_eq!(code, 0, "{err}");
    let (code, diff) = trace_diff_f32(&expected, &planted);
    assert_eq!(code, 1, "{diff}");
    assert!(diff.contains("first layer.02.attn_out"), "{diff}");

    // Refusals, exit 2 in one line: rows not at 0..m−1 (the expected trace's are at 5, 6), P ≥ m.
    let (code, err, _) = layer(&expected, "0", &[]);
    assert_eq!((code, err.lines().count()), (2, 1), "{err}");
    assert!(err.contains("row 0 is at position 5"), "{err}");
    let (code, err, _) = layer(&input, "7", &[]);
    assert_eq!((code, err.lines().count()), (2, 1), "{err}");
    assert!(err.contains("--decode-from 7"), "{err}");
}

#[test]
fn a_moe_model_is_refused_in_one_line() {
    let (code, _, err) = run(
        Path::new(example()),
        &[
            "trace",
            "--model",
            "fixtures/tiny-qwen3-moe",
            "--tokens",
            "1,2",
            "--out",
            "/nonexistent/x.trace",
            "--capture",
            "default",
        ],
    );
    assert_eq!((code, err.lines().count()), (2, 1), "{err}");
    assert!(
        err.contains("model_type \"qwen3_moe\" is not supported"),
        "{err}"
    );
}
