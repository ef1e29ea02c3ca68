//! `gate init`: a port milestone in the user's own directory (docs/gate.md, "Gate your own
//! engine"). It writes nothing until the first run has recorded everything: the golden reference
//! traces under `golden/`, `milestones.json` (one milestone, `port`, naming the candidate's
//! command, the model, the prompt set by sha256 and the policy for the candidate's precision)
//! and `baselines.json` (and a prompt file from outside the project, copied) — all, or none, at
//! every instant: they are written through one journal (crate::journal), which an interrupted
//! init leaves for the next gate command to finish or discard.

use std::path::{Path, PathBuf};

use tracegate_producers::{install_root, Producer, Verb};

use crate::milestone::milestones::{
    Milestone, MilestoneFile, MilestoneModel, Port, PortCandidate, PortReference, PromptRecord,
};
use crate::milestone::run::{run_milestone, tokenize_text, GateOptions};
use crate::paths::UserPaths;
use crate::{gerr, prompts, Result};

/// What `gate init` was asked (paths relative to where it was started).
pub struct InitOptions {
    pub model: PathBuf,
    pub candidate_cmd: String,
    pub prompts: Option<PathBuf>,
    pub generate: usize,
    pub capture: String,
    pub reference: String,
    pub reference_cmd: Option<String>,
    pub dtype: String,
    pub device: String,
    pub deterministic: bool,
    pub policy: Option<String>,
    /// The claimed precision (`--precision`): the bundled policy recorded, when no `--policy`.
    pub precision: Option<String>,
    pub id: String,
    /// `--ranks N`: the candidate is sharded over N ranks (docs/producers.md, "Sharded engines").
    pub ranks: Option<u64>,
    pub work: Option<PathBuf>,
    pub timeout: std::time::Duration,
}

/// The text to print and the exit code of the first run (0 PASS, 1 FAIL, 4 INCOMPLETE).
pub struct Initialised {
    pub text: String,
    pub exit_code: i32,
}

/// The prompt file a project gets when it names none: tracegate's frozen set.
const DEFAULT_PROMPTS: &str = "prompts.json";

/// Runs `gate init` in `root` (default: the current directory): see the module doc. The gate
/// works from the root from here on, as for every other verb.
pub fn run(root: Option<&Path>, a: &InitOptions) -> Result<Initialised> {
    let cwd = std::env::current_dir().map_err(|e| gerr!("the current directory: {e}"))?;
    let root_abs = root.map_or_else(|| cwd.clone(), |r| cwd.join(r));
    if !root_abs.is_dir() {
        return Err(gerr!("--root {}: not a directory", root_abs.display()));
    }
    let up = UserPaths::new(&cwd, &root_abs);
    // An init or bless interrupted here before is finished or discarded first (crate::journal).
    crate::journal::recover(&root_abs)?;
    for kept in ["milestones.json", "baselines.json", "golden"] {
        if root_abs.join(kept).exists() {
            return Err(gerr!(
                "{} already holds {kept}: this project is initialised (`gate run ID --bless` re-records its golden traces); remove milestones.json, baselines.json and golden/ to start over",
                root_abs.display()
            ));
        }
    }
    if !matches!(a.id.as_str(), id if !id.is_empty() && id.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-'))
    {
        return Err(gerr!("--id {:?}: a milestone id is [A-Za-z0-9_-]+", a.id));
    }
    if a.ranks == Some(0) {
        return Err(gerr!("--ranks 0: a sharded port runs on at least 1 rank"));
    }
    if a.generate == 0 {
        return Err(gerr!(
            "--generate 0: a port milestone claims greedy tokens; give at least 1"
        ));
    }
    let reference_cmd = match (a.reference.as_str(), &a.reference_cmd) {
        ("cmd", Some(cmd)) => {
            Producer::command("reference", cmd).map_err(|e| gerr!("--reference-cmd: {e}"))?;
            Some(cmd.clone())
        }
        ("cmd", None) => {
            return Err(gerr!(
                "--reference cmd needs --reference-cmd 'TEMPLATE' (e.g. 'my-reference {{verb}} {{args}}')"
            ))
        }
        (_, Some(_)) => {
            return Err(gerr!(
                "--reference-cmd: the reference is the oracle; give --reference cmd to run a command"
            ))
        }
        (_, None) => None,
    };
    let candidate = Producer::command("candidate", &a.candidate_cmd)
        .map_err(|e| gerr!("--candidate-cmd: {e}"))?;
    let model = up.resolve(&a.model);
    let (config, config_path) = prompts::model_config(&up.absolute(&a.model))
        .map_err(|e| gerr!("--model {}: {e}", a.model.display()))?;
    let family = prompts::family(&config).to_string();
    let prompt_src = match &a.prompts {
        Some(p) => up.absolute(p),
        None => install_root().join("fixtures/prompts/frozen.json"),
    };
    let mut set = prompts::load(&prompt_src)?;
    // The gate works from the root; a prompt file outside it is copied in, so the project
    // stands alone.
    std::env::set_current_dir(&root_abs).map_err(|e| gerr!("{}: {e}", root_abs.display()))?;
    let root = PathBuf::from(".");
    let model = model.display().to_string();
    // Text prompts get their ids from the model's tokenizer here for the checks below; the
    // first run tokenizes them again and records them with the tokenizer's digest.
    if set.prompts.iter().any(|p| p.text.is_some()) {
        let t = tokenize_text(&root, &model, &set, a.timeout)?;
        for p in set.prompts.iter_mut() {
            if let Some(ids) = t.prompts.get(&p.id) {
                p.tokens = ids.tokens.clone();
            }
        }
    }
    check_vocab(&set, &config, &config_path)?;
    let (prompt_rel, copied) = match up.resolve(&prompt_src) {
        // A bare name would read as a bundled set's (prompts::is_path).
        rel if rel.is_relative() && prompts::is_path(&rel.display().to_string()) => {
            (rel.display().to_string(), None)
        }
        rel if rel.is_relative() => (format!("./{}", rel.display()), None),
        _ => (DEFAULT_PROMPTS.to_string(), Some(prompt_src.clone())),
    };
    if copied.is_some() && Path::new(DEFAULT_PROMPTS).exists() {
        return Err(gerr!(
            "{} already holds {DEFAULT_PROMPTS}: name it with --prompts {DEFAULT_PROMPTS}, or move it away",
            root_abs.display()
        ));
    }
    let work = a
        .work
        .as_ref()
        .map(|w| up.resolve(w).display().to_string())
        .unwrap_or_else(|| "target/gate".into());
    let first = set
        .prompts
        .first()
        .ok_or_else(|| gerr!("{}: no prompts", prompt_src.display()))?;
    let cache_off = answers_cache_off(&root, &candidate, &model, &first.tokens, a, &work)?;
    let claim = format!(
        "On {model} ({family}) and every prompt of {prompt_rel}, the port `{}`{} agrees with {} under the policy for its precision: every tensor within the policy, every decision equal to the golden trace's but for near-ties, and its {} greedy tokens the golden trace's{}.",
        a.candidate_cmd,
        match a.ranks {
            Some(n) => format!(", sharded over {n} ranks (its rank traces merged),"),
            None => String::new(),
        },
        match &reference_cmd {
            Some(cmd) => format!("the reference `{cmd}`"),
            None => format!(
                "transformers' own model class ({}, {})",
                a.dtype, a.device
            ),
        },
        a.generate,
        if cache_off {
            ", the same with and without its KV cache"
        } else {
            ""
        }
    );
    let file = MilestoneFile {
        schema: crate::milestone::milestones::SCHEMA,
        milestones: vec![Milestone {
            id: a.id.clone(),
            claim,
            prompts: PromptRecord {
                set: prompt_rel.clone(),
                sha256: set.sha256.clone(),
                only: None,
            },
            generate: a.generate,
            seed: None,
            capture: None,
            // The user's claim, recorded: never chosen later from what the port's traces say.
            policy: a
                .policy
                .clone()
                .or_else(|| a.precision.clone())
                .unwrap_or_else(|| a.dtype.clone()),
            models: vec![MilestoneModel {
                model: model.clone(),
                family,
                expect: Default::default(),
                declared_divergences: Vec::new(),
                shards: Vec::new(),
            }],
            port: Some(Port {
                noise: Default::default(),
                candidate: PortCandidate {
                    cmd: a.candidate_cmd.clone(),
                    deterministic: a.deterministic,
                    cache_off,
                    ranks: a.ranks,
                },
                reference: PortReference {
                    producer: a.reference.clone(),
                    cmd: reference_cmd,
                    dtype: a.dtype.clone(),
                    device: a.device.clone(),
                },
                capture: a.capture.clone(),
                golden: Default::default(),
                expect: Default::default(),
                tokenized: None,
            }),
        }],
    };
    let o = GateOptions {
        root: root.clone(),
        milestone: a.id.clone(),
        // A prompt file outside the project is read where it is; the first run's bless writes
        // its copy with everything else (run/port.rs).
        prompts: Some(match &copied {
            Some(src) => src.display().to_string(),
            None => prompt_rel.clone(),
        }),
        only: None,
        bless: true,
        generate: None,
        model: None,
        threads: 1,
        assert_observed: None,
        contract_cmd: None,
        oracle_cmd: None,
        work,
        timeout: a.timeout,
        gate_invocation: std::env::args().collect(),
        milestones: Some(file),
        baselines: Some(crate::milestone::baselines::BaselineFile {
            schema: 1,
            baselines: Vec::new(),
        }),
    };
    let (reports, log) = run_milestone(&o)?;
    if let Some(hint) = crate::milestone::threads::for_reports(&reports) {
        eprintln!("[gate init] {hint}");
    }
    let mut text = String::new();
    for r in &reports {
        text.push_str(&crate::milestone::render::render(r));
    }
    text.push_str(&format!(
        "\nrecorded (milestones.json, baselines.json, golden/):\n{}\n",
        log.unwrap_or_default()
    ));
    if let Some(src) = &copied {
        text.push_str(&format!(
            "prompts: {} copied to {DEFAULT_PROMPTS}\n",
            src.display()
        ));
    }
    if !cache_off {
        text.push_str("the candidate does not answer `trace --cache off`: generation is NOT CHECKED (candidate.cache_off in milestones.json)\n");
    }
    text.push_str(&format!(
        "\ninitialised {}: `gate run {}` checks the port against its golden traces (no torch needed); commit milestones.json, baselines.json, {prompt_rel} and golden/\n",
        root_abs.display(),
        a.id
    ));
    let exit_code = reports.iter().map(|r| r.exit_code()).max().unwrap_or(1);
    Ok(Initialised { text, exit_code })
}

/// A prompt set whose ids the model's vocabulary cannot hold is refused before anything runs.
fn check_vocab(set: &prompts::PromptSet, config: &serde_json::Value, path: &Path) -> Result<()> {
    let Some(vocab) = prompts::text_fields(config)
        .get("vocab_size")
        .and_then(serde_json::Value::as_i64)
    else {
        return Ok(());
    };
    for p in &set.prompts {
        if let Some(t) = p.tokens.iter().find(|&&t| t >= vocab) {
            return Err(gerr!(
                "{}: prompt {:?} holds token id {t}, outside the vocabulary of {} (vocab_size {vocab}); give --prompts with this model's ids",
                set.path.display(),
                p.id,
                path.display()
            ));
        }
    }
    Ok(())
}

/// Whether the candidate answers `trace --cache off`, asked once on the first prompt: a port
/// without an uncached path is recorded as such (its `generation` NOT CHECKED), not failed.
fn answers_cache_off(
    root: &Path,
    candidate: &Producer,
    model: &str,
    tokens: &[i64],
    a: &InitOptions,
    work: &str,
) -> Result<bool> {
    let dir = format!("{work}/init-probe");
    std::fs::create_dir_all(root.join(&dir)).map_err(|e| gerr!(File: "{dir}: {e}"))?;
    let out = format!("{dir}/candidate-uncached.trace");
    let _ = std::fs::remove_file(root.join(&out));
    let (rec, sharded) = crate::milestone::run::run_trace(
        candidate,
        root,
        &Verb::Trace {
            model: model.to_string(),
            tokens: tokens.to_vec(),
            out,
            internals: a.capture == "internals",
            generate: a.generate,
            cache: false,
            force: None,
            seed: None,
            shards: None,
        },
        a.timeout,
        a.ranks,
    );
    if rec.timed_out {
        return Err(
            gerr!(Producer: "the candidate's `trace --cache off` timed out after {} s (--timeout): $ {}", a.timeout.as_secs(), rec.invocation),
        );
    }
    // A sharded candidate answered when it exited 0: what its rank traces hold is judged by
    // every run's `generation`, never turned into "does not answer" here.
    Ok(rec.ok || sharded.is_some())
}
