//! `gate bisect --ranks 2` (docs/bisect.md, "Sharded candidates"): the example producer split into
//! two rank traces by tests/producers/sharded_port.py, bisected against the engine. Planted
//! sharding defects, each named at its rank, layer and tensor by the bisection and by
//! `trace-diff` of the `{rank}` side: (a) a rank that skips the carry in cached decode only, (b)
//! a slice at the wrong offset, a perturbed shard of q (merged; attributed to the rank whose
//! slice holds it, and to rank 0 when rank 0's is perturbed), (d) partial sums reduced in another
//! order: different by bits, within the f32 policy, and not called a defect. The layer verb:
//! isolated by the candidate's unsharded one, NOT CHECKED when it does not answer.

use std::path::Path;

use serde_json::Value;

use crate::common::{self, repo, work_dir};
use crate::ranks::sharded;

const TOKENS: &str = "12,218,345,152,81";

struct Bisected {
    code: i32,
    stdout: String,
    report: Value,
    /// The work directory (relative to the root), where the rank traces are.
    work: tempfile::TempDir,
}

/// `gate bisect --ranks 2` of tiny-qwen3: the engine against the sharded example producer with
/// `plants`, and `more` arguments.
fn bisect(plants: &str, more: &[&str]) -> Bisected {
    bisect_of("fixtures/tiny-qwen3", &sharded(plants), more)
}

/// `gate bisect --ranks 2` of `model`: the engine against the candidate command `cmd`.
fn bisect_of(model: &str, cmd: &str, more: &[&str]) -> Bisected {
    let (work, rel) = work_dir();
    let settings = [
        "--model",
        model,
        "--tokens",
        TOKENS,
        "--reference",
        "engine",
    ];
    let candidate = ["--candidate", "cmd", "--candidate-cmd", cmd, "--ranks", "2"];
    let all = [&settings[..], &candidate, more].concat();
    let common::Bisected {
        code,
        stdout,
        stderr,
        report,
    } = common::bisect(&rel, &work.path().join("report.json"), &all);
    assert_ne!(code, 2, "refused:\n{stdout}\n{stderr}");
    Bisected {
        code,
        stdout,
        report,
        work,
    }
}

/// `trace-diff` of `reference` and the candidate's `{rank}` side in `work`: exit status and
/// stdout + stderr.
fn trace_diff(reference: &Path, work: &Path, more: &[&str]) -> (i32, String) {
    let mut args = vec![reference.as_os_str().to_owned()];
    args.push(work.join("candidate.rank{rank}.trace").into_os_string());
    args.extend(more.iter().map(|m| m.into()));
    tool("trace-diff", &args)
}

/// A tool beside the gate (`trace-diff`, `trace-merge`) run with `args`: exit status and stdout +
/// stderr.
fn tool(name: &str, args: &[std::ffi::OsString]) -> (i32, String) {
    let out = std::process::Command::new(common::sibling(name))
        .args(args)
        .output()
        .unwrap();
    common::code_and_output(&out)
}

/// The report's `sharded.at`: (step, layer, point, rank).
fn at(r: &Value) -> (Value, Value, Value, Value) {
    let a = &r["sharded"]["at"];
    (
        a["step"].clone(),
        a["layer"].clone(),
        a["point"].clone(),
        a["rank"].clone(),
    )
}

#[test]
fn a_rank_that_skips_the_carry_in_cached_decode_is_named_at_its_step_layer_tensor_and_rank() {
    let tensor = "decode.0001.layer.00.attn_out";
    // The control first: the honest sharded port decodes with nothing wrong, merged from 2 ranks.
    let honest = bisect("", &["--generate", "2"]);
    assert_eq!(honest.code, 0, "{}", honest.stdout);
    let s = &honest.report["sharded"]["run"];
    assert_eq!(s["world"], 2, "{s}");
    assert_eq!(s["ranks"].as_array().unwrap().len(), 2, "{s}");
    assert!(
        honest.stdout.contains("merged from 2 rank traces"),
        "{}",
        honest.stdout
    );

    let b = bisect(&format!("--skip-carry 1:{tensor}"), &["--generate", "2"]);
    let r = &b.report;
    assert_eq!(b.code, 1, "{}", b.stdout);
    assert_eq!(r["verdict"], "rank_traces_refused", "{r}");
    assert_eq!(
        at(r),
        (1.into(), 0.into(), "attn_out".into(), 1.into()),
        "{r}"
    );
    assert_eq!(r["sharded"]["at"]["tensor"], tensor);
    assert_eq!(r["sharded"]["run"]["refused"]["rank"], 1);
    // The decode path names the step and the tensor.
    assert_eq!(r["decode"]["first_diverging_step"], 1, "{r}");
    assert_eq!(r["decode"]["first_diverging"], tensor, "{r}");
    let summary = r["summary"].as_str().unwrap();
    assert!(
        summary.contains("decode step 1, layer 00, stage attn_out") && summary.contains("rank 1"),
        "{summary}"
    );
    // trace-diff of the {rank} side refuses the same merge, naming the rank and the tensor.
    let (code, said) = trace_diff(&b.work.path().join("reference.trace"), b.work.path(), &[]);
    assert_eq!(code, 2, "{said}");
    assert!(said.contains(tensor) && said.contains("rank 1"), "{said}");
}

#[test]
fn a_slice_at_the_wrong_offset_and_a_perturbed_shard_are_named_at_their_rank() {
    // The sliced points (q, k, v, attn_probs) are captured under internals.
    let internals: &[&str] = &["--capture", "internals"];
    // (b) rank 1's slices at offset 0: the merge refuses, naming rank 1 and the first slice.
    let b = bisect("--wrong-offset 1", internals);
    let r = &b.report;
    assert_eq!(b.code, 1, "{}", b.stdout);
    assert_eq!(r["verdict"], "rank_traces_refused", "{r}");
    let (step, layer, point, rank) = at(r);
    assert_eq!(
        (step, layer, point, rank),
        (Value::Null, 0.into(), "q".into(), 1.into()),
        "{r}"
    );
    let (code, said) = trace_diff(&b.work.path().join("reference.trace"), b.work.path(), &[]);
    assert_eq!(code, 2, "{said}");
    assert!(
        said.contains("layer.00.q") && said.contains("rank 1"),
        "{said}"
    );

    // A perturbed shard of q merges; its first divergence is in rank 1's slice. The layer verb
    // answers unsharded, so layer 02 is isolated by it (and matches: the defect is the sharded
    // run's alone, which the candidate's own consistency check then says).
    let b = bisect("--perturb 1:layer.02.q", internals);
    let r = &b.report;
    assert_eq!(b.code, 1, "{}", b.stdout);
    assert_eq!(at(r), (Value::Null, 2.into(), "q".into(), 1.into()), "{r}");
    assert!(
        r["sharded"]["layer_verb"]
            .as_str()
            .unwrap()
            .starts_with("unsharded"),
        "{r}"
    );
    assert_eq!(r["layers"][2]["isolation"], "match", "{r}");
    let summary = r["summary"].as_str().unwrap();
    assert!(
        summary.contains("layer 02, stage q (layer.02.q), rank 1")
            && summary.contains("rank 1's shard"),
        "{summary}"
    );
    let (code, said) = trace_diff(
        &b.work.path().join("reference.trace"),
        b.work.path(),
        &["--policy", "f32"],
    );
    assert_eq!(code, 1, "{said}");
    assert!(said.contains("layer.02.q"), "{said}");

    // Control of the attribution: the same perturbation on rank 0 names rank 0.
    let b = bisect("--perturb 0:layer.02.q", internals);
    assert_eq!(at(&b.report).3, 0, "{}", b.report);

    // A candidate whose layer verb does not answer: isolation NOT CHECKED (exit 4), with the
    // reason, and the rank still named.
    let b = bisect("--perturb 1:layer.02.q --no-layer", internals);
    let r = &b.report;
    assert_eq!(b.code, 4, "{}", b.stdout);
    assert_eq!(r["verdict"], "not_checked", "{r}");
    assert_eq!(at(r).3, 1, "{r}");
    let lv = r["sharded"]["layer_verb"].as_str().unwrap();
    assert!(
        lv.starts_with("NOT CHECKED") && lv.contains("the layer verb is not sharded"),
        "{lv}"
    );
}

#[test]
fn partial_sums_in_another_order_differ_by_bits_and_are_within_the_f32_policy() {
    let b = bisect("--partials", &[]);
    let r = &b.report;
    // Judged by the f32 policy (the candidate is not an ordered producer): nothing wrong.
    assert!(r["judge"]["policy"].as_str().is_some(), "{}", r["judge"]);
    assert_eq!(b.code, 0, "{}", b.stdout);
    assert_eq!(r["verdict"], "nothing_wrong", "{r}");
    assert!(
        r["sharded"]["run"]["counts"]["reduced"].as_u64().unwrap() > 0,
        "{r}"
    );
    // Another order: by bits the merged run differs from the candidate's one-process bits (the
    // honest split's merge, which reproduces them: the control), under the f32 policy it is
    // within.
    let honest = bisect("", &[]);
    let one_process = honest.work.path().join("candidate.trace");
    let (code, said) = trace_diff(&one_process, honest.work.path(), &[]);
    assert_eq!(code, 0, "{said}");
    assert!(said.contains("IDENTICAL"), "{said}");
    let (code, said) = trace_diff(&one_process, b.work.path(), &[]);
    assert_eq!(code, 1, "{said}");
    assert!(
        said.contains("DIFFERENT") && said.contains("attn_out"),
        "{said}"
    );
    let (code, said) = trace_diff(&one_process, b.work.path(), &["--policy", "f32"]);
    assert_eq!(code, 0, "{said}");
    assert!(said.contains("WITHIN POLICY"), "{said}");
}

/// The engine's own expert-parallel run (`--shards ep=2`) behind tests/producers/sharded_port.py,
/// its rank traces copied with `plants`.
fn engine_ep2(plants: &str) -> String {
    let engine = common::sibling("engine");
    format!(
        "'{}' '{}' --exe '{}' --engine-shards ep=2 {plants} {{verb}} {{args}}",
        common::python().display(),
        repo()
            .join("gate/tests/producers/sharded_port.py")
            .display(),
        engine.display()
    )
}

#[test]
fn an_expert_on_none_or_on_two_ranks_is_named_at_its_layer_tensor_and_rank() {
    // Expert tensors are captured under internals.
    let internals: &[&str] = &["--capture", "internals"];
    let moe = "fixtures/tiny-qwen3-moe";
    // The control: the engine's honest ep=2 run, merged (experts united), nothing wrong.
    let honest = bisect_of(moe, &engine_ep2(""), internals);
    assert_eq!(honest.code, 0, "{}", honest.stdout);
    let r = &honest.report;
    assert_eq!(r["verdict"], "nothing_wrong", "{r}");
    assert!(
        r["sharded"]["run"]["counts"]["experts"].as_u64().unwrap() > 0,
        "{r}"
    );
    // The layer the plant must be named at: the first whose router (the one-process engine's,
    // not the merge's reading) sends rows to expert `e`.
    let reference =
        tracegate_trace::Trace::open(honest.work.path().join("reference.trace")).unwrap();
    let first_routing = |e: i64| -> usize {
        reference
            .decisions()
            .iter()
            .filter(|d| d.name.ends_with(".router.topk"))
            .find(|d| reference.decision_values(d).contains(&e))
            .and_then(|d| tracegate_trace::names::Name::parse(&d.name).layer)
            .unwrap_or_else(|| panic!("the prompt routes to expert {e} (precondition)"))
    };
    for (plants, e, rank, said) in [
        // The engine's ExpertNone: computed on no rank, rank 0's held= list intact.
        ("--expert-none 0:3", 3, 0, "is written by no rank"),
        // Rank 1's held= list leaves expert 5 out: held by no rank.
        (
            "--expert-unheld 1:5",
            5,
            1,
            "expert 5 of 8 is held by no rank",
        ),
        // The engine's ExpertTwice: rank 1 also computes rank 0's expert 3.
        ("--expert-twice 1:3", 3, 1, "is on ranks 0, 1"),
    ] {
        let b = bisect_of(moe, &engine_ep2(plants), internals);
        let r = &b.report;
        assert_eq!(b.code, 1, "{plants}: {}", b.stdout);
        assert_eq!(r["verdict"], "rank_traces_refused", "{plants}: {r}");
        let layer = first_routing(e);
        let tensor = format!("layer.{layer:02}.expert.{e:03}.out");
        assert_eq!(
            at(r),
            (Value::Null, layer.into(), "out".into(), rank.into()),
            "{plants}: {r}"
        );
        assert_eq!(r["sharded"]["at"]["tensor"], tensor.as_str(), "{plants}");
        let summary = r["summary"].as_str().unwrap();
        let words = format!("layer {layer:02}, stage out ({tensor}), rank {rank}");
        assert!(
            summary.contains(&words) && summary.contains(said),
            "{plants}: {summary}"
        );
        // trace-diff of the {rank} side and trace-merge refuse with the same words: the layer,
        // the tensor and the rank.
        let layer_words = format!("layer {layer:02}");
        let rank_words = format!("rank {rank}");
        let (code, diff_said) =
            trace_diff(&b.work.path().join("reference.trace"), b.work.path(), &[]);
        let files = b.work.path().join("candidate.rank{rank}.trace");
        let out = b.work.path().join("merged-by-hand.trace");
        let (merge_code, merge_said) = tool(
            "trace-merge",
            &[
                files.into_os_string(),
                "--out".into(),
                out.clone().into_os_string(),
            ],
        );
        for (what, code, words) in [
            ("trace-diff", code, &diff_said),
            ("trace-merge", merge_code, &merge_said),
        ] {
            assert_eq!(code, 2, "{plants}: {what}: {words}");
            assert!(
                words.contains(&tensor)
                    && words.contains(&layer_words)
                    && words.contains(&rank_words)
                    && words.contains(said),
                "{plants}: {what}: {words}"
            );
        }
        assert!(!out.exists(), "{plants}: a refused merge writes nothing");
    }

    // The adversary of the merge's scope: every expert tensor of layer 01 left out on every rank.
    // The merge holds no rank to the routing of a layer with no expert tensor (a capture without
    // them looks the same), so the ranks merge; the comparison with the one-process trace must
    // then say each routed expert's tensor is missing, and the bisection must not pass.
    let b = bisect_of(moe, &engine_ep2("--expert-layer-none 1"), internals);
    assert_eq!(b.code, 1, "{}", b.stdout);
    assert_ne!(b.report["verdict"], "rank_traces_refused", "{}", b.report);
    let (code, said) = trace_diff(&b.work.path().join("reference.trace"), b.work.path(), &[]);
    assert_eq!(code, 1, "{said}");
    assert!(said.contains("missing_tensor  layer.01.expert."), "{said}");
}
