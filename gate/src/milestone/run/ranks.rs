//! A sharded port's rank traces in the milestone gate: running and merging them is crate::ranks
//! (shared with `gate bisect --ranks`); here, a refusal as a gate finding.

use super::report::{finding, Finding, ShardedRun};
use crate::milestone::check::FindingKind;

pub(crate) use crate::ranks::{attribute, run_trace};

/// The refusal of a sharded run's rank traces as a gate finding, named by the rank (`rank 1`,
/// or `rank traces` when the merge names none).
pub(super) fn refusal_finding(run: &ShardedRun) -> Option<Finding> {
    let r = run.refused.as_ref()?;
    Some(finding(
        FindingKind::RankTraces,
        r.rank
            .map_or("rank traces".to_string(), |n| format!("rank {n}")),
        1,
        format!("the candidate's {}", run.line()),
    ))
}
