//! §9 the gated SiLU MLP: a dense layer's feed-forward block, each routed expert, the shared
//! expert.

use rayon::prelude::*;

use crate::config::Config;
use crate::model::{vec_part, weight_part, Rank};
use crate::ops;
use crate::weights::{Store, Weight};
use crate::Result;

pub(crate) struct Mlp<'a> {
    pub gate: Weight<'a>,
    pub up: Weight<'a>,
    pub down: Weight<'a>,
    /// llama's `mlp_bias`: the gate, up and down biases.
    pub bias: Option<Box<[Vec<f32>; 3]>>,
    /// §22.2 gelu_pytorch_tanh instead of SiLU (Gemma 3).
    pub gelu: bool,
    /// §23.2 a rank's block of the intermediate size: `down` is row-parallel, its sum carried
    /// over the ranks (§23.3).
    pub carry: Rank,
}

impl<'a> Mlp<'a> {
    /// The MLP under `p` (`{p}.gate_proj.weight`, …), `inter` wide, with the three biases under
    /// llama's `mlp_bias`.
    /// A rank of a sharded run (`comm`) holds its block of `inter`: those rows of the gate and
    /// up projections (and biases), those columns of down (whose bias the last rank adds).
    pub fn load(
        st: &'a Store,
        cfg: &Config,
        p: &str,
        inter: usize,
        comm: &Rank,
    ) -> Result<Mlp<'a>> {
        let h = cfg.hidden_size;
        let b = comm.as_ref().map(|c| c.block(inter));
        let bias = if cfg.mlp_bias {
            Some(Box::new([
                vec_part(st, &format!("{p}.gate_proj.bias"), inter, b.clone())?,
                vec_part(st, &format!("{p}.up_proj.bias"), inter, b.clone())?,
                vec_part(st, &format!("{p}.down_proj.bias"), h, None)?,
            ]))
        } else {
            None
        };
        let w = |name: &str, shape: &[usize], rows, cols| {
            weight_part(st, &format!("{p}.{name}.weight"), shape, rows, cols)
        };
        Ok(Mlp {
            gate: w("gate_proj", &[inter, h], b.clone(), None)?,
            up: w("up_proj", &[inter, h], b.clone(), None)?,
            down: w("down_proj", &[h, inter], None, b)?,
            bias,
            gelu: cfg.model_type.gelu_mlp(),
            carry: comm.clone(),
        })
    }

    pub fn weights(&self) -> [&Weight<'a>; 3] {
        [&self.gate, &self.up, &self.down]
    }
}

/// §9 `down(silu(gate(x)) ⊗ up(x))` (each projection with its bias under llama's `mlp_bias`);
/// §22.2 `gelu_tanh` for SiLU where the family says.
pub(crate) fn gated_mlp(m: &Mlp, x: &[f32], rows: usize) -> Vec<f32> {
    let bias = |i: usize| m.bias.as_ref().map(|b| b[i].as_slice());
    let g = ops::matmul(x, rows, m.gate.view(rows), bias(0));
    let u = ops::matmul(x, rows, m.up.view(rows), bias(1));
    // Elementwise, so spread over the pool in chunks; bits are per element.
    let mut hmid = vec![0.0f32; g.len()];
    let gelu = m.gelu;
    hmid.par_chunks_mut(4096)
        .zip(g.par_chunks(4096).zip(u.par_chunks(4096)))
        .for_each(|(hc, (gc, uc))| match gelu {
            false => ops::silu_mul(gc, uc, hc),
            true => hc
                .iter_mut()
                .zip(gc.iter().zip(uc))
                .for_each(|(h, (&g, &u))| *h = ops::gelu_tanh(g) * u),
        });
    match &m.carry {
        None => ops::matmul(&hmid, rows, m.down.view(rows), bias(2)),
        Some(c) => c.row_parallel(&hmid, rows, m.down.view(rows), bias(2)),
    }
}
