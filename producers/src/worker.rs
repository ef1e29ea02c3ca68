//! Serving producers (docs/producers.md, "Serving"): a producer whose template declares
//! `{verb|serve}` is started once per gate process as `PREFIX serve` and answers every request
//! of the run, one JSON line each way, so Python and torch start once, not once per run.
//!
//! Lifecycle: a worker is started on its first request (or early, by `prestart`), in a process
//! group of its own like a per-call producer. A request that outlives `--timeout`, a worker that
//! dies, or an answer that breaks the protocol kills the whole group and forgets the worker; the
//! next request starts a fresh one. When the gate exits its end of the worker's stdin closes and
//! the worker leaves (it also watches for the gate's death while busy, see tracegate.serve).
//! Not PR_SET_PDEATHSIG as for per-call runs: that fires when the *thread* that started the
//! child ends, and bisect runs producers from short-lived scoped threads.
//!
//! This file: a gate process's workers, one per working directory and command, each its own
//! child or a resident one. It sits above both kinds, which it chooses between: serve.rs (one
//! worker process and its protocol) and resident.rs (a resident worker's daemon and client).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::{Duration, Instant};

use crate::resident::{self, Client, Reply};
pub use crate::serve::Served;
use crate::serve::{ended, Answer, Worker};
use crate::spawn::Ended;

/// (working directory, worker command line): one worker each.
type Key = (PathBuf, Vec<String>);
type Slot = Arc<Mutex<Option<Conn>>>;

/// A gate process's way to its worker: its own child (per-run), or a resident one on a socket
/// (crate::resident).
enum Conn {
    Local(Worker),
    Resident(Client),
}

static WORKERS: LazyLock<Mutex<HashMap<Key, Slot>>> = LazyLock::new(|| Mutex::new(HashMap::new()));

fn slot(root: &Path, serve_argv: &[String]) -> Slot {
    let mut map = WORKERS.lock().unwrap_or_else(|p| p.into_inner());
    map.entry((root.to_path_buf(), serve_argv.to_vec()))
        .or_default()
        .clone()
}

/// A worker for `slot`: a resident one when residency is on and it is free, else this gate
/// process's own. Says on stderr which, once per worker.
fn connect(name: &str, root: &Path, serve_argv: &[String]) -> crate::error::Result<Conn> {
    match resident::open(name, root, serve_argv) {
        Some(Ok(c)) => return Ok(Conn::Resident(c)),
        Some(Err(why)) => eprintln!("[gate] {name} worker: {why}; this run starts its own"),
        None => {}
    }
    Worker::spawn(root, serve_argv).map(Conn::Local)
}

/// Starts the worker now, so its start-up (imports) overlaps whatever the gate does next.
pub(crate) fn prestart(name: &str, root: &Path, serve_argv: &[String]) {
    let slot = slot(root, serve_argv);
    let mut w = slot.lock().unwrap_or_else(|p| p.into_inner());
    if w.is_none() {
        // A worker that cannot start is reported by the first request that needs it.
        *w = connect(name, root, serve_argv).ok();
    }
}

/// One request: `request` is the per-call command line from the verb on. Returns how it ended
/// (as a per-call run would) and which worker answered. A worker that finds its code changed
/// (stale) is replaced by a fresh one, which gets the request.
pub(crate) fn request(
    name: &str,
    root: &Path,
    serve_argv: &[String],
    request: &[String],
    timeout: Duration,
) -> (Ended, Option<Served>) {
    let slot = slot(root, serve_argv);
    let mut guard = slot.lock().unwrap_or_else(|p| p.into_inner());
    let deadline = Instant::now() + timeout;
    for _ in 0..STALE_RETRIES {
        if guard.is_none() {
            match connect(name, root, serve_argv) {
                Ok(c) => *guard = Some(c),
                Err(e) => return (Ended::failed(e.to_string()), None),
            }
        }
        let stale = match guard.take() {
            None => return (Ended::failed("no worker".into()), None),
            Some(Conn::Local(mut w)) => {
                let pid = w.pid as u32;
                let answer = w.ask(request, Some(deadline), &mut || false);
                let stale = match &answer {
                    Answer::Stale(why) => Some(why.clone()),
                    _ => None,
                };
                let mut local = Some(w);
                let e = ended(&mut local, answer, serve_argv);
                let Some(why) = stale else {
                    *guard = local.map(Conn::Local);
                    let served = Served {
                        pid,
                        resident: None,
                    };
                    return (e, Some(served));
                };
                why
            }
            Some(Conn::Resident(mut c)) => {
                let served = c.served();
                match c.ask(request, deadline) {
                    Reply::Ended(e) => {
                        *guard = Some(Conn::Resident(c));
                        return (e, Some(served));
                    }
                    Reply::Gone(e) => return (e, Some(served)),
                    Reply::Stale(why) => why,
                }
            }
        };
        eprintln!("[gate] {name} worker is stale ({stale}): starting a fresh one");
    }
    let why =
        format!("{name} worker: stale {STALE_RETRIES} times in a row (its code keeps changing)");
    (Ended::failed(why), None)
}

/// The run's last line (docs/producers.md, "Resident workers"): the resident workers this gate
/// process used that still run, and how to stop them; None when none does (residency off
/// included). A slot another thread still holds is skipped rather than waited for.
pub fn resident_after_run() -> Option<String> {
    let map = WORKERS.lock().unwrap_or_else(|p| p.into_inner());
    let mut guards: Vec<_> = map
        .values()
        .filter_map(|slot| slot.try_lock().ok())
        .collect();
    let mut clients: Vec<&mut Client> = guards
        .iter_mut()
        .filter_map(|g| match g.as_mut()? {
            Conn::Resident(c) => Some(c),
            Conn::Local(_) => None,
        })
        .collect();
    // The memory bound (docs/producers.md, "Resident workers"): what does not fit leaves now.
    resident::keep_within_bound(&mut clients);
    let mut names: Vec<String> = clients.iter().filter_map(|c| c.still_resident()).collect();
    if names.is_empty() {
        return None;
    }
    names.sort();
    Some(format!(
        "[gate] resident after this run: {}; they leave after {} s idle; stop now: gate workers stop",
        names.join(", "),
        resident::idle_s()
    ))
}

/// Ends this gate process's own workers (per-run ones: residency off, or a resident worker
/// busy or refused) before it exits, so none outlives it (docs/producers.md, "Serving"): each
/// is asked to leave (its stdin closed, all at once), given until LEAVE_GRACE to do so, and
/// then its process group is killed and the worker reaped. Resident workers are left to their
/// daemons. Call it once the run's requests are done; a slot still held by another thread is
/// waited for.
pub fn end_own_workers() {
    let slots: Vec<Slot> = {
        let map = WORKERS.lock().unwrap_or_else(|p| p.into_inner());
        map.values().cloned().collect()
    };
    let mut own = Vec::new();
    for slot in slots {
        let mut guard = slot.lock().unwrap_or_else(|p| p.into_inner());
        match guard.take() {
            Some(Conn::Local(w)) => own.push(w),
            other => *guard = other,
        }
    }
    for w in &mut own {
        w.close_stdin();
    }
    let deadline = Instant::now() + LEAVE_GRACE;
    for w in own {
        let pid = w.pid;
        if !w.leave(deadline) {
            eprintln!(
                "[gate] worker {pid} had not left {} s after its stdin closed: killed with its process group",
                LEAVE_GRACE.as_secs()
            );
        }
    }
}

/// How long a gate process's own workers have to leave once their stdin closed (Python's
/// interpreter shutdown, torch's included) before their groups are killed.
const LEAVE_GRACE: Duration = Duration::from_secs(3);

/// Fresh workers tried for one request whose worker found its code changed.
const STALE_RETRIES: usize = 3;
