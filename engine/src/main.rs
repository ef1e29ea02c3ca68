//! `engine` CLI: thin wrapper over the library verbs. Errors print one line and exit 2.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use tracegate_engine::{info, run_layer, run_trace, LayerOptions, TraceOptions};

#[derive(Parser)]
#[command(name = "engine", version, about = "tracegate reference engine (ordered fp32 Qwen3 / Qwen3-MoE)")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Clone, Copy, ValueEnum)]
enum CaptureSet {
    Default,
    Internals,
}

#[derive(Clone, Copy, ValueEnum)]
enum OnOff {
    On,
    Off,
}

fn default_threads() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}

#[derive(Subcommand)]
enum Cmd {
    /// Prefill a prompt (and optionally generate greedily) and write a trace.
    Trace {
        #[arg(long)]
        model: PathBuf,
        /// Prompt token ids, comma separated (e.g. 3,17,5).
        #[arg(long, value_delimiter = ',', allow_negative_numbers = true, required = true)]
        tokens: Vec<i64>,
        #[arg(long)]
        out: PathBuf,
        #[arg(long, value_enum, default_value = "default")]
        capture: CaptureSet,
        /// Greedy decode steps after the prompt (recorded as decisions only).
        #[arg(long, default_value_t = 0)]
        generate: usize,
        #[arg(long, value_enum, default_value = "on")]
        cache: OnOff,
        #[arg(long, default_value_t = default_threads())]
        threads: usize,
    },
    /// Run decoder layer L alone on a tensor of another trace (rows at its positions).
    Layer {
        #[arg(long)]
        model: PathBuf,
        #[arg(long)]
        layer: usize,
        #[arg(long)]
        input: PathBuf,
        #[arg(long)]
        input_name: String,
        #[arg(long)]
        out: PathBuf,
        #[arg(long, value_enum, default_value = "default")]
        capture: CaptureSet,
        #[arg(long, default_value_t = default_threads())]
        threads: usize,
    },
    /// Config summary, weights digest and inventory check.
    Info {
        #[arg(long)]
        model: PathBuf,
    },
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        // Usage errors: one line, exit 2 (help and version print normally).
        Err(e) if e.use_stderr() => {
            let msg = e.to_string();
            eprintln!("engine: {}", msg.lines().next().unwrap_or("invalid arguments").trim_start_matches("error: "));
            return ExitCode::from(2);
        }
        Err(e) => e.exit(),
    };
    let command_line: Vec<String> = std::env::args().collect();
    let result = match cli.cmd {
        Cmd::Trace { model, tokens, out, capture, generate, cache, threads } => run_trace(&TraceOptions {
            model_dir: model,
            tokens,
            out: out.clone(),
            internals: matches!(capture, CaptureSet::Internals),
            generate,
            cache: matches!(cache, OnOff::On),
            threads,
            command_line,
        })
        .map(|d| format!("{} {}", d.hex(), out.display())),
        Cmd::Layer { model, layer, input, input_name, out, capture, threads } => run_layer(&LayerOptions {
            model_dir: model,
            layer,
            input,
            input_name,
            out: out.clone(),
            internals: matches!(capture, CaptureSet::Internals),
            threads,
            command_line,
        })
        .map(|d| format!("{} {}", d.hex(), out.display())),
        Cmd::Info { model } => info(&model).map(|s| s.trim_end().to_string()),
    };
    match result {
        Ok(s) => {
            println!("{s}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("engine: error: {e}");
            ExitCode::from(2)
        }
    }
}
