//! The field logs' incident classes as planted defects (docs/traps.md, traps 17-20), each in a
//! producer written as a port would be (tests/producers/field_plants.py, the contract with one
//! defect) and run by the command a porter would use; each must fail and be named at its place:
//! a bf16 store that truncates is a rounding mode in trace-diff, even inside the bf16 policy's
//! bounds (rounded to nearest even it passes; rounded away from zero it is named so); an
//! expert computed over rows instead of rows × width is that expert's tensor in its layer; a
//! Gated DeltaNet without its key-head repeat is its layer's linear attention; a diffusion
//! canvas attending to a prompt cache built from another hidden state is that pass and layer,
//! where the candidate's layer verb disagrees with its own whole run. The unplanted producer is
//! the negative control of each.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

use crate::common;
use common::{headline, repo, Bisected};

/// tests/producers/field_plants.py with `defect` planted, as a serving command template.
fn plant(defect: &str) -> String {
    format!(
        "'{}' '{}' --defect {defect} {{verb|serve}} {{args}}",
        common::python().display(),
        repo()
            .join("gate/tests/producers/field_plants.py")
            .display()
    )
}

/// `gate bisect` of `fixtures/MODEL` on prompt `short`, reference the engine, candidate the
/// plant, with `extra` arguments.
fn bisect(model: &str, defect: &str, extra: &[&str]) -> Bisected {
    let work = tempfile::tempdir_in(repo().join("target")).unwrap();
    let (model, cmd) = (format!("fixtures/{model}"), plant(defect));
    let settings = ["--model", &model, "--prompt", "short"];
    let all = [&settings[..], &common::against_engine(&cmd, extra)].concat();
    common::bisect(work.path(), &work.path().join("report.json"), &all)
}

/// The summary line (after "judged by …").
const PREFILL: [&str; 3] = ["--capture", "internals", "--all-layers"];

#[test]
fn an_expert_computed_over_rows_not_rows_times_width_is_that_expert_in_its_layer() {
    // tiny-qwen3-moe, prompt short: layer 1 routes rows 0, 2 and 3 to expert 4, so its kernel
    // writes 3 of the 3 × 44 elements and leaves the rest zero.
    let o = bisect("tiny-qwen3-moe", "expert-rows@1:4", &PREFILL);
    let r = &o.report;
    assert_eq!(o.code, 1, "{}", o.stdout);
    assert_eq!(r["verdict"], "wrong_layer", "{}", o.stdout);
    assert_eq!(r["first_wrong_layer"], 1, "{}", o.stdout);
    assert_eq!(r["stage"]["block"], "moe_expert", "{}", o.stdout);
    assert_eq!(
        r["stage"]["tensor"], "layer.01.expert.004.out",
        "{}",
        o.stdout
    );
    assert_eq!(
        common::statuses(&r["layers"]),
        ["ok", "wrong", "inherits", "inherits"],
        "{}",
        o.stdout
    );
    assert_eq!(r["layers"][1]["self_check"], "consistent", "{}", o.stdout);
    // The router and the experts computed before it match: the place is the expert, not the MoE.
    let matching = r["stage"]["matching"].to_string();
    assert!(
        matching.contains("router.topk") && matching.contains("expert.002.out"),
        "{matching}"
    );
    assert!(
        headline(&o.stdout).contains("layer 01 body is wrong: expert.004.out differs"),
        "{}",
        o.stdout
    );
    // Negative control: the same producer with nothing planted.
    let o = bisect("tiny-qwen3-moe", "none", &PREFILL);
    assert_eq!(o.code, 0, "{}", o.stdout);
    assert_eq!(o.report["verdict"], "nothing_wrong", "{}", o.stdout);
}

#[test]
fn a_gated_deltanet_without_its_key_head_repeat_is_that_layers_linear_attention() {
    // tiny-qwen3_5: 2 key heads to 4 value heads (a fixture with equal counts could not tell),
    // linear-attention layers 0, 2 and 3. Value head h reads head h's slot for its query and
    // key instead of head h / 2's: value heads 1-3 pair the wrong heads.
    let o = bisect("tiny-qwen3_5", "gdn-no-repeat@2", &PREFILL);
    let r = &o.report;
    assert_eq!(o.code, 1, "{}", o.stdout);
    assert_eq!(r["verdict"], "wrong_layer", "{}", o.stdout);
    assert_eq!(r["first_wrong_layer"], 2, "{}", o.stdout);
    assert_eq!(r["stage"]["block"], "attention", "{}", o.stdout);
    assert_eq!(r["stage"]["tensor"], "layer.02.linear.core", "{}", o.stdout);
    assert_eq!(
        common::statuses(&r["layers"]),
        ["ok", "ok", "wrong", "inherits", "inherits"],
        "{}",
        o.stdout
    );
    // The conv, the normalised per-key-head q and k, the decay and beta come before the
    // repeat: they match, and the delta rule's output is the first to differ.
    let matching = common::matching(r);
    assert_eq!(
        matching,
        [
            "hidden_in",
            "linear.conv_out",
            "linear.q",
            "linear.k",
            "linear.g",
            "linear.beta"
        ]
    );
    assert_eq!(r["layers"][2]["self_check"], "consistent", "{}", o.stdout);
    assert!(
        headline(&o.stdout).contains("layer 02 body is wrong: linear.core differs"),
        "{}",
        o.stdout
    );
}

/// `gate bisect --generate 14 --seed 3` on tiny-diffusion-gemma (dg0's settings).
fn diffusion(defect: &str) -> Bisected {
    bisect(
        "tiny-diffusion-gemma",
        defect,
        &["--generate", "14", "--seed", "3"],
    )
}

#[test]
fn a_canvas_reading_a_prompt_cache_built_from_another_hidden_state_is_named_at_its_pass_and_layer()
{
    for (defect, layer) in [("dg-cache-prenorm@1", 1u64), ("dg-cache-prev@2", 2)] {
        let o = diffusion(defect);
        let (r, d) = (&o.report, &o.report["diffusion"]);
        let say = format!("{defect}: {}", o.stdout);
        assert_eq!(o.code, 1, "{say}");
        // The prompt's pass, its k and v included, is the reference's: the cache is not.
        assert!(r["first_wrong_layer"].is_null(), "{say}");
        assert_eq!(d["place"], "block 0 step 0", "{say}");
        assert_eq!(d["first_diverging_pass"], "denoise.0000.0000.", "{say}");
        assert_eq!(
            d["first_diverging"],
            format!("denoise.0000.0000.layer.{layer:02}.attn_probs"),
            "{say}"
        );
        // Its input agrees and its body matches on the reference's keys: no body is wrong, and
        // the layer did not inherit the difference; its layer verb (which reads the keys its
        // trace records) disagrees with its own whole run there.
        assert_eq!(r["verdict"], "inconsistent_producer", "{say}");
        let l = layer as usize;
        assert_eq!(d["layers"][l]["isolation"], "match", "{say}");
        assert_eq!(d["layers"][l]["status"], "inconsistent", "{say}");
        assert_eq!(d["layers"][l]["self_check"], "inconsistent", "{say}");
        assert_eq!(d["inconsistent"]["layer"], layer, "{say}");
        assert!(
            r["summary"].as_str().unwrap().contains(&format!(
                "at block 0 step 0 the candidate's layer verb disagrees with its own whole run at layer {layer:02}"
            )),
            "{say}"
        );
        assert!(
            !r["summary"].as_str().unwrap().contains("accumulates"),
            "{say}"
        );
    }
    // Negative control: the unplanted producer agrees on every pass.
    let o = diffusion("none");
    assert_eq!(o.code, 0, "{}", o.stdout);
    assert_eq!(o.report["verdict"], "nothing_wrong", "{}", o.stdout);
}

/// trace-diff, built beside the gate (`cargo build --release --bins`).
fn trace_diff() -> PathBuf {
    common::sibling("trace-diff")
}

/// The plant's `trace` verb on tiny-qwen3-moe (bf16 weights: its embedding rows are exact in
/// bf16, so no rule that holds embed.out to 0 ULP can see the store) into `dir`.
fn traced(dir: &Path, defect: &str) -> PathBuf {
    let out = dir.join(format!("{defect}.trace"));
    let run = Command::new(common::python())
        .arg(repo().join("gate/tests/producers/field_plants.py"))
        .args(["--defect", defect, "trace", "--model"])
        .arg(repo().join("fixtures/tiny-qwen3-moe"))
        .args([
            "--tokens",
            "12,218,345,152,81,438,493",
            "--capture",
            "internals",
        ])
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{defect}: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    out
}

#[test]
fn a_bf16_store_that_truncates_is_a_rounding_mode_not_noise() {
    let dir = tempfile::tempdir_in(repo().join("target")).unwrap();
    let reference = traced(dir.path(), "none");
    let diff = |defect: &str| {
        let cand = traced(dir.path(), defect);
        let out = Command::new(trace_diff())
            .args(["--policy", "bf16", "--json"])
            .arg(&reference)
            .arg(&cand)
            .output()
            .unwrap();
        let text = Command::new(trace_diff())
            .args(["--policy", "bf16"])
            .arg(&reference)
            .arg(&cand)
            .output()
            .unwrap();
        let rep: Value = serde_json::from_slice(&out.stdout).unwrap();
        let text = String::from_utf8_lossy(&text.stdout).to_string();
        (out.status.code(), rep, text)
    };
    let rounding = |rep: &Value| -> Vec<Value> {
        rep["findings"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|f| f["kind"] == "rounding_mode")
            .cloned()
            .collect()
    };
    // Rounded to nearest even, the store is honest bf16: within the policy, nothing said.
    let (code, rep, text) = diff("bf16-rne");
    assert_eq!(
        (code, rep["verdict"].as_str()),
        (Some(0), Some("within_policy")),
        "{text}"
    );
    assert!(rounding(&rep).is_empty(), "{text}");
    // Truncated: every tensor is still within the policy's bounds, and the comparison fails,
    // naming the rounding mode at the first tensor it shows in.
    let (code, rep, text) = diff("bf16-trunc");
    assert_eq!(
        (code, rep["verdict"].as_str()),
        (Some(1), Some("different")),
        "{text}"
    );
    assert!(
        rep["per_tensor"]
            .as_array()
            .unwrap()
            .iter()
            .all(|r| r["status"] == "within_policy"),
        "{text}"
    );
    let found = rounding(&rep);
    assert_eq!(found.len(), 1, "{text}");
    assert_eq!(found[0]["tensor"], "layer.00.q", "{text}");
    let detail = found[0]["detail"].as_str().unwrap();
    assert!(
        detail.contains("truncated (rounded towards zero), not rounded to nearest even"),
        "{detail}"
    );
    let first = text.lines().next().unwrap_or("");
    assert!(
        first.starts_with("DIFFERENT")
            && first.contains(
                "rounding mode: bf16 truncated where it should round to nearest even (first: layer.00.q)"
            ),
        "{first}"
    );
    // Another wrong mode is named as itself, never as truncation.
    let (code, rep, text) = diff("bf16-up");
    assert_eq!(code, Some(1), "{text}");
    let found = rounding(&rep);
    assert_eq!(found.len(), 1, "{text}");
    let detail = found[0]["detail"].as_str().unwrap();
    assert!(detail.contains("rounded away from zero"), "{detail}");
    assert!(!detail.contains("truncated"), "{detail}");
}
