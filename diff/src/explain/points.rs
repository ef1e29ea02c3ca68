//! Which capture points `--explain` recomputes, from what (docs/capture-points.md, §11 of
//! docs/numerics.md): `logits` = `final_norm.out · Wᵀ` (W the head: `lm_head.weight`, or the
//! embedding when tied; Gemma 3's softcap after it), and `final_norm.out` = RMSNorm of the last
//! layer's `hidden_out` with the final norm's weight; each also as a decode step's
//! (`decode.SSSS.`). Inside a layer, the projections of a normed input whose norm's own input is
//! captured: `v` and `attn_gate` (of `input_layernorm(hidden_in)`), `router.logits` and
//! `shared_expert.gate` (of `post_attention_layernorm(hidden_in ⊕ attn_out)`). The normed input
//! itself is no capture point, so it is recomputed from the side's own captured input under every
//! norm order, then the projection under every matmul order. Every other point is refused by
//! name, with the reason (`refusal`). The weights are read by the engine's own loader
//! (`tracegate_engine::open_store`, the config by `load_config`), the inputs from each side's
//! own trace.

use std::collections::BTreeMap;
use std::path::Path;

use tracegate_engine::config::Config;
use tracegate_trace::{names, DType, TensorInfo, Trace};

use super::orders::{NormOrder, Order};
use super::{distance, store_as, widened, SideResult};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// `logits`: the head's matmul.
    Head,
    /// `final_norm.out`: the final RMSNorm.
    FinalNorm,
    /// A layer's projection of a normed input (the norm's output is not captured).
    Projection(Proj),
}

/// The layer projections covered: each a plain matmul of a layer norm's output, whose input is
/// captured by default.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Proj {
    /// `v = v_proj(input_layernorm(hidden_in))` (+ bias): neither normed nor rotated (§8.1).
    V,
    /// Qwen3.5's `attn_gate`: the gate half of each head of `q_proj(input_layernorm(hidden_in))`,
    /// before the sigmoid (§17.1).
    AttnGate,
    /// `router.logits = post_attention_layernorm(hidden_in ⊕ attn_out) · router_weightᵀ` (§10).
    Router,
    /// Qwen3.5-MoE's `shared_expert.gate = shared_expert_gate(x2)`, before the sigmoid.
    SharedGate,
}

impl Proj {
    /// The normed input's norm, and whether its input is `hidden_in ⊕ attn_out` (else `hidden_in`).
    fn norm(self) -> (&'static str, bool) {
        match self {
            Proj::V | Proj::AttnGate => ("input_layernorm", false),
            Proj::Router | Proj::SharedGate => ("post_attention_layernorm", true),
        }
    }
}

/// A point with a recomputable definition: which, its step prefix ("" or "decode.SSSS.") and its
/// layer (for a layer's point).
pub(super) struct Definition {
    kind: Kind,
    prefix: String,
    layer: usize,
}

/// Why a layer point has no recomputable definition here (docs/diff.md, "Explaining a
/// difference", says the same).
fn refusal(point: &str) -> &'static str {
    match point {
        "q" | "k" => "its projection after the per-head q_norm/k_norm and RoPE: the projection's own output is not captured, and neither a norm nor a rotation of an uncaptured input is searched",
        "attn_probs" => "a softmax (§8), not a matmul or a norm",
        "attn_out" => "o_proj of the attention context p·v, which is not captured (recomputing it is a second reduction, over the keys, whose order is not searched)",
        "mlp_out" | "out" | "shared_expert.out" | "dense_mlp.out" => "down_proj of act(gate(x2)) · up(x2): the product is not captured (three matmuls and an activation, not one reduction)",
        "hidden_in" | "hidden_out" | "attn_residual" => "an elementwise sum of captured tensors: one rounding per element, no summation order",
        p if p.starts_with("linear.") => "a linear-attention point (conv, L2 norm, delta rule, gated norm): no order of these is searched",
        _ => "a point with no definition from captured inputs here",
    }
}

impl Definition {
    pub fn of(tensor: &str) -> Result<Definition, String> {
        let (prefix, rest) = match tensor.strip_prefix("decode.") {
            Some(r)
                if r.len() > 5 && r[..4].bytes().all(|b| b.is_ascii_digit()) && &r[4..5] == "." =>
            {
                (&tensor[..12], &r[5..])
            }
            _ => ("", tensor),
        };
        let name = names::Name::parse(rest);
        let refused = |why: &str| {
            format!(
                "no recomputable definition: {why}. --explain recomputes logits, final_norm.out (and their decode.SSSS. forms) and a layer's v, attn_gate, router.logits and shared_expert.gate; the inputs of {tensor} are not all captured (docs/diff.md, \"Explaining a difference\")"
            )
        };
        let (kind, layer) = match (name.layer, name.expert, name.diffusion, name.point) {
            (None, _, None, "logits") => (Kind::Head, 0),
            (None, _, None, "final_norm.out") => (Kind::FinalNorm, 0),
            (Some(l), None, None, point) => {
                let proj = match point {
                    "v" => Proj::V,
                    "attn_gate" => Proj::AttnGate,
                    "router.logits" => Proj::Router,
                    "shared_expert.gate" => Proj::SharedGate,
                    p => return Err(refused(&format!("layer.LL.{p} is {}", refusal(p)))),
                };
                (Kind::Projection(proj), l)
            }
            (Some(_), Some(_), None, _) => {
                return Err(refused(&format!(
                    "an expert's output is {}",
                    refusal("out")
                )))
            }
            (_, _, Some(_), _) => return Err(refused("a diffusion pass's point")),
            _ => return Err(refused(&format!("{tensor} is {}", refusal("")))),
        };
        Ok(Definition {
            kind,
            prefix: prefix.to_string(),
            layer,
        })
    }

    pub fn words(&self) -> String {
        let p = &self.prefix;
        let l = |point: &str| format!("{p}{}", names::layer(self.layer, point));
        match self.kind {
            Kind::Head => format!("{p}logits = {p}final_norm.out · Wᵀ"),
            Kind::FinalNorm => format!("{p}final_norm.out = RMSNorm({p}layer.LL.hidden_out)"),
            Kind::Projection(proj) => {
                let (norm, h1) = proj.norm();
                let input = match h1 {
                    false => l("hidden_in"),
                    true => format!("{} ⊕ {}", l("hidden_in"), l("attn_out")),
                };
                format!("{} = {norm}({input}) · Wᵀ", l(self.point()))
            }
        }
    }

    fn point(&self) -> &'static str {
        match self.kind {
            Kind::Head => "logits",
            Kind::FinalNorm => "final_norm.out",
            Kind::Projection(Proj::V) => "v",
            Kind::Projection(Proj::AttnGate) => "attn_gate",
            Kind::Projection(Proj::Router) => "router.logits",
            Kind::Projection(Proj::SharedGate) => "shared_expert.gate",
        }
    }

    pub fn needs(&self) -> &'static str {
        match self.kind {
            Kind::Head => "head weight (lm_head.weight, or embed_tokens.weight when tied)",
            Kind::FinalNorm => "final norm's weight and epsilon",
            Kind::Projection(_) => "layer's projection and norm weights and epsilon",
        }
    }
}

/// One side's input to the definition: its tensor widened to f32, `[rows, width]`.
pub(super) struct SideInput {
    name: String,
    x: Vec<f32>,
    width: usize,
    bytes: Vec<u8>,
}

impl SideInput {
    fn row(&self, r: usize) -> &[f32] {
        &self.x[r * self.width..(r + 1) * self.width]
    }
}

/// Whether the two sides' inputs are the same bits (a note in the explanation).
pub(super) fn inputs_note(r: &SideInput, c: &SideInput) -> String {
    if r.bytes == c.bytes {
        format!(
            "inputs: {} of each side, bit-identical between the two",
            r.name
        )
    } else {
        let differ =
            r.x.iter()
                .zip(&c.x)
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count();
        format!(
            "inputs: {} of each side, differing in {differ} of {} elements: each side is recomputed from its own",
            r.name,
            r.x.len()
        )
    }
}

/// A definition bound to a model: its weights (only the matrix rows the checked elements need)
/// and the names of its inputs.
pub(super) struct Recompute {
    kind: Kind,
    /// The input tensors; two are added elementwise (`hidden_in ⊕ attn_out`).
    inputs: Vec<String>,
    pub definition: String,
    pub notes: Vec<String>,
    /// The matrix's rows, widened, by output index (Head, Projection).
    head: BTreeMap<usize, Vec<f32>>,
    /// The projection's bias by output index, when it has one.
    bias: BTreeMap<usize, f32>,
    softcap: Option<f32>,
    /// The norm's weight factor per element: w, or 1 ⊕ w when zero-centred (FinalNorm, and the
    /// normed input of a Projection).
    scale: Vec<f32>,
    /// The norm's name in an order's name (Projection).
    norm: &'static str,
    eps: f32,
    width: usize,
    /// The output's columns (its elements per row); 0: not checked (FinalNorm, = width).
    columns: usize,
}

impl Recompute {
    /// The config and weights of `model` for `def`, the head rows the elements `at` (row,
    /// output) need; refuses a checkpoint whose weights digest is not the traces'.
    pub fn load(
        def: &Definition,
        model: &Path,
        reference: &Trace,
        candidate: &Trace,
        at: &[(usize, usize)],
    ) -> Result<Recompute, String> {
        let shown = model.display();
        let (cfg, _) =
            tracegate_engine::load_config(model).map_err(|e| format!("--model {shown}: {e}"))?;
        let mut notes = vec![digest_note(model, reference, candidate)?];
        let store =
            tracegate_engine::open_store(model).map_err(|e| format!("--model {shown}: {e}"))?;
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        let m = cfg.layout.prefix();
        let p = &def.prefix;
        let mut r = Recompute {
            kind: def.kind,
            inputs: Vec::new(),
            definition: String::new(),
            notes: Vec::new(),
            head: BTreeMap::new(),
            bias: BTreeMap::new(),
            softcap: None,
            scale: Vec::new(),
            norm: "",
            eps: cfg.eps_f32(),
            width: h,
            columns: 0,
        };
        let zc = cfg.model_type.zero_centred_norms();
        match def.kind {
            Kind::Head => {
                let name = if cfg.tie_word_embeddings {
                    format!("{m}embed_tokens.weight")
                } else {
                    "lm_head.weight".to_string()
                };
                let w = store
                    .take(&name, &[v, h])
                    .map_err(|e| format!("--model {shown}: {e}"))?;
                for &(_, o) in at {
                    let mut row = vec![0.0f32; h];
                    w.widen_row(o, 0, &mut row);
                    r.head.insert(o, row);
                }
                r.softcap = softcap(&cfg);
                r.columns = v;
                r.inputs = vec![format!("{p}final_norm.out")];
                r.definition = format!(
                    "{p}logits = {p}final_norm.out · Wᵀ, W = {name} [{v}, {h}]{} (docs/numerics.md §11, §2){}",
                    if cfg.tie_word_embeddings { " (tied)" } else { "" },
                    match r.softcap {
                        Some(c) => format!(", then the softcap {c} (§22.5)"),
                        None => String::new(),
                    }
                );
            }
            Kind::FinalNorm => {
                let name = format!("{m}norm.weight");
                let w = store
                    .take(&name, &[h])
                    .map_err(|e| format!("--model {shown}: {e}"))?
                    .to_vec();
                r.scale = norm_factor(w, zc);
                r.inputs = vec![format!(
                    "{p}{}",
                    names::layer(cfg.num_hidden_layers.saturating_sub(1), "hidden_out")
                )];
                r.definition = format!(
                    "{p}final_norm.out = RMSNorm({}, {name}, eps {:e}){} (docs/numerics.md {})",
                    r.inputs[0],
                    cfg.rms_norm_eps,
                    if zc { ", zero-centred (1 ⊕ w)" } else { "" },
                    if zc { "§15.1" } else { "§6" }
                );
            }
            Kind::Projection(proj) => {
                let l = def.layer;
                if l >= cfg.num_hidden_layers {
                    return Err(format!(
                        "--model {shown}: layer {l} of a model of {} layers",
                        cfg.num_hidden_layers
                    ));
                }
                let lp = format!("{m}layers.{l}");
                let take = |name: &str, shape: &[usize]| {
                    store
                        .take(name, shape)
                        .map_err(|e| format!("--model {shown}: {e}"))
                };
                let (nq, nkv, d) = (
                    cfg.num_attention_heads,
                    cfg.num_key_value_heads,
                    cfg.head_dim,
                );
                // The matrix, its shape, its bias, the output's columns, and which matrix row
                // gives output column o.
                let (wname, shape, bias, cols, row_of): (_, _, _, _, Box<dyn Fn(usize) -> usize>) =
                    match proj {
                        Proj::V => (
                            format!("{lp}.self_attn.v_proj"),
                            [nkv * d, h],
                            cfg.attention_bias,
                            nkv * d,
                            Box::new(|o| o),
                        ),
                        // §17.1: q_proj's head hh holds [query | gate], d each.
                        Proj::AttnGate => (
                            format!("{lp}.self_attn.q_proj"),
                            [nq * 2 * d, h],
                            cfg.attention_bias,
                            nq * d,
                            Box::new(move |o| (o / d) * 2 * d + d + o % d),
                        ),
                        Proj::Router => (
                            format!("{lp}.mlp.gate"),
                            [cfg.num_experts, h],
                            false,
                            cfg.num_experts,
                            Box::new(|o| o),
                        ),
                        Proj::SharedGate => (
                            format!("{lp}.mlp.shared_expert_gate"),
                            [1, h],
                            false,
                            1,
                            Box::new(|o| o),
                        ),
                    };
                // A family whose layer norms the MLP's input elsewhere (Gemma 3's sandwich).
                if proj.norm().1 && cfg.model_type.sandwich_norms() {
                    return Err(format!(
                        "{:?}'s MLP input is normed by pre_feedforward_layernorm after a normed attn_out: not this definition",
                        cfg.model_type
                    ));
                }
                let w = take(&format!("{wname}.weight"), &shape)?;
                let b = match bias {
                    true => Some(take(&format!("{wname}.bias"), &shape[..1])?.to_vec()),
                    false => None,
                };
                for &(_, o) in at {
                    if o >= cols {
                        return Err(format!("output column {o}: {wname} gives {cols} per row"));
                    }
                    let mut row = vec![0.0f32; h];
                    w.widen_row(row_of(o), 0, &mut row);
                    r.head.insert(o, row);
                    if let Some(b) = &b {
                        r.bias.insert(o, b[row_of(o)]);
                    }
                }
                let (norm, h1) = proj.norm();
                let nw = take(&format!("{lp}.{norm}.weight"), &[h])?.to_vec();
                r.scale = norm_factor(nw, zc);
                r.norm = norm;
                r.columns = cols;
                let lname = |point: &str| format!("{p}{}", names::layer(l, point));
                r.inputs = vec![lname("hidden_in")];
                if h1 {
                    r.inputs.push(lname("attn_out"));
                }
                r.definition = format!(
                    "{} = {norm}({}) · Wᵀ{}, W = {wname}.weight [{}, {h}]{} (docs/numerics.md {}, §2; the normed input is not captured: it is recomputed from the side's own {} under every norm order, then the projection under every matmul order)",
                    lname(def.point()),
                    r.inputs.join(" ⊕ "),
                    if b.is_some() { " + bias" } else { "" },
                    shape[0],
                    if proj == Proj::AttnGate { ", each head's gate half" } else { "" },
                    if zc { "§15.1" } else { "§6" },
                    r.inputs.join(" and "),
                );
            }
        }
        notes.push(format!("model: {shown} (family {:?})", cfg.model_type));
        r.notes = notes;
        Ok(r)
    }

    /// This side's input tensor, checked against its output `out` (`[rows, …]`, same positions).
    pub fn side(&self, t: &Trace, out: &TensorInfo, who: &str) -> Result<SideInput, String> {
        let want_rows = out.shape.first().copied();
        let columns: u64 = out.shape.iter().skip(1).product();
        let mut x: Vec<f32> = Vec::new();
        let mut bytes = Vec::new();
        for input in &self.inputs {
            let info = t.tensor_info(input).ok_or_else(|| {
                format!(
                    "the {who} trace holds no {input} (the input of {})",
                    out.name
                )
            })?;
            if info.shape.len() != 2
                || info.shape[1] as usize != self.width
                || info.shape.first().copied() != want_rows
                || out.shape.len() < 2
            {
                return Err(format!(
                    "{who}: {input} has shape {:?} and {} {:?}: not [rows, {}] beside [rows, …]",
                    info.shape, out.name, out.shape, self.width
                ));
            }
            if info.attributes.positions != out.attributes.positions {
                return Err(format!(
                    "{who}: {input} and {} hold other positions ({:?} / {:?}): their rows are not the same tokens",
                    out.name, info.attributes.positions, out.attributes.positions
                ));
            }
            let v = widened(t, info)?;
            // §11's residual add `hidden_in ⊕ attn_out`: one rounding per element.
            x = match x.is_empty() {
                true => v,
                false => x.iter().zip(&v).map(|(a, b)| a + b).collect(),
            };
            bytes.extend_from_slice(t.data(info));
        }
        if self.columns != 0 && columns != self.columns as u64 {
            return Err(format!(
                "{who}: {} {:?} has {columns} elements per row, the model's {}",
                out.name, out.shape, self.columns
            ));
        }
        Ok(SideInput {
            name: self.inputs.join(" ⊕ "),
            x,
            width: self.width,
            bytes,
        })
    }

    /// Every order against one side's stored bits (`stored`, in `dtype`) at the elements `at`:
    /// how many orders were tried, and what they gave.
    pub fn search(
        &self,
        side: &SideInput,
        at: &[(usize, usize)],
        dtype: DType,
        stored: &[u64],
    ) -> (usize, SideResult) {
        let mut results: Vec<(String, Vec<u64>)> = Vec::new();
        match self.kind {
            Kind::Head => {
                for order in Order::all() {
                    let d = at
                        .iter()
                        .zip(stored)
                        .map(|(&(r, o), &s)| {
                            let mut v = order.dot(side.row(r), &self.head[&o]);
                            if let Some(c) = self.softcap {
                                v = tracegate_engine::ops::softcap(v, c);
                            }
                            distance(dtype, store_as(dtype, v), s)
                        })
                        .collect();
                    results.push((order.name(), d));
                }
            }
            Kind::FinalNorm => {
                for order in NormOrder::all() {
                    let mut inv = BTreeMap::new();
                    let d = at
                        .iter()
                        .zip(stored)
                        .map(|(&(r, i), &s)| {
                            let x = side.row(r);
                            let inv = *inv.entry(r).or_insert_with(|| order.inv(x, self.eps));
                            let v = order.element(x[i], inv, self.scale[i]);
                            distance(dtype, store_as(dtype, v), s)
                        })
                        .collect();
                    results.push((order.name(), d));
                }
            }
            Kind::Projection(_) => {
                let norms = NormOrder::all();
                let orders = Order::all();
                for (first, alike, rows) in self.normed(side, at, &norms) {
                    let norm = match alike {
                        0 => format!("{}: {}", self.norm, norms[first].name()),
                        n => format!(
                            "{}: {} (or {n} other norm orders giving the same rows)",
                            self.norm,
                            norms[first].name()
                        ),
                    };
                    for order in &orders {
                        let d = at
                            .iter()
                            .zip(stored)
                            .map(|(&(r, o), &s)| {
                                let mut v = order.dot(&rows[&r], &self.head[&o]);
                                if let Some(b) = self.bias.get(&o) {
                                    v += b;
                                }
                                distance(dtype, store_as(dtype, v), s)
                            })
                            .collect();
                        results.push((format!("{} | {norm}", order.name()), d));
                    }
                }
                // Every pair was tried: the norm orders that give the same rows at once.
                let tried = norms.len() * orders.len();
                return (tried, summarise(results));
            }
        }
        let tried = results.len();
        (tried, summarise(results))
    }

    /// The normed input rows the elements `at` read, under each norm order, grouped: norm orders
    /// that give the same bits on every such row are one group (first order's index, how many
    /// others, the rows by row index), in the order of their first member (§6's first).
    fn normed(
        &self,
        side: &SideInput,
        at: &[(usize, usize)],
        norms: &[NormOrder],
    ) -> Vec<(usize, usize, BTreeMap<usize, Vec<f32>>)> {
        let rows: std::collections::BTreeSet<usize> = at.iter().map(|&(r, _)| r).collect();
        let mut groups: Vec<(usize, usize, BTreeMap<usize, Vec<f32>>)> = Vec::new();
        for (i, n) in norms.iter().enumerate() {
            let got: BTreeMap<usize, Vec<f32>> = rows
                .iter()
                .map(|&r| {
                    let x = side.row(r);
                    let inv = n.inv(x, self.eps);
                    let y = x
                        .iter()
                        .zip(&self.scale)
                        .map(|(&v, &u)| n.element(v, inv, u))
                        .collect();
                    (r, y)
                })
                .collect();
            let same = |a: &BTreeMap<usize, Vec<f32>>| {
                a.values()
                    .zip(got.values())
                    .all(|(p, q)| p.iter().zip(q).all(|(x, y)| x.to_bits() == y.to_bits()))
            };
            match groups.iter_mut().find(|g| same(&g.2)) {
                Some(g) => g.1 += 1,
                None => groups.push((i, 0, got)),
            }
        }
        groups
    }
}

/// What the orders tried gave: those reproducing every element, and the closest one.
fn summarise(results: Vec<(String, Vec<u64>)>) -> SideResult {
    let reproduced_by = results
        .iter()
        .filter(|(_, d)| d.iter().all(|&x| x == 0))
        .map(|(n, _)| n.clone())
        .collect();
    // `.expect` is safe: every kind tries at least one order (Order::all, NormOrder::all).
    let closest = results
        .into_iter()
        .map(|(n, d)| {
            let max = d.iter().copied().max().unwrap_or(0);
            let off = d.iter().filter(|&&x| x != 0).count();
            (n, max, off, d)
        })
        .min_by_key(|(_, max, off, _)| (*max, *off))
        .expect("at least one order");
    SideResult {
        reproduced_by,
        closest,
    }
}

/// A norm's weight factor per element: w, or `1 ⊕ w` when the family's norms are zero-centred
/// (§15.1).
fn norm_factor(w: Vec<f32>, zero_centred: bool) -> Vec<f32> {
    match zero_centred {
        true => w.iter().map(|&x| 1.0 + x).collect(),
        false => w,
    }
}

fn softcap(cfg: &Config) -> Option<f32> {
    cfg.gemma3
        .as_ref()
        .and_then(|g| g.final_logit_softcapping)
        .map(|c| c as f32)
}

/// The checkpoint's weights digest against the traces' provenance: refused when the reference
/// ran other weights (every recomputation would be of another model); said when a side records
/// none.
fn digest_note(model: &Path, reference: &Trace, candidate: &Trace) -> Result<String, String> {
    let shown = model.display();
    let ours =
        tracegate_engine::weights_digest(model).map_err(|e| format!("--model {shown}: {e}"))?;
    let theirs = |t: &Trace| {
        t.provenance()
            .get("weights_digest")
            .and_then(|v| v.as_str())
            .map(str::to_string)
    };
    let (r, c) = (theirs(reference), theirs(candidate));
    if let Some(r) = &r {
        if *r != ours {
            return Err(format!(
                "--model {shown}: weights digest {ours}, the reference trace's is {r}: not the weights it ran"
            ));
        }
    }
    Ok(match (r, c) {
        (Some(_), Some(c)) if c == ours => "weights: digest equal to both traces'".to_string(),
        (Some(_), Some(c)) => format!(
            "weights: digest equal to the reference's; the candidate records {c}: it ran other weights"
        ),
        (Some(_), None) => {
            "weights: digest equal to the reference's; the candidate records none (NOT CHECKED for it)"
                .to_string()
        }
        (None, _) => "weights: NOT CHECKED against the traces (the reference records no weights_digest)".to_string(),
    })
}
