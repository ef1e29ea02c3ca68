//! A sharded candidate (`gate init --ranks N`, docs/producers.md "Sharded engines"; `gate bisect
//! --ranks N`, docs/bisect.md "Sharded candidates"): its `trace` run writes one trace per rank at
//! `--out` with `{rank}` replaced by 0..N−1; the gate checks that exactly those N files are there,
//! each one rank of world size N, and merges them with the library merge
//! (`tracegate_trace::merge::merge`, the one `trace-merge` runs) into the trace that is judged
//! like any candidate's. A refusal names the rank. A divergence is attributed to the rank whose
//! shard holds the diverging element ([`attribute`]).
//!
//! Below both the milestone gate (run/port.rs, init.rs) and the bisection, which share it.

use std::path::{Path, PathBuf};

use serde::Serialize;
use serde_json::{json, Value};
use tracegate_producers::{Producer, RunRecord, Verb};
use tracegate_trace::{ShardKind, Trace};

/// The placeholder a sharded candidate replaces by its rank in `--out`.
pub use tracegate_trace::merge::RANK;

/// The `--out` a sharded candidate is given for the merged trace `out`:
/// `dir/candidate.trace` → `dir/candidate.rank{rank}.trace`.
pub fn rank_pattern(out: &str) -> String {
    match out.strip_suffix(".trace") {
        Some(stem) => format!("{stem}.rank{RANK}.trace"),
        None => format!("{out}.rank{RANK}"),
    }
}

/// Runs the `trace` verb `verb` by `producer`: as it is for an unsharded candidate (`ranks`
/// None), else with `--out` its rank pattern, the rank traces then checked and merged at the
/// verb's `--out` ([`merge_run`]).
pub fn run_trace(
    producer: &Producer,
    root: &Path,
    verb: &Verb,
    timeout: std::time::Duration,
    ranks: Option<u64>,
) -> (RunRecord, Option<ShardedRun>) {
    let Some(world) = ranks else {
        return (producer.run(root, verb, timeout), None);
    };
    let merged = verb.out().to_string();
    let pattern = rank_pattern(&merged);
    let mut sharded = verb.clone();
    if let Verb::Trace { out, .. } = &mut sharded {
        out.clone_from(&pattern);
    }
    clear(root, &pattern, &merged);
    let mut rec = producer.run(root, &sharded, timeout);
    let run = merge_run(root, &mut rec, &merged, world);
    (rec, run)
}

/// The rank `r`'s file of `pattern`.
fn rank_file(pattern: &str, r: u64) -> String {
    pattern.replace(RANK, &r.to_string())
}

/// The ranks of the files in `pattern`'s directory that match it (`candidate.rank7.trace`: 7).
fn rank_files_present(root: &Path, pattern: &str) -> Vec<(u64, String)> {
    tracegate_trace::merge::rank_files(&root.join(pattern))
        .into_iter()
        .map(|(r, _)| (r, rank_file(pattern, r)))
        .collect()
}

/// Removes what an earlier run left at `pattern` (every rank's file, the literal path) and at
/// `merged`: a stale rank trace is never merged.
fn clear(root: &Path, pattern: &str, merged: &str) {
    for (_, f) in rank_files_present(root, pattern) {
        let _ = std::fs::remove_file(root.join(f));
    }
    let _ = std::fs::remove_file(root.join(pattern));
    let _ = std::fs::remove_file(root.join(merged));
}

/// The first `rank N` a merge message names (the merge names the rank at fault first: "rank 1
/// (FILE) differs from rank 0", "rank 2 of world size 4 is missing").
pub fn named_rank(message: &str) -> Option<u64> {
    message.match_indices("rank ").find_map(|(i, _)| {
        let digits: String = message[i + 5..]
            .chars()
            .take_while(char::is_ascii_digit)
            .collect();
        digits.parse().ok()
    })
}

/// After a sharded `trace` run `rec` (asked for `--out PATTERN`): its rank traces checked and
/// merged into `merged`. `rec` becomes the merged run (ok, `out` the merged trace) or, refused,
/// a failed run saying why; the run's own failure (exit status, timeout) is left as it was.
fn merge_run(root: &Path, rec: &mut RunRecord, merged: &str, world: u64) -> Option<ShardedRun> {
    // The producer run looked for a file at the literal pattern: a sharded run that exited 0
    // is then "ok" only if it wrote there (an unsharded candidate), otherwise failed with
    // "wrote no trace" — the exit status says whether the candidate itself succeeded.
    if rec.timed_out || rec.exit_code != Some(0) {
        return None;
    }
    let pattern = rec.out.clone();
    let mut run = ShardedRun {
        world,
        pattern: pattern.clone(),
        ranks: Vec::new(),
        reduction: None,
        counts: None,
        merged: None,
        merged_digest: None,
        refused: None,
    };
    match check_and_merge(root, &pattern, merged, world) {
        Ok((ranks, m)) => {
            run.ranks = ranks;
            run.reduction = Some(format!(
                "partial sums in rank order, left to right: {}",
                m.reduction_order()
            ));
            run.counts = Some(json!({
                "reduced": m.reduced.len(),
                "first_reduced": m.reduced.first(),
                "concatenated": m.concatenated,
                "experts": m.experts,
                "replicated": m.replicated,
            }));
            run.merged = Some(merged.to_string());
            run.merged_digest = Some(m.digest.hex());
            rec.ok = true;
            rec.out = merged.to_string();
            rec.stderr = String::new();
        }
        Err(refusal) => {
            rec.ok = false;
            rec.stderr = format!(
                "its rank traces ({pattern}) were refused: {}",
                refusal.message
            );
            run.refused = Some(refusal);
        }
    }
    Some(run)
}

/// Exactly ranks 0..world at `pattern`, each one rank of that world size, merged into `merged`.
fn check_and_merge(
    root: &Path,
    pattern: &str,
    merged: &str,
    world: u64,
) -> Result<(Vec<RankTrace>, tracegate_trace::merge::Merged), Refusal> {
    let refuse = |rank: Option<u64>, message: String| Refusal { rank, message };
    if root.join(pattern).exists() {
        return Err(refuse(
            None,
            format!(
                "the candidate wrote one trace at the literal path {pattern} instead of one per rank: a sharded port replaces {RANK} by its rank, 0..{} (docs/producers.md, \"Sharded engines\"); an unsharded port is initialised without --ranks",
                world - 1
            ),
        ));
    }
    let present = rank_files_present(root, pattern);
    if let Some((r, f)) = present.iter().find(|(r, _)| *r >= world) {
        return Err(refuse(
            Some(*r),
            format!("an extra rank trace {f}: rank {r}, but the milestone shards over --ranks {world} (ranks 0..{})", world - 1),
        ));
    }
    let written: Vec<String> = present.iter().map(|(r, _)| r.to_string()).collect();
    let mut paths: Vec<PathBuf> = Vec::new();
    for r in 0..world {
        let f = rank_file(pattern, r);
        if !root.join(&f).is_file() {
            return Err(refuse(
                Some(r),
                format!(
                    "rank {r} of --ranks {world} wrote no trace at {f} (written: {})",
                    if written.is_empty() {
                        "no rank's".to_string()
                    } else {
                        format!("rank {}", written.join(", "))
                    }
                ),
            ));
        }
        // Each file one rank of this world size, before the merge says anything of the set.
        let t = Trace::open(root.join(&f))
            .map_err(|e| refuse(Some(r), format!("rank {r}'s trace {f}: {e}")))?;
        let said = t
            .tensors()
            .iter()
            .find_map(|i| i.attributes.shard().transpose())
            .transpose()
            .map_err(|e| refuse(Some(r), format!("rank {r}'s trace {f}: {e}")))?;
        match said {
            None => {
                return Err(refuse(
                    Some(r),
                    format!("rank {r}'s trace {f}: no tensor has a shard attribute, so it names no rank (an unsharded trace; docs/trace-format.md, \"Sharded traces\")"),
                ))
            }
            Some(s) if s.world != world => {
                return Err(refuse(
                    Some(r),
                    format!("rank {r}'s trace {f} says rank={}/{}: world size {}, but the milestone shards over --ranks {world}", s.rank, s.world, s.world),
                ))
            }
            Some(s) if s.rank != r => {
                return Err(refuse(
                    Some(r),
                    format!("the trace for rank {r} ({f}) says it is rank {} of {world}", s.rank),
                ))
            }
            Some(_) => {}
        }
        paths.push(root.join(&f));
    }
    let m = tracegate_trace::merge::merge(&paths, &root.join(merged)).map_err(|message| {
        // The merge names files by the paths it was given: the project's, relative.
        let message = message.replace(&format!("{}/", root.display()), "");
        refuse(
            named_rank(&message),
            format!("the merge refused: {message}"),
        )
    })?;
    let ranks = m
        .ranks
        .iter()
        .enumerate()
        .map(|(r, (_, d))| RankTrace {
            rank: r as u64,
            file: rank_file(pattern, r as u64),
            digest: d.hex(),
        })
        .collect();
    Ok((ranks, m))
}

/// Which rank holds element `coords` of the merged tensor `name` (docs/producers.md, "Sharded
/// engines"): a slice's, the one whose block holds it; an expert's, its holder; a partial sum's,
/// none alone (every rank contributed); a replicated tensor's, every rank (the merge found them
/// identical). Returns (the rank, when one holds it, and the sentence).
pub fn attribute(
    root: &Path,
    run: &ShardedRun,
    name: &str,
    coords: Option<&[u64]>,
) -> (Option<u64>, String) {
    let at = coords.map_or(String::new(), |c| format!(" {c:?}"));
    let mut partial = Vec::new();
    for r in &run.ranks {
        let Ok(t) = Trace::open(root.join(&r.file)) else {
            continue;
        };
        let Some(info) = t.tensor_info(name) else {
            continue;
        };
        match info.attributes.shard() {
            Ok(Some(s)) => match s.kind {
                ShardKind::Slice {
                    axis,
                    offset,
                    length,
                    ..
                } => {
                    if let Some(i) = coords.and_then(|c| c.get(axis)) {
                        if (offset..offset + length).contains(i) {
                            return (
                                Some(r.rank),
                                format!(
                                    "its worst element{at} is in rank {}'s shard (its slice {offset}..{} of axis {axis})",
                                    r.rank,
                                    offset + length
                                ),
                            );
                        }
                    }
                }
                ShardKind::Experts { .. } => {
                    return (
                        Some(r.rank),
                        format!("rank {} holds this expert's tensor", r.rank),
                    )
                }
                ShardKind::Partial => partial.push(r.rank.to_string()),
                ShardKind::Replicated => {}
            },
            Ok(None) => {}
            Err(_) => {}
        }
    }
    if !partial.is_empty() {
        return (
            None,
            format!(
                "a partial sum: the sum of ranks {} differs (each rank contributed a summand; which one is wrong the merged trace cannot say)",
                partial.join(", ")
            ),
        );
    }
    (
        None,
        format!(
            "replicated on every rank, identical on each (the merge checked): wrong on all {} ranks alike",
            run.world
        ),
    )
}

/// One rank trace of a sharded port's run (docs/producers.md, "Sharded engines").
#[derive(Clone, Debug, Serialize)]
pub struct RankTrace {
    pub rank: u64,
    pub file: String,
    pub digest: String,
}

/// What became of one sharded run (the report's `sharded.ROLE`): merged, or refused naming the
/// rank.
#[derive(Clone, Debug, Serialize)]
pub struct ShardedRun {
    /// `--ranks`: the world size the milestone records.
    pub world: u64,
    /// The rank traces asked for (`{rank}` in it).
    pub pattern: String,
    /// Each rank's trace (rank order), when the merge ran.
    pub ranks: Vec<RankTrace>,
    /// The merge's reduction order ("partial sums in rank order, left to right: …").
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reduction: Option<String>,
    /// The tensors reduced from partial sums (count, and the first), concatenated from slices,
    /// united from experts and checked identical (replicated).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub counts: Option<Value>,
    /// The merged trace (the one judged) and its content digest.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub merged: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub merged_digest: Option<String>,
    /// Why the rank traces were refused: the rank at fault (null when none is), and the one line.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub refused: Option<Refusal>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Refusal {
    pub rank: Option<u64>,
    pub message: String,
}

impl ShardedRun {
    /// One line for the report: "merged from 2 rank traces (…)" or why not.
    pub fn line(&self) -> String {
        if let Some(r) = &self.refused {
            return format!(
                "{} rank traces ({}) refused: {}",
                self.world, self.pattern, r.message
            );
        }
        let ranks: Vec<String> = self
            .ranks
            .iter()
            .map(|r| format!("rank {} {}", r.rank, &r.digest[..16.min(r.digest.len())]))
            .collect();
        let c = self.counts.as_ref().unwrap_or(&Value::Null);
        format!(
            "merged from {} rank traces ({}): {}; {} reduced{}, {} concatenated, {} experts, {} replicated checked identical; {}; merged digest {}",
            self.world,
            self.pattern,
            self.reduction.as_deref().unwrap_or("-"),
            c["reduced"],
            c["first_reduced"]
                .as_str()
                .map(|n| format!(" (first {n})"))
                .unwrap_or_default(),
            c["concatenated"],
            c["experts"],
            c["replicated"],
            ranks.join(", "),
            self.merged_digest
                .as_deref()
                .map_or("-", |d| &d[..16.min(d.len())])
        )
    }
}
