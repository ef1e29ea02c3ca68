"""The package must never hand a reduction or a transcendental to numpy (or to Python's float
`sum`): those choose their own order, precision or implementation (pairwise sums, BLAS, FMA,
numpy's SIMD exp/cos). This walks the package's syntax trees and fails on any such use, so the
rule of docs/numerics.md §2–§4 cannot erode silently."""

import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parents[1] / "tracegate_contract"

# Attribute or function names that reduce (or contract) in an order we do not control.
REDUCING = {
    "sum",
    "nansum",
    "prod",
    "nanprod",
    "mean",
    "nanmean",
    "average",
    "std",
    "var",
    "dot",
    "vdot",
    "inner",
    "outer",
    "matmul",
    "einsum",
    "tensordot",
    "kron",
    "cumsum",
    "cumprod",
    "nancumsum",
    "reduce",
    "accumulate",
    "reduceat",
    "trace",
    "linalg",
    "norm",
    "multi_dot",
    "convolve",
    "correlate",
    "fsum",
    "logsumexp",
}
# Transcendentals that must go through `math` (libm), never numpy's own kernels.
NUMPY_TRANSCENDENTAL = {
    "exp",
    "exp2",
    "expm1",
    "log",
    "log2",
    "log10",
    "log1p",
    "sin",
    "cos",
    "tan",
    "tanh",
    "sinh",
    "cosh",
    "arctan",
    "power",
    "float_power",
    "erf",
    "logaddexp",
    "logaddexp2",
    "sigmoid",
}
NUMPY_NAMES = {"np", "numpy"}
# ndarray / ufunc methods that reduce, caught on any object (`x.sum()`, `np.add.reduce`).
# (`trace` and `norm` are left to the numpy-rooted check: the package has its own `run.trace`
# and `model.norm`.)
METHODS = REDUCING - {"trace", "norm", "linalg"}
# `ops.inv_freq`'s "1.0 / math.pow" and friends are the *allowed* route (§4).
# `pi` is no routine: §7.1's binary64 constant.
ALLOWED_MATH = {"exp", "cos", "sin", "pow", "sqrt", "log1p", "pi", "tanh", "log"}  # tanh, log: DG1
# The package's own ordered kernels that share a name with a reducing routine (numerics.md §2
# calls the linear layer `matmul` on both sides): allowed only as `ops.<name>`, the function
# ops.py defines (`_own_kernels` checks that it is defined there).
OWN_KERNELS = {"matmul"}


def _own_kernels() -> set[str]:
    tree = ast.parse((PKG / "ops.py").read_text())
    defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    return OWN_KERNELS & defined


def _violations(tree: ast.AST, fname: str):
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
            out.append(f"{fname}:{node.lineno}: `@` (matmul)")
        if isinstance(node, ast.AugAssign) and isinstance(node.op, ast.MatMult):
            out.append(f"{fname}:{node.lineno}: `@=` (matmul)")
        if isinstance(node, ast.Attribute):
            base = node.value
            base_name = base.id if isinstance(base, ast.Name) else None
            root = node
            while isinstance(root, ast.Attribute):
                root = root.value
            numpy_rooted = isinstance(root, ast.Name) and root.id in NUMPY_NAMES
            own = base_name == "ops" and node.attr in _own_kernels()
            if (node.attr in METHODS and not own) or (numpy_rooted and node.attr in REDUCING):
                out.append(f"{fname}:{node.lineno}: `.{node.attr}`")
            if base_name in NUMPY_NAMES and node.attr in NUMPY_TRANSCENDENTAL:
                out.append(f"{fname}:{node.lineno}: numpy transcendental `np.{node.attr}`")
            if base_name == "math" and node.attr not in ALLOWED_MATH:
                out.append(
                    f"{fname}:{node.lineno}: `math.{node.attr}` is not one of the §4 routines"
                )
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in REDUCING
        ):
            out.append(f"{fname}:{node.lineno}: builtin `{node.func.id}(...)`")
        if isinstance(node, ast.ImportFrom) and node.module in ("numpy", "math"):
            for a in node.names:
                if a.name in REDUCING | NUMPY_TRANSCENDENTAL:
                    out.append(f"{fname}:{node.lineno}: `from {node.module} import {a.name}`")
    return out


def test_package_uses_no_reducing_or_transcendental_numpy_routines():
    files = sorted(PKG.glob("*.py"))
    assert files, PKG
    bad = []
    for f in files:
        bad += _violations(ast.parse(f.read_text(), str(f)), f.name)
    assert not bad, "ordered-arithmetic rule broken:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "src",
    [
        "y = x @ w",
        "y = np.sum(x)",
        "y = x.sum(axis=0)",
        "y = np.einsum('ij->i', x)",
        "y = np.add.reduce(x)",
        "y = sum(v)",
        "y = np.exp(x)",
        "y = numpy.cos(x)",
        "from numpy import dot",
        "y = np.cumsum(x)",
        "y = np.linalg.norm(x)",
        "y = math.fsum(v)",
        "y = np.mean(x)",
        "y = np.trace(x)",
        "y = x.dot(w)",
        "y = math.log2(v)",
        "y = np.matmul(x, w)",
        "y = x.matmul(w)",
        "y = numerics.matmul(x, w)",
    ],
)
def test_checker_catches(src):
    assert _violations(ast.parse(src), "t.py")


def test_own_ordered_matmul_is_the_one_allowed_call():
    """`ops.matmul` is the package's ordered kernel (defined in ops.py), not numpy's."""
    assert _own_kernels() == {"matmul"}
    assert not _violations(ast.parse("y = ops.matmul(x, wt)"), "t.py")
