//! The work directory (`--work`): a bisection never judges a trace that its producer did not
//! write in this run. A reused directory keeps the previous run's traces, and a producer that
//! exits 0 without writing would otherwise be judged on them; so the directory is emptied of
//! bisect's own files first, and each output is removed again just before its producer runs
//! (`Producer::run` then fails a run that wrote nothing). Only a directory bisect made (its
//! MARKER) or an empty one is used: `--work ~` must never lose a user's `notes.trace`.
//!
//! The producers' runs go through here (`run_fresh`, `candidate_trace`): every phase's, the
//! prefill's, the decode steps' and the block diffusion's.

use std::path::Path;

use tracegate_producers::{Producer, RunRecord, Verb};

use crate::bisect::options::BisectOptions;
use crate::ranks::ShardedRun;
use crate::{gerr, Result};

/// Written into every directory bisect works in; its presence is what lets a later run empty it.
pub const MARKER: &str = ".tracegate-bisect";

/// What bisect and its producers leave in the directory: traces and writers' temporaries.
fn is_ours(name: &str) -> bool {
    name.ends_with(".trace") || name.ends_with(".tracegate-tmp")
}

/// Entries a directory may hold and still count as empty: the work lock (a gate run's `.lock`,
/// left behind by design) and the marker.
fn ignorable(name: &str) -> bool {
    name == ".lock" || name == MARKER
}

/// Refuses a directory that exists and holds anything but a lock unless an earlier bisection
/// marked it. Reads only: nothing is created or removed here (the caller locks, then `prepare`s).
pub fn check(dir: &Path) -> Result<()> {
    let shown = crate::paths::shown(dir);
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => return Err(gerr!("--work {shown}: not a directory")),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(gerr!(File: "--work {shown}: {e}")),
    }
    if dir.join(MARKER).is_file() {
        return Ok(());
    }
    let mut other: Vec<String> = std::fs::read_dir(dir)
        .map_err(|e| gerr!(File: "--work {shown}: {e}"))?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| !ignorable(n))
        .collect();
    if other.is_empty() {
        return Ok(());
    }
    other.sort();
    let count = other.len();
    other.truncate(3);
    Err(gerr!(
        "--work {shown}: the directory holds {count} entr{} gate bisect did not make ({}{}) and no {MARKER} marker; bisect removes the traces an earlier bisection left in its work directory, so it works only in a new or empty directory or one an earlier gate bisect made: give another --work",
        if count == 1 { "y" } else { "ies" },
        other.join(", "),
        if count > other.len() { ", …" } else { "" }
    ))
}

/// After `check` and the lock: marks the directory as bisect's and removes every trace and
/// temporary an earlier bisection left at its top level (nothing else: not a report, not a page,
/// not a subdirectory).
pub fn prepare(dir: &Path) -> Result<()> {
    let shown = crate::paths::shown(dir);
    std::fs::write(
        dir.join(MARKER),
        "a gate bisect work directory: each bisection removes the *.trace files here first\n",
    )
    .map_err(|e| gerr!(File: "--work {shown}: cannot write {MARKER}: {e}"))?;
    let entries = std::fs::read_dir(dir).map_err(|e| gerr!(File: "--work {shown}: {e}"))?;
    for e in entries.filter_map(|e| e.ok()) {
        let name = e.file_name().to_string_lossy().into_owned();
        let is_file = e.file_type().is_ok_and(|t| t.is_file() || t.is_symlink());
        if is_file && is_ours(&name) {
            std::fs::remove_file(e.path()).map_err(
                |err| gerr!(File: "--work {shown}: cannot remove the earlier {name}: {err}"),
            )?;
        }
    }
    Ok(())
}

/// `p.run(verb)` on a fresh output: what the verb is to write is removed first, so a producer
/// that exits 0 without writing it fails (`Producer::run`: "exited 0 but wrote no trace at …")
/// instead of being judged on an earlier run's file.
pub(crate) fn run_fresh(
    root: &Path,
    p: &Producer,
    verb: &Verb,
    timeout: std::time::Duration,
) -> RunRecord {
    match std::fs::remove_file(root.join(verb.out())) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            return RunRecord {
                producer: p.name(),
                verb: verb.name(),
                invocation: tracegate_producers::display(&p.argv(verb)),
                ok: false,
                exit_code: None,
                timed_out: false,
                seconds: 0.0,
                peak_rss_kib: None,
                stderr: format!(
                    "not run: cannot remove the earlier {} first: {e}",
                    verb.out()
                ),
                stderr_bytes: 0,
                out: verb.out().to_string(),
                served_by: None,
                served_resident: None,
            }
        }
    }
    p.run(root, verb, timeout)
}

/// The candidate's `trace` verb: as it is, or under `--ranks N` with `{rank}` in its `--out`,
/// the rank traces checked and merged at the verb's `--out` (crate::ranks::run_trace). A refused
/// merge is a failed run saying why; the ShardedRun says which rank.
pub(crate) fn candidate_trace(o: &BisectOptions, verb: &Verb) -> (RunRecord, Option<ShardedRun>) {
    match o.ranks {
        None => (run_fresh(&o.root, &o.candidate, verb, o.timeout), None),
        Some(_) => crate::ranks::run_trace(&o.candidate, &o.root, verb, o.timeout, o.ranks),
    }
}
