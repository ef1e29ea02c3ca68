//! Precision is the user's claim (docs/diff.md, "Policies"): what a candidate declares or stores
//! is checked and said, never read as a looser judge. Each case is written as an adversary
//! would write it.

use crate::common::*;
use serde_json::json;
use tracegate_diff::{compare_files, render_human, FindingKind, Options, Policy, Verdict};

fn judged(c: &Spec, policy: &str) -> tracegate_diff::Report {
    let r = model();
    let (_dir, rp, cp) = pair(&r, c);
    compare_files(
        &rp,
        &cp,
        &Options {
            policy: Some(Policy::resolve(policy, std::path::Path::new(".")).unwrap()),
            ..Options::default()
        },
    )
}

fn oracle_like() -> Spec {
    let mut c = model();
    c.provenance = oracle_provenance();
    c
}

#[test]
fn attack_a_declaration_about_no_tensor_is_refused() {
    // `vision.tower.*` matches nothing in this text model: a declaration about no tensor once
    // chose the q8 policy for the whole trace.
    let mut c = oracle_like();
    c.provenance["precision"] = json!({"*": "f32", "vision.tower.*": "q8"});
    let rep = judged(&c, "f32");
    assert_eq!(rep.verdict, Verdict::Different, "{}", render_human(&rep));
    let f = rep
        .findings
        .iter()
        .find(|f| f.kind == FindingKind::PrecisionDeclarationRefused)
        .expect("the refusal");
    assert!(
        f.detail
            .contains("\"vision.tower.*\", which matches no tensor"),
        "{}",
        f.detail
    );
    // The control: a declaration about tensors the trace holds is read, and changes nothing.
    let mut c = oracle_like();
    c.provenance["precision"] = json!({"*": "f32", "layer.*.attn_out": "f16"});
    let rep = judged(&c, "f32");
    assert_eq!(rep.verdict, Verdict::Identical, "{}", render_human(&rep));
}

#[test]
fn f32_values_a_bf16_claim_cannot_represent_are_said_in_the_headline() {
    // An f32 candidate judged by the bf16 policy (the user's claim): the values are f32's, and
    // the headline says the looser bounds judge a finer computation.
    let mut c = oracle_like();
    // One element moved by one f32 ULP: no bf16 value (its low 16 bits are not 0 unless by
    // chance: checked).
    let t = c
        .tensors
        .iter()
        .find(|t| t.name == "layer.00.mlp_out")
        .unwrap();
    let x = f32::from_le_bytes(t.bytes[12..16].try_into().unwrap());
    let v = f32::from_bits(x.to_bits() + 1);
    assert_ne!(half::bf16::from_f32(v).to_f32(), v);
    c.set_f32("layer.00.mlp_out", 3, v);
    let rep = judged(&c, "bf16");
    let first = render_human(&rep).lines().next().unwrap().to_string();
    assert!(
        first.contains("WARNING: the policy is for bf16, but")
            && first.contains("bf16 cannot represent"),
        "{first}"
    );
    // The control: a candidate whose f32 tensors hold only bf16 values draws no such note.
    let mut c = model();
    c.provenance = oracle_provenance();
    for t in c.tensors.iter_mut() {
        for b in t.bytes.chunks_exact_mut(4) {
            let x = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            let y = half::bf16::from_f32(x).to_f32();
            b.copy_from_slice(&y.to_le_bytes());
        }
    }
    let rep = judged(&c, "bf16");
    assert!(
        !rep.findings
            .iter()
            .any(|f| f.kind == FindingKind::PrecisionClaim),
        "{:#?}",
        rep.findings
    );
}

/// Every element of `name` scaled by 1 + `by`: a relative L2 of `by`, and decisions untouched
/// (attn_out and mlp_out feed no decision in these traces).
fn scaled(c: &mut Spec, name: &str, by: f32) {
    let t = c.tensors.iter_mut().find(|t| t.name == name).unwrap();
    for b in t.bytes.chunks_exact_mut(4) {
        let x = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        b.copy_from_slice(&(x * (1.0 + by)).to_le_bytes());
    }
}

#[test]
fn a_claim_per_pattern_judges_each_tensor_by_the_precision_that_covers_it() {
    // A port whose attention output is f16 (claimed) and the rest f32: attn_out 1e-3 off is
    // within f16's bound (2.5e-2) and outside f32's (1e-4).
    let claim = "layer.*.attn_out=f16,**=f32";
    let mut c = oracle_like();
    scaled(&mut c, "layer.00.attn_out", 1e-3);
    let rep = judged(&c, claim);
    assert_eq!(rep.verdict, Verdict::WithinPolicy, "{}", render_human(&rep));
    let f32_only = judged(&c, "f32");
    assert_eq!(f32_only.verdict, Verdict::Different);
    assert_eq!(
        f32_only
            .first_violation()
            .map(|v| v.tensor.clone())
            .as_deref(),
        Some("layer.00.attn_out")
    );
    // The same error in mlp_out, which the f32 part covers, fails under the claim: a coarser
    // part never loosens a tensor it does not cover.
    let mut c = oracle_like();
    scaled(&mut c, "layer.00.mlp_out", 1e-3);
    let rep = judged(&c, claim);
    assert_eq!(rep.verdict, Verdict::Different);
    assert_eq!(
        rep.first_violation().map(|v| v.tensor.clone()).as_deref(),
        Some("layer.00.mlp_out")
    );
    // A tensor no pattern covers has no rule (a finding), and a claim naming no precision is
    // refused, naming it.
    let rep = judged(&oracle_like(), "layer.*.attn_out=f16");
    assert!(rep
        .findings
        .iter()
        .any(|f| f.kind == FindingKind::NoPolicyRule));
    let e = Policy::resolve("layer.*.attn_out=fp8,**=f32", std::path::Path::new(".")).unwrap_err();
    assert!(
        e.contains("\"fp8\" is not one of f32, bf16, f16, q8"),
        "{e}"
    );
}

#[test]
fn a_misspelt_precision_is_refused_by_bits_and_under_a_policy_naming_the_one_meant() {
    // `"fp32"` passed silently: by bits the declaration was never read, and under a policy the
    // candidate was said to compute in its dtype's precision as though nothing were declared.
    let mut c = model();
    c.provenance["precision"] = json!("fp32");
    let r = model();
    let (_dir, rp, cp) = pair(&r, &c);
    let by_bits = compare_files(&rp, &cp, &Options::default());
    let under_policy = judged(&c, "f32");
    for rep in [&by_bits, &under_policy] {
        assert_eq!(rep.verdict, Verdict::Different, "{}", render_human(rep));
        let f = rep
            .findings
            .iter()
            .find(|f| f.kind == FindingKind::PrecisionDeclarationRefused)
            .expect("the refusal");
        assert!(
            f.detail.contains(
                r#"provenance precision is "fp32": expected one of f32, f16, bf16, q8 (did you mean "f32"?)"#
            ),
            "{}",
            f.detail
        );
    }
    assert_eq!(
        under_policy.policy.as_ref().unwrap().candidate_computes_in,
        None,
        "a refused declaration is not replaced by the dtype"
    );
    // The control: the name meant is read, and the same traces are identical.
    c.provenance["precision"] = json!("f32");
    let (_dir, rp, cp) = pair(&r, &c);
    let rep = compare_files(&rp, &cp, &Options::default());
    assert_eq!(rep.verdict, Verdict::Identical, "{}", render_human(&rep));
}
