//! `engine` CLI: thin wrapper over the library verbs. Errors exit 2: a refusal prints one line,
//! a usage error prints clap's whole message (the argument it is about, and any suggestion).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use tracegate_engine::{
    info, run_layer, run_trace_ranks, run_trace_with, DiffusionOptions, LayerOptions, Shards,
    TraceOptions,
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
        /// (`python -m tracegate.text`: TRACEGATE_PYTHON, else tracegate's .venv; killed past
        /// TRACEGATE_TEXT_TIMEOUT + 120 s; docs/producers.md "Text prompts").
        #[arg(long)]
        text: Option<String>,
        /// With --text: the text as one user message in the tokenizer's chat template.
        #[arg(long)]
        chat: bool,
        /// Trace file to write (replaced only once complete); under --shards it must contain
        /// {rank}, replaced by each rank's number (one trace per rank).
        #[arg(long)]
        out: PathBuf,
        /// Run as N ranks (threads), each holding only its block of the weights: tp=N (heads,
        /// MLP and vocabulary split) or ep=N (the same, experts split whole); bit-identical to
        /// one process once merged by trace-merge (docs/numerics.md §23).
        #[arg(long, value_name = "tp=N|ep=N")]
        shards: Option<String>,
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
            shards,
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
        } => match (
            // A malformed --shards is refused in one line (not clap's usage message).
            shards.as_deref().map(Shards::parse).transpose(),
            text.map(|t| tokenize(&model, &t, chat)).transpose(),
        ) {
            (Err(e), _) | (_, Err(e)) => Err(e),
            (Ok(shards), Ok(tokenized)) => {
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
                let o = TraceOptions {
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
                    shards,
                };
                match (&o.shards, diffusion.given().is_empty()) {
                    // One line per rank: its digest and file.
                    (Some(_), true) => run_trace_ranks(&o).map(|ranks| {
                        ranks
                            .iter()
                            .map(|(p, d)| format!("{} {}", d.hex(), p.display()))
                            .collect::<Vec<_>>()
                            .join("\n")
                    }),
                    _ => run_trace_with(&o, &diffusion)
                        .map(|d| format!("{} {}", d.hex(), out.display())),
                }
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

/// The setting that bounds `python -m tracegate.text` (docs/producers.md, "Text prompts"): its
/// own limit on loading the tokenizer and on each text; the engine kills it at that limit plus
/// [`TEXT_START_GRACE_S`].
const TEXT_TIMEOUT_VAR: &str = "TRACEGATE_TEXT_TIMEOUT";
const TEXT_DEFAULT_TIMEOUT_S: u64 = 60;
/// The interpreter's start and `import transformers`, which the Python limit does not cover.
const TEXT_START_GRACE_S: u64 = 120;
/// What is kept of the helper's stdout (a JSON line of ids) and stderr (its refusal).
const TEXT_STDOUT_MAX: u64 = 64 << 20;
const TEXT_STDERR_MAX: u64 = 1 << 20;

/// TRACEGATE_TEXT_TIMEOUT, read as `tracegate.text` reads it: a whole number of seconds ≥ 1,
/// digits only; unset: 60; anything else refused in one line naming the variable.
fn text_timeout(v: Option<&str>) -> Result<u64, String> {
    v.map_or(Ok(TEXT_DEFAULT_TIMEOUT_S), |v| {
        tracegate_trace::settings::parse_seconds(TEXT_TIMEOUT_VAR, v)
    })
}

/// Runs `cmd` (stdin closed, stdout and stderr captured up to their bounds) in a process group
/// of its own, killed with everything in it at `deadline`: its output, or None when it was
/// killed. The group dies with the engine too (PR_SET_PDEATHSIG), as it no longer gets the
/// terminal's Ctrl-C.
fn run_with_deadline(
    cmd: &mut std::process::Command,
    deadline: std::time::Duration,
) -> std::io::Result<Option<std::process::Output>> {
    use std::io::Read;
    use std::process::Stdio;
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    tracegate_trace::child::in_own_group(cmd);
    let start = std::time::Instant::now();
    let mut child = cmd.spawn()?;
    let reader = |pipe: Option<Box<dyn Read + Send>>, max: u64| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(p) = pipe {
                let _ = p.take(max).read_to_end(&mut buf);
            }
            buf
        })
    };
    let out = reader(
        child.stdout.take().map(|p| Box::new(p) as _),
        TEXT_STDOUT_MAX,
    );
    let err = reader(
        child.stderr.take().map(|p| Box::new(p) as _),
        TEXT_STDERR_MAX,
    );
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break Some(status);
        }
        if start.elapsed() >= deadline {
            break None;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    };
    // The group goes in either case: nothing it started outlives the answer, and no pipe is
    // held open for the readers.
    // SAFETY: kill(2) of the group this function created (the child's pid is its id).
    unsafe {
        libc::kill(-(child.id() as libc::pid_t), libc::SIGKILL);
    }
    let status = match status {
        Some(s) => s,
        None => {
            child.wait()?;
            let _ = (out.join(), err.join());
            return Ok(None);
        }
    };
    Ok(Some(std::process::Output {
        status,
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
    }))
}

/// `--text`: the ids of `text` by the model's own tokenizer, and the provenance record
/// `prompt_text`, from `python -m tracegate.text` — one tokenization for every producer, so the
/// engine's ids are the contract's and the oracle's. It runs under a deadline: TRACEGATE_TEXT_TIMEOUT
/// (its own limit) plus TEXT_START_GRACE_S.
fn tokenize(
    model: &std::path::Path,
    text: &str,
    chat: bool,
) -> Result<(Vec<i64>, serde_json::Value), tracegate_engine::Error> {
    let refuse = |what: String| tracegate_engine::Error::Input(format!("--text: {what}"));
    let limit = tracegate_trace::settings::raw(TEXT_TIMEOUT_VAR)
        .and_then(|v| text_timeout(v.as_deref()))
        .map_err(tracegate_engine::Error::Input)?;
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
    let deadline = limit + TEXT_START_GRACE_S;
    let out = run_with_deadline(&mut cmd, std::time::Duration::from_secs(deadline))
        .map_err(|e| refuse(format!("cannot run {python} -m tracegate.text: {e} (set TRACEGATE_PYTHON to a Python with tracegate and transformers)")))?
        .ok_or_else(|| refuse(format!(
            "{python} -m tracegate.text did not finish within {deadline} s ({TEXT_TIMEOUT_VAR}={limit} s, and {TEXT_START_GRACE_S} s to start) and was killed"
        )))?;
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

    /// TRACEGATE_TEXT_TIMEOUT is read as tracegate.text reads it: whole seconds ≥ 1 or refused.
    #[test]
    fn text_timeout_is_read_strictly() {
        assert_eq!(super::text_timeout(None), Ok(60));
        assert_eq!(super::text_timeout(Some("5")), Ok(5));
        for bad in ["", "0", "1s", "-1", "1.5", " 5", "+5", "abc"] {
            let e = super::text_timeout(Some(bad)).unwrap_err();
            assert!(
                e.starts_with(&format!("TRACEGATE_TEXT_TIMEOUT={bad:?} is not accepted: "))
                    && !e.contains('\n'),
                "{e}"
            );
        }
    }

    /// The helper that does not answer is killed at the deadline, with what it started (a
    /// `sleep` in its group holding the pipes); one that answers gives its output (the negative
    /// control).
    #[test]
    fn the_text_helper_runs_under_a_deadline() {
        let t = std::time::Instant::now();
        let mut cmd = std::process::Command::new("sh");
        cmd.args(["-c", "sleep 60 & sleep 60"]);
        let got =
            super::run_with_deadline(&mut cmd, std::time::Duration::from_millis(300)).unwrap();
        assert!(got.is_none());
        assert!(
            t.elapsed() < std::time::Duration::from_secs(30),
            "{:?}",
            t.elapsed()
        );

        let mut cmd = std::process::Command::new("sh");
        cmd.args(["-c", "echo ids; echo why >&2; exit 3"]);
        let out = super::run_with_deadline(&mut cmd, std::time::Duration::from_secs(60))
            .unwrap()
            .expect("it answered");
        assert_eq!(out.status.code(), Some(3));
        assert_eq!(
            (&out.stdout[..], &out.stderr[..]),
            (&b"ids\n"[..], &b"why\n"[..])
        );
    }

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
