//! The orders a real kernel sums in (docs/diff.md, "Explaining a difference"): a dot product's
//! accumulation order, with or without fused multiply–add, its inputs rounded to bf16/f16 or
//! not; and the RMSNorm variants built on the same sums. Each is written out once here, in
//! f32 with every operation rounded (Rust never contracts `a * b + c`), so what an order
//! computes is exactly its name.

use half::{bf16, f16};

/// How the terms of a sum are grouped. Every partial sum starts at +0.0; partials are added
/// in ascending order of their first index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sum {
    /// docs/numerics.md §2/§3: one accumulator, k ascending.
    Sequential,
    /// A binary tree: a range is split at its midpoint (len / 2), each half summed so, the two
    /// added; a single term is itself.
    Pairwise,
    /// Consecutive blocks of B terms, each summed sequentially from +0.0, the block sums added
    /// to one accumulator in order (a K-tiled kernel that reduces each tile apart).
    Blocked(usize),
    /// W interleaved accumulators (SIMD lanes): lane l sums the terms k ≡ l (mod W) in order;
    /// then lanes are folded in halves (lane i ⊕ lane i + W/2, W halving) down to one.
    Lanes(usize),
    /// S contiguous parts of ceil(K / S) terms (the last one shorter), each summed from +0.0,
    /// then added in order: split-K.
    Split(usize),
    /// Two parts split where a kernel's K-steps allow: the first ends at K/2 rounded down to a
    /// multiple of A (none when that is 0), each summed from +0.0, then added.
    SplitAligned(usize),
    /// Products and sum in binary64 (every f32 product is exact there), rounded to f32 once.
    Wide,
}

impl Sum {
    /// Every grouping tried, simplest first.
    pub const ALL: [Sum; 20] = [
        Sum::Sequential,
        Sum::Pairwise,
        Sum::Blocked(4),
        Sum::Blocked(8),
        Sum::Blocked(16),
        Sum::Blocked(32),
        Sum::Blocked(64),
        Sum::Blocked(128),
        Sum::Blocked(256),
        Sum::Lanes(4),
        Sum::Lanes(8),
        Sum::Lanes(16),
        Sum::Lanes(32),
        Sum::Split(2),
        Sum::Split(4),
        Sum::SplitAligned(8),
        Sum::SplitAligned(16),
        Sum::SplitAligned(32),
        Sum::SplitAligned(64),
        Sum::Wide,
    ];

    /// Whether a fused multiply–add changes it (a tree adds products, binary64 holds them
    /// exactly: no FMA variant).
    fn fusable(self) -> bool {
        !matches!(self, Sum::Pairwise | Sum::Wide)
    }

    pub fn name(self) -> String {
        match self {
            Sum::Sequential => "sequential (§2)".into(),
            Sum::Pairwise => "pairwise".into(),
            Sum::Blocked(b) => format!("blocked-K {b}"),
            Sum::Lanes(w) => format!("{w} lanes"),
            Sum::Split(s) => format!("split-K {s}"),
            Sum::SplitAligned(a) => format!("split-K 2 at a multiple of {a}"),
            Sum::Wide => "f64 accumulation".into(),
        }
    }
}

/// What the products' inputs are rounded to before the multiply (to nearest even; a bf16/f16
/// kernel accumulating in f32). f32 inputs are used as they are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Inputs {
    F32,
    Bf16,
    F16,
}

impl Inputs {
    fn round(self, v: &[f32]) -> Vec<f32> {
        match self {
            Inputs::F32 => v.to_vec(),
            Inputs::Bf16 => v.iter().map(|&x| bf16::from_f32(x).to_f32()).collect(),
            Inputs::F16 => v.iter().map(|&x| f16::from_f32(x).to_f32()).collect(),
        }
    }
}

/// One dot-product order: grouping, fused or not, inputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Order {
    pub sum: Sum,
    pub fma: bool,
    pub inputs: Inputs,
}

impl Order {
    /// Every order a matmul's output is tried under: each grouping, with and without FMA where
    /// it matters, on f32 inputs, then on inputs rounded to bf16 and to f16.
    pub fn all() -> Vec<Order> {
        let mut v = Vec::new();
        for inputs in [Inputs::F32, Inputs::Bf16, Inputs::F16] {
            for sum in Sum::ALL {
                v.push(Order {
                    sum,
                    fma: false,
                    inputs,
                });
                if sum.fusable() {
                    v.push(Order {
                        sum,
                        fma: true,
                        inputs,
                    });
                }
            }
        }
        v
    }

    /// The order as the report names it, e.g. "blocked-K 64 with FMA, bf16 inputs".
    pub fn name(&self) -> String {
        let mut s = self.sum.name();
        if self.fma {
            s.push_str(" with FMA");
        }
        match self.inputs {
            Inputs::F32 => {}
            Inputs::Bf16 => s.push_str(", inputs rounded to bf16"),
            Inputs::F16 => s.push_str(", inputs rounded to f16"),
        }
        s
    }

    /// `dot(x, w)` in this order.
    pub fn dot(&self, x: &[f32], w: &[f32]) -> f32 {
        match self.inputs {
            Inputs::F32 => sum(self.sum, self.fma, x, w),
            i => sum(self.sum, self.fma, &i.round(x), &i.round(w)),
        }
    }
}

/// `x[k] ⊗ w[k]` summed over k as `how` groups them; `fma`: each accumulator step one fused
/// `acc + x·w` (one rounding) instead of `acc ⊕ (x ⊗ w)`.
pub fn sum(how: Sum, fma: bool, x: &[f32], w: &[f32]) -> f32 {
    let k = x.len().min(w.len());
    let chain = |idx: &mut dyn Iterator<Item = usize>| {
        let mut acc = 0.0f32;
        for i in idx {
            acc = if fma {
                x[i].mul_add(w[i], acc)
            } else {
                acc + x[i] * w[i]
            };
        }
        acc
    };
    match how {
        Sum::Sequential => chain(&mut (0..k)),
        Sum::Pairwise => pairwise(x, w, 0, k),
        Sum::Blocked(b) => {
            let mut acc = 0.0f32;
            for s in (0..k).step_by(b) {
                acc += chain(&mut (s..(s + b).min(k)));
            }
            acc
        }
        Sum::Split(parts) => {
            let c = k.div_ceil(parts).max(1);
            let mut acc = 0.0f32;
            for s in (0..k).step_by(c) {
                acc += chain(&mut (s..(s + c).min(k)));
            }
            acc
        }
        Sum::SplitAligned(a) => {
            let at = k / 2 / a * a;
            chain(&mut (0..at)) + chain(&mut (at..k))
        }
        Sum::Lanes(width) => {
            let mut lanes: Vec<f32> = (0..width)
                .map(|l| chain(&mut (l..k).step_by(width)))
                .collect();
            let mut n = width;
            while n > 1 {
                n /= 2;
                for i in 0..n {
                    lanes[i] += lanes[i + n];
                }
            }
            lanes[0]
        }
        Sum::Wide => {
            let mut acc = 0.0f64;
            for i in 0..k {
                acc += x[i] as f64 * w[i] as f64;
            }
            acc as f32
        }
    }
}

fn pairwise(x: &[f32], w: &[f32], lo: usize, hi: usize) -> f32 {
    match hi - lo {
        0 => 0.0,
        1 => x[lo] * w[lo],
        n => {
            let mid = lo + n / 2;
            pairwise(x, w, lo, mid) + pairwise(x, w, mid, hi)
        }
    }
}

/// How an RMSNorm's mean of squares becomes the mean.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mean {
    /// §6: `ss ⊘ f32(n)`.
    Divide,
    /// `ss ⊗ f32(1/n)`.
    Reciprocal,
}

/// How `inv = 1/√(mean ⊕ eps)` is rounded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Inv {
    /// §6: `1 ⊘ sqrt_f32(t)`, two roundings.
    Divide,
    /// A correctly rounded reciprocal square root: `f32(1/√t)` computed in binary64, one rounding.
    Rsqrt,
}

/// In which order an element meets `inv` and its weight factor `u` (`w`, or `1 ⊕ w` for a
/// zero-centred norm).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scale {
    /// §6 / §15.1: `(x ⊗ inv) ⊗ u`.
    NormFirst,
    /// `(x ⊗ u) ⊗ inv`.
    WeightFirst,
    /// `x ⊗ (inv ⊗ u)`.
    FactorFirst,
}

/// One RMSNorm order: the sum of squares (a [`Sum`], fused or not; inputs as they are), the
/// mean, the reciprocal root, the scaling.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NormOrder {
    pub ss: Sum,
    pub fma: bool,
    pub mean: Mean,
    pub inv: Inv,
    pub scale: Scale,
}

impl NormOrder {
    /// Every variant tried, §6's first.
    pub fn all() -> Vec<NormOrder> {
        let mut v = Vec::new();
        for ss in Sum::ALL {
            for fma in [false, true] {
                if fma && !ss.fusable() {
                    continue;
                }
                for inv in [Inv::Divide, Inv::Rsqrt] {
                    for mean in [Mean::Divide, Mean::Reciprocal] {
                        for scale in [Scale::NormFirst, Scale::WeightFirst, Scale::FactorFirst] {
                            v.push(NormOrder {
                                ss,
                                fma,
                                mean,
                                inv,
                                scale,
                            });
                        }
                    }
                }
            }
        }
        v
    }

    pub fn name(&self) -> String {
        let mut s = format!("sum of squares {}", self.ss.name());
        if self.fma {
            s.push_str(" with FMA");
        }
        if self.mean == Mean::Reciprocal {
            s.push_str(", mean as ss·(1/n)");
        }
        if self.inv == Inv::Rsqrt {
            s.push_str(", rsqrt rounded once");
        }
        match self.scale {
            Scale::NormFirst => {}
            Scale::WeightFirst => s.push_str(", (x·w)·inv"),
            Scale::FactorFirst => s.push_str(", x·(inv·w)"),
        }
        s
    }

    /// `inv` of one row `x` with epsilon `eps` (already f32, §6).
    pub fn inv(&self, x: &[f32], eps: f32) -> f32 {
        let ss = sum(self.ss, self.fma, x, x);
        let n = x.len() as f32;
        let mean = match self.mean {
            Mean::Divide => ss / n,
            Mean::Reciprocal => ss * (1.0 / x.len() as f64) as f32,
        };
        let t = mean + eps;
        match self.inv {
            Inv::Divide => 1.0f32 / t.sqrt(),
            Inv::Rsqrt => (1.0 / (t as f64).sqrt()) as f32,
        }
    }

    /// One element: `x` scaled by `inv` and the weight factor `u`.
    pub fn element(&self, x: f32, inv: f32, u: f32) -> f32 {
        match self.scale {
            Scale::NormFirst => (x * inv) * u,
            Scale::WeightFirst => (x * u) * inv,
            Scale::FactorFirst => x * (inv * u),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values whose sums round differently by grouping: large and small terms interleaved.
    fn data(k: usize) -> (Vec<f32>, Vec<f32>) {
        let x = (0..k)
            .map(|i| ((i * 7919 % 1000) as f32 / 77.0 - 6.3) * if i % 5 == 0 { 1e3 } else { 1.0 })
            .collect();
        let w = (0..k)
            .map(|i| (i * 104729 % 997) as f32 / 331.0 - 1.4)
            .collect();
        (x, w)
    }

    #[test]
    fn sequential_is_numerics_section_2() {
        let (x, w) = data(300);
        let mut acc = 0.0f32;
        for i in 0..300 {
            acc += x[i] * w[i];
        }
        assert_eq!(sum(Sum::Sequential, false, &x, &w).to_bits(), acc.to_bits());
    }

    #[test]
    fn groupings_written_out_by_hand() {
        let x = [1.0f32, 2.0, 3.0, 4.0, 5.0];
        let w = [1.0f32; 5];
        // Exact integers: every order gives 15; the groups are checked on rounding data below.
        for s in Sum::ALL {
            assert_eq!(sum(s, false, &x, &w), 15.0, "{s:?}");
        }
        // 1 + 1 + 1e8 − 1e8: 2 + 1e8 rounds to 1e8 (f32 steps of 8 there), so the ones survive
        // only where they meet each other first.
        let w = [1.0f32; 4];
        let x = [1.0f32, 1.0, 1e8, -1e8];
        assert_eq!(sum(Sum::Sequential, false, &x, &w), 0.0); // (2 + 1e8) rounds to 1e8
        assert_eq!(sum(Sum::Split(2), false, &x, &w), 2.0); // 2 + 0
        assert_eq!(sum(Sum::Pairwise, false, &x, &w), 2.0);
        assert_eq!(sum(Sum::Blocked(2), false, &x, &w), 2.0);
        assert_eq!(sum(Sum::Lanes(2), false, &x, &w), 0.0); // (1 + 1e8) + (1 - 1e8)
                                                            // K = 6: split-K 2 cuts at 3, the aligned split at 3 rounded down to a multiple of 2.
        let w = [1.0f32; 6];
        let x = [1.0f32, 1.0, 1e8, -1e8, 1.0, 1.0];
        assert_eq!(sum(Sum::Sequential, false, &x, &w), 2.0); // the ones before 1e8 are lost
        assert_eq!(sum(Sum::Split(2), false, &x, &w), 0.0); // 1e8 + (-1e8): all ones lost
        assert_eq!(sum(Sum::SplitAligned(2), false, &x, &w), 4.0); // 2 + (0 + 1 + 1)
        assert_eq!(sum(Sum::SplitAligned(4), false, &x, &w), 2.0); // 3/4*4 = 0: one chain
    }

    #[test]
    fn each_variant_is_another_rounding() {
        // On some of ten vectors (one final rounding can land on the same bits by chance),
        // every variant but the sequential one gives other bits than §2: none is §2 renamed.
        // Blocks of 256 and more are sequential for K < 256: K = 300 here.
        let vectors: Vec<(Vec<f32>, Vec<f32>)> = (0..10)
            .map(|s| {
                let (x, w) = data(300 + s);
                (x[s..].to_vec(), w[s..].to_vec())
            })
            .collect();
        let plain: Vec<u32> = vectors
            .iter()
            .map(|(x, w)| sum(Sum::Sequential, false, x, w).to_bits())
            .collect();
        for o in Order::all().into_iter().skip(1) {
            let differs = vectors
                .iter()
                .zip(&plain)
                .any(|((x, w), &p)| o.dot(x, w).to_bits() != p);
            assert!(differs, "{} is §2 on ten vectors", o.name());
        }
    }
}
