//! What a bisection is asked, shared by its every phase (the prefill, the decode steps, the
//! block diffusion's passes): its options, its reference (a producer run now, or a stored trace:
//! prefill/stored.rs opens and verifies one) and its producers by name.

use std::path::{Path, PathBuf};

use tracegate_producers::Producer;

use crate::{gerr, Result};

#[derive(Clone, Debug)]
pub struct BisectOptions {
    pub root: PathBuf,
    pub model: String,
    pub tokens: Vec<i64>,
    pub prompt: Option<String>,
    /// A producer run now, or a trace recorded before (`--reference trace:PATH`, prefill/stored.rs).
    pub reference: Reference,
    pub candidate: Producer,
    /// Judge by this policy (`--policy`); None: see `exact`.
    pub policy: Option<String>,
    /// `--exact`: judge by bits. Neither: by bits for two ordered producers, else by the bundled
    /// policy for the candidate's precision (judge.rs).
    pub exact: bool,
    /// `--precision`: the candidate's precision, over its declaration and its dtype.
    pub precision: Option<String>,
    pub all_layers: bool,
    pub internals: bool,
    pub calibrate: bool,
    /// Seed of the calibration perturbation.
    pub seed: u64,
    /// The model samples (block diffusion, docs/bisect.md "Block diffusion"): its whole runs
    /// take `sampler_seed`, and the passes after the prompt are bisected by diffusion/.
    pub sampling: bool,
    /// A sampling model's seed (`--seed`; a stored reference's own when not given).
    pub sampler_seed: u64,
    /// `--generate N`: decode steps in the whole runs, bisected after the prefill (decode/).
    pub generate: usize,
    /// Where the traces go, relative to root; kept for inspection.
    pub work: String,
    /// Each producer run is killed after this long, and the bisection refused.
    pub timeout: std::time::Duration,
    pub gate_invocation: Vec<String>,
    /// `--allow-stack-mismatch`: two oracle stacks that differ (not only in dtype) are compared,
    /// each difference a `stack_mismatch_allowed` finding, as `trace-diff` does.
    pub allow_stack_mismatch: bool,
    /// `--noise-reference`: tracegate's noise run of the reference, read by the whole runs'
    /// comparison (near-ties' honest noise, the policy's noise ratio; docs/diff.md).
    pub noise: Option<tracegate_diff::NoiseReference>,
    /// `--ranks N`: the candidate's `trace` verb is sharded over N ranks, its rank traces merged
    /// (sharded.rs); None: one process.
    pub ranks: Option<u64>,
}

/// `engine|contract|oracle|cmd` plus an optional template into a producer; usage errors as values.
pub fn producer(
    root: &Path,
    kind: &str,
    template: Option<&str>,
    side: &str,
    threads: usize,
) -> Result<Producer> {
    let cmd =
        |name: &str, default: String| Ok(Producer::command(name, template.unwrap_or(&default))?);
    match (kind, template) {
        ("engine", None) => Ok(Producer::Engine { threads }),
        ("engine", Some(_)) => Err(gerr!("--{side}-cmd: the engine is built into the gate and takes no command; use --{side} cmd to run a command")),
        ("contract", _) => cmd("contract", tracegate_producers::default_contract_cmd(root)),
        ("oracle", _) => cmd("oracle", tracegate_producers::default_oracle_cmd(root)),
        ("cmd", Some(_)) => cmd(&format!("{side}-cmd"), String::new()),
        ("cmd", None) => Err(gerr!("--{side} cmd needs --{side}-cmd 'TEMPLATE' (e.g. 'my-engine {{verb}} {{args}}')")),
        (other, _) => Err(gerr!("--{side} {other:?}: expected engine, contract, oracle or cmd")),
    }
}

/// Whether a producer is one of the built-in ordered ones (docs/numerics.md): the engine, or the
/// contract run by its own command. A replaced command is the user's producer.
pub fn is_ordered(root: &Path, p: &Producer) -> bool {
    match p {
        Producer::Engine { .. } => true,
        Producer::Command { name, words, .. } => {
            name == "contract"
                && matches!(Producer::command("contract", &tracegate_producers::default_contract_cmd(root)), Ok(Producer::Command { words: w, .. }) if w == *words)
        }
    }
}

/// The reference of a bisection: a producer run now, or a trace recorded before.
#[derive(Clone, Debug)]
pub enum Reference {
    Run(Producer),
    Stored(StoredReference),
}

impl Reference {
    /// The report's `reference`: the producer's name, or `trace:PATH`.
    pub fn name(&self) -> String {
        match self {
            Reference::Run(p) => p.name(),
            Reference::Stored(s) => format!("trace:{}", s.shown),
        }
    }

    /// How the judge's reason names it: a stored trace with the producer that recorded it.
    pub(crate) fn described(&self) -> String {
        match self {
            Reference::Run(p) => p.name(),
            Reference::Stored(s) => format!("the stored {} trace {}", s.producer_words(), s.shown),
        }
    }
}

/// A stored reference trace, verified, with what it was recorded for.
#[derive(Clone, Debug)]
pub struct StoredReference {
    pub path: PathBuf,
    /// The path as the user gave it (for messages and the report).
    pub shown: String,
    pub digest: String,
    pub producer: String,
    pub tokens: Vec<i64>,
    pub generate: usize,
    pub internals: bool,
    /// A sampling model's seed (provenance `seed`); None for another model.
    pub seed: Option<u64>,
    /// The engine's or the contract's, without an oracle stack (prefill/stored.rs).
    pub ordered: bool,
}

impl StoredReference {
    fn producer_words(&self) -> &str {
        if self.producer.is_empty() {
            "(producer unnamed)"
        } else {
            &self.producer
        }
    }
}
