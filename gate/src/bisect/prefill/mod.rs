//! The prefill's bisection (docs/bisect.md): both producers write whole traces; then the
//! candidate's `layer` verb runs each layer alone on the **reference's** input to that layer, so
//! a layer that matches in isolation but differs in the whole run has inherited its difference
//! from upstream. Within the first wrong layer the capture points name the first wrong
//! sub-stage. `--calibrate` chains the reference's own layer verb over a 1-ULP perturbation of
//! its input, to say how large the candidate's difference is next to rounding noise. Before a
//! layer body is blamed, the candidate's layer verb is checked against its own whole run
//! (`inconsistent_producer`). How it judges, the rounding-level reading and the outlier flag:
//! ../judge.rs. The decode steps (../decode/) are built on what is here.
//!
//! This file: the options and the helpers the phases share. The phases, which crate::bisect's
//! `run` drives: whole.rs the whole runs (run, judge, force decisions, locate), layers.rs the
//! per-layer phases, isolate.rs layer isolation and self-consistency, calibrate.rs
//! `--calibrate`, verdict.rs the verdict, overrides.rs a forced candidate's own overrides judged
//! row by row (the prefill's and the block diffusion's); report.rs holds the report's types.

use std::path::Path;

use serde::Serialize;
use serde_json::json;
use tracegate_diff::{
    compare, string_enum, FindingKind, Label, Options, Policy, Report, RowStatus, Verdict,
};
use tracegate_producers::{Producer, RunRecord, Verb};
use tracegate_trace::names::{self, Name};
use tracegate_trace::{Attributes, DType, Trace, TraceWriter};

use crate::bisect::judge::{self as judge, Ask, Judge, Outliers};
// The bisection's options and producers, which every phase reads (../options.rs, ../work.rs).
use crate::bisect::options::{is_ordered, BisectOptions, Reference, StoredReference};
use crate::bisect::work::run_fresh;
use crate::{gerr, Result};

mod calibrate;
mod isolate;
pub(super) mod layers;
pub(crate) mod overrides;
mod report;
mod stored;
mod verdict;
pub(super) mod whole;

pub use calibrate::*;
pub(crate) use isolate::*;
pub use report::*;
pub(crate) use verdict::*;

// ------------------------------------------------------------------------------------------
// Helpers

pub(crate) fn is_oracle(t: &Trace) -> bool {
    tracegate_diff::comparable::is_oracle(t.provenance())
}

/// Where a capture point sits: -1 embed, NN a layer, i64::MAX the head (final norm, logits, decode).
pub(crate) fn location(name: &str) -> i64 {
    if name.starts_with("embed.") {
        return -1;
    }
    let n = Name::parse(name);
    match (n.decode_step, n.layer) {
        (None, Some(l)) => l as i64,
        _ => i64::MAX,
    }
}

pub(crate) fn rows(rep: &Report) -> Vec<TensorCmp> {
    rep.per_tensor
        .iter()
        .map(|r| TensorCmp {
            tensor: r.tensor.clone(),
            status: CmpStatus::Row(r.status),
            differing_elements: r.differing_elements,
            total_elements: r.total_elements,
            max_ulp: r.max_ulp,
            rel_l2: r.rel_l2.map(|x| x.0),
            cosine: r.cosine.map(|x| x.0),
            scale_error: r.scale_error.map(|x| x.0),
            violations: r.violations.to_vec(),
        })
        // A common tensor of another dtype or shape gets no value row; it differs all the same.
        .chain(
            rep.findings
                .iter()
                .filter(|f| {
                    matches!(
                        f.kind,
                        FindingKind::DtypeMismatch | FindingKind::ShapeMismatch
                    )
                })
                .map(|f| TensorCmp {
                    tensor: f.tensor().unwrap_or_default().to_string(),
                    status: CmpStatus::Structure(f.kind),
                    differing_elements: None,
                    total_elements: 0,
                    max_ulp: None,
                    rel_l2: None,
                    cosine: None,
                    scale_error: None,
                    violations: Vec::new(),
                }),
        )
        .collect()
}

pub(crate) fn decisions(rep: &Report) -> Vec<DecisionCmp> {
    rep.decisions
        .results
        .iter()
        .map(|d| DecisionCmp {
            name: d.name.clone(),
            rows: d.rows,
            differing_rows: d.differing_rows,
            excused_rows: d.flips.iter().filter(|f| f.excused()).count() as u64,
        })
        .collect()
}

pub(crate) fn open(root: &Path, rel: &str) -> Result<Trace> {
    Trace::open(root.join(rel)).map_err(|e| gerr!(File: "{rel}: {e}"))
}

pub use tracegate_diff::thousands;

pub(crate) fn sci(x: Option<f64>) -> String {
    match x {
        None => "-".into(),
        Some(0.0) => "0".into(),
        Some(v) => format!("{v:.2e}"),
    }
}

pub(crate) fn ulps(x: Option<u64>) -> String {
    x.map(thousands).unwrap_or_else(|| "-".into())
}

pub(crate) fn ratio(x: Option<f64>) -> String {
    match x {
        None => "-".into(),
        Some(v) if v >= 10.0 => format!("{}×", thousands(v.round() as u64)),
        Some(v) => format!("{v:.2}×"),
    }
}

/// "00-01", "03", or "00, 02" for a set of layers (sorted).
pub(crate) fn span(layers: &[usize]) -> String {
    let mut parts = Vec::new();
    let mut i = 0;
    while i < layers.len() {
        let mut j = i;
        while j + 1 < layers.len() && layers[j + 1] == layers[j] + 1 {
            j += 1;
        }
        parts.push(if i == j {
            format!("{:02}", layers[i])
        } else {
            format!("{:02}-{:02}", layers[i], layers[j])
        });
        i = j + 1;
    }
    parts.join(", ")
}

/// "layer 03 inherits" / "layers 03-04 inherit".
pub(crate) fn say(layers: &[usize], one: &str, many: &str) -> String {
    if layers.len() == 1 {
        format!("layer {} {one}", span(layers))
    } else {
        format!("layers {} {many}", span(layers))
    }
}

#[cfg(test)]
mod tests {
    /// Before `names`, `location` read two digits: `layer.100.*` sat at layer 10.
    #[test]
    fn location_reads_every_digit_of_the_layer() {
        assert_eq!(super::location("layer.100.mlp_out"), 100);
        assert_eq!(super::location("layer.07.q"), 7);
        assert_eq!(super::location("embed.out"), -1);
        assert_eq!(super::location("logits"), i64::MAX);
        assert_eq!(super::location("decode.0001.layer.03.q"), i64::MAX);
    }
}
