//! A subprocess run under a timeout: its own process group, bounded captures of its output,
//! its peak RSS, and how it ended.

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tracegate_trace::output::printable;

use crate::verb::display;

/// What a producer's output may cost the gate, per stream, in memory and in the report.
pub const CAPTURE_HEAD: usize = 8 * 1024;
pub const CAPTURE_TAIL: usize = 8 * 1024;
/// How long output is still read after the producer exited (from a child that left its
/// process group and kept the pipe open) before the gate stops listening.
pub(crate) const DRAIN_GRACE: Duration = Duration::from_secs(2);

/// The first CAPTURE_HEAD and last CAPTURE_TAIL bytes of a stream, and its total length.
#[derive(Default)]
pub struct Capture {
    head: Vec<u8>,
    tail: std::collections::VecDeque<u8>,
    total: u64,
}

impl Capture {
    pub fn push(&mut self, mut bytes: &[u8]) {
        self.total += bytes.len() as u64;
        let room = CAPTURE_HEAD - self.head.len();
        let n = room.min(bytes.len());
        self.head.extend_from_slice(&bytes[..n]);
        bytes = &bytes[n..];
        if bytes.len() >= CAPTURE_TAIL {
            self.tail.clear();
            bytes = &bytes[bytes.len() - CAPTURE_TAIL..];
        }
        let over = (self.tail.len() + bytes.len()).saturating_sub(CAPTURE_TAIL);
        self.tail.drain(..over);
        self.tail.extend(bytes);
    }

    pub fn total(&self) -> u64 {
        self.total
    }

    /// Kept bytes, at most CAPTURE_HEAD + CAPTURE_TAIL (plus the note of what was left out), as
    /// written: what is printed or reported of it goes through
    /// [`tracegate_trace::output::printable`] first (`Ended::text`).
    pub fn text(&self) -> String {
        let head = String::from_utf8_lossy(&self.head);
        let tail: Vec<u8> = self.tail.iter().copied().collect();
        let tail = String::from_utf8_lossy(&tail);
        let left_out = self.total - (self.head.len() + self.tail.len()) as u64;
        if left_out == 0 {
            format!("{head}{tail}")
        } else {
            format!(
                "{head}\n[… {left_out} of {} bytes not kept …]\n{tail}",
                self.total
            )
        }
    }
}

/// How a subprocess ended (also what a resident worker's daemon answers, as JSON).
#[derive(serde::Serialize, serde::Deserialize)]
pub(crate) struct Ended {
    pub(crate) ok: bool,
    pub(crate) exit_code: Option<i32>,
    pub(crate) timed_out: bool,
    pub(crate) peak_rss_kib: Option<u64>,
    /// stderr (or stdout, see RunRecord::stderr), with how it ended when it failed; its control
    /// characters escaped (`printable`), as everything built from it prints them.
    pub(crate) text: String,
    pub(crate) stderr_bytes: u64,
    pub(crate) stdout: String,
}

impl Ended {
    pub(crate) fn failed(why: String) -> Ended {
        Ended {
            ok: false,
            exit_code: None,
            timed_out: false,
            peak_rss_kib: None,
            text: why,
            stderr_bytes: 0,
            stdout: String::new(),
        }
    }
}

/// Runs a helper command (not a producer: e.g. the oracle's version probe) under the same
/// timeout and bounds; its stdout when it succeeds, else why not.
pub fn run_helper(root: &Path, argv: &[String], timeout: Duration) -> crate::error::Result<String> {
    let e = run_command(root, argv, timeout);
    match (e.ok, e.timed_out) {
        (true, _) => Ok(e.stdout),
        (false, true) => Err(crate::error::gerr!(
            Producer:
            "timed out after {} s (--timeout) and was killed: $ {}",
            timeout.as_secs_f64(),
            display(argv)
        )),
        (false, false) => Err(crate::error::Error::Producer(e.text)),
    }
}

fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGABRT => "SIGABRT",
        libc::SIGKILL => "SIGKILL",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGBUS => "SIGBUS",
        libc::SIGTERM => "SIGTERM",
        libc::SIGINT => "SIGINT",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGFPE => "SIGFPE",
        libc::SIGILL => "SIGILL",
        _ => "",
    }
}

/// A wait status as (ok, exit code, how it ended).
pub(crate) fn exit_text(status: libc::c_int) -> (bool, Option<i32>, String) {
    if libc::WIFEXITED(status) {
        let code = libc::WEXITSTATUS(status);
        (code == 0, Some(code), format!("exit status {code}"))
    } else if libc::WIFSIGNALED(status) {
        let sig = libc::WTERMSIG(status);
        let name = signal_name(sig);
        (
            false,
            None,
            if name.is_empty() {
                format!("killed by signal {sig}")
            } else {
                format!("killed by signal {sig} ({name})")
            },
        )
    } else {
        (false, None, "ended abnormally".to_string())
    }
}

/// Spawns the command in a process group of its own, reads its output into bounded captures
/// while it runs, and reaps it with wait4 for its peak RSS. At `timeout` the whole group is
/// killed. When it exits, what it left running in its group is killed too, and a pipe still
/// held open (by a child that left the group) is read for DRAIN_GRACE at most: a producer's
/// leftovers never block the gate.
pub(crate) fn run_command(root: &Path, argv: &[String], timeout: Duration) -> Ended {
    use std::os::fd::AsRawFd;
    let Some((prog, rest)) = argv.split_first() else {
        return Ended::failed("empty command template".into());
    };
    let mut cmd = Command::new(prog);
    cmd.args(rest)
        .current_dir(root)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    tracegate_trace::child::in_own_group(&mut cmd);
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            // The template runs in the project root, not where the gate was started: a relative
            // program path is the usual reason it is not found.
            let hint = if e.kind() == std::io::ErrorKind::NotFound && !prog.starts_with('/') {
                let at = std::fs::canonicalize(root).unwrap_or_else(|_| root.to_path_buf());
                format!(
                    " (command templates run in the project root {}: a relative path is taken from there; give an absolute one, or a program on PATH)",
                    at.display()
                )
            } else {
                String::new()
            };
            return Ended::failed(format!("could not start {prog:?}: {e}{hint}"));
        }
    };
    let pid = child.id() as libc::pid_t;
    let as_file = |fd: Option<std::os::fd::OwnedFd>| fd.map(std::fs::File::from);
    // [stdout, stderr]; None once closed or abandoned.
    let mut pipes = [
        as_file(child.stdout.take().map(Into::into)),
        as_file(child.stderr.take().map(Into::into)),
    ];
    for f in pipes.iter().flatten() {
        // SAFETY: fcntl on descriptors this function owns.
        unsafe {
            let flags = libc::fcntl(f.as_raw_fd(), libc::F_GETFL);
            libc::fcntl(f.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK);
        }
    }
    let mut caps = [Capture::default(), Capture::default()];
    let start = Instant::now();
    let mut status: libc::c_int = 0;
    // SAFETY: rusage is a plain out-parameter.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let mut ended: Option<Instant> = None;
    let mut timed_out = false;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let open: Vec<usize> = (0..2).filter(|&i| pipes[i].is_some()).collect();
        if open.is_empty() && ended.is_some() {
            break;
        }
        if open.is_empty() {
            std::thread::sleep(Duration::from_millis(5));
        } else {
            let mut pfds: Vec<libc::pollfd> = open
                .iter()
                .map(|&i| libc::pollfd {
                    fd: pipes[i].as_ref().map_or(-1, |f| f.as_raw_fd()),
                    events: libc::POLLIN,
                    revents: 0,
                })
                .collect();
            // SAFETY: pfds is a live array of pollfd of the given length.
            unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, 20) };
            for (&i, p) in open.iter().zip(&pfds) {
                if p.revents == 0 {
                    continue;
                }
                // One read per round, so an endless writer cannot keep the loop from the clock.
                let Some(f) = pipes[i].as_mut() else { continue };
                match f.read(&mut buf) {
                    Ok(0) => pipes[i] = None,
                    Ok(n) => caps[i].push(&buf[..n]),
                    Err(e)
                        if matches!(
                            e.kind(),
                            std::io::ErrorKind::Interrupted | std::io::ErrorKind::WouldBlock
                        ) => {}
                    Err(_) => pipes[i] = None,
                }
            }
        }
        match ended {
            Some(at) if at.elapsed() >= DRAIN_GRACE => break,
            Some(_) => {}
            None => {
                // Exited, not yet reaped: while the leader is a zombie its pid (the group's id)
                // cannot be reused, so killing the group cannot hit a stranger.
                // SAFETY: waitid on our own child; info is an out-parameter.
                let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
                let rc = unsafe {
                    libc::waitid(
                        libc::P_PID,
                        pid as libc::id_t,
                        &mut info,
                        libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
                    )
                };
                let exited = rc == 0 && unsafe { info.si_pid() } == pid;
                if rc == -1
                    && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted
                {
                    return Ended::failed(format!(
                        "waitid failed: {}",
                        std::io::Error::last_os_error()
                    ));
                }
                let over = !exited && start.elapsed() >= timeout;
                if exited || over {
                    // SAFETY: signals the group this child leads (kept alive as a zombie, see
                    // above); then reaps it with wait4 for its status and peak RSS.
                    unsafe { libc::kill(-pid, libc::SIGKILL) };
                    while unsafe { libc::wait4(pid, &mut status, 0, &mut usage) } == -1
                        && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted
                    {
                    }
                    timed_out = over;
                    ended = Some(Instant::now());
                }
            }
        }
    }
    // `child` was reaped above; dropping it neither waits nor kills.
    drop(child);
    let [out, err] = caps;
    let (ok, code, how) = if timed_out {
        (false, None, String::new())
    } else {
        exit_text(status)
    };
    let stdout = out.text();
    let mut text = err.text();
    if !ok {
        if text.trim().is_empty() {
            text = stdout.clone();
        }
        if !how.is_empty() {
            text.truncate(text.trim_end().len());
            text.push_str(&format!("\n[{how}]"));
        }
    }
    Ended {
        ok,
        exit_code: code,
        timed_out,
        peak_rss_kib: Some(usage.ru_maxrss as u64),
        // What the gate prints and reports of it: never the producer's control sequences.
        text: printable(&text).into_owned(),
        stderr_bytes: err.total(),
        stdout,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_capture_keeps_its_head_and_tail_whatever_is_pushed() {
        let mut c = Capture::default();
        c.push(b"FIRST\n");
        for _ in 0..5_000 {
            c.push(&[b'x'; 10_000]);
        }
        c.push(b"\nLAST\n");
        assert_eq!(c.total(), 6 + 50_000_000 + 6);
        assert_eq!(c.head.len() + c.tail.len(), CAPTURE_HEAD + CAPTURE_TAIL);
        let text = c.text();
        assert!(
            text.starts_with("FIRST\n") && text.ends_with("\nLAST\n"),
            "{}",
            &text[..64]
        );
        assert!(text.contains(&format!(
            "[… {} of 50000012 bytes not kept …]",
            50_000_012 - CAPTURE_HEAD - CAPTURE_TAIL
        )));
        // Under the bound, everything is kept, in order.
        let mut small = Capture::default();
        small.push(b"one ");
        small.push(&[b'y'; CAPTURE_HEAD]);
        small.push(b" two");
        assert_eq!(
            small.text(),
            format!("one {} two", "y".repeat(CAPTURE_HEAD))
        );
    }
}
