//! `example-producer`: a small dense Qwen3 engine (f32, plain loops) that takes part in tracegate
//! the way a user's port does: it answers the two verbs of docs/producers.md and writes traces
//! with the `tracegate-trace` crate. What each capture point holds: docs/capture-points.md.
//!
//! It deliberately does NOT follow docs/numerics.md's ordered arithmetic: a dot product keeps
//! eight fused multiply-add lanes, softmax and SiLU use f32 `exp`, RoPE angles are formed in f64.
//! Its numbers differ from the engine's in the last bits, so it is judged by a policy
//! (`trace-diff --policy f32`, `gate bisect --policy f32`), as a real port is.
//!
//! Implemented: `trace` (default and internals capture points; `--generate N --cache on|off`
//! with the decode-step captures) and `layer` (also `--decode-from P`). Not implemented:
//! `--force-decisions` (optional; refused) and `qwen3_moe` (refused in one line).
//!
//! Test-only planted defects (examples/producer/tests/protocol.rs): `--plant k-norm:L` drops
//! layer L's k_norm weight; `--plant decode-pos` rotates a row decoded on the KV cache at its
//! position + 1 (the cached path only).

use std::collections::BTreeMap;
use std::fmt::Display;
use std::path::Path;
use std::process::ExitCode;

use serde_json::{json, Value};
use tracegate_trace::ndarray::Ix2;
use tracegate_trace::{names, weights_digest, Attributes, Trace, TraceWriter};

type Res<T> = Result<T, String>;

fn text<E: Display>(e: E) -> String {
    e.to_string()
}

fn main() -> ExitCode {
    match run(&std::env::args().collect::<Vec<_>>()) {
        Ok(()) => ExitCode::SUCCESS,
        // One line on stderr, exit 2: the gate quotes it in its refusal.
        Err(e) => {
            eprintln!("example-producer: {e}");
            ExitCode::from(2)
        }
    }
}

fn run(argv: &[String]) -> Res<()> {
    let (verb, args) = parse_args(argv)?;
    let plant = Plant::parse(args.get("--plant"))?;
    match verb.as_str() {
        "trace" => trace_verb(&args, plant),
        _ => layer_verb(&args, plant),
    }
}

// ---------------------------------------------------------------------------------------------
// Arguments: `VERB --name value …` (docs/producers.md; every flag takes a value)

type Args = BTreeMap<String, String>;

fn parse_args(argv: &[String]) -> Res<(String, Args)> {
    let verb = argv
        .get(1)
        .cloned()
        .ok_or("usage: example-producer trace|layer --name value …")?;
    let known: &[&str] = match verb.as_str() {
        "trace" => &[
            "--model",
            "--tokens",
            "--out",
            "--capture",
            "--generate",
            "--cache",
            "--plant",
        ],
        "layer" => &[
            "--model",
            "--layer",
            "--input",
            "--input-name",
            "--out",
            "--capture",
            "--decode-from",
            "--plant",
        ],
        other => return Err(format!("unknown verb {other:?} (expected trace or layer)")),
    };
    let mut args = Args::new();
    let mut rest = argv[2..].iter();
    while let Some(flag) = rest.next() {
        if flag == "--force-decisions" {
            return Err("--force-decisions is not implemented by this example (it is optional: docs/producers.md)".into());
        }
        if !known.contains(&flag.as_str()) {
            return Err(format!("{verb}: unknown argument {flag}"));
        }
        let value = rest
            .next()
            .ok_or_else(|| format!("{flag}: missing value"))?;
        args.insert(flag.clone(), value.clone());
    }
    Ok((verb, args))
}

fn req<'a>(a: &'a Args, flag: &str) -> Res<&'a str> {
    a.get(flag)
        .map(String::as_str)
        .ok_or_else(|| format!("missing {flag}"))
}

fn opt_num(a: &Args, flag: &str) -> Res<Option<usize>> {
    a.get(flag)
        .map(|v| {
            v.parse()
                .map_err(|_| format!("{flag} {v:?}: not a non-negative integer"))
        })
        .transpose()
}

fn internals(a: &Args) -> Res<bool> {
    match req(a, "--capture")? {
        "default" => Ok(false),
        "internals" => Ok(true),
        other => Err(format!(
            "--capture {other:?}: expected default or internals"
        )),
    }
}

/// Test-only planted defects: a negative control for the tests that judge this producer.
#[derive(Clone, Copy, Default)]
struct Plant {
    k_norm_layer: Option<usize>,
    decode_pos: bool,
}

impl Plant {
    fn parse(spec: Option<&String>) -> Res<Plant> {
        match spec.map(String::as_str) {
            None => Ok(Plant::default()),
            Some("decode-pos") => Ok(Plant {
                decode_pos: true,
                ..Plant::default()
            }),
            Some(s) => match s.strip_prefix("k-norm:").and_then(|l| l.parse().ok()) {
                Some(l) => Ok(Plant {
                    k_norm_layer: Some(l),
                    ..Plant::default()
                }),
                None => Err(format!(
                    "--plant {s:?}: expected k-norm:LAYER or decode-pos"
                )),
            },
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Checkpoint: config.json and a minimal safetensors reader

/// The config fields this example uses. A real port refuses every field it does not implement
/// (docs/numerics.md §13 lists them); this one checks the family, sliding windows and RoPE.
struct Config {
    vocab: usize,
    hidden: usize,
    inter: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    eps: f32,
    theta: f64,
    tied: bool,
    bias: bool,
}

fn read_config(dir: &Path) -> Res<(Config, Value)> {
    let p = dir.join("config.json");
    let raw: Value = serde_json::from_str(
        &std::fs::read_to_string(&p).map_err(|e| format!("{}: {e}", p.display()))?,
    )
    .map_err(|e| format!("{}: {e}", p.display()))?;
    let model_type = raw["model_type"].as_str().unwrap_or("");
    if model_type != "qwen3" {
        return Err(format!("{}: model_type {model_type:?} is not supported: this example implements dense qwen3 only", p.display()));
    }
    let rope = &raw["rope_parameters"];
    if raw["use_sliding_window"].as_bool() == Some(true)
        || !raw["rope_scaling"].is_null()
        || rope["rope_type"].as_str().is_some_and(|t| t != "default")
    {
        return Err(format!(
            "{}: sliding windows and RoPE scaling are not supported by this example",
            p.display()
        ));
    }
    let size = |k: &str| {
        raw[k]
            .as_u64()
            .filter(|&v| v > 0)
            .map(|v| v as usize)
            .ok_or_else(|| format!("{}: {k} is missing or not a positive integer", p.display()))
    };
    let (heads, kv_heads) = (size("num_attention_heads")?, size("num_key_value_heads")?);
    if heads % kv_heads != 0 {
        return Err(format!(
            "{}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}",
            p.display()
        ));
    }
    let c = Config {
        vocab: size("vocab_size")?,
        hidden: size("hidden_size")?,
        inter: size("intermediate_size")?,
        layers: size("num_hidden_layers")?,
        heads,
        kv_heads,
        head_dim: if raw["head_dim"].is_null() {
            128
        } else {
            size("head_dim")?
        },
        eps: raw["rms_norm_eps"].as_f64().unwrap_or(1e-6) as f32,
        theta: rope["rope_theta"]
            .as_f64()
            .or(raw["rope_theta"].as_f64())
            .unwrap_or(10000.0),
        tied: raw["tie_word_embeddings"].as_bool().unwrap_or(false),
        bias: raw["attention_bias"].as_bool().unwrap_or(false),
    };
    Ok((c, raw))
}

/// Every tensor of every `*.safetensors` file in `dir`, widened to f32: name → (shape, values).
/// The format: an 8-byte little-endian header length, a JSON header of
/// `{name: {dtype, shape, data_offsets: [begin, end]}}`, then the data the offsets point into.
struct Weights(BTreeMap<String, (Vec<usize>, Vec<f32>)>);

impl Weights {
    fn read(dir: &Path) -> Res<Weights> {
        let mut all = BTreeMap::new();
        for entry in std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))? {
            let path = entry.map_err(text)?.path();
            if path.extension().and_then(|x| x.to_str()) != Some("safetensors") {
                continue;
            }
            let bytes = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
            let bad = |why: String| format!("{}: {why}", path.display());
            let n = bytes.get(..8).map_or(0, |b| {
                u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize
            });
            let header: Value = bytes
                .get(8..8usize.saturating_add(n))
                .and_then(|h| serde_json::from_slice(h).ok())
                .ok_or_else(|| bad("no readable safetensors header".into()))?;
            let data = &bytes[8 + n..];
            for (name, t) in header
                .as_object()
                .ok_or_else(|| bad("header is not a JSON object".into()))?
            {
                if name == "__metadata__" {
                    continue;
                }
                let shape: Vec<usize> = serde_json::from_value(t["shape"].clone())
                    .map_err(|_| bad(format!("{name}: bad shape")))?;
                let [b, e]: [usize; 2] = serde_json::from_value(t["data_offsets"].clone())
                    .map_err(|_| bad(format!("{name}: bad data_offsets")))?;
                let raw = data
                    .get(b..e)
                    .ok_or_else(|| bad(format!("{name}: data_offsets outside the file")))?;
                let dtype = t["dtype"].as_str().unwrap_or("");
                let size: usize = match dtype {
                    "F32" => 4,
                    "BF16" | "F16" => 2,
                    _ => return Err(bad(format!("{name}: dtype {dtype:?} is not supported"))),
                };
                if shape.iter().try_fold(size, |n, &d| n.checked_mul(d)) != Some(raw.len()) {
                    return Err(bad(format!(
                        "{name}: shape {shape:?} of {dtype} does not match its {} bytes",
                        raw.len()
                    )));
                }
                let values: Vec<f32> = match dtype {
                    "F32" => raw
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect(),
                    "BF16" => raw
                        .chunks_exact(2)
                        .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                        .collect(),
                    _ => raw
                        .chunks_exact(2)
                        .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                        .collect(),
                };
                all.insert(name.clone(), (shape, values));
            }
        }
        Ok(Weights(all))
    }

    /// Removes tensor `name`, which must have `shape` (what config.json implies).
    fn take(&mut self, name: &str, shape: &[usize]) -> Res<Vec<f32>> {
        let (s, v) = self
            .0
            .remove(name)
            .ok_or_else(|| format!("checkpoint has no tensor {name}"))?;
        if s != shape {
            return Err(format!(
                "tensor {name} has shape {s:?}, config.json implies {shape:?}"
            ));
        }
        Ok(v)
    }

    fn linear(&mut self, name: &str, out: usize, inp: usize, bias: bool) -> Res<Linear> {
        let w = self.take(&format!("{name}.weight"), &[out, inp])?;
        let b = if bias {
            Some(self.take(&format!("{name}.bias"), &[out])?)
        } else {
            None
        };
        Ok(Linear { w, b, n_in: inp })
    }
}

// ---------------------------------------------------------------------------------------------
// Kernels (not the ordered ones of docs/numerics.md)

/// Eight fused multiply-add lanes summed at the end, as a SIMD kernel orders a dot product.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 8];
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        lanes[i % 8] = x.mul_add(*y, lanes[i % 8]);
    }
    lanes.iter().sum()
}

fn rmsnorm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let inv = 1.0 / (dot(x, x) / x.len() as f32 + eps).sqrt();
    x.iter().zip(w).map(|(v, w)| v * inv * w).collect()
}

/// Rotate-half RoPE of one head vector at position `pos` (element i pairs with i + d/2).
fn rope(x: &mut [f32], pos: f64, theta: f64) {
    let half = x.len() / 2;
    for i in 0..half {
        let angle = pos * theta.powf(-2.0 * i as f64 / x.len() as f64);
        let (s, c) = (angle.sin() as f32, angle.cos() as f32);
        let (a, b) = (x[i], x[i + half]);
        x[i] = a * c - b * s;
        x[i + half] = b * c + a * s;
    }
}

fn softmax(s: &mut [f32]) {
    let m = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut z = 0.0;
    for v in s.iter_mut() {
        *v = (*v - m).exp();
        z += *v;
    }
    s.iter_mut().for_each(|v| *v /= z);
}

fn silu(g: f32) -> f32 {
    g / (1.0 + (-g).exp())
}

/// The greedy decision of one logits row: the largest logit, ties to the lowest index; margin =
/// top-1 − top-2 in logit units (docs/capture-points.md, "Decisions").
fn argmax(row: &[f32]) -> Res<(i64, f32)> {
    if let Some(i) = row.iter().position(|v| v.is_nan()) {
        return Err(format!("NaN logit at vocabulary index {i}"));
    }
    let best = (0..row.len()).fold(0, |b, i| if row[i] > row[b] { i } else { b });
    let second = (0..row.len())
        .filter(|&i| i != best)
        .fold(None, |s: Option<usize>, i| match s {
            Some(j) if row[j] >= row[i] => Some(j),
            _ => Some(i),
        });
    Ok((
        best as i64,
        row[best] - row[second.ok_or("a vocabulary of one token has no margin")?],
    ))
}

// ---------------------------------------------------------------------------------------------
// Capture: what a forward records, then written in capture order

/// One tensor: `shape[0]` rows at positions `pos` (attn_probs: heads first), `path` its attribute.
struct Captured {
    name: String,
    path: &'static str,
    shape: Vec<usize>,
    data: Vec<f32>,
    pos: Vec<i64>,
}

/// `path` is the tensors' `path` attribute (prefill, decode, layer); `step` names a decode
/// step's tensors (`decode.SSSS.*`); `last_row` keeps only the last row (an uncached decode step
/// recomputes the whole sequence); `decode_from` is the attribute of `layer --decode-from`.
struct Cap {
    on: bool,
    internals: bool,
    path: &'static str,
    step: Option<usize>,
    last_row: bool,
    decode_from: Option<usize>,
    tensors: Vec<Captured>,
}

impl Cap {
    fn new(path: &'static str, internals: bool) -> Cap {
        Cap {
            on: true,
            internals,
            path,
            step: None,
            last_row: false,
            decode_from: None,
            tensors: vec![],
        }
    }
    fn off() -> Cap {
        Cap {
            on: false,
            ..Cap::new("", false)
        }
    }

    /// Records tensor `name` (rows at positions `pos`) if this capture wants it. `internal`: an
    /// internals-only point (q, k, v, attn_probs), never captured on a decode step, where only
    /// `logits` is always captured and the layer points and `final_norm.out` under internals.
    fn put(&mut self, name: &str, internal: bool, shape: &[usize], data: &[f32], pos: &[i64]) {
        let decode = self.path == "decode";
        let wanted = match (decode, internal) {
            (_, true) => self.internals && !decode,
            (false, false) => true,
            (true, false) => name == "logits" || (self.internals && name != "embed.out"),
        };
        if !self.on || !wanted {
            return;
        }
        let (mut shape, mut data, mut pos) = (shape.to_vec(), data, pos);
        if self.last_row {
            let cols = data.len() / shape[0];
            (shape[0], data, pos) = (1, &data[data.len() - cols..], &pos[pos.len() - 1..]);
        }
        let name = match self.step {
            Some(s) => names::decode(s, name),
            None => name.to_string(),
        };
        // `layer --decode-from` runs one row at a time: its rows are appended to one tensor.
        match self.tensors.iter_mut().find(|t| t.name == name) {
            Some(t) => {
                t.shape[0] += shape[0];
                t.data.extend_from_slice(data);
                t.pos.extend_from_slice(pos);
            }
            None => self.tensors.push(Captured {
                name,
                path: self.path,
                shape,
                data: data.to_vec(),
                pos: pos.to_vec(),
            }),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The model

struct Linear {
    w: Vec<f32>,
    b: Option<Vec<f32>>,
    n_in: usize,
}

impl Linear {
    /// `W·x (+ b)` for one row `x`, W stored `[out, in]`.
    fn apply(&self, x: &[f32]) -> Vec<f32> {
        self.w
            .chunks_exact(self.n_in)
            .enumerate()
            .map(|(o, w)| dot(x, w) + self.b.as_ref().map_or(0.0, |b| b[o]))
            .collect()
    }
}

/// One decoder layer's weights, by their checkpoint names (`model.layers.N.…`).
struct Layer {
    input_norm: Vec<f32>,
    post_norm: Vec<f32>,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
    gate: Linear,
    up: Linear,
    down: Linear,
}

/// One layer's KV cache: k rows (after k_norm and RoPE) and v rows, `[kv_heads · head_dim]` each,
/// with their positions.
#[derive(Default)]
struct Kv {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    pos: Vec<i64>,
}

struct Model {
    c: Config,
    embed: Vec<f32>,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    head: Linear,
    plant: Plant,
}

impl Model {
    fn load(dir: &Path, plant: Plant) -> Res<(Model, Value)> {
        let (c, raw) = read_config(dir)?;
        let mut w = Weights::read(dir)?;
        let (h, d, b) = (c.hidden, c.head_dim, c.bias);
        let embed = w.take("model.embed_tokens.weight", &[c.vocab, h])?;
        let mut layers = vec![];
        for l in 0..c.layers {
            let p = format!("model.layers.{l}");
            let mut k_norm = w.take(&format!("{p}.self_attn.k_norm.weight"), &[d])?;
            if plant.k_norm_layer == Some(l) {
                k_norm.fill(1.0);
            }
            layers.push(Layer {
                input_norm: w.take(&format!("{p}.input_layernorm.weight"), &[h])?,
                post_norm: w.take(&format!("{p}.post_attention_layernorm.weight"), &[h])?,
                q: w.linear(&format!("{p}.self_attn.q_proj"), c.heads * d, h, b)?,
                k: w.linear(&format!("{p}.self_attn.k_proj"), c.kv_heads * d, h, b)?,
                v: w.linear(&format!("{p}.self_attn.v_proj"), c.kv_heads * d, h, b)?,
                o: w.linear(&format!("{p}.self_attn.o_proj"), h, c.heads * d, b)?,
                q_norm: w.take(&format!("{p}.self_attn.q_norm.weight"), &[d])?,
                k_norm,
                gate: w.linear(&format!("{p}.mlp.gate_proj"), c.inter, h, false)?,
                up: w.linear(&format!("{p}.mlp.up_proj"), c.inter, h, false)?,
                down: w.linear(&format!("{p}.mlp.down_proj"), h, c.inter, false)?,
            });
        }
        let norm = w.take("model.norm.weight", &[h])?;
        let head = if c.tied {
            Linear {
                w: embed.clone(),
                b: None,
                n_in: h,
            }
        } else {
            w.linear("lm_head", c.vocab, h, false)?
        };
        if let Some(name) = w.0.keys().next() {
            return Err(format!(
                "tensor {name} is not used by this example (a model it does not implement)"
            ));
        }
        Ok((
            Model {
                c,
                embed,
                layers,
                norm,
                head,
                plant,
            },
            raw,
        ))
    }

    fn new_cache(&self) -> Vec<Kv> {
        (0..self.c.layers).map(|_| Kv::default()).collect()
    }

    /// Tokens at positions `pos0..`, attending to `kv` and appending to it (empty: a prefill or
    /// an uncached recompute). `decode`: this is one cached decode step. Returns logits `[T, V]`.
    fn forward(
        &self,
        tokens: &[i64],
        pos0: i64,
        kv: &mut [Kv],
        cap: &mut Cap,
        decode: bool,
    ) -> Res<Vec<f32>> {
        let (h, t) = (self.c.hidden, tokens.len());
        let pos: Vec<i64> = (pos0..pos0 + t as i64).collect();
        let mut x = Vec::with_capacity(t * h);
        for &id in tokens {
            let row = usize::try_from(id).ok().filter(|&r| r < self.c.vocab);
            let row = row.ok_or_else(|| {
                format!("token id {id} outside the vocabulary [0, {})", self.c.vocab)
            })?;
            x.extend_from_slice(&self.embed[row * h..(row + 1) * h]);
        }
        cap.put("embed.out", false, &[t, h], &x, &pos);
        for (l, kv) in kv.iter_mut().enumerate() {
            x = self.layer(l, &x, &pos, kv, cap, decode);
        }
        let xn: Vec<f32> = x
            .chunks_exact(h)
            .flat_map(|r| rmsnorm(r, &self.norm, self.c.eps))
            .collect();
        cap.put("final_norm.out", false, &[t, h], &xn, &pos);
        let logits: Vec<f32> = xn
            .chunks_exact(h)
            .flat_map(|r| self.head.apply(r))
            .collect();
        cap.put("logits", false, &[t, self.c.vocab], &logits, &pos);
        Ok(logits)
    }

    /// Decoder layer `l` on rows `x` at positions `pos`: row r attends to every cached or new row
    /// c with `pos[c] <= pos[r]`, and the new rows' k/v are appended to `kv`. The one function for
    /// a prefill, a cached decode step (one row) and the `layer` verb (with or without
    /// `--decode-from`), so the verbs agree with the whole run by construction.
    fn layer(
        &self,
        l: usize,
        x: &[f32],
        pos: &[i64],
        kv: &mut Kv,
        cap: &mut Cap,
        decode: bool,
    ) -> Vec<f32> {
        let (c, w) = (&self.c, &self.layers[l]);
        let (h, d, nq, nkv, t) = (c.hidden, c.head_dim, c.heads, c.kv_heads, pos.len());
        cap.put(&names::layer(l, "hidden_in"), false, &[t, h], x, pos);
        let (mut q, mut k, mut v) = (vec![], vec![], vec![]);
        for (r, row) in x.chunks_exact(h).enumerate() {
            let xn = rmsnorm(row, &w.input_norm, c.eps);
            let at = pos[r] as f64
                + if decode && self.plant.decode_pos {
                    1.0
                } else {
                    0.0
                };
            for (proj, norm, out) in [(&w.q, &w.q_norm, &mut q), (&w.k, &w.k_norm, &mut k)] {
                let mut y = proj.apply(&xn);
                for head in y.chunks_exact_mut(d) {
                    let normed = rmsnorm(head, norm, c.eps);
                    head.copy_from_slice(&normed);
                    rope(head, at, c.theta);
                }
                out.extend(y);
            }
            v.extend(w.v.apply(&xn));
        }
        cap.put(&names::layer(l, "q"), true, &[t, nq, d], &q, pos);
        cap.put(&names::layer(l, "k"), true, &[t, nkv, d], &k, pos);
        cap.put(&names::layer(l, "v"), true, &[t, nkv, d], &v, pos);
        for r in 0..t {
            kv.k.push(k[r * nkv * d..(r + 1) * nkv * d].to_vec());
            kv.v.push(v[r * nkv * d..(r + 1) * nkv * d].to_vec());
            kv.pos.push(pos[r]);
        }
        let tk = kv.pos.len();
        let scale = 1.0 / (d as f32).sqrt();
        let mut probs = vec![0.0f32; nq * t * tk]; // [heads, rows, keys]
        let mut o = vec![0.0f32; t * nq * d]; // per row, head-major
        for r in 0..t {
            let visible: Vec<usize> = (0..tk).filter(|&j| kv.pos[j] <= pos[r]).collect();
            for hq in 0..nq {
                let hk = hq / (nq / nkv); // GQA: consecutive query heads share a kv head
                let qv = &q[(r * nq + hq) * d..(r * nq + hq + 1) * d];
                let mut s: Vec<f32> = visible
                    .iter()
                    .map(|&j| dot(qv, &kv.k[j][hk * d..(hk + 1) * d]) * scale)
                    .collect();
                softmax(&mut s);
                let out = &mut o[(r * nq + hq) * d..(r * nq + hq + 1) * d];
                for (&j, &p) in visible.iter().zip(&s) {
                    probs[(hq * t + r) * tk + j] = p;
                    for (o, vv) in out.iter_mut().zip(&kv.v[j][hk * d..(hk + 1) * d]) {
                        *o = p.mul_add(*vv, *o);
                    }
                }
            }
        }
        cap.put(
            &names::layer(l, "attn_probs"),
            true,
            &[nq, t, tk],
            &probs,
            pos,
        );
        let a: Vec<f32> = o
            .chunks_exact(nq * d)
            .flat_map(|row| w.o.apply(row))
            .collect();
        cap.put(&names::layer(l, "attn_out"), false, &[t, h], &a, pos);
        let h1: Vec<f32> = x.iter().zip(&a).map(|(x, a)| x + a).collect();
        let m: Vec<f32> = h1
            .chunks_exact(h)
            .flat_map(|row| {
                let xn = rmsnorm(row, &w.post_norm, c.eps);
                let hm: Vec<f32> = w
                    .gate
                    .apply(&xn)
                    .iter()
                    .zip(w.up.apply(&xn))
                    .map(|(g, u)| silu(*g) * u)
                    .collect();
                w.down.apply(&hm)
            })
            .collect();
        cap.put(&names::layer(l, "mlp_out"), false, &[t, h], &m, pos);
        let out: Vec<f32> = h1.iter().zip(&m).map(|(a, b)| a + b).collect();
        cap.put(&names::layer(l, "hidden_out"), false, &[t, h], &out, pos);
        out
    }
}

// ---------------------------------------------------------------------------------------------
// The verbs

/// What makes a trace comparable (docs/capture-points.md, "Provenance"): above all
/// `weights_digest` from tracegate's own function — any other hash makes trace-diff and
/// gate bisect refuse every comparison with the engine as `weights_mismatch`.
fn provenance(dir: &Path, raw: &Value, verb: &str, internals: bool) -> Res<Value> {
    Ok(json!({
        "producer": "example-producer",
        "versions": { "tracegate-example-producer": env!("CARGO_PKG_VERSION") },
        "device": "cpu",
        "dtype": "f32",
        "determinism": "single thread; not docs/numerics.md (FMA lanes, f32 exp)",
        "model_dir": dir.display().to_string(),
        "weights_digest": weights_digest(dir).map_err(text)?,
        "config": raw,
        "capture": if internals { "internals" } else { "default" },
        "command_line": std::env::args().collect::<Vec<_>>(),
        "verb": verb,
    }))
}

type Decision = (String, Vec<i64>, Vec<f32>);

fn write(out: &str, provenance: Value, cap: &Cap, decisions: &[Decision]) -> Res<()> {
    let mut w = TraceWriter::create(out, provenance).map_err(text)?;
    for t in &cap.tensors {
        let mut attrs = Attributes::default()
            .with_path(t.path)
            .with_mask("causal")
            .with_positions(t.pos.clone());
        if let Some(p) = cap.decode_from {
            attrs.extra.insert("decode_from".into(), p.to_string());
        }
        let shape: Vec<u64> = t.shape.iter().map(|&n| n as u64).collect();
        w.tensor_f32(&t.name, &shape, &t.data, &attrs)
            .map_err(text)?;
    }
    for (name, values, margins) in decisions {
        w.decision(name, &[values.len() as u64], values, Some(margins))
            .map_err(text)?;
    }
    println!("{} {out}", w.finish().map_err(text)?.hex());
    Ok(())
}

/// `trace`: the prompt at positions 0..n−1, then greedy decode. Step 0 is the prompt's last
/// logits row; step s ≥ 1 runs token s−1 at position n+s−1, on the cache (one row) or by
/// recomputing the whole sequence and keeping its last row.
fn trace_verb(a: &Args, plant: Plant) -> Res<()> {
    let dir = Path::new(req(a, "--model")?);
    let tokens = req(a, "--tokens")?
        .split(',')
        .map(|t| {
            t.trim()
                .parse::<i64>()
                .map_err(|_| format!("--tokens: {t:?} is not a token id"))
        })
        .collect::<Res<Vec<_>>>()?;
    let internals = internals(a)?;
    let generate = opt_num(a, "--generate")?.unwrap_or(0);
    let cache = match a.get("--cache").map(String::as_str) {
        None | Some("on") => true,
        Some("off") => false,
        Some(other) => return Err(format!("--cache {other:?}: expected on or off")),
    };
    let (model, raw) = Model::load(dir, plant)?;
    let (n, vocab) = (tokens.len(), model.c.vocab);
    let mut cap = Cap::new("prefill", internals);
    let mut kv = model.new_cache();
    let logits = model.forward(&tokens, 0, &mut kv, &mut cap, false)?;
    let (ids, margins) = logits
        .chunks_exact(vocab)
        .map(argmax)
        .collect::<Res<Vec<_>>>()?
        .into_iter()
        .unzip();
    let mut decisions: Vec<Decision> = vec![("logits.argmax".into(), ids, margins)];
    let mut seq = tokens.clone();
    let mut row = logits[(n - 1) * vocab..].to_vec();
    cap.path = "decode";
    for s in 0..generate {
        let p = (n + s) as i64 - 1;
        cap.step = Some(s);
        if s == 0 {
            cap.put("logits", false, &[1, vocab], &row, &[p]);
        } else if cache {
            row = model.forward(&seq[seq.len() - 1..], p, &mut kv, &mut cap, true)?;
        } else {
            cap.last_row = true;
            let all = model.forward(&seq, 0, &mut model.new_cache(), &mut cap, false)?;
            cap.last_row = false;
            row = all[(seq.len() - 1) * vocab..].to_vec();
        }
        let (token, margin) = argmax(&row)?;
        decisions.push((names::decode(s, "argmax"), vec![token], vec![margin]));
        seq.push(token);
    }
    let mut prov = provenance(dir, &raw, "trace", internals)?;
    prov["prompt_tokens"] = json!(tokens);
    prov["generate"] = json!(generate);
    prov["cache"] = json!(if cache { "on" } else { "off" });
    write(req(a, "--out")?, prov, &cap, &decisions)
}

/// `layer`: layer L alone on tensor NAME of another trace (rows at its `positions`). With
/// `--decode-from P` (positions 0..m−1): rows before P fill the KV cache, then each row from P on
/// runs the cached decode path; only those rows are written.
fn layer_verb(a: &Args, plant: Plant) -> Res<()> {
    let dir = Path::new(req(a, "--model")?);
    let l = opt_num(a, "--layer")?.ok_or("missing --layer")?;
    let (input, name) = (req(a, "--input")?, req(a, "--input-name")?);
    let internals = internals(a)?;
    let decode_from = opt_num(a, "--decode-from")?;
    let (model, raw) = Model::load(dir, plant)?;
    if l >= model.c.layers {
        return Err(format!(
            "--layer {l} out of range (the model has {} layers)",
            model.c.layers
        ));
    }
    let tr = Trace::open(input).map_err(text)?;
    let info = tr
        .tensor_info(name)
        .ok_or_else(|| format!("{input}: no tensor {name}"))?;
    let h = model.c.hidden;
    // The input in place in the map, as a [rows, hidden] view of its recorded shape.
    let x = match tr
        .view_of::<f32>(info)
        .map_err(text)?
        .into_dimensionality::<Ix2>()
    {
        Ok(x) if x.ncols() == h && x.nrows() > 0 => x,
        _ => {
            return Err(format!(
                "{input}: tensor {name} has shape {:?}, expected [rows, {h}]",
                info.shape
            ))
        }
    };
    let rows = x.nrows();
    let pos = info
        .attributes
        .positions
        .clone()
        .filter(|p| p.len() == rows);
    let pos = pos.ok_or_else(|| {
        format!("{input}: tensor {name} has no positions attribute with one position per row")
    })?;
    let x = x.as_slice().ok_or("a payload view is row-major")?;
    let mut prov = provenance(dir, &raw, "layer", internals)?;
    prov["layer"] = json!(l);
    prov["input"] = json!({ "path": input, "name": name, "trace_digest": tr.digest().hex() });
    let mut kv = Kv::default();
    let cap = match decode_from {
        None => {
            let mut cap = Cap::new("layer", internals);
            model.layer(l, x, &pos, &mut kv, &mut cap, false);
            cap
        }
        Some(p) => {
            if let Some(r) = (0..rows).find(|&r| pos[r] != r as i64) {
                return Err(format!("{input}: tensor {name}: --decode-from needs positions 0..{} in order; row {r} is at position {}", rows - 1, pos[r]));
            }
            if p >= rows {
                return Err(format!(
                    "--decode-from {p}: tensor {name} has {rows} rows (need P < rows)"
                ));
            }
            model.layer(l, &x[..p * h], &pos[..p], &mut kv, &mut Cap::off(), false);
            // No internals points under --decode-from (docs/producers.md).
            let mut cap = Cap {
                decode_from: Some(p),
                ..Cap::new("layer", false)
            };
            for r in p..rows {
                model.layer(
                    l,
                    &x[r * h..(r + 1) * h],
                    &pos[r..r + 1],
                    &mut kv,
                    &mut cap,
                    true,
                );
            }
            prov["decode_from"] = json!(p);
            cap
        }
    };
    write(req(a, "--out")?, prov, &cap, &[])
}
