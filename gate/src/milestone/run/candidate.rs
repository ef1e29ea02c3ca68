//! A port's candidate tried once before its reference runs (`gate init`, `--bless`; port.rs).

use std::path::Path;

use tracegate_producers::{Producer, Verb};

use super::ranks::run_trace;
use crate::prompts::Prompt;
use crate::{gerr, Result};

/// The candidate tried once, on the shortest of `prompts` (one greedy token), before the reference
/// runs on every prompt (`gate init`, `--bless`): a candidate that cannot start — a command that
/// is not there, not executable, or exits non-zero — or writes no readable trace is refused in the
/// seconds its own run takes, not after minutes of the reference. Nothing is recorded then.
#[allow(clippy::too_many_arguments)]
pub(super) fn try_candidate(
    root: &Path,
    candidate: &Producer,
    model: &str,
    prompts: &[Prompt],
    internals: bool,
    work: &str,
    timeout: std::time::Duration,
    ranks: Option<u64>,
) -> Result<()> {
    let Some(p) = prompts.iter().min_by_key(|p| p.tokens.len()) else {
        return Ok(());
    };
    // Not a prompt id (those are [A-Za-z0-9_-]): no prompt's directory.
    let dir = format!("{work}/.candidate-probe");
    std::fs::create_dir_all(root.join(&dir)).map_err(|e| gerr!(File: "{dir}: {e}"))?;
    let out = format!("{dir}/candidate.trace");
    let _ = std::fs::remove_file(root.join(&out));
    let (rec, _) = run_trace(
        candidate,
        root,
        &Verb::Trace {
            model: model.to_string(),
            tokens: p.tokens.clone(),
            out: out.clone(),
            internals,
            generate: 1,
            cache: true,
            force: None,
            seed: None,
            shards: None,
        },
        timeout,
        ranks,
    );
    let failed = if rec.timed_out {
        Some(format!(
            "timed out after {} s (--timeout)",
            timeout.as_secs()
        ))
    } else if !rec.ok {
        Some(format!("failed: {}", rec.why()))
    } else {
        tracegate_trace::Trace::open(root.join(&out))
            .err()
            .map(|e| format!("wrote no readable trace ({out}): {e}"))
    };
    match failed {
        None => Ok(()),
        Some(why) => Err(gerr!(
            Producer: "the candidate, tried once on prompt {:?} before the reference runs, {why}; nothing was recorded (fix the candidate command, then run again)\n    $ {}",
            p.id,
            rec.invocation
        )),
    }
}
