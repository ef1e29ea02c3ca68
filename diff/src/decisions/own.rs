//! One side's own scores for one row of its own decision, for questions about that side alone
//! (`gate bisect` judging a forced candidate's overrides, docs/bisect.md): the margin its scores
//! give a choice, whether they pick it, which indexes they tie. The same rules the comparison
//! applies (scores.rs), read from the same source row.

use tracegate_trace::names::Name;
use tracegate_trace::Trace;

use super::scores::{self, Scores};
use super::source::{holds_scores, source_row, source_tensor};

/// Row `row` of the source tensor of decision `name` in `t`, when that source holds the
/// decision's own scores (docs/diff.md, "The near-tie rule": `logits` for an argmax,
/// `router.logits` for a router, …).
pub struct OwnScores<'a> {
    scores: Scores<'a>,
    router: bool,
    source: String,
}

/// `t`'s own scores for row `row` of its decision `name`; None when it holds no such decision,
/// no source tensor holding the decision's scores, or a source row narrower than a choice.
pub fn own_scores<'a>(t: &'a Trace, name: &str, row: u64) -> Option<OwnScores<'a>> {
    let info = t.decision_info(name)?;
    let rows = info.rows();
    let width = info.count().checked_div(rows)?;
    let source = source_tensor(name, t, t).filter(|s| holds_scores(name, s))?;
    let range = source_row(name, &source, row, rows, t);
    let scores = Scores::of(t, &source, range).filter(|s| s.len() > width)?;
    Some(OwnScores {
        scores,
        router: Name::parse(name).point == "router.topk",
        source,
    })
}

impl OwnScores<'_> {
    /// The source tensor's name.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Whether a recorded margin for `chosen` agrees with the one these scores give it, as the
    /// comparison's `margin_contradicts_scores` check has it; Err: the margin they give. None
    /// without an unchosen index.
    pub fn margin_agrees(&self, chosen: &[i64], recorded: f32) -> Option<Result<(), f64>> {
        scores::margin_agrees(&self.scores, chosen, self.router, recorded as f64)
    }

    /// Whether these scores rank `chosen` (rank order) as chosen, up to what they cannot resolve
    /// (the comparison's check that a side's scores pick its choice); Err says where not.
    pub fn picks(&self, chosen: &[i64]) -> Result<(), String> {
        scores::picks(&self.scores, chosen, self.router)
    }

    /// Whether these scores tie indexes `x` and `y` (either order is theirs).
    pub fn tied(&self, x: i64, y: i64) -> bool {
        scores::tied(&self.scores, x, y, self.router)
    }
}
