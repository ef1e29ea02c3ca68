"""`trace --distributed tp=N|ep=N`: the oracle sharded by transformers' own tensor / expert
parallelism (`from_pretrained(distributed_config=DistributedConfig(...))`) over torch.distributed
(gloo, CPU), one process per rank, each writing its own rank trace (docs/trace-format.md,
"Sharded traces"); `trace-merge` builds the logical trace. The distributed runtime is torch's and
transformers': this module launches it (torchrun), and says what each capture point is on a rank.

What a capture point is on a rank, read from transformers 5.23's TP/EP styles (tensor_parallel.py,
expert_parallel.py) and checked by trace-merge (replicas must be bit-identical across ranks) and
by trace-diff against the one-process trace (oracle/tests/test_distributed.py):
  * q, k, v (and Qwen3.5's attn_gate), attn_probs: `colwise` q/k/v projections give each rank a
    contiguous block of heads, and eager attention runs on those: a head slice, whose offset,
    length and size come from the projection weight's own DTensor placement;
  * attn_out, mlp_out, shared_expert.out: the hooked module's output is after the `rowwise`
    o_proj/down_proj's all-reduce (transformers replaces the projection's forward, and the
    all-reduce is in it): replicated;
  * embed.out: `embedding_rowwise` (vocabulary-parallel) all-reduces in the embedding's forward:
    replicated; logits: `colwise_gather_output` gathers them in lm_head's forward: replicated;
  * expert.EEE.out under tp: `packed_colwise` gate_up / `rowwise` down_proj give each rank its
    share of every expert's intermediate columns, and the down projection's output, tapped
    before `moe_tp_experts` all-reduces the experts' sum, is a summand: partial;
  * expert.EEE.out under ep (`grouped_gemm` shards the experts whole, `ep_dispatch_experts`):
    the rank's own experts, on every row routed to them: experts;held=...;of=E;
  * everything else (hidden_in/out, final_norm.out, router logits and decisions): replicated.
A plan style outside KNOWN_STYLES is refused: its outputs have not been looked at.
"""

from __future__ import annotations

import datetime
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from tracegate.names import layer as names_layer

from .errors import OracleError

BACKEND = "gloo"
RANK_FIELD = "{rank}"
# The styles whose outputs at the capture points are described above (transformers 5.23).
KNOWN_STYLES = {
    "colwise",
    "rowwise",
    "colwise_gather_output",
    "replicated_with_grad_allreduce",
    "embedding_rowwise",
    "packed_colwise",
    "moe_tp_experts",
    "grouped_gemm",
    "ep_dispatch_experts",
}


@dataclass(frozen=True)
class Spec:
    """`tp=N`: tp_size N; `ep=N`: tp_size N and ep_size N (transformers: ep_size divides tp_size)."""

    kind: str
    n: int

    def __str__(self) -> str:
        return f"{self.kind}={self.n}"

    def config_kwargs(self) -> dict:
        return {"tp_size": self.n, **({"ep_size": self.n} if self.kind == "ep" else {})}


def parse(text: str) -> Spec:
    """argparse type of --distributed."""
    import argparse

    m = re.fullmatch(r"(tp|ep)=([1-9][0-9]*)", text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not tp=N or ep=N (N ranks, e.g. tp=2)")
    n = int(m.group(2))
    if n < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: N must be at least 2 (one rank is no shard)")
    return Spec(m.group(1), n)


def rank_paths(out: str, world: int) -> list[str]:
    return [out.replace(RANK_FIELD, str(r)) for r in range(world)]


def check_out(out: str, spec: Spec | None) -> None:
    """Each rank writes its own trace: --out names them with {rank}, and only then."""
    if spec is not None and RANK_FIELD not in out:
        raise OracleError(
            f"--out {out}: with --distributed {spec} each rank writes its own trace: put {RANK_FIELD} "
            f"in the path (e.g. /tmp/o.rank{RANK_FIELD}.trace)"
        )
    if spec is None and RANK_FIELD in out:
        raise OracleError(
            f"--out {out}: {RANK_FIELD} names a rank's trace, only with --distributed"
        )


def under_torchrun() -> tuple[int, int] | None:
    """(rank, world size) when this process is a rank torchrun started, else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    try:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except ValueError:
        raise OracleError(
            f"RANK={os.environ['RANK']!r} / WORLD_SIZE={os.environ['WORLD_SIZE']!r}: not integers"
        ) from None


# ---------------------------------------------------------------------------------------------
# the launcher: torchrun, one process per rank, re-invoking the same command line


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_stderr(log_dir: Path, rank: int) -> str:
    """Rank `rank`'s stderr as torchrun's --redirects wrote it (log_dir/<run>/attempt_N/<rank>/)."""
    found = sorted(log_dir.glob(f"*/attempt_*/{rank}/stderr.log"))
    return found[-1].read_text(errors="replace") if found else ""


def _failure(stderr_of: dict[int, str], torchrun_out: str) -> str:
    """One line naming the rank that failed: its own one-line refusal (`error: ...`) when it
    wrote one, else the last line of its traceback, else torchrun's root-cause rank."""
    for r in sorted(stderr_of):
        for line in stderr_of[r].splitlines():
            m = re.search(r": error: (rank \d+/\d+: .*)", line)
            if m:
                return m.group(1)
    for r in sorted(stderr_of):
        # torch prefixes a rank's own lines with `[rankN]:`
        lines = [re.sub(r"^\[rank\d+\]:", "", x) for x in stderr_of[r].splitlines() if x.strip()]
        if any(x.startswith("Traceback") for x in lines):
            return f"rank {r}/{len(stderr_of)}: failed: {lines[-1].strip()}"
    m = re.search(r"rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", torchrun_out, re.S)
    if m:
        return f"rank {m.group(1)}/{len(stderr_of)}: exited with status {m.group(2)}"
    tail = " | ".join(x.strip() for x in torchrun_out.splitlines()[-3:] if x.strip())
    return f"torchrun failed: {tail or 'no output'}"


def run_ranks(target: list[str], world: int, timeout: float, env: dict | None = None) -> None:
    """Run `target` (`-m MODULE args` or `SCRIPT args`) as `world` ranks under torchrun on this
    host. Raises OracleError, one line naming the rank, when a rank fails; kills every rank and
    raises when the run takes longer than `timeout` seconds (a hung rank)."""
    module = target[:1] == ["-m"]
    with tempfile.TemporaryDirectory(prefix="tracegate-torchrun-") as logs:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "1",
            "--nproc-per-node",
            str(world),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            "--max-restarts",
            "0",
            "--log-dir",
            logs,
            "--redirects",
            "3",
            *(["--module"] if module else []),
            *(target[1:] if module else target),
        ]
        # Its own session, so that a timeout ends torchrun and nothing else. Each rank is in a
        # session of its own (torchrun starts them so): torchrun ends them on SIGTERM.
        p = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
            raise OracleError(
                f"--distributed: the {world} ranks did not finish within {timeout:g} s "
                "(--distributed-timeout): killed (a rank hung?)"
            ) from None
        if p.returncode != 0:
            raise OracleError(_failure({r: _rank_stderr(Path(logs), r) for r in range(world)}, out))


def launch(argv: list[str], spec: Spec, out: str, timeout: float) -> list[str]:
    """`python -m tracegate_oracle <argv>` as spec.n ranks; returns each rank's trace path, in
    rank order, after checking that each was written."""
    # The ranks run on the CPU (gloo; `--device cuda` is refused with --distributed): with a GPU
    # visible, transformers' tensor-parallel set-up puts rank r on cuda:r, which fails on a host
    # with fewer GPUs than ranks ("invalid device ordinal", seen on a one-GPU H100 host).
    run_ranks(
        ["-m", "tracegate_oracle", *argv],
        spec.n,
        timeout,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    paths = rank_paths(out, spec.n)
    missing = [r for r, p in enumerate(paths) if not Path(p).is_file()]
    if missing:
        raise OracleError(
            f"rank {missing[0]}/{spec.n}: exited 0 but wrote no trace at {paths[missing[0]]}"
        )
    return paths


# ---------------------------------------------------------------------------------------------
# a rank


# Whether init() made the process group: a group the caller made (a process that runs several
# traces as one rank) is the caller's to destroy.
_made_group = False


def init(spec: Spec, rank: int, world: int, timeout: float) -> str:
    """Join the process group (gloo: CPU; a collective waits at most `timeout`, so a rank whose
    peer died errors rather than hanging); returns the run id, rank 0's, common to the ranks."""
    import torch.distributed as dist

    if world != spec.n:
        raise OracleError(
            f"--distributed {spec}: torchrun started {world} ranks (WORLD_SIZE), not {spec.n}"
        )
    global _made_group
    if not dist.is_initialized():
        dist.init_process_group(BACKEND, timeout=datetime.timedelta(seconds=timeout))
        _made_group = True
    box = [uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def finish() -> None:
    import torch.distributed as dist

    global _made_group
    if _made_group and dist.is_initialized():
        dist.destroy_process_group()
    _made_group = False


def config(spec: Spec):
    from transformers.distributed import DistributedConfig

    return DistributedConfig(**spec.config_kwargs())


class Sharding:
    """What each capture point is on this rank: the `shard` attribute value of a tensor recorded
    there (docs/trace-format.md grammar), from transformers' own placements of the weights."""

    def __init__(self, model, lay, spec: Spec, rank: int, world: int, run_id: str):
        self.spec, self.rank, self.world, self.run_id = spec, rank, world, run_id
        self.lay = lay
        self._prefix = f"rank={rank}/{world}"
        styles = set(model.tp_plan.values()) | (
            set(model.ep_plan.values()) if spec.kind == "ep" else set()
        )
        unknown = sorted(styles - KNOWN_STYLES)
        if unknown:
            raise OracleError(
                f"--distributed {spec}: transformers shards {type(model).__name__} with "
                f"{', '.join(unknown)}, whose outputs at the capture points the oracle has not "
                "been taught (tracegate_oracle/distributed.py, KNOWN_STYLES)"
            )
        self.styles = sorted(styles)
        self._cache: dict = {}
        self.model_class = type(model).__name__
        # Every attention layer's heads, now: a projection that does not split into whole heads
        # is refused before transformers' attention fails on it mid-forward.
        for L in range(len(lay.layers)):
            if L not in lay.linear_layers:
                self.kind(names_layer(L, "q"), L)
                self.kind(names_layer(L, "k"), L)
                self.kind(names_layer(L, "v"), L)

    def _block(self, param, what: str) -> tuple[int, int, int, int] | None:
        """(dim, offset, length, size) of the one sharded dimension of a DTensor parameter, or
        None when this rank holds it whole."""
        from torch.distributed.tensor import DTensor, Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        if not isinstance(param, DTensor):
            return None
        shape, offset = compute_local_shape_and_global_offset(
            param.shape, param.device_mesh, param.placements
        )
        dims = [d for d in range(param.dim()) if shape[d] != param.shape[d]]
        if not dims:
            return None
        (p,) = param.placements
        if len(dims) != 1 or type(p) is not Shard:
            # _StridedShard (packed gate_up) interleaves: not one block of the logical tensor.
            raise OracleError(
                f"--distributed {self.spec}: {what} is sharded as {p}, not as one block"
            )
        d = dims[0]
        return d, int(offset[d]), int(shape[d]), int(param.shape[d])

    def _heads(self, L: int, proj: str, per_head: int) -> str:
        key = (L, proj)
        if key not in self._cache:
            attn = self.lay.attn(L)
            w = getattr(attn, proj).weight
            b = self._block(w, f"layer {L} {proj}")
            if b is None:
                self._cache[key] = "replicated"
            else:
                d, off, n, size = b
                if d != 0 or off % per_head or n % per_head or size % per_head:
                    raise OracleError(
                        f"--distributed {self.spec}: transformers cannot shard {self.model_class} "
                        f"into whole heads: layer {L} {proj} rows {off}..{off + n} of {size} on "
                        f"rank {self.rank} are not whole heads of {per_head}"
                    )
                self._cache[key] = (
                    f"slice;axis={{axis}};offset={off // per_head};length={n // per_head};"
                    f"size={size // per_head}"
                )
        return self._cache[key]

    def experts(self, L: int) -> tuple[str, range | None]:
        """(kind, the experts this rank holds whole, or None) of layer L's expert outputs."""
        key = (L, "experts")
        if key not in self._cache:
            down = self.lay.experts(L).down_proj
            b = self._block(down, f"layer {L} experts.down_proj")
            if b is None:
                self._cache[key] = ("replicated", None)
            elif b[0] == 0:  # whole experts per rank (ep)
                _, off, n, size = b
                held = ",".join(str(e) for e in range(off, off + n))
                self._cache[key] = (f"experts;held={held};of={size}", range(off, off + n))
            elif b[0] == down.dim() - 1:  # the down projection's input columns (tp): a summand
                self._cache[key] = ("partial", None)
            else:
                raise OracleError(
                    f"--distributed {self.spec}: layer {L}'s experts' down_proj is sharded on "
                    f"dimension {b[0]}, which the oracle does not know"
                )
        return self._cache[key]

    def kind(self, name: str, L: int | None) -> str:
        """The shard attribute of the tensor at (undecorated) capture point `name`."""
        point = name.split(".", 2)[2] if name.startswith("layer.") else name
        a = self.lay.attn(L) if L is not None and L not in self.lay.linear_layers else None
        hd = getattr(a, "head_dim", None)
        if point in ("q", "attn_probs"):
            gate = 2 if self.lay.spec.attn_gate else 1  # Qwen3.5: q_proj holds query and gate
            k = self._heads(L, "q_proj", hd * gate)
        elif point == "attn_gate":
            k = self._heads(L, "q_proj", hd * 2)
        elif point in ("k", "v"):
            k = self._heads(L, f"{point}_proj", hd)
        elif point.startswith("expert."):
            k = self.experts(L)[0]
        else:
            k = "replicated"
        return f"{self._prefix};{k.format(axis=0 if point == 'attn_probs' else 1)}"

    def provenance(self) -> dict:
        return {
            "distributed": {
                "spec": str(self.spec),
                **self.spec.config_kwargs(),
                "backend": BACKEND,
                "world_size": self.world,
                "rank": self.rank,
                "plan_styles": self.styles,
                "launcher": "torchrun",
            },
            "run_id": self.run_id,
        }
