"""measure_policy's glob is diff/src/policy.rs's: same answers, and no backtracking (issue 33
items 5 and 7: a regex over `*a*a*...b` backtracks exponentially)."""

import itertools

from tracegate_oracle.measure_policy import glob_match


def reference(p: str, n: str) -> bool:
    """A plain recursive reading of the syntax (exponential: short inputs only)."""
    if not p:
        return not n
    if p.startswith("**"):
        return any(reference(p[2:], n[k:]) for k in range(len(n) + 1))
    if p[0] == "*":
        limit = n.index(".") if "." in n else len(n)
        return any(reference(p[1:], n[k:]) for k in range(limit + 1))
    if p[0] == "?":
        return bool(n) and reference(p[1:], n[1:])
    return n[:1] == p[0] and reference(p[1:], n[1:])


def words(alphabet: str, most: int) -> list[str]:
    return ["".join(w) for k in range(most + 1) for w in itertools.product(alphabet, repeat=k)]


def test_the_automaton_agrees_with_the_recursive_reading():
    patterns, names = words("a.*?", 4), words("ab.", 4)
    agreed = [glob_match(p, n) == reference(p, n) for p in patterns for n in names]
    assert all(agreed)
    hits = sum(reference(p, n) for p in patterns for n in names)
    assert 1000 < hits < len(patterns) * len(names) / 2  # both answers occur
    # The shipped shapes.
    assert glob_match("layer.*.attn_out", "layer.02.attn_out")
    assert not glob_match("layer.*.attn_out", "layer.02.x.attn_out")
    assert glob_match("layer.**.out", "layer.02.expert.003.out")
    assert glob_match("layer.?.x", "layer.é.x")
    assert not glob_match("layer.??.x", "layer.é.x")


def test_a_long_star_run_and_backtracking_shapes():
    stars = "*" * 200_000
    assert glob_match(stars, "layer.03.attn_out")
    assert not glob_match(stars + "x", "layer.03.attn_out")
    name = "a" * 4000
    for star in ("*", "**"):
        pattern = f"{star}a" * 20 + f"{star}b"
        assert not glob_match(pattern, name)
        assert glob_match(pattern, name + "b")
        assert not glob_match(pattern, name + "ba")
    dotted = "a." * 2000
    assert not glob_match("**a" * 20 + "**b", dotted)
    assert glob_match("**a" * 20 + "**b", dotted + "b")
    assert not glob_match("*a" * 20 + "*b", dotted + "b")
