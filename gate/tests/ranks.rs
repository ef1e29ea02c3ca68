//! A sharded port (`gate init --ranks 2`, docs/producers.md "Sharded engines"): the example
//! producer split into two honest rank traces (tests/producers/sharded_port.py) passes against
//! the one-process golden traces, the merge described in the report. Negative controls, each a
//! FAIL naming the rank: a slice at the wrong offset, a replicated tensor that differs on one
//! rank, a rank's file missing, an extra rank file, a world size other than `--ranks`, a
//! perturbed shard of q (localised by `gate bisect --ranks 2` to layer 02, stage q, rank 1); a
//! defect of a layer in both verbs (isolated, its capsule written); an unsharded candidate given
//! `--ranks 2` is refused by init and FAILs a run.

use crate::common;
use crate::port::{gate, milestones, report, set_candidate};

use std::path::{Path, PathBuf};

use serde_json::Value;

use common::{check, repo};

fn example_producer() -> PathBuf {
    common::sibling("example-producer")
}

/// The example producer behind tests/producers/sharded_port.py with `plants`.
pub(crate) fn sharded(plants: &str) -> String {
    format!(
        "'{}' '{}' --exe '{}' {plants} {{verb}} {{args}}",
        common::python().display(),
        repo()
            .join("gate/tests/producers/sharded_port.py")
            .display(),
        example_producer().display()
    )
}

const PROMPTS: &str = r#"{"schema": 1, "about": "one short prompt", "prompts": [
  {"id": "short", "tokens": [12, 218, 345, 152, 81]}]}"#;

/// A project of tiny-qwen3 and one prompt, `gate init --candidate-cmd CMD --ranks 2 --capture
/// internals --generate 2`, and what init said.
fn init(cmd: &str) -> (tempfile::TempDir, crate::port::Out) {
    let dir = tempfile::tempdir().unwrap();
    common::copy_dir(
        &repo().join("fixtures/tiny-qwen3"),
        &dir.path().join("model"),
    );
    std::fs::write(dir.path().join("prompts.json"), PROMPTS).unwrap();
    let out = gate(
        dir.path(),
        &[
            "init",
            "--model",
            "model",
            "--candidate-cmd",
            cmd,
            "--prompts",
            "prompts.json",
            "--generate",
            "2",
            "--capture",
            "internals",
            "--ranks",
            "2",
        ],
        &[],
    );
    (dir, out)
}

/// `gate run port` with every report, which must exit `code`: stdout, the JSON report, JUnit
/// and HTML.
fn run(d: &Path, code: i32) -> (String, Value, String, String) {
    let (rp, junit, html) = (d.join("r.json"), d.join("r.xml"), d.join("r.html"));
    let out = gate(
        d,
        &[
            "run",
            "port",
            "--report",
            rp.to_str().unwrap(),
            "--junit",
            junit.to_str().unwrap(),
            "--html",
            html.to_str().unwrap(),
        ],
        &[],
    );
    assert_eq!(out.code, code, "{}\n{}", out.stdout, out.stderr);
    (
        out.stdout,
        report(&rp),
        std::fs::read_to_string(junit).unwrap(),
        std::fs::read_to_string(html).unwrap(),
    )
}

/// `agrees` FAILed with a `rank_traces` finding about `rank` whose detail says `said`.
fn assert_rank_refused(r: &Value, rank: &str, said: &str) {
    let agrees = check(r, "agrees");
    assert_eq!(agrees["status"], "FAIL", "{agrees}");
    let f = agrees["findings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["kind"] == "rank_traces")
        .unwrap_or_else(|| panic!("no rank_traces finding: {agrees}"));
    assert_eq!(f["name"], rank, "{f}");
    assert!(f["detail"].as_str().unwrap().contains(said), "{f}");
    assert!(
        r["prompts"][0]["sharded"]["candidate"]["refused"].is_object(),
        "{r}"
    );
}

#[test]
fn a_sharded_port_passes_merged_and_each_rank_defect_fails_naming_the_rank() {
    let (dir, out) = init(&sharded(""));
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    let d = dir.path();
    let m = milestones(d);
    assert_eq!(m["milestones"][0]["port"]["candidate"]["ranks"], 2);
    assert!(
        m["milestones"][0]["claim"]
            .as_str()
            .unwrap()
            .contains("sharded over 2 ranks"),
        "{m}"
    );

    // The honest sharded port: PASS, and every report says it was merged from 2 ranks, in which
    // order, with each rank's digest.
    let (text, r, junit, html) = run(d, 0);
    let s = &r["prompts"][0]["sharded"]["candidate"];
    assert_eq!(s["world"], 2, "{s}");
    let ranks = s["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 2);
    for (i, rk) in ranks.iter().enumerate() {
        let file = d.join(rk["file"].as_str().unwrap());
        let t = tracegate_trace::Trace::open(&file).unwrap();
        assert_eq!(t.digest().hex(), rk["digest"].as_str().unwrap());
        assert!(file.ends_with(format!("candidate.rank{i}.trace")), "{rk}");
    }
    let order = "partial sums in rank order, left to right: (rank 0 + rank 1)";
    assert_eq!(s["reduction"], order);
    assert!(s["counts"]["reduced"].as_u64().unwrap() > 0, "{s}");
    assert!(s["counts"]["concatenated"].as_u64().unwrap() > 0, "{s}");
    // The merged trace is the one judged: the candidate's digest in the report.
    assert_eq!(s["merged_digest"], r["prompts"][0]["digests"]["candidate"]);
    let short = &ranks[1]["digest"].as_str().unwrap()[..16];
    for (what, view) in [("text", &text), ("junit", &junit), ("html", &html)] {
        assert!(
            view.contains("merged from 2 rank traces")
                && view.contains(order)
                && view.contains(short),
            "{what}: {view}"
        );
    }
    assert!(
        r["prompts"][0]["checks"]
            .as_array()
            .unwrap()
            .iter()
            .all(|c| c["status"] == "PASS"),
        "{r}"
    );

    // A rank's shard of q at layer 2 perturbed: merged, it fails agrees, localised by `gate
    // bisect --ranks 2` to layer 02, stage q and rank 1, first in the text. The candidate's layer
    // verb (unsharded) computes layer 02 right, so the bisection blames no layer body: the defect
    // is the sharded run's alone (inconsistent_producer), and no capsule is written.
    set_candidate(d, &sharded("--perturb 1:layer.02.q"));
    let (text, r, junit, _) = run(d, 1);
    assert_eq!(check(&r, "agrees")["status"], "FAIL");
    let l = &r["prompts"][0]["localised"];
    assert_eq!(l["verdict"], "inconsistent_producer", "{l}");
    assert_eq!(l["sharded"]["rank"], 1, "{l}");
    let at = &l["sharded"]["at"];
    assert_eq!(
        (&at["layer"], &at["point"], &at["rank"]),
        (&2.into(), &"q".into(), &1.into()),
        "{l}"
    );
    assert!(
        l["sharded"]["layer_verb"]
            .as_str()
            .unwrap()
            .starts_with("unsharded"),
        "{l}"
    );
    let summary = l["summary"].as_str().unwrap();
    assert!(
        summary.contains("layer 02, stage q (layer.02.q), rank 1")
            && summary.contains("is in rank 1's shard"),
        "{summary}"
    );
    assert!(!summary.contains("NOT CHECKED"), "{summary}");
    assert_eq!(l["capsule"]["written"], false, "{l}");
    let bisect_report: Value = serde_json::from_str(
        &std::fs::read_to_string(d.join(l["report"].as_str().unwrap())).unwrap(),
    )
    .unwrap();
    common::assert_valid_bisect_report(&bisect_report);
    assert_eq!(
        bisect_report["sharded"]["run"]["world"], 2,
        "{bisect_report}"
    );
    let first = text.lines().nth(3).unwrap_or_default();
    assert!(
        first.contains("gate bisect --ranks 2") && first.contains("is in rank 1's shard"),
        "{text}"
    );
    assert!(junit.contains("is in rank 1&apos;s shard"), "{junit}");
    // Control of the attribution: the same perturbation on rank 0 names rank 0.
    set_candidate(d, &sharded("--perturb 0:layer.02.q"));
    let (_, r, _, _) = run(d, 1);
    let l = &r["prompts"][0]["localised"];
    assert_eq!(
        (&l["sharded"]["rank"], &l["sharded"]["at"]["rank"]),
        (&0.into(), &0.into()),
        "{r}"
    );

    // A perturbed summand of a partial sum: no one rank holds the merged element, so neither the
    // bisection nor the gate names a rank; the summary ends with the gate's words for it.
    set_candidate(d, &sharded("--perturb 1:layer.02.attn_out"));
    let (_, r, _, _) = run(d, 1);
    let l = &r["prompts"][0]["localised"];
    assert!(l["sharded"]["rank"].is_null(), "{l}");
    assert!(l["sharded"]["at"]["rank"].is_null(), "{l}");
    let summary = l["summary"].as_str().unwrap();
    assert!(
        summary.contains("by the 2 rank traces the gate merged: layer 02, stage attn_out")
            && summary.contains("a partial sum: the sum of ranks 0, 1 differs"),
        "{summary}"
    );

    // A defect of the layer itself (the base producer's planted k_norm of layer 01, in both its
    // verbs), sharded: the bisection isolates the wrong layer, names its stage and rank, and
    // writes its capsule, as for an unsharded port.
    set_candidate(d, &format!("{} --plant k-norm:1", sharded("")));
    let (text, r, _, html) = run(d, 1);
    let l = &r["prompts"][0]["localised"];
    assert_eq!(l["first_wrong_layer"], 1, "{l}");
    assert!(
        l["stage"]["tensor"]
            .as_str()
            .unwrap()
            .starts_with("layer.01."),
        "{l}"
    );
    assert_eq!(l["capsule"]["written"], true, "{l}");
    assert!(
        d.join(l["capsule"]["path"].as_str().unwrap()).is_dir(),
        "{l}"
    );
    assert_eq!(l["sharded"]["at"]["layer"], 1, "{l}");
    assert!(
        l["sharded"]["at"]["rank"].is_u64(),
        "a sliced point names its rank: {l}"
    );
    let summary = l["summary"].as_str().unwrap();
    assert!(
        summary.contains("sharded over 2 ranks (merged): first divergence at layer 01"),
        "{summary}"
    );
    assert!(text.contains("capsule target/gate/port"), "{text}");
    assert!(html.contains("gate bisect --ranks 2"), "{html}");

    // Refusals of the rank traces, each naming the rank.
    for (plants, rank, said) in [
        ("--wrong-offset 1", "rank 1", "overlapping"),
        (
            "--perturb 1:layer.01.hidden_out",
            "rank 1",
            "is replicated but rank 1",
        ),
        ("--skip 1", "rank 1", "rank 1 of --ranks 2 wrote no trace"),
        ("--world 3", "rank 2", "an extra rank trace"),
        (
            "--say-world 3",
            "rank 0",
            "world size 3, but the milestone shards over --ranks 2",
        ),
    ] {
        set_candidate(d, &sharded(plants));
        let (text, r, _, _) = run(d, 1);
        assert_rank_refused(&r, rank, said);
        assert!(text.contains("rank_traces"), "{plants}: {text}");
    }

    // An unsharded candidate given the sharded milestone: its one trace at the literal path.
    set_candidate(
        d,
        &format!("'{}' {{verb}} {{args}}", example_producer().display()),
    );
    let (_, r, _, _) = run(d, 1);
    assert_rank_refused(&r, "rank traces", "instead of one per rank");
}

#[test]
fn init_refuses_an_unsharded_candidate_given_ranks() {
    // Tried once before the reference runs: refused in the seconds its own run takes.
    let (dir, out) = init(&format!(
        "'{}' {{verb}} {{args}}",
        example_producer().display()
    ));
    assert_eq!(out.code, 2, "{}\n{}", out.stdout, out.stderr);
    assert!(
        out.stderr.contains("instead of one per rank") && out.stderr.contains("{rank}"),
        "{}",
        out.stderr
    );
    assert!(!dir.path().join("milestones.json").exists());
    // A rank count of 0 is refused in one line.
    let z = gate(
        dir.path(),
        &[
            "init",
            "--model",
            "model",
            "--candidate-cmd",
            "x {verb}",
            "--ranks",
            "0",
        ],
        &[],
    );
    assert_eq!(z.code, 2, "{}", z.stderr);
}
