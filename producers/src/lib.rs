//! Running producers. Every producer is a subprocess with a timeout: the contract, the oracle and
//! a user's engine through a command template that answers the two protocol verbs
//! (`docs/producers.md`), the engine as a child of the gate's own executable. Every run records
//! its exact invocation, seconds and peak RSS, and a crash or a hang is a result with the head
//! and tail of its stderr, never a dropped row or a dead gate.
//!
//! A crate of its own, below the gate: it depends on nothing of the gate's (the gate's milestone
//! runs and bisections use it; the gate's binary answers its hidden verbs ENGINE_CHILD and
//! RESIDENT_CHILD).
//!
//! This file: the producers, their command templates and one run's record. verb.rs: the
//! protocol's argument grammar (verbs, words, quoting, token ids); spawn.rs: a subprocess with
//! its bounded captures, timeout and peak RSS; engine_child.rs: the engine side of the gate's
//! own child; builtin.rs: the contract's and the oracle's default templates; serve.rs: one
//! serving worker process and its protocol; worker.rs: serving producers (one worker per gate
//! process, its own or a resident one), above serve.rs and resident.rs; resident.rs: resident
//! workers (one per session), above serve.rs; error.rs: the errors.

use std::path::Path;
use std::time::{Duration, Instant};

use serde::Serialize;

mod builtin;
mod engine_child;
mod error;
pub mod resident;
mod serve;
/// The gate's settings: parsed where every crate can read them (tracegate_trace::settings).
pub use tracegate_trace::settings;
mod spawn;
mod verb;
pub mod worker;

pub use builtin::*;
pub use engine_child::*;
pub use error::*;
pub use spawn::*;
pub use verb::*;

#[derive(Clone, Debug)]
pub enum Producer {
    /// The reference engine (linked into the gate; run as a child process, see `Producer::run`).
    Engine { threads: usize },
    /// A command template, split into words once (`Producer::command` checks it): `{verb}` is
    /// replaced by the verb, `{args}` by its arguments (appended when absent). Words are split
    /// on whitespace; single or double quotes group. `serve`: the index of the word
    /// `{verb|serve}` (the verb, and a declaration that `PREFIX serve` answers requests; see
    /// crate::worker), when the template has it. `shards_flag`: the flag its `trace` takes a
    /// sharded run's split by ([`SHARDS_FLAG`], the oracle's `--distributed`).
    Command {
        name: String,
        words: Vec<String>,
        serve: Option<usize>,
        shards_flag: &'static str,
    },
}

#[derive(Clone, Debug, Serialize)]
pub struct RunRecord {
    pub producer: String,
    pub verb: &'static str,
    /// The exact command line (for the engine: the equivalent `engine` CLI invocation, which the
    /// gate runs as a child of its own executable).
    pub invocation: String,
    pub ok: bool,
    pub exit_code: Option<i32>,
    /// Killed after `--timeout` seconds.
    pub timed_out: bool,
    pub seconds: f64,
    pub peak_rss_kib: Option<u64>,
    /// stderr (stdout when stderr is empty and the run failed), bounded: its first and last
    /// CAPTURE_HEAD / CAPTURE_TAIL bytes, with how many bytes between them were not kept; then,
    /// for a failed run, how it ended (`[exit status 3]`, `[killed by signal 6 (SIGABRT)]`).
    pub stderr: String,
    /// Bytes the producer wrote to stderr, all of them (`stderr` keeps at most head + tail).
    pub stderr_bytes: u64,
    pub out: String,
    /// The pid of the worker that answered this run (docs/producers.md, "Serving"); the
    /// invocation above is then the equivalent per-call command line.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub served_by: Option<u32>,
    /// For a resident worker (docs/producers.md, "Resident workers"): `started` by this gate
    /// run or `reused` from an earlier one; absent for a per-run worker.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub served_resident: Option<&'static str>,
}

impl RunRecord {
    /// One bounded message for a failed run: the head and tail of what it said.
    pub fn why(&self) -> String {
        let text = self.stderr.trim();
        if text.len() <= 2 * WHY_BYTES {
            return text.to_string();
        }
        let head = &text[..floor_char(text, WHY_BYTES)];
        let tail = &text[ceil_char(text, text.len() - WHY_BYTES)..];
        format!("{head} […] {tail}")
    }
}

/// Whether serving producers serve: TRACEGATE_SERVE unset or on (crate::settings).
fn serving() -> bool {
    settings::or_refuse(settings::switch("TRACEGATE_SERVE")) != Some(false)
}

fn floor_char(s: &str, mut i: usize) -> usize {
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

fn ceil_char(s: &str, mut i: usize) -> usize {
    while !s.is_char_boundary(i) {
        i += 1;
    }
    i
}

/// A failure message (check detail, refusal) keeps this much of each end of the capture.
const WHY_BYTES: usize = 1024;
/// Default `--timeout`: the slowest fixture run (the oracle, about 7 s) with a wide margin.
pub const DEFAULT_TIMEOUT_S: u64 = 300;

impl Producer {
    /// A subprocess producer, its template checked now rather than failing every run later.
    pub fn command(name: &str, template: &str) -> crate::error::Result<Producer> {
        let bad = |why: &str| {
            gerr!("{name} command template {template:?}: {why} (example: 'my-engine {{verb}} {{args}}'; docs/producers.md)")
        };
        let words = split_words(template).map_err(|e| bad(&e.to_string()))?;
        if words.is_empty() {
            return Err(bad("empty"));
        }
        let serve = words.iter().position(|w| w == SERVE_VERB);
        if words
            .iter()
            .any(|w| w.contains(SERVE_VERB) && w != SERVE_VERB)
            || words.iter().filter(|w| *w == SERVE_VERB).count() > 1
        {
            return Err(bad("{verb|serve} must be a word of its own, once"));
        }
        if serve.is_some_and(|i| {
            words[..i]
                .iter()
                .any(|w| w.contains("{verb}") || w.contains("{args}"))
        }) {
            return Err(bad(
                "the words before {verb|serve} start the worker and may not hold {verb} or {args}",
            ));
        }
        if serve.is_none() && !words.iter().any(|w| w.contains("{verb}")) {
            return Err(bad(
                "no {verb}: the producer would not be told which verb to run",
            ));
        }
        if words.iter().any(|w| w.contains("{args}") && w != "{args}") {
            return Err(bad("{args} must be a word of its own"));
        }
        Ok(Producer::Command {
            name: name.into(),
            words,
            serve,
            shards_flag: SHARDS_FLAG,
        })
    }

    /// The same producer taking a sharded run's split by `flag` (the oracle's `--distributed`).
    pub fn sharded_by(self, flag: &'static str) -> Producer {
        match self {
            Producer::Command {
                name, words, serve, ..
            } => Producer::Command {
                name,
                words,
                serve,
                shards_flag: flag,
            },
            engine => engine,
        }
    }

    pub fn name(&self) -> String {
        match self {
            Producer::Engine { .. } => "engine".into(),
            Producer::Command { name, .. } => name.clone(),
        }
    }

    pub fn argv(&self, verb: &Verb) -> Vec<String> {
        match self {
            Producer::Engine { threads } => {
                let mut a = vec!["engine".to_string(), verb.name().to_string()];
                a.extend(verb.args());
                a.extend(["--threads".into(), threads.to_string()]);
                a
            }
            Producer::Command {
                words, shards_flag, ..
            } => {
                let args = verb.args_with(shards_flag);
                let mut out = Vec::new();
                let mut placed = false;
                for w in words {
                    if w == "{args}" {
                        out.extend(args.iter().cloned());
                        placed = true;
                    } else if w == SERVE_VERB {
                        out.push(verb.name().to_string());
                    } else {
                        out.push(w.replace("{verb}", verb.name()));
                    }
                }
                if !placed {
                    out.extend(args);
                }
                out
            }
        }
    }

    /// The worker command line (`PREFIX serve`) of a template that declares `{verb|serve}`,
    /// unless TRACEGATE_SERVE is off (`0`, crate::settings) and asks for per-call runs.
    fn serve_argv(&self) -> Option<(usize, Vec<String>)> {
        match self {
            Producer::Command {
                words,
                serve: Some(i),
                ..
            } if serving() => {
                let mut a = words[..*i].to_vec();
                a.push("serve".into());
                Some((*i, a))
            }
            _ => None,
        }
    }

    /// Starts a serving producer's worker now (nothing for the others), so that its start-up
    /// overlaps what the gate does before the first request.
    pub fn prestart(&self, root: &Path) {
        if let Some((_, serve_argv)) = self.serve_argv() {
            crate::worker::prestart(&self.name(), root, &serve_argv);
        }
    }

    /// A request outside the two verbs (the oracle's `versions`) to this producer's worker;
    /// None when it does not serve. Err: why it failed, its stderr's last line last.
    pub fn ask_worker(
        &self,
        root: &Path,
        request: &[String],
        timeout: Duration,
    ) -> Option<crate::error::Result<()>> {
        let (_, serve_argv) = self.serve_argv()?;
        let (e, _) = crate::worker::request(&self.name(), root, &serve_argv, request, timeout);
        Some(match (e.ok, e.timed_out) {
            (true, _) => Ok(()),
            (false, true) => Err(gerr!(
                Producer:
                "timed out after {} s (--timeout) and was killed: $ {}",
                timeout.as_secs_f64(),
                display(&serve_argv)
            )),
            (false, false) => Err(crate::error::Error::Producer(e.text)),
        })
    }

    /// Runs `verb` with `root` as the working directory (paths in the verb are relative to it),
    /// killed after `timeout`. The engine runs as a child of the gate's own executable (the
    /// hidden verb ENGINE_CHILD), so an engine that aborts or hangs ends a run, not the gate.
    pub fn run(&self, root: &Path, verb: &Verb, timeout: Duration) -> RunRecord {
        let argv = self.argv(verb);
        let invocation = display(&argv);
        let start = Instant::now();
        let mut served = None;
        let spawned = match self {
            Producer::Engine { .. } => match std::env::current_exe() {
                Ok(exe) => {
                    let mut a = vec![exe.display().to_string(), ENGINE_CHILD.to_string()];
                    a.extend(argv.iter().cloned());
                    run_command(root, &a, timeout)
                }
                Err(e) => Ended::failed(format!(
                    "cannot find the gate's own executable to run the engine: {e}"
                )),
            },
            Producer::Command { .. } => match self.serve_argv() {
                Some((i, serve_argv)) => {
                    let (ended, by) = crate::worker::request(
                        &self.name(),
                        root,
                        &serve_argv,
                        &argv[i..],
                        timeout,
                    );
                    served = by;
                    ended
                }
                None => run_command(root, &argv, timeout),
            },
        };
        // A sharded run writes one trace per rank: every one of them.
        let missing = verb.outs().into_iter().find(|o| !root.join(o).is_file());
        let ok = spawned.ok && missing.is_none();
        let mut stderr = spawned.text;
        if let (true, Some(o)) = (spawned.ok, &missing) {
            stderr = format!("exited 0 but wrote no trace at {o}");
        }
        if spawned.timed_out {
            stderr = format!(
                "{}\n[timed out after {} s (--timeout); killed: $ {invocation}]",
                stderr.trim_end(),
                timeout.as_secs_f64()
            );
        }
        RunRecord {
            producer: self.name(),
            verb: verb.name(),
            invocation,
            ok,
            exit_code: spawned.exit_code,
            timed_out: spawned.timed_out,
            seconds: start.elapsed().as_secs_f64(),
            peak_rss_kib: spawned.peak_rss_kib,
            stderr,
            stderr_bytes: spawned.stderr_bytes,
            out: verb.out().to_string(),
            served_by: served.map(|s| s.pid),
            served_resident: served.and_then(|s| s.resident),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_serving_template_is_the_per_call_command_and_a_worker_command() {
        let p = Producer::command("c", "py -m x {verb|serve} {args} --threads 1").unwrap();
        let verb = Verb::Trace {
            model: "m".into(),
            tokens: vec![1],
            out: "o".into(),
            internals: false,
            generate: 0,
            cache: true,
            force: None,
            seed: None,
            shards: None,
        };
        assert_eq!(
            display(&p.argv(&verb)),
            "py -m x trace --model m --tokens 1 --out o --capture default --threads 1"
        );
        assert_eq!(
            p.serve_argv().map(|(i, a)| (i, display(&a))),
            Some((3, "py -m x serve".to_string()))
        );
        assert!(Producer::command("c", "py {verb} {args}")
            .unwrap()
            .serve_argv()
            .is_none());
        for bad in [
            "py x{verb|serve} {args}",
            "py {verb|serve} {verb|serve}",
            "py {args} {verb|serve}",
        ] {
            assert!(Producer::command("c", bad).is_err(), "{bad}");
        }
    }
}
