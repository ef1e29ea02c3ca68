//! `trace-diff REF CAND`: compare two traces; `trace-diff --show FILE`: inspect one.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use tracegate_diff::{
    compare_files, terminal_safe, write_html, write_human, write_json, write_show, write_show_json,
    Filter, FilterSummary, NoiseReference, Options, Policy,
};
use tracegate_trace::Trace;

const AFTER_HELP: &str = "\
Checks, in order: both files readable and verified; comparable (oracle stack, weights, prompt,
seed, and each common tensor's path/mask/positions attributes); structure (missing, extra,
dtype, shape, order); values (first differing element in reference capture order, with its
ULP distance in the stored dtype; two float dtypes, e.g. a bf16 candidate against an f32
reference, in the coarser one's, the finer value rounded to nearest even: never identical by
bits); decisions (exact, ordered; each flipped row labelled consequence, near-tie,
after-near-tie or defect, and under a policy a near-tie and its token's later rows are excused
and counted). See docs/diff.md.

Filters: --only GLOB and --skip GLOB (each repeatable; `*` stops at `.`, `**` crosses it) keep
the tensors and decisions whose names match some --only (any name without one) and no --skip.
Left-out names are neither compared nor counted; the report says how many there were, and a
verdict (IDENTICAL included) covers only what was compared. A filter that selects nothing
is an error (exit 2). With --show they restrict the listing.

Exit status:
  0  identical, or within the policy given with --policy
  1  different (values, structure, decisions, or outside the policy)
  2  unreadable or tampered trace, or bad usage
  3  incomparable: the traces cannot be compared (reason printed)";

#[derive(Parser, Debug)]
#[command(name = "trace-diff", version, about = "Compare two tracegate traces and name the first divergence", after_help = AFTER_HELP)]
struct Cli {
    /// Reference trace, or a sharded run's rank traces as one path holding `{rank}`
    /// (`ref.r{rank}.trace`: every rank file on disk, merged as trace-merge does).
    #[arg(required_unless_present = "show")]
    reference: Option<PathBuf>,
    /// Candidate trace, or its rank traces as one path holding `{rank}` (merged first; the
    /// report's first line says so).
    #[arg(required_unless_present = "show")]
    candidate: Option<PathBuf>,
    /// Inspect one trace instead: digest, verify status, provenance, tensors with statistics
    /// (min, max, mean, max |x|, NaN and Inf counts), decisions.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["reference", "candidate", "all", "policy", "allow_stack_mismatch"])]
    show: Option<PathBuf>,
    /// Compare (or list) only tensors and decisions whose name matches GLOB; repeatable.
    #[arg(long, value_name = "GLOB")]
    only: Vec<String>,
    /// Leave out tensors and decisions whose name matches GLOB; repeatable.
    #[arg(long, value_name = "GLOB")]
    skip: Vec<String>,
    /// Keep scanning after the first differing tensor; print one row per tensor.
    #[arg(long)]
    all: bool,
    /// Tolerance policy for comparisons against the oracle; scans every tensor and names the
    /// first tensor outside it (bound, value vs limit, worst element), not the first bit
    /// difference. A bundled name, f32 (fixtures/policy/oracle-default.json), bf16 or f16 (the
    /// candidate's dtype), q8 (GGUF weights, activations quantized to 8 bits per matmul, as
    /// llama.cpp's CPU path), or a file.
    #[arg(long, value_name = "NAME|FILE")]
    policy: Option<String>,
    /// Print the machine-readable report (docs/diff-report.schema.json); with --show, the
    /// trace's description as JSON (docs/diff.md).
    #[arg(long)]
    json: bool,
    /// Also write the report as one self-contained HTML page (no script, no network): the
    /// divergence per capture point on a log scale with the policy's bounds, the first bit
    /// difference and first violation marked, the decisions with their margins, the per-tensor
    /// table. Every number in it is the JSON report's (docs/diff.md, "HTML report").
    #[arg(long, value_name = "OUT.html", conflicts_with = "show")]
    html: Option<PathBuf>,
    /// Skip recomputing digests (then no digest is trusted: no tensor is matched by digest; tensors
    /// are compared element-wise up to the first difference, or all of them with --all).
    #[arg(long)]
    no_verify: bool,
    /// Report an oracle stack mismatch (versions, dtype, device, attention) as a finding
    /// instead of refusing.
    #[arg(long)]
    allow_stack_mismatch: bool,
    /// The reference model run in the claimed precision by a reference producer (e.g. the oracle
    /// in bf16), same weights and prompt as the reference: the honest noise that sizes near-ties
    /// and that the policy's `max_noise_ratio` bounds measure the candidate's error against
    /// (docs/diff.md, "The near-tie rule", "Noise-relative bound"). Needs a policy; a policy with
    /// such a bound needs it. The candidate's own trace, or another producer's, is refused.
    #[arg(long, value_name = "TRACE", conflicts_with = "show")]
    noise_reference: Option<PathBuf>,
}

/// `--noise-reference`, opened and verified, under a policy (which reads it for near-ties and
/// any `max_noise_ratio` bound); a `max_noise_ratio` bound without it, or it without a policy,
/// is a usage error (a bound that cannot be measured, or a trace nothing reads, would each say
/// less than the user asked).
fn noise_reference(cli: &Cli, policy: Option<&Policy>) -> Result<Option<NoiseReference>, String> {
    let rule = policy.and_then(Policy::noise_rule);
    match (&cli.noise_reference, rule) {
        (None, None) => Ok(None),
        (None, Some((i, r))) => Err(format!(
            "policy rule {i} ({:?}) sets max_noise_ratio: give --noise-reference TRACE (the reference model run in the candidate's precision)",
            r.pattern
        )),
        (Some(p), None) if policy.is_none() => Err(format!(
            "--noise-reference {}: without --policy nothing would read it (it sizes near-ties and max_noise_ratio bounds under a policy)",
            p.display()
        )),
        (Some(p), _) => {
            let t = Trace::open(p).map_err(|e| format!("--noise-reference: {e}"))?;
            if !cli.no_verify {
                t.verify()
                    .map_err(|e| format!("--noise-reference {}: {e}", p.display()))?;
            }
            Ok(Some(NoiseReference(std::sync::Arc::new(t))))
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let filter = Filter {
        only: cli.only.clone(),
        skip: cli.skip.clone(),
    };
    if let Some(path) = &cli.show {
        return show(path, !cli.no_verify, cli.json, &filter);
    }
    let policy = match &cli.policy {
        None => None,
        Some(p) => match Policy::resolve(p, std::path::Path::new("")) {
            Ok(p) => Some(p),
            Err(e) => {
                eprintln!("trace-diff: bad policy: {}", terminal_safe(&e.to_string()));
                return ExitCode::from(2);
            }
        },
    };
    let noise = match noise_reference(&cli, policy.as_ref()) {
        Ok(n) => n,
        Err(e) => {
            eprintln!("trace-diff: {}", terminal_safe(&e));
            return ExitCode::from(2);
        }
    };
    let opts = Options {
        verify: !cli.no_verify,
        allow_stack_mismatch: cli.allow_stack_mismatch,
        all: cli.all,
        policy,
        filter,
        noise,
    };
    let (r, c) = (
        cli.reference.expect("required by clap"),
        cli.candidate.expect("required by clap"),
    );
    // Before reading anything: `--html e.trace` must not destroy the trace it reports on.
    if let Some(html) = &cli.html {
        let inputs = [
            ("reference trace", r.as_path()),
            ("candidate trace", c.as_path()),
        ];
        if let Err(e) = tracegate_trace::output::refuse_clobbering(&[("--html", html)], &inputs) {
            eprintln!("trace-diff: {}", terminal_safe(&e));
            return ExitCode::from(2);
        }
    }
    // A `{rank}` path is a sharded run: its rank traces merged into a file of our own first.
    let scratch = match tempfile::tempdir() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("trace-diff: cannot make a scratch directory: {e}");
            return ExitCode::from(2);
        }
    };
    let mut merged_notes = Vec::new();
    let mut merged_side = |side: &str, p: PathBuf| -> Result<PathBuf, String> {
        if !p.to_string_lossy().contains(tracegate_trace::merge::RANK) {
            return Ok(p);
        }
        let ranks = tracegate_trace::merge::rank_traces(&p)?;
        let out = scratch.path().join(format!("{side}.merged.trace"));
        let m = tracegate_trace::merge::merge(&ranks, &out)
            .map_err(|e| format!("{side} {}: merge refused: {e}", p.display()))?;
        merged_notes.push(format!(
            "{side}: {} rank traces of world size {} merged ({}; partial sums in rank order, {}), digest {}",
            m.ranks.len(),
            m.world,
            p.display(),
            m.reduction_order(),
            m.digest.short()
        ));
        Ok(out)
    };
    let (r, c) = match (merged_side("reference", r), merged_side("candidate", c)) {
        (Ok(r), Ok(c)) => (r, c),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("trace-diff: {}", terminal_safe(&e));
            return ExitCode::from(2);
        }
    };
    // On stdout before a human report; on stderr beside a JSON one (stdout is the schema's).
    for note in &merged_notes {
        match cli.json {
            true => eprintln!("trace-diff: {}", terminal_safe(note)),
            false => println!("{}", terminal_safe(note)),
        }
    }
    let report = compare_files(&r, &c, &opts);
    if let Some(code) = report.filter.as_ref().and_then(filter_usage) {
        return code;
    }
    if let Some(path) = &cli.html {
        if let Err(e) = write_html(&report, path) {
            eprintln!(
                "trace-diff: cannot write {}: {e}",
                terminal_safe(&path.display().to_string())
            );
            return ExitCode::from(2);
        }
    }
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    let written = if cli.json {
        write_json(&report, &mut out)
    } else {
        write_human(&report, &mut out)
    };
    if let Err(e) = written {
        if let Some(code) = write_failed(e) {
            return code;
        }
    }
    ExitCode::from(report.exit_code() as u8)
}

/// Warns (stderr) about each glob that matches no name; a filter that selects nothing is bad
/// usage, exit 2 with nothing on stdout: zero checks is never a pass.
fn filter_usage(f: &FilterSummary) -> Option<ExitCode> {
    for w in f.warnings() {
        eprintln!("trace-diff: warning: {}", terminal_safe(&w));
    }
    let why = f.nothing_selected()?;
    eprintln!("trace-diff: {}", terminal_safe(&why));
    Some(ExitCode::from(2))
}

fn show(path: &PathBuf, verify: bool, json: bool, filter: &Filter) -> ExitCode {
    let t = match Trace::open(path) {
        Ok(t) => t,
        Err(e) => {
            // With --json, stdout holds JSON or nothing.
            let line = format!("UNREADABLE — {}", terminal_safe(&e.to_string()));
            if json {
                eprintln!("trace-diff: {line}");
            } else {
                println!("{line}");
            }
            return ExitCode::from(2);
        }
    };
    let filter = filter.summary(&[&t]);
    if let Some(code) = filter.as_ref().and_then(filter_usage) {
        return code;
    }
    let v = verify.then(|| t.verify().map_err(|e| e.to_string()));
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    let written = if json {
        write_show_json(&t, v.as_ref(), filter.as_ref(), &mut out)
    } else {
        write_show(&t, v.as_ref(), filter.as_ref(), &mut out)
    };
    if let Err(e) = written.and_then(|()| std::io::Write::flush(&mut out)) {
        if let Some(code) = write_failed(e) {
            return code;
        }
    }
    match v {
        Some(Err(_)) => ExitCode::from(2),
        _ => ExitCode::SUCCESS,
    }
}

/// A closed pipe (`| head`) is the reader's choice, not a failure: the verdict's exit status
/// stands. Any other write error is exit 2.
fn write_failed(e: std::io::Error) -> Option<ExitCode> {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        return None;
    }
    eprintln!("trace-diff: cannot write to stdout: {e}");
    Some(ExitCode::from(2))
}
