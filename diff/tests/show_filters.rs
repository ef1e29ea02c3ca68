//! `--only` / `--skip` filters (library and CLI) and `--show` statistics, human and JSON.
//! Expected counts and statistics are worked out by hand from the model in `common` (13
//! tensors: embed.out, layer.0{0,1}.{hidden_in, attn_out, router.logits, mlp_out, hidden_out},
//! final_norm.out, logits; 3 decisions: layer.0{0,1}.router.topk, logits.argmax).

use crate::common;

use std::path::Path;

use common::*;
use serde_json::{json, Value};
use tracegate_diff::{Filter, Options, Verdict};
use tracegate_trace::DType;

fn filter(only: &[&str], skip: &[&str]) -> Options {
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect();
    Options {
        filter: Filter {
            only: s(only),
            skip: s(skip),
        },
        ..Options::default()
    }
}

/// (tensors left out, decisions left out).
fn left_out(rep: &tracegate_diff::Report) -> (usize, usize) {
    let f = rep.filter.as_ref().expect("a filter was given");
    (f.tensors_left_out, f.decisions_left_out)
}

fn differs_in(name: &str) -> (Spec, Spec) {
    let mut c = model();
    c.poke_f32_bits(name, 5, |b| b + 3);
    (model(), c)
}

#[test]
fn only_compares_the_selection() {
    let (r, c) = differs_in("layer.01.mlp_out");
    // Negative control: unfiltered, the change is found.
    assert_eq!(
        diff_with(&r, &c, &Options::default()).verdict,
        Verdict::Different
    );

    // Outside the selection: not compared, not a finding, not counted. The whole-trace digests
    // differ, yet IDENTICAL holds: it covers what was compared.
    let rep = diff_with(&r, &c, &filter(&["layer.00.**"], &[]));
    assert_eq!(rep.verdict, Verdict::Identical, "{:?}", rep.findings);
    assert!(rep.findings.is_empty(), "{:?}", rep.findings);
    // layer.00.* is 5 tensors and 1 decision: 8 tensors and 2 decisions left out.
    assert_eq!(left_out(&rep), (8, 2));
    assert_eq!(
        (
            rep.tensors.reference_count,
            rep.tensors.candidate_count,
            rep.per_tensor.len()
        ),
        (5, 5, 5)
    );
    assert_eq!(
        (rep.decisions.reference_count, rep.decisions.compared),
        (1, 1)
    );
    assert!(rep
        .per_tensor
        .iter()
        .all(|t| t.tensor.starts_with("layer.00.")));

    // Inside it: found, and named.
    let rep = diff_with(&r, &c, &filter(&["layer.01.**"], &[]));
    assert_eq!(rep.verdict, Verdict::Different);
    assert_eq!(
        rep.first_divergence.as_ref().unwrap().tensor,
        "layer.01.mlp_out"
    );
    assert_eq!(left_out(&rep), (8, 2));
}

#[test]
fn a_single_star_stops_at_a_dot() {
    let (r, c) = differs_in("layer.01.attn_out");
    // `layer.*` matches no dotted name below a layer: nothing is selected.
    let rep = diff_with(&r, &c, &filter(&["layer.*"], &[]));
    assert_eq!(rep.verdict, Verdict::Unreadable);
    assert_eq!(
        rep.findings
            .iter()
            .map(|f| f.kind.as_str())
            .collect::<Vec<_>>(),
        vec!["nothing_selected"]
    );
    // `layer.*.attn_out`: two tensors, no decision.
    let rep = diff_with(&r, &c, &filter(&["layer.*.attn_out"], &[]));
    assert_eq!(rep.verdict, Verdict::Different);
    assert_eq!(left_out(&rep), (11, 3));
    assert_eq!(
        rep.per_tensor
            .iter()
            .map(|t| t.tensor.as_str())
            .collect::<Vec<_>>(),
        vec!["layer.00.attn_out", "layer.01.attn_out"]
    );
}

#[test]
fn skip_leaves_out_what_it_matches() {
    let (r, c) = differs_in("layer.01.mlp_out");
    let rep = diff_with(&r, &c, &filter(&[], &["layer.01.mlp_out"]));
    assert_eq!(rep.verdict, Verdict::Identical, "{:?}", rep.findings);
    assert_eq!(left_out(&rep), (1, 0));
    assert_eq!(rep.per_tensor.len(), 12);
    // Negative control: skipping another tensor leaves the difference in.
    let rep = diff_with(&r, &c, &filter(&[], &["layer.00.mlp_out"]));
    assert_eq!(rep.verdict, Verdict::Different);
    assert_eq!(
        rep.first_divergence.as_ref().unwrap().tensor,
        "layer.01.mlp_out"
    );
}

#[test]
fn only_and_skip_together() {
    // layer.** minus *.*.mlp_out: 10 - 2 = 8 tensors and both router decisions are compared;
    // embed.out, both mlp_out, final_norm.out, logits and logits.argmax are left out.
    let opts = filter(&["layer.**"], &["*.*.mlp_out"]);
    let (r, c) = differs_in("layer.01.mlp_out");
    let rep = diff_with(&r, &c, &opts);
    assert_eq!(rep.verdict, Verdict::Identical, "{:?}", rep.findings);
    assert_eq!(left_out(&rep), (5, 1));
    assert_eq!((rep.per_tensor.len(), rep.decisions.compared), (8, 2));
    let (r, c) = differs_in("layer.01.attn_out");
    let rep = diff_with(&r, &c, &opts);
    assert_eq!(rep.verdict, Verdict::Different);
    assert_eq!(
        rep.first_divergence.as_ref().unwrap().tensor,
        "layer.01.attn_out"
    );
}

#[test]
fn repeated_only_flags_add_up_and_apply_to_decisions() {
    let r = model();
    let mut c = model();
    c.decision_mut("logits.argmax").values[1] = 3;
    c.decision_mut("layer.01.router.topk").values[0] = 2;
    // embed.out, logits and logits.argmax (`**` crosses the dot): 11 tensors, 2 decisions out.
    let rep = diff_with(&r, &c, &filter(&["embed.out", "logits**"], &[]));
    assert_eq!(left_out(&rep), (11, 2));
    assert_eq!(rep.verdict, Verdict::Different);
    assert_eq!(
        rep.decisions
            .results
            .iter()
            .map(|d| d.name.as_str())
            .collect::<Vec<_>>(),
        vec!["logits.argmax"]
    );
    assert_eq!(
        rep.first_decision_divergence.as_ref().unwrap().name,
        "logits.argmax"
    );
    // Skipping that decision too leaves no difference: the layer.01 flip is outside.
    let rep = diff_with(&r, &c, &filter(&["embed.out", "logits**"], &["*.argmax"]));
    assert_eq!(rep.verdict, Verdict::Identical, "{:?}", rep.findings);
    assert_eq!(left_out(&rep), (11, 3));
}

#[test]
fn left_out_names_are_not_missing_extra_or_out_of_order() {
    let r = model();
    let mut c = model();
    c.tensors.retain(|t| t.name != "layer.01.mlp_out");
    c.tensors.push(t_f32("debug.probe", &[2], &[1.0, 2.0]));
    c.decisions.retain(|d| d.name != "layer.01.router.topk");
    let (a, b) = (
        c.tensors
            .iter()
            .position(|t| t.name == "embed.out")
            .unwrap(),
        c.tensors.iter().position(|t| t.name == "logits").unwrap(),
    );
    c.tensors.swap(a, b);
    // Negative control: every one of them is a finding unfiltered.
    let kinds: Vec<_> = diff_with(&r, &c, &Options::default())
        .findings
        .iter()
        .map(|f| f.kind.as_str())
        .collect();
    for k in [
        "missing_tensor",
        "extra_tensor",
        "missing_decision",
        "order_mismatch",
    ] {
        assert!(kinds.contains(&k), "{k} not in {kinds:?}");
    }
    let rep = diff_with(
        &r,
        &c,
        &filter(&[], &["layer.01.**", "debug.**", "embed.out", "logits"]),
    );
    assert_eq!(rep.verdict, Verdict::Identical, "{:?}", rep.findings);
    // Distinct names over both traces: layer.01.* (5, one only in the reference), debug.probe
    // (candidate only), embed.out, logits; decisions: layer.01.router.topk.
    assert_eq!(left_out(&rep), (8, 1));
    assert_eq!(
        (rep.tensors.reference_count, rep.tensors.candidate_count),
        (6, 6)
    );
}

#[test]
fn the_json_report_carries_the_filter() {
    let (r, c) = differs_in("layer.01.mlp_out");
    let (_dir, rp, cp) = pair(&r, &c);
    let out = run(&[
        "--json",
        "--only",
        "layer.00.**",
        "--skip",
        "no.such.*",
        p(&rp),
        p(&cp),
    ]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let v: Value = serde_json::from_str(&out.stdout).unwrap();
    if v.get("verdict").is_some() {
        assert_valid_report(&v); // a compare report (not --show's description)
    }
    assert_eq!(
        v["filter"],
        json!({"only": ["layer.00.**"], "skip": ["no.such.*"], "tensors_left_out": 8, "decisions_left_out": 2, "unmatched": ["no.such.*"]})
    );
    assert_eq!(
        (
            v["tensors"]["reference_count"].clone(),
            v["decisions"]["reference_count"].clone()
        ),
        (json!(5), json!(1))
    );
    assert!(
        out.stderr
            .contains("warning: --skip 'no.such.*' matches no tensor or decision name"),
        "{}",
        out.stderr
    );
    // Without a filter: null, and no warning.
    let out = run(&["--json", p(&rp), p(&cp)]);
    assert_eq!(out.code, 1);
    let v: Value = serde_json::from_str(&out.stdout).unwrap();
    if v.get("verdict").is_some() {
        assert_valid_report(&v); // a compare report (not --show's description)
    }
    assert_eq!(v["filter"], Value::Null);
    assert_eq!(out.stderr, "");
}

#[test]
fn the_human_report_says_what_was_left_out() {
    let (r, c) = differs_in("layer.01.mlp_out");
    let (_dir, rp, cp) = pair(&r, &c);
    let out = run(&["--only", "layer.00.**", p(&rp), p(&cp)]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(out.stdout.starts_with("IDENTICAL"), "{}", out.stdout);
    assert!(
        out.stdout.contains("filter     --only 'layer.00.**' left out 8 tensors and 2 decisions (not compared, not counted); the verdict covers only what was compared"),
        "{}",
        out.stdout
    );
    let out = run(&[p(&rp), p(&cp)]);
    assert_eq!(out.code, 1);
    assert!(!out.stdout.contains("filter"), "{}", out.stdout);
}

#[test]
fn a_filter_that_selects_nothing_is_an_error() {
    let m = model();
    let (_dir, rp, cp) = pair(&m, &m);
    for args in [
        vec!["--only", "nothing.here"],
        vec!["--skip", "**"],
        vec!["--only", "layer.**", "--skip", "layer.**"],
        vec!["--json", "--only", "x"],
    ] {
        let mut all = args.clone();
        all.extend([p(&rp), p(&cp)]);
        let out = run(&all);
        assert_eq!(out.code, 2, "{all:?}: {}", out.stdout);
        assert_eq!(out.stdout, "", "{all:?}");
        assert!(
            out.stderr
                .contains("selects no tensor or decision name: nothing to compare"),
            "{all:?}: {}",
            out.stderr
        );
        let mut show = args.clone();
        show.extend(["--show", p(&rp)]);
        let out = run(&show);
        assert_eq!((out.code, out.stdout.as_str()), (2, ""), "{show:?}");
    }
    // Negative control: a filter that selects something passes.
    assert_eq!(run(&["--only", "logits", p(&rp), p(&cp)]).code, 0);
}

/// One trace of hand-chosen values for the statistics.
fn stats_trace(dir: &Path) -> std::path::PathBuf {
    let f32s = |v: &[f32]| f32_bytes(v);
    let bf16s = |v: &[f32]| {
        v.iter()
            .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
            .collect::<Vec<u8>>()
    };
    let i64s = |v: &[i64]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let i32s = |v: &[i32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let spec = Spec {
        provenance: engine_provenance(),
        tensors: vec![
            t_raw(
                "mixed",
                DType::F32,
                &[5],
                f32s(&[1.0, -2.0, f32::NAN, f32::INFINITY, 3.0]),
            ),
            t_raw("plain", DType::F32, &[3], f32s(&[1.0, -2.0, 3.0])),
            t_raw("all_nan", DType::F32, &[2], f32s(&[f32::NAN, f32::NAN])),
            t_raw(
                "both_inf",
                DType::F32,
                &[3],
                f32s(&[f32::NEG_INFINITY, f32::INFINITY, 1.0]),
            ),
            t_raw("half", DType::BF16, &[2], bf16s(&[0.5, -1.5])),
            t_raw("ids", DType::I32, &[4], i32s(&[5, -3, 7, 0])),
            t_raw("extremes", DType::I64, &[2], i64s(&[i64::MIN, i64::MAX])),
            t_raw("empty", DType::F32, &[0], vec![]),
        ],
        decisions: vec![D {
            name: "pick".into(),
            shape: vec![2],
            values: vec![1, 0],
            margins: Some(vec![0.5, 0.25]),
        }],
    };
    spec.write(&dir.join("one.trace"))
}

#[test]
fn show_gives_statistics_per_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let path = stats_trace(dir.path());
    let out = run(&["--show", p(&path)]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let row = |name: &str| -> Vec<String> {
        let line = out
            .stdout
            .lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .unwrap_or_else(|| panic!("no row {name}:\n{}", out.stdout));
        // name dtype shape min max mean max|x| NaN Inf (then digest, attributes).
        line.split_whitespace()
            .skip(3)
            .take(6)
            .map(str::to_string)
            .collect()
    };
    // [1, -2, NaN, inf, 3]: NaN left out and counted; inf is the max; the mean is over the
    // finite elements, (1 - 2 + 3) / 3 = 0.666667.
    assert_eq!(row("mixed"), ["-2", "inf", "0.666667", "inf", "1", "1"]);
    // Negative control: the same finite values without NaN or inf.
    assert_eq!(row("plain"), ["-2", "3", "0.666667", "3", "0", "0"]);
    assert_eq!(row("all_nan"), ["-", "-", "-", "-", "2", "0"]);
    assert_eq!(row("both_inf"), ["-inf", "inf", "1", "inf", "0", "2"]);
    assert_eq!(row("half"), ["-1.5", "0.5", "-0.5", "1.5", "0", "0"]);
    // Integers: exact min and max, (5 - 3 + 7 + 0) / 4 = 2.25, no max |x|.
    assert_eq!(row("ids"), ["-3", "7", "2.25", "-", "0", "0"]);
    assert_eq!(
        row("extremes")[..2],
        ["-9223372036854775808", "9223372036854775807"]
    );
    assert_eq!(row("empty"), ["-", "-", "-", "-", "0", "0"]);
    assert!(out.stdout.contains("tensors (8)"));
}

#[test]
fn show_json_describes_the_trace() {
    let dir = tempfile::tempdir().unwrap();
    let path = stats_trace(dir.path());
    let out = run(&["--show", p(&path), "--json"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let v: Value = serde_json::from_str(&out.stdout).unwrap();
    if v.get("verdict").is_some() {
        assert_valid_report(&v); // a compare report (not --show's description)
    }
    assert_eq!(
        (
            v["verified"].clone(),
            v["verify_error"].clone(),
            v["filter"].clone()
        ),
        (json!(true), Value::Null, Value::Null)
    );
    assert_eq!(v["digest"].as_str().unwrap().len(), 64);
    assert_eq!(v["provenance"]["producer"], "engine");
    let tensors = v["tensors"].as_array().unwrap();
    assert_eq!(tensors.len(), 8);
    let t = |name: &str| tensors.iter().find(|t| t["name"] == name).unwrap().clone();
    let mixed = t("mixed");
    assert_eq!(
        (mixed["dtype"].clone(), mixed["shape"].clone()),
        (json!("f32"), json!([5]))
    );
    assert_eq!(
        mixed["attributes"],
        json!({"path": "prefill", "mask": "causal", "positions": [0, 1, 2, 3, 4]})
    );
    assert_eq!(mixed["digest"].as_str().unwrap().len(), 32);
    assert_eq!(
        mixed["statistics"],
        json!({"min": -2.0, "max": "inf", "mean": 2.0 / 3.0, "max_abs": "inf", "nan": 1, "inf": 1})
    );
    assert_eq!(
        t("plain")["statistics"],
        json!({"min": -2.0, "max": 3.0, "mean": 2.0 / 3.0, "max_abs": 3.0, "nan": 0, "inf": 0})
    );
    assert_eq!(
        t("all_nan")["statistics"],
        json!({"min": null, "max": null, "mean": null, "max_abs": null, "nan": 2, "inf": 0})
    );
    assert_eq!(
        t("both_inf")["statistics"],
        json!({"min": "-inf", "max": "inf", "mean": 1.0, "max_abs": "inf", "nan": 0, "inf": 2})
    );
    assert_eq!(
        t("ids")["statistics"],
        json!({"min": -3, "max": 7, "mean": 2.25, "max_abs": null, "nan": 0, "inf": 0})
    );
    // Exact as integers: an f64 would round both to ±2^63.
    assert_eq!(t("extremes")["statistics"]["min"], json!(i64::MIN));
    assert_eq!(t("extremes")["statistics"]["max"], json!(i64::MAX));
    assert_eq!(t("extremes")["statistics"]["mean"], json!(-0.5));
    assert_eq!(
        v["decisions"],
        json!([{"name": "pick", "shape": [2], "has_margins": true}])
    );

    // --no-verify: verified is null (not checked), not false.
    let v: Value =
        serde_json::from_str(&run(&["--show", p(&path), "--json", "--no-verify"]).stdout).unwrap();
    if v.get("verdict").is_some() {
        assert_valid_report(&v); // a compare report (not --show's description)
    }
    assert_eq!(v["verified"], Value::Null);
}

#[test]
fn show_json_on_a_bad_file_is_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let path = model().write(&dir.path().join("one.trace"));
    // A recorded digest that no longer matches its bytes: described, with the reason.
    rewrite_index(&path, |ix| ix["tensors"][1]["xxh3"] = json!("0".repeat(32)));
    let out = run(&["--show", p(&path), "--json"]);
    assert_eq!(out.code, 2);
    let v: Value = serde_json::from_str(&out.stdout).unwrap();
    if v.get("verdict").is_some() {
        assert_valid_report(&v); // a compare report (not --show's description)
    }
    assert_eq!(v["verified"], json!(false));
    assert!(
        v["verify_error"]
            .as_str()
            .unwrap()
            .contains("layer.00.hidden_in"),
        "{}",
        v["verify_error"]
    );
    // Not a trace at all: nothing on stdout, the reason on stderr.
    let junk = dir.path().join("junk.trace");
    std::fs::write(&junk, b"not a trace").unwrap();
    let out = run(&["--show", p(&junk), "--json"]);
    assert_eq!((out.code, out.stdout.as_str()), (2, ""));
    assert!(out.stderr.contains("UNREADABLE"), "{}", out.stderr);
}

#[test]
fn show_lists_only_the_selection() {
    let dir = tempfile::tempdir().unwrap();
    let path = model().write(&dir.path().join("one.trace"));
    let out = run(&[
        "--show",
        p(&path),
        "--json",
        "--only",
        "layer.01.**",
        "--skip",
        "*.*.router.*",
    ]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let v: Value = serde_json::from_str(&out.stdout).unwrap();
    if v.get("verdict").is_some() {
        assert_valid_report(&v); // a compare report (not --show's description)
    }
    let names: Vec<&str> = v["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "layer.01.hidden_in",
            "layer.01.attn_out",
            "layer.01.mlp_out",
            "layer.01.hidden_out"
        ]
    );
    assert_eq!(v["decisions"], json!([]));
    assert_eq!(
        (
            v["filter"]["tensors_left_out"].clone(),
            v["filter"]["decisions_left_out"].clone()
        ),
        (json!(9), json!(3))
    );
    let out = run(&[
        "--show",
        p(&path),
        "--only",
        "layer.01.**",
        "--skip",
        "*.*.router.*",
    ]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(out.stdout.contains("  filter   --only 'layer.01.**' --skip '*.*.router.*' left out 9 tensors and 3 decisions\n"), "{}", out.stdout);
    assert!(
        out.stdout.contains("tensors (4)\n") && out.stdout.contains("decisions (0)\n"),
        "{}",
        out.stdout
    );
    assert!(!out.stdout.contains("embed.out"));
}

#[test]
fn show_json_escapes_control_characters() {
    let dir = tempfile::tempdir().unwrap();
    let path = model().write(&dir.path().join("one.trace"));
    rewrite_index(&path, |ix| {
        ix["provenance"]["note"] = json!("\u{1b}]0;pwned\u{7}\u{202e}txt");
        ix["tensors"][2]["attributes"]["note"] = json!("\u{9b}2Jred");
    });
    let out = run(&["--show", p(&path), "--json", "--no-verify"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(
        !out.stdout
            .chars()
            .any(|c| (c.is_control() && c != '\n') || c == '\u{202e}'),
        "{}",
        out.stdout
    );
    let v: Value = serde_json::from_str(&out.stdout).unwrap();
    if v.get("verdict").is_some() {
        assert_valid_report(&v); // a compare report (not --show's description)
    }
    assert_eq!(
        v["provenance"]["note"], "\u{1b}]0;pwned\u{7}\u{202e}txt",
        "escaped, not altered"
    );
    assert_eq!(v["tensors"][2]["attributes"]["note"], "\u{9b}2Jred");
}

// `--only 'layer.0*'` for "layers 00-09" matches only the name `layer.00`, never a tensor: the
// refusal says why and what would select them.
#[test]
fn a_single_star_glob_that_selects_nothing_says_star_stops_at_a_dot() {
    let m = model();
    let (_d, rp, cp) = pair(&m, &m);
    let out = run(&["--only", "layer.0*", p(&rp), p(&cp)]);
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(
        out.stderr
            .contains("(`*` stops at `.`, `**` crosses it: did you mean 'layer.0*.**'?)"),
        "{}",
        out.stderr
    );
    // The suggestion selects what was meant.
    let out = run(&["--only", "layer.0*.**", p(&rp), p(&cp)]);
    assert_eq!(out.code, 0, "{}", out.stderr);
}
