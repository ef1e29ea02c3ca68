//! The gate: claims about producers, checked every time. `gate m0|m1` runs the engine, the
//! contract and the oracle (each a subprocess with a timeout) on frozen prompts and asserts
//! counts exactly; `gate check` re-derives every milestone; `gate bisect` names the first layer whose
//! body is wrong.
//!
//! Three parts, from the bottom up; no part imports one above it:
//! - the producers: the protocol's verbs, spawning a producer under a timeout, serving and
//!   resident workers. A crate of its own, `tracegate_producers` (producers/), which depends on
//!   nothing of the gate's;
//! - [`bisect`]: the bisection (judge, prefill, decode, html);
//! - [`milestone`]: the milestone gate (run and its checks, milestones, baselines, their
//!   rendering, `gate init`). A port whose `agrees` fails is localised by a bisection, so this
//!   part sits above `bisect`.
//!
//! Below both, what they share: this file (the errors, the root, JSON files written whole, the
//! work directory's lock), [`journal`] (a project's files changed whole by `gate init` and
//! `--bless`), [`prompts`] (prompt sets, a model's config and whether a prompt fits
//! it), [`ranks`] (a sharded candidate's rank traces run and merged), [`paths`] and [`progress`]. On top, main.rs: the CLI.

pub mod bisect;
pub mod journal;
pub mod milestone;
pub mod paths;
pub mod progress;
pub mod prompts;
pub mod ranks;

use std::path::{Path, PathBuf};

/// The gate's errors, by kind, each with its whole message (the offending name, path and
/// numbers), which is what the CLI prints. Callers branch on the kind: a layer verb that failed
/// is not a layer trace that cannot be compared; the CLI exits with [`Error::exit_code`].
#[derive(Debug)]
pub enum Error {
    /// What was asked cannot be done as asked (a flag, a command template, a prompt, a model, a
    /// milestone, a policy): refused before the work it asked for.
    Refused(String),
    /// A file the gate reads or writes: milestones, baselines, prompts, traces, reports.
    File(String),
    /// The work directory is held by another gate run.
    Busy(String),
    /// A producer run failed, timed out, or wrote a trace without what was asked of it.
    Producer(String),
    /// A producer that cannot run here at all (the default oracle without torch): what it would
    /// have checked is NOT CHECKED, where a producer that ran and failed fails it.
    Unavailable(String),
    /// Two traces the differ cannot compare.
    Incomparable(String),
    /// The engine, run as the gate's own child (the engine crate's error, kept whole).
    Engine(tracegate_engine::Error),
}

impl Error {
    /// Every kind ends a command before it has an answer: the CLI's refusal, exit 2.
    pub fn exit_code(&self) -> u8 {
        match self {
            Error::Refused(_)
            | Error::File(_)
            | Error::Busy(_)
            | Error::Producer(_)
            | Error::Unavailable(_)
            | Error::Incomparable(_)
            | Error::Engine(_) => 2,
        }
    }
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::Refused(s)
            | Error::File(s)
            | Error::Busy(s)
            | Error::Producer(s)
            | Error::Unavailable(s)
            | Error::Incomparable(s) => f.write_str(s),
            Error::Engine(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Engine(e) => Some(e),
            _ => None,
        }
    }
}

impl From<tracegate_engine::Error> for Error {
    fn from(e: tracegate_engine::Error) -> Error {
        Error::Engine(e)
    }
}

/// A producer's error is the gate's of the same kind (its message unchanged).
impl From<tracegate_producers::Error> for Error {
    fn from(e: tracegate_producers::Error) -> Error {
        match e {
            tracegate_producers::Error::Refused(s) => Error::Refused(s),
            tracegate_producers::Error::Producer(s) => Error::Producer(s),
            tracegate_producers::Error::Engine(e) => Error::Engine(e),
        }
    }
}

pub type Result<T> = std::result::Result<T, Error>;

/// `gerr!("...", args)`: a refusal; `gerr!(Kind: "...", args)`: an error of that kind.
#[macro_export]
macro_rules! gerr {
    ($kind:ident: $($t:tt)*) => { $crate::Error::$kind(format!($($t)*)) };
    ($($t:tt)*) => { $crate::Error::Refused(format!($($t)*)) };
}

/// The project root: the nearest ancestor of `start` holding `milestones.json`, or the
/// complete journal of a `gate init` interrupted before its milestones.json was in place
/// ([`journal`]: the command run there finishes it).
pub fn find_root(start: &Path) -> Result<PathBuf> {
    let mut cur = Some(start);
    while let Some(dir) = cur {
        if dir.join("milestones.json").is_file()
            || dir.join(journal::STAGING).join("manifest.json").is_file()
        {
            return Ok(dir.to_path_buf());
        }
        cur = dir.parent();
    }
    Err(gerr!("no milestones.json in {} or any parent: run the gate inside a project made by `gate init` (or a tracegate checkout), or pass --root", start.display()))
}

/// A JSON input (milestones.json, baselines.json, a prompt set, a model's config.json): one
/// regular file of at most [`tracegate_trace::json::MAX_JSON_LEN`] bytes (a FIFO would block,
/// `/dev/zero` would be read until memory ran out), no object repeating a key (serde keeps the
/// last, so a second `"policy"` would silently replace the first). `Err` names the file.
pub fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    tracegate_trace::json::read(path).map_err(|e| gerr!(File: "{e}"))
}

/// JSON as the gate writes it: pretty, with a final newline.
pub fn json_bytes(path: &Path, value: &impl serde::Serialize) -> Result<Vec<u8>> {
    let mut text =
        serde_json::to_vec_pretty(value).map_err(|e| gerr!(File: "{}: {e}", path.display()))?;
    text.push(b'\n');
    Ok(text)
}

/// Writes every file or none (a full disk, a read-only directory: the temporaries are removed
/// and each path keeps what it held), so reports never disagree with one another or with the
/// exit status.
pub fn write_files(files: &[(&Path, &[u8])]) -> Result<()> {
    tracegate_trace::output::write_whole(files).map_err(|e| {
        let names: Vec<String> = files.iter().map(|(p, _)| p.display().to_string()).collect();
        gerr!(File: "cannot write {e}: none of {} written", names.join(", "))
    })
}

/// One JSON file, written whole or not at all.
pub fn write_json_atomic(path: &Path, value: &impl serde::Serialize) -> Result<()> {
    write_files(&[(path, &json_bytes(path, value)?)])
}

/// Exclusive use of a trace directory for the life of one gate run. Two runs writing the same
/// `target/gate/<milestone>/<prompt>/` would read each other's traces and judge the wrong bytes,
/// so the second is refused. flock(2) is released by the kernel when the process ends, so a
/// crashed run never leaves a stale lock behind.
pub struct WorkLock {
    _file: std::fs::File,
}

impl WorkLock {
    pub fn acquire(dir: &Path) -> Result<WorkLock> {
        use std::io::{Read, Seek, Write};
        use std::os::fd::AsRawFd;
        std::fs::create_dir_all(dir).map_err(|e| gerr!(File: "{}: {e}", dir.display()))?;
        let path = dir.join(".lock");
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| gerr!(File: "{}: {e}", path.display()))?;
        // SAFETY: flock on a descriptor this function owns; no memory is passed.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() != Some(libc::EWOULDBLOCK) {
                return Err(gerr!(File: "{}: cannot lock: {err}", path.display()));
            }
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            let holder = holder.trim();
            let who = if holder.is_empty() {
                "another gate run".to_string()
            } else {
                format!("another gate run (pid {holder})")
            };
            return Err(
                gerr!(Busy: "{} is in use by {who}; wait for it to finish, or give this run its own directory with --work DIR", dir.display()),
            );
        }
        let _ = file
            .set_len(0)
            .and_then(|_| file.rewind())
            .and_then(|_| writeln!(file, "{}", std::process::id()));
        Ok(WorkLock { _file: file })
    }
}
