//! `gate bisect --generate N` (docs/bisect.md, "Decode"): a position off-by-one planted in the
//! candidate's cached decode only is found at its step and named as the cached path, at its
//! layer (dense and MoE); a candidate whose decode steps are wrong on both paths but that has no
//! `layer --decode-from` is NOT CHECKED, never a pass; clean engine-vs-contract runs (dense and
//! MoE) say nothing wrong and name the steps compared.

use serde_json::Value;

use crate::common;
use common::{defective, headline, work_dir};

/// `gate bisect --generate 3` on a fixture, prompt `short`: (exit code, stdout, report).
fn bisect_generate(model: &str, candidate: &[&str]) -> (i32, String, Value) {
    let (work, rel) = work_dir();
    let model = format!("fixtures/{model}");
    let settings = [
        "--model",
        &model,
        "--prompt",
        "short",
        "--reference",
        "engine",
    ];
    let all = [&settings[..], &["--generate", "3"], candidate].concat();
    let b = common::bisect(&rel, &work.path().join("report.json"), &all);
    (b.code, b.stdout, b.report)
}

#[test]
fn a_cached_decode_position_off_by_one_is_named_as_the_cached_path_at_its_step_and_layer() {
    let cmd = defective("cached-pos");
    for model in ["tiny-qwen3", "tiny-qwen3-moe"] {
        cached_pos_is_found(model, &cmd);
    }
}

fn cached_pos_is_found(model: &str, cmd: &str) {
    let (code, stdout, r) = bisect_generate(model, &["--candidate", "cmd", "--candidate-cmd", cmd]);
    let d = &r["decode"];
    assert_eq!(
        (code, r["verdict"].as_str(), r["exit_code"].as_i64()),
        (6, Some("cached_decode_differs"), Some(6)),
        "{stdout}"
    );
    assert!(headline(&stdout).starts_with("the cached decode path disagrees with the full recompute from step 1: first decode.0001.layer.01.attn_out"), "{stdout}");
    // The prefill is clean; the step is the first with a forward on the cache.
    assert_eq!(r["whole_run"]["verdict"], "identical");
    assert_eq!(
        r["capture"], "internals",
        "--generate implies --capture internals"
    );
    assert_eq!(
        (
            d["status"].as_str(),
            d["generate"].as_u64(),
            d["steps_compared"].as_u64()
        ),
        (Some("compared"), Some(3), Some(2))
    );
    assert_eq!(
        (d["first_diverging_step"].as_u64(), d["position"].as_i64()),
        (Some(1), Some(5))
    );
    assert_eq!(d["first_diverging"], "decode.0001.layer.01.attn_out");
    let c = &d["cache_check"];
    assert_eq!(
        (
            c["status"].as_str(),
            c["first_step"].as_u64(),
            c["first_tensor"].as_str()
        ),
        (
            Some("disagrees"),
            Some(1),
            Some("decode.0001.layer.01.attn_out")
        )
    );
    // Isolated at the step through the candidate's own cached path: layer 00 matches, 01 is wrong.
    let statuses = common::statuses(&d["layers"]);
    assert_eq!(statuses, ["ok", "wrong"], "{stdout}");
    assert_eq!(
        (
            d["first_wrong_layer"].as_u64(),
            d["stage"]["block"].as_str()
        ),
        (Some(1), Some("attention"))
    );
    assert_eq!(d["stage"]["tensor"], "layer.01.attn_out");
    assert!(d["isolation_not_checked"].is_null());
}

#[test]
fn a_wrong_decay_on_a_carried_linear_state_is_named_as_the_cached_path_at_its_layer() {
    // tiny-qwen3_5: layers 00 and 02 linear, 01 full. Layer 02's decay is wrong only on a row
    // that continues a carried state: the prefill and the uncached recompute are correct.
    let cmd = defective("gdn-decay-cached@2");
    let (code, stdout, r) = bisect_generate(
        "tiny-qwen3_5",
        &["--candidate", "cmd", "--candidate-cmd", &cmd],
    );
    let d = &r["decode"];
    assert_eq!(
        (code, r["verdict"].as_str()),
        (6, Some("cached_decode_differs")),
        "{stdout}"
    );
    assert_eq!(r["whole_run"]["verdict"], "identical");
    assert_eq!(
        (
            d["first_diverging_step"].as_u64(),
            d["cache_check"]["status"].as_str()
        ),
        (Some(1), Some("disagrees"))
    );
    assert_eq!(d["first_diverging"], "decode.0001.layer.02.attn_out");
    // Isolated at step 1 through `layer --decode-from`: layer 00's state and layer 01's KV rows
    // carried from the prefill reproduce the whole run; layer 02's carried state is decayed wrong.
    let statuses = common::statuses(&d["layers"]);
    assert_eq!(statuses, ["ok", "ok", "wrong"], "{stdout}");
    assert_eq!(
        (
            d["first_wrong_layer"].as_u64(),
            d["stage"]["block"].as_str()
        ),
        (Some(2), Some("attention"))
    );
    assert_eq!(d["stage"]["tensor"], "layer.02.attn_out");
    assert!(d["isolation_not_checked"].is_null());
}

#[test]
fn a_candidate_without_decode_from_is_not_checked_at_the_step_never_a_pass() {
    let cmd = defective("late-pos");
    let (code, stdout, r) = bisect_generate(
        "tiny-qwen3",
        &["--candidate", "cmd", "--candidate-cmd", &cmd],
    );
    let d = &r["decode"];
    assert_eq!(
        (code, r["verdict"].as_str()),
        (4, Some("not_checked")),
        "{stdout}"
    );
    assert_eq!(d["first_diverging_step"], 1);
    assert_eq!(
        d["cache_check"]["status"], "agrees",
        "the planted defect is on both paths"
    );
    let why = d["isolation_not_checked"].as_str().unwrap();
    assert!(
        why.contains("unrecognized arguments: --decode-from") && why.contains("decode extension"),
        "{why}"
    );
    assert!(
        headline(&stdout).contains("isolation at step 1 NOT CHECKED"),
        "{stdout}"
    );
    assert_eq!(d["layers"][0]["status"], "not_checked");
}

#[test]
fn clean_engine_and_contract_say_nothing_wrong_naming_the_decode_steps() {
    for model in ["tiny-qwen3", "tiny-qwen3-moe"] {
        let (code, stdout, r) = bisect_generate(model, &["--candidate", "contract"]);
        let d = &r["decode"];
        assert_eq!(
            (code, r["verdict"].as_str()),
            (0, Some("nothing_wrong")),
            "{model}: {stdout}"
        );
        assert!(
            headline(&stdout).contains("decode steps 0-2 identical (3 of 3 steps compared)"),
            "{stdout}"
        );
        assert_eq!(
            (d["steps_compared"].as_u64(), d["generate"].as_u64()),
            (Some(3), Some(3))
        );
        assert!(
            d["first_diverging_step"].is_null()
                && d["cache_check"].is_null()
                && d["layers"].as_array().unwrap().is_empty()
        );
    }
}
