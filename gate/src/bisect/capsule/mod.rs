//! Repro capsules (docs/bisect.md, "Capsules"): what `gate bisect --capsule DIR` writes for the
//! first wrong layer — the reference's input rows to that layer and its outputs at every capture
//! point (`reference.trace`), that layer's weights as stored (`layer.safetensors`), the model's
//! `config.json`, the policy that judged it (`policy.json`), a pytest file for the port's own
//! suite (`test_capsule.py`) and `manifest.json` with the sha256 of each — and `gate capsule run
//! DIR`, which replays the candidate's `layer` verb on it with nothing else: no model
//! directory, no reference producer, no prompt set.
//!
//! The replay is the bisection's own isolation (../prefill/isolate.rs `isolate_with`, `stage`),
//! so a capsule judges as the bisection did. Minimising: the shortest prefix of the rows that
//! still fails at the same capture point, found by bisection over positions (rows.rs), and the
//! written capsule replayed once more before it is kept. A layer wrong at a decode step gets a
//! decode capsule (decode.rs): its whole prefix, replayed with `layer --decode-from P`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sha2::Digest as _;
use tracegate_diff::Policy;
use tracegate_producers::{Producer, RunRecord, Verb};
use tracegate_trace::{names, Trace};

use super::options::{BisectOptions, Reference};
use super::prefill::*;
use super::BisectReport;
use crate::{gerr, Result};

mod decode;
mod explain;
mod gguf;
mod rows;
mod units;
mod weights;

pub use explain::{explain, Explained};

/// The manifest's format.
pub const SCHEMA: &str = "tracegate-capsule/1";

/// The generated pytest file (the same bytes in every capsule: it reads manifest.json).
const PYTEST: &str = include_str!("test_capsule.py");

const MANIFEST: &str = "manifest.json";
/// manifest.json's sha256 (`HEX  manifest.json`, sha256sum's format).
const MANIFEST_DIGEST: &str = "manifest.sha256";

/// The generated C test (test_capsule.c): its template, the bounds filled in per capsule.
const C_TEST: &str = "test_capsule.c";
const C_TEMPLATE: &str = include_str!("test_capsule.c");

/// `test_capsule.c` for layer `layer`: the capture points `judged` (those the replay compared),
/// each with the bounds of the rule `policy` holds it to (or bit for bit), and the digest of the
/// capsule's `reference`.
/// `slices`: a head-reduced capsule's per-head points, each with its head axis and the heads
/// its reference holds (units.rs `Cut::slices`): the C test cuts the candidate's to them.
fn c_test(
    layer: usize,
    reference: &Trace,
    policy: &Option<Policy>,
    judged: &[&str],
    slices: &[(String, usize, Vec<usize>)],
) -> String {
    let real = |v: Option<f64>| match v {
        None => "NAN".to_string(),
        Some(x) if x.is_infinite() => "INFINITY".to_string(),
        Some(x) => format!("{x:e}"),
    };
    let mut rows = Vec::new();
    for name in judged {
        // Names are the registry's (`layer.LL.point`): nothing to escape in a C string.
        let row = match policy {
            None => format!("    {{\"{name}\", 1, NAN, NAN, NAN, NAN, NAN, NAN, 0}},"),
            Some(p) => match p.rule_for(name, Some("layer")) {
                Some((i, r)) => format!(
                    "    {{\"{name}\", 0, {}, {}, {}, {}, {}, {}, {}}}, /* policy.json rule {i}: {} */",
                    real(r.max_ulp.map(|u| u as f64)),
                    real(r.max_abs),
                    real(r.max_rel),
                    real(r.max_rel_l2),
                    real(r.min_cosine),
                    real(r.max_scale_error),
                    u8::from(r.max_noise_ratio.is_some()),
                    r.pattern.replace("*/", "*\\/"),
                ),
                None => format!("    /* {name}: no rule of policy.json matches it: not judged */"),
            },
        };
        rows.push(row);
    }
    let slices: Vec<String> = slices
        .iter()
        .map(|(name, axis, heads)| {
            let list: Vec<String> = heads.iter().map(usize::to_string).collect();
            format!(
                "    {{\"{name}\", {axis}, {}, {{{}}}}},",
                heads.len(),
                list.join(", ")
            )
        })
        .collect();
    C_TEMPLATE
        .replace("@LAYER@", &layer.to_string())
        .replace("@SLICES@", &slices.join("\n"))
        .replace("@LL@", &format!("{layer:02}"))
        .replace("@DIGEST@", &reference.digest().hex())
        .replace("@CHECKS@", &rows.join("\n"))
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Manifest {
    pub schema: String,
    pub layer: usize,
    /// A decode-step capsule (decode.rs): `step`, `position` (P), `prompt_rows`, `input`
    /// (`input.trace`); null for a prefill layer.
    #[serde(default)]
    pub decode: Value,
    /// Heads and experts (units.rs): which fail, the experts removed, the heads named.
    #[serde(default)]
    pub units: Value,
    /// `internals` or `default`: what the layer verb is asked to capture.
    pub capture: String,
    /// How the bisection judged: `by` (`bits`, `policy`), `policy_name`, `precision`, and the
    /// policy's file in the capsule (`policy.json`; null by bits).
    pub judge: Value,
    /// The bisection's stage (layer, block, tensor, detail, matching).
    pub stage: Value,
    /// The stage tensor's broken bounds in the bisection (bound, limit, value) and the rule that
    /// holds them (its index and text in policy.json); empty/null by bits.
    pub broke: Value,
    pub rule: Value,
    /// Where it came from: model, prompt, tokens, reference, candidate, its command words (the
    /// pytest file runs them), the project root, the verdict line, the layer's isolated rows.
    pub bisection: Value,
    /// Rows: `bisection` (the prompt's), `kept`, `tokens_kept`, `removed`, `minimised`,
    /// `not_minimised` (why not), `trials` (rows, fails), `one_fewer_passes`, `still_fails`.
    pub rows: Value,
    /// `source_weights_digest`, `layer_file`, `tensors` (the layer's, as stored), `dtypes`,
    /// `other_tensors` (zero in the replay model), `replay_header`, `replay_weights_digest`.
    pub weights: Value,
    /// The replay of the written capsule: verdict, stage, isolated rows (what `capsule run`
    /// compares with).
    pub expected: Value,
    pub not_included: Vec<String>,
    pub allow_stack_mismatch: bool,
    /// Every other file of the capsule, by name: its sha256.
    pub files: BTreeMap<String, String>,
}

/// One replay of the candidate's layer verb on a capsule's rows.
#[derive(Clone, Debug, Serialize)]
pub struct Replayed {
    /// `wrong` (the layer differs in isolation) or `passes`.
    pub verdict: &'static str,
    pub layer: usize,
    pub stage: Option<Stage>,
    pub isolated: Vec<TensorCmp>,
    pub isolated_decisions: Vec<DecisionCmp>,
    pub runs: Vec<RunRecord>,
}

impl Replayed {
    /// What a replay is compared on: verdict, stage and every isolated row.
    fn outcome(&self) -> Value {
        json!({
            "verdict": self.verdict, "stage": self.stage,
            "isolated": self.isolated, "isolated_decisions": self.isolated_decisions,
        })
    }
    fn fails_at(&self, tensor: &str) -> bool {
        self.verdict == "wrong" && self.stage.as_ref().is_some_and(|s| s.tensor == tensor)
    }
}

fn sha256(path: &Path) -> Result<String> {
    let bytes = std::fs::read(path).map_err(|e| gerr!(File: "{}: {e}", path.display()))?;
    Ok(hex::encode(sha2::Sha256::digest(&bytes)))
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    std::fs::write(path, bytes).map_err(|e| gerr!(File: "{}: {e}", path.display()))
}

/// What one replay needs besides the rows: where to run, the candidate, how to judge.
#[derive(Clone)]
struct Replay<'a> {
    root: &'a Path,
    /// Relative to root (or absolute): the trials' and the candidate's traces.
    work: String,
    candidate: &'a Producer,
    timeout: std::time::Duration,
    model: String,
    layer: usize,
    internals: bool,
    policy: &'a Option<Policy>,
    allow_stack_mismatch: bool,
    /// A decode step's `layer --decode-from P` (P, and the trace of the layer's input rows
    /// 0..=P); None: the prefill's layer verb on the compared trace's own `hidden_in`.
    decode_input: Option<(i64, String)>,
    /// A head-reduced capsule (units.rs): the candidate's output sliced as the rows were.
    heads: Option<units::Cut>,
}

impl Replay<'_> {
    /// The candidate's layer verb on `input`'s `layer.LL.hidden_in`, judged against `input`'s
    /// own `layer.LL.*` (and held to `noise`'s rows, when given) by the bisection's isolation.
    fn run(&self, input: &str, noise: Option<&str>, tag: &str) -> Result<Replayed> {
        let o = BisectOptions {
            root: self.root.to_path_buf(),
            model: self.model.clone(),
            tokens: Vec::new(),
            prompt: None,
            reference: Reference::Run(Producer::Engine { threads: 1 }),
            candidate: self.candidate.clone(),
            policy: None,
            exact: false,
            precision: None,
            all_layers: false,
            internals: self.internals,
            calibrate: false,
            seed: 1,
            sampling: false,
            sampler_seed: 0,
            generate: 0,
            work: self.work.clone(),
            timeout: self.timeout,
            gate_invocation: Vec::new(),
            allow_stack_mismatch: self.allow_stack_mismatch,
            noise: None,
            ranks: None,
        };
        let layer = self.layer;
        let reference = open(self.root, input)?;
        let (verb_input, decode_from) = match &self.decode_input {
            Some((p, rows)) => (rows.clone(), Some(*p)),
            None => (input.to_string(), None),
        };
        let noise = match noise {
            None => None,
            Some(n) => Some(tracegate_diff::NoiseReference(std::sync::Arc::new(open(
                self.root, n,
            )?))),
        };
        let run = LayerRun {
            verb: Verb::Layer {
                model: self.model.clone(),
                layer,
                input: verb_input,
                input_name: names::layer(layer, "hidden_in"),
                out: format!("{}/{tag}.candidate.trace", self.work),
                internals: self.internals,
                force: None,
                decode_from,
            },
            layer,
            slice_rel: format!("{}/{tag}.reference.trace", self.work),
            whose: "the capsule's reference rows",
            pass: None,
            noise,
            cut: self
                .heads
                .as_ref()
                .map(|c| Box::new(move |t: &Trace, p: &Path| c.write(t, p)) as _),
        };
        let mut runs = Vec::new();
        let iso = isolate_with(&o, &run, self.policy, &mut runs, |cand, out| {
            write_slice(&reference, cand, layer, out, None)
        })?;
        let mut row = LayerRow::new(layer);
        let wrong = iso.wrong;
        fill_isolated(&mut row, iso);
        let stage = wrong.then(|| {
            stage(
                layer,
                &row,
                is_moe(&reference, layer),
                "differs in isolation",
            )
        });
        Ok(Replayed {
            verdict: if wrong { "wrong" } else { "passes" },
            layer,
            stage,
            isolated: row.isolated,
            isolated_decisions: row.isolated_decisions,
            runs,
        })
    }
}

/// A capsule written: where, what it holds, its size.
pub struct Written {
    pub dir: PathBuf,
    pub manifest: Manifest,
    /// Bytes per file, and in all.
    pub sizes: Vec<(String, u64)>,
    pub bytes: u64,
}

impl Written {
    pub fn words(&self) -> String {
        let m = &self.manifest;
        let sizes: Vec<String> = self
            .sizes
            .iter()
            .map(|(n, b)| format!("{n} {}", thousands(*b)))
            .collect();
        format!(
            "capsule written to {}: layer {:02}{}, stage {}, {} of {} rows ({}); replayed from the capsule alone: {}; {} bytes ({})",
            self.dir.display(),
            m.layer,
            decode::at(m),
            m.stage["tensor"].as_str().unwrap_or("?"),
            m.rows["kept"],
            m.rows["bisection"],
            m.rows["removed"].as_str().unwrap_or(""),
            if m.rows["still_fails"] == json!(true) { "still fails" } else { "does not fail" },
            thousands(self.bytes),
            sizes.join(", ")
        )
    }
}

/// `gate bisect --capsule DIR`: the capsule of `rep`'s first wrong layer, or (Ok(Err)) why none
/// is written — nothing wrong, a forced or block-diffusion bisection, a layer that does not fail
/// when replayed alone. `minimise`: keep
/// only the shortest failing prefix of the rows.
pub fn write(
    o: &BisectOptions,
    rep: &BisectReport,
    dir: &Path,
    minimise: bool,
) -> Result<std::result::Result<Written, String>> {
    let (layer, stage, step) = match (rep.verdict, rep.first_wrong_layer, &rep.stage) {
        (BisectVerdict::WrongLayer, Some(l), Some(s)) => (l, s.clone(), None),
        (BisectVerdict::NothingWrong, ..) => {
            return Ok(Err(
                "nothing is wrong (verdict nothing_wrong): a capsule holds a layer that fails, and no layer does".into(),
            ))
        }
        (v, ..) => match decode::wrong_step(rep) {
            Some((l, s, at)) => (l, s, Some(at)),
            None => {
                return Ok(Err(format!(
                    "the bisection names no wrong layer, at the prefill or a decode step (verdict {v})"
                )))
            }
        },
    };
    if rep
        .decisions_forced
        .as_ref()
        .is_some_and(|f| f.status == Forcing::Forced)
    {
        return Ok(Err("the bisection forced the candidate's decisions from the reference's (--force-decisions): a capsule does not carry the forcing trace yet".into()));
    }
    if o.sampling {
        return Ok(Err(
            "a block-diffusion model's layer reads its pass's keys from the whole trace: not written in capsules".into(),
        ));
    }
    let policy = rep.policy.clone();
    if let Some(p) = &policy {
        let text = serde_json::to_string_pretty(p).map_err(|e| gerr!("policy: {e}"))?;
        if Policy::parse(&text).ok().as_ref() != Some(p) {
            return Ok(Err(format!("the policy {} does not survive being written to a file (a claim per capture-point pattern): judge with one precision or a policy file", p.name)));
        }
    }
    let model_dir = o.root.join(&o.model);
    let lw = weights::of_model(&model_dir, layer)?;
    let shown = crate::paths::shown(dir);
    if std::fs::read_dir(dir).is_ok_and(|mut e| e.next().is_some()) {
        return Err(gerr!(
            "--capsule {shown}: exists and is not empty; give a new directory"
        ));
    }
    std::fs::create_dir_all(dir).map_err(|e| gerr!(File: "--capsule {shown}: {e}"))?;
    let built = match &step {
        None => build(o, rep, dir, minimise, layer, &stage, &policy, &lw),
        Some(at) => decode::build(o, rep, dir, at, layer, &stage, &policy, &lw),
    };
    if !matches!(built, Ok(Ok(_))) {
        let _ = std::fs::remove_dir_all(dir); // half a capsule is none
    }
    built
}

/// `gate run port`'s localisation (milestone/run/port.rs): the capsule of the bisection `rep`
/// written (minimised) to `dir` under `o.root`, replacing one an earlier run left there, as the
/// report's `localised.capsule`: `written`, `path` (as given), the command that replays it, or
/// why it was not written. Never an error: a capsule that cannot be written is said so, and the
/// localisation stands.
pub fn for_report(o: &BisectOptions, rep: &BisectReport, dir: &str) -> Value {
    let abs = o.root.join(dir);
    if abs.exists() {
        // The gate's own work directory: the previous run's capsule of this prompt.
        if let Err(e) = std::fs::remove_dir_all(&abs) {
            return not_written(format!(
                "{dir}: an earlier capsule could not be removed: {e}"
            ));
        }
    }
    match write(o, rep, &abs, true) {
        Ok(Ok(w)) => json!({
            "written": true, "path": dir, "replay": replay_command(dir, &o.candidate),
            "why": null, "layer": w.manifest.layer, "stage": w.manifest.stage["tensor"],
            "rows": w.manifest.rows["kept"], "of": w.manifest.rows["bisection"], "bytes": w.bytes,
        }),
        Ok(Err(why)) => not_written(why),
        Err(e) => not_written(format!("writing it failed: {e}")),
    }
}

/// A report's `localised.capsule` when none is written, and why.
pub fn not_written(why: impl Into<String>) -> Value {
    json!({"written": false, "path": null, "replay": null, "why": why.into()})
}

/// The shell command that replays capsule `dir` with `candidate` (run in the project root).
pub fn replay_command(dir: &str, candidate: &Producer) -> String {
    let q = |w: &str| tracegate_producers::display(&[w.to_string()]);
    let who = match candidate {
        Producer::Engine { .. } => "--candidate engine".to_string(),
        Producer::Command { words, .. } => {
            format!(
                "--candidate-cmd {}",
                q(&tracegate_producers::display(words))
            )
        }
    };
    format!("gate capsule run {} {who}", q(dir))
}

/// What every capsule holds before its rows: `config.json`, `layer.safetensors`, and the replay
/// model built from them under the work dir's `capsule/` (the trials' place), held locked.
struct Prepared {
    _lock: crate::WorkLock,
    trials: String,
    replay_model: String,
    replay_digest: String,
}

fn prepare(o: &BisectOptions, dir: &Path, lw: &weights::LayerWeights) -> Result<Prepared> {
    let model_dir = o.root.join(&o.model);
    if lw.config {
        std::fs::copy(model_dir.join("config.json"), dir.join("config.json"))
            .map_err(|e| gerr!(File: "{}: {e}", model_dir.join("config.json").display()))?;
    }
    write_file(&dir.join("layer.safetensors"), &lw.layer_file)?;
    let work_dir = o.root.join(&o.work);
    let _lock = crate::WorkLock::acquire(&work_dir)?;
    let trials = format!("{}/capsule", o.work);
    let trials_dir = o.root.join(&trials);
    if trials_dir.exists() {
        std::fs::remove_dir_all(&trials_dir)
            .map_err(|e| gerr!(File: "{}: {e}", trials_dir.display()))?;
    }
    std::fs::create_dir_all(&trials_dir)
        .map_err(|e| gerr!(File: "{}: {e}", trials_dir.display()))?;
    let replay_model = format!("{trials}/model");
    let replay_digest = weights::materialise(dir, &json!(lw.replay), &o.root.join(&replay_model))?;
    Ok(Prepared {
        _lock,
        trials,
        replay_model,
        replay_digest,
    })
}

#[allow(clippy::too_many_arguments)]
fn build(
    o: &BisectOptions,
    rep: &BisectReport,
    dir: &Path,
    minimise: bool,
    layer: usize,
    stage: &Stage,
    policy: &Option<Policy>,
    lw: &weights::LayerWeights,
) -> Result<std::result::Result<Written, String>> {
    let Prepared {
        _lock,
        trials,
        replay_model,
        replay_digest,
    } = prepare(o, dir, lw)?;
    // A RefCell: removing experts (units.rs) changes it after the trials' traces recorded it.
    let replay_digest = std::cell::RefCell::new(replay_digest);
    let reference = open(&o.root, &format!("{}/reference.trace", o.work))?;
    let source_digest = reference
        .provenance()
        .get("weights_digest")
        .cloned()
        .unwrap_or(Value::Null);
    let n = rows::input_rows(&reference, layer)?;
    let provenance = |t: &Trace, keep: usize| {
        let mut p = t.provenance().clone();
        if let Some(m) = p.as_object_mut() {
            m.insert("weights_digest".into(), json!(*replay_digest.borrow()));
            if let Some(tokens) = m.get("prompt_tokens").and_then(Value::as_array).cloned() {
                m.insert(
                    "prompt_tokens".into(),
                    json!(tokens[..keep.min(tokens.len())]),
                );
            }
            m.insert(
                "capsule".into(),
                json!({"layer": layer, "rows": keep, "of": n, "source_weights_digest": source_digest}),
            );
        }
        p
    };
    let replay = Replay {
        root: &o.root,
        work: trials.clone(),
        candidate: &o.candidate,
        timeout: o.timeout,
        model: replay_model,
        layer,
        internals: o.internals,
        policy,
        allow_stack_mismatch: o.allow_stack_mismatch,
        decode_input: None,
        heads: None,
    };
    let mut trial_log = Vec::new();
    let mut try_rows = |keep: usize| -> Result<Replayed> {
        let input = format!("{trials}/rows.{keep}.trace");
        rows::write(
            &reference,
            layer,
            keep,
            provenance(&reference, keep),
            &o.root.join(&input),
        )?;
        let noise = match &o.noise {
            Some(nz) => {
                let rel = format!("{trials}/noise.{keep}.trace");
                rows::write(
                    &nz.0,
                    layer,
                    keep,
                    provenance(&nz.0, keep),
                    &o.root.join(&rel),
                )?;
                Some(rel)
            }
            None => None,
        };
        let r = replay.run(&input, noise.as_deref(), &format!("rows.{keep}"))?;
        trial_log.push(json!({"rows": keep, "fails": r.fails_at(&stage.tensor)}));
        Ok(r)
    };
    let full = try_rows(n)?;
    if !full.fails_at(&stage.tensor) {
        return Ok(Err(format!(
            "layer {layer:02} does not fail at {} when replayed from its own weights on the reference's input ({}): a defect the layer verb does not show alone is not captured",
            stage.tensor,
            full.stage.as_ref().map_or("it passes".to_string(), |s| s.detail.clone())
        )));
    }
    let not_minimised = if !minimise {
        Some("--capsule-full: every row kept".to_string())
    } else {
        rows::unsliceable(&reference, layer)
    };
    let (mut lo, mut hi) = (0usize, n);
    if not_minimised.is_none() {
        // Shortest failing prefix: `hi` fails, `lo` passes (0 rows: nothing to fail).
        while hi - lo > 1 {
            let mid = (lo + hi) / 2;
            if try_rows(mid)?.fails_at(&stage.tensor) {
                hi = mid;
            } else {
                lo = mid;
            }
        }
    }
    let keep = hi;
    let cx = units::Ctx {
        o,
        dir,
        layer,
        keep,
        stage: &stage.tensor,
        minimise,
        reference: &reference,
        full: &full,
        trials: &trials,
        policy,
        weights: &json!(lw.replay),
    };
    let (heads, cut) = units::heads(&cx, &replay, &replay_digest, &provenance)?;
    let (experts, kept_tensors) = match &cut {
        Some((_, tensors)) => (units::experts_left_out(&cx), Some(tensors.clone())),
        None => units::experts(&cx, &replay, &replay_digest, &provenance)?,
    };
    let rows_out = match &cut {
        Some(_) => o.root.join(format!("{trials}/reference.rows.trace")),
        None => dir.join("reference.trace"),
    };
    rows::write(
        &reference,
        layer,
        keep,
        provenance(&reference, keep),
        &rows_out,
    )?;
    if let Some((c, _)) = &cut {
        c.write(
            &open(&o.root, &rows_out.display().to_string())?,
            &dir.join("reference.trace"),
        )?;
    }
    if let Some(nz) = &o.noise {
        rows::write(
            &nz.0,
            layer,
            keep,
            provenance(&nz.0, keep),
            &dir.join("noise.trace"),
        )?;
    }
    if let Some(p) = policy {
        let text = serde_json::to_vec_pretty(p).map_err(|e| gerr!("policy: {e}"))?;
        write_file(&dir.join("policy.json"), &text)?;
    }
    write_file(&dir.join("test_capsule.py"), PYTEST.as_bytes())?;
    // A head-reduced capsule judges the kept heads' per-head points only (units.rs).
    let judged: Vec<&str> = match &cut {
        Some((c, _)) => c.points.iter().map(String::as_str).collect(),
        None => full.isolated.iter().map(|t| t.tensor.as_str()).collect(),
    };
    let slices = cut.as_ref().map(|(c, _)| c.slices()).unwrap_or_default();
    let c_text = c_test(
        layer,
        &open(&o.root, &dir.join("reference.trace").display().to_string())?,
        policy,
        &judged,
        &slices,
    );
    write_file(&dir.join(C_TEST), c_text.as_bytes())?;
    let tokens_kept: Vec<i64> = rep.tokens.iter().take(keep).copied().collect();
    let removed = if keep == n {
        "none".to_string()
    } else {
        format!(
            "rows at positions {keep}..{} removed (tokens {:?})",
            n - 1,
            &rep.tokens[keep.min(rep.tokens.len())..]
        )
    };
    let judged = Judged::of(o, rep, policy, stage, &rep.layers[layer]);
    let manifest = Manifest {
        schema: SCHEMA.into(),
        layer,
        capture: if o.internals { "internals" } else { "default" }.into(),
        judge: judged.judge,
        stage: json!(stage),
        broke: judged.broke,
        rule: judged.rule,
        bisection: judged.bisection,
        rows: json!({
            "bisection": n, "kept": keep, "tokens_kept": tokens_kept, "removed": removed,
            "minimised": not_minimised.is_none(), "not_minimised": not_minimised,
            "trials": trial_log, "one_fewer_passes": (lo > 0).then_some(true),
            "still_fails": Value::Null,
        }),
        weights: {
            let mut w = lw.replay.clone();
            w.insert("source_weights_digest".into(), source_digest.clone());
            w.insert(
                "replay_weights_digest".into(),
                json!(*replay_digest.borrow()),
            );
            if let Some(kept) = kept_tensors {
                w.insert("tensors".into(), json!(kept));
            }
            Value::Object(w)
        },
        expected: Value::Null,
        not_included: {
            let mut v = not_included(o);
            if cut.is_some() {
                for line in v.iter_mut().filter(|l| l.as_str() == HEADS_NAMED) {
                    *line = HEADS_CUT.to_string();
                }
            }
            v
        },
        allow_stack_mismatch: o.allow_stack_mismatch,
        files: BTreeMap::new(),
        decode: Value::Null,
        units: json!({"experts": experts, "heads": heads}),
    };
    kept_if_failing(
        o,
        dir,
        manifest,
        &stage.tensor,
        &trials,
        "a candidate that does not repeat itself is not captured",
    )
}

/// Seals `manifest`, then replays the written capsule as `capsule run` reads it (checked by
/// re-running, not assumed); it is kept only if it still fails at `tensor` (else why not, with
/// `unless`), and `expected` records that replay.
fn kept_if_failing(
    o: &BisectOptions,
    dir: &Path,
    mut manifest: Manifest,
    tensor: &str,
    trials: &str,
    unless: &str,
) -> Result<std::result::Result<Written, String>> {
    seal(dir, &mut manifest)?;
    let again = run_loaded(
        &o.root,
        dir,
        &load(dir)?,
        &o.candidate,
        &format!("{trials}/verify"),
        o.timeout,
    )?;
    if !again.fails_at(tensor) {
        return Ok(Err(format!(
            "the written capsule does not fail at {tensor} when replayed ({}): {unless}",
            again.verdict
        )));
    }
    manifest.rows["still_fails"] = json!(true);
    manifest.expected = again.outcome();
    seal(dir, &mut manifest)?;
    let mut sizes = Vec::new();
    for name in manifest
        .files
        .keys()
        .chain([&MANIFEST.to_string(), &MANIFEST_DIGEST.to_string()])
    {
        let len = std::fs::metadata(dir.join(name))
            .map_err(|e| gerr!(File: "{}: {e}", dir.join(name).display()))?
            .len();
        sizes.push((name.clone(), len));
    }
    let bytes = sizes.iter().map(|(_, b)| b).sum();
    Ok(Ok(Written {
        dir: dir.to_path_buf(),
        manifest,
        sizes,
        bytes,
    }))
}

/// The candidate's command words, as the pytest file runs them (`{verb}`, `{verb|serve}` and
/// `{args}` placeholders kept); the engine as its own binary beside the gate.
/// What a capsule's manifest records of the bisection that wrote it, prefill or decode alike:
/// how it judged, the stage tensor's broken bounds and the policy rule that holds it, and the
/// bisection itself with `row`, the layer's isolation (the prefill's or the decode step's).
struct Judged {
    judge: Value,
    broke: Value,
    rule: Value,
    bisection: Value,
}

impl Judged {
    fn of(
        o: &BisectOptions,
        rep: &BisectReport,
        policy: &Option<Policy>,
        stage: &Stage,
        row: &LayerRow,
    ) -> Judged {
        let tensor_row = row.isolated.iter().find(|t| t.tensor == stage.tensor);
        let rule = match (policy, tensor_row) {
            (Some(p), Some(_)) => p
                .rule_for(&stage.tensor, Some("layer"))
                .map(|(i, r)| json!({"index": i, "rule": r}))
                .unwrap_or(Value::Null),
            _ => Value::Null,
        };
        Judged {
            judge: json!({
                "by": rep.judge.by, "policy_name": rep.judge.policy_name, "precision": rep.judge.precision,
                "reason": rep.judge.reason, "policy_file": policy.as_ref().map(|_| "policy.json"),
            }),
            broke: json!(tensor_row.map(|t| &t.violations)),
            rule,
            bisection: json!({
                "model": o.model, "prompt": rep.prompt, "tokens": rep.tokens, "reference": rep.reference,
                "candidate": rep.candidate, "candidate_words": candidate_words(&o.candidate),
                "root": std::fs::canonicalize(&o.root).unwrap_or_else(|_| o.root.clone()),
                "verdict": rep.verdict, "summary": rep.summary, "generate": o.generate,
                "isolated": row.isolated, "isolated_decisions": row.isolated_decisions,
                "gate_invocation": rep.gate_invocation,
            }),
        }
    }
}

fn candidate_words(p: &Producer) -> Vec<String> {
    match p {
        Producer::Command { words, .. } => words.clone(),
        Producer::Engine { threads } => {
            let engine = std::env::current_exe()
                .ok()
                .and_then(|g| g.parent().map(|d| d.join("engine")))
                .map(|e| e.display().to_string())
                .unwrap_or_else(|| "engine".into());
            vec![
                engine,
                "{verb}".into(),
                "{args}".into(),
                "--threads".into(),
                threads.to_string(),
            ]
        }
    }
}

/// A prefill capsule's `not_included` line that a decode capsule (decode.rs) does not carry.
const NO_DECODE_STEP: &str = "decode steps: a prefill layer's capsule replays its prompt rows only (a layer wrong at a decode step gets a decode capsule)";

const HEADS_NAMED: &str =
    "heads are named where they fail (units.heads), not cut: every head of the layer is kept";
const HEADS_CUT: &str = "the heads not kept (units.heads.removed, kv_removed), and every point of the layer but the kept heads' slices of the per-head points up to the stage (units.heads.judged): the reference's later points are not the reduced layer's";
/// What the generated tests say of a head-reduced capsule (they refuse it).
fn not_included(o: &BisectOptions) -> Vec<String> {
    let mut v = vec![
        "other layers' weights, the embedding and the head: zeros in the replay model (the layer verb does not read them)".to_string(),
        NO_DECODE_STEP.to_string(),
        HEADS_NAMED.to_string(),
        "in test_capsule.c: the router's decisions, a noise-relative bound and the tensors' attributes (gate capsule run and test_capsule.py check them)".to_string(),
    ];
    if o.noise.is_none() {
        v.push("a noise run: the bisection had none (--noise-reference)".into());
    }
    v
}

/// Records every file's sha256 in the manifest and writes it.
fn seal(dir: &Path, m: &mut Manifest) -> Result<()> {
    m.files.clear();
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map_err(|e| gerr!(File: "{}: {e}", dir.display()))?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n != MANIFEST && n != MANIFEST_DIGEST)
        .collect();
    names.sort();
    for n in names {
        m.files.insert(n.clone(), sha256(&dir.join(&n))?);
    }
    crate::write_json_atomic(&dir.join(MANIFEST), m)?;
    // The manifest's own sha256, as `sha256sum -c` reads it: an edited manifest is refused.
    let line = format!("{}  {MANIFEST}\n", sha256(&dir.join(MANIFEST))?);
    write_file(&dir.join(MANIFEST_DIGEST), line.as_bytes())
}

/// A capsule read and verified: every file the manifest lists has its recorded sha256, every
/// file the replay reads is listed.
pub struct Loaded {
    pub manifest: Manifest,
    pub policy: Option<Policy>,
}

pub fn load(dir: &Path) -> Result<Loaded> {
    let shown = dir.display();
    let recorded = std::fs::read_to_string(dir.join(MANIFEST_DIGEST))
        .map_err(|e| gerr!(File: "capsule {shown}: {MANIFEST_DIGEST}: {e}"))?;
    let want = recorded.split_whitespace().next().unwrap_or_default();
    let got =
        sha256(&dir.join(MANIFEST)).map_err(|e| gerr!(File: "capsule {shown}: {MANIFEST}: {e}"))?;
    if got != want {
        return Err(
            gerr!(File: "capsule {shown}: {MANIFEST} was changed: its sha256 is {got}, {MANIFEST_DIGEST} records {want:?}"),
        );
    }
    let manifest: Manifest = crate::read_json(&dir.join(MANIFEST))?;
    if manifest.schema != SCHEMA {
        return Err(gerr!(
            "capsule {shown}: {MANIFEST} schema {:?}, expected {SCHEMA:?}",
            manifest.schema
        ));
    }
    let by_policy = manifest.judge["by"] == json!("policy");
    let mut needed = vec!["layer.safetensors", "reference.trace"];
    if manifest.weights["format"] != "gguf" {
        needed.push("config.json"); // a GGUF's config is the replay file's header
    }
    if by_policy {
        needed.push("policy.json");
    }
    for n in needed {
        if !manifest.files.contains_key(n) {
            return Err(gerr!(
                "capsule {shown}: {MANIFEST} records no sha256 for {n}"
            ));
        }
    }
    for (name, want) in &manifest.files {
        if name.contains('/') || name.contains("..") {
            return Err(gerr!(
                "capsule {shown}: {MANIFEST} names {name:?}, not a file of the capsule"
            ));
        }
        let got =
            sha256(&dir.join(name)).map_err(|e| gerr!(File: "capsule {shown}: {name}: {e}"))?;
        if &got != want {
            return Err(
                gerr!(File: "capsule {shown}: {name} was changed: its sha256 is {got}, {MANIFEST} records {want}"),
            );
        }
    }
    let policy = if by_policy {
        let p = dir.join("policy.json");
        Some(Policy::load(&p).map_err(|e| gerr!(File: "capsule {shown}: {e}"))?)
    } else {
        None
    };
    rederive(dir, &manifest, &policy)?;
    Ok(Loaded { manifest, policy })
}

/// The manifest's claims re-derived from the files it pins (an edit that also rewrites
/// manifest.sha256 is still refused): the rule is policy.json's for the stage tensor, the layer
/// and the rows kept are reference.trace's own (its provenance `capsule`).
fn rederive(dir: &Path, m: &Manifest, policy: &Option<Policy>) -> Result<()> {
    let shown = dir.display();
    let refuse = |what: String| gerr!(File: "capsule {shown}: {MANIFEST} {what}");
    if !m.rule.is_null() {
        let tensor = m.stage["tensor"].as_str().unwrap_or_default();
        let derived = policy
            .as_ref()
            .and_then(|p| p.rule_for(tensor, Some("layer")))
            .map(|(i, r)| json!({"index": i, "rule": r}))
            .unwrap_or(Value::Null);
        if derived != m.rule {
            return Err(refuse(format!(
                "records the rule {} for {tensor}, policy.json holds it to {derived}",
                m.rule
            )));
        }
    }
    let reference = Trace::open(dir.join("reference.trace"))
        .map_err(|e| gerr!(File: "capsule {shown}: reference.trace: {e}"))?;
    let own = &reference.provenance()["capsule"];
    if own["layer"] != json!(m.layer) || own["rows"] != m.rows["kept"] {
        return Err(refuse(format!(
            "records layer {} with {} rows, reference.trace holds layer {} with {} rows",
            m.layer, m.rows["kept"], own["layer"], own["rows"]
        )));
    }
    // A decode capsule is one by its traces too: neither kind can be replayed as the other.
    decode::rederive(dir, m, &reference).map_err(refuse)
}

/// The capsule's replay model written to `out`, its weights digest checked against the
/// manifest's: a layer file that does not give the model the capsule recorded is refused.
fn replay_model(dir: &Path, m: &Manifest, out: &Path) -> Result<()> {
    let digest = weights::materialise(dir, &m.weights, out)?;
    let want = m.weights["replay_weights_digest"]
        .as_str()
        .unwrap_or_default();
    if digest != want {
        return Err(
            gerr!(File: "capsule {}: the replay model's weights digest is {digest}, {MANIFEST} records {want}", dir.display()),
        );
    }
    Ok(())
}

/// `gate capsule run DIR`: the capsule verified, its replay model built under `work`, the
/// candidate's layer verb replayed and judged.
fn run_loaded(
    root: &Path,
    dir: &Path,
    c: &Loaded,
    candidate: &Producer,
    work: &str,
    timeout: std::time::Duration,
) -> Result<Replayed> {
    let m = &c.manifest;
    let work_dir = root.join(work);
    std::fs::create_dir_all(&work_dir).map_err(|e| gerr!(File: "{}: {e}", work_dir.display()))?;
    let model = format!("{work}/model");
    replay_model(dir, m, &root.join(&model))?;
    let abs = |n: &str| std::fs::canonicalize(dir.join(n)).unwrap_or_else(|_| dir.join(n));
    let input = abs("reference.trace").display().to_string();
    open(root, &input)?
        .verify()
        .map_err(|e| gerr!(File: "capsule {}: reference.trace: {e}", dir.display()))?;
    let noise = m
        .files
        .contains_key("noise.trace")
        .then(|| abs("noise.trace").display().to_string());
    let decode_input = decode::input(m).map(|(p, name)| (p, abs(name).display().to_string()));
    if let Some((_, rows)) = &decode_input {
        open(root, rows)?
            .verify()
            .map_err(|e| gerr!(File: "capsule {}: {rows}: {e}", dir.display()))?;
    }
    Replay {
        root,
        work: work.to_string(),
        candidate,
        timeout,
        model,
        layer: m.layer,
        internals: m.capture == "internals",
        policy: &c.policy,
        allow_stack_mismatch: m.allow_stack_mismatch,
        decode_input,
        heads: units::Cut::of_manifest(m.layer, &m.units)?,
    }
    .run(&input, noise.as_deref(), "capsule")
}

/// What `gate capsule run` answers: the replay, whether it is what the capsule recorded, the
/// text and the exit code (0 the layer passes, 1 it is still wrong).
#[derive(Serialize)]
pub struct CapsuleRun {
    pub schema: &'static str,
    pub capsule: String,
    pub layer: usize,
    pub judge: Value,
    pub rows: Value,
    #[serde(flatten)]
    pub replayed: Replayed,
    /// The same verdict, stage and numbers as the capsule's `expected`.
    pub as_recorded: bool,
    pub exit_code: i32,
    #[serde(skip)]
    pub text: String,
}

pub fn run(
    root: &Path,
    dir: &Path,
    candidate: &Producer,
    work: &str,
    timeout: std::time::Duration,
) -> Result<CapsuleRun> {
    let c = load(dir)?;
    let r = run_loaded(root, dir, &c, candidate, work, timeout)?;
    let m = &c.manifest;
    let as_recorded = r.outcome() == m.expected;
    let judged = match &c.policy {
        Some(p) => format!("judged by policy {} (policy.json)", p.name),
        None => "judged by bits".to_string(),
    };
    let mut text = format!(
        "capsule {}: layer {:02}{} of {}, {} of {} rows (positions 0-{}), {judged}\n",
        dir.display(),
        m.layer,
        decode::at(m),
        m.bisection["model"].as_str().unwrap_or("?"),
        m.rows["kept"],
        m.rows["bisection"],
        m.rows["kept"].as_u64().unwrap_or(1).saturating_sub(1),
    );
    match &r.stage {
        Some(s) => {
            text.push_str(&format!("layer {:02} body is wrong: {}\n", m.layer, s.detail));
            if let Some(t) = r.isolated.iter().find(|t| t.tensor == s.tensor) {
                for v in &t.violations {
                    text.push_str(&format!("  broke {}: {v}\n", v.bound));
                }
            }
        }
        None => text.push_str(&format!(
            "layer {:02} matches the capsule's reference in isolation ({} tensors): the capsule passes\n",
            m.layer,
            r.isolated.len()
        )),
    }
    text.push_str(if as_recorded {
        "as recorded: the same verdict, stage and numbers as when the capsule was written\n"
    } else {
        "not as recorded: the verdict, stage or numbers differ from the capsule's (manifest.json expected)\n"
    });
    let exit_code = if r.verdict == "wrong" { 1 } else { 0 };
    Ok(CapsuleRun {
        schema: SCHEMA,
        capsule: dir.display().to_string(),
        layer: m.layer,
        judge: m.judge.clone(),
        rows: m.rows.clone(),
        replayed: r,
        as_recorded,
        exit_code,
        text,
    })
}
