//! `engine` CLI: thin wrapper over the library verbs. Errors exit 2: a refusal prints one line,
//! a usage error prints clap's whole message (the argument it is about, and any suggestion).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use tracegate_engine::{
    info, run_layer, run_trace_with, DiffusionOptions, LayerOptions, TraceOptions,
};

#[derive(Parser)]
#[command(
    name = "engine",
    version,
    about = "tracegate reference engine (ordered fp32 Llama / Qwen2 / Qwen3 / Qwen3-MoE / Qwen3.5 / Qwen3.5-MoE / Diffusion Gemma)"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Clone, Copy, ValueEnum)]
enum CaptureSet {
    /// The capture points every producer writes.
    Default,
    /// Add q, k, v, attn_probs, router logits and expert outputs, and Qwen3.5's attn_gate,
    /// linear.* and shared_expert.* points (changes the digest).
    Internals,
}

#[derive(Clone, Copy, ValueEnum)]
enum OnOff {
    On,
    Off,
}

fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

#[derive(Subcommand)]
enum Cmd {
    /// Prefill a prompt (and optionally generate greedily) and write a trace.
    Trace {
        /// Model directory: config.json and model.safetensors (or the shards of an index); or a
        /// GGUF file, or a directory holding one .gguf and no safetensors (docs/numerics.md §21).
        #[arg(long)]
        model: PathBuf,
        /// Prompt token ids, comma separated (e.g. 3,17,5).
        #[arg(
            long,
            value_delimiter = ',',
            allow_negative_numbers = true,
            required_unless_present = "text",
            conflicts_with = "text",
            value_parser = tracegate_trace::protocol::token_id
        )]
        tokens: Vec<i64>,
        /// The prompt as text instead, tokenized by the model directory's own tokenizer
        /// (`python -m tracegate.text`: TRACEGATE_PYTHON, else tracegate's .venv; docs/producers.md
        /// "Text prompts").
        #[arg(long)]
        text: Option<String>,
        /// With --text: the text as one user message in the tokenizer's chat template.
        #[arg(long)]
        chat: bool,
        /// Trace file to write (replaced only once complete).
        #[arg(long)]
        out: PathBuf,
        /// Which capture points to record.
        #[arg(long, value_enum, default_value = "default")]
        capture: CaptureSet,
        /// Greedy decode steps after the prompt (decisions and decode.SSSS.* tensors).
        #[arg(long, default_value_t = 0)]
        generate: usize,
        /// Decode with the KV cache (on) or by re-running the whole sequence (off); same bits.
        #[arg(long, value_enum, default_value = "on")]
        cache: OnOff,
        /// Worker threads (bits do not depend on it).
        #[arg(long, default_value_t = default_threads())]
        threads: usize,
        /// Take router top-k and greedy tokens from this trace instead of computing them.
        #[arg(long)]
        force_decisions: Option<PathBuf>,
        /// diffusion_gemma: the seed of the random streams (docs/diffusion-gemma.md DG15; default 0).
        #[arg(long)]
        seed: Option<u64>,
        /// diffusion_gemma: max_denoising_steps (default: generation_config.json, then 48).
        #[arg(long)]
        denoising_steps: Option<usize>,
        /// diffusion_gemma: t_max of the temperature schedule (default: generation_config.json, then 0.8).
        #[arg(long, allow_negative_numbers = true)]
        t_max: Option<f64>,
        /// diffusion_gemma: t_min of the temperature schedule (default: generation_config.json, then 0.4).
        #[arg(long, allow_negative_numbers = true)]
        t_min: Option<f64>,
        /// diffusion_gemma: the sampler's entropy bound (default: generation_config.json, then 0.1).
        #[arg(long, allow_negative_numbers = true)]
        entropy_bound: Option<f64>,
        /// diffusion_gemma: stability_threshold (default: generation_config.json, then 1).
        #[arg(long)]
        stability_threshold: Option<usize>,
        /// diffusion_gemma: confidence_threshold (default: generation_config.json, then 0.005).
        #[arg(long, allow_negative_numbers = true)]
        confidence_threshold: Option<f64>,
        /// diffusion_gemma: EOS token ids, comma separated (default: generation_config.json's).
        #[arg(long, value_delimiter = ',', allow_negative_numbers = true)]
        eos: Option<Vec<i64>>,
        /// diffusion_gemma: the token replacing those after EOS (default: generation_config.json's).
        #[arg(long, allow_negative_numbers = true)]
        pad: Option<i64>,
    },
    /// Run decoder layer L alone on a tensor of another trace (rows at its positions).
    Layer {
        /// Model directory: config.json and model.safetensors (or the shards of an index); or a
        /// GGUF file, or a directory holding one .gguf and no safetensors (docs/numerics.md §21).
        #[arg(long)]
        model: PathBuf,
        /// Decoder layer index (0-based).
        #[arg(long)]
        layer: usize,
        /// Trace holding the input tensor.
        #[arg(long)]
        input: PathBuf,
        /// Name of the input tensor in that trace: f32 [rows, hidden] with a positions attribute.
        #[arg(long)]
        input_name: String,
        /// Trace file to write (replaced only once complete).
        #[arg(long)]
        out: PathBuf,
        /// Which capture points to record.
        #[arg(long, value_enum, default_value = "default")]
        capture: CaptureSet,
        /// Worker threads (bits do not depend on it).
        #[arg(long, default_value_t = default_threads())]
        threads: usize,
        /// Take the layer's router top-k from this trace (row i: position i) instead of computing it.
        #[arg(long)]
        force_decisions: Option<PathBuf>,
        /// Rows at positions < P fill the layer's KV cache; each later row runs through the cached
        /// decode path; only those are written (input rows must be at positions 0..m−1).
        #[arg(long, value_name = "P", allow_negative_numbers = true)]
        decode_from: Option<i64>,
    },
    /// Config summary, weights digest and inventory check.
    Info {
        /// Model directory: config.json and model.safetensors (or the shards of an index); or a
        /// GGUF file, or a directory holding one .gguf and no safetensors (docs/numerics.md §21).
        #[arg(long)]
        model: PathBuf,
    },
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        // Usage errors: clap's whole message (which argument, "did you mean", usage), exit 2;
        // help and version print normally.
        Err(e) if e.use_stderr() => {
            eprint!("engine: {}", e.render());
            return ExitCode::from(2);
        }
        Err(e) => e.exit(),
    };
    tracegate_engine::keep_freed_memory();
    let command_line: Vec<String> = std::env::args().collect();
    let result = match cli.cmd {
        Cmd::Trace {
            chat: true,
            text: None,
            ..
        } => Err(tracegate_engine::Error::Input(
            "--chat: only with --text (a chat template applies to a text prompt)".into(),
        )),
        Cmd::Trace {
            model,
            tokens,
            text,
            chat,
            out,
            capture,
            generate,
            cache,
            threads,
            force_decisions,
            seed,
            denoising_steps,
            t_max,
            t_min,
            entropy_bound,
            stability_threshold,
            confidence_threshold,
            eos,
            pad,
        } => match text.map(|t| tokenize(&model, &t, chat)).transpose() {
            Err(e) => Err(e),
            Ok(tokenized) => {
                let (tokens, prompt_text) = match tokenized {
                    Some((ids, record)) => (ids, Some(record)),
                    None => (tokens, None),
                };
                let diffusion = DiffusionOptions {
                    seed,
                    denoising_steps,
                    t_max,
                    t_min,
                    entropy_bound,
                    stability_threshold,
                    confidence_threshold,
                    eos,
                    pad,
                };
                run_trace_with(
                    &TraceOptions {
                        model_dir: model,
                        tokens,
                        out: out.clone(),
                        internals: matches!(capture, CaptureSet::Internals),
                        generate,
                        cache: matches!(cache, OnOff::On),
                        threads,
                        command_line,
                        force_decisions,
                        prompt_text,
                    },
                    &diffusion,
                )
                .map(|d| format!("{} {}", d.hex(), out.display()))
            }
        },
        Cmd::Layer {
            model,
            layer,
            input,
            input_name,
            out,
            capture,
            threads,
            force_decisions,
            decode_from,
        } => run_layer(&LayerOptions {
            model_dir: model,
            layer,
            input,
            input_name,
            out: out.clone(),
            internals: matches!(capture, CaptureSet::Internals),
            threads,
            command_line,
            force_decisions,
            decode_from,
        })
        .map(|d| format!("{} {}", d.hex(), out.display())),
        Cmd::Info { model } => info(&model).map(|s| s.trim_end().to_string()),
    };
    match result {
        // A closed stdout (`engine info | head`) drops the text; the verb's work is done.
        Ok(s) => match tracegate_trace::output::print(&format!("{s}\n")) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("engine: error: cannot write to stdout: {e}");
                ExitCode::from(2)
            }
        },
        Err(e) => {
            eprintln!("engine: error: {e}");
            ExitCode::from(2)
        }
    }
}

/// `--text`: the ids of `text` by the model's own tokenizer, and the provenance record
/// `prompt_text`, from `python -m tracegate.text` — one tokenization for every producer, so the
/// engine's ids are the contract's and the oracle's.
fn tokenize(
    model: &std::path::Path,
    text: &str,
    chat: bool,
) -> Result<(Vec<i64>, serde_json::Value), tracegate_engine::Error> {
    let refuse = |what: String| tracegate_engine::Error::Input(format!("--text: {what}"));
    let python = std::env::var("TRACEGATE_PYTHON").unwrap_or_else(|_| {
        let manifest = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        manifest
            .parent()
            .unwrap_or(manifest)
            .join(".venv/bin/python")
            .display()
            .to_string()
    });
    let mut cmd = std::process::Command::new(&python);
    cmd.args(["-m", "tracegate.text", "--model"])
        .arg(model)
        .arg(format!("--text={text}"));
    if chat {
        cmd.arg("--chat");
    }
    let out = cmd
        .output()
        .map_err(|e| refuse(format!("cannot run {python} -m tracegate.text: {e} (set TRACEGATE_PYTHON to a Python with tracegate and transformers)")))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(refuse(
            err.trim()
                .lines()
                .last()
                .unwrap_or("tokenizing failed")
                .trim_start_matches("error: ")
                .to_string(),
        ));
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .map_err(|e| refuse(format!("python -m tracegate.text printed no JSON: {e}")))?;
    let ids: Vec<i64> = v["tokens"]
        .as_array()
        .and_then(|a| a.iter().map(serde_json::Value::as_i64).collect())
        .filter(|ids: &Vec<i64>| !ids.is_empty())
        .ok_or_else(|| refuse("python -m tracegate.text gave no token ids".into()))?;
    let record = serde_json::json!({
        "text": text, "chat": chat, "template": v["template"], "tokenizer_digest": v["tokenizer_digest"],
    });
    Ok((ids, record))
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    #[test]
    fn every_option_and_verb_has_help_text() {
        let cmd = super::Cli::command();
        let mut missing = vec![];
        for sub in cmd.get_subcommands() {
            if sub.get_about().is_none() {
                missing.push(sub.get_name().to_string());
            }
            for a in sub
                .get_arguments()
                .filter(|a| !matches!(a.get_id().as_str(), "help" | "version"))
            {
                if a.get_help().is_none() {
                    missing.push(format!("{} --{}", sub.get_name(), a.get_id()));
                }
            }
        }
        assert!(missing.is_empty(), "no help text: {missing:?}");
    }
}
