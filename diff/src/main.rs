//! `trace-diff REF CAND`: compare two traces; `trace-diff --show FILE`: inspect one.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use tracegate_diff::{compare_files, terminal_safe, write_human, write_json, write_show, Options, Policy};
use tracegate_trace::Trace;

const AFTER_HELP: &str = "\
Checks, in order: both files readable and verified; comparable (oracle stack, weights, prompt,
seed, and each common tensor's path/mask/positions attributes); structure (missing, extra,
dtype, shape, order); values (first differing element in reference capture order, with its
ULP distance in the stored dtype; two float dtypes, e.g. a bf16 candidate against an f32
reference, in the coarser one's, the finer value rounded to nearest even: never identical by
bits); decisions (exact, ordered). See docs/diff.md.

Exit status:
  0  identical, or within the policy given with --policy
  1  different (values, structure, decisions, or outside the policy)
  2  unreadable or tampered trace, or bad usage
  3  incomparable: the traces cannot be compared (reason printed)";

#[derive(Parser, Debug)]
#[command(name = "trace-diff", version, about = "Compare two tracegate traces and name the first divergence", after_help = AFTER_HELP)]
struct Cli {
    /// Reference trace.
    #[arg(required_unless_present = "show")]
    reference: Option<PathBuf>,
    /// Candidate trace.
    #[arg(required_unless_present = "show")]
    candidate: Option<PathBuf>,
    /// Inspect one trace instead: digest, verify status, provenance, tensors, decisions.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["reference", "candidate", "all", "policy", "json", "allow_stack_mismatch"])]
    show: Option<PathBuf>,
    /// Keep scanning after the first differing tensor; print one row per tensor.
    #[arg(long)]
    all: bool,
    /// Tolerance policy (JSON) for comparisons against the oracle; scans every tensor.
    /// Shipped default: fixtures/policy/oracle-default.json.
    #[arg(long, value_name = "FILE")]
    policy: Option<PathBuf>,
    /// Print the machine-readable report (docs/diff-report.schema.json).
    #[arg(long)]
    json: bool,
    /// Skip recomputing digests (then no digest is trusted: no tensor is matched by digest; tensors
    /// are compared element-wise up to the first difference, or all of them with --all).
    #[arg(long)]
    no_verify: bool,
    /// Report an oracle stack mismatch (versions, dtype, device, attention) as a finding
    /// instead of refusing.
    #[arg(long)]
    allow_stack_mismatch: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Some(path) = &cli.show {
        return show(path, !cli.no_verify);
    }
    let policy = match &cli.policy {
        None => None,
        Some(p) => match Policy::load(p) {
            Ok(p) => Some(p),
            Err(e) => {
                eprintln!("trace-diff: bad policy: {}", terminal_safe(&e.to_string()));
                return ExitCode::from(2);
            }
        },
    };
    let opts = Options { verify: !cli.no_verify, allow_stack_mismatch: cli.allow_stack_mismatch, all: cli.all, policy };
    let (r, c) = (cli.reference.expect("required by clap"), cli.candidate.expect("required by clap"));
    let report = compare_files(&r, &c, &opts);
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    let written = if cli.json { write_json(&report, &mut out) } else { write_human(&report, &mut out) };
    if let Err(e) = written {
        if let Some(code) = write_failed(e) {
            return code;
        }
    }
    ExitCode::from(report.exit_code() as u8)
}

fn show(path: &PathBuf, verify: bool) -> ExitCode {
    let t = match Trace::open(path) {
        Ok(t) => t,
        Err(e) => {
            println!("UNREADABLE — {}", terminal_safe(&e.to_string()));
            return ExitCode::from(2);
        }
    };
    let v = verify.then(|| t.verify().map_err(|e| e.to_string()));
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    if let Err(e) = write_show(&t, v.as_ref(), &mut out).and_then(|()| std::io::Write::flush(&mut out)) {
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
