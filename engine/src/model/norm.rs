//! §6 RMSNorm weights, and §15.1's zero-centred form where the family's norms are.

use crate::config::Config;
use crate::ops;
use crate::weights::Store;
use crate::Result;

/// An RMSNorm weight: §6's plain scale, or §15.1's zero-centred `1 ⊕ w` (Qwen3.5).
pub(crate) struct Norm {
    pub w: Vec<f32>,
    pub zero_centred: bool,
}

impl Norm {
    /// The weight `name` (`[n]`), widened once; zero-centred where the family's norms are.
    pub fn load(st: &Store, cfg: &Config, name: &str, n: usize) -> Result<Norm> {
        Ok(Norm {
            w: st.take(name, &[n])?.to_vec(),
            zero_centred: cfg.model_type.zero_centred_norms(),
        })
    }
    pub fn rows(&self, x: &[f32], eps: f32) -> Vec<f32> {
        ops::rmsnorm_rows(x, &self.w, eps, self.zero_centred)
    }
    pub fn one(&self, x: &[f32], eps: f32, out: &mut [f32]) {
        match self.zero_centred {
            false => ops::rmsnorm(x, &self.w, eps, out),
            true => ops::rmsnorm_zero_centred(x, &self.w, eps, out),
        }
    }
}
