//! Progress of a long run on stderr (`gate m0|m1|run|check`, `gate bisect`): on a terminal an
//! indicatif bar under the lines of the steps done; otherwise (CI, a pipe, a file) only those
//! lines, one per step, `[PREFIX] STEP`, so a log shows how far a run got without a bar's
//! control codes. Never stdout: the text output and the JSON and HTML reports are the same with
//! and without a terminal.
//!
//! One run at a time per process, held in a process-wide slot, so a step deep inside a bisection
//! (a layer isolated, a calibration layer, a decode step) is one line at its call site instead of
//! a parameter threaded through every function on the way. `start` returns a guard; the bar is
//! cleared when it drops, on every return path (`?` included). Steps with no run started print
//! nothing (library callers and unit tests).

use std::io::IsTerminal;
use std::sync::Mutex;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

struct Run {
    prefix: String,
    /// None when stderr is not a terminal: steps are plain lines.
    bar: Option<ProgressBar>,
}

static RUN: Mutex<Option<Run>> = Mutex::new(None);

fn with<R>(f: impl FnOnce(&mut Option<Run>) -> R) -> R {
    f(&mut RUN.lock().unwrap_or_else(|p| p.into_inner()))
}

/// Clears the bar when the run ends (dropped).
#[must_use = "the run's progress ends when the guard drops"]
pub struct Guard(());

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(Run { bar: Some(bar), .. }) = with(Option::take) {
            bar.finish_and_clear();
        }
    }
}

/// Starts a run's progress, `planned` steps known so far (more may be added by `plan`).
pub fn start(prefix: impl Into<String>, planned: u64) -> Guard {
    let prefix = prefix.into();
    let bar = std::io::stderr().is_terminal().then(|| {
        let bar = ProgressBar::with_draw_target(Some(planned), ProgressDrawTarget::stderr());
        bar.set_style(
            ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} {msg} ({elapsed})")
                .expect("static template")
                .progress_chars("=> "),
        );
        bar.set_prefix(prefix.clone());
        // The elapsed time moves while a producer runs, so a slow step never looks hung.
        bar.enable_steady_tick(Duration::from_millis(200));
        bar
    });
    with(|run| *run = Some(Run { prefix, bar }));
    Guard(())
}

/// `n` more steps to come (a bisection learns how many layers it isolates as it goes).
pub fn plan(n: u64) {
    with(|run| {
        if let Some(Run { bar: Some(bar), .. }) = run {
            bar.inc_length(n);
        }
    });
}

/// What is running now: the bar's message on a terminal, nothing otherwise (the step's line
/// says it when it is done).
pub fn doing(what: impl Into<String>) {
    let what = what.into();
    with(|run| {
        if let Some(Run { bar: Some(bar), .. }) = run {
            bar.set_message(what);
        }
    });
}

/// One step done: its line (kept above the bar on a terminal) and the bar one further.
pub fn step(line: impl std::fmt::Display) {
    with(|run| match run {
        Some(Run {
            bar: Some(bar),
            prefix,
        }) => {
            bar.println(format!("[{prefix}] {line}"));
            // A step nobody planned (a phase that learns its size late) grows the bar.
            if bar.length().is_some_and(|len| bar.position() >= len) {
                bar.inc_length(1);
            }
            bar.inc(1);
        }
        Some(Run { bar: None, prefix }) => eprintln!("[{prefix}] {line}"),
        None => {}
    });
}
