//! baselines.json: deterministic counts asserted exactly, observations reported with their
//! delta. Each baseline states as data the conditions it applies to.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::{gerr, Result};

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BaselineFile {
    pub schema: u32,
    pub baselines: Vec<Baseline>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Baseline {
    pub id: String,
    pub milestone: String,
    /// Conditions, all of which must hold for this baseline to apply:
    /// `prompt`, `threads`, `generate`, `model` (each compared as JSON values).
    pub requires: BTreeMap<String, Value>,
    /// Deterministic: asserted exactly.
    pub counts: BTreeMap<String, Value>,
    /// Seconds and KiB: reported with the delta; asserted only with `--assert-observed`.
    pub observed: BTreeMap<String, f64>,
}

/// What a run offers to be matched against `requires`.
pub type Conditions = BTreeMap<String, Value>;

impl BaselineFile {
    pub fn load(path: &Path) -> Result<BaselineFile> {
        if !path.exists() {
            return Ok(BaselineFile {
                schema: 1,
                baselines: Vec::new(),
            });
        }
        let f: BaselineFile = crate::read_json(path)?;
        if f.schema != 1 {
            return Err(gerr!(
                "{}: schema {} is not supported",
                path.display(),
                f.schema
            ));
        }
        Ok(f)
    }
}

impl Baseline {
    /// `None` when it applies; otherwise the first unmet condition, as a reason.
    pub fn unmet(&self, conditions: &Conditions) -> Option<String> {
        for (key, want) in &self.requires {
            match conditions.get(key) {
                Some(have) if have == want => {}
                Some(have) => {
                    return Some(format!("requires {key}={want}, this run has {key}={have}"))
                }
                None => {
                    return Some(format!(
                        "requires {key}={want}, which this run does not record"
                    ))
                }
            }
        }
        None
    }
}
