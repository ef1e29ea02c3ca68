//! `trace-merge RANK_TRACE… --out T`: the logical trace of a sharded run from its rank traces
//! (docs/trace-format.md, "Merging rank traces").

use std::path::PathBuf;
use std::process::ExitCode;

const USAGE: &str = "\
usage: trace-merge RANK_TRACE... --out MERGED.trace
       trace-merge 'DIR/r{rank}.trace' --out MERGED.trace   (every rank file on disk)

Builds the logical trace of a sharded run from one trace per rank, each tensor's `shard`
attribute saying what the rank holds (docs/trace-format.md, \"Sharded traces\"): slices are
concatenated along their axis, partial sums reduced in rank order ((rank 0 + rank 1) + ...,
left to right), expert tensors united, replicated tensors and decisions required identical on
every rank. Refused, in one line naming the rank: a gap or an overlap, a missing or repeated
rank, a world size that disagrees, a rank of another run (provenance prompt_tokens,
weights_digest, run_id), a tensor on some ranks only. The merged trace's provenance keeps what
every rank agrees on and lists each rank trace's digest under `shards`.

Exit status: 0 merged, 2 refused or bad usage.";

fn main() -> ExitCode {
    let mut inputs: Vec<PathBuf> = Vec::new();
    let mut out: Option<PathBuf> = None;
    let mut args = std::env::args_os().skip(1);
    while let Some(a) = args.next() {
        match a.to_str() {
            Some("-h" | "--help") => {
                println!("{USAGE}");
                return ExitCode::SUCCESS;
            }
            Some("--out" | "-o") => match args.next() {
                Some(p) if out.is_none() => out = Some(PathBuf::from(p)),
                Some(_) => return usage("--out is given twice"),
                None => return usage("--out needs a path"),
            },
            Some(s) if s.starts_with("--out=") => out = Some(PathBuf::from(&s[6..])),
            Some(s) if s.starts_with('-') && s.len() > 1 => {
                return usage(&format!("unknown option {s:?}"))
            }
            _ => inputs.push(PathBuf::from(a)),
        }
    }
    let Some(out) = out else {
        return usage("--out MERGED.trace is required");
    };
    if inputs.is_empty() {
        return usage("no rank traces given");
    }
    // One path holding {rank}: the rank files on disk (a missing rank is the merge's refusal).
    if let [pattern] = inputs.as_slice() {
        if pattern
            .to_string_lossy()
            .contains(tracegate_trace::merge::RANK)
        {
            inputs = match tracegate_trace::merge::rank_traces(pattern) {
                Ok(found) => found,
                Err(e) => {
                    eprintln!("trace-merge: refused: {e}");
                    return ExitCode::from(2);
                }
            };
        }
    }
    if let Some(same) = inputs.iter().find(|p| **p == out) {
        return usage(&format!("--out {} is also a rank trace", same.display()));
    }
    match tracegate_trace::merge::merge(&inputs, &out) {
        Ok(m) => {
            println!(
                "trace-merge: {} rank traces of world size {} -> {}",
                m.ranks.len(),
                m.world,
                out.display()
            );
            for (path, digest) in &m.ranks {
                println!("  {}  {}", digest.short(), path.display());
            }
            println!(
                "partial sums reduced in rank order, left to right, {}: {} tensor(s){}",
                m.reduction_order(),
                m.reduced.len(),
                m.reduced
                    .first()
                    .map(|n| format!(" (first {n})"))
                    .unwrap_or_default()
            );
            println!(
                "slices concatenated: {}; expert tensors united: {}; replicated, identical on every rank: {}",
                m.concatenated, m.experts, m.replicated
            );
            println!("digest {}", m.digest.hex());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("trace-merge: refused: {e}");
            ExitCode::from(2)
        }
    }
}

fn usage(why: &str) -> ExitCode {
    eprintln!("trace-merge: {why}\n{USAGE}");
    ExitCode::from(2)
}
