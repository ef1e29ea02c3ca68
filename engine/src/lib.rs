//! tracegate reference engine: the fast, exact producer. Qwen3 / Qwen3-MoE forward passes in
//! ordered fp32 (docs/numerics.md), capture of the named tensors and decisions into a `.trace`.
//!
//! - `weights`: safetensors parsing, mapped views, inventory, weights digest
//! - `ops`: the ordered kernels of docs/numerics.md, one definition each
//! - `matmul`: the fast matmul and column dots, bit-equal to the `ops` definitions (tested)
//! - `qwen3`: config, weights binding and forward for both families
//! - `capture`: the capture points a forward records
//! - `force`: `--force-decisions`, decisions taken from another trace
//! - `run`: the verbs (`trace`, `layer`, `info`) as a library API; `main.rs` is the CLI over it

// Index loops mirror the written definitions in docs/numerics.md (x[i], w[k], ...).
#![allow(clippy::needless_range_loop)]

pub mod capture;
pub mod force;
pub mod matmul;
pub mod ops;
pub mod qwen3;
pub mod run;
pub mod weights;

pub use run::{
    generate, info, load_config, run_layer, run_trace, LayerOptions, Step, TraceOptions,
};
pub use tracegate_trace::Digest;

/// An engine failure: one line naming the offending field, tensor, file or value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error(pub String);

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}
impl std::error::Error for Error {}

impl From<tracegate_trace::Error> for Error {
    fn from(e: tracegate_trace::Error) -> Self {
        Error(e.to_string())
    }
}

pub type Result<T> = std::result::Result<T, Error>;

/// `err!("fmt", args)` builds an [`Error`].
#[macro_export]
macro_rules! err {
    ($($t:tt)*) => { $crate::Error(format!($($t)*)) };
}

/// xxh3-128 over the model's safetensors files (sorted by name, index json excluded), hex.
/// The file set is checked first (exactly the checkpoint's files), then hashed by the trace
/// crate's one definition of the digest.
pub fn weights_digest(dir: &std::path::Path) -> Result<String> {
    weights::safetensors_files(dir)?;
    Ok(tracegate_trace::weights_digest(dir)?)
}
