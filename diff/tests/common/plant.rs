//! Planted orders and defects of a layer's projection, shared by diff/tests/explain*.rs and
//! gate/tests/capsule_explain.rs (which includes this file by path): the summation orders a
//! kernel may use, as `dot`s for the engine's `matmul_ref_by` (as the engine's own matmul tests
//! plant them), a layer point recomputed from a trace's captured input with one of them, and a
//! copy of a trace with one tensor replaced.

use std::path::{Path, PathBuf};

use tracegate_engine::ops::{dot, matmul_ref_by, rmsnorm_rows};
use tracegate_engine::weights::Store;
use tracegate_trace::{Trace, TraceWriter};

pub type Dot = fn(&[f32], &[f32]) -> f32;

pub fn split_k(x: &[f32], w: &[f32]) -> f32 {
    let h = x.len() / 2;
    dot(&x[..h], &w[..h]) + dot(&x[h..], &w[h..])
}

pub fn fma(x: &[f32], w: &[f32]) -> f32 {
    x.iter().zip(w).fold(0.0f32, |a, (&p, &q)| p.mul_add(q, a))
}

pub fn blocked16(x: &[f32], w: &[f32]) -> f32 {
    let mut acc = 0.0f32;
    for (xs, ws) in x.chunks(16).zip(w.chunks(16)) {
        acc += dot(xs, ws);
    }
    acc
}

/// The tensors `names` of `trace` added elementwise (`hidden_in ⊕ attn_out`: one rounding each).
pub fn summed(trace: &Path, names: &[String]) -> Vec<f32> {
    let t = Trace::open(trace).unwrap();
    let mut x = t.f32_vec(&names[0]).unwrap();
    for n in &names[1..] {
        let y = t.f32_vec(n).unwrap();
        x = x.iter().zip(&y).map(|(a, b)| a + b).collect();
    }
    x
}

/// A projection of a layer norm's output: the weights' layer prefix (`model.layers.1`), the
/// norm, its epsilon and form, the matrix, whether it has a bias, and a planted scale of its
/// rows (1.0: none).
pub struct Projection<'a> {
    pub layer: &'a str,
    pub norm: &'a str,
    pub eps: f32,
    pub zero_centred: bool,
    pub matrix: &'a str,
    pub bias: bool,
    pub scale: f32,
}

impl Projection<'_> {
    /// The projection of the rows `x` from `store`'s weights: the norm by the engine's §6
    /// RMSNorm, the matmul under `dot`.
    pub fn of(&self, x: &[f32], store: &Store, dot: Dot) -> Vec<f32> {
        let (pre, scale) = (self.layer, self.scale);
        let nname = format!("{pre}.{}.weight", self.norm);
        let h = store.shape(&nname).unwrap()[0] as usize;
        let nw = store.take(&nname, &[h]).unwrap().to_vec();
        let xn = rmsnorm_rows(x, &nw, self.eps, self.zero_centred);
        let wname = format!("{pre}.{}.weight", self.matrix);
        let n = store.shape(&wname).unwrap()[0] as usize;
        let w = store.take(&wname, &[n, h]).unwrap();
        let b = self.bias.then(|| {
            store
                .take(&format!("{pre}.{}.bias", self.matrix), &[n])
                .unwrap()
                .to_vec()
        });
        let scaled = move |a: &[f32], c: &[f32]| {
            let c: Vec<f32> = c.iter().map(|v| v * scale).collect();
            dot(a, &c)
        };
        matmul_ref_by(&xn, x.len() / h, w, b.as_deref(), scaled)
    }
}

/// A copy of `from` with tensor `name` replaced by `values` (f32, same shape), or left out.
pub fn copy_with(from: &Path, to: &Path, name: &str, values: Option<&[f32]>) -> PathBuf {
    let t = Trace::open(from).unwrap();
    let mut w = TraceWriter::create(to, t.provenance().clone()).unwrap();
    for info in t.tensors() {
        if info.name != name {
            w.tensor(
                &info.name,
                info.dtype,
                &info.shape,
                t.data(info),
                &info.attributes,
            )
            .unwrap();
        } else if let Some(v) = values {
            w.tensor_f32(&info.name, &info.shape, v, &info.attributes)
                .unwrap();
        }
    }
    for d in t.decisions() {
        let m = t.decision_margins(d);
        w.decision(&d.name, &d.shape, &t.decision_values(d), m.as_deref())
            .unwrap();
    }
    w.finish().unwrap();
    to.to_path_buf()
}
