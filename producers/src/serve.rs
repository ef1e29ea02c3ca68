//! One serving worker (docs/producers.md, "Serving"): the process a `PREFIX serve` command
//! starts, and the protocol spoken with it, the Rust side of tracegate.serve: a request line on
//! its stdin (`request_line`), an answer line on its stdout (`Worker::ask`, `Answer`), its stderr
//! kept per request, and what a per-call run would have ended with (`ended`).
//!
//! Below both owners of a worker, and importing neither: worker.rs (a gate process's workers,
//! one per command) and resident.rs (a resident daemon owns one exactly as a gate process does).

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use tracegate_trace::output::printable;

use crate::spawn::{exit_text, Capture, Ended};
use crate::verb::display;

pub(crate) struct Worker {
    child: Child,
    pub(crate) pid: libc::pid_t,
    /// None once closed ([`Worker::close_stdin`]): the worker's cue to leave.
    stdin: Option<ChildStdin>,
    out: Option<std::fs::File>,
    err: Option<std::fs::File>,
    /// Bytes of stdout after the last complete answer line (at most MAX_ANSWER_LINE).
    line: Vec<u8>,
    /// How many bytes of `line` are known to hold no newline: each read scans only what it added.
    scanned: usize,
    /// Set once stdout held more than MAX_ANSWER_LINE bytes without a newline (the worker is
    /// then broken: its stdout is no longer read).
    overlong: Option<String>,
    /// stderr since the previous answer (a fresh worker's start-up output goes to its first request).
    err_cap: Capture,
    /// The working directory of the next request (a resident worker serves gate runs of several
    /// project roots: each request runs in its caller's, docs/producers.md "Resident workers").
    pub(crate) cwd: Option<String>,
}

fn nonblocking(f: &std::fs::File) {
    // SAFETY: fcntl on a descriptor the worker owns.
    unsafe {
        let flags = libc::fcntl(f.as_raw_fd(), libc::F_GETFL);
        libc::fcntl(f.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK);
    }
}

impl Worker {
    pub(crate) fn spawn(root: &Path, argv: &[String]) -> crate::error::Result<Worker> {
        use std::os::unix::process::CommandExt;
        let (prog, rest) = argv
            .split_first()
            .ok_or_else(|| crate::error::gerr!("empty worker command"))?;
        let mut child = Command::new(prog)
            .args(rest)
            .current_dir(root)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .spawn()
            .map_err(|e| crate::error::gerr!(Producer: "could not start {prog:?}: {e}"))?;
        let as_file = |fd: Option<std::os::fd::OwnedFd>| fd.map(std::fs::File::from);
        let out = as_file(child.stdout.take().map(Into::into));
        let err = as_file(child.stderr.take().map(Into::into));
        out.iter().chain(err.iter()).for_each(nonblocking);
        let stdin = child
            .stdin
            .take()
            .ok_or_else(|| crate::error::gerr!(Producer: "worker has no stdin"))?;
        Ok(Worker {
            pid: child.id() as libc::pid_t,
            child,
            stdin: Some(stdin),
            out,
            err,
            line: Vec::new(),
            scanned: 0,
            overlong: None,
            err_cap: Capture::default(),
            cwd: None,
        })
    }

    /// Reads what is there (waiting at most 20 ms); Some(answer line) once one is complete.
    pub(crate) fn pump(&mut self, buf: &mut [u8]) -> Option<String> {
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
        // Only the bytes this call added are scanned: a long line costs its length once.
        let nl = self.line[self.scanned..]
            .iter()
            .position(|&b| b == b'\n')
            .map(|at| self.scanned + at);
        match nl {
            Some(nl) if nl <= MAX_ANSWER_LINE => {
                let line: Vec<u8> = self.line.drain(..=nl).collect();
                self.scanned = 0;
                Some(String::from_utf8_lossy(&line).trim().to_string())
            }
            None if self.line.len() <= MAX_ANSWER_LINE => {
                self.scanned = self.line.len();
                None
            }
            _ => {
                if self.overlong.is_none() {
                    self.overlong = Some(format!(
                        "worker {} wrote more than {MAX_ANSWER_LINE} bytes on stdout without a newline \
                         (an answer is one line of at most {MAX_ANSWER_LINE} bytes; docs/producers.md, \"Serving\")",
                        self.pid
                    ));
                }
                // Not read again: whoever sees `overlong` ends the worker.
                self.out = None;
                self.line = Vec::new();
                self.scanned = 0;
                None
            }
        }
    }

    /// Sends one request and waits for its answer (or `deadline`, or `cancelled()`, polled
    /// every 20 ms). The worker's stderr meanwhile goes to `err_cap`.
    pub(crate) fn ask(
        &mut self,
        request: &[String],
        deadline: Option<Instant>,
        cancelled: &mut dyn FnMut() -> bool,
    ) -> Answer {
        let pid = self.pid;
        let line = request_line(request, None, self.cwd.as_deref());
        let mut buf = vec![0u8; 64 * 1024];
        let Some(stdin) = self.stdin.as_mut() else {
            return Answer::Broken(format!(
                "worker {pid} was asked to leave (its stdin closed)"
            ));
        };
        if let Err(e) = stdin.write_all(line.as_bytes()).and_then(|_| stdin.flush()) {
            return Answer::Broken(format!("worker {pid} did not take the request: {e}"));
        }
        loop {
            if let Some(a) = self.pump(&mut buf) {
                let v = serde_json::from_str::<serde_json::Value>(&a).ok();
                if let Some(c) = v.as_ref().and_then(|v| v.get("exit")?.as_i64()) {
                    return Answer::Exit(c as i32);
                }
                if let Some(why) = v.as_ref().and_then(|v| v.get("stale")?.as_str()) {
                    return Answer::Stale(why.to_string());
                }
                return Answer::Broken(format!(
                    "worker {pid} answered {}, not {{\"exit\": N}} (docs/producers.md, \"Serving\")",
                    quoted_start(&a)
                ));
            }
            if let Some(why) = self.overlong.take() {
                return Answer::Broken(why);
            }
            if self.out.is_none() {
                return Answer::Broken(format!("worker {pid} ended without answering"));
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Answer::TimedOut;
            }
            if cancelled() {
                return Answer::Cancelled;
            }
        }
    }

    /// Reads what the worker wrote while no request ran (kept for the next request); false once
    /// it closed its stdout (it ended) or wrote more than MAX_ANSWER_LINE bytes without a newline
    /// (`overlong` says so).
    pub(crate) fn idle(&mut self, buf: &mut [u8]) -> bool {
        let _ = self.pump(buf);
        self.out.is_some()
    }

    /// Why the worker's stdout stopped being read, when it broke the line bound.
    pub(crate) fn overlong(&self) -> Option<&str> {
        self.overlong.as_deref()
    }

    /// Closes the worker's stdin: EOF asks it to leave (tracegate.serve returns, exit 0).
    pub(crate) fn close_stdin(&mut self) {
        self.stdin = None;
    }

    /// Waits until the worker has left (after [`Worker::close_stdin`]), or until `deadline`,
    /// reading (and dropping) what it writes meanwhile so a full pipe cannot hold it; then
    /// [`Worker::end`]: its group is killed — the worker itself if it is still there, and
    /// whatever it left running in its group — and it is reaped. When this returns, no process
    /// of the worker's group runs. True when the worker left by itself.
    pub(crate) fn leave(mut self, deadline: Instant) -> bool {
        let mut buf = vec![0u8; 64 * 1024];
        let left = loop {
            // Exited, not yet reaped (WNOWAIT): its pid, the group's id, is not reused until
            // `end` reaps it, so the group can still be killed safely.
            // SAFETY: waitid on our own child; info is an out-parameter.
            let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
            let rc = unsafe {
                libc::waitid(
                    libc::P_PID,
                    self.pid as libc::id_t,
                    &mut info,
                    libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
                )
            };
            if rc == 0 && unsafe { info.si_pid() } == self.pid {
                break true;
            }
            if rc == -1 && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted
            {
                break false;
            }
            if Instant::now() >= deadline {
                break false;
            }
            // Waits up to 20 ms for output (or sleeps that long once both pipes closed).
            let _ = self.pump(&mut buf);
        };
        // The group killed while its leader is still ours to reap; then until what it left
        // running is gone (a SIGKILL is sent, not yet acted on, when kill returns).
        // SAFETY: the leader is our unreaped child, so its pid (the group id) is not reused.
        unsafe { libc::kill(-self.pid, libc::SIGKILL) };
        let gone_by = Instant::now() + GROUP_GONE_WAIT;
        while group_running(self.pid, self.pid) && Instant::now() < gone_by {
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = self.end();
        left
    }

    /// Kills the group, reads the rest of stderr (DRAIN_GRACE at most), reaps the leader: how it
    /// ended, and its peak RSS.
    pub(crate) fn end(mut self) -> (String, Option<i32>, Option<u64>, Capture) {
        // SAFETY: the leader is our unreaped child, so its pid (the group id) is not reused.
        unsafe { libc::kill(-self.pid, libc::SIGKILL) };
        let start = Instant::now();
        let mut buf = vec![0u8; 64 * 1024];
        self.out = None;
        while self.err.is_some() && start.elapsed() < crate::spawn::DRAIN_GRACE {
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

/// How long [`Worker::leave`] waits for the processes of a killed group to be gone.
const GROUP_GONE_WAIT: Duration = Duration::from_secs(2);

/// Whether a process of group `pgid` other than `leader` runs (is not a zombie), from /proc.
fn group_running(pgid: libc::pid_t, leader: libc::pid_t) -> bool {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return false;
    };
    dir.flatten().any(|e| {
        let Some(pid) = e
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<libc::pid_t>().ok())
        else {
            return false;
        };
        if pid == leader {
            return false;
        }
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            return false;
        };
        // After the command's closing parenthesis: state, ppid, pgrp.
        let mut rest = stat
            .rsplit_once(')')
            .map_or("", |(_, r)| r)
            .split_whitespace();
        let (state, _ppid, pgrp) = (rest.next(), rest.next(), rest.next());
        state != Some("Z") && pgrp.and_then(|g| g.parse().ok()) == Some(pgid)
    })
}

/// `s` quoted, cut after its first 200 characters (an answer line may be up to MAX_ANSWER_LINE).
fn quoted_start(s: &str) -> String {
    match s.char_indices().nth(200) {
        Some((at, _)) => format!("{:?}… ({} bytes)", &s[..at], s.len()),
        None => format!("{s:?}"),
    }
}

/// The longest answer line a worker may write (an answer is `{"exit": N}` or `{"stale": WHY}`):
/// more without a newline is a broken worker, not a buffer that grows without bound.
pub(crate) const MAX_ANSWER_LINE: usize = 64 * 1024;

/// A request as its line on the worker's stdin, `{"argv": [VERB, ARG, …]}` (docs/producers.md,
/// "Serving"), or on a resident daemon's socket, which also takes the time left until the run's
/// timeout: `{"argv": […], "timeout_ms": N}` (`resident.rs`).
/// A request of a resident worker also carries its caller's working directory, `"cwd": ABS`
/// (the worker runs it there).
pub(crate) fn request_line(
    request: &[String],
    timeout: Option<std::time::Duration>,
    cwd: Option<&str>,
) -> String {
    let mut line = serde_json::json!({ "argv": request });
    if let Some(t) = timeout {
        line["timeout_ms"] = u64::try_from(t.as_millis()).unwrap_or(u64::MAX).into();
    }
    if let Some(cwd) = cwd {
        line["cwd"] = cwd.into();
    }
    line.to_string() + "\n"
}

/// The KiB figure of `field` (e.g. `VmHWM`, `VmRSS`) in /proc/`pid`/status.
pub(crate) fn proc_status_kib(pid: libc::pid_t, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status
        .lines()
        .find(|l| l.strip_prefix(field).is_some_and(|r| r.starts_with(':')))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// The worker's peak RSS so far (VmHWM), as a per-call run reports its own.
pub(crate) fn peak_rss_kib(pid: libc::pid_t) -> Option<u64> {
    proc_status_kib(pid, "VmHWM")
}

/// How a request to a worker went.
pub(crate) enum Answer {
    Exit(i32),
    /// The worker's code changed since it imported it (tracegate.serve); it has left.
    Stale(String),
    /// Unusable: ended, or broke the protocol.
    Broken(String),
    TimedOut,
    /// Whoever asked went away (a resident worker's client).
    Cancelled,
}

/// What a per-call run would have ended with, from a worker's answer. A worker that did not
/// answer `{"exit": N}` is ended (its group killed) and taken from `slot`.
pub(crate) fn ended(slot: &mut Option<Worker>, answer: Answer, serve_argv: &[String]) -> Ended {
    let Some(w) = slot.as_mut() else {
        return Ended::failed("no worker".into());
    };
    let (why, timed_out) = match answer {
        Answer::Exit(code) => {
            let cap = std::mem::take(&mut w.err_cap);
            let mut text = printable(&cap.text()).into_owned();
            if code != 0 {
                text.truncate(text.trim_end().len());
                text.push_str(&format!("\n[exit status {code}]"));
            }
            return Ended {
                ok: code == 0,
                exit_code: Some(code),
                timed_out: false,
                peak_rss_kib: peak_rss_kib(w.pid),
                text,
                stderr_bytes: cap.total(),
                stdout: String::new(),
            };
        }
        Answer::TimedOut => (String::new(), true),
        Answer::Broken(why) => (why, false),
        Answer::Stale(why) => (why, false),
        Answer::Cancelled => ("the request was cancelled".into(), false),
    };
    let Some(w) = slot.take() else {
        return Ended::failed(why);
    };
    let (how, code, rss, cap) = w.end();
    let mut text = printable(&cap.text()).into_owned();
    text.truncate(text.trim_end().len());
    if !timed_out {
        text.push_str(&format!("\n[{why}; {how}; $ {}]", display(serve_argv)));
    }
    Ended {
        ok: false,
        exit_code: if timed_out { None } else { code },
        timed_out,
        peak_rss_kib: rss,
        text,
        stderr_bytes: cap.total(),
        stdout: String::new(),
    }
}

/// Which worker answered a run: its pid, and for a resident one whether this gate run started
/// it or found it running (docs/producers.md, "Resident workers").
#[derive(Clone, Copy, Debug)]
pub struct Served {
    pub pid: u32,
    pub resident: Option<&'static str>,
}
