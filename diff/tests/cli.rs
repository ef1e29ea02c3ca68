//! The `trace-diff` binary: exit codes, human and JSON reports (snapshots), the JSON schema,
//! and `--show`.

use crate::common;

use std::path::{Path, PathBuf};

use common::*;
use serde_json::{json, Value};

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

// --- every JSON report is checked against docs/diff-report.schema.json -----------------------

/// `trace-diff --json ARGS`: the exit code and the report, which must match the schema
/// (`common::assert_valid_report`, a real JSON Schema validator).
fn json_run(args: &[&str]) -> (i32, Value) {
    let mut a = vec!["--json"];
    a.extend_from_slice(args);
    let r = run(&a);
    let v: Value = serde_json::from_str(&r.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}\n{}", r.stdout, r.stderr));
    assert_valid_report(&v);
    (r.code, v)
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
    assert!(
        v["first_bit_difference"].is_null()
            && v["first_violation"].is_null()
            && v["first_decision_divergence"].is_null()
    );
}

fn one_ulp_and_flip() -> (Spec, Spec) {
    let r = model();
    let mut c = model();
    c.poke_f32_bits("layer.01.attn_out", 21, |b| b + 1);
    for i in 0..32 {
        c.poke_f32_bits("layer.01.mlp_out", i, |b| {
            b.wrapping_add(1000 * (i as u32 + 1))
        });
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
    assert!(
        first.starts_with("DIFFERENT — first at layer.01.attn_out[2,5]: "),
        "{first}"
    );
    assert!(
        first.ends_with(", 1 ULP (1/32 elements differ); 2 of 3 decisions differ"),
        "{first}"
    );
    snap!("different_human", out.stdout);

    let (code, v) = json_run(&[p(&r), p(&c)]);
    assert_eq!(code, 1);
    assert_eq!(v["verdict"], "different");
    assert!(v["first_violation"].is_null(), "no policy, no violation");
    let d = &v["first_bit_difference"];
    assert_eq!(
        (
            d["tensor"].as_str(),
            d["flat_index"].as_u64(),
            d["ulp"].as_u64()
        ),
        (Some("layer.01.attn_out"), Some(21), Some(1))
    );
    assert_eq!(d["coords"], json!([2, 5]));
    assert_eq!(
        v["first_decision_divergence"]["name"],
        "layer.01.router.topk"
    );
    // The later tensor is not counted as "0 differing": it was not scanned.
    let later = v["per_tensor"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["tensor"] == "layer.01.mlp_out")
        .unwrap();
    assert_eq!(
        (
            later["method"].as_str(),
            later["differing_elements"].is_null()
        ),
        (Some("not_scanned"), true)
    );
    snap!("different_json", serde_json::to_string_pretty(&v).unwrap());
}

#[test]
fn all_prints_the_layer_curve() {
    let (rs, cs) = one_ulp_and_flip();
    let (_d, r, c) = pair(&rs, &cs);
    let out = run(&["--all", p(&r), p(&c)]);
    assert_eq!(out.code, 1);
    assert!(out.stdout.contains("per tensor (reference order)"));
    let row = out
        .stdout
        .lines()
        .find(|l| l.trim_start().starts_with("layer.01.mlp_out"))
        .unwrap();
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
    assert!(out.stdout.starts_with("WITHIN POLICY — 13 tensors judged by policy \"oracle-default\" (for f32 candidates, as this one) (12 bit-identical, 1 within bounds), 3 decisions"), "{}", out.stdout);
    snap!("policy_pass_human", out.stdout);

    c.set_f32("logits", 3, 50.0);
    let (_d, rp, cp) = pair(&r, &c);
    let (code, v) = json_run(&["--policy", p(&pol), p(&rp), p(&cp)]);
    assert_eq!((code, v["verdict"].as_str()), (1, Some("different")));
    let logits = v["per_tensor"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["tensor"] == "logits")
        .unwrap();
    assert_eq!(
        (
            logits["status"].as_str(),
            logits["rule"]["pattern"].as_str()
        ),
        (Some("outside_policy"), Some("logits"))
    );
}

fn f32_values(s: &Spec, name: &str) -> Vec<f32> {
    s.tensors
        .iter()
        .find(|t| t.name == name)
        .unwrap()
        .bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

/// Rounding noise in layer.00.attn_out (a few 1-bit flips, well within the default policy)
/// before a real defect in layer.01.mlp_out ([4, 8]): element 13 = [1,5] moved by +2, after a
/// smaller move (+0.5) at element 5 that crosses zero. So 13 is the worst element by
/// |difference|, while 5 is both the tensor's first difference and its largest in ULPs.
fn noise_then_defect() -> (Spec, Spec) {
    let r = model();
    let mut c = model();
    c.provenance = oracle_provenance();
    for i in [3, 9, 20] {
        c.poke_f32_bits("layer.00.attn_out", i, |b| b ^ 1);
    }
    let mlp = f32_values(&r, "layer.01.mlp_out");
    c.set_f32("layer.01.mlp_out", 13, mlp[13] + 2.0);
    c.set_f32("layer.01.mlp_out", 5, mlp[5] + 0.5);
    (r, c)
}

#[test]
fn under_a_policy_the_first_violation_is_named_not_the_first_bit_difference() {
    let (rs, cs) = noise_then_defect();
    // What the policy must find, from the planted values alone (f64, index order).
    let (a, b) = (
        f32_values(&rs, "layer.01.mlp_out"),
        f32_values(&cs, "layer.01.mlp_out"),
    );
    let (mut rr, mut cc, mut rc, mut dd) = (0.0f64, 0.0f64, 0.0f64, 0.0f64);
    for (&x, &y) in a.iter().zip(&b) {
        let (x, y) = (x as f64, y as f64);
        (rr, cc, rc, dd) = (rr + x * x, cc + y * y, rc + x * y, dd + (x - y) * (x - y));
    }
    let (rel_l2, cosine) = ((dd / rr).sqrt(), rc / (rr * cc).sqrt());
    assert!(
        rel_l2 > 1e-4 && cosine < 0.9999,
        "the plant breaks both bounds of rule #3: {rel_l2} {cosine}"
    );
    assert!(
        a[13] > 0.0 && b[13] > 0.0 && a[5] < 0.0 && b[5] > 0.0,
        "the plant's signs, as the comment says"
    );
    let ulp = (b[13].to_bits() - a[13].to_bits()) as u64;

    let (_d, r, c) = pair(&rs, &cs);
    let pol = policy_path();
    let out = run(&["--policy", p(&pol), p(&r), p(&c)]);
    assert_eq!(out.code, 1, "{}", out.stdout);
    let head = out.stdout.lines().next().unwrap();
    assert!(
        head.starts_with(
            "DIFFERENT — 1 of 13 tensors outside the policy, first layer.01.mlp_out: relative L2 "
        ),
        "{head}"
    );
    assert!(
        head.ends_with(" > 0.0001 (+1 more bound) by rule #3 layer.*.mlp_out; 3 decisions"),
        "{head}"
    );
    assert!(
        !head.contains("layer.00.attn_out"),
        "the noise is not the headline: {head}"
    );
    // The violation's block, with its worst element, comes before the first bit difference.
    let (fv, fb) = (
        out.stdout.find("first violation").unwrap(),
        out.stdout.find("first bit difference").unwrap(),
    );
    assert!(fv < fb, "{}", out.stdout);
    assert!(
        out.stdout.contains("  worst      [1,5]  (flat index 13)\n"),
        "{}",
        out.stdout
    );
    assert!(
        out.stdout.contains(&format!(
            "  distance   {} ULP (f32)\n",
            tracegate_diff::thousands(ulp)
        )),
        "{}",
        out.stdout
    );
    snap!("policy_violation_human", out.stdout);

    let (code, v) = json_run(&["--policy", p(&pol), p(&r), p(&c)]);
    assert_eq!(
        (code, v["verdict"].as_str(), v["schema"].as_str()),
        (1, Some("different"), Some("tracegate-diff-report/4"))
    );
    let f = &v["first_violation"];
    assert_eq!(
        (f["tensor"].as_str(), &f["rule"]),
        (
            Some("layer.01.mlp_out"),
            &json!({"index": 3, "pattern": "layer.*.mlp_out"})
        )
    );
    let bounds: Vec<&str> = f["violations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["bound"].as_str().unwrap())
        .collect();
    assert_eq!(bounds, ["max_rel_l2", "min_cosine"]);
    let close = |got: &Value, want: f64| (got.as_f64().unwrap() - want).abs() <= 1e-12 * want.abs();
    let (l2, cos) = (&f["violations"][0], &f["violations"][1]);
    assert!(
        l2["limit"] == json!(1e-4) && close(&l2["value"], rel_l2),
        "{l2} vs {rel_l2}"
    );
    assert!(
        cos["limit"] == json!(0.9999) && close(&cos["value"], cosine),
        "{cos} vs {cosine}"
    );
    let w = &f["worst_element"];
    assert_eq!(
        (w["flat_index"].as_u64(), &w["coords"], w["ulp"].as_u64()),
        (Some(13), &json!([1, 5]), Some(ulp))
    );
    assert_eq!(
        (w["reference_bits"].as_str(), w["candidate_bits"].as_str()),
        (
            Some(&*format!("0x{:08x}", a[13].to_bits())),
            Some(&*format!("0x{:08x}", b[13].to_bits()))
        )
    );
    assert_eq!(
        w["candidate_value"]
            .as_str()
            .unwrap()
            .parse::<f32>()
            .unwrap()
            .to_bits(),
        b[13].to_bits()
    );
    // The first bit difference keeps its place and its content, under its own name.
    let d = &v["first_bit_difference"];
    assert_eq!(
        (d["tensor"].as_str(), d["flat_index"].as_u64(), &d["coords"]),
        (Some("layer.00.attn_out"), Some(3), &json!([0, 3]))
    );
    let rows = v["per_tensor"].as_array().unwrap();
    let row = |name: &str| rows.iter().find(|t| t["tensor"] == name).unwrap();
    let mlp = row("layer.01.mlp_out");
    assert_eq!(
        (&mlp["status"], &mlp["violations"], &mlp["worst_element"]),
        (&json!("outside_policy"), &f["violations"], w)
    );
    assert!(
        mlp["max_ulp"].as_u64().unwrap() > ulp,
        "worst is by |difference|, not by ULPs: {mlp}"
    );
    let attn = row("layer.00.attn_out");
    assert_eq!(
        (&attn["status"], &attn["violations"], &attn["worst_element"]),
        (&json!("within_policy"), &json!([]), &Value::Null)
    );
}

#[test]
fn by_bits_an_oracle_pair_is_told_that_a_policy_exists() {
    // A port's first trace-diff against the oracle, without --policy: DIFFERENT by bits, and a
    // line saying the oracle is judged by tolerances; with the policy, or between two ordered
    // producers, no such line (the controls).
    let (rs, cs) = noise_then_defect();
    let (_d, r, c) = pair(&rs, &cs);
    let hint =
        "judged by bits: oracle is not a bit-exact producer (engine, contract); --policy f32";
    let out = run(&[p(&r), p(&c)]);
    assert_eq!(out.code, 1, "{}", out.stdout);
    assert!(out.stdout.contains(hint), "{}", out.stdout);
    let pol = policy_path();
    let out = run(&["--policy", p(&pol), p(&r), p(&c)]);
    assert!(!out.stdout.contains("judged by bits:"), "{}", out.stdout);
    let mut ordered = cs.clone();
    ordered.provenance = rs.provenance.clone();
    let (_d, r, c) = pair(&rs, &ordered);
    let out = run(&[p(&r), p(&c)]);
    assert_eq!(out.code, 1, "{}", out.stdout);
    assert!(!out.stdout.contains("judged by bits:"), "{}", out.stdout);
}

#[test]
fn the_validator_rejects_a_report_that_breaks_the_schema() {
    let (rs, cs) = noise_then_defect();
    let (_d, r, c) = pair(&rs, &cs);
    let (_, good) = json_run(&["--policy", p(&policy_path()), p(&r), p(&c)]);
    // Each a planted defect of one kind, each must be refused.
    type Plant = (&'static str, fn(&mut Value));
    let plants: [Plant; 9] = [
        ("a wrong type", |v| {
            v["tensors"]["reference_count"] = json!("13")
        }),
        ("a missing required field", |v| {
            drop(v.as_object_mut().unwrap().remove("first_violation"))
        }),
        ("a missing field of a violation", |v| {
            drop(
                v["first_violation"]["violations"][0]
                    .as_object_mut()
                    .unwrap()
                    .remove("limit"),
            )
        }),
        ("an unknown field", |v| {
            v["first_violation"]["note"] = json!(1)
        }),
        ("the previous version", |v| {
            v["schema"] = json!("tracegate-diff-report/2")
        }),
        ("a violation as prose", |v| {
            let at = v["per_tensor"]
                .as_array()
                .unwrap()
                .iter()
                .position(|t| t["status"] == "outside_policy")
                .unwrap();
            v["per_tensor"][at]["violations"][0] = json!("relative L2 0.01 > 0.0001");
        }),
        ("an unknown bound", |v| {
            v["first_violation"]["violations"][0]["bound"] = json!("max_l2")
        }),
        ("a real that is an arbitrary string", |v| {
            v["first_violation"]["violations"][0]["value"] = json!("big")
        }),
        ("bits that are not hex", |v| {
            v["first_violation"]["worst_element"]["candidate_bits"] = json!("3f800000")
        }),
    ];
    for (what, plant) in plants {
        let mut bad = good.clone();
        plant(&mut bad);
        assert!(
            !report_schema_errors(&bad).is_empty(),
            "the validator accepted {what}"
        );
    }
}

#[test]
fn a_mixed_precision_report_matches_the_schema() {
    // Every tensor of the candidate in bf16 (docs/diff.md, "Mixed precision"), with and
    // without a policy; diff/tests/mixed.rs checks the values.
    let r = model();
    let mut c = model();
    for t in &mut c.tensors {
        t.bytes = t
            .bytes
            .chunks_exact(4)
            .flat_map(|b| ((u32::from_le_bytes(b.try_into().unwrap()) >> 16) as u16).to_le_bytes())
            .collect();
        t.dtype = tracegate_trace::DType::BF16;
    }
    let (_d, rp, cp) = pair(&r, &c);
    let (code, v) = json_run(&["--all", p(&rp), p(&cp)]);
    assert_eq!(
        (code, v["per_tensor"][0]["ulp_dtype"].as_str()),
        (1, Some("bf16"))
    );
    let (_, v) = json_run(&["--policy", p(&policy_path()), p(&rp), p(&cp)]);
    assert_eq!(v["first_bit_difference"]["candidate_dtype"], "bf16");
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
    assert!(
        out.stdout.contains("aaaaaaaaa") && out.stdout.contains("…"),
        "{}",
        out.stdout
    );
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
    assert!(
        out.stdout
            .starts_with("UNREADABLE — unreadable: candidate: "),
        "{}",
        out.stdout
    );
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
fn an_html_page_onto_an_input_trace_is_refused_and_the_trace_kept() {
    let m = model();
    let (_d, r, c) = pair(&m, &m);
    let before = std::fs::read(&c).unwrap();
    let out = run(&["--html", p(&c), p(&r), p(&c)]);
    assert_eq!(out.code, 2, "{}{}", out.stdout, out.stderr);
    assert!(
        out.stderr.contains("is the candidate trace") && out.stderr.contains("destroy"),
        "{}",
        out.stderr
    );
    assert_eq!(
        std::fs::read(&c).unwrap(),
        before,
        "the candidate trace was overwritten"
    );
}

#[test]
fn help_documents_exit_codes() {
    let out = run(&["--help"]);
    assert_eq!(out.code, 0);
    for line in [
        "0  identical",
        "1  different",
        "2  unreadable",
        "3  incomparable",
    ] {
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

// A NaN margin is below nothing: the minimum passed over it and --show said 0.5 (row 0).
#[test]
fn show_counts_nan_margins_aloud() {
    let mut m = model();
    let last = m.decisions.len() - 1;
    m.decisions[last].margins = Some(vec![f32::NAN, 2.0, f32::NAN, 0.75]);
    let dir = tempfile::tempdir().unwrap();
    let path = m.write(&dir.path().join("one.trace"));
    let out = run(&["--show", p(&path)]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let line = out
        .stdout
        .lines()
        .find(|l| l.contains("logits.argmax"))
        .unwrap();
    assert!(line.contains("0.75 (row 3); 2 NaN (first row 0)"), "{line}");
}

// --- hostile names, attributes and provenance on a terminal (issue 12, item 7) -------------

/// What must never reach a terminal raw: controls but the newline, and bidirectional overrides.
fn raw_control(s: &str) -> Option<char> {
    s.chars().find(|&c| {
        (c.is_control() && c != '\n')
            || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
    })
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
    let path = hostile_trace(dir.path(), "one.trace", |ix| {
        ix["tensors"][1]["name"] = json!(long)
    });
    let out = run(&["--no-verify", "--show", p(&path)]);
    // An older reader lists it; a reader that enforces the 4,096-byte limit refuses the file.
    assert!(
        out.code == 0 || (out.code == 2 && out.stdout.starts_with("UNREADABLE")),
        "exit {}: {}",
        out.code,
        out.stderr
    );
    if out.code == 0 {
        assert!(out.stdout.contains(&long));
    }
    let out = run(&["--all", "--no-verify", p(&path), p(&path)]);
    assert!(
        out.code == 0 || out.code == 2,
        "exit {}: {}",
        out.code,
        out.stderr
    );
    if out.code == 0 {
        assert!(
            out.stdout.starts_with("IDENTICAL") && out.stdout.contains(&long),
            "{}",
            &out.stdout[..200]
        );
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
    let named = hostile_trace(dir.path(), "ref.trace", |ix| {
        ix["tensors"][3]["name"] = json!("layer.00.\u{1b}[2Kattn_out")
    });
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
            assert_eq!(
                raw_control(text),
                None,
                "{args:?} printed a raw control character on {stream}:\n{text}"
            );
        }
        if args.contains(&p(&named)) {
            continue;
        }
        if args[0] == "--json" {
            let v: Value = serde_json::from_str(&out.stdout).unwrap();
            assert_eq!(
                v["candidate"]["producer"], "oracle\u{85}",
                "the JSON escapes, it does not alter"
            );
        } else if args.contains(&"--no-verify") {
            assert!(out.stdout.contains("\\u{1b}"), "{args:?}: {}", out.stdout);
        }
    }
}

#[test]
fn a_full_disk_leaves_no_page_and_no_temporary() {
    // RLIMIT_FSIZE stands in for a full disk: past 512 bytes every write fails (EFBIG, with
    // SIGXFSZ ignored), as ENOSPC does, without root or a filesystem of our own.
    let (r, c) = oracle_like_pair();
    let (dir, rp, cp) = pair(&r, &c);
    let out_dir = dir.path().join("out");
    std::fs::create_dir(&out_dir).unwrap();
    let page = out_dir.join("page.html");
    let o = std::process::Command::new("sh")
        .arg("-c")
        .arg(r#"trap '' XFSZ; ulimit -f 1; exec "$0" "$@""#)
        .arg(env!("CARGO_BIN_EXE_trace-diff"))
        .args([p(&rp), p(&cp), "--html", p(&page)])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("cannot write") && err.contains("page.html"),
        "{err}"
    );
    let left: Vec<_> = std::fs::read_dir(&out_dir).unwrap().collect();
    assert!(left.is_empty(), "{left:?}");
    // The control: no limit, the page is written.
    let ok = run(&[p(&rp), p(&cp), "--html", p(&page)]);
    assert!(page.is_file(), "{}", ok.stderr);
}

// The max-ULP chart's caption promised orange bars that a policy without a positive max_ulp
// never draws (the bundled f32 policy bounds ULPs only by 0, which a log scale cannot place).
#[test]
fn each_charts_caption_promises_only_the_bars_it_draws() {
    let (r, c) = oracle_like_pair();
    let (dir, rp, cp) = pair(&r, &c);
    let page = dir.path().join("page.html");
    let policy = policy_path();
    let out = run(&[p(&rp), p(&cp), "--policy", p(&policy), "--html", p(&page)]);
    assert!(page.is_file(), "{}{}", out.stdout, out.stderr);
    let html = std::fs::read_to_string(&page).unwrap();
    for chart in ["chart-rel-l2", "chart-max-ulp"] {
        let start = html.find(&format!("id=\"{chart}\"")).expect(chart);
        let end = html[start..]
            .find("</svg>")
            .map_or(html.len(), |e| start + e);
        let svg = &html[start..end];
        let bars = svg.matches("class=\"bound\"").count();
        let caption_at = html[end..].find("<div class=\"note\">").unwrap() + end;
        let caption = &html[caption_at..caption_at + html[caption_at..].find("</div>").unwrap()];
        assert_eq!(
            bars > 0,
            caption.contains("orange bars"),
            "{chart}: {bars} bars drawn, caption {caption:?}"
        );
        if bars == 0 {
            assert!(caption.contains("no bars"), "{chart}: {caption:?}");
        }
    }
}

// Issue 52: the line that says where the runs part comes first everywhere. On the page it sat
// under the sides and the policy; the text report's opening line now heads the page.
#[test]
fn the_page_opens_with_the_text_reports_first_line() {
    let (r, c) = oracle_like_pair();
    let (dir, rp, cp) = pair(&r, &c);
    let page = dir.path().join("page.html");
    let out = run(&[p(&rp), p(&cp), "--html", p(&page)]);
    let first = out.stdout.lines().next().unwrap_or_default();
    assert!(first.contains("first at "), "{}", out.stdout);
    let html = std::fs::read_to_string(&page).unwrap();
    let line = format!(
        "<p id=\"headline\">{}</p>",
        tracegate_diff::html::esc(first)
    );
    let at = html
        .find(&line)
        .unwrap_or_else(|| panic!("no {line} in {html}"));
    assert!(at < html.find("id=\"sides\"").unwrap(), "{html}");
    assert!(
        at < html.find("id=\"first-bit-difference\"").unwrap(),
        "{html}"
    );
}
