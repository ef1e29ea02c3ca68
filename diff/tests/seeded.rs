//! The seeded-failure suite: each test plants one defect in a model-shaped trace and checks
//! that the differ names exactly that defect (and would fail without the feature).

use crate::common;

use common::*;
use serde_json::json;
use tracegate_diff::{compare_files, Options, Policy, Report, RowSet, Special, Verdict};
use tracegate_trace::DType;

/// The findings' kinds but the early exit's note on what was verified (tests/early.rs).
fn kinds(rep: &tracegate_diff::Report) -> Vec<&'static str> {
    rep.findings
        .iter()
        .filter(|f| f.kind != tracegate_diff::FindingKind::VerifiedInPart)
        .map(|f| f.kind.as_str())
        .collect()
}

#[test]
fn identical_traces_match_by_digest() {
    let m = model();
    let rep = diff_with(&m, &m, &Options::default());
    assert_eq!(rep.verdict, Verdict::Identical);
    assert_eq!(rep.tensors.matched_by_digest.len(), 13);
    assert!(rep.tensors.compared_elementwise.is_empty());
    assert_eq!(rep.decisions.compared, 3);
    assert!(rep.findings.is_empty(), "{:?}", rep.findings);
}

#[test]
fn no_verify_trusts_no_digest() {
    let m = model();
    let opts = Options {
        verify: false,
        ..Options::default()
    };
    let rep = diff_with(&m, &m, &opts);
    assert_eq!(rep.verdict, Verdict::Identical);
    assert!(rep.tensors.matched_by_digest.is_empty());
    assert_eq!(rep.tensors.compared_elementwise.len(), 13);
}

#[test]
fn one_ulp_change_is_located_to_the_element() {
    let r = model();
    let mut c = model();
    // layer.01.attn_out is [4, 8]: flat 21 = [2, 5].
    c.poke_f32_bits("layer.01.attn_out", 21, |b| b + 1);
    let rep = diff_with(&r, &c, &Options::default());
    assert_eq!(rep.verdict, Verdict::Different);
    let d = rep.first_divergence.as_ref().unwrap();
    assert_eq!(d.tensor, "layer.01.attn_out");
    assert_eq!((d.flat_index, d.coords.clone()), (21, vec![2, 5]));
    assert_eq!(d.ulp, Some(1));
    assert_eq!((d.differing_elements, d.total_elements), (1, 32));
    assert_eq!((d.max_ulp, d.median_ulp), (Some(1), Some(1)));
    let rv: f32 = d.reference_value.parse().unwrap();
    let cv: f32 = d.candidate_value.parse().unwrap();
    assert_eq!(
        cv.to_bits(),
        rv.to_bits() + 1,
        "printed values must round-trip exactly"
    );
    assert_eq!(d.reference_bits, format!("0x{:08x}", rv.to_bits()));
    assert!(d.special.is_none());
    // Everything before it was matched by digest, it alone element by element.
    assert_eq!(
        rep.names(RowSet::CompareElementwise).collect::<Vec<_>>(),
        vec!["layer.01.attn_out"]
    );
    assert_eq!(rep.tensors.matched_by_digest.len(), 12);
}

#[test]
fn a_later_second_change_is_hidden_by_default_and_shown_by_all() {
    let r = model();
    let mut c = model();
    c.poke_f32_bits("layer.00.mlp_out", 3, |b| b + 2);
    for i in 0..32 {
        c.poke_f32_bits("layer.01.mlp_out", i, |b| b + 5);
    }
    let rep = diff_with(&r, &c, &Options::default());
    assert_eq!(
        rep.first_divergence.as_ref().unwrap().tensor,
        "layer.00.mlp_out"
    );
    let later = tensor_row(&rep, "layer.01.mlp_out");
    assert_eq!(
        (
            later.method.as_str(),
            later.status.as_str(),
            later.differing_elements
        ),
        ("not_scanned", "differs_by_digest", None)
    );
    assert!(rep
        .names(RowSet::KnownDifferent)
        .any(|n| n == "layer.01.mlp_out"));
    // Not reported: no finding names it, and the human report only counts what was not scanned.
    assert_eq!(
        rep.findings
            .iter()
            .filter(|f| f.kind != tracegate_diff::FindingKind::VerifiedInPart)
            .map(|f| (f.kind.as_str(), f.tensor()))
            .collect::<Vec<_>>(),
        vec![("values_differ", Some("layer.00.mlp_out"))]
    );
    let human = tracegate_diff::render_human(&rep);
    assert!(!human.contains("layer.01.mlp_out"), "{human}");
    assert!(
        human.contains("not scanned after the first difference: "),
        "{human}"
    );

    let rep = diff_with(
        &r,
        &c,
        &Options {
            all: true,
            ..Options::default()
        },
    );
    assert_eq!(rep.scan, "all");
    assert_eq!(
        rep.first_divergence.as_ref().unwrap().tensor,
        "layer.00.mlp_out"
    );
    let later = tensor_row(&rep, "layer.01.mlp_out");
    assert_eq!(
        (
            later.method.as_str(),
            later.status.as_str(),
            later.differing_elements
        ),
        ("elementwise", "different", Some(32))
    );
    assert_eq!(
        (later.max_ulp, later.median_ulp),
        (Some(5), None),
        "the median is computed for the first divergence only"
    );
    assert!(rep.tensors.not_scanned.is_empty());
}

#[test]
fn a_transposed_tensor_is_a_shape_finding() {
    let r = model();
    let mut c = model();
    let t = c.tensor_mut("layer.00.attn_out");
    let v: Vec<f32> = t
        .bytes
        .chunks(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    let transposed: Vec<f32> = (0..32).map(|i| v[(i % 4) * 8 + i / 4]).collect();
    *t = t_f32("layer.00.attn_out", &[8, 4], &transposed);
    let rep = diff_with(&r, &c, &Options::default());
    assert_eq!(rep.verdict, Verdict::Different);
    assert_eq!(kinds(&rep), vec!["shape_mismatch"]);
    assert!(rep.findings[0]
        .detail
        .contains("[4, 8] vs candidate [8, 4]"));
    assert!(
        rep.first_divergence.is_none(),
        "a shape finding is not a byte difference"
    );
}

#[test]
fn a_flipped_topk_with_identical_floats_is_reported() {
    let r = model();
    let mut c = model();
    // Row 2 of layer.00 keeps its first expert and swaps its second for one the reference did
    // not choose; every tensor stays bit-identical.
    let chosen = r.decisions[0].values[4..6].to_vec();
    let other = (0..4).find(|e| !chosen.contains(e)).unwrap();
    c.decision_mut("layer.00.router.topk").values[5] = other;
    let rep = diff_with(&r, &c, &Options::default());
    assert_eq!(rep.verdict, Verdict::Different);
    assert_eq!(rep.tensors.matched_by_digest.len(), 13);
    assert!(rep.first_divergence.is_none());
    let d = rep.first_decision_divergence.as_ref().unwrap();
    assert_eq!((d.name.as_str(), d.row), ("layer.00.router.topk", 2));
    assert_eq!(
        (d.reference.clone(), d.candidate.clone()),
        (chosen.clone(), vec![chosen[0], other])
    );
    assert!(!d.same_values_different_order);
    assert_eq!(
        d.reference_margin.unwrap().0,
        r.decisions[0].margins.as_ref().unwrap()[2] as f64
    );
    assert_eq!((rep.decisions.compared, rep.decisions.differing), (3, 1));
    // The source tensor is bit-identical, so a flip cannot be a near-tie: the rule differs.
    let res = decision_result(&rep, "layer.00.router.topk");
    assert_eq!(res.source.as_deref(), Some("layer.00.router.logits"));
    assert_eq!(res.flips[0].label.as_str(), "defect");
}

#[test]
fn a_reordered_topk_is_same_values_different_order() {
    let r = model();
    let mut c = model();
    c.decision_mut("layer.01.router.topk").values.swap(2, 3);
    let rep = diff_with(&r, &c, &Options::default());
    let d = rep.first_decision_divergence.as_ref().unwrap();
    assert_eq!((d.name.as_str(), d.row), ("layer.01.router.topk", 1));
    let row = r.decisions[1].values[2..4].to_vec();
    assert_eq!(
        (d.reference.clone(), d.candidate.clone()),
        (row.clone(), vec![row[1], row[0]])
    );
    assert!(d.same_values_different_order);
    let res = decision_result(&rep, "layer.01.router.topk");
    assert_eq!(
        (res.differing_rows, res.reordered_rows, res.rows),
        (1, 1, 4)
    );
}

#[test]
fn without_a_policy_flips_after_a_bit_difference_are_consequences() {
    let r = model();
    let mut c = model();
    // logits row 2 has margin 1e-7 in the reference; the candidate's logits row 2 moved by
    // ~1e-6, and its argmax flipped; row 0 (margin 1.5) flipped too. Judged by bits there is no
    // near-tie: the source differs, so both are its consequences (labels.rs: under a policy).
    for i in 32..48 {
        c.poke_f32_bits("logits", i, |b| b + 4);
    }
    c.poke_f32_bits("logits", 0, |b| b + 1);
    c.decision_mut("logits.argmax").values[2] = 3;
    c.decision_mut("logits.argmax").values[0] = 6;
    let rep = diff_with(&r, &c, &Options::default());
    let res = decision_result(&rep, "logits.argmax");
    assert_eq!(res.source.as_deref(), Some("logits"));
    let by_row = |row: u64| res.flips.iter().find(|f| f.row == row).unwrap();
    for row in [2, 0] {
        assert_eq!(
            (by_row(row).label.as_str(), by_row(row).upstream.as_deref()),
            ("consequence", Some("logits"))
        );
    }
    assert!(by_row(2).source_divergence.unwrap().0 > 1e-7);
    assert_eq!(
        by_row(0).reference_margin.unwrap().0,
        r.decisions[2].margins.as_ref().unwrap()[0] as f64
    );
}

#[test]
fn missing_and_extra_tensors_and_decisions() {
    let r = model();
    let mut c = model();
    c.tensors.retain(|t| t.name != "layer.01.hidden_in");
    c.tensors.push(t_f32("layer.01.q", &[4, 8], &values(32, 5)));
    c.decisions.retain(|d| d.name != "logits.argmax");
    c.decisions.push(D {
        name: "decode.0000.argmax".into(),
        shape: vec![1],
        values: vec![3],
        margins: None,
    });
    let rep = diff_with(&r, &c, &Options::default());
    assert_eq!(rep.verdict, Verdict::Different);
    assert_eq!(rep.tensors.missing, vec!["layer.01.hidden_in".to_string()]);
    assert_eq!(rep.tensors.extra, vec!["layer.01.q".to_string()]);
    assert_eq!(rep.decisions.missing, vec!["logits.argmax".to_string()]);
    assert_eq!(rep.decisions.extra, vec!["decode.0000.argmax".to_string()]);
    let k = kinds(&rep);
    for want in [
        "missing_tensor",
        "extra_tensor",
        "missing_decision",
        "extra_decision",
    ] {
        assert!(k.contains(&want), "{want} not in {k:?}");
    }
    assert!(rep.first_divergence.is_none());
}

#[test]
fn order_differences_are_structure_findings() {
    let r = model();
    let mut c = model();
    c.tensors.swap(2, 3);
    let rep = diff_with(&r, &c, &Options::default());
    assert_eq!(kinds(&rep), vec!["order_mismatch"]);
    assert_eq!(rep.findings[0].tensor(), Some("layer.00.attn_out"));
}

#[test]
fn signed_zero_is_named_not_counted_as_distance() {
    let mut r = model();
    let mut c = model();
    r.set_f32("layer.00.hidden_out", 7, 0.0);
    c.set_f32("layer.00.hidden_out", 7, -0.0);
    let rep = diff_with(&r, &c, &Options::default());
    let d = rep.first_divergence.as_ref().unwrap();
    assert_eq!(
        (d.special, d.ulp, d.max_ulp),
        (Some(Special::SignedZero), Some(0), Some(0))
    );
    assert_eq!(
        (d.reference_value.as_str(), d.candidate_value.as_str()),
        ("0", "-0")
    );
    assert_eq!(
        (d.reference_bits.as_str(), d.candidate_bits.as_str()),
        ("0x00000000", "0x80000000")
    );
    assert_eq!(d.differing_elements, 1);
    assert!(kinds(&rep).contains(&"signed_zero"));
}

#[test]
fn nan_payload_and_nan_mismatch_are_named() {
    let mut r = model();
    let mut c = model();
    r.poke_f32_bits("final_norm.out", 1, |_| 0x7fc0_0000);
    c.poke_f32_bits("final_norm.out", 1, |_| 0x7fc0_0001);
    c.poke_f32_bits("final_norm.out", 9, |_| 0x7fc0_0000);
    let rep = diff_with(&r, &c, &Options::default());
    let d = rep.first_divergence.as_ref().unwrap();
    assert_eq!((d.special, d.ulp), (Some(Special::NanPayload), None));
    assert_eq!(
        (d.reference_value.as_str(), d.candidate_value.as_str()),
        ("NaN", "NaN")
    );
    assert_eq!(
        (d.reference_bits.as_str(), d.candidate_bits.as_str()),
        ("0x7fc00000", "0x7fc00001")
    );
    assert_eq!(d.differing_elements, 2);
    assert_eq!(
        d.max_ulp, None,
        "NaN pairs have no distance, so no huge number appears"
    );
    let k = kinds(&rep);
    assert!(
        k.contains(&"nan_payload") && k.contains(&"nan_mismatch"),
        "{k:?}"
    );
}

#[test]
fn infinities_are_handled() {
    let mut r = model();
    let mut c = model();
    r.set_f32("logits", 4, f32::MAX);
    c.set_f32("logits", 4, f32::INFINITY);
    let rep = diff_with(&r, &c, &Options::default());
    let d = rep.first_divergence.as_ref().unwrap();
    assert_eq!((d.special, d.ulp), (Some(Special::Infinity), Some(1)));
    assert_eq!(d.candidate_value, "inf");
}

fn half_pair(dtype: DType, a: u16, b: u16) -> (Spec, Spec) {
    let mut r = model();
    let bytes: Vec<u8> = (0..8u16)
        .flat_map(|i| (0x3c00u16 + i).to_le_bytes())
        .collect();
    r.tensors.push(t_raw("extra.half", dtype, &[8], bytes));
    let mut c = r.clone();
    r.tensor_mut("extra.half").bytes[6..8].copy_from_slice(&a.to_le_bytes());
    c.tensor_mut("extra.half").bytes[6..8].copy_from_slice(&b.to_le_bytes());
    (r, c)
}

#[test]
fn bf16_ulps_are_bf16_steps() {
    let one = half::bf16::from_f32(1.0).to_bits();
    let (r, c) = half_pair(DType::BF16, one, one + 3);
    let d = diff_with(&r, &c, &Options::default())
        .first_divergence
        .unwrap();
    assert_eq!(
        (d.tensor.as_str(), d.flat_index, d.ulp),
        ("extra.half", 3, Some(3))
    );
    assert_eq!(
        (d.reference_value.as_str(), d.candidate_value.as_str()),
        ("1", "1.02")
    );
    assert_eq!(
        (d.reference_bits.as_str(), d.candidate_bits.as_str()),
        ("0x3f80", "0x3f83")
    );
}

#[test]
fn f16_ulps_are_f16_steps_and_cross_zero() {
    // Smallest positive subnormal against the smallest negative one: 2 steps.
    let (r, c) = half_pair(DType::F16, 0x0001, 0x8001);
    let d = diff_with(&r, &c, &Options::default())
        .first_divergence
        .unwrap();
    assert_eq!(d.ulp, Some(2));
    assert_eq!(
        (d.reference_value.as_str(), d.candidate_value.as_str()),
        ("6e-8", "-6e-8")
    );
}

#[test]
fn f64_ulps_are_f64_steps() {
    let mut r = model();
    let vals: Vec<u8> = [1.0f64, 2.0, 3.0]
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    r.tensors.push(t_raw("extra.f64", DType::F64, &[3], vals));
    let mut c = r.clone();
    let bits = 2.0f64.to_bits() - 1000;
    c.tensor_mut("extra.f64").bytes[8..16].copy_from_slice(&bits.to_le_bytes());
    let d = diff_with(&r, &c, &Options::default())
        .first_divergence
        .unwrap();
    assert_eq!((d.flat_index, d.ulp), (1, Some(1000)));
    assert_eq!(d.reference_value, "2");
    assert_eq!(d.candidate_value, format!("{}", f64::from_bits(bits)));
}

#[test]
fn integer_tensors_report_absolute_difference() {
    let mut r = model();
    let ids: Vec<u8> = [5i32, -7, 9].iter().flat_map(|x| x.to_le_bytes()).collect();
    r.tensors.push(t_raw("extra.ids", DType::I32, &[3], ids));
    let mut c = r.clone();
    c.tensor_mut("extra.ids").bytes[4..8].copy_from_slice(&12i32.to_le_bytes());
    let d = diff_with(&r, &c, &Options::default())
        .first_divergence
        .unwrap();
    assert_eq!(
        (
            d.ulp,
            d.reference_value.as_str(),
            d.candidate_value.as_str()
        ),
        (Some(19), "-7", "12")
    );
}

#[test]
fn path_mask_and_positions_mismatches_are_refused() {
    for (field, kind) in [
        ("path", "path_mismatch"),
        ("mask", "mask_mismatch"),
        ("positions", "positions_mismatch"),
    ] {
        let r = model();
        let mut c = model();
        let a = &mut c.tensor_mut("layer.00.attn_out").attrs;
        match field {
            "path" => a.path = Some("decode".into()),
            "mask" => a.mask = Some("bidirectional".into()),
            _ => a.positions = Some(vec![1, 2, 3, 4]),
        }
        // Even with a value difference elsewhere, refusal comes first.
        c.poke_f32_bits("embed.out", 0, |b| b + 1);
        let rep = diff_with(&r, &c, &Options::default());
        assert_eq!(rep.verdict, Verdict::Incomparable, "{field}");
        assert_eq!(rep.exit_code(), 3);
        assert_eq!(kinds(&rep), vec![kind]);
        assert_eq!(rep.findings[0].tensor(), Some("layer.00.attn_out"));
        assert!(rep.first_divergence.is_none());
    }
}

#[test]
fn attribute_mismatch_is_refused_even_with_equal_bytes() {
    // Same bytes, same digest per tensor — but a different mask: not comparable.
    let r = model();
    let mut c = model();
    c.tensor_mut("logits").attrs.mask = Some("bidirectional".into());
    let rep = diff_with(&r, &c, &Options::default());
    assert_eq!(rep.verdict, Verdict::Incomparable);
}

#[test]
fn weights_and_prompt_mismatches_are_refused() {
    let r = model();
    let mut c = model();
    c.provenance["weights_digest"] = json!("w-9999");
    c.provenance["prompt_tokens"] = json!([1, 15, 27, 10]);
    let rep = diff_with(&r, &c, &Options::default());
    assert_eq!(rep.verdict, Verdict::Incomparable);
    assert_eq!(kinds(&rep), vec!["weights_mismatch", "prompt_mismatch"]);
}

#[test]
fn oracle_stack_mismatch_is_refused_then_allowed_with_the_flag() {
    let mut r = model();
    r.provenance = oracle_provenance();
    let mut c = r.clone();
    c.provenance["versions"]["transformers"] = json!("4.48.0");
    c.provenance["device"] = json!("cuda");
    let rep = diff_with(&r, &c, &Options::default());
    assert_eq!(rep.verdict, Verdict::Incomparable);
    assert_eq!(kinds(&rep), vec!["stack_mismatch", "stack_mismatch"]);
    assert!(rep.findings[0]
        .detail
        .contains("versions.transformers is 4.47.0 in the reference, 4.48.0"));

    let allowed = Options {
        allow_stack_mismatch: true,
        ..Options::default()
    };
    let rep = diff_with(&r, &c, &allowed);
    assert_eq!(rep.verdict, Verdict::Identical);
    assert_eq!(
        kinds(&rep),
        vec!["stack_mismatch_allowed", "stack_mismatch_allowed"]
    );

    // The flag downgrades only the stack rule.
    c.provenance["weights_digest"] = json!("w-other");
    let rep = diff_with(&r, &c, &allowed);
    assert_eq!(rep.verdict, Verdict::Incomparable);
}

#[test]
fn a_port_that_names_itself_the_oracle_is_told_so_not_offered_the_stack_flag() {
    // A port's provenance says producer "oracle" (copied from an oracle trace) without the
    // torch version every oracle run records: once five stack_mismatch refusals, each advising
    // --allow-stack-mismatch, which would compare it as though it were an oracle run.
    let mut r = model();
    r.provenance = oracle_provenance();
    let mut c = model();
    c.provenance["producer"] = json!("oracle");
    for allow in [false, true] {
        let rep = diff_with(
            &r,
            &c,
            &Options {
                allow_stack_mismatch: allow,
                ..Options::default()
            },
        );
        assert_eq!(rep.verdict, Verdict::Incomparable, "allow {allow}");
        assert_eq!(kinds(&rep), vec!["stack_mismatch"], "allow {allow}");
        let said = &rep.findings[0].detail;
        assert!(
            said.starts_with("the candidate claims to be the oracle: its provenance says producer \"oracle\" but records no versions.torch")
                && said.contains("record your engine's own name as `producer`")
                && !said.contains("--allow-stack-mismatch"),
            "{said}"
        );
    }
    // The control: named as itself, the same run is compared (an engine against the oracle
    // differs in stack by construction).
    c.provenance["producer"] = json!("my-port");
    let rep = diff_with(&r, &c, &Options::default());
    assert_eq!(rep.verdict, Verdict::Identical, "{:?}", rep.findings);
}

#[test]
fn comparability_names_each_side_as_its_caller_does() {
    // The gate compares a port's run (first) with its golden trace (second); named "reference"
    // and "candidate", a port with foreign weights read as though the golden trace's digest
    // were the foreign one.
    let port = model();
    let mut golden = model();
    golden.provenance = oracle_provenance();
    let mut port = port;
    let sha = "ab".repeat(32);
    let ours = "0123456789abcdef0123456789abcdef";
    port.provenance["weights_digest"] = json!(sha);
    golden.provenance["weights_digest"] = json!(ours);
    let (_dir, pp, gp) = pair(&port, &golden);
    let (p, g) = (
        tracegate_trace::Trace::open(&pp).unwrap(),
        tracegate_trace::Trace::open(&gp).unwrap(),
    );
    let (refused, _) =
        tracegate_diff::comparable::check_sides(&p, &g, ("candidate", "golden"), false);
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert_eq!(
        refused[0].detail,
        format!("weights_digest differs: {sha} in the candidate, {ours} in the golden (the candidate's is not a tracegate weights digest: record tracegate.weights_digest(model_dir) / tracegate_trace::weights_digest, xxh3-128 of the *.safetensors files in name order, 32 hex digits)")
    );
    // `check` keeps its own names: its first trace is the reference.
    let (refused, _) = tracegate_diff::comparable::check(&p, &g, false);
    assert!(refused[0].detail.contains(&format!(
        "in the reference, {ours} in the candidate (the reference's is not"
    )));
}

#[test]
fn engine_against_oracle_is_not_a_stack_mismatch() {
    let r = model();
    let mut c = model();
    c.provenance = oracle_provenance();
    let rep = diff_with(&r, &c, &Options::default());
    assert_eq!(rep.verdict, Verdict::Identical);
}

#[test]
fn tampered_trace_is_unreadable() {
    let m = model();
    let (_dir, rp, cp) = pair(&m, &m);
    let off = tracegate_trace::Trace::open(&cp)
        .unwrap()
        .tensor_info("layer.01.mlp_out")
        .unwrap()
        .offset;
    let mut bytes = std::fs::read(&cp).unwrap();
    bytes[off as usize + 5] ^= 0x10;
    std::fs::write(&cp, bytes).unwrap();
    let rep = compare_files(&rp, &cp, &Options::default());
    assert_eq!(rep.verdict, Verdict::Unreadable);
    assert_eq!(rep.exit_code(), 2);
    assert!(
        rep.findings[0].detail.contains("layer.01.mlp_out"),
        "{}",
        rep.findings[0].detail
    );
    // With --no-verify the edit is compared as a value difference instead.
    let rep = compare_files(
        &rp,
        &cp,
        &Options {
            verify: false,
            ..Options::default()
        },
    );
    assert_eq!(rep.first_divergence.unwrap().tensor, "layer.01.mlp_out");
}

#[test]
fn policy_pass() {
    let (r, c) = oracle_like_pair();
    let policy = Policy::load(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../fixtures/policy/oracle-default.json"),
    )
    .unwrap();
    let rep = diff(&r, &c, Some(policy));
    assert_eq!(rep.verdict, Verdict::WithinPolicy, "{:?}", rep.findings);
    assert_eq!(rep.exit_code(), 0);
    // Every tensor compared (not stop-at-first) and judged by a named rule.
    assert_eq!(rep.per_tensor.len(), 13);
    let embed = &rep.per_tensor[0];
    assert_eq!(
        (
            embed.status.as_str(),
            embed.rule.as_ref().unwrap().pattern.as_str()
        ),
        ("identical", "embed.out")
    );
    let attn = tensor_row(&rep, "layer.01.attn_out");
    assert_eq!(
        (
            attn.status.as_str(),
            attn.rule.as_ref().unwrap().pattern.as_str()
        ),
        ("within_policy", "layer.*.attn_out")
    );
}

#[test]
fn policy_fail_and_unmatched_tensor() {
    let (r, mut c) = oracle_like_pair();
    c.set_f32("layer.00.mlp_out", 5, 100.0);
    c.decision_mut("logits.argmax").values[1] = 0;
    let mut with_extra = r.clone();
    with_extra
        .tensors
        .push(t_f32("custom.probe", &[2], &[1.0, 2.0]));
    c.tensors.push(t_f32("custom.probe", &[2], &[1.0, 2.0]));
    let policy = Policy::load(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../fixtures/policy/oracle-default.json"),
    )
    .unwrap();
    let rep = diff(&with_extra, &c, Some(policy));
    assert_eq!(rep.verdict, Verdict::Different);
    let mlp = tensor_row(&rep, "layer.00.mlp_out");
    assert_eq!(mlp.status.as_str(), "outside_policy");
    assert!(
        mlp.violations.iter().any(|v| v.bound == "max_rel_l2"),
        "{:?}",
        mlp.violations
    );
    let probe = tensor_row(&rep, "custom.probe");
    assert_eq!(
        (probe.status.as_str(), probe.rule.is_none()),
        ("no_rule", true)
    );
    let k = kinds(&rep);
    assert!(
        k.contains(&"outside_policy")
            && k.contains(&"no_policy_rule")
            && k.contains(&"decision_differs"),
        "{k:?}"
    );
    // Decisions stay exact under a policy.
    assert_eq!(rep.decisions.differing, 1);
}

#[test]
fn policy_rejects_a_bad_file() {
    assert!(Policy::parse(
        r#"{"format":"tracegate-policy/1","name":"x","rules":[{"pattern":"a"}]}"#
    )
    .is_err());
    assert!(Policy::parse(r#"{"format":"other","name":"x","rules":[]}"#).is_err());
    assert!(Policy::parse(
        r#"{"format":"tracegate-policy/1","name":"x","rules":[{"pattern":"a","max_ulps":1}]}"#
    )
    .is_err());
}

// --- content the digest covers beyond tensor bytes: margins and every attribute (issue 12) ---

/// The one finding of `kind`, which must name `name`.
fn only_finding<'a>(
    rep: &'a tracegate_diff::Report,
    kind: &str,
    name: &str,
) -> &'a tracegate_diff::Finding {
    let found: Vec<_> = rep
        .findings
        .iter()
        .filter(|f| f.kind.as_str() == kind)
        .collect();
    assert_eq!(found.len(), 1, "{:?}", rep.findings);
    assert_eq!(found[0].tensor(), Some(name), "{:?}", found[0]);
    found[0]
}

/// `c` against `r` with --verify and without: both reports, each asserted Different (`what`
/// names the change in the message).
fn different_with_and_without_verify(r: &Spec, c: &Spec, what: &str) -> [Report; 2] {
    [true, false].map(|verify| {
        let rep = diff_with(
            r,
            c,
            &Options {
                verify,
                ..Options::default()
            },
        );
        assert_eq!(
            rep.verdict,
            Verdict::Different,
            "{what}, verify {verify}: {:?}",
            rep.findings
        );
        rep
    })
}

#[test]
fn a_changed_margin_is_different_with_and_without_verify() {
    let r = model();
    let mut c = model();
    c.decision_mut("logits.argmax").margins.as_mut().unwrap()[3] = 1e6;
    for rep in different_with_and_without_verify(&r, &c, "a changed margin") {
        let f = only_finding(&rep, "margin_differs", "logits.argmax");
        assert!(
            f.detail.contains("1 of 4 rows")
                && f.detail.contains("row 3")
                && f.detail.contains("1e6"),
            "{}",
            f.detail
        );
        let res = decision_result(&rep, "logits.argmax");
        assert_eq!(
            (
                res.margins.as_str(),
                res.margin_differing_rows,
                res.status.as_str()
            ),
            ("different", 1, "identical")
        );
        assert_eq!(
            kinds(&rep),
            vec!["margin_contradicts_scores", "margin_differs"],
            "values are equal, so nothing else is reported but the margin's own contradiction of the candidate's logits"
        );
    }
}

#[test]
fn a_negative_zero_margin_differs_from_a_positive_zero() {
    let mut r = model();
    r.decision_mut("logits.argmax").margins.as_mut().unwrap()[1] = 0.0;
    let mut c = r.clone();
    c.decision_mut("logits.argmax").margins.as_mut().unwrap()[1] = -0.0;
    let rep = diff_with(&r, &c, &Options::default());
    assert_eq!(rep.verdict, Verdict::Different);
    let f = only_finding(&rep, "margin_differs", "logits.argmax");
    assert!(
        f.detail.contains("0x00000000") && f.detail.contains("0x80000000"),
        "{}",
        f.detail
    );
}

#[test]
fn removed_margins_are_a_finding() {
    let r = model();
    let mut c = model();
    c.decision_mut("layer.01.router.topk").margins = None;
    let rep = diff_with(&r, &c, &Options::default());
    assert_eq!(rep.verdict, Verdict::Different);
    let f = only_finding(&rep, "margin_presence_mismatch", "layer.01.router.topk");
    assert!(
        f.detail.contains("in the reference, none in the candidate"),
        "{}",
        f.detail
    );
    // And the other way round.
    let rep = diff_with(&c, &r, &Options::default());
    assert!(
        only_finding(&rep, "margin_presence_mismatch", "layer.01.router.topk")
            .detail
            .contains("in the candidate, none in the reference")
    );
}

#[test]
fn an_added_empty_or_changed_attribute_is_different() {
    let r = model();
    for (what, edit) in [
        (
            "added",
            Box::new(|a: &mut tracegate_trace::Attributes| {
                a.extra.insert("rounding".into(), "rne".into());
            }) as Box<dyn Fn(&mut tracegate_trace::Attributes)>,
        ),
        (
            "empty",
            Box::new(|a: &mut tracegate_trace::Attributes| {
                a.extra.insert("note".into(), String::new());
            }),
        ),
        (
            "step",
            Box::new(|a: &mut tracegate_trace::Attributes| a.step = Some(3)),
        ),
    ] {
        let mut c = model();
        edit(&mut c.tensor_mut("logits").attrs);
        for rep in different_with_and_without_verify(&r, &c, what) {
            let f = only_finding(&rep, "attribute_differs", "logits");
            assert!(
                f.detail.contains("absent in the reference"),
                "{what}: {}",
                f.detail
            );
        }
    }
    // A changed value names both.
    let mut a = model();
    a.tensor_mut("logits")
        .attrs
        .extra
        .insert("rounding".into(), "rne".into());
    let mut b = model();
    b.tensor_mut("logits")
        .attrs
        .extra
        .insert("rounding".into(), "truncate".into());
    let rep = diff_with(&a, &b, &Options::default());
    let f = only_finding(&rep, "attribute_differs", "logits");
    assert!(
        f.detail
            .contains("\"rne\" in the reference, \"truncate\" in the candidate"),
        "{}",
        f.detail
    );
}

#[test]
fn under_a_policy_margins_get_the_documented_tolerance() {
    let (r, mut c) = oracle_like_pair();
    // logits row 0 moved by 1 ULP at most (~2.4e-7 at |x| < 2); its margin m0 (below 1) may
    // move by 2·d + 1e-5 — 5e-6 is inside, 1e-3 is not.
    let m0 = r.decisions[2].margins.as_ref().unwrap()[0];
    assert!(m0.abs() < 1.0, "{m0}");
    let d = {
        let rep = diff(&r, &c, Some(oracle_policy()));
        assert_eq!(rep.verdict, Verdict::WithinPolicy, "{:?}", rep.findings);
        tensor_row(&rep, "logits").max_abs.unwrap().0
    };
    assert!(d < 1e-6, "{d}");
    c.decision_mut("logits.argmax").margins.as_mut().unwrap()[0] = m0 + 5e-6;
    let rep = diff(&r, &c, Some(oracle_policy()));
    assert_eq!(rep.verdict, Verdict::WithinPolicy, "{:?}", rep.findings);
    let res = decision_result(&rep, "logits.argmax");
    assert_eq!(
        (
            res.margins.as_str(),
            res.margin_differing_rows,
            res.margin_outside_rows
        ),
        ("within_tolerance", 1, 0)
    );
    c.decision_mut("logits.argmax").margins.as_mut().unwrap()[0] = m0 + 1e-3;
    let rep = diff(&r, &c, Some(oracle_policy()));
    assert_eq!(rep.verdict, Verdict::Different);
    let f = only_finding(&rep, "margin_differs", "logits.argmax");
    assert!(
        f.detail.contains("row 0") && f.detail.contains("outside the tolerance"),
        "{}",
        f.detail
    );
    // The tolerance is exactly 2·d + 1e-5·max(1, |a|, |b|), d being the row's divergence.
    let m = res_first(&rep);
    assert!(
        m.outside && m.tolerance.unwrap().0 <= 2.0 * d + 1e-5 + 1e-12,
        "{m:?}"
    );
    // Without a policy the same tiny change is different.
    c.decision_mut("logits.argmax").margins.as_mut().unwrap()[0] = m0 + 5e-6;
    let exact = diff_with(&r, &c, &Options::default());
    assert!(exact
        .findings
        .iter()
        .any(|f| f.kind.as_str() == "margin_differs"));
}

fn res_first(rep: &tracegate_diff::Report) -> tracegate_diff::MarginDifference {
    decision_result(rep, "logits.argmax")
        .first_margin_difference
        .clone()
        .unwrap()
}

#[test]
fn one_oracle_stack_in_two_precisions_is_compared_and_said() {
    // An fp32 oracle against its own bf16 run: only dtype differs, the usual calibration.
    let mut r = model();
    r.provenance = oracle_provenance();
    let mut c = r.clone();
    c.provenance["dtype"] = json!("bfloat16");
    let rep = diff_with(&r, &c, &Options::default());
    assert_eq!(rep.verdict, Verdict::Identical, "{:#?}", rep.findings);
    assert_eq!(kinds(&rep), vec!["stack_mismatch_allowed"]);
    assert!(rep.findings[0]
        .detail
        .contains("differs only in dtype: float32 in the reference, bfloat16"));
    // The control: dtype and another key differ: two stacks, refused, naming the flag.
    c.provenance["versions"]["torch"] = json!("2.6.0");
    let rep = diff_with(&r, &c, &Options::default());
    assert_eq!(rep.verdict, Verdict::Incomparable);
    assert_eq!(kinds(&rep), vec!["stack_mismatch", "stack_mismatch"]);
    assert!(
        rep.findings[0].detail.contains("--allow-stack-mismatch"),
        "{}",
        rep.findings[0].detail
    );
}
