//! The op-level conformance vectors (fixtures/conformance/vectors.json, derived independently by
//! fixtures/conformance/derive.py) through the engine's ops and its DG15 random numbers
//! (engine/src/splitmix.rs), bit for bit. The contract checks the same file in
//! contract/tests/test_conformance.py.

use std::collections::BTreeSet;

use serde_json::Value;
use tracegate_engine::ops;
use tracegate_engine::splitmix::{self, Purpose};
use tracegate_engine::weights::{widen, Mat, WDType};

/// Every op of the file, each checked below: a new op in the file that no test reads fails here.
const OPS: [&str; 20] = [
    "widen",
    "dot",
    "ordered_sum",
    "matmul",
    "rmsnorm",
    "inv_freq",
    "rope_tables",
    "rope_apply",
    "exp_to_f32",
    "softmax",
    "sigmoid",
    "silu",
    "topk",
    "argmax_margin",
    "margin_of",
    "splitmix64",
    "dg_key",
    "dg_uniform",
    "dg_token",
    "dg_categorical",
];

fn vectors() -> Value {
    let p = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../fixtures/conformance/vectors.json"
    );
    serde_json::from_str(&std::fs::read_to_string(p).expect("vectors.json")).expect("JSON")
}

fn hex(v: &Value) -> u32 {
    u32::from_str_radix(v.as_str().expect("hex string"), 16).expect("hex")
}
fn f(v: &Value) -> f32 {
    f32::from_bits(hex(v))
}
fn fs(v: &Value) -> Vec<f32> {
    v.as_array().expect("list").iter().map(f).collect()
}
/// A 64-bit integer or a binary64's bits, 16 hex digits.
fn hex64(v: &Value) -> u64 {
    u64::from_str_radix(v.as_str().expect("hex string"), 16).expect("hex")
}
fn hex64s(v: &Value) -> Vec<u64> {
    v.as_array().expect("list").iter().map(hex64).collect()
}
fn h64(x: u64) -> String {
    format!("{x:016x}")
}
fn strs(v: &Value) -> Vec<String> {
    let s = v.as_array().expect("list").iter();
    s.map(|h| h.as_str().expect("hex string").to_owned())
        .collect()
}
fn int(v: &Value) -> u64 {
    v.as_u64().expect("integer")
}
fn purpose(v: &Value) -> Purpose {
    match int(v) {
        1 => Purpose::Init,
        2 => Purpose::Sample,
        3 => Purpose::Renoise,
        p => panic!("purpose {p}"),
    }
}
fn idx(v: &Value) -> Vec<usize> {
    v.as_array()
        .expect("list")
        .iter()
        .map(|i| i.as_u64().expect("index") as usize)
        .collect()
}

/// Bits equal; where the expected value is a NaN produced by arithmetic, any NaN (IEEE leaves a
/// generated NaN's sign and payload to the platform). Returns the first mismatch.
fn mismatch(what: &str, got: &[f32], want: &[f32]) -> Option<String> {
    if got.len() != want.len() {
        return Some(format!(
            "{what}: {} values, expected {}",
            got.len(),
            want.len()
        ));
    }
    got.iter().zip(want).enumerate().find_map(|(i, (g, w))| {
        let same = g.to_bits() == w.to_bits() || (w.is_nan() && g.is_nan());
        (!same).then(|| {
            format!(
                "{what}[{i}]: got {:08x}, expected {:08x}",
                g.to_bits(),
                w.to_bits()
            )
        })
    })
}

fn check(errors: &mut Vec<String>, what: String, got: &[f32], want: &[f32]) {
    errors.extend(mismatch(&what, got, want));
}

/// Integers are equal or not; 64-bit patterns are compared as their 16 hex digits (`h64`).
fn check_eq<T: PartialEq + std::fmt::Debug>(
    errors: &mut Vec<String>,
    what: String,
    got: T,
    want: T,
) {
    if got != want {
        errors.push(format!("{what}: got {got:?}, expected {want:?}"));
    }
}

#[test]
fn every_op_of_the_vectors_matches_bit_for_bit() {
    let v = vectors();
    let ops_in_file: BTreeSet<&str> = v["ops"]
        .as_object()
        .expect("ops")
        .keys()
        .map(|k| k.as_str())
        .collect();
    assert_eq!(
        ops_in_file,
        OPS.into_iter().collect(),
        "ops in vectors.json vs checked here"
    );
    let mut errors = vec![];
    let mut checked = 0;
    for op in OPS {
        for c in v["ops"][op].as_array().expect("cases") {
            let what = format!("{op} {:?}", c["name"].as_str().unwrap_or(""));
            checked += 1;
            match op {
                "widen" => {
                    let h: Vec<u16> = c["bits16"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|b| hex(b) as u16)
                        .collect();
                    let bytes: Vec<u8> = h.iter().flat_map(|b| b.to_le_bytes()).collect();
                    let dtype = match c["dtype"].as_str() {
                        Some("bf16") => WDType::BF16,
                        _ => WDType::F16,
                    };
                    let mut out = vec![0.0f32; h.len()];
                    widen(dtype, &bytes, &mut out);
                    // Exact bits, NaN payloads included: widening is a conversion, not arithmetic.
                    let (got, want): (Vec<u32>, Vec<u32>) = (
                        out.iter().map(|x| x.to_bits()).collect(),
                        c["out"].as_array().unwrap().iter().map(hex).collect(),
                    );
                    if got != want {
                        errors.push(format!("{what}: got {got:08x?}, expected {want:08x?}"));
                    }
                }
                "dot" => check(
                    &mut errors,
                    what,
                    &[ops::dot(&fs(&c["x"]), &fs(&c["w"]))],
                    &[f(&c["out"])],
                ),
                "ordered_sum" => check(
                    &mut errors,
                    what,
                    &[ops::ordered_sum(&fs(&c["v"]))],
                    &[f(&c["out"])],
                ),
                "matmul" => {
                    let (rows, n, k) = (
                        c["rows"].as_u64().unwrap() as usize,
                        c["n"].as_u64().unwrap() as usize,
                        c["k"].as_u64().unwrap() as usize,
                    );
                    let x: Vec<f32> = c["x"].as_array().unwrap().iter().flat_map(fs).collect();
                    let (dtype, bytes): (WDType, Vec<u8>) = if c["w_dtype"] == "bf16" {
                        let rows16 = c["w_bits16"].as_array().unwrap();
                        let b = rows16
                            .iter()
                            .flat_map(|r| r.as_array().unwrap().iter())
                            .flat_map(|h| (hex(h) as u16).to_le_bytes())
                            .collect();
                        (WDType::BF16, b)
                    } else {
                        let w = c["w"].as_array().unwrap().iter().flat_map(fs);
                        (WDType::F32, w.flat_map(|x| x.to_le_bytes()).collect())
                    };
                    let w = Mat::rows(dtype, n, k, &bytes);
                    let bias = (!c["bias"].is_null()).then(|| fs(&c["bias"]));
                    let want: Vec<f32> = c["out"].as_array().unwrap().iter().flat_map(fs).collect();
                    let got = ops::matmul(&x, rows, w, bias.as_deref());
                    check(&mut errors, format!("{what} matmul"), &got, &want);
                    let got = ops::matmul_ref(&x, rows, w, bias.as_deref());
                    check(&mut errors, format!("{what} matmul_ref"), &got, &want);
                }
                "rmsnorm" => {
                    let x = fs(&c["x"]);
                    let mut out = vec![0.0f32; x.len()];
                    ops::rmsnorm(&x, &fs(&c["w"]), f(&c["eps"]), &mut out);
                    check(&mut errors, what, &out, &fs(&c["out"]));
                }
                "inv_freq" => {
                    let got = ops::inv_freq(
                        c["base"].as_f64().unwrap(),
                        c["d"].as_u64().unwrap() as usize,
                    );
                    check(&mut errors, what, &got, &fs(&c["out"]));
                }
                "rope_tables" => {
                    let positions: Vec<i64> = c["positions"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|p| p.as_i64().unwrap())
                        .collect();
                    let rope = ops::Rope::new(
                        c["base"].as_f64().unwrap(),
                        c["d"].as_u64().unwrap() as usize,
                        &positions,
                    );
                    let flat = |k: &str| -> Vec<f32> {
                        c[k].as_array().unwrap().iter().flat_map(fs).collect()
                    };
                    check(&mut errors, format!("{what} cos"), &rope.cos, &flat("cos"));
                    check(&mut errors, format!("{what} sin"), &rope.sin, &flat("sin"));
                }
                "rope_apply" => {
                    let mut x = fs(&c["x"]);
                    let rope = ops::Rope {
                        half: x.len() / 2,
                        cos: fs(&c["cos"]),
                        sin: fs(&c["sin"]),
                    };
                    rope.apply(0, &mut x);
                    check(&mut errors, what, &x, &fs(&c["out"]));
                }
                "exp_to_f32" => {
                    let got: Vec<f32> = fs(&c["x"]).into_iter().map(ops::exp_to_f32).collect();
                    check(&mut errors, what, &got, &fs(&c["out"]));
                }
                "softmax" => {
                    let s = fs(&c["s"]);
                    let vis: Vec<bool> = c["visible"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|b| b.as_bool().unwrap())
                        .collect();
                    let mut p = vec![f32::NAN; s.len()];
                    ops::softmax(&s, |i| vis[i], &mut p);
                    check(&mut errors, what, &p, &fs(&c["out"]));
                }
                "sigmoid" | "silu" => {
                    let op_fn = if op == "sigmoid" {
                        ops::sigmoid
                    } else {
                        ops::silu
                    };
                    let got: Vec<f32> = fs(&c["g"]).into_iter().map(op_fn).collect();
                    check(&mut errors, what, &got, &fs(&c["out"]));
                }
                "topk" => {
                    let p = fs(&c["p"]);
                    let k = c["k"].as_u64().unwrap() as usize;
                    let (chosen, next) = ops::topk(&p, k);
                    let want = (idx(&c["chosen"]), c["next"].as_u64().map(|n| n as usize));
                    if (chosen.clone(), next) != want {
                        errors.push(format!(
                            "{what}: got {:?}, expected {want:?}",
                            (chosen, next)
                        ));
                    } else if let Some(n) = next {
                        let m = p[chosen[k - 1]] - p[n];
                        check(
                            &mut errors,
                            format!("{what} margin"),
                            &[m],
                            &[f(&c["margin"])],
                        );
                    }
                }
                "argmax_margin" => {
                    let (i, m) = ops::argmax_margin(&fs(&c["v"]));
                    let want_i = c["index"].as_u64().unwrap() as usize;
                    if i != want_i {
                        errors.push(format!("{what}: index {i}, expected {want_i}"));
                    }
                    check(
                        &mut errors,
                        format!("{what} margin"),
                        &[m],
                        &[f(&c["margin"])],
                    );
                }
                "margin_of" => {
                    let m = ops::margin_of(&fs(&c["v"]), &idx(&c["chosen"]));
                    check(&mut errors, what, &[m], &[f(&c["margin"])]);
                }
                "splitmix64" => {
                    let (k, want) = (hex64(&c["key"]), strs(&c["out"]));
                    let got: Vec<String> = (0..want.len() as u64)
                        .map(|i| h64(splitmix::output(k, i)))
                        .collect();
                    check_eq(&mut errors, what, got, want);
                }
                "dg_key" => {
                    let got = splitmix::key(
                        hex64(&c["seed"]),
                        purpose(&c["purpose"]),
                        int(&c["block"]),
                        int(&c["step"]),
                    );
                    let want = c["key"].as_str().expect("hex string").to_owned();
                    check_eq(&mut errors, what, h64(got), want);
                }
                "dg_uniform" => {
                    let got: Vec<String> = hex64s(&c["x"])
                        .into_iter()
                        .map(|x| h64(splitmix::uniform(x).to_bits()))
                        .collect();
                    check_eq(&mut errors, what, got, strs(&c["u"]));
                }
                "dg_token" => {
                    let vocab = int(&c["vocab"]);
                    let got: Vec<u64> = hex64s(&c["x"])
                        .into_iter()
                        .map(|x| splitmix::token(x, vocab))
                        .collect();
                    let want: Vec<u64> = c["out"].as_array().unwrap().iter().map(int).collect();
                    check_eq(&mut errors, what, got, want);
                }
                "dg_categorical" => {
                    let p = fs(&c["p"]);
                    let got: Vec<Option<usize>> = hex64s(&c["u"])
                        .into_iter()
                        .map(|u| splitmix::categorical(&p, f64::from_bits(u)))
                        .collect();
                    let want: Vec<Option<usize>> = idx(&c["out"]).into_iter().map(Some).collect();
                    check_eq(&mut errors, what, got, want);
                }
                _ => unreachable!("OPS lists the ops handled"),
            }
        }
    }
    assert!(checked >= OPS.len(), "{checked} cases");
    assert!(
        errors.is_empty(),
        "{} mismatches:\n{}",
        errors.len(),
        errors.join("\n")
    );
}

#[test]
fn the_comparison_rejects_one_ulp_a_sign_of_zero_and_a_nan_for_a_number() {
    // Negative controls for `mismatch`: the smallest differences the vectors are about.
    let one = [1.0f32];
    assert!(mismatch("x", &[f32::from_bits(1.0f32.to_bits() + 1)], &one).is_some());
    assert!(mismatch("x", &[-0.0], &[0.0]).is_some());
    assert!(mismatch("x", &[f32::NAN], &one).is_some());
    assert!(mismatch("x", &one, &[f32::NAN]).is_some());
    assert!(mismatch("x", &[1.0, 2.0], &one).is_some());
    // A generated NaN matches any NaN; equal bits match.
    assert!(mismatch("x", &[f32::from_bits(0xffc0_0000)], &[f32::NAN]).is_none());
    assert!(mismatch("x", &one, &one).is_none());
}

#[test]
fn a_kernel_that_sums_right_to_left_fails_the_vectors() {
    // Negative control for the vectors themselves: the `dot` cases tell the §2 order from the
    // reverse one, so a kernel that reassociates cannot pass them.
    let v = vectors();
    let caught = v["ops"]["dot"].as_array().unwrap().iter().any(|c| {
        let (x, w) = (fs(&c["x"]), fs(&c["w"]));
        let mut acc = 0.0f32;
        for k in (0..x.len()).rev() {
            acc += x[k] * w[k];
        }
        mismatch("dot reversed", &[acc], &[f(&c["out"])]).is_some()
    });
    assert!(caught, "no dot vector distinguishes the summation order");
}
