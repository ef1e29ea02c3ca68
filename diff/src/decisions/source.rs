//! Where a decision row's numbers come from: the source tensor a decision was taken from, its
//! place in the capture order, the source row of each decision row, the row's token
//! position, and how far the two sides' source rows are apart.

use tracegate_trace::names::{Diffusion, Name};
use tracegate_trace::{TensorInfo, Trace};

use crate::excuse::capture_index;
use crate::{numeric, Pair};

/// The tensor a decision was taken from, if the traces hold it: `logits` for `logits.argmax`;
/// `decode.SSSS.logits`, else `logits`, for `decode.SSSS.argmax`; `denoise.BBBB.SSSS.logits.tempered`
/// for `denoise.BBBB.SSSS.argmax` (a router of any pass: that pass's `router.logits`); `layer.NN.router.logits`,
/// else `layer.NN.hidden_in`, for `layer.NN.router.topk`; `X` for any other `X.argmax`.
pub(crate) fn source_tensor(name: &str, r: &Trace, c: &Trace) -> Option<String> {
    let both = |n: &str| r.tensor_info(n).is_some() && c.tensor_info(n).is_some();
    let n = Name::parse(name);
    let at = |point| Name { point, ..n }.to_string();
    let denoise = matches!(n.diffusion, Some(Diffusion::Denoise { .. }));
    let candidates: Vec<String> = match (n.decode_step, n.layer, n.point) {
        (Some(_), None, "argmax") => vec![at("logits"), "logits".into()],
        // A denoise step's argmax is taken from its tempered logits (DG13.1).
        (None, None, "argmax") if denoise => vec![at("logits.tempered")],
        (_, Some(_), "router.topk") => vec![at("router.logits"), at("hidden_in")],
        _ => name
            .strip_suffix(".argmax")
            .map(|base| vec![base.to_string()])
            .unwrap_or_default(),
    };
    candidates.into_iter().find(|n| both(n))
}

/// Where a decision is taken in the reference's capture order: at its source; a router without
/// `router.logits` at `layer.NN.attn_out` when later than its fallback `hidden_in` (the router
/// reads `hidden_in + attn_out`); without a source, after every tensor.
pub(super) fn taken_at(name: &str, source: Option<&str>, r: &Trace) -> usize {
    let Some(source) = source else {
        return usize::MAX;
    };
    let at = capture_index(r, source).unwrap_or(usize::MAX);
    let n = Name::parse(name);
    if n.layer.is_some() && n.point == "router.topk" && Name::parse(source).point == "hidden_in" {
        let attn_out = Name {
            point: "attn_out",
            ..n
        };
        capture_index(r, &attn_out.to_string()).map_or(at, |a| a.max(at))
    } else {
        at
    }
}

/// The step of a `decode.SSSS.argmax` decision.
pub(super) fn decode_step(name: &str) -> Option<u64> {
    let n = Name::parse(name);
    match (n.decode_step, n.layer, n.point) {
        (Some(step), None, "argmax") => Some(step as u64),
        _ => None,
    }
}

/// The source row a decision row was taken from, as `(row, rows)` for
/// [`range_divergence`]: row `row` of `rows`; the first decode
/// step without its own logits is the prompt's last `logits` row (step 0 is the argmax of that
/// row).
pub(super) fn source_row(name: &str, source: &str, row: u64, rows: u64, r: &Trace) -> (u64, u64) {
    if decode_step(name) == Some(0) && source == "logits" {
        if let Some(&n) = r
            .tensor_info("logits")
            .and_then(|i| i.shape.first())
            .filter(|&&n| n > 0)
        {
            return (n - 1, n);
        }
    }
    (row, rows)
}

/// Whether `source` holds the decision's own scores, so that its divergence bounds how far a
/// margin can move. Not for a router's fallback `hidden_in` (an activation, not the router's
/// scores), nor for a decode step after the first without its own logits (the prompt's
/// `logits` did not produce it).
pub(super) fn holds_scores(name: &str, source: &str) -> bool {
    if let Some(step) = decode_step(name) {
        step == 0 || source != "logits"
    } else if Name::parse(name).point == "router.topk" {
        Name::parse(source).point == "router.logits"
    } else {
        true
    }
}

/// The token position of a decision row: the source's `positions` entry when it has one per
/// decision row, else the row index; decode step s is the prompt's last position + s (step 0
/// decides from that position's logits).
pub(super) fn row_position(
    name: &str,
    source: Option<&str>,
    row: u64,
    rows: u64,
    r: &Trace,
) -> Option<i64> {
    if let Some(step) = decode_step(name) {
        let logits = r.tensor_info("logits")?;
        let last = match &logits.attributes.positions {
            Some(p) => *p.last()?,
            None => (*logits.shape.first()? as i64).checked_sub(1)?,
        };
        return last.checked_add(step as i64);
    }
    let positions = source
        .and_then(|s| r.tensor_info(s))
        .and_then(|i| i.attributes.positions.as_ref())
        .filter(|p| p.len() as u64 == rows);
    Some(positions.map_or(row as i64, |p| p[row as usize]))
}

/// Max |reference − candidate| over elements `[start, end)` of a tensor present in both with
/// the same shape and comparable dtypes (the same, or two floats: real values, each in its
/// own dtype); infinite when a NaN or infinity differs there.
pub(super) fn range_divergence(
    r: &Trace,
    c: &Trace,
    name: &str,
    rows: Option<(u64, u64)>,
) -> Option<f64> {
    let (ri, ci) = (r.tensor_info(name)?, c.tensor_info(name)?);
    let pair = Pair::new(ri.dtype, ci.dtype).filter(|_| ri.shape == ci.shape)?;
    let (rs, cs) = (ri.dtype.size(), ci.dtype.size());
    let (start, end) = row_range(ri, rows);
    let (a, b) = (
        &r.data(ri)[start as usize * rs..end as usize * rs],
        &c.data(ci)[start as usize * cs..end as usize * cs],
    );
    let (s, _) = numeric::scan(pair, a, b, false);
    if s.nan_mismatch + s.nan_payload + s.infinity > 0 {
        return Some(f64::INFINITY);
    }
    Some(s.max_abs)
}

/// The elements `[start, end)` of row `row` of `count` rows, when the tensor's first axis has
/// that many rows; else of the whole tensor.
pub(super) fn row_range(info: &TensorInfo, rows: Option<(u64, u64)>) -> (u64, u64) {
    let n = info.element_count();
    match rows {
        Some((row, count)) if info.shape.first() == Some(&count) && count > 0 => {
            let width = n / count;
            (row * width, (row + 1) * width)
        }
        _ => (0, n),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_steps() {
        assert_eq!(decode_step("decode.0000.argmax"), Some(0));
        assert_eq!(decode_step("decode.0012.argmax"), Some(12));
        assert_eq!(decode_step("logits.argmax"), None);
        assert!(holds_scores("decode.0000.argmax", "logits"));
        assert!(!holds_scores("decode.0001.argmax", "logits"));
        assert!(holds_scores("decode.0001.argmax", "decode.0001.logits"));
        assert!(holds_scores(
            "layer.00.router.topk",
            "layer.00.router.logits"
        ));
        assert!(!holds_scores("layer.00.router.topk", "layer.00.hidden_in"));
        assert!(holds_scores("logits.argmax", "logits"));
        assert!(holds_scores(
            "denoise.0000.0003.argmax",
            "denoise.0000.0003.logits.tempered"
        ));
    }
}
