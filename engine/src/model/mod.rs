//! The model, family-neutral (docs/numerics.md §5–§12, §§15–20, §22): the embedding, the decoder
//! layers, the final norm and the head. A decoder layer (`layer.rs`) is a token mixer
//! (`mixer/`: softmax attention, Gated DeltaNet) and a feed-forward block (`feed_forward/`: the
//! gated MLP, the sparse MoE with its optional shared expert), each chosen per layer from the
//! config. What a family changes is read from the config (config.rs, `config/`): the layer
//! kinds, the sizes, and the family's traits (`ModelType`: zero-centred norms, the attention's
//! output gate, the tensors present and not run; Gemma 3's sandwich norms and gelu MLP), and
//! Gemma 3's own fields (`Config::gemma3`: the windows, the second RoPE table, the scale, the
//! embedding scale and the final softcap).

pub mod diffusion_gemma;
mod feed_forward;
mod layer;
mod mixer;
mod norm;

use crate::aligned::Lines;
use crate::capture::Capture;
use crate::config::{check_sizes, Config};
use crate::force::Forcing;
use crate::ops::{self, Rope};
use crate::shard::Comm;
use crate::weights::{Mat, Store, Weight};
use crate::{err, Result};
use layer::Layer;
pub use mixer::LinearState;
use norm::Norm;

/// The model: matrices stay bf16/f16/f32 (in the mapped checkpoint, or bf16 repacked as panels:
/// `Weight`) and are widened tile by tile at use; only the O(hidden) vectors (norm
/// weights, biases) are widened once here.
pub struct Model<'a> {
    pub cfg: Config,
    embed: Mat<'a>,
    head: Weight<'a>,
    norm: Norm,
    layers: Vec<Layer<'a>>,
    /// `--force-decisions`: router rows at the positions it holds are taken from it.
    pub forcing: Option<Forcing>,
    /// Tensors present and not run (Qwen3.5's vision tower and multi-token prediction), by
    /// prefix with their count (§20); empty for the other families.
    pub unused_tensors: Vec<(String, usize)>,
    /// §22.2 Gemma 3's embedding scale f32(√hidden_size) (None: rows as stored).
    embed_scale: Option<f32>,
    /// A rank of a sharded run (§23): its end of the collective; the head holds its vocabulary
    /// block only (None: the whole model).
    pub(crate) comm: Rank,
}

/// The rank of a sharded run that a part of the model belongs to (§23.2; None: unsharded).
pub(crate) type Rank = Option<std::sync::Arc<Comm>>;

/// Rows `rows` and columns `cols` of the matrix `name` of shape `shape` (`None`: all of them)
/// as a `Weight`: the unsharded model's view of the file, or a rank's block copied (§23.2).
pub(crate) fn weight_part<'a>(
    st: &'a Store,
    name: &str,
    shape: &[usize],
    rows: Option<std::ops::Range<usize>>,
    cols: Option<std::ops::Range<usize>>,
) -> Result<Weight<'a>> {
    if rows.is_none() && cols.is_none() {
        return st.weight(name, shape);
    }
    let (r, c) = (
        shape[..shape.len() - 1].iter().product(),
        shape[shape.len() - 1],
    );
    st.weight_block(name, shape, rows.unwrap_or(0..r), cols.unwrap_or(0..c))
}

/// The vector `name` (`[n]`), or its elements `part` only (a rank's bias block, §23.2).
pub(crate) fn vec_part(
    st: &Store,
    name: &str,
    n: usize,
    part: Option<std::ops::Range<usize>>,
) -> Result<Vec<f32>> {
    let m = st.take(name, &[n])?;
    Ok(match part {
        None => m.to_vec(),
        Some(p) => {
            let mut v = vec![0.0f32; p.len()];
            m.widen_row(0, p.start, &mut v);
            v
        }
    })
}

/// §7 RoPE tables of a forward's positions: the full layers' and, where the family has sliding
/// layers with their own base (Gemma 3, §22.3), theirs.
pub struct Ropes {
    full: Rope,
    sliding: Option<Rope>,
}

impl Ropes {
    /// The tables layer `l` rotates by.
    pub fn of_layer(&self, cfg: &Config, l: usize) -> &Rope {
        match (&self.sliding, cfg.window(l)) {
            (Some(s), Some(_)) => s,
            _ => &self.full,
        }
    }
}

/// Per-layer cache: for a full-attention layer the k (normed, rotated) and v rows `[n, kv, d]`
/// with their positions (cache-line aligned: P·V loads value rows a vector at a time); for a
/// linear-attention layer its conv and recurrent state (§18.7).
#[derive(Clone, Default)]
pub struct LayerKv {
    k: Lines,
    v: Lines,
    pos: Vec<i64>,
    pub linear: LinearState,
}

impl<'a> Model<'a> {
    /// Bind every tensor the config requires (shapes checked) and refuse any the checkpoint
    /// holds that no module claims.
    pub fn load(cfg: Config, st: &'a Store) -> Result<Model<'a>> {
        Model::load_rank(cfg, st, None)
    }

    /// `load` for one rank of a sharded run (§23.2): only its blocks of the weights are read.
    pub fn load_rank(cfg: Config, st: &'a Store, comm: Rank) -> Result<Model<'a>> {
        check_sizes(&cfg, st)?;
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        let m = cfg.layout.prefix();
        let embed_name = format!("{m}embed_tokens.weight");
        let embed = st.take(&embed_name, &[v, h])?;
        let layers = (0..cfg.num_hidden_layers)
            .map(|l| Layer::load(st, &cfg, l, &comm))
            .collect::<Result<Vec<_>>>()?;
        let norm = Norm::load(st, &cfg, &format!("{m}norm.weight"), h)?;
        // Tied, the head is the embedding (looked up from the file's rows, multiplied by as a
        // `Weight`).
        let vocab = comm.as_ref().map(|c| c.block(v));
        let head = match (cfg.tie_word_embeddings, &vocab) {
            (true, None) => st.weight_of(&embed_name, embed),
            (true, Some(b)) => {
                st.weight_of(&embed_name, st.block(&embed_name, embed, b.clone(), 0..h)?)
            }
            (false, _) => weight_part(st, "lm_head.weight", &[v, h], vocab, None)?,
        };
        // §20: Qwen3.5 checkpoints carry a vision tower and a multi-token-prediction head the
        // language model does not run; they are listed, not refused.
        let unused_tensors = st.set_aside(cfg.model_type.unused_prefixes());
        st.finish_claims()?;
        // transformers: `hidden_size**0.5` (binary64 pow) held as an f32 tensor, in the weights'
        // dtype (f32 here; a bf16 run rounds it again, docs/numerics.md §22.2).
        let embed_scale = cfg.gemma3.as_ref().map(|_| (h as f64).powf(0.5) as f32);
        Ok(Model {
            embed_scale,
            cfg,
            embed,
            head,
            norm,
            layers,
            forcing: None,
            unused_tensors,
            comm,
        })
    }

    /// Makes every matrix's panels now instead of on first decode use (`Weight`): for a
    /// measurement of steady decode (the bench), packing counted as load time.
    pub fn pack_panels(&self) {
        let mut all: Vec<&Weight> = vec![&self.head];
        for l in &self.layers {
            l.mixer.weights(&mut all);
            l.ffn.weights(&mut all);
        }
        for w in all {
            w.pack();
        }
    }

    pub fn new_cache(&self) -> Vec<LayerKv> {
        vec![LayerKv::default(); self.cfg.num_hidden_layers]
    }

    /// §5 embedding rows.
    pub fn embed(&self, tokens: &[i64]) -> Result<Vec<f32>> {
        let h = self.cfg.hidden_size;
        let mut x = vec![0.0f32; tokens.len() * h];
        for (r, &t) in tokens.iter().enumerate() {
            if t < 0 || t as u64 >= self.cfg.vocab_size as u64 {
                return Err(err!(Input:
                    "token id {t} outside the vocabulary [0, {})",
                    self.cfg.vocab_size
                ));
            }
            let row = &mut x[r * h..(r + 1) * h];
            self.embed.widen_row(t as usize, 0, row);
            if let Some(s) = self.embed_scale {
                row.iter_mut().for_each(|v| *v *= s);
            }
        }
        Ok(x)
    }

    /// Tokens at positions `pos0..`, appending to `cache` (empty for an uncached forward).
    /// Captures embed.out … logits into `cap`; returns logits `[T, V]`.
    pub fn forward(
        &self,
        tokens: &[i64],
        pos0: i64,
        cache: &mut [LayerKv],
        cap: &mut Capture,
    ) -> Result<Vec<f32>> {
        let t = tokens.len();
        let (h, v) = (self.cfg.hidden_size, self.cfg.vocab_size);
        let pos: Vec<i64> = (0..t as i64).map(|i| pos0 + i).collect();
        if let Some(c) = &self.comm {
            c.set_decoding(pos0 > 0);
        }
        let rope = self.rope(&pos);
        let mut x = self.embed(tokens)?;
        cap.tensor("embed.out", &[t, h], &x, &pos);
        for (l, kv) in cache.iter_mut().enumerate() {
            x = self.layer(l, &x, &pos, &rope, kv, cap)?;
        }
        let xn = self.norm.rows(&x, self.cfg.eps_f32());
        cap.tensor("final_norm.out", &[t, h], &xn, &pos);
        let mut logits = ops::matmul(&xn, t, self.head.view(t), None);
        // §22.5 Gemma 3's final softcap, where the config sets one.
        if let Some(c) = self
            .cfg
            .gemma3
            .as_ref()
            .and_then(|g| g.final_logit_softcapping)
        {
            let c = c as f32;
            logits.iter_mut().for_each(|x| *x = ops::softcap(*x, c));
        }
        // §23.3 a rank's vocabulary block, gathered: every rank decides on the whole row.
        if let Some(c) = &self.comm {
            logits = c.gather(&logits, t, v, c.block(v));
        }
        self.record_logits(cap, "logits", &logits, &pos);
        Ok(logits)
    }

    /// Records the whole logits rows `logits` as `name`; a rank of a sharded run its
    /// vocabulary block of them (§23.2).
    pub fn record_logits(&self, cap: &mut Capture, name: &str, logits: &[f32], pos: &[i64]) {
        let (t, v) = (pos.len(), self.cfg.vocab_size);
        match &self.comm {
            None => cap.tensor(name, &[t, v], logits, pos),
            Some(c) => {
                let b = c.block(v);
                let part: Vec<f32> = logits
                    .chunks_exact(v)
                    .flat_map(|row| row[b.clone()].iter().copied())
                    .collect();
                let kind = c.slice(1, b.clone(), v);
                cap.tensor_as(name, &[t, b.len()], &part, pos, Some(kind));
            }
        }
    }

    /// (rank, world) of a sharded run's rank (None: unsharded), for its captures.
    pub fn rank(&self) -> Option<(u64, u64)> {
        self.comm.as_ref().map(|c| (c.rank as u64, c.world as u64))
    }

    /// §7 / §16 RoPE tables for these positions, over the config's rotary dims; §22.3 Gemma 3's
    /// sliding layers' own (`rope_local_base_freq`, the default rope type).
    pub fn rope(&self, pos: &[i64]) -> Ropes {
        let c = &self.cfg;
        Ropes {
            full: Rope::scaled(c.rope_theta, c.rotary_dim, c.rope_scaling, pos),
            sliding: c
                .gemma3
                .as_ref()
                .map(|g| Rope::new(g.local_rope_theta, c.rotary_dim, pos)),
        }
    }
}
