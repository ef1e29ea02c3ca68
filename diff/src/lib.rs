//! How two traces compare. [`compare`] runs the checks in a fixed order — readable and
//! verified, comparable, structure, values, decisions — and returns a [`Report`] that the CLI
//! prints (human or JSON) and the gate and bisect read directly. Semantics are specified in
//! `docs/diff.md`; the JSON form in `docs/diff-report.schema.json`.
//!
//! One concept a module. The algorithm: `compare` (the phases in order, and the verdict),
//! `comparable`, `structure`, `values` and `decisions` (one phase each), with `reroute`
//! (rerouted experts), `excuse` (rows after a near-tie) and `worst` (a violation's worst
//! element); `numeric` and `measures` the element arithmetic. The result: `report` (its types
//! and JSON form), `vocab` (the words shared with other crates). Its output: `render` (text,
//! JSON, `--show`) and `html`. Every public item is re-exported here.

pub mod comparable;
mod compare;
mod decisions;
mod excuse;
pub mod filter;
pub mod html;
pub mod measures;
pub mod noise;
pub mod numeric;
mod options;
pub mod policy;
mod positions;
mod render;
mod report;
mod rows;
pub mod stats;
mod structure;
mod values;
mod vocab;

#[doc(hidden)]
pub use serde as __serde;

pub use compare::{compare, compare_files};
pub use decisions::{margin_tolerance, MARGIN_SLACK};
pub use filter::{Filter, FilterSummary};
pub use html::write_html;
pub use noise::NoiseReference;
pub use numeric::{describe_bits, Pair, Special};
pub use options::Options;
pub use policy::{glob_match, Amount, NearTie, Policy, Rule, Violation, DEFAULT_NEAR_TIE_FACTOR};
pub use render::{
    label_text, render_human, render_show, terminal_safe, thousands, write_human, write_json,
    write_show, write_show_json,
};
pub use report::{
    Count, DecisionDivergence, DecisionResult, DecisionSummary, Divergence, Element, Finding, Flip,
    MarginDifference, Method, NearTieRef, NearTieSummary, OnTensor, PassingBounds, PolicyRef,
    Report, RowSet, RowsAfter, RuleRef, Side, TensorRow, TensorSummary, TensorViolation,
    REPORT_SCHEMA,
};
pub use vocab::{DecisionStatus, FindingKind, Label, Margins, Real, RowStatus, Verdict};
