//! The canonical content encoding a trace's digest is taken over (docs/trace-format.md).

use sha2::{Digest as _, Sha256};

use crate::attrs::{AttrValue, Attributes};
use crate::digest::Digest;
use crate::dtype::DType;

/// Canonical content encoding, fed straight into sha256 (see docs/trace-format.md).
pub(crate) struct Canonical(Sha256);

impl Canonical {
    pub fn new(n_tensors: usize) -> Self {
        let mut c = Canonical(Sha256::new());
        c.str("tracegate-content-v1");
        c.u64(n_tensors as u64);
        c
    }
    fn u64(&mut self, v: u64) {
        self.0.update(v.to_le_bytes());
    }
    fn str(&mut self, s: &str) {
        self.u64(s.len() as u64);
        self.0.update(s.as_bytes());
    }
    fn shape(&mut self, shape: &[u64]) {
        self.u64(shape.len() as u64);
        for &d in shape {
            self.u64(d);
        }
    }
    pub fn tensor(
        &mut self,
        name: &str,
        dtype: DType,
        shape: &[u64],
        attrs: &Attributes,
        xxh3: u128,
    ) {
        self.str(name);
        self.str(dtype.name());
        self.shape(shape);
        let sorted = attrs.sorted();
        self.u64(sorted.len() as u64);
        for (key, value) in sorted {
            self.str(key);
            match value {
                AttrValue::Str(s) => {
                    self.0.update([1u8]);
                    self.str(s);
                }
                AttrValue::Int(i) => {
                    self.0.update([2u8]);
                    self.0.update(i.to_le_bytes());
                }
                AttrValue::Ints(list) => {
                    self.0.update([3u8]);
                    self.u64(list.len() as u64);
                    for i in list {
                        self.0.update(i.to_le_bytes());
                    }
                }
            }
        }
        self.0.update(xxh3.to_be_bytes());
    }
    pub fn begin_decisions(&mut self, n: usize) {
        self.u64(n as u64);
    }
    /// `values` and `margins` are the little-endian payload bytes as stored.
    pub fn decision(&mut self, name: &str, shape: &[u64], values: &[u8], margins: Option<&[u8]>) {
        self.str(name);
        self.shape(shape);
        self.u64((values.len() / 8) as u64);
        self.0.update(values);
        match margins {
            None => self.0.update([0u8]),
            Some(m) => {
                self.0.update([1u8]);
                self.u64((m.len() / 4) as u64);
                self.0.update(m);
            }
        }
    }
    pub fn finish(self) -> Digest {
        Digest(self.0.finalize().into())
    }
}
