//! Resident workers (docs/producers.md, "Resident workers"): a built-in worker that outlives the
//! gate run that started it and serves the next run that would start the same one, so Python,
//! torch and transformers are imported once per session rather than once per gate run.
//!
//! A resident worker is a small daemon, the gate's own executable under the hidden verb
//! RESIDENT_CHILD, that owns the Python worker exactly as a gate process owns its per-run one
//! (crate::serve: stdin/stdout lines, stderr kept per request) and listens on a Unix socket in
//! a private runtime directory, one socket per key. The key is a digest of what decides what
//! the worker computes: worker command line (its Python included), what Python could import
//! from the project root, the environment variables of KEY_ENV, and the gate executable itself;
//! not the working directory: each request carries its caller's (`"cwd"`), where it runs. On
//! the socket: a hello line from the daemon (`{"pid", "worker_pid", "started"}`), then per
//! request the client's `{"argv": [...], "timeout_ms": N, "cwd": ABS}` line and the daemon's
//! `{"ended": …}` (what the request ended with, stderr bounded as for a per-call run) or
//! `{"stale": WHY}`.
//!
//! Lifecycle: one client at a time, held by an flock on the key's lock file for the whole gate
//! run; a second run finds it taken and starts its own per-run worker. The daemon leaves after
//! TRACEGATE_RESIDENT_IDLE seconds without a client (default IDLE_S), when its worker ends or
//! finds its code stale, and when a client leaves mid-request (the request is dropped: the
//! worker's group is killed). A request that outlives its `timeout_ms` (the run's `--timeout`)
//! is ended by the daemon as a per-call run is (the worker's group killed, its stderr so far
//! quoted), and the daemon leaves; a daemon that does not answer by then plus `BACKSTOP` is
//! killed with its worker by the client. After any request that ends the worker the client
//! returns only once the daemon has left (`Client::ask`).
//!
//! Memory: the resident set of this user's workers is kept within TRACEGATE_RESIDENT_MAX_MB
//! (`within_bound`: least recently used idle workers of other keys retire first).
//!
//! Hygiene: the daemon keeps no descriptor the gate inherited (`cloexec_from_3`), reads a request
//! line of at most MAX_REQUEST_LINE, and a record's pids are signalled only once verified
//! (`kill_verified`): records are files anyone of this user can write, and pids are reused.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::builtin::{default_contract_cmd, default_oracle_cmd};
use crate::serve::{self, Answer, Served, Worker};
use crate::settings;
use crate::spawn::Ended;
use crate::verb::{display, split_words, SERVE_VERB};

/// The hidden first argument that runs the gate's executable as a resident worker's daemon.
pub const RESIDENT_CHILD: &str = "__resident-worker";
/// How long past a request's deadline the client waits for the daemon to end the request and
/// answer (killing the worker and draining its stderr takes up to DRAIN_GRACE).
const BACKSTOP: Duration = Duration::from_secs(5);
/// Seconds a resident worker waits for its next client before it leaves.
pub const IDLE_S: u64 = 600;
/// Environment variables (exact names, or prefixes ending in `_` or `*`) that can change what
/// a worker computes or which code it runs: a different value is a different worker. The gate's
/// own residency settings are not among them.
const KEY_ENV: &[&str] = &[
    "TRACEGATE_*",
    "PYTHON*",
    "OMP_*",
    "MKL_*",
    "OPENBLAS_*",
    "KMP_*",
    "NUMEXPR_*",
    "TORCH*",
    "CUDA_*",
    "HF_*",
    "TRANSFORMERS_*",
    "PATH",
    "LD_LIBRARY_PATH",
    "LD_PRELOAD",
    "VIRTUAL_ENV",
];
const GATE_SIDE_ENV: &[&str] = &[
    "TRACEGATE_RESIDENT",
    "TRACEGATE_RESIDENT_IDLE",
    "TRACEGATE_RESIDENT_MAX_MB",
    "TRACEGATE_RUNTIME_DIR",
    "TRACEGATE_SERVE",
    // The gate's journal test hook (gate/src/journal.rs): no worker reads it.
    "TRACEGATE_FAULT_AT",
];
/// The longest request line the daemon reads from a client: a request is a command line (its
/// longest part a prompt's token ids), far below this; more is refused, not buffered.
pub(crate) const MAX_REQUEST_LINE: usize = 16 << 20;
/// How long a client waits for a daemon it started to listen, or for a hello.
const CONNECT_WAIT: Duration = Duration::from_secs(10);

/// Residency is on unless TRACEGATE_RESIDENT is off (`0`, crate::settings), or, with it unset,
/// CI is set (CI services set CI=true; `settings::ci`): a CI job leaves no process behind.
pub fn enabled() -> bool {
    match settings::or_refuse(settings::switch("TRACEGATE_RESIDENT")) {
        Some(on) => on,
        None => !settings::ci(),
    }
}

/// TRACEGATE_RESIDENT_IDLE (seconds, at least 1), else IDLE_S.
pub(crate) fn idle_s() -> u64 {
    settings::or_refuse(settings::seconds("TRACEGATE_RESIDENT_IDLE")).unwrap_or(IDLE_S)
}

/// The bound, MiB, on the resident set of this user's resident workers (daemons included):
/// TRACEGATE_RESIDENT_MAX_MB (MiB, at least 1), else half of MemTotal (8192 where
/// /proc/meminfo cannot say).
fn max_mb() -> u64 {
    if let Some(v) = settings::or_refuse(settings::mib("TRACEGATE_RESIDENT_MAX_MB")) {
        return v;
    }
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            let line = m.lines().find(|l| l.starts_with("MemTotal:"))?;
            line.split_whitespace().nth(1)?.parse::<u64>().ok()
        })
        .map_or(8192, |kib| kib / 1024 / 2)
}

/// The records of running resident workers in `dir` (daemon verified): key, record, resident
/// set of daemon and worker (KiB).
fn running(dir: &Path) -> Vec<(String, Info, u64)> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .filter_map(|path| {
            let info = read_info(&path)?;
            let key = path.file_stem()?.to_str()?.to_string();
            is_daemon_of(info.pid, dir, &key).then_some(())?;
            let kib = rss_kib(info.pid) + rss_kib(info.worker_pid);
            Some((key, info, kib))
        })
        .collect()
}

/// Keeps the resident set of this user's resident workers within `max_mb`: retires idle ones of
/// keys not in `mine` (never one another gate run holds: its lock is taken first; pids verified),
/// least recently used first, one line each. `mine` (this run's keys) are never retired, and
/// counted only when `count_mine`. Ok, or Err((MB still resident, the bound)).
fn within_bound(dir: &Path, mine: &[String], count_mine: bool) -> Result<(), (u64, u64)> {
    let max = max_mb();
    let mut all = running(dir);
    all.retain(|(k, _, _)| count_mine || !mine.contains(k));
    let mut total: u64 = all.iter().map(|r| r.2).sum();
    all.sort_by_key(|r| r.1.last_used);
    let now = now_s();
    for (k, info, kib) in all {
        if total <= max * 1024 {
            break;
        }
        if mine.contains(&k) {
            continue;
        }
        let p = paths(dir, &k);
        let Ok(lock) = std::fs::OpenOptions::new().write(true).open(&p.lock) else {
            continue;
        };
        if !lock_within(&lock, Duration::ZERO) {
            continue; // another gate run holds it
        }
        if kill_verified(dir, &k, info.pid, info.worker_pid).is_err() {
            continue;
        }
        for f in [&p.sock, &p.info, &p.purpose] {
            let _ = std::fs::remove_file(f);
        }
        eprintln!(
            "[gate] resident worker {} ({:.0} MB, idle for {} s; $ {}) retired: this user's resident workers used {:.0} MB, over TRACEGATE_RESIDENT_MAX_MB={max} (least recently used first)",
            info.worker_pid,
            kib as f64 / 1024.0,
            now.saturating_sub(info.last_used),
            info.command,
            total as f64 / 1024.0
        );
        total = total.saturating_sub(kib);
    }
    if total > max * 1024 {
        return Err((total / 1024, max));
    }
    Ok(())
}

/// At the end of a gate run: keeps what `clients` hold resident only within the bound
/// (`within_bound`, retiring others' idle workers first); those that do not fit are ended now,
/// one line each, and marked so the run's last line does not name them.
pub(crate) fn keep_within_bound(clients: &mut [&mut Client]) {
    let Some((dir, _)) = clients.first().map(|c| c.dir_key()) else {
        return;
    };
    let mine: Vec<String> = clients.iter().map(|c| c.dir_key().1).collect();
    let Err((mb, max)) = within_bound(&dir, &mine, true) else {
        return;
    };
    for c in clients.iter_mut() {
        let (dir, key) = c.dir_key();
        let kib = rss_kib(c.pid) + rss_kib(c.worker_pid);
        if kill_verified(&dir, &key, c.pid, c.worker_pid).is_ok() {
            let _ = std::fs::remove_file(&c.sock);
            let _ = std::fs::remove_file(c.sock.with_extension("json"));
            c.ended = true;
            eprintln!(
                "[gate] {} worker {} ({:.0} MB) not kept resident: this user's resident workers use {mb} MB, over TRACEGATE_RESIDENT_MAX_MB={max} even after retiring the idle ones",
                c.name,
                c.worker_pid,
                kib as f64 / 1024.0
            );
        }
    }
}

fn uid() -> u32 {
    // SAFETY: getuid cannot fail.
    unsafe { libc::getuid() }
}

/// TRACEGATE_RUNTIME_DIR, else $XDG_RUNTIME_DIR/tracegate, else /tmp/tracegate-$UID: created
/// 0700; refused when another user owns it or others may enter it.
pub fn runtime_dir() -> Result<PathBuf, String> {
    let dir = match (
        std::env::var_os("TRACEGATE_RUNTIME_DIR"),
        std::env::var_os("XDG_RUNTIME_DIR"),
    ) {
        (Some(d), _) if !d.is_empty() => PathBuf::from(d),
        (_, Some(x)) if !x.is_empty() => PathBuf::from(x).join("tracegate"),
        _ => PathBuf::from(format!("/tmp/tracegate-{}", uid())),
    };
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&dir)
        .map_err(|e| format!("runtime dir {}: {e}", dir.display()))?;
    let m = std::fs::symlink_metadata(&dir)
        .map_err(|e| format!("runtime dir {}: {e}", dir.display()))?;
    if !m.is_dir() {
        return Err(format!("runtime dir {} is not a directory", dir.display()));
    }
    if m.uid() != uid() {
        return Err(format!(
            "runtime dir {} is owned by uid {}, not this user ({})",
            dir.display(),
            m.uid(),
            uid()
        ));
    }
    if m.mode() & 0o077 != 0 {
        return Err(format!(
            "runtime dir {} is not private (mode {:o}; want 700)",
            dir.display(),
            m.mode() & 0o777
        ));
    }
    Ok(dir)
}

fn key_env() -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = std::env::vars()
        .filter(|(k, _)| {
            !GATE_SIDE_ENV.contains(&k.as_str())
                && KEY_ENV.iter().any(|p| match p.strip_suffix('*') {
                    Some(prefix) => k.starts_with(prefix),
                    None => k == p,
                })
        })
        .collect();
    v.sort();
    v
}

fn file_id(p: &Path) -> serde_json::Value {
    match std::fs::metadata(p) {
        Ok(m) => serde_json::json!([p.display().to_string(), m.len(), m.mtime(), m.mtime_nsec()]),
        Err(_) => serde_json::json!([p.display().to_string()]),
    }
}

/// The key of the worker `serve_argv` started in `root`: 16 hex digits of a SHA-256.
/// Also returns the worker's purpose: the same digest without the gate executable and the
/// interpreter's file (its size and mtime; the Python's path stays). Two keys of one purpose differ only by a rebuilt gate or a reinstalled Python, and
/// the older worker will not be asked again (`retire_superseded`).
///
/// Not the working directory (one worker serves every project root of an installation; each
/// request runs in its caller's, `"cwd"`), but what a worker started there could import from
/// it: `python -m` puts the directory first on sys.path, so its top-level modules and packages
/// (`importable_at`) are part of the installation. The Python is named by its absolute path
/// with symlinks kept (a venv's `bin/python` is a symlink to the same interpreter in every
/// venv; the venv decides the site-packages, hence which tracegate* packages are imported); that
/// path is part of the purpose, so two checkouts' venvs never supersede each other's workers.
fn key(root: &Path, serve_argv: &[String]) -> Result<(String, String), String> {
    let cwd = std::fs::canonicalize(root).map_err(|e| format!("{}: {e}", root.display()))?;
    let exe = std::env::current_exe().map_err(|e| format!("the gate's executable: {e}"))?;
    let python = serve_argv.first().map(|p| cwd.join(p));
    let purpose = serde_json::json!({
        "argv": serve_argv,
        "python_path": python.as_ref().map(|p| p.display().to_string()),
        "env": key_env(),
        "importable": importable_at(&cwd).iter().map(|(n, _)| n.clone()).collect::<Vec<_>>(),
    });
    let mut what = purpose.clone();
    what["python"] = python
        .map(|p| file_id(&std::fs::canonicalize(&p).unwrap_or(p)))
        .into();
    what["gate"] = file_id(&exe);
    what["importable_files"] = importable_at(&cwd)
        .into_iter()
        .map(|(_, id)| id)
        .collect::<Vec<_>>()
        .into();
    let hex16 = |v: &serde_json::Value| hex::encode(&Sha256::digest(v.to_string().as_bytes())[..8]);
    Ok((hex16(&what), hex16(&purpose)))
}

/// The top-level modules and packages `python -m` could import from `dir` (it is sys.path[0]):
/// `NAME.py`, `NAME.pyc`, `NAME*.so` and `NAME/__init__.py`, each with its file's size and
/// mtime (path left out: two checkouts' same files are one installation). A directory without
/// `__init__.py` is left out: a namespace portion loses to a regular package found later.
fn importable_at(dir: &Path) -> Vec<(String, serde_json::Value)> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<(String, serde_json::Value)> = entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let file = if [".py", ".pyc", ".so"].iter().any(|x| name.ends_with(x)) {
                e.path()
            } else {
                let init = e.path().join("__init__.py");
                if !init.is_file() {
                    return None;
                }
                init
            };
            let m = std::fs::metadata(&file).ok()?;
            Some((
                name,
                serde_json::json!([m.len(), m.mtime(), m.mtime_nsec()]),
            ))
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// What a daemon records about itself next to its socket (`gate workers` reads it).
#[derive(Serialize, Deserialize)]
pub struct Info {
    pub pid: i32,
    pub worker_pid: i32,
    pub command: String,
    pub cwd: String,
    /// Unix seconds.
    pub started: u64,
    /// Unix seconds at the end of the last request (or the start).
    pub last_used: u64,
}

fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Local wall-clock time of unix seconds `t`, `HH:MM:SS`.
pub fn clock(t: u64) -> String {
    // SAFETY: localtime_r fills the out-parameter from a time_t.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    let tt = t as libc::time_t;
    unsafe { libc::localtime_r(&tt, &mut tm) };
    format!("{:02}:{:02}:{:02}", tm.tm_hour, tm.tm_min, tm.tm_sec)
}

struct Paths {
    sock: PathBuf,
    lock: PathBuf,
    info: PathBuf,
    log: PathBuf,
    /// The worker's purpose (`key`), for `retire_superseded`.
    purpose: PathBuf,
}

fn paths(dir: &Path, key: &str) -> Paths {
    Paths {
        sock: dir.join(format!("{key}.sock")),
        lock: dir.join(format!("{key}.lock")),
        info: dir.join(format!("{key}.json")),
        log: dir.join(format!("{key}.log")),
        purpose: dir.join(format!("{key}.purpose")),
    }
}

fn read_info(path: &Path) -> Option<Info> {
    serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()
}

fn write_info(path: &Path, info: &Info) {
    let tmp = path.with_extension("json.tmp");
    if let Ok(text) = serde_json::to_string(info) {
        if std::fs::write(&tmp, text).is_ok() {
            let _ = std::fs::rename(&tmp, path);
        }
    }
}

/// A gate run's connection to a resident worker; holds the key's lock while it lives.
pub(crate) struct Client {
    reader: BufReader<UnixStream>,
    stream: UnixStream,
    _lock: std::fs::File,
    pid: i32,
    worker_pid: i32,
    resident: &'static str,
    /// The producer it serves (`contract`, `oracle`), for the run's last line.
    name: String,
    /// This run's working directory (absolute), sent with each request.
    cwd: String,
    /// Ended at the end of the run for the memory bound (`keep_within_bound`).
    ended: bool,
    sock: PathBuf,
    /// Bytes of the daemon's next line read so far.
    line: Vec<u8>,
}

pub(crate) enum Reply {
    /// Answered: what the request ended with (a failed run included).
    Ended(Ended),
    /// The worker's code changed; it has left. Ask a fresh one.
    Stale(String),
    /// The worker is gone (or was killed at the timeout): the request's result says why.
    Gone(Ended),
}

/// Whether `serve_argv` is the built-in contract's or oracle's worker (a user's template is
/// never resident: the gate cannot know what its worker's result depends on).
fn built_in(root: &Path, serve_argv: &[String]) -> bool {
    [default_contract_cmd(root), default_oracle_cmd(root)]
        .iter()
        .any(|t| {
            let words = split_words(t).unwrap_or_default();
            words.iter().position(|w| w == SERVE_VERB).is_some_and(|i| {
                words[..i]
                    .iter()
                    .chain(["serve".to_string()].iter())
                    .eq(serve_argv)
            })
        })
}

#[derive(Deserialize)]
struct Hello {
    pid: i32,
    worker_pid: i32,
    started: u64,
}

/// A resident worker for `serve_argv` in `root`: None when residency is off; Err(why this run
/// starts its own instead: busy, or the runtime directory refused). Prints which worker serves.
pub(crate) fn open(
    name: &str,
    root: &Path,
    serve_argv: &[String],
) -> Option<Result<Client, String>> {
    if !enabled() || !built_in(root, serve_argv) {
        return None;
    }
    Some(open_resident(name, root, serve_argv))
}

/// How long a run waits for the key's lock before it starts its own worker. Not zero: a process
/// forked at the moment another thread of this gate still held the lock (to start another
/// worker's daemon) keeps the lock until it execs, a few milliseconds.
const LOCK_GRACE: std::time::Duration = std::time::Duration::from_secs(1);

/// Takes the exclusive flock on `lock`, trying until `grace` has passed.
fn lock_within(lock: &std::fs::File, grace: std::time::Duration) -> bool {
    let until = std::time::Instant::now() + grace;
    loop {
        // SAFETY: flock on a descriptor the caller owns.
        if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return true;
        }
        if std::time::Instant::now() >= until {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

fn open_resident(name: &str, root: &Path, serve_argv: &[String]) -> Result<Client, String> {
    let dir = runtime_dir()?;
    let (key, purpose) = key(root, serve_argv)?;
    let p = paths(&dir, &key);
    if p.sock.as_os_str().len() >= 100 {
        return Err(format!(
            "socket path {} is too long for a Unix socket",
            p.sock.display()
        ));
    }
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&p.lock)
        .map_err(|e| format!("{}: {e}", p.lock.display()))?;
    if !lock_within(&lock, LOCK_GRACE) {
        let pid = read_info(&p.info).map_or(String::new(), |i| format!(" (pid {})", i.worker_pid));
        return Err(format!(
            "the resident worker{pid} is busy with another gate run"
        ));
    }
    // Within the memory bound before this worker is kept or started: others' idle workers are
    // retired; if what other gate runs hold is over it, this run starts its own.
    if let Err((mb, max)) = within_bound(&dir, std::slice::from_ref(&key), false) {
        return Err(format!(
            "this user's other resident workers use {mb} MB, over TRACEGATE_RESIDENT_MAX_MB={max}, and other gate runs hold them"
        ));
    }
    // A socket that does not answer with a hello (its daemon died, or is leaving: idle, stale)
    // is replaced (we hold the lock, so no one else is replacing it).
    let reused = UnixStream::connect(&p.sock)
        .map_err(|e| e.to_string())
        .and_then(|s| hello(s, &p.sock));
    let ((reader, stream, h), resident) = match reused {
        Ok(x) => (x, "reused"),
        Err(_) => {
            let _ = std::fs::remove_file(&p.sock);
            let _ = std::fs::remove_file(&p.info);
            let s = start(root, &dir, &key, &p, serve_argv)?;
            let _ = std::fs::write(&p.purpose, &purpose);
            retire_superseded(name, &dir, &key, &purpose);
            (hello(s, &p.sock)?, "started")
        }
    };
    match resident {
        "reused" => eprintln!(
            "[gate] {name} worker {} reused (resident since {}; `gate workers stop` ends it)",
            h.worker_pid,
            clock(h.started)
        ),
        _ => eprintln!(
            "[gate] {name} worker {} started, resident (serves later gate runs; leaves after {} s idle; `gate workers stop` ends it)",
            h.worker_pid,
            idle_s()
        ),
    }
    Ok(Client {
        reader,
        stream,
        _lock: lock,
        pid: h.pid,
        worker_pid: h.worker_pid,
        resident,
        name: name.to_string(),
        cwd: std::fs::canonicalize(root)
            .map_err(|e| format!("{}: {e}", root.display()))?
            .display()
            .to_string(),
        sock: p.sock,
        ended: false,
        line: Vec::new(),
    })
}

/// Ends the idle resident workers of `purpose` under other keys (the gate rebuilt, the Python
/// reinstalled since they started): no gate run would ask them again, and each holds a model's
/// worth of memory until its idle exit. One another gate run holds is left to it.
fn retire_superseded(name: &str, dir: &Path, key: &str, purpose: &str) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for path in entries.flatten().map(|e| e.path()) {
        let Some(other) = path
            .file_stem()
            .and_then(|s| s.to_str())
            .filter(|_| path.extension().is_some_and(|x| x == "purpose"))
        else {
            continue;
        };
        if other == key || std::fs::read_to_string(&path).ok().as_deref() != Some(purpose) {
            continue;
        }
        let p = paths(dir, other);
        let Ok(lock) = std::fs::OpenOptions::new().write(true).open(&p.lock) else {
            continue;
        };
        if !lock_within(&lock, Duration::ZERO) {
            continue;
        }
        if let Some(info) =
            read_info(&p.info).filter(|i| kill_verified(dir, other, i.pid, i.worker_pid).is_ok())
        {
            eprintln!(
                "[gate] {name} worker {} retired: superseded by this one (the gate executable or the Python changed)",
                info.worker_pid
            );
        }
        for f in [&p.sock, &p.info, &p.purpose] {
            let _ = std::fs::remove_file(f);
        }
    }
}

fn hello(
    stream: UnixStream,
    sock: &Path,
) -> Result<(BufReader<UnixStream>, UnixStream, Hello), String> {
    stream
        .set_read_timeout(Some(CONNECT_WAIT))
        .map_err(|e| e.to_string())?;
    let mut reader = BufReader::new(stream.try_clone().map_err(|e| e.to_string())?);
    let mut line = String::new();
    reader.read_line(&mut line).map_err(|e| {
        format!(
            "no hello from the resident worker at {}: {e}",
            sock.display()
        )
    })?;
    let h: Hello = serde_json::from_str(&line).map_err(|e| {
        format!(
            "the resident worker at {} said {line:?}: {e}",
            sock.display()
        )
    })?;
    Ok((reader, stream, h))
}

/// Starts the daemon detached (a session of its own, reparented to init, stdio on its log
/// file) and connects to it.
fn start(
    root: &Path,
    dir: &Path,
    key: &str,
    p: &Paths,
    serve_argv: &[String],
) -> Result<UnixStream, String> {
    use std::os::unix::process::CommandExt;
    let exe = std::env::current_exe().map_err(|e| format!("the gate's executable: {e}"))?;
    let log = std::fs::File::create(&p.log).map_err(|e| format!("{}: {e}", p.log.display()))?;
    let log2 = log.try_clone().map_err(|e| e.to_string())?;
    let mut cmd = std::process::Command::new(exe);
    cmd.arg(RESIDENT_CHILD)
        .arg(dir)
        .arg(key)
        .args(serve_argv)
        .current_dir(root)
        .stdin(std::process::Stdio::null())
        .stdout(log)
        .stderr(log2);
    // SAFETY: fork, setsid, _exit, syscall(close_range), getrlimit and fcntl are
    // async-signal-safe. The intermediate child exits at once, so the daemon is nobody's child
    // but init's and never this gate's zombie.
    unsafe {
        cmd.pre_exec(|| {
            match libc::fork() {
                -1 => return Err(std::io::Error::last_os_error()),
                0 => {}
                _ => libc::_exit(0),
            }
            libc::setsid();
            cloexec_from_3();
            Ok(())
        });
    }
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("could not start the resident worker: {e}"))?;
    let _ = child.wait();
    let since = Instant::now();
    loop {
        match UnixStream::connect(&p.sock) {
            Ok(s) => return Ok(s),
            Err(e) if since.elapsed() > CONNECT_WAIT => {
                return Err(format!(
                    "the resident worker did not listen at {} within {} s: {e} (log: {})",
                    p.sock.display(),
                    CONNECT_WAIT.as_secs(),
                    p.log.display()
                ))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

/// Marks every descriptor above stderr close-on-exec, so the daemon (and its worker) keeps none
/// the gate inherited: a caller that waits for EOF on a pipe it gave the gate does not wait for
/// the daemon's idle exit. Marked rather than closed: std's own exec-error pipe must stay open
/// until the exec. Runs between fork and exec (async-signal-safe calls only).
unsafe fn cloexec_from_3() {
    const CLOSE_RANGE_CLOEXEC: libc::c_uint = 1 << 2;
    if libc::syscall(
        libc::SYS_close_range,
        3 as libc::c_uint,
        libc::c_uint::MAX,
        CLOSE_RANGE_CLOEXEC,
    ) == 0
    {
        return;
    }
    // Kernels before 5.11: every descriptor the limit allows.
    let mut lim: libc::rlimit = std::mem::zeroed();
    let max = if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 {
        lim.rlim_cur.min(1 << 20) as libc::c_int
    } else {
        1024
    };
    for fd in 3..max {
        let flags = libc::fcntl(fd, libc::F_GETFD);
        if flags >= 0 {
            libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC);
        }
    }
}

fn kill_groups(pids: &[i32]) {
    for &pid in pids.iter().filter(|&&p| p > 1) {
        // SAFETY: kill sends a signal; both are session/group leaders we started.
        unsafe { libc::kill(-pid, libc::SIGKILL) };
    }
}

impl Client {
    pub(crate) fn served(&self) -> Served {
        Served {
            pid: self.worker_pid as u32,
            resident: Some(self.resident),
        }
    }

    /// One request, to be answered by `deadline`: the daemon ends it there as a per-run worker's
    /// request is ended (its answer says timed out, with the worker's stderr so far); if the
    /// daemon has not answered by `deadline + BACKSTOP`, both groups (daemon and worker) are
    /// killed here and the request is a timeout without stderr.
    ///
    /// A request after which the daemon leaves (`Reply::Gone`: the worker failed, ended or timed
    /// out; `Reply::Stale`) returns only once the daemon has left (it reaps its worker before it
    /// answers), or BACKSTOP later with both killed: when the gate returns, neither runs any
    /// more (docs/producers.md, "Resident workers").
    pub(crate) fn ask(&mut self, request: &[String], deadline: Instant) -> Reply {
        let reply = self.ask_daemon(request, deadline);
        if matches!(reply, Reply::Gone(_) | Reply::Stale(_)) {
            self.wait_gone();
        }
        reply
    }

    /// What stays resident after this run, `oracle worker 1234 (812 MB)`: None when its daemon
    /// has left (a request ended it), so the run's last line names only what still runs.
    pub(crate) fn still_resident(&self) -> Option<String> {
        let (dir, key) = self.dir_key();
        if self.ended || !is_daemon_of(self.pid, &dir, &key) {
            return None;
        }
        let kib = rss_kib(self.pid) + rss_kib(self.worker_pid);
        Some(format!(
            "{} worker {} ({:.0} MB)",
            self.name,
            self.worker_pid,
            kib as f64 / 1024.0
        ))
    }

    /// The daemon's runtime directory and key (its socket's directory and name).
    fn dir_key(&self) -> (PathBuf, String) {
        let dir = self.sock.parent().map_or(PathBuf::new(), Path::to_path_buf);
        let key = self
            .sock
            .file_stem()
            .map_or(String::new(), |s| s.to_string_lossy().into_owned());
        (dir, key)
    }

    fn wait_gone(&self) {
        let (dir, key) = self.dir_key();
        let since = Instant::now();
        while is_daemon_of(self.pid, &dir, &key) {
            if since.elapsed() >= BACKSTOP {
                let _ = kill_verified(&dir, &key, self.pid, self.worker_pid);
                let _ = std::fs::remove_file(&self.sock);
                let _ = std::fs::remove_file(self.sock.with_extension("json"));
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn ask_daemon(&mut self, request: &[String], deadline: Instant) -> Reply {
        let gone = |why: String| Reply::Gone(Ended::failed(why));
        let left = deadline.saturating_duration_since(Instant::now());
        let line = serve::request_line(request, Some(left), Some(&self.cwd));
        if line.len() > MAX_REQUEST_LINE {
            // The daemon would refuse it (and drop this client): refused here, the worker kept.
            return Reply::Ended(Ended::failed(format!(
                "the request line is {} bytes, over the resident worker's bound of {MAX_REQUEST_LINE}",
                line.len()
            )));
        }
        let deadline = deadline + BACKSTOP;
        if let Err(e) = self.stream.write_all(line.as_bytes()) {
            return gone(format!(
                "resident worker {} did not take the request: {e}",
                self.worker_pid
            ));
        }
        self.line.clear();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let (dir, key) = self.dir_key();
                let _ = kill_verified(&dir, &key, self.pid, self.worker_pid);
                let _ = std::fs::remove_file(&self.sock);
                let mut e = Ended::failed(String::new());
                e.timed_out = true;
                return Reply::Gone(e);
            }
            let _ = self
                .reader
                .get_ref()
                .set_read_timeout(Some(left.min(Duration::from_millis(200))));
            match self.reader.read_until(b'\n', &mut self.line) {
                Ok(0) => {
                    return gone(format!(
                        "resident worker {} (daemon {}) ended without answering (log: {})",
                        self.worker_pid,
                        self.pid,
                        self.sock.with_extension("log").display()
                    ))
                }
                Ok(_) if self.line.ends_with(b"\n") => break,
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock
                            | std::io::ErrorKind::TimedOut
                            | std::io::ErrorKind::Interrupted
                    ) => {}
                Err(e) => return gone(format!("resident worker {}: {e}", self.worker_pid)),
            }
        }
        match serde_json::from_slice::<DaemonAnswer>(&self.line) {
            Ok(DaemonAnswer::Ended(e)) => Reply::Ended(e),
            Ok(DaemonAnswer::Gone(e)) => Reply::Gone(e),
            Ok(DaemonAnswer::Stale(why)) => Reply::Stale(why),
            Err(e) => gone(format!(
                "resident worker {} answered {:?}: {e}",
                self.worker_pid,
                String::from_utf8_lossy(&self.line)
            )),
        }
    }
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
enum DaemonAnswer {
    /// Answered; the worker stays.
    Ended(Ended),
    /// Failed and the worker is gone (the daemon leaves too).
    Gone(Ended),
    Stale(String),
}

fn log(msg: &str) {
    println!("[{}] {msg}", clock(now_s()));
}

/// The daemon: `RESIDENT_CHILD DIR KEY SERVE_ARGV…`, started in its first client's working
/// directory (its worker's start; each request then runs in its own client's).
pub fn daemon_main(args: &[String]) -> i32 {
    let [dir, key, serve_argv @ ..] = args else {
        eprintln!("usage: gate {RESIDENT_CHILD} DIR KEY SERVE_ARGV...");
        return 2;
    };
    // The gate checked its settings before it started this daemon; a daemon never runs on a
    // refused one (its idle time, its bound).
    if let Err(e) = settings::check() {
        log(&format!("refused: {e}"));
        return 2;
    }
    let p = paths(Path::new(dir), key);
    let listener = match UnixListener::bind(&p.sock) {
        Ok(l) => l,
        Err(e) => {
            log(&format!("cannot listen at {}: {e}", p.sock.display()));
            return 2;
        }
    };
    let bound = std::fs::metadata(&p.sock).map(|m| m.ino()).ok();
    let code = serve_socket(&listener, &p, serve_argv);
    // Only our own files: a fresh daemon may already listen under the same name.
    if std::fs::metadata(&p.sock).map(|m| m.ino()).ok() == bound {
        let _ = std::fs::remove_file(&p.sock);
    }
    if read_info(&p.info).is_some_and(|i| i.pid == std::process::id() as i32) {
        let _ = std::fs::remove_file(&p.info);
    }
    code
}

fn serve_socket(listener: &UnixListener, p: &Paths, serve_argv: &[String]) -> i32 {
    let root = Path::new(".");
    let mut worker = match Worker::spawn(root, serve_argv) {
        Ok(w) => Some(w),
        Err(e) => {
            log(&format!("{e}"));
            return 2;
        }
    };
    let worker_pid = worker.as_ref().map_or(0, |w| w.pid);
    let mut info = Info {
        pid: std::process::id() as i32,
        worker_pid,
        command: display(serve_argv),
        cwd: std::fs::canonicalize(root).map_or(String::new(), |c| c.display().to_string()),
        started: now_s(),
        last_used: now_s(),
    };
    write_info(&p.info, &info);
    log(&format!(
        "started: daemon {}, worker {worker_pid}: $ {}",
        info.pid, info.command
    ));
    let idle = Duration::from_secs(idle_s());
    let mut idle_since = Instant::now();
    let mut buf = vec![0u8; 64 * 1024];
    let _ = listener.set_nonblocking(true);
    loop {
        let Some(w) = worker.as_mut() else { return 1 };
        if !w.idle(&mut buf) {
            let why = w
                .overlong()
                .map_or("the worker ended on its own".into(), str::to_string);
            let _ = serve::ended(&mut worker, Answer::Broken("ended".into()), serve_argv);
            log(&why);
            return 1;
        }
        if idle_since.elapsed() >= idle {
            log(&format!("idle for {} s: leaving", idle.as_secs()));
            return 0; // dropping the worker closes its stdin: it leaves (EOF)
        }
        let stream = match listener.accept() {
            Ok((s, _)) => s,
            Err(_) => continue, // nothing yet: `idle` waited 20 ms
        };
        log("client connected");
        match serve_client(stream, &mut worker, &info, p, serve_argv) {
            Ok(()) => log("client left"),
            Err(why) => {
                log(&why);
                return 1;
            }
        }
        info.last_used = now_s();
        write_info(&p.info, &info);
        idle_since = Instant::now();
    }
}

/// Serves one client until it leaves (Ok) or the worker cannot go on (Err: why).
fn serve_client(
    stream: UnixStream,
    worker: &mut Option<Worker>,
    info: &Info,
    p: &Paths,
    serve_argv: &[String],
) -> Result<(), String> {
    let _ = stream.set_nonblocking(false);
    let mut out = stream.try_clone().map_err(|e| e.to_string())?;
    let hello = serde_json::json!({"pid": info.pid, "worker_pid": info.worker_pid, "started": info.started});
    writeln!(out, "{hello}").map_err(|e| format!("hello: {e}"))?;
    let fd = stream.as_raw_fd();
    let mut reader = BufReader::new(stream);
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        // Wait for a request while keeping the worker's stderr drained.
        let mut line = Vec::new();
        loop {
            if !readable(fd, 20) {
                if let Some(w) = worker.as_mut() {
                    if !w.idle(&mut buf) {
                        let why = w.overlong().unwrap_or("the worker ended between requests");
                        return Err(why.to_string());
                    }
                }
                continue;
            }
            // Bounded: read at most one byte past MAX_REQUEST_LINE (BufReader's read_until scans
            // each buffered chunk once).
            let room = (MAX_REQUEST_LINE + 1 - line.len()) as u64;
            match (&mut reader).take(room).read_until(b'\n', &mut line) {
                Ok(0) => return Ok(()),
                Ok(_) if line.ends_with(b"\n") => break,
                Ok(_) if line.len() > MAX_REQUEST_LINE => {
                    // The client is dropped, not the worker: the next client is served as before.
                    let _ = writeln!(
                        out,
                        "{}",
                        json(&DaemonAnswer::Ended(Ended::failed(format!(
                            "request line over {MAX_REQUEST_LINE} bytes without a newline: refused"
                        ))))
                    );
                    log(&format!(
                        "a client sent more than {MAX_REQUEST_LINE} bytes without a newline (the bound of a request line): it was dropped"
                    ));
                    return Ok(());
                }
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => return Ok(()),
            }
        }
        let parsed = serde_json::from_slice::<serde_json::Value>(&line).ok();
        let deadline = parsed
            .as_ref()
            .and_then(|v| v.get("timeout_ms")?.as_u64())
            .map(|ms| Instant::now() + Duration::from_millis(ms));
        let request: Vec<String> = match parsed
            .as_ref()
            .and_then(|v| serde_json::from_value(v.get("argv")?.clone()).ok())
        {
            Some(r) => r,
            None => {
                return Err(format!(
                    "bad request line {:?}",
                    String::from_utf8_lossy(&line)
                ))
            }
        };
        let Some(w) = worker.as_mut() else {
            return Err("no worker".into());
        };
        // Run where the client runs (the daemon itself stays where it started).
        w.cwd = parsed
            .as_ref()
            .and_then(|v| Some(v.get("cwd")?.as_str()?.to_string()));
        log(&format!(
            "request: {}",
            request.first().map_or("", String::as_str)
        ));
        // The client sends nothing while it waits: readable now means it left.
        let answer = w.ask(&request, deadline, &mut || readable(fd, 0));
        if matches!(answer, Answer::TimedOut) {
            log("the request outlived its timeout: the worker is ended");
        }
        let reply = match answer {
            Answer::Stale(why) => {
                // Gone before the client hears it, so its next connect starts a fresh one.
                let _ = std::fs::remove_file(&p.sock);
                let _ = serve::ended(worker, Answer::Stale(why.clone()), serve_argv);
                let _ = writeln!(out, "{}", json(&DaemonAnswer::Stale(why.clone())));
                return Err(format!("stale: {why}"));
            }
            Answer::Cancelled => {
                let _ = serve::ended(worker, Answer::Cancelled, serve_argv);
                return Err("the client left mid-request: the request was dropped".into());
            }
            a @ Answer::Exit(_) => DaemonAnswer::Ended(serve::ended(worker, a, serve_argv)),
            a => DaemonAnswer::Gone(serve::ended(worker, a, serve_argv)),
        };
        let gone = matches!(reply, DaemonAnswer::Gone(_));
        writeln!(out, "{}", json(&reply)).map_err(|e| format!("answer: {e}"))?;
        if gone {
            return Err("the worker failed a request and was ended".into());
        }
    }
}

fn json<T: Serialize>(v: &T) -> String {
    serde_json::to_string(v).unwrap_or_else(|e| format!("{{\"stale\": \"answer: {e}\"}}"))
}

/// Whether `fd` has something to read (or hung up), within `ms` milliseconds.
fn readable(fd: i32, ms: i32) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one live pollfd.
    unsafe { libc::poll(&mut p, 1, ms) > 0 }
}

/// A running resident worker as `gate workers` lists it.
pub struct Listed {
    pub info: Info,
    /// Resident set of the daemon and its worker, KiB.
    pub rss_kib: u64,
}

fn rss_kib(pid: i32) -> u64 {
    serve::proc_status_kib(pid, "VmRSS").unwrap_or(0)
}

/// Whether `pid` is the daemon of `key` in the runtime directory `dir`: this user's process
/// running `EXE RESIDENT_CHILD DIR KEY …` (DIR the same directory), leading its own process group
/// (it called setsid). A record names pids; only this makes it safe to signal them.
fn is_daemon_of(pid: i32, dir: &Path, key: &str) -> bool {
    use std::os::unix::ffi::OsStrExt;
    if pid <= 1 {
        return false;
    }
    let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
    let (Some(&verb), Some(&d), Some(&k)) = (args.get(1), args.get(2), args.get(3)) else {
        return false;
    };
    if verb != RESIDENT_CHILD.as_bytes() || k != key.as_bytes() {
        return false;
    }
    let d = Path::new(std::ffi::OsStr::from_bytes(d));
    let d = if d.is_relative() {
        match std::fs::read_link(format!("/proc/{pid}/cwd")) {
            Ok(cwd) => cwd.join(d),
            Err(_) => return false,
        }
    } else {
        d.to_path_buf()
    };
    let same_dir = match (std::fs::metadata(&d), std::fs::metadata(dir)) {
        (Ok(a), Ok(b)) => (a.dev(), a.ino()) == (b.dev(), b.ino()),
        _ => false,
    };
    // SAFETY: getpgid reads a process's group id.
    same_dir && unsafe { libc::getpgid(pid) } == pid
}

/// Whether `worker` is `daemon`'s worker: its child, leading a process group of its own (as
/// crate::serve starts it). Anything else a record names is not ours to signal.
fn is_worker_of(worker: i32, daemon: i32) -> bool {
    if worker <= 1 {
        return false;
    }
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{worker}/stat")) else {
        return false;
    };
    // After the command's closing parenthesis: state, ppid, pgrp, …
    let mut fields = stat
        .rsplit_once(") ")
        .map_or("", |(_, r)| r)
        .split_whitespace();
    let _state = fields.next();
    let ppid = fields.next().and_then(|v| v.parse::<i32>().ok());
    let pgrp = fields.next().and_then(|v| v.parse::<i32>().ok());
    ppid == Some(daemon) && pgrp == Some(worker)
}

/// Whether a record's pids are what it says: Err(why nothing may be signalled) when `daemon` is
/// not the key's daemon (`is_daemon_of`); Ok(Some(why the worker may not be)) when `worker` is
/// not that daemon's worker (`is_worker_of`). A stale or planted record's pids may belong to
/// anyone's processes.
fn verify(dir: &Path, key: &str, daemon: i32, worker: i32) -> Result<Option<String>, String> {
    if !is_daemon_of(daemon, dir, key) {
        return Err(format!(
            "{key}.json names daemon pid {daemon}, which is not that worker's daemon (not `gate {RESIDENT_CHILD} {} {key} …` leading its own process group): not signalled",
            dir.display()
        ));
    }
    if is_worker_of(worker, daemon) {
        return Ok(None);
    }
    Ok(Some(format!(
        "{key}.json names worker pid {worker}, which is not daemon {daemon}'s child leading its own process group: not signalled (the daemon was)"
    )))
}

/// Kills the daemon a record names (its group) and its worker's group, each only when `verify`
/// says it is what the record says; `verify`'s verdict (a worker not signalled leaves at the EOF
/// on its stdin).
fn kill_verified(
    dir: &Path,
    key: &str,
    daemon: i32,
    worker: i32,
) -> Result<Option<String>, String> {
    let verdict = verify(dir, key, daemon, worker)?;
    if verdict.is_none() {
        kill_groups(&[worker]);
    }
    kill_groups(&[daemon]);
    Ok(verdict)
}

fn alive(pid: i32) -> bool {
    pid > 0
        && std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .is_ok_and(|s| s.rsplit(") ").next().is_some_and(|r| !r.starts_with('Z')))
}

/// The resident workers of this user's runtime directory; entries whose daemon is gone are
/// removed.
pub fn list() -> Result<Vec<Listed>, String> {
    let dir = runtime_dir()?;
    let mut out = Vec::new();
    let entries = std::fs::read_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    for e in entries.flatten() {
        let path = e.path();
        if path.extension().is_none_or(|x| x != "json") {
            continue;
        }
        let Some(info) = read_info(&path) else {
            continue;
        };
        let key = path
            .file_stem()
            .map_or(String::new(), |s| s.to_string_lossy().into_owned());
        if !is_daemon_of(info.pid, &dir, &key) {
            for ext in ["json", "sock", "purpose"] {
                let _ = std::fs::remove_file(path.with_extension(ext));
            }
            continue;
        }
        let rss_kib = rss_kib(info.pid) + rss_kib(info.worker_pid);
        out.push(Listed { info, rss_kib });
    }
    out.sort_by_key(|l| l.info.started);
    Ok(out)
}

/// Ends every resident worker: how many it ended, and why it signalled what a record named only
/// in part or not at all (a record whose pids are not its daemon and worker: stale, or planted).
pub fn stop_all() -> Result<(usize, Vec<String>), String> {
    let dir = runtime_dir()?;
    let mut notes = Vec::new();
    let mut stopped = Vec::new();
    let entries = std::fs::read_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    // Every record is judged before any is acted on: a record naming another's daemon is refused
    // for what it names, whichever is listed first.
    let mut judged = Vec::new();
    for path in entries.flatten().map(|e| e.path()) {
        if path.extension().is_none_or(|x| x != "json") {
            continue;
        }
        let Some(info) = read_info(&path) else {
            continue;
        };
        let key = path
            .file_stem()
            .map_or(String::new(), |s| s.to_string_lossy().into_owned());
        // A pid that has ended is a stale record, nothing to tell; a live one is not ours.
        let verdict = verify(&dir, &key, info.pid, info.worker_pid)
            .map_err(|why| alive(info.pid).then_some(why));
        judged.push((key, info, verdict));
    }
    for (key, info, verdict) in judged {
        match verdict {
            // Verified again as it is signalled (it may have ended since).
            Ok(_) => {
                if let Ok(note) = kill_verified(&dir, &key, info.pid, info.worker_pid) {
                    notes.extend(note);
                    stopped.push((key, info.pid, info.worker_pid));
                }
            }
            Err(why) => notes.extend(why),
        }
    }
    // "Stopped" means ended: the daemon and its worker (signalled apart, they end apart).
    let since = Instant::now();
    while stopped
        .iter()
        .any(|(k, pid, worker)| is_daemon_of(*pid, &dir, k) || alive(*worker))
        && since.elapsed() < Duration::from_secs(5)
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    // Their files (a killed daemon cannot remove its own), and those of records naming no daemon.
    list()?;
    Ok((stopped.len(), notes))
}

/// `gate workers [stop]`'s text.
pub fn workers_verb(stop: bool) -> Result<String, String> {
    if stop {
        let (n, notes) = stop_all()?;
        let mut s = format!("stopped {n} resident worker(s)");
        for note in notes {
            s.push_str(&format!("\n  {note}"));
        }
        return Ok(s);
    }
    let all = list()?;
    let dir = runtime_dir()?;
    let mut s = format!("{} resident worker(s) in {}", all.len(), dir.display());
    let now = now_s();
    for l in &all {
        let i = &l.info;
        s.push_str(&format!(
            "\n  worker {} (daemon {}): started {}, idle for {} s, RSS {:.0} MiB\n    $ {}\n    in {}",
            i.worker_pid,
            i.pid,
            clock(i.started),
            now.saturating_sub(i.last_used),
            l.rss_kib as f64 / 1024.0,
            i.command,
            i.cwd
        ));
    }
    Ok(s)
}
