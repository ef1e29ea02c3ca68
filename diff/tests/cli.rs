//! The `trace-diff` binary: exit codes, human and JSON reports (snapshots), the JSON schema,
//! and `--show`.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;
use serde_json::{json, Value};

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

fn run(args: &[&str]) -> Run {
    let out = Command::new(env!("CARGO_BIN_EXE_trace-diff")).args(args).output().unwrap();
    Run {
        code: out.status.code().unwrap(),
        stdout: String::from_utf8(out.stdout).unwrap(),
        stderr: String::from_utf8(out.stderr).unwrap(),
    }
}

fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

fn policy_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/policy/oracle-default.json")
}

/// Temp paths vary and whole-trace content digests belong to the trace crate's encoding, so
/// snapshots hide them, found by their key only: every number (statistics, margins, the
/// per-tensor xxh3 of fixed bytes) stays pinned.
macro_rules! snap {
    ($name:expr, $value:expr) => {
        insta::with_settings!({filters => vec![
            (r#"/[^\s"]*/((ref|cand|one)\.trace)"#, "[TMP]/$1"),
            (r#"("digest": ")[0-9a-f]{64}""#, r#"${1}[DIGEST]""#),
            (r"(digest +)[0-9a-f]{16}(?:[0-9a-f]{48})?\b", "${1}[DIGEST]"),
        ]}, {
            insta::assert_snapshot!($name, $value);
        })
    };
}

// --- a minimal JSON Schema checker: the keywords docs/diff-report.schema.json uses ---------

fn schema() -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/diff-report.schema.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn type_ok(t: &str, v: &Value) -> bool {
    match t {
        "object" => v.is_object(),
        "array" => v.is_array(),
        "string" => v.is_string(),
        "integer" => v.is_u64() || v.is_i64(),
        "number" => v.is_number(),
        "boolean" => v.is_boolean(),
        "null" => v.is_null(),
        other => panic!("schema uses unknown type {other}"),
    }
}

fn validate(root: &Value, s: &Value, v: &Value, at: &str, errors: &mut Vec<String>) {
    let known = ["$schema", "$id", "title", "description", "type", "required", "additionalProperties", "properties", "$defs", "$ref", "items", "enum", "minimum"];
    for k in s.as_object().unwrap().keys() {
        assert!(known.contains(&k.as_str()), "checker does not implement schema keyword {k}");
    }
    if let Some(r) = s.get("$ref").and_then(Value::as_str) {
        let name = r.strip_prefix("#/$defs/").expect("local $ref");
        return validate(root, &root["$defs"][name], v, at, errors);
    }
    if let Some(t) = s.get("type") {
        let ok = match t {
            Value::String(t) => type_ok(t, v),
            Value::Array(ts) => ts.iter().any(|t| type_ok(t.as_str().unwrap(), v)),
            _ => panic!("bad type"),
        };
        if !ok {
            errors.push(format!("{at}: {v} is not of type {t}"));
            return;
        }
    }
    if let Some(e) = s.get("enum").and_then(Value::as_array) {
        if !e.contains(v) {
            errors.push(format!("{at}: {v} not in {e:?}"));
        }
    }
    if let (Some(m), Some(x)) = (s.get("minimum").and_then(Value::as_f64), v.as_f64()) {
        if x < m {
            errors.push(format!("{at}: {x} < minimum {m}"));
        }
    }
    if let Some(obj) = v.as_object() {
        let props = s.get("properties").and_then(Value::as_object);
        for req in s.get("required").and_then(Value::as_array).into_iter().flatten() {
            if !obj.contains_key(req.as_str().unwrap()) {
                errors.push(format!("{at}: missing required {req}"));
            }
        }
        for (k, val) in obj {
            match props.and_then(|p| p.get(k)) {
                Some(ps) => validate(root, ps, val, &format!("{at}.{k}"), errors),
                None if s.get("additionalProperties") == Some(&Value::Bool(false)) => errors.push(format!("{at}: unexpected key {k}")),
                None => {}
            }
        }
    }
    if let (Some(items), Some(arr)) = (s.get("items"), v.as_array()) {
        for (i, x) in arr.iter().enumerate() {
            validate(root, items, x, &format!("{at}[{i}]"), errors);
        }
    }
}

fn assert_valid(report: &Value) {
    let root = schema();
    let mut errors = Vec::new();
    validate(&root, &root, report, "$", &mut errors);
    assert!(errors.is_empty(), "report does not match docs/diff-report.schema.json:\n{}", errors.join("\n"));
}

fn json_run(args: &[&str]) -> (i32, Value) {
    let mut a = vec!["--json"];
    a.extend_from_slice(args);
    let r = run(&a);
    let v: Value = serde_json::from_str(&r.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {}\n{}", r.stdout, r.stderr));
    assert_valid(&v);
    (r.code, v)
}

#[test]
fn the_checker_catches_a_bad_report() {
    let root = schema();
    let mut errors = Vec::new();
    validate(&root, &root, &json!({"verdict": "fine", "extra_key": 1}), "$", &mut errors);
    assert!(errors.iter().any(|e| e.contains("not in")));
    assert!(errors.iter().any(|e| e.contains("missing required \"tensors\"")));
    assert!(errors.iter().any(|e| e.contains("unexpected key extra_key")));
}

// --- the reports -----------------------------------------------------------------------------

#[test]
fn identical_exits_0() {
    let m = model();
    let (_d, r, c) = pair(&m, &m);
    let out = run(&[p(&r), p(&c)]);
    assert_eq!(out.code, 0);
    assert!(out.stdout.starts_with("IDENTICAL — 13 tensors (13 by digest, 0 element-wise), 0 differing elements, 3 decisions\n"), "{}", out.stdout);
    snap!("identical_human", out.stdout);
    let (code, v) = json_run(&[p(&r), p(&c)]);
    assert_eq!((code, v["verdict"].as_str()), (0, Some("identical")));
    assert!(v["first_divergence"].is_null() && v["first_decision_divergence"].is_null());
}

fn one_ulp_and_flip() -> (Spec, Spec) {
    let r = model();
    let mut c = model();
    c.poke_f32_bits("layer.01.attn_out", 21, |b| b + 1);
    for i in 0..32 {
        c.poke_f32_bits("layer.01.mlp_out", i, |b| b.wrapping_add(1000 * (i as u32 + 1)));
    }
    c.decision_mut("layer.01.router.topk").values.swap(2, 3);
    c.decision_mut("logits.argmax").values[2] = 3;
    (r, c)
}

#[test]
fn different_exits_1_with_a_located_first_divergence() {
    let (rs, cs) = one_ulp_and_flip();
    let (_d, r, c) = pair(&rs, &cs);
    let out = run(&[p(&r), p(&c)]);
    assert_eq!(out.code, 1);
    let first = out.stdout.lines().next().unwrap();
    assert!(first.starts_with("DIFFERENT — first at layer.01.attn_out[2,5]: "), "{first}");
    assert!(first.ends_with(", 1 ULP (1/32 elements differ); 2 of 3 decisions differ"), "{first}");
    snap!("different_human", out.stdout);

    let (code, v) = json_run(&[p(&r), p(&c)]);
    assert_eq!(code, 1);
    assert_eq!(v["verdict"], "different");
    let d = &v["first_divergence"];
    assert_eq!((d["tensor"].as_str(), d["flat_index"].as_u64(), d["ulp"].as_u64()), (Some("layer.01.attn_out"), Some(21), Some(1)));
    assert_eq!(d["coords"], json!([2, 5]));
    assert_eq!(v["first_decision_divergence"]["name"], "layer.01.router.topk");
    // The later tensor is not counted as "0 differing": it was not scanned.
    let later = v["per_tensor"].as_array().unwrap().iter().find(|t| t["tensor"] == "layer.01.mlp_out").unwrap();
    assert_eq!((later["method"].as_str(), later["differing_elements"].is_null()), (Some("not_scanned"), true));
    snap!("different_json", serde_json::to_string_pretty(&v).unwrap());
}

#[test]
fn all_prints_the_layer_curve() {
    let (rs, cs) = one_ulp_and_flip();
    let (_d, r, c) = pair(&rs, &cs);
    let out = run(&["--all", p(&r), p(&c)]);
    assert_eq!(out.code, 1);
    assert!(out.stdout.contains("per tensor (reference order)"));
    let row = out.stdout.lines().find(|l| l.trim_start().starts_with("layer.01.mlp_out")).unwrap();
    assert!(row.contains("32/32"), "{row}");
    snap!("all_human", out.stdout);
}

#[test]
fn policy_reports_the_rule_per_tensor() {
    let r = model();
    let mut c = model();
    c.provenance = oracle_provenance();
    for i in (0..32).step_by(2) {
        c.poke_f32_bits("layer.00.attn_out", i, |b| b ^ 3);
    }
    let (_d, rp, cp) = pair(&r, &c);
    let pol = policy_path();
    let out = run(&["--policy", p(&pol), p(&rp), p(&cp)]);
    assert_eq!(out.code, 0, "{}", out.stdout);
    assert!(out.stdout.starts_with("WITHIN POLICY — 13 tensors judged by policy \"oracle-default\" (12 bit-identical, 1 within bounds), 3 decisions"), "{}", out.stdout);
    snap!("policy_pass_human", out.stdout);

    c.set_f32("logits", 3, 50.0);
    let (_d, rp, cp) = pair(&r, &c);
    let (code, v) = json_run(&["--policy", p(&pol), p(&rp), p(&cp)]);
    assert_eq!((code, v["verdict"].as_str()), (1, Some("different")));
    let logits = v["per_tensor"].as_array().unwrap().iter().find(|t| t["tensor"] == "logits").unwrap();
    assert_eq!((logits["status"].as_str(), logits["rule"]["pattern"].as_str()), (Some("outside_policy"), Some("logits")));
}

#[test]
fn a_mixed_precision_report_matches_the_schema() {
    // Every tensor of the candidate in bf16 (docs/diff.md, "Mixed precision"), with and
    // without a policy; diff/tests/mixed.rs checks the values.
    let r = model();
    let mut c = model();
    for t in &mut c.tensors {
        t.bytes = t.bytes.chunks_exact(4).flat_map(|b| ((u32::from_le_bytes(b.try_into().unwrap()) >> 16) as u16).to_le_bytes()).collect();
        t.dtype = tracegate_trace::DType::BF16;
    }
    let (_d, rp, cp) = pair(&r, &c);
    let (code, v) = json_run(&["--all", p(&rp), p(&cp)]);
    assert_eq!((code, v["per_tensor"][0]["ulp_dtype"].as_str()), (1, Some("bf16")));
    let (_, v) = json_run(&["--policy", p(&policy_path()), p(&rp), p(&cp)]);
    assert_eq!(v["first_divergence"]["candidate_dtype"], "bf16");
}

#[test]
fn incomparable_exits_3_naming_the_reason() {
    let r = model();
    let mut c = model();
    c.tensor_mut("layer.00.mlp_out").attrs.positions = Some(vec![4, 5, 6, 7]);
    let (_d, rp, cp) = pair(&r, &c);
    let out = run(&[p(&rp), p(&cp)]);
    assert_eq!(out.code, 3);
    assert!(out.stdout.starts_with("INCOMPARABLE — positions_mismatch (layer.00.mlp_out): positions [0, 1, 2, 3] vs [4, 5, 6, 7]"), "{}", out.stdout);
    let (code, v) = json_run(&[p(&rp), p(&cp)]);
    assert_eq!((code, v["verdict"].as_str()), (3, Some("incomparable")));

    let mut ro = model();
    ro.provenance = oracle_provenance();
    let mut co = ro.clone();
    co.provenance["versions"]["torch"] = json!("2.6.0");
    let (_d, rp, cp) = pair(&ro, &co);
    let out = run(&[p(&rp), p(&cp)]);
    assert_eq!(out.code, 3);
    snap!("stack_mismatch_human", out.stdout);
    let out = run(&["--allow-stack-mismatch", p(&rp), p(&cp)]);
    assert_eq!(out.code, 0, "{}", out.stdout);
    assert!(out.stdout.contains("stack_mismatch_allowed"));

    // A long non-ASCII provenance value is shortened at a character boundary, not a byte.
    let mut ru = model();
    ru.provenance["prompt_tokens"] = json!([format!("{}{}", "a".repeat(9), "é".repeat(100))]);
    let mut cu = ru.clone();
    cu.provenance["prompt_tokens"] = json!([format!("{}{}", "b".repeat(9), "é".repeat(100))]);
    let (_d, rp, cp) = pair(&ru, &cu);
    let out = run(&[p(&rp), p(&cp)]);
    assert_eq!(out.code, 3, "{}{}", out.stdout, out.stderr);
    assert!(out.stdout.contains("aaaaaaaaa") && out.stdout.contains("…"), "{}", out.stdout);
}

#[test]
fn unreadable_and_bad_usage_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let m = model();
    let good = m.write(&dir.path().join("ref.trace"));
    let junk = dir.path().join("cand.trace");
    std::fs::write(&junk, b"not a trace at all").unwrap();
    let out = run(&[p(&good), p(&junk)]);
    assert_eq!(out.code, 2);
    assert!(out.stdout.starts_with("UNREADABLE — unreadable: candidate: "), "{}", out.stdout);
    let (code, v) = json_run(&[p(&good), p(&junk)]);
    assert_eq!((code, v["verdict"].as_str()), (2, Some("unreadable")));
    assert!(v["candidate"]["digest"].is_null());

    assert_eq!(run(&[p(&good)]).code, 2, "missing CAND is bad usage");
    assert_eq!(run(&["--bogus", p(&good), p(&good)]).code, 2);
    let bad_policy = dir.path().join("p.json");
    std::fs::write(&bad_policy, "{}").unwrap();
    let out = run(&["--policy", p(&bad_policy), p(&good), p(&good)]);
    assert_eq!(out.code, 2);
    assert!(out.stderr.contains("bad policy"));
}

#[test]
fn help_documents_exit_codes() {
    let out = run(&["--help"]);
    assert_eq!(out.code, 0);
    for line in ["0  identical", "1  different", "2  unreadable", "3  incomparable"] {
        assert!(out.stdout.contains(line), "--help lacks {line:?}");
    }
}

#[test]
fn show_inspects_one_trace() {
    let mut m = model();
    m.provenance = oracle_provenance();
    let dir = tempfile::tempdir().unwrap();
    let path = m.write(&dir.path().join("one.trace"));
    let out = run(&["--show", p(&path)]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(out.stdout.contains("verify   ok"));
    snap!("show", out.stdout);
}

// --- hostile names, attributes and provenance on a terminal (issue 12, item 7) -------------

/// What must never reach a terminal raw: controls but the newline, and bidirectional overrides.
fn raw_control(s: &str) -> Option<char> {
    s.chars().find(|&c| (c.is_control() && c != '\n') || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}'))
}

fn hostile_trace(dir: &Path, name: &str, edit: impl FnOnce(&mut Value)) -> PathBuf {
    let path = model().write(&dir.join(name));
    rewrite_index(&path, edit);
    path
}

#[test]
fn a_name_over_65535_bytes_does_not_panic_show_or_diff() {
    let dir = tempfile::tempdir().unwrap();
    let long = format!("layer.{}", "x".repeat(70_000));
    let path = hostile_trace(dir.path(), "one.trace", |ix| ix["tensors"][1]["name"] = json!(long));
    let out = run(&["--no-verify", "--show", p(&path)]);
    // An older reader lists it; a reader that enforces the 4,096-byte limit refuses the file.
    assert!(out.code == 0 || (out.code == 2 && out.stdout.starts_with("UNREADABLE")), "exit {}: {}", out.code, out.stderr);
    if out.code == 0 {
        assert!(out.stdout.contains(&long));
    }
    let out = run(&["--all", "--no-verify", p(&path), p(&path)]);
    assert!(out.code == 0 || out.code == 2, "exit {}: {}", out.code, out.stderr);
    if out.code == 0 {
        assert!(out.stdout.starts_with("IDENTICAL") && out.stdout.contains(&long), "{}", &out.stdout[..200]);
    }
}

#[test]
fn control_characters_are_escaped_in_every_output() {
    let dir = tempfile::tempdir().unwrap();
    let path = hostile_trace(dir.path(), "one.trace", |ix| {
        ix["provenance"]["producer"] = json!("engine\u{9b}2J\u{7f}");
        ix["provenance"]["note"] = json!("\u{1b}]0;pwned\u{7}\u{202e}txt.exe");
        ix["tensors"][2]["attributes"]["note"] = json!("\u{1b}[31mred\r");
    });
    // A reader that refuses control characters in names refuses this one: then the refusal
    // itself must not print the name raw.
    let named = hostile_trace(dir.path(), "ref.trace", |ix| ix["tensors"][3]["name"] = json!("layer.00.\u{1b}[2Kattn_out"));
    let other = hostile_trace(dir.path(), "cand.trace", |ix| {
        ix["provenance"]["producer"] = json!("oracle\u{85}");
        ix["tensors"][2]["attributes"]["note"] = json!("\u{1b}[32mgreen");
    });
    for args in [
        vec!["--no-verify", "--show", p(&path)],
        vec!["--show", p(&path)],
        vec!["--no-verify", "--all", p(&path), p(&other)],
        vec!["--no-verify", "--all", p(&other), p(&path)],
        vec!["--all", p(&path), p(&other)],
        vec!["--json", "--no-verify", p(&path), p(&other)],
        vec!["--no-verify", "--show", p(&named)],
        vec!["--no-verify", "--all", p(&named), p(&other)],
        vec!["--json", p(&named), p(&other)],
    ] {
        let out = run(&args);
        assert_ne!(out.code, 101, "{args:?} panicked: {}", out.stderr);
        for (stream, text) in [("stdout", &out.stdout), ("stderr", &out.stderr)] {
            assert_eq!(raw_control(text), None, "{args:?} printed a raw control character on {stream}:\n{text}");
        }
        if args.contains(&p(&named)) {
            continue;
        }
        if args[0] == "--json" {
            let v: Value = serde_json::from_str(&out.stdout).unwrap();
            assert_eq!(v["candidate"]["producer"], "oracle\u{85}", "the JSON escapes, it does not alter");
        } else if args.contains(&"--no-verify") {
            assert!(out.stdout.contains("\\u{1b}"), "{args:?}: {}", out.stdout);
        }
    }
}
