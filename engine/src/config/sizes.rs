//! Every size the config declares against the checkpoint's own tensors (§13), before the model
//! allocates or loops by it.

use super::{Config, LayerKind, LinearSizes};
use crate::weights::Store;
use crate::{err, Result};

/// The `linear_*` sizes against a linear-attention layer's tensors (`a` its `linear_attn`
/// prefix), products checked for overflow: `in_proj_qkv` has `2·num_key_heads·key_head_dim +
/// num_value_heads·value_head_dim` rows, `in_proj_a` one per value head, `conv1d` the kernel's
/// width, the gated norm `value_head_dim`.
type DimCheck<'a> = dyn Fn(&str, usize, u64, &dyn Fn() -> String) -> Result<()> + 'a;
fn check_linear_sizes(s: &LinearSizes, a: &str, dim: &DimCheck) -> Result<()> {
    let over = || err!(Config: "config.json: linear_num_key_heads, linear_key_head_dim, linear_num_value_heads, linear_value_head_dim = {}, {}, {}, {} overflow the projection width", s.num_key_heads, s.key_head_dim, s.num_value_heads, s.value_head_dim);
    let kd = s
        .num_key_heads
        .checked_mul(s.key_head_dim)
        .ok_or_else(over)?;
    let vd = s
        .num_value_heads
        .checked_mul(s.value_head_dim)
        .ok_or_else(over)?;
    let conv = kd
        .checked_mul(2)
        .and_then(|x| x.checked_add(vd))
        .ok_or_else(over)?;
    dim(&format!("{a}.in_proj_qkv.weight"), 0, conv as u64, &|| {
        format!(
            "linear_num_key_heads = {} × linear_key_head_dim = {} (× 2) + linear_num_value_heads = {} × linear_value_head_dim = {} (= {conv} rows)",
            s.num_key_heads, s.key_head_dim, s.num_value_heads, s.value_head_dim
        )
    })?;
    dim(
        &format!("{a}.in_proj_a.weight"),
        0,
        s.num_value_heads as u64,
        &|| format!("linear_num_value_heads = {}", s.num_value_heads),
    )?;
    dim(
        &format!("{a}.conv1d.weight"),
        2,
        s.conv_kernel as u64,
        &|| format!("linear_conv_kernel_dim = {}", s.conv_kernel),
    )?;
    dim(
        &format!("{a}.norm.weight"),
        0,
        s.value_head_dim as u64,
        &|| format!("linear_value_head_dim = {}", s.value_head_dim),
    )?;
    Ok(())
}

/// Every size the config declares, checked against the checkpoint's own tensors before the model
/// allocates or loops by it: 2^40 layers or 2^62 heads are refused naming the field, never turned
/// into an allocation, a long loop or an overflowing product. A representative tensor that is
/// absent is left to `Store::take`, which refuses it by name.
pub fn check_sizes(c: &Config, st: &Store) -> Result<()> {
    let dim = |name: &str, axis: usize, want: u64, field: &dyn Fn() -> String| -> Result<()> {
        match st.shape(name) {
            Some(s) if s.get(axis).is_some_and(|&g| g != want) => Err(err!(Config:
                "config.json: {} does not match the checkpoint: {name} has shape {s:?}",
                field()
            )),
            _ => Ok(()),
        }
    };
    let product = |field: &str, x: usize, by: &str, y: usize| -> Result<u64> {
        x.checked_mul(y).map(|p| p as u64).ok_or_else(
            || err!(Config: "config.json: {field} = {x} overflows when multiplied by {by} ({y})"),
        )
    };
    let (h, v, d) = (c.hidden_size, c.vocab_size, c.head_dim);
    let m = c.layout.prefix(); // "model." or "model.language_model."
    let emb = format!("{m}embed_tokens.weight");
    dim(&emb, 0, v as u64, &|| format!("vocab_size = {v}"))?;
    dim(&emb, 1, h as u64, &|| format!("hidden_size = {h}"))?;
    let have = st.layer_count(m);
    if c.num_hidden_layers > have {
        return Err(err!(Config:
            "config.json: num_hidden_layers = {} but the checkpoint holds {have} layers ({m}layers.N tensors for N < {have})",
            c.num_hidden_layers
        ));
    }
    let layers = 0..c.num_hidden_layers; // bounded by the checkpoint now
    let (nq, nkv) = (c.num_attention_heads, c.num_key_value_heads);
    if let Some(l) = layers.clone().find(|&l| c.layer_kind(l) == LayerKind::Full) {
        let a = format!("{m}layers.{l}.self_attn");
        dim(&format!("{a}.q_norm.weight"), 0, d as u64, &|| {
            format!("head_dim = {d}")
        })?;
        let q_rows = product("num_attention_heads", nq, "head_dim", d)?;
        let kv_rows = product("num_key_value_heads", nkv, "head_dim", d)?;
        // A gated q_proj (Qwen3.5) holds each head's query and output gate: twice the rows.
        let (gated, times) = if c.model_type.gated_attention() {
            (q_rows.checked_mul(2), " × 2")
        } else {
            (Some(q_rows), "")
        };
        let q_rows = gated.ok_or_else(|| {
            err!(Config: "config.json: num_attention_heads = {nq} overflows when multiplied by head_dim ({d}) and 2")
        })?;
        dim(&format!("{a}.q_proj.weight"), 0, q_rows, &|| {
            format!("num_attention_heads = {nq} (× head_dim {d}{times} = {q_rows} rows)")
        })?;
        dim(&format!("{a}.k_proj.weight"), 0, kv_rows, &|| {
            format!("num_key_value_heads = {nkv} (× head_dim {d} = {kv_rows} rows)")
        })?;
    }
    if let (Some(s), Some(l)) = (
        c.linear,
        layers
            .clone()
            .find(|&l| c.layer_kind(l) == LayerKind::Linear),
    ) {
        check_linear_sizes(&s, &format!("{m}layers.{l}.linear_attn"), &dim)?;
    }
    if let (Some(i), Some(l)) = (
        c.intermediate_size,
        layers.clone().find(|&l| !c.is_sparse(l)),
    ) {
        dim(
            &format!("{m}layers.{l}.mlp.gate_proj.weight"),
            0,
            i as u64,
            &|| format!("intermediate_size = {i}"),
        )?;
    }
    if let Some(l) = layers.clone().find(|&l| c.is_sparse(l)) {
        let (ne, mi) = (c.num_experts, c.moe_intermediate_size);
        let p = format!("{m}layers.{l}.mlp");
        if c.shared_expert_intermediate_size > 0 {
            let si = c.shared_expert_intermediate_size;
            dim(
                &format!("{p}.shared_expert.gate_proj.weight"),
                0,
                si as u64,
                &|| format!("shared_expert_intermediate_size = {si}"),
            )?;
        }
        dim(&format!("{p}.gate.weight"), 0, ne as u64, &|| {
            format!("num_experts = {ne}")
        })?;
        let gu_rows = product("moe_intermediate_size", mi, "2 (gate and up rows)", 2)?;
        dim(&format!("{p}.experts.gate_up_proj"), 0, ne as u64, &|| {
            format!("num_experts = {ne}")
        })?;
        dim(&format!("{p}.experts.gate_up_proj"), 1, gu_rows, &|| {
            format!("moe_intermediate_size = {mi} (× 2 = {gu_rows} rows)")
        })?;
        dim(
            &format!("{p}.experts.0.gate_proj.weight"),
            0,
            mi as u64,
            &|| format!("moe_intermediate_size = {mi}"),
        )?;
    }
    Ok(())
}
