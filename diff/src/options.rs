//! What a comparison is asked to do ([`Options`]): verify digests, scan past the first
//! difference, judge by a policy against a noise reference, and which tensors are compared.
//! Every phase reads it; [`crate::compare()`] takes it.

use crate::{Filter, NoiseReference, Policy};

#[derive(Clone, Debug)]
pub struct Options {
    /// Recompute every digest of both traces first. Without it the per-tensor digests are not
    /// trusted either, so every common tensor is compared element by element.
    pub verify: bool,
    /// Downgrade the oracle stack rule (versions, dtype, device, attention) to a finding.
    pub allow_stack_mismatch: bool,
    /// Keep scanning values after the first differing tensor.
    pub all: bool,
    /// Judge numeric differences by this policy (implies scanning every tensor).
    pub policy: Option<Policy>,
    /// `--only` / `--skip`: the tensors and decisions compared; the rest are left out.
    pub filter: Filter,
    /// `--noise-reference`: what the policy's `max_noise_ratio` bounds measure against.
    pub noise: Option<NoiseReference>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            verify: true,
            allow_stack_mismatch: false,
            all: false,
            policy: None,
            filter: Filter::default(),
            noise: None,
        }
    }
}

impl Options {
    /// Whether the tensor or decision `name` is compared (see [`Filter`]).
    pub fn selects(&self, name: &str) -> bool {
        self.filter.selects(name)
    }
}
