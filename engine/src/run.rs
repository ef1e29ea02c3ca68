//! The engine's verbs as a library API (the gate calls these in-process; `main.rs` is a thin CLI):
//! `run_trace` (prefill + optional greedy generation), `run_layer` (one decoder layer on a
//! tensor from any trace, for bisect) and `info`.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use tracegate_trace::{names, Digest, Trace, TraceWriter};

use crate::capture::Capture;
use crate::config::{load_config, Config, LayerKind, ModelType, MAX_POSITIONS};
use crate::force::{self, overridden, Forcing};
use crate::model::diffusion_gemma::config::DiffusionOptions;
use crate::model::Model;
use crate::options::{pool, LayerOptions, TraceOptions};
use crate::provenance::{beside_weights_digest, finish, provenance, unused_provenance};
use crate::shard::{self, Collective, Comm, Shards};
use crate::{err, Result};
use std::sync::Arc;

/// One greedy step: the chosen token, its margin and the logits row it came from.
pub struct Step {
    pub token: i64,
    pub margin: f32,
    pub logits: Vec<f32>,
    /// Forced (`--force-decisions`) and this producer's own argmax is another token.
    pub overridden: bool,
    /// The step's tensors (`Capture::step`): `decode.SSSS.logits`, and the layer points under
    /// internals.
    pub capture: Capture,
}

/// §12 decision `name` on one logits row (`force::argmax_or_forced`): this producer's argmax,
/// or under `--force-decisions` the forced value (row `forced_row` of the decision, checked by
/// `force` before the forward) with this producer's margin for it.
fn decide_or_force(
    model: &Model,
    name: &str,
    row: &[f32],
    forced_row: usize,
    what: &str,
) -> Result<(i64, f32, bool)> {
    let forced = model
        .forcing
        .as_ref()
        .and_then(|f| f.values(name))
        .and_then(|v| v.get(forced_row))
        .copied();
    force::argmax_or_forced(row, forced, || format!("logit in {what}"))
}

/// Greedy generation of `n` tokens after `prompt`, given the prompt's logits and (for the cached
/// path) the cache filled by the prompt's forward. Step 0 is the argmax of the prompt's last row;
/// step s ≥ 1 feeds token s−1 at position `prompt.len() + s − 1`. Under `--force-decisions`
/// step s is the forcing trace's `decode.SSSS.argmax`. Each step records its tensors (the
/// last row of its forward, cached or not), the layer points under `internals`.
pub fn generate(
    model: &Model,
    prompt: &[i64],
    prompt_logits: &[f32],
    n: usize,
    cache: Option<&mut [crate::model::LayerKv]>,
    internals: bool,
) -> Result<Vec<Step>> {
    let v = model.cfg.vocab_size;
    let t = prompt.len();
    // Not reserved up front: `n` is the caller's number and may be absurd.
    let mut steps: Vec<Step> = Vec::new();
    let mut row = prompt_logits[(t - 1) * v..t * v].to_vec();
    let mut seq = prompt.to_vec();
    let mut cache = cache;
    for s in 0..n {
        let mut capture = Capture::step(s, internals).of_rank(model.rank());
        if s > 0 {
            let last = steps[s - 1].token;
            seq.push(last);
            row = match cache.as_deref_mut() {
                Some(kv) => model.forward(&[last], (t + s - 1) as i64, kv, &mut capture)?,
                None => {
                    let mut fresh = model.new_cache();
                    let all = model.forward(&seq, 0, &mut fresh, &mut capture)?;
                    all[(seq.len() - 1) * v..].to_vec()
                }
            };
        } else {
            // Step 0 runs no forward: its logits are the prompt's last row.
            model.record_logits(&mut capture, "logits", &row, &[t as i64 - 1]);
        }
        let (token, margin, overridden) = decide_or_force(
            model,
            &names::decode(s, "argmax"),
            &row,
            0,
            &format!("decode step {s}"),
        )?;
        steps.push(Step {
            token,
            margin,
            logits: std::mem::take(&mut row),
            overridden,
            capture,
        });
    }
    Ok(steps)
}

/// Whether `dir`'s config.json names diffusion Gemma (docs/diffusion-gemma.md), whose verbs
/// are its own module's; anything unreadable is left to the common path to report.
fn is_diffusion_gemma(dir: &Path) -> bool {
    if !matches!(crate::gguf::model_file(dir), Ok(None)) {
        return false;
    }
    tracegate_trace::json::read_bytes(
        &dir.join("config.json"),
        tracegate_trace::json::MAX_JSON_LEN,
    )
    .ok()
    .and_then(|b| tracegate_trace::json::parse(&b).ok())
    .is_some_and(|v: Value| v.get("model_type").and_then(Value::as_str) == Some("diffusion_gemma"))
}

/// `engine trace` with diffusion Gemma's generation knobs (`--seed`, `--denoising-steps`, …):
/// refused, naming them, for every other family.
pub fn run_trace_with(o: &TraceOptions, d: &DiffusionOptions) -> Result<Digest> {
    check_out(o)?;
    if is_diffusion_gemma(&o.model_dir) {
        return crate::model::diffusion_gemma::run::run_trace(o, d);
    }
    let given = d.given();
    if !given.is_empty() {
        return Err(err!(Input:
            "{}: only for diffusion_gemma models (docs/diffusion-gemma.md)",
            given.join(", ")
        ));
    }
    run_trace(o)
}

/// `engine trace`: prefill the prompt (positions 0..n−1, causal), capture, optionally generate,
/// write the trace. Returns its content digest. A diffusion Gemma model runs its block diffusion
/// with the checkpoint's knobs (`run_trace_with` takes the command line's).
/// Under `--shards` every rank's trace is written; the digest returned is rank 0's
/// (`run_trace_ranks` returns each).
pub fn run_trace(o: &TraceOptions) -> Result<Digest> {
    check_out(o)?;
    if is_diffusion_gemma(&o.model_dir) {
        return crate::model::diffusion_gemma::run::run_trace(o, &DiffusionOptions::default());
    }
    let (cfg, raw) = trace_config(o)?;
    if let Some(s) = &o.shards {
        let ranks = run_ranks(o, s, cfg, &raw)?;
        return Ok(ranks[0].1);
    }
    let store = crate::open_store(&o.model_dir)?;
    let mut model = Model::load(cfg, &store)?;
    force(&mut model, o)?;
    let pool = pool(o.threads)?;
    let cap = streaming(&o.out, Capture::new("prefill", o.internals), &model)?;
    let (wd, cap) = beside_weights_digest(&store, || {
        pool.install(|| prefill_and_generate(&model, o, cap))
    })?;
    let prov = trace_provenance(o, &raw, &wd, &model.unused_tensors);
    finish(prov, cap, model.forcing.as_ref(), &wd)
}

/// The prompt's and generation's limits checked, and the config read.
fn trace_config(o: &TraceOptions) -> Result<(Config, Value)> {
    if o.tokens.is_empty() {
        return Err(err!(Input: "--tokens: the prompt is empty"));
    }
    if o.tokens.len().saturating_add(o.generate) > MAX_POSITIONS {
        return Err(err!(Input:
            "--generate {}: {} prompt tokens plus the generated ones exceed the position limit 2^24 = {MAX_POSITIONS}",
            o.generate,
            o.tokens.len()
        ));
    }
    let (cfg, raw) = load_config(&o.model_dir)?;
    if let Some(m) = cfg.max_position_embeddings {
        let n = o.tokens.len().saturating_add(o.generate);
        if n > m {
            return Err(err!(Input:
                "--tokens/--generate: {} prompt tokens plus {} generated = {n} positions exceed max_position_embeddings {m}",
                o.tokens.len(),
                o.generate
            ));
        }
    }
    Ok((cfg, raw))
}

/// `--force-decisions`: the forcing trace, checked against this run's prompt and sizes.
fn force(model: &mut Model, o: &TraceOptions) -> Result<()> {
    let Some(path) = &o.force_decisions else {
        return Ok(());
    };
    let f = Forcing::open(path)?;
    f.check_prompt(&o.tokens)?;
    let (c, t) = (&model.cfg, o.tokens.len());
    for l in (0..c.num_hidden_layers).filter(|&l| c.is_sparse(l)) {
        f.require(
            &names::layer(l, "router.topk"),
            Some(t),
            Some(c.num_experts_per_tok),
            c.num_experts,
        )?;
    }
    f.require("logits.argmax", Some(t), None, c.vocab_size)?;
    for s in 0..o.generate {
        f.require(&names::decode(s, "argmax"), Some(1), None, c.vocab_size)?;
    }
    model.forcing = Some(f);
    Ok(())
}

/// `engine trace`'s forward: the prompt's prefill, its argmax decisions, then the greedy steps.
fn prefill_and_generate(model: &Model, o: &TraceOptions, mut cap: Capture) -> Result<Capture> {
    let mut kv = model.new_cache();
    let logits = model.forward(&o.tokens, 0, &mut kv, &mut cap)?;
    let v = model.cfg.vocab_size;
    let (mut ids, mut margins, mut rows_over) = (vec![], vec![], vec![]);
    for r in 0..o.tokens.len() {
        let (i, m, over) = decide_or_force(
            model,
            "logits.argmax",
            &logits[r * v..(r + 1) * v],
            r,
            &format!("logits row {r}"),
        )?;
        ids.push(i);
        margins.push(m);
        if over {
            rows_over.push(r as u64);
        }
    }
    let over = model.forcing.as_ref().map(|_| rows_over);
    cap.decided("logits.argmax", &[o.tokens.len()], ids, Some(margins), over);
    if o.generate > 0 {
        let steps = generate(
            model,
            &o.tokens,
            &logits,
            o.generate,
            if o.cache { Some(&mut kv) } else { None },
            o.internals,
        )?;
        for (s, st) in steps.into_iter().enumerate() {
            let name = names::decode(s, "argmax");
            let over = model
                .forcing
                .as_ref()
                .map(|_| overridden([st.overridden].into_iter()));
            cap.decided(&name, &[1], vec![st.token], Some(vec![st.margin]), over);
            cap.append(st.capture);
        }
    }
    Ok(cap)
}

/// `engine trace`'s provenance (a rank's adds what names the sharded run: `run_ranks`).
fn trace_provenance(o: &TraceOptions, raw: &Value, wd: &str, unused: &[(String, usize)]) -> Value {
    let mut prov = provenance(
        &o.model_dir,
        raw,
        wd,
        o.threads,
        o.internals,
        &o.command_line,
    );
    unused_provenance(&mut prov, unused);
    prov["verb"] = json!("trace");
    prov["prompt_tokens"] = json!(o.tokens);
    if let Some(text) = &o.prompt_text {
        prov["prompt_text"] = text.clone();
    }
    prov["cache"] = json!(if o.cache { "on" } else { "off" });
    prov["generate"] = json!(o.generate);
    prov
}

/// `--out` and `--shards`: a sharded run writes one trace per rank, so its `--out` holds
/// `{rank}`; a whole run's must not.
/// Diffusion Gemma is refused under `--shards` (§23.5).
fn check_out(o: &TraceOptions) -> Result<()> {
    if let (Some(s), true) = (&o.shards, is_diffusion_gemma(&o.model_dir)) {
        return Err(err!(Input:
            "--shards {s}: diffusion_gemma is not sharded (docs/numerics.md §23.5)"
        ));
    }
    let has = o.out.to_str().map(|s| s.contains(RANK));
    match (&o.shards, has) {
        (Some(s), None) => Err(err!(Input:
            "--out {}: not UTF-8, so {RANK} cannot be replaced (--shards {s})",
            o.out.display()
        )),
        (Some(s), Some(false)) => Err(err!(Input:
            "--out {}: --shards {s} writes one trace per rank: --out must contain {RANK} (replaced by the rank number)",
            o.out.display()
        )),
        (None, Some(true)) => Err(err!(Input:
            "--out {}: {RANK} is replaced by the rank number of a sharded run only: give --shards tp=N|ep=N, or another name",
            o.out.display()
        )),
        _ => Ok(()),
    }
}

/// The placeholder of a sharded run's `--out`.
const RANK: &str = "{rank}";

/// A sharded run (docs/numerics.md §23): one thread per rank, each loading its blocks of the
/// weights and running the same forward with its end of the collective; then each rank's trace
/// written to `--out` with `{rank}` replaced. Returns each rank's file and digest, in rank order.
pub fn run_trace_ranks(o: &TraceOptions) -> Result<Vec<(PathBuf, Digest)>> {
    let Some(s) = &o.shards else {
        return Err(err!(Input: "run_trace_ranks: no --shards given"));
    };
    check_out(o)?;
    let (cfg, raw) = trace_config(o)?;
    run_ranks(o, s, cfg, &raw)
}

fn run_ranks(
    o: &TraceOptions,
    s: &Shards,
    cfg: Config,
    raw: &Value,
) -> Result<Vec<(PathBuf, Digest)>> {
    let family = raw.get("model_type").and_then(Value::as_str).unwrap_or("?");
    shard::check(s, &cfg, family)?;
    let store = crate::open_store(&o.model_dir)?;
    let collective = Arc::new(Collective::new(s.world));
    // Names the run in every rank's provenance (`trace-merge` refuses ranks of other runs).
    let run_id = format!(
        "engine-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    );
    type Done = (Capture, Option<Forcing>, Vec<(String, usize)>);
    let (wd, ranks) = beside_weights_digest(&store, || {
        std::thread::scope(|scope| {
            let running: Vec<_> = (0..s.world)
                .map(|rank| {
                    let (store, cfg, collective) = (&store, cfg.clone(), collective.clone());
                    scope.spawn(move || -> Result<Done> {
                        // A rank that stops (an error, a panic) wakes the others.
                        let stop = AbortOnDrop(&collective);
                        let comm = Arc::new(Comm::new(s, rank, collective.clone()));
                        let mut model = Model::load_rank(cfg, store, Some(comm))?;
                        force(&mut model, o)?;
                        let out = shard::rank_path(&o.out, rank);
                        let cap = streaming(&out, Capture::new("prefill", o.internals), &model)?;
                        let cap =
                            pool(o.threads)?.install(|| prefill_and_generate(&model, o, cap))?;
                        std::mem::forget(stop);
                        Ok((cap, model.forcing.take(), model.unused_tensors.clone()))
                    })
                })
                .collect();
            let done: Vec<Result<Done>> = running
                .into_iter()
                .enumerate()
                .map(|(rank, h)| {
                    h.join().unwrap_or_else(|_| {
                        Err(err!(Internal: "rank {rank} of --shards {s} panicked"))
                    })
                })
                .collect();
            // The first rank's own error (those after an abort computed nothing).
            done.into_iter().collect::<Result<Vec<Done>>>()
        })
    })?;
    if collective.aborted() {
        return Err(err!(Internal: "--shards {s}: a rank stopped without an error"));
    }
    let mut written = Vec::new();
    for (rank, (cap, forcing, unused)) in ranks.into_iter().enumerate() {
        let mut prov = trace_provenance(o, raw, &wd, &unused);
        prov["shards"] = json!(s.to_string());
        prov["rank"] = json!(rank);
        prov["run_id"] = json!(run_id);
        let digest = finish(prov, cap, forcing.as_ref(), &wd)?;
        written.push((shard::rank_path(&o.out, rank), digest));
    }
    Ok(written)
}

/// Aborts the collective when dropped (a rank's thread leaving early); forgotten on success.
struct AbortOnDrop<'c>(&'c Collective);

impl Drop for AbortOnDrop<'_> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// `cap` (of `model`'s rank) writing each tensor to `out` as it is recorded, through the
/// writer's temporary file: nothing is at `out` until `finish`. The provenance comes at the end.
fn streaming(out: &Path, cap: Capture, model: &Model) -> Result<Capture> {
    let w = TraceWriter::create(out, json!({}))?;
    let cfg = model.cfg.clone();
    let forcing = model.forcing.as_ref().map(|f| f.digest.as_str());
    Ok(cap.of_rank(model.rank()).stream_to(
        w,
        forcing,
        Box::new(move |n| n.layer.map_or_else(|| "causal".into(), |l| cfg.mask(l))),
    ))
}

/// `engine layer`: decoder layer L alone on tensor `input_name` of another trace, rows at that
/// tensor's `positions` attribute (causal by position), captured with `path = layer`. With
/// `--decode-from P` (docs/producers.md) the rows must be at positions 0..m−1: those below P
/// fill the layer's KV cache through the prefill path, then each later row goes through the
/// cached decode path alone — `Model::layer` on one row and the filled cache, the call a cached
/// `--generate` step makes for every layer — and only those rows are written.
pub fn run_layer(o: &LayerOptions) -> Result<Digest> {
    if is_diffusion_gemma(&o.model_dir) {
        return crate::model::diffusion_gemma::run::run_layer(o);
    }
    let (cfg, raw) = load_config(&o.model_dir)?;
    if o.layer >= cfg.num_hidden_layers {
        return Err(err!(Input:
            "--layer {} out of range (model has {} layers)",
            o.layer,
            cfg.num_hidden_layers
        ));
    }
    let store = crate::open_store(&o.model_dir)?;
    let mut model = Model::load(cfg, &store)?;
    let input = Trace::open(&o.input)?;
    let info = input
        .tensor_info(&o.input_name)
        .ok_or_else(|| err!(Input: "{}: no tensor {}", o.input.display(), o.input_name))?;
    let h = model.cfg.hidden_size;
    let rows = match info.shape.as_slice() {
        [t, hh] if *hh as usize == h && *t >= 1 => *t as usize,
        s => {
            return Err(err!(Input:
                "{}: tensor {} has shape {s:?}, expected [rows, {h}]",
                o.input.display(),
                o.input_name
            ))
        }
    };
    let pos = info.attributes.positions.clone().ok_or_else(|| {
        err!(Input:
            "{}: tensor {} has no positions attribute",
            o.input.display(),
            o.input_name
        )
    })?;
    if pos.len() != rows {
        return Err(err!(Input:
            "{}: tensor {}: {} positions for {rows} rows",
            o.input.display(),
            o.input_name,
            pos.len()
        ));
    }
    if let Some(p) = pos
        .iter()
        .find(|&&p| !(0..MAX_POSITIONS as i64).contains(&p))
    {
        return Err(err!(Input:
            "{}: tensor {}: position {p} outside [0, 2^24)",
            o.input.display(),
            o.input_name
        ));
    }
    if let Some(p) = o.decode_from {
        check_decode_from(&pos, p)
            .map_err(|e| err!(Input: "{}: tensor {}: {e}", o.input.display(), o.input_name))?;
    }
    let x = input.f32_vec(&o.input_name)?;
    if let Some(path) = &o.force_decisions {
        let f = Forcing::open(path)?;
        let c = &model.cfg;
        if c.is_sparse(o.layer) {
            let name = names::layer(o.layer, "router.topk");
            let rows = f.require(&name, None, Some(c.num_experts_per_tok), c.num_experts)?;
            // Row i of the forcing decision is position i's: every input row needs one.
            if let Some(p) = pos.iter().find(|&&p| p as u64 >= rows as u64) {
                return Err(
                    err!(Input: "--force-decisions {}: decision {name} has {rows} rows, the input holds position {p}", path.display()),
                );
            }
        }
        model.forcing = Some(f);
    }
    let pool = pool(o.threads)?;
    let (wd, cap) = beside_weights_digest(&store, || {
        pool.install(|| -> Result<Capture> {
            let mut kv = Default::default();
            let Some(p) = o.decode_from.map(|p| p as usize) else {
                let mut cap = streaming(&o.out, Capture::new("layer", o.internals), &model)?;
                let rope = model.rope(&pos);
                model.layer(o.layer, &x, &pos, &rope, &mut kv, &mut cap)?;
                return Ok(cap);
            };
            // No internal points under --decode-from (docs/producers.md).
            let mut cap = Capture::new("layer", false);
            if p > 0 {
                let rope = model.rope(&pos[..p]);
                model.layer(
                    o.layer,
                    &x[..p * h],
                    &pos[..p],
                    &rope,
                    &mut kv,
                    &mut Capture::off(),
                )?;
            }
            for r in p..rows {
                let at = &pos[r..r + 1];
                model.layer(
                    o.layer,
                    &x[r * h..(r + 1) * h],
                    at,
                    &model.rope(at),
                    &mut kv,
                    &mut cap,
                )?;
            }
            // Joined, so kept until every row is in; then written.
            cap.join_rows();
            cap.decode_from = Some(p as i64);
            streaming(&o.out, cap, &model)
        })
    })?;
    let mut prov = provenance(
        &o.model_dir,
        &raw,
        &wd,
        o.threads,
        o.internals && o.decode_from.is_none(),
        &o.command_line,
    );
    unused_provenance(&mut prov, &model.unused_tensors);
    prov["verb"] = json!("layer");
    prov["layer"] = json!(o.layer);
    if let Some(p) = o.decode_from {
        prov["decode_from"] = json!(p);
    }
    prov["input"] = json!({ "path": o.input.display().to_string(), "name": o.input_name, "trace_digest": input.digest().hex() });
    finish(prov, cap, model.forcing.as_ref(), &wd)
}

/// `--decode-from P`: the rows must be at positions exactly 0..m−1 in order, and 0 ≤ P < m.
fn check_decode_from(pos: &[i64], p: i64) -> Result<()> {
    if let Some((i, &bad)) = pos.iter().enumerate().find(|&(i, &q)| q != i as i64) {
        return Err(err!(Input:
            "--decode-from needs rows at positions 0..{} in order; row {i} is at position {bad}",
            pos.len() - 1
        ));
    }
    if !(0..pos.len() as i64).contains(&p) {
        return Err(err!(Input:
            "--decode-from {p} outside 0..{} (the input's {} rows)",
            pos.len() - 1,
            pos.len()
        ));
    }
    Ok(())
}

/// `engine info`: config summary, weights digest, inventory check (loading binds every tensor).
pub fn info(dir: &Path) -> Result<String> {
    if is_diffusion_gemma(dir) {
        return crate::model::diffusion_gemma::run::info(dir);
    }
    let (cfg, _) = load_config(dir)?;
    let store = crate::open_store(dir)?;
    let n = store.tensor_count();
    let model = Model::load(cfg, &store)?;
    let c = &model.cfg;
    let mut s = format!(
        "family {:?}\nlayers {}  hidden {}  heads {}/{}  head_dim {}  vocab {}\nintermediate {:?}  rms_norm_eps {}  rope_theta {}  tied {}  attention_bias {}\n",
        c.model_type, c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
        c.vocab_size, c.intermediate_size, c.rms_norm_eps, c.rope_theta, c.tie_word_embeddings, c.attention_bias
    );
    if c.model_type.is_qwen3_5() {
        let kinds: String = (0..c.num_hidden_layers)
            .map(|l| match c.layer_kind(l) {
                LayerKind::Full => 'F',
                LayerKind::Linear => 'L',
            })
            .collect();
        s += &format!(
            "layout {:?}  layer_types {kinds} (L linear, F full)  rotary_dim {}\n",
            c.layout, c.rotary_dim
        );
        if let Some(ls) = c.linear {
            s += &format!(
                "linear: conv_kernel {}  key heads {}×{}  value heads {}×{}\n",
                ls.conv_kernel,
                ls.num_key_heads,
                ls.key_head_dim,
                ls.num_value_heads,
                ls.value_head_dim
            );
        }
    }
    if let Some(g) = &c.gemma3 {
        let kinds: String = (0..c.num_hidden_layers)
            .map(|l| if c.window(l).is_some() { 'S' } else { 'F' })
            .collect();
        s += &format!(
            "layer_types {kinds} (S sliding, F full)  sliding_window {}  rope_local_base_freq {}  query_pre_attn_scalar {}  final_logit_softcapping {:?}\n",
            g.sliding_window, g.local_rope_theta, g.query_pre_attn_scalar, g.final_logit_softcapping
        );
    }
    if matches!(c.model_type, ModelType::Qwen3Moe | ModelType::Qwen3_5Moe) {
        let sparse: Vec<usize> = (0..c.num_hidden_layers)
            .filter(|&l| c.is_sparse(l))
            .collect();
        s += &format!(
            "experts {} top-{}  moe_intermediate {}  norm_topk_prob {}  sparse layers {:?}\n",
            c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.norm_topk_prob, sparse
        );
    }
    if c.shared_expert_intermediate_size > 0 {
        s += &format!(
            "shared expert intermediate {}\n",
            c.shared_expert_intermediate_size
        );
    }
    if c.model_type.is_qwen3_5() {
        let unused: usize = model.unused_tensors.iter().map(|(_, n)| n).sum();
        let list: Vec<String> = model
            .unused_tensors
            .iter()
            .map(|(p, n)| format!("{p}* {n}"))
            .collect();
        s += &format!(
            "tensors {n}: all present; {} run, {unused} unused ({})\n",
            n - unused,
            if list.is_empty() {
                "none".to_string()
            } else {
                list.join(", ")
            }
        );
    } else {
        s += &format!("tensors {n}: all present, all claimed\n");
    }
    s += &format!("weights_digest {}\n", store.weights_digest()?);
    Ok(s)
}
