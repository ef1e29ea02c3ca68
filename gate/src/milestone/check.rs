//! What a milestone run checks, by name (milestones.json's `check`, the report's `check`), and
//! what a check finds: the gate's finding kinds.

use serde::Serialize;

/// A check of a milestone run; a baseline's is `baseline ID` (`baselines` when none applied).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Check {
    Stable,
    Matches,
    Generation,
    Agrees,
    GenerationOracle,
    /// A port's greedy tokens against its golden trace's (docs/gate.md, "Gate your own engine").
    GenerationReference,
    /// A sharded milestone (docs/gate.md, "m2"): the merged rank traces of the sharded engine
    /// ≡ the unsharded engine, bit for bit.
    MergedEngine,
    /// The merged sharded contract ≡ the merged sharded engine, bit for bit.
    MergedContract,
    /// The merged sharded oracle within the policy of the unsharded oracle, every decision and
    /// greedy token equal.
    MergedOracle,
    /// Each rank trace holds the part its mode says: head slices, an expert on one rank.
    RankShards,
    Baseline(String),
    Baselines,
}

impl std::fmt::Display for Check {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Check::Stable => f.pad("stable"),
            Check::Matches => f.pad("matches"),
            Check::Generation => f.pad("generation"),
            Check::Agrees => f.pad("agrees"),
            Check::GenerationOracle => f.pad("generation_oracle"),
            Check::GenerationReference => f.pad("generation_reference"),
            Check::MergedEngine => f.pad("merged_engine"),
            Check::MergedContract => f.pad("merged_contract"),
            Check::MergedOracle => f.pad("merged_oracle"),
            Check::RankShards => f.pad("rank_shards"),
            Check::Baseline(id) => f.pad(&format!("baseline {id}")),
            Check::Baselines => f.pad("baselines"),
        }
    }
}

impl std::str::FromStr for Check {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Check, String> {
        Ok(match s {
            "stable" => Check::Stable,
            "matches" => Check::Matches,
            "generation" => Check::Generation,
            "agrees" => Check::Agrees,
            "generation_oracle" => Check::GenerationOracle,
            "generation_reference" => Check::GenerationReference,
            "merged_engine" => Check::MergedEngine,
            "merged_contract" => Check::MergedContract,
            "merged_oracle" => Check::MergedOracle,
            "rank_shards" => Check::RankShards,
            "baselines" => Check::Baselines,
            _ => match s.strip_prefix("baseline ") {
                Some(id) => Check::Baseline(id.to_string()),
                None => return Err(format!("{s:?} is not a check")),
            },
        })
    }
}

impl Serialize for Check {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Check {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Check, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

/// What a gate finding is (docs/gate.md, the report's `findings[].kind`, a declared
/// divergence's `kind`): what a check states itself, with its own count, or a differ finding of
/// structure or comparability that a check passes on under the differ's word (`Differ`). The
/// gate reads the differ's reports with the differ's kinds; what it finds is one of these.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FindingKind {
    /// `matches`: a tensor's bits differ (count: differing elements).
    TensorDiffers,
    /// A decision's rows differ (count: differing rows; for `agrees`, those labelled
    /// `consequence` or `defect`).
    DecisionDiffers,
    /// `agrees`: a tensor outside the policy.
    OutsidePolicy,
    /// `agrees`: a tensor no rule of the policy matches.
    NoRule,
    /// A comparison's verdict says the runs differ and no other finding says how.
    Different,
    /// A recorded count (`tensors`, `decisions`, `differing_elements`,
    /// `oracle_decisions_differing`) is not this run's.
    CountChanged,
    /// `stable`: a run's digest is not the one recorded.
    DigestChanged,
    /// Two runs' greedy tokens differ (count: differing positions).
    TokensDiffer,
    /// The greedy tokens are not the ones recorded.
    TokensChanged,
    /// A baseline's observation is outside `--assert-observed`.
    ObservedOutOfTolerance,
    /// A run's provenance says it is not the run the gate asked for (`generation`: the
    /// uncached run's `cache` is not `"off"`, or the cached run's not `"on"`).
    NotAsAsked,
    /// A sharded port's rank traces refused (docs/producers.md, "Sharded engines"): a rank's
    /// file missing or extra, another world size than `--ranks`, or the merge's refusal; named
    /// by the rank at fault (`rank 1`). Never excused: nothing merged is left to judge.
    RankTraces,
    /// `rank_shards`: a rank trace does not hold what its mode says (a head point replicated, an
    /// expert on two ranks), or its rank traces do not merge.
    ShardLayout,
    /// The differ's finding (docs/diff.md), passed on by a check.
    Differ(tracegate_diff::FindingKind),
}

impl FindingKind {
    /// What the gate's checks state themselves. The last eleven are words of the gate's alone,
    /// in the order its refusal lists them after the differ's.
    pub const OWN: &'static [FindingKind] = &[
        FindingKind::DecisionDiffers,
        FindingKind::OutsidePolicy,
        FindingKind::TensorDiffers,
        FindingKind::Different,
        FindingKind::NoRule,
        FindingKind::CountChanged,
        FindingKind::DigestChanged,
        FindingKind::TokensDiffer,
        FindingKind::TokensChanged,
        FindingKind::ObservedOutOfTolerance,
        FindingKind::NotAsAsked,
        FindingKind::RankTraces,
        FindingKind::ShardLayout,
    ];

    /// The word the reports and milestones.json carry.
    pub fn as_str(self) -> &'static str {
        match self {
            FindingKind::TensorDiffers => "tensor_differs",
            FindingKind::DecisionDiffers => "decision_differs",
            FindingKind::OutsidePolicy => "outside_policy",
            FindingKind::Different => "different",
            FindingKind::NoRule => "no_rule",
            FindingKind::CountChanged => "count_changed",
            FindingKind::DigestChanged => "digest_changed",
            FindingKind::TokensDiffer => "tokens_differ",
            FindingKind::TokensChanged => "tokens_changed",
            FindingKind::ObservedOutOfTolerance => "observed_out_of_tolerance",
            FindingKind::NotAsAsked => "not_as_asked",
            FindingKind::RankTraces => "rank_traces",
            FindingKind::ShardLayout => "shard_layout",
            FindingKind::Differ(k) => k.as_str(),
        }
    }

    /// The differ's kind, for a finding a check passed on from the differ.
    pub fn differ(self) -> Option<tracegate_diff::FindingKind> {
        match self {
            FindingKind::Differ(k) => Some(k),
            _ => None,
        }
    }
}

impl From<tracegate_diff::FindingKind> for FindingKind {
    fn from(k: tracegate_diff::FindingKind) -> FindingKind {
        FindingKind::Differ(k)
    }
}

impl std::fmt::Display for FindingKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(self.as_str())
    }
}

impl std::str::FromStr for FindingKind {
    type Err = String;
    /// The gate's own words first, then the differ's; refused naming every word either knows.
    fn from_str(s: &str) -> std::result::Result<FindingKind, String> {
        if let Some(k) = FindingKind::OWN.iter().find(|k| k.as_str() == s) {
            return Ok(*k);
        }
        s.parse::<tracegate_diff::FindingKind>()
            .map(FindingKind::Differ)
            .map_err(|_| {
                let mut words: Vec<&str> = tracegate_diff::FindingKind::ALL
                    .iter()
                    .map(|k| k.as_str())
                    .collect();
                for k in FindingKind::OWN {
                    if !words.contains(&k.as_str()) {
                        words.push(k.as_str());
                    }
                }
                format!(
                    "{s:?} is not a FindingKind: expected one of {}",
                    words.join(", ")
                )
            })
    }
}

impl Serialize for FindingKind {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> serde::Deserialize<'de> for FindingKind {
    fn deserialize<D: serde::Deserializer<'de>>(
        d: D,
    ) -> std::result::Result<FindingKind, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_finding_word_reads_back_as_its_kind() {
        for k in FindingKind::OWN {
            assert_eq!(k.as_str().parse::<FindingKind>(), Ok(*k));
        }
        for k in tracegate_diff::FindingKind::ALL {
            let read: FindingKind = k.as_str().parse().unwrap();
            assert_eq!(read.as_str(), k.as_str());
            if !FindingKind::OWN.contains(&read) {
                assert_eq!(read, FindingKind::Differ(*k));
            }
        }
        let e = "decision_differ".parse::<FindingKind>().unwrap_err();
        assert!(e.starts_with("\"decision_differ\" is not a FindingKind: expected one of "));
        for k in FindingKind::OWN {
            assert!(e.contains(k.as_str()), "{e}");
        }
    }
}
