//! Early exit (issue 54 item 7, docs/diff.md "Early exit"): the payloads are verified at the
//! end — all of them before IDENTICAL or WITHIN POLICY, for a DIFFERENT only those it read,
//! and the report says what was left unverified.

use crate::common;

use std::path::Path;

use common::*;
use tracegate_diff::{compare_files, FindingKind, Options, Verdict};
use tracegate_trace::Trace;

/// Flips one bit of `name`'s payload on disk: the index (and its digests) stay as written.
fn tamper(path: &Path, name: &str) {
    let offset = Trace::open(path).unwrap().tensor_info(name).unwrap().offset;
    let mut bytes = std::fs::read(path).unwrap();
    bytes[offset as usize] ^= 1;
    std::fs::write(path, bytes).unwrap();
}

fn nbytes(path: &Path, names: &[&str]) -> u64 {
    let t = Trace::open(path).unwrap();
    names.iter().map(|n| t.tensor_info(n).unwrap().nbytes).sum()
}

#[test]
fn a_tampered_last_tensor_is_refused_before_identical() {
    // `logits` is the last tensor (and the decisions' source), `final_norm.out` one nothing
    // compares when the recorded digests are equal.
    for name in ["logits", "final_norm.out"] {
        let (_d, r, c) = pair(&model(), &model());
        tamper(&c, name);
        let rep = compare_files(&r, &c, &Options::default());
        assert_eq!(rep.verdict, Verdict::Unreadable, "{name}");
        let f = &rep.findings[0];
        assert_eq!(f.kind, FindingKind::Unreadable);
        assert!(
            f.detail.contains("candidate") && f.detail.contains(&format!("{name:?}")),
            "{}",
            f.detail
        );
    }
    // Negative control: the index check the comparison starts from passes such a file (the
    // recorded digests are the producer's); only the payloads' verification at the end refuses.
    let (_d, _r, c) = pair(&model(), &model());
    tamper(&c, "final_norm.out");
    let t = Trace::open(&c).unwrap();
    t.verify_index().unwrap();
    assert!(t.verify().is_err());
}

#[test]
fn a_tampered_tensor_is_refused_before_within_policy() {
    let (r, mut c) = oracle_like_pair();
    c.poke_f32_bits("layer.00.attn_out", 0, |b| b + 1);
    let (_d, rp, cp) = pair(&r, &c);
    let opts = Options {
        policy: Some(
            tracegate_diff::Policy::load(Path::new(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../fixtures/policy/oracle-default.json"
            )))
            .unwrap(),
        ),
        ..Options::default()
    };
    assert_eq!(
        compare_files(&rp, &cp, &opts).verdict,
        Verdict::WithinPolicy
    );
    tamper(&cp, "embed.out");
    assert_eq!(compare_files(&rp, &cp, &opts).verdict, Verdict::Unreadable);
}

#[test]
fn a_first_tensor_difference_is_different_and_says_the_rest_was_not_verified() {
    let r = model();
    let mut c = model();
    c.poke_f32_bits("embed.out", 0, |b| b + 1);
    let (_d, rp, cp) = pair(&r, &c);
    // A tampered tensor the comparison never reads: not verified, and said so.
    tamper(&cp, "layer.01.hidden_out");
    let rep = compare_files(&rp, &cp, &Options::default());
    assert_eq!(rep.verdict, Verdict::Different);
    assert_eq!(rep.first_divergence.as_ref().unwrap().tensor, "embed.out");
    assert!(!rep.candidate.verified && !rep.reference.verified);
    // Read: the differing tensor and the decisions' sources (their margins are checked).
    let read = [
        "embed.out",
        "layer.00.router.logits",
        "layer.01.router.logits",
        "logits",
    ];
    let t = Trace::open(&cp).unwrap();
    let total: u64 = t.tensors().iter().map(|i| i.nbytes).sum();
    let (n, bytes) = (read.len(), nbytes(&cp, &read));
    let want = format!(
        "candidate: verified its index, its decisions and the {n} tensor(s) read ({bytes} of {total} payload bytes); the other {} tensor(s) ({} bytes) are NOT VERIFIED",
        t.tensors().len() - n,
        total - bytes
    );
    let notes: Vec<_> = rep
        .findings
        .iter()
        .filter(|f| f.kind == FindingKind::VerifiedInPart)
        .map(|f| f.detail.as_str())
        .collect();
    assert_eq!(notes.len(), 2, "{notes:?}");
    assert!(notes[1].starts_with(&want), "{}\nwanted {want}", notes[1]);
    assert!(
        bytes < total / 2,
        "the early exit read {bytes} of {total} bytes"
    );

    // What it read is verified: the differing tensor's own bytes tampered is UNREADABLE.
    let (_d2, rp, cp) = pair(&r, &c);
    tamper(&cp, "embed.out");
    assert_eq!(
        compare_files(&rp, &cp, &Options::default()).verdict,
        Verdict::Unreadable
    );
}
