//! Per-tensor statistics for `--show`: what a person inspecting a dump looks at first.
//!
//! Floats: NaNs are counted and excluded from everything else; infinities count in min, max
//! and max |x| (an overflow must show there) but not in the mean, which is over the finite
//! elements (one infinity would make it ±inf or NaN and hide the rest; `inf` counts them).
//! Integers (and bool, as 0/1): exact min and max, the mean; no max |x|, no NaN or Inf.

use rayon::prelude::*;
use serde::{Serialize, Serializer};
use tracegate_trace::{DType, TensorInfo, Trace};

use crate::numeric::{dispatch, Num, BF16K, F16K, F32K, F64K, I16K, I32K, I64K, I8K, U8K};
use crate::Real;

/// Elements per parallel work unit within one tensor; partial results are folded in index
/// order, so the mean does not depend on the thread count.
const CHUNK: usize = 1 << 16;

/// Tensors whose statistics are computed at once (in parallel) before they are written: the
/// listing streams, holding one batch, however many tensors the trace has.
const BATCH: usize = 1024;

/// A stored value: integers stay exact (an i64 does not fit an f64).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Scalar {
    Int(i64),
    Float(f64),
}

impl Serialize for Scalar {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match *self {
            Scalar::Int(v) => s.serialize_i64(v),
            Scalar::Float(v) => Real(v).serialize(s),
        }
    }
}

/// One tensor's statistics; null (None) when there is nothing to measure (no element, or
/// every element NaN; `max_abs` for integers).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct TensorStats {
    pub min: Option<Scalar>,
    pub max: Option<Scalar>,
    pub mean: Option<Real>,
    pub max_abs: Option<Real>,
    pub nan: u64,
    pub inf: u64,
}

#[derive(Clone, Copy)]
struct Acc {
    /// Elements that are not NaN.
    n: u64,
    finite: u64,
    nan: u64,
    inf: u64,
    lo: f64,
    hi: f64,
    max_abs: f64,
    sum: f64,
    ilo: i128,
    ihi: i128,
    isum: i128,
}

impl Acc {
    const EMPTY: Acc = Acc {
        n: 0,
        finite: 0,
        nan: 0,
        inf: 0,
        lo: f64::INFINITY,
        hi: f64::NEG_INFINITY,
        max_abs: 0.0,
        sum: 0.0,
        ilo: i128::MAX,
        ihi: i128::MIN,
        isum: 0,
    };

    fn merge(self, o: Acc) -> Acc {
        Acc {
            n: self.n + o.n,
            finite: self.finite + o.finite,
            nan: self.nan + o.nan,
            inf: self.inf + o.inf,
            lo: self.lo.min(o.lo),
            hi: self.hi.max(o.hi),
            max_abs: self.max_abs.max(o.max_abs),
            sum: self.sum + o.sum,
            ilo: self.ilo.min(o.ilo),
            ihi: self.ihi.max(o.ihi),
            isum: self.isum + o.isum,
        }
    }
}

fn chunk<K: Num>(data: &[u8]) -> Acc {
    let mut a = Acc::EMPTY;
    for e in data.chunks_exact(K::SIZE) {
        let bits = K::bits(e);
        if !K::FLOAT {
            // The exact value: i128 holds every stored integer and their sum.
            let v = K::ord(bits);
            (a.ilo, a.ihi, a.isum) = (a.ilo.min(v), a.ihi.max(v), a.isum + v);
            a.n += 1;
            continue;
        }
        if K::is_nan(bits) {
            a.nan += 1;
            continue;
        }
        let v = K::to_f64(bits);
        a.n += 1;
        (a.lo, a.hi, a.max_abs) = (a.lo.min(v), a.hi.max(v), a.max_abs.max(v.abs()));
        if K::is_inf(bits) {
            a.inf += 1;
        } else {
            a.finite += 1;
            a.sum += v;
        }
    }
    a
}

fn stats_of<K: Num>(data: &[u8]) -> TensorStats {
    let parts: Vec<Acc> = data.par_chunks(CHUNK * K::SIZE).map(chunk::<K>).collect();
    let a = parts.into_iter().fold(Acc::EMPTY, Acc::merge);
    let some = a.n > 0;
    if K::FLOAT {
        TensorStats {
            min: some.then_some(Scalar::Float(a.lo)),
            max: some.then_some(Scalar::Float(a.hi)),
            mean: (a.finite > 0).then(|| Real(a.sum / a.finite as f64)),
            max_abs: some.then_some(Real(a.max_abs)),
            nan: a.nan,
            inf: a.inf,
        }
    } else {
        TensorStats {
            // Every integer dtype fits an i64.
            min: some.then_some(Scalar::Int(a.ilo as i64)),
            max: some.then_some(Scalar::Int(a.ihi as i64)),
            mean: some.then(|| Real(a.isum as f64 / a.n as f64)),
            max_abs: None,
            nan: 0,
            inf: 0,
        }
    }
}

/// Statistics of one payload of `dtype`, in one pass (parallel over chunks of a large tensor).
pub fn tensor_stats(dtype: DType, data: &[u8]) -> TensorStats {
    dispatch!(dtype, stats_of, data)
}

/// Calls `f` on each tensor of `infos` with its statistics, in order, computing [`BATCH`]
/// tensors at a time in parallel.
pub(crate) fn each_with_stats<'a, E>(
    t: &'a Trace,
    infos: impl Iterator<Item = &'a TensorInfo>,
    mut f: impl FnMut(&'a TensorInfo, TensorStats) -> Result<(), E>,
) -> Result<(), E> {
    let mut infos = infos.peekable();
    let mut batch: Vec<&TensorInfo> = Vec::with_capacity(BATCH);
    while infos.peek().is_some() {
        batch.clear();
        batch.extend(infos.by_ref().take(BATCH));
        let stats: Vec<TensorStats> = batch
            .par_iter()
            .map(|i| tensor_stats(i.dtype, t.data(i)))
            .collect();
        for (i, s) in batch.iter().zip(stats) {
            f(i, s)?;
        }
    }
    Ok(())
}
