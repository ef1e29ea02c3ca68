//! Which capture points `--explain` recomputes, from what (docs/capture-points.md, §11 of
//! docs/numerics.md): `logits` = `final_norm.out · Wᵀ` (W the head: `lm_head.weight`, or the
//! embedding when tied; Gemma 3's softcap after it), and `final_norm.out` = RMSNorm of the last
//! layer's `hidden_out` with the final norm's weight; each also as a decode step's
//! (`decode.SSSS.`). Every other point's input is not captured (the normed `xn` and `x2` the
//! projections read, the attention's `p·v`), so it is refused by name. The weights are read by
//! the engine's own loader (`tracegate_engine::open_store`, the config by `load_config`), the
//! inputs from each side's own trace.

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
}

/// A point with a recomputable definition: which, and its step prefix ("" or "decode.SSSS.").
pub(super) struct Definition {
    kind: Kind,
    prefix: String,
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
        let kind = match rest {
            "logits" => Kind::Head,
            "final_norm.out" => Kind::FinalNorm,
            _ => {
                return Err(format!(
                    "no recomputable definition: --explain recomputes logits (from final_norm.out and the head's weight) and final_norm.out (from the last layer's hidden_out and the final norm's weight), and their decode.SSSS. forms; the inputs of {tensor} are not all captured (docs/diff.md, \"Explaining a difference\")"
                ))
            }
        };
        Ok(Definition {
            kind,
            prefix: prefix.to_string(),
        })
    }

    pub fn words(&self) -> String {
        match self.kind {
            Kind::Head => format!("{p}logits = {p}final_norm.out · Wᵀ", p = self.prefix),
            Kind::FinalNorm => format!(
                "{p}final_norm.out = RMSNorm({p}layer.LL.hidden_out)",
                p = self.prefix
            ),
        }
    }

    pub fn needs(&self) -> &'static str {
        match self.kind {
            Kind::Head => "head weight (lm_head.weight, or embed_tokens.weight when tied)",
            Kind::FinalNorm => "final norm's weight and epsilon",
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

/// A definition bound to a model: its weights (only the head rows the checked elements need)
/// and the names of its inputs.
pub(super) struct Recompute {
    kind: Kind,
    input: String,
    pub definition: String,
    pub notes: Vec<String>,
    /// The head's rows, widened, by output index (Head).
    head: BTreeMap<usize, Vec<f32>>,
    softcap: Option<f32>,
    /// The final norm's weight factor per element: w, or 1 ⊕ w when zero-centred (FinalNorm).
    scale: Vec<f32>,
    eps: f32,
    width: usize,
    vocab: usize,
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
            input: String::new(),
            definition: String::new(),
            notes: Vec::new(),
            head: BTreeMap::new(),
            softcap: None,
            scale: Vec::new(),
            eps: cfg.eps_f32(),
            width: h,
            vocab: v,
        };
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
                r.input = format!("{p}final_norm.out");
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
                let zc = cfg.model_type.zero_centred_norms();
                r.scale = if zc {
                    w.iter().map(|&x| 1.0 + x).collect()
                } else {
                    w
                };
                r.input = format!(
                    "{p}{}",
                    names::layer(cfg.num_hidden_layers.saturating_sub(1), "hidden_out")
                );
                r.definition = format!(
                    "{p}final_norm.out = RMSNorm({}, {name}, eps {:e}){} (docs/numerics.md {})",
                    r.input,
                    cfg.rms_norm_eps,
                    if zc { ", zero-centred (1 ⊕ w)" } else { "" },
                    if zc { "§15.1" } else { "§6" }
                );
            }
        }
        notes.push(format!("model: {shown} (family {:?})", cfg.model_type));
        r.notes = notes;
        Ok(r)
    }

    /// This side's input tensor, checked against its output `out` (`[rows, …]`, same positions).
    pub fn side(&self, t: &Trace, out: &TensorInfo, who: &str) -> Result<SideInput, String> {
        let info = t.tensor_info(&self.input).ok_or_else(|| {
            format!(
                "the {who} trace holds no {} (the input of {})",
                self.input, out.name
            )
        })?;
        let want_rows = out.shape.first().copied();
        if info.shape.len() != 2
            || info.shape[1] as usize != self.width
            || info.shape.first().copied() != want_rows
            || out.shape.len() != 2
        {
            return Err(format!(
                "{who}: {} has shape {:?} and {} {:?}: not [rows, {}] beside [rows, n]",
                self.input, info.shape, out.name, out.shape, self.width
            ));
        }
        if info.attributes.positions != out.attributes.positions {
            return Err(format!(
                "{who}: {} and {} hold other positions ({:?} / {:?}): their rows are not the same tokens",
                self.input, out.name, info.attributes.positions, out.attributes.positions
            ));
        }
        if self.kind == Kind::Head && out.shape[1] as usize != self.vocab {
            return Err(format!(
                "{who}: {} has {} columns, the model's vocabulary {}",
                out.name, out.shape[1], self.vocab
            ));
        }
        Ok(SideInput {
            name: self.input.clone(),
            x: widened(t, info)?,
            width: self.width,
            bytes: t.data(info).to_vec(),
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
        }
        let tried = results.len();
        let reproduced_by = results
            .iter()
            .filter(|(_, d)| d.iter().all(|&x| x == 0))
            .map(|(n, _)| n.clone())
            .collect();
        let closest = results
            .into_iter()
            .map(|(n, d)| {
                let max = d.iter().copied().max().unwrap_or(0);
                let off = d.iter().filter(|&&x| x != 0).count();
                (n, max, off, d)
            })
            .min_by_key(|(_, max, off, _)| (*max, *off))
            .expect("at least one order");
        (
            tried,
            SideResult {
                reproduced_by,
                closest,
            },
        )
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
