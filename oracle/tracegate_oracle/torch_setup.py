"""The run's torch set-up: the configuration of one run (`RunConfig`), and its pinning — threads,
seed, deterministic algorithms, no autocast, no TF32 — and the device each module's inputs go to.
Nothing here loads or observes a model."""

from __future__ import annotations

import contextlib
import os
import random
import warnings
from dataclasses import dataclass

import numpy as np

from .errors import OracleError

TORCH_DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}


@dataclass
class RunConfig:
    device: str = "cpu"
    dtype: str = "f32"  # f32 | bf16 | f16
    threads: int = 1
    seed: int = 0
    capture: str = "default"  # default | internals
    cache: str = "on"  # generation with the model's KV cache (on) or full recompute (off)
    generate: int = 0
    # --device-map auto: transformers/accelerate place the modules over the visible GPUs (and, when
    # --max-memory leaves too little GPU memory, keep some in CPU memory: accelerate's offload).
    device_map: str | None = None
    max_memory: dict | None = None  # accelerate's max_memory: {GPU index or "cpu": size}
    # --distributed tp=N|ep=N (distributed.Spec): this process is one rank of transformers' own
    # tensor / expert parallel run (from_pretrained(distributed_config=...)).
    distributed: object | None = None


def check_device_map(rc: RunConfig) -> None:
    """--device-map / --max-memory combinations that mean nothing, refused before torch is imported."""
    if rc.max_memory is not None and rc.device_map is None:
        raise OracleError("--max-memory: only with --device-map auto")
    if rc.device_map is not None and rc.device_map != "auto":
        raise OracleError(f"--device-map {rc.device_map!r}: expected auto")
    if rc.device_map is not None and rc.device != "cuda":
        # On CPU there is nothing to spread: transformers would load it as plain --device cpu does.
        raise OracleError(
            f"--device-map auto: needs --device cuda (it spreads the model over the visible GPUs), "
            f"not --device {rc.device}"
        )


def setup_torch(rc: RunConfig) -> dict:
    """Pin the run; returns the determinism record for provenance."""
    check_device_map(rc)
    if rc.device == "cuda":
        # cuBLAS is only deterministic with a fixed workspace, and it must be set before init.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch

    if rc.device == "cuda":
        if not torch.cuda.is_available():
            raise OracleError(
                "--device cuda: CUDA is not available in this torch build / machine"
                + (" (--device-map auto needs visible GPUs)" if rc.device_map else "")
            )
        bad = [k for k in rc.max_memory or {} if k != "cpu" and not k < torch.cuda.device_count()]
        if bad:
            raise OracleError(
                f"--max-memory: GPU {bad[0]} is not visible ({torch.cuda.device_count()} visible: "
                f"0..{torch.cuda.device_count() - 1})"
            )
        # TF32 would silently round fp32 matmul inputs to 10 mantissa bits.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
    elif rc.device != "cpu":
        raise OracleError(f"--device {rc.device!r}: expected cpu or cuda")
    if rc.dtype not in TORCH_DTYPES:
        raise OracleError(f"--dtype {rc.dtype!r}: expected one of {', '.join(TORCH_DTYPES)}")
    if rc.threads < 1:
        raise OracleError(f"--threads {rc.threads}: must be >= 1")
    torch.set_float32_matmul_precision("highest")
    torch.set_num_threads(rc.threads)
    with contextlib.suppress(RuntimeError):  # can only be set once per process
        torch.set_num_interop_threads(1)
    torch.manual_seed(rc.seed)
    random.seed(rc.seed)
    np.random.seed(rc.seed % 2**32)
    det = {"use_deterministic_algorithms": True, "warn_only": False, "refusals": []}
    try:
        torch.use_deterministic_algorithms(True)
    except Exception as e:  # record, do not hide: the trace says it was not deterministic
        det["use_deterministic_algorithms"] = False
        det["refusals"].append(f"use_deterministic_algorithms(True): {e}")
    det["cudnn_deterministic"] = bool(torch.backends.cudnn.deterministic)
    det["cudnn_benchmark"] = bool(torch.backends.cudnn.benchmark)
    det["float32_matmul_precision"] = torch.get_float32_matmul_precision()
    det["autocast"] = False
    if rc.device == "cuda":
        det["CUBLAS_WORKSPACE_CONFIG"] = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    return det


def deterministic(fn, det: dict):
    """Run fn under strict determinism; if an op refuses, record it and re-run with warn_only."""
    import torch

    try:
        return fn()
    except RuntimeError as e:
        if "deterministic" not in str(e):
            raise
        det["refusals"].append(str(e).splitlines()[0])
    torch.use_deterministic_algorithms(True, warn_only=True)
    det["warn_only"] = True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    det["refusals"] += sorted(
        {str(w.message).splitlines()[0] for w in caught if "deterministic" in str(w.message)}
    )
    return out


def execution_device(module, rc: RunConfig):
    """Where `module` computes, so its inputs are sent there: accelerate's hook's execution device
    under --device-map auto, else the device of its weights, else --device. Sending token ids to
    plain `cuda` (GPU 0) fails when accelerate puts the whole model on GPU 1: a map of one device
    dispatches nothing, so no hook moves them."""
    import torch

    d = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
    if d is not None:
        return torch.device("cuda", d) if isinstance(d, int) else torch.device(d)
    p = next(module.parameters(), None)
    return p.device if p is not None and p.device.type != "meta" else torch.device(rc.device)
