//! tracegate reference engine: the fast, exact producer. llama, Qwen3, Qwen3-MoE, Qwen3.5 and
//! Qwen3.5-MoE forward passes in ordered fp32 (docs/numerics.md), capture of the named tensors
//! and decisions into a `.trace`.
//!
//! - `weights`: safetensors parsing, mapped views, inventory, weights digest
//! - `gguf`: GGUF weights: the file checked, dequantized, read as the Hugging Face checkpoint
//! - `config`: `config.json` as the forward reads it (§13), refusals included
//! - `ops`: the ordered kernels of docs/numerics.md, one definition each (the fast attention is
//!   tested against its definition)
//! - `matmul`: the fast matmul and its kernel families, bit-equal to the `ops` definition (tested)
//! - `model`: the family-neutral model: weights binding and forward; a decoder layer
//!   (`model/layer.rs`) is a token mixer (`model/mixer/`: attention, Gated DeltaNet) and a
//!   feed-forward block (`model/feed_forward/`: MLP, MoE, shared expert) chosen per layer from
//!   the config, which is where the families differ
//! - `capture`: the capture points a forward records
//! - `force`: `--force-decisions`, decisions taken from another trace
//! - `options`: what the verbs are asked (`TraceOptions`, `LayerOptions`, the `--threads` pool)
//! - `provenance`: what a trace records about its run, the weights digest hashed beside the forward
//! - `run`: the verbs (`trace`, `layer`, `info`) as a library API; `main.rs` is the CLI over it

// Index loops mirror the written definitions in docs/numerics.md (x[i], w[k], ...).
#![allow(clippy::needless_range_loop)]

pub mod aligned;
pub mod capture;
pub mod config;
pub mod force;
pub mod gguf;
pub mod matmul;
pub mod model;
pub mod ops;
pub mod options;
pub mod provenance;
pub mod run;
pub mod shard;
pub mod splitmix;
pub mod weights;

pub use config::load_config;
pub use model::diffusion_gemma::config::DiffusionOptions;
pub use options::{LayerOptions, TraceOptions};
pub use run::{generate, info, run_layer, run_trace, run_trace_ranks, run_trace_with, Step};
pub use shard::Shards;
pub use tracegate_trace::Digest;

/// Keep memory the forward frees for its next allocation. A forward allocates and frees its
/// activations layer by layer (megabytes per matmul output at a 64-token prefill); by default
/// glibc hands large freed blocks back to the kernel (chunks above its mmap threshold, and the
/// heap's top past its trim threshold), so the next forward page-faults and the kernel zeroes
/// every page again (on the 16-core Xeon, a 64-token prefill of bench-qwen3 at 2 threads
/// 10 % faster without that: docs/benchmarks.md, "Freed memory kept"). Called once by each
/// program that runs forwards (the CLI, the bench); no effect on values. Peak memory is
/// unchanged (the same blocks are reused); what a run freed stays resident until the process
/// exits.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets allocator parameters; called before the forward's threads run.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 30);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
    }
}

/// An engine failure, by kind, so callers (the gate, tests) branch on the kind rather than the
/// text. Each displays as one line naming the offending field, tensor, file or value; the CLI
/// prints it after `engine: error:` and exits 2 whatever the kind.
#[derive(Debug)]
pub enum Error {
    /// `config.json`: unreadable, a field refused (§7, §13), or a size that disagrees with the
    /// checkpoint.
    Config(String),
    /// The checkpoint: its safetensors files, headers, shard index, and tensors missing,
    /// unclaimed, mis-shaped or of an unsupported dtype.
    Checkpoint(String),
    /// What the run was asked to do: tokens, positions, options, the input tensor of `layer`,
    /// the `--force-decisions` trace.
    Input(String),
    /// The numbers leave no decision: a NaN logit or router probability (§10, §12).
    NaN(String),
    /// Reading or writing a trace (the trace crate's error, kept whole).
    Trace(tracegate_trace::Error),
    /// The run could not proceed for a reason outside its inputs (thread pool, a worker panicked).
    Internal(String),
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::Config(s)
            | Error::Checkpoint(s)
            | Error::Input(s)
            | Error::NaN(s)
            | Error::Internal(s) => f.write_str(s),
            Error::Trace(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Trace(e) => Some(e),
            _ => None,
        }
    }
}

impl From<tracegate_trace::Error> for Error {
    fn from(e: tracegate_trace::Error) -> Self {
        Error::Trace(e)
    }
}

pub type Result<T> = std::result::Result<T, Error>;

/// `err!(Kind: "fmt", args)` builds an [`Error`] of that kind, e.g. `err!(Config: "…{x}")`.
#[macro_export]
macro_rules! err {
    ($kind:ident: $($t:tt)*) => { $crate::Error::$kind(format!($($t)*)) };
}

/// The checkpoint of `--model`: its GGUF file (`gguf::model_file`: a `.gguf`, or a directory
/// holding one and no safetensors; read by `gguf`), else the directory's safetensors.
pub fn open_store(dir: &std::path::Path) -> Result<weights::Store> {
    match gguf::model_file(dir)? {
        Some(file) => gguf::load(&file)?.into_store(),
        None => weights::Store::open(dir),
    }
}

/// xxh3-128 over the model's safetensors files (sorted by name, index json excluded), hex.
/// The file set is checked first (exactly the checkpoint's files), then hashed by the trace
/// crate's one definition of the digest. A GGUF checkpoint (`gguf::model_file`): xxh3-128 of
/// the .gguf file's bytes.
pub fn weights_digest(dir: &std::path::Path) -> Result<String> {
    if let Some(file) = gguf::model_file(dir)? {
        return Ok(tracegate_trace::weights_digest(&file)?);
    }
    weights::safetensors_files(dir)?;
    Ok(tracegate_trace::weights_digest(dir)?)
}
