//! §10 the sparse MoE block: the router's softmax and top-k (or the forced choice), the chosen
//! experts accumulated in ascending id; §19 the shared expert added after the routed sum.

use tracegate_trace::names;

use super::mlp::{gated_mlp, Mlp};
use super::shared_expert::SharedExpert;
use crate::capture::Capture;
use crate::config::Config;
use crate::force::Forcing;
use crate::model::Rank;
use crate::ops;
use crate::shard::Split;
use crate::weights::{Store, Weight};
use crate::{err, Result};

/// Router `[E, H]`, the experts in id order, and Qwen3.5-MoE's shared expert (§19).
pub(crate) struct Moe<'a> {
    router: Weight<'a>,
    /// The experts `held`, in id order (all of them but on a rank of an `ep` run, §23.2).
    experts: Vec<Mlp<'a>>,
    held: std::ops::Range<usize>,
    shared: Option<Box<SharedExpert<'a>>>,
    /// A rank of an `ep` run: the routed sum is carried over the ranks (§23.3).
    ep: Rank,
}

impl<'a> Moe<'a> {
    /// The block under `p` (`…layers.N.mlp`).
    pub fn load(st: &'a Store, cfg: &Config, p: &str, comm: &Rank) -> Result<Moe<'a>> {
        let h = cfg.hidden_size;
        let (ne, mi) = (cfg.num_experts, cfg.moe_intermediate_size);
        let router = st.weight(&format!("{p}.gate.weight"), &[ne, h])?;
        // §23.2: under tp every expert split like the dense MLP; under ep a rank's block of the
        // experts, whole (the others' tensors claimed, never read).
        let held = comm.as_ref().map_or(0..ne, |c| c.experts(ne));
        let ep = comm.clone().filter(|c| c.split == Split::Ep);
        let tp = comm.clone().filter(|c| c.split == Split::Tp);
        let ib = tp.as_ref().map(|c| c.block(mi));
        let part = |name: &str, m: crate::weights::Mat<'a>, rows, cols| -> Result<Weight<'a>> {
            Ok(match &ib {
                None => st.weight_of(name, m),
                Some(_) => st.weight_of(name, st.block(name, m, rows, cols)?),
            })
        };
        let (ir, all_h) = (ib.clone().unwrap_or(0..mi), 0..h);
        // On disk experts are either per-expert modules (what save_pretrained writes) or
        // transformers 5's fused `gate_up_proj [E, 2I, H]` / `down_proj [E, H, I]`.
        let fused = format!("{p}.experts.gate_up_proj");
        let experts = if st.contains(&fused) {
            let gu = st.take(&fused, &[ne, 2 * mi, h])?;
            let dn = st.take(&format!("{p}.experts.down_proj"), &[ne, h, mi])?;
            let dn_name = format!("{p}.experts.down_proj");
            held.clone()
                .map(|e| -> Result<Mlp<'a>> {
                    let g = gu.row_block(e * 2 * mi, mi);
                    let u = gu.row_block(e * 2 * mi + mi, mi);
                    Ok(Mlp {
                        gate: part(&fused, g, ir.clone(), all_h.clone())?,
                        up: part(&fused, u, ir.clone(), all_h.clone())?,
                        down: part(&dn_name, dn.row_block(e * h, h), all_h.clone(), ir.clone())?,
                        bias: None,
                        gelu: false,
                        carry: tp.clone(),
                    })
                })
                .collect::<Result<Vec<_>>>()?
        } else {
            let load = |e: usize, c: &Rank| Mlp::load(st, cfg, &format!("{p}.experts.{e}"), mi, c);
            // Another rank's experts: claimed (shapes checked), their views dropped unread.
            for e in (0..ne).filter(|e| !held.contains(e)) {
                load(e, &None)?;
            }
            held.clone()
                .map(|e| load(e, &tp))
                .collect::<Result<Vec<_>>>()?
        };
        let shared = match cfg.shared_expert_intermediate_size {
            0 => None,
            si => Some(Box::new(SharedExpert::load(st, cfg, p, si, comm)?)),
        };
        Ok(Moe {
            router,
            experts,
            held,
            shared,
            ep,
        })
    }

    /// Its matrices (`Model::pack_panels`).
    pub fn weights<'s>(&'s self, all: &mut Vec<&'s Weight<'a>>) {
        all.push(&self.router);
        all.extend(self.experts.iter().flat_map(Mlp::weights));
        if let Some(sh) = &self.shared {
            all.extend(sh.mlp.weights());
            all.push(&sh.gate);
        }
    }

    /// §10 the routed experts' sum, then §19 the shared expert's share added.
    pub fn forward(
        &self,
        l: usize,
        c: &Config,
        forcing: Option<&Forcing>,
        xn: &[f32],
        pos: &[i64],
        cap: &mut Capture,
    ) -> Result<Vec<f32>> {
        let routed = self.routed(l, c, forcing, xn, pos, cap)?;
        Ok(match &self.shared {
            None => routed,
            Some(se) => se.add_to(l, routed, xn, pos, cap),
        })
    }

    /// §10 the routed experts: router softmax, top-k (the forced rows where `forcing` holds
    /// them), the chosen experts' outputs weighted and accumulated in ascending expert id.
    fn routed(
        &self,
        l: usize,
        c: &Config,
        forcing: Option<&Forcing>,
        xn: &[f32],
        pos: &[i64],
        cap: &mut Capture,
    ) -> Result<Vec<f32>> {
        let (router, experts) = (&self.router, &self.experts);
        let (t, h, ne, k) = (
            pos.len(),
            c.hidden_size,
            c.num_experts,
            c.num_experts_per_tok,
        );
        let logits = ops::matmul(xn, t, router.view(t), None);
        cap.internal(&names::layer(l, "router.logits"), &[t, ne], &logits, pos);
        // weight[r][e] for the chosen experts of row r (None: not chosen).
        let mut weight: Vec<Vec<Option<f32>>> = vec![vec![None; ne]; t];
        let mut chosen_all = Vec::with_capacity(t * k);
        let mut margins = Vec::with_capacity(t);
        let mut p = vec![0.0f32; ne];
        let name = names::layer(l, "router.topk");
        // Forced rows are keyed by position: row i of the forcing decision is position i's.
        let forced = forcing.and_then(|f| f.values(&name));
        let mut overridden = Vec::new();
        for r in 0..t {
            ops::softmax(&logits[r * ne..(r + 1) * ne], |_| true, &mut p);
            if p.iter().any(|x| x.is_nan()) {
                return Err(err!(NaN:
                    "{}: NaN probability at row {r} (position {})",
                    names::layer(l, "router"),
                    pos[r]
                ));
            }
            let (own, next) = ops::topk(&p, k);
            let next = next.expect("k < num_experts checked in config");
            let at = pos[r] as usize * k;
            let chosen: Vec<usize> = match forced.and_then(|f| f.get(at..at + k)) {
                Some(row) => {
                    let row: Vec<usize> = row.iter().map(|&e| e as usize).collect();
                    if row != own {
                        overridden.push(r as u64);
                    }
                    margins.push(ops::margin_of(&p, &row));
                    row
                }
                None => {
                    margins.push(p[own[k - 1]] - p[next]);
                    own
                }
            };
            // §10.4 in the chosen (rank or forced) order.
            let den = if c.norm_topk_prob {
                ops::ordered_sum(&chosen.iter().map(|&e| p[e]).collect::<Vec<_>>())
            } else {
                1.0
            };
            for &e in &chosen {
                weight[r][e] = Some(if c.norm_topk_prob { p[e] / den } else { p[e] });
                chosen_all.push(e as i64);
            }
        }
        let overridden = forced.map(|_| overridden);
        cap.decided(&name, &[t, k], chosen_all, Some(margins), overridden);
        // §10.6: each row's chosen experts' `w ⊗ out_e` added in ascending id.
        let add = |out: &mut [f32], e: usize, rows: &[usize], ye: &[f32]| {
            for (i, &r) in rows.iter().enumerate() {
                let w = weight[r][e].expect("row routed to e");
                for j in 0..h {
                    out[r * h + j] += w * ye[i * h + j];
                }
            }
        };
        let mut out = vec![0.0f32; t * h];
        // Under ep this rank's experts' outputs, added in the carry's turn (§23.3).
        let mut mine = Vec::new();
        let kind = self.ep.as_ref().and_then(|c| c.expert_kind(ne));
        // Ascending expert id, so each row accumulates its experts in ascending id.
        for (e, mlp) in self.held.clone().zip(experts) {
            let rows: Vec<usize> = (0..t).filter(|&r| weight[r][e].is_some()).collect();
            if rows.is_empty() {
                continue;
            }
            let xe: Vec<f32> = rows
                .iter()
                .flat_map(|&r| xn[r * h..(r + 1) * h].iter().copied())
                .collect();
            let ye = gated_mlp(mlp, &xe, rows.len());
            let epos: Vec<i64> = rows.iter().map(|&r| pos[r]).collect();
            let name = names::expert(l, e, "out");
            cap.internal_as(&name, &[rows.len(), h], &ye, &epos, kind.clone());
            match self.ep {
                None => add(&mut out, e, &rows, &ye),
                Some(_) => mine.push((e, rows, ye)),
            }
        }
        if let Some(c) = &self.ep {
            let turn = |acc: &mut [f32]| {
                for (e, rows, ye) in &mine {
                    add(acc, *e, rows, ye);
                }
            };
            out = c.carry(t * h, turn, |_| {});
        }
        Ok(out)
    }
}
