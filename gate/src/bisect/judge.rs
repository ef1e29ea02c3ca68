//! How `gate bisect` judges (docs/bisect.md, "Judging"): by bits for a pair of ordered
//! producers, else by the bundled policy for the candidate's precision; what a bits verdict
//! means when the calibration puts it at rounding level; and the outlier check that flags a
//! layer whose isolated error is far above its peers' (`suspicious`) without failing the run.

use serde::Serialize;
use tracegate_diff::Policy;
use tracegate_trace::Trace;

use crate::{gerr, Result};

/// An isolated difference at most this many times what a 1-ULP perturbation of the same
/// layer's input produces is called rounding level (docs/bisect.md, "Judging").
pub const ROUNDING_LEVEL: f64 = 10.0;
/// Judged by policy, a layer whose isolated block output (attn_out, mlp_out) is more than this
/// many times the reference's response to one ULP of the candidate's precision at the layer's
/// input is far above rounding (docs/bisect.md, "Rounding response"): clean f32 pairs measured
/// at most 1.37× on the fixtures and 11× on a trained model (SmolLM2 mlp_out, the layers that
/// make its massive activations), a wrong eps in every norm at least 30× at its first layer.
pub const RESPONSE_FACTOR: f64 = 20.0;
/// A layer whose isolated error is more than this many times the median of the other matching
/// isolated layers' is flagged `suspicious`: clean runs measured at most 1.37× on what the check
/// reads, the planted RMSNorm-eps defect at least 2.83× (docs/bisect.md, "Outliers").
pub const SUSPICIOUS_FACTOR: f64 = 2.0;
/// The outlier check needs a layer and at least two peers.
pub const OUTLIER_MIN_LAYERS: usize = 3;

/// What the command line asked for.
#[derive(Clone, Debug, PartialEq)]
pub enum Ask {
    /// Neither `--exact` nor `--policy`: by bits for two ordered producers, else by policy.
    Default,
    /// `--exact`: by bits.
    Exact,
    /// `--policy NAME|FILE`.
    Policy(String),
}

tracegate_diff::string_enum! {
    /// What a bisection judges by.
    pub enum By {
        Bits = "bits",
        Policy = "policy",
    }
}

/// How a bisection judges, and why (the first line of its verdict; `judge` in the report).
#[derive(Clone, Debug, Serialize)]
pub struct Judge {
    pub by: By,
    /// The policy as given or chosen: a bundled name (f32, bf16, f16, q8) or a file; null by bits.
    pub policy: Option<String>,
    /// The policy file's own name (e.g. oracle-default); null by bits.
    pub policy_name: Option<String>,
    /// The candidate's precision: `--precision`, else what it declares, else the coarsest
    /// float dtype among its whole-run tensors (`precision`).
    pub precision: &'static str,
    /// Why it judges so, in words.
    pub reason: String,
}

impl Judge {
    pub fn line(&self) -> String {
        match &self.policy {
            Some(p) => format!("judged by policy {p} ({})", self.reason),
            None => format!("judged by bits ({})", self.reason),
        }
    }
}

/// What the candidate's trace says of its precision, checked, never chosen by: its declaration
/// and the coarsest float dtype of its tensors, the parts of tracegate_diff::policy::computes_in
/// the judge line names apart. A declaration that names no precision, or a pattern that matches
/// none of its tensors, is refused.
fn stated_precision(t: &Trace) -> Result<(Option<&'static str>, &'static str)> {
    let declared = tracegate_diff::policy::checked_declaration(
        t.provenance(),
        t.tensors().iter().map(|i| i.name.as_str()),
    )
    .map_err(|e| gerr!(Producer: "{}: {e}", t.path().display()))?;
    let stored = tracegate_diff::policy::stored_precision(t.tensors().iter().map(|i| i.dtype));
    Ok((declared, stored))
}

/// The candidate's precision is the user's claim (`--precision`, else f32): what the candidate
/// declares or stores is checked and said beside it, never read as a looser claim (docs/bisect.md,
/// "Judging"). Returns the precision and the words of the judge's reason.
pub fn claimed_precision(
    candidate: &Trace,
    given: Option<&str>,
) -> Result<(String, &'static str, String)> {
    let (declared, stored) = stated_precision(candidate)?;
    let text = given.unwrap_or("f32").to_string();
    // A claim per pattern (`layer.*.attn_probs=f16,**=f32`) is compared by its coarsest part.
    let claim = Policy::claimed_precision(&text).ok_or_else(|| {
        gerr!("--precision {text}: names no precision (f32, f16, bf16, q8, or PATTERN=NAME,...)")
    })?;
    let mut from = match given {
        Some(_) => "--precision".to_string(),
        None => "the default claim; --precision claims another".to_string(),
    };
    let coarser = |p: &str| tracegate_diff::policy::coarsest([p, claim]) == Some(p) && p != claim;
    if let Some(d) = declared.filter(|d| coarser(d)) {
        from.push_str(&format!(
            "; the candidate declares {d}, coarser than claimed: judged as claimed"
        ));
    }
    if coarser(stored) {
        from.push_str(&format!(
            "; the candidate stores {stored} tensors, coarser than claimed: judged as claimed"
        ));
    }
    Ok((text, claim, from))
}

/// The judge and its policy. `ordered`: whether each side (reference, candidate) is one of the
/// built-in ordered producers (the engine, the contract with its own command).
pub fn choose(
    ask: &Ask,
    names: (&str, &str),
    ordered: (bool, bool),
    candidate: &Trace,
    given: Option<&str>,
    root: &std::path::Path,
) -> Result<(Judge, Option<Policy>)> {
    let (claim, precision, from) = claimed_precision(candidate, given)?;
    let by_policy = |arg: &str, reason: String| -> Result<(Judge, Option<Policy>)> {
        let p = Policy::resolve(arg, root).map_err(|e| gerr!("--policy {arg}: {e}"))?;
        Ok((
            Judge {
                by: By::Policy,
                policy: Some(arg.to_string()),
                policy_name: Some(p.name.clone()),
                precision,
                reason,
            },
            Some(p),
        ))
    };
    let bits = |reason: String| {
        Ok((
            Judge {
                by: By::Bits,
                policy: None,
                policy_name: None,
                precision,
                reason,
            },
            None,
        ))
    };
    match ask {
        Ask::Exact => bits("--exact".into()),
        Ask::Policy(p) => by_policy(p, "--policy".into()),
        Ask::Default if ordered.0 && ordered.1 => bits(if names.0 == names.1 {
            format!("both sides are the {}, an ordered producer", names.0)
        } else {
            format!("{} and {} are both ordered producers", names.0, names.1)
        }),
        Ask::Default => {
            let not: Vec<String> = [
                ("reference", names.0, ordered.0),
                ("candidate", names.1, ordered.1),
            ]
            .iter()
            .filter(|s| !s.2)
            .map(|(side, name, _)| format!("the {side} ({name})"))
            .collect();
            let is = if not.len() == 1 {
                "is not an ordered producer"
            } else {
                "are not ordered producers"
            };
            by_policy(
                &claim,
                format!(
                    "{} {is}; candidate's precision: {claim} ({from}); --exact judges by bits",
                    not.join(" and ")
                ),
            )
        }
    }
}

/// A bits verdict next to the calibration: the blamed layer's isolated difference against what
/// a 1-ULP perturbation of its input produces.
#[derive(Clone, Debug, Serialize)]
pub struct RoundingLevel {
    pub layer: usize,
    pub isolated_rel_l2: f64,
    pub one_ulp_rel_l2: f64,
    /// isolated_rel_l2 / one_ulp_rel_l2.
    pub ratio: f64,
    /// ROUNDING_LEVEL: at or below it the difference is rounding level.
    pub factor: f64,
    pub at_rounding_level: bool,
    /// The flag that judges by policy instead, when at rounding level, and that policy.
    pub flag: Option<String>,
    pub precision: &'static str,
}

impl RoundingLevel {
    /// None when either number is missing or the 1-ULP response is zero.
    pub fn new(
        layer: usize,
        isolated: Option<f64>,
        one_ulp: Option<f64>,
        judge: &Judge,
        exact: bool,
    ) -> Option<RoundingLevel> {
        let (iso, cal) = (isolated?, one_ulp?);
        if cal <= 0.0 {
            return None;
        }
        let ratio = iso / cal;
        let at = ratio <= ROUNDING_LEVEL;
        let flag = at.then(|| {
            if exact {
                "drop --exact".to_string()
            } else {
                format!("--policy {}", judge.precision)
            }
        });
        Some(RoundingLevel {
            layer,
            isolated_rel_l2: iso,
            one_ulp_rel_l2: cal,
            ratio,
            factor: ROUNDING_LEVEL,
            at_rounding_level: at,
            flag,
            precision: judge.precision,
        })
    }

    /// The words the verdict line gets.
    pub fn words(&self) -> String {
        let size = format!(
            "layer {:02}'s isolated difference (rel L2 {:.2e}) is {:.2}× what a 1-ULP perturbation of its input produces ({:.2e})",
            self.layer, self.isolated_rel_l2, self.ratio, self.one_ulp_rel_l2
        );
        match &self.flag {
            Some(flag) => format!("{size}: rounding level (<= {}×), as a correct producer that is not bit-exact gives; {flag} to judge by policy {}", self.factor, self.precision),
            None => format!("{size}: above rounding level (> {}×)", self.factor),
        }
    }
}

/// The outlier check over the isolated layers (docs/bisect.md, "Outliers").
#[derive(Clone, Debug, Serialize)]
pub struct Outliers {
    /// The isolated errors compared (rel L2, layer verb on the reference's input vs the
    /// reference), each against the same tensor of the peers: OUTLIER_MEASURE.
    pub measure: &'static str,
    pub factor: f64,
    /// How many layers were isolated and match (within the policy, or bit for bit): the
    /// population; a wrong layer is neither a peer nor flagged.
    pub isolated_layers: usize,
    /// False when fewer than OUTLIER_MIN_LAYERS layers were isolated (`not_checked` says so).
    pub checked: bool,
    pub not_checked: Option<String>,
    /// The flagged layers.
    pub suspicious: Vec<usize>,
    /// The largest ratio to the peers' median (null: none defined), and its layer.
    pub largest_ratio: Option<f64>,
    pub largest_layer: Option<usize>,
}

/// What the outlier check reads. attn_out: its clean ratios stay at or below 1.37 in every
/// measured pair; mlp_out only where the layer has no router: an MoE layer's mlp_out under a
/// reduced precision moves with routing near-ties (clean ratios up to 9.8 measured), and
/// hidden_out carries both (docs/bisect.md, "Outliers").
pub const OUTLIER_MEASURE: &str =
    "attn_out; mlp_out of layers without a router; each against the layers of its kind";

/// One matching isolated layer's errors: (layer, attn_out rel L2, mlp_out rel L2 when the layer
/// has no router, the layer's kind: its `layer_types` entry, "" for a family without one).
pub type LayerErrors = (usize, Option<f64>, Option<f64>, String);

/// Per layer: its largest ratio to the median of its peers (the other matching layers of its
/// kind: a linear-attention layer is not measured against full-attention ones) over the
/// measured tensors (None where undefined: zero medians, or fewer than OUTLIER_MIN_LAYERS layers
/// of its kind), and whether it is flagged; a zero median under a nonzero error flags too (every
/// peer bit-exact, this one not).
pub fn outliers(errors: &[LayerErrors]) -> (Outliers, Vec<(usize, Option<f64>, bool)>) {
    let mut kinds: Vec<(&str, usize)> = Vec::new();
    for e in errors {
        match kinds.iter_mut().find(|k| k.0 == e.3) {
            Some(k) => k.1 += 1,
            None => kinds.push((&e.3, 1)),
        }
    }
    let mut few: Vec<String> = kinds
        .iter()
        .filter(|k| k.1 < OUTLIER_MIN_LAYERS)
        .map(|(kind, n)| {
            let of = if kind.is_empty() {
                String::new()
            } else {
                format!(" of kind {kind}")
            };
            format!(
                "{n} layer{}{of} isolated and matching",
                if *n == 1 { "" } else { "s" }
            )
        })
        .collect();
    if errors.is_empty() {
        few.push("0 layers isolated and matching".into());
    }
    let mut out = Outliers {
        measure: OUTLIER_MEASURE,
        factor: SUSPICIOUS_FACTOR,
        isolated_layers: errors.len(),
        checked: kinds.iter().any(|k| k.1 >= OUTLIER_MIN_LAYERS),
        not_checked: (!few.is_empty()).then(|| format!("{}; the outlier check needs at least {OUTLIER_MIN_LAYERS} of a kind (--all-layers isolates every layer)", few.join(", "))),
        suspicious: Vec::new(),
        largest_ratio: None,
        largest_layer: None,
    };
    let mut per: Vec<(usize, Option<f64>, bool)> =
        errors.iter().map(|e| (e.0, None, false)).collect();
    for pick in [|e: &LayerErrors| e.1, |e: &LayerErrors| e.2] {
        for &(kind, _) in &kinds {
            let values: Vec<(usize, f64)> = errors
                .iter()
                .enumerate()
                .filter(|(_, e)| e.3 == kind)
                .filter_map(|(i, e)| pick(e).map(|v| (i, v)))
                .collect();
            if values.len() < OUTLIER_MIN_LAYERS {
                continue;
            }
            for &(i, e) in &values {
                let mut peers: Vec<f64> = values
                    .iter()
                    .filter(|(j, _)| *j != i)
                    .map(|p| p.1)
                    .collect();
                peers.sort_by(f64::total_cmp);
                let m = peers.len();
                let median = if m % 2 == 1 {
                    peers[m / 2]
                } else {
                    (peers[m / 2 - 1] + peers[m / 2]) / 2.0
                };
                let ratio = (median > 0.0).then(|| e / median);
                per[i].2 |= ratio.map_or(e > 0.0, |r| r > SUSPICIOUS_FACTOR);
                per[i].1 = match (per[i].1, ratio) {
                    (Some(a), Some(b)) => Some(a.max(b)),
                    (a, b) => a.or(b),
                };
            }
        }
    }
    for &(layer, ratio, flagged) in &per {
        if let Some(r) = ratio.filter(|r| out.largest_ratio.is_none_or(|l| *r > l)) {
            (out.largest_ratio, out.largest_layer) = (Some(r), Some(layer));
        }
        if flagged {
            out.suspicious.push(layer);
        }
    }
    (out, per)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_layer_far_above_its_peers_is_flagged_and_a_flat_curve_is_not() {
        let dense = |e: &[f64]| -> Vec<LayerErrors> {
            e.iter()
                .enumerate()
                .map(|(l, &x)| (l, Some(x), Some(x), String::new()))
                .collect()
        };
        assert!(outliers(&dense(&[2e-7, 1.6e-7, 1.4e-7, 1.7e-7, 1.1e-7]))
            .0
            .suspicious
            .is_empty());
        assert_eq!(
            outliers(&dense(&[2e-7, 5e-7, 1.4e-7, 1.7e-7, 1.1e-7]))
                .0
                .suspicious,
            [1]
        );
        // Bit-exact peers: any difference stands out; all bit-exact: nothing does.
        assert_eq!(outliers(&dense(&[0.0, 1e-8, 0.0])).0.suspicious, [1]);
        assert!(outliers(&dense(&[0.0, 0.0, 0.0])).0.suspicious.is_empty());
        // An MoE layer's mlp_out is not read: only its attn_out.
        let moe = [
            (0, Some(2e-7), None, String::new()),
            (1, Some(1.5e-7), None, String::new()),
            (2, Some(1.8e-7), None, String::new()),
        ];
        assert!(outliers(&moe).0.suspicious.is_empty());
        let two = outliers(&dense(&[1e-7, 1e-3])).0;
        assert!(!two.checked && two.not_checked.unwrap().starts_with("2 layers isolated"));
        let none = outliers(&[]).0;
        assert!(!none.checked && none.not_checked.unwrap().starts_with("0 layers isolated"));
    }

    #[test]
    fn peers_are_layers_of_one_kind() {
        // A clean engine-vs-oracle bisection of an 8-layer hybrid Qwen3.5-MoE (docs/bisect.md,
        // "Outliers"): attn_out's isolated errors, layers 3 and 7 full attention, the rest linear.
        let measured = [
            4.29e-7, 4.17e-7, 4.44e-7, 2.62e-7, 2.21e-7, 2.52e-7, 7.66e-7, 2.24e-7,
        ];
        let errors = |kinds: bool| -> Vec<LayerErrors> {
            measured
                .iter()
                .enumerate()
                .map(|(l, &x)| {
                    let k = match (kinds, l % 4 == 3) {
                        (false, _) => "",
                        (true, true) => "full_attention",
                        (true, false) => "linear_attention",
                    };
                    (l, Some(x), None, k.to_string())
                })
                .collect()
        };
        // Among every layer, linear layer 6 is 2.9× the median (full layers pull it down).
        assert_eq!(outliers(&errors(false)).0.suspicious, [6]);
        // Among its kind it is not; the two full layers are too few to compare, and it says so.
        let (o, per) = outliers(&errors(true));
        assert!(o.checked && o.suspicious.is_empty(), "{o:?}");
        assert!(
            o.not_checked
                .as_deref()
                .is_some_and(|n| n.starts_with("2 layers of kind full_attention isolated")),
            "{o:?}"
        );
        assert!(per
            .iter()
            .filter(|p| p.0 % 4 == 3)
            .all(|p| p.1.is_none() && !p.2));
        // A planted layer still stands out among its kind.
        let mut planted = errors(true);
        planted[2].1 = Some(1.2e-6);
        assert_eq!(outliers(&planted).0.suspicious, [2]);
    }
}

tracegate_diff::string_enum! {
    /// What a differ finding is, as the differ itself treats it (docs/diff.md): one reading for
    /// `gate bisect` and `gate m0|m1 … agrees`, so a pair trace-diff calls within policy is
    /// never "structure differs" in one of them.
    pub enum FindingClass {
        /// About the values of a tensor or decision both traces hold: the differ judges it by
        /// that tensor's row (`per_tensor[].status`) or that decision's rows, and the finding
        /// only names what kind of difference it is. A signed zero, a NaN on one side, another
        /// NaN payload and an infinity are values: under a policy a signed zero (0 ULP) can be
        /// within it, a NaN or infinity difference breaks `nonfinite_differences`; by bits each
        /// is a differing element.
        Values = "values",
        /// What the traces hold or how they are laid out: a tensor or decision on one side only,
        /// another order, attributes, path, mask, positions; or the pair refused.
        Structure = "structure",
        /// Says how the comparison ran, not that anything differs (an allowed stack mismatch,
        /// decisions forced from the other side).
        Note = "note",
    }
}

/// The class of a finding kind (see [`FindingClass`]).
pub fn finding_class(kind: tracegate_diff::FindingKind) -> FindingClass {
    use tracegate_diff::FindingKind as K;
    match kind {
        K::ValuesDiffer
        | K::OutsidePolicy
        | K::SignedZero
        | K::NanMismatch
        | K::NanPayload
        | K::Infinity
        | K::DecisionDiffers
        | K::MarginDiffers
        | K::MarginContradictsScores
        | K::DtypeMismatch
        | K::ShapeMismatch
        | K::Rerouted
        | K::CommitNotArgmax
        | K::RoundingMode => FindingClass::Values,
        K::StackMismatchAllowed
        | K::DecisionsForced
        | K::ComparabilityNotChecked
        | K::PolicyPrecisionMismatch
        | K::PrecisionClaim
        | K::SamplingDivergence
        | K::AfterSamplingDivergence
        | K::VerifiedInPart => FindingClass::Note,
        K::Unreadable
        | K::StackMismatch
        | K::WeightsMismatch
        | K::PromptMismatch
        | K::SeedMismatch
        | K::PathMismatch
        | K::MaskMismatch
        | K::PositionsMismatch
        | K::MissingTensor
        | K::ExtraTensor
        | K::OrderMismatch
        | K::AttributeDiffers
        | K::NoPolicyRule
        | K::MissingDecision
        | K::ExtraDecision
        | K::DecisionShapeMismatch
        | K::DecisionOrderMismatch
        | K::MarginPresenceMismatch
        | K::ContentDigestDiffers
        | K::NoiseReferenceRefused
        | K::PrecisionDeclarationRefused
        | K::NothingSelected => FindingClass::Structure,
    }
}
