//! The words the reports share between crates — the verdict, finding kinds, row and decision
//! statuses, margin states, flip labels — as enums. Each serialises to exactly the string the JSON reports carry
//! (docs/diff-report.schema.json), so code matches them exhaustively and a typo does not compile.
//! And the form every real number of a report takes ([`Real`]).

use serde::{Serialize, Serializer};

/// An enum whose variants are written as fixed strings: `as_str`, `Display` (padded like a
/// `str`), `FromStr`, serde both ways, and ordering by the string (so a map keyed by one
/// serialises in the same order as one keyed by its string).
#[macro_export]
macro_rules! string_enum {
    ($(#[$m:meta])* $vis:vis enum $name:ident { $($(#[$vm:meta])* $var:ident = $s:literal),+ $(,)? }) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        $vis enum $name { $($(#[$vm])* $var),+ }

        impl $name {
            /// Every variant, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$var),+];
            /// The word the reports carry.
            pub fn as_str(self) -> &'static str {
                match self { $($name::$var => $s),+ }
            }
        }

        impl ::std::str::FromStr for $name {
            type Err = ::std::string::String;
            fn from_str(s: &str) -> ::std::result::Result<Self, Self::Err> {
                match s {
                    $($s => Ok($name::$var),)+
                    other => Err(format!(
                        "{other:?} is not a {}: expected one of {}",
                        stringify!($name),
                        [$($s),+].join(", ")
                    )),
                }
            }
        }

        impl ::std::fmt::Display for $name {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.pad(self.as_str())
            }
        }

        impl PartialOrd for $name {
            fn partial_cmp(&self, other: &Self) -> Option<::std::cmp::Ordering> {
                Some(self.cmp(other))
            }
        }

        impl Ord for $name {
            fn cmp(&self, other: &Self) -> ::std::cmp::Ordering {
                self.as_str().cmp(other.as_str())
            }
        }

        impl $crate::__serde::Serialize for $name {
            fn serialize<S: $crate::__serde::Serializer>(
                &self,
                s: S,
            ) -> ::std::result::Result<S::Ok, S::Error> {
                s.serialize_str(self.as_str())
            }
        }

        impl<'de> $crate::__serde::Deserialize<'de> for $name {
            fn deserialize<D: $crate::__serde::Deserializer<'de>>(
                d: D,
            ) -> ::std::result::Result<Self, D::Error> {
                let s = <::std::string::String as $crate::__serde::Deserialize>::deserialize(d)?;
                s.parse().map_err(<D::Error as $crate::__serde::de::Error>::custom)
            }
        }
    };
}

string_enum! {
    /// The outcome, one word; [`Verdict::exit_code`] is the CLI's exit status.
    pub enum Verdict {
        Identical = "identical",
        Different = "different",
        WithinPolicy = "within_policy",
        Incomparable = "incomparable",
        Unreadable = "unreadable",
        /// Nothing judged failed, but rows after an excused near-tie were not judged: the
        /// continuation is compared only with the decision forced (docs/diff.md).
        NotChecked = "not_checked",
    }
}

impl Verdict {
    pub fn exit_code(self) -> i32 {
        match self {
            Verdict::Identical | Verdict::WithinPolicy => 0,
            Verdict::Different => 1,
            Verdict::Unreadable => 2,
            Verdict::Incomparable => 3,
            Verdict::NotChecked => 4,
        }
    }
}

string_enum! {
    /// What a finding is about (docs/diff.md). The differ emits the first group; the gate also
    /// states its own checks' findings with the last group (docs/gate.md).
    pub enum FindingKind {
        Unreadable = "unreadable",
        StackMismatch = "stack_mismatch",
        StackMismatchAllowed = "stack_mismatch_allowed",
        /// A comparability key (`weights_digest`, `prompt_tokens`) one side does not record: that
        /// rule did not run, and the report says so (a note; the verdict is unchanged).
        ComparabilityNotChecked = "comparability_not_checked",
        /// The policy's bounds were measured for another precision than the candidate's.
        PolicyPrecisionMismatch = "policy_precision_mismatch",
        WeightsMismatch = "weights_mismatch",
        PromptMismatch = "prompt_mismatch",
        SeedMismatch = "seed_mismatch",
        PathMismatch = "path_mismatch",
        MaskMismatch = "mask_mismatch",
        PositionsMismatch = "positions_mismatch",
        MissingTensor = "missing_tensor",
        ExtraTensor = "extra_tensor",
        DtypeMismatch = "dtype_mismatch",
        ShapeMismatch = "shape_mismatch",
        OrderMismatch = "order_mismatch",
        AttributeDiffers = "attribute_differs",
        ValuesDiffer = "values_differ",
        Rerouted = "rerouted",
        SignedZero = "signed_zero",
        NanMismatch = "nan_mismatch",
        NanPayload = "nan_payload",
        Infinity = "infinity",
        OutsidePolicy = "outside_policy",
        NoPolicyRule = "no_policy_rule",
        MissingDecision = "missing_decision",
        ExtraDecision = "extra_decision",
        DecisionShapeMismatch = "decision_shape_mismatch",
        DecisionOrderMismatch = "decision_order_mismatch",
        DecisionDiffers = "decision_differs",
        MarginDiffers = "margin_differs",
        MarginPresenceMismatch = "margin_presence_mismatch",
        MarginContradictsScores = "margin_contradicts_scores",
        ContentDigestDiffers = "content_digest_differs",
        DecisionsForced = "decisions_forced",
        NothingSelected = "nothing_selected",
        /// Two traces of different `rng`, the candidate not forced, first differ at a draw: not
        /// a defect; what follows it is not judged (docs/diff.md, "Sampling divergence").
        SamplingDivergence = "sampling_divergence",
        /// A side's committed canvas row is not its own last step's argmax row (docs/diff.md,
        /// "Diffusion decisions"): the reply was taken from another canvas.
        CommitNotArgmax = "commit_not_argmax",
        /// A tensor or decision after a sampling divergence in a step, commit pass or block only
        /// one side ran: not a structure difference (docs/diff.md, "Sampling divergence").
        AfterSamplingDivergence = "after_sampling_divergence",
        /// A `--noise-reference` that is the candidate's own content or not a reference
        /// producer's run: honest noise is tracegate's measurement (docs/diff.md).
        NoiseReferenceRefused = "noise_reference_refused",
        /// The candidate's tensors hold values finer than the claimed precision: a note in the
        /// headline, not a verdict (docs/diff.md, "Policies").
        PrecisionClaim = "precision_claim",
        /// The candidate's own precision declaration names no precision, or a pattern that
        /// matches none of its tensors: refused (a structure finding; docs/diff.md, "Policies").
        PrecisionDeclarationRefused = "precision_declaration_refused",
        /// A bf16 candidate's values are the f32 reference's truncated, not rounded to nearest
        /// even (docs/diff.md, "Rounding mode"): fails, within the policy's bounds or not.
        RoundingMode = "rounding_mode",
        /// A DIFFERENT found before every payload was hashed: what was read is verified, the
        /// rest is not, and the finding counts both (docs/diff.md, "Early exit").
        VerifiedInPart = "verified_in_part",
    }
}

string_enum! {
    /// How one common tensor compared (a `per_tensor` row's `status`).
    pub enum RowStatus {
        Identical = "identical",
        Different = "different",
        WithinPolicy = "within_policy",
        OutsidePolicy = "outside_policy",
        /// No rule of the policy matches the tensor.
        NoRule = "no_rule",
        /// Not scanned; the verified digests differ.
        DiffersByDigest = "differs_by_digest",
        /// Not scanned, digests not trusted.
        Unknown = "unknown",
        /// An expert's tokens differ, not all after a near-tie (docs/diff.md, "Rerouted experts").
        Rerouted = "rerouted",
        /// Not judged: a tensor of a decode step after a near-tie chose another token, so every
        /// row of it runs on another sequence (docs/diff.md, "Near-ties under a policy").
        AfterNearTie = "after_near_tie",
        /// Not judged: captured after a sampling divergence, so it computes on another canvas
        /// (docs/diff.md, "Sampling divergence").
        AfterSamplingDivergence = "after_sampling_divergence",
    }
}

impl RowStatus {
    /// Whether the tensor counts as agreeing: bit-identical or within the policy.
    pub fn agrees(self) -> bool {
        match self {
            // Left out, and counted as such (`near_ties.tensors`), not found wrong.
            RowStatus::Identical
            | RowStatus::WithinPolicy
            | RowStatus::AfterNearTie
            | RowStatus::AfterSamplingDivergence => true,
            RowStatus::Different
            | RowStatus::OutsidePolicy
            | RowStatus::NoRule
            | RowStatus::DiffersByDigest
            | RowStatus::Unknown
            | RowStatus::Rerouted => false,
        }
    }
}

string_enum! {
    /// How one common decision compared.
    pub enum DecisionStatus {
        Identical = "identical",
        Different = "different",
        ShapeMismatch = "shape_mismatch",
    }
}

string_enum! {
    /// The margins of a decision's rows whose values are equal.
    pub enum Margins {
        /// Bit for bit.
        Identical = "identical",
        /// Policy only: every difference within the margin tolerance.
        WithinTolerance = "within_tolerance",
        Different = "different",
        /// Neither side has margins.
        Absent = "absent",
        ReferenceOnly = "reference_only",
        CandidateOnly = "candidate_only",
        /// The shapes differ.
        NotCompared = "not_compared",
    }
}

string_enum! {
    /// What a differing decision row is (docs/diff.md, "Labels").
    pub enum Label {
        /// Something upstream is outside the policy (differs, by bits).
        Consequence = "consequence",
        /// The reference gap it crossed is within the noise bound.
        NearTie = "near-tie",
        /// A row after a near-tie: another sequence from there on.
        AfterNearTie = "after-near-tie",
        /// None of the above: the decision rule itself differs.
        Defect = "defect",
        /// A row of the first draw that differs between producers of different `rng`, the
        /// candidate not forced (docs/diff.md, "Sampling divergence").
        SamplingDivergence = "sampling-divergence",
        /// A row of a decision taken after a sampling divergence: another canvas from there on.
        AfterSamplingDivergence = "after-sampling-divergence",
    }
}

impl Label {
    /// A near-tie, a row after one, or a sampling divergence and the rows after it: under a
    /// policy it does not fail the verdict.
    pub fn excused(self) -> bool {
        match self {
            Label::NearTie
            | Label::AfterNearTie
            | Label::SamplingDivergence
            | Label::AfterSamplingDivergence => true,
            Label::Consequence | Label::Defect => false,
        }
    }
}

/// An f64 that serialises non-finite values as the strings "inf", "-inf", "nan" (JSON has no
/// such numbers, and null would read as "not measured").
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Real(pub f64);

impl Serialize for Real {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let v = self.0;
        if v.is_finite() {
            s.serialize_f64(v)
        } else if v.is_nan() {
            s.serialize_str("nan")
        } else if v > 0.0 {
            s.serialize_str("inf")
        } else {
            s.serialize_str("-inf")
        }
    }
}
