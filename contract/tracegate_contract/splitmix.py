"""The random numbers of the bit-exact producers (docs/diffusion-gemma.md DG15): SplitMix64 with
one stream per (purpose, block, step), uniforms, uniform tokens and the categorical draw. Python
integers masked to 64 bits; the engine's mirror uses u64 wrapping arithmetic."""

from __future__ import annotations

import numpy as np

MASK = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15
INIT, SAMPLE, RENOISE = 1, 2, 3  # DG15.2 purposes


def mix64(z: int) -> int:
    z &= MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def output(key: int, i: int) -> int:
    """Output i (0-based) of the stream with key `key`: mix64(K + (i + 1)·GAMMA)."""
    return mix64((key + (i + 1) * GAMMA) & MASK)


def key(seed: int, purpose: int, block: int, step: int) -> int:
    """DG15.2: mix64(mix64(mix64(S) ^ purpose) ^ ((b << 32) | s)); b, s < 2^32."""
    if not (0 <= seed <= MASK and 0 <= block < 1 << 32 and 0 <= step < 1 << 32):
        raise ValueError(f"key({seed}, {purpose}, {block}, {step}) outside its ranges")
    return mix64(mix64(mix64(seed) ^ purpose) ^ ((block << 32) | step))


def outputs(k: int, n: int) -> list[int]:
    return [output(k, i) for i in range(n)]


def uniform(x: int) -> float:
    """DG15.3: (x >> 11)·2^−53, exact in binary64, in [0, 1)."""
    return (x >> 11) * (1.0 / (1 << 53))


def token(x: int, vocab: int) -> int:
    """DG15.3: the high 64 bits of x·V (no rejection)."""
    return (x * vocab) >> 64


def categorical(p: np.ndarray, u: float) -> int:
    """DG15.4: binary64 running sum of the f32 probabilities in ascending order; the first v whose
    cumulative sum exceeds u·total, else (rounding at the top) the last v with P[v] > 0."""
    cum = []
    c = 0.0
    for x in np.asarray(p, dtype=np.float32).astype(np.float64).tolist():
        c = c + x
        cum.append(c)
    t = u * cum[-1]
    for v, cv in enumerate(cum):
        if cv > t:
            return v
    pos = [v for v, x in enumerate(np.asarray(p, dtype=np.float32).tolist()) if x > 0]
    if not pos:
        raise ValueError("categorical draw from a row without a positive probability")
    return pos[-1]
