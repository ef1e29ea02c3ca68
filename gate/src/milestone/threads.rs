//! A port whose runs are far slower than they should be: a hint to pin its BLAS threads
//! (docs/producers.md, "Threads"). The gate runs a port's producers at once (candidate cached
//! and uncached; blessing, the reference and the noise run too), and a numerical library that
//! starts one thread per core in each process oversubscribes the machine. The gate knows each
//! run's seconds (the report's `runs[].seconds`): a candidate run many times the reference's
//! on the same prompt, or of many seconds per position, gets one line saying what to set and
//! where. A hint, never a check: it changes no verdict and no exit code.

use crate::milestone::run::{MilestoneReport, Role};

/// The variables that bound the threads of OpenMP, OpenBLAS and MKL (numpy's and torch's BLAS).
pub const THREAD_VARS: [&str; 3] = ["OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"];

/// A candidate run this many times its reference's seconds on the same prompt is slow...
pub const SLOWER_THAN_REFERENCE: f64 = 5.0;
/// ...when it also took at least this long (a fast run is never worth a hint).
pub const MIN_SECONDS: f64 = 10.0;
/// With no reference run to compare with (a run against golden traces): this many seconds per
/// position (prompt tokens and generated tokens)...
pub const SECONDS_PER_POSITION: f64 = 1.0;
/// ...and at least this long in all.
pub const MIN_SECONDS_ALONE: f64 = 30.0;

/// One prompt's slowest candidate run, and what it is compared with.
#[derive(Clone, Debug, PartialEq)]
pub struct Timing {
    pub prompt: String,
    pub candidate_s: f64,
    /// The reference's run on the same prompt, when it ran (`gate init`, `--bless`).
    pub reference_s: Option<f64>,
    /// Prompt tokens plus generated tokens.
    pub positions: usize,
}

/// Whether `t` is slow enough for the hint: see the constants.
pub fn slow(t: &Timing) -> bool {
    match t.reference_s {
        Some(r) => t.candidate_s >= MIN_SECONDS && t.candidate_s >= SLOWER_THAN_REFERENCE * r,
        None => {
            t.candidate_s >= MIN_SECONDS_ALONE
                && t.candidate_s >= SECONDS_PER_POSITION * t.positions.max(1) as f64
        }
    }
}

/// The hint for the slowest of `timings`, if one is slow. `at_once`: how many producers the gate
/// ran together; `cores`: the machine's; `pinned`: the threads are bounded already (a
/// [`THREAD_VARS`] set in the gate's environment or in the candidate's command), so no hint.
pub fn hint(timings: &[Timing], at_once: usize, cores: usize, pinned: bool) -> Option<String> {
    if pinned {
        return None;
    }
    let t = timings
        .iter()
        .filter(|t| slow(t))
        .max_by(|a, b| a.candidate_s.total_cmp(&b.candidate_s))?;
    let at_once = at_once.max(1);
    let n = (cores / at_once).max(1);
    let against = match t.reference_s {
        Some(r) => format!(
            "{:.0}× the reference's {r:.1} s",
            t.candidate_s / r.max(f64::MIN_POSITIVE)
        ),
        None => format!(
            "{:.1} s per position over {} positions",
            t.candidate_s / t.positions.max(1) as f64,
            t.positions
        ),
    };
    let set: Vec<String> = THREAD_VARS.iter().map(|v| format!("{v}={n}")).collect();
    Some(format!(
        "hint: the candidate took {:.0} s on prompt {:?} ({against}). The gate runs {at_once} producers at once on {cores} cores, and a BLAS that starts a thread per core in each (numpy's OpenBLAS, MKL, OpenMP) thrashes: bound its threads with `env {} ` before the command in milestones.json's port.candidate.cmd (gate init: --candidate-cmd 'env {} ./my-port {{verb}} {{args}}'), or export them where the gate runs (CI: the job's env); docs/producers.md, \"Threads\"",
        t.candidate_s,
        t.prompt,
        set.join(" "),
        set.join(" "),
    ))
}

/// The timings of a port milestone's report: per prompt, its slowest candidate run (cached or
/// uncached) and the reference's run when it ran. Empty for tracegate's own milestones.
pub fn timings(r: &MilestoneReport) -> Vec<Timing> {
    r.prompts
        .iter()
        .filter_map(|p| {
            let candidate_s = p
                .runs
                .by_role()
                .filter(|(role, _)| matches!(role, Role::Candidate | Role::CandidateUncached))
                .map(|(_, rec)| rec.seconds)
                .max_by(f64::total_cmp)?;
            Some(Timing {
                prompt: p.id.clone(),
                candidate_s,
                reference_s: p.runs.get(Role::Oracle).map(|rec| rec.seconds),
                positions: p.tokens + r.generate,
            })
        })
        .collect()
}

/// How many producers ran at once for `r`'s prompts: one thread per role (run/port.rs).
fn at_once(r: &MilestoneReport) -> usize {
    r.prompts
        .iter()
        .map(|p| p.runs.by_role().count())
        .max()
        .unwrap_or(1)
}

/// Whether the threads are bounded already: a [`THREAD_VARS`] set in `env` (the gate's, which
/// its producers inherit) or named in the candidate's command (`env OMP_NUM_THREADS=1 …`).
pub fn pinned(env: impl Fn(&str) -> Option<String>, candidate_cmd: Option<&str>) -> bool {
    THREAD_VARS.iter().any(|v| {
        env(v).is_some_and(|s| !s.is_empty())
            || candidate_cmd.is_some_and(|c| c.contains(&format!("{v}=")))
    })
}

/// The hint for the reports of one gate run, if any is due (see the module doc).
pub fn for_reports(reports: &[MilestoneReport]) -> Option<String> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    // The candidate's command line as it ran (`env OMP_NUM_THREADS=1 …` included).
    let invocation = reports
        .iter()
        .flat_map(|r| &r.prompts)
        .find_map(|p| p.runs.get(Role::Candidate))
        .map(|rec| rec.invocation.as_str());
    let is_pinned = pinned(|v| std::env::var(v).ok(), invocation);
    reports
        .iter()
        .find_map(|r| hint(&timings(r), at_once(r), cores, is_pinned))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(candidate_s: f64, reference_s: Option<f64>, positions: usize) -> Timing {
        Timing {
            prompt: "short".into(),
            candidate_s,
            reference_s,
            positions,
        }
    }

    /// The field log's port: 56–145 s a trace of ~40 positions against a reference of a few
    /// seconds gets the hint; the same port pinned, or a fast one, does not.
    #[test]
    fn a_thrashing_port_gets_the_hint_and_a_fast_or_pinned_one_does_not() {
        let slow_run = [t(4.0, Some(3.0), 40), t(145.0, Some(6.0), 40)];
        let h = hint(&slow_run, 3, 16, false).expect("a hint");
        assert!(
            h.contains("145 s on prompt \"short\"")
                && h.contains("24× the reference's 6.0 s")
                && h.contains("3 producers at once on 16 cores")
                && h.contains("env OMP_NUM_THREADS=5 OPENBLAS_NUM_THREADS=5 MKL_NUM_THREADS=5 ")
                && h.contains("port.candidate.cmd"),
            "{h}"
        );
        assert_eq!(h.lines().count(), 1);
        // Negative controls.
        assert_eq!(hint(&slow_run, 3, 16, true), None, "pinned");
        assert_eq!(
            hint(&[t(9.0, Some(0.5), 40)], 3, 16, false),
            None,
            "under 10 s"
        );
        assert_eq!(
            hint(&[t(20.0, Some(5.0), 40)], 3, 16, false),
            None,
            "4× only"
        );
        assert_eq!(hint(&[], 3, 16, false), None);
    }

    #[test]
    fn without_a_reference_run_seconds_per_position_decide() {
        // A run against golden traces: no reference seconds.
        let h = hint(&[t(60.0, None, 40)], 2, 2, false).expect("1.5 s a position");
        assert!(
            h.contains("1.5 s per position over 40 positions") && h.contains("OMP_NUM_THREADS=1"),
            "{h}"
        );
        assert_eq!(hint(&[t(29.0, None, 4)], 2, 2, false), None, "under 30 s");
        assert_eq!(
            hint(&[t(60.0, None, 100)], 2, 2, false),
            None,
            "0.6 s a position"
        );
    }

    #[test]
    fn pinned_reads_the_environment_and_the_command() {
        let none = |_: &str| None;
        assert!(!pinned(none, Some("./my-port {verb} {args}")));
        assert!(pinned(
            none,
            Some("env OPENBLAS_NUM_THREADS=2 ./my-port {verb} {args}")
        ));
        assert!(pinned(
            |v: &str| (v == "OMP_NUM_THREADS").then(|| "4".to_string()),
            None
        ));
        assert!(!pinned(|_: &str| Some(String::new()), None), "set empty");
    }
}
