//! `gate bisect --generate N`: the decode path (docs/bisect.md, "Decode"). The whole runs were
//! made with `--generate N --cache on --capture internals`; once their prefill agrees, the
//! decode steps (`decode.SSSS.*` tensors and decisions, docs/producers.md) are compared in order
//! to name the first diverging step s. Then the candidate's own `--cache off` run is compared
//! with its cached run: a difference at or before s means its cached decode path disagrees with
//! the full recompute. Last, each layer is isolated at step s: the candidate's
//! `layer --decode-from P` (P = n+s−1) runs on the reference's rows of that layer's input at
//! positions 0..P, and its one decode row is compared with the reference's step-s tensors.
//!
//! The parts: report.rs the report types, steps.rs the driver (the first diverging step and the
//! verdict), cache.rs the cached-path self-check, isolate.rs the layers isolated at that step,
//! render.rs the text output.

use tracegate_diff::{Filter, Options, Policy};
use tracegate_trace::names::Name;
use tracegate_trace::Trace;

mod cache;
pub(crate) mod isolate;
pub(crate) mod render;
mod report;
mod steps;

pub use render::render;
pub use report::*;
pub use steps::run;

/// What the prefill bisection hands over.
pub struct Context<'a> {
    pub reference: &'a Trace,
    pub candidate: &'a Trace,
    pub policy: &'a Option<Policy>,
    /// Decoder layers.
    pub layers: usize,
    pub allow_stack_mismatch: bool,
}

/// The whole runs' comparison leaves the decode steps to this module, and a sampling model's
/// passes after the prompt to ../diffusion/.
pub fn prefill_filter(generate: usize, sampling: bool) -> Filter {
    Filter {
        only: vec![],
        skip: match (generate > 0, sampling) {
            (false, _) => vec![],
            (true, false) => vec!["decode.**".into()],
            (true, true) => vec!["encode.**".into(), "denoise.**".into()],
        },
    }
}

/// Options for the decode comparisons, judged by `policy` (the whole runs' judge). Nothing is
/// filtered out: the steps are read from the `decode.SSSS.*` rows, but the prefill stays in view,
/// because a tensor left out excuses no flip after it (docs/diff.md, "The near-tie rule") and an
/// honest decode near-tie needs its clean prefill to be seen as clean.
fn decode_view(c: &Context) -> Options {
    Options {
        all: true,
        policy: c.policy.clone(),
        allow_stack_mismatch: c.allow_stack_mismatch,
        ..Options::default()
    }
}

/// The step of a `decode.SSSS.…` name (every digit: a step past 9999 has more than four).
fn step_of(name: &str) -> Option<usize> {
    Name::parse(name).decode_step
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_step_is_every_digit_up_to_the_dot() {
        assert_eq!(super::step_of("decode.0003.logits"), Some(3));
        assert_eq!(
            super::step_of("decode.10000.layer.01.attn_out"),
            Some(10000)
        );
        assert_eq!(super::step_of("decode.x.logits"), None);
        assert_eq!(super::step_of("layer.01.attn_out"), None);
    }
}
