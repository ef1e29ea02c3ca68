//! Phase 3 of [`crate::compare`], structure: tensors missing or extra, dtypes and shapes that
//! cannot be compared, attributes that differ, and the capture order.

use tracegate_trace::{DType, TensorInfo, Trace};

use crate::{positions, Finding, FindingKind, Options, Pair, Report};

/// Missing, extra, dtype, shape and order findings; true if there is any.
pub(crate) fn structure(r: &Trace, c: &Trace, opts: &Options, rep: &mut Report) -> bool {
    rep.tensors.reference_count = r.tensors().iter().filter(|i| opts.selects(&i.name)).count();
    rep.tensors.candidate_count = c.tensors().iter().filter(|i| opts.selects(&i.name)).count();
    let before = rep.findings.len();
    let digests = [r.digest().hex(), c.digest().hex()];
    for info in r.tensors().iter().filter(|i| opts.selects(&i.name)) {
        // f64 is a legal trace dtype, and none of the precisions a candidate is judged by: a
        // candidate tensor stored in f64 against a reference's in another dtype was computed in
        // f64 (docs/capture-points.md: each tensor is stored in the dtype it is computed in),
        // finer than any claim, and once passed unnoticed by value. Still compared by value.
        if let Some(ci) = c
            .tensor_info(&info.name)
            .filter(|ci| ci.dtype == DType::F64 && info.dtype != DType::F64)
        {
            rep.findings.push(Finding::new(
                FindingKind::DtypeMismatch,
                Some(&ci.name),
                format!(
                    "reference {} vs candidate f64: stored in f64, so computed in f64 (docs/capture-points.md), which is none of the precisions a candidate is judged by ({}): compute and store it in the precision claimed (numpy's default float64 is the usual cause)",
                    info.dtype,
                    crate::policy::PRECISIONS.join(", ")
                ),
            ));
        }
        match c.tensor_info(&info.name) {
            None => {
                rep.tensors.missing.push(info.name.clone());
                rep.findings.push(Finding::new(
                    FindingKind::MissingTensor,
                    Some(&info.name),
                    "in the reference, not in the candidate",
                ));
            }
            // Two float dtypes are compared by value (Values); anything else cannot be.
            Some(ci) if Pair::new(info.dtype, ci.dtype).is_none() => {
                rep.findings.push(Finding::new(
                    FindingKind::DtypeMismatch,
                    Some(&info.name),
                    format!("reference {} vs candidate {}", info.dtype, ci.dtype),
                ));
            }
            Some(ci) if ci.shape != info.shape && !positions::rerouted(info, ci) => {
                let same_count = ci.element_count() == info.element_count();
                let note = if same_count {
                    " (same element count: transposed or reshaped)"
                } else {
                    ""
                };
                rep.findings.push(Finding::new(
                    FindingKind::ShapeMismatch,
                    Some(&info.name),
                    format!(
                        "reference {:?} vs candidate {:?}{note}",
                        info.shape, ci.shape
                    ),
                ));
            }
            Some(ci) => attribute_findings(info, ci, &digests, rep),
        }
    }
    for info in c.tensors().iter().filter(|i| opts.selects(&i.name)) {
        if r.tensor_info(&info.name).is_none() {
            rep.tensors.extra.push(info.name.clone());
            // `layer.0.q` for `layer.00.q`: the one mistake that makes every name of a port
            // missing and extra at once; say what the reference calls it.
            let canonical = tracegate_trace::names::Name::parse(&info.name).to_string();
            let detail = if canonical != info.name && r.tensor_info(&canonical).is_some() {
                format!("in the candidate, not in the reference, which has {canonical}: names are zero-padded (layer.NN, expert.EEE, decode.SSSS; docs/capture-points.md)")
            } else {
                "in the candidate, not in the reference".to_string()
            };
            rep.findings.push(Finding::new(
                FindingKind::ExtraTensor,
                Some(&info.name),
                detail,
            ));
        }
    }
    let rn = r
        .tensors()
        .iter()
        .map(|i| i.name.as_str())
        .filter(|n| opts.selects(n) && c.tensor_info(n).is_some());
    let cn = c
        .tensors()
        .iter()
        .map(|i| i.name.as_str())
        .filter(|n| opts.selects(n) && r.tensor_info(n).is_some());
    if let Some(f) = order_finding(FindingKind::OrderMismatch, rn, cn) {
        rep.findings.push(f);
    }
    rep.findings.len() > before
}

/// `step` and extra attributes are content compared exactly (path, mask and positions decide
/// comparability instead, `comparable::check`); absent and empty are different — except a
/// `forced` attribute naming the other side (`forced_from_other`), noted once by `forced_note`.
fn attribute_findings(r: &TensorInfo, c: &TensorInfo, digests: &[String; 2], rep: &mut Report) {
    let (ra, ca) = (&r.attributes, &c.attributes);
    let show = |v: Option<String>| v.unwrap_or_else(|| "absent".into());
    if ra.step != ca.step {
        let detail = format!(
            "attribute step: {} in the reference, {} in the candidate",
            show(ra.step.map(|s| s.to_string())),
            show(ca.step.map(|s| s.to_string()))
        );
        rep.findings.push(Finding::new(
            FindingKind::AttributeDiffers,
            Some(&r.name),
            detail,
        ));
    }
    let keys: std::collections::BTreeSet<&String> =
        ra.extra.keys().chain(ca.extra.keys()).collect();
    for key in keys {
        let (a, b) = (ra.extra.get(key), ca.extra.get(key));
        if a != b && !forced_from_other(key, a, b, digests) {
            let q = |v: Option<&String>| show(v.map(|s| format!("{s:?}")));
            let detail = format!(
                "attribute {key:?}: {} in the reference, {} in the candidate",
                q(a),
                q(b)
            );
            rep.findings.push(Finding::new(
                FindingKind::AttributeDiffers,
                Some(&r.name),
                detail,
            ));
        }
    }
}

/// `forced=D` on one side only, D the other side's content digest: that side took its decisions
/// from this very trace (`--force-decisions`, docs/producers.md), which is not a difference.
fn forced_from_other(
    key: &str,
    r: Option<&String>,
    c: Option<&String>,
    digests: &[String; 2],
) -> bool {
    key == "forced"
        && match (r, c) {
            (None, Some(d)) => *d == digests[0],
            (Some(d), None) => *d == digests[1],
            _ => false,
        }
}

/// The one informational `decisions_forced` finding (not a difference): how many common tensors
/// carry a `forced` attribute naming the other side.
pub(crate) fn forced_note(r: &Trace, c: &Trace) -> Option<Finding> {
    let digests = [r.digest().hex(), c.digest().hex()];
    let mut sides = [0usize; 2];
    for ri in r.tensors() {
        if let Some(ci) = c.tensor_info(&ri.name) {
            let (a, b) = (
                ri.attributes.extra.get("forced"),
                ci.attributes.extra.get("forced"),
            );
            if a != b && forced_from_other("forced", a, b, &digests) {
                sides[usize::from(a.is_none())] += 1;
            }
        }
    }
    let (forced, from, n, digest) = if sides[1] > 0 {
        ("candidate", "reference", sides[1], &digests[0])
    } else {
        ("reference", "candidate", sides[0], &digests[1])
    };
    (n > 0).then(|| Finding::new(FindingKind::DecisionsForced, None, format!("the {forced}'s decisions were forced from the {from} (--force-decisions): {n} tensors carry forced={digest}")))
}

/// Compares the relative order of the names both sides share (each iterator already keeps
/// only those); names the first out of place. Allocates nothing: traces hold a million names.
pub(crate) fn order_finding<'a>(
    kind: FindingKind,
    r_common: impl Iterator<Item = &'a str>,
    c_common: impl Iterator<Item = &'a str>,
) -> Option<Finding> {
    let (i, (a, b)) = r_common
        .zip(c_common)
        .enumerate()
        .find(|(_, (a, b))| a != b)?;
    Some(Finding::new(kind, Some(a), format!("capture order differs at common position {i}: reference has {a:?}, candidate has {b:?}")))
}
