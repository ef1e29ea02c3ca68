//! Diffusion Gemma's `engine trace`: the prompt's encoder pass, then per block the denoise
//! steps (temperature, probabilities, entropy, and the step's decisions: argmax, sampled, accept,
//! renoise, stop), the commit and the commit's encoder pass (docs/diffusion-gemma.md DG12–DG17);
//! the capture in DG16's order and the forcing of DG17.

use rayon::prelude::*;
use serde_json::{json, Value};
use tracegate_trace::{names, Digest, TraceWriter};

use super::config::{DgConfig, DiffusionOptions, Knobs};
use super::{mask_of, DgModel, Pass};
use crate::capture::Capture;
use crate::force::{argmax_or_forced, forced_values, overridden, Forcing};
use crate::options::{pool, LayerOptions, TraceOptions};
use crate::provenance::{beside_weights_digest, finish, provenance, unused_provenance};
use crate::splitmix::{self, Purpose};
use crate::{err, Result};

/// The per-row statistics of one step's tempered logits (DG12.2, DG12.3).
struct RowStats {
    p: Vec<f32>,
    entropy: f32,
}

/// §8.6 softmax of `l` (the exponentials by `ops::exp_shifted`, bit-equal to §4's libm rule)
/// and DG12.3's entropy from the same `m` and `z`.
fn row_stats(l: &[f32]) -> RowStats {
    let (p, m, z) = super::softmax_row(l);
    let lse = m + ((z as f64).ln() as f32);
    let mut acc = 0.0f32;
    for (&v, &pv) in l.iter().zip(&p) {
        let lp = (v - lse).max(-f32::MAX);
        acc += lp * pv;
    }
    RowStats { p, entropy: -acc }
}

/// A diffusion Gemma trace (DG14, DG16). `o.generate` is max_new_tokens: ceil(N / C) blocks.
pub fn run_trace(o: &TraceOptions, d: &DiffusionOptions) -> Result<Digest> {
    if !o.cache {
        return Err(
            err!(Input: "--cache off: not supported for diffusion_gemma (the decoder reads the encoder's KV cache; there is no uncached path)"),
        );
    }
    if o.tokens.is_empty() {
        return Err(err!(Input: "--tokens: the prompt is empty"));
    }
    let (_, raw) = read_config(&o.model_dir)?;
    let cfg = DgConfig::from_json(&raw)?;
    let knobs = Knobs::resolve(&o.model_dir, o.generate, d, cfg.vocab)?;
    let seed = d.seed.unwrap_or(0);
    let c = cfg.canvas;
    let blocks = o.generate.div_ceil(c);
    let n = o.tokens.len();
    let total = blocks
        .checked_mul(c)
        .and_then(|x| x.checked_add(n))
        .filter(|&x| x <= cfg.max_positions && blocks < 1 << 32);
    if total.is_none() {
        return Err(err!(Input:
            "--tokens/--generate: {n} prompt tokens plus {blocks} canvases of {c} exceed max_position_embeddings {}",
            cfg.max_positions
        ));
    }
    let store = crate::open_store(&o.model_dir)?;
    let model = DgModel::load(cfg, &store)?;
    let forcing = match &o.force_decisions {
        Some(p) => {
            let f = Forcing::open(p)?;
            f.check_prompt(&o.tokens)?;
            Some(f)
        }
        None => None,
    };
    let pool = pool(o.threads)?;
    let cap = streaming(&o.out, o.internals, &model, forcing.as_ref())?;
    let (wd, (cap, output, blocks_run)) = beside_weights_digest(&store, || {
        pool.install(|| {
            generate(
                &model,
                &o.tokens,
                &knobs,
                seed,
                blocks,
                cap,
                forcing.as_ref(),
            )
        })
    })?;
    let mut prov = provenance(
        &o.model_dir,
        &raw,
        &wd,
        o.threads,
        o.internals,
        &o.command_line,
    );
    unused_provenance(&mut prov, &model.unused_tensors);
    prov["verb"] = json!("trace");
    prov["prompt_tokens"] = json!(o.tokens);
    if let Some(text) = &o.prompt_text {
        prov["prompt_text"] = text.clone();
    }
    prov["cache"] = json!("on");
    prov["generate"] = json!(o.generate);
    prov["generation"] = knobs.provenance(c);
    prov["rng"] = json!("splitmix64-dg15");
    prov["seed"] = json!(seed);
    prov["blocks"] = json!(blocks_run);
    prov["output_tokens"] = json!(output);
    finish(prov, cap, forcing.as_ref(), &wd)
}

/// A capture (`encode` the path of the prompt pass's names) writing each tensor to `out` as it
/// is recorded, with DG16's masks; nothing is at `out` until `finish`.
fn streaming(
    out: &std::path::Path,
    internals: bool,
    model: &DgModel,
    forcing: Option<&Forcing>,
) -> Result<Capture> {
    let w = TraceWriter::create(out, json!({}))?;
    Ok(Capture::new("encode", internals).stream_to(
        w,
        forcing.map(|f| f.digest.as_str()),
        mask_of(&model.cfg),
    ))
}

fn read_config(dir: &std::path::Path) -> Result<((), Value)> {
    let p = dir.join("config.json");
    let bytes = tracegate_trace::json::read_bytes(&p, tracegate_trace::json::MAX_JSON_LEN)
        .map_err(|e| err!(Config: "{e}"))?;
    let raw = tracegate_trace::json::parse(&bytes)
        .map_err(|e| err!(Config: "{}: invalid JSON: {e}", p.display()))?;
    Ok(((), raw))
}

/// DG14: the prompt's pass, then the blocks. Returns the capture, the output tokens (committed
/// canvases after EOS padding) and the number of blocks run.
fn generate(
    model: &DgModel,
    prompt: &[i64],
    k: &Knobs,
    seed: u64,
    blocks: usize,
    mut cap: Capture,
    forcing: Option<&Forcing>,
) -> Result<(Capture, Vec<i64>, usize)> {
    let cfg = &model.cfg;
    let (c, v) = (cfg.canvas, cfg.vocab);
    let mut cache = model.new_cache();
    let ppos: Vec<i64> = (0..prompt.len() as i64).collect();
    model.encode(Pass::Prompt, prompt, &ppos, &mut cache, &mut cap, forcing)?;
    let mut output = vec![];
    let mut l0 = prompt.len();
    let mut run = 0;
    let n_steps = k.steps;
    // DG12.1's constants: f32(t_min), f32(t_max − t_min) (the binary64 difference), f32(N).
    let (t_min, t_span, nf) = (k.t_min as f32, (k.t_max - k.t_min) as f32, n_steps as f32);
    // What a forced value of each decision may be (DG17).
    let is_token = |t: i64| (0..v as i64).contains(&t);
    let is_token_or_kept = |t: i64| (-1..v as i64).contains(&t);
    let is_flag = |a: i64| a == 0 || a == 1;
    let beta = k.entropy_bound as f32;
    let thr = k.confidence as f32;
    for b in 0..blocks {
        run = b + 1;
        let pos: Vec<i64> = (l0 as i64..(l0 + c) as i64).collect();
        // DG14: the initial canvas, INIT(b, 0).
        let init_name = names::denoise_block(b, "init_canvas");
        let forced = forced_values(forcing, &init_name, c, is_token, "a token id")?;
        // A draw has no "own choice" to override: none counted.
        let over = forced.as_ref().map(|_| vec![]);
        let canvas_0 = forced.unwrap_or_else(|| {
            let key = splitmix::key(seed, Purpose::Init, b as u64, 0);
            (0..c)
                .map(|r| splitmix::token(splitmix::output(key, r as u64), v as u64) as i64)
                .collect()
        });
        cap.decided(&init_name, &[c], canvas_0.clone(), None, over);
        let mut canvas = canvas_0;
        let mut prev: Option<Vec<f32>> = None;
        let mut history: Vec<Vec<i64>> = vec![];
        let mut last_argmax: (Vec<i64>, Vec<f32>) = (vec![], vec![]);
        for s in 0..n_steps {
            let pass = Pass::Denoise(b, s);
            cap.tokens(&pass.name("canvas"), &[c], &canvas, &pos);
            let logits = model.denoise(
                pass,
                &canvas,
                &pos,
                prev.as_deref(),
                &mut cache,
                &mut cap,
                forcing,
            )?;
            // DG12.1 T_s with k = N − s.
            let kk = (n_steps - s) as f32;
            let temp = t_min + t_span * (kk / nf);
            let mut tempered = logits;
            tempered.par_chunks_mut(v).for_each(|row| {
                for x in row {
                    *x /= temp;
                }
            });
            cap.tensor(&pass.name("logits.tempered"), &[c, v], &tempered, &pos);
            let stats: Vec<RowStats> = tempered.par_chunks(v).map(row_stats).collect();
            let entropy: Vec<f32> = stats.iter().map(|s| s.entropy).collect();
            if let Some(r) = entropy.iter().position(|h| h.is_nan()) {
                return Err(err!(NaN: "NaN entropy at block {b}, step {s}, row {r}"));
            }
            cap.tensor(&pass.name("entropy"), &[c], &entropy, &pos);

            // DG13.1 argmax of the tempered logits.
            let name = pass.name("argmax");
            let forced = forced_values(forcing, &name, c, is_token, "a token id")?;
            let (mut argmax, mut margins, mut over) = (vec![], vec![], vec![]);
            for (r, row) in tempered.chunks(v).enumerate() {
                let (t, m, o) = argmax_or_forced(row, forced.as_ref().map(|f| f[r]), || {
                    format!("tempered logit at block {b}, step {s}, row {r}")
                })?;
                argmax.push(t);
                margins.push(m);
                if o {
                    over.push(r as u64);
                }
            }
            let over = forced.map(|_| over);
            cap.decided(&name, &[c], argmax.clone(), Some(margins.clone()), over);

            // DG13.2 sampled: categorical from P with SAMPLE(b, s).
            let name = pass.name("sampled");
            let forced = forced_values(forcing, &name, c, is_token, "a token id")?;
            // A draw has no "own choice" to override: none counted.
            let over = forced.as_ref().map(|_| vec![]);
            let sampled = match forced {
                Some(f) => f,
                None => {
                    let key = splitmix::key(seed, Purpose::Sample, b as u64, s as u64);
                    let mut f = vec![];
                    for (r, st) in stats.iter().enumerate() {
                        let u = splitmix::uniform(splitmix::output(key, r as u64));
                        let t = splitmix::categorical(&st.p, u).ok_or_else(
                            || err!(NaN: "no positive probability at block {b}, step {s}, row {r}"),
                        )?;
                        f.push(t as i64);
                    }
                    f
                }
            };
            let m: Vec<f32> = sampled
                .iter()
                .zip(&stats)
                .map(|(&t, st)| st.p[t as usize])
                .collect();
            cap.decided(&name, &[c], sampled.clone(), Some(m), over);

            // DG13.3 accept: rank by (entropy, row), cumulative sums in rank order.
            let mut order: Vec<usize> = (0..c).collect();
            order.sort_by(|&a, &bb| {
                entropy[a]
                    .partial_cmp(&entropy[bb])
                    .unwrap_or(std::cmp::Ordering::Equal)
            });
            let mut x = vec![0.0f32; c];
            let mut sum = 0.0f32;
            for &r in &order {
                sum += entropy[r];
                x[r] = sum - entropy[r];
            }
            let own_accept: Vec<i64> = x.iter().map(|&xj| i64::from(xj <= beta)).collect();
            let name = pass.name("accept");
            let forced = forced_values(forcing, &name, c, is_flag, "0 or 1")?;
            let over = forced
                .as_ref()
                .map(|f| overridden(f.iter().zip(&own_accept).map(|(a, b)| a != b)));
            let accept = forced.unwrap_or(own_accept);
            let m = accept_margins(&accept, &x, beta);
            cap.decided(&name, &[c], accept.clone(), Some(m), over);

            // DG13.4 renoise: a whole new canvas from RENOISE(b, s); the next canvas.
            let name = pass.name("renoise");
            let forced = forced_values(forcing, &name, c, is_token_or_kept, "a token id or -1")?;
            if let Some(f) = &forced {
                if let Some(r) = (0..c).find(|&r| (f[r] == -1) != (accept[r] == 1)) {
                    return Err(err!(Input:
                        "--force-decisions: decision {name} row {r} is {} where accept is {}",
                        f[r], accept[r]
                    ));
                }
            }
            // A draw has no "own choice" to override: none counted.
            let over = forced.as_ref().map(|_| vec![]);
            let renoise = forced.unwrap_or_else(|| {
                let key = splitmix::key(seed, Purpose::Renoise, b as u64, s as u64);
                (0..c)
                    .map(|r| {
                        let t = splitmix::token(splitmix::output(key, r as u64), v as u64);
                        if accept[r] == 1 {
                            -1
                        } else {
                            t as i64
                        }
                    })
                    .collect()
            });
            cap.decided(&name, &[c], renoise.clone(), None, over);
            let next: Vec<i64> = (0..c)
                .map(|r| {
                    if accept[r] == 1 {
                        sampled[r]
                    } else {
                        renoise[r]
                    }
                })
                .collect();

            // DG13.5 stop = stable ∧ confident.
            let run_len = history.iter().rev().take_while(|h| **h == argmax).count();
            let st_thr = k.stability;
            let mut mu = 0.0f32;
            for &h in &entropy {
                mu += h;
            }
            mu /= c as f32;
            let own_stable = run_len >= st_thr;
            let own_conf = mu < thr;
            let own = [own_stable, own_conf, own_stable && own_conf].map(i64::from);
            let name = pass.name("stop");
            let forced = forced_values(forcing, &name, 3, is_flag, "0 or 1")?;
            let over = forced
                .as_ref()
                .map(|f| overridden(f.iter().zip(&own).map(|(a, b)| a != b)));
            let stop = forced.unwrap_or(own.to_vec());
            let stab_m = |stable: bool| {
                if stable {
                    run_len as f32 - st_thr as f32
                } else {
                    st_thr as f32 - run_len as f32
                }
            };
            let conf_m = |conf: bool| if conf { thr - mu } else { mu - thr };
            let (m0, m1) = (stab_m(stop[0] == 1), conf_m(stop[1] == 1));
            let m2 = if stop[0] == 1 { m1 } else { m0 };
            cap.decided(&name, &[3], stop.clone(), Some(vec![m0, m1, m2]), over);
            history.push(argmax.clone());
            last_argmax = (argmax, margins);
            prev = Some(tempered);
            canvas = next;
            if stop[2] == 1 {
                break;
            }
        }
        // DG13.6 commit = the last step's argmax.
        let (commit, cm) = last_argmax;
        let name = names::denoise_block(b, "commit");
        if let Some(f) = forcing {
            if let Some(refc) = f.values(&name) {
                if refc != commit.as_slice() {
                    return Err(err!(Input:
                        "--force-decisions {}: decision {name} is {refc:?}, this run commits {commit:?} (the forced argmax of its last step)",
                        f.path.display()
                    ));
                }
            }
        }
        cap.decision(&name, &[c], commit.clone(), Some(cm));
        let mut out = commit.clone();
        let eos_at = out.iter().position(|t| k.eos.contains(t));
        if let Some(i) = eos_at {
            if let Some(pad) = k.pad {
                for t in out.iter_mut().skip(i + 1) {
                    *t = pad;
                }
            }
        }
        output.extend_from_slice(&out);
        if eos_at.is_some() {
            break;
        }
        if b + 1 < blocks {
            model.encode(
                Pass::Encode(b),
                &commit,
                &pos,
                &mut cache,
                &mut cap,
                forcing,
            )?;
        }
        l0 += c;
    }
    Ok((cap, output, run))
}

/// DG13.3's margins for accept values `a`: `β ⊖ x` where accepted, `x ⊖ β` where not (negative
/// where the value is not this producer's own).
fn accept_margins(a: &[i64], x: &[f32], beta: f32) -> Vec<f32> {
    a.iter()
        .zip(x)
        .map(|(&a, &xj)| if a == 1 { beta - xj } else { xj - beta })
        .collect()
}

/// `engine info` for diffusion Gemma: the config as read, the tensors (every one bound or set
/// aside), the weights digest.
pub fn info(dir: &std::path::Path) -> Result<String> {
    let (_, raw) = read_config(dir)?;
    let cfg = DgConfig::from_json(&raw)?;
    let store = crate::open_store(dir)?;
    let n = store.tensor_count();
    let model = DgModel::load(cfg, &store)?;
    let c = &model.cfg;
    let kinds: String = c
        .sliding
        .iter()
        .map(|&s| if s { 'S' } else { 'F' })
        .collect();
    let unused: usize = model.unused_tensors.iter().map(|(_, n)| n).sum();
    let mut s = format!(
        "family diffusion_gemma\nlayers {}  hidden {}  heads {}  vocab {}  intermediate {}  rms_norm_eps {}  tied {}\n",
        c.layers, c.hidden, c.heads, c.vocab, c.intermediate, c.eps, c.tied
    );
    s += &format!(
        "layer_types {kinds} (S sliding, F full)  sliding_window {}  sliding head_dim {} kv {} theta {}  full head_dim {} kv {} theta {} rotated pairs {}\n",
        c.window, c.sliding_attn.head_dim, c.sliding_attn.kv_heads, c.sliding_attn.theta,
        c.full_attn.head_dim, c.full_attn.kv_heads, c.full_attn.theta, c.full_attn.rotated
    );
    s += &format!(
        "experts {} top-{}  moe_intermediate {}  canvas {}  final_logit_softcapping {}\n",
        c.experts, c.top_k, c.moe_intermediate, c.canvas, c.softcap
    );
    s += &format!(
        "tensors {n}: all present; {} run, {unused} unused\n",
        n - unused
    );
    s += &format!("weights_digest {}\n", store.weights_digest()?);
    Ok(s)
}

/// Which pass `name` is layer `l`'s input of (`P` + `layer.LL.hidden_in`, P one of DG16's
/// three pass prefixes); an error naming it for anything else.
fn layer_input_pass(name: &str, l: usize) -> Result<Pass> {
    match Pass::of(&names::Name::parse(name)) {
        Some(p) if p.name(&names::layer(l, "hidden_in")) == name => Ok(p),
        _ => Err(err!(Input:
            "--input-name {name}: not layer {l}'s input of a pass ({0}, encode.BBBB.{0} or denoise.BBBB.SSSS.{0})",
            names::layer(l, "hidden_in")
        )),
    }
}

/// DG6's cache of layer `l` for `pass`, read back from `input`: every earlier encoder pass's
/// `layer.LL.k`/`v` (the prompt's, then `encode.0000.` … up to the block before this one), in
/// the order the whole run appended them. The prompt pass has none. The decoder's sliding
/// window over it is `DgModel::layer`'s, as in the whole run.
fn cache_from_trace(
    input: &tracegate_trace::Trace,
    path: &std::path::Path,
    pass: Pass,
    l: usize,
    row: usize,
) -> Result<super::LayerCache> {
    let before = match pass {
        Pass::Prompt => return Ok(super::LayerCache::default()),
        Pass::Encode(b) | Pass::Denoise(b, _) => b,
    };
    let earlier = std::iter::once(Pass::Prompt).chain((0..before).map(Pass::Encode));
    let mut kv = super::LayerCache::default();
    for p in earlier {
        let (kn, vn) = (p.name(&names::layer(l, "k")), p.name(&names::layer(l, "v")));
        let mut rows: Option<Vec<i64>> = None;
        for (name, dst) in [(&kn, &mut kv.k), (&vn, &mut kv.v)] {
            let Some(info) = input.tensor_info(name) else {
                return Err(err!(Input:
                    "{}: no tensor {name} (the keys of {}): the input trace must be captured with --capture internals",
                    path.display(),
                    pass.name(&names::layer(l, "hidden_in"))
                ));
            };
            let pos = info.attributes.positions.clone().unwrap_or_default();
            let data = input.f32_vec(name)?;
            if pos.is_empty() || data.len() != pos.len() * row {
                return Err(err!(Input:
                    "{}: tensor {name} has shape {:?} and {} positions, expected [rows, {row}] elements per position",
                    path.display(),
                    info.shape,
                    pos.len()
                ));
            }
            if rows.as_ref().is_some_and(|r| *r != pos) {
                return Err(err!(Input:
                    "{}: tensors {kn} and {vn} are at different positions",
                    path.display()
                ));
            }
            dst.extend_from_slice(&data);
            rows = Some(pos);
        }
        kv.pos.extend(rows.unwrap_or_default());
    }
    Ok(kv)
}

/// `engine layer` for diffusion Gemma (docs/producers.md, "Block diffusion"): layer L alone on
/// `P.layer.LL.hidden_in` of TRACE, its keys DG6's for pass P — the cached rows read back from
/// the same TRACE's encoder k/v — through `DgModel::layer`, the call the whole run makes, so the
/// output repeats the whole run's points for that layer and pass bit for bit.
pub fn run_layer(o: &LayerOptions) -> Result<Digest> {
    if o.decode_from.is_some() {
        return Err(
            err!(Input: "--decode-from: not for diffusion_gemma (there is no greedy decode step; name a denoise step's input instead)"),
        );
    }
    let (_, raw) = read_config(&o.model_dir)?;
    let cfg = DgConfig::from_json(&raw)?;
    if o.layer >= cfg.layers {
        return Err(err!(Input:
            "--layer {} out of range (model has {} layers)",
            o.layer,
            cfg.layers
        ));
    }
    let pass = layer_input_pass(&o.input_name, o.layer)?;
    let input = tracegate_trace::Trace::open(&o.input)?;
    let shown = o.input.display();
    let info = input
        .tensor_info(&o.input_name)
        .ok_or_else(|| err!(Input: "{shown}: no tensor {}", o.input_name))?;
    let h = cfg.hidden;
    let rows = match info.shape.as_slice() {
        [t, hh] if *hh as usize == h && *t >= 1 => *t as usize,
        s => {
            return Err(err!(Input:
                "{shown}: tensor {} has shape {s:?}, expected [rows, {h}]",
                o.input_name
            ))
        }
    };
    let pos = info.attributes.positions.clone().ok_or_else(
        || err!(Input: "{shown}: tensor {} has no positions attribute", o.input_name),
    )?;
    if pos.len() != rows {
        return Err(err!(Input:
            "{shown}: tensor {}: {} positions for {rows} rows",
            o.input_name,
            pos.len()
        ));
    }
    if let Some(p) = pos
        .iter()
        .find(|&&p| !(0..cfg.max_positions as i64).contains(&p))
    {
        return Err(err!(Input:
            "{shown}: tensor {}: position {p} outside [0, max_position_embeddings {})",
            o.input_name,
            cfg.max_positions
        ));
    }
    let x = input.f32_vec(&o.input_name)?;
    let a = cfg.attn(o.layer);
    let mut kv = cache_from_trace(&input, &o.input, pass, o.layer, a.kv_heads * a.head_dim)?;
    let forcing = o
        .force_decisions
        .as_deref()
        .map(Forcing::open)
        .transpose()?;
    let store = crate::open_store(&o.model_dir)?;
    let model = DgModel::load(cfg, &store)?;
    let pool = pool(o.threads)?;
    let mut cap = streaming(&o.out, o.internals, &model, forcing.as_ref())?;
    let (wd, ()) = beside_weights_digest(&store, || {
        pool.install(|| model.layer(pass, o.layer, &x, &pos, &mut kv, &mut cap, forcing.as_ref()))
            .map(|_| ())
    })?;
    let mut prov = provenance(
        &o.model_dir,
        &raw,
        &wd,
        o.threads,
        o.internals,
        &o.command_line,
    );
    unused_provenance(&mut prov, &model.unused_tensors);
    prov["verb"] = json!("layer");
    prov["layer"] = json!(o.layer);
    prov["input"] = json!({ "path": o.input.display().to_string(), "name": o.input_name, "trace_digest": input.digest().hex() });
    finish(prov, cap, forcing.as_ref(), &wd)
}
