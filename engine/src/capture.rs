//! What a forward pass records: tensors at the named capture points (default set, plus the
//! internals when asked) and decisions, in the order they were produced. A disabled capture
//! records nothing (generation steps and uncached re-runs). Under `--force-decisions` it also
//! records which decisions were forced and marks every tensor captured after the first of them.

use tracegate_trace::{Attributes, TraceWriter};

use crate::force::Record;
use crate::Result;

pub struct Tensor {
    pub name: String,
    pub shape: Vec<u64>,
    pub data: Vec<f32>,
    pub positions: Vec<i64>,
}

pub struct Decision {
    pub name: String,
    pub shape: Vec<u64>,
    pub values: Vec<i64>,
    pub margins: Option<Vec<f32>>,
}

pub struct Capture {
    on: bool,
    internals: bool,
    /// The `path` attribute: "prefill" for whole forwards, "layer" for the layer verb.
    path: &'static str,
    pub tensors: Vec<Tensor>,
    pub decisions: Vec<Decision>,
    /// The decisions taken from the forcing trace, in the order they were recorded.
    pub forced: Vec<Record>,
    /// How many tensors were captured before the first forced decision.
    first_forced: Option<usize>,
}

impl Capture {
    pub fn new(path: &'static str, internals: bool) -> Capture {
        Capture { on: true, internals, path, tensors: vec![], decisions: vec![], forced: vec![], first_forced: None }
    }
    pub fn off() -> Capture {
        Capture { on: false, internals: false, path: "", tensors: vec![], decisions: vec![], forced: vec![], first_forced: None }
    }
    pub fn internals(&self) -> bool {
        self.on && self.internals
    }

    /// A default-set capture point.
    pub fn tensor(&mut self, name: &str, shape: &[usize], data: &[f32], positions: &[i64]) {
        if self.on {
            self.tensors.push(Tensor {
                name: name.to_string(),
                shape: shape.iter().map(|&d| d as u64).collect(),
                data: data.to_vec(),
                positions: positions.to_vec(),
            });
        }
    }

    /// An internals-only capture point.
    pub fn internal(&mut self, name: &str, shape: &[usize], data: &[f32], positions: &[i64]) {
        if self.internals() {
            self.tensor(name, shape, data, positions);
        }
    }

    pub fn decision(&mut self, name: &str, shape: &[usize], values: Vec<i64>, margins: Option<Vec<f32>>) {
        if self.on {
            let shape = shape.iter().map(|&d| d as u64).collect();
            self.decisions.push(Decision { name: name.to_string(), shape, values, margins });
        }
    }

    /// Marks the decision just recorded as forced; `overridden`: rows where this producer would
    /// have chosen otherwise.
    pub fn forced(&mut self, name: &str, overridden: u64) {
        if self.on {
            self.first_forced.get_or_insert(self.tensors.len());
            self.forced.push(Record { name: name.to_string(), overridden });
        }
    }

    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// Write everything, in order, with `path`, `mask = causal` and `positions` attributes, and
    /// `forced = <digest>` (the forcing trace's) on every tensor captured after a forced decision.
    pub fn write(&self, w: &mut TraceWriter, forcing_digest: Option<&str>) -> Result<()> {
        for (i, t) in self.tensors.iter().enumerate() {
            let mut attrs = Attributes::default().with_path(self.path).with_mask("causal").with_positions(t.positions.clone());
            if let (Some(d), Some(first)) = (forcing_digest, self.first_forced) {
                if i >= first {
                    attrs.extra.insert("forced".into(), d.to_string());
                }
            }
            w.tensor_f32(&t.name, &t.shape, &t.data, &attrs)?;
        }
        for d in &self.decisions {
            w.decision(&d.name, &d.shape, &d.values, d.margins.as_deref())?;
        }
        Ok(())
    }
}
