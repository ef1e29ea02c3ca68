//! `gate capsule explain DIR --candidate-trace T` (docs/diff.md, "Explaining a difference"):
//! is the candidate's difference from the capsule's reference rows a summation order, or a bug?
//! The capsule is verified (`load`), its replay model built and its weights digest checked
//! (`replay_model`, as `gate capsule run` does), then the capsule's `reference.trace` and the
//! candidate's layer trace are compared as `trace-diff` compares them and the first differing
//! tensor is explained against the replay model by `tracegate_diff::explain`: the same words,
//! the same exit status (the comparison's), no model directory.

use std::path::Path;

use tracegate_diff::{Filter, Options};
use tracegate_trace::Trace;

use crate::{gerr, Result};

/// The text `gate capsule explain` prints and its exit code (the comparison's, as
/// `trace-diff --explain` exits).
pub struct Explained {
    pub text: String,
    pub exit_code: i32,
}

/// Explains `candidate` (a trace of the capsule's layer on its rows, e.g. `gate capsule run`'s
/// `WORK/capsule.candidate.trace`) against capsule `dir`; `only` is trace-diff's `--only GLOB`.
/// The replay model is written to `root/work/model`.
pub fn explain(
    root: &Path,
    dir: &Path,
    candidate: &Path,
    only: Option<&str>,
    work: &str,
) -> Result<Explained> {
    let c = super::load(dir)?;
    let model = root.join(work).join("model");
    super::replay_model(dir, &c.manifest, &model)?;
    let reference = dir.join("reference.trace");
    let open = |p: &Path| Trace::open(p).map_err(|e| gerr!(File: "{}: {e}", p.display()));
    let (r, t) = (open(&reference)?, open(candidate)?);
    let opts = Options {
        filter: Filter {
            only: only.map(|g| vec![g.to_string()]).unwrap_or_default(),
            skip: Vec::new(),
        },
        ..Options::default()
    };
    // A filter that selects nothing is bad usage (trace-diff's exit 2): zero checks is no answer.
    if let Some(why) = opts
        .filter
        .summary(&[&r, &t])
        .and_then(|s| s.nothing_selected())
    {
        return Err(gerr!("--only: {why}"));
    }
    let report = tracegate_diff::compare(&r, &t, &opts);
    let m = &c.manifest;
    let mut text = format!(
        "capsule {}: layer {:02} of {}, {} of {} rows; replay model {} (weights digest as the manifest records)\n",
        dir.display(),
        m.layer,
        m.bisection["model"].as_str().unwrap_or("?"),
        m.rows["kept"],
        m.rows["bisection"],
        model.display(),
    );
    text.push_str(&tracegate_diff::render_human(&report));
    let first = report.first_divergence.as_ref().map(|d| d.tensor.as_str());
    text.push_str(&tracegate_diff::explain::explain_first(&r, &t, first, Some(&model)).render());
    Ok(Explained {
        text,
        exit_code: report.exit_code(),
    })
}
