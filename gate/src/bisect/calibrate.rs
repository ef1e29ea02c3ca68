//! `--calibrate`: the reference's layer verb chained over a 1-ULP perturbation of its input, and
//! the measures the layer rows are divided by.

use super::*;

/// rel L2 (vs `reference`), max ULP and differing count: trace-diff's measures
/// (`tracegate_diff::measures`, docs/diff.md "Measures"), the ones the layer rows carry, since
/// calibration divides those by these. NaN and infinity pairs are counted there, not summed; a
/// row whose differing pairs are all NaN pairs (no distance) has max ULP 0 here.
pub fn f32_stats(reference: &[f32], candidate: &[f32]) -> Result<CalibrationRow> {
    let m = tracegate_diff::measures::measure_f32(reference, candidate)
        .map_err(|e| gerr!(Incomparable: "{e}"))?;
    Ok(CalibrationRow {
        layer: 0,
        rel_l2: m.rel_l2(),
        max_ulp: m.max_ulp().unwrap_or(0),
        differing_elements: m.differing(),
        total_elements: m.total(),
    })
}

/// Moves every finite element one ULP up or down in magnitude, the direction from a seeded
/// splitmix64 stream, so the calibration is reproducible bit for bit.
pub(crate) fn perturb(data: &[f32], seed: u64) -> Vec<f32> {
    let mut s = seed;
    data.iter()
        .map(|&x| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            let up = (z ^ (z >> 31)) & 1 == 1;
            let b = x.to_bits();
            let mag = b & 0x7fff_ffff;
            if !x.is_finite() {
                x
            } else if mag == 0 {
                f32::from_bits(b | 1) // ±0 → ±smallest subnormal
            } else if up && mag < 0x7f7f_ffff {
                f32::from_bits(b + 1)
            } else {
                f32::from_bits(b - 1)
            }
        })
        .collect()
}

// ------------------------------------------------------------------------------------------
// Calibration

/// The reference's layer verb chained over a 1-ULP perturbation of layer `from`'s input, up to
/// (not including) layer `upto`.
pub(crate) fn calibrate(
    o: &BisectOptions,
    reference: &Trace,
    from: usize,
    upto: usize,
    runs: &mut Vec<RunRecord>,
) -> Calibration {
    let mut cal = Calibration {
        automatic: !o.calibrate,
        from_layer: from,
        seed: o.seed,
        perturbation: format!("every finite element of {} moved one f32 ULP up or down in magnitude (splitmix64, seed {})", names::layer(from, "hidden_in"), o.seed),
        input_rel_l2: None,
        rows: Vec::new(),
        not_checked: None,
    };
    let reference_producer = match &o.reference {
        Reference::Run(p) => p,
        Reference::Stored(s) => {
            cal.not_checked = Some(format!(
                "the reference is a stored trace (trace:{}): calibration runs the reference's own layer verb, which a trace does not have",
                s.shown
            ));
            return cal;
        }
    };
    let name = names::layer(from, "hidden_in");
    let input_rel = format!("{}/calibration.input.trace", o.work);
    let written = (|| -> Result<Option<f64>> {
        let info = reference
            .tensor_info(&name)
            .ok_or_else(|| gerr!(Producer: "the reference has no {name}"))?;
        if info.dtype != DType::F32 {
            return Err(gerr!("{name} is {}, calibration perturbs f32", info.dtype));
        }
        let x = reference.f32_slice(&name).map_err(|e| gerr!(File: "{e}"))?;
        let y = perturb(x, o.seed);
        let mut prov = reference.provenance().clone();
        if let Some(p) = prov.as_object_mut() {
            p.insert(
                "bisect_calibration".into(),
                json!({ "layer": from, "seed": o.seed }),
            );
        }
        let path = o.root.join(&input_rel);
        let mut w =
            TraceWriter::create(&path, prov).map_err(|e| gerr!(File: "{input_rel}: {e}"))?;
        w.tensor_f32(&name, &info.shape, &y, &info.attributes)
            .map_err(|e| gerr!(File: "{input_rel}: {e}"))?;
        w.finish().map_err(|e| gerr!(File: "{input_rel}: {e}"))?;
        Ok(f32_stats(x, &y)
            .map_err(|e| gerr!(Incomparable: "{name}: {e}"))?
            .rel_l2)
    })();
    match written {
        Ok(r) => cal.input_rel_l2 = r,
        Err(e) => {
            cal.not_checked = Some(e.to_string());
            return cal;
        }
    }
    // The reference's own layer verb, chained: each layer's hidden_out is the next one's input.
    let (mut input, mut input_name) = (input_rel, name);
    crate::progress::plan((upto - from) as u64);
    for layer in from..upto {
        let out = format!("{}/calibration.layer.{layer:02}.trace", o.work);
        let verb = Verb::Layer {
            model: o.model.clone(),
            layer,
            input,
            input_name,
            out: out.clone(),
            internals: false,
            force: None,
            decode_from: None,
        };
        let rec = run_fresh(&o.root, reference_producer, &verb, o.timeout);
        runs.push(rec.clone());
        crate::progress::step(format_args!(
            "calibration: layer {layer:02} on the perturbed input"
        ));
        let hidden = names::layer(layer, "hidden_out");
        let got = if rec.ok {
            open(&o.root, &out)
        } else {
            Err(gerr!(Producer: "the reference's layer verb failed: {}", rec.why()))
        };
        let stats = got.and_then(|t| {
            let c = t.f32_slice(&hidden).map_err(|e| gerr!(File: "{e}"))?;
            let r = reference
                .f32_slice(&hidden)
                .map_err(|e| gerr!(File: "{e}"))?;
            if c.len() != r.len() {
                return Err(gerr!(
                    Incomparable: "{hidden}: {} elements vs {} in the reference",
                    c.len(),
                    r.len()
                ));
            }
            f32_stats(r, c)
        });
        match stats {
            Ok(row) => cal.rows.push(CalibrationRow { layer, ..row }),
            Err(e) => {
                cal.not_checked = Some(format!("layer {layer:02}: {e}"));
                return cal;
            }
        }
        (input, input_name) = (out, hidden);
    }
    cal
}
