//! The decode part of the bisect report (docs/bisect.md, "Decode").

use serde::Serialize;
use tracegate_diff::string_enum;

use crate::bisect::prefill::{DecisionCmp, How, LayerRow, Stage, TensorCmp};

string_enum! {
    /// The candidate's cached decode against its own full recompute.
    pub enum CacheStatus {
        /// No difference at or before the diverging step.
        Agrees = "agrees",
        Disagrees = "disagrees",
        NotChecked = "not_checked",
    }
}

string_enum! {
    /// Whether the decode steps were compared.
    pub enum DecodeStatus {
        Compared = "compared",
        /// The prefill verdict wins (`reason`).
        NotCompared = "not_compared",
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct CacheCheck {
    pub status: CacheStatus,
    /// The candidate's `--cache off` trace.
    pub trace: Option<String>,
    /// The first difference between the candidate's cached and uncached decode steps.
    pub first_step: Option<usize>,
    pub first_tensor: Option<String>,
    pub detail: Option<String>,
    pub reason: Option<String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct DecodeReport {
    /// `--generate N`: decode steps in each whole run.
    pub generate: usize,
    pub status: DecodeStatus,
    pub reason: Option<String>,
    /// Steps compared, 0.. in order: up to and including the first diverging one.
    pub steps_compared: usize,
    pub first_diverging_step: Option<usize>,
    /// Its absolute position, n+s−1.
    pub position: Option<i64>,
    /// The first tensor or decision of that step that differs (or is outside the policy, or on
    /// one side only), and how.
    pub first_diverging: Option<String>,
    pub first_diverging_how: Option<How>,
    /// The step's differing tensors and decision.
    pub step_tensors: Vec<TensorCmp>,
    pub step_decisions: Vec<DecisionCmp>,
    /// Null when no step diverged (nothing to check).
    pub cache_check: Option<CacheCheck>,
    /// Layers isolated at the diverging step (`layer --decode-from P`), as the prefill's table:
    /// `whole_*` from `decode.SSSS.layer.LL.hidden_out`, `isolated_*` the candidate's decode row.
    pub layers: Vec<LayerRow>,
    pub first_wrong_layer: Option<usize>,
    pub stage: Option<Stage>,
    /// Why the isolation at that step did not run or did not finish.
    pub isolation_not_checked: Option<String>,
}

impl DecodeReport {
    pub(crate) fn new(generate: usize) -> DecodeReport {
        DecodeReport {
            generate,
            status: DecodeStatus::Compared,
            reason: None,
            steps_compared: 0,
            first_diverging_step: None,
            position: None,
            first_diverging: None,
            first_diverging_how: None,
            step_tensors: vec![],
            step_decisions: vec![],
            cache_check: None,
            layers: vec![],
            first_wrong_layer: None,
            stage: None,
            isolation_not_checked: None,
        }
    }
}
