//! What a milestone run checks, by name (milestones.json's `check`, the report's `check`).

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
