//! `gate`: run milestones on frozen prompts, re-derive every milestone, bisect a divergence.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use tracegate_gate::milestone::check::Check;
use tracegate_gate::milestone::run::{run_milestone, GateOptions, MilestoneReport};
use tracegate_gate::milestone::{milestones::MilestoneFile, render};
use tracegate_gate::paths::UserPaths;
use tracegate_gate::{find_root, gerr, Error};
use tracegate_producers::DEFAULT_TIMEOUT_S;
use tracegate_trace::output::printable;

#[derive(Parser)]
#[command(
    name = "gate",
    version,
    about = "tracegate gates: claims about producers, checked exactly every time",
    after_help = "Exit codes: 0 every check passed; 1 a check failed (or none ran); 2 refused (bad arguments, \
unknown prompt id, prompt file changed without --bless, unreadable files); 4 nothing failed but some check \
was NOT CHECKED (its reason is printed)."
)]
struct Cli {
    /// Project root (default: the nearest ancestor of the current directory with milestones.json;
    /// for init, the current directory).
    #[arg(long, global = true)]
    root: Option<PathBuf>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Args, Clone)]
struct RunArgs {
    /// Prompt set: a name under fixtures/prompts/ (e.g. frozen) or a path to a prompt file
    /// (default: the milestone's own set, milestones.json prompts.set).
    #[arg(long)]
    prompts: Option<String>,
    /// Only these prompt ids (comma separated); an unknown id is refused.
    #[arg(long, value_delimiter = ',')]
    only: Option<Vec<String>>,
    /// Write the full JSON report here (relative to the current directory).
    #[arg(long)]
    report: Option<PathBuf>,
    /// Also write the report as one self-contained HTML page (relative to the current
    /// directory): the milestone table per prompt and check linked to the findings, the oracle
    /// agreement, the baselines with their deltas (docs/gate.md, "HTML report"). m0, m1, run only.
    #[arg(long, value_name = "OUT.html")]
    html: Option<PathBuf>,
    /// Also write the checks as JUnit XML (relative to the current directory): a test case per
    /// prompt and check and per baseline, FAIL a failure and NOT CHECKED a skipped case, each
    /// with its detail (docs/ci.md). Under GitHub Actions (GITHUB_ACTIONS=true) the gate also
    /// prints an ::error line per FAIL and a ::warning line per NOT CHECKED.
    #[arg(long, value_name = "OUT.xml")]
    junit: Option<PathBuf>,
    /// Accept this run as the new expectation: rewrite milestones.json and baselines.json and print what changed.
    #[arg(long)]
    bless: bool,
    /// Greedy tokens per prompt (default: the milestone's).
    #[arg(long)]
    generate: Option<usize>,
    /// Run the milestone's checks on this checkpoint instead, for the milestone's model of its
    /// family only (relative to the current directory).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Engine threads (at least 1).
    #[arg(long, default_value_t = 1, value_parser = at_least_one)]
    threads: usize,
    /// Also assert observed seconds and peak RSS within this relative tolerance (e.g. 0.5 = ±50%).
    #[arg(long)]
    assert_observed: Option<f64>,
    /// Contract producer command template ({verb} and {args} are filled in).
    #[arg(long)]
    contract_cmd: Option<String>,
    /// Oracle producer command template ({verb} and {args} are filled in).
    #[arg(long)]
    oracle_cmd: Option<String>,
    /// Trace directory (default: target/gate under the root; a DIR given is relative to the
    /// current directory): traces go to DIR/<milestone>/<prompt>/, emptied first. Locked for
    /// the run; a second run on the same directory is refused.
    #[arg(long)]
    work: Option<PathBuf>,
    /// Seconds each producer run may take before it is killed and the run refused.
    #[arg(long, default_value_t = DEFAULT_TIMEOUT_S, value_parser = at_least_one_u64)]
    timeout: u64,
}

#[derive(Args, Clone)]
struct InitArgs {
    /// The model directory (HF layout: config.json + *.safetensors), or a GGUF file (or a
    /// directory holding one; docs/numerics.md §21), relative to the current directory; recorded
    /// relative to the project root when it lies inside it.
    #[arg(long)]
    model: PathBuf,
    /// Your engine's producer command template, run in the project root, e.g.
    /// 'my-engine {verb} {args}' (docs/producers.md).
    #[arg(long)]
    candidate_cmd: String,
    /// Prompt file (relative to the current directory; docs/gate.md, "Prompt sets"). Default:
    /// tracegate's frozen set, copied to prompts.json. One outside the project is copied there.
    #[arg(long)]
    prompts: Option<PathBuf>,
    /// Greedy tokens per prompt.
    #[arg(long, default_value_t = 8)]
    generate: usize,
    /// The capture points of the golden traces and the candidate's runs.
    #[arg(long, default_value = "default", value_parser = ["default", "internals"])]
    capture: String,
    /// Who records the golden traces: the oracle (transformers' own class, from tracegate's
    /// installation) or cmd (--reference-cmd).
    #[arg(long, default_value = "oracle", value_parser = ["oracle", "cmd"])]
    reference: String,
    /// The reference's command template, with --reference cmd.
    #[arg(long)]
    reference_cmd: Option<String>,
    /// The oracle's compute dtype for the golden traces.
    #[arg(long, default_value = "f32", value_parser = ["f32", "bf16", "f16"])]
    dtype: String,
    /// The oracle's device for the golden traces.
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda"])]
    device: String,
    /// The candidate writes the same trace on every run: `stable` is then a check (otherwise
    /// its digest is an observation).
    #[arg(long)]
    deterministic: bool,
    /// Judge by this policy: a bundled name (f32, bf16, f16, q8) or a file relative to the
    /// project root. Default: the bundled policy of --precision.
    #[arg(long, conflicts_with = "precision")]
    policy: Option<String>,
    /// The precision you claim the port computes in (f32, f16, bf16, q8), recorded in
    /// milestones.json as the policy it is judged by. Default: --dtype (f32). What the port's
    /// traces declare or store is checked against it, never read as a looser claim.
    #[arg(long, value_parser = precision_claim)]
    precision: Option<String>,
    /// The milestone's id.
    #[arg(long, default_value = "port")]
    id: String,
    /// The candidate is sharded over N ranks: each `trace` run gets an --out holding `{rank}`
    /// and writes one trace per rank there (0..N-1), which the gate merges as trace-merge does
    /// and judges against the one-process golden trace (docs/producers.md, "Sharded engines").
    #[arg(long, value_name = "N", value_parser = at_least_one_u64)]
    ranks: Option<u64>,
    /// Trace directory (default: target/gate under the project root).
    #[arg(long)]
    work: Option<PathBuf>,
    /// Seconds each producer run may take before it is killed and init refused.
    #[arg(long, default_value_t = DEFAULT_TIMEOUT_S, value_parser = at_least_one_u64)]
    timeout: u64,
}

#[derive(Args, Clone)]
struct BisectArgs {
    /// Model directory (HF layout), relative to the current directory.
    #[arg(long)]
    model: PathBuf,
    /// Prompt token ids, comma separated (or --prompt).
    #[arg(long, conflicts_with = "prompt")]
    tokens: Option<String>,
    /// A prompt id from --prompts (e.g. short, mid).
    #[arg(long)]
    prompt: Option<String>,
    /// Prompt set for --prompt: a name under fixtures/prompts/ or a path (relative to the current directory).
    #[arg(long, default_value = "frozen")]
    prompts: String,
    /// Reference producer: engine, contract, oracle or cmd (then --reference-cmd); or trace:PATH,
    /// a whole trace recorded before (relative to the current directory), which supplies the
    /// prompt, --generate, --capture and a block-diffusion model's --seed unless they are given
    /// (docs/bisect.md, "A stored reference").
    #[arg(long)]
    reference: String,
    /// Candidate producer: engine, contract, oracle or cmd (then --candidate-cmd).
    #[arg(long)]
    candidate: String,
    /// Reference command template ({verb} and {args} are filled in; docs/producers.md).
    #[arg(long)]
    reference_cmd: Option<String>,
    /// Candidate command template, e.g. 'my-engine {verb} {args}'.
    #[arg(long)]
    candidate_cmd: Option<String>,
    /// Judge by this policy: a bundled name (f32, bf16, f16, q8) or a file (relative to the current
    /// directory). Default: by bits when both sides are ordered producers (engine, contract),
    /// else by the bundled policy for the claimed --precision (docs/bisect.md, "Judging").
    #[arg(long)]
    policy: Option<PathBuf>,
    /// Judge by bits whatever the pair (a port meant to be bit-exact); not with --policy.
    #[arg(long, conflicts_with = "policy")]
    exact: bool,
    /// The precision you claim the candidate computes in (f32, f16, bf16, q8; default f32):
    /// picks the bundled policy and the ULP the rounding response perturbs by. What the
    /// candidate's trace declares or stores is checked and said, never read as a looser claim
    /// (docs/bisect.md, "Judging").
    #[arg(long, value_parser = precision_claim, conflicts_with = "exact")]
    precision: Option<String>,
    /// Write the JSON report here (schema: docs/bisect.md; relative to the current directory).
    #[arg(long)]
    report: Option<PathBuf>,
    /// Also write the bisection as one self-contained page (docs/bisect.md, "HTML report";
    /// relative to the current directory). Not written when the bisection is refused.
    #[arg(long, value_name = "OUT.html")]
    html: Option<PathBuf>,
    /// Isolate every layer, not only those up to the first diverging one.
    #[arg(long)]
    all_layers: bool,
    /// After the report: is the whole runs' first bit difference a summation order? Its first
    /// differing elements recomputed under the orders real kernels use (docs/diff.md,
    /// "Explaining a difference"; logits and final_norm.out). Text only.
    #[arg(long)]
    explain: bool,
    /// default or internals (q/k/v, attn_probs, router logits, expert outputs: names sub-stages).
    #[arg(long, value_parser = ["default", "internals"])]
    capture: Option<String>,
    /// Chain the reference's layer verb over a 1-ULP perturbation of its input, to scale the difference.
    #[arg(long)]
    calibrate: bool,
    /// Greedy decode steps: once the prefill agrees, name the first diverging step, check the
    /// candidate's cached decode against its full recompute, and isolate layers at that step
    /// (implies --capture internals; docs/bisect.md, "Decode"). On a block-diffusion model: the
    /// new tokens, and the first diverging denoise step or commit pass is bisected instead
    /// (docs/bisect.md, "Block diffusion").
    #[arg(long)]
    generate: Option<usize>,
    /// Seed of the calibration perturbation (default 1); for a sampling model (block diffusion)
    /// also its sampler's seed (default: a stored reference's own, else 0; docs/bisect.md).
    #[arg(long)]
    seed: Option<u64>,
    /// Compare two oracle runs whose stacks differ (torch, transformers, device, …), each
    /// difference stated; one stack in two precisions needs no flag (docs/diff.md, "Comparable").
    #[arg(long)]
    allow_stack_mismatch: bool,
    /// Tracegate's noise run of the reference (the reference model in the claimed precision, by
    /// a reference producer; `gate init` records one per prompt as golden/PROMPT.noise.trace):
    /// the whole runs' comparison reads it for near-ties' honest noise and the policy's noise
    /// ratio (docs/diff.md). Judged by bits, nothing reads it. Relative to the current directory.
    #[arg(long, value_name = "TRACE")]
    noise_reference: Option<PathBuf>,
    /// Engine threads (at least 1).
    #[arg(long, default_value_t = 1, value_parser = at_least_one)]
    threads: usize,
    /// Directory for the traces (relative to the current directory; default
    /// target/bisect/<time>-<pid> under the root); kept, and locked while the bisection runs.
    #[arg(long)]
    work: Option<PathBuf>,
    /// Seconds each producer run may take before it is killed and the bisection refused.
    #[arg(long, default_value_t = DEFAULT_TIMEOUT_S, value_parser = at_least_one_u64)]
    timeout: u64,
    /// Write the first wrong layer as a repro capsule into DIR (new or empty; relative to the
    /// current directory): its input rows, weights, config, outputs, rule and a pytest file,
    /// minimised to the shortest failing prefix (docs/bisect.md, "Capsules").
    #[arg(long, value_name = "DIR")]
    capsule: Option<PathBuf>,
    /// With --capsule: keep every row of the prompt (no minimisation).
    #[arg(long, requires = "capsule")]
    capsule_full: bool,
    /// The candidate's trace verb is sharded over N ranks: its --out holds {rank}, the rank
    /// traces are merged, and the first divergence is named at its rank; a merge refused is the
    /// finding (exit 1). Its layer verb is run unsharded (docs/bisect.md, "Sharded candidates").
    #[arg(long, value_name = "N", value_parser = at_least_one_u64)]
    ranks: Option<u64>,
}

#[derive(Args)]
struct CapsuleRunArgs {
    /// The capsule (`gate bisect --capsule DIR`; relative to the current directory).
    dir: PathBuf,
    /// Candidate producer: engine, contract or cmd (then --candidate-cmd).
    #[arg(long, default_value = "cmd")]
    candidate: String,
    /// Candidate command template, e.g. 'my-engine {verb} {args}'.
    #[arg(long)]
    candidate_cmd: Option<String>,
    /// Write the replay as JSON here (relative to the current directory).
    #[arg(long)]
    report: Option<PathBuf>,
    /// Directory for the replay model and traces (relative to the current directory; default
    /// target/capsule/<time>-<pid> under the root).
    #[arg(long)]
    work: Option<PathBuf>,
    /// Engine threads (at least 1).
    #[arg(long, default_value_t = 1, value_parser = at_least_one)]
    threads: usize,
    /// Seconds the candidate's layer verb may take before it is killed and the replay refused.
    #[arg(long, default_value_t = DEFAULT_TIMEOUT_S, value_parser = at_least_one_u64)]
    timeout: u64,
}

#[derive(Args)]
struct CapsuleExplainArgs {
    /// The capsule (`gate bisect --capsule DIR`; relative to the current directory).
    dir: PathBuf,
    /// The candidate's trace of the capsule's layer on its rows (e.g. `gate capsule run`'s
    /// WORK/capsule.candidate.trace; relative to the current directory).
    #[arg(long, value_name = "TRACE")]
    candidate_trace: PathBuf,
    /// Compare (and explain the first difference of) only the tensors matching GLOB.
    #[arg(long, value_name = "GLOB")]
    only: Option<String>,
    /// Directory for the replay model (relative to the current directory; default
    /// target/capsule/<pid> under the root).
    #[arg(long)]
    work: Option<PathBuf>,
}

#[derive(Subcommand)]
enum CapsuleAction {
    /// Replay the candidate's layer verb on the capsule and judge it under the capsule's rule.
    Run(CapsuleRunArgs),
    /// Is the candidate's first difference from the capsule a summation order? trace-diff
    /// --explain against the capsule's replay model (docs/diff.md, "Explaining a difference").
    /// Exit as trace-diff: 0 identical, 1 different, 2 refused or unreadable, 3 incomparable.
    Explain(CapsuleExplainArgs),
}

fn at_least_one(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!("{s:?} is not a whole number of at least 1")),
    }
}

fn at_least_one_u64(s: &str) -> Result<u64, String> {
    at_least_one(s).map(|n| n as u64)
}

#[derive(Subcommand)]
enum Cmd {
    /// Milestone m0: the dense fixtures (tiny-qwen3, tiny-qwen3_5, tiny-llama, tiny-qwen2,
    /// tiny-gemma3) — engine ≡ contract, engine ≈ oracle, generation.
    M0(RunArgs),
    /// Milestone m1: the MoE fixtures (tiny-qwen3-moe, tiny-qwen3_5-moe) — the same checks plus
    /// every router decision.
    M1(RunArgs),
    /// Milestone m2: sharded runs (tp=2, ep=2) — the merged rank traces of the engine ≡ the
    /// unsharded engine ≡ the merged contract, the merged oracle ≈ the unsharded oracle, and each
    /// rank holding its part (docs/gate.md, "m2").
    M2(RunArgs),
    /// Gate your own engine: in your project directory (not tracegate's), record golden
    /// reference traces (transformers' own class by default) and write milestones.json (one
    /// milestone, `port`) and baselines.json; then `gate run port` checks your engine against
    /// them in your CI, with no torch (docs/gate.md, "Gate your own engine").
    Init(InitArgs),
    /// Run any milestone of milestones.json by id (a port milestone from `gate init` too).
    Run {
        id: String,
        #[command(flatten)]
        args: RunArgs,
    },
    /// Re-derive every milestone: per milestone, stable / matches / agrees.
    Check {
        #[command(flatten)]
        args: RunArgs,
    },
    /// Name the first layer whose body is wrong: whole traces, then the candidate's layer verb on
    /// the reference's input to each layer (docs/bisect.md). Exit 0 nothing wrong, 1 wrong layer,
    /// inconsistent producer or divergence, 2 refused, 4 isolation NOT CHECKED, 6 the cached
    /// decode path disagrees with the full recompute (--generate).
    Bisect(BisectArgs),
    /// A repro capsule (`gate bisect --capsule DIR`): `gate capsule run DIR --candidate-cmd T`
    /// replays the candidate's layer verb on it with nothing but the capsule (docs/bisect.md,
    /// "Capsules"). Exit 0 the layer passes, 1 it is still wrong, 2 refused (a changed file).
    Capsule {
        #[command(subcommand)]
        action: CapsuleAction,
    },
    /// List the resident contract and oracle workers (pid, command, started, idle for, RSS), or
    /// end them all with `gate workers stop` (docs/producers.md, "Resident workers").
    Workers {
        #[command(subcommand)]
        action: Option<WorkersAction>,
    },
}

#[derive(Subcommand)]
enum WorkersAction {
    /// End every resident worker of this user (says how many).
    Stop,
}

/// A `--prompts` value: a set name stays a name; a path is taken from where the gate started.
fn prompts_arg(up: &UserPaths, spec: &str) -> String {
    if tracegate_gate::prompts::is_path(spec) {
        up.resolve(std::path::Path::new(spec)).display().to_string()
    } else {
        spec.to_string()
    }
}

fn bisect(root: &std::path::Path, up: &UserPaths, a: &BisectArgs) -> Result<i32, Error> {
    let report = a.report.as_ref().map(|p| up.absolute(p));
    let html = a.html.as_ref().map(|p| up.absolute(p));
    // Refused before any producer runs: a report that cannot be written would lose the bisection.
    check_outputs(
        root,
        &[("--report", report.as_ref()), ("--html", html.as_ref())],
    )?;
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0);
    let work = a
        .work
        .as_ref()
        .map(|w| up.resolve(w).display().to_string())
        .unwrap_or_else(|| format!("target/bisect/{stamp}-{}", std::process::id()));
    // A CI job that asked for a report gets one saying why there is no bisection.
    let refused = |err: Error| -> Error {
        let refused = serde_json::json!({
            "schema": tracegate_gate::bisect::SCHEMA, "verdict": "refused", "exit_code": 2, "summary": err.to_string(),
            "work_dir": work, "timeout_s": a.timeout, "gate_invocation": std::env::args().collect::<Vec<_>>(),
        });
        match write_report(&report, &refused) {
            Ok(()) => err,
            Err(e) => e,
        }
    };
    let o = bisect_options(root, up, a, &work).map_err(refused)?;
    let rep = tracegate_gate::bisect::run(&o).map_err(refused)?;
    let mut text = tracegate_gate::bisect::render::render(&rep);
    if a.explain {
        // The whole runs' traces, as bisect/prefill/whole.rs names them in the work directory.
        let whole = root.join(&rep.work_dir);
        text.push_str(&tracegate_diff::explain::explain_files(
            &whole.join("reference.trace"),
            &whole.join("candidate.trace"),
            rep.whole_run
                .first_bit_difference
                .as_ref()
                .map(|d| d.tensor.as_str()),
            Some(&root.join(&rep.model)),
        ));
    }
    let printed = say(&text);
    let mut files = Vec::new();
    if let Some(p) = &report {
        files.push(Output::json(p, &rep)?);
    }
    if let Some(p) = &html {
        files.push(Output::html(
            p,
            tracegate_gate::bisect::html::render_html(&rep),
        ));
    }
    write_outputs(&files)?;
    printed?;
    if let Some(dir) = &a.capsule {
        let dir = up.absolute(dir);
        let words = match tracegate_gate::bisect::capsule::write(&o, &rep, &dir, !a.capsule_full)? {
            Ok(w) => w.words(),
            Err(why) => format!("capsule NOT WRITTEN: {why}"),
        };
        say(&format!("{words}\n"))?;
    }
    Ok(rep.exit_code)
}

fn capsule_run(root: &std::path::Path, up: &UserPaths, a: &CapsuleRunArgs) -> Result<i32, Error> {
    let report = a.report.as_ref().map(|p| up.absolute(p));
    check_outputs(root, &[("--report", report.as_ref())])?;
    let candidate = tracegate_gate::bisect::producer(
        root,
        &a.candidate,
        a.candidate_cmd.as_deref(),
        "candidate",
        a.threads,
    )?;
    let work = match &a.work {
        Some(w) => up.resolve(w).display().to_string(),
        None => format!("target/capsule/{}", std::process::id()),
    };
    let _lock = tracegate_gate::WorkLock::acquire(&root.join(&work))?;
    let done = tracegate_gate::bisect::capsule::run(
        root,
        &up.absolute(&a.dir),
        &candidate,
        &work,
        std::time::Duration::from_secs(a.timeout),
    )?;
    say(&done.text)?;
    write_report(&report, &done)?;
    Ok(done.exit_code)
}

fn capsule_explain(
    root: &std::path::Path,
    up: &UserPaths,
    a: &CapsuleExplainArgs,
) -> Result<i32, Error> {
    let work = match &a.work {
        Some(w) => up.resolve(w).display().to_string(),
        None => format!("target/capsule/{}", std::process::id()),
    };
    let _lock = tracegate_gate::WorkLock::acquire(&root.join(&work))?;
    let done = tracegate_gate::bisect::capsule::explain(
        root,
        &up.absolute(&a.dir),
        &up.absolute(&a.candidate_trace),
        a.only.as_deref(),
        &work,
    )?;
    say(&done.text)?;
    Ok(done.exit_code)
}

/// The bisection `a` asks for; a stored reference (`--reference trace:PATH`) supplies the prompt,
/// --generate and --capture that were not given.
fn bisect_options(
    root: &std::path::Path,
    up: &UserPaths,
    a: &BisectArgs,
    work: &str,
) -> Result<tracegate_gate::bisect::BisectOptions, Error> {
    use tracegate_gate::{bisect, prompts};
    let stored = match a.reference.strip_prefix("trace:") {
        Some(_) if a.reference_cmd.is_some() => {
            return Err(gerr!("--reference-cmd: a stored reference (--reference {}) runs no command; give one or the other", a.reference))
        }
        Some("") => return Err(gerr!("--reference trace:PATH needs a path after trace:")),
        Some(p) => Some(bisect::StoredReference::open(
            &up.resolve(std::path::Path::new(p)),
            p,
        )?),
        None => None,
    };
    let tokens = match (&a.tokens, &a.prompt, &stored) {
        (Some(t), None, _) => tracegate_producers::parse_tokens(t)?,
        (None, Some(id), _) => prompts::load(&prompts::resolve(root, &prompts_arg(up, &a.prompts)))
            .and_then(|s| {
                s.token_ids_only("gate bisect")?;
                s.get(id).map(|p| p.tokens.clone())
            })?,
        (None, None, Some(s)) => s.tokens.clone(),
        _ => return Err(gerr!("bisect needs --tokens IDS or --prompt ID")),
    };
    let generate = a
        .generate
        .or(stored.as_ref().map(|s| s.generate))
        .unwrap_or(0);
    let internals = match a.capture.as_deref() {
        Some(c) => c == "internals",
        None => stored.as_ref().is_some_and(|s| s.internals),
    };
    // A stored reference of the default capture (`gate init`'s golden traces) is bisected with
    // what it holds: --generate does not imply internals for it (docs/bisect.md).
    let stored_default = stored.as_ref().is_some_and(|s| !s.internals);
    let model = up.resolve(&a.model).display().to_string();
    let sampler_seed = a.seed.or(stored.as_ref().and_then(|s| s.seed)).unwrap_or(0);
    Ok(bisect::BisectOptions {
        root: root.to_path_buf(),
        model: model.clone(),
        tokens,
        prompt: a.prompt.clone(),
        reference: match stored {
            Some(s) => bisect::Reference::Stored(s),
            None => bisect::Reference::Run(bisect::producer(
                root,
                &a.reference,
                a.reference_cmd.as_deref(),
                "reference",
                a.threads,
            )?),
        },
        candidate: bisect::producer(
            root,
            &a.candidate,
            a.candidate_cmd.as_deref(),
            "candidate",
            a.threads,
        )?,
        policy: a.policy.as_ref().map(|p| match p.to_str() {
            Some(name)
                if tracegate_diff::Policy::is_name(name)
                    || tracegate_diff::Policy::is_claim(name) =>
            {
                name.to_string()
            }
            _ => up.resolve(p).display().to_string(),
        }),
        exact: a.exact,
        precision: a.precision.clone(),
        all_layers: a.all_layers,
        // Decode steps capture their layer points only under internals (docs/producers.md).
        internals: internals || (generate > 0 && !stored_default),
        calibrate: a.calibrate,
        generate,
        seed: a.seed.unwrap_or(1),
        sampling: bisect::samples(root, &model)?,
        sampler_seed,
        work: work.to_string(),
        timeout: std::time::Duration::from_secs(a.timeout),
        gate_invocation: std::env::args().collect(),
        allow_stack_mismatch: a.allow_stack_mismatch,
        ranks: a.ranks,
        noise: match &a.noise_reference {
            None => None,
            Some(p) => {
                let path = up.resolve(p);
                let t = tracegate_trace::Trace::open(&path)
                    .and_then(|t| t.verify().map(|()| t))
                    .map_err(|e| gerr!("--noise-reference {}: {e}", path.display()))?;
                Some(tracegate_diff::NoiseReference(std::sync::Arc::new(t)))
            }
        },
    })
}

fn options(root: &std::path::Path, up: &UserPaths, id: &str, a: &RunArgs) -> GateOptions {
    GateOptions {
        root: root.to_path_buf(),
        milestone: id.to_string(),
        prompts: a.prompts.as_ref().map(|p| prompts_arg(up, p)),
        only: a.only.clone(),
        bless: a.bless,
        generate: a.generate,
        model: a.model.as_ref().map(|m| up.resolve(m)),
        threads: a.threads,
        assert_observed: a.assert_observed,
        contract_cmd: a.contract_cmd.clone(),
        oracle_cmd: a.oracle_cmd.clone(),
        work: a
            .work
            .as_ref()
            .map(|w| up.resolve(w).display().to_string())
            .unwrap_or_else(|| "target/gate".into()),
        timeout: std::time::Duration::from_secs(a.timeout),
        gate_invocation: std::env::args().collect(),
        milestones: None,
        baselines: None,
    }
}

fn write_report(path: &Option<PathBuf>, value: &impl serde::Serialize) -> Result<(), Error> {
    match path {
        Some(p) => write_outputs(&[Output::json(p, value)?]),
        None => Ok(()),
    }
}

/// Refuses, before anything runs, an output location that cannot take a file: a missing parent
/// directory, a parent that is not a directory, or a path that is a directory. Found after the
/// work, it would cost the whole run.
fn check_outputs(
    root: &std::path::Path,
    outputs: &[(&str, Option<&PathBuf>)],
) -> Result<(), Error> {
    // Neither output may be the other, nor a file the gate reads and a user keeps.
    let named: Vec<(&str, &std::path::Path)> = outputs
        .iter()
        .filter_map(|(flag, p)| p.map(|p| (*flag, p.as_path())))
        .collect();
    let (milestones, baselines) = (root.join("milestones.json"), root.join("baselines.json"));
    let kept = [
        ("milestones file", milestones.as_path()),
        ("baselines file", baselines.as_path()),
    ];
    tracegate_trace::output::refuse_clobbering(&named, &kept).map_err(|e| gerr!("{e}"))?;
    for (flag, p) in outputs {
        let Some(p) = p else { continue };
        if p.is_dir() {
            return Err(gerr!("{flag} {}: is a directory", p.display()));
        }
        let dir = p
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(std::path::Path::new("."));
        if !dir.is_dir() {
            let what = if dir.exists() {
                "is not a directory"
            } else {
                "does not exist"
            };
            return Err(gerr!(
                "{flag} {}: directory {} {what}",
                p.display(),
                dir.display()
            ));
        }
    }
    Ok(())
}

/// A report file: where it goes, what it holds, and what the run says once it is written.
struct Output {
    path: PathBuf,
    bytes: Vec<u8>,
    what: &'static str,
}

impl Output {
    fn json(path: &std::path::Path, value: &impl serde::Serialize) -> Result<Output, Error> {
        Ok(Output {
            path: path.to_path_buf(),
            bytes: tracegate_gate::json_bytes(path, value)?,
            what: "report",
        })
    }
    fn html(path: &std::path::Path, page: String) -> Output {
        Output {
            path: path.to_path_buf(),
            bytes: page.into_bytes(),
            what: "HTML report",
        }
    }
    fn junit(path: &std::path::Path, reps: &[MilestoneReport]) -> Output {
        Output {
            path: path.to_path_buf(),
            bytes: tracegate_gate::milestone::ci::junit(reps).into_bytes(),
            what: "JUnit report",
        }
    }
}

/// Every report of a run, or none: a JSON report saying exit 0 beside a page that could not be
/// written (and an exit status of 2) would be two answers.
fn write_outputs(files: &[Output]) -> Result<(), Error> {
    let refs: Vec<(&std::path::Path, &[u8])> = files
        .iter()
        .map(|f| (f.path.as_path(), f.bytes.as_slice()))
        .collect();
    tracegate_gate::write_files(&refs)?;
    for f in files {
        eprintln!("{} written to {}", f.what, f.path.display());
    }
    Ok(())
}

/// Prints the text output. A closed stdout (`| head`, `| true`) drops it and the run goes on
/// (its reports are written, its exit status stands); another write error is exit 2 once the
/// reports are written.
fn say(text: &str) -> Result<(), Error> {
    // The text quotes producers' output and names read from traces: shown, never obeyed.
    tracegate_trace::output::print(&printable(text))
        .map_err(|e| gerr!(File: "cannot write to stdout: {e}"))
}

/// One milestone, every model of it: each model's report printed, and its HTML page when asked
/// for (not yet written: the caller writes the pages with the JSON report, all or none).
fn run_one(root: &std::path::Path, up: &UserPaths, id: &str, a: &RunArgs) -> Result<Run, Error> {
    let (report, html, junit) = (
        a.report.as_ref().map(|p| up.absolute(p)),
        a.html.as_ref().map(|p| up.absolute(p)),
        a.junit.as_ref().map(|p| up.absolute(p)),
    );
    check_outputs(
        root,
        &[
            ("--report", report.as_ref()),
            ("--html", html.as_ref()),
            ("--junit", junit.as_ref()),
        ],
    )?;
    let (reps, bless_log) = run_milestone(&options(root, up, id, a))?;
    if let Some(hint) = tracegate_gate::milestone::threads::for_reports(&reps) {
        eprintln!("[gate {id}] {hint}");
    }
    let mut text = String::new();
    for rep in &reps {
        text.push_str(&render::render(rep));
    }
    if reps.len() > 1 {
        text.push_str(&overall_line(id, &reps));
    }
    let mut pages = Vec::new();
    if let Some(p) = &a.html {
        let p = up.absolute(p);
        for rep in &reps {
            // Several models: one page each, the model's directory name before the extension,
            // and a sharded run's split (m2: `tp2`, `ep2` of one model), so no page replaces another.
            let page = if reps.len() == 1 {
                p.clone()
            } else {
                let model = tracegate_gate::milestone::run::dir_name(&rep.model);
                let split = rep
                    .shards
                    .as_ref()
                    .map(|s| format!(".{}", s.replace('=', "")));
                html_path(&p, &format!("{model}{}", split.unwrap_or_default()))
            };
            pages.push(Output::html(&page, render::render_html(rep)));
        }
    }
    if let Some(log) = bless_log {
        text.push_str(&format!(
            "\nblessed (milestones.json, baselines.json):\n{log}\n"
        ));
    }
    let printed = say(&text);
    Ok(Run {
        reps,
        pages,
        printed,
    })
}

/// A milestone's run: its reports, the HTML pages to write, and whether stdout took the text.
struct Run {
    reps: Vec<MilestoneReport>,
    pages: Vec<Output>,
    printed: Result<(), Error>,
}

/// A milestone run's pages, JSON report (an array, one report per model) and JUnit XML, all or
/// none; under GitHub Actions its annotations; the exit code of the worst model.
fn finish_run(run: Run, up: &UserPaths, a: &RunArgs) -> Result<i32, Error> {
    let mut files = run.pages;
    if let Some(p) = &a.report {
        files.push(Output::json(&up.absolute(p), &run.reps)?);
    }
    if let Some(p) = &a.junit {
        files.push(Output::junit(&up.absolute(p), &run.reps));
    }
    write_outputs(&files)?;
    let annotated = annotate(&run.reps);
    run.printed.and(annotated).map(|()| worst_exit(&run.reps))
}

/// Under GitHub Actions: an ::error line per FAIL and a ::warning per NOT CHECKED, on stdout
/// after the text (where the runner reads workflow commands).
fn annotate(reps: &[MilestoneReport]) -> Result<(), Error> {
    if !tracegate_gate::milestone::ci::on_github_actions().map_err(|e| gerr!("{e}"))? {
        return Ok(());
    }
    let lines = tracegate_gate::milestone::ci::github_annotations(reps);
    if lines.is_empty() {
        return Ok(());
    }
    say(&(lines.join("\n") + "\n"))
}

/// `OUT.html` → `OUT.<model>.html`.
fn html_path(p: &std::path::Path, model: &str) -> PathBuf {
    let stem = p.file_stem().unwrap_or_default().to_string_lossy();
    let name = match p.extension() {
        Some(ext) => format!("{stem}.{model}.{}", ext.to_string_lossy()),
        None => format!("{stem}.{model}"),
    };
    p.with_file_name(name)
}

/// Several models: one line that sums every report's checks, so the last line is the verdict.
fn overall_line(id: &str, reps: &[MilestoneReport]) -> String {
    use tracegate_gate::milestone::run::Status;
    let n = |s: Status| -> usize { reps.iter().filter_map(|r| r.totals.get(&s)).sum() };
    let verdict = match worst_exit(reps) {
        0 => "PASS",
        4 => "INCOMPLETE",
        _ => "FAIL",
    };
    format!(
        "\ngate {id}, {} models: {verdict} — {} PASS, {} FAIL, {} NOT CHECKED\n",
        reps.len(),
        n(Status::Pass),
        n(Status::Fail),
        n(Status::NotChecked)
    )
}

/// The exit code of a run of several reports: 1 if any failed, else 4 if any was incomplete.
fn worst_exit(reps: &[MilestoneReport]) -> i32 {
    let codes: Vec<i32> = reps.iter().map(MilestoneReport::exit_code).collect();
    if codes.iter().any(|&c| c != 0 && c != 4) {
        1
    } else if codes.contains(&4) {
        4
    } else {
        0
    }
}

/// The three answers `gate check` gives per milestone, over every model's report.
fn answer(reps: &[MilestoneReport], checks: &[Check]) -> (&'static str, String) {
    use tracegate_gate::milestone::run::Status;
    let relevant: Vec<_> = reps
        .iter()
        .flat_map(|r| {
            r.prompts
                .iter()
                .flat_map(move |p| p.checks.iter().map(move |c| (r, p, c)))
        })
        .filter(|(_, _, c)| checks.contains(&c.check))
        .collect();
    let at = |r: &MilestoneReport, p: &str, c: &Check| {
        format!(
            "{} {p}/{c}",
            tracegate_gate::milestone::run::dir_name(&r.model)
        )
    };
    if let Some((r, p, c)) = relevant.iter().find(|(_, _, c)| c.status == Status::Fail) {
        return ("FAIL", format!("{}: {}", at(r, &p.id, &c.check), c.detail));
    }
    if let Some((r, p, c)) = relevant
        .iter()
        .find(|(_, _, c)| c.status == Status::NotChecked)
    {
        return (
            "NOT CHECKED",
            format!("{}: {}", at(r, &p.id, &c.check), c.detail),
        );
    }
    if relevant.is_empty() {
        // Not a check that did not run: one this milestone does not state (a port whose
        // candidate is not declared deterministic has no `stable`). Its exit code is the runs'.
        return ("NOT CLAIMED", "the milestone states no such check".into());
    }
    let per_model: Vec<String> = reps
        .iter()
        .map(|r| {
            format!(
                "{} {} prompts",
                tracegate_gate::milestone::run::dir_name(&r.model),
                r.prompts.len()
            )
        })
        .collect();
    ("PASS", per_model.join(", "))
}

fn main() -> ExitCode {
    if std::env::args_os()
        .nth(1)
        .is_some_and(|a| a == tracegate_producers::ENGINE_CHILD)
    {
        return engine_child();
    }
    if std::env::args_os()
        .nth(1)
        .is_some_and(|a| a == tracegate_producers::resident::RESIDENT_CHILD)
    {
        let args: Vec<String> = std::env::args_os()
            .skip(2)
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        return ExitCode::from(tracegate_producers::resident::daemon_main(&args) as u8);
    }
    let cli = Cli::parse();
    // Every setting read from the environment, strictly, before anything runs (issue 51).
    if let Err(e) = tracegate_producers::settings::check() {
        eprintln!("gate: {e}");
        return ExitCode::from(2);
    }
    // Needs no project: the runtime directory is the user's.
    if let Cmd::Workers { action } = &cli.cmd {
        let stop = matches!(action, Some(WorkersAction::Stop));
        return match tracegate_producers::resident::workers_verb(stop) {
            Ok(text) => match say(&format!("{text}\n")) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("gate workers: {e}");
                    ExitCode::from(2)
                }
            },
            Err(e) => {
                eprintln!("gate workers: {e}");
                ExitCode::from(2)
            }
        };
    }
    if let Cmd::Init(a) = &cli.cmd {
        let code = match tracegate_gate::milestone::init::run(cli.root.as_deref(), &init_options(a))
        {
            Ok(done) => match say(&done.text) {
                Ok(()) => done.exit_code,
                Err(e) => {
                    eprintln!("gate init: {e}");
                    2
                }
            },
            Err(e) => {
                eprintln!("gate init: {}", printable(&e.to_string()));
                e.exit_code() as i32
            }
        };
        tracegate_producers::worker::end_own_workers();
        return ExitCode::from(code as u8);
    }
    let root = match cli.root.clone().map(Ok).unwrap_or_else(|| {
        std::env::current_dir()
            .map_err(|e| gerr!("{e}"))
            .and_then(|d| find_root(&d))
    }) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("gate: {e}");
            return ExitCode::from(2);
        }
    };
    // Paths the user typed are taken from here, before the gate moves to the root.
    let up = match std::env::current_dir() {
        Ok(cwd) => UserPaths::new(&cwd, &root),
        Err(e) => {
            eprintln!("gate: the current directory: {e}");
            return ExitCode::from(2);
        }
    };
    // Producers get paths relative to the root, so traces record the same paths (and bytes)
    // wherever the checkout lives.
    if let Err(e) = std::env::set_current_dir(&root) {
        eprintln!("gate: {}: {e}", root.display());
        return ExitCode::from(2);
    }
    let root = PathBuf::from(".");
    // An interrupted init or bless is finished or discarded before anything reads the project.
    if let Err(e) = tracegate_gate::journal::recover(&root) {
        eprintln!("gate: {e}");
        return ExitCode::from(e.exit_code());
    }
    let result = match &cli.cmd {
        Cmd::M0(a) => run_one(&root, &up, "m0", a).and_then(|r| finish_run(r, &up, a)),
        Cmd::M1(a) => run_one(&root, &up, "m1", a).and_then(|r| finish_run(r, &up, a)),
        Cmd::M2(a) => run_one(&root, &up, "m2", a).and_then(|r| finish_run(r, &up, a)),
        Cmd::Run { id, args } => {
            run_one(&root, &up, id, args).and_then(|r| finish_run(r, &up, args))
        }
        Cmd::Bisect(a) => bisect(&root, &up, a),
        Cmd::Capsule {
            action: CapsuleAction::Run(a),
        } => capsule_run(&root, &up, a),
        Cmd::Capsule {
            action: CapsuleAction::Explain(a),
        } => capsule_explain(&root, &up, a),
        Cmd::Workers { .. } | Cmd::Init(_) => Ok(0), // answered above
        Cmd::Check { args } if args.html.is_some() => Err(gerr!(
            "gate check writes no HTML report: run each milestone with gate m0|m1|run --html"
        )),
        Cmd::Check { args } => (|| {
            let file = MilestoneFile::load(&root.join("milestones.json"))?;
            let mut reports = Vec::new();
            let mut table = Vec::new();
            let mut worst = 0;
            let mut stdout = Ok(());
            for m in &file.milestones {
                let Run { reps, printed, .. } = run_one(&root, &up, &m.id, args)?;
                stdout = stdout.and(printed);
                let stable = answer(&reps, &[Check::Stable]);
                let matches = answer(
                    &reps,
                    &[
                        Check::Matches,
                        Check::Generation,
                        Check::MergedEngine,
                        Check::MergedContract,
                        Check::RankShards,
                    ],
                );
                let agrees = answer(
                    &reps,
                    &[
                        Check::Agrees,
                        Check::GenerationOracle,
                        Check::GenerationReference,
                        Check::MergedOracle,
                    ],
                );
                table.push(format!(
                    "{:<4} stable: {:<11} matches: {:<11} agrees: {:<11}\n     stable  — {}\n     matches — {}\n     agrees  — {}",
                    m.id, stable.0, matches.0, agrees.0, stable.1, matches.1, agrees.1
                ));
                worst = worst.max(match worst_exit(&reps) {
                    0 => 0,
                    4 => 1,
                    _ => 2,
                });
                reports.extend(reps);
            }
            let printed = say(&format!(
                "\n== gate check: {} milestones\n{}\n",
                file.milestones.len(),
                table.join("\n")
            ));
            let mut files = Vec::new();
            if let Some(p) = &args.report {
                files.push(Output::json(&up.absolute(p), &reports)?);
            }
            if let Some(p) = &args.junit {
                files.push(Output::junit(&up.absolute(p), &reports));
            }
            write_outputs(&files)?;
            stdout.and(printed).and(annotate(&reports))?;
            Ok(match worst {
                0 => 0,
                1 => 4,
                _ => 1,
            })
        })(),
    };
    let code = match result {
        Ok(code) => ExitCode::from(code as u8),
        Err(e) => {
            // A refusal may quote a producer's output (its stderr is escaped where it is
            // captured) or a file's names: nothing of it drives the terminal.
            eprintln!("gate: {}", printable(&e.to_string()));
            ExitCode::from(e.exit_code())
        }
    };
    // This run's own workers leave with it: none outlives the gate's process.
    tracegate_producers::worker::end_own_workers();
    // Last: what outlives this run and how to stop it (docs/producers.md, "Resident workers").
    if let Some(line) = tracegate_producers::worker::resident_after_run() {
        eprintln!("{line}");
    }
    code
}

/// A `--precision` value: a bundled precision (f32, f16, bf16, q8), or a claim per capture-point
/// pattern, `PATTERN=NAME,...` (first match wins), checked now.
fn precision_claim(v: &str) -> Result<String, String> {
    if tracegate_diff::policy::PRECISIONS.contains(&v) {
        return Ok(v.to_string());
    }
    if tracegate_diff::Policy::is_claim(v) {
        return tracegate_diff::Policy::claimed(v).map(|_| v.to_string());
    }
    Err(format!(
        "expected one of {}, or a claim per pattern such as 'layer.*.attn_probs=f16,**=f32'",
        tracegate_diff::policy::PRECISIONS.join(", ")
    ))
}

fn init_options(a: &InitArgs) -> tracegate_gate::milestone::init::InitOptions {
    tracegate_gate::milestone::init::InitOptions {
        model: a.model.clone(),
        candidate_cmd: a.candidate_cmd.clone(),
        prompts: a.prompts.clone(),
        generate: a.generate,
        capture: a.capture.clone(),
        reference: a.reference.clone(),
        reference_cmd: a.reference_cmd.clone(),
        dtype: a.dtype.clone(),
        device: a.device.clone(),
        deterministic: a.deterministic,
        policy: a.policy.clone(),
        precision: a.precision.clone(),
        id: a.id.clone(),
        ranks: a.ranks,
        work: a.work.clone(),
        timeout: std::time::Duration::from_secs(a.timeout),
    }
}

/// The hidden ENGINE_CHILD verb: the gate's engine producer, in a process of its own. Errors
/// print one line and exit 2, as the `engine` binary's do.
fn engine_child() -> ExitCode {
    let argv: Result<Vec<String>, _> = std::env::args_os()
        .skip(2)
        .map(|a| a.into_string())
        .collect();
    let result = match argv {
        Ok(argv) => tracegate_producers::engine_child(&argv).map_err(Error::from),
        Err(bad) => Err(gerr!("argument {bad:?} is not UTF-8")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("engine: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}
