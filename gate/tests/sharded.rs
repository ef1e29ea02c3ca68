//! `gate m2` (docs/gate.md, "m2"): sharded runs merged and judged. One fixture (tiny-qwen3,
//! tp=2) and one prompt (`short`) per run, to keep the oracle's torchrun to one launch: the
//! milestone passes with the real producers, and fails for a contract whose rank 1 skips the
//! carry in decode (merged_contract) and for one that computes everything on every rank and
//! writes it whole, which merges to the right digest (rank_shards). Its HTML (tiny-qwen3-moe's two
//! splits, no oracle): one page per split, the split on every row.

use std::path::Path;

use serde_json::Value;

use crate::common::{self, check, python, repo};

/// `gate m2 --model fixtures/tiny-qwen3 --only short`, with `extra` arguments: (exit code, the
/// one report, stderr).
fn m2(extra: &[&str]) -> (i32, Value, String) {
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("r.json");
    let root = repo().canonicalize().unwrap();
    let out = common::gate()
        .current_dir(&root)
        .args(["m2", "--model", "fixtures/tiny-qwen3", "--only", "short"])
        .arg("--work")
        .arg(dir.path().join("work"))
        .arg("--report")
        .arg(&report)
        .args(extra)
        .env("TRACEGATE_PYTHON", python())
        .output()
        .unwrap();
    let reports: Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    for r in reports.as_array().unwrap() {
        common::validator("gate-report.schema.json").assert_valid(r);
    }
    let [one] = reports.as_array().unwrap().as_slice() else {
        panic!("one report (tiny-qwen3 tp=2) expected: {reports}");
    };
    (
        out.status.code().unwrap_or(-1),
        one.clone(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

fn plant(defect: &str) -> String {
    format!(
        "'{}' '{}' --defect {defect} {{verb}} {{args}}",
        python().display(),
        Path::new(&repo())
            .join("gate/tests/producers/sharded_plants.py")
            .display()
    )
}

/// An oracle that cannot run: the negative controls judge the engine and the contract only.
const NO_ORACLE: &str = "false {verb} {args}";

#[test]
fn m2_passes_with_the_real_producers_and_says_what_it_merged() {
    let (code, r, stderr) = m2(&[]);
    assert_eq!(code, 0, "{stderr}\n{r:#}");
    assert_eq!(r["shards"], "tp=2");
    for c in [
        "stable",
        "merged_engine",
        "merged_contract",
        "merged_oracle",
        "rank_shards",
    ] {
        assert_eq!(check(&r, c)["status"], "PASS", "{c}: {:#}", check(&r, c));
    }
    let p = &r["prompts"][0];
    // (a) and (b): one digest, the recorded one.
    let recorded = p["digests"]["engine"].as_str().unwrap();
    assert_eq!(p["digests"]["engine_sharded_merged"], recorded);
    assert_eq!(p["digests"]["contract_sharded_merged"], recorded);
    assert_eq!(p["counts"]["ranks_merged"], 2);
    // The merges, as the report states them: two ranks, the reduction order, rank digests.
    for role in ["engine_sharded", "contract_sharded", "oracle_sharded"] {
        let s = &p["sharded"][role];
        assert_eq!(s["ranks"].as_array().unwrap().len(), 2, "{role}: {s}");
        let producer = role.trim_end_matches("_sharded");
        assert!(
            s["pattern"]
                .as_str()
                .unwrap()
                .ends_with(&format!("/tp2/{producer}.rank{{rank}}.trace")),
            "{s}"
        );
        assert!(
            s["reduction"]
                .as_str()
                .unwrap()
                .contains("(rank 0 + rank 1)"),
            "{s}"
        );
    }
    // (d) says what it checked, per producer.
    let d = check(&r, "rank_shards")["detail"].as_str().unwrap();
    for who in ["engine: 2 ranks", "contract: 2 ranks", "oracle: 2 ranks"] {
        assert!(d.contains(who), "{d}");
    }
    assert!(d.contains("head-sliced tensors"), "{d}");
}

#[test]
fn a_contract_rank_skipping_the_carry_in_decode_fails_merged_contract() {
    let cmd = plant("skip-carry-decode");
    let (code, r, stderr) = m2(&["--contract-cmd", &cmd, "--oracle-cmd", NO_ORACLE]);
    assert_eq!(code, 1, "{stderr}");
    assert_eq!(check(&r, "merged_engine")["status"], "PASS");
    let c = check(&r, "merged_contract");
    assert_eq!(c["status"], "FAIL", "{c:#}");
    // The prefill is right: the first tensor that differs is a decode step's.
    let first = c["findings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["kind"] == "tensor_differs")
        .unwrap_or_else(|| panic!("no tensor_differs: {c:#}"));
    assert!(
        first["name"].as_str().unwrap().starts_with("decode."),
        "{first}"
    );
    // Its rank traces hold the right parts: only the arithmetic is wrong.
    assert!(check(&r, "rank_shards")["detail"]
        .as_str()
        .unwrap()
        .contains("contract: 2 ranks"));
}

#[test]
fn all_replicated_rank_traces_merge_to_the_digest_and_fail_rank_shards() {
    let cmd = plant("replicated");
    let (code, r, stderr) = m2(&["--contract-cmd", &cmd, "--oracle-cmd", NO_ORACLE]);
    assert_eq!(code, 1, "{stderr}");
    // The adversary: merged, its trace is the one-process trace bit for bit.
    assert_eq!(check(&r, "merged_contract")["status"], "PASS");
    let c = check(&r, "rank_shards");
    assert_eq!(c["status"], "FAIL", "{c:#}");
    let findings = c["findings"].as_array().unwrap();
    assert!(
        findings.iter().any(|f| f["kind"] == "shard_layout"
            && f["name"] == "layer.00.q"
            && f["detail"]
                .as_str()
                .unwrap()
                .contains("contract: rank 0 holds Replicated")),
        "{c:#}"
    );
    // The engine's own ranks are not blamed (the oracle, which cannot run here, is).
    assert!(
        findings.iter().all(
            |f| f["name"] != "engine" && !f["detail"].as_str().unwrap().starts_with("engine: ")
        ),
        "{c:#}"
    );
}

#[test]
fn a_producer_without_a_sharded_mode_is_not_checked_never_passed() {
    // The contract as it was before `--shards`: argparse refuses the flag as unknown.
    let cmd = format!(
        "'{}' -c 'import sys; sys.stderr.write(\"error: unrecognized arguments: --shards tp=2\\n\"); sys.exit(2)' {{verb}} {{args}}",
        python().display()
    );
    let (code, r, stderr) = m2(&["--contract-cmd", &cmd, "--oracle-cmd", NO_ORACLE]);
    assert_eq!(code, 1, "the oracle fails: {stderr}");
    let c = check(&r, "merged_contract");
    assert_eq!(c["status"], "NOT CHECKED", "{c:#}");
    assert!(
        c["detail"]
            .as_str()
            .unwrap()
            .contains("has no sharded mode"),
        "{c:#}"
    );
    // rank_shards says the contract's part was not checked (it fails on the oracle's failure).
    let d = check(&r, "rank_shards")["detail"].as_str().unwrap();
    assert!(d.contains("contract: NOT CHECKED"), "{d}");
}

#[test]
fn each_split_of_a_model_has_its_own_html_page_showing_the_split_on_every_row() {
    // tiny-qwen3-moe runs under two splits (tp=2, ep=2): two reports of one model. The oracle
    // cannot run (its checks fail, exit 1); the pages are written all the same.
    let dir = tempfile::tempdir().unwrap();
    let root = repo().canonicalize().unwrap();
    let html = dir.path().join("r.html");
    let out = common::gate()
        .current_dir(&root)
        .args([
            "m2",
            "--model",
            "fixtures/tiny-qwen3-moe",
            "--only",
            "short",
        ])
        .args(["--oracle-cmd", NO_ORACLE])
        .arg("--work")
        .arg(dir.path().join("work"))
        .arg("--html")
        .arg(&html)
        .env("TRACEGATE_PYTHON", python())
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{said}");
    // One page per split: neither replaces the other.
    assert!(!dir.path().join("r.tiny-qwen3-moe.html").exists());
    let shown = |split: &str| {
        format!("<code class=\"text\" data-json=\"/shards\" data-v=\"&quot;{split}&quot;\">{split}</code>")
    };
    for (split, other) in [("tp=2", "ep=2"), ("ep=2", "tp=2")] {
        let file = dir
            .path()
            .join(format!("r.tiny-qwen3-moe.{}.html", split.replace('=', "")));
        let page = std::fs::read_to_string(&file)
            .unwrap_or_else(|e| panic!("{}: {e}\n{said}", file.display()));
        assert!(
            page.contains(&format!(
                "sharded <span id=\"split\">{}</span>",
                shown(split)
            )),
            "{split}: {page}"
        );
        let row = page
            .split("<tr data-prompt=\"short\">")
            .nth(1)
            .and_then(|r| r.split("</tr>").next())
            .unwrap_or_else(|| panic!("{split}: no row for short: {page}"));
        assert!(
            row.contains(&format!("<td class=\"split\">{}</td>", shown(split))),
            "{split}: {row}"
        );
        // Control: the other split's page is not this one.
        assert!(!page.contains(&shown(other)), "{split}: {page}");
    }
}
