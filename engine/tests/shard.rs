//! `engine trace --shards` (docs/numerics.md §23): the ranks' traces, merged by `trace-merge`,
//! are the one-process trace bit for bit; refusals; and the planted sharding defects each caught
//! by the merge or the comparison (negative controls).

use std::path::{Path, PathBuf};

use tracegate_engine::shard::{Plant, Shards};
use tracegate_engine::{run_trace, run_trace_ranks, Digest, TraceOptions};
use tracegate_trace::{merge::merge, ShardKind, Trace};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures")
        .join(name)
}

const PROMPT: [i64; 6] = [1, 17, 5, 42, 9, 3];

fn opts(model: &str, out: PathBuf, internals: bool, cache: bool, generate: usize) -> TraceOptions {
    TraceOptions {
        model_dir: fixture(model),
        tokens: PROMPT.to_vec(),
        out,
        internals,
        generate,
        cache,
        threads: 1,
        command_line: vec![],
        force_decisions: None,
        prompt_text: None,
        shards: None,
    }
}

fn shards(s: &str, plant: Option<Plant>) -> Option<Shards> {
    Some(Shards {
        plant,
        ..Shards::parse(s).unwrap()
    })
}

/// The ranks of `o` (with `shards`) run and merged: the merge's digest, or its refusal.
fn sharded(
    dir: &Path,
    o: &TraceOptions,
    s: Option<Shards>,
    tag: &str,
) -> (Vec<PathBuf>, Result<Digest, String>) {
    let o = TraceOptions {
        out: dir.join(format!("{tag}-{{rank}}.trace")),
        shards: s,
        ..clone(o)
    };
    let ranks: Vec<PathBuf> = run_trace_ranks(&o)
        .unwrap_or_else(|e| panic!("{tag}: {e}"))
        .into_iter()
        .map(|(p, _)| p)
        .collect();
    let merged = dir.join(format!("{tag}-merged.trace"));
    (ranks.clone(), merge(&ranks, &merged).map(|m| m.digest))
}

fn clone(o: &TraceOptions) -> TraceOptions {
    TraceOptions {
        model_dir: o.model_dir.clone(),
        tokens: o.tokens.clone(),
        out: o.out.clone(),
        command_line: o.command_line.clone(),
        force_decisions: o.force_decisions.clone(),
        prompt_text: o.prompt_text.clone(),
        shards: o.shards.clone(),
        ..*o
    }
}

#[test]
fn merged_rank_traces_are_the_one_process_trace() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        ("tiny-qwen3", "tp=2"),
        ("tiny-qwen3", "tp=1"),
        ("tiny-llama", "tp=2"),
        ("tiny-qwen2", "tp=2"),
        ("tiny-qwen3-moe", "tp=2"),
        ("tiny-qwen3-moe", "ep=2"),
    ];
    let mut checked = 0;
    for (model, s) in cases {
        for internals in [false, true] {
            for cache in [true, false] {
                let tag = format!("{model}-{s}-{internals}-{cache}");
                let o = opts(
                    model,
                    dir.path().join(format!("{tag}.trace")),
                    internals,
                    cache,
                    8,
                );
                let whole = run_trace(&o).unwrap();
                let (ranks, merged) = sharded(dir.path(), &o, shards(s, None), &tag);
                assert_eq!(merged.unwrap(), whole, "{tag}: merged != one process");
                // Each rank holds what §23.2 says, and names the run.
                let world: usize = s[3..].parse().unwrap();
                assert_eq!(ranks.len(), world);
                let run_ids: Vec<_> = ranks
                    .iter()
                    .map(|p| Trace::open(p).unwrap().provenance()["run_id"].clone())
                    .collect();
                assert!(run_ids.iter().all(|r| r == &run_ids[0] && r.is_string()));
                let r1 = Trace::open(ranks.last().unwrap()).unwrap();
                assert_eq!(r1.provenance()["shards"], s, "{tag}");
                let kind = |name: &str| {
                    r1.tensor_info(name)
                        .unwrap_or_else(|| panic!("{tag}: no {name}"))
                        .attributes
                        .shard()
                        .unwrap()
                        .unwrap()
                        .kind
                };
                let vocab = r1.tensor_info("logits").unwrap().shape[1];
                match kind("logits") {
                    ShardKind::Slice {
                        axis: 1,
                        length,
                        size,
                        ..
                    } if world > 1 => {
                        assert!(length == vocab && length < size, "{tag}")
                    }
                    ShardKind::Slice {
                        axis: 1, offset: 0, ..
                    } => {}
                    k => panic!("{tag}: logits held as {k:?}"),
                }
                assert_eq!(kind("layer.00.hidden_out"), ShardKind::Replicated);
                if internals {
                    assert!(matches!(
                        kind("layer.00.q"),
                        ShardKind::Slice { axis: 1, .. }
                    ));
                    assert!(matches!(
                        kind("layer.00.attn_probs"),
                        ShardKind::Slice { axis: 0, .. }
                    ));
                    if model == "tiny-qwen3-moe" {
                        let e = r1
                            .tensors()
                            .iter()
                            .find(|t| t.name.contains(".expert."))
                            .map(|t| t.name.clone())
                            .expect("an expert tensor");
                        match (s, kind(&e)) {
                            ("ep=2", ShardKind::Experts { held, of: 8 }) => {
                                assert_eq!(held, vec![4, 5, 6, 7])
                            }
                            ("tp=2", ShardKind::Replicated) => {}
                            (_, k) => panic!("{tag}: {e} held as {k:?}"),
                        }
                    }
                }
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 24);
}

/// Refused before anything runs, in one line naming the numbers.
fn refusal(model_dir: PathBuf, s: &str, out: &str) -> String {
    let o = TraceOptions {
        model_dir,
        out: PathBuf::from(out),
        shards: Some(Shards::parse(s).unwrap()),
        ..opts("tiny-qwen3", PathBuf::new(), false, true, 0)
    };
    let e = run_trace(&o).expect_err(s).to_string();
    assert!(!e.contains('\n'), "{e}");
    let e2 = run_trace_ranks(&o).expect_err(s).to_string();
    assert_eq!(e, e2);
    e
}

#[test]
fn sharded_runs_that_section_23_does_not_allow_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("r{rank}.trace");
    let out = out.to_str().unwrap();
    let e = refusal(fixture("tiny-gemma3"), "tp=2", out);
    assert!(
        e.contains("2 ranks must divide both num_attention_heads 4 and num_key_value_heads 1"),
        "{e}"
    );
    for (m, family) in [
        ("tiny-qwen3_5", "qwen3_5 has"),
        ("tiny-qwen3_5-moe", "qwen3_5_moe_text has"),
    ] {
        let e = refusal(fixture(m), "tp=2", out);
        assert!(e.contains(family) && e.contains("linear-attention"), "{e}");
    }
    let e = refusal(fixture("tiny-diffusion-gemma"), "tp=1", out);
    assert!(e.contains("diffusion_gemma is not sharded"), "{e}");
    let e = refusal(fixture("tiny-qwen3"), "ep=2", out);
    assert!(e.contains("no routed experts"), "{e}");
    // ep: W must divide num_experts (a config whose heads W divides; refused before weights).
    let cfg_dir = dir.path().join("six-experts");
    std::fs::create_dir(&cfg_dir).unwrap();
    let mut cfg: serde_json::Value = serde_json::from_slice(
        &std::fs::read(fixture("tiny-qwen3-moe").join("config.json")).unwrap(),
    )
    .unwrap();
    cfg["num_experts"] = 6.into();
    cfg["num_key_value_heads"] = 4.into();
    std::fs::write(cfg_dir.join("config.json"), cfg.to_string()).unwrap();
    let e = refusal(cfg_dir.clone(), "ep=4", out);
    assert!(e.contains("4 ranks must divide num_experts 6"), "{e}");
    // Control: the same config under tp=4 passes that check (and stops at the missing weights).
    let e = refusal(cfg_dir, "tp=4", out);
    assert!(!e.contains("divide"), "{e}");
    // {rank}: required with --shards, refused without.
    let e = refusal(fixture("tiny-qwen3"), "tp=2", "/tmp/no-placeholder.trace");
    assert!(e.contains("must contain {rank}"), "{e}");
    let o = opts("tiny-qwen3", PathBuf::from(out), false, true, 0);
    let e = run_trace(&o).unwrap_err().to_string();
    assert!(
        e.contains("{rank} is replaced by the rank number of a sharded run only"),
        "{e}"
    );
    // Malformed --shards and W < 1.
    for bad in ["tp2", "xp=2", "tp=", "tp=-1", "tp=2x", "tp=+2", "=2", ""] {
        let e = Shards::parse(bad).expect_err(bad).to_string();
        assert!(
            e.contains("expected tp=N or ep=N") && !e.contains('\n'),
            "{e}"
        );
    }
    let e = Shards::parse("tp=0").unwrap_err().to_string();
    assert!(e.contains("0 ranks"), "{e}");
    assert_eq!(Shards::parse("ep=3").unwrap().to_string(), "ep=3");
}

#[test]
fn the_command_line_writes_one_trace_per_rank_and_refuses_in_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let run = |args: &[&str]| {
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_engine"))
            .args(["trace", "--model"])
            .arg(fixture("tiny-qwen3"))
            .args(["--tokens", "1,17,5", "--threads", "1"])
            .args(args)
            .output()
            .unwrap();
        (
            o.status.code(),
            String::from_utf8_lossy(&o.stdout).into_owned(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    let out = dir.path().join("r{rank}.trace");
    let (code, stdout, _) = run(&["--shards", "tp=2", "--out", out.to_str().unwrap()]);
    assert_eq!(code, Some(0));
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 2, "{stdout}");
    for (r, l) in lines.iter().enumerate() {
        let file = dir.path().join(format!("r{r}.trace"));
        assert!(l.ends_with(file.to_str().unwrap()), "{l}");
        assert!(l.starts_with(&Trace::open(&file).unwrap().digest().hex()));
    }
    let (code, _, stderr) = run(&["--shards", "tp:2", "--out", out.to_str().unwrap()]);
    assert_eq!(code, Some(2));
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("--shards \"tp:2\": expected tp=N or ep=N"),
        "{stderr}"
    );
}

fn qwen3(dir: &Path, tag: &str, internals: bool, cache: bool, generate: usize) -> TraceOptions {
    opts(
        "tiny-qwen3",
        dir.join(format!("{tag}.trace")),
        internals,
        cache,
        generate,
    )
}

#[test]
fn a_rank_that_skips_the_carry_in_cached_decode_is_refused_by_the_merge() {
    let dir = tempfile::tempdir().unwrap();
    let plant = || shards("tp=2", Some(Plant::SkipCarryInDecode { rank: 1 }));
    let o = qwen3(dir.path(), "skip", true, true, 8);
    run_trace(&o).unwrap();
    let (_, merged) = sharded(dir.path(), &o, plant(), "skip");
    let e = merged.expect_err("the planted rank's replicated tensors differ");
    assert!(
        e.contains("rank 1") && e.contains("\"decode.0001.layer.00.attn_out\""),
        "{e}"
    );
    // Controls: the plant is in cached decode only — prefill, and decode without the cache, right.
    for (tag, o) in [
        ("prefill", qwen3(dir.path(), "skip-prefill", true, true, 0)),
        (
            "uncached",
            qwen3(dir.path(), "skip-uncached", true, false, 8),
        ),
    ] {
        let whole = run_trace(&o).unwrap();
        assert_eq!(
            sharded(dir.path(), &o, plant(), tag).1.unwrap(),
            whole,
            "{tag}"
        );
    }
}

#[test]
fn a_slice_recorded_at_the_wrong_offset_is_refused_by_the_merge() {
    let dir = tempfile::tempdir().unwrap();
    let o = qwen3(dir.path(), "offset", true, true, 2);
    let (_, merged) = sharded(
        dir.path(),
        &o,
        shards("tp=2", Some(Plant::SliceAtZero { rank: 1 })),
        "offset",
    );
    let e = merged.expect_err("rank 1's slices overlap rank 0's");
    assert!(e.contains("layer.00.q") && e.contains("rank 1"), "{e}");
}

#[test]
fn an_expert_on_two_ranks_or_on_none_is_caught() {
    let dir = tempfile::tempdir().unwrap();
    let moe = |tag: &str, internals: bool| {
        opts(
            "tiny-qwen3-moe",
            dir.path().join(format!("{tag}.trace")),
            internals,
            true,
            4,
        )
    };
    run_trace(&moe("whole-i", true)).unwrap();
    let wd = run_trace(&moe("whole-d", false)).unwrap();
    let whole = Trace::open(dir.path().join("whole-i.trace")).unwrap();
    let twice = || shards("ep=2", Some(Plant::ExpertTwice { rank: 1 }));
    let none = || shards("ep=2", Some(Plant::ExpertNone { rank: 0 }));
    // Twice: the merge names the expert's tensor on both ranks; by default capture (no expert
    // tensors) the doubled contribution changes the merged trace.
    let e = sharded(dir.path(), &moe("twice-i", true), twice(), "twice-i")
        .1
        .expect_err("expert 3 on ranks 0 and 1");
    assert!(
        e.contains("\"layer.00.expert.003.out\"") && e.contains("on ranks 0, 1"),
        "{e}"
    );
    let d = sharded(dir.path(), &moe("twice-d", false), twice(), "twice-d")
        .1
        .unwrap();
    assert_ne!(d, wd, "an expert added twice");
    // None: expert 3 computed by no rank, rank 0's held= list intact. Captured with internals, the
    // merge refuses it at the first layer routing rows to expert 3, naming the tensor no rank
    // wrote and its holder; by default capture the merged trace differs.
    let first3 = whole
        .tensors()
        .iter()
        .find(|t| t.name.ends_with(".expert.003.out"))
        .map(|t| t.name.clone())
        .expect("the prompt routes to expert 3 (precondition of this control)");
    let e = sharded(dir.path(), &moe("none-i", true), none(), "none-i")
        .1
        .expect_err("expert 3 on no rank");
    assert!(
        e.contains(&format!("tensor {first3:?} is written by no rank"))
            && e.contains("rank 0 holds it (its held= list: 0,1,2,3)"),
        "{e}"
    );
    let d = sharded(dir.path(), &moe("none-d", false), none(), "none-d")
        .1
        .unwrap();
    assert_ne!(d, wd, "an expert left out");
}

#[test]
fn partial_sums_reduced_as_an_all_reduce_differ_but_within_the_f32_policy() {
    let dir = tempfile::tempdir().unwrap();
    let o = qwen3(dir.path(), "partials", true, true, 8);
    let whole = run_trace(&o).unwrap();
    let (_, merged) = sharded(
        dir.path(),
        &o,
        shards("tp=2", Some(Plant::Partials)),
        "partials",
    );
    assert_ne!(
        merged.unwrap(),
        whole,
        "another order of the sum is not bit-identical"
    );
    let policy = tracegate_diff::Policy::load(&fixture("policy/oracle-default.json")).unwrap();
    let opts = tracegate_diff::Options {
        policy: Some(policy),
        ..Default::default()
    };
    let report = tracegate_diff::compare_files(
        &dir.path().join("partials.trace"),
        &dir.path().join("partials-merged.trace"),
        &opts,
    );
    assert_eq!(
        report.verdict,
        tracegate_diff::Verdict::WithinPolicy,
        "{:?}",
        report.verdict
    );
    // Control: without the policy the same comparison says different.
    let strict = tracegate_diff::compare_files(
        &dir.path().join("partials.trace"),
        &dir.path().join("partials-merged.trace"),
        &Default::default(),
    );
    assert_eq!(strict.verdict, tracegate_diff::Verdict::Different);
}
