//! A project's files changed whole (issue 51): `gate init` and `--bless` write milestones.json,
//! baselines.json, the golden and noise traces (and init a copied prompt file) through one
//! journal, so that every gate command sees the project as it was or as it became, never a mix
//! (docs/gate.md, "Interrupted init and bless").
//!
//! [`commit`], under an exclusive flock(2) of the project root directory:
//! 1. creates `.tracegate-staging/` and writes (and fsyncs) every new file under
//!    `.tracegate-staging/files/<its path>`;
//! 2. writes `.tracegate-staging/manifest.json` (the paths, in order) to a temporary and renames it
//!    into place: **the commit point**;
//! 3. renames each staged file onto its place, milestones.json first (so the root is found by
//!    [`crate::find_root`] as soon as anything new is in place);
//! 4. removes the staging directory.
//!
//! [`recover`], which every gate command that reads a project runs first, under the same lock:
//! a staging directory with a manifest is finished (steps 3 and 4 for the files still staged:
//! roll forward); one without is removed (roll back). The lock is the kernel's, released when
//! its process ends, so a journal found under it belongs to no live gate.
//!
//! Test hook: `TRACEGATE_FAULT_AT=N` (N ≥ 1, digits only) SIGKILLs the gate right after the N-th
//! journal step of the process (commit's and recover's, counted together), having printed the
//! step to stderr; any other value is refused before anything runs. gate/tests/atomic.rs kills
//! `gate init` and `--bless` at every step with it.

use std::io::Write;
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

use crate::{gerr, Result};

/// The journal's directory, in the project root.
pub const STAGING: &str = ".tracegate-staging";

/// The test hook's variable (module doc).
pub const FAULT_AT: &str = "TRACEGATE_FAULT_AT";

/// What a new file of the project holds: bytes, or a copy of a file (a trace in the work
/// directory).
pub enum Content<'a> {
    Bytes(&'a [u8]),
    Copy(&'a Path),
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Manifest {
    schema: u32,
    /// The command whose journal this is (said when a later command finishes it).
    command: String,
    /// The project's paths, relative to the root, in the order they are renamed into place.
    files: Vec<String>,
}

/// `TRACEGATE_FAULT_AT`, parsed strictly: None when unset.
pub fn fault_at() -> Result<Option<u64>> {
    tracegate_trace::settings::count(FAULT_AT).map_err(|e| gerr!("{e}"))
}

static STEPS: AtomicU64 = AtomicU64::new(0);

/// One journal step done: under the test hook, the gate is killed here when it is the N-th.
fn step(what: &str) {
    let n = STEPS.fetch_add(1, Ordering::SeqCst) + 1;
    if let Ok(Some(at)) = fault_at() {
        if at == n {
            eprintln!("{FAULT_AT}={at}: killed after journal step {n} ({what})");
            // SAFETY: kill(2) of this very process; no memory is passed.
            unsafe {
                libc::kill(libc::getpid(), libc::SIGKILL);
            }
        }
    }
}

/// The exclusive lock of a project root for the life of a commit or a recovery.
struct RootLock {
    _dir: std::fs::File,
}

impl RootLock {
    fn acquire(root: &Path) -> Result<RootLock> {
        use std::os::fd::AsRawFd;
        let dir = std::fs::File::open(root).map_err(|e| gerr!(File: "{}: {e}", root.display()))?;
        let flock = |how| {
            // SAFETY: flock on a descriptor this function owns; no memory is passed.
            if unsafe { libc::flock(dir.as_raw_fd(), how) } == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        };
        match flock(libc::LOCK_EX | libc::LOCK_NB) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EWOULDBLOCK) => {
                eprintln!(
                    "gate: waiting for another gate writing {} (gate init or --bless)",
                    root.display()
                );
                flock(libc::LOCK_EX)
                    .map_err(|e| gerr!(File: "{}: cannot lock: {e}", root.display()))?;
            }
            Err(e) => return Err(gerr!(File: "{}: cannot lock: {e}", root.display())),
        }
        Ok(RootLock { _dir: dir })
    }
}

/// A path the manifest may name: relative, plain components only (nothing outside the root).
fn checked_rel(rel: &str) -> Option<&Path> {
    let p = Path::new(rel);
    let plain = p.components().all(|c| matches!(c, Component::Normal(_)));
    (plain && !rel.is_empty() && !rel.starts_with(STAGING)).then_some(p)
}

/// `bytes` as the file `path`, on disk before this returns.
fn write_synced(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut f = std::fs::File::create(path)?;
    f.write_all(bytes)?;
    f.sync_all()
}

fn sync_dir(dir: &Path) -> Result<()> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| gerr!(File: "{}: {e}", dir.display()))
}

/// Finishes or discards the journal an interrupted `gate init` or `--bless` left in `root`
/// (module doc), saying which on stderr; nothing when there is none. Every gate command that
/// reads a project calls it first. Also refuses a malformed test hook before anything runs.
pub fn recover(root: &Path) -> Result<()> {
    fault_at()?;
    let staging = root.join(STAGING);
    if std::fs::symlink_metadata(&staging).is_err() {
        return Ok(());
    }
    let _lock = RootLock::acquire(root)?;
    recover_locked(root)
}

fn recover_locked(root: &Path) -> Result<()> {
    let staging = root.join(STAGING);
    let fix = format!("move {} away and rerun the command", staging.display());
    match std::fs::symlink_metadata(&staging) {
        Err(_) => return Ok(()),
        Ok(m) if !m.is_dir() => {
            return Err(
                gerr!(File: "{}: not a directory (the gate's journal is one): {fix}", staging.display()),
            )
        }
        Ok(_) => {}
    }
    let manifest_path = staging.join("manifest.json");
    if std::fs::symlink_metadata(&manifest_path).is_err() {
        // Interrupted before its commit point: the project never changed.
        std::fs::remove_dir_all(&staging).map_err(|e| gerr!(File: "{}: {e}", staging.display()))?;
        step("journal discarded");
        eprintln!(
            "gate: discarded {STAGING}/, left by a gate init or --bless interrupted before it was complete: the project is as it was before that command"
        );
        return Ok(());
    }
    let manifest: Manifest =
        crate::read_json(&manifest_path).map_err(|e| gerr!(File: "{e}: {fix}"))?;
    if manifest.schema != 1 {
        return Err(
            gerr!(File: "{}: schema {} is not supported: {fix}", manifest_path.display(), manifest.schema),
        );
    }
    let mut rels = Vec::new();
    for rel in &manifest.files {
        rels.push(checked_rel(rel).ok_or_else(|| {
            gerr!(File: "{}: {rel:?} is not a path inside the project: {fix}", manifest_path.display())
        })?);
    }
    roll_forward(root, &rels)?;
    eprintln!(
        "gate: finished `{}`, interrupted after it was complete ({STAGING}/ held every file): the project is as that command left it",
        manifest.command
    );
    Ok(())
}

/// Steps 3 and 4: every file still staged renamed onto its place, then the journal removed.
fn roll_forward(root: &Path, rels: &[&Path]) -> Result<()> {
    let files = root.join(STAGING).join("files");
    let mut dirs: Vec<PathBuf> = vec![root.to_path_buf()];
    for rel in rels {
        let (from, to) = (files.join(rel), root.join(rel));
        if std::fs::symlink_metadata(&from).is_err() {
            // Renamed by the run (or recovery) that was interrupted.
            if std::fs::symlink_metadata(&to).is_err() {
                return Err(
                    gerr!(File: "{}: neither staged nor in place; the journal {STAGING}/ is damaged: restore the project from version control and remove {STAGING}/", to.display()),
                );
            }
            continue;
        }
        let parent = to.parent().unwrap_or(root).to_path_buf();
        std::fs::create_dir_all(&parent).map_err(|e| gerr!(File: "{}: {e}", parent.display()))?;
        std::fs::rename(&from, &to)
            .map_err(|e| gerr!(File: "{} -> {}: {e}", from.display(), to.display()))?;
        if !dirs.contains(&parent) {
            dirs.push(parent);
        }
        step(&format!("renamed {}", rel.display()));
    }
    for d in &dirs {
        sync_dir(d)?;
    }
    let staging = root.join(STAGING);
    std::fs::remove_dir_all(&staging).map_err(|e| gerr!(File: "{}: {e}", staging.display()))?;
    step("journal removed");
    Ok(())
}

/// Writes `files` (paths relative to `root`) into the project, all or none at every instant
/// (module doc). `command` names what wrote them, for a later recovery's message. Any journal
/// left behind is recovered first. An error before the commit point leaves the project as it
/// was.
pub fn commit(root: &Path, command: &str, files: &[(&str, Content)]) -> Result<()> {
    fault_at()?;
    let _lock = RootLock::acquire(root)?;
    recover_locked(root)?;
    // What would stop a rename is refused before anything is staged.
    let mut rels = Vec::new();
    for (rel, _) in files {
        let p = checked_rel(rel).ok_or_else(|| gerr!("{rel:?}: not a path inside the project"))?;
        let to = root.join(p);
        if to.is_dir() {
            return Err(gerr!(File: "{}: is a directory; nothing written", to.display()));
        }
        let mut parent = to.parent();
        while let Some(d) = parent.filter(|d| *d != root && !d.as_os_str().is_empty()) {
            if d.exists() && !d.is_dir() {
                return Err(
                    gerr!(File: "{}: not a directory, so {} cannot be written; nothing written", d.display(), to.display()),
                );
            }
            parent = d.parent();
        }
        rels.push(p);
    }
    // milestones.json first: the root is found by it (crate::find_root).
    let mut order: Vec<usize> = (0..files.len()).collect();
    order.sort_by_key(|&i| files[i].0 != "milestones.json");
    let files: Vec<&(&str, Content)> = order.iter().map(|&i| &files[i]).collect();
    let rels: Vec<&Path> = order.iter().map(|&i| rels[i]).collect();
    let staging = root.join(STAGING);
    std::fs::create_dir(&staging)
        .map_err(|e| gerr!(File: "{}: {e}; nothing written", staging.display()))?;
    step("journal created");
    let staged = stage(&staging, command, &files, &rels);
    if let Err(e) = staged {
        let _ = std::fs::remove_dir_all(&staging);
        return Err(e);
    }
    roll_forward(root, &rels)
}

/// Steps 1 and 2: every file staged, then the manifest (the commit point).
fn stage(staging: &Path, command: &str, files: &[&(&str, Content)], rels: &[&Path]) -> Result<()> {
    let dir = staging.join("files");
    for ((_, content), rel) in files.iter().zip(rels) {
        let to = dir.join(rel);
        let parent = to.parent().unwrap_or(&dir);
        std::fs::create_dir_all(parent)
            .map_err(|e| gerr!(File: "{}: {e}; nothing written", parent.display()))?;
        let written = match content {
            Content::Bytes(b) => write_synced(&to, b),
            Content::Copy(from) => std::fs::copy(from, &to)
                .and_then(|_| std::fs::File::open(&to))
                .and_then(|f| f.sync_all())
                .map_err(|e| {
                    std::io::Error::new(
                        e.kind(),
                        format!("{} -> {}: {e}", from.display(), to.display()),
                    )
                }),
        };
        written.map_err(|e| gerr!(File: "{}: {e}; nothing written", to.display()))?;
        step(&format!("staged {}", rel.display()));
    }
    let manifest = Manifest {
        schema: 1,
        command: command.to_string(),
        files: rels.iter().map(|r| r.display().to_string()).collect(),
    };
    let path = staging.join("manifest.json");
    let tmp = staging.join("manifest.json.tmp");
    let bytes = crate::json_bytes(&path, &manifest)?;
    write_synced(&tmp, &bytes)
        .map_err(|e| gerr!(File: "{}: {e}; nothing written", tmp.display()))?;
    let _ = sync_dir(&dir);
    std::fs::rename(&tmp, &path)
        .map_err(|e| gerr!(File: "{}: {e}; nothing written", path.display()))?;
    // Committed: from here on nothing may undo it (a failed sync is not a reason to).
    let _ = sync_dir(staging);
    step("manifest written (commit point)");
    Ok(())
}
