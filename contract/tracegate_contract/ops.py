"""The ordered fp32 kernels of docs/numerics.md, in numpy.

How the arithmetic is kept in the document's order:

* Every reduction is an explicit Python loop over the reduced index, ascending, whose body is
  one numpy ufunc call vectorised across the *other* axes (outputs, rows, heads). That is the
  "vectorise across outputs only" rule of §2: each output still sees exactly
  `acc = acc ⊕ (x[k] ⊗ w[k])`, k = 0, 1, ..., from +0.0.
* numpy's reducing routines (`sum`, `dot`, `matmul`/`@`, `einsum`, `mean`, `add.reduce`, ...)
  choose their own order (pairwise summation, BLAS blocking, FMA) and are never called;
  tests/test_no_reductions.py fails if the package uses one.
* A `*`, `+`, `-` or `/` between float32 arrays is a separate ufunc call, hence one IEEE-rounded
  f32 operation: numpy never fuses two ufunc calls into an FMA.
* Transcendentals (§4) go through Python's `math` module — the platform libm in binary64, the
  same routines the engine reaches through Rust's f64 methods — one element at a time, and are
  rounded to f32 once. numpy's own `np.exp/np.sin/np.cos` (own SIMD code) are not used.
* `np.max` is allowed: a maximum is exact whatever the order (§8.6).
"""

from __future__ import annotations

import math

import numpy as np

from .errors import ContractError

F32 = np.float32
F64 = np.float64


# --------------------------------------------------------------------------------------------
# Config numbers (§6; widening of stored weights, §1, is weights.widen)


def f32_of_config_number(value) -> np.float32:
    """A config number as §6 reads it: the JSON decimal parsed to binary64 (as every JSON
    reader and transformers do), then rounded to f32 once."""
    if isinstance(value, bool):
        raise TypeError("boolean is not a number")
    return F32(float(value))


# --------------------------------------------------------------------------------------------
# Transcendentals (§4): libm binary64, rounded to f32 once


def _exp64(t: float) -> float:
    # libm's exp; math.exp raises where the result overflows binary64, libm (and Rust's
    # f64::exp) returns +inf there.
    try:
        return math.exp(t)
    except OverflowError:
        return float("inf")


def exp_to_f32(a: np.ndarray) -> np.ndarray:
    """f32(E(binary64(a))) element-wise, through libm's exp (math.exp)."""
    a = np.asarray(a, dtype=F32)
    flat = a.astype(F64).ravel().tolist()
    out = np.fromiter(map(_exp64, flat), dtype=F64, count=len(flat))
    return out.astype(F32).reshape(a.shape)


def _softplus64(u: float) -> float:
    # §18.4: PyTorch's threshold (20, beta 1) above which softplus returns its input; NaN fails
    # the comparison and propagates through log1p(exp(NaN)).
    return u if u > 20.0 else math.log1p(math.exp(u))


def softplus(u: np.ndarray) -> np.ndarray:
    """§18.4: u where u > 20, else f32(log1p(E(u))) (libm exp then log1p, binary64, rounded
    once). u ≤ 20 keeps exp's result far from overflow."""
    u = np.asarray(u, dtype=F32)
    flat = u.astype(F64).ravel().tolist()
    return (
        np.fromiter(map(_softplus64, flat), dtype=F64, count=len(flat)).astype(F32).reshape(u.shape)
    )


def _sigmoid64(g: float) -> float:
    # §9: the branch on the sign keeps exp's argument ≤ 0 (no overflow); NaN fails `g >= 0`,
    # takes the second branch and propagates.
    if g >= 0.0:
        return 1.0 / (1.0 + math.exp(-g))
    e = math.exp(g)
    return e / (1.0 + e)


def sigmoid(g: np.ndarray) -> np.ndarray:
    """f32(sigmoid(g)) element-wise, binary64 throughout and rounded once (§9)."""
    g = np.asarray(g, dtype=F32)
    flat = g.astype(F64).ravel().tolist()
    return (
        np.fromiter(map(_sigmoid64, flat), dtype=F64, count=len(flat)).astype(F32).reshape(g.shape)
    )


def silu(g: np.ndarray) -> np.ndarray:
    """silu(g) = g ⊗ sigmoid(g) (§9)."""
    return g * sigmoid(g)


def tanh_to_f32(a: np.ndarray) -> np.ndarray:
    """f32(tanh(binary64(a))) element-wise through libm (docs/diffusion-gemma.md DG1)."""
    a = np.asarray(a, dtype=F32)
    flat = a.astype(F64).ravel().tolist()
    return (
        np.fromiter(map(math.tanh, flat), dtype=F64, count=len(flat)).astype(F32).reshape(a.shape)
    )


def log_to_f32(a: np.ndarray) -> np.ndarray:
    """f32(log(binary64(a))) element-wise through libm (DG1); log(0) is −inf as libm gives it
    (math.log raises there), a negative argument NaN."""

    def log64(t: float) -> float:
        if t == 0.0:
            return float("-inf")
        if not t >= 0.0:
            return float("nan")
        return math.log(t)

    a = np.asarray(a, dtype=F32)
    flat = a.astype(F64).ravel().tolist()
    return np.fromiter(map(log64, flat), dtype=F64, count=len(flat)).astype(F32).reshape(a.shape)


# DG7: torch's constant M_SQRT2·M_2_SQRTPI·0.5 and 0.044715, each rounded to f32 once.
GELU_BETA = F32(math.sqrt(2.0) * (2.0 / math.sqrt(math.pi)) * 0.5)
GELU_KAPPA = F32(0.044715)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """DG7 gelu_pytorch_tanh: (0.5 ⊗ x) ⊗ (1 ⊕ tanh(β ⊗ (x ⊕ κ ⊗ ((x ⊗ x) ⊗ x))))."""
    x = np.asarray(x, dtype=F32)
    x3 = (x * x) * x
    inner = GELU_BETA * (x + GELU_KAPPA * x3)
    return (F32(0.5) * x) * (F32(1.0) + tanh_to_f32(inner))


# --------------------------------------------------------------------------------------------
# Ordered reductions (§2, §3)


def ordered_sum(a: np.ndarray, axis: int = -1) -> np.ndarray:
    """sum over `axis` ascending from +0.0, one rounded f32 add per step (§3)."""
    a = np.moveaxis(np.asarray(a, dtype=F32), axis, -1)
    acc = np.zeros(a.shape[:-1], dtype=F32)
    for i in range(a.shape[-1]):
        acc = acc + a[..., i]
    return acc


def transpose_weight(w: np.ndarray) -> np.ndarray:
    """A stored [out, in] weight as a contiguous f32 [in, out] array, the layout `matmul` walks
    (row k of the result holds every output's k-th weight, so one loop step is one ufunc)."""
    return np.ascontiguousarray(np.asarray(w, dtype=F32).T)


def matmul(
    x: np.ndarray, wt: np.ndarray, bias: np.ndarray | None = None, acc: np.ndarray | None = None
) -> np.ndarray:
    """y = x·Wᵀ (+ b) (§2). `x` is [rows, K]; `wt` is Wᵀ, [K, out] (see `transpose_weight`).

    For every (row, output): acc = +0.0; for k ascending: acc = acc ⊕ (x[r,k] ⊗ W[o,k]); the
    bias is added once after the loop. `acc` [rows, out]: the accumulation goes on from these
    values instead of +0.0 (a rank's block of K in §23.3's ordered carry; not modified)."""
    x = np.asarray(x, dtype=F32)
    rows, k_dim = x.shape
    if wt.shape[0] != k_dim:
        raise ValueError(f"matmul: input width {k_dim} != weight in-features {wt.shape[0]}")
    if acc is None:
        acc = np.zeros((rows, wt.shape[1]), dtype=F32)
    else:
        acc = np.array(acc, dtype=F32)  # a copy: the carried accumulator stays the sender's
    prod = np.empty_like(acc)
    for k in range(k_dim):
        np.multiply(x[:, k : k + 1], wt[k], out=prod)  # one rounded product per output
        np.add(acc, prod, out=acc)  # one rounded add per output
    if bias is not None:
        np.add(acc, bias, out=acc)
    return acc


# --------------------------------------------------------------------------------------------
# RMSNorm (§6)


def _sum_squares(x: np.ndarray) -> np.ndarray:
    ss = np.zeros(x.shape[:-1], dtype=F32)
    for i in range(x.shape[-1]):
        xi = x[..., i]
        ss = ss + xi * xi
    return ss


def _rms_scaled(x: np.ndarray, eps: np.float32) -> np.ndarray:
    """x ⊗ inv over the last axis: ss ordered, mean = ss ⊘ n, t = mean ⊕ eps, s = sqrt_f32(t),
    inv = 1 ⊘ s. np.sqrt on f32 is the correctly rounded IEEE sqrt."""
    x = np.asarray(x, dtype=F32)
    mean = _sum_squares(x) / F32(x.shape[-1])
    t = mean + F32(eps)
    inv = F32(1.0) / np.sqrt(t)
    return x * inv[..., None]


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: np.float32) -> np.ndarray:
    """§6 over the last axis: y = w ⊗ (x ⊗ inv)."""
    return w * _rms_scaled(x, eps)


def rmsnorm_plain(x: np.ndarray, eps: np.float32) -> np.ndarray:
    """§6 without a weight (docs/diffusion-gemma.md DG3, with_scale=False): y = x ⊗ inv."""
    return _rms_scaled(x, eps)


def rmsnorm_zero_centred(x: np.ndarray, w: np.ndarray, eps: np.float32) -> np.ndarray:
    """§15.1: y = (x ⊗ inv) ⊗ (1 ⊕ w) — Qwen3.5's weights are offsets from one."""
    return _rms_scaled(x, eps) * (F32(1.0) + np.asarray(w, dtype=F32))


def gated_rmsnorm(x: np.ndarray, w: np.ndarray, z: np.ndarray, eps: np.float32) -> np.ndarray:
    """§15.2: §6 (plain weight), then ⊗ silu(z)."""
    return rmsnorm(x, w, eps) * silu(np.asarray(z, dtype=F32))


def l2norm(x: np.ndarray) -> np.ndarray:
    """§18.3 over the last axis: y = x ⊗ (1 ⊘ sqrt_f32(ss ⊕ f32(1e-6))); the constant is
    transformers' (not the config's rms_norm_eps)."""
    x = np.asarray(x, dtype=F32)
    t = _sum_squares(x) + F32(1e-6)
    inv = F32(1.0) / np.sqrt(t)
    return x * inv[..., None]


# --------------------------------------------------------------------------------------------
# RoPE (§7)


def inv_freq(base: float, d: int, scaling: dict | None = None) -> np.ndarray:
    """inv_freq[i] = f32(1.0 / pow(base, (2i)/d)), all binary64 (libm pow) until the final round,
    for i in 0 .. ceil(d/2)−1: an odd d (§16's rotary dim) gets the frequency of i = (d−1)/2 too,
    as transformers' arange(0, d, 2) does. `scaling` (§7.1, llama): {"rope_type": "linear" or
    "llama3", and that type's numbers}, applied in binary64 before the one rounding."""
    freqs = [1.0 / math.pow(float(base), (2 * i) / d) for i in range((d + 1) // 2)]
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "linear":
        freqs = [f / scaling["factor"] for f in freqs]
    elif kind == "llama3":
        factor, low, high = (
            scaling["factor"],
            scaling["low_freq_factor"],
            scaling["high_freq_factor"],
        )
        old = scaling["original_max_position_embeddings"]
        scaled = []
        for f in freqs:
            wavelen = 2.0 * math.pi / f
            if wavelen < old / high:  # high frequencies: kept
                scaled.append(f)
            elif wavelen > old / low:  # low frequencies: divided by the factor
                scaled.append(f / factor)
            else:  # between: a blend, weighted by where the wavelength sits
                smooth = (old / wavelen - low) / (high - low)
                scaled.append((1.0 - smooth) * f / factor + smooth * f)
        freqs = scaled
    return np.array(freqs, dtype=F64).astype(F32)


class Rope:
    """cos/sin rows per absolute position, computed on first use and kept (a position's row is
    a pure function of the position, so caching cannot change a bit). `rotary_dim` < d: partial
    RoPE (§16), the tables cover the first 2·ceil(rotary_dim/2) dims only (an odd rotary dim
    rounds up, as in transformers)."""

    def __init__(
        self, base: float, d: int, rotary_dim: int | None = None, scaling: dict | None = None
    ):
        self.inv_freq = inv_freq(base, d if rotary_dim is None else rotary_dim, scaling)
        self._rows: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def row(self, p: int) -> tuple[np.ndarray, np.ndarray]:
        r = self._rows.get(p)
        if r is None:
            angle = F32(p) * self.inv_freq  # f32 product; positions < 2^24 are exact in f32
            a64 = angle.astype(F64).tolist()
            cos = np.array([math.cos(v) for v in a64], dtype=F64).astype(F32)
            sin = np.array([math.sin(v) for v in a64], dtype=F64).astype(F32)
            r = self._rows[p] = (cos, sin)
        return r

    def tables(self, positions) -> tuple[np.ndarray, np.ndarray]:
        rows = [self.row(int(p)) for p in positions]
        return np.stack([c for c, _ in rows]), np.stack([s for _, s in rows])

    @staticmethod
    def apply(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """x [T, heads, d] rotated at each row's position ("rotate half": i pairs with i+h).
        cos/sin are [T, h] (`tables`); with h < d/2 (§16) dims 2h.. are copied unchanged.
        2h ≤ d is the config's check (§16)."""
        h = cos.shape[-1]
        x1, x2 = x[..., :h], x[..., h : 2 * h]
        c, s = cos[:, None, :], sin[:, None, :]
        out = np.array(x, dtype=F32)  # the copy keeps the unrotated dims bit for bit
        out[..., :h] = (x1 * c) - (x2 * s)
        out[..., h : 2 * h] = (x2 * c) + (x1 * s)
        return out


# --------------------------------------------------------------------------------------------
# Softmax (§8.6, §10.2)


def softmax(scores: np.ndarray, visible: np.ndarray | None = None) -> np.ndarray:
    """Softmax over the last axis. `visible` (broadcastable bool) marks the unmasked entries;
    masked ones are −∞ before the max and come out +0.0.

    Masked entries contribute e = +0.0 to the ordered sum; since the sum starts at +0.0 and
    every e ≥ 0, adding +0.0 never changes a bit, so the loop may run over all entries."""
    s = np.asarray(scores, dtype=F32)
    if visible is not None:
        visible = np.broadcast_to(visible, s.shape)
        s = np.where(visible, s, F32(-np.inf))
    m = np.max(s, axis=-1, keepdims=True)  # exact whatever the order
    diff = s - m  # an f32 op, before exp (§8.6)
    if visible is None:
        e = exp_to_f32(diff)
    else:
        e = np.zeros_like(diff)
        e[visible] = exp_to_f32(diff[visible])
    z = ordered_sum(e, axis=-1)
    p = e / z[..., None]
    if visible is not None:
        p = np.where(visible, p, F32(0.0))
    return p


# --------------------------------------------------------------------------------------------
# Attention (§8.3 – §8.7)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos, k_pos, scale: np.float32):
    """Causal GQA attention of query rows q [T, nh, d] over key rows k, v [S, nkv, d].

    Key c is visible to query r iff k_pos[c] ≤ q_pos[r]. Returns (o [T, nh, d], probs
    [nh, T, S]). Query head hq reads kv head hq // (nh / nkv)."""
    visible = np.asarray(k_pos)[None, :] <= np.asarray(q_pos)[:, None]  # [T, S]
    return attention_visible(q, k, v, visible, scale)


def attention_visible(q: np.ndarray, k: np.ndarray, v: np.ndarray, visible: np.ndarray, scale):
    """GQA attention as `attention` with an explicit visibility matrix [T, S] (True: key c is
    one of row r's keys); the keys in the order given (ascending position)."""
    t, nh, d = q.shape
    s_len, nkv, _ = k.shape
    kv_of = np.arange(nh) // (nh // nkv)
    qh = np.ascontiguousarray(q.transpose(1, 0, 2))  # [nh, T, d]
    kh = np.ascontiguousarray(k.transpose(1, 0, 2)[kv_of])  # [nh, S, d]
    vh = np.ascontiguousarray(v.transpose(1, 0, 2)[kv_of])  # [nh, S, d]

    # s[r,c] = dot(q[r], k[c]) ⊗ scale: the dot over j ascending, vectorised over (head, r, c).
    acc = np.zeros((nh, t, s_len), dtype=F32)
    for j in range(d):
        acc = acc + qh[:, :, j, None] * kh[:, None, :, j]
    scores = acc * F32(scale)

    probs = softmax(scores, visible[None, :, :])

    # o[r,j] = Σ_c visible, ascending, of p[r,c] ⊗ v[c,j]. Rows that cannot see key c keep acc
    # untouched (not even a +0.0 product, which a non-finite v would turn into NaN).
    out = np.zeros((nh, t, d), dtype=F32)
    with np.errstate(invalid="ignore", over="ignore"):  # IEEE results are the point; no warnings
        for c in range(s_len):
            upd = out + probs[:, :, c, None] * vh[:, None, c, :]
            out = np.where(visible[None, :, c, None], upd, out)
    return np.ascontiguousarray(out.transpose(1, 0, 2)), probs


# --------------------------------------------------------------------------------------------
# Gated DeltaNet (§18)


def causal_conv1d(mixed: np.ndarray, w: np.ndarray, state: np.ndarray):
    """§18.2. mixed [T, C] (pre-conv), w [C, K], state [C, K−1] (the previous rows' pre-conv
    values, oldest first). Returns (silu(conv) [T, C], the new state). Row t's window is the
    K−1 rows before it then itself; the K products are summed in tap order, all of them."""
    k = w.shape[1]
    full = np.concatenate([np.asarray(state, dtype=F32).T, np.asarray(mixed, dtype=F32)])
    t = mixed.shape[0]
    acc = np.zeros((t, w.shape[0]), dtype=F32)
    for j in range(k):  # tap j reads row t−(K−1)+j: vectorised over rows and channels
        acc = acc + full[j : j + t] * w[:, j]
    return silu(acc), np.ascontiguousarray(full[t:].T)


def gdn_decay(a: np.ndarray, dt_bias: np.ndarray, a_log: np.ndarray) -> np.ndarray:
    """§18.4: g = (−f32(E(A_log))) ⊗ softplus(a ⊕ dt_bias), per row and value head."""
    neg_a = -exp_to_f32(a_log)  # negation is exact
    return neg_a * softplus(np.asarray(a, dtype=F32) + dt_bias)


def delta_rule_step(s: np.ndarray, q, k, v, alpha, beta) -> np.ndarray:
    """§18.5, one row, every value head at once (heads are independent). s [nv, dk, dv] is
    updated in place; q, k [nv, dk] are the key heads as each value head reads them (q already
    scaled); v [nv, dv]; alpha, beta [nv]. Returns core [nv, dv]. Both reads sum over the key
    dim i ascending from +0.0."""
    nv, dk, dv = s.shape
    s *= alpha[:, None, None]  # 1. decay
    mem = np.zeros((nv, dv), dtype=F32)
    for i in range(dk):  # 2. read
        mem = mem + s[:, i, :] * k[:, i, None]
    d = (v - mem) * beta[:, None]  # 3. delta
    s += k[:, :, None] * d[:, None, :]  # 4. write
    core = np.zeros((nv, dv), dtype=F32)
    for i in range(dk):  # 5. output, from the written state
        core = core + s[:, i, :] * q[:, i, None]
    return core


# --------------------------------------------------------------------------------------------
# Decisions (§10.3, §12)


def rank_order(scores: np.ndarray) -> np.ndarray:
    """Indices of each row ordered by (descending score, ascending index): a stable sort of the
    negated scores keeps equal scores in index order (ties go to the lowest index). `+ 0.0`
    turns −0.0 into +0.0 first, so the two zeros tie as IEEE `>` says. Callers reject NaN."""
    return np.argsort(-(scores + F32(0.0)), axis=-1, kind="stable")


def topk(p: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Router top-k (§10.3): chosen [T, k] in rank order, margin [T] = p[k-th] ⊖ p[(k+1)-th]."""
    order = rank_order(p)
    rows = np.arange(p.shape[0])
    margin = p[rows, order[:, k - 1]] - p[rows, order[:, k]]
    return order[:, :k].astype(np.int64), margin.astype(F32)


def margin_of(v: np.ndarray, chosen) -> F32:
    """The margin of a given choice on one row (docs/producers.md, forced decisions): the value
    of the chosen index that comes last in rank order ⊖ the value of the unchosen index that
    comes first. For the row's own choice it is the margin of `topk` / `argmax_margin`;
    for another choice, negative where the row ranks an unchosen index higher."""
    order = [int(i) for i in rank_order(np.asarray(v, dtype=F32)[None])[0]]
    chosen = [int(c) for c in chosen]
    weakest = max(chosen, key=order.index)
    strongest = next(i for i in order if i not in chosen)
    return F32(v[weakest] - v[strongest])


def argmax_margin(logits: np.ndarray, what: str = "logits") -> tuple[np.ndarray, np.ndarray]:
    """Per row: index of the largest value (IEEE `>`, ties to the lowest index) and margin
    top1 ⊖ top2, top2 the largest among the other indices (§12). NaN is an error naming the row.

    top2 is taken as the value at rank 2 of the (−value, index) order, so when the runner-up is
    a tie between +0.0 and −0.0 the lower index's value (and its sign) is the one subtracted."""
    logits = np.asarray(logits, dtype=F32)
    nan_rows = np.nonzero(np.isnan(logits).any(axis=-1))[0]
    if nan_rows.size:
        raise ContractError(f"{what}: NaN in row {int(nan_rows[0])}")
    order = rank_order(logits)
    rows = np.arange(logits.shape[0])
    margin = logits[rows, order[:, 0]] - logits[rows, order[:, 1]]
    return order[:, 0].astype(np.int64), margin.astype(F32)
