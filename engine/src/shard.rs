//! docs/numerics.md §23: a sharded run (`--shards tp=W|ep=W`). W ranks, threads of this process,
//! each holding only its block of the weights (§23.2, `model` loads a rank's slices), exchange
//! values through one collective, the ordered carry (§23.3): rank 0 starts the accumulator at
//! +0.0 and adds its terms, hands it to rank 1, …; rank W−1's accumulator is the result, which
//! every rank then reads. A gather (the head's vocabulary blocks) is the same hand-over with
//! copies instead of additions.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};

use rayon::prelude::*;
use tracegate_trace::{Shard, ShardKind};

use crate::matmul::layout::Mat;
use crate::{err, ops, Result};

/// How the weights are split (§23.2): the two differ only in the routed experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// Tensor parallel: every expert's MLP split by columns like the dense MLP.
    Tp,
    /// Expert parallel: each rank holds its block of `num_experts` whole.
    Ep,
}

/// `--shards tp=W|ep=W`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shards {
    pub split: Split,
    pub world: usize,
    /// A planted sharding defect (negative controls of the tests; no command-line spelling).
    #[doc(hidden)]
    pub plant: Option<Plant>,
}

/// Planted sharding defects, each one a test must catch (engine/tests/shard.rs).
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Plant {
    /// This rank adds its terms to the carry but, in a cached decode step only, takes its own
    /// partial (its terms from +0.0, plus the bias if it is the last rank) as the result.
    SkipCarryInDecode { rank: usize },
    /// This rank records its slices at offset 0 instead of its block's.
    SliceAtZero { rank: usize },
    /// ep: this rank also computes, records and adds the expert just below its block.
    ExpertTwice { rank: usize },
    /// ep: this rank leaves the last expert of its block out (computed by no rank).
    ExpertNone { rank: usize },
    /// Every sum over ranks as a real all-reduce: each rank's partial from +0.0, then
    /// `((p0 + p1) + …)`, then the bias.
    Partials,
}

impl Shards {
    /// Parses `tp=W` or `ep=W` (W ≥ 1).
    pub fn parse(s: &str) -> Result<Shards> {
        let bad = || err!(Input: "--shards {s:?}: expected tp=N or ep=N (N ranks, N ≥ 1)");
        let (kind, n) = s.split_once('=').ok_or_else(bad)?;
        let split = match kind {
            "tp" => Split::Tp,
            "ep" => Split::Ep,
            _ => return Err(bad()),
        };
        if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        let world: usize = n.parse().map_err(|_| bad())?;
        if world == 0 {
            return Err(err!(Input: "--shards {s}: 0 ranks; a sharded run needs at least 1"));
        }
        Ok(Shards {
            split,
            world,
            plant: None,
        })
    }
}

impl std::fmt::Display for Shards {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.split {
            Split::Tp => "tp",
            Split::Ep => "ep",
        };
        write!(f, "{kind}={}", self.world)
    }
}

/// §23.1 rank `rank`'s block of a length `n` split over `world` ranks.
pub fn block(n: usize, rank: usize, world: usize) -> Range<usize> {
    n * rank / world..n * (rank + 1) / world
}

/// The hand-over between the ranks' threads. Turn `k·(W+1) + ρ` of the k-th collective is rank
/// ρ's; turn `k·(W+1) + W` ends when every rank has read the result (so the next collective's
/// rank 0 cannot overwrite it first). A rank that stops (an error, a panic) aborts it: every
/// wait then returns at once, so no rank is left blocked.
pub struct Collective {
    world: usize,
    state: Mutex<State>,
    moved: Condvar,
}

struct State {
    acc: Vec<f32>,
    turns: u64,
    readers: usize,
    aborted: bool,
}

impl Collective {
    pub fn new(world: usize) -> Collective {
        Collective {
            world,
            state: Mutex::new(State {
                acc: Vec::new(),
                turns: 0,
                readers: 0,
                aborted: false,
            }),
            moved: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wakes every waiting rank for good (a rank stopped early).
    pub fn abort(&self) {
        self.lock().aborted = true;
        self.moved.notify_all();
    }

    pub fn aborted(&self) -> bool {
        self.lock().aborted
    }

    fn wait_for(&self, turn: u64) -> Option<MutexGuard<'_, State>> {
        let mut s = self.lock();
        while s.turns < turn && !s.aborted {
            s = self.moved.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        (!s.aborted).then_some(s)
    }

    /// Collective number `k`, rank `rank`'s part: `turn` on the accumulator (`len` values, made
    /// +0.0 by rank 0), then the result once every rank has had its turn. Aborted: zeros.
    fn run(&self, k: u64, rank: usize, len: usize, turn: impl FnOnce(&mut Vec<f32>)) -> Vec<f32> {
        let w = self.world as u64;
        let base = k * (w + 1);
        let Some(mut s) = self.wait_for(base + rank as u64) else {
            return vec![0.0; len];
        };
        if rank == 0 {
            s.acc = vec![0.0; len];
        }
        turn(&mut s.acc);
        s.turns += 1;
        drop(s);
        self.moved.notify_all();
        let Some(mut s) = self.wait_for(base + w) else {
            return vec![0.0; len];
        };
        let out = s.acc.clone();
        s.readers += 1;
        if s.readers == self.world {
            s.readers = 0;
            s.turns += 1;
            drop(s);
            self.moved.notify_all();
        }
        out
    }
}

/// One rank of a sharded run: which block it is and its end of the collective.
pub struct Comm {
    pub split: Split,
    pub rank: usize,
    pub world: usize,
    plant: Option<Plant>,
    collective: std::sync::Arc<Collective>,
    /// Collectives this rank has taken part in (every rank calls them in the same order).
    count: AtomicU64,
    /// The forward running is a cached decode step (`Plant::SkipCarryInDecode`).
    decoding: AtomicBool,
}

impl Comm {
    pub fn new(s: &Shards, rank: usize, collective: std::sync::Arc<Collective>) -> Comm {
        Comm {
            split: s.split,
            rank,
            world: s.world,
            plant: s.plant,
            collective,
            count: AtomicU64::new(0),
            decoding: AtomicBool::new(false),
        }
    }

    /// §23.1 this rank's block of `n`.
    pub fn block(&self, n: usize) -> Range<usize> {
        block(n, self.rank, self.world)
    }

    /// The experts this rank computes (all under `tp`, its block under `ep`), with the planted
    /// defects (c).
    pub fn experts(&self, n: usize) -> Range<usize> {
        if self.split == Split::Tp {
            return 0..n;
        }
        let b = self.block(n);
        match self.plant {
            Some(Plant::ExpertTwice { rank }) if rank == self.rank && b.start > 0 => {
                b.start - 1..b.end
            }
            Some(Plant::ExpertNone { rank }) if rank == self.rank => b.start..b.end - 1,
            _ => b,
        }
    }

    pub(crate) fn set_decoding(&self, on: bool) {
        self.decoding.store(on, Ordering::Relaxed);
    }

    /// The `shard` attribute of a tensor this rank records: `kind`, or replicated.
    pub fn shard(&self, kind: Option<ShardKind>) -> Shard {
        Shard::new(
            self.rank as u64,
            self.world as u64,
            kind.unwrap_or(ShardKind::Replicated),
        )
    }

    /// The slice `block` of a logical axis `axis` of length `size` (planted: at offset 0).
    pub fn slice(&self, axis: usize, block: Range<usize>, size: usize) -> ShardKind {
        let at_zero = self.plant == Some(Plant::SliceAtZero { rank: self.rank });
        ShardKind::Slice {
            axis,
            offset: if at_zero { 0 } else { block.start as u64 },
            length: block.len() as u64,
            size: size as u64,
        }
    }

    /// `layer.NN.expert.EEE.out`'s kind: under `ep` the experts this rank holds, of `n` (its
    /// block, and an expert `Plant::ExpertTwice` adds).
    pub fn expert_kind(&self, n: usize) -> Option<ShardKind> {
        let (b, e) = (self.block(n), self.experts(n));
        (self.split == Split::Ep).then(|| ShardKind::Experts {
            held: (b.start.min(e.start)..b.end).map(|e| e as u64).collect(),
            of: n as u64,
        })
    }

    fn next(&self) -> u64 {
        self.count.fetch_add(1, Ordering::Relaxed)
    }

    /// §23.3 the ordered carry of a sum whose terms are spread over the ranks: `add` adds this
    /// rank's terms, in §2's / §10's order, to the accumulator (`len` values); the last rank then
    /// applies `finish` (a bias, added once after the whole accumulation). Returns the result,
    /// the same on every rank.
    pub fn carry(
        &self,
        len: usize,
        add: impl Fn(&mut [f32]) + Sync,
        finish: impl Fn(&mut [f32]),
    ) -> Vec<f32> {
        let k = self.next();
        let last = self.rank + 1 == self.world;
        let own = || {
            let mut p = vec![0.0f32; len];
            add(&mut p);
            p
        };
        match self.plant {
            Some(Plant::Partials) => {
                // (d) the real all-reduce: this rank's partial from +0.0, added to the others'.
                let p = own();
                let rank = self.rank;
                self.collective.run(k, rank, len, |acc| {
                    if rank == 0 {
                        acc.copy_from_slice(&p);
                    } else {
                        acc.iter_mut().zip(&p).for_each(|(a, b)| *a += b);
                    }
                    if last {
                        finish(acc);
                    }
                })
            }
            Some(Plant::SkipCarryInDecode { rank })
                if rank == self.rank && self.decoding.load(Ordering::Relaxed) =>
            {
                let _ = self.collective.run(k, self.rank, len, |acc| {
                    add(acc);
                    if last {
                        finish(acc);
                    }
                });
                // (a) its own partial taken as the result.
                let mut p = own();
                if last {
                    finish(&mut p);
                }
                p
            }
            _ => self.collective.run(k, self.rank, len, |acc| {
                add(acc);
                if last {
                    finish(acc);
                }
            }),
        }
    }

    /// §23.3 a row-parallel projection: `y = x·Wᵀ (+ b)` where this rank holds columns of W
    /// (`w` `[N, K_ρ]`) and the matching columns of x (`[rows, K_ρ]`). Each `y[r,o]` is §2's dot
    /// continued rank after rank; the bias is added once, by the last rank, after the whole
    /// accumulation.
    pub fn row_parallel(&self, x: &[f32], rows: usize, w: Mat, bias: Option<&[f32]>) -> Vec<f32> {
        let (n, kl) = (w.rows, w.cols);
        let mut wf = vec![0.0f32; n * kl];
        for (o, row) in wf.chunks_exact_mut(kl.max(1)).enumerate().take(n) {
            w.widen_row(o, 0, row);
        }
        self.carry(
            rows * n,
            |acc| {
                acc.par_chunks_mut(n.max(1))
                    .enumerate()
                    .for_each(|(r, yr)| {
                        let xr = &x[r * kl..(r + 1) * kl];
                        for (o, y) in yr.iter_mut().enumerate() {
                            *y = ops::dot_from(*y, xr, &wf[o * kl..(o + 1) * kl]);
                        }
                    })
            },
            |acc| {
                if let Some(b) = bias {
                    for yr in acc.chunks_exact_mut(n.max(1)) {
                        yr.iter_mut().zip(b).for_each(|(y, bb)| *y += bb);
                    }
                }
            },
        )
    }

    /// §23.3 the head's gather: this rank's columns `cols` of a `[rows, n]` result (`part`,
    /// `[rows, cols.len()]`) copied into place; every rank gets the whole. No arithmetic.
    pub fn gather(&self, part: &[f32], rows: usize, n: usize, cols: Range<usize>) -> Vec<f32> {
        let k = self.next();
        let c = cols.len();
        self.collective.run(k, self.rank, rows * n, |acc| {
            for r in 0..rows {
                acc[r * n + cols.start..r * n + cols.end]
                    .copy_from_slice(&part[r * c..(r + 1) * c]);
            }
        })
    }
}

/// Whether a sharded run of this family and these sizes is allowed (§23.1, §23.5): refusals name
/// the numbers.
pub fn check(s: &Shards, cfg: &crate::config::Config, model_type: &str) -> Result<()> {
    let w = s.world;
    if (0..cfg.num_hidden_layers).any(|l| cfg.layer_kind(l) == crate::config::LayerKind::Linear) {
        return Err(err!(Input:
            "--shards {s}: {model_type} has linear-attention layers (§18), which are not sharded (docs/numerics.md §23.5)"
        ));
    }
    let (nq, nkv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
    if !nq.is_multiple_of(w) || !nkv.is_multiple_of(w) {
        return Err(err!(Input:
            "--shards {s}: {w} ranks must divide both num_attention_heads {nq} and num_key_value_heads {nkv} (docs/numerics.md §23.1)"
        ));
    }
    if s.split == Split::Ep {
        let sparse = (0..cfg.num_hidden_layers).any(|l| cfg.is_sparse(l));
        if !sparse {
            return Err(err!(Input:
                "--shards {s}: {model_type} has no routed experts to split (ep=N needs a MoE model; tp=N splits the rest)"
            ));
        }
        if !cfg.num_experts.is_multiple_of(w) {
            return Err(err!(Input:
                "--shards {s}: {w} ranks must divide num_experts {} (docs/numerics.md §23.5)",
                cfg.num_experts
            ));
        }
    }
    Ok(())
}

/// `--out` of a sharded run: must hold `{rank}` (and a run without `--shards` must not).
pub fn rank_path(out: &std::path::Path, rank: usize) -> std::path::PathBuf {
    out.to_string_lossy()
        .replace("{rank}", &rank.to_string())
        .into()
}
