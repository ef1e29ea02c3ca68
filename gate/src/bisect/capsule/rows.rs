//! A capsule's reference rows: the reference whole trace's `layer.LL.*` (the layer's input
//! `hidden_in`, every capture point of the layer, its router decision) for the rows at positions
//! below `keep`, with `path=layer` as the bisection's slice has them. Causal attention makes a
//! prefix of the prompt self-contained: rows 0..k−1 of a layer see no later row, so their
//! outputs in the whole run are the outputs of the layer on those rows alone.

use std::path::Path;

use serde_json::Value;
use tracegate_trace::names;
use tracegate_trace::{Trace, TraceWriter};

use crate::{gerr, Result};

/// Why the layer's rows cannot be cut to a prefix (then the capsule keeps them all), or None.
pub(super) fn unsliceable(t: &Trace, layer: usize) -> Option<String> {
    let pfx = names::layer_prefix(layer);
    for info in t.tensors().iter().filter(|i| i.name.starts_with(&pfx)) {
        let name = &info.name;
        if name.ends_with(".linear.state") {
            return Some(format!("{name} is the recurrent state after the last row; a shorter prefix needs the state after its own last row, which the reference trace does not hold"));
        }
        let Some(pos) = &info.attributes.positions else {
            return Some(format!("{name} has no positions attribute"));
        };
        if pos.windows(2).any(|w| w[0] >= w[1]) {
            return Some(format!("{name}'s positions are not ascending"));
        }
        let rows_axis = usize::from(name.ends_with(".attn_probs"));
        let ok = info.shape.get(rows_axis).copied() == Some(pos.len() as u64)
            && (rows_axis == 0 || info.shape.get(2).copied() == Some(pos.len() as u64));
        if !ok {
            return Some(format!(
                "{name} has shape {:?} for {} positions",
                info.shape,
                pos.len()
            ));
        }
    }
    let input = names::layer(layer, "hidden_in");
    match t
        .tensor_info(&input)
        .and_then(|i| i.attributes.positions.clone())
    {
        Some(p) if p.iter().enumerate().all(|(i, &q)| q == i as i64) => None,
        Some(_) => Some(format!("{input}'s rows are not at positions 0..n-1")),
        None => Some(format!("the reference trace has no {input} with positions")),
    }
}

/// The layer's input rows in `t`: the number of rows of `layer.LL.hidden_in`.
pub(super) fn input_rows(t: &Trace, layer: usize) -> Result<usize> {
    let name = names::layer(layer, "hidden_in");
    t.tensor_info(&name)
        .and_then(|i| i.shape.first().copied())
        .map(|n| n as usize)
        .ok_or_else(|| gerr!(File: "{}: no tensor {name}", t.path().display()))
}

/// Writes `layer`'s points of `t` for positions < `keep` to `out`, every tensor with
/// `path=layer`; `provenance` is the trace's own, as the caller rewrote it. An expert that
/// received no kept row is left out, as a layer verb on those rows writes none.
pub(super) fn write(
    t: &Trace,
    layer: usize,
    keep: usize,
    provenance: Value,
    out: &Path,
) -> Result<()> {
    let io = |e: tracegate_trace::Error| gerr!(File: "{}: {e}", out.display());
    let pfx = names::layer_prefix(layer);
    let n = input_rows(t, layer)?;
    let cut = keep < n;
    let mut w = TraceWriter::create(out, provenance).map_err(io)?;
    for info in t.tensors().iter().filter(|i| i.name.starts_with(&pfx)) {
        let data = t.data(info);
        let mut attrs = info.attributes.clone();
        attrs.path = Some("layer".into());
        if !cut {
            w.tensor(&info.name, info.dtype, &info.shape, data, &attrs)
                .map_err(io)?;
            continue;
        }
        let pos = attrs.positions.clone().unwrap_or_default();
        let m = pos.iter().take_while(|&&p| p < keep as i64).count();
        if m == 0 {
            continue;
        }
        attrs.positions = Some(pos[..m].to_vec());
        let es = info.dtype.size();
        if info.name.ends_with(".attn_probs") {
            // [heads, rows, keys], keys = the rows: the first m of both.
            let (h, r) = (info.shape[0] as usize, info.shape[1] as usize);
            let mut bytes = Vec::with_capacity(h * m * m * es);
            for head in 0..h {
                for row in 0..m {
                    let at = ((head * r + row) * r) * es;
                    bytes.extend_from_slice(&data[at..at + m * es]);
                }
            }
            w.tensor(
                &info.name,
                info.dtype,
                &[h as u64, m as u64, m as u64],
                &bytes,
                &attrs,
            )
            .map_err(io)?;
        } else {
            let row = data.len() / pos.len().max(1);
            let mut shape = info.shape.clone();
            shape[0] = m as u64;
            w.tensor(&info.name, info.dtype, &shape, &data[..m * row], &attrs)
                .map_err(io)?;
        }
    }
    for d in t.decisions().iter().filter(|d| d.name.starts_with(&pfx)) {
        let values = t.decision_values(d);
        let margins = t.decision_margins(d);
        let rows = d.rows() as usize;
        let m = if cut { keep.min(rows) } else { rows };
        let per = values.len() / rows.max(1);
        let mut shape = d.shape.clone();
        if let Some(first) = shape.first_mut() {
            *first = m as u64;
        }
        w.decision(
            &d.name,
            &shape,
            &values[..m * per],
            margins.as_ref().map(|x| &x[..m]),
        )
        .map_err(io)?;
    }
    w.finish().map_err(io)?;
    Ok(())
}
