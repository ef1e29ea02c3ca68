//! The block-diffusion part of the bisect report (docs/bisect.md, "Block diffusion").

use serde::Serialize;

use crate::bisect::decode::DecodeStatus;
use crate::bisect::options::BisectOptions;
use crate::bisect::prefill::{
    DecisionCmp, DecisionsForced, How, Inconsistency, LayerRow, Stage, TensorCmp,
};

#[derive(Clone, Debug, Serialize)]
pub struct DiffusionReport {
    /// `--generate N` and the sampler's seed of the whole runs.
    pub generate: usize,
    pub seed: u64,
    pub status: DecodeStatus,
    /// Why the passes were not compared, or what of them was not judged.
    pub reason: Option<String>,
    /// The candidate traced again taking the reference's draws and decisions (its generator
    /// differs); null when the draws agreed.
    pub forced: Option<DecisionsForced>,
    /// Forced: the argmax and router decisions the candidate overrode in rows their own numbers
    /// do not explain (margins outside the policy, or a row's own margin putting the reference's
    /// choice on top with no exact tie); their rows and why: `forced.overrides_unexplained`.
    pub forced_unexplained: Vec<String>,
    /// Passes after the prompt in the reference (denoise steps and commit passes), and those
    /// compared up to and including the first diverging one.
    pub passes: usize,
    pub passes_compared: usize,
    /// Its prefix (`denoise.BBBB.SSSS.`, `encode.BBBB.`, `denoise.BBBB.`) and in words.
    pub first_diverging_pass: Option<String>,
    pub place: Option<String>,
    /// The first tensor or decision of that pass that differs, and how.
    pub first_diverging: Option<String>,
    pub first_diverging_how: Option<How>,
    /// That pass's differing tensors and decisions.
    pub pass_tensors: Vec<TensorCmp>,
    pub pass_decisions: Vec<DecisionCmp>,
    /// The layers isolated at that pass, as the prefill's table (`whole_*`: the pass's
    /// `hidden_out` in the whole runs).
    pub layers: Vec<LayerRow>,
    pub first_wrong_layer: Option<usize>,
    pub stage: Option<Stage>,
    /// The candidate's layer verb against its own whole run at the blamed layer.
    pub inconsistent: Option<Inconsistency>,
    pub self_check_not_checked: Option<String>,
    /// Why the isolation at that pass did not run or did not finish.
    pub isolation_not_checked: Option<String>,
}

impl DiffusionReport {
    pub(super) fn new(o: &BisectOptions, passes: usize) -> DiffusionReport {
        DiffusionReport {
            generate: o.generate,
            seed: o.sampler_seed,
            status: DecodeStatus::Compared,
            reason: None,
            forced: None,
            forced_unexplained: vec![],
            passes,
            passes_compared: 0,
            first_diverging_pass: None,
            place: None,
            first_diverging: None,
            first_diverging_how: None,
            pass_tensors: vec![],
            pass_decisions: vec![],
            layers: vec![],
            first_wrong_layer: None,
            stage: None,
            inconsistent: None,
            self_check_not_checked: None,
            isolation_not_checked: None,
        }
    }
}
