//! What the verbs are asked to do: `engine trace`'s and `engine layer`'s options, and the
//! thread pool of their `--threads`. Every family's verbs take these (`run` dispatches).

use std::path::PathBuf;

use crate::shard::Shards;
use crate::{err, Result};

pub struct TraceOptions {
    pub model_dir: PathBuf,
    pub tokens: Vec<i64>,
    pub out: PathBuf,
    /// Add the internal capture points (q, k, v, attn_probs, router logits, expert outputs).
    pub internals: bool,
    /// Greedy decode steps after the prompt (decisions, `decode.SSSS.logits`, and under
    /// `internals` the steps' layer points).
    pub generate: usize,
    /// Decode with the KV cache (`true`) or by re-running the whole sequence (`false`).
    pub cache: bool,
    pub threads: usize,
    /// Recorded in provenance.
    pub command_line: Vec<String>,
    /// `--force-decisions`: take the router top-k and greedy tokens from this trace.
    pub force_decisions: Option<PathBuf>,
    /// `--text`: the prompt as text and how it was tokenized (`prompt_text` in provenance,
    /// docs/producers.md "Text prompts"); `tokens` are its ids.
    pub prompt_text: Option<serde_json::Value>,
    /// `--shards tp=W|ep=W` (docs/numerics.md §23): W ranks, one trace each at `out` with
    /// `{rank}` replaced.
    pub shards: Option<Shards>,
}

pub struct LayerOptions {
    pub model_dir: PathBuf,
    pub layer: usize,
    pub input: PathBuf,
    pub input_name: String,
    pub out: PathBuf,
    pub internals: bool,
    pub threads: usize,
    pub command_line: Vec<String>,
    /// `--force-decisions`: take the layer's router top-k from this trace.
    pub force_decisions: Option<PathBuf>,
    /// `--decode-from P`: rows at positions ≥ P go one at a time through the cached decode path.
    pub decode_from: Option<i64>,
}

/// The pool of `--threads` worker threads the forward runs on.
pub(crate) fn pool(threads: usize) -> Result<rayon::ThreadPool> {
    if threads == 0 {
        return Err(err!(Input: "--threads must be at least 1"));
    }
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| err!(Internal: "thread pool: {e}"))
}
