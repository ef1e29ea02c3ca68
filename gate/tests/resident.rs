//! Resident workers (docs/producers.md, "Resident workers"): the contract's worker outlives the
//! gate run that started it and serves the next one, never with stale code; idle ones leave; a
//! busy one is not waited for; `gate workers stop` ends them. Each test has a runtime directory
//! of its own and stops its workers when it ends, passed or failed (Env's Drop).
//!
//! Driven by `gate bisect --reference engine --candidate contract` on tiny-qwen3's short prompt:
//! one request to the contract's worker per run, a second of Python start-up when cold.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;

struct Env {
    tmp: tempfile::TempDir,
    /// The gate executable the commands run (a test may swap in a copy).
    exe: std::cell::RefCell<PathBuf>,
}

struct Run {
    report: Value,
    stderr: String,
}

impl Run {
    fn contract(&self) -> &Value {
        let runs = self.report["runs"].as_array().expect("runs");
        runs.iter()
            .find(|r| r["producer"] == "contract")
            .unwrap_or_else(|| panic!("no contract run in {runs:?}"))
    }
    fn pid(&self) -> u64 {
        self.contract()["served_by"]
            .as_u64()
            .unwrap_or_else(|| panic!("not served: {}\n{}", self.contract(), self.stderr))
    }
    fn resident(&self) -> Option<&str> {
        self.contract()["served_resident"].as_str()
    }
    /// The contract trace's content digest.
    fn digest(&self) -> String {
        let out = common::repo().join(self.contract()["out"].as_str().expect("out"));
        tracegate_trace::Trace::open(&out)
            .unwrap_or_else(|e| panic!("{}: {e}", out.display()))
            .digest()
            .hex()
    }
}

impl Env {
    fn new() -> Env {
        Env {
            tmp: tempfile::tempdir().expect("tempdir"),
            exe: std::cell::RefCell::new(env!("CARGO_BIN_EXE_gate").into()),
        }
    }

    fn runtime(&self) -> PathBuf {
        self.tmp.path().join("rt")
    }

    fn gate(&self, env: &[(&str, &str)]) -> Command {
        let mut cmd = Command::new(self.exe.borrow().as_path());
        cmd.current_dir(common::repo())
            .env("TRACEGATE_RESIDENT", "1")
            .env("TRACEGATE_RUNTIME_DIR", self.runtime());
        for k in [
            "TRACEGATE_RESIDENT_IDLE",
            "TRACEGATE_SERVE",
            "TRACEGATE_SERVE_WATCH",
            "TRACEGATE_SERVE_STALE_CHECK",
        ] {
            cmd.env_remove(k);
        }
        cmd.envs(env.iter().copied());
        cmd
    }

    /// `gate bisect` of the engine against the contract, its traces in `tag`.
    fn bisect_cmd(&self, tag: &str, env: &[(&str, &str)]) -> Command {
        let work = self.tmp.path().join(tag);
        self.bisect_cmd_in(&common::repo(), "fixtures/tiny-qwen3", &work, env)
    }

    /// `gate bisect` of `model` run from project root `root`, the engine against the contract,
    /// its traces in `work` (relative to `root` when relative).
    fn bisect_cmd_in(
        &self,
        root: &Path,
        model: &str,
        work: &Path,
        env: &[(&str, &str)],
    ) -> Command {
        let mut cmd = self.gate(env);
        cmd.current_dir(root)
            .args(["bisect", "--model", model, "--prompt", "short"])
            .args(["--reference", "engine", "--candidate", "contract", "--work"])
            .arg(work);
        cmd
    }

    fn bisect(&self, tag: &str, env: &[(&str, &str)]) -> Run {
        self.run_bisect(tag, self.bisect_cmd(tag, env))
    }

    /// Runs bisect command `cmd`, which must exit 0, its report at `tag`.json.
    fn run_bisect(&self, tag: &str, mut cmd: Command) -> Run {
        let report = self.tmp.path().join(format!("{tag}.json"));
        let out = cmd
            .arg("--report")
            .arg(&report)
            .output()
            .expect("gate runs");
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.status.code(), Some(0), "{tag}: {stderr}");
        let report = std::fs::read_to_string(&report).expect("report");
        let report: Value = serde_json::from_str(&report).expect("report JSON");
        common::assert_valid_bisect_report(&report);
        Run { report, stderr }
    }

    /// `gate workers [ARGS]`: its stdout (it must exit 0).
    fn workers(&self, args: &[&str]) -> String {
        let out = self
            .gate(&[])
            .arg("workers")
            .args(args)
            .output()
            .expect("gate workers runs");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert_eq!(
            out.status.code(),
            Some(0),
            "{stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        let _ = self.gate(&[]).args(["workers", "stop"]).output();
    }
}

/// Whether a process runs (a zombie has ended).
fn alive(pid: u64) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|s| s.rsplit(") ").next().is_some_and(|r| !r.starts_with('Z')))
}

#[test]
fn a_resident_worker_serves_the_next_run_with_the_traces_of_a_per_call_run() {
    let env = Env::new();
    let first = env.bisect("first", &[]);
    let second = env.bisect("second", &[]);
    assert_eq!(first.pid(), second.pid(), "{}", second.stderr);
    assert_eq!(
        (first.resident(), second.resident()),
        (Some("started"), Some("reused"))
    );
    let says = format!("contract worker {} reused (resident since", first.pid());
    assert!(second.stderr.contains(&says), "{}", second.stderr);
    let per_call = env.bisect("per-call", &[("TRACEGATE_SERVE", "0")]);
    assert!(per_call.contract().get("served_by").is_none());
    assert_eq!(first.digest(), per_call.digest());
    assert_eq!(second.digest(), per_call.digest());
    // Still there after the runs (the default idle time), listed with its command.
    let listed = env.workers(&[]);
    assert!(listed.starts_with("1 resident worker(s)"), "{listed}");
    assert!(
        listed.contains(&format!("worker {} (daemon", first.pid())),
        "{listed}"
    );
    assert!(listed.contains("-m tracegate_contract serve"), "{listed}");
    // Negative control: with residency off, each run has a worker of its own and no record.
    let off = [("TRACEGATE_RESIDENT", "0")];
    let (a, b) = (env.bisect("off-a", &off), env.bisect("off-b", &off));
    assert_ne!(a.pid(), b.pid());
    assert_eq!((a.resident(), b.resident()), (None, None));
    assert_eq!(a.digest(), per_call.digest());
}

/// The run's last stderr line that is not empty.
fn last_line(stderr: &str) -> &str {
    stderr
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("")
}

#[test]
fn the_runs_last_line_says_what_stays_resident_and_how_to_stop_it() {
    let env = Env::new();
    let started = env.bisect("first", &[("TRACEGATE_RESIDENT_IDLE", "300")]);
    let reused = env.bisect("second", &[("TRACEGATE_RESIDENT_IDLE", "300")]);
    for run in [&started, &reused] {
        let last = last_line(&run.stderr);
        let says = format!(
            "[gate] resident after this run: contract worker {} (",
            run.pid()
        );
        assert!(
            last.starts_with(&says),
            "last line {last:?} of\n{}",
            run.stderr
        );
        assert!(
            last.ends_with(" MB); they leave after 300 s idle; stop now: gate workers stop"),
            "{last:?}"
        );
        // Only one such line: printed once, at the end.
        assert_eq!(run.stderr.matches("resident after this run").count(), 1);
    }
    // Negative control: residency off, nothing stays and nothing is said.
    let off = env.bisect("off", &[("TRACEGATE_RESIDENT", "0")]);
    assert_eq!(off.resident(), None);
    assert!(
        !off.stderr.contains("resident after this run"),
        "{}",
        off.stderr
    );
    // Nor once the workers were stopped and a per-call run (no worker at all) follows.
    env.workers(&["stop"]);
    let per_call = env.bisect("per-call", &[("TRACEGATE_SERVE", "0")]);
    assert!(!per_call.stderr.contains("resident after this run"));
}

/// A second project root of the same installation: every top-level entry of the repository
/// (but target/ and .git) linked into `dir`, and `m2` there (only there) naming tiny-qwen3.
fn second_root(dir: &Path) {
    std::fs::create_dir_all(dir).expect("second root");
    for e in std::fs::read_dir(common::repo()).expect("repo").flatten() {
        let name = e.file_name();
        if name == "target" || name == ".git" {
            continue;
        }
        std::os::unix::fs::symlink(e.path(), dir.join(&name)).expect("link");
    }
    std::os::unix::fs::symlink(common::repo().join("fixtures/tiny-qwen3"), dir.join("m2"))
        .expect("m2");
}

#[test]
fn two_project_roots_of_one_installation_share_one_worker_and_each_request_runs_in_its_callers() {
    let env = Env::new();
    let python = std::fs::canonicalize(common::repo())
        .expect("repo")
        .join(".venv/bin/python");
    let python = python.to_str().expect("utf-8");
    let py = [("TRACEGATE_PYTHON", python)];
    let first = env.bisect("first", &py);
    assert_eq!(first.resident(), Some("started"), "{}", first.stderr);
    // From another project root, with paths that exist only relative to it: the model `m2`, and
    // the work directory `w` (the contract writes its trace there).
    let root2 = env.tmp.path().join("proj2");
    second_root(&root2);
    assert!(!common::repo().join("m2").exists());
    let second = env.run_bisect(
        "second",
        env.bisect_cmd_in(&root2, "m2", Path::new("w"), &py),
    );
    assert_eq!(second.resident(), Some("reused"), "{}", second.stderr);
    assert_eq!(second.pid(), first.pid(), "{}", second.stderr);
    let rel = second.contract()["out"].as_str().expect("out").to_string();
    assert!(rel.starts_with("w/") || rel.starts_with("./w/"), "{rel}");
    assert!(
        !common::repo().join(&rel).exists(),
        "written in the first root: {rel}"
    );
    let trace =
        tracegate_trace::Trace::open(root2.join(&rel)).unwrap_or_else(|e| panic!("{rel}: {e}"));
    // The same report as a per-run worker's, from that same root.
    let per_run_cmd = env.bisect_cmd_in(
        &root2,
        "m2",
        Path::new("w-per-run"),
        &[("TRACEGATE_RESIDENT", "0"), py[0]],
    );
    let per_run = env.run_bisect("per-run", per_run_cmd);
    assert_eq!(per_run.resident(), None);
    let per_run_trace =
        tracegate_trace::Trace::open(root2.join(per_run.contract()["out"].as_str().expect("out")))
            .expect("per-run trace");
    assert_eq!(trace.digest().hex(), per_run_trace.digest().hex());
    assert_eq!(first.digest(), per_run_trace.digest().hex());
    assert!(second.report["verdict"].is_string(), "{}", second.report);
    assert_eq!(second.report["verdict"], per_run.report["verdict"]);
    // Still one worker for both roots.
    let listed = env.workers(&[]);
    assert!(listed.starts_with("1 resident worker(s)"), "{listed}");
    // Negative control: another installation (the default Python, `.venv/bin/python` of each
    // root: another path) gets a worker of its own.
    let report = env.tmp.path().join("own.json");
    let out = env
        .gate(&[])
        .current_dir(&root2)
        .args([
            "bisect",
            "--model",
            "m2",
            "--prompt",
            "short",
            "--reference",
            "engine",
            "--candidate",
            "contract",
            "--work",
            "w-own",
            "--report",
        ])
        .arg(&report)
        .output()
        .expect("gate runs");
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let own: Value =
        serde_json::from_str(&std::fs::read_to_string(&report).expect("report")).expect("JSON");
    let own = Run {
        report: own,
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    };
    assert_eq!(own.resident(), Some("started"), "{}", own.stderr);
    assert_ne!(own.pid(), first.pid());
}

#[test]
fn over_the_memory_bound_the_least_recently_used_idle_worker_retires_and_a_held_one_never() {
    use std::os::fd::AsRawFd;
    let env = Env::new();
    let first = env.bisect("first", &[]);
    let wait_gone = |pid: u64| {
        let since = Instant::now();
        while alive(pid) && since.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(20));
        }
        !alive(pid)
    };
    // Negative control: another key (another TRACEGATE_* value) within the default bound keeps
    // the first worker.
    let other = env.bisect("other", &[("TRACEGATE_TEST_KEY", "b")]);
    assert_eq!(other.resident(), Some("started"));
    assert_ne!(other.pid(), first.pid());
    assert!(alive(first.pid()) && alive(other.pid()));
    assert!(!first.stderr.contains("retired"), "{}", first.stderr);
    assert!(!other.stderr.contains("retired"), "{}", other.stderr);
    env.workers(&["stop"]);
    assert!(wait_gone(first.pid()) && wait_gone(other.pid()));
    drop(env);

    // Held by another gate run (its lock taken here, as a run holds it): never retired, and a
    // run over the bound then starts its own per-run worker.
    let env = Env::new(); // a runtime directory with one lock file
    let first = env.bisect("first-again", &[]);
    let held = std::fs::File::open(lock_file(&env.runtime())).unwrap();
    // SAFETY: flock on a descriptor this test owns.
    assert_eq!(
        unsafe { libc::flock(held.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) },
        0
    );
    let tiny = [
        ("TRACEGATE_TEST_KEY", "b"),
        ("TRACEGATE_RESIDENT_MAX_MB", "1"),
    ];
    let over = env.bisect("over-held", &tiny);
    assert!(alive(first.pid()), "{}", over.stderr);
    assert!(!over.stderr.contains("retired"), "{}", over.stderr);
    assert_eq!(over.resident(), None, "{}", over.stderr);
    assert!(
        over.stderr.contains("over TRACEGATE_RESIDENT_MAX_MB=1, and other gate runs hold them; this run starts its own"),
        "{}",
        over.stderr
    );
    assert!(
        !over.stderr.contains("resident after this run"),
        "{}",
        over.stderr
    );
    drop(held);

    // Idle: a second key's run retires it (one line naming it), and its own worker, alone over
    // the bound, is not kept resident either.
    let second = env.bisect("second", &tiny);
    let says = format!("[gate] resident worker {} (", first.pid());
    let line = second
        .stderr
        .lines()
        .find(|l| l.starts_with(&says))
        .unwrap_or_else(|| panic!("no retirement of {}:\n{}", first.pid(), second.stderr));
    assert!(
        line.contains("retired: this user's resident workers used ")
            && line.contains("over TRACEGATE_RESIDENT_MAX_MB=1 (least recently used first)"),
        "{line}"
    );
    assert!(wait_gone(first.pid()), "{}", second.stderr);
    assert_eq!(second.resident(), Some("started"), "{}", second.stderr);
    let not_kept = format!("[gate] contract worker {} (", second.pid());
    assert!(
        second
            .stderr
            .lines()
            .any(|l| l.starts_with(&not_kept) && l.contains(") not kept resident: ")),
        "{}",
        second.stderr
    );
    assert!(wait_gone(second.pid()), "{}", second.stderr);
    assert!(
        !second.stderr.contains("resident after this run"),
        "{}",
        second.stderr
    );
    assert!(env.workers(&[]).starts_with("0 resident worker(s)"));
}

#[test]
fn a_worker_whose_tracegate_code_changed_is_replaced() {
    let env = Env::new();
    let watched = env.tmp.path().join("watched.py");
    std::fs::write(&watched, "x = 1\n").unwrap();
    let watch = watched.to_str().unwrap();
    let run_twice = |tag: &str, check: &str| {
        let env_vars = [
            ("TRACEGATE_SERVE_WATCH", watch),
            ("TRACEGATE_SERVE_STALE_CHECK", check),
        ];
        let before = env.bisect(&format!("{tag}-before"), &env_vars);
        std::fs::write(&watched, format!("x = 2  # {tag}\n")).unwrap();
        let after = env.bisect(&format!("{tag}-after"), &env_vars);
        (before, after)
    };
    let (before, after) = run_twice("checked", "1");
    assert_ne!(before.pid(), after.pid(), "{}", after.stderr);
    assert_eq!(after.resident(), Some("started"));
    assert!(
        after.stderr.contains("contract worker is stale (") && after.stderr.contains(watch),
        "{}",
        after.stderr
    );
    assert!(
        !alive(before.pid()),
        "the stale worker {} still runs",
        before.pid()
    );
    // Negative control: without the check the edited file goes unnoticed and the old worker
    // serves (so the assertion above fails whenever the check does not run).
    let (before, after) = run_twice("unchecked", "0");
    assert_eq!(before.pid(), after.pid(), "{}", after.stderr);
    assert_eq!(after.resident(), Some("reused"));
}

#[test]
fn an_idle_resident_worker_leaves() {
    let env = Env::new();
    let run = env.bisect("idle", &[("TRACEGATE_RESIDENT_IDLE", "1")]);
    let pid = run.pid();
    // Lifecycle, not performance: a generous bound.
    let since = Instant::now();
    while alive(pid) && since.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        !alive(pid),
        "worker {pid} still runs 30 s after 1 s of idle"
    );
    let listed = env.workers(&[]);
    assert!(listed.starts_with("0 resident worker(s)"), "{listed}");
    // The negative control is the first test: with the default idle time the worker stays.
}

fn lock_file(runtime: &Path) -> PathBuf {
    let locks: Vec<PathBuf> = std::fs::read_dir(runtime)
        .expect("runtime dir")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "lock"))
        .collect();
    assert_eq!(locks.len(), 1, "{locks:?}");
    locks[0].clone()
}

#[test]
fn a_busy_worker_is_not_waited_for_and_workers_stop_ends_them() {
    use std::os::fd::AsRawFd;
    let env = Env::new();
    let first = env.bisect("first", &[]);
    // Another gate run holds the worker (as one does for its whole run): this one starts its own.
    let held = std::fs::File::open(lock_file(&env.runtime())).unwrap();
    // SAFETY: flock on a descriptor this test owns.
    assert_eq!(
        unsafe { libc::flock(held.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) },
        0
    );
    let busy = env.bisect("busy", &[]);
    assert_ne!(busy.pid(), first.pid());
    assert_eq!(busy.resident(), None);
    let says = format!(
        "contract worker: the resident worker (pid {}) is busy with another gate run; this run starts its own",
        first.pid()
    );
    assert!(busy.stderr.contains(&says), "{}", busy.stderr);
    // Negative control: released, it serves again.
    drop(held);
    let again = env.bisect("again", &[]);
    assert_eq!(
        (again.pid(), again.resident()),
        (first.pid(), Some("reused"))
    );
    assert_eq!(
        env.workers(&["stop"]).trim(),
        "stopped 1 resident worker(s)"
    );
    assert!(!alive(first.pid()));
    assert!(env.workers(&[]).starts_with("0 resident worker(s)"));
    assert_eq!(
        env.workers(&["stop"]).trim(),
        "stopped 0 resident worker(s)"
    );
}

#[test]
fn a_client_that_leaves_mid_request_takes_the_request_with_it() {
    let env = Env::new();
    let mut gate = env
        .bisect_cmd("left", &[("TRACEGATE_SERVE_TEST_SLEEP", "120")])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("gate starts");
    // The runtime dir's log says when the request is in flight (the worker sleeps in it).
    let in_flight = |what: &str| {
        std::fs::read_dir(env.runtime()).ok().and_then(|d| {
            d.flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == "log"))
                .find_map(|p| std::fs::read_to_string(p).ok().filter(|t| t.contains(what)))
        })
    };
    let since = Instant::now();
    while in_flight("request: trace").is_none() && since.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let listed = env.workers(&[]);
    let pid: u64 = listed
        .split("worker ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no worker listed: {listed}"));
    assert!(in_flight("request: trace").is_some(), "{listed}");
    gate.kill().expect("kill the gate we started");
    let _ = gate.wait();
    while alive(pid) && since.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(50));
    }
    // Negative control: the first test's worker outlives the clients that leave between requests.
    assert!(
        !alive(pid),
        "worker {pid} still computes for a client that left"
    );
    // The daemon says so once it has ended the worker: after the worker is gone, not before,
    // so on a loaded machine the line may come a moment later (waited for, with a bound).
    let said = "the client left mid-request: the request was dropped";
    while in_flight(said).is_none() && since.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let log = in_flight("request: trace").unwrap_or_default();
    assert!(log.contains(said), "{log}");
}

/// Also the promise of docs/producers.md ("Resident workers", "Ending"): a request after which
/// the daemon leaves returns only once it has (bounded, then killed), so when the gate returns
/// neither the worker nor its daemon runs; asserted at once, no waiting.
#[test]
fn a_request_past_its_timeout_is_ended_with_the_workers_stderr_so_far() {
    let env = Env::new();
    // 10 s: time enough for the worker to start and say it sleeps on a loaded machine.
    let out = env
        .bisect_cmd("slow", &[("TRACEGATE_SERVE_TEST_SLEEP", "60")])
        .args(["--timeout", "10"])
        .output()
        .expect("gate runs");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    // The daemon ended the request at the deadline and quoted what the worker had written (the
    // client's own backstop, 5 s later, has no stderr to quote).
    assert!(
        stderr.contains(
            "candidate (contract) trace failed: serve: test sleep of 60 s before the request\n\
             [timed out after 10 s (--timeout); killed: $ "
        ),
        "{stderr}"
    );
    // The worker and its daemon are gone (pids from the daemon's log, which outlives it).
    let log = std::fs::read_dir(env.runtime())
        .expect("runtime dir")
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "log"))
        .and_then(|p| std::fs::read_to_string(p).ok())
        .unwrap_or_default();
    let pid_after = |what: &str| -> u64 {
        log.split(what)
            .nth(1)
            .and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok())
            .unwrap_or_else(|| panic!("no {what:?} in the log: {log}"))
    };
    let (daemon, worker) = (pid_after("started: daemon "), pid_after(", worker "));
    assert!(
        !alive(worker),
        "worker {worker} runs after the gate returned\n{log}"
    );
    assert!(
        !alive(daemon),
        "daemon {daemon} runs after the gate returned\n{log}"
    );
    assert!(env.workers(&[]).starts_with("0 resident worker(s)"));
    // Negative control: the quoted line comes from the slow request, not from every request.
    let quick = env.bisect("quick", &[]);
    assert!(!quick.stderr.contains("test sleep"), "{}", quick.stderr);
}

#[test]
fn a_worker_of_a_replaced_gate_executable_is_retired_by_the_next_one_started() {
    let env = Env::new();
    let first = env.bisect("first", &[]);
    // The same gate at another path: another executable (as after a rebuild), same purpose.
    let copy = env.tmp.path().join("gate-rebuilt");
    std::fs::copy(env!("CARGO_BIN_EXE_gate"), &copy).expect("copy the gate");
    *env.exe.borrow_mut() = copy;
    let second = env.bisect("second", &[]);
    assert_eq!(second.resident(), Some("started"));
    let says = format!(
        "contract worker {} retired: superseded by this one (the gate executable or the Python changed)",
        first.pid()
    );
    assert!(second.stderr.contains(&says), "{}", second.stderr);
    let since = Instant::now();
    while alive(first.pid()) && since.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!alive(first.pid()));
    // Negative control: a worker of another purpose (other environment) is not retired.
    let other = env.bisect("other", &[("TRACEGATE_SERVE_WATCH", "README.md")]);
    assert!(!other.stderr.contains("retired"), "{}", other.stderr);
    assert!(alive(second.pid()));
    assert!(env.workers(&[]).starts_with("2 resident worker(s)"));
}

/// The one record (`KEY.json`) of the runtime directory: its key and JSON.
fn the_record(runtime: &Path) -> (String, Value) {
    let records: Vec<PathBuf> = std::fs::read_dir(runtime)
        .expect("runtime dir")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    assert_eq!(records.len(), 1, "{records:?}");
    let key = records[0]
        .file_stem()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let json = serde_json::from_str(&std::fs::read_to_string(&records[0]).unwrap()).unwrap();
    (key, json)
}

/// Waits (lifecycle, not speed: `bound`) until `pid` has ended; whether it did.
fn ends_within(pid: u64, bound: Duration) -> bool {
    let since = Instant::now();
    while alive(pid) && since.elapsed() < bound {
        std::thread::sleep(Duration::from_millis(50));
    }
    !alive(pid)
}

/// Issue 33 item 9: a caller that gave the gate a pipe and waits for EOF on it gets EOF when the
/// gate exits, not when the resident daemon it started leaves (600 s idle by default).
#[test]
fn the_daemon_keeps_no_descriptor_the_gate_inherited() {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    use std::os::unix::process::CommandExt;
    let env = Env::new();
    let mut fds = [0i32; 2];
    // SAFETY: pipe2 fills two descriptors, both close-on-exec (no other test's child gets them).
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: pipe2 returned two fresh descriptors that nothing else owns.
    let (read_end, write_end) =
        unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    let w = write_end.as_raw_fd();
    let mut cmd = env.bisect_cmd("fds", &[]);
    // SAFETY: dup2 and fcntl are async-signal-safe; they give only the gate the write end, as
    // fd 9, not close-on-exec (as Python's pass_fds would).
    unsafe {
        cmd.pre_exec(move || {
            // dup2 onto itself would leave it close-on-exec.
            let r = if w == 9 {
                libc::fcntl(9, libc::F_SETFD, 0)
            } else {
                libc::dup2(w, 9)
            };
            if r == -1 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let out = cmd.output().expect("gate runs");
    drop(write_end);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The daemon outlives the gate (else EOF would prove nothing)...
    let listed = env.workers(&[]);
    assert!(listed.starts_with("1 resident worker(s)"), "{listed}");
    // ...and holds no copy of the write end: EOF, within a bound far below the idle time.
    let mut p = libc::pollfd {
        fd: read_end.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one live pollfd.
    let ready = unsafe { libc::poll(&mut p, 1, 60_000) };
    let mut byte = [0u8; 1];
    // SAFETY: reading one byte into a live buffer from a descriptor this test owns.
    let n = if ready > 0 {
        unsafe { libc::read(read_end.as_raw_fd(), byte.as_mut_ptr().cast(), 1) }
    } else {
        -1
    };
    assert_eq!(
        n, 0,
        "no EOF on the gate's inherited pipe 60 s after the gate exited: {listed}"
    );
}

/// A serving producer that misbehaves on stdout (issue 33 item 10): `serve` reads one request and
/// writes MODE's line, then sleeps (the gate must end it, not wait).
const HOSTILE_WORKER: &str = r#"
import sys, time
mode = sys.argv[1]
if sys.argv[2:3] != ["serve"]:
    sys.exit(3)
sys.stdin.readline()
out = sys.stdout.buffer
if mode == "over":  # 50 MiB without a newline, then one
    for _ in range(50):
        out.write(b"x" * (1 << 20))
    out.write(b"\n")
else:  # 60 KiB of garbage: within the bound, not an answer
    out.write(b"y" * (60 << 10) + b"\n")
out.flush()
time.sleep(600)
"#;

#[test]
fn a_workers_stdout_line_is_bounded() {
    let env = Env::new();
    let script = env.tmp.path().join("hostile_worker.py");
    std::fs::write(&script, HOSTILE_WORKER).unwrap();
    let python = common::repo().join(".venv/bin/python");
    let run = |mode: &str| {
        let template = format!(
            "'{}' '{}' {mode} {{verb|serve}} {{args}}",
            python.display(),
            script.display()
        );
        let out = env
            .gate(&[])
            .args([
                "bisect",
                "--model",
                "fixtures/tiny-qwen3",
                "--prompt",
                "short",
            ])
            .args([
                "--reference",
                "engine",
                "--candidate",
                "cmd",
                "--candidate-cmd",
                &template,
            ])
            .args(["--timeout", "120", "--work"])
            .arg(env.tmp.path().join(mode))
            .output()
            .expect("gate runs");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, stderr) = run("over");
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("wrote more than 65536 bytes on stdout without a newline"),
        "{}",
        &stderr[..stderr.len().min(4000)]
    );
    // Nothing of the 50 MiB is quoted.
    assert!(stderr.len() < 64 << 10, "{} bytes of stderr", stderr.len());
    // Negative control: a line within the bound is read whole, and refused as no answer (quoted
    // only in part).
    let (code, stderr) = run("under");
    assert_eq!(code, Some(2), "{stderr}");
    assert!(!stderr.contains("without a newline"), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "\"{}\"… (61440 bytes), not {{\"exit\": N}}",
            "y".repeat(200)
        )),
        "{stderr}"
    );
}

/// Issue 33 item 10: a client's request line is read up to MAX_REQUEST_LINE (16 MiB), not
/// buffered whole; the client is refused and dropped, the worker kept for the next gate run.
#[test]
fn an_overlong_request_line_is_refused_and_the_worker_kept() {
    use std::io::{BufRead, BufReader, Write};
    let env = Env::new();
    let first = env.bisect("first", &[]);
    let (key, record) = the_record(&env.runtime());
    let daemon = record["pid"].as_u64().expect("pid");
    let sock = env.runtime().join(format!("{key}.sock"));
    let stream = std::os::unix::net::UnixStream::connect(&sock).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut hello = String::new();
    reader.read_line(&mut hello).expect("hello");
    assert!(hello.contains(&format!("\"pid\":{daemon}")), "{hello}");
    // 300 MiB without a newline, as a hostile client sends it; the daemon may hang up midway.
    let mut w = stream.try_clone().unwrap();
    let chunk = vec![b'x'; 1 << 20];
    let sent = (0..300).take_while(|_| w.write_all(&chunk).is_ok()).count();
    let _ = stream.shutdown(std::net::Shutdown::Write);
    let mut answer = String::new();
    let _ = reader.read_line(&mut answer);
    assert!(
        answer.contains("request line over 16777216 bytes without a newline: refused"),
        "answer {answer:?} after {sent} MiB sent"
    );
    // Bounded: the daemon's peak resident set is far below the line (it held at most 16 MiB of it).
    let status = std::fs::read_to_string(format!("/proc/{daemon}/status")).expect("daemon runs");
    let hwm: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("VmHWM");
    assert!(hwm < 128 << 10, "daemon {daemon} peaked at {hwm} KiB");
    // The worker stays: the next gate run is served by it (the negative control of the refusal
    // being the client's alone).
    let again = env.bisect("again", &[]);
    assert_eq!(
        (again.pid(), again.resident()),
        (first.pid(), Some("reused")),
        "{}",
        again.stderr
    );
}

/// Issue 33 item 11: `gate workers stop` signals a record's pids only once they are its daemon
/// (`gate __resident-worker DIR KEY`, leading its group) and that daemon's worker; a planted or
/// stale record's other pids (here two `sleep`s, each leading its own group) survive, and the
/// output says why they were not signalled.
#[test]
fn workers_stop_signals_only_the_processes_it_verified() {
    use std::os::unix::process::CommandExt;
    let env = Env::new();
    use std::io::BufRead;
    let run = env.bisect("first", &[]);
    let (key, _) = the_record(&env.runtime());
    // Connected (and greeted), the daemon is past its record's update for the gate run that left
    // and will not rewrite it while this client stays: the tampering below is not undone.
    let client = std::os::unix::net::UnixStream::connect(env.runtime().join(format!("{key}.sock")))
        .expect("connect");
    client
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let mut hello = String::new();
    std::io::BufReader::new(&client)
        .read_line(&mut hello)
        .expect("hello");
    let (_, mut record) = the_record(&env.runtime());
    let daemon = record["pid"].as_u64().expect("pid");
    assert!(hello.contains(&format!("\"pid\":{daemon}")), "{hello}");
    let sleep = || {
        Command::new("sleep")
            .arg("300")
            .process_group(0)
            .spawn()
            .expect("sleep starts")
    };
    let (mut a, mut b, mut c) = (sleep(), sleep(), sleep());
    let write = |name: &str, v: &Value| {
        std::fs::write(env.runtime().join(format!("{name}.json")), v.to_string()).unwrap()
    };
    // A planted record under another key naming the live daemon and a sleep as its worker.
    let mut planted = record.clone();
    planted["worker_pid"] = a.id().into();
    write("00000000deadbeef", &planted);
    // One naming a sleep as its daemon.
    planted["pid"] = b.id().into();
    write("00000000feedf00d", &planted);
    // The daemon's own record, its worker pid replaced by a sleep's (stale, or tampered).
    record["worker_pid"] = c.id().into();
    write(&key, &record);
    let out = env.workers(&["stop"]);
    drop(client);
    let survived = [a.id(), b.id(), c.id()].map(|p| alive(p.into()));
    for s in [&mut a, &mut b, &mut c] {
        let _ = s.kill();
        let _ = s.wait();
    }
    assert_eq!(survived, [true; 3], "{out}");
    assert!(out.starts_with("stopped 1 resident worker(s)"), "{out}");
    for says in [
        format!("00000000deadbeef.json names daemon pid {daemon}, which is not that worker's daemon"),
        format!("00000000feedf00d.json names daemon pid {}, which is not that worker's daemon", b.id()),
        format!(
            "{key}.json names worker pid {}, which is not daemon {daemon}'s child leading its own process group: not signalled (the daemon was)",
            c.id()
        ),
    ] {
        assert!(out.contains(&says), "{says:?} not in:\n{out}");
    }
    // Negative control: what the record rightly named was signalled; its real worker, not
    // signalled, leaves at the EOF on its stdin.
    assert!(
        ends_within(daemon, Duration::from_secs(30)),
        "daemon {daemon} runs: {out}"
    );
    assert!(
        ends_within(run.pid(), Duration::from_secs(60)),
        "worker {} runs",
        run.pid()
    );
    assert!(env.workers(&[]).starts_with("0 resident worker(s)"));
}

/// Issue 51: a setting the gate cannot read is refused, exit 2, in one line naming the variable,
/// its value and what is accepted, before anything runs; never read as its default.
#[test]
fn a_bad_setting_is_refused_in_one_line_and_the_accepted_values_still_work() {
    let env = Env::new();
    for (name, value) in [
        ("TRACEGATE_RESIDENT", "off!"),
        ("TRACEGATE_RESIDENT", "disable"),
        ("TRACEGATE_RESIDENT", "n"),
        ("TRACEGATE_RESIDENT_IDLE", "2s"),
        ("TRACEGATE_RESIDENT_IDLE", "-1"),
        ("TRACEGATE_RESIDENT_MAX_MB", "0.5"),
        ("TRACEGATE_SERVE", "nope"),
        ("TRACEGATE_SERVE_STALE_CHECK", "disabled"),
        ("GITHUB_ACTIONS", "yes please"),
        ("TRACEGATE_TEXT_TIMEOUT", "60s"),
        ("TRACEGATE_TEXT_MAX_MB", "1GB"),
        ("TRACEGATE_FAULT_AT", "0"),
    ] {
        let out = env
            .bisect_cmd("refused", &[(name, value)])
            .output()
            .expect("gate runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{name}={value}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{name}={value}: {stderr}");
        assert!(
            stderr.starts_with(&format!(
                "gate: {name}={value:?} is not accepted: {name} takes "
            )),
            "{stderr}"
        );
        assert!(
            !env.tmp.path().join("refused").exists(),
            "{name}={value}: ran"
        );
    }
    for (name, value) in [
        ("TRACEGATE_RESIDENT", "0"),
        ("TRACEGATE_RESIDENT", "OFF"),
        ("TRACEGATE_SERVE", "0"),
        ("TRACEGATE_SERVE", "false"),
        ("TRACEGATE_RESIDENT_IDLE", "30"),
        ("TRACEGATE_RESIDENT_MAX_MB", "2048"),
        ("GITHUB_ACTIONS", "true"),
        ("GITHUB_ACTIONS", "false"),
    ] {
        let out = env
            .gate(&[(name, value)])
            .arg("workers")
            .output()
            .expect("gate workers runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{name}={value}: {stderr}");
    }
}
