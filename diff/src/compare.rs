//! [`compare`]: the checks in their fixed order (docs/diff.md) — readable and verified,
//! comparable (`comparable`), structure (`structure`), values (`values`), decisions
//! (`decisions`) — then the verdict. Each phase adds its findings to the report.

use std::path::Path;

use tracegate_trace::Trace;

use crate::report::{Finding, Method, Report, Side};
use crate::structure::{forced_note, structure};
use crate::values::values;
use crate::{comparable, decisions, FilterSummary, FindingKind, Options, RowStatus, Verdict};

fn side(t: Option<&Trace>, path: Option<&Path>, verified: bool) -> Side {
    Side {
        path: path.map(|p| p.display().to_string()),
        digest: t.map(|t| t.digest().hex()),
        producer: t
            .and_then(|t| t.provenance().get("producer"))
            .and_then(|v| v.as_str())
            .map(str::to_string),
        verified,
    }
}

/// Opens both files and compares them; an unopenable file gives an `unreadable` report.
pub fn compare_files(reference: &Path, candidate: &Path, opts: &Options) -> Report {
    let (r, c) = rayon::join(|| Trace::open(reference), || Trace::open(candidate));
    match (r, c) {
        (Ok(r), Ok(c)) => compare(&r, &c, opts),
        (r, c) => {
            let rep = Report::empty(
                side(r.as_ref().ok(), Some(reference), false),
                side(c.as_ref().ok(), Some(candidate), false),
                opts,
            );
            unreadable(rep, [&r, &c])
        }
    }
}

/// An `unreadable` report: one finding for each side that could not be opened or verified.
fn unreadable<T, E: std::fmt::Display>(mut rep: Report, sides: [&Result<T, E>; 2]) -> Report {
    rep.verdict = Verdict::Unreadable;
    for (label, res) in ["reference", "candidate"].into_iter().zip(sides) {
        if let Err(e) = res {
            rep.findings.push(Finding::new(
                FindingKind::Unreadable,
                None,
                format!("{label}: {e}"),
            ));
        }
    }
    rep
}

/// Compares two opened traces: verify, comparability, structure, values, decisions.
///
/// Verification (unless `--no-verify`) is in two steps so that a difference early in the files
/// is found without hashing both whole files first: each index now (decisions, padding, the
/// content digest from the recorded per-tensor digests), the tensors' payloads at the end:
/// every one before any verdict but DIFFERENT, for a DIFFERENT only those it read, the rest
/// said to be NOT VERIFIED in a `verified_in_part` finding (docs/diff.md, "Early exit").
pub fn compare(reference: &Trace, candidate: &Trace, opts: &Options) -> Report {
    let rep = phases(reference, candidate, opts);
    if !opts.verify || rep.verdict == Verdict::Unreadable {
        return rep;
    }
    if rep.verdict != Verdict::Different {
        let (vr, vc) = rayon::join(|| reference.verify(), || candidate.verify());
        if vr.is_err() || vc.is_err() {
            return unreadable_after(rep, vr, vc);
        }
        return rep;
    }
    let read = read_tensors(reference, candidate, &rep);
    let check = |t: &Trace| -> Result<(), tracegate_trace::Error> {
        read.iter()
            .filter_map(|n| t.tensor_info(n))
            .try_for_each(|i| t.verify_tensor(i))
    };
    let (vr, vc) = rayon::join(|| check(reference), || check(candidate));
    if vr.is_err() || vc.is_err() {
        return unreadable_after(rep, vr, vc);
    }
    let mut rep = rep;
    for (label, t, is_ref) in [
        ("reference", reference, true),
        ("candidate", candidate, false),
    ] {
        let total: u64 = t.tensors().iter().map(|i| i.nbytes).sum();
        let read_here: Vec<_> = read.iter().filter_map(|n| t.tensor_info(n)).collect();
        let bytes: u64 = read_here.iter().map(|i| i.nbytes).sum();
        let unread = t.tensors().len() - read_here.len();
        if unread == 0 {
            continue;
        }
        if is_ref {
            rep.reference.verified = false;
        } else {
            rep.candidate.verified = false;
        }
        rep.findings.push(Finding::new(
            FindingKind::VerifiedInPart,
            None,
            format!(
                "{label}: verified its index, its decisions and the {} tensor(s) read ({bytes} of {total} payload bytes); the other {unread} tensor(s) ({} bytes) are NOT VERIFIED: a difference was found without them",
                read_here.len(),
                total - bytes
            ),
        ));
    }
    rep
}

/// The tensors whose bytes a DIFFERENT may rest on: those compared element by element (or by
/// position), those matched by digest before the first divergence (they are what "first" rests
/// on: a payload edited behind an intact index must not pass as equal there), and the source of
/// every common decision (its margins are checked against it).
fn read_tensors(reference: &Trace, candidate: &Trace, rep: &Report) -> Vec<String> {
    let first = rep.first_divergence.as_ref().map(|f| f.tensor.as_str());
    let before_first = rep
        .per_tensor
        .iter()
        .position(|r| Some(r.tensor.as_str()) == first)
        .unwrap_or(0);
    let mut read: Vec<String> = rep
        .per_tensor
        .iter()
        .enumerate()
        .filter(|(i, r)| match r.method {
            Method::NotScanned => false,
            Method::Digest => *i < before_first,
            _ => true,
        })
        .map(|(_, r)| r)
        .map(|r| r.tensor.clone())
        .collect();
    for d in reference.decisions() {
        if candidate.decision_info(&d.name).is_some() {
            read.extend(decisions::source_tensor(&d.name, reference, candidate));
        }
    }
    read.sort();
    read.dedup();
    read
}

/// An `unreadable` report in place of `rep`, whose phases ran on a file that fails verification.
fn unreadable_after(
    rep: Report,
    vr: Result<(), tracegate_trace::Error>,
    vc: Result<(), tracegate_trace::Error>,
) -> Report {
    let mut fresh = Report::empty(
        Side {
            verified: vr.is_ok(),
            ..rep.reference
        },
        Side {
            verified: vc.is_ok(),
            ..rep.candidate
        },
        &Options::default(),
    );
    (fresh.policy, fresh.filter, fresh.scan) = (rep.policy, rep.filter, rep.scan);
    unreadable(fresh, [&vr, &vc])
}

/// The phases, in order, with each index verified (`compare` verifies the payloads).
fn phases(reference: &Trace, candidate: &Trace, opts: &Options) -> Report {
    // Beside a noise reference the policy's noise ratio joins every rule (Policy::with_noise).
    let with_noise;
    let opts = match (&opts.policy, &opts.noise) {
        (Some(p), Some(_)) if p.noise_ratio.is_some() => {
            with_noise = Options {
                policy: Some(p.with_noise()),
                ..opts.clone()
            };
            &with_noise
        }
        _ => opts,
    };
    // A filter that selects nothing is bad usage, known from the indexes alone: no hashing first.
    let filter = opts.filter.summary(&[reference, candidate]);
    if let Some(why) = filter.as_ref().and_then(FilterSummary::nothing_selected) {
        let mut rep = Report::empty(
            side(Some(reference), Some(reference.path()), false),
            side(Some(candidate), Some(candidate.path()), false),
            opts,
        );
        (rep.verdict, rep.filter) = (Verdict::Unreadable, filter);
        rep.findings
            .push(Finding::new(FindingKind::NothingSelected, None, why));
        return rep;
    }
    // 1. Readable and verified: both indexes now, at once; the payloads in `compare`.
    let (vr, vc) = if opts.verify {
        rayon::join(|| reference.verify_index(), || candidate.verify_index())
    } else {
        (Ok(()), Ok(()))
    };
    let mut rep = Report::empty(
        side(
            Some(reference),
            Some(reference.path()),
            opts.verify && vr.is_ok(),
        ),
        side(
            Some(candidate),
            Some(candidate.path()),
            opts.verify && vc.is_ok(),
        ),
        opts,
    );
    rep.filter = filter;
    // A declaration about no tensor, or of no precision (`"fp32"`), is refused under a policy
    // and by bits alike: it was how a port once chose a looser judge, and a misspelt one passed
    // silently. Refused, it is not read: never its dtype instead.
    let computes_in = crate::policy::computes_in(
        candidate.provenance(),
        candidate
            .tensors()
            .iter()
            .map(|i| (i.name.as_str(), i.dtype)),
    )
    .unwrap_or_else(|why| {
        rep.findings.push(Finding::new(
            FindingKind::PrecisionDeclarationRefused,
            None,
            format!("the candidate's declared precision is not read: {why}"),
        ));
        None
    });
    if let Some(p) = rep.policy.as_mut() {
        p.candidate_computes_in = computes_in.map(String::from);
        if let Some(claim) = p.candidate_dtype.clone() {
            rep.findings.extend(finer_than_claimed(candidate, &claim));
        }
        if let (Some(want), Some(have)) = (&p.candidate_dtype, &p.candidate_computes_in) {
            if want != have {
                // A note, not a verdict: the bounds still judge, but the reader must know
                // they were measured for another precision.
                let why = if want == "f32" {
                    "its bounds are f32 rounding's: honest reduced-precision rounding breaks them"
                } else if have == "f32" {
                    "its bounds are far looser than f32 rounding needs: a defect can hide in them"
                } else {
                    "its bounds were measured for another rounding"
                };
                rep.findings.push(Finding::new(
                    FindingKind::PolicyPrecisionMismatch,
                    None,
                    format!(
                        "policy {:?} is for {want} candidates, and this candidate computes in {have} (its provenance precision, else the finer of its dtype and its tensors'): {why}",
                        p.name
                    ),
                ));
            }
        }
    }
    if vr.is_err() || vc.is_err() {
        return unreadable(rep, [&vr, &vc]);
    }

    // 2. Comparable: runs before any digest is looked at.
    let (refusals, allowed) = comparable::check(reference, candidate, opts.allow_stack_mismatch);
    rep.findings.extend(allowed);
    if !refusals.is_empty() {
        rep.findings.extend(refusals);
        rep.verdict = Verdict::Incomparable;
        return rep;
    }

    // The noise reference must be the reference's model on the reference's prompt; only its
    // precision (the stack) may differ, and that is reported.
    if let Some(noise) = &opts.noise {
        if let Some(why) = untrusted_noise(&noise.0, candidate) {
            rep.findings.push(Finding::new(
                FindingKind::NoiseReferenceRefused,
                None,
                format!("noise reference {}: {why}", noise.0.path().display()),
            ));
            rep.verdict = Verdict::Incomparable;
            return rep;
        }
        let (refusals, allowed) = comparable::check(reference, &noise.0, true);
        let named = |mut f: Finding| {
            f.detail = format!("noise reference {}: {}", noise.0.path().display(), f.detail);
            f
        };
        rep.findings.extend(allowed.into_iter().map(named));
        if !refusals.is_empty() {
            rep.findings.extend(refusals.into_iter().map(named));
            rep.verdict = Verdict::Incomparable;
            return rep;
        }
    }

    // 3. Structure.
    let mut different = structure(reference, candidate, opts, &mut rep)
        || rep
            .findings
            .iter()
            .any(|f| f.kind == FindingKind::PrecisionDeclarationRefused);
    let forced = forced_note(reference, candidate);
    let forced_from_other = forced.is_some();
    rep.findings.extend(forced);

    // 4. Values.
    let values_different = values(reference, candidate, opts, &mut rep);

    // 5. Decisions (every one the filter selects), each flip labelled; under a policy the rows
    // after a near-tie leave the judgement and their tensors are judged again without them.
    different |= decisions::compare(reference, candidate, opts, &mut rep);
    // After a sampling divergence a step or block may run on one side only: not a structure
    // difference; then what fails is read again from the findings and flips.
    if decisions::one_sided_after_sampling(reference, candidate, &mut rep) > 0 {
        different = decisions::still_different(&rep);
    }
    let rejudged = rep
        .decisions
        .near_ties
        .as_ref()
        .is_some_and(|n| !n.tensors.is_empty())
        || rep
            .decisions
            .sampling_divergence
            .as_ref()
            .is_some_and(|s| s.tensors_not_judged > 0);
    different |= if rejudged {
        rep.per_tensor.iter().any(|r| {
            matches!(
                r.status,
                RowStatus::OutsidePolicy | RowStatus::NoRule | RowStatus::Rerouted
            )
        })
    } else {
        values_different
    };

    // A bf16 store that truncates: its own finding, whatever the bounds (docs/diff.md).
    different |= crate::rounding::check(reference, candidate, opts, &mut rep);

    rep.verdict = verdict(&rep, opts, different);
    if rep.verdict == Verdict::Identical && !forced_from_other {
        digests_confirm(reference, candidate, &mut rep);
    }
    rep
}

/// The candidate's f32 tensors holding values the claimed precision (bf16, f16) cannot
/// represent: evidence of a finer computation judged by the claim's looser bounds. A note in the
/// headline, not a verdict (the user's claim stands; docs/diff.md, "Precision").
fn finer_than_claimed(candidate: &Trace, claim: &str) -> Option<Finding> {
    let representable: fn(f32) -> bool = match claim {
        "bf16" => |x| !x.is_finite() || half::bf16::from_f32(x).to_f32() == x,
        "f16" => |x| !x.is_finite() || half::f16::from_f32(x).to_f32() == x,
        _ => return None,
    };
    let finer: Vec<&str> = candidate
        .tensors()
        .iter()
        .filter(|i| i.dtype == tracegate_trace::DType::F32)
        .filter(|i| {
            candidate
                .data(i)
                .chunks_exact(4)
                .any(|b| !representable(f32::from_le_bytes([b[0], b[1], b[2], b[3]])))
        })
        .map(|i| i.name.as_str())
        .collect();
    let first = finer.first()?;
    Some(Finding::new(
        FindingKind::PrecisionClaim,
        None,
        format!(
            "the policy is for {claim}, but {} of the candidate's f32 tensors hold values {claim} cannot represent (first: {first}): a finer computation, judged by {claim}'s looser bounds as claimed",
            finer.len()
        ),
    ))
}

/// The producers whose runs may serve as honest noise: tracegate's own reference producers (the
/// oracle with 8-bit activations for a q8 claim). A candidate's trace (or a copy of it) would
/// make every ratio 1 and size its own near-ties.
pub const NOISE_PRODUCERS: [&str; 4] = ["oracle", "engine", "contract", "oracle-q8-activations"];

/// Why a noise reference cannot be believed, if it cannot: it is the candidate's own content, or
/// not a reference producer's run.
fn untrusted_noise(noise: &Trace, candidate: &Trace) -> Option<String> {
    if noise.digest() == candidate.digest() {
        return Some(format!(
            "its content is the candidate's own (digest {}): honest noise is measured by a reference producer's run, never supplied by the candidate",
            noise.digest().hex()
        ));
    }
    let producer = noise.provenance().get("producer").and_then(|v| v.as_str());
    if !producer.is_some_and(|p| NOISE_PRODUCERS.contains(&p)) {
        return Some(format!(
            "its producer is {}, not one of tracegate's reference producers ({}): honest noise is tracegate's own run of the reference in the claimed precision",
            producer.map_or("not recorded".to_string(), |p| format!("{p:?}")),
            NOISE_PRODUCERS.join(", ")
        ));
    }
    None
}

/// The verdict from the phases' outcome: different, else within the policy when some value or
/// margin differs under one, else identical.
fn verdict(rep: &Report, opts: &Options, different: bool) -> Verdict {
    let any_value_difference = rep
        .per_tensor
        .iter()
        .any(|r| r.status != RowStatus::Identical)
        || rep
            .decisions
            .results
            .iter()
            .any(|d| d.margin_differing_rows > 0 || d.differing_rows > 0);
    if different {
        Verdict::Different
    } else if rep.decisions.sampling_divergence.is_some() {
        // Past the first differing draw the two runs follow other canvases: what came before is
        // within the policy, what came after was not compared, so the whole is no agreement.
        Verdict::Incomparable
    } else if rep
        .decisions
        .near_ties
        .as_ref()
        .is_some_and(|n| n.rows_after() > 0)
    {
        // An excused near-tie sent its token down another path: what it computed afterwards
        // was left out, and a pass over it would be a pass of something never judged.
        Verdict::NotChecked
    } else if opts.policy.is_some() && any_value_difference {
        Verdict::WithinPolicy
    } else {
        Verdict::Identical
    }
}

/// IDENTICAL claims equal content, and two verified digests decide that on their own: a
/// disagreement means a check above misses some content, which must not pass as identical.
/// Under a filter that left something out, IDENTICAL covers what was compared only; a side
/// forced from the other differs from it in that attribute, so its digest cannot match (the
/// caller skips this then: the decisions_forced note says so instead).
fn digests_confirm(reference: &Trace, candidate: &Trace, rep: &mut Report) {
    let whole = rep.filter.as_ref().is_none_or(|f| !f.left_out_any());
    if whole
        && rep.reference.verified
        && rep.candidate.verified
        && reference.digest() != candidate.digest()
    {
        rep.verdict = Verdict::Different;
        rep.findings.push(Finding::new(
            FindingKind::ContentDigestDiffers,
            None,
            format!(
                "no difference was found, but the verified content digests differ ({} vs {}): a content field this differ does not compare",
                reference.digest().hex(),
                candidate.digest().hex()
            ),
        ));
    }
}
