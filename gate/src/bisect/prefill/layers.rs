//! The per-layer phases of a bisection: each layer isolated on the reference's input, each
//! layer's status, the calibration rows, the outliers within the policy and the amplification.

use super::whole::{Located, Whole};
use super::*;

/// Isolation: layers up to and including the first diverging one, or all of them. A layer verb
/// that fails leaves the layers after it not attempted: `failed` is that layer and why.
pub(crate) fn isolate_layers(
    o: &BisectOptions,
    whole: &Whole,
    located: &Located,
    policy: &Option<Policy>,
    forced: bool,
    runs: &mut Vec<RunRecord>,
) -> (Vec<LayerRow>, Option<(usize, String)>) {
    let n = located.n;
    let isolate_upto = if o.all_layers {
        n
    } else {
        located.first_layer.map_or(0, |l| l + 1)
    };
    let mut layers: Vec<LayerRow> = (0..n)
        .map(|l| {
            let pfx = names::layer_prefix(l);
            let differs = located
                .diverging
                .iter()
                .any(|(_, name, _)| name.starts_with(&pfx));
            let h = located
                .rows
                .iter()
                .find(|t| t.tensor == names::layer(l, "hidden_out"));
            layer_row(l, differs, h)
        })
        .collect();
    let mut failed: Option<(usize, String)> = None;
    crate::progress::plan(isolate_upto as u64);
    let src = Source {
        trace: &whole.reference,
        rel: &whole.ref_rel,
        whose: "the reference's",
        out_stem: "candidate.layer",
        slice_stem: "reference.layer",
        noise: o.noise.as_ref(),
    };
    for (l, row) in layers.iter_mut().enumerate().take(isolate_upto) {
        if let Some((at, _)) = &failed {
            row.isolation = Isolated::NotChecked;
            row.reason = Some(format!(
                "not attempted: the candidate's layer verb failed on layer {at:02}"
            ));
            continue;
        }
        match isolate(o, &src, l, policy, forced, runs) {
            Ok(iso) => fill_isolated(row, iso),
            Err(why) => {
                row.isolation = Isolated::NotChecked;
                row.reason = Some(why.to_string());
                failed = Some((l, why.to_string()));
            }
        }
        crate::progress::step(format_args!("layer {l:02} in isolation: {}", row.isolation));
    }
    (layers, failed)
}

/// A layer whose status would be "inherits" though there is nothing to inherit: its input
/// (`layer.LL.hidden_in`) agrees with the reference in the whole runs, its output does not, and
/// the candidate's layer verb on the reference's input matches the reference. Such a difference
/// cannot come from upstream, nor from the layer body the layer verb runs: the candidate's whole
/// run computes that layer otherwise (a weight loaded from another block, a setting the layer
/// verb does not share). Its self-check settles which (`self_check`). The first such layer.
#[derive(Clone, Debug)]
pub(crate) struct Unexplained {
    pub layer: usize,
    /// The whole runs' `layer.LL.hidden_in` and `layer.LL.hidden_out` rel L2.
    pub input_rel_l2: Option<f64>,
    pub output_rel_l2: Option<f64>,
}

pub(crate) fn unexplained(layers: &[LayerRow], located: &Located) -> Option<Unexplained> {
    layers
        .iter()
        .filter(|r| r.isolation == Isolated::Match && r.whole_run == WholeRunState::Differs)
        .find_map(|r| {
            let input = names::layer(r.layer, "hidden_in");
            let compared = located.rows.iter().find(|t| t.tensor == input)?;
            let agrees = !compared.status.is_bad()
                && !located.diverging.iter().any(|(_, name, _)| *name == input);
            agrees.then_some(Unexplained {
                layer: r.layer,
                input_rel_l2: compared.rel_l2,
                output_rel_l2: r.whole_rel_l2,
            })
        })
}

/// Each layer's status from its isolation, its whole-run comparison and its self-check; the
/// first layer wrong in isolation.
pub(crate) fn settle_statuses(layers: &mut [LayerRow]) -> Option<usize> {
    for row in layers.iter_mut() {
        row.status = if row.self_check == SelfCheck::Inconsistent {
            LayerStatus::Inconsistent
        } else {
            layer_status(row.isolation, row.whole_run)
        };
    }
    layers
        .iter()
        .find(|r| r.status == LayerStatus::Wrong)
        .map(|r| r.layer)
}

/// Calibration: from the first wrong layer, else the first diverging one, else layer 0. `auto`:
/// judged by bits, a layer about to be blamed in a pair that is not two ordered producers gets
/// it without --calibrate, for that one layer: is its difference rounding? Each calibrated
/// row gets its calibration error and the ratios of its own errors to it.
pub(crate) fn calibration(
    o: &BisectOptions,
    reference: &Trace,
    layers: &mut [LayerRow],
    located: &Located,
    first_wrong: Option<usize>,
    auto: bool,
    runs: &mut Vec<RunRecord>,
) -> Option<Calibration> {
    let n = located.n;
    let cal = match first_wrong {
        Some(l) if auto => Some(calibrate(o, reference, l, l + 1, runs)),
        _ => (o.calibrate && n > 0).then(|| {
            let from = first_wrong.or(located.first_layer).unwrap_or(0);
            calibrate(o, reference, from, n, runs)
        }),
    }?;
    for c in &cal.rows {
        let row = &mut layers[c.layer];
        row.calibration_rel_l2 = c.rel_l2;
        let over = |x: Option<f64>| match (x, c.rel_l2) {
            (Some(a), Some(b)) if b > 0.0 => Some(a / b),
            _ => None,
        };
        row.whole_vs_calibration = over(row.whole_rel_l2);
        if c.layer == cal.from_layer {
            row.isolated_vs_calibration = over(row.isolated_rel_l2);
        }
    }
    Some(cal)
}

/// The rounding response (judged by policy only): for the isolated layers up to the first
/// wrong one (all of them when none is), each one's isolated block-output errors over the
/// reference's response to one ULP of the candidate's precision at that layer's input. It runs
/// when the whole runs are outside the policy, or under --all-layers (then an observation).
pub(crate) fn rounding_response(
    o: &BisectOptions,
    reference: &Trace,
    layers: &[LayerRow],
    first_wrong: Option<usize>,
    whole_within: bool,
    precision: &'static str,
    runs: &mut Vec<RunRecord>,
) -> Option<RoundingResponse> {
    if whole_within && !o.all_layers {
        return None;
    }
    let mut rr = RoundingResponse {
        precision,
        perturbation: format!("every finite element of the reference's input to each layer moved one {precision} ULP up or down in magnitude (splitmix64, seed {}), that layer alone", o.seed),
        factor: judge::RESPONSE_FACTOR,
        rows: Vec::new(),
        first_far_above: None,
        ratio: None,
        not_checked: None,
    };
    let Some(unit) = Unit::of(precision) else {
        rr.not_checked = Some(format!("no rounding unit for precision {precision}"));
        return Some(rr);
    };
    let upto = first_wrong.map_or(layers.len(), |l| l + 1);
    let isolated: Vec<&LayerRow> = layers[..upto]
        .iter()
        .filter(|r| matches!(r.isolation, Isolated::Match | Isolated::Wrong))
        .collect();
    if isolated.is_empty() {
        rr.not_checked = Some("no layer was isolated (the whole runs diverge after the last layer, or not at all; --all-layers isolates every layer)".into());
        return Some(rr);
    }
    // Block outputs, not hidden_out: the residual carries the perturbed input straight into
    // hidden_out, which on a trained model's massive activations swamps the block's own rounding
    // (SmolLM2: clean hidden_out ratios 0.11-11, attn_out 1.9-3.4).
    let which: Vec<(usize, Vec<&'static str>)> = isolated
        .iter()
        .map(|r| {
            let t = if is_moe(reference, r.layer) {
                vec!["attn_out"]
            } else {
                vec!["attn_out", "mlp_out"]
            };
            (r.layer, t)
        })
        .collect();
    match responses(o, reference, &which, unit, runs) {
        Err(why) => rr.not_checked = Some(why),
        Ok(measured) => {
            for ((row, (_, suffixes)), cal) in isolated.iter().zip(&which).zip(measured) {
                let isolated: Vec<(String, Option<f64>)> = suffixes
                    .iter()
                    .map(|t| {
                        let name = names::layer(row.layer, t);
                        let iso = row
                            .isolated
                            .iter()
                            .find(|x| x.tensor == name)
                            .and_then(|x| x.rel_l2);
                        (name, iso)
                    })
                    .collect();
                rr.rows.push(response_row(row.layer, isolated, &cal));
            }
            (rr.first_far_above, rr.ratio) = first_far_above(&rr.rows, rr.factor);
        }
    }
    Some(rr)
}

/// A layer's row: each block output's isolated rel L2 (`isolated`, by tensor name) over the
/// reference's response (`response`, in the same order).
pub(crate) fn response_row(
    layer: usize,
    isolated: Vec<(String, Option<f64>)>,
    response: &[CalibrationRow],
) -> ResponseRow {
    let tensors: Vec<ResponseTensor> = isolated
        .into_iter()
        .zip(response)
        .map(|((tensor, iso), c)| {
            let (ratio, undefined) = match (iso, c.rel_l2) {
                (Some(a), Some(b)) if b > 0.0 => (Some(a / b), None),
                // Rounding moves nothing there, the candidate does: no ratio bounds it, so it
                // counts as far above (never as within).
                (Some(a), Some(_)) if a > 0.0 => (None, Some(Undefined::ZeroResponse)),
                (Some(_), Some(_)) => (None, Some(Undefined::BothZero)),
                _ => (None, Some(Undefined::NotMeasured)),
            };
            ResponseTensor {
                tensor,
                isolated_rel_l2: iso,
                response_rel_l2: c.rel_l2,
                ratio,
                undefined,
            }
        })
        .collect();
    let ratio = tensors
        .iter()
        .filter_map(|t| t.ratio)
        .max_by(f64::total_cmp);
    ResponseRow {
        layer,
        tensors,
        ratio,
    }
}

/// The first layer far above rounding, and its ratio: above `factor`, or unbounded (a zero
/// response where the candidate differs; its ratio null).
pub(crate) fn first_far_above(rows: &[ResponseRow], factor: f64) -> (Option<usize>, Option<f64>) {
    rows.iter()
        .find_map(|r| {
            let unbounded = r
                .tensors
                .iter()
                .any(|t| t.undefined == Some(Undefined::ZeroResponse));
            if unbounded {
                Some((Some(r.layer), None))
            } else if r.ratio.is_some_and(|x| x > factor) {
                Some((Some(r.layer), r.ratio))
            } else {
                None
            }
        })
        .unwrap_or((None, None))
}

/// Outliers within the policy: the matching isolated layers' errors against their peers'; each
/// such row gets its ratio and flag.
pub(crate) fn outliers(reference: &Trace, kinds: &[String], layers: &mut [LayerRow]) -> Outliers {
    let errors: Vec<judge::LayerErrors> = layers
        .iter()
        .filter(|r| r.isolation == Isolated::Match && r.status != LayerStatus::Inconsistent)
        .map(|r| {
            let rel = |t: &str| {
                r.isolated
                    .iter()
                    .find(|x| x.tensor == names::layer(r.layer, t))
                    .and_then(|x| x.rel_l2)
            };
            (
                r.layer,
                rel("attn_out"),
                if is_moe(reference, r.layer) {
                    None
                } else {
                    rel("mlp_out")
                },
                kinds.get(r.layer).cloned().unwrap_or_default(),
            )
        })
        .collect();
    let (outliers, per) = judge::outliers(&errors);
    for (l, ratio, flagged) in per {
        (layers[l].peer_ratio, layers[l].suspicious) = (ratio, flagged);
    }
    outliers
}

/// Geometric-mean growth of the whole-run error over consecutive differing layers.
pub(crate) fn amplification(layers: &[LayerRow]) -> Option<f64> {
    let errs: Vec<f64> = layers
        .iter()
        .filter_map(|r| r.whole_rel_l2)
        .filter(|&e| e > 0.0)
        .collect();
    (errs.len() >= 2).then(|| (errs[errs.len() - 1] / errs[0]).powf(1.0 / (errs.len() - 1) as f64))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cal(rel: Option<f64>) -> CalibrationRow {
        CalibrationRow {
            layer: 0,
            rel_l2: rel,
            max_ulp: 0,
            differing_elements: 0,
            total_elements: 1,
        }
    }

    fn row(
        layer: usize,
        attn: (Option<f64>, Option<f64>),
        mlp: (Option<f64>, Option<f64>),
    ) -> ResponseRow {
        response_row(
            layer,
            vec![("attn_out".into(), attn.0), ("mlp_out".into(), mlp.0)],
            &[cal(attn.1), cal(mlp.1)],
        )
    }

    #[test]
    fn a_layer_is_far_above_by_its_largest_block_ratio_or_by_a_response_that_never_moved() {
        // The larger block output decides: mlp_out 30x, attn_out 1x.
        let rows = [row(0, (Some(1e-7), Some(1e-7)), (Some(3e-6), Some(1e-7)))];
        assert_eq!(
            first_far_above(&rows, 20.0),
            (Some(0), Some(30.000000000000004))
        );
        // At rounding level everywhere: none.
        let clean = [
            row(0, (Some(1e-7), Some(1e-7)), (Some(1.5e-7), Some(1e-7))),
            row(1, (Some(0.0), Some(1e-7)), (Some(0.0), Some(1e-7))),
        ];
        assert_eq!(first_far_above(&clean, 20.0), (None, None));
        // A reference layer that does not move with its input while the candidate differs is
        // never "within": it is the first far above, with no ratio to show.
        let frozen = [
            row(0, (Some(1e-7), Some(1e-7)), (Some(1e-7), Some(1e-7))),
            row(1, (Some(1e-7), Some(0.0)), (Some(1e-7), Some(1e-7))),
        ];
        assert_eq!(first_far_above(&frozen, 20.0), (Some(1), None));
        assert_eq!(
            frozen[1].tensors[0].undefined,
            Some(Undefined::ZeroResponse)
        );
        // Both bit for bit: no ratio and nothing above; a missing measure is said.
        let quiet = [row(0, (Some(0.0), Some(0.0)), (None, Some(1e-7)))];
        assert_eq!(first_far_above(&quiet, 20.0), (None, None));
        assert_eq!(
            quiet[0]
                .tensors
                .iter()
                .map(|t| t.undefined)
                .collect::<Vec<_>>(),
            [Some(Undefined::BothZero), Some(Undefined::NotMeasured)]
        );
        let rr = RoundingResponse {
            precision: "f32",
            perturbation: String::new(),
            factor: 20.0,
            rows: quiet.to_vec(),
            first_far_above: None,
            ratio: None,
            not_checked: None,
        };
        let words = response_words(&rr, BisectVerdict::Accumulates, None).unwrap();
        assert!(
            words.ends_with(
                "; rounding response NOT CHECKED at layer 00: a block output was not measured"
            ),
            "{words}"
        );
    }
}
