"""`--force-decisions TRACE`: router top-k and greedy tokens taken from another trace instead of
computed, so a run's numbers can be compared past a decision that flipped legitimately
(docs/producers.md, "Forced decisions"). Everything is checked before the forward runs; a trace
that cannot serve this run is refused in one line naming the file and the decision."""

from __future__ import annotations

import numpy as np

from .errors import ContractError


class Forcing:
    """The forcing trace's decisions, checked before anything runs. The oracle reads them through
    this class too (its own error type and preflight): one reader, one set of refusals."""

    error: type[Exception] = ContractError

    def __init__(self, path: str):
        import tracegate

        self.path = str(path)
        try:
            t = tracegate.Trace(path)
            # The digest recorded with the forced run must be that of the bytes the choices came from.
            t.verify()
        except (tracegate.TraceError, OSError) as e:
            raise self.error(
                f"--force-decisions {path}: not a valid trace: {e}".splitlines()[0]
            ) from None
        self.digest = t.digest
        self.decisions = {name: np.array(v, dtype=np.int64) for name, v in t.decisions.items()}
        self._provenance = t.provenance

    def _refuse(self, what: str) -> Exception:
        return self.error(f"--force-decisions {self.path}: {what}")

    def check_prompt(self, tokens) -> None:
        """The forcing trace must be a run of this prompt (when it records one)."""
        theirs = self._provenance.get("prompt_tokens")
        if theirs is not None and list(theirs) != [int(t) for t in tokens]:
            raise self._refuse(
                f"its prompt_tokens {theirs} are not this run's {[int(t) for t in tokens]}"
            )

    def check_weights(self, weights_digest: str | None) -> None:
        """The forcing trace must be a run of these weights (when both record them)."""
        theirs = self._provenance.get("weights_digest")
        if isinstance(theirs, str) and weights_digest is not None and theirs != weights_digest:
            raise self._refuse(f"its weights_digest {theirs} is not this run's {weights_digest}")

    def require(self, name: str, rows: int | None, width: int | None, value_range: int) -> int:
        """Decision `name` exists, has `width` values per row (rank 1 when None) and, when `rows`
        is given, that many rows; every value in [0, value_range) and none twice in one row.
        Returns its row count."""
        v = self.decisions.get(name)
        if v is None:
            raise self._refuse(f"decision {name} is missing (this run needs it)")
        want = [str(rows) if rows is not None else "rows"] + (
            [str(width)] if width is not None else []
        )
        ok = (
            v.ndim == (1 if width is None else 2)
            and (rows is None or v.shape[0] == rows)
            and (width is None or v.shape[1] == width)
        )
        if not ok:
            raise self._refuse(
                f"decision {name} has shape {list(v.shape)}, this run needs [{', '.join(want)}]"
            )
        for r, row in enumerate(v.reshape(v.shape[0], -1)):
            bad = [int(x) for x in row if not 0 <= int(x) < value_range]
            if bad:
                raise self._refuse(
                    f"decision {name} row {r}: value {bad[0]} outside [0, {value_range})"
                )
            for i, x in enumerate(row):
                if x in row[:i]:
                    raise self._refuse(
                        f"decision {name} row {r}: value {int(x)} repeated (position {i})"
                    )
        return int(v.shape[0])

    def take(
        self,
        name: str,
        shape: tuple[int, ...],
        value_range: int,
        distinct: bool = False,
        allow_minus_one: bool = False,
    ) -> np.ndarray:
        """Decision `name`'s values, of exactly `shape` (block diffusion's decisions: every row is
        this run's), each in [0, value_range) (or −1 where `allow_minus_one`), and with
        `distinct` no value twice in one row; a missing one is refused naming it."""
        v = self.decisions.get(name)
        if v is None:
            raise self._refuse(f"decision {name} is missing (this run needs it)")
        if list(v.shape) != list(shape):
            raise self._refuse(
                f"decision {name} has shape {list(v.shape)}, this run needs {list(shape)}"
            )
        for idx, x in np.ndenumerate(v):
            if not (0 <= x < value_range or (allow_minus_one and x == -1)):
                raise self._refuse(
                    f"decision {name} value {int(x)} at {list(idx)} outside [0, {value_range})"
                )
        if distinct:
            for r, row in enumerate(v):
                if len(set(row.tolist())) != len(row):
                    raise self._refuse(f"decision {name} row {r}: a value repeated")
        return v.astype(np.int64)

    def values(self, name: str) -> np.ndarray | None:
        return self.decisions.get(name)

    def provenance(self, records: list[tuple[str, list[int]]]) -> dict:
        """Which trace, which decisions, which rows this producer would have decided otherwise:
        counted in total and per decision that has any, and listed per decision (docs/producers.md,
        "Recorded.")."""
        total = 0
        for _, rows in records:  # integer row counts; the package's lint bans sum() outright
            total += len(rows)
        return {
            "trace": self.path,
            "trace_digest": self.digest,
            "decisions": [n for n, _ in records],
            "rows_overridden": total,
            "overridden": {n: len(rows) for n, rows in records if rows},
            "overridden_rows": {n: [int(r) for r in rows] for n, rows in records if rows},
        }


def rows_differing(forced, own) -> list[int]:
    """The rows (first axis, ascending) where the forced values differ from this producer's own
    choice: the rows it would have decided otherwise."""
    f, o = np.asarray(forced), np.asarray(own)
    n = f.shape[0] if f.ndim else 1
    differs = (f.reshape(n, -1) != o.reshape(n, -1)).any(axis=1)
    return [int(r) for r in np.flatnonzero(differs)]
