//! §18 Gated DeltaNet, the token mixer of Qwen3.5's `linear_attention` layers: its weights, the
//! causal conv1d and the delta-rule recurrence over the layer's conv and recurrent state.

use rayon::prelude::*;
use tracegate_trace::names;

use crate::capture::Capture;
use crate::config::{Config, LinearSizes};
use crate::ops;
use crate::weights::{Store, Weight};
use crate::{err, Result};

/// §18 one linear-attention layer's weights (under `linear_attn.`). The projections stay mapped;
/// the conv taps and the per-head vectors are widened once.
pub struct GatedDeltaNet<'a> {
    sizes: LinearSizes,
    in_proj_qkv: Weight<'a>,
    in_proj_z: Weight<'a>,
    in_proj_b: Weight<'a>,
    in_proj_a: Weight<'a>,
    /// `conv1d.weight` `[conv_dim, 1, K]` as `[conv_dim, K]`.
    conv: Vec<f32>,
    dt_bias: Vec<f32>,
    a_log: Vec<f32>,
    norm: Vec<f32>,
    out_proj: Weight<'a>,
}

/// §18 a linear-attention layer's state after the rows it has run: the conv state `C`
/// (`[conv_dim, K−1]`, channel-major, oldest first) and the recurrent state `S` (`[nv, dk, dv]`),
/// both +0.0 before position 0 (empty vectors until the first row), and the position the next
/// row must have.
#[derive(Clone, Default)]
pub struct LinearState {
    conv: Vec<f32>,
    s: Vec<f32>,
    next_pos: i64,
}

impl<'a> GatedDeltaNet<'a> {
    /// Takes the layer's tensors (`p` = `…layers.N.linear_attn`), shapes from the config (§18).
    pub fn load(st: &'a Store, p: &str, cfg: &Config) -> Result<GatedDeltaNet<'a>> {
        let s = cfg
            .linear
            .expect("a linear layer exists only with the linear sizes");
        let (h, nv) = (cfg.hidden_size, s.num_value_heads);
        let vec = |name: &str, n: usize| st.take(&format!("{p}.{name}"), &[n]).map(|m| m.to_vec());
        let mat =
            |name: &str, rows: usize, cols: usize| st.weight(&format!("{p}.{name}"), &[rows, cols]);
        Ok(GatedDeltaNet {
            sizes: s,
            in_proj_qkv: mat("in_proj_qkv.weight", s.conv_dim(), h)?,
            in_proj_z: mat("in_proj_z.weight", s.value_dim(), h)?,
            in_proj_b: mat("in_proj_b.weight", nv, h)?,
            in_proj_a: mat("in_proj_a.weight", nv, h)?,
            conv: st
                .take(
                    &format!("{p}.conv1d.weight"),
                    &[s.conv_dim(), 1, s.conv_kernel],
                )?
                .to_vec(),
            dt_bias: vec("dt_bias", nv)?,
            a_log: vec("A_log", nv)?,
            norm: vec("norm.weight", s.value_head_dim)?,
            out_proj: mat("out_proj.weight", h, s.value_dim())?,
        })
    }

    /// Its matrices (`Model::pack_panels`).
    pub(crate) fn weights(&self) -> [&Weight<'a>; 5] {
        [
            &self.in_proj_qkv,
            &self.in_proj_z,
            &self.in_proj_b,
            &self.in_proj_a,
            &self.out_proj,
        ]
    }

    /// §18 the mixer on `xn` (`input_layernorm`'s output, `[T, H]`) at positions `pos`, which
    /// must continue `state` (0.. for a fresh one); returns attn_out and leaves `state` after the
    /// last row. Captures the `linear.*` internals.
    pub fn forward(
        &self,
        l: usize,
        cfg: &Config,
        xn: &[f32],
        pos: &[i64],
        state: &mut LinearState,
        cap: &mut Capture,
    ) -> Result<Vec<f32>> {
        let s = self.sizes;
        let (t, k) = (pos.len(), s.conv_kernel);
        let (nk, nv, dk, dv) = (
            s.num_key_heads,
            s.num_value_heads,
            s.key_head_dim,
            s.value_head_dim,
        );
        let (cd, kd, vd) = (s.conv_dim(), s.key_dim(), s.value_dim());
        if let Some((i, &p)) = pos
            .iter()
            .enumerate()
            .find(|&(i, &p)| p != state.next_pos + i as i64)
        {
            return Err(err!(Input:
                "layer {l} is linear attention: it runs from a zero state at position 0, so its rows must be at positions {}..{} in order; row {i} is at position {p}",
                state.next_pos,
                state.next_pos + t as i64 - 1
            ));
        }
        if state.s.is_empty() {
            state.conv = vec![0.0; cd * (k - 1)];
            state.s = vec![0.0; nv * dk * dv];
        }
        let name = |point: &str| names::layer(l, point);
        // §18.1 projections.
        let mixed = ops::matmul(xn, t, self.in_proj_qkv.view(t), None);
        let z = ops::matmul(xn, t, self.in_proj_z.view(t), None);
        let b = ops::matmul(xn, t, self.in_proj_b.view(t), None);
        let a = ops::matmul(xn, t, self.in_proj_a.view(t), None);
        // §18.2 conv, rows ascending through the state.
        let conv_out = self.conv_rows(&mixed, t, &mut state.conv);
        cap.internal(&name("linear.conv_out"), &[t, cd], &conv_out, pos);
        // §18.3 split and L2-normalise q and k per key head; v as is. Rows on the pool.
        let (mut qn, mut kn) = (vec![0.0f32; t * kd], vec![0.0f32; t * kd]);
        let mut v = vec![0.0f32; t * vd];
        conv_out
            .par_chunks_exact(cd)
            .zip(qn.par_chunks_exact_mut(kd))
            .zip(kn.par_chunks_exact_mut(kd))
            .zip(v.par_chunks_exact_mut(vd))
            .for_each(|(((row, qr), kr), vr)| {
                for g in 0..nk {
                    let at = g * dk..(g + 1) * dk;
                    ops::l2norm(&row[at.clone()], &mut qr[at.clone()]);
                    ops::l2norm(&row[kd + g * dk..kd + (g + 1) * dk], &mut kr[at]);
                }
                vr.copy_from_slice(&row[2 * kd..]);
            });
        cap.internal(&name("linear.q"), &[t, nk, dk], &qn, pos);
        cap.internal(&name("linear.k"), &[t, nk, dk], &kn, pos);
        let scale_k = (1.0f64 / (dk as f64).sqrt()) as f32;
        let qs: Vec<f32> = qn.iter().map(|&x| x * scale_k).collect();
        // §18.4 decay and beta.
        let mut g = vec![0.0f32; t * nv];
        let mut alpha = vec![0.0f32; t * nv];
        let beta: Vec<f32> = b.iter().map(|&x| ops::sigmoid(x)).collect();
        for r in 0..t {
            for hh in 0..nv {
                let i = r * nv + hh;
                (g[i], alpha[i]) = ops::gdn_decay(a[i], self.dt_bias[hh], self.a_log[hh]);
            }
        }
        cap.internal(&name("linear.g"), &[t, nv], &g, pos);
        cap.internal(&name("linear.beta"), &[t, nv], &beta, pos);
        // §18.5 the delta rule: each value head's rows in order, heads on the pool (independent).
        let per_head: Vec<Vec<f32>> = state
            .s
            .par_chunks_exact_mut(dk * dv)
            .enumerate()
            .map(|(hh, sh)| {
                let gk = hh / (nv / nk);
                let mut core = vec![0.0f32; t * dv];
                let mut mem = vec![0.0f32; dv];
                for r in 0..t {
                    let kk = &kn[r * kd + gk * dk..r * kd + (gk + 1) * dk];
                    let qq = &qs[r * kd + gk * dk..r * kd + (gk + 1) * dk];
                    let vv = &v[r * vd + hh * dv..r * vd + (hh + 1) * dv];
                    let (al, be) = (alpha[r * nv + hh], beta[r * nv + hh]);
                    let out = &mut core[r * dv..(r + 1) * dv];
                    ops::delta_rule_step(sh, qq, kk, vv, al, be, &mut mem, out);
                }
                core
            })
            .collect();
        let mut core = vec![0.0f32; t * vd];
        for (hh, ch) in per_head.iter().enumerate() {
            for r in 0..t {
                core[r * vd + hh * dv..r * vd + (hh + 1) * dv]
                    .copy_from_slice(&ch[r * dv..(r + 1) * dv]);
            }
        }
        cap.internal(&name("linear.core"), &[t, nv, dv], &core, pos);
        state.next_pos += t as i64;
        // §18.6 gated norm per (row, value head), rows on the pool, then out_proj.
        let eps = cfg.eps_f32();
        let mut normed = vec![0.0f32; t * vd];
        normed
            .par_chunks_exact_mut(vd)
            .zip(core.par_chunks_exact(vd).zip(z.par_chunks_exact(vd)))
            .for_each(|(nr, (cr, zr))| {
                for ((n, c), zz) in nr
                    .chunks_exact_mut(dv)
                    .zip(cr.chunks_exact(dv))
                    .zip(zr.chunks_exact(dv))
                {
                    ops::gated_rmsnorm(c, &self.norm, zz, eps, n);
                }
            });
        cap.internal(&name("linear.norm_out"), &[t, nv, dv], &normed, pos);
        // The state after the block's last row, at that row's position.
        cap.internal(
            &name("linear.state"),
            &[1, nv, dk, dv],
            &state.s,
            &pos[t - 1..],
        );
        Ok(ops::matmul(&normed, t, self.out_proj.view(t), None))
    }
}

impl GatedDeltaNet<'_> {
    /// §18.2 the causal conv1d + SiLU of `t` rows of `mixed` (`[t, conv_dim]`), rows ascending
    /// through `conv_state`. A channel reads and updates only its own state, so blocks of
    /// channels run on the pool, each through every row in order; the bits are
    /// `ops::causal_conv1d`'s row by row.
    fn conv_rows(&self, mixed: &[f32], t: usize, conv_state: &mut [f32]) -> Vec<f32> {
        const BLOCK: usize = 512;
        let (cd, k) = (self.sizes.conv_dim(), self.sizes.conv_kernel);
        let keep = k - 1;
        let mut states: Vec<&mut [f32]> = Vec::with_capacity(cd.div_ceil(BLOCK));
        let mut rest = conv_state;
        for c0 in (0..cd).step_by(BLOCK) {
            let (st, tail) = rest.split_at_mut(BLOCK.min(cd - c0) * keep);
            states.push(st);
            rest = tail;
        }
        let blocks: Vec<Vec<f32>> = states
            .into_par_iter()
            .enumerate()
            .map(|(b, st)| {
                let (c0, c1) = (b * BLOCK, ((b + 1) * BLOCK).min(cd));
                let mut out = vec![0.0f32; t * (c1 - c0)];
                for (r, o) in out.chunks_exact_mut(c1 - c0).enumerate() {
                    let row = &mixed[r * cd + c0..r * cd + c1];
                    ops::causal_conv1d(row, &self.conv[c0 * k..c1 * k], k, st, o);
                }
                out
            })
            .collect();
        let mut conv_out = vec![0.0f32; t * cd];
        for (b, block) in blocks.iter().enumerate() {
            let (c0, w) = (b * BLOCK, block.len() / t.max(1));
            for (r, o) in block.chunks_exact(w.max(1)).enumerate() {
                conv_out[r * cd + c0..r * cd + c0 + w].copy_from_slice(o);
            }
        }
        conv_out
    }
}
