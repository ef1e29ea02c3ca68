//! How two traces compare. [`compare`] runs the checks in a fixed order — readable and
//! verified, comparable, structure, values, decisions — and returns a [`Report`] that the CLI
//! prints (human or JSON) and the gate and bisect read directly. Semantics are specified in
//! `docs/diff.md`; the JSON form in `docs/diff-report.schema.json`.
//!
//! One concept a module, in layers: a module imports from the layers below its own and from
//! those listed before it in its layer, never from above. Bottom to top:
//!
//! 1. Element arithmetic: `numeric` (ULP distance, printing values, a tensor pair's statistics
//!    and the scan and kernels that gather them), with `measures` its face for other tools.
//! 2. Words and inputs: `words` (the words and the number form the reports share with other
//!    crates), `policy` (rules and their bounds), `filter` (`--only` / `--skip`), `noise` (the
//!    noise reference), `options` (what a comparison is asked to do), `stats` (`--show`'s
//!    statistics of one trace).
//! 3. The result: `report` (its types and JSON form).
//! 4. Rows: `rows` (a tensor's row: its statistics, judged by a rule, an element shown; with
//!    `rows/worst`, the element a violation is shown at).
//! 5. Positioned tensors: `positions` (lists of positions, and experts matched by position,
//!    the rerouted experts).
//! 6. The phases: `comparable`, `structure`, `values`; `excuse` (rows after a near-tie, left out
//!    and the rest judged again: a pass over the judged rows, driven by `decisions` as it meets
//!    near-ties); `decisions`.
//! 7. `compare`: the phases in order, and the verdict.
//! 8. Output: `render` (text, JSON, `--show`) and `html` on top.
//! 9. `explain` (`--explain`): the first difference recomputed under other summation orders,
//!    from the traces and the model's weights (read by the engine's loader).
//!
//! Every public item is re-exported here.

pub mod comparable;
mod compare;
mod decisions;
mod excuse;
pub mod explain;
pub mod filter;
pub mod html;
pub mod measures;
pub mod noise;
pub mod numeric;
mod options;
pub mod passes;
pub mod policy;
mod positions;
mod render;
mod report;
mod rounding;
mod rows;
pub mod stats;
mod structure;
mod values;
mod words;

#[doc(hidden)]
pub use serde as __serde;

pub use compare::{compare, compare_files, NOISE_PRODUCERS};
pub use decisions::{
    margin_tolerance, override_gap, own_scores, OverrideGap, OwnScores, MARGIN_SLACK,
};
pub use filter::{Filter, FilterSummary};
pub use html::write_html;
pub use noise::NoiseReference;
pub use numeric::{describe_bits, Pair, Special};
pub use options::Options;
pub use policy::{
    glob_match, Amount, NearTie, NoiseAbs, Policy, Rule, Violation, DEFAULT_NEAR_TIE_FACTOR,
};
pub use render::{
    label_text, render_human, render_show, terminal_safe, thousands, write_human, write_json,
    write_show, write_show_json,
};
pub use report::{
    Count, DecisionDivergence, DecisionResult, DecisionSummary, Divergence, Element, Finding, Flip,
    MarginDifference, Method, NearTieRef, NearTieSummary, NoiseRow, NoiseRows, OnTensor,
    PassingBounds, PolicyRef, Report, RowSet, RowsAfter, RuleRef, SamplingDivergence, Side,
    TensorRow, TensorSummary, TensorViolation, REPORT_SCHEMA,
};
pub use words::{DecisionStatus, FindingKind, Label, Margins, Real, RowStatus, Verdict};
