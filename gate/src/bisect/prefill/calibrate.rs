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

/// The ULP a perturbation moves by: one of f32's, or one of a coarser precision's (bf16, f16)
/// at the element's magnitude, so the response scales with what that precision rounds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Unit {
    F32,
    BF16,
    F16,
}

impl Unit {
    /// The unit of a precision the judge uses (tracegate_diff::policy::PRECISIONS); None for
    /// one without a ULP of its own size here (q8).
    pub(crate) fn of(precision: &str) -> Option<Unit> {
        match precision {
            "f32" => Some(Unit::F32),
            "bf16" => Some(Unit::BF16),
            "f16" => Some(Unit::F16),
            _ => None,
        }
    }

    /// How many f32 ULPs one of this unit's is: 2^(23 − fraction bits).
    fn step(self) -> u32 {
        match self {
            Unit::F32 => 1,
            Unit::BF16 => 1 << 16,
            Unit::F16 => 1 << 13,
        }
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Unit::F32 => "f32",
            Unit::BF16 => "bf16",
            Unit::F16 => "f16",
        }
    }
}

/// Moves every finite element one `unit` ULP up or down in magnitude, the direction from a
/// seeded splitmix64 stream, so the calibration is reproducible bit for bit: the f32 bit
/// pattern's magnitude moved by `unit.step()`, one ULP of that precision at the element's
/// magnitude (a magnitude below one step goes to zero going down).
pub(crate) fn perturb_in(data: &[f32], seed: u64, unit: Unit) -> Vec<f32> {
    let step = unit.step();
    let mut s = seed;
    data.iter()
        .map(|&x| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            let up = (z ^ (z >> 31)) & 1 == 1;
            let b = x.to_bits();
            let (sign, mag) = (b & 0x8000_0000, b & 0x7fff_ffff);
            if !x.is_finite() {
                x
            } else if mag == 0 {
                f32::from_bits(b | step) // ±0 → ± one step
            } else if up && mag <= 0x7f7f_ffff - step {
                f32::from_bits(sign | (mag + step))
            } else {
                f32::from_bits(sign | mag.saturating_sub(step))
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
    match write_perturbed(o, reference, from, Unit::F32, &input_rel) {
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
        let hidden = names::layer(layer, "hidden_out");
        let row = run_reference_layer(
            o,
            reference_producer,
            layer,
            &input,
            &input_name,
            &out,
            runs,
        )
        .and_then(|t| against_whole(reference, &t, &hidden, layer));
        crate::progress::step(format_args!(
            "calibration: layer {layer:02} on the perturbed input"
        ));
        match row {
            Ok(row) => cal.rows.push(row),
            Err(e) => {
                cal.not_checked = Some(format!("layer {layer:02}: {e}"));
                return cal;
            }
        }
        (input, input_name) = (out, hidden);
    }
    cal
}

/// Writes the reference's input to `layer`, every finite element moved one `unit` ULP, as a
/// trace at `rel`; its rel L2 against the unperturbed input.
fn write_perturbed(
    o: &BisectOptions,
    reference: &Trace,
    layer: usize,
    unit: Unit,
    rel: &str,
) -> Result<Option<f64>> {
    let name = names::layer(layer, "hidden_in");
    let info = reference
        .tensor_info(&name)
        .ok_or_else(|| gerr!(Producer: "the reference has no {name}"))?;
    if info.dtype != DType::F32 {
        return Err(gerr!("{name} is {}, calibration perturbs f32", info.dtype));
    }
    let x = reference.f32_slice(&name).map_err(|e| gerr!(File: "{e}"))?;
    let y = perturb_in(x, o.seed, unit);
    let mut prov = reference.provenance().clone();
    if let Some(p) = prov.as_object_mut() {
        p.insert(
            "bisect_calibration".into(),
            json!({ "layer": layer, "seed": o.seed, "unit": unit.name() }),
        );
    }
    let path = o.root.join(rel);
    let mut w = TraceWriter::create(&path, prov).map_err(|e| gerr!(File: "{rel}: {e}"))?;
    w.tensor_f32(&name, &info.shape, &y, &info.attributes)
        .map_err(|e| gerr!(File: "{rel}: {e}"))?;
    w.finish().map_err(|e| gerr!(File: "{rel}: {e}"))?;
    Ok(f32_stats(x, &y)
        .map_err(|e| gerr!(Incomparable: "{name}: {e}"))?
        .rel_l2)
}

/// The reference's layer verb on `layer` with `input` (a trace holding `input_name`): its trace.
fn run_reference_layer(
    o: &BisectOptions,
    producer: &Producer,
    layer: usize,
    input: &str,
    input_name: &str,
    out: &str,
    runs: &mut Vec<RunRecord>,
) -> Result<Trace> {
    let verb = Verb::Layer {
        model: o.model.clone(),
        layer,
        input: input.to_string(),
        input_name: input_name.to_string(),
        out: out.to_string(),
        internals: false,
        force: None,
        decode_from: None,
    };
    let rec = run_fresh(&o.root, producer, &verb, o.timeout);
    runs.push(rec.clone());
    if !rec.ok {
        return Err(gerr!(Producer: "the reference's layer verb failed: {}", rec.why()));
    }
    open(&o.root, out)
}

/// `name` of a layer run measured against the reference's whole-run `name`.
fn against_whole(
    reference: &Trace,
    run: &Trace,
    name: &str,
    layer: usize,
) -> Result<CalibrationRow> {
    let c = run.f32_slice(name).map_err(|e| gerr!(File: "{e}"))?;
    let r = reference.f32_slice(name).map_err(|e| gerr!(File: "{e}"))?;
    if c.len() != r.len() {
        return Err(gerr!(
            Incomparable: "{name}: {} elements vs {} in the reference",
            c.len(),
            r.len()
        ));
    }
    Ok(CalibrationRow {
        layer,
        ..f32_stats(r, c)?
    })
}

// ------------------------------------------------------------------------------------------
// Rounding response

/// Each listed layer's response to rounding in the candidate's precision: the reference's layer
/// verb on its own input to that layer moved one ULP of that precision (`unit`), not chained;
/// per layer, each of `tensors` (capture-point suffixes) against the reference's whole run. The
/// ratio of the candidate's isolated error to it says how far above what that precision rounds
/// the layer's body is (docs/bisect.md, "Rounding response").
pub(crate) fn responses(
    o: &BisectOptions,
    reference: &Trace,
    layers: &[(usize, Vec<&'static str>)],
    unit: Unit,
    runs: &mut Vec<RunRecord>,
) -> std::result::Result<Vec<Vec<CalibrationRow>>, String> {
    let Reference::Run(producer) = &o.reference else {
        return Err("the reference is a stored trace: the rounding response runs the reference's own layer verb, which a trace does not have".into());
    };
    crate::progress::plan(layers.len() as u64);
    let mut rows = Vec::new();
    for (layer, tensors) in layers {
        let layer = *layer;
        let input = format!("{}/response.input.{layer:02}.trace", o.work);
        let out = format!("{}/response.layer.{layer:02}.trace", o.work);
        let measured = write_perturbed(o, reference, layer, unit, &input)
            .and_then(|_| {
                run_reference_layer(
                    o,
                    producer,
                    layer,
                    &input,
                    &names::layer(layer, "hidden_in"),
                    &out,
                    runs,
                )
            })
            .and_then(|t| {
                tensors
                    .iter()
                    .map(|s| against_whole(reference, &t, &names::layer(layer, s), layer))
                    .collect::<Result<Vec<_>>>()
            });
        crate::progress::step(format_args!(
            "rounding response: layer {layer:02} on its input moved one {} ULP",
            unit.name()
        ));
        rows.push(measured.map_err(|e| format!("layer {layer:02}: {e}"))?);
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One ULP of `unit` at `x`'s magnitude, away from or toward zero, as that format spaces it.
    fn neighbours(x: f32, unit: Unit) -> (f32, f32) {
        let bits = match unit {
            Unit::F32 => 24,
            Unit::BF16 => 8,
            Unit::F16 => 11,
        };
        let e = x.abs().log2().floor() as i32;
        let up = 2f32.powi(e - bits + 1);
        // Just below a power of two the spacing halves.
        let below = if x.abs() == 2f32.powi(e) {
            up / 2.0
        } else {
            up
        };
        (x.abs() + up, x.abs() - below)
    }

    #[test]
    fn each_unit_moves_an_element_one_ulp_of_its_own_format() {
        let xs = [1.0f32, -1.0, 1.5, -0.75, 3.0, 1024.0, 0.0078125];
        for unit in [Unit::F32, Unit::BF16, Unit::F16] {
            let y = perturb_in(&xs, 7, unit);
            for (&x, &v) in xs.iter().zip(&y) {
                let (up, down) = neighbours(x, unit);
                assert!(
                    v.abs() == up || v.abs() == down,
                    "{unit:?}: {x} -> {v}, expected ±{up} or ±{down}"
                );
                assert_eq!(
                    v.is_sign_negative(),
                    x.is_sign_negative(),
                    "{unit:?}: {x} -> {v}"
                );
                if unit == Unit::BF16 {
                    assert_eq!(
                        v.to_bits() & 0xffff,
                        0,
                        "{x} -> {v} is not on the bf16 grid"
                    );
                }
            }
            // Both directions occur (the seeded stream), and non-finite values stay.
            assert!(xs.iter().zip(&y).any(|(x, v)| v.abs() > x.abs()));
            assert!(xs.iter().zip(&y).any(|(x, v)| v.abs() < x.abs()));
            let odd = perturb_in(&[f32::NAN, f32::INFINITY, f32::NEG_INFINITY], 1, unit);
            assert!(odd[0].is_nan() && odd[1] == f32::INFINITY && odd[2] == f32::NEG_INFINITY);
        }
        // The f32 unit is the calibration's one-ULP move: a neighbour in the bit pattern.
        let y = perturb_in(&xs, 1, Unit::F32);
        for (x, v) in xs.iter().zip(&y) {
            assert_eq!(
                (x.to_bits() as i64 - v.to_bits() as i64).abs(),
                1,
                "{x} -> {v}"
            );
        }
    }
}
