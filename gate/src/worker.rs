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

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::{Duration, Instant};

use crate::producer::{display, exit_text, Capture, Ended};

/// (working directory, worker command line): one worker each.
type Key = (PathBuf, Vec<String>);
type Slot = Arc<Mutex<Option<Worker>>>;

static WORKERS: LazyLock<Mutex<HashMap<Key, Slot>>> = LazyLock::new(|| Mutex::new(HashMap::new()));

struct Worker {
    child: Child,
    pid: libc::pid_t,
    stdin: ChildStdin,
    out: Option<std::fs::File>,
    err: Option<std::fs::File>,
    /// Bytes of stdout after the last complete answer line.
    line: Vec<u8>,
    /// stderr since the previous answer (a fresh worker's start-up output goes to its first request).
    err_cap: Capture,
}

fn slot(root: &Path, serve_argv: &[String]) -> Slot {
    let mut map = WORKERS.lock().unwrap_or_else(|p| p.into_inner());
    map.entry((root.to_path_buf(), serve_argv.to_vec()))
        .or_default()
        .clone()
}

fn nonblocking(f: &std::fs::File) {
    // SAFETY: fcntl on a descriptor the worker owns.
    unsafe {
        let flags = libc::fcntl(f.as_raw_fd(), libc::F_GETFL);
        libc::fcntl(f.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK);
    }
}

impl Worker {
    fn spawn(root: &Path, argv: &[String]) -> crate::Result<Worker> {
        use std::os::unix::process::CommandExt;
        let (prog, rest) = argv
            .split_first()
            .ok_or_else(|| crate::gerr!("empty worker command"))?;
        let mut child = Command::new(prog)
            .args(rest)
            .current_dir(root)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .spawn()
            .map_err(|e| crate::gerr!(Producer: "could not start {prog:?}: {e}"))?;
        let as_file = |fd: Option<std::os::fd::OwnedFd>| fd.map(std::fs::File::from);
        let out = as_file(child.stdout.take().map(Into::into));
        let err = as_file(child.stderr.take().map(Into::into));
        out.iter().chain(err.iter()).for_each(nonblocking);
        let stdin = child
            .stdin
            .take()
            .ok_or_else(|| crate::gerr!(Producer: "worker has no stdin"))?;
        Ok(Worker {
            pid: child.id() as libc::pid_t,
            child,
            stdin,
            out,
            err,
            line: Vec::new(),
            err_cap: Capture::default(),
        })
    }

    /// Reads what is there (waiting at most 20 ms); Some(answer line) once one is complete.
    fn pump(&mut self, buf: &mut [u8]) -> Option<String> {
        let open: Vec<(usize, i32)> = [&self.out, &self.err]
            .iter()
            .enumerate()
            .filter_map(|(i, f)| f.as_ref().map(|f| (i, f.as_raw_fd())))
            .collect();
        if open.is_empty() {
            std::thread::sleep(Duration::from_millis(20));
            return None;
        }
        let mut pfds: Vec<libc::pollfd> = open
            .iter()
            .map(|&(_, fd)| libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        // SAFETY: pfds is a live array of pollfd of the given length.
        unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, 20) };
        for (&(i, _), p) in open.iter().zip(&pfds) {
            if p.revents == 0 {
                continue;
            }
            let f = if i == 0 { &mut self.out } else { &mut self.err };
            let Some(file) = f.as_mut() else { continue };
            match file.read(buf) {
                Ok(0) => *f = None,
                Ok(n) if i == 0 => self.line.extend_from_slice(&buf[..n]),
                Ok(n) => self.err_cap.push(&buf[..n]),
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::Interrupted | std::io::ErrorKind::WouldBlock
                    ) => {}
                Err(_) => *f = None,
            }
        }
        let nl = self.line.iter().position(|&b| b == b'\n')?;
        let line: Vec<u8> = self.line.drain(..=nl).collect();
        Some(String::from_utf8_lossy(&line).trim().to_string())
    }

    /// Kills the group, reads the rest of stderr (DRAIN_GRACE at most), reaps the leader: how it
    /// ended, and its peak RSS.
    fn end(mut self) -> (String, Option<i32>, Option<u64>, Capture) {
        // SAFETY: the leader is our unreaped child, so its pid (the group id) is not reused.
        unsafe { libc::kill(-self.pid, libc::SIGKILL) };
        let start = Instant::now();
        let mut buf = vec![0u8; 64 * 1024];
        self.out = None;
        while self.err.is_some() && start.elapsed() < crate::producer::DRAIN_GRACE {
            self.pump(&mut buf);
        }
        let mut status: libc::c_int = 0;
        // SAFETY: rusage is a plain out-parameter; wait4 on our own child.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        while unsafe { libc::wait4(self.pid, &mut status, 0, &mut usage) } == -1
            && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted
        {}
        let (_, code, how) = exit_text(status);
        drop(self.child); // reaped above: dropping neither waits nor kills
        (how, code, Some(usage.ru_maxrss as u64), self.err_cap)
    }
}

/// The worker's peak RSS so far (VmHWM), as a per-call run reports its own.
fn peak_rss_kib(pid: libc::pid_t) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Starts the worker now, so its start-up (imports) overlaps whatever the gate does next.
pub(crate) fn prestart(root: &Path, serve_argv: &[String]) {
    let slot = slot(root, serve_argv);
    let mut w = slot.lock().unwrap_or_else(|p| p.into_inner());
    if w.is_none() {
        // A worker that cannot start is reported by the first request that needs it.
        *w = Worker::spawn(root, serve_argv).ok();
    }
}

/// One request: `request` is the per-call command line from the verb on. Returns how it ended
/// (as a per-call run would) and the worker's pid.
pub(crate) fn request(
    root: &Path,
    serve_argv: &[String],
    request: &[String],
    timeout: Duration,
) -> (Ended, Option<u32>) {
    let slot = slot(root, serve_argv);
    let mut guard = slot.lock().unwrap_or_else(|p| p.into_inner());
    if guard.is_none() {
        match Worker::spawn(root, serve_argv) {
            Ok(w) => *guard = Some(w),
            Err(e) => return (Ended::failed(e.to_string()), None),
        }
    }
    let Some(w) = guard.as_mut() else {
        return (Ended::failed("no worker".into()), None);
    };
    let pid = w.pid as u32;
    let start = Instant::now();
    let line = serde_json::json!({ "argv": request }).to_string() + "\n";
    let mut buf = vec![0u8; 64 * 1024];
    // Ok(exit status) from the answer; Err(why the worker is unusable, timed out).
    let answer: Result<i32, (String, bool)> = match w
        .stdin
        .write_all(line.as_bytes())
        .and_then(|_| w.stdin.flush())
    {
        Err(e) => Err((format!("worker {pid} did not take the request: {e}"), false)),
        Ok(()) => loop {
            if let Some(a) = w.pump(&mut buf) {
                let code = serde_json::from_str::<serde_json::Value>(&a)
                    .ok()
                    .and_then(|v| v.get("exit")?.as_i64());
                break match code {
                    Some(c) => Ok(c as i32),
                    None => Err((format!("worker {pid} answered {a:?}, not {{\"exit\": N}} (docs/producers.md, \"Serving\")"), false)),
                };
            }
            if w.out.is_none() {
                break Err((format!("worker {pid} ended without answering"), false));
            }
            if start.elapsed() >= timeout {
                break Err((String::new(), true));
            }
        },
    };
    match answer {
        Ok(code) => {
            let cap = std::mem::take(&mut w.err_cap);
            let mut text = cap.text();
            if code != 0 {
                text.truncate(text.trim_end().len());
                text.push_str(&format!("\n[exit status {code}]"));
            }
            let ended = Ended {
                ok: code == 0,
                exit_code: Some(code),
                timed_out: false,
                peak_rss_kib: peak_rss_kib(w.pid),
                text,
                stderr_bytes: cap.total(),
                stdout: String::new(),
            };
            (ended, Some(pid))
        }
        Err((why, timed_out)) => {
            let Some(w) = guard.take() else {
                return (Ended::failed(why), Some(pid));
            };
            let (how, code, rss, cap) = w.end();
            let mut text = cap.text();
            text.truncate(text.trim_end().len());
            if !timed_out {
                text.push_str(&format!("\n[{why}; {how}; $ {}]", display(serve_argv)));
            }
            (
                Ended {
                    ok: false,
                    exit_code: if timed_out { None } else { code },
                    timed_out,
                    peak_rss_kib: rss,
                    text,
                    stderr_bytes: cap.total(),
                    stdout: String::new(),
                },
                Some(pid),
            )
        }
    }
}
