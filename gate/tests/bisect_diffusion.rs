//! `gate bisect --generate N` on a block-diffusion model (docs/bisect.md, "Block diffusion"):
//! each incident class of the diffusion port (defective_contract.py `dg-*`, docs/diffusion-gemma.md
//! DG18) bisected against the engine on `tiny-diffusion-gemma` must be named at its pass, layer
//! and stage — a causal canvas in one denoise layer isolated to that layer's attention, a skipped
//! self-conditioning before the layers, an OR stop rule, an argmax that is not argmax and a reply
//! from the sampled canvas as decisions on agreeing numbers (forced by torch's draws too), the prompt's defects by the prompt's bisection; clean pairs
//! (engine vs contract by bits, the oracle's generator against the engine's, forced) must say
//! nothing wrong, naming the passes compared; forced past another generator's draws, an OR stop
//! rule is still its own decision that differs; a candidate that cannot be forced is NOT
//! CHECKED, never a pass; nor is one that does not record which rows it overrode, and an
//! override is judged by its own row's margin, never covered by a margin ≤ 0 in another row,
//! nor excused by a margin ≤ 0 of its own far from any tie (the near-tie rule measures it).

use serde_json::Value;

use crate::common;
use common::{defective, repo};

const MODEL: &str = "fixtures/tiny-diffusion-gemma";

/// `gate bisect --generate 14 --seed 3` (dg0's settings) on prompt `short`: (exit, stdout, report).
fn bisect(reference: &[&str], candidate: &[&str]) -> (i32, String, Value) {
    bisect_at("short", 3, reference, candidate)
}

/// `gate bisect --generate 14 --seed SEED` on prompt `prompt`: (exit, stdout, report).
fn bisect_at(
    prompt: &str,
    seed: u64,
    reference: &[&str],
    candidate: &[&str],
) -> (i32, String, Value) {
    let work = tempfile::tempdir_in(repo().join("target")).unwrap();
    bisect_in(work.path(), prompt, seed, reference, candidate)
}

/// torch's generator against the engine's: `gate bisect --reference oracle --candidate engine`
/// once for this test binary (the oracle's start-up is most of a run): its exit, stdout and
/// report, and its reference trace (torch's whole run of dg0's prompt) as a stored reference
/// for the candidates forced by torch's draws.
fn torch_run() -> &'static (i32, String, Value, String) {
    static RUN: std::sync::OnceLock<(i32, String, Value, String)> = std::sync::OnceLock::new();
    RUN.get_or_init(|| {
        let work = tempfile::tempdir_in(repo().join("target")).unwrap().keep();
        let (code, stdout, report) = bisect_in(
            &work,
            "short",
            3,
            &["--reference", "oracle"],
            &["--candidate", "engine"],
        );
        let stored = format!("trace:{}", work.join("reference.trace").display());
        (code, stdout, report, stored)
    })
}

/// The bisection with its work directory `work` (under the repository).
fn bisect_in(
    work: &std::path::Path,
    prompt: &str,
    seed: u64,
    reference: &[&str],
    candidate: &[&str],
) -> (i32, String, Value) {
    let seed = seed.to_string();
    let settings = [
        "--model",
        MODEL,
        "--prompt",
        prompt,
        "--generate",
        "14",
        "--seed",
        &seed,
    ];
    let all = [&settings[..], reference, candidate].concat();
    let b = common::bisect(work, &work.join("report.json"), &all);
    (b.code, b.stdout, b.report)
}

/// The contract with `defect` planted, against the engine.
fn planted(defect: &str) -> (i32, String, Value) {
    let cmd = defective(defect);
    bisect(
        &["--reference", "engine"],
        &["--candidate", "cmd", "--candidate-cmd", &cmd],
    )
}

/// The contract with `defect` planted, forced by torch's run (the stored reference of
/// [`torch_run`]).
fn forced_by_torch(defect: &str) -> (i32, String, Value) {
    let cmd = defective(defect);
    bisect(
        &["--reference", &torch_run().3],
        &["--candidate", "cmd", "--candidate-cmd", &cmd],
    )
}

#[test]
fn engine_and_contract_agree_on_every_pass_by_bits() {
    let (code, stdout, r) = bisect(&["--reference", "engine"], &["--candidate", "contract"]);
    assert_eq!(code, 0, "{stdout}");
    assert_eq!(r["verdict"], "nothing_wrong", "{stdout}");
    assert_eq!(r["judge"]["by"], "bits", "{stdout}");
    let d = &r["diffusion"];
    assert_eq!(d["status"], "compared");
    assert!(d["forced"].is_null(), "one generator: nothing to force");
    let passes = d["passes"].as_u64().unwrap();
    // Two blocks of 7: at least one denoise step and a commit pass each.
    assert!(passes >= 4, "{d}");
    assert_eq!(d["passes_compared"].as_u64(), Some(passes));
    assert!(d["first_diverging"].is_null());
    assert!(
        stdout.contains(&format!("the {passes} passes after the prompt agree")),
        "{stdout}"
    );
}

#[test]
fn a_causal_canvas_in_one_denoise_layer_is_that_layers_attention_at_the_first_step() {
    let (code, stdout, r) = planted("dg-canvas-causal");
    assert_eq!(code, 1, "{stdout}");
    assert_eq!(r["verdict"], "wrong_layer", "{stdout}");
    // The prompt's encoder pass is causal anyway: the prompt agrees, the defect is after it.
    assert!(r["first_wrong_layer"].is_null(), "{stdout}");
    let d = &r["diffusion"];
    assert_eq!(d["place"], "block 0 step 0", "{stdout}");
    assert_eq!(d["first_diverging_pass"], "denoise.0000.0000.");
    assert_eq!(d["first_wrong_layer"], 1, "{stdout}");
    assert_eq!(common::statuses(&d["layers"]), ["ok", "wrong"], "{stdout}");
    assert_eq!(d["stage"]["block"], "attention", "{stdout}");
    assert_eq!(d["stage"]["tensor"], "layer.01.attn_probs", "{stdout}");
    // Its layer verb runs the same code as its whole run: the blame stands.
    assert_eq!(d["layers"][1]["self_check"], "consistent", "{stdout}");
    assert!(d["inconsistent"].is_null());
    assert!(
        r["summary"]
            .as_str()
            .unwrap()
            .contains("in isolation at block 0 step 0 layer 01's body is wrong: attention block"),
        "{stdout}"
    );
}

#[test]
fn self_conditioning_skipped_on_a_blocks_first_step_is_named_before_the_layers() {
    let (code, stdout, r) = planted("dg-sc-skip");
    assert_eq!(code, 1, "{stdout}");
    assert_eq!(r["verdict"], "outside_layers", "{stdout}");
    let d = &r["diffusion"];
    assert_eq!(d["place"], "block 0 step 0", "{stdout}");
    let first = d["first_diverging"].as_str().unwrap();
    assert!(
        first.starts_with("denoise.0000.0000.sc.")
            || first == "denoise.0000.0000.layer.00.hidden_in",
        "{first}: {stdout}"
    );
    assert!(
        d["layers"].as_array().unwrap().is_empty(),
        "no layer is blamed for its input"
    );
}

#[test]
fn an_or_stop_rule_is_a_stop_decision_on_agreeing_numbers() {
    let (code, stdout, r) = planted("dg-stop-or");
    assert_eq!(code, 1, "{stdout}");
    assert_eq!(r["verdict"], "decisions_differ", "{stdout}");
    let d = &r["diffusion"];
    let first = d["first_diverging"].as_str().unwrap();
    assert!(
        first.starts_with("denoise.") && first.ends_with(".stop"),
        "{first}"
    );
    assert!(d["pass_tensors"].as_array().unwrap().is_empty(), "{stdout}");
    assert!(
        r["summary"]
            .as_str()
            .unwrap()
            .contains("stop decision differs"),
        "{stdout}"
    );
}

#[test]
fn an_argmax_that_is_not_argmax_differs_unforced_and_is_not_excused_forced() {
    let (code, stdout, r) = planted("dg-argmax-second");
    assert_eq!(code, 1, "{stdout}");
    assert_eq!(r["verdict"], "decisions_differ", "{stdout}");
    assert_eq!(
        r["diffusion"]["first_diverging"], "denoise.0000.0000.argmax",
        "{stdout}"
    );
    // Forced by torch's run, its own logits put the reference's token on top where it
    // overrode it: not a near-tie the judged logits explain.
    let (code, stdout, r) = forced_by_torch("dg-argmax-second");
    assert_eq!(code, 1, "{stdout}");
    assert_eq!(r["verdict"], "decisions_differ", "{stdout}");
    let unexplained = r["diffusion"]["forced_unexplained"].as_array().unwrap();
    assert!(
        unexplained.iter().any(|n| n == "denoise.0000.0000.argmax"),
        "{stdout}"
    );
    // Judged row by row: the row it overrode, and why its own numbers do not explain it.
    assert!(
        r["summary"].as_str().unwrap().contains(
            "denoise.0000.0000.argmax: 1 (not explained by its own numbers: row 0: its margin "
        ),
        "{stdout}"
    );
    let f = &r["diffusion"]["forced"];
    assert_eq!(
        f["overridden_rows"]["denoise.0000.0000.argmax"],
        serde_json::json!([0]),
        "{stdout}"
    );
    assert!(
        f["overrides_unexplained"]
            .as_array()
            .unwrap()
            .iter()
            .any(|u| u["decision"] == "denoise.0000.0000.argmax"
                && u["rows"] == serde_json::json!([0])),
        "{stdout}"
    );
}

/// Adversaries of the forced override rule (docs/bisect.md, "Block diffusion"), forced by
/// torch's run: a port whose argmax takes every row's runner-up and records nothing of what it
/// overrode is NOT CHECKED, naming the missing record — never read as no override (it was
/// `nothing wrong` while a missing count read as 0).
#[test]
fn a_forced_port_that_records_no_overrides_is_not_checked_never_none() {
    let (code, stdout, r) = forced_by_torch("dg-argmax-runner-up");
    assert_eq!(code, 4, "{stdout}");
    assert_eq!(r["verdict"], "not_checked", "{stdout}");
    let f = &r["diffusion"]["forced"];
    assert_eq!(f["status"], "forced", "{stdout}");
    assert!(f["overridden"].is_null(), "{stdout}");
    let why = f["overrides_not_checked"].as_str().unwrap();
    assert!(
        why.contains("forced_decisions records no overridden"),
        "{why}"
    );
    let summary = r["summary"].as_str().unwrap();
    assert!(
        summary.starts_with("the candidate's own decisions NOT CHECKED: ")
            && summary.contains("records no overridden"),
        "{stdout}"
    );
}

/// A port that says which row it overrode (block 0 step 0's argmax, row 0: its rule took the
/// runner-up) and manufactures a margin of 0 in another row of the same step — its recorded
/// tempered logits tied there, within the policy — is judged by the overridden row's own margin:
/// `decisions_differ`, naming that row (it was `nothing wrong` while overrides were counted
/// against rows with a margin ≤ 0 anywhere).
#[test]
fn an_override_covered_by_a_margin_manufactured_in_another_row_fails_naming_its_row() {
    let (code, stdout, r) = forced_by_torch("dg-argmax-covered");
    assert_eq!(code, 1, "{stdout}");
    assert_eq!(r["verdict"], "decisions_differ", "{stdout}");
    let d = &r["diffusion"];
    // The cover holds as far as the comparison goes: no pass diverges, its margins within policy.
    assert!(d["first_diverging"].is_null(), "{stdout}");
    let f = &d["forced"];
    assert_eq!(f["overridden"]["denoise.0000.0000.argmax"], 1, "{f}");
    assert_eq!(
        f["overridden_rows"]["denoise.0000.0000.argmax"],
        serde_json::json!([0]),
        "{f}"
    );
    // Not the other rows of the step: the 0 it manufactured there is no tie of a top-k.
    assert!(f["overrides_ties"].as_object().unwrap().is_empty(), "{f}");
    assert_eq!(
        f["overrides_unexplained"],
        serde_json::json!([{
            "decision": "denoise.0000.0000.argmax",
            "rows": [0],
            "why": f["overrides_unexplained"][0]["why"],
        }]),
        "{stdout}"
    );
    assert!(f["overrides_not_checked"].is_null(), "{stdout}");
    assert_eq!(
        d["forced_unexplained"],
        serde_json::json!(["denoise.0000.0000.argmax"])
    );
    assert!(
        r["summary"].as_str().unwrap().starts_with(
            "the candidate's own decisions differ on the reference's numbers: denoise.0000.0000.argmax: 1 (not explained by its own numbers: row 0: its margin "
        ),
        "{stdout}"
    );
}

/// Issue 50 item 3, an adversary of the override rule: block 0 step 0's argmax takes the
/// runner-up of a row whose top-two gap is far above the honest-noise bound (> 0.1, the bound
/// F·h 0.02), and says so as an honest near-tie would — its recorded tempered logits put the
/// runner-up on top (moved within the policy) and its margin for the forced token is the one
/// they give it, < 0. A margin ≤ 0 is its word, not an excuse: the gap its choice crossed in
/// torch's own tempered logits is measured against F·h, and fails naming the row, the gap and
/// the bound (it was `nothing wrong` while a margin ≤ 0 excused the row).
#[test]
fn a_far_flip_recorded_with_its_own_margin_below_zero_fails_with_the_gap_and_bound() {
    let (code, stdout, r) = forced_by_torch("dg-argmax-far");
    assert_eq!(code, 1, "{stdout}");
    assert_eq!(r["verdict"], "decisions_differ", "{stdout}");
    let d = &r["diffusion"];
    // The comparison does not catch it: no pass diverges, its margins within the policy.
    assert!(d["first_diverging"].is_null(), "{stdout}");
    let f = &d["forced"];
    let name = "denoise.0000.0000.argmax";
    assert_eq!(f["overridden"][name], 1, "{f}");
    let judged: Vec<&Value> = f["overrides_rows"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|x| x["decision"] == name)
        .collect();
    assert_eq!(judged.len(), 1, "{f}");
    let row = judged[0];
    assert_eq!(row["outcome"], "unexplained", "{row}");
    assert!(row["margin"].as_f64().unwrap() < 0.0, "{row}");
    let (gap, bound) = (
        row["gap"].as_f64().unwrap(),
        row["noise_bound"].as_f64().unwrap(),
    );
    assert!(gap > 0.1 && (bound - 0.02).abs() < 1e-12, "{row}");
    assert_eq!(row["honest_noise_from"], "policy", "{row}");
    assert_eq!(
        d["forced_unexplained"],
        serde_json::json!([name]),
        "{stdout}"
    );
    let summary = r["summary"].as_str().unwrap();
    assert!(
        summary.starts_with(&format!(
            "the candidate's own decisions differ on the reference's numbers: {name}: 1 (not explained by its own numbers: row {}: its own denoise.0000.0000.logits.tempered make [",
            row["row"]
        )) && summary.contains("nor a near-tie: the reference's denoise.0000.0000.logits.tempered put its own choice [")
            && summary.contains("above the honest-noise bound 2e-2 (F·h, h 1e-2 from the policy)"),
        "{stdout}"
    );
}

#[test]
fn a_reply_from_the_sampled_canvas_is_the_blocks_commit() {
    // Seed 0: block 0's last step samples a token other than its argmax in one row (with seed 3
    // every row's sample is its argmax there, and the defect changes nothing).
    let cmd = defective("dg-reply-sampled");
    let (code, stdout, r) = bisect_at(
        "short",
        0,
        &["--reference", "engine"],
        &["--candidate", "cmd", "--candidate-cmd", &cmd],
    );
    assert_eq!(code, 1, "{stdout}");
    assert_eq!(r["verdict"], "decisions_differ", "{stdout}");
    assert_eq!(
        r["diffusion"]["first_diverging"], "denoise.0000.commit",
        "{stdout}"
    );
    assert_eq!(r["diffusion"]["place"], "block 0", "{stdout}");
}

#[test]
fn the_prompts_defects_are_the_prompt_bisections_and_the_passes_after_wait() {
    for (defect, block) in [("dg-bidir-prompt", "attention"), ("dg-mlp-add", "mlp")] {
        let (code, stdout, r) = planted(defect);
        assert_eq!(code, 1, "{defect}: {stdout}");
        assert_eq!(r["verdict"], "wrong_layer", "{defect}: {stdout}");
        assert_eq!(r["first_wrong_layer"], 0, "{defect}: {stdout}");
        assert_eq!(r["stage"]["block"], block, "{defect}: {stdout}");
        assert_eq!(
            r["diffusion"]["status"], "not_compared",
            "{defect}: {stdout}"
        );
    }
}

#[test]
fn another_generator_is_forced_and_then_agrees_or_is_not_checked() {
    // The engine against torch's generator: forced by the oracle's trace, the passes agree.
    let (code, stdout, r, _) = torch_run();
    let code = *code;
    assert_eq!(code, 0, "{stdout}");
    assert_eq!(r["verdict"], "nothing_wrong", "{stdout}");
    let f = &r["diffusion"]["forced"];
    assert_eq!(f["status"], "forced", "{stdout}");
    assert!(f["unforced"]
        .as_array()
        .unwrap()
        .iter()
        .any(|u| u["name"] == "denoise.0000.init_canvas"));
    // Against torch's run stored (the same trace), forced, an OR stop rule takes the reference's stop, and says where its own differs: the
    // numbers agree, the candidate's decision does not.
    let (code, stdout, r) = forced_by_torch("dg-stop-or");
    assert_eq!(code, 1, "{stdout}");
    assert_eq!(r["verdict"], "decisions_differ", "{stdout}");
    assert_eq!(r["diffusion"]["forced"]["status"], "forced", "{stdout}");
    let summary = r["summary"].as_str().unwrap();
    assert!(
        summary.starts_with(
            "the candidate's own decisions differ on the reference's numbers: denoise."
        ) && summary.contains(".stop: 1"),
        "{stdout}"
    );
    // A candidate that ignores --force-decisions cannot be compared past the first draw.
    let (code, stdout, r) = forced_by_torch("no-force");
    assert_eq!(code, 4, "{stdout}");
    assert_eq!(r["verdict"], "not_checked", "{stdout}");
    assert_eq!(r["diffusion"]["forced"]["status"], "not_forced", "{stdout}");
    assert!(
        r["summary"].as_str().unwrap().contains("NOT CHECKED"),
        "{stdout}"
    );
}

/// A golden trace recorded once stands in for the reference: its prompt, --generate and seed
/// are the bisection's unless given; another seed is refused; a planted defect is named at the
/// same pass, layer and stage as against the live engine.
#[test]
fn a_stored_diffusion_reference_bisects_as_the_live_one_and_refuses_another_seed() {
    let root = repo();
    let dir = tempfile::tempdir_in(root.join("target")).unwrap();
    // The engine's whole run, as a live bisection records it (its work dir's reference.trace).
    let live = common::gate()
        .current_dir(&root)
        .args(["--root", root.to_str().unwrap(), "bisect", "--model", MODEL])
        .args(["--prompt", "short", "--generate", "14", "--seed", "3"])
        .args(["--reference", "engine", "--candidate", "engine", "--work"])
        .arg(dir.path().join("live"))
        .output()
        .unwrap();
    assert_eq!(live.status.code(), Some(0), "{live:?}");
    let golden = dir.path().join("live/reference.trace");
    let reference = format!("trace:{}", golden.display());
    let run = |extra: &[&str], candidate: &[&str]| {
        let work = tempfile::tempdir_in(root.join("target")).unwrap();
        let out = common::gate()
            .current_dir(&root)
            .args(["--root", root.to_str().unwrap(), "bisect", "--model", MODEL])
            .args(["--reference", &reference])
            .args([
                "--work",
                work.path().strip_prefix(&root).unwrap().to_str().unwrap(),
            ])
            .args(extra)
            .args(candidate)
            .output()
            .unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).to_string()
                + &String::from_utf8_lossy(&out.stderr),
        )
    };
    let (code, said) = run(&[], &["--candidate", "contract"]);
    assert_eq!(code, 0, "{said}");
    assert!(said.contains("passes after the prompt agree"), "{said}");
    let (code, said) = run(&["--seed", "4"], &["--candidate", "contract"]);
    assert_eq!(code, 2, "{said}");
    assert!(
        said.contains("recorded with --seed 3, this bisection asks --seed 4"),
        "{said}"
    );
    let cmd = defective("dg-canvas-causal");
    let (code, said) = run(&[], &["--candidate", "cmd", "--candidate-cmd", &cmd]);
    assert_eq!(code, 1, "{said}");
    assert!(
        said.contains("in isolation at block 0 step 0 layer 01's body is wrong: attention block"),
        "{said}"
    );
}
