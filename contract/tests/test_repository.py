"""The Python packages as installed and the docs that describe them: the contract needs no torch,
each package's declared pins are requirements.txt's, one Python version everywhere, and every
"trap N" the tree cites is defined in docs/traps.md with tests that exist, no Rust target that
is not built as a test holds one, and the test command's cargo builds share one feature set."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from importlib.metadata import requires
from pathlib import Path

from conftest import FIXTURES, ROOT

ROOT_PATH = Path(ROOT)

PYPROJECTS = {
    "tracegate": "binding/pyproject.toml",
    "tracegate-contract": "contract/pyproject.toml",
    "tracegate-oracle": "oracle/pyproject.toml",
}


def _project(path: str) -> dict:
    with open(os.path.join(ROOT, path), "rb") as f:
        return tomllib.load(f)["project"]


def _pins(lines) -> dict[str, str]:
    """`name==version` lines (comments and blanks skipped) as {name: version}."""
    out = {}
    for line in lines:
        line = line.split("#")[0].strip()
        if line:
            name, eq, version = line.partition("==")
            assert eq, f"not pinned: {line!r}"
            out[name.strip().lower()] = version.strip()
    return out


def _disagreements(declared: list[str], pinned: dict[str, str]) -> list[str]:
    """Each declared dependency that is not `name==version` with requirements.txt's version."""
    bad = []
    for dep, (name, version) in zip(declared, _pins(declared).items(), strict=True):
        if pinned.get(name) != version:
            bad.append(f"{dep} (requirements.txt: {pinned.get(name, 'absent')})")
    return bad


def _pinned() -> dict[str, str]:
    with open(os.path.join(ROOT, "requirements.txt")) as f:
        pins = _pins(f)
    # The repository's own packages are pinned by their pyproject.toml.
    pins.update({name: _project(path)["version"] for name, path in PYPROJECTS.items()})
    return pins


def test_declared_dependencies_are_the_pinned_versions():
    pinned = _pinned()
    for path in PYPROJECTS.values():
        assert _disagreements(_project(path)["dependencies"], pinned) == [], path
    # Negative control: a drifted pin and an unpinned package are both reported.
    assert _disagreements(["numpy==1.0", "ml-dtypes==1"], pinned) == [
        f"numpy==1.0 (requirements.txt: {pinned['numpy']})",
        "ml-dtypes==1 (requirements.txt: absent)",
    ]


def test_the_contract_declares_no_torch_and_the_oracle_does():
    names = {
        dist: {re.split(r"[<>=!~ ;\[]", r)[0].lower() for r in requires(dist) or []}
        for dist in ("tracegate-contract", "tracegate-oracle")
    }
    assert names["tracegate-contract"] == {"numpy", "tracegate"}
    assert {"torch", "transformers", "accelerate"} <= names["tracegate-oracle"]


def test_the_contract_runs_where_torch_cannot_be_imported(tmp_path):
    out = tmp_path / "t.trace"
    script = (
        "import sys\n"
        "sys.modules['torch'] = sys.modules['transformers'] = None  # imports now fail\n"
        "try:\n"
        "    import torch\n"
        "    sys.exit('torch is importable: the block did not work')\n"
        "except ImportError:\n"
        "    pass\n"
        "from tracegate_contract.__main__ import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    argv = ["trace", "--model", FIXTURES["dense"], "--tokens", "3,17,5", "--out", str(out)]
    r = subprocess.run(
        [sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert out.is_file()


def test_one_python_version_everywhere():
    wanted = {_project(path)["requires-python"] for path in PYPROJECTS.values()}
    assert wanted == {">=3.11"}
    with open(os.path.join(ROOT, "ruff.toml"), "rb") as f:
        assert tomllib.load(f)["target-version"] == "py311"
    with open(os.path.join(ROOT, "README.md")) as f:
        said = set(re.findall(r"Python (3\.\d+)", f.read()))
    assert said == {"3.11"}, said


def _tree_files():
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in (".git", ".venv", "target", "__pycache__")]
        for f in files:
            if f.endswith((".md", ".py", ".rs", ".sh", ".toml")):
                yield os.path.join(top, f)


def _numbers(text: str) -> set[int]:
    """The trap numbers a text cites: `trap 1`, `traps 1–3 and 13`, `traps 2, 5`."""
    out = set()
    for m in re.finditer(r"\btraps? (\d+(?:\s*(?:–|-|,|and)\s*\d+)*)", text, re.I):
        for a, b in re.findall(r"(\d+)(?:\s*[–-]\s*(\d+))?", m.group(1)):
            out.update(range(int(a), int(b or a) + 1))
    return out


def test_every_cited_trap_is_defined_in_docs_traps_md():
    with open(os.path.join(ROOT, "docs", "traps.md")) as f:
        doc = f.read()
    defined = {int(n) for n in re.findall(r"^## (\d+)\. ", doc, re.M)}
    # the 15 of the design, 16: the judged choosing its judge, 17-20: the field logs' incident
    # classes as planted defects
    assert defined == set(range(1, 21))
    cited = {}
    for path in _tree_files():
        if os.path.samefile(path, __file__):  # its negative controls cite what is not defined
            continue
        with open(path, errors="replace") as f:
            text = f.read()
        assert "DESIGN.md" not in text, path
        for n in _numbers(text):
            cited.setdefault(n, []).append(os.path.relpath(path, ROOT))
    assert cited and set(cited) <= defined, {n: p for n, p in cited.items() if n not in defined}
    # Negative control: the reader of citations sees a range and an undefined number.
    assert _numbers("(traps 1–3 and 13) trap 99") == {1, 2, 3, 13, 99}


_CITED = re.compile(r"`((?:[\w/]+/)?tests/[\w/]+\.(?:rs|py))(?:::(\w+))?`|`([a-z][a-z0-9_]+)`")


def _missing_tests(doc: str) -> tuple[int, list[str]]:
    """(how many test citations were checked, those that do not exist). A citation is
    `path/tests/file.rs` or `…::name`; a bare `name` later in the same paragraph is in that file."""
    checked, missing = 0, []
    for paragraph in doc.split("\n\n"):
        current = None
        for m in _CITED.finditer(paragraph):
            path, name = (m.group(1), m.group(2)) if m.group(1) else (current, m.group(3))
            if path is None:
                continue  # a bare word before any file: not a citation
            current = path
            full = os.path.join(ROOT, path)
            checked += 1
            if not os.path.isfile(full):
                missing.append(path)
            elif name and not re.search(rf"\b(?:fn|def) {name}\(", open(full).read()):
                missing.append(f"{path}::{name}")
    return checked, missing


def test_every_test_docs_traps_md_names_exists():
    with open(os.path.join(ROOT, "docs", "traps.md")) as f:
        doc = f.read()
    checked, missing = _missing_tests(doc)
    assert missing == [] and checked >= 60, (checked, missing)
    # Negative control: a renamed test and a moved file are reported.
    bad = "`contract/tests/test_ops.py::test_gone`, `test_topk_treats_signed_zeros_as_equal`, `x_y`"
    assert _missing_tests(bad + " `oracle/tests/test_moved.py`") == (
        4,
        [
            "contract/tests/test_ops.py::test_gone",
            "contract/tests/test_ops.py::x_y",
            "oracle/tests/test_moved.py",
        ],
    )


def _untested_targets(root: Path) -> tuple[list[Path], list[str]]:
    """The `[[bin]]` files under `root` built with `test = false`, and those of them holding a
    test."""
    found = []
    for cargo in sorted(root.glob("**/Cargo.toml")):
        if "target" in cargo.parts or ".venv" in cargo.parts:
            continue
        with open(cargo, "rb") as f:
            bins = tomllib.load(f).get("bin", [])
        found += [cargo.parent / b["path"] for b in bins if b.get("test", True) is False]
    holding = [str(p) for p in found if re.search(r"#\[(cfg\()?test\)?\]", p.read_text())]
    return found, holding


def test_a_target_built_without_its_test_harness_holds_no_test(tmp_path):
    """A `[[bin]]` with `test = false` (no test build, to save compile time) would skip a
    `#[test]` in its file silently: there is none."""
    found, holding = _untested_targets(ROOT_PATH)
    assert found, "no [[bin]] with test = false: this check checks nothing"
    assert not holding, f"targets built without their tests hold tests: {holding}"
    # Negative control: such a target with a test in it is found.
    (tmp_path / "src").mkdir()
    (tmp_path / "Cargo.toml").write_text(
        '[[bin]]\nname = "x"\npath = "src/main.rs"\ntest = false\n'
    )
    (tmp_path / "src/main.rs").write_text("fn main() {}\n#[test]\nfn t() {}\n")
    assert _untested_targets(tmp_path)[1] == [str(tmp_path / "src/main.rs")]


# The cargo builds scripts/test.sh and scripts/setup.sh run, each as the `cargo tree` arguments
# that select what it resolves features for: the binaries (`cargo build --release --bins`), the C
# library (`-p tracegate-capi`), the Rust tests (`cargo test --release`: dev-dependencies too) and
# the Python module (maturin: `-p tracegate-python` with pyproject.toml's features).
_BUILDS = {
    "cargo build": ["-e", "normal,build"],
    "cargo build -p tracegate-capi": ["-p", "tracegate-capi", "-e", "normal,build"],
    "cargo test": ["-e", "normal,build,dev"],
    "maturin": ["-p", "tracegate-python", "-e", "normal,build"],
}
# trace/Cargo.toml's block of feature pins, between these lines.
_PINS = ("# Feature pins", "[dev-dependencies]")


def _feature_splits(root: Path, lock: str = "--locked") -> tuple[dict[str, int], list[str]]:
    """How many packages each build resolves, and each package two builds resolve with different
    features (cargo compiles it, and every crate above it, once per feature set)."""
    seen: dict[str, dict[str, set[str]]] = {}
    sizes = {}
    with open(ROOT_PATH / "binding/pyproject.toml", "rb") as f:
        maturin = tomllib.load(f)["tool"]["maturin"].get("features", [])
    for build, args in _BUILDS.items():
        args = [*args, "--features", ",".join(maturin)] if build == "maturin" and maturin else args
        r = subprocess.run(
            ["cargo", "tree", lock, *args, "--prefix", "none", "--no-dedupe"]
            + ["--format", "{p} [{f}]"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, f"cargo tree {' '.join(args)} in {root}: {r.stderr[-800:]}"
        packages: dict[str, set[str]] = {}
        for line in r.stdout.splitlines():
            package, _, features = line.partition(" [")
            # "name vX (path)" and "(proc-macro)", "(*)" marks: the name and version alone.
            name = " ".join(package.split()[:2])
            packages.setdefault(name, set()).add(features.split("]")[0])
        sizes[build] = len(packages)
        for name, features in packages.items():
            seen.setdefault(name, {})[build] = features
    splits = [
        f"{name}: " + "; ".join(f"{b} [{' | '.join(sorted(f))}]" for b, f in by.items())
        for name, by in sorted(seen.items())
        if len({frozenset(f) for f in by.values()}) > 1
    ]
    return sizes, splits


def test_every_build_resolves_one_feature_set(tmp_path):
    """The binaries, the Rust tests and the Python module share their dependencies' builds only
    if cargo resolves each dependency with the same features in each (trace/Cargo.toml's pins):
    no dependency compiles twice. Negative control: the workspace without the pins splits."""
    sizes, splits = _feature_splits(ROOT_PATH)
    assert all(n > 20 for n in sizes.values()), f"too few packages resolved: {sizes}"
    assert not splits, (
        "dependencies resolved with different features (pin their union in trace/Cargo.toml):\n"
        + "\n".join(splits)
    )
    # The same workspace (manifests, lock file and Rust sources), the pins dropped.
    for top, dirs, files in os.walk(ROOT_PATH):  # symbolic links (a target/ elsewhere) not walked
        dirs[:] = [d for d in dirs if d not in ("target", ".venv", ".git")]
        for f in files:
            if f == "Cargo.toml" or f.endswith(".rs"):
                rel = Path(top, f).relative_to(ROOT_PATH)
                (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
                (tmp_path / rel).write_bytes((ROOT_PATH / rel).read_bytes())
    (tmp_path / "Cargo.lock").write_bytes((ROOT_PATH / "Cargo.lock").read_bytes())
    trace = (tmp_path / "trace/Cargo.toml").read_text()
    start, end = trace.index(_PINS[0]), trace.index(_PINS[1])
    (tmp_path / "trace/Cargo.toml").write_text(trace[:start] + trace[end:])
    _, unpinned = _feature_splits(tmp_path, "--offline")  # the lock file loses the pins
    assert any(s.startswith("num-traits v") for s in unpinned), unpinned


# The GGUF architectures each side reads (CONTRIBUTING, "Adding a model family", step 2): the
# engine's `Arch` (engine/src/gguf/hf.rs), the contract's gguf.py `ARCHITECTURES` and the
# oracle's gguf_source.py `ARCHITECTURES`. Read as text: the contract imports no oracle (torch).
GGUF_TABLES = {
    "engine": "engine/src/gguf/hf.rs",
    "contract": "contract/tracegate_contract/gguf.py",
    "oracle": "oracle/tracegate_oracle/gguf_source.py",
}


def _architectures_node(text: str, where: str):
    """The value of a Python source's module-level `ARCHITECTURES = ...`, as parsed."""
    import ast

    for node in ast.parse(text).body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [
            "ARCHITECTURES"
        ]:
            return node.value
    raise AssertionError(f"{where}: no module-level ARCHITECTURES")


def _python_architectures(text: str, where: str) -> dict[str, str]:
    """The module-level `ARCHITECTURES = {...}` literal of a Python source."""
    import ast

    return ast.literal_eval(_architectures_node(text, where))


def _engine_architectures(text: str, where: str) -> list[str]:
    """The names `Arch::from_name` takes, in order; each must be in `Arch::NAMES` and `name()`."""
    body = re.search(r"fn from_name\(.*?\n    \}", text, re.S)
    assert body, f"{where}: no Arch::from_name"
    taken = re.findall(r'"([a-z0-9_]+)" => Some\(Arch::', body.group(0))
    listed = re.search(r'const NAMES: &\'static str = "([^"]*)"', text)
    assert listed, f"{where}: no Arch::NAMES"
    named = re.findall(r'Arch::\w+ => "([a-z0-9_]+)"', text)
    assert listed.group(1) == ", ".join(taken), (
        f"{where}: NAMES {listed.group(1)!r}, from_name {taken}"
    )
    assert named == taken, f"{where}: Arch::name gives {named}, from_name takes {taken}"
    return taken


def _gguf_disagreements(texts: dict[str, str]) -> list[str]:
    """Where the three GGUF architecture tables differ (names, order, transformers class)."""
    contract = _python_architectures(texts["contract"], GGUF_TABLES["contract"])
    oracle = _python_architectures(texts["oracle"], GGUF_TABLES["oracle"])
    engine = _engine_architectures(texts["engine"], GGUF_TABLES["engine"])
    bad = []
    if list(oracle.items()) != list(contract.items()):
        bad.append(f"{GGUF_TABLES['oracle']} ARCHITECTURES {oracle} != contract's {contract}")
    if engine != list(contract):
        bad.append(f"{GGUF_TABLES['engine']} Arch {engine} != contract's {list(contract)}")
    return bad


def _gguf_texts() -> dict[str, str]:
    return {side: (ROOT_PATH / path).read_text() for side, path in GGUF_TABLES.items()}


def test_the_three_gguf_architecture_tables_are_one():
    texts = _gguf_texts()
    assert len(_python_architectures(texts["contract"], "contract")) >= 3  # read, not empty
    assert _gguf_disagreements(texts) == []


def test_gguf_table_check_sees_each_copy_drift():
    # Negative controls: each table changed alone is named; the unchanged texts pass above.
    texts = _gguf_texts()
    oracle = texts["oracle"].replace('"qwen3": "Qwen3ForCausalLM",', "", 1)
    assert oracle != texts["oracle"]
    bad = _gguf_disagreements({**texts, "oracle": oracle})
    assert len(bad) == 1 and "gguf_source.py" in bad[0], bad
    renamed = texts["contract"].replace(
        '"Gemma3ForCausalLM"', '"Gemma3ForConditionalGeneration"', 1
    )
    bad = _gguf_disagreements({**texts, "contract": renamed})
    assert len(bad) == 1 and "Gemma3ForConditionalGeneration" in bad[0], bad  # the class too
    engine = texts["engine"].replace('"qwen3" => Some(Arch::Qwen3),', "", 1)
    assert engine != texts["engine"]
    try:
        _gguf_disagreements({**texts, "engine": engine})
    except AssertionError as e:  # NAMES still lists it: the engine disagrees with itself
        assert "NAMES" in str(e), e
    else:
        raise AssertionError("a name dropped from Arch::from_name only was not seen")
    engine = engine.replace('"llama, qwen3, gemma3"', '"llama, gemma3"', 1)
    engine = engine.replace('Arch::Qwen3 => "qwen3",', "", 1)
    bad = _gguf_disagreements({**texts, "engine": engine})
    assert len(bad) == 1 and "hf.rs" in bad[0], bad


# The model families each bit-exact side computes (CONTRIBUTING, "Adding a model family"): the
# engine's per-family configs (`FAMILIES` in engine/src/config.rs, each `model_type` in
# engine/src/config/<family>.rs) and `BIT_EXACT_FAMILIES`, which a gate checks before any producer
# runs, against the contract's `ARCHITECTURES` and diffusion `MODEL_TYPE`; every one a family of
# the capture-point registry (the oracle's table is held to the registry in
# oracle/tests/test_capture_registry.py). Read as text, like the GGUF tables above.
FAMILY_TABLES = {
    "engine": "engine/src/config.rs",
    "engine_families": "engine/src/config",
    "contract": "contract/tracegate_contract/config.py",
    "diffusion": "contract/tracegate_contract/diffusion_gemma.py",
}


def _family_texts() -> dict[str, str]:
    cfg = ROOT_PATH / FAMILY_TABLES["engine_families"]
    return {
        "engine": (ROOT_PATH / FAMILY_TABLES["engine"]).read_text(),
        "engine_families": "\n".join(p.read_text() for p in sorted(cfg.glob("*.rs"))),
        "contract": (ROOT_PATH / FAMILY_TABLES["contract"]).read_text(),
        "diffusion": (ROOT_PATH / FAMILY_TABLES["diffusion"]).read_text(),
    }


def _family_disagreements(texts: dict[str, str]) -> list[str]:

    from tracegate import names

    engine = texts["engine"]
    listed = re.search(r"pub const BIT_EXACT_FAMILIES: \[&str; \d+\] = \[(.*?)\];", engine, re.S)
    table = re.search(r"const FAMILIES: \[Family; \d+\] = \[(.*?)\];", engine, re.S)
    assert listed and table, f"{FAMILY_TABLES['engine']}: no BIT_EXACT_FAMILIES or FAMILIES"
    bit_exact = re.findall(r'"([a-z0-9_]+)"', listed.group(1))
    # Each FAMILIES entry `module::CONST` names a const whose `model_type:` is its family.
    consts = {}
    for name, body in re.findall(
        r"const (\w+): Family = Family \{(.*?)\n\};", texts["engine_families"], re.S
    ):
        m = re.search(r'model_type: "([a-z0-9_]+)"', body)
        consts[name] = m.group(1) if m else f"<{name}: no model_type>"
    entries = re.findall(r"\w+::(\w+)", table.group(1))
    engine_read = [consts.get(c, f"<{c}: no model_type>") for c in entries]
    table = _architectures_node(texts["contract"], FAMILY_TABLES["contract"])
    contract = [k.value for k in table.keys if k is not None]
    spread = any(k is None for k in table.keys)
    m = re.search(r'^MODEL_TYPE = "([a-z0-9_]+)"', texts["diffusion"], re.M)
    diffusion = m.group(1) if m else None
    assert diffusion, f"{FAMILY_TABLES['diffusion']}: no MODEL_TYPE"
    # ARCHITECTURES spreads the Qwen3.5 tables; read their keys from the contract itself.
    from tracegate_contract import config as contract_config

    contract = set(contract) | (
        set(contract_config.QWEN3_5_TEXT) | set(contract_config.QWEN3_5_MULTIMODAL)
        if spread
        else set()
    )
    bad = []
    if set(engine_read) | {"diffusion_gemma"} != set(bit_exact):
        bad.append(
            f"engine FAMILIES {engine_read} + diffusion_gemma != BIT_EXACT_FAMILIES {bit_exact}"
        )
    if contract | {diffusion} != set(bit_exact):
        bad.append(
            f"contract {sorted(contract | {diffusion})} != engine BIT_EXACT_FAMILIES {bit_exact}"
        )
    not_registered = [f for f in bit_exact if f not in names.FAMILIES]
    if not_registered:
        bad.append(f"not in the capture-point registry's families: {not_registered}")
    return bad


def test_the_bit_exact_family_tables_are_one():
    texts = _family_texts()
    assert _family_disagreements(texts) == []


def test_family_table_check_sees_each_copy_drift():
    # Negative controls: each table changed alone is named; the unchanged texts pass above.
    texts = _family_texts()
    engine = texts["engine"].replace('    "qwen2",\n', "", 1)
    assert engine != texts["engine"]
    bad = _family_disagreements({**texts, "engine": engine})
    assert len(bad) == 2 and all("BIT_EXACT_FAMILIES" in b for b in bad), bad
    families = texts["engine_families"].replace('model_type: "qwen3",', 'model_type: "qwen4",', 1)
    assert families != texts["engine_families"]
    bad = _family_disagreements({**texts, "engine_families": families})
    assert len(bad) == 1 and "qwen4" in bad[0], bad
    contract = texts["contract"].replace('    "qwen2": "Qwen2ForCausalLM",\n', "", 1)
    assert contract != texts["contract"]
    bad = _family_disagreements({**texts, "contract": contract})
    assert len(bad) == 1 and bad[0].startswith("contract"), bad
    unknown = texts["engine"].replace('    "llama",\n', '    "llama",\n    "qwen9",\n', 1)
    bad = _family_disagreements({**texts, "engine": unknown})
    assert any("qwen9" in b and "registry" in b for b in bad), bad
