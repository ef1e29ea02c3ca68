//! Builders for the seeded-failure suite: a small model-shaped trace written with the real
//! TraceWriter, which each test copies and plants one defect in.
#![allow(dead_code)]

pub mod plant;

use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use tracegate_diff::{compare_files, DecisionResult, Flip, Options, Policy, Report, TensorRow};
use tracegate_trace::{Attributes, DType, TraceWriter};

#[derive(Clone)]
pub struct T {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub bytes: Vec<u8>,
    pub attrs: Attributes,
}

#[derive(Clone)]
pub struct D {
    pub name: String,
    pub shape: Vec<u64>,
    pub values: Vec<i64>,
    pub margins: Option<Vec<f32>>,
}

#[derive(Clone)]
pub struct Spec {
    pub provenance: Value,
    pub tensors: Vec<T>,
    pub decisions: Vec<D>,
}

/// Deterministic, varied, non-zero-mean values.
pub fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n as u32)
        .map(|i| ((i.wrapping_mul(7919).wrapping_add(seed * 104729)) % 1000) as f32 / 250.0 - 1.7)
        .collect()
}

pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub fn t_f32(name: &str, shape: &[u64], v: &[f32]) -> T {
    T {
        name: name.into(),
        dtype: DType::F32,
        shape: shape.to_vec(),
        bytes: f32_bytes(v),
        attrs: rows_of(name, shape),
    }
}

pub fn t_raw(name: &str, dtype: DType, shape: &[u64], bytes: Vec<u8>) -> T {
    T {
        name: name.into(),
        dtype,
        shape: shape.to_vec(),
        bytes,
        attrs: rows_of(name, shape),
    }
}

/// [`prefill`]'s attributes with one position per row of the tensor's token axis (the writer
/// refuses another count): 0..rows, so a `[4, …]` tensor holds the prompt's positions 0..3.
pub fn rows_of(name: &str, shape: &[u64]) -> Attributes {
    let axis = tracegate_trace::names::token_axis(name).unwrap_or(0);
    match shape.get(axis) {
        Some(&rows) => prefill().with_positions((0..rows as i64).collect()),
        None => Attributes {
            positions: None,
            ..prefill()
        },
    }
}

pub fn prefill() -> Attributes {
    Attributes::default()
        .with_path("prefill")
        .with_mask("causal")
        .with_positions(vec![0, 1, 2, 3])
}

pub fn engine_provenance() -> Value {
    json!({"producer": "engine", "versions": {"tracegate": "0.1.0"}, "dtype": "f32", "device": "cpu",
           "weights_digest": "w-1234", "prompt_tokens": [1, 15, 27, 9]})
}

pub fn oracle_provenance() -> Value {
    json!({"producer": "oracle", "versions": {"torch": "2.5.1", "transformers": "4.47.0", "numpy": "2.1.3"},
           "dtype": "float32", "device": "cpu", "attn_implementation": "eager",
           "weights_digest": "w-1234", "prompt_tokens": [1, 15, 27, 9]})
}

/// 4 tokens, hidden 8, vocab 16, two layers, a router with 4 experts and top-2.
pub fn model() -> Spec {
    let mut tensors = vec![t_f32("embed.out", &[4, 8], &values(32, 1))];
    for l in 0..2 {
        let s = 10 * (l + 1);
        tensors.push(t_f32(
            &format!("layer.{l:02}.hidden_in"),
            &[4, 8],
            &values(32, s),
        ));
        tensors.push(t_f32(
            &format!("layer.{l:02}.attn_out"),
            &[4, 8],
            &values(32, s + 1),
        ));
        tensors.push(t_f32(
            &format!("layer.{l:02}.router.logits"),
            &[4, 4],
            &values(16, s + 2),
        ));
        tensors.push(t_f32(
            &format!("layer.{l:02}.mlp_out"),
            &[4, 8],
            &values(32, s + 3),
        ));
        tensors.push(t_f32(
            &format!("layer.{l:02}.hidden_out"),
            &[4, 8],
            &values(32, s + 4),
        ));
    }
    tensors.push(t_f32("final_norm.out", &[4, 8], &values(32, 90)));
    tensors.push(t_f32("logits", &[4, 16], &values(64, 91)));
    let decisions = vec![
        D {
            name: "layer.00.router.topk".into(),
            shape: vec![4, 2],
            values: vec![0, 3, 1, 2, 3, 0, 2, 1],
            margins: Some(vec![0.5, 0.25, 0.75, 1e-6]),
        },
        D {
            name: "layer.01.router.topk".into(),
            shape: vec![4, 2],
            values: vec![1, 0, 2, 3, 0, 1, 3, 2],
            margins: Some(vec![0.5, 0.5, 0.5, 0.5]),
        },
        D {
            name: "logits.argmax".into(),
            shape: vec![4],
            values: vec![5, 9, 2, 14],
            margins: Some(vec![1.5, 2.0, 1e-7, 0.75]),
        },
    ];
    let mut s = Spec {
        provenance: engine_provenance(),
        tensors,
        decisions,
    };
    s.decide();
    s
}

/// The model with scores crafted for the label tests: each router row and logits row gives a
/// known choice — layer 0's router `[0, 3] [1, 2] [3, 0] [2, 1]`, layer 1's `[1, 0] [2, 3]
/// [0, 1] [3, 2]`, `logits.argmax` `[5, 9, 2, 14]` with margins 1.5, 2, 0.5, 0.75 — and token 3's
/// layer-0 router row a near-tie: expert 0's logit `1e-6` below expert 1's, the runner-up.
/// Every decision is then taken from these scores ([`Spec::decide`]).
pub fn crafted() -> Spec {
    let mut m = model();
    m.craft();
    m
}

impl Spec {
    /// Sets the crafted scores of [`crafted`] (and takes every decision from them again).
    pub fn craft(&mut self) {
        let routers: [[[f32; 4]; 4]; 2] = [
            [
                [1.0, -0.5, -1.0, 0.5],
                [-0.5, 1.0, 0.5, -1.0],
                [0.5, -1.0, -0.5, 1.0],
                [0.3 - 1e-6, 0.3, 1.0, -1.0],
            ],
            [
                [0.5, 1.0, -0.5, -1.0],
                [-1.0, -0.5, 1.0, 0.5],
                [1.0, 0.5, -0.5, -1.0],
                [-1.0, -0.5, 0.5, 1.0],
            ],
        ];
        for (l, rows) in routers.iter().enumerate() {
            for (t, row) in rows.iter().enumerate() {
                for (e, &z) in row.iter().enumerate() {
                    self.set_f32(&format!("layer.{l:02}.router.logits"), 4 * t + e, z);
                }
            }
        }
        for (t, (a, m)) in [(5, 1.5f32), (9, 2.0), (2, 0.5), (14, 0.75)]
            .into_iter()
            .enumerate()
        {
            self.raise("logits", t, a, m);
        }
        self.decide();
    }

    /// Sets element `index` of row `row` of a `[rows, n]` f32 tensor to `by` above the largest
    /// other element of the row.
    pub fn raise(&mut self, name: &str, row: usize, index: usize, by: f32) {
        let width = self.tensors.iter().find(|t| t.name == name).unwrap().shape[1] as usize;
        let v = self.f32s(name);
        let top = (0..width)
            .filter(|&j| j != index)
            .map(|j| v[row * width + j])
            .fold(f32::NEG_INFINITY, f32::max);
        self.set_f32(name, row * width + index, top + by);
    }
}

/// Indices of `row` by descending value, ties to the lowest index (the tie rule everywhere).
pub fn ranked(row: &[f32]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..row.len()).collect();
    order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
    order
}

/// f32 softmax of one row, as a producer's router computes it (max subtracted, f64 exp rounded
/// once, ordered sum, divide).
pub fn softmax(row: &[f32]) -> Vec<f32> {
    let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f32> = row.iter().map(|&z| ((z - m) as f64).exp() as f32).collect();
    let sum = e.iter().fold(0f32, |a, &x| a + x);
    e.iter().map(|&x| x / sum).collect()
}

impl Spec {
    /// The f32 values of a tensor.
    pub fn f32s(&self, name: &str) -> Vec<f32> {
        let t = self
            .tensors
            .iter()
            .find(|t| t.name == name)
            .unwrap_or_else(|| panic!("no tensor {name}"));
        t.bytes
            .chunks(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    }

    /// Every decision this spec can take from its own tensors, taken as a producer takes it
    /// (docs/numerics.md §§10, 12): `layer.NN.router.topk` from the f32 softmax of
    /// `router.logits` (top-k, margin k-th minus (k+1)-th probability), `logits.argmax` and
    /// `decode.0000.argmax` (the last row) from `logits` (margin top-1 minus top-2). Decisions
    /// without their scores here (later decode steps) are left as they are.
    pub fn decide(&mut self) {
        let names: Vec<String> = self.decisions.iter().map(|d| d.name.clone()).collect();
        for name in names {
            let (source, router) = if let Some(l) = name.strip_suffix(".router.topk") {
                (format!("{l}.router.logits"), true)
            } else if name == "logits.argmax" || name == "decode.0000.argmax" {
                ("logits".to_string(), false)
            } else {
                continue;
            };
            if !self.tensors.iter().any(|t| t.name == source) {
                continue;
            }
            let shape = self
                .tensors
                .iter()
                .find(|t| t.name == source)
                .unwrap()
                .shape
                .clone();
            let width = shape[1] as usize;
            let all = self.f32s(&source);
            let mut rows: Vec<&[f32]> = all.chunks(width).collect();
            if name == "decode.0000.argmax" {
                rows = vec![rows[rows.len() - 1]];
            }
            let d = self.decision_mut(&name);
            let k = if router { d.shape[1] as usize } else { 1 };
            let (mut values, mut margins) = (Vec::new(), Vec::new());
            for row in rows {
                let scores = if router { softmax(row) } else { row.to_vec() };
                let order = ranked(&scores);
                values.extend(order[..k].iter().map(|&i| i as i64));
                margins.push(scores[order[k - 1]] - scores[order[k]]);
            }
            d.values = values;
            if d.margins.is_some() {
                d.margins = Some(margins);
            }
        }
    }

    pub fn tensor_mut(&mut self, name: &str) -> &mut T {
        self.tensors
            .iter_mut()
            .find(|t| t.name == name)
            .unwrap_or_else(|| panic!("no tensor {name}"))
    }
    pub fn decision_mut(&mut self, name: &str) -> &mut D {
        self.decisions
            .iter_mut()
            .find(|t| t.name == name)
            .unwrap_or_else(|| panic!("no decision {name}"))
    }
    /// Reads element `i` of an f32 tensor as bits, applies `f`, writes it back.
    pub fn poke_f32_bits(&mut self, name: &str, i: usize, f: impl Fn(u32) -> u32) {
        let t = self.tensor_mut(name);
        let b = &mut t.bytes[i * 4..i * 4 + 4];
        let v = f(u32::from_le_bytes(b.try_into().unwrap()));
        b.copy_from_slice(&v.to_le_bytes());
    }
    pub fn set_f32(&mut self, name: &str, i: usize, v: f32) {
        self.poke_f32_bits(name, i, |_| v.to_bits());
    }
    pub fn write(&self, path: &Path) -> PathBuf {
        let mut w = TraceWriter::create(path, self.provenance.clone()).unwrap();
        for t in &self.tensors {
            w.tensor(&t.name, t.dtype, &t.shape, &t.bytes, &t.attrs)
                .unwrap();
        }
        for d in &self.decisions {
            w.decision(&d.name, &d.shape, &d.values, d.margins.as_deref())
                .unwrap();
        }
        w.finish().unwrap();
        path.to_path_buf()
    }
}

/// Writes `reference` and `candidate` into a fresh temp dir as ref.trace / cand.trace.
pub fn pair(reference: &Spec, candidate: &Spec) -> (tempfile::TempDir, PathBuf, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let r = reference.write(&dir.path().join("ref.trace"));
    let c = candidate.write(&dir.path().join("cand.trace"));
    (dir, r, c)
}

/// Rewrites a trace's index JSON through `edit` and re-digests the footer, as a hostile or
/// older writer could: the file opens, and only `verify` (the content digest) can object.
pub fn rewrite_index(path: &Path, edit: impl FnOnce(&mut Value)) {
    let mut bytes = std::fs::read(path).unwrap();
    let footer = bytes.len() - 40;
    let offset = u64::from_le_bytes(bytes[footer..footer + 8].try_into().unwrap()) as usize;
    let mut index: Value = serde_json::from_slice(&bytes[offset..footer]).unwrap();
    edit(&mut index);
    let new_index = serde_json::to_vec(&index).unwrap();
    bytes.truncate(offset);
    bytes.extend_from_slice(&new_index);
    bytes.extend_from_slice(&(offset as u64).to_le_bytes());
    bytes.extend_from_slice(&(new_index.len() as u64).to_le_bytes());
    bytes.extend_from_slice(&xxhash_rust::xxh3::xxh3_128(&new_index).to_be_bytes());
    bytes.extend_from_slice(b"TGTREND\0");
    std::fs::write(path, bytes).unwrap();
}

// --- the JSON report's schema, checked by a real JSON Schema validator ----------------------

fn report_validator() -> &'static tracegate_schema_check::Schema {
    tracegate_schema_check::schema("diff-report.schema.json")
}

/// Every way `report` departs from docs/diff-report.schema.json, each "at /json/pointer: why".
pub fn report_schema_errors(report: &Value) -> Vec<String> {
    report_validator().errors(report)
}

/// Panics unless `report` is valid under docs/diff-report.schema.json. Every test that makes a
/// JSON report (the CLI's `--json`, or a library report through [`report_json`]) checks it here.
pub fn assert_valid_report(report: &Value) {
    let errors = report_schema_errors(report);
    assert!(
        errors.is_empty(),
        "the report does not match docs/diff-report.schema.json:\n{}\n{report:#}",
        errors.join("\n")
    );
}

/// A library report as `trace-diff --json` writes it (the same writer), checked against the schema.
pub fn report_json(rep: &tracegate_diff::Report) -> Value {
    let mut out = Vec::new();
    tracegate_diff::write_json(rep, &mut out).expect("writing to a Vec");
    let v: Value =
        serde_json::from_slice(&out).unwrap_or_else(|e| panic!("write_json wrote no JSON ({e})"));
    assert_valid_report(&v);
    v
}

/// `reference` against `candidate` as the library compares them, the report checked against the
/// JSON schema (every report these tests make matches it).
pub fn diff_with(reference: &Spec, candidate: &Spec, opts: &Options) -> Report {
    let (_dir, rp, cp) = pair(reference, candidate);
    let rep = compare_files(&rp, &cp, opts);
    report_json(&rep);
    rep
}

/// [`diff_with`] by bits (None) or under a policy.
pub fn diff(reference: &Spec, candidate: &Spec, policy: Option<Policy>) -> Report {
    diff_with(
        reference,
        candidate,
        &Options {
            policy,
            ..Options::default()
        },
    )
}

/// The shipped default policy, fixtures/policy/oracle-default.json.
pub fn oracle_policy() -> Policy {
    Policy::load(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/policy/oracle-default.json"),
    )
    .unwrap()
}

/// A `trace-diff` run: exit status and both streams.
pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

pub fn run(args: &[&str]) -> Run {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_trace-diff"))
        .args(args)
        .output()
        .unwrap();
    Run {
        code: out.status.code().unwrap(),
        stdout: String::from_utf8(out.stdout).unwrap(),
        stderr: String::from_utf8(out.stderr).unwrap(),
    }
}

pub fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// The model against an oracle-like candidate: small, spread differences everywhere after the
/// embedding, as a different summation order produces.
pub fn oracle_like_pair() -> (Spec, Spec) {
    let r = model();
    let mut c = model();
    c.provenance = oracle_provenance();
    let names: Vec<String> = c
        .tensors
        .iter()
        .map(|t| t.name.clone())
        .filter(|n| n != "embed.out")
        .collect();
    for n in names {
        let count = c.tensor_mut(&n).bytes.len() / 4;
        for i in (0..count).step_by(3) {
            c.poke_f32_bits(&n, i, |b| b ^ 1);
        }
    }
    (r, c)
}

/// Decision `name`'s result in a report.
pub fn decision_result<'a>(rep: &'a Report, name: &str) -> &'a DecisionResult {
    rep.decisions
        .results
        .iter()
        .find(|d| d.name == name)
        .unwrap_or_else(|| panic!("no decision {name} in the report"))
}

/// The flip at row `row` of decision `name` in a report.
pub fn flip_at<'a>(rep: &'a Report, name: &str, row: u64) -> &'a Flip {
    let res = decision_result(rep, name);
    res.flips
        .iter()
        .find(|f| f.row == row)
        .unwrap_or_else(|| panic!("{name} row {row} did not flip: {:?}", res.flips))
}

/// Tensor `name`'s row of a report's per-tensor table.
pub fn tensor_row<'a>(rep: &'a Report, name: &str) -> &'a TensorRow {
    rep.per_tensor
        .iter()
        .find(|t| t.tensor == name)
        .unwrap_or_else(|| panic!("no row {name}"))
}
