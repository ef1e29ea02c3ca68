"""Assertions for a test suite: ``assert_traces_agree`` fails with what ``trace-diff`` would name.

from tracegate.testing import assert_traces_agree

def test_my_engine_matches_the_oracle(tmp_path):
    run_my_engine(out=tmp_path / "mine.trace")
    assert_traces_agree("oracle.trace", tmp_path / "mine.trace", policy="f32")
"""

from __future__ import annotations

from . import compare

__all__ = ["assert_traces_agree"]


def _amount(v) -> str:
    return "undefined" if v is None else str(v)


def _rows(rows) -> str:
    return "[" + ", ".join(str(v) for v in rows) + "]"


def disagreement(report) -> str:
    """The failure message for a report that is not ok: the verdict line, the first violation
    (tensor, rule, each broken bound with its value and limit, the worst element), the first bit
    difference, every flipped decision with its label, and the findings."""
    # Exit 4: nothing judged failed, but what followed a near-tie was not judged (no pass).
    what = "traces not checked" if report.verdict == "not_checked" else "traces disagree"
    lines = [
        f"{what}: {str(report).splitlines()[0]}",
        f"  reference: {report.reference['path']}",
        f"  candidate: {report.candidate['path']}",
    ]
    v = report.first_violation
    if v is not None:
        rule = f" (rule #{v['rule']['index']} {v['rule']['pattern']})" if v["rule"] else ""
        lines.append(f"  first violation: {v['tensor']}{rule}")
        for b in v["violations"]:
            op = "<" if b["bound"] == "min_cosine" else ">"
            lines.append(
                f"    {b['bound']}: value {_amount(b['value'])} {op} limit {_amount(b['limit'])}"
            )
        w = v["worst_element"]
        if w is not None:
            lines.append(
                f"    worst element {w['coords']}: reference {w['reference_value']} vs candidate {w['candidate_value']}"
            )
    d = report.first_bit_difference
    if d is not None:
        lines.append(
            f"  first bit difference: {d['tensor']} {d['coords']}: reference {d['reference_value']} "
            f"vs candidate {d['candidate_value']} ({_amount(d['ulp'])} ULP)"
        )
    flips = report.flipped_decisions
    if flips:
        lines.append(f"  flipped decisions ({len(flips)}):")
        for f in flips:
            why = (
                f" of {f['upstream']}"
                if f["upstream"]
                else f" ({f['after']})"
                if f["after"]
                else ""
            )
            lines.append(
                f"    {f['decision']}[{f['row']}]: {_rows(f['reference'])} -> {_rows(f['candidate'])} ({f['label']}{why})"
            )
    for f in report.findings:
        lines.append(f"  {f['kind']}{' ' + f['tensor'] if f['tensor'] else ''}: {f['detail']}")
    return "\n".join(lines)


def assert_traces_agree(reference, candidate, policy=None, only=None, skip=None):
    """Passes (returning the report) when the traces are identical, or within ``policy``
    (a bundled name, ``"f32"``, ``"bf16"``, ``"f16"``, or a path); otherwise raises
    AssertionError with :func:`disagreement`'s message — also when nothing judged fails but
    what followed an excused near-tie was not judged (verdict ``not_checked``: force the
    reference's decisions in the candidate to compare it). Unreadable traces raise TraceError."""
    __tracebackhide__ = True  # pytest shows the caller's line, not this one
    report = compare(reference, candidate, policy=policy, only=only, skip=skip)
    if not report.ok:
        raise AssertionError(disagreement(report))
    return report
