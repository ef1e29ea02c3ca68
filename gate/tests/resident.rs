//! Resident workers (docs/producers.md, "Resident workers"): the contract's worker outlives the
//! gate run that started it and serves the next one, never with stale code; idle ones leave; a
//! busy one is not waited for; `gate workers stop` ends them. Each test has a runtime directory
//! of its own and stops its workers when it ends, passed or failed (Env's Drop).
//!
//! Driven by `gate bisect --reference engine --candidate contract` on tiny-qwen3's short prompt:
//! one request to the contract's worker per run, a second of Python start-up when cold.

mod common;

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
        let mut cmd = self.gate(env);
        cmd.args([
            "bisect",
            "--model",
            "fixtures/tiny-qwen3",
            "--prompt",
            "short",
            "--reference",
            "engine",
            "--candidate",
            "contract",
            "--work",
        ])
        .arg(self.tmp.path().join(tag));
        cmd
    }

    fn bisect(&self, tag: &str, env: &[(&str, &str)]) -> Run {
        let report = self.tmp.path().join(format!("{tag}.json"));
        let out = self
            .bisect_cmd(tag, env)
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
    let log = in_flight("request: trace").unwrap_or_default();
    assert!(
        log.contains("the client left mid-request: the request was dropped"),
        "{log}"
    );
}

#[test]
fn a_request_past_its_timeout_is_ended_with_the_workers_stderr_so_far() {
    let env = Env::new();
    let out = env
        .bisect_cmd("slow", &[("TRACEGATE_SERVE_TEST_SLEEP", "60")])
        .args(["--timeout", "4"])
        .output()
        .expect("gate runs");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    // The daemon ended the request at the deadline and quoted what the worker had written (the
    // client's own backstop, 5 s later, has no stderr to quote).
    assert!(
        stderr.contains(
            "candidate (contract) trace failed: serve: test sleep of 60 s before the request\n\
             [timed out after 4 s (--timeout); killed: $ "
        ),
        "{stderr}"
    );
    // The worker and its daemon are gone.
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
